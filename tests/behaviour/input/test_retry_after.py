"""Every 503 the proxy answers carries ``Retry-After``, and ``/health`` turns 503 as a drain
starts: a client knows when to come back, and a load balancer (docs/cluster.md) retries the
request on another server and stops sending to a draining one before its engines stop."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiohttp
from kit import FakeEngine, RunningProxy, StartProxy, make_config, wait_for
from kit import budget_config as budget
from kit.raw import RAW_ENGINE_SCRIPT

from vllm_proxy.errors import RETRY_AFTER_S, EngineFailed, ProxyError, Unavailable
from vllm_proxy.frontend.serving import error_response

RAW_ENGINE = [sys.executable, str(RAW_ENGINE_SCRIPT)]
SLOW = FakeEngine(tokens=20, token_delay=0.05).env()
LONG = FakeEngine(tokens=400, token_delay=0.05).env()


async def refused(resp: aiohttp.ClientResponse, code: str) -> None:
    """A 503 in the OpenAI shape with the given code and a positive ``Retry-After``."""
    body = await resp.json()
    assert resp.status == 503, body
    assert body["error"]["code"] == code, body
    assert int(resp.headers["Retry-After"]) >= 1, dict(resp.headers)


async def first_chunk(proxy: RunningProxy, model: str) -> aiohttp.ClientResponse:
    stream = await proxy.chat(model, stream=True)
    assert stream.status == 200
    assert await stream.content.readany()
    return stream


def test_error_response_gives_every_503_a_retry_after() -> None:
    """The last line of defence: a 503 raised as a plain `ProxyError` gets one too; an
    `Unavailable` keeps its own value; other statuses get none."""
    plain = error_response(ProxyError("no", status=503), "rid-1")
    assert plain.status == 503 and plain.headers["Retry-After"] == str(RETRY_AFTER_S)
    own = error_response(Unavailable("later", retry_after_s=9), "rid-2")
    assert own.headers["Retry-After"] == "9"
    assert "Retry-After" not in error_response(EngineFailed("died"), "rid-3").headers


async def test_health_is_503_from_the_start_of_a_drain_while_streams_finish(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(make_config(tmp_path, {"m1": {"model": "x", "env": SLOW}}))
    health = await proxy.http.get(proxy.url + "/health")
    assert health.status == 200 and "Retry-After" not in health.headers
    stream = await first_chunk(proxy, "m1")
    drain = asyncio.ensure_future(proxy.server.shutdown())
    try:

        async def unhealthy() -> bool:
            async with proxy.http.get(proxy.url + "/health") as r:
                if r.status != 503:
                    return False
                assert int(r.headers["Retry-After"]) >= 1
                assert (await r.json())["status"] == "shutting_down"
                return True

        await wait_for(unhealthy, what="/health 503 while draining")
        assert not drain.done(), "the drain waits for the stream"
        await refused(await proxy.chat("m1"), "shutting_down")
        rest = await stream.read()
        assert rest.endswith(b"data: [DONE]\n\n"), "the in-flight stream completes"
    finally:
        await asyncio.wait_for(drain, 30)


async def test_queue_full_503_has_retry_after(tmp_path: Path, start_proxy: StartProxy) -> None:
    models = {
        "a": {"model": "x", "memory_mb": 600, "env": LONG},
        "c": {"model": "x", "memory_mb": 600, "env": SLOW},
    }
    proxy = await start_proxy(budget(tmp_path, models, queue_timeout_s=30, max_queue=1))
    stream = await first_chunk(proxy, "a")  # a holds the memory while it streams
    queued = asyncio.ensure_future(proxy.chat("c", max_tokens=1))
    await wait_for(lambda: proxy.model("c").waiting == 1, what="one request queued for c")
    await refused(await proxy.chat("c"), "queue_full")
    stream.close()  # a's lease is released: c is admitted
    resp = await asyncio.wait_for(queued, 30)
    assert resp.status == 200, await resp.text()


async def test_insufficient_memory_503s_have_retry_after(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Both ways a model finds no memory: admission (a busy model holds it) and an engine that
    runs out of GPU memory at start with nothing left to evict."""
    oom = 'echo "torch.OutOfMemoryError: CUDA out of memory"; exit 1'
    models = {
        "a": {"model": "x", "memory_mb": 600, "env": LONG},
        "c": {"model": "x", "memory_mb": 600},
        "oom": {"model": "x", "memory_mb": 300, "command": ["sh", "-c", oom, "sh"]},
    }
    proxy = await start_proxy(budget(tmp_path, models, queue_timeout_s=0))
    stream = await first_chunk(proxy, "a")
    await refused(await proxy.chat("c"), "insufficient_gpu_memory")
    await refused(await proxy.chat("oom"), "insufficient_gpu_memory")
    stream.close()


async def test_no_connection_slot_503_has_retry_after(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    cfg = make_config(
        tmp_path,
        {"m1": {"model": "x", "env": LONG}},
        server={"max_upstream_connections": 1, "connection_queue_timeout_s": 0.2},
    )
    proxy = await start_proxy(cfg)
    stream = await first_chunk(proxy, "m1")  # holds the model's only engine connection
    await refused(await proxy.chat("m1"), "connections_busy")
    stream.close()


async def test_an_engines_own_503_is_relayed_with_retry_after(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """vLLM answers 503 itself (queue limits): relayed as sent, with ``Retry-After`` added when
    the engine gave none, the engine's own kept when it did."""
    body = json.dumps({"error": {"message": "queue full", "code": 503}}).encode()
    head = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    cases = {"bare": (b"", str(RETRY_AFTER_S)), "own": (b"Retry-After: 7\r\n", "7")}
    models = {}
    for name, (extra, _) in cases.items():
        answer = tmp_path / f"answer-{name}"
        answer.write_bytes(head + extra + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        env = {"RAW_ENGINE_ANSWER": str(answer), "RAW_ENGINE_LOG": str(tmp_path / "seen")}
        models[name] = {"model": "raw", "command": RAW_ENGINE, "env": env}
    proxy = await start_proxy(make_config(tmp_path, models))
    for name, (_, expected) in cases.items():
        resp = await proxy.chat(name)
        assert resp.status == 503 and await resp.read() == body
        assert resp.headers.getall("Retry-After") == [expected]
