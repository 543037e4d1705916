"""The fake engine run on its own, as a process the test starts (no proxy): spawn it on a free
port, wait until it is ready, call it, read its metrics, kill its group."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from . import FakeEngine, scrape

ROOT = Path(__file__).resolve().parents[2]


READY_TIMEOUT = 10.0


EXIT_TIMEOUT = 5.0


POLL_INTERVAL = 0.02


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Fake:
    proc: subprocess.Popen[bytes]
    port: int
    logs: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stdout(self) -> str:
        return (self.logs / "stdout.log").read_text()

    def stderr(self) -> str:
        return (self.logs / "stderr.log").read_text()

    def wait_exit(self, timeout: float = EXIT_TIMEOUT) -> int:
        return self.proc.wait(timeout)


def spawn(logs: Path, port: int, env: dict[str, str], args: list[str]) -> Fake:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_ENGINE_", "VLLM_"))}
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "fake_vllm", "--model", "m"]
    command += ["--served-model-name", "m", "alias", "--port", str(port), *args]
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "stdout.log", "wb") as out, open(logs / "stderr.log", "wb") as err:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env={**base, "PYTHONPATH": pythonpath, **env},
            cwd=ROOT,
            start_new_session=True,
        )
    return Fake(proc, port, logs)


def kill_group(fake: Fake) -> None:
    try:
        os.killpg(fake.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        fake.proc.wait(EXIT_TIMEOUT)
    except subprocess.TimeoutExpired:
        pass


def probe(port: int) -> int | None:
    """Status of GET /health, or None when the connection is refused."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except ConnectionError:
        return None
    finally:
        conn.close()


def wait_until(
    condition: Callable[[], bool], fake: Fake, what: str, timeout: float = READY_TIMEOUT
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if fake.proc.poll() is not None:
            raise AssertionError(f"fake exited {fake.proc.returncode}: {fake.stderr()}")
        time.sleep(POLL_INTERVAL)
    raise AssertionError(f"timed out waiting for {what}; stdout: {fake.stdout()}")


def wait_ready(fake: Fake, timeout: float = READY_TIMEOUT) -> None:
    wait_until(lambda: probe(fake.port) == 200, fake, "GET /health -> 200", timeout)


StartFake = Callable[..., Fake]


@pytest.fixture
def start_fake(tmp_path: Path) -> Iterator[StartFake]:
    started: list[Fake] = []

    def start(env: dict[str, str] | None = None, args: tuple[str, ...] = (), port: int = 0) -> Fake:
        fake = spawn(tmp_path / f"fake{len(started)}", port or free_port(), env or {}, list(args))
        started.append(fake)
        return fake

    try:
        yield start
    finally:
        for fake in started:
            kill_group(fake)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def post(session: aiohttp.ClientSession, url: str, payload: Any) -> tuple[int, Any]:
    async with session.post(url, json=payload) as resp:
        return resp.status, await resp.json()


async def metric(session: aiohttp.ClientSession, fake: Fake, series: str) -> float:
    async with session.get(f"{fake.url}/metrics") as resp:
        text = await resp.text()
    value = scrape(text).at(series)
    assert value is not None, text
    return value


CHAT = {
    "messages": [{"role": "user", "content": "hello there"}, {"role": "user", "content": "a b c"}]
}


DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}


#: Dev mode, and requests while asleep refused (503) so that tests can see them: by default
#: they park until the wake (`test_requests_park_by_default_until_wake_up`).
SLEEP_ENV = {**DEV_MODE, **FakeEngine(asleep="reject").env()}


SLEEP_ARGS = ("--enable-sleep-mode",)


LABELS = 'engine="0",model_name="m"'


ASLEEP_ERROR = {
    "error": {
        "message": "The engine is sleeping; wake it up with POST /wake_up first.",
        "type": "ServiceUnavailableError",
        "param": None,
        "code": 503,
    }
}


NORMAL_TEXT = "".join(f"tok{i} " for i in range(8))


GARBAGE_TEXT = "<garbage> " * 8


async def is_sleeping(session: aiohttp.ClientSession, fake: Fake) -> bool:
    async with session.get(f"{fake.url}/is_sleeping") as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body.keys() == {"is_sleeping"}
    state: bool = body["is_sleeping"]
    return state


async def chat_text(session: aiohttp.ClientSession, fake: Fake) -> str:
    status, body = await post(session, f"{fake.url}/v1/chat/completions", CHAT)
    assert status == 200, body
    text: str = body["choices"][0]["message"]["content"]
    return text


async def assert_refused(session: aiohttp.ClientSession, fake: Fake) -> None:
    """A chat completion is answered 503 with vLLM's nested error body."""
    assert await post(session, f"{fake.url}/v1/chat/completions", CHAT) == (503, ASLEEP_ERROR)
