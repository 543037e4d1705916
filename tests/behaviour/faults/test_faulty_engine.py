"""Faulty engines answering through the whole proxy: what a client receives when an engine's
answer is odd (scripted bytes from `fake_vllm.raw`, a real engine process the proxy starts)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from kit import RunningProxy, StartProxy, make_config

RAW = [sys.executable, "-m", "fake_vllm.raw"]
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "x"}]}


async def raw_proxy(
    tmp_path: Path, start_proxy: StartProxy, answer: bytes, transport: str = "tcp"
) -> RunningProxy:
    (tmp_path / "answer").write_bytes(answer)
    env = {"FAKE_RAW_ANSWER": str(tmp_path / "answer"), "FAKE_RAW_LOG": str(tmp_path / "seen")}
    model = {
        "model": "raw",
        "command": RAW,
        "env": env,
        "transport": transport,
        "read_timeout_s": 5,
    }
    return await start_proxy(make_config(tmp_path, {"m1": model}))


def seen(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "seen").read_text().splitlines()]


async def raw_exchange(proxy: RunningProxy, body: dict[str, Any]) -> tuple[bytes, bytes]:
    """One request on a connection of its own; the response's head and body as bytes."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        data = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def answer(body: bytes, *headers: bytes, status: bytes = b"200 OK") -> bytes:
    fields = b"".join(h + b"\r\n" for h in headers)
    return b"HTTP/1.1 %s\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s" % (
        status, fields, len(body), body,
    )  # fmt: skip


async def test_a_usage_count_of_1e999_still_answers_the_client(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """``1e999`` is valid JSON (infinity as a float): the token count is unusable, the answer
    is still good and reaches the client whole."""
    body = b'{"choices":[],"usage":{"prompt_tokens":1e999,"completion_tokens":2}}'
    proxy = await raw_proxy(tmp_path, start_proxy, answer(body))
    resp = await proxy.chat("m1")
    assert resp.status == 200
    assert await resp.read() == body


@pytest.mark.parametrize("transport", ["tcp", "uds"])
async def test_bytes_after_a_complete_response_never_reach_the_client(
    tmp_path: Path, start_proxy: StartProxy, transport: str
) -> None:
    """A second response the engine sends in the same write after a complete one is not part
    of the client's answer, and the connection it came on is closed, never used again."""
    extra = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nEVIL!"
    proxy = await raw_proxy(tmp_path, start_proxy, answer(b'{"a":1}') + extra, transport)
    for _ in range(2):
        resp = await proxy.chat("m1")
        assert resp.status == 200
        assert await resp.read() == b'{"a":1}'
    connections = [entry["connection"] for entry in seen(tmp_path)]
    assert len(connections) == 2 and connections[0] != connections[1], "no connection reused"


async def test_engine_header_bytes_reach_the_client_unchanged(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    value = "café ✓".encode()
    proxy = await raw_proxy(tmp_path, start_proxy, answer(b"{}", b"X-Note: " + value))
    head, _ = await raw_exchange(proxy, CHAT)
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"\r\nX-Note: " + value + b"\r\n" in head + b"\r\n"


@pytest.mark.parametrize("status", [b"600 Beyond", b"099 Below", b"000 Zero", b"999 Odd"])
async def test_a_status_outside_100_to_599_is_a_502(
    tmp_path: Path, start_proxy: StartProxy, status: bytes
) -> None:
    proxy = await raw_proxy(tmp_path, start_proxy, answer(b"{}", status=status))
    resp = await proxy.chat("m1")
    assert resp.status == 502
    error = (await resp.json())["error"]
    assert error["type"] and "m1" in error["message"]
