"""An instance's idle timers, and the `ReplicaPolicy` its model answers them with.

Three timers run while an instance is idle (no lease), each armed from its spec:

- the stop timer (``idle_timeout_s`` of total idleness, asleep or not): evicts it, unless the
  policy keeps it (a replica floor), then asks again after another period;
- the sleep timer (``sleep.after_idle_s``, RUNNING with a usable sleep level): puts it to
  sleep, or asks again after another period while a request of its model waits;
- the downscale timer (``autoscale.downscale_delay_s``, RUNNING): asks the policy whether the
  model may shrink by this replica.

The timers only ask: the instance decides and changes its own state (`evict`, `sleep`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Generic, Protocol, TypeVar

from ..config import ModelSpec
from .ports import EngineContext
from .states import State

log = logging.getLogger(__name__)

Inst_contra = TypeVar("Inst_contra", contravariant=True)


class ReplicaPolicy(Protocol[Inst_contra]):
    """What the model decides for its replicas when one of them has been idle."""

    def may_idle_stop(self, inst: Inst_contra) -> bool:
        """Whether the idle timeout may stop `inst` now (else it is asked again later)."""
        ...

    def downscale(self, inst: Inst_contra) -> bool:
        """`downscale_delay_s` idle: remove it if the model may shrink; False: ask again later."""
        ...


class Idler(Protocol):
    """What the timers see of an instance."""

    id: str
    spec: ModelSpec
    state: State
    leases: int
    ctx: EngineContext

    @property
    def routable(self) -> bool: ...

    def usable_level(self, level: int | None = None) -> int | None: ...

    def evict(self, reason: str) -> asyncio.Task[None] | None: ...

    def sleep(self, reason: str, level: int | None = None) -> asyncio.Task[None] | None: ...


I = TypeVar("I", bound=Idler)  # noqa: E741

#: Where an instance without a lease idles: serving, or put to sleep.
IDLE_STATES = frozenset({State.RUNNING, State.FALLING_ASLEEP, State.SLEEPING})


def idles(state: State, leases: int, retired: bool, wake_asked: bool) -> bool:
    """Whether an instance's idle timers run: in `IDLE_STATES` with no lease, not retired (it
    drains) and no wake asked for (a request waits for it)."""
    return state in IDLE_STATES and leases == 0 and not retired and not wake_asked


class IdleTimers(Generic[I]):
    """The stop, sleep and downscale timers of one instance (see the module docstring)."""

    def __init__(self, inst: I, policy: ReplicaPolicy[I] | None) -> None:
        self._inst = inst
        self._policy = policy
        self._idle: asyncio.TimerHandle | None = None
        self._sleep: asyncio.TimerHandle | None = None
        self._downscale: asyncio.TimerHandle | None = None

    @property
    def armed(self) -> bool:
        """Whether any of them runs."""
        return self._idle is not None or self._sleep is not None or self._downscale is not None

    @property
    def stop_armed(self) -> bool:
        """Whether the stop timer runs."""
        return self._idle is not None

    def arm(self) -> None:
        """Idle from now: every timer its spec and state call for, afresh."""
        self.cancel()
        inst = self._inst
        spec = inst.spec
        policy, scale = spec.sleep, spec.autoscale
        if spec.idle_timeout_s <= 0 and policy is None and scale is None:
            return  # nothing to arm (and no asyncio.get_running_loop(): a getpid() call)
        loop = asyncio.get_running_loop()
        if spec.idle_timeout_s > 0:
            self._idle = loop.call_later(spec.idle_timeout_s, self.idle_expired)
        running = inst.state is State.RUNNING
        if policy is not None and running and inst.usable_level() is not None:
            self._sleep = loop.call_later(policy.after_idle_s, self.sleep_due)
        if scale is not None and running:
            self._downscale = loop.call_later(scale.downscale_delay_s, self.downscale_due)

    def cancel(self) -> None:
        """Not idle any more (a lease, a wake asked for, a stop): every timer off."""
        for timer in (self._idle, self._sleep, self._downscale):
            if timer is not None:
                timer.cancel()
        self._idle = self._sleep = self._downscale = None

    def cancel_sleep(self) -> None:
        """Falling asleep: the stop timer keeps counting total idleness, the sleep timer goes."""
        if self._sleep is not None:
            self._sleep.cancel()
            self._sleep = None

    def idle_expired(self) -> None:
        """The stop timer fired."""
        self._idle = None
        inst = self._inst
        if self._policy is not None and not self._policy.may_idle_stop(inst):
            loop = asyncio.get_running_loop()
            self._idle = loop.call_later(inst.spec.idle_timeout_s, self.idle_expired)
            return
        if inst.evict("idle") is not None:
            log.info("%s: idle for %gs, unloaded", inst.id, inst.spec.idle_timeout_s)

    def downscale_due(self) -> None:
        """The downscale timer fired."""
        self._downscale = None
        inst = self._inst
        scale = inst.spec.autoscale
        if scale is None or self._policy is None or not inst.routable:
            return
        if not self._policy.downscale(inst):
            loop = asyncio.get_running_loop()
            self._downscale = loop.call_later(scale.downscale_delay_s, self.downscale_due)

    def sleep_due(self) -> None:
        """The sleep timer fired: the engine sleeps, unless nobody may want its memory
        (``sleep.on_idle: needed`` and `MemoryBook.room_for_all`); then, or while a request
        of its model waits in admission, the timer is armed for another period."""
        self._sleep = None
        inst = self._inst
        policy = inst.spec.sleep
        if policy is not None and policy.on_idle == "needed" and inst.ctx.memory.room_for_all():
            if inst.state is State.RUNNING and inst.leases == 0:
                log.debug("%s: idle, kept awake: every model fits awake", inst.id)
                loop = asyncio.get_running_loop()
                self._sleep = loop.call_later(policy.after_idle_s, self.sleep_due)
            return
        if inst.sleep("idle") is not None:
            assert policy is not None
            log.info("%s: idle for %gs, put to sleep", inst.id, policy.after_idle_s)
        elif (
            policy is not None
            and inst.state is State.RUNNING
            and inst.leases == 0
            and inst.usable_level() is not None
        ):
            # Not now (a request of its model waits in admission): idle still, so ask again
            # after another period rather than stay awake until its next lease.
            loop = asyncio.get_running_loop()
            self._sleep = loop.call_later(policy.after_idle_s, self.sleep_due)
