"""vLLM's realtime transcription WebSocket (``/v1/realtime``), relayed both ways.

vLLM 0.33 (``entrypoints/speech_to_text/realtime/api_router.py:17``, ``connection.py``)
accepts the socket, sends ``session.created``, and takes the model from the client's
``session.update`` event; its clients wait for ``session.created`` before they send that. The
proxy needs the model before it can pick (and start) an engine, so it takes it from one of:

* the URL: ``?model=NAME`` (the OpenAI Realtime API's convention) or ``/serve/NAME/v1/realtime``.
  It is resolved before the upgrade (an unknown model is a JSON 404), the engine is leased
  and connected, then the client's socket is accepted and everything passes through, the
  engine's ``session.created`` included;
* the first event: the proxy accepts the socket, sends ``session.created`` itself and reads
  the client's first event, which must be a ``session.update`` naming a model (within
  ``body_timeout_s``); the engine's own ``session.created`` is then not passed on.

A ``session.update`` naming an alias reaches the engine with the canonical name (the engine
knows only that one); one naming another model than the connection's is answered with an
``error`` event and not passed on. The lease is held for the connection's lifetime, so an open
session's engine is neither evicted nor stopped for idleness. After the upgrade the proxy's
errors are vLLM's ``error`` events (``{"type": "error", "error": MESSAGE, "code": CODE}``),
then a close (1008 for the client's fault, 1011 for an engine's, 1001 when the proxy shuts
down, also for a client that has not named its model yet).

What a client sends is counted in ``server.max_bodies_mb`` as its bytes arrive, before aiohttp
has made a message of them (`Meter`, fed by `ClientSocket`), and given back once the message
has gone on to the engine: thirty sockets each sending 30 MiB of a frame that never ends
otherwise held 900 MiB outside the budget. Past the budget the session gets an ``error``
event (``request_bodies_full``) and is closed. A message still arriving after
``body_timeout_s`` (from when `PARTIAL_FROM` bytes of it were in) ends the session too
(``request_timeout``), pings answered or not. Counting is by socket reads: bytes of the next
message that came in the same read as the end of one are given back with it (at most one
read, and one message queued behind it, per socket).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aiohttp
from aiohttp import WSMsgType, web

from ..errors import BadRequest, ProxyError, RequestTimeout, TooManyRequests, Unavailable
from .bytes.intake import Hold

PATH = "/v1/realtime"
UPDATE = "session.update"
#: Close codes: the client's fault (policy violation), the server's (internal error), the
#: server going away.
CLIENT_FAULT, SERVER_FAULT, GOING_AWAY = 1008, 1011, 1001


def session_created() -> str:
    """vLLM's ``SessionCreated`` event (``realtime/protocol.py``)."""
    event = {"type": "session.created", "id": f"sess-{os.urandom(16).hex()}",
             "created": int(time.time())}  # fmt: skip
    return json.dumps(event)


def error_event(message: str, code: str | None) -> str:
    """vLLM's ``ErrorEvent``."""
    return json.dumps({"type": "error", "error": message, "code": code})


def update_of(text: str) -> dict[str, Any] | None:
    """The ``session.update`` event a text message is, if it is one (an audio append, the
    bulk of a session, is not parsed)."""
    if UPDATE not in text:
        return None
    try:
        event = json.loads(text)
    except ValueError:
        return None
    return event if isinstance(event, dict) and event.get("type") == UPDATE else None


async def first_update(
    ws: web.WebSocketResponse, timeout: float, going_away: asyncio.Event
) -> dict[str, Any]:
    """The client's first event, a ``session.update`` naming a model; `BadRequest` for any
    other, or none within `timeout`; `Unavailable` once `going_away` is set (the proxy shuts
    down: a client that says nothing must not hold it)."""
    receiving = asyncio.ensure_future(ws.receive())
    away = asyncio.ensure_future(going_away.wait())
    try:
        await asyncio.wait({receiving, away}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (receiving, away):
            task.cancel()
        await asyncio.gather(receiving, away, return_exceptions=True)
    if receiving.cancelled():
        if going_away.is_set():
            raise Unavailable("the proxy is shutting down", code="shutting_down")
        raise BadRequest(
            f"no {UPDATE} event within {timeout:g}s (server.body_timeout_s); name the model "
            f"in it, or as ?model= in the URL",
            code="invalid_event",
        )
    msg = receiving.result()
    event = update_of(msg.data) if msg.type == WSMsgType.TEXT else None
    if event is None:
        raise BadRequest(
            f"the first event must be {UPDATE} with the model (or give ?model= in the URL)",
            code="invalid_event",
        )
    model = event.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("Missing required field: model", param="model", code="invalid_event")
    return event


async def refuse(ws: web.WebSocketResponse, err: ProxyError) -> None:
    """An error event for `err`, then the close."""
    code = "model_not_found" if err.status == 404 else err.code
    if err.code == "shutting_down":
        close = GOING_AWAY
    else:
        close = CLIENT_FAULT if err.status < 500 else SERVER_FAULT
    with contextlib.suppress(ConnectionError, aiohttp.ClientError):
        await ws.send_str(error_event(err.message, code))
        await ws.close(code=close)


async def connect(
    socket_path: str | None, url: str, headers: dict[str, str], max_msg: int, timeout: float
) -> tuple[aiohttp.ClientSession, aiohttp.ClientWebSocketResponse]:
    """A WebSocket to the engine, in a session of its own (a connection held for a whole
    session must not take one of the shared session's); close both when done."""
    connector: aiohttp.BaseConnector = (
        aiohttp.UnixConnector(path=socket_path) if socket_path else aiohttp.TCPConnector()
    )
    session = aiohttp.ClientSession(connector=connector)
    try:
        async with asyncio.timeout(timeout):
            ws = await session.ws_connect(
                url, headers=headers, max_msg_size=max_msg, autoping=True, compress=0
            )
    except BaseException:
        await session.close()
        raise
    return session, ws


#: A message counts as unfinished (bounded by ``body_timeout_s``) once this much of it is in:
#: less is control frames (a pong every ``send_timeout_s``) or a message about to end.
PARTIAL_FROM = 64 * 1024


class Meter:
    """The bytes a client's socket brought in that have not gone on to the engine as a
    message: counted in `hold` (``server.max_bodies_mb``) as they arrive (`arrived`), given
    back once the message they made has gone on (`passed`). `broken` is set when the budget
    is full: the bytes are then dropped, and the session ends with `error`."""

    __slots__ = ("broken", "error", "fed", "hold", "since")

    def __init__(self, hold: Hold) -> None:
        self.hold = hold
        self.fed = 0
        #: When the bytes in had grown past `PARTIAL_FROM` (None: they have not).
        self.since: float | None = None
        self.error: ProxyError | None = None
        self.broken = asyncio.Event()

    def arrived(self, n: int) -> bool:
        """Count `n` bytes just read; False once over the budget (drop them)."""
        if self.error is not None:
            return False
        try:
            self.hold.take(n)
        except Unavailable as err:
            self.error = err
            self.broken.set()
            return False
        self.fed += n
        if self.since is None and self.fed >= PARTIAL_FROM:
            self.since = time.monotonic()
        return True

    def passed(self, mark: int) -> None:
        """A message has gone on; `mark`: the bytes counted when it was received."""
        self.hold.give(mark)
        self.fed -= mark
        self.since = time.monotonic() if self.fed >= PARTIAL_FROM else None


class _Metered:
    """The client socket's frame parser, each read counted by a `Meter` first."""

    __slots__ = ("meter", "parser")

    def __init__(self, parser: Any, meter: Meter) -> None:
        self.parser = parser
        self.meter = meter

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        if not self.meter.arrived(len(data)):
            return False, b""
        result: tuple[bool, bytes] = self.parser.feed_data(data)
        return result

    def feed_eof(self) -> None:
        self.parser.feed_eof()


class ClientSocket(web.WebSocketResponse):
    """The client's WebSocket, whose reads are counted by `meter` before they are parsed."""

    def __init__(self, meter: Meter, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.meter = meter

    def _post_start(self, request: web.BaseRequest, protocol: str | None, writer: Any) -> None:
        super()._post_start(request, protocol, writer)
        handler: Any = request.protocol
        handler._payload_parser = _Metered(handler._payload_parser, self.meter)


#: How often a session's `watch` looks again at a message still arriving.
WATCH_S = 1.0


class Counts:
    """What a relay passed to the client: its bytes, and when the first message went."""

    __slots__ = ("bytes", "first_at")

    def __init__(self) -> None:
        self.bytes = 0
        self.first_at: float | None = None


async def relay(
    client: ClientSocket,
    engine: aiohttp.ClientWebSocketResponse,
    inbound: Callable[[str], Awaitable[str | None]],
    drop_created: bool,
    counts: Counts,
    going_away: asyncio.Event,
    message_timeout_s: float,
    idle_timeout_s: float,
) -> None:
    """Pass messages both ways until either side closes, or `going_away` is set (then the
    client's socket closes with 1001); the engine's socket is closed by the caller.
    `inbound` rewrites a client's text message, or refuses it (None; it has answered the
    client itself). `drop_created`: the client already has a ``session.created``. The
    session ends with an ``error`` event when the client's bytes pass the bodies' budget, or
    a message is still arriving `message_timeout_s` after it was `PARTIAL_FROM` long, or no
    message has gone either way for `idle_timeout_s` (`watch`)."""
    meter = client.meter
    ended: list[ProxyError] = []
    last = [time.monotonic()]  # when a message last went either way

    async def up() -> None:
        async for msg in client:
            mark = meter.fed
            last[0] = time.monotonic()
            try:
                if msg.type == WSMsgType.TEXT:
                    text = await inbound(msg.data)
                    if text is not None:
                        await engine.send_str(text)
                elif msg.type == WSMsgType.BINARY:
                    await engine.send_bytes(msg.data)
            finally:
                meter.passed(mark)

    async def watch() -> None:
        while meter.error is None:
            since = meter.since
            now = time.monotonic()
            if since is not None and now - since >= message_timeout_s:
                ended.append(
                    RequestTimeout(
                        f"a message did not arrive whole within {message_timeout_s:g}s"
                        " (server.body_timeout_s)"
                    )
                )
                return
            if now - last[0] >= idle_timeout_s:
                ended.append(
                    RequestTimeout(
                        f"no message either way for {idle_timeout_s:g}s"
                        " (server.realtime_idle_timeout_s): the session is closed",
                        code="session_idle",
                    )
                )
                return
            wait = min(WATCH_S, last[0] + idle_timeout_s - now)
            if since is not None:
                wait = min(wait, since + message_timeout_s - now)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(wait, 0.0)):
                    await meter.broken.wait()
        ended.append(meter.error)

    async def down() -> None:
        skip = drop_created
        async for msg in engine:
            if msg.type == WSMsgType.TEXT:
                if skip and '"session.created"' in msg.data:
                    skip = False
                    continue
                skip = False
                await client.send_str(msg.data)
                counts.bytes += len(msg.data)
            elif msg.type == WSMsgType.BINARY:
                await client.send_bytes(msg.data)
                counts.bytes += len(msg.data)
            else:
                continue
            last[0] = time.monotonic()
            if counts.first_at is None:
                counts.first_at = time.monotonic()

    async def away() -> None:
        await going_away.wait()

    tasks = [
        asyncio.ensure_future(up()),
        asyncio.ensure_future(down()),
        asyncio.ensure_future(away()),
        asyncio.ensure_future(watch()),
    ]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    # The side that ended first gives its close code to the other (the engine's: `Sessions`).
    if ended and not client.closed:
        await refuse(client, ended[0])
    elif going_away.is_set():
        with contextlib.suppress(ConnectionError):
            await client.close(code=GOING_AWAY, message=b"the proxy is shutting down")
    elif engine.closed and not client.closed:
        with contextlib.suppress(ConnectionError):
            await client.close(code=_passable(engine.close_code, SERVER_FAULT))


class Sessions:
    """The proxy's realtime sessions together: how many each model has open (`open`: at
    most ``max_realtime_sessions``), `end_all` closes them at shutdown (a session never ends
    by itself, and would hold its lease through the whole drain), and the engines' sockets
    close in tasks of their own (`close_later`)."""

    def __init__(self) -> None:
        self.going_away = asyncio.Event()
        self._closing: set[asyncio.Task[None]] = set()
        #: Sessions open (or waiting for their engine) per model, and per API key (by its
        #: ident) where the key has a limit.
        self.count: dict[str, int] = {}
        self.by_key: dict[str, int] = {}

    @contextlib.contextmanager
    def open(
        self, model: str, limit: int, key: tuple[str, int | None] | None = None
    ) -> Iterator[None]:
        """One more session of `model` (and of the API key `key`: its ident and limit) while
        in the block; `Unavailable` past the model's `limit`, `TooManyRequests` past the
        key's."""
        count = self.count.get(model, 0)
        if count >= limit:
            raise Unavailable(
                f"model '{model}' has {count} realtime sessions open, its limit"
                " (server.max_realtime_sessions); retry later",
                code="realtime_sessions_full",
            )
        if key is not None and key[1] is not None:
            mine = self.by_key.get(key[0], 0)
            if mine >= key[1]:
                raise TooManyRequests(
                    f"this API key has {mine} realtime sessions open, its limit"
                    " (server.api_keys.max_realtime_sessions); close one first",
                    code="realtime_sessions_limit",
                    reason="realtime_sessions",
                )
            self.by_key[key[0]] = mine + 1
        self.count[model] = count + 1
        try:
            yield
        finally:
            _down(self.count, model)
            if key is not None and key[1] is not None:
                _down(self.by_key, key[0])

    def end_all(self) -> None:
        self.going_away.set()

    def close_later(
        self,
        engine: aiohttp.ClientWebSocketResponse,
        session: aiohttp.ClientSession,
        client: web.WebSocketResponse,
    ) -> None:
        """Close the engine's socket (with the client's close code) and its session, without
        the handler waiting for the engine's answer: the client has its close, and its handler
        ends now, before aiohttp sees the connection go (which would cancel it)."""
        code = GOING_AWAY if self.going_away.is_set() else _passable(client.close_code, 1000)
        task = asyncio.ensure_future(_close(engine, session, code))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


async def _close(
    engine: aiohttp.ClientWebSocketResponse, session: aiohttp.ClientSession, code: int
) -> None:
    try:
        with contextlib.suppress(ConnectionError, aiohttp.ClientError):
            await engine.close(code=code)
    finally:
        await session.close()


def _down(counts: dict[str, int], name: str) -> None:
    left = counts[name] - 1
    if left:
        counts[name] = left
    else:
        del counts[name]


def _passable(code: int | None, otherwise: int) -> int:
    """`code` if it may be sent on, else `otherwise` (1005, 1006 and 1015 are never sent)."""
    if code is not None and (code in _SENDABLE or 3000 <= code <= 4999):
        return code
    return otherwise


_SENDABLE = frozenset((1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011))
