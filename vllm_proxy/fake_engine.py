"""A fake vLLM OpenAI-compatible server for component tests, benchmarks and the no-GPU demo.

Run it the way the proxy runs vLLM::

    python -m vllm_proxy.fake_engine --model m --served-model-name m alias --port 8001

Understood flags: ``--model`` (default ``fake-model``), ``--served-model-name A [B ...]``
(first name is the response ``model``; any listed name is accepted), ``--host`` (default
127.0.0.1), ``--port`` (default 8000), ``--max-model-len`` (default 2048; ``4k``/``4K``/``auto``
accepted), ``--max-num-seqs`` (default 256; more concurrent requests queue as "waiting"),
``--tensor-parallel-size``/``-tp`` (entries in ``/collective_rpc`` results) and ``--api-key``
(also ``VLLM_API_KEY``; guards ``/v1*`` with 401 ``{"error":"Unauthorized"}``). Flags may be
spelled with ``_`` or ``-``; every other flag is accepted and ignored.

It mimics the newest vLLM server: the port is bound only when the "engine" is ready (connections
are refused before), ``Errno 98`` and exit 1 when the port is taken, nested OpenAI error bodies,
``{"detail": ...}`` for unknown routes, vLLM's exact JSON and SSE shapes, Prometheus ``/metrics``
with ``vllm:*`` series, dev-mode sleep endpoints (``VLLM_SERVER_DEV_MODE=1``) that park requests
until ``/wake_up``, and SIGTERM/SIGINT aborting in-flight requests (``finish_reason: "abort"``)
before exiting 0. Replies are the words ``tok0 tok1 ...``; prompt tokens are counted as words.
``/v1/embeddings`` returns deterministic unit vectors of dimension 8. Nothing is logged per request.
``/sleep`` takes ``level`` (0-2) and ``mode`` (``abort``: in-flight requests end with ``abort``;
``wait``: drain first; ``keep``: freeze them until woken). As in vLLM, requests parked by sleep do
not show in ``vllm:num_requests_waiting``; requests queued beyond ``--max-num-seqs`` do.

Knobs (environment variables):

``FAKE_ENGINE_STARTUP_DELAY``
    Seconds of "model loading" before the port is bound (default 0).
``FAKE_ENGINE_TOKENS``
    Tokens per reply (default 8); a reply has ``min(max_tokens, FAKE_ENGINE_TOKENS)`` tokens and
    finishes with ``length`` when ``max_tokens`` (or the context) was the limit, else ``stop``.
``FAKE_ENGINE_TOKEN_DELAY``
    Seconds per generated token (default 0); the first token also waits one delay.
``FAKE_ENGINE_CRASH_AFTER``
    N: after N chat/completion requests, the next one kills the process with
    ``os._exit(FAKE_ENGINE_CRASH_CODE)``; a stream first sends a couple of chunks.
``FAKE_ENGINE_CRASH_CODE``
    Exit status of that crash (default 3).
``FAKE_ENGINE_EXIT_CODE``
    Fail start-up: after the startup delay, print
    ``RuntimeError: Engine core initialization failed (fake) ...`` and exit with this status
    without ever binding the port.
``FAKE_ENGINE_IGNORE_SIGTERM``
    ``1``: SIGTERM is ignored from the very start (SIGINT still stops the server).
``FAKE_ENGINE_SPAWN_CHILD``
    ``1``: fork an ``EngineCore`` child (same process group, title ``VLLM::EngineCore`` when it
    can be set, SIGTERM ignored, sleeps forever) and print ``EngineCore pid=<pid>``. It is left
    behind on a clean shutdown, like vLLM's orphaned engine: only a process-group kill ends it.
``FAKE_ENGINE_PORT_IN_USE_ONCE``
    A file path: if the file does not exist, create it and fail like a taken port when binding
    (after the startup delay; ``Errno 98``, exit 1); later starts with that path run normally.
``FAKE_ENGINE_SLEEP_DELAY`` / ``FAKE_ENGINE_WAKE_DELAY``
    Seconds ``/sleep`` and ``/wake_up`` take (default 0).
``VLLM_SERVER_DEV_MODE``
    ``1``: register ``/sleep``, ``/wake_up``, ``/is_sleeping``, ``/collective_rpc`` and
    ``/reset_prefix_cache`` (404 ``{"detail":"Not Found"}`` otherwise).
"""

import argparse
import asyncio
import base64
import errno
import hashlib
import json
import math
import os
import signal
import socket
import sys
import time
from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

VERSION = "0.0.0-fake"
FINGERPRINT = f"vllm-{VERSION}"
EMBEDDING_DIM = 8
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
SLEEP_MODES = ("abort", "wait", "keep")
CLIENT_MAX_SIZE = 64 * 1024 * 1024
KEEPALIVE_TIMEOUT = 5.0
SHUTDOWN_GRACE = 0.5
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DONE = b"data: [DONE]\n\n"

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True)
class Settings:
    """Command line and environment of one fake engine."""

    model: str = "fake-model"
    served_names: tuple[str, ...] = ("fake-model",)
    host: str = "127.0.0.1"
    port: int = 8000
    max_model_len: int = 2048
    max_num_seqs: int = 256
    tensor_parallel_size: int = 1
    api_keys: tuple[str, ...] = ()
    dev_mode: bool = False
    startup_delay: float = 0.0
    tokens: int = 8
    token_delay: float = 0.0
    crash_after: int | None = None
    crash_code: int = 3
    exit_code: int | None = None
    ignore_sigterm: bool = False
    spawn_child: bool = False
    port_in_use_once: str | None = None
    sleep_delay: float = 0.0
    wake_delay: float = 0.0


def _model_len(text: str) -> int:
    value = text.strip()
    if value.lower() in ("auto", "-1"):
        return 2048
    units = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}
    if value[-1:] in units:
        return int(float(value[:-1]) * units[value[-1]])
    return int(value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fake_engine", allow_abbrev=False)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--served-model-name", nargs="+", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-model-len", type=_model_len, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--api-key", nargs="+", default=None)
    return parser


def _normalize_flag(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value


def _env_number(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def load_settings(argv: Sequence[str], environ: Mapping[str, str]) -> Settings:
    """Parse a vLLM-style command line (unknown flags ignored) and the FAKE_ENGINE_* knobs."""
    args, _unknown = _parser().parse_known_args([_normalize_flag(a) for a in argv])
    keys = args.api_key or ([environ["VLLM_API_KEY"]] if environ.get("VLLM_API_KEY") else [])
    crash_code = _env_int(environ, "FAKE_ENGINE_CRASH_CODE")
    return Settings(
        model=args.model,
        served_names=tuple(args.served_model_name or [args.model]),
        host=args.host,
        port=args.port,
        max_model_len=args.max_model_len,
        max_num_seqs=max(1, args.max_num_seqs),
        tensor_parallel_size=max(1, args.tensor_parallel_size),
        api_keys=tuple(keys),
        dev_mode=environ.get("VLLM_SERVER_DEV_MODE") == "1",
        startup_delay=_env_number(environ, "FAKE_ENGINE_STARTUP_DELAY", 0.0),
        tokens=max(0, int(_env_number(environ, "FAKE_ENGINE_TOKENS", 8))),
        token_delay=_env_number(environ, "FAKE_ENGINE_TOKEN_DELAY", 0.0),
        crash_after=_env_int(environ, "FAKE_ENGINE_CRASH_AFTER"),
        crash_code=3 if crash_code is None else crash_code,
        exit_code=_env_int(environ, "FAKE_ENGINE_EXIT_CODE"),
        ignore_sigterm=environ.get("FAKE_ENGINE_IGNORE_SIGTERM") == "1",
        spawn_child=environ.get("FAKE_ENGINE_SPAWN_CHILD") == "1",
        port_in_use_once=environ.get("FAKE_ENGINE_PORT_IN_USE_ONCE") or None,
        sleep_delay=_env_number(environ, "FAKE_ENGINE_SLEEP_DELAY", 0.0),
        wake_delay=_env_number(environ, "FAKE_ENGINE_WAKE_DELAY", 0.0),
    )


# --------------------------------------------------------------------------- errors


class ApiError(Exception):
    """An error answered as JSON with an HTTP status (turned into a response by middleware)."""

    def __init__(self, status: int, payload: dict[str, Any]) -> None:
        super().__init__(status)
        self.status = status
        self.payload = payload


def _error(status: int, message: str, type_: str, param: str | None) -> ApiError:
    return ApiError(
        status, {"error": {"message": message, "type": type_, "param": param, "code": status}}
    )


def _summary(value: object) -> object:
    if isinstance(value, list | tuple | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    return value if isinstance(value, str | int | float | bool | None) else str(value)


def _validation(kind: str, loc: tuple[object, ...], msg: str, value: object) -> ApiError:
    """A FastAPI/pydantic-style 400, the way vLLM renders request validation errors."""
    dotted = ".".join(str(part) for part in loc)
    detail = {"type": kind, "loc": dotted, "msg": msg, "input": _summary(value)}
    return _error(400, f"1 validation error:\n  {detail}", "Bad Request", dotted)


def _json_response(payload: object, status: int = 200) -> web.Response:
    return web.Response(
        body=_dumps(payload).encode(), status=status, content_type="application/json"
    )


async def _read_json(request: web.Request, check_type: bool = True) -> dict[str, Any]:
    if check_type and request.content_type != "application/json":
        message = (
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
        )
        raise _error(400, message, "Bad Request", None)
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        loc = ("body", getattr(exc, "pos", 0))
        raise _validation("json_invalid", loc, "JSON decode error", {}) from None
    if not isinstance(body, dict):
        msg = "Input should be a valid dictionary or object to extract fields from"
        raise _validation("model_attributes_type", ("body",), msg, body)
    return body


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return _json_response(exc.payload, exc.status)
    except web.HTTPNotFound:
        return _json_response({"detail": "Not Found"}, 404)
    except web.HTTPMethodNotAllowed:
        return _json_response({"detail": "Method Not Allowed"}, 405)


def _auth_middleware(keys: Sequence[str]) -> Middleware:
    accepted = frozenset(f"Bearer {key}" for key in keys)

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1") and request.method != "OPTIONS":
            if request.headers.get("Authorization") not in accepted:
                return _json_response({"error": "Unauthorized"}, 401)
        return await handler(request)

    return auth


# --------------------------------------------------------------------------- metrics


def _num(value: float) -> str:
    return repr(float(value))


class Histogram:
    """A Prometheus histogram with fixed bounds, rendered by hand."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            cumulative += n
            out.append(f'{name}_bucket{{{labels},le="{bound!r}"}} {_num(cumulative)}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {_num(self.count)}')
        out.append(f"{name}_count{{{labels}}} {_num(self.count)}")
        out.append(f"{name}_sum{{{labels}}} {_num(self.total)}")
        return out


class Metrics:
    """vLLM's engine series for one model (labels ``engine="0",model_name=...``)."""

    def __init__(self, model_name: str) -> None:
        escaped = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        self.labels = f'engine="0",model_name="{escaped}"'
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def record(
        self, prompt: int, generated: int, reason: str, ttft: float | None, e2e: float
    ) -> None:
        self.prompt_tokens += prompt
        self.generation_tokens += generated
        self.finished[reason] += 1
        if ttft is not None:
            self.ttft.observe(ttft)
        self.e2e.observe(e2e)

    def _sample(self, name: str, kind: str, value: float, extra: str = "") -> list[str]:
        base = name.removesuffix("_total") if kind == "counter" else name
        return [f"# TYPE {base} {kind}", f"{name}{{{self.labels}{extra}}} {_num(value)}"]

    def render(self, running: int, waiting: int, kv_usage: float, sleep: dict[str, int]) -> str:
        out = self._sample("vllm:num_requests_running", "gauge", running)
        out += self._sample("vllm:num_requests_waiting", "gauge", waiting)
        out += self._sample("vllm:kv_cache_usage_perc", "gauge", kv_usage)
        out.append("# TYPE vllm:engine_sleep_state gauge")
        for state, value in sleep.items():
            out.append(
                f'vllm:engine_sleep_state{{{self.labels},sleep_state="{state}"}} {_num(value)}'
            )
        out += self._sample("vllm:prompt_tokens_total", "counter", self.prompt_tokens)
        out += self._sample("vllm:generation_tokens_total", "counter", self.generation_tokens)
        out.append("# TYPE vllm:request_success counter")
        for reason, count in self.finished.items():
            label = f',finished_reason="{reason}"'
            out.append(f"vllm:request_success_total{{{self.labels}{label}}} {_num(count)}")
        out += self.ttft.lines("vllm:time_to_first_token_seconds", self.labels)
        out += self.e2e.lines("vllm:e2e_request_latency_seconds", self.labels)
        return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- engine state


def _resolve(future: "asyncio.Future[None]") -> None:
    if not future.done():
        future.set_result(None)


class Engine:
    """Admission, sequence slots, sleep state and aborts shared by all request handlers.

    A generation handler calls ``enter()``, then ``admit()`` (parks while the engine sleeps,
    queues while ``max_num_seqs`` requests run) and always ``leave()`` in ``finally``. An admitted
    request gets the current abort epoch; ``abort_running()`` bumps it and cuts token pauses
    short, so a handler that sees a different epoch finishes with ``abort``.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics(settings.served_names[0])
        self.loop = asyncio.get_running_loop()
        self.stopping = False
        self.epoch = 0
        self.started = 0
        self.running = 0
        self.waiting = 0
        self.active = 0
        self.kv_tokens = 0
        self.paused = False
        self.frozen = False
        self.level = 0
        self.asleep_memory: set[str] = set()
        self._awake = asyncio.Event()
        self._awake.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self._slots: deque[asyncio.Future[None]] = deque()
        self._timers: set[asyncio.Future[None]] = set()

    def enter(self) -> None:
        self.active += 1
        self._drained.clear()

    async def admit(self, kv_tokens: int) -> int | None:
        """Wait until the request may run; its abort epoch, or None when shutting down."""
        while not self.stopping:
            if self.paused:
                await self._awake.wait()
            elif self.running >= self.settings.max_num_seqs:
                await self._queue_for_slot()
            else:
                self.running += 1
                self.kv_tokens += kv_tokens
                self._idle.clear()
                return self.epoch
        return None

    async def _queue_for_slot(self) -> None:
        slot = self.loop.create_future()
        self._slots.append(slot)
        self.waiting += 1
        try:
            await slot
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled():
                self._wake_next_slot()
            raise
        finally:
            self.waiting -= 1

    def _wake_next_slot(self) -> None:
        while self._slots:
            slot = self._slots.popleft()
            if not slot.done():
                slot.set_result(None)
                return

    def leave(self, admitted: bool, kv_tokens: int) -> None:
        if admitted:
            self.running -= 1
            self.kv_tokens -= kv_tokens
            if self.running == 0:
                self._idle.set()
            self._wake_next_slot()
        self.active -= 1
        if self.active == 0:
            self._drained.set()

    async def pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less if ``abort_running()`` is called meanwhile."""
        timer = self.loop.create_future()
        handle = self.loop.call_later(seconds, _resolve, timer)
        self._timers.add(timer)
        try:
            await timer
        finally:
            handle.cancel()
            self._timers.discard(timer)

    async def hold(self) -> None:
        """Stay still while a ``mode=keep`` sleep freezes running requests."""
        while self.frozen and not self.stopping:
            await self._awake.wait()

    def abort_running(self) -> None:
        self.epoch += 1
        for timer in self._timers:
            _resolve(timer)

    async def sleep(self, level: int, mode: str) -> None:
        self.paused = True
        self.level = level
        self._awake.clear()
        if level >= 1:
            self.asleep_memory = {"weights", "kv_cache"}
        if mode == "abort":
            self.abort_running()
        elif mode == "wait":
            await self._idle.wait()
        else:
            self.frozen = True
        if self.settings.sleep_delay > 0:
            await asyncio.sleep(self.settings.sleep_delay)

    async def wake_up(self, tags: list[str] | None) -> bool:
        """Wake the given memory tags (all when None); True once fully awake."""
        if self.settings.wake_delay > 0:
            await asyncio.sleep(self.settings.wake_delay)
        if tags is None:
            self.asleep_memory.clear()
        else:
            self.asleep_memory.difference_update(tags)
        if self.asleep_memory:
            return False
        self.paused = False
        self.frozen = False
        self.level = 0
        self._awake.set()
        return True

    def shutdown(self) -> None:
        """Abort everything in flight and release every parked or queued request."""
        self.stopping = True
        self.abort_running()
        self._awake.set()
        while self._slots:
            _resolve(self._slots.popleft())

    async def wait_drained(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._drained.wait(), timeout)
        except TimeoutError:
            pass

    def render_metrics(self) -> str:
        capacity = self.settings.max_model_len * self.settings.max_num_seqs
        sleep = {
            "awake": 0 if self.paused else 1,
            "weights_offloaded": int(self.paused and self.level == 1),
            "discard_all": int(self.paused and self.level == 2),
        }
        kv_usage = min(1.0, self.kv_tokens / capacity)
        return self.metrics.render(self.running, self.waiting, kv_usage, sleep)


# --------------------------------------------------------------------------- request parsing


@dataclass(slots=True)
class Reply:
    """One parsed chat/completion request and the progress of its generation."""

    chat: bool
    rid: str
    model: str
    created: int
    stream: bool
    choices: int
    tokens: int
    finish: str
    prompt_tokens: int
    include_usage: bool
    continuous_usage: bool
    arrival: float
    crash: bool = False
    produced: int = 0
    first_token_at: float | None = None

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.tokens * self.choices


def _words(text: str) -> int:
    return len(text.split())


def _content_words(content: object) -> int:
    if isinstance(content, str):
        return _words(content)
    if isinstance(content, list):
        parts = (p.get("text") for p in content if isinstance(p, dict))
        return sum(_words(text) for text in parts if isinstance(text, str))
    return 0


def _chat_prompt_tokens(body: dict[str, Any]) -> list[int]:
    if "messages" not in body:
        raise _validation("missing", ("body", "messages"), "Field required", body)
    messages = body["messages"]
    if not isinstance(messages, list):
        raise _validation(
            "list_type", ("body", "messages"), "Input should be a valid list", messages
        )
    words = 0
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            msg = "Input should be a valid dictionary"
            raise _validation("dict_type", ("body", "messages", index), msg, message)
        words += _content_words(message.get("content"))
    return [max(1, words)]


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and all(type(x) is int for x in value)


def _completion_prompt_tokens(body: dict[str, Any]) -> list[int]:
    if "prompt" not in body:
        raise _validation("missing", ("body", "prompt"), "Field required", body)
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return [max(1, _words(prompt))]
    if isinstance(prompt, list) and prompt:
        if _is_ids(prompt):
            return [len(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [max(1, _words(p)) for p in prompt]
        if all(_is_ids(p) and p for p in prompt):
            return [len(p) for p in prompt]
    msg = "Input should be a string, a list of strings or a list of token ids"
    raise _validation("union_type", ("body", "prompt"), msg, prompt)


def _int_field(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not int:
        msg = "Input should be a valid integer"
        raise _validation("int_type", ("body", name), msg, value)
    if value < 1:
        raise _error(400, f"{name} must be at least 1, got {value}.", "BadRequestError", name)
    return value


def _request_id(request: web.Request, body: dict[str, Any]) -> str:
    rid = request.headers.get("X-Request-Id") or body.get("request_id")
    return rid if isinstance(rid, str) and rid else os.urandom(8).hex()


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    stream = body.get("stream") is True
    options = body.get("stream_options")
    if options is not None and not stream:
        msg = "Stream options can only be defined when `stream=True`."
        raise _error(400, msg, "BadRequestError", "stream_options")
    if not isinstance(options, dict):
        return stream, False, False
    include = bool(options.get("include_usage"))
    return stream, include, include and bool(options.get("continuous_usage_stats"))


# --------------------------------------------------------------------------- SSE rendering


class SseFormat:
    """Renders one request's SSE events as compact JSON in vLLM's field order."""

    __slots__ = ("chat", "fingerprint", "head", "prompt_tokens")

    def __init__(self, reply: Reply) -> None:
        obj = "chat.completion.chunk" if reply.chat else "text_completion"
        self.head = (
            f'data: {{"id":{_dumps(reply.rid)},"object":"{obj}","created":{reply.created},'
            f'"model":{_dumps(reply.model)},"choices":['
        )
        self.chat = reply.chat
        self.prompt_tokens = reply.prompt_tokens
        self.fingerprint = "" if reply.include_usage else f',"system_fingerprint":"{FINGERPRINT}"'

    def usage(self, completion: int) -> str:
        total = self.prompt_tokens + completion
        return (
            f'"usage":{{"prompt_tokens":{self.prompt_tokens},"total_tokens":{total},'
            f'"completion_tokens":{completion}}}'
        )

    def role(self, index: int, usage: str = "") -> bytes:
        delta = '"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null'
        tail = ',"prompt_token_ids":null,"prompt_text":null'
        return f'{self.head}{{"index":{index},{delta}}}]{tail}{usage}}}\n\n'.encode()

    def token(self, index: int, text_json: str, finish: str | None, usage: str = "") -> bytes:
        reason = "null" if finish is None else f'"{finish}"'
        if self.chat:
            stop = "" if finish is None else ',"stop_reason":null'
            body = (
                f'"delta":{{"content":{text_json}}},"logprobs":null,"finish_reason":{reason}{stop}'
            )
            body += ',"token_ids":null'
        else:
            body = f'"text":{text_json},"logprobs":null,"finish_reason":{reason},"stop_reason":null'
            body += ',"prompt_token_ids":null,"token_ids":null'
        tail = "" if finish is None else self.fingerprint
        return f'{self.head}{{"index":{index},{body}}}]{tail}{usage}}}\n\n'.encode()

    def usage_chunk(self, completion: int) -> bytes:
        usage = self.usage(completion)
        return f'{self.head}],{usage},"system_fingerprint":"{FINGERPRINT}"}}\n\n'.encode()


# --------------------------------------------------------------------------- handlers


def _embedding(key: str, encoding: str) -> list[float] | str:
    digest = hashlib.blake2b(key.encode(), digest_size=EMBEDDING_DIM).digest()
    raw = [b - 127.5 for b in digest]
    norm = math.sqrt(sum(v * v for v in raw))
    vector = [v / norm for v in raw]
    if encoding == "base64":
        return base64.b64encode(array("f", vector).tobytes()).decode()
    return vector


def _embedding_inputs(body: dict[str, Any]) -> list[tuple[str, int]]:
    if "input" not in body:
        raise _validation("missing", ("body", "input"), "Field required", body)
    value = body["input"]
    if isinstance(value, str):
        return [(value, max(1, _words(value)))]
    if isinstance(value, list) and value:
        if _is_ids(value):
            return [(repr(value), len(value))]
        if all(isinstance(v, str) for v in value):
            return [(v, max(1, _words(v))) for v in value]
        if all(_is_ids(v) and v for v in value):
            return [(repr(v), len(v)) for v in value]
    msg = "Input should be a string, a list of strings or a list of token ids"
    raise _validation("union_type", ("body", "input"), msg, value)


class FakeServer:
    """The HTTP surface of the fake engine."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine = Engine(settings)
        self.model = settings.served_names[0]
        self.names = frozenset(settings.served_names)
        words = [f"tok{i} " for i in range(settings.tokens)]
        self.token_json = [_dumps(word) for word in words]
        self.text = "".join(words)
        self.offsets = [0]
        for word in words:
            self.offsets.append(self.offsets[-1] + len(word))

    def build_app(self) -> web.Application:
        middlewares: list[Middleware] = [_error_middleware]
        if self.settings.api_keys:
            middlewares.append(_auth_middleware(self.settings.api_keys))
        app = web.Application(middlewares=middlewares, client_max_size=CLIENT_MAX_SIZE)
        add = app.router.add_route
        add("GET", "/health", self.health)
        add("GET", "/ping", self.health)
        add("POST", "/ping", self.health)
        add("GET", "/version", self.version)
        add("GET", "/load", self.load)
        add("GET", "/metrics", self.metrics)
        add("GET", "/v1/models", self.models)
        add("POST", "/v1/chat/completions", self.chat_completions)
        add("POST", "/v1/completions", self.completions)
        add("POST", "/v1/embeddings", self.embeddings)
        if self.settings.dev_mode:
            add("POST", "/sleep", self.sleep)
            add("POST", "/wake_up", self.wake_up)
            add("GET", "/is_sleeping", self.is_sleeping)
            add("POST", "/collective_rpc", self.collective_rpc)
            add("POST", "/reset_prefix_cache", self.reset_prefix_cache)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def version(self, request: web.Request) -> web.Response:
        return _json_response({"version": VERSION})

    async def load(self, request: web.Request) -> web.Response:
        return _json_response({"server_load": 0})

    async def metrics(self, request: web.Request) -> web.Response:
        body = self.engine.render_metrics().encode()
        return web.Response(body=body, headers={"Content-Type": PROMETHEUS_TYPE})

    def _model_card(self, name: str, created: int) -> dict[str, Any]:
        permission = {
            "id": f"modelperm-{os.urandom(8).hex()}",
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": self.settings.model,
            "parent": None,
            "max_model_len": self.settings.max_model_len,
            "permission": [permission],
        }

    async def models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        cards = [self._model_card(name, created) for name in self.settings.served_names]
        return _json_response({"object": "list", "data": cards})

    def _check_model(self, body: dict[str, Any]) -> None:
        name = body.get("model")
        if name is None or name == "":
            return
        if not isinstance(name, str):
            raise _validation(
                "string_type", ("body", "model"), "Input should be a valid string", name
            )
        if name not in self.names:
            message = f"The model `{name}` does not exist."
            raise _error(404, message, "NotFoundError", "model")

    def _reply(self, request: web.Request, body: dict[str, Any], chat: bool) -> Reply:
        prompts = _chat_prompt_tokens(body) if chat else _completion_prompt_tokens(body)
        self._check_model(body)
        limit_name = (
            "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        )
        limit = _int_field(body, limit_name, None if chat else 16)
        n = _int_field(body, "n", 1) or 1
        stream, include_usage, continuous = _stream_flags(body)
        max_len = self.settings.max_model_len
        longest = max(prompts)
        if longest > max_len:
            message = (
                f"This model's maximum context length is {max_len} tokens. However, your prompt "
                f"contains at least {longest} input tokens, which exceeds this limit even without "
                "any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={longest})"
            )
            raise _error(400, message, "BadRequestError", "input_tokens")
        if limit is not None and limit > max_len:
            message = (
                f"{limit_name}={limit} cannot be greater than max_model_len={max_len}. Please "
                f"request fewer output tokens. (parameter={limit_name}, value={limit})"
            )
            raise _error(400, message, "BadRequestError", limit_name)
        cap = max_len - longest if limit is None else min(limit, max_len - longest)
        tokens = min(cap, self.settings.tokens)
        prefix = "chatcmpl-" if chat else "cmpl-"
        return Reply(
            chat=chat,
            rid=prefix + _request_id(request, body),
            model=self.model,
            created=int(time.time()),
            stream=stream,
            choices=n * len(prompts),
            tokens=tokens,
            finish="length" if tokens == cap else "stop",
            prompt_tokens=sum(prompts),
            include_usage=include_usage,
            continuous_usage=continuous,
            arrival=self.engine.loop.time(),
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        reply = self._reply(request, await _read_json(request), chat)
        engine = self.engine
        engine.started += 1
        crash_after = self.settings.crash_after
        reply.crash = crash_after is not None and engine.started > crash_after
        engine.enter()
        epoch = None
        try:
            epoch = await engine.admit(reply.kv_tokens)
            if reply.crash and epoch is not None and not reply.stream:
                self._crash()
            if reply.stream:
                return await self._stream(request, reply, epoch)
            return await self._complete(reply, epoch)
        finally:
            engine.leave(epoch is not None, reply.kv_tokens)

    def _crash(self) -> NoReturn:
        message = "EngineCore encountered an issue (fake crash: FAKE_ENGINE_CRASH_AFTER)."
        _log(message, "ERROR", sys.stderr)
        print("RuntimeError: EngineCore died unexpectedly (fake)", file=sys.stderr, flush=True)
        os._exit(self.settings.crash_code)

    def _record(self, reply: Reply, reason: str) -> None:
        now = self.engine.loop.time()
        ttft = None if reply.first_token_at is None else reply.first_token_at - reply.arrival
        generated = reply.produced * reply.choices
        self.engine.metrics.record(
            reply.prompt_tokens, generated, reason, ttft, now - reply.arrival
        )

    def _usage(self, reply: Reply) -> dict[str, Any]:
        completion = reply.produced * reply.choices
        return {
            "prompt_tokens": reply.prompt_tokens,
            "total_tokens": reply.prompt_tokens + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }

    async def _run_all_tokens(self, reply: Reply, epoch: int | None) -> str:
        engine = self.engine
        if epoch is None:
            return "abort"
        delay = self.settings.token_delay
        start = engine.loop.time()
        if delay > 0 and reply.tokens > 0:
            await engine.pause(delay * reply.tokens)
        await engine.hold()
        if engine.epoch != epoch or engine.stopping:
            elapsed = engine.loop.time() - start
            reply.produced = min(reply.tokens, int(elapsed / delay)) if delay > 0 else 0
            reason = "abort"
        else:
            reply.produced = reply.tokens
            reason = reply.finish
        if reply.produced:
            reply.first_token_at = start + delay
        return reason

    async def _complete(self, reply: Reply, epoch: int | None) -> web.Response:
        reason = await self._run_all_tokens(reply, epoch)
        text = self.text[: self.offsets[reply.produced]]
        self._record(reply, reason)
        if reply.chat:
            choices = [_chat_choice(i, text, reason) for i in range(reply.choices)]
            body = {"id": reply.rid, "object": "chat.completion", "created": reply.created}
        else:
            choices = [_completion_choice(i, text, reason) for i in range(reply.choices)]
            body = {"id": reply.rid, "object": "text_completion", "created": reply.created}
        body |= {
            "model": reply.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": FINGERPRINT,
            "usage": self._usage(reply),
        }
        if reply.chat:
            body |= {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
        body |= {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
        return _json_response(body)

    async def _stream(
        self, request: web.Request, reply: Reply, epoch: int | None
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        sse = SseFormat(reply)
        reason = "abort"
        try:
            if reply.chat:
                usage = "," + sse.usage(0) if reply.continuous_usage else ""
                for index in range(reply.choices):
                    await response.write(sse.role(index, usage))
            if epoch is not None:
                reason = await self._stream_tokens(response, sse, reply, epoch)
            await self._end_stream(response, sse, reply, reason)
        except ConnectionError:
            reason = "abort"
        self._record(reply, reason)
        return response

    async def _stream_tokens(
        self, response: web.StreamResponse, sse: SseFormat, reply: Reply, epoch: int
    ) -> str:
        engine = self.engine
        delay = self.settings.token_delay
        crash_at = min(2, reply.tokens - 1) if reply.crash else -1
        for t in range(reply.tokens):
            if delay > 0:
                await engine.pause(delay)
            await engine.hold()
            if engine.epoch != epoch or engine.stopping:
                return "abort"
            if t == crash_at:
                self._crash()
            finish = reply.finish if t + 1 == reply.tokens else None
            usage = "," + sse.usage(t + 1) if reply.continuous_usage else ""
            chunk = sse.token
            for index in range(reply.choices):
                await response.write(chunk(index, self.token_json[t], finish, usage))
            if t == 0:
                reply.first_token_at = engine.loop.time()
            reply.produced = t + 1
        if reply.crash:
            self._crash()
        return reply.finish

    async def _end_stream(
        self, response: web.StreamResponse, sse: SseFormat, reply: Reply, reason: str
    ) -> None:
        if reason == "abort" and self.engine.stopping:
            await response.write(DONE)
            return
        if reason == "abort" or reply.tokens == 0:
            usage = "," + sse.usage(reply.produced) if reply.continuous_usage else ""
            for index in range(reply.choices):
                await response.write(sse.token(index, '""', reason, usage))
        if reply.include_usage:
            await response.write(sse.usage_chunk(reply.produced * reply.choices))
        await response.write(DONE)

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await _read_json(request)
        inputs = _embedding_inputs(body)
        self._check_model(body)
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            msg = "Input should be 'float' or 'base64'"
            raise _validation("literal_error", ("body", "encoding_format"), msg, encoding)
        engine = self.engine
        engine.enter()
        epoch = None
        try:
            epoch = await engine.admit(0)
        finally:
            engine.leave(epoch is not None, 0)
        if epoch is None:
            raise _error(503, "The server is shutting down.", "ServiceUnavailableError", None)
        tokens = sum(count for _, count in inputs)
        engine.metrics.record(tokens, 0, "stop", None, 0.0)
        data = [
            {"index": i, "object": "embedding", "embedding": _embedding(key, encoding)}
            for i, (key, _) in enumerate(inputs)
        ]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
        return _json_response(
            {
                "id": f"embd-{_request_id(request, body)}",
                "object": "list",
                "created": int(time.time()),
                "model": self.model,
                "data": data,
                "usage": usage | {"prompt_tokens_details": None},
            }
        )

    async def sleep(self, request: web.Request) -> web.Response:
        raw_level = request.query.get("level", "1")
        try:
            level = int(raw_level)
        except ValueError:
            msg = "Input should be a valid integer, unable to parse string as an integer"
            raise _validation("int_parsing", ("query", "level"), msg, raw_level) from None
        if not 0 <= level <= 2:
            kind, msg = ("greater_than_equal", "greater than or equal to 0")
            if level > 2:
                kind, msg = ("less_than_equal", "less than or equal to 2")
            raise _validation(kind, ("query", "level"), f"Input should be {msg}", raw_level)
        mode = request.query.get("mode", "abort")
        if mode not in SLEEP_MODES:
            msg = "Input should be 'abort', 'wait' or 'keep'"
            raise _validation("literal_error", ("query", "mode"), msg, mode)
        await self.engine.sleep(level, mode)
        return _json_response({"status": "sleeping", "level": level})

    async def wake_up(self, request: web.Request) -> web.Response:
        tags = request.query.getall("tags", []) or None
        awake = await self.engine.wake_up(tags)
        return _json_response({"status": "awake" if awake else "sleeping", "tags": tags})

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return _json_response({"is_sleeping": self.engine.paused})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = await _read_json(request, check_type=False)
        if not isinstance(body.get("method"), str):
            raise _error(400, "Missing 'method' in request body", "BadRequestError", "method")
        return _json_response({"results": [None] * self.settings.tensor_parallel_size})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        return _json_response({"success": True})


def _chat_choice(index: int, text: str, reason: str) -> dict[str, Any]:
    message = {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    return {
        "index": index,
        "message": message,
        "logprobs": None,
        "finish_reason": reason,
        "stop_reason": None,
        "token_ids": None,
        "routed_experts": None,
    }


def _completion_choice(index: int, text: str, reason: str) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": reason,
        "stop_reason": None,
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "routed_experts": None,
    }


# --------------------------------------------------------------------------- process lifecycle


def _log(message: str, level: str = "INFO", stream: Any = None) -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    line = f"(APIServer pid={os.getpid()}) {level} {stamp} [fake_engine.py] {message}"
    print(line, file=stream or sys.stdout, flush=True)


def _uvicorn(message: str) -> None:
    print(f"INFO:     {message}", flush=True)


def _display_host(settings: Settings) -> str:
    return settings.host or "0.0.0.0"


def _set_title(title: str) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(title)
        return
    except ImportError:
        pass
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(title[:15])
    except OSError:
        pass


def _engine_core_main() -> NoReturn:
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _set_title("VLLM::EngineCore")
        while True:
            time.sleep(3600)
    finally:
        os._exit(0)


def _spawn_engine_core() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _engine_core_main()
    _log(f"EngineCore pid={pid}")


def _bind(settings: Settings) -> socket.socket:
    host = _display_host(settings)
    infos = socket.getaddrinfo(
        host, settings.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def _claim_port_race_marker(path: str) -> bool:
    """True the first time ``path`` is seen (the file is created atomically)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True


def _listening_socket(settings: Settings) -> socket.socket | None:
    try:
        marker = settings.port_in_use_once
        if marker and _claim_port_race_marker(marker):
            raise OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE))
        return _bind(settings)
    except OSError as exc:
        url = f"http://{_display_host(settings)}:{settings.port}"
        _log(f"Failed to bind the API server socket on {url}", "ERROR", sys.stderr)
        print(f"OSError: {exc}", file=sys.stderr, flush=True)
        return None


def _log_banner(settings: Settings) -> None:
    _log(f"vLLM server version {VERSION}, serving model {settings.model}")
    names = list(settings.served_names)
    _log(f"non-default args: {{'model': {settings.model!r}, 'served_model_name': {names!r}}}")
    if settings.dev_mode:
        warning = "Development endpoints are enabled! This should NOT be used in production!"
        _log(f"SECURITY WARNING: {warning}", "WARNING")
    _log(f"Using max model len {settings.max_model_len}")


async def serve(settings: Settings, sock: socket.socket) -> int:
    """Serve on the bound socket until SIGTERM/SIGINT, then abort requests and return 0."""
    server = FakeServer(settings)
    runner = web.AppRunner(
        server.build_app(),
        access_log=None,
        keepalive_timeout=KEEPALIVE_TIMEOUT,
        shutdown_timeout=SHUTDOWN_GRACE,
    )
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    if not settings.ignore_sigterm:
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    await web.SockSite(runner, sock, backlog=2048).start()
    _log("Supported tasks: ['generate', 'embed']")
    _log(f"Starting vLLM server on http://{_display_host(settings)}:{settings.port}")
    _uvicorn(f"Started server process [{os.getpid()}]")
    _uvicorn("Waiting for application startup.")
    _uvicorn("Application startup complete.")
    await stop.wait()
    _log("[shutdown] API server: shutdown triggered (mode=abort)")
    _uvicorn("Shutting down")
    server.engine.shutdown()
    await server.engine.wait_drained(SHUTDOWN_GRACE)
    await runner.cleanup()
    _uvicorn("Waiting for application shutdown.")
    _uvicorn("Application shutdown complete.")
    _uvicorn(f"Finished server process [{os.getpid()}]")
    return 0


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def _run(coro: Coroutine[Any, Any, int]) -> int:
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    """Start the fake engine; returns the process exit status."""
    try:
        settings = load_settings(sys.argv[1:] if argv is None else argv, os.environ)
    except ValueError as exc:
        print(f"fake_engine: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if settings.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _log_banner(settings)
    if settings.spawn_child:
        _spawn_engine_core()
    try:
        if settings.startup_delay > 0:
            time.sleep(settings.startup_delay)
        if settings.exit_code is not None:
            _log("EngineCore failed to start.", "ERROR", sys.stderr)
            message = (
                "RuntimeError: Engine core initialization failed (fake). See root cause above."
            )
            print(f"{message} Failed core proc(s): {{}}", file=sys.stderr, flush=True)
            return settings.exit_code
        sock = _listening_socket(settings)
        if sock is None:
            return 1
        return _run(serve(settings, sock))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
