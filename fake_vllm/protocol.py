"""vLLM's wire format: API errors, JSON helpers, request parsing, SSE and response bodies."""

import base64
import hashlib
import json
import math
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from .settings import EMBEDDING_DIM, FINGERPRINT

dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


# --------------------------------------------------------------------------- errors


class ApiError(Exception):
    """An error answered as JSON with an HTTP status (turned into a response by middleware)."""

    def __init__(self, status: int, payload: dict[str, Any]) -> None:
        super().__init__(status)
        self.status = status
        self.payload = payload


def error(status: int, message: str, type_: str, param: str | None) -> ApiError:
    return ApiError(
        status, {"error": {"message": message, "type": type_, "param": param, "code": status}}
    )


def _summary(value: object) -> object:
    if isinstance(value, list | tuple | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    return value if isinstance(value, str | int | float | bool | None) else str(value)


def validation(kind: str, loc: tuple[object, ...], msg: str, value: object) -> ApiError:
    """A FastAPI/pydantic-style 400, the way vLLM renders request validation errors."""
    dotted = ".".join(str(part) for part in loc)
    detail = {"type": kind, "loc": dotted, "msg": msg, "input": _summary(value)}
    return error(400, f"1 validation error:\n  {detail}", "Bad Request", dotted)


def json_response(payload: object, status: int = 200) -> web.Response:
    return web.Response(
        body=dumps(payload).encode(), status=status, content_type="application/json"
    )


async def read_json(request: web.Request, check_type: bool = True) -> dict[str, Any]:
    if check_type and request.content_type != "application/json":
        message = (
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
        )
        raise error(400, message, "Bad Request", None)
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        loc = ("body", getattr(exc, "pos", 0))
        raise validation("json_invalid", loc, "JSON decode error", {}) from None
    if not isinstance(body, dict):
        msg = "Input should be a valid dictionary or object to extract fields from"
        raise validation("model_attributes_type", ("body",), msg, body)
    return body


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return json_response(exc.payload, exc.status)
    except web.HTTPNotFound:
        return json_response({"detail": "Not Found"}, 404)
    except web.HTTPMethodNotAllowed:
        return json_response({"detail": "Method Not Allowed"}, 405)


def auth_middleware(keys: Sequence[str]) -> Middleware:
    accepted = frozenset(f"Bearer {key}" for key in keys)

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1") and request.method != "OPTIONS":
            if request.headers.get("Authorization") not in accepted:
                return json_response({"error": "Unauthorized"}, 401)
        return await handler(request)

    return auth


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
    #: Stalls for good (`Settings.stall_after`): a stream after its first chunks.
    stall: bool = False
    garbage: bool = False
    produced: int = 0
    first_token_at: float | None = None
    #: ``logprobs`` (completions: alternatives per token) and ``return_token_ids`` as asked.
    logprobs: int | None = None
    token_ids: bool = False

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


def chat_prompt_tokens(body: dict[str, Any]) -> list[int]:
    if "messages" not in body:
        raise validation("missing", ("body", "messages"), "Field required", body)
    messages = body["messages"]
    if not isinstance(messages, list):
        raise validation(
            "list_type", ("body", "messages"), "Input should be a valid list", messages
        )
    words = 0
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            msg = "Input should be a valid dictionary"
            raise validation("dict_type", ("body", "messages", index), msg, message)
        words += _content_words(message.get("content"))
    return [max(1, words)]


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and all(type(x) is int for x in value)


def completion_prompt_tokens(body: dict[str, Any]) -> list[int]:
    if "prompt" not in body:
        raise validation("missing", ("body", "prompt"), "Field required", body)
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
    raise validation("union_type", ("body", "prompt"), msg, prompt)


def int_field(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not int:
        msg = "Input should be a valid integer"
        raise validation("int_type", ("body", name), msg, value)
    if value < 1:
        raise error(400, f"{name} must be at least 1, got {value}.", "BadRequestError", name)
    return value


def request_id(request: web.Request, body: dict[str, Any]) -> str:
    rid = request.headers.get("X-Request-Id") or body.get("request_id")
    return rid if isinstance(rid, str) and rid else os.urandom(8).hex()


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    stream = body.get("stream") is True
    options = body.get("stream_options")
    if options is not None and not stream:
        msg = "Stream options can only be defined when `stream=True`."
        raise error(400, msg, "BadRequestError", "stream_options")
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
            f'data: {{"id":{dumps(reply.rid)},"object":"{obj}","created":{reply.created},'
            f'"model":{dumps(reply.model)},"choices":['
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


# --------------------------------------------------------------------------- response bodies


def embedding(key: str, encoding: str) -> list[float] | str:
    digest = hashlib.blake2b(key.encode(), digest_size=EMBEDDING_DIM).digest()
    raw = [b - 127.5 for b in digest]
    norm = math.sqrt(sum(v * v for v in raw))
    vector = [v / norm for v in raw]
    if encoding == "base64":
        return base64.b64encode(array("f", vector).tobytes()).decode()
    return vector


def embedding_inputs(body: dict[str, Any]) -> list[tuple[str, int]]:
    if "input" not in body:
        raise validation("missing", ("body", "input"), "Field required", body)
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
    raise validation("union_type", ("body", "input"), msg, value)


def chat_choice(index: int, text: str, reason: str) -> dict[str, Any]:
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


def completion_choice(index: int, text: str, reason: str) -> dict[str, Any]:
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
