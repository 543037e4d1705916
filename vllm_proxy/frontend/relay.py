"""The relay of an engine's answer to its client, on its own.

* the request goes to the engine with the client's headers, less hop-by-hop ones and the
  client's key, plus the request id and the engine's own key;
* a whole answer goes back in one response; a large or slow one as it arrives
  (`Relay._body`); an SSE stream from the engine socket's read callback (`Relay._stream`);
* a stream already answered 200 while its model loaded takes the engine's stream, or an SSE
  error event for anything else;
* a client that takes nothing for ``server.send_timeout_s`` is dropped (`ClientTooSlow`);
  an engine silent for its ``read_timeout_s`` is a 504 (`read_timeout`), a failed exchange
  what `Upstream.failure` says.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Iterable

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from multidict import CIMultiDict

from ..errors import RETRY_AFTER_S, EngineTimeout, Unavailable, error_body
from ..pool.lease import Upstream
from .bytes.body import Body
from .serving import BODY_HOLD, ENGINE_ID, REQUEST_ID, Serving, Tap
from .upstream import BodySource, NoSlot, UpstreamError, UpstreamResponse

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
#: ``content-encoding``: aiohttp has decoded the body already (gzip, deflate): it goes on plain.
DROP_REQUEST = HOP_BY_HOP | {
    "host", "content-length", "authorization", "expect", "x-request-id", "content-encoding"
}  # fmt: skip
DROP_RESPONSE = HOP_BY_HOP | {"content-length", "server", "date"}

#: Bytes queued for a client beyond which a write is timed (``server.send_timeout_s``).
SEND_BACKLOG = 64 * 1024


class ClientTooSlow(Exception):
    """The client did not take its response for ``send_timeout_s``."""


def sse_error(message: str, type_: str, code: str) -> bytes:
    """An OpenAI-shaped error as the last event of an SSE stream, then ``[DONE]``."""
    event = json.dumps(error_body(message, type_, code))
    return f"data: {event}\n\ndata: [DONE]\n\n".encode()


def read_timeout(engine: Upstream) -> EngineTimeout:
    """The 504 of an engine that sent nothing for its ``read_timeout_s``."""
    return EngineTimeout(
        f"model '{engine.model}': no data from the engine for {engine.read_timeout_s:g}s",
        code="engine_read_timeout",
    )


def _upstream_headers(request: web.Request, engine_key: str | None) -> list[tuple[str, str]]:
    """The client's headers minus hop-by-hop ones (and those its ``Connection`` names), with
    the request id (vLLM logs it) and the engine's own API key when it was started with one
    (the client's ``Authorization`` is the proxy's key, never passed on)."""
    headers = request.headers
    drop = DROP_REQUEST
    if "Connection" in headers:
        drop = drop | _connection_named(headers.getall("Connection"))
    out = [(k, v) for k, v in headers.items() if k.lower() not in drop]
    out.append(("X-Request-ID", request[ENGINE_ID]))
    if engine_key:
        out.append(("Authorization", f"Bearer {engine_key}"))
    return out


def _downstream_headers(raw: list[tuple[bytes, bytes]]) -> CIMultiDict[str]:
    """The engine's headers minus hop-by-hop ones and those its ``Connection`` names."""
    headers: CIMultiDict[str] = CIMultiDict()
    named: list[str] = []
    for k, v in raw:
        name = k.decode("latin-1")
        lower = name.lower()
        if lower == "connection":
            named.append(v.decode("latin-1"))
        elif lower not in DROP_RESPONSE:
            try:  # aiohttp writes values as UTF-8: decoded so, the engine's bytes go out
                headers.add(name, v.decode("utf-8"))
            except UnicodeDecodeError:  # no str aiohttp writes as these bytes
                log.warning("engine header %s is not UTF-8; dropped", name)
    for extra in _connection_named(named):  # rare: headers the engine marked hop-by-hop
        headers.popall(extra, None)
    return headers


def _connection_named(values: Iterable[str]) -> frozenset[str]:
    """Header names listed in ``Connection`` (RFC 9110 7.6.1: hop-by-hop too)."""
    return frozenset(t.strip().lower() for v in values for t in v.split(",") if t.strip())


class Relay:
    """Engines' answers relayed to their clients, under one `Serving`'s settings."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def answer(
        self,
        request: web.Request,
        path: str,
        body: Body | BodySource,
        engine: Upstream,
        tap: Tap,
        prepared: web.StreamResponse | None = None,
    ) -> web.StreamResponse:
        """The engine's answer to the client. `prepared`: a stream already answered 200 (while
        the model loaded): an SSE answer goes on in it, anything else becomes an SSE error."""
        timeout = engine.read_timeout_s
        try:
            up = await self.serving.upstream.request(
                engine.address,
                "POST",
                path,
                _upstream_headers(request, engine.api_key),
                body,
                timeout,
                engine.model,
                engine.progress,
            )
        except TimeoutError:
            raise read_timeout(engine) from None
        except NoSlot as err:
            raise Unavailable(f"model '{engine.model}': {err}", code="connections_busy") from None
        except UpstreamError as err:
            raise await engine.failure(err) from None
        hold = request.get(BODY_HOLD)
        if hold is not None:  # written to the engine: a large body is dropped and given back
            hold.handed_over(body)
        try:
            headers = _downstream_headers(up.headers)
            if up.status == 503 and "Retry-After" not in headers:  # vLLM's own (queue limits)
                headers["Retry-After"] = str(RETRY_AFTER_S)
            if headers.get("Content-Type", "").lower().startswith("text/event-stream"):
                return await self._stream(request, up, headers, engine, tap, prepared)
            if prepared is not None:
                return await self._error_into_stream(up, engine, prepared)
            try:
                first = await up.read_chunk(timeout)
                if up.complete():  # the whole body is here (the usual case): one response
                    payload = first + up.take_rest()
                    tap.feed(payload)
                    tap.first_byte = time.monotonic()
                    tap.bytes = len(payload)
                    return web.Response(status=up.status, body=payload, headers=headers)
            except TimeoutError:
                raise read_timeout(engine) from None
            except UpstreamError as err:
                raise await engine.failure(err) from None
            return await self._body(request, up, headers, first, engine, tap)
        finally:
            up.release()  # not read to the end (client gone, error): closes, the engine aborts

    async def _error_into_stream(
        self, up: UpstreamResponse, engine: Upstream, resp: web.StreamResponse
    ) -> web.StreamResponse:
        """A non-stream answer (an engine's error) to a stream that already answered 200."""
        try:
            data = await up.read_chunk(engine.read_timeout_s) + up.take_rest()
        except (TimeoutError, UpstreamError):
            data = b""
        message = f"model '{engine.model}': the engine answered {up.status}"
        try:
            err = json.loads(data).get("error")
            if isinstance(err, dict) and isinstance(err.get("message"), str):
                message = err["message"]
        except (ValueError, AttributeError):
            pass
        await write_quietly(resp, sse_error(message, "engine_error", str(up.status)))
        return resp

    async def _body(
        self,
        request: web.Request,
        up: UpstreamResponse,
        headers: CIMultiDict[str],
        first: bytes,
        engine: Upstream,
        tap: Tap,
    ) -> web.StreamResponse:
        """A large or slow non-stream body: passed on as it arrives, never held whole. Past
        `prepare()` an engine failure can only cut the response short (the client sees a
        truncated body), and is logged."""
        resp = web.StreamResponse(status=up.status, headers=headers)
        if up.content_length is not None:
            resp.content_length = up.content_length
        await resp.prepare(request)
        chunk, timeout = first, engine.read_timeout_s
        try:
            while chunk:
                await self._send(request, resp, chunk)
                if tap.first_byte is None:
                    tap.first_byte = time.monotonic()
                tap.bytes += len(chunk)
                tap.feed(chunk)
                chunk = await up.read_chunk(timeout)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError, ClientTooSlow):
            tap.client_gone = True
            return resp
        except (TimeoutError, UpstreamError) as err:
            log.error("%s: response body cut short (request %s): %s", engine.instance,
                      request[REQUEST_ID], err or "no data")  # fmt: skip
            if request.transport is not None:
                request.transport.close()
            return resp
        await resp.write_eof()
        return resp

    async def _send(self, request: web.Request, resp: web.StreamResponse, chunk: bytes) -> None:
        """Write a chunk; a client whose socket buffer stays full for ``send_timeout_s`` is
        dropped (`ClientTooSlow`). The timer runs only when the buffer is already backed up."""
        transport = request.transport
        if transport is None or transport.get_write_buffer_size() < SEND_BACKLOG:
            await resp.write(chunk)
            return
        try:
            async with asyncio.timeout(self.serving.send_timeout_s):
                await resp.write(chunk)
        except TimeoutError:
            log.warning("request %s: the client took nothing for %gs, dropped",
                        request[REQUEST_ID], self.serving.send_timeout_s)  # fmt: skip
            transport.abort()
            raise ClientTooSlow from None

    async def _stream(
        self,
        request: web.Request,
        up: UpstreamResponse,
        headers: CIMultiDict[str],
        engine: Upstream,
        tap: Tap,
        resp: web.StreamResponse | None = None,
    ) -> web.StreamResponse:
        """An SSE stream: what each read of the engine socket carries is written to the client
        from that read's callback (`UpstreamResponse.relay`), bytes as the engine sent them,
        with no task switch and no timer per event. `resp`: a stream already answered 200
        while the model loaded."""
        if resp is None:
            resp = web.StreamResponse(status=up.status, headers=headers)
            resp.headers["X-Accel-Buffering"] = "no"
            resp.headers["Cache-Control"] = "no-cache"
            resp.headers["X-Request-ID"] = request[REQUEST_ID]
        writer = await resp.prepare(request)
        if writer is None or request.transport is None:  # the client left meanwhile
            tap.client_gone = True
            return resp
        # Written to the client's transport directly, framed as the writer would (HTTP/1.1
        # chunks, or raw for an HTTP/1.0 client): the writer of an SSE answer has no
        # compression and no length. Its byte count is brought up to date at the end.
        chunked = bool(getattr(writer, "chunked", False))  # aiohttp's StreamWriter has it
        timeout = engine.read_timeout_s
        drain = functools.partial(self._drain, request, writer)
        try:
            await up.relay(request.transport, chunked, drain, timeout)
        except TimeoutError:
            msg = f"model '{engine.model}': no data for {timeout:g}s"
            await write_quietly(resp, sse_error(msg, "engine_error", "engine_read_timeout"))
            return resp
        except UpstreamError as cause:
            err = await engine.failure(cause)
            await write_quietly(resp, sse_error(err.message, err.type_, str(err.code)))
            return resp
        except (ConnectionResetError, aiohttp.ClientConnectionResetError, ClientTooSlow):
            tap.client_gone = True
            return resp  # the client left; the unread response closes the engine connection
        finally:
            if up.sink is not None:
                tap.relayed(up.sink)
                writer.output_size += up.sink.bytes  # (the body: chunk framing not counted)
        await resp.write_eof()
        return resp

    async def _drain(self, request: web.Request, writer: AbstractStreamWriter) -> None:
        """Wait until the client has taken its backlog; a client that takes nothing for
        ``send_timeout_s`` is dropped (`ClientTooSlow`)."""
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        try:
            async with asyncio.timeout(self.serving.send_timeout_s):
                await writer.drain()
        except TimeoutError:
            log.warning("request %s: the client took nothing for %gs, dropped",
                        request[REQUEST_ID], self.serving.send_timeout_s)  # fmt: skip
            transport.abort()
            raise ClientTooSlow from None


async def write_quietly(resp: web.StreamResponse, data: bytes) -> None:
    """Write `data` and end the response; a client gone meanwhile is no error."""
    try:
        await resp.write(data)
        await resp.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        pass
