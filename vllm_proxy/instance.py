"""One engine instance of a model: its state machine, leases (ref counts) and idle timer.

Each `Instance` is the single owner of one engine's state. Callers never read the state and then
act on it; they ask: ``await instance.acquire()`` (start if needed, then hold a lease),
``instance.release()``, ``await instance.stop()``, ``instance.evict(reason)``. What an instance
needs from the rest of the proxy (ports, registry, metrics, admission) comes in `EngineContext`.
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
from .errors import EngineFailed, ProxyError, Unavailable
from .memory import OOM_MARKERS, Placement
from .metrics import Metrics
from .registry import EngineRegistry

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
    memory_lock: Callable[[tuple[int, ...], str], AbstractAsyncContextManager[None]] | None = None


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
                self._start_task.add_done_callback(retrieve)
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
        lock = self.ctx.memory_lock(devices, self.name) if self.ctx.memory_lock else _nothing()
        async with lock:
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


def retrieve(task: asyncio.Task[None]) -> None:
    """Done-callback for background tasks: proxy errors are already reported, others are bugs."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, ProxyError):
        log.error("background task failed", exc_info=exc)
