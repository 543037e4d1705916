"""One proxy harness: in-process proxies from a `Config` or a config file, or the proxy as a
process of its own; everything started is shut down (engines stopped) after the test."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp

from kit.chat import chat_body, healthy
from kit.configs import write_config
from kit.wait import wait_for
from vllm_proxy.app import Server
from vllm_proxy.config import Config, load_config
from vllm_proxy.engine import instance_logs
from vllm_proxy.instance import Instance
from vllm_proxy.manager import Manager
from vllm_proxy.model import Model


class RunningProxy:
    """An in-process proxy and the client session the test talks to it with."""

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

    def engine_log(self, name: str) -> str:
        """The logs of the model's engines, oldest instance first."""
        logs = instance_logs(self.model(name).spec)
        return "".join(logs[n].read_text(errors="replace") for n in sorted(logs))

    async def chat(self, model: str, **extra: Any) -> aiohttp.ClientResponse:
        """``POST /v1/chat/completions`` for `model` with one user message and `extra` keys."""
        return await self.http.post(
            self.url + "/v1/chat/completions", json=chat_body(model, **extra)
        )

    async def reload(self, path: Path, data: dict[str, Any]) -> dict[str, Any]:
        """A hot reload from a file at `path` with `data`, as ``POST /admin/reload`` does it."""
        write_config(path, data)
        runtime = self.server.runtime
        runtime.config_path = str(path)
        return await runtime.reload()


class ProxyProcess:
    """``python -m vllm_proxy --config PATH`` as a process of its own, its output in `log`."""

    def __init__(self, config: Path, port: int, log: Path) -> None:
        self.config = config
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_proxy", "--config", str(config)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def listening(self, session: aiohttp.ClientSession, timeout: float = 30) -> None:
        """Wait until ``/health`` answers 200."""
        await wait_for(lambda: healthy(session, self.url), timeout=timeout, what="proxy listening")

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM, then SIGKILL after `timeout`; nothing if it has ended."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class Proxies:
    """The `start_proxy` fixture: call it with a `Config`; `.file()` starts one from a config
    file (so that it can reload), `.process()` runs one as a process of its own."""

    def __init__(self) -> None:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        self._servers: list[Server] = []
        self._processes: list[ProxyProcess] = []

    async def __call__(self, config: Config, path: Path | None = None) -> RunningProxy:
        server = Server(config, str(path) if path else None)
        await server.start()
        self._servers.append(server)
        return RunningProxy(server, self.http)

    async def file(self, path: Path) -> RunningProxy:
        """An in-process proxy that reads, and reloads, the config file at `path`."""
        return await self(load_config(path), path)

    def process(self, config: Path, port: int, log: Path) -> ProxyProcess:
        """The proxy as a process (killed after the test unless it ended)."""
        proc = ProxyProcess(config, port, log)
        self._processes.append(proc)
        return proc

    async def close(self) -> None:
        await self.http.close()
        for server in self._servers:
            await server.shutdown()
        for proc in self._processes:
            proc.kill()


#: What tests annotate the `start_proxy` fixture with.
StartProxy = Proxies
