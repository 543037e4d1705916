"""Admission: when a start or a wake may take GPU memory, and which requests wait for it.

`Admission` owns the one wait queue (`queueing.Queue`) and decides, on the live instances,
with the pure `planner.plan()` and the pure queue rules of `queueing`:

* a start or a wake (`admit`, `readmit`) waits in the queue for its turn and for memory, then
  claims its placement and asks the victims of its plan to sleep or stop (it never changes
  their state itself), waits for their memory to come back, and returns; a plan that stops
  engines which waiting for busy or moving ones would spare waits first (`_spare_stops`);
* a request for a serving instance asks `holds` whether a waiter before it needs that
  instance's memory and has used up its reorder window;
* starts, wakes and sleeps report their measured seconds (`timed`): the planner's prices.

The manager keeps the names, reload and shutdown; ``app.py`` builds this before the manager,
with the roster's views of the models, and gives it to instances as their `AdmissionPort`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..config import ModelSpec
from ..engines.failures import Stopped
from ..engines.instance import Instance
from ..engines.model import Model, rank_of
from ..engines.states import AWAKE, PHASES, State
from ..errors import Unavailable
from ..metrics import Metrics
from ..planning import queueing
from ..planning.memory import Memory, Placement
from ..planning.planner import (
    DEFAULT_START_S,
    DEFAULT_WAKE_S,
    MOVING,
    Demand,
    DeviceView,
    InstanceView,
    NoFit,
    Plan,
    after,
    plan,
    settled,
)
from ..planning.queueing import Queue, Rank, Waiter

log = logging.getLogger(__name__)

#: The shortest wait for a deadline (`Admission._next_change`): one closer than this is waited
#: for this long, so that the plan made after the wait sees it passed. A deadline a float step
#: or a timer tick (uvloop's are milliseconds, and it runs shorter delays at once) after now
#: would otherwise wake the waiter over and over until the clock reaches it.
MIN_WAIT_S = 0.001


#: States of a placed instance that settle awake or asleep (`scheduler.settled`).
SETTLING = frozenset({State.STARTING, State.WAKE_WAITING, State.WAKING, State.FALLING_ASLEEP})


class Admission:
    """GPU memory admission for every instance, through one queue (see the module docstring)."""

    def __init__(
        self,
        queue: Queue,
        metrics: Metrics,
        memory: Memory,
        instances: Callable[[], list[Instance]],
        models: Callable[[], Mapping[str, Model]],
    ) -> None:
        self.queue = queue
        self.metrics = metrics
        self.memory = memory
        self._all = instances
        self._models = models
        #: Starts and wakes waiting for memory now, by instance id: whose turn it is.
        self._reclaiming: dict[str, Instance] = {}
        #: When each of them gives up (its deadline as last computed by `_take_turn`).
        self._give_up: dict[str, float] = {}
        #: Measured seconds of starts and wakes, by model and engine (the planner's prices).
        self.timings: dict[tuple[str, tuple[Any, ...]], dict[str, float]] = {}

    @property
    def queue_timeout_s(self) -> float:
        return self.queue.rules.queue_timeout_s

    def _instance(self, iid: str) -> Instance | None:
        return next((i for i in self._all() if i.id == iid), None)

    def timed(self, spec: ModelSpec, kind: str, seconds: float) -> None:
        """A start, wake or sleep of `spec` took `seconds` (the mean with the previous one
        counts)."""
        seen = self.timings.setdefault((spec.name, spec.engine_key()), {})
        old = seen.get(kind)
        seen[kind] = seconds if old is None else (old + seconds) / 2

    def _timing(self, spec: ModelSpec, kind: str) -> float | None:
        return self.timings.get((spec.name, spec.engine_key()), {}).get(kind)

    def _views(
        self, waiter: Waiter | None = None, drained: bool = False, protect: bool = True
    ) -> tuple[list[InstanceView], dict[int, int]]:
        """The planner's view of every placed instance (a model's old and new instance during a
        handover both count), and memory promised to starting or waking instances that they
        have not allocated yet. Minimum residencies are weighed against `waiter`; `drained`:
        as if every request in flight had ended (what a waiter's turn would take)."""
        memory = self.memory
        assert memory is not None
        views: list[InstanceView] = []
        pending: dict[int, int] = {}
        pinned = {m.name: m.pinned for m in self._models().values()}
        rules = self.queue.rules
        now = self.queue.clock()
        for i in self._all():
            claim = memory.claims.get(i.id)
            phase = PHASES.get(i.state)
            if claim is None or phase is None:
                continue
            held = memory.held_mb(i.id)
            state = i.state
            # A draining instance is not put to sleep: it is about to stop; nor one whose
            # wakes kept failing the wake check (`breaker`): it is stopped instead. One that is
            # starting, waking or falling asleep carries what it would hold asleep too: it is
            # never taken now, but once settled (`scheduler.settled`) it can be put to sleep
            # (or is asleep), which is what a waiter that spares stops waits for.
            sleepy = i.usable_level() is not None and (i.routable or state in SETTLING)
            load = 0 if drained else i.leases + i.queued()
            kept = (
                protect
                and not drained
                and state in AWAKE
                and queueing.protected(
                    i.running_since, i.spec.min_resident_s,
                    queueing.in_use(i.leases, i.queued(), i.last_used, now, rules),
                    now, waiter, rules,
                )
            )  # fmt: skip
            views.append(
                InstanceView(i.id, held, claim.devices, phase,
                             load, i.last_used, pinned.get(i.name, False),
                             sleep_mb=min(memory.sleep_mb(i.spec), held) if sleepy else None,
                             priority=i.spec.priority, protected=kept,
                             start_s=self._timing(i.spec, "start"),
                             wake_s=self._timing(i.spec, "wake"),
                             sleep_s=self._timing(i.spec, i.next_sleep_kind))
            )  # fmt: skip
            # Growth still to come: a start's, or a wake's once its claim is made (while its
            # victims free memory, and after; before that it holds what NVML already shows),
            # or an awake engine's transient peak, freed after profiling or a wake and taken
            # back on its first full batch.
            woken = state in (State.WAKE_WAITING, State.WAKING) and i.id not in memory.asleep
            growing = state is State.STARTING or woken
            if memory.kind == "nvml" and (growing or state in AWAKE):
                pgid = i.engine.pid if i.engine is not None else None
                for d in claim.devices:
                    if growing:
                        rest = max(held - memory.allocated_mb(i.id, pgid, d), 0)
                    else:
                        rest = memory.unrealised_mb(i.id, pgid, d)
                    pending[d] = pending.get(d, 0) + rest
        return views, pending

    def _inputs(
        self, inst: Instance, drained: bool = False, protect: bool = True
    ) -> tuple[Demand, list[DeviceView], list[InstanceView]]:
        """The planner's input for starting (or waking) `inst` now (see `plan_for`)."""
        memory = self.memory
        assert memory is not None
        views, pending = self._views(self._waiter(inst.name), drained, protect)
        if inst.state is State.WAKE_WAITING:  # its own devices; it holds its sleep memory
            claim = memory.claims[inst.id]
            need = memory.wake_need(inst.id)
            demand = Demand(inst.id, need, len(claim.devices), claim.devices, memory.reserve_mb)
        else:
            siblings = [memory.claims[i.id].devices for i in self._siblings(inst)]
            avoid = tuple(sorted({d for devs in siblings for d in devs}))
            demand = memory.demand(inst.spec, inst.id, avoid)
        # Its own model's other replicas are never its victims.
        demand = dataclasses.replace(demand, siblings=tuple(i.id for i in self._siblings(inst)))
        return demand, list(memory.device_views(pending)), views

    def plan_for(
        self, inst: Instance, drained: bool = False, protect: bool = True, spare: bool = True
    ) -> Plan | NoFit:
        """The scheduler's decision for starting (or waking) `inst` now (pure; no effects);
        `drained`: as if every request in flight had ended; `protect`: minimum residencies
        count; `spare`: a plan that stops engines waiting would spare waits (`_spare_stops`)."""
        demand, devices, views = self._inputs(inst, drained, protect)
        now = self.queue.clock()
        decision = plan(demand, devices, views, now)
        if protect and isinstance(decision, Plan):
            # A plan that went around protected engines: wait for them (until they are idle
            # or the waiter's window ends) when without the protection it would be another,
            # cheaper one (it would have taken them), rather than stop what is at hand.
            bare = plan(demand, devices, self._views(None, drained, protect=False)[0], now)
            kept = tuple(v.name for v in views if v.protected)
            if bare != decision and kept:
                return NoFit(
                    f"model '{inst.name}' waits for {', '.join(kept)} (inside the minimum"
                    " residency and in use)",
                    kept,
                )
        if spare and protect and not drained and isinstance(decision, Plan) and decision.evict:
            return self._spare_stops(inst, decision, demand, devices, now)
        return decision

    def _needs(self, waiter: Instance, inst: Instance) -> bool:
        """Whether `waiter` cannot be placed now without `inst`'s memory, even by stopping
        every idle or asleep engine it may take (only then do requests for `inst` wait behind
        it: otherwise it is not starved by them)."""
        demand, devices, views = self._inputs(waiter, protect=False)
        kept = [dataclasses.replace(v, pinned=True) if v.name == inst.id else v for v in views]
        return not isinstance(plan(demand, devices, kept, self.queue.clock()), Plan)

    def _spare_stops(
        self, inst: Instance, decision: Plan, demand: Demand, devices: list[DeviceView],
        now: float,
    ) -> Plan | NoFit:  # fmt: skip
        """`decision`, or a wait when it stops engines that waiting would spare. A stop costs
        that model a cold start later (tens of seconds), while a busy engine is put to sleep in
        seconds once its requests end, and an engine starting, waking, falling asleep or
        stopping settles soon. So a plan that stops more engines than the plan on the settled
        snapshot (`planner.settled`) waits for those engines, until `_spare_until` (then it
        stops: a 503 when it gives up would be worse)."""
        waiter = self._waiter(inst.name)
        if waiter is None or now >= self._spare_until(inst, waiter):
            return decision
        views = self._views(None, drained=True)[0]
        later = plan(demand, *settled(demand, devices, views), now)
        if not isinstance(later, Plan) or len(later.evict) >= len(decision.evict):
            return decision
        waits = tuple(
            v.name for v in self._views(None, protect=False)[0]
            if v.name != demand.name and not v.pinned and (v.leases > 0 or v.phase in MOVING)
        )  # fmt: skip
        if not waits:
            return decision
        spared = ", ".join(n for n in decision.evict if n not in later.evict)
        return NoFit(
            f"model '{inst.name}' waits for {', '.join(waits)} (busy or changing state) rather"
            f" than stop {spared}",
            waits,
        )

    def devices(self) -> list[DeviceView]:
        """Each device as the planner sees it now (memory promised to starts and wakes
        counted, and what the first start or wake waiting for memory is about to take)."""
        assert self.memory is not None
        return self.memory.device_views(_added(self._views(None)[1], self.queued()))

    def regrowing(self, inst: Instance) -> list[str]:
        """The awake instances on `inst`'s devices that hold less than their claim now (their
        transient peak freed): any of them may take it back while `inst`'s start profiles."""
        claim = self.memory.claims.get(inst.id)
        if claim is None:
            return []
        out = []
        for other in self._all():
            theirs = self.memory.claims.get(other.id)
            if other is inst or other.state not in AWAKE or theirs is None:
                continue
            pgid = other.engine.pid if other.engine is not None else None
            shared = set(theirs.devices) & set(claim.devices)
            if any(self.memory.unrealised_mb(other.id, pgid, d) > 0 for d in shared):
                out.append(other.id)
        return out

    def queued(self, but: str | None = None, head: Instance | None = None) -> dict[int, int]:
        """MiB per device that the first start or wake in the queue for memory (`head`, where
        the caller has it) will take, on the devices its plan chooses once requests in flight
        have ended ({} when none waits, it is of model `but`, or it cannot be placed). Waiting
        instances hold no claim, so without this `/placement` offered the fleet room the
        queue's head was about to take."""
        if head is None:
            turns = self._turns()
            head = turns[0][1] if turns else None
        if head is None or head.name == but:
            return {}
        try:
            demand, devices, views = self._inputs(head, drained=True, protect=False)
        except KeyError:  # its claim went meanwhile (stopped while waiting)
            return {}
        decision = plan(demand, devices, views, self.queue.clock())
        if not isinstance(decision, Plan):
            return {}
        return {d: demand.footprint_mb for d in decision.devices}

    def fit(self, spec: ModelSpec) -> Plan | NoFit:
        """What starting one more instance of `spec` would take now (pure: nothing is claimed
        and nobody is asked to sleep or stop). A `Plan` without victims: it fits as things
        are; with victims: what its start would put to sleep or stop once minimum residencies
        allow; `NoFit`: it would wait for busy or pinned engines."""
        return self.fits([spec])[spec.name]

    def fits(self, specs: list[ModelSpec]) -> dict[str, Plan | NoFit]:
        """`fit` of each of `specs`, all from one snapshot of the instances and devices (made
        once: a view of every model costs one planning round each, not a snapshot each)."""
        memory = self.memory
        assert memory is not None
        views, pending = self._views(None, protect=False)
        # The footprint the queue's head is about to take counts, but in its own model's fit.
        turns = self._turns()
        first = turns[0][1] if turns else None
        head = first.name if first is not None else None
        ahead = self.queued(head=first) if first is not None else {}
        with_head = memory.device_views(_added(pending, ahead))
        without_head = memory.device_views(pending)
        models = self._models()
        now = self.queue.clock()
        out: dict[str, Plan | NoFit] = {}
        for spec in specs:
            model = models.get(spec.name)
            placed = [i for i in model.instances if i.id in memory.claims] if model else []
            avoid = tuple(sorted({d for i in placed for d in memory.claims[i.id].devices}))
            demand = memory.demand(spec, f"{spec.name}#fit", avoid)
            demand = dataclasses.replace(demand, siblings=tuple(i.id for i in placed))
            devices = without_head if spec.name == head else with_head
            out[spec.name] = plan(demand, devices, views, now)
        return out

    def _leaves_first(
        self, head: Instance, inst: Instance, decision: Plan, unplaceable: bool = False
    ) -> bool:
        """Whether `inst` carrying out `decision` leaves `head` (the first in order, or a
        waiter that began waiting more than the reorder window before `inst`) as well off:
        once it has, `head`'s plan with busy engines drained still fits and waits for no
        engine busy now that its plan did not wait for already (`planner.after`).
        `unplaceable`: the answer when `head` cannot be placed even with busy engines
        drained (nothing it needs can be taken from it then)."""
        now = self.queue.clock()
        busy = {v.name for v in self._views(protect=False)[0] if v.leases > 0}
        first, devices, views = self._inputs(head, drained=True)
        before = plan(first, devices, views, now)
        if not isinstance(before, Plan):
            return unplaceable
        mine, _, _ = self._inputs(inst)
        devices, views = after(mine, decision, devices, views)
        later = plan(first, devices, views, now)
        if not isinstance(later, Plan):
            return False
        waited = busy & {*before.evict, *before.sleep}
        return busy & {*later.evict, *later.sleep} <= waited

    def _restore_s(self, inst: Instance) -> float:
        """How long `inst`'s bring-up is expected to take (measured, else the planner's
        stand-ins): a wake's for a sleeping instance, else a cold start's."""
        if inst.state is State.WAKE_WAITING:
            return self._timing(inst.spec, "wake") or DEFAULT_WAKE_S
        return self._timing(inst.spec, "start") or DEFAULT_START_S

    def _spare_until(self, inst: Instance, waiter: Waiter) -> float:
        """Until when `inst` waits for busy and changing engines rather than stop idle ones:
        `queueing.spare_s` after it began waiting, or one reorder window before it gives up
        where the bring-ups ahead of it pushed that back (`_give_up`)."""
        rules = self.queue.rules
        plain = waiter.since + queueing.spare_s(self.queue_timeout_for(inst.spec), rules)
        gives_up = self._give_up.get(inst.id)
        return plain if gives_up is None else max(plain, gives_up - rules.window_s)

    def _turn_s(self, inst: Instance) -> float:
        """Seconds of work expected before `inst`'s turn: the bring-ups of the waiters before it
        in the queue's order, and the longest of the starts and wakes under way (each model's
        measured time, else the planner's stand-in)."""
        ahead = 0.0
        for _, other in self._turns():
            if other is inst:
                break
            ahead += self._restore_s(other)
        under_way = [
            self._timing(i.spec, "wake") or DEFAULT_WAKE_S
            if i.state is State.WAKING
            else self._timing(i.spec, "start") or DEFAULT_START_S
            for i in self._all()
            if i is not inst and i.id not in self._reclaiming
            and i.state in (State.STARTING, State.WAKING)
        ]  # fmt: skip
        return ahead + max(under_way, default=0.0)

    def queue_timeout_for(self, spec: ModelSpec) -> float:
        """How long a start or wake of `spec` waits for memory: the model's own
        ``queue_timeout_s``, else ``admission.queue_timeout_s``."""
        own = spec.queue_timeout_s
        return self.queue_timeout_s if own is None else own

    def _waiter(self, model: str) -> Waiter | None:
        """`model` as the queue sees it (None: nothing of it waits)."""
        return next((w for w in self.queue.waiters() if w.model == model), None)

    def _turns(self) -> list[tuple[Waiter, Instance]]:
        """Starts and wakes waiting for memory, in the queue's order."""
        by_model: dict[str, Instance] = {}
        for inst in self._reclaiming.values():
            by_model.setdefault(inst.name, inst)
        waiters = self.queue.waiters(bringing=by_model)
        return [(w, by_model[w.model]) for w in waiters]

    def holds(self, inst: Instance, rank: Rank, arrived: float) -> bool:
        """Whether a request (of `rank`, arrived at `arrived`) for the serving `inst` queues
        behind a waiter: one that may go (`queueing.may_hold`), before it in the queue's order,
        whose reorder window has run out and whose plan once busy engines drain takes `inst`
        (`queueing.holds`)."""
        if not self._reclaiming:
            return False
        now = self.queue.clock()
        rules = self.queue.rules
        turns = self._turns()
        first, head = turns[0]
        placeable = isinstance(self.plan_for(head, drained=True), Plan)
        for waiter, other in turns:
            if other.name == inst.name or not queueing.overdue(waiter, now, rules):
                continue
            if not queueing.may_hold(waiter, first, rules, first_placeable=placeable):
                continue
            if (waiter.rank, waiter.since) > (rank, arrived):
                continue
            decision = self.plan_for(other, drained=True)
            if (
                isinstance(decision, Plan)
                and queueing.holds(
                    waiter, rank, arrived, (*decision.evict, *decision.sleep), inst.id, now, rules
                )
                # Only behind a waiter that cannot be placed without `inst` (by what is free,
                # idle or asleep elsewhere): otherwise holding requests would slow the engine
                # that serves them, not bring a turn that would never come.
                and self._needs(other, inst)
            ):
                return True
        return False

    def _take(
        self,
        inst: Instance,
        decision: Plan,
        claim: Callable[[Plan], Placement],
        unclaim: Callable[[], None],
    ) -> Placement | None:
        """Claim `decision`'s memory if it is `inst`'s turn (None: not yet; `queueing.turn`)."""
        turns = self._turns()
        if not turns:
            return claim(decision)
        first, head = turns[0]
        me = next((w for w, i in turns if i.name == inst.name), None)
        if me is None or me.model == first.model:
            return claim(decision)
        reclaims = bool(decision.sleep or decision.evict)
        answer = queueing.turn(
            me, first, self.queue.rules,
            first_placeable=isinstance(self.plan_for(head, drained=True), Plan),
            reclaims=reclaims,
            quick=reclaims and self._restore_s(inst) <= self.queue.rules.window_s,
        )  # fmt: skip
        if answer == queueing.WAIT:
            return None
        if answer == queueing.IF_FIRST_STILL_FITS and not self._leaves_first(head, inst, decision):
            return None
        # The bound on reordering, for every waiter (not only the first) that began waiting
        # more than the window before this one: none of them loses what its plan needs.
        window = self.queue.rules.window_s
        for waiter, other in turns[1:]:
            if me.since - waiter.since <= window or other.name == inst.name:
                continue
            if not self._leaves_first(other, inst, decision, unplaceable=True):
                return None
        return claim(decision)

    def _next_change(self) -> float | None:
        """Seconds until a window, residency, idle grace or wait for spared stops runs out
        (None: none pending); at least `MIN_WAIT_S`."""
        now = self.queue.clock()
        residents = [
            (i.running_since, i.spec.min_resident_s, i.last_used)
            for i in self._all()
            if i.state in AWAKE
        ]
        rules = self.queue.rules
        at = queueing.next_deadline(self.queue.waiters(), residents, now, rules)
        # A waiter that spares stops stops waiting for them at its own moment.
        spares = [self._spare_until(i, w) for w, i in self._turns()]
        later = [t for t in (*spares, at) if t is not None and t > now]
        return max(min(later) - now, MIN_WAIT_S) if later else None

    async def admit(self, inst: Instance) -> Placement | None:
        """Wait until `inst` fits (putting idle instances to sleep or stopping them, LRU
        first), up to the queue timeout; then its memory is claimed."""
        memory = self.memory
        assert memory is not None

        def claim(decision: Plan) -> Placement:
            placement = memory.placement(inst.spec, decision.devices)
            memory.claim(inst.id, placement)
            return placement

        def unclaim() -> None:
            memory.release_claim(inst.id)

        return await self._reclaim(inst, State.STARTING, claim, unclaim)

    async def readmit(self, inst: Instance) -> None:
        """A wake (the instance is WAKE_WAITING): wait until its whole footprint fits on its
        devices again (same rules as a start), then claim it."""
        memory = self.memory
        assert memory is not None

        asleep_mb = memory.held_mb(inst.id)
        level = memory.slept_level.get(inst.id)

        def claim(decision: Plan) -> Placement:
            memory.wake_claim(inst.id)
            return memory.claims[inst.id]

        def unclaim() -> None:
            memory.sleep_claim(inst.id, asleep_mb, level)

        await self._reclaim(inst, State.WAKE_WAITING, claim, unclaim)

    async def _reclaim(
        self,
        inst: Instance,
        state: State,
        claim: Callable[[Plan], Placement],
        unclaim: Callable[[], None],
    ) -> Placement:
        ticket = self.queue.enter(inst.name, rank_of(inst.spec), instance=inst.id)
        self._reclaiming[inst.id] = inst
        try:
            return await self._take_turn(inst, state, claim, unclaim)
        finally:
            del self._reclaiming[inst.id]
            self._give_up.pop(inst.id, None)
            self.queue.leave(ticket)

    async def _take_turn(
        self,
        inst: Instance,
        state: State,
        claim: Callable[[Plan], Placement],
        unclaim: Callable[[], None],
    ) -> Placement:
        """Plan, wait for the turn, claim and make room (see `_reclaim`)."""
        memory = self.memory
        assert memory is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        expected_end = started
        wait_metric = self.metrics.queue_wait.labels(inst.name)
        while True:
            await memory.read_fresh()
            if inst.state is not state:
                raise Stopped(f"model '{inst.name}' was stopped while waiting", code="stopped")
            model = self._models().get(inst.name)
            if model is not None and model.forsaken(inst):
                # Every request it was brought up for has gone: take nobody's memory for it.
                raise Unavailable(
                    f"model '{inst.name}': no request waits for it any more", code="abandoned"
                )
            # The timeout in force now (a reload that shortens it bounds this wait too), counted
            # from the end of the last bring-up ahead of it that it is expected to wait for.
            timeout_s = self.queue_timeout_for(inst.spec)
            ahead = self._turn_s(inst)
            if ahead > 0:
                expected_end = max(expected_end, loop.time() + ahead)
            deadline = queueing.give_up_at(started, expected_end, timeout_s, self.queue.rules)
            self._give_up[inst.id] = deadline
            decision = self.plan_for(inst)
            need = self._need(inst)  # taken before the claim (a wake's)
            placement = None
            if isinstance(decision, Plan):
                placement = self._take(inst, decision, claim, unclaim)
            if isinstance(decision, Plan) and placement is not None:
                # Memory is claimed; act on the victims before the first await: later plans
                # see both (an instance counts as awake until its /sleep call has returned).
                self.queue.changed()
                naps = [v.sleep("memory") for v in self._instances(decision.sleep)]
                stops = [v.evict("memory") for v in self._instances(decision.evict)]
                if decision.sleep:
                    log.info("%s: putting %s to sleep to make room", inst.id,
                             ", ".join(decision.sleep))  # fmt: skip
                if decision.evict:
                    log.info("%s: evicting %s to make room", inst.id, ", ".join(decision.evict))
                if decision.sleep or decision.evict:
                    # Its own stop (an unload, shutdown) ends this wait at once: the victims'
                    # sleeps and stops go on by themselves.
                    victims = [t for t in (*naps, *stops) if t is not None]
                    await self._while_in(inst, state, _settled(victims))
                    freed = await self._while_in(inst, state, memory.wait_free(decision.devices,
                                                                               need))  # fmt: skip
                    if not freed:
                        # Less came back than planned (a sleep that kept more, another
                        # program): plan again on fresh readings rather than fail in vLLM.
                        unclaim()
                        if inst.state is state and loop.time() < deadline:
                            continue
                        raise Unavailable(
                            f"model '{inst.name}' cannot start: the GPU memory freed for it did"
                            f" not come back within {memory.free_timeout_s:g}s",
                            code="insufficient_gpu_memory",
                            retry_after_s=max(1, int(self.queue_timeout_s) or 5),
                        )
                wait_metric.observe(loop.time() - started)
                return placement
            remaining = deadline - loop.time()
            hopeless = isinstance(decision, NoFit) and self._hopeless(decision)
            if remaining <= 0 or hopeless:
                wait_metric.observe(loop.time() - started)
                what = "wake" if state is State.WAKE_WAITING else "start"
                why = (
                    f"{what}: not enough GPU memory: {decision.reason}"
                    if isinstance(decision, NoFit)
                    else f"{what} within {loop.time() - started:.0f}s: models queued before it"
                    " still wait for the memory it needs"
                )
                if isinstance(decision, NoFit) and decision.blockers and hopeless:
                    why += " (pinned engines keep it: waiting cannot help)"
                raise Unavailable(
                    f"model '{inst.name}' cannot {why}",
                    code="insufficient_gpu_memory",
                    retry_after_s=max(1, int(timeout_s) or 5),
                )
            change = self._next_change()
            await self._wait_capacity(inst, remaining if change is None else min(change, remaining))

    def _hopeless(self, decision: NoFit) -> bool:
        """Whether waiting cannot make `decision` fit: nothing holds the memory it lacks but
        pinned engines (or nothing at all: the devices are too small, or others use them)."""
        pinned = {
            i.id for m in self._models().values() if m.pinned for i in m.instances
            if i.state is State.RUNNING or i.state is State.SLEEPING
        }  # fmt: skip
        return set(decision.blockers) <= pinned

    async def _while_in(self, inst: Instance, state: State, wait: Awaitable[bool]) -> bool:
        """`wait`'s answer, unless `inst` leaves `state` first (stopped, unloaded, shut down):
        then `Stopped` at once, not when the wait runs out."""
        task = asyncio.ensure_future(wait)
        try:
            while not task.done():
                if inst.state is not state:
                    raise Stopped(f"model '{inst.name}' was stopped while waiting", code="stopped")
                change = asyncio.ensure_future(inst.wait_change())
                try:
                    await asyncio.wait({task, change}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    change.cancel()
            return task.result()
        finally:
            task.cancel()

    def _siblings(self, inst: Instance) -> list[Instance]:
        """The other placed, live replicas of `inst`'s model."""
        assert self.memory is not None
        model = self._models().get(inst.name)
        if model is None:
            return []
        return [
            i for i in model.instances
            if i is not inst and not i.retired and i.id in self.memory.claims
        ]  # fmt: skip

    def _instances(self, ids: tuple[str, ...]) -> list[Instance]:
        return [i for i in map(self._instance, ids) if i is not None]

    def _need(self, inst: Instance) -> int:
        """What must be free on the devices before the engine allocates: a start's footprint,
        or what a wake adds to what the sleeping engine still holds (taken before the claim)."""
        assert self.memory is not None
        if inst.state is State.WAKE_WAITING:
            return self.memory.wake_need(inst.id)
        return self.memory.footprint(inst.spec.name)

    async def _wait_capacity(self, inst: Instance, timeout: float) -> None:
        waits = [
            asyncio.ensure_future(self.queue.wait(timeout)),
            asyncio.ensure_future(inst.wait_change()),
        ]
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def evict_more(self, devices: tuple[int, ...]) -> bool:
        """After an out-of-memory start: stop the least recently used idle instance there."""
        if not devices or self.memory is None:
            return False
        pinned = {m.name for m in self._models().values() if m.pinned}
        claims = self.memory.claims
        idle = [
            i for i in self._all()
            if i.id in claims and set(devices) & set(claims[i.id].devices)
            and (i.asleep or (i.state in AWAKE and i.leases == 0))
            and i.name not in pinned
        ]  # fmt: skip
        for victim in sorted(idle, key=lambda i: i.last_used):
            task = victim.evict("out_of_memory")
            if task is not None:
                await task
                need = self.memory.demand_mb(victim.spec)
                await self.memory.wait_free(devices, need)
                return True
        return False


async def _settled(tasks: list[asyncio.Task[None]]) -> bool:
    """True once `tasks` have ended; a caller that gives up does not cancel them (and what
    they end with is still retrieved: each task reports its own failure)."""
    if tasks:
        together = asyncio.gather(*tasks)
        together.add_done_callback(_retrieved)
        await asyncio.shield(together)
    return True


def _retrieved(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


def _added(a: Mapping[int, int], b: Mapping[int, int]) -> dict[int, int]:
    """Two per-device figures added."""
    out = dict(a)
    for d, mb in b.items():
        out[d] = out.get(d, 0) + mb
    return out
