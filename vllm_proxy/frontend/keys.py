"""API keys at request time: which entry of ``server.api_keys`` a request's bearer token is,
and what that key may reach.

A token is compared with every key by `hmac.compare_digest`, with no early exit on a match, so
the time a check takes says nothing about how much of a key a client guessed.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from fnmatch import fnmatchcase

from ..config import ApiKey, key_label
from ..errors import TooManyRequests

#: The window of ``max_requests_per_minute``, in seconds.
WINDOW_S = 60.0
#: ``Retry-After`` past ``max_concurrent_requests``: when one of the key's requests may have ended.
BUSY_RETRY_S = 1


class Scope:
    """What one API key may use: the models its ``models`` patterns match by name or alias
    (every model when it has none), under all their names; and the admin API when ``admin``.
    `ident` names the key where its uses are counted (a digest: the same across reloads, and
    no part of the key), `label` where they are shown (its ``name``, or ``key-<n>``); the
    limits are the entry's own (None: none)."""

    __slots__ = ("_seen", "admin", "ident", "label", "max_concurrent_requests",
                 "max_realtime_sessions", "max_requests_per_minute", "patterns",
                 "priority")  # fmt: skip

    def __init__(
        self,
        patterns: tuple[str, ...] | None,
        admin: bool = False,
        ident: str = "",
        max_realtime_sessions: int | None = None,
        *,
        label: str = "",
        max_concurrent_requests: int | None = None,
        max_requests_per_minute: int | None = None,
        priority: int = 0,
    ) -> None:
        self.patterns = patterns
        self.admin = admin
        self.ident = ident
        self.label = label
        self.max_realtime_sessions = max_realtime_sessions
        self.max_concurrent_requests = max_concurrent_requests
        self.max_requests_per_minute = max_requests_per_minute
        self.priority = priority
        #: Verdicts by (name, aliases): only configured models are asked about, and a reload
        #: builds new scopes, so it stays as small as the model list.
        self._seen: dict[tuple[str, tuple[str, ...]], bool] = {}

    @property
    def everything(self) -> bool:
        return self.patterns is None

    def allows(self, name: str, aliases: tuple[str, ...]) -> bool:
        """Whether the model `name` (with `aliases`) is in this scope."""
        if self.patterns is None:
            return True
        verdict = self._seen.get((name, aliases))
        if verdict is None:
            verdict = any(fnmatchcase(n, p) for p in self.patterns for n in (name, *aliases))
            self._seen[(name, aliases)] = verdict
        return verdict


class KeyRing:
    """The keys of ``server.api_keys`` with their scopes."""

    def __init__(self, entries: Iterable[ApiKey]) -> None:
        self._keys = [(e.secret.encode(), _scope(e, i)) for i, e in enumerate(entries)]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def admin_keys(self) -> list[bytes]:
        """The keys that open the admin API too (``admin: true``)."""
        return [key for key, scope in self._keys if scope.admin]

    def scopes(self) -> list[Scope]:
        """Every key's scope, in the order of ``server.api_keys``."""
        return [scope for _, scope in self._keys]

    def find(self, token: bytes) -> Scope | None:
        """The scope of the key `token` is, or None; compared with every key."""
        found = None
        for key, scope in self._keys:
            if hmac.compare_digest(token, key):
                found = scope  # keys are unique (config): at most one matches
        return found


def _scope(entry: ApiKey, position: int) -> Scope:
    patterns = tuple(entry.models) if entry.models is not None else None
    ident = hashlib.sha256(entry.secret.encode()).hexdigest()[:16]
    return Scope(
        patterns,
        entry.admin,
        ident,
        entry.max_realtime_sessions,
        label=key_label(entry, position),
        max_concurrent_requests=entry.max_concurrent_requests,
        max_requests_per_minute=entry.max_requests_per_minute,
        priority=entry.priority,
    )


class KeyLimits:
    """The uses of every API key that limit it: its requests in flight and the starts of its
    requests in the last minute, by the key's ident (a reload builds new scopes; the counts
    stay, so a lowered limit meets the requests already in flight and refuses new ones only).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        #: Requests in flight per key (absent: none).
        self.inflight: dict[str, int] = {}
        #: Start times within the window per key with a ``max_requests_per_minute``, oldest first.
        self._starts: dict[str, deque[float]] = {}

    def take(self, scope: Scope) -> None:
        """One more request of `scope`'s key, to be given back with `release`;
        `TooManyRequests` (code ``rate_limit_exceeded``, reason ``concurrency`` or ``rate``)
        past its ``max_concurrent_requests`` or ``max_requests_per_minute``: nothing is taken
        then."""
        ident = scope.ident
        running = self.inflight.get(ident, 0)
        limit = scope.max_concurrent_requests
        if limit is not None and running >= limit:
            raise _refusal(
                f"this API key has {running} requests in flight, its limit"
                " (server.api_keys.max_concurrent_requests); retry when one has ended",
                BUSY_RETRY_S,
                "concurrency",
            )
        if scope.max_requests_per_minute is not None:
            self._count_start(ident, scope.max_requests_per_minute)
        self.inflight[ident] = running + 1

    def release(self, scope: Scope) -> None:
        """The end of a request `take` counted (in a ``finally``)."""
        left = self.inflight[scope.ident] - 1
        if left:
            self.inflight[scope.ident] = left
        else:
            del self.inflight[scope.ident]

    @contextlib.contextmanager
    def hold(self, scope: Scope) -> Iterator[None]:
        """`take` for the block, released when it ends."""
        self.take(scope)
        try:
            yield
        finally:
            self.release(scope)

    def _count_start(self, ident: str, per_minute: int) -> None:
        now = self._clock()
        starts = self._starts.get(ident)
        if starts is None:
            starts = self._starts[ident] = deque()
        while starts and starts[0] <= now - WINDOW_S:
            starts.popleft()
        if len(starts) >= per_minute:
            # The oldest start that keeps the window full leaves it first.
            wait = starts[len(starts) - per_minute] + WINDOW_S - now
            raise _refusal(
                f"this API key started {len(starts)} requests in the last minute, its limit"
                " (server.api_keys.max_requests_per_minute)",
                max(1, math.ceil(wait)),
                "rate",
            )
        starts.append(now)

    def keep(self, scopes: Iterable[Scope]) -> None:
        """After a reload: forget the windows of keys gone or without a rate any more (their
        requests in flight are counted out as they end)."""
        kept = {s.ident for s in scopes if s.max_requests_per_minute is not None}
        for ident in [i for i in self._starts if i not in kept]:
            del self._starts[ident]


def _refusal(message: str, retry_after_s: int, reason: str) -> TooManyRequests:
    return TooManyRequests(message, retry_after_s=retry_after_s, reason=reason)


def bearer(authorization: str) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header as the bytes the client sent,
    or None for any other header (or none)."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip().encode("utf-8", "surrogateescape")
