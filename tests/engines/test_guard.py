"""Unit and process tests for the engine guard, port allocation and log tails."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from kit import alive, group_alive, wait_for_sync

from vllm_proxy.engines.engine import PortAllocator, port_is_free, read_tail
from vllm_proxy.engines.guard import RotatingLog, exit_status
from vllm_proxy.errors import EngineFailed


def test_rotating_log_is_bounded(tmp_path: Path) -> None:
    path = tmp_path / "m.log"
    log = RotatingLog(str(path), max_bytes=100, backups=2)
    for i in range(50):
        log.write(f"line {i:03d} ..........\n".encode())
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["m.log", "m.log.1", "m.log.2"]
    assert all(p.stat().st_size <= 100 for p in tmp_path.iterdir())
    assert "line 049" in path.read_text()


def test_rotating_log_without_backups_truncates(tmp_path: Path) -> None:
    path = tmp_path / "m.log"
    log = RotatingLog(str(path), max_bytes=64, backups=0)
    for i in range(20):
        log.write(f"{i:02d}-----------\n".encode())
    log.close()
    assert [p.name for p in tmp_path.iterdir()] == ["m.log"]
    assert path.stat().st_size <= 64


def test_read_tail(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    path.write_text("".join(f"l{i}\n" for i in range(100)))
    assert read_tail(path, lines=3) == "l97\nl98\nl99"
    assert read_tail(tmp_path / "missing") == ""


def test_exit_status_maps_signals() -> None:
    assert exit_status(3) == 3
    assert exit_status(-9) == 137


def _free_run(n: int) -> int:
    """A port p such that p .. p+n-1 are free now."""
    for base in range(46000, 47000, n):
        if all(port_is_free(base + i) for i in range(n)):
            return base
    raise AssertionError("no free run of ports")


def test_port_allocator_skips_busy_and_held_ports() -> None:
    p = _free_run(3)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", p))
        busy.listen()
        assert not port_is_free(p)
        ports = PortAllocator()  # starts at a random point of the range
        first = ports.allocate((p, p + 2))
        second = ports.allocate((p, p + 2))
        assert {first, second} == {p + 1, p + 2}  # never the busy one, never twice
        with pytest.raises(EngineFailed, match="no free port"):
            ports.allocate((p, p + 2))
        ports.release(first)
        assert ports.allocate((p, p + 2)) == first


CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # One write per line: with PYTHONUNBUFFERED=1, print() writes word by word and the two
    # processes' lines would interleave in the shared log.
    if os.fork() == 0:          # a grandchild that outlives its parent, like VLLM::EngineCore
        os.write(1, f"child {os.getpid()}\\n".encode())
        time.sleep(600)
    os.write(1, f"main {os.getpid()}\\n".encode())
    time.sleep(float(sys.argv[1]))
    sys.exit(int(sys.argv[2]))
    """
)


def _guard(tmp_path: Path, *engine_args: str) -> subprocess.Popen[bytes]:
    script = tmp_path / "engine.py"
    script.write_text(CHILD)
    return subprocess.Popen(
        [sys.executable, "-m", "vllm_proxy.engines.guard", "--parent", str(os.getpid()),
         "--log", str(tmp_path / "e.log"), "--", sys.executable, str(script), *engine_args],
        start_new_session=True,
    )  # fmt: skip


def _pids(log: Path, kind: str) -> list[int]:
    if not log.exists():
        return []
    return [int(x.split()[1]) for x in log.read_text().splitlines() if x.startswith(kind + " ")]


def test_guard_exits_with_engine_code_and_sweeps_leftovers(tmp_path: Path) -> None:
    guard = _guard(tmp_path, "0.5", "7")
    try:
        assert guard.wait(timeout=30) == 7
        log = tmp_path / "e.log"
        assert "engine exited with code 7" in log.read_text()
        assert not group_alive(guard.pid)
        assert all(not alive(p) for p in _pids(log, "child"))
    finally:
        os.killpg(guard.pid, signal.SIGKILL) if group_alive(guard.pid) else None


def test_guard_kills_group_when_its_parent_dies(tmp_path: Path) -> None:
    # A middle process plays the proxy: it starts the guard and is then killed with SIGKILL.
    script = tmp_path / "engine.py"
    script.write_text(CHILD)
    log = tmp_path / "e.log"
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import os, subprocess, sys, time
            g = subprocess.Popen([sys.executable, "-m", "vllm_proxy.engines.guard", "--parent",
                str(os.getpid()), "--log", {str(log)!r}, "--", sys.executable, {str(script)!r},
                "600", "0"], start_new_session=True)
            print(g.pid, flush=True)
            time.sleep(600)
        """)],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert parent.stdout is not None
    guard_pid = int(parent.stdout.readline())
    wait_for_sync(
        lambda: len(_pids(log, "child")) == 1 and len(_pids(log, "main")) == 1,
        timeout=60,
        what="engine and its child to start",
    )
    members = group_alive(guard_pid)
    assert len(members) >= 3  # guard, engine, grandchild
    parent.kill()
    parent.wait()
    parent.stdout.close()
    wait_for_sync(lambda: not group_alive(guard_pid), what="engine group to die with the parent")


async def test_readiness_polling_stays_within_tens_of_milliseconds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Against an engine that is refused, then not ready (503), then ready: the poller keeps
    polling through refusals and 503s at intervals that start at 5 ms and never exceed 20 ms,
    and returns at the first 200 (so the engine is seen within one interval of being ready)."""
    import asyncio

    import aiohttp
    from aiohttp import web
    from kit import free_port

    import vllm_proxy.engines.engine as engine_module
    from vllm_proxy.config import parse_config
    from vllm_proxy.engines.engine import POLL_FIRST_S, POLL_MAX_S, EngineProcess

    port = free_port()
    spec = parse_config({"server": {"state_dir": str(tmp_path)}, "models": {"m": {"model": "x"}}})
    engine = EngineProcess(spec.specs()["m"], port, tmp_path / "m.log")
    monkeypatch.setattr(engine, "_verify_listener", lambda: True)  # served in-process here
    hits: list[int] = []
    runner: web.AppRunner | None = None

    async def health(request: web.Request) -> web.Response:
        hits.append(len(delays))
        return web.Response(status=200 if len(hits) > 10 else 503)

    delays: list[float] = []
    real_sleep = asyncio.sleep

    async def record(delay: float) -> None:
        nonlocal runner
        delays.append(delay)
        if len(delays) == 5:  # after 5 refused connections the engine starts listening
            app = web.Application()
            app.router.add_get("/health", health)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        await real_sleep(0)

    monkeypatch.setattr(engine_module.asyncio, "sleep", record)
    try:
        async with aiohttp.ClientSession() as session:
            assert await asyncio.wait_for(engine._poll_health(session), 30) is True
            paused = len(delays)
    finally:
        if runner is not None:
            await runner.cleanup()
    assert len(hits) == 11, "ten 503s, then the 200 that ends the wait"
    assert hits == list(range(5, 16)), "first polled after 5 refusals, then one pause per 503"
    assert paused == hits[-1], "no pause after the 200"
    assert delays[0] == POLL_FIRST_S <= 0.005
    assert delays[:paused] == sorted(delays[:paused]), "backs off monotonically"
    assert max(delays[:paused]) == POLL_MAX_S <= 0.02


ESCAPEE = textwrap.dedent(
    """
    import os, sys, time
    if os.fork() == 0:               # a helper that daemonises: new session, double fork
        os.setsid()
        if os.fork() == 0:
            os.write(1, f"escapee {os.getpid()}\\n".encode())
            time.sleep(600)
        os._exit(0)
    os.write(1, f"main {os.getpid()}\\n".encode())
    time.sleep(600)
    """
)


def test_a_process_that_left_the_group_is_still_stopped(tmp_path: Path) -> None:
    """An engine helper that calls setsid() escapes the group kill; the guard remembers its
    tree (and, as subreaper, adopts its orphans) and stops it when the engine goes."""
    script = tmp_path / "engine.py"
    script.write_text(ESCAPEE)
    log = tmp_path / "e.log"
    guard = subprocess.Popen(
        [sys.executable, "-m", "vllm_proxy.engines.guard", "--parent", str(os.getpid()),
         "--log", str(log), "--", sys.executable, str(script)],
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_for_sync(lambda: _pids(log, "escapee") and _pids(log, "main"), timeout=30,
                      what="engine and its escaped helper")  # fmt: skip
        (escapee,) = _pids(log, "escapee")
        assert os.getpgid(escapee) != guard.pid, "it really left the group"
        wait_for_sync(lambda: _parent(escapee) == guard.pid, what="the guard adopted the orphan")
        os.killpg(guard.pid, signal.SIGTERM)  # what the proxy's stop sends: the group only
        assert guard.wait(timeout=30) == 128 + signal.SIGTERM
        wait_for_sync(lambda: not alive(escapee), what="the escaped helper stopped")
    finally:
        if guard.poll() is None:
            os.killpg(guard.pid, signal.SIGKILL)


def _parent(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.NoSuchProcess:
        return None


def test_sweep_leaves_a_reused_pid_alone(tmp_path: Path) -> None:
    """engines.json names a group whose leader is now someone else's process (the pid was
    reused): the start-up sweep must not kill it."""
    import json

    from vllm_proxy.engines.registry import EngineRegistry

    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        state = tmp_path / "state"
        state.mkdir()
        record = {"engines": {str(stranger.pid): {"instance": "m#1", "started": 1.0}}}
        (state / "engines.json").write_text(json.dumps(record))
        assert EngineRegistry(str(state)).sweep(timeout_s=1) == []
        assert alive(stranger.pid), "a process that is not our guard was left alone"
    finally:
        stranger.kill()
        stranger.wait()


def test_the_death_handler_can_interrupt_the_tree_lock_holder() -> None:
    """The parent-death handler runs in the guard's main thread between any two bytecodes,
    also inside `Tree.refresh()`/`Tree.kill()` (a multithreaded parent's death delivers the
    signal once per exiting thread, so one handler can interrupt another): taking the tree's
    lock again from there must not deadlock."""
    import threading

    from vllm_proxy.engines.guard import Tree

    tree = Tree(os.getpid())
    tree.refresh()
    done = threading.Event()

    def nested() -> None:
        with tree._lock:  # what the interrupted frame holds
            tree.kill()  # what the handler does
        done.set()

    worker = threading.Thread(target=nested, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert done.is_set(), "the handler deadlocked on the tree's lock"


def test_repeated_death_signals_still_take_the_group_down(tmp_path: Path) -> None:
    from vllm_proxy.engines.guard import DEATH_SIGNAL

    script = tmp_path / "engine.py"
    script.write_text(CHILD)
    log = tmp_path / "e.log"
    guard = subprocess.Popen(
        [sys.executable, "-m", "vllm_proxy.engines.guard", "--parent", str(os.getpid()), "--log",
         str(log), "--", sys.executable, str(script), "600", "0"],
        start_new_session=True,
    )  # fmt: skip
    wait_for_sync(
        lambda: len(_pids(log, "child")) == 1 and len(_pids(log, "main")) == 1,
        timeout=60,
        what="engine and its child to start",
    )
    for _ in range(20):  # as a dying multithreaded parent can deliver it
        os.kill(guard.pid, DEATH_SIGNAL)
    guard.wait(timeout=15)
    wait_for_sync(lambda: not group_alive(guard.pid), what="engine group gone")
