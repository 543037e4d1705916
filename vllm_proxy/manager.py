"""Model state machine, leases (ref counts), idle timers and the set of models.

Each `Instance` is the single owner of one engine's state. Callers never read the state and then
act on it; they ask: ``await instance.acquire()`` (start if needed, then hold a lease),
``instance.release()``, ``await instance.stop()``. The `Manager` maps names and aliases to
instances and runs proxy-wide operations (shutdown, drain).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

import aiohttp

from .config import ModelSpec
from .engine import (
    KILL_WAIT_S,
    STARTING_STOP_GRACE_S,
    EngineProcess,
    PortAllocator,
    PortInUse,
    read_tail,
)
from .errors import EngineFailed, NotFound, ProxyError, Unavailable
from .memory import OOM_MARKERS, Memory, Placement
from .metrics import Metrics
from .registry import EngineRegistry
from .scheduler import ModelView, NoFit, Plan, plan

log = logging.getLogger(__name__)

#: Port races retried per start (new vLLM exits 1 on "Address already in use").
PORT_ATTEMPTS = 3
#: Starts one request may sit through (an engine that crashes right after starting is retried).
START_ATTEMPTS = 2


class State(enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    ERROR = "error"


#: States in which the engine holds no process and no memory.
DOWN = frozenset({State.STOPPED, State.ERROR})
#: The allowed transitions. Sleep states (SLEEPING/WAKING) slot in here when sleep mode lands.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.STOPPED: frozenset({State.STARTING}),
    # STARTING -> STOPPED: admission refused (no GPU memory in time); no process was started.
    State.STARTING: frozenset({State.RUNNING, State.STOPPING, State.ERROR, State.STOPPED}),
    State.RUNNING: frozenset({State.STOPPING, State.ERROR}),
    State.STOPPING: frozenset({State.STOPPED}),
    State.ERROR: frozenset({State.STARTING, State.STOPPED}),
}


class InvalidTransition(RuntimeError):
    pass


async def _no_admission(_inst: Instance) -> Placement | None:
    return None


@dataclass
class EngineContext:
    """What every instance shares: session, ports, registry, metrics, the manager's hooks."""

    session: aiohttp.ClientSession
    ports: PortAllocator
    registry: EngineRegistry
    metrics: Metrics
    max_queue: int = 1024
    #: Called when a lease is released or an engine goes down: memory may have become free.
    on_capacity: Callable[[], None] = lambda: None
    #: Waits until the instance may start; returns where (None: memory is not managed).
    admit: Callable[[Instance], Awaitable[Placement | None]] = _no_admission
    #: After an out-of-memory start: evict one more idle model; False if none could go.
    evict_more: Callable[[Instance], Awaitable[bool]] | None = None
    #: Gives a stopped engine's memory back to the budget (memory managed only).
    vacate: Callable[[str], None] = lambda _name: None
    #: Serialises starts per device (memory managed only).
    memory_lock: Callable[[tuple[int, ...]], AbstractAsyncContextManager[None]] | None = None


class Instance:
    """One engine of one model, and the only code that changes its state."""

    def __init__(self, spec: ModelSpec, ctx: EngineContext) -> None:
        self.spec = spec
        self.ctx = ctx
        self.state = State.STOPPED
        self.engine: EngineProcess | None = None
        self.leases = 0
        #: Wall-clock time of the last lease release; 0 until the model is first used.
        self.last_used = 0.0
        self.last_error: str | None = None
        self.restarts = 0
        self.closed = False
        #: Set by admission: where the engine runs and the memory it was given.
        self.placement: Placement | None = None
        #: Requests waiting for this model to start (the per-model admission queue).
        self.waiting = 0
        self.ready_at = 0.0
        #: Never evicted for memory; from the config, changed at run time by the admin API.
        self.pinned = spec.pinned
        #: Set while an unload waits for in-flight requests; new requests wait for it.
        self.draining = False
        self._released: asyncio.Event | None = None
        self._changed = asyncio.Event()
        self._start_task: asyncio.Task[None] | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        ctx.metrics.set_state(spec.name, None, self.state.value, loaded=False)
        self._active_gauge = ctx.metrics.active.labels(spec.name)  # cached: on the request path
        self._active_gauge.set(0)

    @property
    def name(self) -> str:
        return self.spec.name

    # -- state ---------------------------------------------------------------------------

    def _set_state(self, new: State) -> None:
        old = self.state
        if new not in TRANSITIONS[old]:
            raise InvalidTransition(f"{self.name}: {old.name} -> {new.name} is not allowed")
        self.state = new
        log.info("%s: %s -> %s", self.name, old.name, new.name)
        self.ctx.metrics.set_state(self.name, old.value, new.value, new is State.RUNNING)
        if new in DOWN:
            self.placement = None
            self.ctx.vacate(self.name)
            self.ctx.on_capacity()
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self) -> None:
        await self._changed.wait()

    # -- leases --------------------------------------------------------------------------

    async def acquire(self) -> EngineProcess:
        """Start the engine if needed and hold a lease on it; pair with `release()`."""
        await self.ensure_running()
        # No await between the RUNNING check above and taking the lease: nothing can stop the
        # engine in between, and from here on the idle timer and eviction see the lease.
        assert self.engine is not None
        self.leases += 1
        self._active_gauge.inc()
        self._cancel_idle_timer()
        return self.engine

    def release(self) -> None:
        """Give a lease back (call in `finally`); arms the idle timer at zero."""
        self.leases -= 1
        self.last_used = time.time()
        self._active_gauge.dec()
        if self._released is not None:
            self._released.set()
        if self.leases == 0:
            if self.state is State.RUNNING and not self.draining:
                self._arm_idle_timer()
            self.ctx.on_capacity()

    def _arm_idle_timer(self) -> None:
        self._cancel_idle_timer()
        if self.spec.idle_timeout_s > 0:
            loop = asyncio.get_running_loop()
            self._idle_timer = loop.call_later(self.spec.idle_timeout_s, self._idle_expired)

    def _cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _idle_expired(self) -> None:
        self._idle_timer = None
        if self.evict("idle") is not None:
            log.info("%s: idle for %gs, unloaded", self.name, self.spec.idle_timeout_s)

    # -- lifecycle -----------------------------------------------------------------------

    async def ensure_running(self) -> None:
        """Return once RUNNING; concurrent callers share one start and all see its error."""
        starts = 0
        while True:
            if self.closed:
                raise Unavailable(f"model '{self.name}' is shutting down", code="shutting_down")
            if self.draining:
                await self._wait_change()
                continue
            if self.state is State.RUNNING:
                return
            if self.state in (State.STOPPED, State.ERROR):
                if starts >= START_ATTEMPTS:
                    raise EngineFailed(self.last_error or f"model '{self.name}' failed to start")
                starts += 1
                self._set_state(State.STARTING)
                self._start_task = asyncio.create_task(self._start())
                self._start_task.add_done_callback(_retrieve)
            if self.state is State.STARTING and self._start_task is not None:
                await self._wait_start(self._start_task)
            elif self.state is State.STOPPING:
                await self._wait_change()

    async def _wait_start(self, task: asyncio.Task[None]) -> None:
        if self.waiting >= self.ctx.max_queue:
            raise Unavailable(
                f"model '{self.name}': {self.waiting} requests already wait for it to start",
                code="queue_full",
            )
        self.waiting += 1
        self.ctx.metrics.queue_depth.labels(self.name).set(self.waiting)
        try:
            await asyncio.shield(task)
        finally:
            self.waiting -= 1
            self.ctx.metrics.queue_depth.labels(self.name).set(self.waiting)

    async def _start(self) -> None:
        try:
            self.placement = await self.ctx.admit(self)
        except ProxyError:
            if self.state is State.STARTING:
                self._set_state(State.STOPPED)
            raise
        self._raise_if_stopped()
        port_attempts, oom_retried = 0, False
        while True:
            try:
                await self._start_once()
                return
            except PortInUse:
                port_attempts += 1
                if port_attempts < PORT_ATTEMPTS:
                    continue
                msg = f"model '{self.name}': no port could be bound after {PORT_ATTEMPTS} attempts"
                self._fail(msg, "start_failed")
                raise EngineFailed(msg, code="engine_start_failed") from None
            except EngineFailed as err:
                if oom_retried or not self._out_of_memory():
                    self._fail(err.message, "start_failed")
                    raise
                oom_retried = True
                if not await self._evict_more():
                    self._fail(err.message, "out_of_memory")
                    raise Unavailable(err.message, code="insufficient_gpu_memory") from None
                self._raise_if_stopped()
                log.warning("%s: out of GPU memory at start; evicted one more, retrying", self.name)
            except Unavailable:
                raise  # stopped while starting: the stop owns the state
            except ProxyError as err:
                self._fail(err.message, "start_failed")
                raise

    async def _start_once(self) -> None:
        """Spawn and wait for readiness once; serialised per device when memory is managed."""
        devices = self.placement.devices if self.placement else ()
        async with self.ctx.memory_lock(devices) if self.ctx.memory_lock else _nothing():
            engine = await self._spawn()
            try:
                seconds = await engine.wait_ready(self.ctx.session)
            except ProxyError as err:
                await engine.stop(STARTING_STOP_GRACE_S)
                self._raise_if_stopped()
                if isinstance(err, PortInUse):
                    log.warning("%s: port %d was taken, retrying", self.name, engine.port)
                raise
        self._raise_if_stopped()
        self.ctx.metrics.starts.labels(self.name).observe(seconds)
        log.info("%s: ready on port %d after %.2fs", self.name, engine.port, seconds)
        self.ready_at = time.monotonic()
        self._set_state(State.RUNNING)
        if self.leases == 0:
            self._arm_idle_timer()

    def _out_of_memory(self) -> bool:
        if self.placement is None or self.engine is None:
            return False
        tail = read_tail(self.engine.log_path, lines=200)
        return any(marker in tail for marker in OOM_MARKERS)

    async def _evict_more(self) -> bool:
        return self.ctx.evict_more is not None and await self.ctx.evict_more(self)

    async def _spawn(self) -> EngineProcess:
        port = self.ctx.ports.allocate(self.spec.port_range)
        p = self.placement
        engine = EngineProcess(
            self.spec,
            port,
            tag=self.ctx.registry.tag,
            overrides=p.overrides if p else None,
            env=p.env if p else None,
        )
        try:
            await engine.spawn()
        except OSError as err:
            self.ctx.ports.release(port)
            msg = f"model '{self.name}': cannot start engine command: {err}"
            raise EngineFailed(msg, code="engine_start_failed") from None
        assert engine.pid is not None
        self.engine = engine
        self.ctx.registry.add(engine.pid, self.name)
        asyncio.get_running_loop().create_task(self._monitor(engine))
        if self.state is not State.STARTING:
            await engine.stop(STARTING_STOP_GRACE_S)
            self._raise_if_stopped()
        return engine

    def _raise_if_stopped(self) -> None:
        if self.state is not State.STARTING:
            raise Unavailable(f"model '{self.name}' was stopped while starting", code="stopped")

    def _fail(self, message: str, reason: str) -> None:
        if self.state not in (State.STARTING, State.RUNNING):
            return  # a stop got there first and owns the state
        self.last_error = message
        self.restarts += 1
        self.ctx.metrics.restarts.labels(self.name, reason).inc()
        log.error("%s", message)
        self._set_state(State.ERROR)

    async def _monitor(self, engine: EngineProcess) -> None:
        """Watch one engine process until it exits; a RUNNING engine that exits is an ERROR."""
        await engine.wait_exit()
        assert engine.pid is not None
        self.ctx.registry.remove(engine.pid)
        self.ctx.ports.release(engine.port)
        if self.engine is engine and self.state is State.RUNNING:
            self._cancel_idle_timer()
            self._fail(engine.failure_message("exited unexpectedly"), "crash")

    async def stop(self) -> None:
        """Stop the engine (SIGTERM, grace, SIGKILL). Idempotent; in-flight requests are cut."""
        while self.state is State.STOPPING:
            await self._wait_change()
        if self.state is State.STOPPED:
            return
        self._cancel_idle_timer()
        if self.state is State.ERROR:  # the engine is already gone
            self.engine = None
            self._set_state(State.STOPPED)
            return
        await self._finish_stop(*self._claim_stop())

    async def drain_and_stop(self, timeout: float) -> None:
        """Unload: new requests wait, in-flight ones get up to `timeout` to finish, then stop."""
        self.draining = True
        self._cancel_idle_timer()
        try:
            deadline = time.monotonic() + timeout
            while self.leases > 0 and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._lease_change(), deadline - time.monotonic())
            await self.stop()
        finally:
            self.draining = False
            self._changed.set()
            self._changed = asyncio.Event()

    async def _lease_change(self) -> None:
        self._released = asyncio.Event()
        await self._released.wait()

    def status(self) -> dict[str, object]:
        """What an operator sees of this instance (admin API, status page)."""
        engine = self.engine
        up = self.state is State.RUNNING and engine is not None
        return {
            "name": self.name,
            "model": self.spec.model,
            "aliases": list(self.spec.aliases),
            "state": self.state.value,
            "pid": engine.pid if engine else None,
            "port": engine.port if engine else None,
            "devices": list(self.placement.devices) if self.placement else [],
            "leases": self.leases,
            "queue": self.waiting,
            "last_used": self.last_used or None,
            "uptime_s": round(time.monotonic() - self.ready_at, 3) if up else None,
            "restarts": self.restarts,
            "last_error": self.last_error,
            "pinned": self.pinned,
            "draining": self.draining,
        }

    def evict(self, reason: str) -> asyncio.Task[None] | None:
        """Stop now if RUNNING with no lease, else do nothing; decided without yielding.

        Returns the task finishing the stop, or None when the instance was not evictable.
        """
        if self.state is not State.RUNNING or self.leases > 0:
            return None
        self.ctx.metrics.evictions.labels(self.name, reason).inc()
        return asyncio.ensure_future(self._finish_stop(*self._claim_stop()))

    def _claim_stop(self) -> tuple[EngineProcess | None, bool]:
        """Enter STOPPING synchronously, so no new lease can be taken from here on."""
        starting = self.state is State.STARTING
        self._cancel_idle_timer()
        self._set_state(State.STOPPING)
        engine, self.engine = self.engine, None
        return engine, starting

    async def _finish_stop(self, engine: EngineProcess | None, starting: bool) -> None:
        if engine is not None:
            grace = STARTING_STOP_GRACE_S if starting else self.spec.stop_timeout_s
            code = await engine.stop(grace)
            log.info("%s: engine stopped (exit code %s)", self.name, code)
        if starting and self._start_task is not None:
            await asyncio.wait({self._start_task}, timeout=KILL_WAIT_S)
        self._set_state(State.STOPPED)

    async def failure_detail(self, engine: EngineProcess, timeout: float = 3.0) -> str:
        """Why an upstream connection broke: the exit code and log tail if the engine died."""
        if await engine.wait_exit(timeout) is not None:
            return engine.failure_message("exited while serving the request")
        return f"model '{self.name}': connection to the engine was lost"


@asynccontextmanager
async def _nothing() -> AsyncIterator[None]:
    yield


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


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
        task.add_done_callback(_retrieve)

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
