"""Engines on Unix sockets (transport uds, the default): reachable by the proxy's user only,
no TCP port, the listener verified like a port's, and a sleep the proxy did not order is a
fault."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from aiohttp import web
from kit import FakeEngine, RunningProxy, StartProxy, make_config, wait_for

from vllm_proxy.config import parse_config
from vllm_proxy.engines.engine import SUN_PATH_MAX, socket_path
from vllm_proxy.engines.instance import Instance
from vllm_proxy.engines.states import State
from vllm_proxy.errors import ConfigError

NOBODY = 65534


def spec_in(state_dir: Path, transport: str = "uds") -> Any:
    data = {
        "server": {"state_dir": str(state_dir)},
        "engine": {"transport": transport},
        "models": {"m1": {"model": "x"}},
    }
    return parse_config(data).specs()["m1"]


# -- the socket's place and the command line ---------------------------------------------------


def test_sockets_live_in_a_directory_only_the_proxys_user_can_open(tmp_path: Path) -> None:
    path = socket_path(spec_in(tmp_path / "state"), "m1#7")
    assert path == str(tmp_path / "state" / "sockets" / "m1.7.sock")
    st = os.lstat(Path(path).parent)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
    assert stat.S_IMODE(st.st_mode) == 0o700


def test_a_socket_directory_open_to_others_is_made_private(tmp_path: Path) -> None:
    sockets = tmp_path / "state" / "sockets"
    sockets.mkdir(parents=True)
    sockets.chmod(0o755)
    socket_path(spec_in(tmp_path / "state"), "m1#1")
    assert stat.S_IMODE(os.lstat(sockets).st_mode) == 0o700


def test_a_link_in_place_of_the_socket_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "elsewhere").mkdir(mode=0o755)
    (tmp_path / "state" / "sockets").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError, match="not a directory owned"):
        socket_path(spec_in(tmp_path / "state"), "m1#1")


def test_a_socket_path_too_long_for_an_address_is_shortened(tmp_path: Path) -> None:
    medium = tmp_path / ("d" * max(1, 80 - len(str(tmp_path))))  # the name, not the dir, is long
    path = socket_path(spec_in(medium), "a-model-with-a-rather-long-name#12345")
    assert len(os.fsencode(path)) <= SUN_PATH_MAX
    assert Path(path).parent == medium / "sockets" and path.endswith(".sock")

    deep = tmp_path / ("d" * 120)  # even the directory is too long: a private one under /tmp
    path = socket_path(spec_in(deep), "m1#1")
    assert len(os.fsencode(path)) <= SUN_PATH_MAX
    st = os.lstat(Path(path).parent)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert socket_path(spec_in(deep), "m1#1") == path, "the same place every time"
    assert socket_path(spec_in(deep), "m1#2") != path


def test_the_engine_serves_on_its_socket_or_on_a_loopback_port(tmp_path: Path) -> None:
    uds = spec_in(tmp_path).engine_argv("/run/x/m1.1.sock")
    assert uds[uds.index("--uds") + 1] == "/run/x/m1.1.sock"
    assert "--host" not in uds and "--port" not in uds
    tcp = spec_in(tmp_path, "tcp").engine_argv(8123)
    assert tcp[tcp.index("--port") + 1] == "8123" and "--uds" not in tcp
    assert spec_in(tmp_path).engine_key() != spec_in(tmp_path, "tcp").engine_key()
    with pytest.raises(ConfigError, match=r"models\.q\.args\.uds: reserved"):
        parse_config({"models": {"q": {"model": "x", "args": {"uds": "/tmp/s"}}}})
    with pytest.raises(ConfigError, match=r"models\.q\.transport"):
        parse_config({"models": {"q": {"model": "x", "transport": "udp"}}})


# -- a running engine on its socket -------------------------------------------------------------


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def listening_inet(pid: int) -> list[Any]:
    found = []
    for proc in tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            found += [c for c in proc.net_connections(kind="inet") if c.status == "LISTEN"]
    return found


async def running(proxy: RunningProxy, name: str = "m1") -> Instance:
    resp = await proxy.chat(name)
    assert resp.status == 200, await resp.text()
    inst = proxy.instance(name)
    assert inst.state is State.RUNNING and inst.engine is not None
    return inst


async def test_a_socket_engine_binds_no_tcp_port(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(make_config(tmp_path))
    inst = await running(proxy)
    engine = inst.engine
    assert engine is not None and engine.pid is not None and engine.socket_path is not None
    assert engine.tcp_port is None
    assert listening_inet(engine.pid) == [], "no TCP listener in the engine's tree"
    unix = [c for p in tree(engine.pid) for c in p.net_connections(kind="unix")]
    assert any(c.laddr == engine.socket_path for c in unix), "it listens on its socket"
    status = inst.status()
    assert status["port"] is None and status["socket"] == engine.socket_path
    assert proxy.manager.ctx.ports._held == set(), "no port allocated"  # type: ignore[attr-defined]


async def test_another_user_cannot_connect_to_an_engine_socket(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(make_config(tmp_path))
    inst = await running(proxy)
    assert inst.engine is not None and inst.engine.socket_path is not None
    path = inst.engine.socket_path
    st = os.lstat(Path(path).parent)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    with socket.socket(socket.AF_UNIX) as sock:  # the proxy's own user connects
        sock.connect(path)
    os.chmod(path, 0o777)  # even a socket file anyone may write to: the directory stops them
    if os.geteuid() != 0:
        pytest.skip("only root can run a child as another user; the directory's mode is checked")
    code = await asyncio.to_thread(_connect_as, NOBODY, path)
    assert code == errno.EACCES, f"user {NOBODY} connected to the engine socket ({code})"


def _connect_as(uid: int, path: str) -> int:
    """In a forked child that became `uid`: the errno of connecting to `path` (0: connected)."""
    pid = os.fork()
    if pid == 0:  # the child: no Python-level cleanup, only an exit status
        code = 99
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as sock:
                sock.connect(path)
            code = 0
        except PermissionError:
            code = errno.EACCES
        except OSError as err:
            code = err.errno or 98
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@contextlib.asynccontextmanager
async def unix_session(path: str) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as session:
        yield session


SLEEPY = {"model": "x", "sleep": {"level": 1, "after_idle_s": 600}}


async def test_requests_sleep_wake_and_metrics_go_over_the_socket(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Chat, a stream, an ordered sleep and the wake a request makes, the engines' metrics:
    all over the socket, and the health watcher (probing often) counts no fault on the way."""
    cfg = make_config(
        tmp_path,
        {"m1": {**SLEEPY, "warmup": True}},
        server={"admin_open": True},
        engine={"health_interval_s": 0.05, "env": FakeEngine(sleep_delay=0.2).env()},
    )
    proxy = await start_proxy(cfg)
    inst = await running(proxy)
    stream = await proxy.chat("m1", stream=True)
    assert stream.status == 200 and (await stream.read()).endswith(b"data: [DONE]\n\n")

    resp = await proxy.http.post(proxy.url + "/admin/models/m1/sleep")
    assert resp.status == 200, await resp.text()
    await wait_for(lambda: inst.asleep, what="asleep")
    assert inst.engine is not None and inst.engine.socket_path is not None
    async with unix_session(inst.engine.socket_path) as engine:
        async with engine.get("http://localhost/is_sleeping") as r:
            assert await r.json() == {"is_sleeping": True}
        assert (await proxy.chat("m1")).status == 200  # the request wakes it
        assert proxy.instance("m1") is inst and inst.state is State.RUNNING
        async with engine.get("http://localhost/metrics") as r:
            assert "fake_engine:wakes_total{" in (page := await r.text())
        assert 'fake_engine:wakes_total{engine="0",model_name="m1"} 1.0' in page

    async with proxy.http.get(proxy.url + "/metrics/engines") as r:
        page = await r.text()
    assert 'vllm:num_requests_running{engine="0",instance="m1#1"' in page
    async with proxy.http.get(proxy.url + "/metrics") as r:
        assert "vllm_proxy_engine_restarts_total{" not in await r.text()


async def test_a_sleep_the_proxy_did_not_order_is_found_within_one_health_interval(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """A local ``POST /sleep`` straight to the engine (as anyone who could reach vLLM's dev
    routes might): the next health probe finds /is_sleeping true while the proxy has the
    engine running, kills it, and the next request is served by a new engine."""
    interval = 1.0
    cfg = make_config(tmp_path, {"m1": SLEEPY}, engine={"health_interval_s": interval})
    proxy = await start_proxy(cfg)
    first = await running(proxy)
    assert first.engine is not None and first.engine.socket_path is not None
    async with unix_session(first.engine.socket_path) as engine:
        async with engine.post("http://localhost/sleep?level=1") as r:
            assert r.status == 200
    slept = time.monotonic()
    await wait_for(lambda: first.state is State.UNHEALTHY, timeout=interval * 3, what="the fault")
    assert time.monotonic() - slept <= interval + 0.5, "found at the next probe"
    assert first.unhealthy and "put to sleep by someone else" in (first.last_error or "")

    resp = await proxy.chat("m1")
    assert resp.status == 200, await resp.text()
    second = proxy.instance("m1")
    assert second is not first and second.id == "m1#2" and second.state is State.RUNNING
    async with proxy.http.get(proxy.url + "/metrics") as r:
        text = await r.text()
    assert 'vllm_proxy_engine_restarts_total{model_id="m1",reason="sleep_not_ordered"} 1.0' in text


# -- the listener is the engine's own ------------------------------------------------------------


async def test_a_foreign_listener_on_the_engine_socket_is_never_trusted(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """A program (of the proxy's own user: nobody else can reach the directory) binds the
    engine's socket while the engine loads and answers /health 200: the start fails, no client
    request reaches that listener, and no other "port" is tried."""
    hits: list[str] = []

    async def anything(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.json_response({"object": "foreign"})

    env = FakeEngine(startup_delay=3).env()
    proxy = await start_proxy(make_config(tmp_path, {"m1": {"model": "x", "env": env}}))
    path = tmp_path / "state" / "sockets" / "m1.1.sock"
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        request = asyncio.ensure_future(proxy.chat("m1"))
        inst: Instance | None = None

        def spawned() -> bool:
            nonlocal inst
            inst = proxy.model("m1").instances[0] if proxy.model("m1").instances else None
            return inst is not None and inst.engine is not None and inst.engine.pid is not None

        await wait_for(spawned, what="the engine spawned")
        await web.UnixSite(runner, str(path)).start()
        resp = await request
        assert resp.status == 502, await resp.text()
        assert (await resp.json())["error"]["code"] == "engine_start_failed"
        assert set(hits) <= {"/health"}, "no client request reached the foreign listener"
        assert [i.id for i in proxy.model("m1").instances] in ([], ["m1#1"]), "no retry"
        assert inst is not None and inst.state is State.ERROR
    finally:
        await runner.cleanup()


async def test_a_socket_replaced_while_running_marks_the_engine_unhealthy(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    cfg = make_config(tmp_path, engine={"health_interval_s": 0.1})
    proxy = await start_proxy(cfg)
    inst = await running(proxy)
    assert inst.engine is not None and inst.engine.socket_path is not None
    path = inst.engine.socket_path
    os.unlink(path)
    with socket.socket(socket.AF_UNIX) as other:
        other.bind(path)
        other.listen()
        await wait_for(lambda: inst.state is State.UNHEALTHY, what="marked unhealthy")
    assert inst.unhealthy and "socket path is no longer held" in (inst.last_error or "")
    assert (await proxy.chat("m1")).status == 200


async def test_a_stale_socket_file_does_not_keep_an_engine_from_starting(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """A socket file left where the next engine will serve (its engine died with a proxy):
    removed before the engine starts (vLLM's bind would fail on it)."""
    sockets = tmp_path / "state" / "sockets"
    sockets.mkdir(parents=True, mode=0o700)
    with socket.socket(socket.AF_UNIX) as old:
        old.bind(str(sockets / "m1.1.sock"))
    proxy = await start_proxy(make_config(tmp_path))
    inst = await running(proxy)
    assert inst.engine is not None and inst.engine.socket_path == str(sockets / "m1.1.sock")
    await inst.stop()
    assert not (sockets / "m1.1.sock").exists(), "removed once the engine exited"
