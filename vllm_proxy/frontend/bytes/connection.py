"""What happens on a client connection before a request reaches the application.

aiohttp answers malformed HTTP (a bad request line, a header too long) itself, as text with a
logged traceback, and bounds a request head only by the keep-alive timeout. The proxy's
connection handler answers those in the OpenAI error shape with one log line, and closes a
connection whose request head has not arrived whole within ``server.header_timeout_s``
(slow-loris clients hold descriptors). `Runner` installs it for every connection.

`Site` listens and accepts itself: the event loop's own server (libuv, which uvloop bundles)
accepted about one connection per loop iteration, so while the loop was busy relaying
thousands of streams new connections waited in the listen queue for seconds. `Site` drains
the queue each time the listening socket is readable.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import socket
from collections.abc import Callable, Coroutine
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from ...errors import error_body

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


#: Listen queue length asked for (the kernel caps it at net.core.somaxconn).
BACKLOG = 4096
#: Connections accepted per wake-up of a listening socket at most; the rest on the next one.
ACCEPT_BATCH = 1024
#: Out of descriptors: accepting pauses this long (connections wait in the listen queue).
ACCEPT_RETRY_S = 0.5
_OUT_OF = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class Listener(asyncio.AbstractServer):
    """Listening sockets whose accept queue is drained each time one is readable; each
    accepted socket gets a protocol from `factory` (`loop.connect_accepted_socket`)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sockets: list[socket.socket],
        factory: Callable[[], asyncio.Protocol],
    ) -> None:
        self._loop = loop
        self._sockets = sockets
        self._factory = factory
        #: Connections being set up: their transport's waiter -> the setup coroutine.
        self._pending: dict[asyncio.Future[Any], Coroutine[Any, Any, Any]] = {}
        self._serving = True
        for sock in sockets:
            loop.add_reader(sock.fileno(), self._accept, sock, int(sock.family))

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return tuple(self._sockets)

    def _accept(self, sock: socket.socket, family: int) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                # `socket.accept()` without its wrapper: the family is known here, and the
                # wrapper's look-ups convert family and type to enums for every connection.
                fd, _addr = sock._accept()  # type: ignore[attr-defined]
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                if err.errno in _OUT_OF:
                    log.error("cannot accept connections: %s; retrying in %gs",
                              err.strerror, ACCEPT_RETRY_S)  # fmt: skip
                    self._loop.remove_reader(sock.fileno())
                    self._loop.call_later(ACCEPT_RETRY_S, self._resume, sock, family)
                    return
                continue  # ECONNABORTED and the like: that client is gone, the next may not be
            conn = socket.socket(family, socket.SOCK_STREAM, 0, fd)
            conn.setblocking(False)
            self._connect(conn)

    def _connect(self, conn: socket.socket) -> None:
        """`loop.connect_accepted_socket`, stepped here rather than in a task of its own: the
        transport is made and reading starts now, one loop iteration sooner (those are long
        while thousands of streams are relayed); its last step, returning the pair nobody
        needs, runs when its waiter is done."""
        coro = self._loop.connect_accepted_socket(self._factory, conn)
        try:
            waiter = coro.send(None)
        except StopIteration:
            return
        except Exception as err:
            log.warning("an accepted connection could not be set up: %s", err)
            conn.close()
            return
        self._pending[waiter] = coro
        waiter.add_done_callback(self._connected)

    def _connected(self, waiter: asyncio.Future[Any]) -> None:
        coro = self._pending.pop(waiter, None)
        if coro is None:
            return
        try:
            coro.send(None)
        except StopIteration:
            pass
        except (Exception, asyncio.CancelledError) as err:
            log.warning("an accepted connection could not be set up: %r", err)

    def _resume(self, sock: socket.socket, family: int) -> None:
        if self._serving and sock.fileno() >= 0:
            self._loop.add_reader(sock.fileno(), self._accept, sock, family)

    def close(self) -> None:
        """Stop accepting and close the listening sockets (open connections stay)."""
        if not self._serving:
            return
        self._serving = False
        for sock in self._sockets:
            if sock.fileno() >= 0:
                self._loop.remove_reader(sock.fileno())
                sock.close()
        for coro in self._pending.values():
            coro.close()  # closes that connection's transport
        self._pending.clear()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return self._serving

    async def start_serving(self) -> None:
        pass  # serving from construction

    async def serve_forever(self) -> None:
        raise NotImplementedError("serve through the runner")

    async def wait_closed(self) -> None:
        pass  # close() finishes synchronously


def listen(host: str | None, port: int, backlog: int = BACKLOG) -> list[socket.socket]:
    """Bound, listening, non-blocking sockets for every address `host` resolves to (all
    interfaces when empty), as ``loop.create_server`` makes them."""
    infos = socket.getaddrinfo(
        host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE
    )
    sockets: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as err:
                raise OSError(
                    err.errno, f"error while attempting to bind on address {addr!r}: {err.strerror}"
                ) from None
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class Site(web.BaseSite):
    """A TCP site served by a `Listener` (see the module docstring)."""

    __slots__ = ("_host", "_port")

    def __init__(
        self, runner: web.BaseRunner, host: str | None, port: int, backlog: int = BACKLOG
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port

    @property
    def name(self) -> str:
        return f"http://{self._host or '0.0.0.0'}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        sockets = listen(self._host, self._port, self._backlog)
        self._server = Listener(asyncio.get_running_loop(), sockets, server)
