"""A client's mistake is never a 500; every request has an id and one access-log line."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp
import pytest
from kit import FakeEngine, StartProxy, make_config, wait_for
from kit.metrics import proxy_samples


async def test_deeply_nested_json_is_a_400(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(make_config(tmp_path))
    body = b'{"model": "m1", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    resp = await proxy.http.post(
        proxy.url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    assert resp.status == 400
    assert "nested too deeply" in (await resp.json())["error"]["message"]
    assert proxy.model("m1").instances == []


async def test_invalid_utf8_bearer_token_is_a_401(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(make_config(tmp_path, server={"api_keys": ["k"]}))
    raw = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\xc3\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    writer.write(raw)
    await writer.drain()
    head = (await reader.read(65536)).split(b"\r\n", 1)[0]
    writer.close()
    assert head.startswith(b"HTTP/1.1 401"), head


async def test_wrong_method_gets_405_with_allow(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(make_config(tmp_path))
    resp = await proxy.http.get(proxy.url + "/v1/chat/completions")
    assert resp.status == 405
    assert "POST" in resp.headers["Allow"]
    assert (await resp.json())["error"]["code"] == "method_not_allowed"


async def test_request_id_is_passed_on_or_made_and_returned(
    tmp_path: Path, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = await start_proxy(make_config(tmp_path))
    with caplog.at_level(logging.INFO, logger="vllm_proxy.access"):
        given = await proxy.chat("m1", max_tokens=1)  # no id sent: the proxy makes one
        made = given.headers["X-Request-ID"]
        assert given.status == 200 and made
        body = {"model": "m1", "messages": [{"role": "user", "content": "x"}]}
        own = await proxy.http.post(
            proxy.url + "/v1/chat/completions", json=body, headers={"X-Request-ID": "abc-123"}
        )
        assert own.headers["X-Request-ID"] == "abc-123"
        bad = await proxy.http.post(
            proxy.url + "/v1/chat/completions", json=body, headers={"X-Request-ID": "a b\tc" * 50}
        )
        assert bad.headers["X-Request-ID"] not in ("", "a b\tc" * 50)  # replaced, not echoed
        stream = await proxy.chat("m1", stream=True)
        assert stream.headers["X-Request-ID"]
        await stream.read()
        missing = await proxy.chat("nope")
        assert missing.status == 404 and missing.headers["X-Request-ID"]
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm_proxy.access"]
    assert len(lines) == 5, lines
    assert any(
        line.startswith(
            "abc-123 POST /v1/chat/completions model=m1 instance=m1#1 status=200 bytes="
        )
        for line in lines
    ), lines
    assert any(f"{made} " in line and "status=200" in line for line in lines)
    assert any("model=- instance=- status=404" in line for line in lines)


async def test_a_5xx_names_its_request_id(tmp_path: Path, start_proxy: StartProxy) -> None:
    models = {"m1": {"model": "x", "env": FakeEngine(exit_code=9).env()}}
    proxy = await start_proxy(make_config(tmp_path, models))
    body = {"model": "m1", "messages": [{"role": "user", "content": "x"}]}
    resp = await proxy.http.post(
        proxy.url + "/v1/chat/completions", json=body, headers={"X-Request-ID": "find-me"}
    )
    assert resp.status == 502
    assert "(request id find-me)" in (await resp.json())["error"]["message"]


async def test_client_gone_mid_stream_is_499(
    tmp_path: Path, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    env = FakeEngine(tokens=1000, token_delay=0.01).env()
    proxy = await start_proxy(make_config(tmp_path, {"m1": {"model": "x", "env": env}}))
    assert (await proxy.chat("m1", max_tokens=1)).status == 200
    with caplog.at_level(logging.INFO, logger="vllm_proxy.access"):
        async with aiohttp.ClientSession() as client:
            body = {"model": "m1", "stream": True, "messages": [{"role": "user", "content": "x"}]}
            async with client.post(proxy.url + "/v1/chat/completions", json=body) as resp:
                await resp.content.readany()
        await wait_for(lambda: proxy.instance("m1").leases == 0, what="lease released")
        await wait_for(
            lambda: any("status=499" in r.getMessage() for r in caplog.records),
            what="a 499 access line",
        )
    metrics = await proxy_samples(proxy)
    assert metrics.get("vllm_requests_total", model_id="m1", status="499") == 1.0
