"""Whether an engine makes progress on the requests it has in flight (the stall watchdog).

vLLM's ``/health`` answers 200 while its decode loop is stuck (``/health/decode`` was never
merged), so health probes cannot see a decode stall. What the proxy can see is the bytes: the
upstream client counts every byte an engine sends on a request's connection (`Progress.seen`),
without a clock call per read, and the health watcher compares that count from probe to probe
(`Progress.stalled_for`). Time spent while a client holds a response back (its buffers full,
the engine's socket paused) is no stall of the engine's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class Flow(Protocol):
    """A response in flight, as the watchdog looks at it."""

    def waiting_on_client(self) -> bool:
        """Whether reading it is paused because its client takes nothing."""
        ...


class Progress:
    """One engine's responses in flight and the bytes it has sent on them."""

    __slots__ = ("_clock", "_mark", "_since", "flows", "seen")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        #: Responses in flight (added when sent, removed when released).
        self.flows: set[Flow] = set()
        #: Bytes received from the engine on them, in all.
        self.seen = 0
        self._mark = 0
        self._since = clock()

    def begin(self, flow: Flow) -> None:
        """A request went out: the first of a busy spell starts the clock."""
        if not self.flows:
            self._mark, self._since = self.seen, self._clock()
        self.flows.add(flow)

    def end(self, flow: Flow) -> None:
        self.flows.discard(flow)

    def stalled_for(self) -> float:
        """Seconds since the engine last sent a byte while it had requests in flight and
        none was held back by its client (0: making progress, or nothing to do)."""
        now = self._clock()
        if (
            not self.flows
            or self.seen != self._mark
            or any(f.waiting_on_client() for f in self.flows)
        ):
            self._mark, self._since = self.seen, now
            return 0.0
        return now - self._since
