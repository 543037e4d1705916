"""What the operator console shows over time: the instances' state changes (with their reasons)
and each device's memory, sampled, over the last hour; both bounded.

The `Manager` notes every public state change here (`EngineContext.observe`); the console's
sampler adds a memory sample every `SAMPLE_S`. Readers wait on `changed()` rather than
polling, and read only what came after the sequence number they last saw.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

#: Events kept (a day of an idle server; a busy one keeps its last hour or so).
MAX_EVENTS = 1000
#: How far back memory samples go, and how often one is taken.
WINDOW_S = 3600.0
SAMPLE_S = 10.0


class Journal:
    """A bounded timeline of state changes and memory samples, with a change signal."""

    def __init__(self, max_events: int = MAX_EVENTS, window_s: float = WINDOW_S) -> None:
        self.events: deque[dict[str, Any]] = deque(maxlen=max_events)
        # Room for a sample every SAMPLE_S and as many again after state changes.
        self.samples: deque[dict[str, Any]] = deque(maxlen=2 * int(window_s / SAMPLE_S) + 2)
        self.window_s = window_s
        #: Bumped on every event; the live stream sends what came after the last one it sent.
        self.seq = 0
        self._changed = asyncio.Event()

    def note(self, model: str, instance: str, old: str, new: str, reason: str = "") -> None:
        """One state change, as operators see states (``running``, ``sleeping``...)."""
        self.seq += 1
        self.events.append({"seq": self.seq, "t": time.time(), "model": model,
                            "instance": instance, "old": old, "new": new,
                            "reason": reason})  # fmt: skip
        self.poke()

    def poke(self) -> None:
        """Wake the readers: something they show changed (a state, a queue, a request)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def changed(self) -> asyncio.Event:
        """The event set at the next change after this call."""
        return self._changed

    def sample(self, gpus: list[dict[str, Any]]) -> None:
        """One memory sample: per device, ``used_mb`` and each model's ``awake``/``asleep``
        MiB."""
        now = time.time()
        self.samples.append({"t": now, "gpus": gpus})
        while self.samples and self.samples[0]["t"] < now - self.window_s:
            self.samples.popleft()

    def since(self, seq: int) -> list[dict[str, Any]]:
        """The events after `seq` (all kept ones for 0)."""
        return [e for e in self.events if e["seq"] > seq]

    def history(self) -> dict[str, Any]:
        """The last hour: memory samples and the events within it."""
        start = time.time() - self.window_s
        return {
            "window_s": self.window_s,
            "samples": list(self.samples),
            "events": [e for e in self.events if e["t"] >= start],
        }
