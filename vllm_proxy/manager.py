"""The set of models: names and aliases, admission by GPU memory, reload, drain and shutdown.

The `Manager` maps names and aliases to `Model`s (each the owner of its instances), decides
admission with the pure `scheduler.plan()` over every live instance, and asks instances to
evict themselves; it never changes an instance's state directly. Admin and proxy read
`snapshot()`, never Memory's or an instance's internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .config import ModelSpec
from .engine import EngineProcess
from .errors import NotFound, Unavailable
from .footprint import footprint_for_spec
from .instance import EngineContext, Instance, State, Stopped, retrieve
from .memory import Memory, Placement
from .model import Model
from .scheduler import Demand, ModelView, NoFit, Plan, plan

log = logging.getLogger(__name__)

#: On a forced exit: how long the guards get to stop their engine trees before the group kill.
FORCED_KILL_GRACE_S = 0.3


class Lease:
    """The request path's hold on an instance: acquired on entry, released in ``__aexit__``.

    A plain class rather than a generator-based context manager: it is on every request.
    """

    __slots__ = ("inst", "model", "session")

    def __init__(self, model: Model, session: str | None = None) -> None:
        self.model = model
        self.session = session

    async def __aenter__(self) -> tuple[Instance, EngineProcess]:
        self.inst, engine = await self.model.acquire(self.session)
        return self.inst, engine

    async def __aexit__(self, *exc: object) -> None:
        self.inst.release()


class Manager:
    """All configured models by name and alias, admission by GPU memory, proxy-wide operations."""

    def __init__(
        self,
        specs: dict[str, ModelSpec],
        ctx: EngineContext,
        memory: Memory | None = None,
        queue_timeout_s: float = 30.0,
        max_queue: int = 1024,
    ) -> None:
        self.ctx = ctx
        self.memory = memory
        self.queue_timeout_s = queue_timeout_s
        self.max_queue = max_queue
        ctx.on_capacity = self._capacity_changed
        if memory is not None:
            ctx.admit = self._admit
            ctx.readmit = self._readmit
            ctx.memory_lock = memory.starting_on
            ctx.device_lock = memory.device_lock
            ctx.vacate = memory.vacate
            ctx.doze = memory.doze
            ctx.usage = memory.usage
            ctx.residue = memory.residue
            ctx.wait_released = memory.wait_released
            ctx.grow_budget = memory.grow_budget
        ctx.weights_mb = self._weights_mb
        self.models: dict[str, Model] = {n: self._new_model(s) for n, s in specs.items()}
        #: Models removed by a reload whose instances still drain or stop.
        self.removed: set[Model] = set()
        self.names: dict[str, str] = {}
        self._index_names()
        self.closing = False
        self._capacity = asyncio.Event()
        self._background: asyncio.Task[None] | None = None
        #: Preloads still running, by model name.
        self.preloading: dict[str, asyncio.Task[None]] = {}

    def _new_model(self, spec: ModelSpec) -> Model:
        evict_more = self._evict_more if self.memory is not None else None
        return Model(spec, self.ctx, self.ctx.registry.new_id, self.max_queue, evict_more)

    def _index_names(self) -> None:
        names = {}
        for name, model in self.models.items():
            names[name] = name
            for alias in model.spec.aliases:
                names[alias] = name
        self.names = names

    def all_instances(self) -> list[Instance]:
        """Every live instance, of configured and of removed models."""
        return [i for m in (*self.models.values(), *self.removed) for i in m.instances]

    def instance(self, iid: str) -> Instance | None:
        return next((i for i in self.all_instances() if i.id == iid), None)

    def start(self) -> None:
        """Start background work (the NVML refresher); call inside the running loop."""
        if self.memory is not None:
            self._background = asyncio.ensure_future(self.memory.run(self._engine_groups))

    def preload(self, names: list[str] | None = None) -> None:
        """Start the models marked ``preload`` (or those of `names` that are) in the background;
        those with a sleep policy go to sleep once up. `preloading` lists the ones under way."""
        for name, model in self.models.items():
            if not model.spec.preload or (names is not None and name not in names):
                continue
            if name in self.preloading:
                continue
            task = asyncio.ensure_future(model.preload())
            self.preloading[name] = task

            def done(t: asyncio.Task[None], name: str = name) -> None:
                if self.preloading.get(name) is t:
                    del self.preloading[name]
                retrieve(t)

            task.add_done_callback(done)

    def _engine_groups(self) -> dict[str, tuple[int, float]]:
        """Every RUNNING engine's process group, with when it (last) became RUNNING."""
        return {
            i.id: (i.engine.pid, i.running_since)
            for i in self.all_instances()
            if i.state is State.RUNNING and i.engine is not None and i.engine.pid is not None
        }

    def resolve(self, requested: str) -> Model:
        """The model serving `requested` (a model name or alias), or `NotFound`."""
        name = self.names.get(requested)
        if name is None:
            valid = ", ".join(sorted(self.names)) or "(none configured)"
            raise NotFound(
                f"The model '{requested}' does not exist. Available models: {valid}",
                param="model",
            )
        return self.models[name]

    def lease(self, model: str | Model, session: str | None = None) -> Lease:
        """``async with manager.lease(name) as (instance, engine):`` holds a lease for the body.

        `session` is the value of the model's affinity header, if any. Raises `NotFound` for an
        unknown name and `Unavailable` while shutting down.
        """
        if self.closing:
            raise Unavailable("the proxy is shutting down", code="shutting_down")
        return Lease(self.resolve(model) if isinstance(model, str) else model, session)

    def update_metrics(self) -> None:
        """Refresh the request gauges from the leases (at scrape time: the request path itself
        touches no metric for a lease)."""
        metrics = self.ctx.metrics
        for model in self.models.values():
            total = 0
            for inst in model.instances:
                total += inst.leases
                metrics.instance_active.labels(model.name, inst.id).set(inst.leases)
            metrics.active.labels(model.name).set(total)

    def active_leases(self) -> int:
        return sum(i.leases for i in self.all_instances())

    def _capacity_changed(self) -> None:
        self._capacity.set()
        self._capacity = asyncio.Event()

    # -- admission -----------------------------------------------------------------------

    def _views(self) -> tuple[list[ModelView], dict[int, int]]:
        """The planner's view of every placed instance (a model's old and new instance during a
        handover both count), and memory promised to starting or waking instances that they
        have not allocated yet."""
        memory = self.memory
        assert memory is not None
        views: list[ModelView] = []
        pending: dict[int, int] = {}
        pinned = {m.name: m.pinned for m in self.models.values()}
        for i in self.all_instances():
            claim = memory.claims.get(i.id)
            if claim is None:
                continue
            held = memory.held_mb(i.id)
            state = i.state
            sleepy = i.spec.sleep is not None and state is State.RUNNING
            views.append(
                ModelView(i.id, held, claim.devices, state is State.RUNNING,
                          i.leases + i.queued(), i.last_used, pinned.get(i.name, False),
                          starting=state is State.STARTING, stopping=state is State.STOPPING,
                          sleep_mb=min(memory.sleep_mb(i.spec), held) if sleepy else None,
                          asleep=i.asleep, waking=state is State.WAKING,
                          falling_asleep=state is State.SLEEPING and not i.asleep)
            )  # fmt: skip
            # Growth still to come; a wake not yet admitted holds what NVML already shows.
            roused = state is State.WAKING and i.id not in memory.asleep
            growing = state is State.STARTING or roused
            if growing and memory.kind == "nvml":
                pgid = i.engine.pid if i.engine is not None else None
                for d in claim.devices:
                    rest = max(held - memory.allocated_mb(i.id, pgid, d), 0)
                    pending[d] = pending.get(d, 0) + rest
        return views, pending

    def plan_for(self, inst: Instance) -> Plan | NoFit:
        """The scheduler's decision for starting (or waking) `inst` now (pure; no effects)."""
        memory = self.memory
        assert memory is not None
        views, pending = self._views()
        if inst.state is State.WAKING:  # its own devices; it already holds its sleep memory
            claim = memory.claims[inst.id]
            need = memory.wake_need(inst.id)
            demand = Demand(inst.id, need, len(claim.devices), claim.devices, memory.reserve_mb)
        else:
            siblings = [memory.claims[i.id].devices for i in self._siblings(inst)]
            avoid = tuple(sorted({d for devs in siblings for d in devs}))
            demand = memory.demand(inst.spec, inst.id, avoid)
        return plan(demand, memory.device_views(pending), views)

    async def _admit(self, inst: Instance) -> Placement | None:
        """Wait until `inst` fits (putting idle instances to sleep or stopping them, LRU
        first), up to the queue timeout; then its memory is claimed."""
        memory = self.memory
        assert memory is not None

        def claim(decision: Plan) -> Placement:
            placement = memory.placement(inst.spec, decision.devices)
            memory.occupy(inst.id, placement)
            return placement

        def unclaim() -> None:
            memory.vacate(inst.id)

        return await self._reclaim(inst, State.STARTING, claim, unclaim)

    async def _readmit(self, inst: Instance) -> None:
        """A wake: wait until the instance's whole footprint fits on its devices again (same
        rules as a start), then claim it."""
        memory = self.memory
        assert memory is not None

        asleep_mb = memory.held_mb(inst.id)
        level = memory.slept_level.get(inst.id)

        def claim(decision: Plan) -> Placement:
            memory.rouse(inst.id)
            return memory.claims[inst.id]

        def unclaim() -> None:
            memory.doze(inst.id, asleep_mb, level)

        await self._reclaim(inst, State.WAKING, claim, unclaim)

    async def _reclaim(
        self,
        inst: Instance,
        state: State,
        claim: Callable[[Plan], Placement],
        unclaim: Callable[[], None],
    ) -> Placement:
        memory = self.memory
        assert memory is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.queue_timeout_s
        wait_metric = self.ctx.metrics.queue_wait.labels(inst.name)
        while True:
            await memory.read_fresh()
            if inst.state is not state:
                raise Stopped(f"model '{inst.name}' was stopped while waiting", code="stopped")
            decision = self.plan_for(inst)
            if isinstance(decision, Plan):
                need = self._need(inst)
                # Claim memory and act on the victims before the first await: later plans see
                # both (an instance counts as awake until its /sleep call has returned).
                placement = claim(decision)
                naps = [v.sleep("memory") for v in self._instances(decision.sleep)]
                stops = [v.evict("memory") for v in self._instances(decision.evict)]
                if decision.sleep:
                    log.info("%s: putting %s to sleep to make room", inst.id,
                             ", ".join(decision.sleep))  # fmt: skip
                if decision.evict:
                    log.info("%s: evicting %s to make room", inst.id, ", ".join(decision.evict))
                if decision.sleep or decision.evict:
                    await asyncio.gather(*(t for t in (*naps, *stops) if t is not None))
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
            if remaining <= 0 or not decision.blockers:
                wait_metric.observe(loop.time() - started)
                what = "wake" if state is State.WAKING else "start"
                raise Unavailable(
                    f"model '{inst.name}' cannot {what}: not enough GPU memory: {decision.reason}",
                    code="insufficient_gpu_memory",
                    retry_after_s=max(1, int(self.queue_timeout_s) or 5),
                )
            await self._wait_capacity(inst, remaining)

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
        model = self.models.get(inst.name)
        if model is None:
            return []
        return [
            i for i in model.instances
            if i is not inst and not i.retired and i.id in self.memory.claims
        ]  # fmt: skip

    def _instances(self, ids: tuple[str, ...]) -> list[Instance]:
        return [i for i in map(self.instance, ids) if i is not None]

    def _need(self, inst: Instance) -> int:
        """What must be free on the devices before the engine allocates: a start's footprint,
        or what a wake adds to what the sleeping engine still holds (taken before the claim)."""
        assert self.memory is not None
        if inst.state is State.WAKING:
            return self.memory.wake_need(inst.id)
        return self.memory.footprint(inst.spec.name)

    def _weights_mb(self, spec: ModelSpec) -> int | None:
        """Host RAM a level-1 sleep of `spec` pins: its weights, all devices together (the
        caller adds the runtime pool)."""
        fp = self.memory.estimates.get(spec.name) if self.memory is not None else None
        if fp is None:
            try:
                fp = footprint_for_spec(spec, None, spec.params_b)
            except (ValueError, OSError):
                fp = None
        weights = fp.detail.get("weights_mb") if fp is not None else None
        if fp is not None and isinstance(weights, int | float):
            return int(weights) * fp.gpus
        if spec.params_b is not None:  # 16-bit weights
            return math.ceil(spec.params_b * 1e9 * 2 / 2**20)
        if fp is not None:  # no breakdown (memory_mb): the whole footprint, an upper bound
            return fp.budget_mb * fp.gpus
        return None

    async def _wait_capacity(self, inst: Instance, timeout: float) -> None:
        waits = [
            asyncio.ensure_future(self._capacity.wait()),
            asyncio.ensure_future(inst.wait_change()),
        ]
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _evict_more(self, devices: tuple[int, ...]) -> bool:
        """After an out-of-memory start: stop the least recently used idle instance there."""
        if not devices or self.memory is None:
            return False
        pinned = {m.name for m in self.models.values() if m.pinned}
        claims = self.memory.claims
        idle = [
            i for i in self.all_instances()
            if i.id in claims and set(devices) & set(claims[i.id].devices)
            and (i.asleep or (i.state is State.RUNNING and i.leases == 0))
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

    # -- reload --------------------------------------------------------------------------

    def reload(self, specs: dict[str, ModelSpec], drain_timeout_s: float) -> dict[str, list[str]]:
        """Reconcile model by model; unchanged models keep their instances (same pid and port).

        Added models become routable; removed ones stop being routable and their instances
        drain and stop; a model whose engine (command, model, args, env) changed, or whose
        memory or devices now need another placement, gets a new instance while the old ones
        drain. The caller has validated `specs` as a whole (and the memory plan).
        """
        report: dict[str, list[str]] = {"added": [], "removed": [], "restarted": [], "kept": []}
        models: dict[str, Model] = {}
        asleep = {n for n, m in self.models.items() if m.sleeper() is not None}
        for name, spec in specs.items():
            cur = self.models.get(name)
            if cur is None:
                models[name] = self._new_model(spec)
                report["added"].append(name)
                continue
            restart = self._needs_new_instance(cur, spec)
            cur.update(spec, drain_timeout_s, restart)
            cur.max_queue = self.max_queue
            models[name] = cur
            report["restarted" if restart else "kept"].append(name)
        for name, cur in self.models.items():
            if name not in specs:
                self._remove(cur, drain_timeout_s)
                report["removed"].append(name)
        self.models = models
        self._index_names()
        self._capacity_changed()
        # A restarted model whose pool was asleep has nothing coming up: preload it again.
        pools = [n for n in report["restarted"] if n in asleep and models[n].starting() is None]
        self.preload(report["added"] + pools)
        log.info("reloaded: %s", ", ".join(f"{k} {v}" for k, v in report.items() if v) or "none")
        return report

    def _needs_new_instance(self, model: Model, spec: ModelSpec) -> bool:
        """Whether the running instances cannot take `spec` in place: a different engine, or a
        memory/devices change that moves the engine or changes what it is started with."""
        if model.spec.engine_key() != spec.engine_key():
            return True
        if self.memory is None:
            return False
        updates = {}
        for inst in model.instances:
            claim = self.memory.claims.get(inst.id)
            if claim is None:
                continue
            allowed = spec.devices is None or set(claim.devices) <= set(spec.devices)
            new = self.memory.placement(spec, claim.devices) if allowed else None
            if new is None or (new.overrides, new.env) != (claim.overrides, claim.env):
                return True
            updates[inst.id] = new
        for iid, new in updates.items():  # the same engines, a new budget
            self.memory.occupy(iid, new)
        return False

    def _remove(self, model: Model, drain_timeout_s: float) -> None:
        stops = model.remove(drain_timeout_s)
        starting = model.starting()
        if not model.instances and starting is None:
            if all(m.name != model.name for m in self.removed):  # none of an older one drains
                self.ctx.metrics.forget_model(model.name)
            return
        self.removed.add(model)  # still counted (and stopped at shutdown) until it is down

        async def gone() -> None:
            await asyncio.gather(*stops, return_exceptions=True)
            if starting is not None:
                await asyncio.gather(starting, return_exceptions=True)
            await asyncio.gather(*(i.stop() for i in list(model.instances)), return_exceptions=True)
            self.removed.discard(model)
            self._forget_model(model.name)

        asyncio.ensure_future(gone()).add_done_callback(retrieve)

    def _forget_model(self, name: str) -> None:
        """Drop a model's gauges once nothing of that name is configured or still draining (a
        name removed, added back and removed again has two generations of instances)."""
        if name not in self.models and all(m.name != name for m in self.removed):
            self.ctx.metrics.forget_model(name)

    # -- views ---------------------------------------------------------------------------

    def snapshot(self) -> list[dict[str, Any]]:
        """Every configured model with its instances (and the memory each holds), for the admin
        API and the status page; removed models still draining are listed with ``removed``."""
        rows = []
        for model in (*self.models.values(), *self.removed):
            row = model.status()
            row["removed"] = model.removed
            if self.memory is not None:
                row["memory"] = self.memory.describe(model.spec)
                for inst in row["instances"]:  # type: ignore[attr-defined]
                    inst["memory"] = self.memory.describe_instance(inst["id"])
            rows.append(row)
        return rows

    # -- shutdown ------------------------------------------------------------------------

    async def drain(self, timeout: float) -> bool:
        """Stop admitting requests and wait for in-flight ones; True if all finished in time."""
        self.closing = True
        deadline = time.monotonic() + timeout
        while self.active_leases() > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._capacity.wait(), remaining)
        return True

    async def shutdown(self) -> None:
        """Refuse new work, fail waiters, stop every engine in parallel."""
        self.closing = True
        if self._background is not None:
            self._background.cancel()
        everything = [*self.models.values(), *self.removed]
        await asyncio.gather(*(m.shutdown() for m in everything), return_exceptions=True)
        if self.memory is not None:
            self.memory.close()

    def kill_all(self) -> None:
        """Kill every engine now (forced exit, the proxy exits right after): each guard is
        asked first (it also stops helpers that left the group), then every group gets SIGKILL."""
        everything = self.all_instances()
        for inst in everything:
            inst.kill()
        time.sleep(FORCED_KILL_GRACE_S)
        for inst in everything:
            inst.kill_group()
