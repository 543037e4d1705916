"""``server.max_bodies_mb`` for compressed bodies (issue 42, row 1): 13 gzip requests, 95 KiB on
the wire, inflated to 31 MiB each and held for their whole streams; another client's 300-byte
request then got 503 ``request_bodies_full``. Now a client's compressed bodies may hold at most
half of the budget beyond their first, and a large body is given back once it has been written
to the engine. Requests go over HTTP to the proxy, engines are fake-engine processes."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path
from typing import Any

from kit import FakeEngine, RunningProxy, StartProxy, make_config, wait_for

MIB = 1024 * 1024
PLAIN = {"Content-Type": "application/json"}
GZIP = {**PLAIN, "Content-Encoding": "gzip"}


def gzipped(model: str, inflated: int, **extra: Any) -> bytes:
    """A chat request that inflates to `inflated` bytes (one long message): a few KiB."""
    body: dict[str, Any] = {"model": model, "max_tokens": 5, **extra,
                            "messages": [{"role": "user", "content": ""}]}  # fmt: skip
    body["messages"][0]["content"] = "x" * (inflated - len(json.dumps(body)))
    raw = json.dumps(body).encode()
    assert len(raw) == inflated
    return gzip.compress(raw, 9)


def held(proxy: RunningProxy) -> int:
    return proxy.server.runtime.proxy.bodies.held


async def test_one_client_s_compressed_bodies_cannot_take_max_bodies_mb(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Four gzip bodies of 4 KiB that inflate to 4 MiB each, waiting for a slow start, took all
    of 16 MiB: the next request of anyone got 503. Now the third and fourth are refused (the
    client's share, half of it) and another request is served."""
    models = {
        "slow": {"model": "x", "env": FakeEngine(startup_delay=60).env()},
        "fast": {"model": "y"},
    }
    server = {"max_bodies_mb": 16, "max_body_mb": 16}
    proxy = await start_proxy(make_config(tmp_path, models, server=server))
    url = proxy.url + "/v1/chat/completions"
    body = gzipped("slow", 4 * MIB, stream=True)
    assert len(body) < 64 * 1024

    async def wait_in_queue() -> int:
        async with proxy.http.post(url, data=body, headers=GZIP) as r:
            return r.status

    waiting = [asyncio.ensure_future(wait_in_queue()) for _ in range(2)]
    try:
        await wait_for(lambda: held(proxy) == 8 * MIB, timeout=60, what="two bodies held")
        for _ in range(2):
            async with proxy.http.post(url, data=body, headers=GZIP) as r:
                assert r.status == 503, await r.text()
                err = (await r.json())["error"]
                assert err["code"] == "request_bodies_full" and "share" in err["message"], err
        assert held(proxy) == 8 * MIB
        small = {"model": "fast", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        async with proxy.http.post(url, json=small) as r:
            assert r.status == 200, await r.text()
        async with proxy.http.post(url, data=gzipped("fast", 2 * MIB), headers=GZIP) as r:
            assert r.status == 503, "over the share while the two still wait"
    finally:
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
    await wait_for(lambda: held(proxy) == 0, what="every byte given back")


async def test_a_large_body_is_given_back_once_written_to_the_engine(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """A 12 MiB body (gzip) whose stream lasts seconds held its bytes until the stream ended:
    with 16 MiB a second one got 503. Now the bytes are given back when the body has gone to
    the engine, and the second is served while the first still streams."""
    models = {"m": {"model": "x", "env": FakeEngine(tokens=1000, token_delay=0.1).env()}}
    server = {"max_bodies_mb": 16, "max_body_mb": 16}
    proxy = await start_proxy(make_config(tmp_path, models, server=server))
    url = proxy.url + "/v1/chat/completions"
    assert (await proxy.chat("m", max_tokens=1)).status == 200  # started
    body = gzipped("m", 12 * MIB, stream=True, max_tokens=1000)  # a stream of 100 s
    async with proxy.http.post(url, data=body, headers=GZIP) as first:
        assert first.status == 200
        assert (await first.content.readany()).startswith(b"data: ")
        await wait_for(lambda: held(proxy) == 0, timeout=20, what="the first body given back")
        async with proxy.http.post(url, data=gzipped("m", 12 * MIB), headers=GZIP) as second:
            assert second.status == 200, await second.text()
        more = await asyncio.wait_for(first.content.readany(), 30)
        assert more and b"[DONE]" not in more, "the first stream still runs"
    await wait_for(lambda: held(proxy) == 0, what="nothing held")


async def test_plain_bodies_of_one_client_still_share_the_whole_budget(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """The share is for inflation only: plain bodies cost their sender what they hold."""
    models = {"slow": {"model": "x", "env": FakeEngine(startup_delay=60).env()}}
    server = {"max_bodies_mb": 4, "max_body_mb": 4}
    proxy = await start_proxy(make_config(tmp_path, models, server=server))
    url = proxy.url + "/v1/chat/completions"
    raw = gzip.decompress(gzipped("slow", 1 * MIB, stream=True))

    async def send() -> int:
        async with proxy.http.post(
            url, data=raw, headers={"Content-Type": "application/json"}
        ) as r:
            return r.status

    waiting = [asyncio.ensure_future(send()) for _ in range(3)]
    try:
        await wait_for(lambda: held(proxy) == 3 * MIB, timeout=60, what="three plain bodies held")
    finally:
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
