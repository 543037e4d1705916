"""One engine instance: one process group of one model, its state machine, leases and idle timer.

An `Instance` lives for exactly one engine process: it is created to start, and once its process
is gone (stopped, crashed, failed to start) it is done; the next start is a new instance with a
new id. The id (``<model>#<n>``) is never reused, and every piece of runtime state that belongs
to an engine is keyed by it: leases, the memory claim, metric series, the registry entry and the
log file.

Each `Instance` is the single owner of its state. Its `Model` (model.py) decides which instance
serves a request; callers never read the state and then act on it, they ask:
``await instance.start()``, ``instance.acquire()``, ``instance.release()``,
``await instance.stop()``, ``instance.evict(reason)``, ``instance.retire(timeout)``. What an
instance needs from the rest of the proxy comes in its `EngineContext` (`ports.py`): admission,
the memory book and the pool's hooks as named ports, with the session, registry and metrics.
Its idle timers (`idle.py`) and health watcher (`health.py`) ask it; only it changes its state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

from ..config import ModelSpec
from ..errors import EngineFailed, ProxyError, consume_exception
from ..planning.hostmem import sleep_guess, sleep_levels
from ..planning.memory import Placement, Use, stop_path
from ..planning.memory import sized as memory_sized
from .breaker import barred_note
from .engine import (
    KILL_WAIT_S,
    STARTING_STOP_GRACE_S,
    EngineProcess,
    address_for,
    log_path,
)
from .failures import (
    Stopped,
    WakeFailed,
    classify_start,
    level_barred,
    no_level_fits,
    sleep_failure,
    stopped_while,
    upstream_error,
    wake_failure,
)
from .health import watch_health
from .idle import IdleTimers, ReplicaPolicy, idles
from .lora import Registrations
from .oracle import Oracle, record, verify
from .ports import EngineContext, no_hold
from .progress import Progress
from .readahead import Outcome
from .rows import instance_row
from .states import (
    ASLEEP_OR_FALLING,
    AWAKE,
    DOWN,
    LIVE,
    TRANSITIONS,
    InvalidTransition,
    State,
    awake_state,
)

log = logging.getLogger(__name__)


#: Called by an instance after each of its state changes: (instance, old state).
StateHook = Callable[["Instance", State], None]


class Instance:
    """One engine process of one model, and the only code that changes its state."""

    def __init__(
        self,
        spec: ModelSpec,
        iid: str,
        ctx: EngineContext[Instance],
        on_state: StateHook,
        queued: Callable[[], int] = lambda: 0,
        policy: ReplicaPolicy[Instance] | None = None,
    ) -> None:
        self.spec = spec
        #: ``<model>#<n>``: never reused, the key of everything this instance owns.
        self.id = iid
        self.ctx = ctx
        self._on_state = on_state
        self.state = State.NEW
        self.engine: EngineProcess | None = None
        self.leases = 0
        #: When its last request ended, or it became RUNNING (monotonic; 0: never): the idle
        #: grace, and least recent use for the planner. Shown as wall time (`status`).
        self.last_used = 0.0
        self.last_error: str | None = None
        #: Set by admission: where the engine runs and the memory it was given (None when down).
        self.placement: Placement | None = None
        #: The devices it was placed on; kept after it is down (for the out-of-memory retry).
        self.devices: tuple[int, ...] = ()
        self.ready_at = 0.0
        #: Replaced by a reload or its model removed: takes no new request, drains (DRAINING
        #: while it runs), stops.
        self.retired = False
        #: Stops of engines asleep that its next sleep waits for (`_free_host_ram`).
        self._host_freeing: list[asyncio.Task[None]] = []
        #: Why the health watcher killed it (UNHEALTHY): the reason counted for it.
        self.unhealthy_reason = ""
        #: Why the change under way was made (an eviction's or a sleep's reason), for the
        #: console's timeline; "" when not known.
        self.change_reason = ""
        #: Its requests in flight and the bytes its engine sent on them (the stall watchdog).
        self.progress = Progress()
        self._changed = asyncio.Event()
        #: Set by `release()` while a drain waits for leases to run out (None otherwise).
        self._released: asyncio.Event | None = None
        #: The sleep level it was put to (0: awake) ...
        self.sleep_level = 0
        #: Whether its engine slept at level 1 before. Each level-1 sleep copies the weights
        #: into pinned host tensors (`vllm/device_allocator/cumem.py:268-276`, vLLM 0.33), which
        #: the wake drops into torch's pinned-memory cache: the first sleep allocates them
        #: (slow), later ones reuse them (fast). Timed apart for the planner's prices.
        self.slept_at_1 = False
        #: ... and the /sleep call, and the measurement after it, while FALLING_ASLEEP.
        self._sleep_call: asyncio.Task[None] | None = None
        self._wake_task: asyncio.Task[None] | None = None
        #: Holds its devices' lock (spawning, waking, falling asleep, or stopping under it): a
        #: stop begun meanwhile runs without the lock and is awaited before it goes.
        self._owns_devices = False
        #: Waiting for its devices' lock to start: a stop need not wait for the start task.
        self._awaiting_devices = False
        #: Its wake failed and it is being stopped for that (not by someone else).
        self._woken_in_vain = False
        #: Awake neighbours below their claim when its engine began (its profiling window).
        self.profiled_beside: list[str] = []
        #: Its answer to the check request, recorded once started (None: no check after its
        #: wakes: verify_wake off, no sleep policy, or it could not be recorded).
        self.oracle: Oracle | None = None
        #: When it last became RUNNING (monotonic): readings older than this are not of it,
        #: and its minimum residency counts from it.
        self.running_since = 0.0
        #: Requests waiting for this model to come up: no sleep while there are any.
        self._queued = queued
        self._start_task: asyncio.Task[None] | None = None
        self._stopping: asyncio.Task[None] | None = None
        #: Its stop, sleep and downscale timers while idle (they ask, it decides).
        self.timers = IdleTimers(self, policy)
        #: The LoRA adapters this engine holds (a new instance starts with none).
        self.adapters = Registrations(iid, ctx.metrics, lambda: ctx.queue.timeout_s)
        ctx.metrics.set_instance_state(spec.name, iid, None, self.state.public.value)

    @property
    def name(self) -> str:
        """The model's name."""
        return self.spec.name

    @property
    def done(self) -> bool:
        """Ended (STOPPED, UNHEALTHY, ERROR): no process (any more, or none was spawned when
        admission refused the start) and it never runs again. A NEW instance is not done."""
        return self.state in DOWN

    @property
    def log_path(self) -> Path:
        return log_path(self.spec, self.id)

    def queued(self) -> int:
        """Requests waiting for this instance's model to come up."""
        return self._queued()

    @property
    def asleep(self) -> bool:
        """SLEEPING: its /sleep call has returned, it holds only its sleep memory now."""
        return self.state is State.SLEEPING

    @property
    def routable(self) -> bool:
        """RUNNING: new requests may be sent here (not draining, asleep, starting or ended)."""
        return self.state is State.RUNNING

    @property
    def unhealthy(self) -> bool:
        """Killed by the health watcher (hung, its listener taken over, or put to sleep by
        someone else)."""
        return self.state is State.UNHEALTHY

    @property
    def host_key(self) -> tuple[str, str]:
        """What the host RAM a sleep pins is learned by: the model and its engine (a reload that
        changes the engine starts afresh)."""
        return self.name, repr(self.spec.engine_key())

    def usable_level(self, level: int | None = None) -> int | None:
        """The level a sleep asked at `level` (default: its policy's) may take, given the
        levels whose wakes kept failing the wake check (`breaker`); None: it does not sleep
        (no sleep policy, or every usable level barred: kept as with ``sleep: null``)."""
        policy = self.spec.sleep.level if self.spec.sleep is not None else None
        return self.ctx.breaker.usable(self.host_key, policy, level, self.spec.reloadable)

    @property
    def wake_asked(self) -> bool:
        """A wake was asked for and has not ended (it may wait for the /sleep call in flight):
        a request waits for this instance, it is not idle."""
        return self._wake_task is not None

    # -- state ---------------------------------------------------------------------------

    def _set_state(self, new: State) -> None:
        old = self.state
        if new not in TRANSITIONS[old]:
            raise InvalidTransition(f"{self.id}: {old.name} -> {new.name} is not allowed")
        if new in AWAKE and old not in AWAKE:
            self.running_since = self.last_used = self.ctx.queue.clock()
        self.state = new
        log.info("%s: %s -> %s", self.id, old.name, new.name)
        metrics = self.ctx.metrics
        if new in DOWN:
            metrics.forget_instance(self.name, self.id)
            self.placement = None
            self.ctx.memory.release_claim(self.id)
            self.ctx.host.forget(self.id)
            self.ctx.pool.on_capacity()
        elif new.public is not old.public:
            metrics.set_instance_state(self.name, self.id, old.public.value, new.public.value)
        self._changed.set()
        self._changed = asyncio.Event()
        self._on_state(self, old)
        self.ctx.pool.observe(self, old)

    def wait_change(self) -> Coroutine[Any, Any, Literal[True]]:
        """Until the next state change after this call: the change is bound now, not when the
        awaitable first runs (a task made of it and run a turn later misses no change)."""
        return self._changed.wait()

    # -- leases --------------------------------------------------------------------------

    def acquire(self) -> EngineProcess:
        """Hold a lease on a RUNNING instance (synchronous, so nothing can stop it between the
        caller's check and the lease); pair with `release()` in ``finally``."""
        if not self.routable or self.engine is None:
            raise InvalidTransition(f"{self.id}: lease taken while {self.state.name}")
        self.leases += 1
        if self.timers.armed:
            self.timers.cancel()
        return self.engine

    def release(self) -> None:
        """Give a lease back; arms the idle timer at zero."""
        self.leases -= 1
        self.last_used = self.ctx.queue.clock()
        if self._released is not None:
            self._released.set()
            self._released = None
        if self.leases == 0:
            if self.routable:
                self.timers.arm()
            self.ctx.pool.on_capacity()

    def rearm_idle(self) -> None:
        """Restart the idle timers with the (reloaded) spec's timeouts, if it is idle."""
        if idles(self.state, self.leases, self.retired, self.wake_asked):
            self.timers.arm()

    # -- start ---------------------------------------------------------------------------

    def start(self) -> asyncio.Task[None]:
        """Begin the one start of this instance: admission, spawn, readiness.

        The task raises `Stopped` when the instance is stopped meanwhile, `OutOfMemory` when the
        engine died for lack of GPU memory, `PortInUse` when it lost its port, and other
        `ProxyError`s for everything else; the instance is then done.
        """
        assert self._start_task is None, f"{self.id} is started once"
        self._set_state(State.STARTING)
        self._start_task = asyncio.ensure_future(self._start())
        self._start_task.add_done_callback(consume_exception)
        return self._start_task

    async def _start(self) -> None:
        try:
            await self._start_steps()
        except ProxyError:
            raise
        except Exception as err:  # a bug or an OS error (NVML, a full disk): never stuck
            log.exception("%s: start failed", self.id)
            if self.engine is not None:
                self.engine.kill()
            if self.state is State.STARTING:
                self._fail(f"model '{self.name}': the start failed ({type(err).__name__})")
            raise EngineFailed(
                f"model '{self.name}': the start failed; see the proxy's log",
                code="engine_start_failed",
            ) from err

    async def _start_steps(self) -> None:
        self.read_ahead("start")  # while it waits for memory, its devices and vLLM's imports
        try:
            self.placement = await self.ctx.admission.admit(self)
        except ProxyError:
            if self.state is State.STARTING:
                self._set_state(State.STOPPED)
            raise
        if self.placement is not None:
            self.devices = self.placement.devices
        self._raise_if_stopped()
        try:
            await self._spawn_and_wait()
        except Stopped:
            raise  # stopped while starting: the stop owns the state
        except ProxyError as err:
            err = classify_start(err, self.devices, self.engine)
            self._fail(err.message)
            raise err from None

    async def _spawn_and_wait(self) -> None:
        """Spawn and wait for readiness. Where memory is managed, under its devices' locks:
        alone while its vLLM profiles their memory (until its log says every worker has
        measured), beside other allocations from the start when it is told its KV cache size
        (`memory.sized`). A measured KV cache size is given to the model's later starts."""
        sized = memory_sized(self.spec, self.placement)
        lock = self.ctx.memory.starting_on(self.devices, self.id, sized)
        async with contextlib.AsyncExitStack() as stack:
            need = self.ctx.memory.start_host_mb(self.spec)  # promised until the start ends
            stack.enter_context(self.ctx.host.start_promised(self.name, self.id, need))
            self._awaiting_devices = True
            try:
                held = await stack.enter_async_context(lock)
            finally:
                self._awaiting_devices = False
            self._raise_if_stopped()  # stopped while queued for the device: spawn nothing
            self._owns_devices = True
            try:
                engine = await self._spawn()
                try:
                    relax = None if held is None or sized else held.profiled
                    workers = max(len(self.devices), 1)
                    seconds = await engine.until_ready(self.ctx.session, workers, self.id, relax)
                except ProxyError:
                    if held is not None and sized:
                        held.failed()  # the size it was told may be what failed it
                    await engine.stop(STARTING_STOP_GRACE_S)
                    self._raise_if_stopped()
                    raise
            finally:
                self._owns_devices = False
        if held is not None and not sized and engine.kv_measured is not None:
            held.learned(engine.kv_measured)
        self._raise_if_stopped()
        if self.spec.warmup:
            try:
                await engine.warm_up(self.ctx.session, self.spec.startup_timeout_s, self.id)
            except EngineFailed:
                self._raise_if_stopped()  # stopped meanwhile: `Stopped`, not its failure
                raise
            self._raise_if_stopped()
        if self.spec.verify_wake:
            self.oracle = await record(
                engine, self.ctx.session, self.spec.startup_timeout_s, self.id
            )
            self._raise_if_stopped()
        if self.spec.warmup or self.spec.verify_wake:  # timed to its end
            seconds = self.ctx.queue.clock() - engine.started_at
        self.ctx.metrics.starts.labels(self.name).observe(seconds)
        self.ctx.admission.timed(self.spec, "start", seconds)
        self.ctx.metrics.transitions.labels(self.name, "cold_start").observe(seconds)
        log.info("%s: ready on %s after %.2fs", self.id, engine.endpoint, seconds)
        self.ready_at = self.ctx.queue.clock()
        self._set_state(awake_state(self.retired))
        if engine.exit_code is not None:  # died in the moment after its healthy answer
            self._exited(engine, "exited right after becoming ready")
            return
        if self.leases == 0:
            self.timers.arm()
        if self.spec.health_interval_s > 0:
            watcher = asyncio.ensure_future(watch_health(self, engine, self.ctx.session))
            watcher.add_done_callback(consume_exception)

    async def _spawn(self) -> EngineProcess:
        address = address_for(self.spec, self.id, self.ctx.ports)
        overrides, env = (p.overrides, p.env) if (p := self.placement) else (None, None)
        factory, tag = self.ctx.engine_factory, self.ctx.registry.tag
        engine = factory(self.spec, address, self.log_path, tag=tag, overrides=overrides, env=env)
        try:
            await engine.spawn()
        except OSError as err:
            if isinstance(address, int):
                self.ctx.ports.release(address)
            msg = f"model '{self.name}': cannot start engine command: {err}"
            raise EngineFailed(msg, code="engine_start_failed") from None
        assert engine.pid is not None
        self.engine = engine
        # vLLM's profiling measures the whole device: a neighbour that takes its peak back
        # meanwhile shrinks this engine's KV cache (a "no room" there is not this model's).
        self.profiled_beside = self.ctx.admission.regrowing(self)
        self.ctx.registry.add(engine.pid, self.id)
        asyncio.get_running_loop().create_task(self._monitor(engine))
        if self.state is not State.STARTING:
            await engine.stop(STARTING_STOP_GRACE_S)
            self._raise_if_stopped()
        return engine

    @property
    def next_sleep_kind(self) -> str:
        """The timing its next /sleep is measured as: its engine's first, or a later one."""
        return "sleep" if self.slept_at_1 else "first sleep"

    def _raise_if_stopped(self) -> None:
        if self.state is not State.STARTING:
            raise stopped_while(self.name, "starting")

    def _fail(self, message: str, end: State = State.ERROR) -> None:
        """The engine is gone or unusable: ERROR, or `end` (unless a stop got there first)."""
        if self.state not in (State.STARTING, *LIVE):
            return
        self.last_error = message
        self.timers.cancel()
        log.error("%s: %s", self.id, message)
        self._set_state(end)

    async def _monitor(self, engine: EngineProcess) -> None:
        """Watch the engine process until it exits; a live engine that exits is an ERROR."""
        await engine.wait_exit()
        assert engine.pid is not None
        if self.state in LIVE and self.engine is engine:
            self._exited(engine, "exited unexpectedly")
        if engine.tcp_port is not None:
            self.ctx.ports.release(engine.tcp_port)
        try:
            self.ctx.registry.remove(engine.pid)
        except OSError as err:
            log.error("%s: cannot update the engine registry: %s", self.id, err)

    def _exited(self, engine: EngineProcess, what: str) -> None:
        """The engine crashed: the log tail to the proxy's log, the short cause to clients."""
        self.ctx.metrics.restarts.labels(self.name, "crash").inc()
        log.error("%s", engine.failure_message(what))
        self._fail(engine.short_failure(what))

    # -- health --------------------------------------------------------------------------

    def mark_unhealthy(self, engine: EngineProcess, why: str, reason: str = "unhealthy") -> None:
        """The health watcher found `engine` unhealthy (`health`): UNHEALTHY, and killed."""
        self.unhealthy_reason = reason
        self.ctx.metrics.restarts.labels(self.name, reason).inc()
        self._fail(f"model '{self.name}': engine not healthy: {why}; killed", State.UNHEALTHY)
        engine.kill()

    async def upstream_failure_after_exit(
        self, engine: EngineProcess, cause: BaseException | None = None
    ) -> ProxyError:
        """What a request whose engine connection broke is told (`failures.upstream_error`),
        once the engine's exit was looked for (`EngineProcess.look_for_exit`)."""
        await engine.look_for_exit()
        reason = self.unhealthy_reason if self.unhealthy else None
        return upstream_error(self.name, self.id, reason, engine, cause)

    # -- stop ----------------------------------------------------------------------------

    async def stop(self) -> None:
        """Stop the engine (SIGTERM, grace, SIGKILL). Idempotent; in-flight requests are cut.

        The stop runs as a task of its own: a caller that is cancelled (a client gone during an
        unload) does not leave the instance half-stopped.
        """
        if self.state in DOWN or self.state is State.NEW:
            return
        task = self._stopping if self.state is State.STOPPING else self._begin_stop()
        assert task is not None
        await asyncio.shield(task)

    def evict(self, reason: str) -> asyncio.Task[None] | None:
        """Stop now if awake (RUNNING or DRAINING) with no lease, or put to sleep (asleep or
        falling asleep), else do nothing; decided without yielding.

        Returns the task finishing the stop, or None when the instance was not evictable.
        """
        if self.state not in (*AWAKE, *ASLEEP_OR_FALLING) or self.leases > 0:
            return None
        self.ctx.metrics.evictions.labels(self.name, reason).inc()
        self.change_reason = reason
        task = self._begin_stop()
        if reason == "idle":
            # Stopped for idleness, it may be asked for again; one stopped to make room for
            # another model is not read back beside that model's own load.
            task.add_done_callback(lambda _t: self.read_ahead("stopped"))
        return task

    def read_ahead(self, why: str) -> asyncio.Task[Outcome] | None:
        """Ask the kernel to read the model's weight files into the page cache, off the loop,
        where host RAM has room for them (``read_ahead``): its next start or level-2 wake reads
        them from RAM. Never fails; None when nothing was begun (`ReadAhead.for_instance`)."""
        ahead, ctx = self.ctx.read_ahead, self.ctx
        if ahead is None:
            return None
        return ahead.for_instance(self.spec, ctx.metrics, ctx.host.room_mb, self.id, why)

    # -- sleep and wake ------------------------------------------------------------------

    def sleep(self, reason: str, level: int | None = None) -> asyncio.Task[None] | None:
        """Put a RUNNING instance with a sleep policy to sleep if nothing is in flight or waiting
        for it; decided without yielding (no lease can be taken from here on). Returns the task
        that ends when the /sleep call has returned (or the fallback stop has finished), or
        None when it may not sleep now. With no sleep level fitting in host RAM the engine is
        stopped instead, except for an operator's sleep (`Conflict`).
        """
        if (
            not self.routable
            or self.spec.sleep is None
            or self.leases > 0
            or self._queued() > 0
            or self.engine is None
        ):
            return None
        asked = level or self.spec.sleep.level
        usable = self.usable_level(asked)
        if usable is None and reason == "admin":
            raise level_barred(self.name, asked)
        if usable is None:  # kept awake, as with sleep: null
            return None
        chosen = self._choose_level(usable)
        if chosen is None and reason == "admin":  # an operator asked for a sleep, not a stop
            raise no_level_fits(self.name)
        if chosen is None:  # no host RAM to pin even the runtime pool: free the GPU anyway
            self.ctx.metrics.evictions.labels(self.name, reason).inc()
            self.change_reason = f"{reason} (no host RAM to sleep)"
            return self._begin_stop()
        self.timers.cancel_sleep()
        self.change_reason = reason
        self._set_state(State.FALLING_ASLEEP)
        self._sleep_call = asyncio.ensure_future(self._fall_asleep(self.engine, chosen, reason))
        self._sleep_call.add_done_callback(consume_exception)
        return self._sleep_call

    def _choose_level(self, level: int) -> int | None:
        """The level a sleep asked at `level` takes, promised in host RAM until the /sleep call
        returns (`HostRam.choose_level`, over the levels its breaker allows); None when no level
        fits (the caller stops the engine instead)."""
        levels = [v for v in sleep_levels(level, self.spec.reloadable) if self.usable_level(v) == v]
        guesses = {v: self._pin_guess(v) for v in levels}
        return self.ctx.host.choose_level(
            self.id, self.host_key, level, guesses, self._free_host_ram
        )

    def _free_host_ram(self, short_mb: int) -> bool:
        """Stop engines asleep that were used less recently than this one, least recently used
        first, so that its sleep finds `short_mb` more of host RAM (their pinned memory goes
        with them; the sleep waits for their stops: `_host_freeing`); False when they cannot
        free that much (none is stopped then)."""
        victims = self.ctx.pool.host_victims(self, short_mb)
        tasks = [t for t in (v.evict("host memory") for v in victims) if t is not None]
        if not tasks:
            return False
        log.info("%s: stopping %s (asleep, used less recently) for the host RAM its sleep pins",
                 self.id, ", ".join(v.id for v in victims))  # fmt: skip
        self._host_freeing = tasks
        return True

    def _pin_guess(self, level: int) -> int | None:
        """What a sleep at `level` pins in host RAM before it was measured (`sleep_guess`)."""
        memory = self.ctx.memory
        weights = memory.weights_mb(self.spec) if level == 1 else None
        return sleep_guess(level, weights, memory.runtime_mb(self.spec))

    async def _fall_asleep(self, engine: EngineProcess, level: int, reason: str) -> None:
        """The /sleep call, under its devices' lock (vLLM asserts that nobody allocated on the
        device while it slept, and a start next to it must not see memory freed while it
        profiles); what the engine still holds afterwards is measured and from then on is its
        claim. A sleep that fails or runs out of time stops the engine before the lock goes:
        the engine may still be freeing memory."""
        residue = grown = seen = None
        failed = False
        try:
            if self._host_freeing:  # engines stopped for the host RAM it pins: gone first
                freeing, self._host_freeing = self._host_freeing, []
                await asyncio.wait(freeing)
            async with self._devices_held(Use.SLEEP):
                started = self.ctx.queue.clock()
                try:
                    before = await self.ctx.memory.usage(engine.pid, self.devices)
                    host, pid, path = self.ctx.host, engine.pid, engine.log_path
                    mark = await asyncio.to_thread(host.before_sleep, pid, path)
                    async with asyncio.timeout(self.spec.sleep_timeout_s):
                        await engine.sleep(engine.client(self.ctx.session), level)
                    after = await self.ctx.memory.usage(engine.pid, self.devices)
                    residue = self.ctx.memory.residue(self.id, before, after)
                    grown, seen = await asyncio.to_thread(host.after_sleep, mark, pid, path)
                except Exception as err:  # failed, timed out, or a bug: the engine is stopped
                    failed = True
                    self._sleep_failed(engine, err)
        finally:
            self._sleep_call = None
            self.ctx.host.settle(self.id)
        if failed:
            return
        if self.state is not State.FALLING_ASLEEP or self.engine is not engine:
            return  # stopped meanwhile
        seconds = self.ctx.queue.clock() - started
        self.sleep_level = level
        self.ctx.admission.timed(self.spec, self.next_sleep_kind, seconds)
        self.slept_at_1 = self.slept_at_1 or level == 1
        self.ctx.host.slept(self.id, self.host_key, level, grown, self._pin_guess(level), seen)
        pinned = self.ctx.host.retained.get(self.id)
        self.ctx.metrics.instance_asleep(self.name, self.id, level, seconds, pinned)
        held = f", {residue} MiB per GPU still held" if residue is not None else ""
        log.info("%s: asleep at level %d after %.2fs (%s)%s", self.id, level, seconds, reason, held)
        self.ctx.memory.sleep_claim(self.id, residue, level)
        if level >= 2:  # its wake reads the weights from disk again
            self.read_ahead("asleep at level 2")
        self._set_state(State.SLEEPING)  # memory came back: waiters re-plan
        self.ctx.pool.on_capacity()
        idle = idles(self.state, self.leases, self.retired, self.wake_asked)
        if idle and not self.timers.stop_armed:
            self.timers.arm()  # only the stop timer: it is not RUNNING

    def _sleep_failed(self, engine: EngineProcess, err: Exception) -> None:
        """A /sleep that failed or ran out of time: stop the engine (begun at once, so that the
        lock is kept until it is down)."""
        failure = sleep_failure(err, self.spec.sleep_timeout_s)
        if failure.bug:
            log.error("%s: sleep failed", self.id, exc_info=err)
        if self.state is State.FALLING_ASLEEP and self.engine is engine:
            log.error("%s: sleep failed (%s); stopping the engine", self.id, failure.why)
            self.ctx.metrics.restarts.labels(self.name, failure.reason).inc()
            self._begin_stop()

    @asynccontextmanager
    async def _devices_held(self, use: Use) -> AsyncIterator[None]:
        """Its devices' lock (memory managed only) in `use`, marked as held by this instance
        (`memory.Use`: a sleep beside nothing that allocates, a wake beside other allocations
        and stops, a stop beside all but a start that profiles). A stop begun while it is held
        (its own failed sleep or wake, an unload) runs without the lock and is waited for
        before the lock goes: the engine's memory is back by then."""
        memory = self.ctx.memory
        async with memory.device_lock(self.devices, use, self.id) if self.devices else no_hold():
            self._owns_devices = True
            try:
                yield
            finally:
                stopping = self._stopping
                if stopping is not None and stopping is not asyncio.current_task():
                    await asyncio.wait({stopping})
                self._owns_devices = False

    def wake(self) -> asyncio.Task[None]:
        """Wake an instance put to sleep (one wake for every caller; one still falling asleep
        is woken once its /sleep call has returned): the memory first (WAKE_WAITING), then
        /wake_up (WAKING; level 2: wake the weights, reload them, then the KV cache), a check
        that it is awake, and the warm-up. Raises `WakeFailed` after stopping the engine when
        any step fails or takes longer than ``wake_timeout_s``; `Unavailable` when memory for
        the wake did not come in time (it stays asleep)."""
        # (A wake that has just failed, its callback not yet run, is not joined: a new one.)
        if self._wake_task is None or self._wake_task.done():
            if self.state in ASLEEP_OR_FALLING:  # a request waits for it: it is not idle
                self.timers.cancel()
            self._wake_task = asyncio.ensure_future(self._wake())
            self._wake_task.add_done_callback(self._wake_done)
        return self._wake_task

    def _wake_done(self, task: asyncio.Task[None]) -> None:
        if self._wake_task is task:
            self._wake_task = None
        consume_exception(task)

    async def _wake(self) -> None:
        if self._sleep_call is not None:  # let the /sleep call finish first
            await asyncio.wait({self._sleep_call})
        if self.state in AWAKE:
            return
        if self.state is not State.SLEEPING or self.engine is None:
            raise stopped_while(self.name, "asleep")
        engine = self.engine
        self.timers.cancel()
        self._set_state(State.WAKE_WAITING)
        try:
            await self.ctx.admission.readmit(self)
        except ProxyError:
            if self.state is State.WAKE_WAITING:
                self._set_state(State.SLEEPING)
                if self.leases == 0 and not self.retired:
                    self.timers.arm()
            raise
        except Exception as err:  # a bug or an OS error: never left half-woken
            log.exception("%s: admission of the wake failed", self.id)
            return await self._wake_failed(type(err).__name__)
        if self.state is not State.WAKE_WAITING:
            raise stopped_while(self.name, "waking")
        self._set_state(State.WAKING)
        # Timed from here, a wait for the devices' lock (behind a start or a sleep) included:
        # what the next request for it waits, which the scheduler prices a sleep by. Timed
        # from the lock's grant instead, the scheduler answered 3 points fewer within 10 s at
        # 0.2 and 0.5 requests/s in the density benchmark (more sleeps where wakes queue).
        started = self.ctx.queue.clock()
        level = self.sleep_level
        failed: str | None = None
        # Not while another engine's start profiles these devices (it would count the wake's
        # allocations as its own) or one sleeps there (vLLM asserts the device's usage went
        # down); beside other wakes, sized starts and stops. Bounded by that start or sleep.
        # A failed wake stops the engine before the lock goes: it may still be allocating.
        async with self._devices_held(Use.ALLOC):
            try:
                async with asyncio.timeout(self.spec.wake_timeout_s):
                    if self.state is not State.WAKING:
                        raise stopped_while(self.name, "waking")
                    client = engine.client(self.ctx.session)
                    await engine.wake(client, level)
                    if self.oracle is not None:  # (the check warms it up too)
                        observe = self.ctx.metrics.wake_verify.labels(self.name).observe
                        edp, clock = self.spec.expert_data_parallel, self.ctx.queue.clock
                        await verify(engine, client, self.oracle, edp, self.id, clock, observe)
                    elif self.spec.warmup:
                        await engine.warmup(client)
            except Stopped:
                raise
            except Exception as err:  # failed, late, a wrong answer, a bug: never half-woken
                failure = wake_failure(err, self.spec.wake_timeout_s)
                if failure.bug:
                    log.error("%s: wake failed", self.id, exc_info=err)
                failed = failure.why
                self._abandon_wake(failure.why, failure.reason)
                if failure.wrong_answer:
                    self.ctx.metrics.wake_verify_failures.labels(self.name, str(level)).inc()
                    self._check_failed(level)
        if failed is not None:
            return await self._wake_failed(failed)
        if self.state is not State.WAKING or self.engine is not engine:
            raise stopped_while(self.name, "waking")
        seconds = self.ctx.queue.clock() - started
        self.ctx.metrics.instance_awake(self.name, self.id, level, seconds)
        self.ctx.admission.timed(self.spec, "wake", seconds)
        log.info("%s: awake after %.2fs (level %d)", self.id, seconds, level)
        if self.oracle is not None:
            self.ctx.breaker.passed(self.host_key, level)
        if level >= 2:  # the adapters' GPU copies went with the weights: registered again
            self.adapters.reset()
        self.sleep_level = 0
        self._set_state(awake_state(self.retired))
        if self.leases == 0 and self.routable:
            self.timers.arm()

    def _check_failed(self, level: int) -> None:
        """Count a failed wake check; once that bars the level, say so (log, metric)."""
        if self.ctx.breaker.failed(self.host_key, level):
            self.ctx.metrics.sleep_level_barred.labels(self.name, str(level)).set(1)
            log.error("%s", barred_note(self.name, level, self.usable_level()))

    def _abandon_wake(self, why: str, reason: str = "wake_failed") -> None:
        """A failed wake: begin the stop at once (still holding the devices' lock)."""
        if self.state in (State.WAKE_WAITING, State.WAKING):
            log.error("model %s: %s: the wake from level %d failed (%s); stopping the engine",
                      self.name, self.id, self.sleep_level, why)  # fmt: skip
            self.ctx.metrics.restarts.labels(self.name, reason).inc()
            self._woken_in_vain = True
            self._begin_stop()

    async def _wake_failed(self, why: str) -> None:
        """Never serve from a half-woken engine: stop it; the caller cold-starts a new one."""
        if self.state in (State.WAKE_WAITING, State.WAKING):
            self._abandon_wake(why)
        elif not self._woken_in_vain:  # stopped meanwhile (unload, shutdown, eviction)
            raise stopped_while(self.name, "waking")
        if self._stopping is not None:
            await asyncio.shield(self._stopping)
        raise WakeFailed(f"model '{self.name}': the engine did not wake; restarting it",
                         code="wake_failed")  # fmt: skip

    async def drain_and_stop(self, timeout: float) -> None:
        """In-flight requests get up to `timeout` to finish, then the engine stops.

        The caller has made sure no new request is routed here (retired, or its model drains).
        """
        self.timers.cancel()
        if not await self.drained(timeout):
            log.warning("%s: %d request(s) still in flight, stopping", self.id, self.leases)
        await self.stop()

    async def drained(self, timeout: float) -> bool:
        """Wait up to `timeout` for the leases to run out; True when none is left."""
        deadline = self.ctx.queue.clock() + timeout
        while self.leases > 0 and self.state in AWAKE:
            remaining = deadline - self.ctx.queue.clock()
            if remaining <= 0:
                return False
            if self._released is None:  # one event for every waiter
                self._released = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._released.wait(), remaining)
        return self.leases == 0

    def retire(self, timeout: float) -> asyncio.Task[None]:
        """Take no new requests from now on (DRAINING while it runs); drain for up to
        `timeout`, then stop."""
        self.retired = True
        self.timers.cancel()
        if self.state is State.RUNNING:
            self._set_state(State.DRAINING)
        task = asyncio.ensure_future(self.drain_and_stop(timeout))
        task.add_done_callback(consume_exception)
        return task

    def _begin_stop(self) -> asyncio.Task[None]:
        """Enter STOPPING synchronously (no new lease from here on) and start the stop task."""
        starting = self.state is State.STARTING
        if self.sleep_level or self.state in ASLEEP_OR_FALLING:
            self.ctx.metrics.forget_sleep(self.name, self.id)
        self.timers.cancel()
        self._set_state(State.STOPPING)
        self._stopping = asyncio.ensure_future(self._finish_stop(self.engine, starting))
        self._stopping.add_done_callback(consume_exception)
        return self._stopping

    async def _finish_stop(self, engine: EngineProcess | None, starting: bool) -> None:
        if engine is not None:
            grace = STARTING_STOP_GRACE_S if starting else self.spec.stop_timeout_s
            # Gone already, its own start/wake/sleep holding the lock, or under the lock:
            path = stop_path(engine.exit_code is not None, self._owns_devices)
            memory = self.ctx.memory
            async with self._devices_held(Use.STOP) if path.locks else no_hold():
                before = await memory.usage(engine.pid, self.devices) if path.waits else None
                code = await engine.stop(grace)
                if path.waits:
                    await memory.wait_released(before)
            log.info("%s: engine stopped (exit code %s)", self.id, code)
        if starting and self._start_task is not None and not self._awaiting_devices:
            # (A start still queued for its devices spawns nothing once it gets them.)
            await asyncio.wait({self._start_task}, timeout=KILL_WAIT_S)
        self._set_state(State.STOPPED)

    def kill(self) -> None:
        """Kill the engine now (see `EngineProcess.kill`)."""
        if self.engine is not None:
            self.engine.kill()

    def kill_group(self) -> None:
        """SIGKILL the engine's process group at once."""
        if self.engine is not None:
            self.engine.kill_group()

    # -- views ---------------------------------------------------------------------------

    def status(self) -> dict[str, object]:
        """What an operator sees of this instance (`rows.instance_row`)."""
        return instance_row(self)
