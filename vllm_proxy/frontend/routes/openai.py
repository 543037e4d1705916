"""aiohttp handlers: parse just enough, hold a lease, pass bytes through, answer errors.

The request body is forwarded as received; only the ``model`` field is read (and rewritten when
the client used an alias): see `body`. Streams are passed through chunk by chunk as they arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from urllib.parse import urlencode

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from multidict import CIMultiDict

from ...adapters import AdapterSpec
from ...config import ServerConfig
from ...errors import (
    RETRY_AFTER_S,
    BadRequest,
    EngineTimeout,
    Forbidden,
    MethodNotAllowed,
    NotFound,
    ProxyError,
    TooManyRequests,
    Unauthorized,
    Unavailable,
    error_body,
)
from ...metrics import KeySeries, Metrics
from ...pool.lease import Lease, Upstream
from ...pool.manager import Manager
from ...pool.views import Model
from .. import realtime_relay
from ..bytes import heap
from ..bytes.body import Body, bulk, model_of
from ..bytes.form import MISSING
from ..bytes.intake import MIB, Bodies, Hold, read_body, too_large
from ..bytes.upload import open_upload
from ..keys import KeyLimits, KeyRing, Scope, bearer
from ..recent import MAX_CAPTURE_BYTES, Recent
from ..upstream import (
    BodySource,
    ClientRelay,
    NoSlot,
    Tail,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
)
from .catalogue import Catalogue

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

#: POST endpoints routed to an engine by the body's ``model``: every JSON route of vLLM that
#: names one (docs/design.md, "Routes that name a model").
MODEL_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/score",
    "/v1/rerank",
    "/tokenize",
    "/detokenize",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/chat/completions/batch",
    "/v2/embed",
    "/pooling",
    "/classify",
    "/score",
    "/rerank",
    "/v2/rerank",
    "/generative_scoring",
    "/v1/decisions",
    "/v1/systemone",
    "/cohere/v2/chat",
    "/invocations",
    # vLLM's scale-out routes (``--enable-scale-out``, ``--tokens-only``)
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v1/messages/render",
    "/v1/responses/render",
    "/cohere/v2/chat/render",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
    "/inference/v1/generate",
)
#: POST endpoints whose body is a form upload, routed by its ``model`` field (`upload`).
UPLOAD_ROUTES = ("/v1/audio/transcriptions", "/v1/audio/translations")
CLIENT_CLOSED = "499"
#: How long a realtime client has to answer the proxy's close frame.
CLOSE_TIMEOUT_S = 2.0
#: Bytes queued for a client beyond which a write is timed (``server.send_timeout_s``).
SEND_BACKLOG = 64 * 1024


class ClientTooSlow(Exception):
    """The client did not take its response for ``send_timeout_s``."""


REQUEST_ID = web.RequestKey("request_id", str)
ENGINE_ID = web.RequestKey("engine_request_id", str)
#: One line per request on the model routes (``server.access_log``).
ACCESS = logging.getLogger("vllm_proxy.access")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(err: ProxyError, request_id: str | None = None) -> web.Response:
    """The OpenAI-shaped error; with the request id in ``X-Request-ID`` and, for the proxy's and
    engines' failures (5xx), in the message, so an operator can find it in the log. A 503 always
    carries ``Retry-After``: a client backs off, a load balancer tries another server."""
    headers = dict(err.headers)
    if err.status == 503:
        headers.setdefault("Retry-After", str(RETRY_AFTER_S))
    body = err.body()
    if request_id is not None:
        headers["X-Request-ID"] = request_id
        if err.status >= 500:
            body["error"]["message"] += f" (request id {request_id})"
    return web.Response(
        status=err.status,
        body=json.dumps(body).encode(),
        content_type="application/json",
        headers=headers,
    )


def sse_error(message: str, type_: str, code: str) -> bytes:
    event = json.dumps(error_body(message, type_, code))
    return f"data: {event}\n\ndata: [DONE]\n\n".encode()


#: What precedes the token counts in a response (the last such object is the final one).
USAGE = b'"usage":'
#: A token count above this in an engine's usage is counted as this.
MAX_TOKENS = 1 << 31


class Tap:
    """What the request path notes about a response without buffering it: first byte, usage,
    bytes sent, and whether the client went away."""

    __slots__ = ("body", "bytes", "client_gone", "ended", "first_byte", "instance", "key",
                 "leased", "model", "started", "usage")  # fmt: skip

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.first_byte: float | None = None
        self.usage = Tail(USAGE)
        self.bytes = 0
        self.client_gone = False
        self.model = "-"
        self.instance = "-"
        #: The status of an exchange that ended before its handler was cancelled: a WebSocket
        #: closed by its client (aiohttp cancels the handler when the connection then goes).
        self.ended: int | None = None
        #: The request's API key: its label (the access log) and its series (its tokens).
        self.key: tuple[str, KeySeries] | None = None
        #: When an engine was leased for it (the end of its wait in the queue).
        self.leased: float | None = None
        #: Its body, only while the console captures its model's (`Recent.capture`).
        self.body: bytes | None = None

    def feed(self, chunk: bytes) -> None:
        """Keep the bytes from the last ``"usage":`` on (bounded), across chunk boundaries."""
        self.usage.feed(chunk)

    def relayed(self, relay: ClientRelay) -> None:
        """Take what a stream's relay noted: its bytes, its first write, and its last writes,
        where the closing ``"usage":`` object is."""
        if relay.first_at is not None and self.first_byte is None:
            self.first_byte = relay.first_at
        self.bytes += relay.bytes
        if relay.recent:
            self.feed(b"".join(relay.recent))

    def tokens(self) -> tuple[int, int] | None:
        """(prompt, completion) tokens from the last usage object seen, if any."""
        if not self.usage.text:
            return None
        try:
            text = self.usage.text.decode("utf-8", "replace").lstrip()
            usage, _ = _DECODER.raw_decode(text)
            prompt = usage.get("prompt_tokens", usage.get("input_tokens"))  # (or Anthropic's)
            completion = usage.get("completion_tokens", usage.get("output_tokens"))
            return min(int(prompt or 0), MAX_TOKENS), min(int(completion or 0), MAX_TOKENS)
        except (ValueError, AttributeError, TypeError, OverflowError):  # 1e999 is inf
            return None


_DECODER = json.JSONDecoder()
#: Below this, the time from the first byte is no measure of generation (a whole answer in one
#: write): tokens per second are counted from the lease instead.
MIN_GEN_S = 0.05
#: What a client's request id may be made of: no space, no control character.
_TOKEN = re.compile(r"[A-Za-z0-9\-._:~+/=]+")
#: Characters escaped in access-log fields: controls, space, backslash, quotes, non-ASCII.
_UNSAFE = re.compile(r'[^\x21-\x7e]|[\\"]')


def _escaped(text: str) -> str:
    """`text` with every character that could end an access-log line or blur its fields (a
    control, a space, a quote, a backslash, anything not ASCII) written as an escape."""
    return _UNSAFE.sub(_escape_char, text) if _UNSAFE.search(text) else text


def _escape_char(match: re.Match[str]) -> str:
    char = match.group()
    if char == "\\":
        return "\\\\"
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


TAP = web.RequestKey("tap", Tap)
#: The scope of the request's API key (`Proxy.key_use`; `_narrowed` for its models).
SCOPE = web.RequestKey("key_scope", Scope)
#: The request's share of ``server.max_bodies_mb`` (given back once its body is sent).
BODY_HOLD = web.RequestKey("body_hold", Hold)
#: Why a model route refused a request's key.
KEY_REFUSAL = "missing or invalid API key (expected 'Authorization: Bearer KEY')"


def _narrowed(request: web.Request) -> Scope | None:
    """The scope of the request's key when it is limited to some models."""
    scope = request.get(SCOPE)
    return None if scope is None or scope.everything else scope


def key_priority(request: web.Request) -> int:
    """The ``priority`` of the request's API key (0 without one)."""
    scope = request.get(SCOPE)
    return 0 if scope is None else scope.priority


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


#: The ``/v1/...`` routes a ``/serve/{model}/v1/{tail}`` path may reach.
PREFIXED_TAILS = frozenset(
    r.removeprefix("/v1/") for r in (*MODEL_ROUTES, *UPLOAD_ROUTES) if r.startswith("/v1/")
)
UPLOAD_TAILS = frozenset(r.removeprefix("/v1/") for r in UPLOAD_ROUTES)


class Proxy:
    """The request path: one instance per application."""

    def __init__(
        self,
        manager: Manager,
        metrics: Metrics,
        upstream: UpstreamPool,
        server: ServerConfig,
    ) -> None:
        self.manager = manager
        self.metrics = metrics
        self.upstream = upstream
        self.max_body_bytes = int(server.max_body_mb * MIB)
        #: Request bodies held by all requests (``server.max_bodies_mb``).
        self.bodies = Bodies(int(server.max_bodies_mb * MIB), heap.give_back())
        #: Uploads spooled to disk by all requests (``server.max_spool_mb``).
        self.spools = Bodies(
            int(server.max_spool_mb * MIB),
            key="server.max_spool_mb",
            what="uploads spooled to disk",
            code="upload_spool_full",
        )
        bulk()  # the scan's regexes, compiled now rather than when the first body needs them
        #: Every key's requests in flight and recent starts (kept across reloads).
        self.key_limits = KeyLimits()
        self.configure(server)
        #: What ``/v1/models`` lists.
        self.catalogue = Catalogue(manager, int(time.time()))
        #: The last requests, for the console and ``vllm-proxy ctl``.
        self.recent = Recent()
        #: Request ids made here: a random prefix per proxy process and a counter (cheap, unique).
        self._rid_prefix = secrets.token_hex(4)
        self._rid_seq = 0

    def configure(self, server: ServerConfig) -> None:
        """Apply the keys of a (re)loaded config."""
        self.api_keys = KeyRing(server.api_keys)
        scopes = self.api_keys.scopes()
        self.key_limits.keep(scopes)
        self.metrics.keep_keys({scope.label for scope in scopes})
        self.admin_keys = [k.encode() for k in server.admin_api_keys] + self.api_keys.admin_keys()
        self.admin_open = server.admin_open
        self.access_log = server.access_log
        self.body_timeout_s = server.body_timeout_s
        self.send_timeout_s = server.send_timeout_s
        self.bodies.limit = int(server.max_bodies_mb * MIB)
        self.spools.limit = int(server.max_spool_mb * MIB)

    # -- middleware ----------------------------------------------------------------------

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Request ids, API keys on the OpenAI routes, OpenAI-shaped errors for everything, and
        one access-log line per request on the model routes (one frame: it is on every
        request)."""
        rid = request[REQUEST_ID] = self._request_id(request)
        tap = request[TAP] = Tap()
        path = request.path
        guarded = _guarded(path)
        try:
            if path.startswith("/admin"):
                self._check_admin(request)
            elif guarded and self.api_keys:
                self._check_api_key(request)
            resp = await handler(request)
            if not resp.prepared:
                resp.headers["X-Request-ID"] = rid
        except ProxyError as err:
            resp = error_response(err, rid)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            resp = error_response(_from_http_exception(exc, request, self.max_body_bytes), rid)
        except (asyncio.CancelledError, ConnectionResetError):
            if guarded:
                self._remember(request, rid, tap, tap.ended or 499)
                if self.access_log:
                    self._access(request, rid, tap, tap.ended or 499)
            raise
        except Exception:
            log.exception("unexpected error while handling %s %s (request %s)",
                          request.method, path, rid)  # fmt: skip
            resp = error_response(ProxyError("internal error in the proxy; see its log"), rid)
        if guarded:
            self._remember(request, rid, tap, resp.status)
            if self.access_log and ACCESS.isEnabledFor(logging.INFO):
                self._access(request, rid, tap, resp.status)
        return resp

    def _remember(self, request: web.Request, rid: str, tap: Tap, status: int) -> None:
        """The request in the console's ring of recent ones (no body unless captured)."""
        if tap.model in ("-", None):
            return  # refused before it named a model (a bad key, a bad body): the log has it
        now = time.monotonic()
        usage = tap.tokens()
        ttft = tap.first_byte - tap.started if tap.first_byte is not None else None
        out = usage[1] if usage else None
        # Generation time: from the first byte for a stream, else the whole time on the engine.
        gen_s = now - tap.first_byte if tap.first_byte is not None else None
        if gen_s is not None and gen_s < MIN_GEN_S and tap.leased is not None:
            gen_s = now - tap.leased
        self.recent.add(
            {
                "id": rid, "t": time.time(), "model": tap.model, "instance": tap.instance,
                "key": tap.key[0] if tap.key is not None else None,
                "route": request.path[:200], "status": 499 if tap.client_gone else status,
                "wait_s": round(tap.leased - tap.started, 4) if tap.leased else None,
                "ttft_s": round(ttft, 4) if ttft is not None else None,
                "tokens_in": usage[0] if usage else None, "tokens_out": out,
                "tokens_per_s": round(out / gen_s, 1) if out and gen_s else None,
                "duration_s": round(now - tap.started, 4),
            },
            tap.body,
        )  # fmt: skip

    def _access(self, request: web.Request, rid: str, tap: Tap, status: int) -> None:
        # The path and the model come from the client: escaped, so that no value can end the
        # line or pass for another field (the request id is a token, see `_request_id`; a
        # key's label is the operator's, see `config.ApiKey.name`).
        ACCESS.info(
            "%s %s %s model=%s instance=%s status=%d bytes=%d duration_ms=%.1f%s",
            rid, request.method, _escaped(request.path),
            _escaped(tap.model) if tap.model is not None else None, tap.instance,
            499 if tap.client_gone else status, tap.bytes,
            (time.monotonic() - tap.started) * 1000,
            "" if tap.key is None else " key=" + tap.key[0],
        )  # fmt: skip

    def _request_id(self, request: web.Request) -> str:
        """The client's ``X-Request-ID`` when it is a token (letters, digits and ``-._:~+/=``,
        at most 128), else a new one."""
        self._rid_seq += 1
        own = f"{self._rid_prefix}-{self._rid_seq:x}"
        given = request.headers.get("X-Request-ID")
        if given and len(given) <= 128 and _TOKEN.fullmatch(given):
            # vLLM takes the header as its own request id, which must be unique: the engine
            # gets the client's id with ours appended (`ENGINE_ID`), the client its own back.
            request[ENGINE_ID] = f"{given}.{own}"
            return given
        request[ENGINE_ID] = own
        return own

    def _check_admin(self, request: web.Request) -> None:
        if self.admin_keys:
            check_key(request, self.admin_keys)
        elif not self.admin_open:
            raise Forbidden(
                "the admin API is disabled: set server.admin_api_keys (or server.admin_open: true)"
            )

    def _check_api_key(self, request: web.Request) -> None:
        """401 unless the request carries a key of ``server.api_keys``; the key's scope is
        left on the request, for `resolve` and `key_use`."""
        token = bearer(request.headers.get("Authorization", ""))
        scope = self.api_keys.find(token) if token is not None else None
        if scope is None:
            raise Unauthorized(KEY_REFUSAL)
        request[SCOPE] = scope

    @contextlib.contextmanager
    def key_use(self, request: web.Request) -> Iterator[None]:
        """The request counted for its API key while in the block: in the key's series, and
        against its ``max_concurrent_requests`` and ``max_requests_per_minute`` (past one,
        `TooManyRequests` and a count of the refusal). Held for the whole request: its
        stream, upload or realtime session."""
        scope = request.get(SCOPE)
        if scope is None:
            yield
            return
        series = self.metrics.key_series(scope.label)
        request[TAP].key = (scope.label, series)
        series.requests += 1
        try:
            self.key_limits.take(scope)
        except TooManyRequests as err:
            series.reject(err.reason)
            raise
        try:
            yield
        finally:
            self.key_limits.release(scope)

    def _resolve_target(
        self, request: web.Request, requested: str
    ) -> tuple[Model, AdapterSpec | None]:
        """The LoRA adapter `requested` names with its base model, if the request's key may
        use that model; else `_resolve` (the model, or 404)."""
        scope = _narrowed(request)
        visible = None if scope is None else (lambda m: scope.allows(m.name, m.spec.aliases))
        found = self.manager.find_adapter(requested, visible)
        if found is not None:
            return found
        return self.resolve(request, requested, observe=True), None

    def resolve(self, request: web.Request, requested: str, observe: bool = False) -> Model:
        """The model `requested` names, if the request's key may use it. A model outside the
        key's scope is answered as one that does not exist, listing only the key's models, so
        a key learns nothing of the others; with `observe` that refusal is counted as a 404
        of the model. Every route that finds a model by name goes through here."""
        scope = _narrowed(request)
        if scope is None:
            return self.manager.resolve(requested)
        try:
            return self.manager.resolve(requested, lambda m: scope.allows(m.name, m.spec.aliases))
        except NotFound:
            target = self.manager.names.get(requested)
            if observe and target is not None:
                self.metrics.series(target).count("404")
            raise

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
        hold = request[BODY_HOLD] = self.bodies.hold(_client(request))
        try:
            body, scanned = await read_body(request, self.max_body_bytes, self.body_timeout_s, hold)
            parsed = model_of(body, forced, scanned)
            model, adapter = self._resolve_target(request, parsed.model)
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
            return await self._counted(model.name, tap, send)
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
            return await self._relay(request, path, body, engine, tap)

    async def _counted(
        self, model: str, tap: Tap, send: Awaitable[web.StreamResponse]
    ) -> web.StreamResponse:
        """`send`'s response; the request is counted for `model` by how it ended (its status,
        the client gone, or an error)."""
        status = "error"
        try:
            resp = await send
            status = CLIENT_CLOSED if tap.client_gone else str(resp.status)
            return resp
        except ProxyError as err:
            status = str(err.status)
            raise
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            raise
        finally:
            self.observe(model, status, tap.started, tap)

    async def forward_upload(self, request: web.Request) -> web.StreamResponse:
        """Route a form upload (vLLM's speech-to-text routes) by its ``model`` field."""
        with self.key_use(request):
            return await self._forward_upload(request, request.raw_path, None)

    async def _forward_upload(
        self, request: web.Request, path: str, forced: str | None
    ) -> web.StreamResponse:
        """`_forward` for a form: the body goes on while it arrives (`upload`), once its model
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
            return await self._counted(model.name, tap, send)
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
            await _write_quietly(resp, sse_error(err.message, err.type_, str(err.code)))
            return resp
        try:
            tap.instance, tap.leased = engine.instance, time.monotonic()
            if adapter is not None:
                return await self._relay_adapter(request, path, body, engine, tap, adapter, resp)
            return await self._relay(request, path, body, engine, tap, resp)
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
        """`_relay` for a request that names a LoRA adapter: the engine registers it first
        (one load per adapter and engine however many requests wait; see `lora`), and it
        counts as in use, never unloaded for another, until the response has ended."""
        self.metrics.adapter_requests.labels(engine.model, adapter.name).inc()
        use = engine.adapter(adapter)
        try:
            async with use:
                return await self._relay(request, path, body, engine, tap, prepared)
        except ProxyError as err:
            if prepared is None or use.entered:  # (the relay's own errors go on as before)
                raise
            await _write_quietly(prepared, sse_error(err.message, err.type_, str(err.code)))
            return prepared

    def observe(self, model: str, status: str, started: float, tap: Tap) -> None:
        series = self.metrics.series(model)
        series.count(status)
        series.duration.observe(time.monotonic() - started)
        if tap.first_byte is not None:
            series.ttfb.observe(tap.first_byte - started)
        usage = tap.tokens()
        if usage is not None:  # (an engine's negative count would make a counter go down)
            prompt, completion = max(0, usage[0]), max(0, usage[1])
            series.prompt += prompt
            series.completion += completion
            if tap.key is not None:
                tap.key[1].prompt += prompt
                tap.key[1].completion += completion

    async def _relay(
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
            up = await self.upstream.request(
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
            raise self.read_timeout(engine) from None
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
                raise self.read_timeout(engine) from None
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
        await _write_quietly(resp, sse_error(message, "engine_error", str(up.status)))
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
            async with asyncio.timeout(self.send_timeout_s):
                await resp.write(chunk)
        except TimeoutError:
            log.warning("request %s: the client took nothing for %gs, dropped",
                        request[REQUEST_ID], self.send_timeout_s)  # fmt: skip
            transport.abort()
            raise ClientTooSlow from None

    @staticmethod
    def read_timeout(engine: Upstream) -> EngineTimeout:
        return EngineTimeout(
            f"model '{engine.model}': no data from the engine for {engine.read_timeout_s:g}s",
            code="engine_read_timeout",
        )

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
            await _write_quietly(resp, sse_error(msg, "engine_error", "engine_read_timeout"))
            return resp
        except UpstreamError as cause:
            err = await engine.failure(cause)
            await _write_quietly(resp, sse_error(err.message, err.type_, str(err.code)))
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
            async with asyncio.timeout(self.send_timeout_s):
                await writer.drain()
        except TimeoutError:
            log.warning("request %s: the client took nothing for %gs, dropped",
                        request[REQUEST_ID], self.send_timeout_s)  # fmt: skip
            transport.abort()
            raise ClientTooSlow from None

    # -- proxy's own routes --------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        cards = await self.catalogue.cards(_narrowed(request))
        return web.json_response({"object": "list", "data": cards})

    async def model(self, request: web.Request) -> web.Response:
        wanted = request.match_info["model"]
        card = await self.catalogue.card(_narrowed(request), wanted)
        if card is not None:
            return web.json_response(card)
        self.resolve(request, wanted)  # raises NotFound with the list of valid names
        raise NotFound(f"The model '{wanted}' does not exist.")  # pragma: no cover

    async def prefixed_models(self, request: web.Request) -> web.Response:
        name = self.resolve(request, request.match_info["model"]).name
        card = await self.catalogue.card(_narrowed(request), name)
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


def check_key(request: web.Request, keys: list[bytes], refusal: str = KEY_REFUSAL) -> None:
    """`Unauthorized` (with `refusal`) unless the request's bearer token is one of `keys`,
    compared in constant time with every key."""
    given = bearer(request.headers.get("Authorization", ""))
    ok = False
    for key in keys:  # compare with every key: no early exit on a match
        ok |= hmac.compare_digest(given or b"", key)
    if given is None or not ok:
        raise Unauthorized(refusal)


def _client(request: web.Request) -> str:
    """Who a request's body counts for in the share of compressed bodies: its API key, else
    the address it came from."""
    scope = request.get(SCOPE)
    if scope is not None and scope.ident:
        return "key " + scope.ident
    return "address " + str(request.remote)


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


async def _write_quietly(resp: web.StreamResponse, data: bytes) -> None:
    try:
        await resp.write(data)
        await resp.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        pass


#: The model routes outside ``/v1/``.
_ROOT_ROUTES = frozenset(r for r in MODEL_ROUTES if not r.startswith("/v1/"))
#: Routes a page of any site could reach without a CORS preflight and be served (`opens_to_pages`).
_PAGE_ROUTES = frozenset((*UPLOAD_ROUTES, realtime_relay.PATH))
_PAGE_TAILS = tuple(r.removeprefix("/v1") for r in _PAGE_ROUTES)


def _guarded(path: str) -> bool:
    return path.startswith(("/v1/", "/serve/")) or path in _ROOT_ROUTES


def opens_to_pages(path: str) -> bool:
    """Whether a browser page of any site could make a request to `path` without a CORS
    preflight, and be served: a form upload or a WebSocket (the JSON routes refuse the types
    a page may send without one: `intake.check_type`)."""
    return path in _PAGE_ROUTES or (path.startswith("/serve/") and path.endswith(_PAGE_TAILS))


def _from_http_exception(exc: web.HTTPException, request: web.Request, limit: int) -> ProxyError:
    """aiohttp's own refusals (routing, body size) in the OpenAI shape."""
    if exc.status == 413:
        return too_large(limit)
    if exc.status == 404:
        return NotFound(
            f"unknown endpoint {request.method} {request.path}", code="unknown_endpoint"
        )
    if exc.status == 405:
        allowed = sorted(getattr(exc, "allowed_methods", ()) or ())
        return MethodNotAllowed(
            f"method {request.method} not allowed on {request.path}",
            headers={"Allow": ", ".join(allowed)} if allowed else None,
        )
    return BadRequest(exc.reason or "bad request", status=exc.status)


def add_routes(app: web.Application, proxy: Proxy) -> None:
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
