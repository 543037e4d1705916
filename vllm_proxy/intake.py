"""Reading a request body from the client, whole, before it goes to an engine.

Bounded by ``max_body_mb`` (413, before reading when the client announced a longer plain body)
and, unless it came with the request head, by ``body_timeout_s`` (408). A small body, or one
of unknown length, is read by aiohttp's ``read()``. A large one whose length is known is kept
as the pieces aiohttp hands over (`body.Pieces`), with no copy into one buffer, and each piece
is scanned for ``model`` as it comes (`body.Scan`): when the last piece is in, the model is
known and the pieces go on. Receiving 10 MB took 6.5-7.5 ms of the proxy's CPU when every
piece was copied into one buffer (zeroed first) and the scan walked it after its end.

The body is read whole before anything goes to an engine: the model is often its last key (the
OpenAI SDK sends ``messages`` first), and a body that turns out invalid must start nothing.
Passing a large body on while it arrives, when its model comes first, was measured too: on the
2-core benchmark machine it was about 1 ms slower at 3 and 10 MB (client, proxy and engine then
compete for the cores), so it is not done.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from .body import SCAN_MIN_BYTES, Body, Pieces, Scan
from .errors import PayloadTooLarge, RequestTimeout

#: Bodies announced at least this long are kept as their pieces and scanned as they arrive.
PIECES_FROM = SCAN_MIN_BYTES


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"request body too large: the limit is {limit / 1048576:g} MB (server.max_body_mb)"
    )


#: What `read_body` returns: the body, and its scan for ``model`` when it was scanned while
#: it arrived.
Received = tuple[Body, "Scan | None"]


async def read_body(request: web.Request, limit: int, timeout_s: float) -> Received:
    """The body (decoded if it was compressed), and its scan when it was scanned."""
    if request.content.is_eof():  # the whole body came with the head: no timer, nothing to scan
        return await request.read(), None  # (aiohttp answers 413 past client_max_size)
    try:
        async with asyncio.timeout(timeout_s):
            return await _read(request, limit)
    except TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {timeout_s:g}s (server.body_timeout_s)"
        ) from None


async def _read(request: web.Request, limit: int) -> Received:
    length = request.content_length
    plain = "Content-Encoding" not in request.headers  # else the length is not the body's
    if length is None or length < PIECES_FROM or not plain:
        # The usual small request, or one whose size is unknown: aiohttp's read() (which
        # answers 413 past client_max_size, that is max_body_mb).
        return await request.read(), None
    if length > limit:
        raise too_large(limit)
    content = request.content
    content.set_read_chunk_size(limit)  # no pause/resume of the socket every 64 KiB
    parts: list[bytes] = []
    scan = Scan(length)
    while True:
        data, end_of_http_chunk = await content.readchunk()  # a piece as held, no join
        if not data:
            if end_of_http_chunk:  # (b"", True): the end of an HTTP chunk, not of the body
                continue
            break
        parts.append(data)  # aiohttp stops at Content-Length
        scan.feed(data)
    body = Pieces(parts)
    # aiohttp ends a short body with an error; a scan of one is only a safeguard
    return body, (scan if len(body) == length else None)
