"""The proxy's own admission in virtual time: the density benchmark's planner and scheduler.

`run()` builds the real `Manager` (its `Model`s, `Instance`s, `Admission`, `Memory` on a static
budget, the admission queue and `HostRam`) from a parsed config, so the shipped defaults apply
(idle timers, sleep levels and the level-2 fallback when host RAM is short, the device locks of
starts and wakes), and drives it with one task per request. Only the engine process is
simulated (`VirtualEngine`: the profile's start, sleep, wake and stop times), and time is
virtual (`VirtualLoop`: the loop's clock jumps to the next timer when nothing is ready), so a
day of traffic runs in seconds. The code under test reads time from the queue's clock, which
is the loop's here.

What is observed, never decided, here: every memory claim is checked against the budget
(`over_commits`), a sleep or stop of an engine with a request in flight is counted
(`busy_evictions`), and a claim that puts engines to sleep or stops them for a model whose
oldest request came more than the reorder window after another model's oldest waiting one
counts as a reorder of that model; it is a late overtake only when the memory it took was memory
that model's plan needed: once the claim has been carried out, its plan (busy engines drained)
can no longer be placed, or waits for an engine busy now that it did not wait for before.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import selectors
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_proxy.app import admission_rules, build_memory, engine_context
from vllm_proxy.config import ModelSpec, parse_config
from vllm_proxy.engines.engine import EngineProcess
from vllm_proxy.errors import ProxyError
from vllm_proxy.metrics import Metrics
from vllm_proxy.planning.hostmem import HostRam
from vllm_proxy.planning.memory import Memory, Placement
from vllm_proxy.planning.planner import Plan, after, plan
from vllm_proxy.planning.queueing import Queue
from vllm_proxy.pool.admission import Admission
from vllm_proxy.pool.manager import Manager

MIB_PER_GIB = 1024


class _Selector(selectors.DefaultSelector):
    loop: VirtualLoop

    def select(self, timeout: float | None = None) -> list[Any]:
        events = super().select(0)
        if events or timeout == 0:
            return events
        if timeout is None:
            raise RuntimeError("virtual loop: nothing ready and no timer (a deadlock)")
        # Never less than one float step: a timer is due only once the clock reads its time.
        self.loop.now = max(self.loop.now + timeout, math.nextafter(self.loop.now, math.inf))
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock jumps to the next timer when nothing is ready.

    A timer that runs moves the clock to its time: asyncio runs timers due within its clock
    resolution at once, and while other callbacks are ready it does not wait, so without this a
    task that waits for a deadline one float step after now, and plans again when woken, would
    be woken at the same instant for ever (admission's next-change wait, two waiters)."""

    def __init__(self) -> None:
        selector = _Selector()
        self.now = 0.0
        super().__init__(selector)
        selector.loop = self
        self._clock_resolution = 1e-9

    def call_at(  # type: ignore[override]
        self, when: float, callback: Callable[..., Any], *args: Any, context: Any = None
    ) -> asyncio.TimerHandle:
        return super().call_at(when, self._due, when, callback, *args, context=context)

    def _due(self, when: float, callback: Callable[..., Any], *args: Any) -> None:
        self.now = max(self.now, when)
        callback(*args)

    def time(self) -> float:
        return self.now

    def run_in_executor(self, executor: Any, func: Callable[..., Any], *args: Any) -> Any:  # type: ignore[override]
        """Inline: only in-memory readers (host RAM) are run in threads on this path."""
        fut = self.create_future()
        try:
            fut.set_result(func(*args))
        except Exception as err:
            fut.set_exception(err)
        return fut


@dataclass(frozen=True)
class Timing:
    """One model's engine times (seconds) and sizes (MiB), from the density profile."""

    start_s: float
    stop_s: float
    wake_s: Callable[[int], float]
    sleep_s: Callable[[int, bool], float]
    weights_mib: int
    footprint_mib: int = 0
    residue_mib: int = 0
    #: From spawn to the end of vLLM's memory profiling (set-up, weights, the compiling profile
    #: run): a start that measures holds its devices alone this long (0: its whole start).
    profile_s: float = 0.0


@dataclass
class World:
    """What the virtual engines share: their times, host RAM and the observers' counters."""

    timing: dict[str, Timing]
    host_ram_mib: int
    #: The GPU memory engines may use on each device (total less the reserve): what they hold
    #: is checked, device by device.
    capacity_mib: int = 1 << 40
    pinned: dict[int, int] = field(default_factory=dict)
    #: What each live engine holds on each of its devices now, by pid, and its devices.
    held: dict[int, int] = field(default_factory=dict)
    on: dict[int, tuple[int, ...]] = field(default_factory=dict)
    #: The devices the proxy placed each model on (its last claim), by model name.
    devices: dict[str, tuple[int, ...]] = field(default_factory=dict)
    busy_evictions: int = 0
    over_commits: int = 0
    max_used_mib: int = 0
    #: Claims that left an earlier waiter (by more than the reorder window) unable to place
    #: its plan without waiting for more (see `ObservedAdmission._harmed`).
    late_overtakes: int = 0
    #: Claims that took memory while such an earlier waiter waited, whatever they took.
    reorders: int = 0
    swaps: int = 0
    cold_starts: int = 0
    wakes: int = 0
    #: Sleeps and stops of engines (for memory or by the idle timers), and level-1 sleeps asked
    #: that host RAM turned into level-2 ones.
    sleeps: int = 0
    stops: int = 0
    fallbacks: int = 0
    start_gpu_s: float = 0.0
    wake_gpu_s: float = 0.0
    #: The most host RAM pinned by sleeping engines at once (MiB).
    max_pinned_mib: int = 0
    counting: bool = False
    leases: dict[str, int] = field(default_factory=dict)

    def free_ram_mb(self) -> int:
        return self.host_ram_mib - sum(self.pinned.values())

    def hold(self, pid: int, mib: int, devices: tuple[int, ...] = (0,)) -> None:
        """Engine `pid` holds `mib` on each of `devices` from now: never more than a device
        has. `max_used_mib` is the most held on one device at once."""
        self.held[pid] = mib
        self.on[pid] = devices
        for d in devices:
            used = sum(mib for p, mib in self.held.items() if d in self.on.get(p, (0,)))
            self.max_used_mib = max(self.max_used_mib, used)
            if used > self.capacity_mib:
                self.over_commits += 1


class VirtualEngine(EngineProcess):
    """An engine process that exists only in virtual time (see the module docstring)."""

    world: World
    pids = itertools.count(1 << 30)

    def __init__(self, spec: ModelSpec, address: int | str, log_file: Path, tag: str = "",
                 overrides: Any = None, env: Any = None) -> None:  # fmt: skip
        super().__init__(spec, address, log_file, tag=tag, overrides=overrides, env=env)
        self.timing = self.world.timing[spec.name]
        self._gone = asyncio.Event()
        self._slept = False
        self._pid: int | None = None
        self._devices: tuple[int, ...] = (0,)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    @property
    def pid(self) -> int | None:
        return self._pid

    async def spawn(self) -> None:
        self._pid = next(self.pids)
        self.started_at = self._now()
        self._devices = self.world.devices.get(self.spec.name, (0,))
        self.world.hold(self._pid, self.timing.footprint_mib, self._devices)

    async def wait_ready(self, session: Any) -> float:
        await asyncio.sleep(self.timing.start_s)
        if self.world.counting:
            self.world.cold_starts += 1
            self.world.start_gpu_s += self.timing.start_s
        return self._now() - self.started_at

    async def watch_profiling(self, workers: int) -> bool:
        """The end of the start's profiling window (`Timing.profile_s`), where vLLM logs the KV
        cache it measured: what the engine holds less its weights."""
        if self.timing.profile_s <= 0:
            await self._gone.wait()
            return False
        await asyncio.sleep(max(self.started_at + self.timing.profile_s - self._now(), 0))
        self.kv_measured = max(self.timing.footprint_mib - self.timing.weights_mib, 1) << 20
        return True

    async def warmup(self, client: Any) -> None:
        return None

    def client(self, session: Any) -> Any:
        return session

    def _evicted(self) -> None:
        if self.world.leases.get(self.spec.name, 0) > 0:
            self.world.busy_evictions += 1

    async def sleep(self, client: Any, level: int) -> None:
        self._evicted()
        if self.world.counting:
            self.world.sleeps += 1
            asked = self.spec.sleep.level if self.spec.sleep is not None else level
            self.world.fallbacks += level > asked
        await asyncio.sleep(self.timing.sleep_s(level, not self._slept))
        assert self.pid is not None
        self.world.hold(self.pid, self.timing.residue_mib, self._devices)
        if level == 1:
            self._slept = True
            assert self.pid is not None
            self.world.pinned[self.pid] = self.timing.weights_mib
            pinned = sum(self.world.pinned.values())
            self.world.max_pinned_mib = max(self.world.max_pinned_mib, pinned)

    async def wake(self, client: Any, level: int) -> None:
        seconds = self.timing.wake_s(level)
        assert self.pid is not None
        self.world.hold(self.pid, self.timing.footprint_mib, self._devices)
        await asyncio.sleep(seconds)
        if self.world.counting:
            self.world.wakes += 1
            self.world.wake_gpu_s += seconds

    async def probe(self, *args: Any, **kwargs: Any) -> bool:
        return True

    async def probe_sleeping(self, *args: Any, **kwargs: Any) -> bool:
        return False

    def listener_unchanged(self) -> bool:
        return True

    def engine_alive(self) -> bool:
        return not self._gone.is_set()

    async def stop(self, grace: float) -> int | None:
        if not self._gone.is_set():
            self._evicted()
            if self.world.counting:
                self.world.stops += 1
            await asyncio.sleep(self.timing.stop_s)
            self._exit(0)
        return self.exit_code

    def _exit(self, code: int) -> None:
        if self.exit_code is None:
            self.exit_code = code
            self.exited_at = self._now()
        self.world.pinned.pop(self.pid or 0, None)
        self.world.held.pop(self.pid or 0, None)
        self.world.on.pop(self.pid or 0, None)
        self._gone.set()

    def kill(self) -> None:
        self._exit(-9)

    def kill_group(self) -> None:
        self._exit(-9)

    async def wait_exit(self, timeout: float | None = None) -> int | None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._gone.wait(), timeout)
        return self.exit_code


def _no_holds(self: Any, inst: Any, rank: Any, arrived: float) -> bool:
    return False


def _no_prices(self: Any, spec: ModelSpec, kind: str, seconds: float) -> None:
    return None


def _no_spare(self: Any, inst: Any, decision: Plan, *args: Any) -> Plan:
    return decision


class ObservedAdmission(Admission):
    """`Admission`, with the claims it makes watched (see the module docstring)."""

    world: World

    def _take(self, inst: Any, decision: Plan, claim: Any, unclaim: Any) -> Placement | None:
        if not self.world.counting:
            return self._claim(inst, decision, claim, unclaim)
        harmed = self._harmed(inst, decision)
        placement = self._claim(inst, decision, claim, unclaim)
        if placement is None:
            return placement
        if decision.sleep or decision.evict:
            self.world.swaps += 1
        self.world.late_overtakes += harmed[0]
        self.world.reorders += harmed[1]
        return placement

    def _claim(self, inst: Any, decision: Plan, claim: Any, unclaim: Any) -> Placement | None:
        placement = super()._take(inst, decision, claim, unclaim)
        if placement is not None and placement.devices:
            self.world.devices[inst.name] = placement.devices  # where its engine will run
        return placement

    def _harmed(self, inst: Any, decision: Plan) -> tuple[int, int]:
        """What `inst` carrying out `decision` would do to the models that began waiting more
        than the reorder window before it: how many of them it would leave unable to place
        their plan (busy engines drained) without waiting for more than they already did (late
        overtakes), and how many of them there are at all if the claim takes memory (reorders).
        """
        mine = self._waiter(inst.name)
        if mine is None:
            return 0, 0
        window = self.queue.rules.window_s
        waiting = {i.name: i for i in self._reclaiming.values()}
        older = [
            waiting[w.model]
            for w in self.queue.waiters()
            if w.model != inst.name and w.model in waiting and mine.since - w.since > window
        ]
        if not older:
            return 0, 0
        reorders = len(older) if decision.sleep or decision.evict else 0
        now = self.queue.clock()
        busy = {v.name for v in self._views(protect=False)[0] if v.leases > 0}
        own, _, _ = self._inputs(inst)
        late = 0
        for other in older:
            demand, devices, views = self._inputs(other, drained=True)
            before = plan(demand, devices, views, now)
            if not isinstance(before, Plan):
                continue  # it could not be placed anyway: nothing it needed was taken
            devices, views = after(own, decision, devices, views)
            later = plan(demand, devices, views, now)
            waited = busy & {*before.evict, *before.sleep}
            if not isinstance(later, Plan) or not busy & {*later.evict, *later.sleep} <= waited:
                late += 1
        return late, reorders


class PlannerAdmission(ObservedAdmission):
    """The proxy before admission: no prices (least recently used first), no holds, no turns:
    any waiting bring-up may take memory as soon as its plan fits."""

    timed = _no_prices
    holds = _no_holds
    _spare_stops = _no_spare

    def _claim(self, inst: Any, decision: Plan, claim: Any, unclaim: Any) -> Placement | None:
        backup = dict(self._reclaiming)
        self._reclaiming.clear()  # nobody's turn: every waiter goes
        try:
            return super()._claim(inst, decision, claim, unclaim)
        finally:
            self._reclaiming.update(backup)


#: Scheduler rules a run can go without (``density.py --without``), to measure what each is
#: worth: holds (the reorder bound on requests for serving engines), measured prices (victims
#: least recently used first instead) and waits that spare stops; each the `Admission` method
#: replaced and what replaces it.
ABLATIONS: dict[str, tuple[str, Callable[..., Any]]] = {
    "holds": ("holds", _no_holds),
    "prices": ("timed", _no_prices),
    "spare": ("_spare_stops", _no_spare),
}


@dataclass(frozen=True)
class Request:
    """One request: when, which model (name), its prefill and decode seconds."""

    time: float
    model: str
    prefill_s: float
    decode_s: float
    client: int | None = None


@dataclass
class Outcome:
    """What happened to one request."""

    request: Request
    #: TTFT (inf: not served: 503 or the client gave up).
    ttft: float = math.inf
    cold: bool = False
    failed: bool = False
    gave_up: bool = False


def config(models: dict[str, dict[str, Any]], total_mib: int, reserve_mib: int, state: str,
           admission: dict[str, Any], engine: dict[str, Any], gpus: int = 1) -> Any:  # fmt: skip
    """The proxy's config for a virtual run: the shipped defaults, a static GPU budget of
    `gpus` devices of `total_mib` each."""
    data = {
        "server": {"state_dir": state},
        "engine": {"command": ["true"], "health_interval_s": 0, "warmup": False, **engine},
        "gpu": {
            "monitor": "static",
            "devices": [{"id": d, "memory_mb": total_mib} for d in range(gpus)],
            "reserve_mb": reserve_mib,
        },
        "admission": admission,
        "models": models,
    }
    return parse_config(data)


def run(
    cfg: Any,
    world: World,
    requests: Sequence[Request],
    *,
    planner: bool = False,
    without: frozenset[str] = frozenset(),
    count: Callable[[float], bool] = lambda _t: True,
    give_up_s: float | None = None,
    think_s: Sequence[float] = (),
    until: float = math.inf,
    client_requests: Callable[[int, float], Request | None] | None = None,
) -> list[Outcome]:
    """Serve `requests` (and closed-loop clients' next requests from `client_requests`)
    through the real proxy in virtual time; one `Outcome` per request."""
    loop = VirtualLoop()
    previous = logging.getLogger("vllm_proxy").level
    logging.getLogger("vllm_proxy").setLevel(logging.ERROR)
    try:
        return loop.run_until_complete(
            _serve(cfg, world, requests, planner, count, give_up_s, client_requests, until, without)
        )
    finally:
        logging.getLogger("vllm_proxy").setLevel(previous)
        # What engines still do (idle timers, sleeps) is cancelled and awaited, so that nothing
        # is left unretrieved.
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        # (gather() of nothing would make its future on another loop than this one)
        with contextlib.suppress(RuntimeError):
            if left:
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.close()


async def _serve(cfg: Any, world: World, requests: Sequence[Request], planner: bool,
                 count: Callable[[float], bool], give_up_s: float | None,
                 client_requests: Callable[[int, float], Request | None] | None,
                 until: float, without: frozenset[str] = frozenset()) -> list[Outcome]:  # fmt: skip
    loop = asyncio.get_running_loop()
    metrics = Metrics()
    specs = cfg.specs()
    memory = build_memory(cfg, specs, metrics)
    assert isinstance(memory, Memory)
    memory.sizes_kv = True  # an NVML-managed GPU: starts are told the KV size once measured
    engine_class = type("Engine", (VirtualEngine,), {"world": world})
    host = HostRam(reader=world.free_ram_mb, rss=lambda pgid: world.pinned.get(pgid or 0))
    # The proxy's admission, watched (and for the planner, without the queue's rules).
    kind = PlannerAdmission if planner else ObservedAdmission
    removed = dict(ABLATIONS[name] for name in without)
    watched = type("Watched", (kind,), {"world": world, **removed})
    ctx, roster, admission = engine_context(
        None, _Registry(), metrics, memory, queue=Queue(clock=loop.time), host=host,  # type: ignore[arg-type]
        admission_class=watched, engine_factory=engine_class,
    )  # fmt: skip
    adm = cfg.admission
    manager = Manager(specs, ctx, roster, memory, admission, adm.queue_timeout_s, adm.max_queue,
                      admission_rules(adm))  # fmt: skip
    assert manager.admission is not None
    outcomes: list[Outcome] = []
    tasks: list[asyncio.Task[None]] = []

    async def one(r: Request) -> None:
        await asyncio.sleep(max(r.time - loop.time(), 0))
        world.counting = count(loop.time())
        model = manager.models[r.model]
        out = Outcome(r, cold=model.serving() is None and model.sleeper() is None)
        outcomes.append(out)
        try:
            async with asyncio.timeout(give_up_s):
                inst, _ = await model.acquire()
        except ProxyError:
            out.failed = True
        except TimeoutError:
            out.gave_up = True
        else:
            out.ttft = loop.time() - r.time + r.prefill_s
            world.leases[r.model] = world.leases.get(r.model, 0) + 1
            try:
                await asyncio.sleep(r.prefill_s + r.decode_s)
            finally:
                world.leases[r.model] -= 1
                inst.release()
        if r.client is not None and client_requests is not None:
            nxt = client_requests(r.client, loop.time())
            if nxt is not None and nxt.time < until:
                tasks.append(asyncio.ensure_future(one(nxt)))

    tasks.extend(asyncio.ensure_future(one(r)) for r in requests)
    while tasks:
        batch = list(tasks)
        tasks.clear()
        await asyncio.gather(*batch)
    # Every request has ended: what engines still do (idle timers, sleeps) is not measured.
    return outcomes


class _Registry:
    """The engine registry, in memory (virtual engines have no process group)."""

    tag = ""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def new_id(self, model: str) -> str:
        self._ids[model] = self._ids.get(model, 0) + 1
        return f"{model}#{self._ids[model]}"

    def add(self, pgid: int, instance_id: str) -> None:
        return None

    def remove(self, pgid: int) -> None:
        return None


def state_dir() -> str:
    return tempfile.mkdtemp(prefix="density-")
