"""The engine registry's start-up sweep and the state dir's lock."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import psutil
import pytest
import yaml
from kit import (
    FakeEngine,
    StartProxy,
    free_port,
    group_alive,
    kill_group,
    make_config,
    wait_for,
    wait_for_sync,
)

from vllm_proxy.engines.registry import EngineRegistry, StateDirBusy, StateLock, _is_our_guard

MODELS = {"m1": {"model": "x", "env": FakeEngine(spawn_child=True).env()}}


async def test_startup_sweep_kills_engines_of_a_dead_proxy(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """A proxy died and its engine's guard could not act on the death signal (here: stopped;
    elsewhere, a kernel without it): the next proxy on the state dir kills that engine group
    before it starts its own, and goes on counting instance ids."""
    config = make_config(tmp_path, MODELS)
    port = free_port()
    data = config.model_dump(mode="json", exclude_none=True)
    data["server"]["port"] = port
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(
            [sys.executable, "-m", "vllm_proxy", "--config", str(tmp_path / "config.yaml")],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    pgids: list[int] = []
    try:
        await wait_for(lambda: served(port), timeout=30, what="the first proxy serving")
        pgids = [
            int(g) for g in json.loads((tmp_path / "state" / "engines.json").read_text())["engines"]
        ]
        assert len(pgids) == 1
        os.kill(pgids[0], signal.SIGSTOP)  # the guard: it will not act on its parent's death
        first.kill()
        await asyncio.to_thread(first.wait, 10)
        assert len(group_alive(pgids[0])) >= 3, "the engine tree outlived its proxy"

        second = await start_proxy(config)  # same state dir: sweeps before allocating ports
        assert not group_alive(pgids[0])
        assert (await second.chat("m1")).status == 200
        assert second.instance("m1").id == "m1#2", "instance ids are not reused across restarts"
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        for pgid in pgids:
            if group_alive(pgid):  # the test failed before the sweep
                kill_group(pgid)


async def served(port: int) -> bool:
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as s:
        try:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            async with s.post(url, json=body) as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False


async def test_the_sweep_never_stops_engines_of_a_live_proxy(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """engines.json and the guards' tag name a proxy that is alive (here, this process): a
    sweep run on the same state dir leaves its engines alone."""
    proxy = await start_proxy(make_config(tmp_path))
    assert (await proxy.chat("m1")).status == 200
    pid = proxy.instance("m1").engine.pid  # type: ignore[union-attr]
    pgid = os.getpgid(pid)
    members = group_alive(pgid)

    assert EngineRegistry(str(tmp_path / "state")).sweep(timeout_s=1) == []
    assert group_alive(pgid) == members
    assert (await proxy.chat("m1")).status == 200


def test_the_state_dir_lock_is_exclusive_and_names_its_holder(tmp_path: Path) -> None:
    lock = StateLock(str(tmp_path / "st"))
    with pytest.raises(StateDirBusy) as busy:
        StateLock(str(tmp_path / "st"))
    assert busy.value.holder == os.getpid()
    lock.release()
    lock.release()  # idempotent
    StateLock(str(tmp_path / "st")).release()  # free again


@pytest.mark.parametrize(
    ("argv_tail", "ours"),
    [(["vllm_proxy.engines.guard"], True), (["vllm_proxy.guard"], True), (["other"], False)],
)
def test_a_guard_is_known_by_its_module_now_and_before_0_2_0(
    argv_tail: list[str], ours: bool
) -> None:
    """0.2.0 moved the guard module; a leftover guard of a 0.1.0 proxy is still one of ours."""
    cmd = [sys.executable, "-c", "import time; time.sleep(60)", *argv_tail]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    try:
        # Popen returns once the exec began; the kernel fills in the new command line a moment
        # later (until then /proc shows it empty). Recorded guards are long past that point.
        wait_for_sync(lambda: _cmdline(proc.pid) == cmd, what="the child's command line")
        assert _is_our_guard(proc.pid, None) is ours
    finally:
        proc.kill()
        proc.wait()


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []
