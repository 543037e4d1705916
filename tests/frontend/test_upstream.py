"""Unit tests for the request path's upstream client, against a small aiohttp server."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from kit import RawEngine, free_port, wait_for

from vllm_proxy.frontend.bytes.body import Pieces
from vllm_proxy.frontend.serving import Tap
from vllm_proxy.frontend.upstream import (
    HIGH_WATER,
    ClientRelay,
    NoSlot,
    Tail,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    _after,
)


class Upstream:
    def __init__(self) -> None:
        self.port = free_port()
        self.cancelled = asyncio.Event()
        self.finished = asyncio.Event()
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
        self.finished.set()
        return resp

    async def halves(self, request: web.Request) -> web.StreamResponse:
        """Each event in two writes, a pause between them: the proxy sees it in two pieces."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(b'data: {"n": %d, ' % i)
            await asyncio.sleep(0.05)
            await resp.write(b'"pad": "%s"}\n\n' % (b"x" * i))
        await resp.write_eof()
        return resp

    async def big(self, request: web.Request) -> web.Response:
        return web.Response(body=bytes(range(256)) * 8192)  # 2 MiB


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    app = web.Application(client_max_size=64 * 1024 * 1024)  # the large-body test
    app.router.add_post("/echo", up.echo)
    app.router.add_post("/stream", up.stream)
    app.router.add_post("/big", up.big)
    app.router.add_post("/halves", up.halves)
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


async def test_a_body_larger_than_the_socket_takes_at_once_arrives_whole(
    upstream: Upstream,
) -> None:
    """A new connection sends the request from its socket before the loop has a transport
    for it; what the socket does not take then (here most of 24 MB, in pieces) the transport
    sends after. On a pooled connection it all goes through the transport."""
    parts = [bytes([i]) * (256 * 1024 + i) for i in range(96)]
    body = Pieces(parts)
    pool = UpstreamPool(limit=8)
    for _ in range(2):  # new, then pooled
        resp = await pool.request(upstream.port, "POST", "/echo", [], body, 30)
        assert resp.status == 200
        assert await resp.read_all(30) == b"".join(parts)
        resp.release()
    assert len(set(upstream.peers)) == 1


def test_what_is_left_after_a_partial_send() -> None:
    parts = (b"head", b"", b"0123456789", b"xyz")
    assert [bytes(p) for p in _after(parts, 0)] == [b"head", b"0123456789", b"xyz"]
    assert [bytes(p) for p in _after(parts, 6)] == [b"23456789", b"xyz"]
    assert [bytes(p) for p in _after(parts, 14)] == [b"xyz"]
    assert _after(parts, 17) == []


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


# -- relay: pieces written to a client transport from the read callback ----------------------


class Client:
    """A client's transport as `ClientRelay` uses it: what is written, a buffer size to report,
    and whether it is closing (then, as uvloop's closed transport does, it refuses writes)."""

    def __init__(self, backed_after: int | None = None) -> None:
        self.pieces: list[bytes] = []
        self.backed_after = backed_after  # report a full buffer after this many writes
        self.closing = False
        self.last_write = 0.0

    def write(self, data: bytes) -> None:
        if self.closing:
            raise RuntimeError("unable to perform operation; the handler is closed")
        self.pieces.append(data)
        self.last_write = time.monotonic()

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (16 * 1024, 64 * 1024)

    def get_write_buffer_size(self) -> int:
        if self.backed_after is not None and len(self.pieces) >= self.backed_after:
            return 1024 * 1024
        return 0


async def relay(
    resp: UpstreamResponse,
    client: Client,
    drain: Callable[[], Awaitable[None]],
    timeout: float,
    chunked: bool = False,
) -> ClientRelay:
    return await resp.relay(client, chunked, drain, timeout)  # type: ignore[arg-type]


async def no_drain() -> None:
    raise AssertionError("the relay never asked for a drain")


async def relayed(pool: UpstreamPool, port: int, path: str, timeout: float = 5) -> Client:
    """A request to `path`, its response relayed whole to a client that is never backed up."""
    resp = await pool.request(port, "POST", path, [], b"", 5)
    client = Client()
    try:
        await relay(resp, client, no_drain, timeout)
    finally:
        resp.release()
    return client


async def test_relay_hands_every_piece_over_as_it_arrives(upstream: Upstream) -> None:
    pool = UpstreamPool(limit=8)
    pieces = (await relayed(pool, upstream.port, "/halves")).pieces
    # What arrives is handed on at once: the first half of an event goes before the engine
    # has sent the rest; the bytes are the engine's, in order.
    assert pieces[0] == b'data: {"n": 0, ' and len(pieces) >= 4
    assert b"".join(pieces) == b"".join(
        b'data: {"n": %d, "pad": "%s"}\n\n' % (i, b"x" * i) for i in range(3)
    )
    assert pool._idle[upstream.port], "read to its end: the connection is kept"
    pool.close()


async def test_relay_frames_chunks_and_notes_bytes_first_write_and_tail(
    upstream: Upstream,
) -> None:
    pool = UpstreamPool(limit=8)
    resp = await pool.request(upstream.port, "POST", "/stream?n=3", [], b"", 5)
    client = Client()
    sink = await relay(resp, client, no_drain, 5, chunked=True)
    resp.release()
    events = [b"data: %d\n\n" % i for i in range(3)]
    assert client.pieces == [b"%x\r\n%b\r\n" % (len(e), e) for e in events]
    assert sink is resp.sink and sink.bytes == sum(map(len, events))
    assert sink.first_at is not None
    assert list(sink.recent) == events
    pool.close()


async def test_the_relay_reads_the_engine_socket_while_it_runs_then_hands_it_back(
    upstream: Upstream,
) -> None:
    """While relaying, the relay is the engine transport's protocol (one read callback per
    event); at the end the connection reads for itself again, and serves the next request."""
    pool = UpstreamPool(limit=8)
    resp = await pool.request(upstream.port, "POST", "/stream?n=4&delay=0.05", [], b"", 5)
    conn = resp._conn
    assert conn.transport is not None and conn.transport.get_protocol() is conn
    client = Client()
    relaying = asyncio.ensure_future(relay(resp, client, no_drain, 5))
    await wait_for(lambda: len(client.pieces) >= 1, what="an event relayed")
    assert conn.transport.get_protocol() is resp.sink
    await asyncio.wait_for(relaying, 5)
    assert conn.transport.get_protocol() is conn
    resp.release()
    assert b"".join(client.pieces) == b"".join(b"data: %d\n\n" % i for i in range(4))
    again = await pool.request(upstream.port, "POST", "/stream?n=2", [], b"", 5)
    assert again._conn is conn, "the pooled connection is reused"
    assert await again.read_all(5) == b"data: 0\n\ndata: 1\n\n"
    again.release()
    pool.close()


async def test_a_close_delimited_body_is_relayed_to_the_engine_close() -> None:
    """The engine's close reaches the connection through the relay: the body ends there."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + b"x" * 300_000
    async with RawEngine(answer) as engine:
        pool = UpstreamPool(limit=4)
        resp = await pool.request(engine.port, "POST", "/x", [], b"{}", 5)
        client = Client()
        sink = await relay(resp, client, no_drain, 5)
        resp.release()
        assert b"".join(client.pieces) == b"x" * 300_000 and sink.bytes == 300_000
        assert not pool._idle.get(engine.port), "a close-delimited connection is not reused"
        pool.close()


def usage_of(*writes: bytes) -> tuple[int, int] | None:
    """The token counts a request's log and metrics take from a stream relayed as `writes`."""
    sink = ClientRelay(Client(), chunked=False)  # type: ignore[arg-type]
    for data in writes:
        sink.send(data)
    tap = Tap()
    tap.relayed(sink)
    return tap.tokens()


def test_the_usage_of_a_relayed_stream_comes_from_its_last_writes() -> None:
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}\n\n'
    done = b"data: [DONE]\n\n"
    events = [b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'] * 50
    assert usage_of(*events, usage, done) == (3, 4)
    assert usage_of(*events, usage[:20], usage[20:], done) == (3, 4), "marker cut in two"
    assert usage_of(*events, usage[:29], usage[29:], done) == (3, 4), "marker ends a write"
    continuous = [b'data: {"usage":{"prompt_tokens":3,"completion_tokens":%d}}\n\n' % i
                  for i in range(1, 9)]  # fmt: skip
    assert usage_of(*continuous, done) == (3, 8), "the last usage counts"
    assert usage_of(*events, done) is None
    # Only the last writes are kept, and what follows the marker is bounded.
    sink = ClientRelay(Client(), chunked=False)  # type: ignore[arg-type]
    for i in range(100):
        sink.send(b"%d" % i)
    assert list(sink.recent) == [b"%d" % i for i in range(100 - ClientRelay.RECENT, 100)]
    assert usage_of(b'"usage":' + b"x" * 3 * Tail.MAX) is None
    tap = Tap()
    tap.feed(b'"usage":' + b"x" * 3 * Tail.MAX)
    assert len(tap.usage.text) == Tail.MAX


async def test_relay_stops_reading_while_the_client_is_backed_up(upstream: Upstream) -> None:
    pool = UpstreamPool(limit=8)
    resp = await pool.request(upstream.port, "POST", "/stream?n=4&delay=0.02", [], b"", 5)
    client = Client(backed_after=1)
    drained = asyncio.Event()
    drains = 0

    async def drain() -> None:
        nonlocal drains
        drains += 1
        await drained.wait()
        client.backed_after = None

    relaying = asyncio.ensure_future(relay(resp, client, drain, 5))
    await wait_for(upstream.finished.is_set, what="the engine wrote every event")
    await wait_for(lambda: drains == 1, what="a drain asked for")
    assert client.pieces == [b"data: 0\n\n"], "nothing read while the client was backed up"
    drained.set()
    await asyncio.wait_for(relaying, 5)
    resp.release()
    assert b"".join(client.pieces) == b"".join(b"data: %d\n\n" % i for i in range(4))
    pool.close()


async def test_relay_times_out_on_silence_not_on_length(upstream: Upstream) -> None:
    pool = UpstreamPool(limit=8)
    # 8 events 0.1 s apart: the whole stream takes longer than the timeout, no gap does.
    client = await relayed(pool, upstream.port, "/stream?n=8&delay=0.1", 0.5)
    assert len(client.pieces) == 8
    resp = await pool.request(upstream.port, "POST", "/stream?n=2&delay=5", [], b"", 5)
    client = Client()
    with pytest.raises(TimeoutError):
        await relay(resp, client, no_drain, 0.3)
    silent = time.monotonic() - client.last_write
    assert client.pieces == [b"data: 0\n\n"]
    assert silent >= 0.3 - 0.01, "silence is noticed after the timeout, not before"
    resp.release()
    pool.close()


async def test_a_gone_client_ends_the_relay_and_the_request(upstream: Upstream) -> None:
    pool = UpstreamPool(limit=8)
    resp = await pool.request(upstream.port, "POST", "/stream?n=1000&delay=0.02", [], b"", 5)
    client = Client()
    relaying = asyncio.ensure_future(relay(resp, client, no_drain, 5))
    await wait_for(lambda: len(client.pieces) >= 2, what="two events relayed")
    client.closing = True
    with pytest.raises(ConnectionResetError, match="client closed"):
        await asyncio.wait_for(relaying, 5)
    resp.release()  # not read to its end: the engine connection closes, the engine aborts
    await wait_for(upstream.cancelled.is_set, what="upstream handler cancelled")
    pool.close()


class Failing(Client):
    """A client transport whose writes fail after the first two."""

    def write(self, data: bytes) -> None:
        if len(self.pieces) >= 2:
            raise RuntimeError("the transport is broken")
        super().write(data)


async def test_a_failing_client_write_ends_the_relay_not_the_engine_connection_reader(
    upstream: Upstream,
) -> None:
    """A write to the client that raises is the client's failure: it ends the relay with that
    error (the engine connection's read callback does not raise), and the unfinished engine
    request is aborted."""
    pool = UpstreamPool(limit=8)
    resp = await pool.request(upstream.port, "POST", "/stream?n=1000&delay=0.02", [], b"", 5)
    client = Failing()
    with pytest.raises(RuntimeError, match="broken"):
        await asyncio.wait_for(relay(resp, client, no_drain, 5), 5)
    assert len(client.pieces) == 2
    resp.release()
    await wait_for(upstream.cancelled.is_set, what="upstream handler cancelled")
    pool.close()


async def test_a_connection_paused_by_its_last_read_is_pooled_reading(upstream: Upstream) -> None:
    """The read that ends a body may also pause the socket (a backed-up client, a buffer past
    the high-water mark): the connection goes back to the pool reading again, or the next
    response on it would never be read."""
    pool = UpstreamPool(limit=8)
    resp = await pool.request(upstream.port, "POST", "/echo", [], b"one", 5)
    assert await resp.read_all(5) == b"one"
    conn = resp._conn
    assert conn.transport is not None
    conn.transport.pause_reading()
    resp.release()
    assert conn.transport.is_reading()
    resp = await pool.request(upstream.port, "POST", "/echo", [], b"two", 2)
    assert resp._conn is conn, "the pooled connection was used"
    assert await resp.read_all(2) == b"two"
    resp.release()
    pool.close()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


@contextlib.asynccontextmanager
async def engine_server(handler: Handler) -> AsyncIterator[int]:
    """A loopback server running `handler` per connection (a peer's hang-up ends it quietly);
    yields its port, and closes the server and every connection it accepted."""
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await handler(reader, writer)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        await server.wait_closed()


async def test_a_stream_whose_last_read_backs_the_client_up_leaves_a_usable_connection() -> None:
    relaying = asyncio.Event()  # set by the test as it hands the response to the relay

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(STREAM_HEAD)
            await writer.drain()
            await relaying.wait()  # the relay has started: the rest comes in one read
            relaying.clear()
            writer.write(b"9\r\ndata: 0\n\n\r\n0\r\n\r\n")
            await writer.drain()

    pool = UpstreamPool(limit=8)
    async with engine_server(answer) as port:
        try:
            resp = await pool.request(port, "POST", "/v1/chat/completions", [], b"", 5)
            conn = resp._conn
            client = Client(backed_after=1)  # the event's write leaves the client backed up

            async def drain() -> None:
                client.backed_after = None

            relaying.set()
            await relay(resp, client, drain, 5)
            resp.release()
            assert client.pieces == [b"data: 0\n\n"]
            resp = await pool.request(port, "POST", "/v1/chat/completions", [], b"", 2)
            assert resp._conn is conn
            client = Client()
            relaying.set()
            await relay(resp, client, no_drain, 2)
            resp.release()
            assert client.pieces == [b"data: 0\n\n"]
        finally:
            pool.close()


async def test_bad_framing_mid_stream_relays_what_came_before_it_then_fails() -> None:
    """The events parsed from a read before its broken chunk reach the client first; then the
    relay ends with the engine's error and the connection is not reused."""
    relaying = asyncio.Event()  # set by the test as it hands the response to the relay

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(STREAM_HEAD)
        await writer.drain()
        await relaying.wait()  # the relay has started
        writer.write(b"9\r\ndata: 0\n\n\r\nZZ\r\nnot a chunk\r\n")
        await writer.drain()
        await reader.read()  # until the proxy closes

    pool = UpstreamPool(limit=8)
    async with engine_server(answer) as port:
        try:
            resp = await pool.request(port, "POST", "/v1/chat/completions", [], b"", 5)
            client = Client()
            relaying.set()
            with pytest.raises(UpstreamError, match="bad HTTP response"):
                await relay(resp, client, no_drain, 5)
            resp.release()
            assert client.pieces == [b"data: 0\n\n"]
            assert not pool._idle.get(port), "a connection with a broken response is not reused"
        finally:
            pool.close()


async def test_refused_connection_is_an_upstream_error() -> None:
    pool = UpstreamPool(limit=8)
    with pytest.raises(UpstreamError, match="cannot connect"):
        await pool.request(free_port(), "POST", "/", [], b"", 5)
    # the slot was given back: the pool is not exhausted by failures
    for _ in range(10):
        with pytest.raises(UpstreamError):
            await asyncio.wait_for(pool.request(free_port(), "POST", "/", [], b"", 5), 5)


async def test_slow_reader_pauses_the_engine_socket_and_gets_every_byte(
    upstream: Upstream,
) -> None:
    pool = UpstreamPool(limit=8)
    resp = await pool.request(upstream.port, "POST", "/big", [], b"", 5)
    # Nobody reads: the engine's 2 MiB pile up to the high-water mark, then the socket pauses.
    await wait_for(lambda: resp._paused, what="socket paused above the high-water mark")
    assert HIGH_WATER < resp._buffered < 2 * 1024 * 1024
    received = bytearray()
    while chunk := await resp.read_chunk(5):
        received += chunk
    assert not resp._paused, "resumed once the reader caught up"
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
    assert pool._share("").locked() and not second.done()
    await first.read_all(5)
    first.release()
    resp = await asyncio.wait_for(second, 5)
    assert await resp.read_all(5) == b"2"
    resp.release()
    pool.close()


async def test_one_model_cannot_take_every_connection(upstream: Upstream) -> None:
    """Two models share 2 connections: one each. A slow model's second request waits (bounded)
    while the other model's request goes through."""
    pool = UpstreamPool(limit=2, slot_wait_s=0.3)
    pool.set_shares(["slow", "other"])
    held = await pool.request(upstream.port, "POST", "/stream?n=50&delay=0.1", [], b"", 5, "slow")
    other = await pool.request(upstream.port, "POST", "/echo", [], b"o", 5, "other")
    assert await other.read_all(5) == b"o"  # not starved by the slow model
    other.release()
    with pytest.raises(NoSlot, match="all 1 connections to model 'slow'"):
        await pool.request(upstream.port, "POST", "/echo", [], b"s", 5, "slow")
    held.release()
    resp = await pool.request(upstream.port, "POST", "/echo", [], b"s", 5, "slow")
    assert await resp.read_all(5) == b"s"
    resp.release()
    pool.close()


# -- conformance against a raw-socket engine ---------------------------------------------------


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def body_of(port: int, pool: UpstreamPool) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    resp = await pool.request(port, "POST", "/x", [], b"{}", 5)
    body = await resp.read_all(5)
    resp.release()
    return resp.status, resp.headers, body


@pytest.mark.parametrize(
    "interim",
    [
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n",
    ],
)
async def test_interim_responses_are_skipped(interim: bytes) -> None:
    async with RawEngine(interim + OK) as engine:
        pool = UpstreamPool(limit=4)
        status, headers, body = await body_of(engine.port, pool)
        assert (status, body) == (200, b"ok")
        assert all(k.lower() != b"link" for k, _ in headers), "the interim head is not kept"
        pool.close()


async def test_switching_protocols_is_refused() -> None:
    answer = (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    )
    async with RawEngine(answer) as engine:
        pool = UpstreamPool(limit=4)
        with pytest.raises(UpstreamError, match="101"):
            await pool.request(engine.port, "POST", "/x", [], b"{}", 5)
        pool.close()


async def test_close_delimited_body_is_relayed_to_its_end() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n" + b"x" * 100_000
    async with RawEngine(answer) as engine:
        pool = UpstreamPool(limit=4)
        status, _, body = await body_of(engine.port, pool)
        assert status == 200 and body == b"x" * 100_000
        assert not pool._idle.get(engine.port), "a close-delimited connection is not reused"
        pool.close()


async def test_chunk_extensions_and_trailers_parse() -> None:
    answer = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Sum\r\n\r\n"
        b"5;name=value\r\nhello\r\n6\r\n world\r\n0\r\nX-Sum: 11\r\n\r\n"
    )
    async with RawEngine(answer, OK) as engine:
        pool = UpstreamPool(limit=4)
        status, headers, body = await body_of(engine.port, pool)
        assert (status, body) == (200, b"hello world")
        assert all(k.lower() != b"x-sum" for k, _ in headers), "trailers are not forwarded"
        assert (await body_of(engine.port, pool))[2] == b"ok"  # the connection stays usable
        assert engine.requests == 2
        pool.close()


async def test_a_huge_response_head_is_an_error() -> None:
    fields = b"".join(b"X-F%d: %s\r\n" % (i, b"v" * 900) for i in range(100))
    async with RawEngine(b"HTTP/1.1 200 OK\r\n" + fields + b"Content-Length: 0\r\n\r\n") as e:
        pool = UpstreamPool(limit=4)
        with pytest.raises(UpstreamError, match="too large"):
            await pool.request(e.port, "POST", "/x", [], b"{}", 5)
        pool.close()


async def test_a_request_that_went_out_is_never_sent_again() -> None:
    """The engine reads the second request on a kept-alive connection and closes without an
    answer: that is an error for the client, never a resend (the generation may have begun)."""
    async with RawEngine(OK, None, OK) as engine:  # a resend would get the last answer
        pool = UpstreamPool(limit=4)
        assert (await body_of(engine.port, pool))[2] == b"ok"
        with pytest.raises(UpstreamError):
            await pool.request(engine.port, "POST", "/x", [], b"{}", 5)
        pool.close()
        await engine.idle()  # every connection the engine accepted, handled to its end
        assert (engine.requests, engine.connections, engine.answers) == (2, 1, [OK])


@pytest.mark.parametrize(
    "extra",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nEVIL!",  # a whole second response
        b"HTTP/1.1 200 OK\r\nX-Part",  # the start of one
        b"EXTRA",  # not HTTP at all
    ],
)
async def test_bytes_after_a_complete_response_end_it_and_close_the_connection(
    extra: bytes,
) -> None:
    """The response ends where its framing says; what the engine wrote after it is never part
    of it (nor of the next response), and the connection is not used again."""
    async with RawEngine(OK + extra, OK) as engine:
        pool = UpstreamPool(limit=4)
        status, _, body = await body_of(engine.port, pool)
        assert (status, body) == (200, b"ok")
        assert not pool._idle.get(engine.port), "the connection is closed, not pooled"
        assert (await body_of(engine.port, pool))[2] == b"ok"
        assert (engine.requests, engine.connections) == (2, 2)
        pool.close()


async def test_a_line_break_after_a_response_keeps_the_connection() -> None:
    """Empty lines between messages are allowed (RFC 9112 2.2): not bytes after the end."""
    async with RawEngine(OK + b"\r\n", OK) as engine:
        pool = UpstreamPool(limit=4)
        assert (await body_of(engine.port, pool))[2] == b"ok"
        assert (await body_of(engine.port, pool))[2] == b"ok"
        assert engine.connections == 1
        pool.close()


@pytest.mark.parametrize("status", [b"000", b"099", b"600", b"999"])
async def test_a_status_outside_100_to_599_is_refused(status: bytes) -> None:
    async with RawEngine(b"HTTP/1.1 %s X\r\nContent-Length: 2\r\n\r\nok" % status) as e:
        pool = UpstreamPool(limit=4)
        with pytest.raises(UpstreamError, match="outside 100-599"):
            await pool.request(e.port, "POST", "/x", [], b"{}", 5)
        assert not pool._idle.get(e.port)
        pool.close()
