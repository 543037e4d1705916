"""The request path's HTTP/1.1 client to engines: keep-alive connections to each engine's Unix
socket or loopback port.

Engines are local processes that speak plain HTTP/1.1 (uvicorn), so the proxy does not need a
general-purpose client on its hottest path. This one writes the request head and body in one
`write` (a form upload, a `BodySource`, goes after the head as it arrives), parses the
response with httptools (the C parser uvicorn uses) and hands body chunks over as they
arrive, pausing the socket when the client reads slower than the engine writes.
A stream is relayed from the socket's read callback itself (`UpstreamResponse.relay` makes a
`ClientRelay` the engine transport's protocol): what each read carries is written to the
client's transport at once, with no task switch, no timer and one Python call per event.
A response that is not read to its end closes its connection: for vLLM that aborts the request.
`aiohttp` still serves everything else (health polling, engine metrics).
"""

from __future__ import annotations

import abc
import asyncio
import collections
import errno
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterable

import httptools

from ..pool.lease import Progress
from .bytes.body import Body, Pieces

log = logging.getLogger(__name__)

#: Idle keep-alive connections older than this are closed (uvicorn closes them after 5 s).
IDLE_TIMEOUT_S = 4.0
MAX_IDLE_PER_ENGINE = 256
#: Addresses remembered (their ``Host`` line, their idle connections); every instance of an
#: engine on a socket has an address of its own, so past this many the unused ones go.
MAX_ADDRESSES = 4096
#: A Unix socket's listen queue that is full answers a connect at once (EAGAIN): tried again
#: after this, within the connect timeout.
FULL_QUEUE_RETRY_S = 0.005
#: Socket reads pause while this much body is buffered, and resume below the low mark.
HIGH_WATER, LOW_WATER = 256 * 1024, 64 * 1024
#: At most this many buffers go in the first send on a new connection (the system's limit
#: on one call is 1024); the transport sends the rest.
EARLY_PARTS = 256
#: A relay's silence timer looks this many times per read timeout (see `_wait_silence`).
SILENCE_LOOKS = 4
#: Bounds on an engine's response head (its count of fields, and bytes in all of them).
MAX_HEADERS, MAX_HEADER_BYTES = 128, 64 * 1024


class UpstreamError(Exception):
    """The connection to the engine failed, or broke before the response was complete."""


class BodySource(abc.ABC):
    """A request body passed on while it is still arriving (a form upload, see `bytes.upload`):
    written to the engine by `write_to` after the request head, through a `BodySink`."""

    #: The body's length; None: it is sent chunked.
    length: int | None = None

    @abc.abstractmethod
    async def write_to(self, sink: BodySink) -> None:
        """Write the whole body to `sink`; what this raises ends the request (the engine then
        has an incomplete body, and the connection is closed)."""


class EngineAnswered(Exception):
    """The engine answered (or closed the connection) before it had the whole body."""


class BodySink:
    """Where a `BodySource` writes: the engine connection, framed as HTTP/1.1 chunks when the
    length is unknown. `drain` waits while the connection's buffer is full, at most `timeout`
    (`TimeoutError`: the engine takes nothing)."""

    __slots__ = ("_conn", "_resp", "chunked", "timeout")

    def __init__(self, conn: _Conn, resp: UpstreamResponse, chunked: bool, timeout: float) -> None:
        self._conn, self._resp = conn, resp
        self.chunked = chunked
        self.timeout = timeout

    def write(self, data: bytes) -> None:
        conn, resp = self._conn, self._resp
        if conn.closed or resp.status or resp._done or conn.transport is None:
            raise EngineAnswered
        if not data:
            return
        if self.chunked:
            conn.transport.writelines((b"%x\r\n" % len(data), data, b"\r\n"))
        else:
            conn.transport.write(data)

    async def drain(self) -> None:
        conn = self._conn
        while conn.writing_paused and not conn.closed:
            assert conn.loop is not None
            conn.drained = waiter = conn.loop.create_future()
            try:
                async with asyncio.timeout(self.timeout):
                    await waiter
            finally:
                conn.drained = None

    def finish(self) -> None:
        if self.chunked:
            self.write(b"")
            assert self._conn.transport is not None
            self._conn.transport.write(b"0\r\n\r\n")


class Tail:
    """What follows the last occurrence of `marker` in bytes that come in pieces: from the piece
    holding it on, growing with the pieces after it, up to `MAX` bytes. The proxy's token counts
    come from a response's final ``"usage":`` object this way. A marker cut in two by a piece
    boundary is not seen (a relayed stream's last writes are fed joined, see `ClientRelay`)."""

    __slots__ = ("marker", "seen", "text")

    #: `text` stops growing past this many bytes.
    MAX = 8192

    def __init__(self, marker: bytes) -> None:
        self.marker = marker
        self.text = b""
        self.seen = False

    def feed(self, data: bytes) -> None:
        i = data.rfind(self.marker)
        if i >= 0:
            self.text = data[i + len(self.marker) : i + len(self.marker) + self.MAX]
            self.seen = True
        elif self.seen and len(self.text) < self.MAX:
            self.text += data


class ClientRelay(asyncio.Protocol):
    """Writes a relayed body to a client's transport, framed as an HTTP/1.1 chunk (`chunked`)
    or raw (an HTTP/1.0 client, a body the client's response frames itself).

    While a response is relayed (`UpstreamResponse.relay`), the relay is the engine
    transport's protocol: its `data_received` feeds the response's parser and writes what the
    read carried of the body to the client at once, one Python call per read (the parser
    appends body pieces to a list itself). `send` writes one piece the same way (what arrived
    before the relay started; a standalone relay).

    It tells its response when the client is backed up or gone (the response stops reading
    the engine), and keeps its own bookkeeping for the caller to read afterwards: the bytes
    passed on (`bytes`), when the first went (`first_at`, `time.monotonic()`) and the last
    `RECENT` writes (`recent`): a stream's closing ``"usage":`` object is found there once, at
    the end, not searched for in every event.

    A client that has gone is noticed by aiohttp, which cancels the handler (and with it the
    relay) when the client's connection is lost, or before that by the write that fails:
    uvloop's transport raises once it is closed (and drops the writes between the close and
    then). Nothing else is asked of the client's transport per event but its buffer size.
    """

    __slots__ = ("buffered", "bytes", "chunked", "conn", "feed", "first_at", "high", "last",
                 "pieces", "prev", "prev2", "prev3", "resp", "transport", "write")  # fmt: skip

    #: Writes kept at the end of a relayed body: a closing event, even cut in two, and the
    #: ``data: [DONE]`` after it.
    RECENT = 4

    def __init__(
        self, transport: asyncio.Transport, chunked: bool, resp: UpstreamResponse | None = None
    ) -> None:
        self.transport = transport
        # The transport's own methods, bound once: the hot path calls them per event.
        self.write = transport.write
        self.buffered = transport.get_write_buffer_size
        self.chunked = chunked
        self.resp = resp
        # The engine side: the connection, its parser's feed and the list it appends to.
        self.conn: _Conn | None = None
        self.feed: Callable[[bytes], None] | None = None
        self.pieces: list[bytes] = []
        if resp is not None:
            self.conn = conn = resp._conn
            self.pieces = conn.pieces
            if conn.parser is not None:
                self.feed = conn.parser.feed_data
        # The transport pauses its protocol (a writer then waits in drain()) past this many
        # buffered bytes; the relay stops reading the engine at the same mark.
        self.high = transport.get_write_buffer_limits()[1]
        self.bytes = 0
        self.first_at: float | None = None
        # The last writes, newest first: slots of this object, which the hot path touches
        # anyway, rather than a deque of its own.
        self.last = self.prev = self.prev2 = self.prev3 = b""

    @property
    def recent(self) -> list[bytes]:
        """The last `RECENT` writes, oldest first."""
        return [w for w in (self.prev3, self.prev2, self.prev, self.last) if w]

    # -- the engine transport's protocol while relaying -----------------------------------

    def data_received(self, data: bytes) -> None:
        progress = self.conn.progress  # type: ignore[union-attr]
        if progress is not None:
            progress.seen += len(data)
        try:
            self.feed(data)  # type: ignore[misc]
        except (httptools.HttpParserError, UpstreamError) as err:
            assert self.conn is not None
            self.conn._refuse(err)
            return
        pieces = self.pieces
        if not pieces:
            return
        body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        # `send`, written out: this is the hot path, once per event.
        try:
            self.write(b"%x\r\n%b\r\n" % (len(body), body) if self.chunked else body)
        except Exception as err:  # the client's failure, not the engine's
            self._failed(err)
            return
        self.bytes += len(body)
        self.prev3, self.prev2, self.prev, self.last = self.prev2, self.prev, self.last, body
        if self.first_at is None:
            self.first_at = time.monotonic()
        if self.buffered() > self.high:
            self.resp._backed_up()  # type: ignore[union-attr]

    def eof_received(self) -> bool:
        assert self.conn is not None
        return self.conn.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        assert self.conn is not None
        self.conn.connection_lost(exc)

    # -- one piece ------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        try:
            self.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
        except Exception as err:  # the client's failure, not the engine's
            self._failed(err)
            return
        self.bytes += len(data)
        self.prev3, self.prev2, self.prev, self.last = self.prev2, self.prev, self.last, data
        if self.first_at is None:
            self.first_at = time.monotonic()
        if self.buffered() > self.high and self.resp is not None:
            self.resp._backed_up()

    def _failed(self, err: Exception) -> None:
        if self.transport.is_closing():  # a closed transport refuses writes: the client left
            err = ConnectionResetError("the client closed the connection")
        if self.resp is not None:
            self.resp._relay_failed(err)


class UpstreamResponse:
    """Status, headers and the body as a stream of chunks (`read_chunk`) or relayed to a sink
    (`relay`); `release()` when done."""

    __slots__ = (
        "_backed", "_buffered", "_chunks", "_conn", "_done", "_error", "_head_bytes", "_loop",
        "_paused", "_pieces", "_pool", "_progress", "_relay_error", "_slot", "_timer", "_waiter",
        "headers", "keep_alive", "sink", "status", "until_close",
    )  # fmt: skip

    def __init__(self, conn: _Conn, pool: UpstreamPool, slot: asyncio.Semaphore) -> None:
        self._conn, self._pool, self._slot = conn, pool, slot
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        #: No Content-Length and not chunked: the body ends when the engine closes.
        self.until_close = False
        self._head_bytes = 0
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._done = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._pieces: list[bytes] = []  # parsed from the current socket read, not yet handed
        #: Where a stream's body went (`relay`), for its bookkeeping.
        self.sink: ClientRelay | None = None
        # While relaying: whether the client is backed up, and what its side raised.
        self._backed = False
        self._relay_error: BaseException | None = None
        self._loop = pool.loop  # the pool's: asyncio.get_running_loop() is a getpid() call
        self._timer: asyncio.TimerHandle | None = None
        self._progress: Progress | None = None

    def waiting_on_client(self) -> bool:
        """Whether reading the engine is paused because the client takes nothing."""
        return self._paused or self._backed

    # -- fed by the protocol --------------------------------------------------------------

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _keep(self, data: bytes) -> None:
        """Not relaying: the body that one socket read carried goes to the buffer that
        `read_chunk` takes from; the socket pauses past `HIGH_WATER`."""
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._paused and self._conn.transport:
            self._conn.transport.pause_reading()
            self._paused = True
        self._wake()

    def _relay_failed(self, err: BaseException) -> None:
        self._relay_error = err
        self._unrelay()  # the rest is kept, not written
        self._backed_up()

    def _backed_up(self) -> None:
        """The client is backed up (or gone): stop reading the engine; `relay` drains."""
        if self._backed:
            return
        self._backed = True
        if self._conn.transport is not None:
            self._conn.transport.pause_reading()
        self._wake()

    def _finish(self, error: Exception | None = None) -> None:
        if not self._done:
            self._done = True
            self._error = error
        self._wake()

    # -- read by the proxy ----------------------------------------------------------------

    async def _wait(self, timeout: float) -> None:
        loop = self._loop
        assert loop is not None
        self._waiter = fut = loop.create_future()
        handle = loop.call_later(timeout, _expire, fut)
        try:
            await fut
        finally:
            handle.cancel()
            self._waiter = None

    async def wait_headers(self, timeout: float) -> None:
        while not self.status:
            if self._done:
                raise self._error or UpstreamError("engine closed the connection")
            await self._wait(timeout)

    async def read_chunk(self, timeout: float) -> bytes:
        """The next piece of the body as received; b"" at its end. `TimeoutError` when silent."""
        while not self._chunks:
            if self._done:
                if self._error is not None:
                    raise self._error
                return b""
            await self._wait(timeout)
        data = self._chunks.popleft()
        self._buffered -= len(data)
        if self._paused and self._buffered < LOW_WATER and self._conn.transport:
            self._conn.transport.resume_reading()
            self._paused = False
        return data

    async def relay(
        self,
        transport: asyncio.Transport,
        chunked: bool,
        drain: Callable[[], Awaitable[None]],
        timeout: float,
    ) -> ClientRelay:
        """Pass the rest of the body to a client's `transport`, piece by piece as the socket
        delivers it, through a `ClientRelay` (`sink`, also returned; its bookkeeping stays
        readable when this raises).

        The relay is the engine transport's protocol meanwhile: its read callback writes
        what each socket read carried of the body (chunk framing removed) to the client at
        once, in the same callback (see `ClientRelay`): an event that arrived
        split goes on split, events that arrived together go on together, the bytes always
        the engine's, in order. When the client's buffer is past its mark the socket stops
        being read until `drain()` returns. What the client's side or `drain` raise ends the
        relay and is raised here; so are `TimeoutError` once the engine has sent nothing for
        `timeout` seconds (at most 1.25 `timeout`, see `_wait_silence`) and `UpstreamError`
        if the engine's response breaks. Returns at the end of the body.
        """
        loop = self._loop
        assert loop is not None
        conn = self._conn
        self.sink = sink = ClientRelay(transport, chunked, self)
        conn.deliver = sink.send  # (what a broken response parsed before its error)
        if self._chunks:  # what arrived before the relay started goes first, in one write
            sink.send(b"".join(self._chunks))
            self._chunks.clear()
            self._buffered = 0
        try:
            engine = conn.transport
            if engine is not None:
                if self._relay_error is None and not self._done and not conn.closed:
                    engine.set_protocol(sink)  # its reads go to the relay until the end
                if self._paused:
                    self._paused = False
                    engine.resume_reading()
            while True:
                if self._relay_error is not None:
                    raise self._relay_error
                if self._backed:
                    await drain()
                    self._backed = False
                    conn = self._conn
                    if conn.transport is not None and not conn.closed and not self._done:
                        conn.transport.resume_reading()
                    continue
                if self._done:
                    if self._error is not None:
                        raise self._error
                    return sink
                await self._wait_silence(loop, timeout, sink)
        finally:
            self._unrelay()

    def _unrelay(self) -> None:
        """The connection reads for itself again, and keeps what it reads (anything after an
        early end of the relay is kept, not written)."""
        conn = self._conn
        conn.deliver = self._keep
        if conn.transport is not None and conn.transport.get_protocol() is not conn:
            conn.transport.set_protocol(conn)

    async def _wait_silence(
        self, loop: asyncio.AbstractEventLoop, timeout: float, sink: ClientRelay
    ) -> None:
        """Until woken (the end, an error, a backed-up sink); `TimeoutError` once the engine
        has sent nothing for `timeout`. Nothing is timed per piece: a timer looks at the
        sink's byte count every quarter of `timeout`, and four looks in a row that find it
        unchanged are the silence."""
        self._waiter = fut = loop.create_future()
        self._timer = loop.call_later(
            timeout / SILENCE_LOOKS, self._silence, fut, timeout, sink, sink.bytes, 0
        )
        try:
            await fut
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._waiter = None

    def _silence(
        self, fut: asyncio.Future[None], timeout: float, sink: ClientRelay, seen: int, quiet: int
    ) -> None:
        if fut.done():
            return
        assert self._loop is not None
        now = sink.bytes
        quiet = quiet + 1 if now == seen else 0
        if quiet >= SILENCE_LOOKS:
            self._timer = None
            fut.set_exception(TimeoutError())
        else:
            self._timer = self._loop.call_later(
                timeout / SILENCE_LOOKS, self._silence, fut, timeout, sink, now, quiet
            )

    def complete(self) -> bool:
        """The whole body has arrived (and is buffered here), without error."""
        return self._done and self._error is None

    def take_rest(self) -> bytes:
        """Everything still buffered (after `complete()`: the rest of the body), at once."""
        rest = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        return rest

    @property
    def content_length(self) -> int | None:
        for k, v in self.headers:
            if k.lower() == b"content-length":
                try:
                    return int(v)
                except ValueError:
                    return None
        return None

    async def read_all(self, timeout: float) -> bytes:
        parts = []
        while chunk := await self.read_chunk(timeout):
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Return the connection for reuse if the response was read to its end, else close it."""
        if self.sink is not None:
            self.sink.resp = None  # (a reference cycle otherwise)
        if self._progress is not None:
            self._progress.end(self)
            self._progress = self._conn.progress = None
        self._pool._release(self._conn, slot=self._slot, reusable=self._done and self._error is None
                            and not self._chunks and self.keep_alive)  # fmt: skip


def _unasked(data: bytes) -> None:
    raise AssertionError("a body piece with no response")


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class _Conn(asyncio.Protocol):
    """One keep-alive connection; parser callbacks feed the current response."""

    __slots__ = ("address", "closed", "deliver", "drained", "idle_since", "loop", "on_body",
                 "parser", "pieces", "progress", "refused", "resp", "transport",
                 "writing_paused")  # fmt: skip

    def __init__(self, address: int | str) -> None:
        #: The engine's loopback port, or the path of its Unix socket.
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.resp: UpstreamResponse | None = None
        self.parser: httptools.HttpResponseParser | None = None
        #: httptools' body callback, the list it appends to, and where what one read carried
        #: goes (the response's buffer, or a `ClientRelay`); set per response (`start`).
        self.on_body: Callable[[bytes], None] | None = None
        self.pieces: list[bytes] = []
        self.deliver: Callable[[bytes], None] = _unasked
        #: Why a parser callback refused the response.
        self.refused: str | None = None
        #: The transport's buffer is full (`pause_writing`); a `BodySink` waits on `drained`.
        self.writing_paused = False
        self.drained: asyncio.Future[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        #: The engine's byte count while a request's response is read (the stall watchdog).
        self.progress: Progress | None = None

    def start(self, resp: UpstreamResponse) -> None:
        self.resp = resp
        self.writing_paused = False  # (a pooled connection has nothing left to send)
        self.pieces = resp._pieces
        self.deliver = resp._keep
        # httptools takes its callbacks from the protocol when the parser is made: body
        # pieces go straight onto the list (no Python call per piece).
        self.on_body = resp._pieces.append
        self.parser = httptools.HttpResponseParser(self)

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        self._wake_writer()

    def _wake_writer(self) -> None:
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.progress is not None:
            self.progress.seen += len(data)
        parser = self.parser
        if parser is None:  # bytes nobody asked for: unusable
            self.close()
            return
        try:
            parser.feed_data(data)
        except (httptools.HttpParserError, UpstreamError) as err:
            self._refuse(err)
            return
        # What this read carried goes on in one piece, to the response's buffer (a relayed
        # stream is read by the `ClientRelay`, the transport's protocol meanwhile; `deliver`
        # points at its `send` only for what a broken response parsed before its error).
        pieces = self.pieces
        if pieces:
            body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            pieces.clear()
            self.deliver(body)

    def _refuse(self, err: Exception) -> None:
        """The response broke: what was parsed before the error still goes on, then the
        response ends with the error and the connection closes."""
        if self.pieces:
            self.deliver(b"".join(self.pieces))
            self.pieces.clear()
        why = self.refused or str(err)  # a callback's own reason, not the wrapper
        assert self.resp is not None
        self.resp._finish(UpstreamError(f"bad HTTP response from the engine: {why}"))
        self.close()

    def eof_received(self) -> bool:
        self._lost("engine closed the connection")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(
            f"connection to the engine lost: {exc}" if exc else "engine closed the connection"
        )

    def _lost(self, why: str) -> None:
        self.closed = True
        self._wake_writer()
        resp = self.resp
        if resp is not None and not resp._done:
            if resp.status and resp.until_close:  # a close-delimited body ends here
                resp.keep_alive = False
                resp._finish()
            else:
                resp._finish(UpstreamError(why))

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        # A response is one message: anything after its end (an engine that wrote more than
        # it was asked) is not read as part of it, and the connection is not used again.
        if self.resp._done:  # type: ignore[union-attr]
            self.refused = "bytes after the end of the response"
            raise UpstreamError(self.refused)

    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self.resp
        assert resp is not None
        if resp.status:  # trailers after a chunked body: parsed, not forwarded
            return
        resp._head_bytes += len(name) + len(value)
        if len(resp.headers) >= MAX_HEADERS or resp._head_bytes > MAX_HEADER_BYTES:
            self.refused = "response head too large"
            raise UpstreamError(self.refused)
        resp.headers.append((name, value))

    def on_headers_complete(self) -> None:
        resp, parser = self.resp, self.parser
        assert resp is not None and parser is not None
        status = parser.get_status_code()
        if status == 101:
            self.refused = "the engine switched protocols (101), which the proxy refuses"
            raise UpstreamError(self.refused)
        if status < 200:
            if status < 100:
                self.refused = f"status {status}, outside 100-599"
                raise UpstreamError(self.refused)
            resp.headers.clear()  # 100 Continue, 103 Early Hints: not the final response
            resp._head_bytes = 0
            return
        if status > 599:
            self.refused = f"status {status}, outside 100-599"
            raise UpstreamError(self.refused)
        resp.status = status
        resp.keep_alive = parser.should_keep_alive()
        names = {k.lower() for k, _ in resp.headers}
        resp.until_close = (
            b"content-length" not in names
            and b"transfer-encoding" not in names
            and status not in (204, 304)
        )
        resp._wake()

    def on_message_complete(self) -> None:
        assert self.resp is not None
        if self.resp.status:  # not the end of an interim (1xx) response
            self.resp._finish()


class NoSlot(UpstreamError):
    """Every connection of the share was busy for the whole wait."""


class UpstreamPool:
    """Keep-alive connections to engines, each reached at its address: the path of its Unix
    socket (a str) or its port on 127.0.0.1 (an int). At most `limit` in use at once, split in
    equal shares between the models (`set_shares`), so that one slow model cannot take every
    connection; a request waits for a slot of its share at most `slot_wait_s`."""

    def __init__(self, limit: int, connect_timeout_s: float = 10.0, slot_wait_s: float = 30.0):
        self._idle: dict[int | str, collections.deque[_Conn]] = {}
        #: The ``Host`` line of the requests to each address, made once.
        self._hosts: dict[int | str, str] = {}
        self.limit = limit
        self.connect_timeout_s = connect_timeout_s
        self.slot_wait_s = slot_wait_s
        self._shares: dict[str, asyncio.Semaphore] = {}
        self.share_size = limit
        #: The loop its connections live on (taken at the first request).
        self.loop: asyncio.AbstractEventLoop | None = None

    def set_shares(self, names: Iterable[str]) -> None:
        """One share per model: ``limit // len(names)`` connections each (at least one).
        Requests in flight keep the share they hold until they finish."""
        names = list(names)
        self.share_size = max(1, self.limit // max(1, len(names)))
        self._shares = {n: asyncio.Semaphore(self.share_size) for n in names}

    def _share(self, name: str) -> asyncio.Semaphore:
        share = self._shares.get(name)
        if share is None:
            share = self._shares[name] = asyncio.Semaphore(self.share_size)
        return share

    async def _take(self, name: str) -> asyncio.Semaphore:
        share = self._share(name)
        if not share.locked():
            await share.acquire()  # free: no timer on the common path
            return share
        try:
            await asyncio.wait_for(share.acquire(), self.slot_wait_s)
        except TimeoutError:
            raise NoSlot(
                f"all {self.share_size} connections to model '{name}' stayed busy for "
                f"{self.slot_wait_s:g}s"
            ) from None
        return share

    async def take_slot(self, name: str) -> asyncio.Semaphore:
        """A connection of `name`'s share for a caller that opens its own (a realtime
        session): ``release()`` it in ``finally``. `NoSlot` as for a request."""
        return await self._take(name)

    async def request(
        self,
        address: int | str,
        method: str,
        path: str,
        headers: Iterable[tuple[str, str]],
        body: Body | BodySource,
        timeout: float,
        share: str = "",
        progress: Progress | None = None,
    ) -> UpstreamResponse:
        """Send a request and wait for the response head; `release()` the response after use.

        A request is written once: a pooled connection is used only while it is open, and a
        connection that breaks after the request went out is an error, never a resend (the
        engine may have started the generation). A `BodySource` is written after the head, as
        it comes; an engine that answers before it has all of it ends the writing, and the
        connection is not used again. `progress` counts the engine's bytes for this request
        until its release (the stall watchdog).
        """
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        host = self._hosts.get(address) or self._host(address)
        source: BodySource | None = None
        if isinstance(body, BodySource):
            source = body
            parts: tuple[bytes | bytearray, ...] = (
                _head(method, path, host, headers, source.length),
            )
        elif isinstance(body, Pieces):  # a large body as it arrived: one writev, no join
            parts = (_head(method, path, host, headers, len(body)), *body.parts)
        else:
            head = _head(method, path, host, headers, len(body))
            parts = (head, body) if body else (head,)
        slot = await self._take(share)
        resp: UpstreamResponse | None = None
        try:
            pooled = self._pooled(address)
            conn = pooled or _Conn(address)
            conn.loop = self.loop
            resp = UpstreamResponse(conn, self, slot)
            conn.start(resp)  # before a new socket is read: the answer may come at once
            if progress is not None:
                resp._progress = conn.progress = progress
                progress.begin(resp)
            if pooled is None:
                await self._open(conn, parts)
            else:
                assert conn.transport is not None
                conn.transport.writelines(parts)
            try:
                whole = source is None or await _send(conn, resp, source, timeout)
                await resp.wait_headers(timeout)
                if not whole:
                    resp.keep_alive = False
                return resp
            except BaseException:
                conn.close()
                raise
        except BaseException:
            slot.release()
            if progress is not None and resp is not None:
                progress.end(resp)
                resp._progress = resp._conn.progress = None
            raise

    def _host(self, address: int | str) -> str:
        """The ``Host`` line for an address not seen before (once per engine)."""
        if len(self._hosts) >= MAX_ADDRESSES:
            self._hosts.clear()
            self._idle = {a: idle for a, idle in self._idle.items() if idle}
        host = self._hosts[address] = (
            "Host: localhost" if isinstance(address, str) else f"Host: 127.0.0.1:{address}"
        )
        return host

    def _pooled(self, address: int | str) -> _Conn | None:
        """An open pooled connection to `address`, if there is one."""
        idle = self._idle.get(address)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            transport = conn.transport
            if (
                not conn.closed
                and transport is not None
                and not transport.is_closing()
                and now - conn.idle_since < IDLE_TIMEOUT_S
            ):
                return conn
            conn.close()
        return None

    async def _open(self, conn: _Conn, parts: tuple[bytes | bytearray, ...]) -> None:
        """Connect `conn` to its engine and send it `parts`.

        The request goes out from the socket before the event loop has a transport for it:
        on loopback the handshake is done when ``connect`` returns, so the engine has the
        request (or as much of it as the socket takes; the transport sends the rest) at once,
        not after the loop iterations that making a transport takes (two, each as long as
        the loop's work for every other stream: a new stream waited tens of ms for them
        with 2,000 streams open)."""
        loop = self.loop
        assert loop is not None
        address = conn.address
        # A Unix socket's path, or the loopback port.
        target = address if isinstance(address, str) else ("127.0.0.1", address)
        unix = isinstance(target, str)
        try:
            sock = socket.socket(socket.AF_UNIX if unix else socket.AF_INET, socket.SOCK_STREAM)
        except OSError as err:
            raise self._connect_error(address, err) from None
        try:
            sock.setblocking(False)
            # asyncio.timeout, not wait_for: on 3.11 wait_for runs its awaitable in a task of
            # its own, two more loop iterations before a new stream's request can go out.
            async with asyncio.timeout(self.connect_timeout_s):
                if unix:
                    code = sock.connect_ex(target)
                    while code == errno.EAGAIN:  # the engine's listen queue is full
                        await asyncio.sleep(FULL_QUEUE_RETRY_S)
                        code = sock.connect_ex(target)
                else:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    code = sock.connect_ex(target)
                    if code == errno.EINPROGRESS:
                        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                        if code == 0 and not _connected(sock):  # not done yet: the loop waits
                            await loop.sock_connect(sock, target)
                if code:
                    raise OSError(code, os.strerror(code))
                try:
                    sent = sock.sendmsg(parts[:EARLY_PARTS])
                except (BlockingIOError, InterruptedError):
                    sent = 0
                if unix:
                    await loop.create_unix_connection(lambda: conn, sock=sock)
                else:
                    await loop.create_connection(lambda: conn, sock=sock)
        except BaseException as err:
            sock.close()
            if isinstance(err, OSError):
                raise self._connect_error(address, err) from None
            raise
        rest = _after(parts, sent)
        if rest:
            assert conn.transport is not None
            conn.transport.writelines(rest)

    @staticmethod
    def _connect_error(address: int | str, err: OSError) -> Exception:
        if err.errno in (errno.EMFILE, errno.ENFILE):  # ours to answer, not the engine's fault
            log.error("out of file descriptors: cannot open a connection to an engine")
            return NoSlot("the proxy is out of file descriptors")
        where = f"socket {address}" if isinstance(address, str) else f"port {address}"
        return UpstreamError(f"cannot connect to the engine on {where}: {err}")

    def _release(self, conn: _Conn, reusable: bool, slot: asyncio.Semaphore) -> None:
        slot.release()
        conn.resp = conn.parser = None
        conn.deliver = _unasked
        if not reusable or conn.closed:
            conn.close()
            return
        idle = self._idle.setdefault(conn.address, collections.deque())
        if len(idle) >= MAX_IDLE_PER_ENGINE:
            conn.close()
            return
        transport = conn.transport
        if transport is not None and not transport.is_reading():
            # The read that ended the body also paused the socket (a backed-up or departed
            # client, a buffer past HIGH_WATER): the next response on it must be read.
            transport.resume_reading()
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


async def _send(conn: _Conn, resp: UpstreamResponse, source: BodySource, timeout: float) -> bool:
    """Write `source` to the engine; False when the engine answered before it had it all."""
    sink = BodySink(conn, resp, source.length is None, timeout)
    try:
        await source.write_to(sink)
        sink.finish()
    except EngineAnswered:
        return False
    return True


def _connected(sock: socket.socket) -> bool:
    try:
        sock.getpeername()
    except OSError:
        return False
    return True


def _after(parts: tuple[bytes | bytearray, ...], sent: int) -> list[bytes | bytearray | memoryview]:
    """What is left of `parts` once their first `sent` bytes have gone."""
    rest: list[bytes | bytearray | memoryview] = []
    for part in parts:
        if sent >= len(part):
            sent -= len(part)
        else:
            rest.append(memoryview(part)[sent:] if sent else part)
            sent = 0
    return rest


def _head(
    method: str, path: str, host: str, headers: Iterable[tuple[str, str]], length: int | None
) -> bytes:
    framing = "Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}"
    lines = [f"{method} {path} HTTP/1.1", host, framing]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")
