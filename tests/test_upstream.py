"""Unit tests for the request path's upstream client, against a small aiohttp server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from conftest import free_port, wait_for

from vllm_proxy.upstream import UpstreamError, UpstreamPool


class Upstream:
    def __init__(self) -> None:
        self.port = free_port()
        self.cancelled = asyncio.Event()
        self.peers: list[int] = []

    async def echo(self, request: web.Request) -> web.Response:
        self.peers.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        return web.Response(body=await request.read(), headers={"X-Seen": "1"})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(int(request.query.get("n", "3"))):
                await resp.write(f"data: {i}\n\n".encode())
                await asyncio.sleep(float(request.query.get("delay", "0.05")))
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        await resp.write_eof()
        return resp

    async def big(self, request: web.Request) -> web.Response:
        return web.Response(body=bytes(range(256)) * 8192)  # 2 MiB


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    app = web.Application()
    app.router.add_post("/echo", up.echo)
    app.router.add_post("/stream", up.stream)
    app.router.add_post("/big", up.big)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", up.port).start()
    try:
        yield up
    finally:
        await runner.cleanup()


async def test_keep_alive_connection_is_reused(upstream: Upstream) -> None:
    pool = UpstreamPool(limit=8)
    for body in (b"one", b"two", b"three"):
        resp = await pool.request(upstream.port, "POST", "/echo", [("X-A", "b")], body, 5)
        assert resp.status == 200
        assert (b"X-Seen", b"1") in resp.headers
        assert await resp.read_all(5) == body
        resp.release()
    assert len(set(upstream.peers)) == 1
    pool.close()


async def test_stream_chunks_arrive_as_sent(upstream: Upstream) -> None:
    pool = UpstreamPool(limit=8)
    resp = await pool.request(upstream.port, "POST", "/stream?n=3", [], b"", 5)
    chunks = []
    while chunk := await resp.read_chunk(5):
        chunks.append(chunk)
    resp.release()
    assert chunks == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    pool.close()


async def test_unread_response_closes_the_connection_and_aborts(upstream: Upstream) -> None:
    pool = UpstreamPool(limit=8)
    resp = await pool.request(upstream.port, "POST", "/stream?n=1000&delay=0.02", [], b"", 5)
    assert await resp.read_chunk(5) == b"data: 0\n\n"
    resp.release()  # the client went away mid-stream
    await wait_for(upstream.cancelled.is_set, what="upstream handler cancelled")
    pool.close()


async def test_silence_is_a_timeout(upstream: Upstream) -> None:
    pool = UpstreamPool(limit=8)
    resp = await pool.request(upstream.port, "POST", "/stream?n=2&delay=5", [], b"", 5)
    assert await resp.read_chunk(1) == b"data: 0\n\n"
    with pytest.raises(TimeoutError):
        await resp.read_chunk(0.2)
    resp.release()
    pool.close()


async def test_refused_connection_is_an_upstream_error() -> None:
    pool = UpstreamPool(limit=8)
    with pytest.raises(UpstreamError, match="cannot connect"):
        await pool.request(free_port(), "POST", "/", [], b"", 5)
    # the slot was given back: the pool is not exhausted by failures
    for _ in range(10):
        with pytest.raises(UpstreamError):
            await asyncio.wait_for(pool.request(free_port(), "POST", "/", [], b"", 5), 5)


async def test_slow_reader_gets_every_byte(upstream: Upstream) -> None:
    pool = UpstreamPool(limit=8)
    resp = await pool.request(upstream.port, "POST", "/big", [], b"", 5)
    received = bytearray()
    while chunk := await resp.read_chunk(5):
        received += chunk
        await asyncio.sleep(0)  # let the socket fill the buffer past its high-water mark
    resp.release()
    assert bytes(received) == bytes(range(256)) * 8192
    pool.close()


async def test_closed_idle_connection_is_not_reused(upstream: Upstream) -> None:
    pool = UpstreamPool(limit=8)
    resp = await pool.request(upstream.port, "POST", "/echo", [], b"x", 5)
    await resp.read_all(5)
    resp.release()
    (conn,) = pool._idle[upstream.port]
    assert conn.transport is not None
    conn.transport.close()  # as if the engine had closed it after its keep-alive timeout
    await wait_for(lambda: conn.closed, what="connection seen as closed")
    resp = await pool.request(upstream.port, "POST", "/echo", [], b"y", 5)
    assert await resp.read_all(5) == b"y"
    resp.release()
    assert len(set(upstream.peers)) == 2
    pool.close()


async def test_limit_bounds_connections_in_use(upstream: Upstream) -> None:
    pool = UpstreamPool(limit=1)
    first = await pool.request(upstream.port, "POST", "/echo", [], b"1", 5)
    second = asyncio.ensure_future(pool.request(upstream.port, "POST", "/echo", [], b"2", 5))
    for _ in range(20):  # let it run as far as it can: it must stop at the semaphore
        await asyncio.sleep(0)
    assert pool._slots.locked() and not second.done()
    await first.read_all(5)
    first.release()
    resp = await asyncio.wait_for(second, 5)
    assert await resp.read_all(5) == b"2"
    resp.release()
    pool.close()
