"""Component tests of the fake vLLM engine, started as a real subprocess on a free port."""

import asyncio
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kit import FakeEngine
from kit.fakeproc import (
    ASLEEP_ERROR,
    CHAT,
    DEV_MODE,
    EXIT_TIMEOUT,
    GARBAGE_TEXT,
    LABELS,
    NORMAL_TEXT,
    POLL_INTERVAL,
    READY_TIMEOUT,
    ROOT,
    SLEEP_ARGS,
    SLEEP_ENV,
    Fake,
    StartFake,
    assert_refused,
    chat_text,
    free_port,
    is_sleeping,
    kill_group,
    metric,
    post,
    probe,
    spawn,
    wait_ready,
    wait_until,
)
from prometheus_client.parser import text_string_to_metric_families

# --------------------------------------------------------------------------- helpers


def sse_events(raw: str) -> list[str]:
    assert raw.endswith("\n\n"), raw
    blocks = raw[:-2].split("\n\n")
    assert all(block.startswith("data: ") and "\n" not in block for block in blocks), raw
    return [block.removeprefix("data: ") for block in blocks]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fake]:
    ignored = ["--gpu-memory-utilization", "0.3", "--enforce-eager", "--dtype", "half"]
    args = ["--max-model-len", "4K", *ignored, "--trust-remote-code", "--disable-log-stats"]
    fake = spawn(tmp_path_factory.mktemp("engine"), free_port(), {}, args)
    try:
        wait_ready(fake)
        yield fake
    finally:
        kill_group(fake)


async def wait_metric(
    session: aiohttp.ClientSession, fake: Fake, series: str, value: float
) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while await metric(session, fake, series) != value:
        assert time.monotonic() < deadline, f"{series} never reached {value}"
        await asyncio.sleep(POLL_INTERVAL)


RUNNING = 'vllm:num_requests_running{engine="0",model_name="m"}'


# --------------------------------------------------------------------------- startup


def test_refuses_connections_until_ready(start_fake: StartFake) -> None:
    fake = start_fake(env=FakeEngine(startup_delay=1.0).env(), args=("--api-key", "secret"))
    wait_until(lambda: "Using max model len" in fake.stdout(), fake, "the startup banner")
    assert probe(fake.port) is None
    wait_ready(fake)
    out = fake.stdout()
    assert f"Starting vLLM server on http://127.0.0.1:{fake.port}" in out
    assert "INFO:     Application startup complete." in out
    conn = http.client.HTTPConnection("127.0.0.1", fake.port, timeout=2)
    conn.request("GET", "/v1/models")
    response = conn.getresponse()
    assert (response.status, json.loads(response.read())) == (401, {"error": "Unauthorized"})
    conn.request("GET", "/v1/models", headers={"Authorization": "Bearer secret"})
    assert conn.getresponse().status == 200
    conn.close()


def test_exit_code_knob_fails_before_binding(start_fake: StartFake) -> None:
    fake = start_fake(env=FakeEngine(exit_code=7).env())
    assert fake.wait_exit() == 7
    assert "RuntimeError: Engine core initialization failed (fake)" in fake.stderr()
    assert "Application startup complete." not in fake.stdout()


def test_port_in_use_exits_1_with_errno_98(start_fake: StartFake) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        fake = start_fake(port=holder.getsockname()[1])
        assert fake.wait_exit() == 1
    assert "OSError: [Errno 98] Address already in use" in fake.stderr()


def test_port_in_use_once_fails_only_the_first_start(start_fake: StartFake, tmp_path: Path) -> None:
    env = FakeEngine(port_in_use_once=tmp_path / "race-marker").env()
    first = start_fake(env=env)
    assert first.wait_exit() == 1
    assert "OSError: [Errno 98] Address already in use" in first.stderr()
    second = start_fake(env=env)
    wait_ready(second)


def unix_probe(path: Path) -> int | None:
    """Status of GET /health over the Unix socket at `path`, or None when nothing listens."""
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(2)
            sock.connect(str(path))
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            head = sock.recv(4096)
    except (FileNotFoundError, ConnectionError):
        return None
    return int(head.split(b" ", 2)[1])


def test_serves_on_a_unix_socket_only_with_uds(start_fake: StartFake, tmp_path: Path) -> None:
    """``--uds PATH``: as vLLM, the socket replaces host and port (nothing listens on TCP), and
    it is bound only once the engine is ready."""
    path = tmp_path / "engine.sock"
    env = FakeEngine(startup_delay=0.5).env()
    fake = start_fake(env=env, args=("--uds", str(path)))
    wait_until(lambda: "Using max model len" in fake.stdout(), fake, "the startup banner")
    assert unix_probe(path) is None
    wait_until(lambda: unix_probe(path) == 200, fake, "GET /health over the socket -> 200")
    assert f"Starting vLLM server on unix:{path}" in fake.stdout()
    assert probe(fake.port) is None, "no TCP listener"


def test_a_file_at_the_uds_path_exits_1_with_errno_98(
    start_fake: StartFake, tmp_path: Path
) -> None:
    path = tmp_path / "engine.sock"
    with socket.socket(socket.AF_UNIX) as old:
        old.bind(str(path))  # left behind, as by an engine that died
    fake = start_fake(args=("--uds", str(path)))
    assert fake.wait_exit() == 1
    assert "OSError: [Errno 98] Address already in use" in fake.stderr()


@pytest.mark.parametrize("transport", ["tcp", "uds"])
def test_the_raw_engine_answers_with_exact_bytes(tmp_path: Path, transport: str) -> None:
    """`fake_vllm.raw`: /health 200, every other request the answer file's bytes as they are,
    each logged with its connection's number."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA"
    (tmp_path / "answer").write_bytes(answer)
    port, path = free_port(), tmp_path / "raw.sock"
    where = ["--uds", str(path)] if transport == "uds" else ["--port", str(port)]
    env = {**os.environ, "FAKE_RAW_ANSWER": str(tmp_path / "answer"),
           "FAKE_RAW_LOG": str(tmp_path / "seen"), "PYTHONPATH": str(ROOT)}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "fake_vllm.raw", "--model", "x", *where],
                            env=env, cwd=ROOT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            try:
                family = socket.AF_UNIX if transport == "uds" else socket.AF_INET
                sock = socket.socket(family)
                sock.connect(str(path) if transport == "uds" else ("127.0.0.1", port))
                break
            except OSError:
                sock.close()
                assert time.monotonic() < deadline and proc.poll() is None, "raw engine up"
                time.sleep(POLL_INTERVAL)
        with sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n")
            sock.sendall(b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            got = b""
            while len(got) < len(answer):
                got += sock.recv(4096)
        assert got == answer
        [entry] = [json.loads(line) for line in (tmp_path / "seen").read_text().splitlines()]
        assert entry == {"connection": 1, "line": "POST /v1/x HTTP/1.1", "body": "{}"}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(EXIT_TIMEOUT)


# --------------------------------------------------------------------------- API shapes


async def test_health_version_and_models(engine: Fake, session: aiohttp.ClientSession) -> None:
    async with session.get(f"{engine.url}/health") as resp:
        assert (resp.status, await resp.read()) == (200, b"")
    async with session.get(f"{engine.url}/version") as resp:
        assert await resp.json() == {"version": "0.0.0-fake"}
    async with session.get(f"{engine.url}/v1/models") as resp:
        models = await resp.json()
    assert models["object"] == "list"
    assert [card["id"] for card in models["data"]] == ["m", "alias"]
    for card in models["data"]:
        assert card.keys() == {
            "id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"
        }  # fmt: skip
        assert (card["object"], card["owned_by"], card["root"], card["parent"]) == (
            "model", "vllm", "m", None
        )  # fmt: skip
        assert card["max_model_len"] == 4096
        [permission] = card["permission"]
        assert permission["object"] == "model_permission"
        assert permission["id"].startswith("modelperm-")


async def test_chat_json(engine: Fake, session: aiohttp.ClientSession) -> None:
    payload = {**CHAT, "model": "alias", "max_tokens": 3}
    headers = {"X-Request-Id": "req-123"}
    async with session.post(
        f"{engine.url}/v1/chat/completions", json=payload, headers=headers
    ) as r:
        assert r.status == 200
        body = await r.json()
    assert (body["id"], body["object"], body["model"]) == (
        "chatcmpl-req-123",
        "chat.completion",
        "m",
    )
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == "tok0 tok1 tok2 "
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (5, 3, 8)
    status, body = await post(session, f"{engine.url}/v1/chat/completions", CHAT)
    assert status == 200
    assert body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"]["content"] == "".join(f"tok{i} " for i in range(8))
    assert body["choices"][0]["finish_reason"] == "stop"
    capped = {**CHAT, "max_completion_tokens": 2}
    status, body = await post(session, f"{engine.url}/v1/chat/completions", capped)
    assert body["usage"]["completion_tokens"] == 2


async def test_chat_stream_chunk_sequence(engine: Fake, session: aiohttp.ClientSession) -> None:
    payload = {**CHAT, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(f"{engine.url}/v1/chat/completions", json=payload) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    role, *content, usage = [json.loads(event) for event in events[:-1]]
    assert role["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None}
    ]  # fmt: skip
    assert [c["choices"][0]["delta"] for c in content] == [
        {"content": "tok0 "}, {"content": "tok1 "}, {"content": "tok2 "}
    ]  # fmt: skip
    assert [c["choices"][0]["finish_reason"] for c in content] == [None, None, "length"]
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 5, "total_tokens": 8, "completion_tokens": 3}
    chunks = [role, *content, usage]
    assert {(c["id"], c["object"], c["model"]) for c in chunks} == {
        (role["id"], "chat.completion.chunk", "m")
    }


async def test_completions_json_and_stream(engine: Fake, session: aiohttp.ClientSession) -> None:
    url = f"{engine.url}/v1/completions"
    status, body = await post(
        session, url, {"model": "m", "prompt": "one two three", "max_tokens": 2}
    )
    assert status == 200
    assert (body["object"], body["model"]) == ("text_completion", "m")
    assert body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == "tok0 tok1 "
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 3
    async with session.post(url, json={"prompt": "x", "max_tokens": 2, "stream": True}) as resp:
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["tok0 ", "tok1 "]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "length"]
    assert chunks[-1]["system_fingerprint"] == "vllm-0.0.0-fake"
    assert all(c["object"] == "text_completion" for c in chunks)


async def test_embeddings(engine: Fake, session: aiohttp.ClientSession) -> None:
    url = f"{engine.url}/v1/embeddings"
    status, body = await post(session, url, {"model": "alias", "input": ["a b", "c"]})
    assert status == 200
    assert (body["object"], body["model"]) == ("list", "m")
    assert body["id"].startswith("embd-")
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "embedding"), (1, "embedding")]
    assert all(len(d["embedding"]) == 8 for d in body["data"])
    assert body["usage"]["prompt_tokens"] == 3
    _, again = await post(session, url, {"input": "a b"})
    assert again["data"][0]["embedding"] == body["data"][0]["embedding"]


ERROR_CASES = [
    ("/v1/chat/completions", {"json": {**CHAT, "model": "nope"}}, 404, "NotFoundError"),
    ("/v1/completions", {"json": {"prompt": "x", "model": "nope"}}, 404, "NotFoundError"),
    ("/v1/chat/completions", {"data": b"{not", "headers": {"Content-Type": "application/json"}},
     400, "Bad Request"),
    ("/v1/chat/completions", {"data": b"{}", "headers": {"Content-Type": "text/plain"}},
     400, "Bad Request"),
    ("/v1/chat/completions", {"json": ["not", "an", "object"]}, 400, "Bad Request"),
    ("/v1/chat/completions", {"json": {"model": "m"}}, 400, "Bad Request"),
    ("/v1/completions", {"json": {"model": "m"}}, 400, "Bad Request"),
    ("/v1/completions", {"json": {"prompt": "x", "max_tokens": 99999}}, 400, "BadRequestError"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "request_kwargs", "status", "error_type"), ERROR_CASES)
async def test_request_errors(
    engine: Fake,
    session: aiohttp.ClientSession,
    path: str,
    request_kwargs: dict[str, Any],
    status: int,
    error_type: str,
) -> None:
    async with session.post(f"{engine.url}{path}", **request_kwargs) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    assert (error["type"], error["code"]) == (error_type, status)
    if status == 404:
        assert error == {
            "message": "The model `nope` does not exist.", "type": "NotFoundError",
            "param": "model", "code": 404,
        }  # fmt: skip


async def test_unknown_routes_and_dev_endpoints_hidden(
    engine: Fake, session: aiohttp.ClientSession
) -> None:
    for method, path in [("GET", "/nope"), ("POST", "/sleep"), ("GET", "/is_sleeping")]:
        async with session.request(method, f"{engine.url}{path}") as resp:
            assert (resp.status, await resp.json()) == (404, {"detail": "Not Found"})
    async with session.get(f"{engine.url}/v1/chat/completions") as resp:
        assert (resp.status, await resp.json()) == (405, {"detail": "Method Not Allowed"})


async def test_metrics_series(engine: Fake, session: aiohttp.ClientSession) -> None:
    await post(session, f"{engine.url}/v1/chat/completions", {**CHAT, "max_tokens": 1})
    async with session.get(f"{engine.url}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    labels = 'engine="0",model_name="m"'
    for name in [
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_sum",
    ]:  # fmt: skip
        assert f"{name}{{{labels}}} " in text, name
    assert f'vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}}' in text
    assert f'vllm:engine_sleep_state{{{labels},sleep_state="awake"}} 1.0' in text
    for name in [
        "fake_engine:wakes_total", "fake_engine:reload_weights_total",
        "fake_engine:reset_prefix_cache_total", "fake_engine:requests_while_asleep_total",
        "fake_engine:garbage_completions_total", "fake_engine:gpu_bytes",
    ]:  # fmt: skip
        assert f"{name}{{{labels}}} 0.0" in text, name
    for level in (0, 1, 2):
        assert f'fake_engine:sleeps_total{{{labels},level="{level}"}} 0.0' in text
    for operation in ("sleep", "wake"):
        series = f'fake_engine:sleep_operations_in_flight{{{labels},operation="{operation}"}}'
        assert f"{series} 0.0" in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    sleeps = families["fake_engine:sleeps"]
    assert (sleeps.type, len(sleeps.samples)) == ("counter", 3)
    assert families["fake_engine:requests_while_asleep"].type == "counter"
    assert families["vllm:engine_sleep_state"].type == "gauge"
    success = re.search(
        rf'^vllm:request_success_total{{{labels},finished_reason="length"}} (\S+)$', text, re.M
    )
    assert success and float(success[1]) >= 1


# --------------------------------------------------------------------------- failures and signals


async def test_crash_after_exits_mid_stream(
    start_fake: StartFake, session: aiohttp.ClientSession
) -> None:
    env = FakeEngine(crash_after=1, crash_code=5).env()
    fake = start_fake(env=env)
    wait_ready(fake)
    status, _ = await post(session, f"{fake.url}/v1/chat/completions", CHAT)
    assert status == 200
    events: list[bytes] = []
    with pytest.raises(aiohttp.ClientError):
        payload = {**CHAT, "stream": True}
        async with session.post(f"{fake.url}/v1/chat/completions", json=payload) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: "):
                    events.append(line)
    assert len(events) >= 2
    assert not any(b"[DONE]" in event for event in events)
    assert fake.wait_exit() == 5


async def test_sigterm_aborts_in_flight_and_exits_0(
    start_fake: StartFake, session: aiohttp.ClientSession
) -> None:
    fake = start_fake(env=FakeEngine(tokens=1000, token_delay=0.05).env())
    wait_ready(fake)
    url = f"{fake.url}/v1/chat/completions"

    async def streamed() -> str:
        async with session.post(url, json={**CHAT, "max_tokens": 1000, "stream": True}) as resp:
            return await resp.text()

    plain = asyncio.create_task(post(session, url, {**CHAT, "max_tokens": 1000}))
    stream = asyncio.create_task(streamed())
    await wait_metric(session, fake, RUNNING, 2.0)
    started = time.monotonic()
    os.kill(fake.proc.pid, signal.SIGTERM)
    status, body = await asyncio.wait_for(plain, EXIT_TIMEOUT)
    assert (status, body["choices"][0]["finish_reason"]) == (200, "abort")
    events = sse_events(await asyncio.wait_for(stream, EXIT_TIMEOUT))
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-1])
    assert fake.wait_exit() == 0
    assert time.monotonic() - started < 2.0
    assert "Application shutdown complete." in fake.stdout()


def test_ignore_sigterm_knob(start_fake: StartFake) -> None:
    fake = start_fake(env=FakeEngine(ignore_sigterm=True).env())
    wait_ready(fake)
    os.kill(fake.proc.pid, signal.SIGTERM)
    with pytest.raises(subprocess.TimeoutExpired):
        fake.wait_exit(timeout=0.3)
    assert probe(fake.port) == 200
    os.kill(fake.proc.pid, signal.SIGINT)
    assert fake.wait_exit() == 0


def test_spawned_engine_core_outlives_sigterm(start_fake: StartFake) -> None:
    fake = start_fake(env=FakeEngine(spawn_child=True).env())
    wait_ready(fake)
    match = re.search(r"EngineCore pid=(\d+)", fake.stdout())
    assert match
    child = int(match[1])
    assert os.getpgid(child) == fake.proc.pid
    assert Path(f"/proc/{child}/comm").read_text().startswith("VLLM::EngineCor")
    os.kill(fake.proc.pid, signal.SIGTERM)
    assert fake.wait_exit() == 0
    state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
    assert state != "Z"
    os.killpg(fake.proc.pid, signal.SIGKILL)


# --------------------------------------------------------------------------- sleep mode


def fake_series(name: str, extra: str = "") -> str:
    return f"{name}{{{LABELS}{extra}}}"


ASLEEP_TOTAL = fake_series("fake_engine:requests_while_asleep_total")
WAKES = fake_series("fake_engine:wakes_total")
GARBAGE = fake_series("fake_engine:garbage_completions_total")
RELOADS = fake_series("fake_engine:reload_weights_total")
RESETS = fake_series("fake_engine:reset_prefix_cache_total")


def sleeps(level: int) -> str:
    return fake_series("fake_engine:sleeps_total", f',level="{level}"')


def in_flight(operation: str) -> str:
    return fake_series("fake_engine:sleep_operations_in_flight", f',operation="{operation}"')


def sleep_state(state: str) -> str:
    return fake_series("vllm:engine_sleep_state", f',sleep_state="{state}"')


def start_sleepy(start_fake: StartFake, **env: str) -> Fake:
    fake = start_fake(env={**SLEEP_ENV, **env}, args=SLEEP_ARGS)
    wait_ready(fake)
    return fake


@pytest.mark.parametrize(
    ("env", "args", "sleep_routes", "dev_routes"),
    [
        ({}, SLEEP_ARGS, False, False),
        # As vLLM 0.33: dev mode alone registers /sleep (the flag is what makes it free memory).
        (SLEEP_ENV, (), True, True),
        (SLEEP_ENV, SLEEP_ARGS, True, True),
    ],
    ids=["flag-without-dev-mode", "dev-mode-without-flag", "both"],
)
async def test_sleep_routes_need_dev_mode(
    start_fake: StartFake,
    session: aiohttp.ClientSession,
    env: dict[str, str],
    args: tuple[str, ...],
    sleep_routes: bool,
    dev_routes: bool,
) -> None:
    fake = start_fake(env=env, args=args)
    wait_ready(fake)
    routes = [
        ("POST", "/sleep", sleep_routes), ("POST", "/wake_up", sleep_routes),
        ("GET", "/is_sleeping", sleep_routes), ("POST", "/reset_prefix_cache", dev_routes),
    ]  # fmt: skip
    for method, path, present in routes:
        async with session.request(method, f"{fake.url}{path}") as resp:
            body = await resp.json()
            assert (resp.status == 200) == present, (path, resp.status, body)
            if not present:
                assert (resp.status, body) == (404, {"detail": "Not Found"})
    status, body = await post(session, f"{fake.url}/collective_rpc", {"method": "noop"})
    expected = (200, {"results": [None]}) if dev_routes else (404, {"detail": "Not Found"})
    assert (status, body) == expected


async def test_sleep_refuses_and_counts_requests_until_wake_up(
    start_fake: StartFake, session: aiohttp.ClientSession
) -> None:
    fake = start_sleepy(start_fake)
    async with session.post(f"{fake.url}/sleep?level=3") as resp:
        assert resp.status == 400
    assert await metric(session, fake, sleeps(1)) == 0.0
    status, body = await post(session, f"{fake.url}/sleep", None)
    assert (status, body) == (200, {"status": "sleeping", "level": 1})
    assert await is_sleeping(session, fake)
    assert probe(fake.port) == 200
    assert await metric(session, fake, sleep_state("awake")) == 0.0
    assert await metric(session, fake, sleep_state("weights_offloaded")) == 1.0
    assert await metric(session, fake, sleeps(1)) == 1.0

    await assert_refused(session, fake)
    completion = {"prompt": "x", "stream": True}
    assert await post(session, f"{fake.url}/v1/completions", completion) == (503, ASLEEP_ERROR)
    embed = await post(session, f"{fake.url}/v1/embeddings", {"input": "x"})
    assert embed == (503, ASLEEP_ERROR)
    assert await metric(session, fake, ASLEEP_TOTAL) == 3.0

    status, body = await post(session, f"{fake.url}/wake_up", None)
    assert (status, body) == (200, {"status": "awake", "tags": None})
    assert not await is_sleeping(session, fake)
    assert await chat_text(session, fake) == NORMAL_TEXT
    assert await metric(session, fake, WAKES) == 1.0
    assert await metric(session, fake, sleep_state("awake")) == 1.0
    assert await metric(session, fake, ASLEEP_TOTAL) == 3.0
    assert await metric(session, fake, GARBAGE) == 0.0


async def test_requests_park_by_default_until_wake_up(
    start_fake: StartFake, session: aiohttp.ClientSession
) -> None:
    """vLLM 0.33 queues requests sent while it sleeps ("All pause modes queue new adds",
    ``v1/engine/core.py:2186``): so does the fake unless ``FAKE_ENGINE_ASLEEP=reject``."""
    fake = start_fake(env=DEV_MODE, args=SLEEP_ARGS)
    wait_ready(fake)
    status, body = await post(session, f"{fake.url}/sleep?level=1", None)
    assert (status, body) == (200, {"status": "sleeping", "level": 1})
    parked = asyncio.create_task(post(session, f"{fake.url}/v1/chat/completions", CHAT))
    await wait_metric(session, fake, ASLEEP_TOTAL, 1.0)
    assert not parked.done()
    status, body = await post(session, f"{fake.url}/wake_up", None)
    assert (status, body) == (200, {"status": "awake", "tags": None})
    status, body = await asyncio.wait_for(parked, EXIT_TIMEOUT)
    assert (status, body["choices"][0]["finish_reason"]) == (200, "stop")
    assert not await is_sleeping(session, fake)


async def test_level_2_wake_serves_garbage_until_reload_weights(
    start_fake: StartFake, session: aiohttp.ClientSession
) -> None:
    fake = start_sleepy(start_fake)
    assert await post(session, f"{fake.url}/sleep?level=2", None) == (
        200, {"status": "sleeping", "level": 2}
    )  # fmt: skip
    assert await metric(session, fake, sleep_state("discard_all")) == 1.0
    assert (await post(session, f"{fake.url}/wake_up", None))[0] == 200
    assert not await is_sleeping(session, fake)
    assert await chat_text(session, fake) == GARBAGE_TEXT
    payload = {"prompt": "x", "max_tokens": 2, "stream": True}
    async with session.post(f"{fake.url}/v1/completions", json=payload) as resp:
        chunks = [json.loads(event) for event in sse_events(await resp.text())[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["<garbage> ", "<garbage> "]
    assert await metric(session, fake, GARBAGE) == 2.0
    assert await metric(session, fake, RELOADS) == 0.0

    rpc = await post(session, f"{fake.url}/collective_rpc", {"method": "reload_weights"})
    assert rpc == (200, {"results": [None]})
    assert await post(session, f"{fake.url}/reset_prefix_cache", None) == (200, {"success": True})
    assert await chat_text(session, fake) == NORMAL_TEXT
    assert await metric(session, fake, GARBAGE) == 2.0
    assert await metric(session, fake, RELOADS) == 1.0
    assert await metric(session, fake, RESETS) == 1.0
    assert await metric(session, fake, sleeps(2)) == 1.0


async def test_level_2_wake_by_tags_and_reload(
    start_fake: StartFake, session: aiohttp.ClientSession
) -> None:
    fake = start_sleepy(start_fake)
    assert (await post(session, f"{fake.url}/sleep?level=2", None))[0] == 200
    status, body = await post(session, f"{fake.url}/collective_rpc", {"method": "reload_weights"})
    assert status == 500
    assert (body["error"]["type"], body["error"]["code"]) == ("InternalServerError", 500)
    assert body["error"]["message"].startswith("Call to collective_rpc method failed")
    partial = await post(session, f"{fake.url}/wake_up?tags=weights", None)
    assert partial == (200, {"status": "sleeping", "tags": ["weights"]})
    assert await is_sleeping(session, fake)
    await assert_refused(session, fake)
    rpc = await post(session, f"{fake.url}/collective_rpc", {"method": "reload_weights"})
    assert rpc == (200, {"results": [None]})
    woken = await post(session, f"{fake.url}/wake_up?tags=kv_cache", None)
    assert woken == (200, {"status": "awake", "tags": ["kv_cache"]})
    reset = await post(session, f"{fake.url}/reset_prefix_cache", None)
    assert reset == (200, {"success": True})
    assert await chat_text(session, fake) == NORMAL_TEXT
    assert await metric(session, fake, WAKES) == 2.0
    assert await metric(session, fake, RELOADS) == 1.0


async def test_sleep_and_wake_answer_after_their_delays(
    start_fake: StartFake, session: aiohttp.ClientSession
) -> None:
    delays = FakeEngine(sleep_delay=1.5, wake_delay=1.5).env()
    fake = start_sleepy(start_fake, **delays)
    falling = asyncio.create_task(post(session, f"{fake.url}/sleep", None))
    await wait_metric(session, fake, in_flight("sleep"), 1.0)
    assert await is_sleeping(session, fake)
    await assert_refused(session, fake)
    assert not falling.done()
    assert await asyncio.wait_for(falling, EXIT_TIMEOUT) == (
        200, {"status": "sleeping", "level": 1}
    )  # fmt: skip
    assert await metric(session, fake, in_flight("sleep")) == 0.0

    waking = asyncio.create_task(post(session, f"{fake.url}/wake_up", None))
    await wait_metric(session, fake, in_flight("wake"), 1.0)
    assert await is_sleeping(session, fake)
    await assert_refused(session, fake)
    assert not waking.done()
    assert (await asyncio.wait_for(waking, EXIT_TIMEOUT))[0] == 200
    assert not await is_sleeping(session, fake)
    assert await chat_text(session, fake) == NORMAL_TEXT
    assert await metric(session, fake, ASLEEP_TOTAL) == 2.0


async def test_sleep_fail_knob(start_fake: StartFake, session: aiohttp.ClientSession) -> None:
    fake = start_sleepy(start_fake, **FakeEngine(sleep_fail=True).env())
    status, body = await post(session, f"{fake.url}/sleep?level=1", None)
    assert status == 500
    assert (body["error"]["type"], body["error"]["code"]) == ("InternalServerError", 500)
    assert not await is_sleeping(session, fake)
    assert await chat_text(session, fake) == NORMAL_TEXT
    assert await metric(session, fake, sleeps(1)) == 0.0


async def test_wake_fail_knob(start_fake: StartFake, session: aiohttp.ClientSession) -> None:
    fake = start_sleepy(start_fake, **FakeEngine(wake_fail=True).env())
    assert (await post(session, f"{fake.url}/sleep?level=1", None))[0] == 200
    status, body = await post(session, f"{fake.url}/wake_up", None)
    assert status == 500
    assert (body["error"]["type"], body["error"]["code"]) == ("InternalServerError", 500)
    assert await is_sleeping(session, fake)
    await assert_refused(session, fake)
    assert await metric(session, fake, WAKES) == 0.0


async def test_wake_lies_knob(start_fake: StartFake, session: aiohttp.ClientSession) -> None:
    fake = start_sleepy(start_fake, **FakeEngine(wake_lies=True).env())
    assert (await post(session, f"{fake.url}/sleep?level=1", None))[0] == 200
    status, body = await post(session, f"{fake.url}/wake_up", None)
    assert (status, body) == (200, {"status": "awake", "tags": None})
    assert await is_sleeping(session, fake)
    await assert_refused(session, fake)
    assert await metric(session, fake, ASLEEP_TOTAL) == 1.0


async def test_wake_hang_knob_answers_only_at_shutdown(
    start_fake: StartFake, session: aiohttp.ClientSession
) -> None:
    fake = start_sleepy(start_fake, **FakeEngine(wake_hang=True).env())
    assert (await post(session, f"{fake.url}/sleep?level=1", None))[0] == 200

    async def wake() -> int:
        async with session.post(f"{fake.url}/wake_up") as resp:
            return resp.status

    hanging = asyncio.create_task(wake())
    await wait_metric(session, fake, in_flight("wake"), 1.0)
    assert await is_sleeping(session, fake)
    await assert_refused(session, fake)
    assert probe(fake.port) == 200
    assert not hanging.done()
    os.kill(fake.proc.pid, signal.SIGTERM)
    assert await asyncio.wait_for(hanging, EXIT_TIMEOUT) == 503
    assert fake.wait_exit() == 0
