"""Reading a request body from the client, whole, before it goes to an engine.

It is bounded by ``max_body_mb`` (413: before reading when the client announced a longer plain
body, else as soon as more has come, decoded), its type must be JSON (`check_type`: 415
before anything is read), and it is bounded by ``body_timeout_s`` unless it came with the
request head (408) and by ``max_bodies_mb`` for all requests together (`Bodies`: 503 +
``Retry-After``). A body is counted in `Bodies` as its bytes arrive, never by the length its
head announces: a client that announces 32 MiB and sends one byte holds one byte of the
budget, not 32 MiB of every other client's.

A small plain body whose length is known is read by aiohttp's ``read()``. A large one is kept as
the pieces aiohttp hands over (`body.Pieces`), with no copy into one buffer, and each piece is
scanned for ``model`` as it comes (`body.Scan`): when the last piece is in, the model is known
and the pieces go on: no piece is copied into one buffer, and the scan does not walk the body
again after its end. A body of unknown length (chunked) or compressed (``Content-Encoding``:
aiohttp inflates it as it is read, 64 KiB at a time) is read piece by piece too (a piece being
all that has arrived, not one HTTP chunk: a body sent a byte per chunk would hold a Python
object per byte), counted against both limits as it inflates, and scanned once it is
`PIECES_FROM` long: a small gzip body of dense JSON inflates to tens of MiB, which `json.loads`
would turn into a heap many times that size while the event loop stands still. The scan works in
slices of at most `FEED_BYTES` and lets the loop run whenever it has worked `YIELD_AFTER_S`; a
body it refuses is answered at once, without reading the rest.

The body is read whole before anything goes to an engine: the model is often its last key (the
OpenAI SDK sends ``messages`` first), and a body that turns out invalid must start nothing.
Passing a large body on while it arrives, when its model comes first, was measured too and was
slower, not faster (client, proxy and engine then compete for the cores), so it is not done.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from aiohttp import web

from ...errors import BadRequest, PayloadTooLarge, RequestTimeout, Unavailable
from . import heap
from .body import SCAN_MIN_BYTES, Body, Pieces, Scan, needs_scan

#: Bodies announced at least this long are kept as their pieces and scanned as they arrive.
PIECES_FROM = SCAN_MIN_BYTES
#: A scan is fed at most this much at a time ...
FEED_BYTES = 16 * 1024
#: ... and lets the event loop run once it has worked this long since it last did.
YIELD_AFTER_S = 0.001
MIB = 1024 * 1024

#: The media type of a JSON body, as vLLM checks it (`is_json`).
JSON = "application/json"


def is_json(media: str) -> bool:
    """Whether a media type (lower case, no parameters) is what vLLM takes on the routes that
    read a JSON body: ``application/json`` exactly (its ``validate_json_request``)."""
    return media == JSON


def is_form(media: str) -> bool:
    """Whether a media type is what vLLM's speech-to-text routes take: a form upload (FastAPI
    reads ``Form()`` fields from ``application/x-www-form-urlencoded`` too, but a file cannot
    come that way)."""
    return media == "multipart/form-data"


def check_type(
    request: web.Request, accepts: Callable[[str], bool] = is_json, takes: str = JSON
) -> None:
    """Refuse (415) a body whose ``Content-Type`` the route does not take, before it is read.

    The proxy takes what the engine takes, so that a request the engine would refuse starts
    nothing: on every JSON route vLLM answers anything but ``application/json`` (parameters
    such as ``charset`` aside, the type in any case) with a 400 "Unsupported Media Type", a
    body without a ``Content-Type`` included. The OpenAI SDKs, ``curl --json`` and
    ``requests.post(url, json=...)`` send ``application/json``. Refused: ``curl -d`` without
    ``-H 'Content-Type: application/json'`` (it sends ``application/x-www-form-urlencoded``),
    a raw ``requests``/aiohttp body (none, or ``application/octet-stream``), and the types a
    browser page may POST to any address without a CORS preflight (``text/plain``, forms,
    ``multipart/form-data``, none), so a page cannot start engines or generations here.

    `accepts`: the route's test of a media type, `takes` its name for the message. The routes
    whose body is a form upload (vLLM's ``/v1/audio/transcriptions``) pass `is_form`, and read
    their ``model`` from the form (`upload`) rather than with `read_body`."""
    value = request.headers.get("Content-Type")
    if value == JSON and accepts is is_json:
        return
    if value is None:
        raise BadRequest(
            f"the request body has no Content-Type: POST {request.path} takes {takes}",
            status=415,
            code="unsupported_media_type",
        )
    if not accepts(value.partition(";")[0].strip().lower()):
        raise BadRequest(
            f"unsupported Content-Type {value[:100]!r}: POST {request.path} takes {takes}",
            status=415,
            code="unsupported_media_type",
        )


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"request body too large: the limit is {limit / MIB:g} MB (server.max_body_mb)"
    )


class Bodies:
    """The bytes of request bodies held at once by all requests (``server.max_bodies_mb``):
    while they are read, wait for a model and are sent. Each request takes its share through a
    `Hold` and gives it back in ``finally``; a request whose body would pass the limit gets
    503 + ``Retry-After``. Once the bytes held have fallen more than `keep` below their high
    mark, a burst of large bodies has ended: `give_back` (`heap.give_back`) returns the heap
    they left free to the kernel.

    A compressed body counts what it inflates to, and inflation makes a few KiB on the wire
    into tens of MiB held: the inflated bytes of one client's compressed bodies (its API key,
    else its address) may take at most half of the limit (`share`) once it holds one, so one
    client cannot take the budget from the others. A large body is given back as soon as it
    has been written to the engine (`Hold.handed_over`), not when the answer ends.

    The same count bounds other bytes held for clients, named by `key`, `what` and `code`:
    uploads spooled to disk (``server.max_spool_mb``)."""

    __slots__ = ("by_client", "code", "give_back", "held", "high", "keep", "key", "limit",
                 "what")  # fmt: skip

    def __init__(
        self,
        limit: int,
        give_back: Callable[[], None] | None = None,
        keep: int = heap.TRIM_THRESHOLD,
        *,
        key: str = "server.max_bodies_mb",
        what: str = "request bodies",
        code: str = "request_bodies_full",
    ) -> None:
        self.limit = limit
        self.held = 0
        self.high = 0  # the most held since the heap was last given back
        self.give_back = give_back
        self.keep = keep
        self.key = key
        self.what = what
        self.code = code
        #: Inflated bytes of compressed bodies held, per client.
        self.by_client: dict[str, int] = {}

    @property
    def share(self) -> int:
        """What one client's compressed bodies may hold beyond their first."""
        return self.limit // 2

    def hold(self, client: str = "") -> Hold:
        return Hold(self, client)


class Hold:
    """One request's share of `Bodies`."""

    __slots__ = ("bodies", "client", "inflated", "size")

    def __init__(self, bodies: Bodies, client: str = "") -> None:
        self.bodies = bodies
        self.size = 0
        #: Who sent it (an API key's id, else the client's address) ...
        self.client = client
        #: ... and the bytes of it counted in that client's share (a compressed body's).
        self.inflated = 0

    def take(self, n: int, compressed: bool = False) -> None:
        """Count `n` more bytes of this request's body (`compressed`: inflated bytes, also
        counted in the client's share); `Unavailable` past the limit or the share."""
        bodies = self.bodies
        if compressed:
            mine = bodies.by_client.get(self.client, 0)
            if mine > self.inflated and mine + n > bodies.share:  # (its first body may grow)
                raise Unavailable(
                    f"compressed bodies of this client inflate to {mine / MIB:.0f} MiB held "
                    f"and this one would pass its share of {bodies.share / MIB:g} MiB (half of "
                    f"{bodies.key}); retry later",
                    code=bodies.code,
                )
        held = bodies.held + n
        if held > bodies.limit:
            raise Unavailable(
                f"the proxy holds {bodies.held / MIB:.0f} MiB of {bodies.what} and this one "
                f"would pass its limit of {bodies.limit / MIB:g} MiB ({bodies.key}); "
                "retry later",
                code=bodies.code,
            )
        bodies.held = held
        self.size += n
        if compressed:
            self.inflated += n
            bodies.by_client[self.client] = bodies.by_client.get(self.client, 0) + n
        if held > bodies.high:
            bodies.high = held

    def release(self) -> None:
        """Give this request's bytes back (idempotent)."""
        self.give(self.size)

    def handed_over(self, body: object) -> None:
        """`body` has been written to the engine: a large one (`Pieces`) drops its bytes now
        and gives them back, rather than when the answer ends (a stream may last minutes).
        A small one is kept: it is little, and its bytes may still be referenced."""
        if isinstance(body, Pieces):
            body.parts.clear()
            self.release()

    def give(self, n: int) -> None:
        """Give `n` of this request's bytes back (at most what it holds)."""
        n = min(n, self.size)
        self.size -= n
        bodies = self.bodies
        bodies.held -= n
        if self.inflated > self.size:  # the compressed bytes go back first
            back = self.inflated - self.size
            self.inflated -= back
            left = bodies.by_client.get(self.client, 0) - back
            if left > 0:
                bodies.by_client[self.client] = left
            else:
                bodies.by_client.pop(self.client, None)
        if bodies.high - bodies.held > bodies.keep:
            bodies.high = bodies.held
            if bodies.give_back is not None:
                bodies.give_back()


#: What `read_body` returns: the body, and its scan for ``model`` when it was scanned.
Received = tuple[Body, "Scan | None"]


async def read_body(request: web.Request, limit: int, timeout_s: float, hold: Hold) -> Received:
    """The body (decoded if it was compressed), and its scan when it was scanned; its bytes
    are counted in `hold`. Checked first: its announced length, then its type."""
    length = request.content_length
    if length is not None and length > limit and "Content-Encoding" not in request.headers:
        raise too_large(limit)
    check_type(request)
    if request.content.is_eof():  # the whole body came with the head: no timer
        body = await request.read()  # (aiohttp answers 413 past client_max_size)
        hold.take(len(body), "Content-Encoding" in request.headers)
        return body, (await scan_whole(body) if needs_scan(body) else None)
    try:
        async with asyncio.timeout(timeout_s):
            return await _read(request, limit, hold)
    except TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {timeout_s:g}s (server.body_timeout_s)"
        ) from None


async def _read(request: web.Request, limit: int, hold: Hold) -> Received:
    length = request.content_length
    if length is None or "Content-Encoding" in request.headers:  # else the length is the body's
        return await _read_counted(request, limit, hold)
    content = request.content
    if length < PIECES_FROM:  # the usual small request: read whole, counted as it arrives
        small: list[bytes] = []
        while data := await content.readany():
            hold.take(len(data))
            small.append(data)
        body = small[0] if len(small) == 1 else b"".join(small)
        return body, (await scan_whole(body) if needs_scan(body) else None)
    content.set_read_chunk_size(limit)  # no pause/resume of the socket every 64 KiB
    parts: list[bytes] = []
    scan = Scan(length)
    feed = Feed(scan)
    while True:
        data, end_of_http_chunk = await content.readchunk()  # a piece as held, no join
        if not data:
            if end_of_http_chunk:  # (b"", True): the end of an HTTP chunk, not of the body
                continue
            break
        hold.take(len(data))  # what has arrived, not what was announced
        parts.append(data)  # aiohttp stops at Content-Length
        await feed(data)
    await feed.flush()
    pieces = Pieces(parts)
    # aiohttp ends a short body with an error; a scan of one is only a safeguard
    return pieces, (scan if len(pieces) == length else None)


async def _read_counted(request: web.Request, limit: int, hold: Hold) -> Received:
    """A body of unknown length, or a compressed one (as it inflates): counted against the
    limits piece by piece, scanned from `PIECES_FROM` on."""
    content = request.content
    compressed = "Content-Encoding" in request.headers
    parts: list[bytes] = []
    size = 0
    feed: Feed | None = None
    while True:
        # Everything buffered at once, not one HTTP chunk at a time: a client sending a
        # byte per chunk would make a Python object (and a loop turn) of every byte.
        data = await content.readany()
        if not data:
            break
        size += len(data)
        if size > limit:
            raise too_large(limit)
        hold.take(len(data), compressed)
        parts.append(data)
        if feed is not None:
            await feed(data)
        elif size >= PIECES_FROM:
            feed = Feed(Scan())
            for part in parts:
                await feed(part)
    if feed is None:
        body = b"".join(parts)
        return body, (await scan_whole(body) if needs_scan(body) else None)
    return Pieces(parts), await feed.flush()


async def scan_whole(body: bytes) -> Scan:
    """The scan of a body that is all there (one that `needs_scan`): walked where it lies, in
    steps that double while they are quick (the inside of a long string is only searched)
    and halve when they are not, letting the loop run every `YIELD_AFTER_S`."""
    scan = Scan(len(body), body)
    size, at, step, busy = len(body), 0, FEED_BYTES, 0.0
    while at < size:
        at = min(at + step, size)
        began = time.perf_counter()
        scan.walk(at)
        spent = time.perf_counter() - began
        if scan.error is not None:
            raise scan.error
        if spent < YIELD_AFTER_S / 8:
            step = min(step * 2, 64 * FEED_BYTES)
        elif spent > YIELD_AFTER_S / 2:
            step = max(step // 2, FEED_BYTES)
        busy += spent
        if busy > YIELD_AFTER_S:
            await asyncio.sleep(0)
            busy = 0.0
    return scan


class Feed:
    """Feeds a scan the pieces of a body in slices of `FEED_BYTES` (the inside of a long string
    in one go: it is only searched; small pieces joined first, so a body that trickles in is
    not walked a few bytes at a time), letting the event loop run whenever the scan has worked
    `YIELD_AFTER_S` since it last did; raises the scan's error as soon as it refuses the
    body. `flush` once the body has ended."""

    __slots__ = ("busy", "pending", "scan", "waiting")

    def __init__(self, scan: Scan) -> None:
        self.scan = scan
        self.busy = 0.0
        self.pending: list[bytes] = []  # small pieces not fed yet ...
        self.waiting = 0  # ... and their bytes

    async def __call__(self, data: bytes) -> None:
        if self.pending or len(data) < FEED_BYTES:
            self.pending.append(data)
            self.waiting += len(data)
            if self.waiting < FEED_BYTES:
                return
            data = self._joined()
        await self._slices(data)

    async def flush(self) -> Scan:
        """Feed what is still pending (the body has ended); the scan."""
        if self.pending:
            await self._slices(self._joined())
        return self.scan

    def _joined(self) -> bytes:
        data = b"".join(self.pending)
        self.pending.clear()
        self.waiting = 0
        return data

    async def _slices(self, data: bytes) -> None:
        scan = self.scan
        at, size = 0, len(data)
        while at < size:
            if scan.skipping:
                at = scan.skip(data, at, size)
                continue
            began = time.perf_counter()
            scan.feed(data, at, at + FEED_BYTES)
            at += FEED_BYTES
            self.busy += time.perf_counter() - began
            if scan.error is not None:
                raise scan.error
            if self.busy > YIELD_AFTER_S:
                await asyncio.sleep(0)
                self.busy = 0.0
        if scan.error is not None:
            raise scan.error
