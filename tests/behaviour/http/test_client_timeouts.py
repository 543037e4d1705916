"""Every wait on a client is bounded: body, idle keep-alive, a stuck reader; descriptors."""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import time
from pathlib import Path

import pytest
from kit import FakeEngine, StartProxy, make_config, wait_for

from vllm_proxy.app import raise_fd_limit

FAST = {"body_timeout_s": 0.5, "keepalive_timeout_s": 0.5, "send_timeout_s": 0.5}


async def test_a_body_that_never_arrives_is_a_408(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(make_config(tmp_path, server=FAST))
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"model": '
    )
    await writer.drain()
    started = time.monotonic()
    answer = await asyncio.wait_for(reader.read(65536), 10)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert b'"request_timeout"' in answer
    assert time.monotonic() - started < 5
    assert proxy.model("m1").instances == [], "no engine was started for it"


@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"])
async def test_idle_or_half_sent_connections_are_closed(
    tmp_path: Path, start_proxy: StartProxy, sent: bytes
) -> None:
    proxy = await start_proxy(make_config(tmp_path, server=FAST))
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    writer.write(sent)
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 10) == b"", "closed by the proxy"
    writer.close()


async def test_a_client_that_reads_nothing_is_dropped_and_its_lease_released(
    tmp_path: Path, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    env = FakeEngine(tokens=200000, token_delay=0).env()
    model = {"model": "x", "env": env, "args": {"max_model_len": 10_000_000}}  # ~40 MB of SSE
    cfg = make_config(tmp_path, {"m1": model}, server=FAST)
    proxy = await start_proxy(cfg)
    assert (await proxy.chat("m1", max_tokens=1)).status == 200
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", proxy.server.port))
    body = b'{"model": "m1", "stream": true, "messages": [{"role": "user", "content": "x"}]}'
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    inst = proxy.instance("m1")
    with caplog.at_level(logging.INFO):
        await wait_for(lambda: inst.leases == 1, what="stream started")
        # The client reads nothing: once its buffers are full, the proxy waits 0.5 s, then drops it.
        await wait_for(lambda: inst.leases == 0, timeout=30, what="lease released")
        await wait_for(lambda: "status=499" in caplog.text, what="logged as client gone")
    assert "took nothing for 0.5s" in caplog.text
    sock.close()


def test_open_file_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 2:
        pytest.fail(f"this machine's hard limit ({hard}) cannot show the raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard // 2, hard))
    try:
        raise_fd_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, hard // 2), hard))


async def test_a_slow_request_head_is_cut_off(
    tmp_path: Path, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """Slow loris: a head that trickles in is closed after header_timeout_s, even though the
    keep-alive timeout is far longer."""
    server = {"header_timeout_s": 0.5, "keepalive_timeout_s": 60}
    proxy = await start_proxy(make_config(tmp_path, server=server))
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    with caplog.at_level(logging.WARNING, logger="vllm_proxy.frontend.bytes.connection"):
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\n")
        await writer.drain()
        for _ in range(100):  # one header line at a time, never the blank line that ends it
            if reader.at_eof():
                break
            writer.write(b"X-Slow: 1\r\n")
            try:
                await writer.drain()
                assert await asyncio.wait_for(reader.read(), 0.1) == b""
                break
            except TimeoutError:
                continue
            except ConnectionError:
                break
        writer.close()
    assert "did not arrive within 0.5s" in caplog.text
    # A whole request on a fresh connection is unaffected.
    assert (await proxy.chat("m1", max_tokens=1)).status == 200


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
        b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
)
async def test_malformed_http_gets_an_openai_error_and_one_log_line(
    tmp_path: Path, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture, raw: bytes
) -> None:
    proxy = await start_proxy(make_config(tmp_path))
    with caplog.at_level(logging.DEBUG):
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
        writer.write(raw)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400", head
    assert b"application/json" in head
    err = json.loads(body)["error"]
    assert err["code"] == "bad_http_request" and err["type"] == "invalid_request_error"
    assert not any(r.exc_info for r in caplog.records), "no traceback for a client's mistake"
    assert (await proxy.http.get(proxy.url + "/health")).status == 200
