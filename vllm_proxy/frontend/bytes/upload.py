"""Form uploads (vLLM's speech-to-text routes), passed on to the engine while they arrive.

A JSON body is read whole before anything goes to an engine (`intake`). An upload is audio, up
to 25 MB by vLLM's default (``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB``) and as much as
``max_body_mb`` allows, and is never held whole: `Upload` reads the body until its ``model``
field is known (`form.FormScan`), keeping what it read, in memory up to `SPOOL_FROM` and past
that in a temporary file; once a lease on the engine is held, it sends what it kept and passes
the rest on from the client as it comes, scanning it still (`write_to`, a
`upstream.BodySource`). The OpenAI SDK sends the fields before the file, so the model is known
from the first piece and nothing goes to disk; a form with ``model`` after the file waits on
disk, bounded by ``max_body_mb``, never in memory, and the spool files of all uploads
together by ``max_spool_mb`` (503 past it: the temporary directory may be a tmpfs). While an
engine starts, the client's upload waits: aiohttp stops reading its socket once about 128 KiB
are buffered.

The bytes go on as received; for an alias only the model value is replaced and the length
adjusted (`form.Rename`); a body of unknown length (chunked, or decoded from a
``Content-Encoding``) goes on chunked. The last piece is held back until the body has ended
and its closing boundary has been seen: an engine never gets whole a body the proxy refuses
(truncated, ``model`` twice), and the client gets the proxy's 400.

The client's reads are bounded by ``body_timeout_s`` in all (the time spent waiting for the
engine, to start or to take the bytes, is not counted: the engine's is bounded by
``read_timeout_s``), the body by ``max_body_mb`` (413).
"""

from __future__ import annotations

import asyncio
import tempfile
from typing import IO

from aiohttp import web

from ...errors import BadRequest, RequestTimeout
from ..upstream import BodySink, BodySource
from .form import FORM_DATA, MISSING, FormScan, Rename, boundary_of, model_field
from .intake import Hold, check_type, is_form, too_large

#: What is read before the model is known is kept in memory up to this many bytes ...
SPOOL_FROM = 256 * 1024
#: ... and past that in a temporary file, written and read back this much at a time (in a
#: thread: the event loop does not wait on the disk).
SPOOL_BYTES = 1024 * 1024


def open_upload(
    request: web.Request, limit: int, timeout_s: float, hold: Hold, spooled: Hold
) -> Upload:
    """The upload of `request`, checked before anything is read: its announced length (413),
    its type (415: only ``multipart/form-data``) and its boundary (400). `hold` counts what is
    kept in memory, `spooled` what goes to the spool file (``server.max_spool_mb``)."""
    length = request.content_length
    encoded = "Content-Encoding" in request.headers  # aiohttp decodes it: the length is not its
    if length is not None and length > limit and not encoded:
        raise too_large(limit)
    check_type(request, is_form, FORM_DATA)
    boundary = boundary_of(request.headers["Content-Type"])
    return Upload(request, boundary, None if encoded else length, limit, timeout_s, hold, spooled)


class Upload(BodySource):
    """One form upload on its way from a client to an engine: `find_model`, then `rename` for
    the canonical name, then `write_to` the engine (through `UpstreamPool.request`); `close`
    in ``finally``."""

    def __init__(
        self,
        request: web.Request,
        boundary: bytes,
        length: int | None,
        limit: int,
        timeout_s: float,
        hold: Hold,
        spooled: Hold,
    ) -> None:
        self.content = request.content
        self.boundary = boundary
        #: The length the engine gets (None: chunked).
        self.length = length
        self.limit = limit
        self.timeout_s = timeout_s
        self.budget = timeout_s  # what is left of it for the client's reads
        self.hold = hold
        self.spooled = spooled
        self.scan = FormScan(boundary)
        self.rename: Rename | None = None
        self.ended = False
        # What was read before the model was known: in memory, then in the spool file (its
        # `pending` pieces not written yet).
        self.kept: list[bytes] = []
        self.kept_bytes = 0
        self.spool: IO[bytes] | None = None
        self.pending: list[bytes] = []
        self.pending_bytes = 0
        # While sending: the offset of the next byte, and the piece held back.
        self.at = 0
        self.held = b""

    async def find_model(self) -> str | None:
        """Read until the form's ``model`` field is known; None when the body has none (it has
        then been read to its end). `BadRequest` for a body that `FormScan` refuses."""
        scan = self.scan
        while scan.model is None:
            data = await self._read()
            if not data:
                scan.end()
                return None
            scan.feed(data)
            await self._keep(data)
        return scan.model

    def rename_to(self, name: str, forced: bool) -> None:
        """The engine gets `name`, the canonical name: in place of the form's ``model`` when it
        differs (an alias, or a model given in the path: `forced`), or, for a form without one
        (only with `forced`), as a field of its own before the first part."""
        scan = self.scan
        if scan.span is not None:
            if scan.model != name:
                self.rename = Rename(*scan.span, name.encode())
        elif not forced or scan.first is None:
            raise BadRequest(MISSING, param="model")
        else:
            field = model_field(self.boundary, name)
            self.rename = Rename(scan.first, scan.first, field)
        if self.rename is not None and self.length is not None:
            self.length += self.rename.growth

    async def write_to(self, sink: BodySink) -> None:
        for piece in self.kept:
            await self._push(sink, piece)
        self.kept = []
        if self.spool is not None:
            await self._flush()
            spool = self.spool
            await asyncio.to_thread(spool.seek, 0)
            while piece := await asyncio.to_thread(spool.read, SPOOL_BYTES):
                await self._push(sink, piece)
        scan = self.scan
        while data := await self._read():
            scan.feed(data)
            await self._push(sink, data)
        scan.end()
        await self._push(sink, b"")  # the last piece, now that the body is known whole

    async def _push(self, sink: BodySink, piece: bytes) -> None:
        """Send the piece held back, and hold `piece` back."""
        held, self.held = self.held, piece
        if not held:
            return
        at = self.at
        self.at += len(held)
        for part in self.rename.apply(held, at) if self.rename is not None else (held,):
            sink.write(part)
        await sink.drain()

    async def _read(self) -> bytes:
        """The client's next piece (b"" at the end), within what is left of the time bound."""
        if self.ended:
            return b""
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            async with asyncio.timeout(max(self.budget, 0.0)):
                # Everything buffered at once, not one HTTP chunk at a time: a client sending
                # a byte per chunk would make a scan step and a kept piece of every byte.
                data = await self.content.readany()
        except TimeoutError:
            raise RequestTimeout(
                f"the request body did not arrive within {self.timeout_s:g}s "
                "(server.body_timeout_s)"
            ) from None
        self.budget -= loop.time() - began
        if not data:
            self.ended = True
        elif self.scan.received + len(data) > self.limit:
            raise too_large(self.limit)
        return data

    async def _keep(self, data: bytes) -> None:
        if self.spool is None and self.kept_bytes + len(data) <= SPOOL_FROM:
            self.hold.take(len(data))
            self.kept.append(data)
            self.kept_bytes += len(data)
            return
        self.spooled.take(len(data))  # 503 once the spool files of all uploads would pass
        if self.spool is None:
            self.spool = await asyncio.to_thread(tempfile.TemporaryFile, prefix="vllm-proxy-")
        self.pending.append(data)
        self.pending_bytes += len(data)
        if self.pending_bytes >= SPOOL_BYTES:
            await self._flush()

    async def _flush(self) -> None:
        pending, self.pending, self.pending_bytes = self.pending, [], 0
        if pending and self.spool is not None:
            await asyncio.to_thread(self.spool.writelines, pending)

    def close(self) -> None:
        """Remove the spool file, if there is one (idempotent)."""
        spool, self.spool = self.spool, None
        if spool is not None:
            spool.close()
