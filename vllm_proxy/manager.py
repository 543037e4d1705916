"""The set of models: names and aliases, admission by GPU memory, reload, drain and shutdown.

The `Manager` maps names and aliases to `Instance`s (each the single owner of its engine's
state), decides admission with the pure `scheduler.plan()` and asks instances to evict
themselves; it never changes an instance's state directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from .config import ModelSpec
from .engine import EngineProcess
from .errors import NotFound, ProxyError, Unavailable
from .instance import EngineContext, Instance, State, retrieve
from .memory import Memory, Placement
from .scheduler import ModelView, NoFit, Plan, plan

log = logging.getLogger(__name__)


class Lease:
    """The request path's hold on an engine: acquired on entry, released in ``__aexit__``.

    A plain class rather than a generator-based context manager: it is on every request.
    """

    __slots__ = ("engine", "inst")

    def __init__(self, inst: Instance) -> None:
        self.inst = inst

    async def __aenter__(self) -> tuple[Instance, EngineProcess]:
        self.engine = await self.inst.acquire()
        return self.inst, self.engine

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
    ) -> None:
        self.ctx = ctx
        self.memory = memory
        self.queue_timeout_s = queue_timeout_s
        ctx.on_capacity = self._capacity_changed
        if memory is not None:
            ctx.admit = self._admit
            ctx.evict_more = self._evict_more
            ctx.memory_lock = memory.starting_on
            ctx.vacate = memory.vacate
        self.instances: dict[str, Instance] = {n: Instance(s, ctx) for n, s in specs.items()}
        #: Instances removed or replaced by a reload that are still draining or stopping.
        self.retiring: set[Instance] = set()
        self.names: dict[str, str] = {}
        self._index_names()
        self.closing = False
        self._capacity = asyncio.Event()
        self._background: asyncio.Task[None] | None = None

    def _index_names(self) -> None:
        names = {}
        for name, inst in self.instances.items():
            names[name] = name
            for alias in inst.spec.aliases:
                names[alias] = name
        self.names = names

    def all_instances(self) -> list[Instance]:
        return [*self.instances.values(), *self.retiring]

    def start(self) -> None:
        """Start background work (the NVML refresher); call inside the running loop."""
        if self.memory is not None:
            self._background = asyncio.ensure_future(self.memory.run(self._engine_groups))

    def _engine_groups(self) -> dict[str, int]:
        return {
            i.name: i.engine.pid
            for i in self.instances.values()
            if i.state is State.RUNNING and i.engine is not None and i.engine.pid is not None
        }

    def resolve(self, requested: str) -> Instance:
        """The instance serving `requested` (a model name or alias), or `NotFound`."""
        name = self.names.get(requested)
        if name is None:
            valid = ", ".join(sorted(self.names)) or "(none configured)"
            raise NotFound(
                f"The model '{requested}' does not exist. Available models: {valid}",
                param="model",
            )
        return self.instances[name]

    def lease(self, model: str | Instance) -> Lease:
        """``async with manager.lease(name) as (instance, engine):`` holds a lease for the body.

        Raises `NotFound` for an unknown name and `Unavailable` while shutting down.
        """
        if self.closing:
            raise Unavailable("the proxy is shutting down", code="shutting_down")
        return Lease(self.resolve(model) if isinstance(model, str) else model)

    def active_leases(self) -> int:
        return sum(i.leases for i in self.all_instances())

    def _capacity_changed(self) -> None:
        self._capacity.set()
        self._capacity = asyncio.Event()

    # -- admission -----------------------------------------------------------------------

    def _views(self) -> tuple[list[ModelView], dict[int, int]]:
        """The planner's view of our engines, and memory promised to starts not yet allocated."""
        assert self.memory is not None
        models: list[ModelView] = []
        pending: dict[int, int] = {}
        for i in self.all_instances():
            if i.placement is None:
                continue
            footprint = max(i.placement.footprint_mb, self.memory.measured.get(i.name, 0))
            starting = i.state is State.STARTING
            models.append(
                ModelView(i.name, footprint, i.placement.devices, i.state is State.RUNNING,
                          i.leases, i.last_used, i.pinned, starting)
            )  # fmt: skip
            if starting and self.memory.kind == "nvml":
                for d in i.placement.devices:
                    pending[d] = pending.get(d, 0) + footprint
        return models, pending

    def plan_for(self, inst: Instance) -> Plan | NoFit:
        """The scheduler's decision for starting `inst` now (pure; no side effects)."""
        assert self.memory is not None
        models, pending = self._views()
        return plan(self.memory.demand(inst.spec), self.memory.device_views(pending), models)

    async def _admit(self, inst: Instance) -> Placement | None:
        """Wait until `inst` fits (evicting idle models LRU first), up to the queue timeout."""
        memory = self.memory
        assert memory is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.queue_timeout_s
        while True:
            if inst.state is not State.STARTING or inst.closed:
                raise Unavailable(f"model '{inst.name}' was stopped while waiting", code="stopped")
            decision = self.plan_for(inst)
            if isinstance(decision, Plan):
                # Claim memory and victims before the first await: later plans see both.
                placement = memory.placement(inst.spec, decision.devices)
                inst.placement = placement
                memory.occupy(inst.name, placement)
                stops = [self.instances[n].evict("memory") for n in decision.evict]
                if decision.evict:
                    log.info("%s: evicting %s to make room", inst.name, ", ".join(decision.evict))
                    await asyncio.gather(*(t for t in stops if t is not None))
                    await memory.wait_free(decision.devices, placement.footprint_mb)
                self.ctx.metrics.queue_wait.labels(inst.name).observe(loop.time() - started)
                return placement
            remaining = deadline - loop.time()
            if remaining <= 0 or not decision.blockers:
                self.ctx.metrics.queue_wait.labels(inst.name).observe(loop.time() - started)
                raise Unavailable(
                    f"model '{inst.name}' does not fit in GPU memory: {decision.reason}",
                    code="insufficient_gpu_memory",
                    retry_after_s=max(1, int(self.queue_timeout_s) or 5),
                )
            await self._wait_capacity(inst, remaining)

    async def _wait_capacity(self, inst: Instance, timeout: float) -> None:
        waits = [
            asyncio.ensure_future(self._capacity.wait()),
            asyncio.ensure_future(inst._wait_change()),
        ]
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _evict_more(self, inst: Instance) -> bool:
        """After an out-of-memory start: stop the least recently used idle model on its devices."""
        if inst.placement is None or self.memory is None:
            return False
        devices = set(inst.placement.devices)
        idle = [
            i for i in self.all_instances()
            if i is not inst and i.placement and devices & set(i.placement.devices)
            and i.state is State.RUNNING and i.leases == 0 and not i.pinned
        ]  # fmt: skip
        for victim in sorted(idle, key=lambda i: i.last_used):
            task = victim.evict("out_of_memory")
            if task is not None:
                await task
                await self.memory.wait_free(inst.placement.devices, inst.placement.footprint_mb)
                return True
        return False

    # -- reload --------------------------------------------------------------------------

    def reload(self, specs: dict[str, ModelSpec], drain_timeout_s: float) -> dict[str, list[str]]:
        """Reconcile model by model; unchanged models keep their engine (same pid and port).

        Added models become routable, removed ones stop being routable and drain, models whose
        engine (command, model, args, env) changed are replaced by a new instance and restarted
        if they were up. The caller has validated `specs` as a whole (and the memory plan).
        """
        old = self.instances
        report: dict[str, list[str]] = {"added": [], "removed": [], "restarted": [], "kept": []}
        instances: dict[str, Instance] = {}
        for name, spec in specs.items():
            cur = old.get(name)
            if cur is None:
                instances[name] = Instance(spec, self.ctx)
                report["added"].append(name)
            elif cur.spec.engine_key() != spec.engine_key():
                instances[name] = Instance(spec, self.ctx)
                self._retire(cur, drain_timeout_s, successor=instances[name])
                report["restarted"].append(name)
            else:
                cur.spec, cur.pinned = spec, spec.pinned
                instances[name] = cur
                report["kept"].append(name)
        for name, cur in old.items():
            if name not in specs:
                self._retire(cur, drain_timeout_s, successor=None)
                report["removed"].append(name)
        self.instances = instances
        self._index_names()
        log.info("reloaded: %s", ", ".join(f"{k} {v}" for k, v in report.items() if v) or "none")
        return report

    def _retire(self, inst: Instance, drain_timeout_s: float, successor: Instance | None) -> None:
        was_up = inst.state in (State.RUNNING, State.STARTING)
        self.retiring.add(inst)

        async def retire() -> None:
            try:
                await inst.drain_and_stop(drain_timeout_s)
            finally:
                self.retiring.discard(inst)
                if successor is None and inst.name not in self.instances:
                    self.ctx.metrics.forget(inst.name, [s.value for s in State])
            if successor is not None and was_up and not self.closing:
                with contextlib.suppress(ProxyError):
                    await successor.ensure_running()

        task = asyncio.ensure_future(retire())
        task.add_done_callback(retrieve)

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
        everything = self.all_instances()
        for inst in everything:
            inst.closed = True
        await asyncio.gather(*(i.stop() for i in everything), return_exceptions=True)
        if self.memory is not None:
            self.memory.close()

    def kill_all(self) -> None:
        """SIGKILL every engine group now (forced exit)."""
        for inst in self.all_instances():
            if inst.engine is not None:
                inst.engine.kill()
