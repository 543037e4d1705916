"""What every route shares: the door every request goes through, whatever its URL.

* request ids and the OpenAI-shaped errors (`Serving.middleware`, `error_response`);
* API keys: who may call a model route, the admin API (`check_key`);
* resolution within a key's scope: a model outside it is answered as one that does not exist
  (`Serving.resolve`, `Serving.resolve_target`);
* key limits: a request counted for its key while it lasts (`Serving.key_use`);
* budgets: the bytes of bodies held and of uploads spooled (`Serving.bodies`, `Serving.spools`);
* observation: what a response carried (`Tap`), the request's metrics (`Serving.observe`,
  `Serving.counted`), the access log and the ring of recent requests.

The OpenAI routes (`routes.openai.OpenAIRoutes`) are a `Serving`; the realtime route uses one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator

from aiohttp import web

from ..adapters import AdapterSpec
from ..config import ServerConfig
from ..errors import (
    RETRY_AFTER_S,
    BadRequest,
    Forbidden,
    MethodNotAllowed,
    NotFound,
    ProxyError,
    TooManyRequests,
    Unauthorized,
)
from ..metrics import KeySeries, Metrics
from ..pool.manager import Manager
from ..pool.views import Model
from .bytes import heap
from .bytes.intake import MIB, Bodies, Hold, too_large
from .keys import KeyLimits, KeyRing, Scope, bearer
from .recent import Recent
from .routes import paths
from .upstream import ClientRelay, Tail, UpstreamPool

log = logging.getLogger(__name__)

#: The status a request is counted with when its client went away before the answer ended.
CLIENT_CLOSED = "499"
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
#: The scope of the request's API key (`Serving.key_use`; `narrowed` for its models).
SCOPE = web.RequestKey("key_scope", Scope)
#: The request's share of ``server.max_bodies_mb`` (given back once its body is sent).
BODY_HOLD = web.RequestKey("body_hold", Hold)
#: Why a model route refused a request's key.
KEY_REFUSAL = "missing or invalid API key (expected 'Authorization: Bearer KEY')"


def narrowed(request: web.Request) -> Scope | None:
    """The scope of the request's key when it is limited to some models."""
    scope = request.get(SCOPE)
    return None if scope is None or scope.everything else scope


def key_priority(request: web.Request) -> int:
    """The ``priority`` of the request's API key (0 without one)."""
    scope = request.get(SCOPE)
    return 0 if scope is None else scope.priority


class Serving:
    """What the routes of one proxy share (one per application): the manager to resolve
    models in, the metrics, the client to engines, the budgets of bodies and spooled uploads,
    the API keys with their limits, and the ring of recent requests."""

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
        #: Every key's requests in flight and recent starts (kept across reloads).
        self.key_limits = KeyLimits()
        self.configure(server)
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
        guarded = paths.guarded(path)
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

    def resolve_target(
        self, request: web.Request, requested: str
    ) -> tuple[Model, AdapterSpec | None]:
        """The LoRA adapter `requested` names with its base model, if the request's key may
        use that model; else `resolve` (the model, or 404)."""
        scope = narrowed(request)
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
        scope = narrowed(request)
        if scope is None:
            return self.manager.resolve(requested)
        try:
            return self.manager.resolve(requested, lambda m: scope.allows(m.name, m.spec.aliases))
        except NotFound:
            target = self.manager.names.get(requested)
            if observe and target is not None:
                self.metrics.series(target).count("404")
            raise

    def observe(self, model: str, status: str, started: float, tap: Tap) -> None:
        """Count a request that ended with `status` in its model's series (and its tokens in
        its key's)."""
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

    async def counted(
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


def check_key(request: web.Request, keys: list[bytes], refusal: str = KEY_REFUSAL) -> None:
    """`Unauthorized` (with `refusal`) unless the request's bearer token is one of `keys`,
    compared in constant time with every key."""
    given = bearer(request.headers.get("Authorization", ""))
    ok = False
    for key in keys:  # compare with every key: no early exit on a match
        ok |= hmac.compare_digest(given or b"", key)
    if given is None or not ok:
        raise Unauthorized(refusal)


def client_of(request: web.Request) -> str:
    """Who a request's body counts for in the share of compressed bodies: its API key, else
    the address it came from."""
    scope = request.get(SCOPE)
    if scope is not None and scope.ident:
        return "key " + scope.ident
    return "address " + str(request.remote)


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
