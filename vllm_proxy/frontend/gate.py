"""The `Gate`: the checks on who may drive the proxy, in front of every handler.

* ``server.allowed_hosts``: a Host header outside the list gets 421 (`Misdirected`);
* admin changes, form uploads and WebSockets from a browser page of another origin get 403;
* ``server.metrics_api_keys``: the metrics routes (`METRICS_PATHS`) need one when set.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from aiohttp import web

from ..config import ServerConfig
from ..errors import ConfigError, Forbidden, ProxyError
from .routes.paths import opens_to_pages
from .serving import Handler, check_key

#: Methods that change nothing; an admin call with any other is refused from another origin.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
METRICS_PATHS = frozenset({"/metrics", "/metrics/engines", "/placement", "/metrics/model-server"})
#: Answered whatever the Host: load balancers probe by address.
ANY_HOST_PATHS = frozenset({"/health"})
#: Host header values allowed: ``(name, None)`` for any port, ``(name, port)`` for that one.
Hosts = frozenset[tuple[str, int | None]]
#: Host header values whose verdict is remembered (a look-up is far cheaper than parsing one);
#: the memory is emptied when full, so a client sending new values cannot grow it.
HOST_VERDICTS = 1024


class Misdirected(ProxyError):
    """The request names a Host this proxy does not answer (RFC 9110 15.5.20)."""

    status = 421
    type_ = "invalid_request_error"
    code = "host_not_allowed"


class Gate:
    """The checks on who may drive the proxy, in front of every handler.

    * ``server.allowed_hosts``: a Host header outside the list gets 421, except on ``/health``.
      A page that rebinds its own DNS name to this host (DNS rebinding) sends its own name.
    * Admin changes from a browser page of another origin get 403: a cross-site form POST needs
      no preflight, and with ``admin_open`` it needs no key either. The page's browser names it
      in ``Origin`` (or, without one, ``Sec-Fetch-Site``); curl and scripts send neither.
      So do form uploads and WebSockets on the model routes (`paths.opens_to_pages`): a page
      may send either to any site without a preflight.
    * ``server.metrics_api_keys``: ``/metrics``, ``/metrics/engines``, ``/placement`` and
      ``/metrics/model-server`` need one when set.

    It runs inside `Serving.middleware`, which turns its refusals into OpenAI-shaped errors with
    the request id.
    """

    def __init__(self, server: ServerConfig) -> None:
        self.configure(server, parse_hosts(server.allowed_hosts))

    def configure(self, server: ServerConfig, hosts: Hosts) -> None:
        self.hosts = hosts
        self._verdicts: dict[str, bool] = {}
        self.metrics_keys = [k.encode() for k in server.metrics_api_keys]

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if self.hosts and path not in ANY_HOST_PATHS:
            self._check_host(request.headers.get("Host", ""))
        if path.startswith("/admin"):
            if request.method not in SAFE_METHODS:
                _check_origin(request)
        elif opens_to_pages(path):  # a form upload or a WebSocket: no CORS preflight
            _check_origin(request, "uploads and WebSockets")
        elif self.metrics_keys and path in METRICS_PATHS:
            check_key(request, self.metrics_keys, METRICS_REFUSAL)
        return await handler(request)

    def _check_host(self, header: str) -> None:
        allowed = self._verdicts.get(header)
        if allowed is None:
            parsed = _host_port(header)
            allowed = parsed is not None and bool({parsed, (parsed[0], None)} & self.hosts)
            if len(self._verdicts) >= HOST_VERDICTS:
                self._verdicts.clear()
            self._verdicts[header] = allowed
        if not allowed:
            shown = repr(header[:200]) if header else "none"
            raise Misdirected(f"this proxy does not answer for Host {shown} (server.allowed_hosts)")


def parse_hosts(entries: list[str]) -> Hosts:
    """``server.allowed_hosts`` as (name, port) pairs; `ConfigError` naming a bad entry."""
    hosts = set()
    for i, entry in enumerate(entries):
        parsed = _host_port(entry)
        if parsed is None:
            raise ConfigError(
                f"server.allowed_hosts.{i}: {entry!r} is not a host name or name:port"
            )
        hosts.add(parsed)
    return frozenset(hosts)


def _host_port(value: str) -> tuple[str, int | None] | None:
    """``name``, ``name:port``, ``[v6]`` or ``[v6]:port`` as (lower-case name, port); None
    for anything else."""
    if not value or any(c in value for c in "/?#@ \t"):
        return None
    try:
        parts = urlsplit("//" + value)
        name, port = parts.hostname, parts.port
    except ValueError:
        return None
    return (name.rstrip("."), port) if name else None


def _check_origin(request: web.Request, what: str = "admin changes") -> None:
    """Refuse `what` from a page of another origin than the proxy's own (its Host)."""
    origin = request.headers.get("Origin")
    if origin is None:
        # Browsers send Origin with every POST today; Sec-Fetch-Site covers older ones.
        if request.headers.get("Sec-Fetch-Site", "").lower() in ("cross-site", "same-site"):
            raise Forbidden(f"{what} from another site's page are refused", code="cross_origin")
        return
    if not _same_origin(origin, request.headers.get("Host", "")):
        raise Forbidden(
            f"{what} from another origin ({origin[:200]!r}) are refused",
            code="cross_origin",
        )


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _same_origin(origin: str, host: str) -> bool:
    """Whether the Origin header names the host and port of the Host header. The scheme is
    not compared: behind a TLS terminator the page is https, the proxy plain http."""
    try:
        parts = urlsplit(origin)
        name, port = parts.hostname, parts.port
    except ValueError:
        return False
    if parts.scheme not in _DEFAULT_PORTS or not name:
        return False  # "null" (a sandboxed frame, a file), or no origin a browser sends
    own = _host_port(host)
    if own is None:
        return False
    default = _DEFAULT_PORTS[parts.scheme]
    return (name.rstrip("."), port or default) == (own[0], own[1] or default)


#: Why a metrics route refused a request.
METRICS_REFUSAL = (
    "missing or invalid metrics key (expected 'Authorization: Bearer KEY' with a key of"
    " server.metrics_api_keys)"
)
