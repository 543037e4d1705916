"""One proxy harness: in-process proxies from a `Config` or a config file, or the proxy as a
process of its own; everything started is shut down (engines stopped) after the test."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp

from kit.chat import chat_body, chat_text, healthy
from kit.configs import write_config
from kit.wait import wait_for
from vllm_proxy.app import Server
from vllm_proxy.config import Config, load_config
from vllm_proxy.engines.engine import instance_logs
from vllm_proxy.engines.instance import Instance
from vllm_proxy.engines.model import Model
from vllm_proxy.pool.manager import Manager


async def wait_healthy(session: aiohttp.ClientSession, url: str, timeout: float = 30) -> None:
    """Wait until ``GET {url}/health`` answers 200."""
    await wait_for(lambda: healthy(session, url), timeout=timeout, what=f"{url} listening")


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

    async def open_stream(self, model: str, **headers: str) -> aiohttp.ClientResponse:
        """A streamed chat that has sent its first event: it holds its lease until read or
        closed."""
        url = self.url + "/v1/chat/completions"
        resp = await self.http.post(url, json=chat_body(model, stream=True), headers=headers)
        assert resp.status == 200
        await resp.content.readany()
        return resp

    async def status(self, model: str, max_tokens: int = 1, **headers: str) -> int:
        """The status of a short chat, read to its end."""
        body = chat_body(model, max_tokens=max_tokens)
        url = self.url + "/v1/chat/completions"
        async with self.http.post(url, json=body, headers=headers) as resp:
            await resp.read()
            return resp.status

    async def reply(self, model: str, **extra: Any) -> tuple[int, str]:
        """`chat`, read whole: (200, the reply's text), else (status, the body)."""
        return await chat_text(await self.chat(model, **extra))

    async def reload(self, path: Path, data: dict[str, Any]) -> dict[str, Any]:
        """A hot reload from a file at `path` with `data`, as ``POST /admin/reload`` does it."""
        write_config(path, data)
        runtime = self.server.runtime
        runtime.config_path = str(path)
        return await runtime.reload()


class ProxyProcess:
    """``python -m vllm_proxy --config PATH`` as a process of its own, its output in `log`."""

    def __init__(self, config: Path, port: int, log: Path, *args: str) -> None:
        self.config = config
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_proxy", "--config", str(config), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def listening(self, session: aiohttp.ClientSession, timeout: float = 30) -> None:
        """Wait until ``/health`` answers 200."""
        await wait_healthy(session, self.url, timeout)

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

    async def serving(
        self, config: Config, model: str, max_tokens: int = 4
    ) -> tuple[RunningProxy, Instance]:
        """A proxy whose `model` has answered one short chat: the proxy, and the instance that
        answered."""
        proxy = await self(config)
        status, text = await proxy.reply(model, max_tokens=max_tokens)
        assert status == 200, text
        return proxy, proxy.instance(model)

    async def file(self, path: Path) -> RunningProxy:
        """An in-process proxy that reads, and reloads, the config file at `path`."""
        return await self(load_config(path), path)

    def process(self, config: Path, port: int, log: Path, *args: str) -> ProxyProcess:
        """The proxy as a process (killed after the test unless it ended)."""
        proc = ProxyProcess(config, port, log, *args)
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
