"""What happens on a client connection before a request reaches the application.

aiohttp answers malformed HTTP (a bad request line, a header too long) itself, as text with a
logged traceback, and bounds a request head only by the keep-alive timeout. The proxy's
connection handler answers those in the OpenAI error shape with one log line, and closes a
connection whose request head has not arrived whole within ``server.header_timeout_s``
(slow-loris clients hold descriptors). `Runner` installs it for every connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from .errors import error_body

log = logging.getLogger(__name__)


class _Handler(RequestHandler):
    __slots__ = ("_head_timeout_s", "_head_timer")

    def __init__(self, *args: Any, head_timeout_s: float = 30.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Bytes came but no whole request head is queued and no request is being handled:
        # a head is on its way. It gets `head_timeout_s` from its first byte.
        waiting_for_head = not self._messages and not self._request_in_progress
        if waiting_for_head and self._head_timer is None and self.transport is not None:
            loop = asyncio.get_running_loop()
            self._head_timer = loop.call_later(self._head_timeout_s, self._head_expired)
        elif not waiting_for_head and self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if not self._messages and not self._request_in_progress and self.transport is not None:
            log.warning("a request head did not arrive within %gs; closing", self._head_timeout_s)
            self.force_close()
            self.transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Malformed HTTP: an OpenAI-shaped 4xx, one log line, the connection closed."""
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        what = type(exc).__name__ if exc is not None else "bad request"
        log.warning("malformed HTTP request from %s: %s", request.remote, what)
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send the error")
        body = error_body(
            f"malformed HTTP request ({what})", "invalid_request_error", "bad_http_request"
        )
        resp = web.Response(
            status=status, body=json.dumps(body).encode(), content_type="application/json"
        )
        resp.force_close()
        return resp


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    """An `AppRunner` whose connections get the proxy's handler (`head_timeout_s`)."""

    def __init__(self, app: web.Application, *, head_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, head_timeout_s=head_timeout_s, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # same object and state; only the handler class differs
        return server
