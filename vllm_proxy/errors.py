"""Errors the proxy answers with, and their OpenAI-shaped bodies.

Every error a client sees from the proxy itself is a `ProxyError`: it carries the HTTP status, the
OpenAI error `type` and `code`, and optional extra headers (e.g. `Retry-After`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)

#: Seconds a client (or a load balancer) is told to wait before it retries a 503.
RETRY_AFTER_S = 5


def error_body(message: str, type_: str, code: str | int | None, param: str | None = None) -> dict:
    """The OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ProxyError(Exception):
    """An error answered to the client with `status` and an OpenAI-shaped body."""

    status = 500
    type_ = "internal_error"
    code: str | None = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type_, self.code, self.param)


class BadRequest(ProxyError):
    status = 400
    type_ = "invalid_request_error"
    code = "invalid_request"


class Unauthorized(ProxyError):
    status = 401
    type_ = "authentication_error"
    code = "invalid_api_key"


class Forbidden(ProxyError):
    status = 403
    type_ = "permission_error"
    code = "forbidden"


class NotFound(ProxyError):
    status = 404
    type_ = "invalid_request_error"
    code = "model_not_found"


class MethodNotAllowed(ProxyError):
    status = 405
    type_ = "invalid_request_error"
    code = "method_not_allowed"


class RequestTimeout(ProxyError):
    status = 408
    type_ = "invalid_request_error"
    code = "request_timeout"


class Conflict(ProxyError):
    """The request conflicts with the model's current state (an admin action)."""

    status = 409
    type_ = "invalid_request_error"
    code = "conflict"


class PayloadTooLarge(ProxyError):
    status = 413
    type_ = "invalid_request_error"
    code = "request_too_large"


class TooManyRequests(ProxyError):
    """A limit of the client's own (its API key's) is reached: with ``Retry-After``."""

    status = 429
    type_ = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: int = RETRY_AFTER_S,
        code: str | None = None,
        reason: str = "limit",
    ) -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(retry_after_s)})
        #: Which limit: the label of ``vllm_proxy_key_rejected_total``.
        self.reason = reason


class EngineFailed(ProxyError):
    """The engine could not start, or died while serving."""

    status = 502
    type_ = "engine_error"
    code = "engine_failed"


class EngineTimeout(ProxyError):
    """The engine did not become ready within its startup timeout."""

    status = 504
    type_ = "engine_error"
    code = "engine_start_timeout"


class Unavailable(ProxyError):
    """No capacity right now, or the proxy is shutting down; the client may retry (and a load
    balancer may try another server): always with ``Retry-After``."""

    status = 503
    type_ = "service_unavailable"
    code = "service_unavailable"

    def __init__(
        self, message: str, *, retry_after_s: int = RETRY_AFTER_S, code: str | None = None
    ) -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(retry_after_s)})


class ConfigError(Exception):
    """A configuration file that cannot be used; the message names the key path."""


def consume_exception(task: asyncio.Task[Any]) -> None:
    """Done-callback for background tasks: takes their exception so that asyncio does not warn
    of it; proxy errors are already reported, others are bugs and are logged."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, ProxyError):
        log.error("background task failed", exc_info=exc)
