"""Shared fixtures: configs that run the fake engine, an in-process proxy, polling helpers."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from vllm_proxy.app import Server
from vllm_proxy.config import Config, parse_config
from vllm_proxy.engine import instance_logs
from vllm_proxy.instance import Instance
from vllm_proxy.manager import Manager
from vllm_proxy.model import Model

FAKE_ENGINE = [sys.executable, "-m", "fake_vllm"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_for(
    predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 15.0, what: str = ""
) -> None:
    """Poll `predicate` until true, failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        await asyncio.sleep(0.02)


def wait_for_sync(predicate: Callable[[], bool], timeout: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(0.02)


def alive(pid: int) -> bool:
    """True for a live, non-zombie process."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def group_alive(pgid: int) -> list[int]:
    """Live (non-zombie) members of a process group."""
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return out


def make_config(
    tmp_path: Path,
    models: dict[str, dict[str, Any]] | None = None,
    server: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
) -> Config:
    """A config that runs the fake engine with short timeouts and a private state dir."""
    data: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": 0, "state_dir": str(tmp_path / "state")},
        "engine": {
            "command": FAKE_ENGINE,
            "startup_timeout_s": 20,
            "stop_timeout_s": 5,
            "idle_timeout_s": 0,
            "port_range": [20000, 29999],
        },
        "models": models if models is not None else {"m1": {"model": "fake/m1"}},
    }
    data["server"].update(server or {})
    data["engine"].update(engine or {})
    return parse_config(data)


class RunningProxy:
    def __init__(self, server: Server, session: aiohttp.ClientSession) -> None:
        self.server = server
        self.http = session
        self.url = f"http://127.0.0.1:{server.port}"

    @property
    def manager(self) -> Manager:
        return self.server.runtime.manager

    def model(self, name: str) -> Model:
        return self.manager.models[name]

    def instance(self, name: str) -> Instance:
        """The model's serving instance, else its newest live one, else the last that ended."""
        model = self.model(name)
        inst = model.serving() or (model.instances[-1] if model.instances else model.last_ended)
        assert inst is not None, f"model {name} has never had an instance"
        return inst

    def engine_starts(self, name: str) -> int:
        """Engine processes started for the model, counted from its instances' log files."""
        spec = self.model(name).spec
        return sum(
            path.read_text().count("[vllm-proxy] starting engine")
            for path in instance_logs(spec).values()
        )

    async def chat(self, model: str, **extra: Any) -> aiohttp.ClientResponse:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
        return await self.http.post(self.url + "/v1/chat/completions", json=body)


StartProxy = Callable[[Config], Awaitable[RunningProxy]]


@pytest.fixture
async def start_proxy() -> AsyncIterator[Callable[[Config], Awaitable[RunningProxy]]]:
    """Start in-process proxies; they are shut down (engines stopped) after the test."""
    servers: list[Server] = []
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))

    async def start(config: Config) -> RunningProxy:
        server = Server(config)
        await server.start()
        servers.append(server)
        return RunningProxy(server, session)

    try:
        yield start
    finally:
        await session.close()
        for server in servers:
            await server.shutdown()


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
