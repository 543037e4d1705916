"""The OpenAI-compatible routes: find the model, hold a lease, let the engine answer.

* ``POST`` on every route that names a model (`paths.MODEL_ROUTES`), by the body's ``model``;
* the form uploads (`paths.UPLOAD_ROUTES`), by their ``model`` field, passed on as they arrive;
* ``/serve/{model}/v1/...``: the model from the path;
* ``GET /v1/models`` (`catalogue`), ``/health``, ``/metrics``.

The request body is forwarded as received; only the ``model`` field is read (and rewritten when
the client used an alias): see `bytes.body`. A stream that waits for its engine gets keep-alives;
the engine's answer is relayed by `relay`. What every route shares (keys, scope, limits,
budgets, observation) is `serving.Serving`, which `OpenAIRoutes` is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from urllib.parse import urlencode

import aiohttp
from aiohttp import web

from ...adapters import AdapterSpec
from ...config import ServerConfig
from ...errors import RETRY_AFTER_S, BadRequest, NotFound, ProxyError, Unavailable
from ...metrics import Metrics
from ...pool.lease import Lease, Upstream
from ...pool.manager import Manager
from ...pool.views import Model
from ..bytes.body import Body, bulk, model_of
from ..bytes.form import MISSING
from ..bytes.intake import read_body
from ..bytes.upload import open_upload
from ..recent import MAX_CAPTURE_BYTES
from ..relay import Relay, sse_error, write_quietly
from ..serving import BODY_HOLD, REQUEST_ID, TAP, Serving, Tap, client_of, key_priority, narrowed
from ..upstream import BodySource, UpstreamPool
from .catalogue import Catalogue
from .paths import MODEL_ROUTES, PREFIXED_TAILS, UPLOAD_ROUTES, UPLOAD_TAILS

log = logging.getLogger(__name__)


class OpenAIRoutes(Serving):
    """The OpenAI routes of one proxy (one instance per application)."""

    def __init__(
        self,
        manager: Manager,
        metrics: Metrics,
        upstream: UpstreamPool,
        server: ServerConfig,
    ) -> None:
        super().__init__(manager, metrics, upstream, server)
        bulk()  # the scan's regexes, compiled now rather than when the first body needs them
        #: What ``/v1/models`` lists.
        self.catalogue = Catalogue(manager, int(time.time()))
        #: The engines' answers to their clients.
        self.relay = Relay(self)

    # -- model routes --------------------------------------------------------------------

    async def forward(self, request: web.Request) -> web.StreamResponse:
        """Route a JSON POST to the engine of the model named in its body."""
        with self.key_use(request):
            return await self._forward(request, request.raw_path, None)

    async def forward_prefixed(self, request: web.Request) -> web.StreamResponse:
        """``/serve/{model}/v1/...``: the model comes from the path; the body's is optional."""
        tail = request.match_info["tail"]
        if tail not in PREFIXED_TAILS:  # never copy a client's path into the request line
            raise NotFound(
                f"unknown endpoint POST {request.path}; /serve/<model>/v1/ takes: "
                + ", ".join(sorted(PREFIXED_TAILS)),
                code="unknown_endpoint",
            )
        path = "/v1/" + tail
        if request.query:
            path += "?" + urlencode(list(request.query.items()))  # re-encoded, not raw
        with self.key_use(request):
            if tail in UPLOAD_TAILS:
                return await self._forward_upload(request, path, request.match_info["model"])
            return await self._forward(request, path, request.match_info["model"])

    async def _forward(
        self, request: web.Request, path: str, forced: str | None
    ) -> web.StreamResponse:
        tap = request[TAP]
        if self.manager.closing:
            raise Unavailable("the proxy is shutting down", code="shutting_down")
        # The body's bytes, held until it has been sent (a large one) or the request ends.
        hold = request[BODY_HOLD] = self.bodies.hold(client_of(request))
        try:
            body, scanned = await read_body(request, self.max_body_bytes, self.body_timeout_s, hold)
            parsed = model_of(body, forced, scanned)
            model, adapter = self.resolve_target(request, parsed.model)
            # An alias goes to the engine as the name it serves (the adapter's, for an adapter).
            body = parsed.body_for(model.name if adapter is None else adapter.name)
            parsed.body = b""  # (the bytes as received: `body` alone holds them now)
            tap.model = model.name
            if self.recent.wants_body(model.name):
                tap.body = bytes(body)[: MAX_CAPTURE_BYTES + 1]
            affinity = model.spec.affinity_header
            session = request.headers.get(affinity) if affinity else None
            send = self._lease_and_relay(
                request, path, body, model, session, tap, parsed.stream, adapter
            )
            return await self.counted(model.name, tap, send)
        finally:
            hold.release()

    async def _lease_and_relay(
        self,
        request: web.Request,
        path: str,
        body: Body | BodySource,
        model: Model,
        session: str | None,
        tap: Tap,
        stream: bool,
        adapter: AdapterSpec | None,
    ) -> web.StreamResponse:
        """Lease an engine of `model` (with `adapter` registered on it) and relay `body`."""
        # A stream that may wait (no engine serves, or the queue may hold it behind a swap)
        # gets keep-alives while it waits (an upload does not: its client is still sending).
        if stream and (model.serving() is None or self.manager.queue.tickets):
            return await self._forward_loading(request, path, body, model, session, tap, adapter)
        if adapter is not None:
            lease = self.manager.lease(model, session, adapter.name, key_priority(request))
            async with lease as engine:
                tap.instance, tap.leased = engine.instance, time.monotonic()
                return await self._relay_adapter(request, path, body, engine, tap, adapter)
        lease = self.manager.lease(model, session, None, key_priority(request))
        async with lease as engine:
            tap.instance, tap.leased = engine.instance, time.monotonic()
            return await self.relay.answer(request, path, body, engine, tap)

    async def forward_upload(self, request: web.Request) -> web.StreamResponse:
        """Route a form upload (vLLM's speech-to-text routes) by its ``model`` field."""
        with self.key_use(request):
            return await self._forward_upload(request, request.raw_path, None)

    async def _forward_upload(
        self, request: web.Request, path: str, forced: str | None
    ) -> web.StreamResponse:
        """`_forward` for a form: the body goes on while it arrives (`bytes.upload`), once its model
        is known and a lease held. An upload waits for its engine without keep-alives: its
        client is still sending."""
        tap = request[TAP]
        if self.manager.closing:
            raise Unavailable("the proxy is shutting down", code="shutting_down")
        # A model in the path is known before anything is read.
        model = None if forced is None else self.resolve(request, forced, observe=True)
        hold = self.bodies.hold()  # what is kept in memory before the model is known
        spooled = self.spools.hold()  # ... and on disk
        upload = open_upload(request, self.max_body_bytes, self.body_timeout_s, hold, spooled)
        try:
            named = await upload.find_model()  # (with a model in the path: to replace it)
            if model is None:
                if not named:
                    raise BadRequest(MISSING, param="model")
                model = self.resolve(request, named, observe=True)
            upload.rename_to(model.name, forced is not None)
            tap.model = model.name
            affinity = model.spec.affinity_header
            session = request.headers.get(affinity) if affinity else None
            send = self._lease_and_relay(request, path, upload, model, session, tap, False, None)
            return await self.counted(model.name, tap, send)
        finally:
            upload.close()
            spooled.release()
            hold.release()

    async def _forward_loading(
        self,
        request: web.Request,
        path: str,
        body: Body | BodySource,
        model: Model,
        session: str | None,
        tap: Tap,
        adapter: AdapterSpec | None = None,
    ) -> web.StreamResponse:
        """A stream that may wait (no serving instance: it starts or wakes; or the admission
        queue holds it behind a swap): if no instance serves within
        ``loading_keepalive_interval_s``, answer 200 with ``text/event-stream`` and send an SSE
        comment (``: loading <model>``) every ``loading_keepalive_interval_s`` so balancers and
        clients in between keep the connection; with ``loading_progress`` a chat stream gets
        visible progress (``reasoning_content`` chunks) instead. Then the engine's stream
        follows byte for byte; a failure after the 200 is an SSE error event and
        ``data: [DONE]``."""
        lease = self.manager.lease(
            model, session, adapter.name if adapter else None, key_priority(request)
        )
        acquiring = asyncio.ensure_future(lease.__aenter__())
        spec = model.spec
        progress = spec.loading_progress and path.endswith("/chat/completions")
        resp: web.StreamResponse | None = None
        waited, every = 0.0, spec.loading_keepalive_interval_s
        try:
            while not (await asyncio.wait({acquiring}, timeout=every))[0]:
                waited += every
                if resp is None:
                    resp = _sse_response(request)
                    await resp.prepare(request)
                if progress:
                    await resp.write(_progress_chunk(model.name, request[REQUEST_ID], waited))
                else:
                    await resp.write(b": loading %s\n\n" % model.name.encode())
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            tap.client_gone = True
            _abandon(lease, acquiring)
            assert resp is not None
            return resp
        except BaseException:  # cancelled (client gone): the start goes on for the others
            _abandon(lease, acquiring)
            raise
        try:
            engine = acquiring.result()
        except ProxyError as err:
            if resp is None:
                raise
            await write_quietly(resp, sse_error(err.message, err.type_, str(err.code)))
            return resp
        try:
            tap.instance, tap.leased = engine.instance, time.monotonic()
            if adapter is not None:
                return await self._relay_adapter(request, path, body, engine, tap, adapter, resp)
            return await self.relay.answer(request, path, body, engine, tap, resp)
        finally:
            lease.release()

    async def _relay_adapter(
        self,
        request: web.Request,
        path: str,
        body: Body | BodySource,
        engine: Upstream,
        tap: Tap,
        adapter: AdapterSpec,
        prepared: web.StreamResponse | None = None,
    ) -> web.StreamResponse:
        """`Relay.answer` for a request that names a LoRA adapter: the engine registers it first
        (one load per adapter and engine however many requests wait; see `lora`), and it
        counts as in use, never unloaded for another, until the response has ended."""
        self.metrics.adapter_requests.labels(engine.model, adapter.name).inc()
        use = engine.adapter(adapter)
        try:
            async with use:
                return await self.relay.answer(request, path, body, engine, tap, prepared)
        except ProxyError as err:
            if prepared is None or use.entered:  # (the relay's own errors go on as before)
                raise
            await write_quietly(prepared, sse_error(err.message, err.type_, str(err.code)))
            return prepared

    # -- proxy's own routes --------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        cards = await self.catalogue.cards(narrowed(request))
        return web.json_response({"object": "list", "data": cards})

    async def model(self, request: web.Request) -> web.Response:
        wanted = request.match_info["model"]
        card = await self.catalogue.card(narrowed(request), wanted)
        if card is not None:
            return web.json_response(card)
        self.resolve(request, wanted)  # raises NotFound with the list of valid names
        raise NotFound(f"The model '{wanted}' does not exist.")  # pragma: no cover

    async def prefixed_models(self, request: web.Request) -> web.Response:
        name = self.resolve(request, request.match_info["model"]).name
        card = await self.catalogue.card(narrowed(request), name)
        return web.json_response({"object": "list", "data": [] if card is None else [card]})

    async def health(self, request: web.Request) -> web.Response:
        """200 while the proxy takes requests; 503 + ``Retry-After`` from the moment a drain
        starts (SIGTERM), while in-flight requests finish: a load balancer stops sending here
        before the engines stop."""
        if self.manager.closing:
            return web.json_response(
                {"status": "shutting_down"},
                status=503,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        body: dict[str, object] = {"status": "ok"}
        if self.manager.preloading:  # the proxy serves meanwhile; these models are coming up
            body["preloading"] = sorted(self.manager.preloading)
        return web.json_response(body)

    async def metrics_page(self, request: web.Request) -> web.Response:
        self.manager.update_metrics()
        if self.manager.memory is not None:
            self.manager.memory.update_metrics()
        resp = web.Response(body=self.metrics.render())
        resp.headers["Content-Type"] = self.metrics.content_type
        return resp


def _sse_response(request: web.Request) -> web.StreamResponse:
    """The 200 of a stream that is answered before its engine is up."""
    resp = web.StreamResponse(status=200)
    resp.headers["Content-Type"] = "text/event-stream; charset=utf-8"
    resp.headers["Cache-Control"] = "no-cache"
    resp.headers["X-Accel-Buffering"] = "no"
    resp.headers["X-Request-ID"] = request[REQUEST_ID]
    return resp


def _progress_chunk(model: str, rid: str, waited: float) -> bytes:
    """Visible loading progress for chat UIs: a chunk whose delta is ``reasoning_content``
    (shown as "thinking", not as the answer)."""
    chunk = {
        "id": f"loading-{rid}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "delta": {"reasoning_content": f"Loading model {model}... {waited:.0f}s\n"},
                "finish_reason": None,
            }
        ],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _abandon(lease: Lease, acquiring: asyncio.Future[Upstream]) -> None:
    """Stop waiting for an instance; a lease that was taken meanwhile goes back."""
    if not acquiring.done():
        acquiring.cancel()
    elif not acquiring.cancelled() and acquiring.exception() is None:
        lease.release()


def add_routes(app: web.Application, proxy: OpenAIRoutes) -> None:
    for path in MODEL_ROUTES:
        app.router.add_post(path, proxy.forward)
    for path in UPLOAD_ROUTES:
        app.router.add_post(path, proxy.forward_upload)
    app.router.add_post("/serve/{model}/v1/{tail:.+}", proxy.forward_prefixed)
    app.router.add_get("/serve/{model}/v1/models", proxy.prefixed_models)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/v1/models/{model:.+}", proxy.model)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/metrics", proxy.metrics_page)
