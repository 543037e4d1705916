"""API keys at request time: which entry of ``server.api_keys`` a request's bearer token is,
and what that key may reach.

A token is compared with every key by `hmac.compare_digest`, with no early exit on a match, so
the time a check takes says nothing about how much of a key a client guessed.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from fnmatch import fnmatchcase

from .config import ApiKey


class Scope:
    """What one API key may use: the models its ``models`` patterns match by name or alias
    (every model when it has none), under all their names; and the admin API when ``admin``.
    `ident` names the key where its uses are counted (a digest: the same across reloads, and
    no part of the key); `max_realtime_sessions` bounds its realtime sessions."""

    __slots__ = ("_seen", "admin", "ident", "max_realtime_sessions", "patterns")

    def __init__(
        self,
        patterns: tuple[str, ...] | None,
        admin: bool = False,
        ident: str = "",
        max_realtime_sessions: int | None = None,
    ) -> None:
        self.patterns = patterns
        self.admin = admin
        self.ident = ident
        self.max_realtime_sessions = max_realtime_sessions
        #: Verdicts by (name, aliases): only configured models are asked about, and a reload
        #: builds new scopes, so it stays as small as the model list.
        self._seen: dict[tuple[str, tuple[str, ...]], bool] = {}

    @property
    def everything(self) -> bool:
        return self.patterns is None

    @property
    def unbounded(self) -> bool:
        """Every model, and no limit of its own: a request needs nothing of its scope."""
        return self.patterns is None and self.max_realtime_sessions is None

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
        self._keys = [(e.secret.encode(), _scope(e)) for e in entries]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def admin_keys(self) -> list[bytes]:
        """The keys that open the admin API too (``admin: true``)."""
        return [key for key, scope in self._keys if scope.admin]

    def find(self, token: bytes) -> Scope | None:
        """The scope of the key `token` is, or None; compared with every key."""
        found = None
        for key, scope in self._keys:
            if hmac.compare_digest(token, key):
                found = scope  # keys are unique (config): at most one matches
        return found


def _scope(entry: ApiKey) -> Scope:
    patterns = tuple(entry.models) if entry.models is not None else None
    ident = hashlib.sha256(entry.secret.encode()).hexdigest()[:16]
    return Scope(patterns, entry.admin, ident, entry.max_realtime_sessions)


def bearer(authorization: str) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header as the bytes the client sent,
    or None for any other header (or none)."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip().encode("utf-8", "surrogateescape")
