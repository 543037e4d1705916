"""Model state machine, leases (ref counts), idle timers and the set of models.

Each `Instance` is the single owner of one engine's state. Callers never read the state and then
act on it; they ask: ``await instance.acquire()`` (start if needed, then hold a lease),
``instance.release()``, ``await instance.stop()``. The `Manager` maps names and aliases to
instances and runs proxy-wide operations (shutdown, drain).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp

from .config import ModelSpec
from .engine import KILL_WAIT_S, STARTING_STOP_GRACE_S, EngineProcess, PortAllocator, PortInUse
from .errors import EngineFailed, NotFound, ProxyError, Unavailable
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


#: The allowed transitions. Sleep states (SLEEPING/WAKING) slot in here when sleep mode lands.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.STOPPED: frozenset({State.STARTING}),
    State.STARTING: frozenset({State.RUNNING, State.STOPPING, State.ERROR}),
    State.RUNNING: frozenset({State.STOPPING, State.ERROR}),
    State.STOPPING: frozenset({State.STOPPED}),
    State.ERROR: frozenset({State.STARTING, State.STOPPED}),
}


class InvalidTransition(RuntimeError):
    pass


@dataclass
class EngineContext:
    """What every instance shares: the HTTP session, ports, the registry and metrics."""

    session: aiohttp.ClientSession
    ports: PortAllocator
    registry: EngineRegistry
    metrics: Metrics
    on_release: Callable[[], None] = lambda: None


class Instance:
    """One engine of one model, and the only code that changes its state."""

    def __init__(self, spec: ModelSpec, ctx: EngineContext) -> None:
        self.spec = spec
        self.ctx = ctx
        self.state = State.STOPPED
        self.engine: EngineProcess | None = None
        self.leases = 0
        self.last_used = time.time()
        self.last_error: str | None = None
        self.restarts = 0
        self.closed = False
        self._changed = asyncio.Event()
        self._start_task: asyncio.Task[None] | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        ctx.metrics.set_state(spec.name, None, self.state.value, loaded=False)
        ctx.metrics.active.labels(spec.name).set(0)

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
        self.ctx.metrics.active.labels(self.name).inc()
        self._cancel_idle_timer()
        return self.engine

    def release(self) -> None:
        """Give a lease back (call in `finally`); arms the idle timer at zero."""
        self.leases -= 1
        self.last_used = time.time()
        self.ctx.metrics.active.labels(self.name).dec()
        if self.leases == 0 and self.state is State.RUNNING:
            self._arm_idle_timer()
        self.ctx.on_release()

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
        if self.leases == 0 and self.state is State.RUNNING:
            log.info("%s: idle for %.0fs, unloading", self.name, self.spec.idle_timeout_s)
            asyncio.get_running_loop().create_task(self.stop())

    # -- lifecycle -----------------------------------------------------------------------

    async def ensure_running(self) -> None:
        """Return once RUNNING; concurrent callers share one start and all see its error."""
        starts = 0
        while True:
            if self.closed:
                raise Unavailable(f"model '{self.name}' is shutting down", code="shutting_down")
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
                await asyncio.shield(self._start_task)
            elif self.state is State.STOPPING:
                await self._wait_change()

    async def _start(self) -> None:
        for _attempt in range(PORT_ATTEMPTS):
            engine = await self._spawn()
            try:
                seconds = await engine.wait_ready(self.ctx.session)
            except PortInUse:
                log.warning("%s: port %d was taken, retrying", self.name, engine.port)
                await engine.stop(STARTING_STOP_GRACE_S)
                self._raise_if_stopped()
                continue
            except ProxyError as err:
                await engine.stop(STARTING_STOP_GRACE_S)
                self._raise_if_stopped()
                self._fail(err.message, "start_failed")
                raise
            self._raise_if_stopped()
            self.ctx.metrics.starts.labels(self.name).observe(seconds)
            log.info("%s: ready on port %d after %.2fs", self.name, engine.port, seconds)
            self._set_state(State.RUNNING)
            if self.leases == 0:
                self._arm_idle_timer()
            return
        msg = f"model '{self.name}': no port could be bound after {PORT_ATTEMPTS} attempts"
        self._fail(msg, "start_failed")
        raise EngineFailed(msg, code="engine_start_failed")

    async def _spawn(self) -> EngineProcess:
        port = self.ctx.ports.allocate(self.spec.port_range)
        engine = EngineProcess(self.spec, port, tag=self.ctx.registry.tag)
        try:
            await engine.spawn()
        except OSError as err:
            self.ctx.ports.release(port)
            msg = f"model '{self.name}': cannot start engine command: {err}"
            self._fail(msg, "start_failed")
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
        starting = self.state is State.STARTING
        self._set_state(State.STOPPING)
        engine, self.engine = self.engine, None
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


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


class Manager:
    """All configured models by name and alias, plus proxy-wide operations."""

    def __init__(self, specs: dict[str, ModelSpec], ctx: EngineContext) -> None:
        self.ctx = ctx
        ctx.on_release = self._on_release
        self.instances: dict[str, Instance] = {n: Instance(s, ctx) for n, s in specs.items()}
        self.names: dict[str, str] = {}
        for name, spec in specs.items():
            self.names[name] = name
            for alias in spec.aliases:
                self.names[alias] = name
        self.closing = False
        self._drained = asyncio.Event()
        self._drained.set()

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

    @asynccontextmanager
    async def lease(self, requested: str) -> AsyncIterator[tuple[Instance, EngineProcess]]:
        """Hold a lease on the model's running engine for the body of the ``async with``."""
        if self.closing:
            raise Unavailable("the proxy is shutting down", code="shutting_down")
        inst = self.resolve(requested)
        engine = await inst.acquire()
        self._drained.clear()
        try:
            yield inst, engine
        finally:
            inst.release()

    def active_leases(self) -> int:
        return sum(i.leases for i in self.instances.values())

    def _on_release(self) -> None:
        if self.active_leases() == 0:
            self._drained.set()

    async def drain(self, timeout: float) -> bool:
        """Stop admitting requests and wait for in-flight ones; True if all finished in time."""
        self.closing = True
        if self.active_leases() == 0:
            return True
        try:
            await asyncio.wait_for(self._drained.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def shutdown(self) -> None:
        """Refuse new work, fail waiters, stop every engine in parallel."""
        self.closing = True
        for inst in self.instances.values():
            inst.closed = True
        await asyncio.gather(*(i.stop() for i in self.instances.values()), return_exceptions=True)

    def kill_all(self) -> None:
        """SIGKILL every engine group now (forced exit)."""
        for inst in self.instances.values():
            if inst.engine is not None:
                inst.engine.kill()
