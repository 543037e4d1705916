"""Hostile request bodies cost about their size and never hold the event loop; bodies held at
once are capped (503); only JSON is taken on the JSON routes (415); the heap left free by a
burst of large bodies is given back."""

from __future__ import annotations

import asyncio
import functools
import gzip
import io
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kit import (
    FAKE_ENGINE,
    FakeEngine,
    RunningProxy,
    StartProxy,
    free_port,
    heap_probe,
    make_config,
    wait_for,
    wait_healthy,
    write_config,
)

MIB = 1024 * 1024
JSON = {"Content-Type": "application/json"}


@functools.cache
def dense_json(size: int) -> bytes:
    """A request of `size` bytes that is nearly all empty objects (``[{},{},...]``): 25 times
    its size once built by `json.loads`; its model does not exist."""
    head, tail = b'{"model":"nope","x":[', b"{}]}"
    return head + b"{}," * ((size - len(head) - len(tail)) // 3) + tail


@functools.cache
def dense_gzip(size: int) -> bytes:
    """`dense_json` compressed: 32 MiB of it is 31 KiB on the wire."""
    return gzip.compress(dense_json(size), 6)


GZIP = {"Content-Type": "application/json", "Content-Encoding": "gzip"}


def peak_rss(pid: int) -> int:
    """The process's resident memory at its highest (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def one_model_process(tmp_path: Path, start_proxy: StartProxy) -> tuple[Any, int]:
    """The proxy as a process of its own (its memory measured alone), one model."""
    port = free_port()
    data = {
        "server": {"host": "127.0.0.1", "port": port, "state_dir": str(tmp_path / "st")},
        "engine": {"command": FAKE_ENGINE, "stop_timeout_s": 1, "port_range": [30000, 39999]},
        "models": {"m1": {"model": "x"}},
    }
    path = write_config(tmp_path / "config.yaml", data)
    return start_proxy.process(path, port, tmp_path / "proxy.log"), port


@pytest.fixture
def proxy_process(tmp_path: Path, start_proxy: StartProxy) -> tuple[subprocess.Popen[bytes], str]:
    proxy, _port = one_model_process(tmp_path, start_proxy)
    return proxy.proc, proxy.url


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM in /proc")
async def test_a_31_kib_gzip_body_of_dense_json_costs_about_its_inflated_size(
    proxy_process: tuple[subprocess.Popen[bytes], str],
) -> None:
    """It inflated to 32 MiB, was parsed whole (`json.loads` builds some 11 million dicts) and
    took the proxy from 57 to 923 MiB. Now it is scanned as it inflates and held once: the
    proxy's peak grows by about its inflated size, and the client learns that its model does
    not exist."""
    proc, url = proxy_process
    body = dense_gzip(32 * MIB - 1024)
    assert len(body) < 64 * 1024
    async with aiohttp.ClientSession() as http:
        await wait_healthy(http, url)
        async with http.post(url + "/v1/chat/completions", json={"model": "nope"}) as r:
            assert r.status == 404  # warm: the request path has run once
        before = peak_rss(proc.pid)
        async with http.post(url + "/v1/chat/completions", data=body, headers=GZIP) as r:
            assert r.status == 404, await r.text()
            assert "'nope'" in (await r.json())["error"]["message"]
        grown = peak_rss(proc.pid) - before
    assert grown < 128 * MIB, f"peak resident memory grew by {grown / MIB:.0f} MiB"


async def largest_gap(ticks: list[float], stop: asyncio.Event) -> None:
    """Note the longest time the event loop took to come back to a 2 ms timer."""
    while not stop.is_set():
        began = time.perf_counter()
        await asyncio.sleep(0.002)
        ticks[0] = max(ticks[0], time.perf_counter() - began)


@pytest.mark.parametrize("encoded", [True, False], ids=["gzip", "plain"])
async def test_a_dense_body_never_holds_the_event_loop(
    tmp_path: Path, start_proxy: StartProxy, encoded: bool
) -> None:
    """32 MiB of dense JSON, gzip (31 KiB sent) or plain: the scan works in slices and lets
    the loop run every millisecond; `json.loads` held it for a second."""
    proxy = await start_proxy(make_config(tmp_path))
    size = 32 * MIB - 1024
    data = dense_gzip(size) if encoded else io.BytesIO(dense_json(size))
    headers = GZIP if encoded else JSON
    ticks = [0.0]
    stop = asyncio.Event()
    ticker = asyncio.create_task(largest_gap(ticks, stop))
    try:
        async with proxy.http.post(
            proxy.url + "/v1/chat/completions", data=data, headers=headers
        ) as r:
            assert r.status == 404, await r.text()
    finally:
        stop.set()
        await ticker
    assert ticks[0] < 0.25, f"the event loop was held for {ticks[0] * 1000:.0f} ms"
    assert proxy.model("m1").instances == []


async def test_a_body_that_is_not_an_object_is_refused_at_once(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """``[{},{},...]`` is refused as soon as the scan starts: the rest is not read for it."""
    proxy = await start_proxy(make_config(tmp_path))
    raw = b"[" + b"{}," * (10 * MIB) + b"{}]"
    async with proxy.http.post(
        proxy.url + "/v1/chat/completions", data=gzip.compress(raw, 6), headers=GZIP
    ) as r:
        assert r.status == 400
        assert "must be a JSON object" in (await r.json())["error"]["message"]


async def test_an_inflated_body_past_max_body_mb_is_a_413(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(make_config(tmp_path, server={"max_body_mb": 2}))
    async with proxy.http.post(
        proxy.url + "/v1/chat/completions", data=dense_gzip(4 * MIB), headers=GZIP
    ) as r:
        assert r.status == 413
        assert "max_body_mb" in (await r.json())["error"]["message"]
    assert proxy.server.runtime.proxy.bodies.held == 0


def chat_body(model: str, size: int) -> bytes:
    """A chat request of about `size` bytes (one long message)."""
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": ""}]}
    pad = size - len(json.dumps(body))
    body["messages"][0]["content"] = "x" * max(pad, 0)
    return json.dumps(body).encode()


def held(proxy: RunningProxy) -> int:
    return proxy.server.runtime.proxy.bodies.held


def assert_bodies_full(status: int, headers: Any, body: dict[str, Any]) -> None:
    assert status == 503
    assert headers["Retry-After"]
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "request_bodies_full"
    assert "server.max_bodies_mb" in err["message"]


async def test_bodies_waiting_for_a_model_are_capped_by_max_bodies_mb(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Two requests of 450 KB wait for their model to start (their bodies held); a third
    would pass 1 MiB of bodies: 503 + Retry-After at once. Once they are served, every byte is
    given back and the third goes through."""
    models = {"m1": {"model": "x", "env": FakeEngine(startup_delay=1.5).env()}}
    server = {"max_bodies_mb": 1, "max_body_mb": 1}
    proxy = await start_proxy(make_config(tmp_path, models, server=server))
    body = chat_body("m1", 450_000)
    url = proxy.url + "/v1/chat/completions"

    async def send() -> int:
        async with proxy.http.post(url, data=body, headers=JSON) as r:
            await r.read()
            return r.status

    waiting = [asyncio.create_task(send()) for _ in range(2)]
    await wait_for(lambda: held(proxy) == 2 * len(body), what="two bodies held")
    async with proxy.http.post(url, data=body, headers=JSON) as r:
        assert_bodies_full(r.status, r.headers, await r.json())
    assert await asyncio.gather(*waiting) == [200, 200]
    assert held(proxy) == 0
    assert await send() == 200
    assert held(proxy) == 0


async def test_slow_uploads_are_capped_and_given_back_when_the_client_goes(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Bodies still arriving count, as their bytes arrive (whether a length was announced or
    the body is chunked): 503 as soon as the next piece would pass. A client that goes away
    mid-body gives its bytes back."""
    proxy = await start_proxy(make_config(tmp_path, server={"max_bodies_mb": 1, "max_body_mb": 1}))
    body = chat_body("m1", 600_000)
    _, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    sent = len(body) - 1000
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body[:sent]
    )
    await writer.drain()
    await wait_for(lambda: held(proxy) == sent, what="the slow upload held")

    async def pieces() -> Any:  # chunked: no length announced
        for i in range(0, len(body), 64 * 1024):
            yield body[i : i + 64 * 1024]

    async with proxy.http.post(
        proxy.url + "/v1/chat/completions", data=pieces(), headers=JSON
    ) as r:
        assert_bodies_full(r.status, r.headers, await r.json())
    assert held(proxy) == sent, "the refused one gave its pieces back"
    writer.close()  # the slow client goes away
    await wait_for(lambda: held(proxy) == 0, what="its bytes given back")
    async with proxy.http.post(
        proxy.url + "/v1/chat/completions", data=pieces(), headers=JSON
    ) as r:
        assert r.status == 200, await r.text()
    assert held(proxy) == 0


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",  # a browser page's fetch() or form: no CORS preflight
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",  # curl -d without -H
        "multipart/form-data; boundary=x",
        "application/octet-stream",  # a raw body from aiohttp or requests
        None,  # no Content-Type (vLLM refuses it too)
    ],
)
async def test_non_json_bodies_get_415_and_start_no_engine(
    tmp_path: Path, start_proxy: StartProxy, content_type: str | None
) -> None:
    proxy = await start_proxy(make_config(tmp_path))
    body = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}]})
    headers = {} if content_type is None else {"Content-Type": content_type}
    for path in ("/v1/chat/completions", "/serve/m1/v1/chat/completions", "/v1/embeddings"):
        async with proxy.http.post(
            proxy.url + path,
            data=body.encode(),
            headers=headers,
            skip_auto_headers=["Content-Type"],
        ) as r:
            assert r.status == 415, await r.text()
            err = (await r.json())["error"]
            assert err["code"] == "unsupported_media_type"
            assert err["type"] == "invalid_request_error"
            assert (content_type or "no Content-Type") in err["message"]
            assert "application/json" in err["message"]
    assert proxy.model("m1").instances == [], "no engine started"


async def test_json_with_parameters_or_in_capitals_is_taken(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(make_config(tmp_path))
    body = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}]})
    for content_type in ("application/json; charset=utf-8", "Application/JSON"):
        async with proxy.http.post(
            proxy.url + "/v1/chat/completions",
            data=body.encode(),
            headers={"Content-Type": content_type},
        ) as r:
            assert r.status == 200, await r.text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_a_burst_of_large_bodies_leaves_at_most_128_mib_of_free_heap() -> None:
    """Sixteen bodies of 30 MiB held at once, as their pieces, and something allocated after
    them (the heap's top stays in use, so glibc's own trim gives nothing back): once they are
    given back through the bodies' accounting, the process is at most `TRIM_THRESHOLD` above
    where it started (it stayed 480 MiB up). Run in a fresh interpreter, as the proxy runs."""
    code = (
        "import sys, psutil\n"
        "from vllm_proxy.frontend.bytes import heap\n"
        "from vllm_proxy.frontend.bytes.intake import Bodies\n"
        "if not heap.tune(): sys.exit(3)\n"
        "rss = lambda: psutil.Process().memory_info().rss\n"
        "bodies = Bodies(1 << 30, heap.give_back())\n"
        "piece = b'x' * (256 * 1024 + 1)\n"
        "base = rss()\n"
        "held = []\n"
        "for _ in range(16):\n"
        "    hold = bodies.hold()\n"
        "    hold.take(30 << 20)\n"
        "    held.append((hold, [piece[1:] for _ in range(120)]))  # malloc'd, as pieces\n"
        "pin = bytes(4 << 20)  # larger than any free chunk: from the top of the heap\n"
        "for hold, parts in held:\n"
        "    parts.clear()\n"
        "    hold.release()\n"
        "print(rss() - base)\n"
    )
    kept = heap_probe(code)
    assert kept <= 128 * MIB, f"{kept / MIB:.0f} MiB still resident after the burst"


async def test_bodies_announced_but_not_sent_do_not_fill_max_bodies_mb(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Sixteen connections announced 32 MiB each and sent one byte: the budget (512 MiB) was
    charged what they announced, and every other client got 503 ``request_bodies_full`` until
    ``body_timeout_s``. Bytes are counted as they arrive: a 60-byte request from someone else
    is answered 200 while the sixteen hold their connections open. The proxy runs as a
    process of its own, the attackers are raw sockets."""
    proxy, port = one_model_process(tmp_path, start_proxy)
    writers: list[asyncio.StreamWriter] = []
    async with aiohttp.ClientSession() as http:
        await proxy.listening(http)
        try:
            for _ in range(16):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n{" % (32 * MIB)
                )
                await writer.drain()
                writers.append(writer)
            small = b'{"model":"m1","messages":[{"role":"user","content":"hi"}]}'
            assert len(small) < 64
            for _ in range(3):
                async with http.post(
                    proxy.url + "/v1/chat/completions", data=small, headers=JSON
                ) as r:
                    assert r.status == 200, await r.text()
            assert all(not w.is_closing() for w in writers), "the sixteen still hold on"
        finally:
            for writer in writers:
                writer.close()
