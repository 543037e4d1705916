"""How many replicas a model runs: the load check, the upscale delay, and which replicas leave.

The rules are pure functions of the spec and a few counts (`desired`, `may_shrink`,
`surplus_count`); `Autoscaler` (one per model, owned by its `Model`) applies them to the model's
instances. It decides and the model acts: adding replicas is `Model.grow` (wake sleeping ones
first, then start new ones), and retiring those a reload leaves above the ceiling is the model's
too. The one thing it does itself is ask an idle replica to leave (`downscale`): it is the
`idle.ReplicaPolicy` the model's instances call from their idle and downscale timers.

* **Desired** replicas: the fixed count, or ``ceil((requests in flight + waiting) /
  target_ongoing_requests)`` within ``[max(min_replicas, 1), max_replicas]``.
* **Up** (`check_load`, on every lease and every replica that comes up): the replicas missing
  (starting, running and waking ones count) are added at once, or after ``upscale_delay_s`` if
  the load still asks for them then. With no request in flight or waiting, an asleep replica
  counts too: only a missing one is started, none is woken.
* **Down** (`downscale`): an autoscaled replica idle for ``downscale_delay_s`` leaves while more
  replicas are awake than ``min_replicas`` and than desired, one at a time. ``idle_timeout_s``
  stops idle instances down to ``min_replicas`` (`may_idle_stop`); fixed replicas stop together.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Protocol

from ..config import ModelSpec
from .instance import Instance
from .states import ASLEEP_OR_FALLING, DORMANT, State

log = logging.getLogger(__name__)

#: Instance states that count as kept by the model (for the replica floor and the ceiling).
KEPT = frozenset({State.STARTING, State.RUNNING, *DORMANT})
#: Instance states that count toward the model's size (an asleep one is woken before a new
#: one is started).
COUNTED = frozenset({State.STARTING, State.RUNNING, State.WAKE_WAITING, State.WAKING})


def scaled(spec: ModelSpec) -> bool:
    """More than one engine may run (fixed replicas or an autoscaler)."""
    return spec.replica_bounds() != (0, 1)


def desired(spec: ModelSpec, ongoing: int) -> int:
    """Replicas the load asks for: `ongoing` requests (in flight on running replicas plus
    waiting) per ``target_ongoing_requests``, within the bounds; the ceiling without an
    autoscaler."""
    floor, ceiling = spec.replica_bounds()
    scale = spec.autoscale
    if scale is None:
        return ceiling
    return min(ceiling, max(floor, 1, math.ceil(ongoing / scale.target_ongoing_requests)))


def may_shrink(spec: ModelSpec, awake: int, wanted: int, leaving: int) -> bool:
    """Whether an idle replica of an autoscaled model may leave: more are `awake` than
    ``min_replicas`` and than `wanted` (the desired count), and none is `leaving` already."""
    scale = spec.autoscale
    return scale is not None and awake > max(scale.min_replicas, wanted) and leaving == 0


def surplus_count(spec: ModelSpec, kept: int) -> int:
    """Replicas above the ceiling (after a reload lowered it)."""
    _, ceiling = spec.replica_bounds()
    return max(kept - ceiling, 0)


class Replicas(Protocol):
    """What the autoscaler reads of its model and asks of it (`model.Model`)."""

    spec: ModelSpec
    #: Live instances, oldest first.
    instances: list[Instance]
    #: Requests waiting for an instance to start or wake.
    waiting: int
    closed: bool
    removed: bool

    @property
    def draining(self) -> bool: ...

    def serving(self) -> Instance | None: ...

    def grow(self, count: int, wake: bool = True) -> None:
        """Add `count` replicas in the background (waking asleep ones first, with `wake`)."""
        ...


class Autoscaler:
    """One model's replica count: the `idle.ReplicaPolicy` of its instances."""

    def __init__(self, model: Replicas) -> None:
        self._model = model
        #: The load check due after ``upscale_delay_s`` (None: none pending).
        self._upscale_at: asyncio.TimerHandle | None = None

    @property
    def scaled(self) -> bool:
        return scaled(self._model.spec)

    @property
    def upscale_pending(self) -> bool:
        """A load check is due after ``upscale_delay_s``."""
        return self._upscale_at is not None

    def replicas(self) -> list[Instance]:
        """Live replicas that count toward the model's size: not retired, not on their way
        out, not asleep."""
        return [i for i in self._model.instances if i.state in COUNTED and not i.retired]

    def desired(self) -> int:
        """How many replicas the load asks for now, within the model's bounds."""
        return desired(self._model.spec, self._ongoing())

    def _ongoing(self) -> int:
        """Requests in flight on the running replicas plus those waiting for one."""
        m = self._model
        return sum(i.leases for i in m.instances if i.routable) + m.waiting

    def kept(self) -> list[Instance]:
        """Live replicas the model keeps, asleep ones included."""
        return [i for i in self._model.instances if i.state in KEPT and not i.retired]

    def _may_grow(self) -> bool:
        m = self._model
        return not (m.closed or m.removed or m.draining)

    def check_load(self) -> None:
        """After a lease (or a start): add replicas when the load asks for more, at once or
        after ``upscale_delay_s`` of sustained load. A single-engine model never grows."""
        if not self.scaled:
            return
        missing = self.desired() - len(self.replicas())
        if missing <= 0 or not self._may_grow():
            return
        if self._ongoing() == 0:
            # No request in flight or waiting: a replica asleep keeps its place in the count
            # (woken, it would only fall asleep again, and wake the other as it does: replicas
            # that wake each other in turn for ever). Only a replica that is missing starts.
            missing = self.desired() - len(self.kept())
            if missing > 0:
                self._model.grow(missing, wake=False)
            return
        scale = self._model.spec.autoscale
        delay = scale.upscale_delay_s if scale else 0.0
        if delay <= 0:
            self._model.grow(missing)
        elif self._upscale_at is None:
            loop = asyncio.get_running_loop()
            self._upscale_at = loop.call_later(delay, self._upscale_due)

    def _upscale_due(self) -> None:
        self._upscale_at = None
        if self._model.serving() is None:  # unloaded, idle-stopped or crashed meanwhile: no load
            return
        missing = self.desired() - len(self.replicas())
        if missing > 0 and self._may_grow():
            self._model.grow(missing)

    def surplus(self, keep: Instance | None) -> list[Instance]:
        """After a reload lowered the ceiling: the replicas to retire, asleep ones first, then
        the least busy; never `keep` (the one waiting requests are brought up on)."""
        kept = [i for i in self._model.instances if i.state in KEPT and not i.retired]
        kept.sort(
            key=lambda i: (i is keep, i.state not in ASLEEP_OR_FALLING, i.leases, -i.last_used)
        )
        return kept[: surplus_count(self._model.spec, len(kept))]

    def status(self) -> dict[str, object]:
        """The replica counts an operator sees."""
        spec = self._model.spec
        floor, ceiling = spec.replica_bounds()
        mode = "autoscale" if spec.autoscale else ("fixed" if spec.replicas else "single")
        return {
            "mode": mode,
            "min": floor,
            "max": ceiling,
            "desired": self.desired() if self._model.serving() is not None else floor,
            "live": len(self.replicas()),
        }

    # -- idle.ReplicaPolicy --------------------------------------------------------------

    def may_idle_stop(self, inst: Instance) -> bool:
        """Whether `inst`'s idle timeout may stop it. Fixed replicas stop together, once none
        of them has served for ``idle_timeout_s``; otherwise the model keeps `min_replicas`."""
        spec = self._model.spec
        floor, _ = spec.replica_bounds()
        if spec.replicas is not None:
            cutoff = time.monotonic() - spec.idle_timeout_s
            return all(i.leases == 0 and i.last_used <= cutoff for i in self.replicas())
        others = [i for i in self._model.instances
                  if i is not inst and i.state in KEPT and not i.retired]  # fmt: skip
        return len(others) >= floor

    def downscale(self, inst: Instance) -> bool:
        """An autoscaled replica idle for ``downscale_delay_s``: remove it (put to sleep with a
        sleep policy, else stop) if `may_shrink`; False when it stays (its timer is armed
        again)."""
        scale = self._model.spec.autoscale
        if scale is None or inst.state is not State.RUNNING or inst.leases > 0:
            return True
        instances = self._model.instances
        awake = [i for i in instances if i.routable]
        leaving = [i for i in instances if i.state in (State.STOPPING, State.FALLING_ASLEEP)]
        # The load decides, not this replica's idleness: streams stay where they started, so
        # a replica the load asks for can sit idle while another carries the requests.
        if not may_shrink(self._model.spec, len(awake), self.desired(), len(leaving)):
            return False
        log.info("%s: idle for %gs, scaling %s down to %d replica(s)", inst.id,
                 scale.downscale_delay_s, self._model.spec.name, len(awake) - 1)  # fmt: skip
        if inst.sleep("downscale") is None:
            inst.evict("downscale")
        return True
