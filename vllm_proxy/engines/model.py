"""A configured model: its spec, names, the instances running it, and which one serves a request.

A `Model` owns the set of its `Instance`s (one engine process each; the only code that creates
them) and the decision of which one serves a request (`route`): among the RUNNING replicas that
are not retired the least loaded, a session staying on its replica (affinity) and a LoRA
adapter going to a replica that holds it. When none serves, it brings one up: one task shared
by every waiting request, which wakes a sleeping instance or starts new ones, a fresh instance
and id per attempt (lost port races, disturbed memory profiling, a budget with no room for the
KV cache, one out-of-memory retry). A reload that changes the engine retires the old instances
(they drain and stop) and the next start uses the new spec.

How many replicas run is its `autoscale.Autoscaler`'s decision, and whether a start may be tried
after failed ones its `backoff.Backoff`'s; the model does the starting and stopping.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from ..config import ModelSpec
from ..errors import Conflict, EngineFailed, NotFound, ProxyError, Unavailable, consume_exception
from ..planning.queueing import Rank
from .autoscale import Autoscaler
from .backoff import Backoff
from .engine import EngineProcess, PortInUse, prune_logs
from .failures import KvCacheShort, OutOfMemory, ProfilingDisturbed, Stopped, WakeFailed
from .instance import Instance
from .ports import EngineContext
from .rows import wall_time
from .states import ASLEEP_OR_FALLING, AWAKE, DORMANT, DOWN, State

log = logging.getLogger(__name__)

#: Port races retried per start (new vLLM exits 1 on "Address already in use").
PORT_ATTEMPTS = 3
#: Starts retried after vLLM's memory profiling was disturbed by another process freeing memory.
PROFILING_RETRIES = 2
#: Starts retried with a larger budget after vLLM found no room for the KV cache.
KV_RETRIES = 3
#: Starts one request may sit through (an engine that crashes right after starting is retried).
START_ATTEMPTS = 2
#: Log files of ended instances kept per model (besides those of live instances).
LOGS_KEPT = 4

#: Affinity sessions remembered per model (the least recently seen are forgotten first).
SESSIONS_KEPT = 10_000

#: After an out-of-memory start: evict one more idle instance on these devices (False: none).
EvictMore = Callable[[tuple[int, ...]], Awaitable[bool]]


def rank_of(spec: ModelSpec, key_priority: int = 0) -> Rank:
    """A place in the admission queue, set by the operator: the model's priority, then the
    ``priority`` of the request's API key (among models of one priority, a batch key's
    requests wait behind an interactive key's). A request's own ``priority`` (vLLM's field)
    orders requests within its model's engine and takes no part here: a client that writes
    ``-1000000`` must not rank its model ahead of other models."""
    return (spec.priority, key_priority)


class Model:
    """One configured model and its instances; the only code that creates them."""

    def __init__(
        self,
        spec: ModelSpec,
        ctx: EngineContext[Instance],
        new_id: Callable[[str], str],
        max_queue: int = 1024,
        evict_more: EvictMore | None = None,
    ) -> None:
        self.spec = spec
        self.ctx = ctx
        self._new_id = new_id
        self.max_queue = max_queue
        self._evict_more = evict_more
        #: Live instances, oldest first (done ones are dropped).
        self.instances: list[Instance] = []
        #: The most recent instance that ended (for the summary state and its error).
        self.last_ended: Instance | None = None
        self.last_error: str | None = None
        #: Bring-ups that failed, once each whatever their retries (an engine that crashes
        #: while running is not counted here).
        self.restarts = 0
        #: Never evicted for memory; from the config, changed at run time by the admin API.
        self.pinned = spec.pinned
        #: Requests waiting for an instance to start or wake (the per-model admission queue).
        self.waiting = 0
        #: Unloads and admin sleeps under way: while any runs, new requests wait.
        self._drains = 0
        #: Drains begun so far: a waiter whose bring-up was stopped by one that has already
        #: ended still tries again.
        self._drains_begun = 0
        #: No longer configured (reload); requests still waiting get an error.
        self.removed = False
        #: The proxy is shutting down.
        self.closed = False
        self._bringup: asyncio.Task[None] | None = None
        #: The instance the bring-up is waking or starting now (the waiting requests' own).
        self._bringing: Instance | None = None
        #: The bring-up was begun by requests (not a preload, an admin load or a reload): it is
        #: given up while it still waits for memory once they have all gone (`forsaken`).
        self._on_demand = False
        #: Failed starts in a row and when the next start may be tried (crash loops).
        self.backoff = Backoff(spec.name)
        #: How many replicas run; the policy the instances ask when they are idle.
        self.autoscaler = Autoscaler(self)
        #: Affinity: session -> the replica it stays on (least recently seen dropped first).
        self._sessions: OrderedDict[str, Instance] = OrderedDict()
        #: Replica starts and wakes in the background (scale-up, the replica floor).
        self._growing: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Event()
        self._summary = State.STOPPED
        ctx.metrics.set_model_state(self.name, None, self._summary.value, loaded=False)
        ctx.metrics.active.labels(self.name).set(0)
        self._queue_gauge = ctx.metrics.queue_depth.labels(self.name)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def draining(self) -> bool:
        """An unload or an admin sleep is under way: new requests wait for it."""
        return self._drains > 0

    @property
    def failures(self) -> int:
        """Failed starts in a row (see `backoff.Backoff`)."""
        return self.backoff.failures

    # -- routing -------------------------------------------------------------------------

    def serving(self) -> Instance | None:
        """The instance a new request goes to: among routable (RUNNING) instances the one with
        the fewest requests in flight; ties go to the most recently used, so idle replicas can
        age out. Never one that is starting, waking, asleep, stopping or unhealthy."""
        best: Instance | None = None
        for inst in self.instances:
            if inst.routable:
                if best is None or (inst.leases, -inst.last_used) < (best.leases, -best.last_used):
                    best = inst
        return best

    def route(self, session: str | None, adapter: str | None = None) -> Instance | None:
        """`serving()`, but a session (the affinity header's value) stays on its replica while
        that one serves, and a request without a session for a LoRA adapter goes to the least
        loaded replica that holds it, unless those are at the autoscaler's target."""
        if adapter is not None and len(self.instances) > 1 and session is None:
            holder = self._holding(adapter)
            scale = self.spec.autoscale
            if holder is not None and (
                scale is None or holder.leases < scale.target_ongoing_requests
            ):
                return holder
            return self.serving()  # none holds it, or the holders are full: the least loaded
        if session is None or self.spec.affinity_header is None:
            return self.serving()
        sticky = self._sessions.get(session)
        if sticky is not None and sticky.routable:
            self._sessions.move_to_end(session)
            return sticky
        inst = self.serving()
        if inst is not None:
            self._sessions[session] = inst
            self._sessions.move_to_end(session)
            if len(self._sessions) > SESSIONS_KEPT:
                self._sessions.popitem(last=False)
        return inst

    def _holding(self, adapter: str) -> Instance | None:
        """Among the serving replicas that hold (or are loading) `adapter`, the least loaded:
        Ray Serve's multiplexing rule, which saves a load on another replica (unless those
        are at the autoscaler's target, as Ray Serve falls back when they are full)."""
        best: Instance | None = None
        for inst in self.instances:
            if inst.routable and inst.adapters.holds(adapter):
                if best is None or (inst.leases, -inst.last_used) < (best.leases, -best.last_used):
                    best = inst
        return best

    def rank(self, key_priority: int = 0) -> Rank:
        """A request's place in the admission queue (see `rank_of`)."""
        return rank_of(self.spec, key_priority)

    async def acquire(
        self, session: str | None = None, adapter: str | None = None, priority: int = 0
    ) -> tuple[Instance, EngineProcess]:
        """Wait until an instance serves (waking or starting one if needed) and hold a lease on it.

        Concurrent callers share one start and all see its error. Pair with
        ``instance.release()`` in ``finally``. `session` is the affinity header's value,
        `adapter` the LoRA adapter it names (a replica that holds
        it is preferred), `priority` its API key's. A request for a serving instance is sent
        at once unless
        the admission queue holds it behind a waiter that needs that instance's memory.
        """
        starts = 0
        arrived = self.ctx.queue.clock()
        # Brought up for this request: its lease is not held behind another waiter (the
        # engine was started or woken for it; held, it could be taken before serving anyone).
        brought = False
        # Held until the queue's timeout at most: then sent whatever waits before it.
        hold_over = False
        while True:
            rank = self.rank(priority)  # the model's priority as reloaded
            if self.closed:
                raise Unavailable(f"model '{self.name}' is shutting down", code="shutting_down")
            if self.removed:
                raise NotFound(
                    f"model '{self.name}' was removed from the configuration while the request"
                    " waited",
                    code="model_removed",
                    param="model",
                )
            inst = self.route(session, adapter)
            if inst is not None and not self.draining:
                if not (brought or hold_over) and self.ctx.admission.holds(inst, rank, arrived):
                    hold_over = await self._held(rank, arrived)
                    continue
                # No await between finding it RUNNING and the lease.
                engine = inst.acquire()
                self.autoscaler.check_load()
                return inst, engine
            if self.draining:
                await self._wait_change()
                continue
            if self._bringup is None:
                if starts >= START_ATTEMPTS:
                    raise EngineFailed(self.last_error or f"model '{self.name}' failed to start")
                self._check_backoff()
                starts += 1
                self._bringup = asyncio.ensure_future(self._bring_up())
                self._bringup.add_done_callback(self._bringup_done)
                self._on_demand = True
            drains = self._drains_begun
            try:
                await self._wait_bringup(self._bringup, rank, arrived)
                brought = True
            except Stopped:
                if self.draining or self.removed or self.closed or drains != self._drains_begun:
                    continue  # the loop answers for the unload, removal or shutdown
                raise
            except ProxyError:
                if self.route(session) is not None and not self.draining:
                    continue  # this start failed, but another replica serves meanwhile
                raise

    def backoff_s(self) -> float:
        """Seconds until the next start may be tried (0: now)."""
        return self.backoff.remaining()

    def _check_backoff(self) -> None:
        """Fail fast while a crash loop backs off: 503, Retry-After and the last cause."""
        refusal = self.backoff.refusal(self.last_error)
        if refusal is not None:
            raise refusal

    def ensure_started(self) -> asyncio.Task[None] | None:
        """Bring an instance up in the background (wake or start) unless one serves or is
        coming up (preload, reload, admin load); returns the bring-up task."""
        if self.serving() is None and self._bringup is None and not self.closed:
            self._bringup = asyncio.ensure_future(self._bring_up())
            self._bringup.add_done_callback(self._bringup_done)
        self._on_demand = False  # wanted whether requests wait for it or not
        return self._bringup

    def forsaken(self, inst: Instance) -> bool:
        """Whether `inst`, still waiting for memory, is the bring-up of requests that have all
        gone (their clients hung up): then it is dropped, and the next request begins anew."""
        if inst is not self._bringing or not self._on_demand or self.waiting > 0:
            return False
        self._bringup = self._bringing = None
        return True

    # -- replicas ------------------------------------------------------------------------

    def grow(self, count: int, wake: bool = True) -> None:
        """Add `count` replicas in the background (the autoscaler asks): wake sleeping ones
        first (with `wake`), then start new ones (each placed by the memory rules, on devices
        of its own where it can). Not while a crash loop backs off."""
        if self.backoff_s() > 0:
            return
        sleepers = [i for i in self.instances if i.state in ASLEEP_OR_FALLING and not i.retired]
        sleepers = sleepers if wake else []
        for _ in range(count):
            if sleepers:
                inst = sleepers.pop()
                task = inst.wake()  # the instance's one wake task, shared with any waiter
            else:
                inst = self._new_instance()
                log.info("%s: new replica of %s (%d wanted)", inst.id, self.name,
                         self.autoscaler.desired())  # fmt: skip
                task = inst.start()
            self._growing.add(task)
            task.add_done_callback(self._grown)

    def _grown(self, task: asyncio.Task[None]) -> None:
        self._growing.discard(task)
        if task.cancelled():
            return
        err = task.exception()
        if isinstance(err, ProxyError) and not isinstance(err, Stopped):
            log.warning("%s: a replica did not come up: %s", self.name, err.message)
        elif err is not None and not isinstance(err, ProxyError):
            log.error("%s: replica start failed", self.name, exc_info=err)

    def starting(self) -> asyncio.Task[None] | None:
        """The bring-up (a wake or a start) in progress, if any."""
        return self._bringup

    def _bringup_done(self, task: asyncio.Task[None]) -> None:
        if self._bringup is task:
            self._bringup = None
            self._bringing = None
        consume_exception(task)

    async def _wait_bringup(self, task: asyncio.Task[None], rank: Rank, arrived: float) -> None:
        if self.waiting >= self.max_queue:
            raise Unavailable(
                f"model '{self.name}': {self.waiting} requests already wait for it to start",
                code="queue_full",
            )
        self.waiting += 1
        self._queue_gauge.set(self.waiting)
        ticket = self.ctx.queue.enter(self.name, rank, arrived)
        try:
            await asyncio.shield(task)
        finally:
            self.ctx.queue.leave(ticket)
            self.waiting -= 1
            self._queue_gauge.set(self.waiting)

    def _hold_ends(self, arrived: float) -> float:
        """When a request that arrived at `arrived` is sent anyway, held or not: once it has
        waited the queue's timeout (the waiter it let pass has given up by then, or is stuck
        behind requests that do not end)."""
        return arrived + self.ctx.queue.timeout_s

    async def _held(self, rank: Rank, arrived: float) -> bool:
        """Wait, queued behind the waiter that takes this model's engine, until something in
        the queue changes (the caller looks again), the model changes, or the hold runs out
        (True). The hold is over once its wait has timed out, whatever the clock reads then:
        a deadline that rounding puts a hair after the timer would otherwise be waited for
        again and again without the clock moving."""
        queue = self.ctx.queue
        remaining = self._hold_ends(arrived) - queue.clock()
        if remaining <= 0:
            return True
        ticket = queue.enter(self.name, rank, arrived, held=True)
        waits = [asyncio.ensure_future(queue.changes()),
                 asyncio.ensure_future(self._changed.wait())]  # fmt: skip
        try:
            done, _ = await asyncio.wait(
                waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for w in waits:
                w.cancel()
            queue.leave(ticket)
        return not done

    def sleeper(self) -> Instance | None:
        """The newest sleeping (or waking) instance that is not retired: woken before any
        cold start."""
        for inst in reversed(self.instances):
            if inst.state in DORMANT and not inst.retired:
                return inst
        return None

    async def _bring_up(self) -> None:
        """Wake a sleeping instance if there is one; else (or when the wake fails: that engine
        is stopped) start new instances until one is RUNNING, a new instance per attempt. Tried
        again: a lost port race on a new port (`PORT_ATTEMPTS`), a start whose memory profiling
        another process disturbed (`PROFILING_RETRIES`), one with no room for the KV cache with
        a larger budget (`KV_RETRIES`), an out-of-memory start once after evicting one more
        idle instance, and one a reload retired with the new spec."""
        sleeper = self.sleeper()
        if sleeper is not None:
            self._bringing = sleeper
            try:
                await sleeper.wake()
                return
            except WakeFailed as err:
                log.warning("%s: %s; cold start instead", sleeper.id, err.message)
            except Stopped:
                if self.removed or self.closed or self.draining:
                    raise  # the waiters' loop answers (an unload: they wait for its end)
        port_attempts, oom_retried, disturbed, grown = 0, False, 0, 0
        plain = False  # retried once without a larger budget (a neighbour may have regrown)
        while True:
            if self.removed or self.closed or self.draining:  # between two attempts
                raise Stopped(f"model '{self.name}' is no longer served", code="stopped")
            inst = self._new_instance()
            self._bringing = inst
            try:
                start = inst.start()
                self.autoscaler.check_load()  # the other replicas the model wants start alongside
                await start
                self.last_error = None
                return
            except Stopped:
                if inst.retired and not (self.removed or self.closed):
                    continue  # replaced by a reload while starting: start the new spec
                raise
            except PortInUse as err:
                port_attempts += 1
                log.warning("%s: port taken, retrying with a new instance", inst.id)
                if port_attempts < PORT_ATTEMPTS:
                    continue
                msg = f"model '{self.name}': no port could be bound after {PORT_ATTEMPTS} attempts"
                self._failed(msg, "start_failed")
                raise EngineFailed(msg, code="engine_start_failed") from err
            except KvCacheShort as err:
                if inst.profiled_beside and not plain:
                    # Another engine there was below its claim while this one profiled: its
                    # peak may have come back inside the window. No boost learned from that;
                    # the same budget once more.
                    plain = True
                    log.warning("%s: no room for the KV cache while %s could regrow beside it;"
                                " retrying with the same budget", inst.id,
                                ", ".join(inst.profiled_beside))  # fmt: skip
                    continue
                grown += 1
                why = (
                    self.ctx.memory.grow_budget(self.spec)
                    if grown <= KV_RETRIES
                    else (f"{KV_RETRIES} larger budgets did not help; set memory_mb")
                )
                if why is None:
                    log.warning("%s: no room for the KV cache; retrying with a larger budget",
                                inst.id)  # fmt: skip
                    continue
                msg = f"model '{self.name}': vLLM found no room for the KV cache: {why}"
                log.error("%s", msg)
                self._failed(msg, "out_of_memory")
                raise Unavailable(msg, code="insufficient_gpu_memory") from err
            except ProfilingDisturbed as err:
                disturbed += 1
                if disturbed <= PROFILING_RETRIES:
                    log.warning("%s: another process freed GPU memory while vLLM profiled its"
                                " start; retrying", inst.id)  # fmt: skip
                    continue
                self._failed(err.message, "start_failed")
                raise
            except OutOfMemory as err:
                evict = self._evict_more
                if not oom_retried and evict is not None and await evict(inst.devices):
                    oom_retried = True
                    log.warning("%s: out of GPU memory at start; evicted one more", inst.id)
                    continue
                self._failed(err.message, "out_of_memory")
                raise Unavailable(err.message, code="insufficient_gpu_memory") from None
            except EngineFailed as err:
                self._failed(err.message, "start_failed")
                raise
            except ProxyError as err:
                if inst.state is State.ERROR:  # a failed start (timeout), not a refusal
                    self._failed(err.message, "start_failed")
                raise

    def _failed(self, message: str, reason: str) -> None:
        """A bring-up gave up: its cause is the model's last error, counted by `reason`."""
        self.last_error = message
        self.restarts += 1
        self.ctx.metrics.restarts.labels(self.name, reason).inc()

    def _new_instance(self) -> Instance:
        inst = Instance(
            self.spec,
            self._new_id(self.name),
            self.ctx,
            self._instance_changed,
            self._queued,
            self.autoscaler,
        )
        self.instances.append(inst)
        keep = {int(i.id.rpartition("#")[2]) for i in self.instances}
        prune_logs(self.spec, keep, LOGS_KEPT)
        return inst

    def _instance_changed(self, inst: Instance, old: State) -> None:
        """Every state change of one of our instances: keep the books and the summary."""
        if inst.state in AWAKE and old in (State.STARTING, State.WAKING):
            # Up (RUNNING, or DRAINING when it was retired meanwhile): no more waiting; a fresh
            # start is on probation.
            self.backoff.up(inst, started=old is State.STARTING)
            self.autoscaler.check_load()  # the replica floor, and load that came meanwhile
        if inst.state in DOWN and inst.done:
            if inst in self.instances:
                self.instances.remove(inst)
            if self._sessions:  # sessions on it move to another replica at their next request
                for key in [k for k, v in self._sessions.items() if v is inst]:
                    del self._sessions[key]
            self.last_ended = inst
            failed = inst.state.public is State.ERROR
            if failed and inst.last_error:
                self.last_error = inst.last_error
            self.backoff.ended(
                inst,
                failed=failed,
                ran=inst.ready_at != 0,
                stopped=old is State.STOPPING,
                max_s=self.spec.max_backoff_s,
            )
        summary = self.state()
        if summary is not self._summary:
            self.ctx.metrics.set_model_state(
                self.name, self._summary.value, summary.value, loaded=summary is State.RUNNING
            )
            self._summary = summary
        self._changed.set()
        self._changed = asyncio.Event()

    def _queued(self) -> int:
        return self.waiting

    async def _wait_change(self) -> None:
        await self._changed.wait()

    def state(self) -> State:
        """One state for the model: RUNNING while any instance serves, else the most advanced
        live one, else how the last one ended."""
        live = {i.state.public for i in self.instances}
        for s in (State.RUNNING, State.WAKING, State.STARTING, State.SLEEPING, State.STOPPING):
            if s in live:
                return s
        if self.last_ended is not None and self.last_ended.state.public is State.ERROR:
            return State.ERROR
        return State.STOPPED

    # -- lifecycle -----------------------------------------------------------------------

    def update(self, spec: ModelSpec, drain_timeout_s: float, restart: bool) -> None:
        """Take a reloaded spec. Without `restart` the instances take it in place (and the
        replica count its new bounds); with it every instance is retired (they drain and
        stop) and, if one was running or starting, a new one starts with the new spec."""
        self.spec = spec
        self.pinned = spec.pinned
        if not restart:
            for inst in self.instances:
                inst.spec = spec
                inst.rearm_idle()
            self._resize(drain_timeout_s)
            return
        was_up = any(i.state.public in (State.RUNNING, State.STARTING) for i in self.instances)
        self.retire_all(drain_timeout_s)
        if was_up:
            self.ensure_started()

    def _resize(self, drain_timeout_s: float) -> None:
        """After a reload changed the replica bounds: retire replicas above the new ceiling
        (asleep ones first, then the least busy; they drain; never the one that waiting
        requests are brought up on), and grow toward the new floor if the model is up."""
        _, ceiling = self.spec.replica_bounds()
        for inst in self.autoscaler.surplus(keep=self._bringing):
            log.info("%s: replicas of %s reduced to %d; retiring it", inst.id, self.name, ceiling)
            inst.retire(drain_timeout_s)
        if self.serving() is not None:
            self.autoscaler.check_load()

    def retire_all(self, drain_timeout_s: float) -> list[asyncio.Task[None]]:
        """Retire every instance: no new requests, drain, stop."""
        return [i.retire(drain_timeout_s) for i in self.instances if not i.retired]

    def remove(self, drain_timeout_s: float) -> list[asyncio.Task[None]]:
        """No longer configured: waiting requests get an error, instances drain and stop."""
        self.removed = True
        self._changed.set()
        return self.retire_all(drain_timeout_s)

    async def unload(self, timeout: float) -> None:
        """Admin unload: new requests wait; in-flight ones get `timeout`; every instance stops."""
        self._drains += 1
        self._drains_begun += 1
        try:
            while self.instances:
                for inst in self.instances:
                    inst.change_reason = "admin unload"
                await asyncio.gather(*(i.drain_and_stop(timeout) for i in list(self.instances)))
        finally:
            self._drains -= 1
            self._changed.set()
            self._changed = asyncio.Event()

    async def preload(self) -> None:
        """Start at boot (in the background): up, and with a sleep policy put to sleep at
        once, so that the first request pays only a wake."""
        try:
            started = self.ensure_started()
            if started is not None:
                await asyncio.shield(started)
        except ProxyError as err:
            log.error("%s: preload failed: %s", self.name, err.message)
            return
        inst = self.serving()
        if self.spec.sleep is not None and inst is not None:
            task = inst.sleep("preload")
            if task is not None:
                await task

    async def sleep(self, level: int | None, timeout: float) -> None:
        """Admin sleep: new requests wait, in-flight ones get `timeout` to finish, then every
        RUNNING instance is put to sleep (`Conflict` when requests are still in flight)."""
        if self.spec.sleep is None:
            raise Conflict(
                f"model '{self.name}' has no sleep policy (set sleep: {{level: 1}} for it)",
                code="sleep_not_enabled",
            )
        if level == 2 and not self.spec.reloadable:
            raise Conflict(
                f"model '{self.name}' cannot sleep at level 2: its load_format cannot reload the"
                " weights on wake; use level 1",
                code="sleep_level_unsupported",
            )
        self._drains += 1
        self._drains_begun += 1
        try:
            instances = [i for i in self.instances if i.state in AWAKE]
            await asyncio.gather(*(i.drained(timeout) for i in instances))
            busy = [i.id for i in instances if i.leases > 0]
            if busy:
                raise Conflict(
                    f"model '{self.name}': requests still in flight on {', '.join(busy)} after"
                    f" {timeout:g}s; not put to sleep",
                    code="model_busy",
                )
            naps = [i.sleep("admin", level) for i in instances]
            # Shielded: an admin client that hangs up must not cancel a /sleep call half-way
            # (the engine would sleep, the proxy not knowing at which level).
            await asyncio.shield(asyncio.gather(*(t for t in naps if t is not None)))
        finally:
            self._drains -= 1
            self._changed.set()
            self._changed = asyncio.Event()

    async def wake(self) -> None:
        """Admin wake: wake the sleeping instance (no-op when one serves)."""
        if self.serving() is not None:
            return
        if self.sleeper() is None:
            raise Conflict(f"model '{self.name}' is not asleep", code="not_sleeping")
        inst, _ = await self.acquire()
        inst.release()

    def clear_wake_check(self) -> list[int]:
        """An operator's reset: the sleep levels barred because their wakes kept failing the
        wake check are used again (their failures forgotten); returns those levels. Instances
        idle now arm their sleep timers again."""
        levels = self.ctx.breaker.clear(self.name)
        for level in levels:
            self.ctx.metrics.sleep_level_barred.labels(self.name, str(level)).set(0)
        if levels:
            log.warning("model %s: sleep levels %s cleared by an operator; used again",
                        self.name, ", ".join(map(str, levels)))  # fmt: skip
            for inst in self.instances:
                inst.rearm_idle()
        return levels

    def close(self) -> None:
        """The proxy is shutting down: requests still waiting (held, or for an unload) get
        503 now, and nothing new is started; those in flight go on."""
        self.closed = True
        self._changed.set()

    async def shutdown(self) -> None:
        """Fail waiters, stop every instance."""
        self.close()
        await asyncio.gather(*(i.stop() for i in list(self.instances)), return_exceptions=True)
        if self._bringup is not None:  # it stops at its next step; then stop what it made
            await asyncio.gather(self._bringup, return_exceptions=True)
            await asyncio.gather(*(i.stop() for i in list(self.instances)), return_exceptions=True)

    # -- views ---------------------------------------------------------------------------

    def status(self) -> dict[str, object]:
        """What an operator sees of the model and its instances."""
        last, clock = self.last_ended, self.ctx.queue.clock
        return {
            "name": self.name,
            "model": self.spec.model,
            "sleep": self.spec.sleep.status() if self.spec.sleep is not None else None,
            "sleep_levels": self._sleep_levels(),
            "replicas": {
                **self.autoscaler.status(),
                "affinity_header": self.spec.affinity_header,
            },
            "aliases": list(self.spec.aliases),
            "state": self.state().value,
            "leases": sum(i.leases for i in self.instances),
            "queue": self.waiting,
            "held": sum(
                1 for t in self.ctx.queue.tickets.values() if t.held and t.model == self.name
            ),
            "restarts": self.restarts,
            "failures_in_a_row": self.failures,
            "wake_check": self.ctx.breaker.status(self.name),
            "last_error": self.last_error,
            "pinned": self.pinned,
            "draining": self.draining,
            "last_used": max(
                (wall_time(i.last_used, clock) or 0.0 for i in self.instances), default=0.0
            )
            or (wall_time(last.last_used, clock) if last else None),
            "instances": [i.status() for i in self.instances],
            "last_instance": last.status() if last is not None else None,
            "adapters": self.adapter_status(),
            "adapters_dir": self.spec.adapters_dir,
            "max_adapters": self.spec.max_adapters or None,
        }

    def _sleep_levels(self) -> list[int]:
        """The levels an operator may put it to sleep at (`sleep`): none without a policy, 2
        only where the weights can be reloaded on wake."""
        if self.spec.sleep is None:
            return []
        return [1, 2] if self.spec.reloadable else [1]

    def adapter_status(self) -> list[dict[str, object]]:
        """The model's LoRA adapters (configured ones, then those found in its folder that an
        engine holds), each with the instances holding it (``loaded`` or ``loading``)."""
        held: dict[str, dict[str, str]] = {}
        paths: dict[str, str] = {}
        for inst in self.instances:
            for name, state in inst.adapters.status().items():
                held.setdefault(name, {})[inst.id] = state
                paths[name] = inst.adapters.slots[name].adapter.path
        rows: list[dict[str, object]] = []
        for a in self.spec.adapters:
            rows.append({"name": a.name, "aliases": list(a.aliases), "path": a.path,
                         "source": "config", "instances": held.pop(a.name, {})})  # fmt: skip
        for name, where in sorted(held.items()):
            rows.append({"name": name, "aliases": [], "path": paths[name],
                         "source": "adapters_dir", "instances": where})  # fmt: skip
        return rows
