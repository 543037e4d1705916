"""The realtime route: vLLM's realtime WebSocket (``GET /v1/realtime``,
``/serve/{model}/v1/realtime``) under the request path's rules.

A session is a request that lasts: it is counted for its API key (and refused past the key's
limits with an HTTP 429 before the upgrade), what the client sends is counted in the bodies'
budget as it arrives, the model is found by name within the key's scope (from the URL, or from
the client's first ``session.update``), and a lease on an instance and a connection of the
model's share are held for the session's lifetime. The proxy's and each key's
``max_realtime_sessions`` bound how many are open; ``realtime_idle_timeout_s`` ends a silent one.
The protocol itself (events, the relay loop, metering, the open sessions) is `realtime_relay`;
what every route shares (scope, key limits, budgets, observation) is `serving.Serving`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from ...config import ServerConfig
from ...errors import (
    BadRequest,
    EngineFailed,
    NotFound,
    ProxyError,
    TooManyRequests,
    Unavailable,
)
from ...pool.lease import Upstream
from ...pool.views import Model
from ..bytes.intake import Hold
from ..realtime_relay import (
    PATH,
    ClientSocket,
    Counts,
    Meter,
    Sessions,
    connect,
    error_event,
    first_update,
    refuse,
    relay,
    session_created,
    update_of,
)
from ..relay import read_timeout
from ..serving import CLIENT_CLOSED, ENGINE_ID, SCOPE, TAP, Serving, Tap, key_priority
from ..upstream import NoSlot, UpstreamError

#: How long a realtime client has to answer the proxy's close frame.
CLOSE_TIMEOUT_S = 2.0


class RealtimeRoute:
    """The realtime sessions of one proxy: their route, their count, their settings."""

    def __init__(self, serving: Serving, server: ServerConfig) -> None:
        #: What the routes share: keys and their scope, limits, budgets, observation.
        self.serving = serving
        #: The open sessions (closed with 1001 when the proxy shuts down).
        self.sessions = Sessions()
        self.configure(server)

    def configure(self, server: ServerConfig) -> None:
        """Apply the keys of a (re)loaded config."""
        self.max_sessions = server.max_realtime_sessions
        self.idle_timeout_s = server.realtime_idle_timeout_s

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """vLLM's realtime WebSocket (``GET /v1/realtime``, ``/serve/{model}/v1/realtime``),
        relayed both ways under a lease held for the connection's lifetime; see `realtime`."""
        tap = request[TAP]
        if self.serving.manager.closing:
            raise Unavailable("the proxy is shutting down", code="shutting_down")
        hold = self.serving.bodies.hold()  # what the client sends, until it has gone on
        try:
            with self.serving.key_use(request):  # before the upgrade: past a limit, an HTTP 429
                return await self._session(request, tap, hold)
        finally:
            hold.release()

    async def _session(self, request: web.Request, tap: Tap, hold: Hold) -> web.StreamResponse:
        # Pinged after send_timeout_s of silence and dropped without a pong: a client whose
        # host vanished would otherwise hold its lease (and the engine) for good. What it
        # sends is counted in the bodies' budget as it arrives (`Meter`).
        client = ClientSocket(
            Meter(hold),
            max_msg_size=self.serving.max_body_bytes,
            compress=False,
            heartbeat=self.serving.send_timeout_s,
            timeout=CLOSE_TIMEOUT_S,
        )
        if not client.can_prepare(request).ok:
            raise BadRequest(
                f"GET {request.path} takes a WebSocket (Upgrade: websocket)",
                code="websocket_required",
            )
        named = request.match_info.get("model") or request.query.get("model")
        first: dict[str, Any] | None = None
        if named:
            model = self.serving.resolve(request, named, observe=True)
        else:  # the model comes in the client's first event
            await client.prepare(request)
            await client.send_str(session_created())
            try:
                first = await first_update(
                    client, self.serving.body_timeout_s, self.sessions.going_away
                )
                client.meter.passed(client.meter.fed)
                model = self.serving.resolve(request, first["model"], observe=True)
            except ProxyError as err:
                await refuse(client, err)
                return client
        tap.model = model.name
        status = "error"
        affinity = model.spec.affinity_header
        session = request.headers.get(affinity) if affinity else None
        try:
            # Counted before the lease: a session refused starts no engine.
            scope = request.get(SCOPE)
            key = None if scope is None else (scope.ident, scope.max_realtime_sessions)
            with self.sessions.open(model.name, self.max_sessions, key):
                lease = self.serving.manager.lease(model, session, None, key_priority(request))
                async with lease as engine:
                    tap.instance = engine.instance
                    slot = await self._slot(engine)
                    try:
                        await self._relay(request, client, model, first, engine, tap)
                    finally:
                        slot.release()
            status = str(client.status)
        except ProxyError as err:
            status = str(err.status)
            if isinstance(err, TooManyRequests) and tap.key is not None:
                tap.key[1].reject(err.reason)  # the key's max_realtime_sessions
            if not client.prepared:
                raise
            await refuse(client, err)
        except asyncio.CancelledError:
            status = str(tap.ended) if tap.ended else CLIENT_CLOSED
            raise
        finally:
            self.serving.observe(model.name, status, tap.started, tap)
        return client

    async def _slot(self, engine: Upstream) -> asyncio.Semaphore:
        """A connection of the model's share (``max_upstream_connections``), held for the
        session's lifetime: a session holds an engine connection as a request does."""
        try:
            return await self.serving.upstream.take_slot(engine.model)
        except NoSlot as err:
            raise Unavailable(f"model '{engine.model}': {err}", code="connections_busy") from None

    async def _relay(
        self,
        request: web.Request,
        client: ClientSocket,
        model: Model,
        first: dict[str, Any] | None,
        engine: Upstream,
        tap: Tap,
    ) -> None:
        """Connect to the engine's realtime socket, accept the client's, and relay."""
        headers = {"X-Request-ID": request[ENGINE_ID]}
        if engine.api_key:
            headers["Authorization"] = f"Bearer {engine.api_key}"
        url = engine.base_url + PATH
        wait = self.serving.upstream.connect_timeout_s
        try:
            session, up = await connect(
                engine.socket_path, url, headers, self.serving.max_body_bytes, wait
            )
        except TimeoutError:
            raise read_timeout(engine) from None
        except aiohttp.WSServerHandshakeError as err:
            if err.status == 404:
                raise NotFound(
                    f"model '{engine.model}' does not serve {PATH} (vLLM serves it for "
                    "realtime models only)",
                    code="unknown_endpoint",
                ) from None
            raise EngineFailed(
                f"model '{engine.model}': the engine refused the WebSocket ({err.status})"
            ) from None
        except (aiohttp.ClientError, OSError) as err:
            raise await engine.failure(UpstreamError(str(err))) from None

        async def inbound(text: str) -> str | None:
            """A ``session.update`` for an alias gets the canonical name; one for another
            model is refused."""
            event = update_of(text)
            wanted = event.get("model") if event is not None else None
            if event is None or not isinstance(wanted, str) or wanted == model.name:
                return text
            try:
                target = self.serving.resolve(request, wanted)
            except NotFound as err:
                await client.send_str(error_event(err.message, "model_not_found"))
                return None
            if target is not model:
                message = f"this session is bound to model '{model.name}'; open another one"
                await client.send_str(error_event(message, "model_mismatch"))
                return None
            event["model"] = model.name
            return json.dumps(event)

        counts = Counts()
        try:
            if not client.prepared:
                await client.prepare(request)
            if first is not None:
                first["model"] = model.name
                await up.send_str(json.dumps(first))
            going_away = self.sessions.going_away
            await relay(
                client, up, inbound, first is not None, counts, going_away,
                self.serving.body_timeout_s, self.idle_timeout_s,
            )  # fmt: skip
        finally:
            self.sessions.close_later(up, session, client)
            tap.bytes, tap.first_byte = counts.bytes, counts.first_at
            if client.closed:  # the close handshake is done: the session ended as it should
                tap.ended = client.status


def add_realtime_routes(app: web.Application, route: RealtimeRoute) -> None:
    app.router.add_get(PATH, route.handle)
    app.router.add_get("/serve/{model}" + PATH, route.handle)
