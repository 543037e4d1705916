"""A model's crash-loop back-off: failed starts in a row, and when the next start may be tried.

Bookkeeping on a clock (`time.monotonic` unless told otherwise), with no timers and no event
loop: the model reports what became of its instances and asks whether a start may go now.

* Every failed start is one more failure in a row; after the n-th the next start waits 1, 2,
  4 ... s (``2 ** (n - 1)``), at most the model's ``max_backoff_s``. Meanwhile requests are
  refused at once: 503, ``Retry-After``, the last cause (`refusal`).
* An instance that started is on probation for `STABLE_S`: dying within it counts as a failed
  start, but the first such death in a row is free (its requests are retried at once). An
  instance that lives through its probation ends the crash loop, as does one that ran and was
  stopped or that died later on.
* An instance that comes up (started or woken) lets the next start go at once; the count of
  failures stays until the loop is over.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Hashable

from ..errors import Unavailable

log = logging.getLogger(__name__)

#: An engine that dies within this long of becoming ready counts as a failed start (crash loop).
STABLE_S = 30.0


def delay_for(failures: int, max_s: float, grace: int = 0) -> float:
    """Seconds the next start waits after `failures` failed starts in a row, the first `grace`
    of them free (0: at once): 1, 2, 4 ... up to `max_s`."""
    if failures <= grace:
        return 0.0
    return min(2.0 ** (failures - 1 - grace), max_s)


class Backoff:
    """One model's failed starts in a row and the time before which no start is tried."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self._clock = clock
        self._failures = 0
        #: No start before this (clock time; 0: now).
        self._retry_at = 0.0
        #: Instances on probation, and when each one's probation is over (clock time).
        self._probation: dict[Hashable, float] = {}

    @property
    def failures(self) -> int:
        """Failed starts in a row (0 once the loop is over)."""
        self._settle()
        return self._failures

    def remaining(self) -> float:
        """Seconds until the next start may be tried (0: now)."""
        self._settle()
        return max(0.0, self._retry_at - self._clock())

    def refusal(self, last_error: str | None) -> Unavailable | None:
        """The error a request gets while the loop backs off (None: a start may go)."""
        wait = self.remaining()
        if wait <= 0:
            return None
        return Unavailable(
            f"model '{self.name}': {self._failures} failed start(s) in a row, next attempt in"
            f" {math.ceil(wait)}s; last error: {last_error}",
            code="engine_backoff",
            retry_after_s=math.ceil(wait),
        )

    def up(self, key: Hashable, started: bool) -> None:
        """Instance `key` serves: the next start may go at once. A fresh start (`started`,
        not a wake) is on probation for `STABLE_S` from now."""
        self._settle()
        self._retry_at = 0.0
        if started:
            self._probation.setdefault(key, self._clock() + STABLE_S)

    def ended(self, key: Hashable, *, failed: bool, ran: bool, stopped: bool, max_s: float) -> None:
        """Instance `key` is gone: `failed` (it ended in ERROR), having `ran` (it was ready
        once), `stopped` (by the proxy). A failed start, or a second death on probation in a
        row, backs off; a stop after it ran, or a death after its probation, ends the loop."""
        self._settle()
        on_probation = self._probation.pop(key, None) is not None
        if failed:
            if not ran:
                self._fail(max_s)
            elif on_probation:
                self._fail(max_s, grace=1)
            else:
                self._failures = 0
        elif stopped and ran:
            self._failures = 0

    def _fail(self, max_s: float, grace: int = 0) -> None:
        """One more failure in a row; past the first `grace` of them, the next start waits."""
        self._failures += 1
        if self._failures <= grace:
            return
        delay = delay_for(self._failures, max_s, grace)
        self._retry_at = self._clock() + delay
        log.warning("%s: %d failed start(s) in a row; next start in %gs", self.name,
                    self._failures, delay)  # fmt: skip

    def _settle(self) -> None:
        """Probations that are over end the loop (in the order the clock passed them)."""
        now = self._clock()
        for key, due in list(self._probation.items()):
            if due <= now:
                del self._probation[key]
                self._failures = 0
                self._retry_at = 0.0
