"""GPU memory as the admission path sees it: the source, footprints, placements, device locks.

`Memory` answers "how much does this model take", "what is used where now" and "where may it go";
the decision itself is `planner.plan()` (pure). `admission.Admission` drives admission with
it; instances report their sleeps and wakes to it (`sleep_claim`, `wake_claim`).

Budgets and measurements are kept apart. The budget an engine is started with
(``--gpu-memory-utilization``) comes from the model's config alone: the estimate, ``memory_mb``
or the operator's own fraction, raised only after vLLM said the budget left no room for its KV
cache. What NVML measures an engine to hold is used for accounting (what a running or sleeping
instance holds, the overhead outside the budget, what a sleep leaves behind) and never fed back
into the budget: vLLM's KV cache fills whatever budget it is given, so a measurement fed back
would grow the budget at every restart.

vLLM measures memory device-wide while it profiles a start and while it sleeps, and fails when
another process freed (or, during a sleep, allocated) memory on the device meanwhile. So every
change an engine makes on its devices that the proxy orders — start, wake, sleep, stop — holds
that device's lock (`device_lock`) for as long as the change takes, in a `Use` that says what
may run beside it (`BESIDE`): a start alone only while its vLLM profiles the device (until its
log says so); a start told its KV cache size (the size a measured start of the same engine
found: `kv_bytes`), wakes and stops beside each other; sleeps beside sleeps and stops.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from ..config import Config, GpuDevice, ModelSpec
from ..engine_args import ArgValue
from ..errors import ConfigError
from ..metrics import Metrics
from .footprint import (
    Footprint,
    footprint_for_spec,
    host_runtime_mb,
    host_start_mb,
    host_weights_mb,
    reload_peak_mb,
    utilization_for,
)
from .gpu import GpuSnapshot, GpuSource, NvmlMonitor, StaticBudget
from .planner import Demand, DeviceView, never_fits

log = logging.getLogger(__name__)

#: How often `wait_free` re-reads the GPUs while waiting for a stopped engine's memory.
FREE_POLL_S = 0.2
#: How much a budget grows after vLLM found no room for the KV cache: a quarter, at least this.
KV_BOOST_MIN_MB = 512
#: Why a budget cannot be grown where the proxy does not pass --gpu-memory-utilization.
NOT_SIZED = (
    "the proxy does not size its budget here (no NVML); raise args.gpu_memory_utilization or"
    " lower max_model_len / max_num_seqs"
)
#: Headroom kept free on every NVML device unless `gpu.reserve_mb` says otherwise.
NVML_RESERVE_MB = 256
#: What a sleeping engine holds beyond its overhead when nothing was measured yet (CUDA graphs,
#: buffers outside the sleep allocator's pools).
SLEEP_GUESS_MB = 512


@dataclass(frozen=True)
class Usage:
    """One reading of an engine's devices: MiB used on each, MiB its own processes hold on each
    (empty where NVML does not report per process) and those processes."""

    used: dict[int, int]
    own: dict[int, int]
    pids: frozenset[int]


@dataclass(frozen=True)
class Placement:
    """Where an admitted engine runs and what it is given there."""

    devices: tuple[int, ...]
    footprint_mb: int
    overrides: dict[str, ArgValue] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


def source_kind(config: Config) -> str:
    """The kind of GPU source the config asks for on this host: "nvml", "static" or "none"
    (``gpu.monitor: auto`` resolved: NVML where a driver answers and the proxy was given GPUs,
    else a static budget where `gpu.devices` have sizes, else none)."""
    gpu = config.gpu
    sized = any(isinstance(d, GpuDevice) for d in ([] if gpu.devices == "all" else gpu.devices))
    mode = gpu.monitor
    if mode == "auto" and os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        mode = "static" if sized else "none"  # the proxy was given no GPU
    if mode == "auto":
        mode = "nvml" if NvmlMonitor.available() else ("static" if sized else "none")
    return mode


def engines_of(spec: ModelSpec) -> int:
    """The most engines a model runs at once: its replicas, an autoscaler's maximum, else 1."""
    if spec.autoscale is not None:
        return spec.autoscale.max_replicas
    return spec.replicas or 1


def all_fit(engines: list[tuple[int, int, tuple[int, ...] | None]], room: dict[int, int]) -> bool:
    """Whether every engine fits at once: each is (MiB per device, devices it spans, devices it
    may use or None for any), placed largest first on the devices with the most room left
    (first fit decreasing: a True is always right; a False may miss a packing that exists,
    which only keeps idle engines sleeping as they would anyway)."""
    left = dict(room)
    for mb, gpus, allowed in sorted(engines, key=lambda e: -e[0] * e[1]):
        fits = [d for d in (allowed or left) if d in left and left[d] >= mb]
        if len(fits) < gpus:
            return False
        for d in sorted(fits, key=lambda d: -left[d])[:gpus]:
            left[d] -= mb
    return True


def make_source(config: Config) -> tuple[GpuSource | None, str]:
    """The GPU source the config asks for, and its kind (`source_kind`)."""
    gpu = config.gpu
    listed: list[int | GpuDevice] = [] if gpu.devices == "all" else list(gpu.devices)
    ids = [d.id if isinstance(d, GpuDevice) else d for d in listed] or None
    sizes = {d.id: d.memory_mb for d in listed if isinstance(d, GpuDevice)}
    mode = source_kind(config)
    if mode == "none":
        return None, "none"
    if mode == "static":
        if not sizes or len(sizes) != len(listed):
            raise ConfigError("gpu.devices: the static monitor needs [{id: N, memory_mb: M}, ...]")
        return StaticBudget(sizes), "static"
    if not NvmlMonitor.available():
        raise ConfigError("gpu.monitor: nvml was requested but NVML does not answer (no driver?)")
    return _nvml_source(ids), "nvml"


def _nvml_source(ids: list[int] | None) -> NvmlMonitor:
    """The NVML monitor over the GPUs the proxy may use: `gpu.devices`, within what its own
    ``CUDA_VISIBLE_DEVICES`` shows (the engines are given NVML indices, so an inherited value is
    honoured by planning on those GPUs only). MIG GPUs are refused."""
    monitor = NvmlMonitor(devices=ids)
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is not None:
        order = os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
        try:
            visible = list(monitor.visible(inherited, order))
        except ValueError as err:
            raise ConfigError(f"CUDA_VISIBLE_DEVICES in the proxy's environment: {err}") from None
        if ids is not None and not set(ids) <= set(visible):
            raise ConfigError(
                f"gpu.devices: {ids} are not all among the GPUs the proxy's CUDA_VISIBLE_DEVICES"
                f" shows (NVML indices {visible})"
            )
        monitor = NvmlMonitor(devices=ids if ids is not None else visible, nvml=monitor._nvml)
    mig = [d for d in monitor.mig_devices() if monitor.devices is None or d in monitor.devices]
    if mig:
        raise ConfigError(
            f"GPU(s) {mig} are in MIG mode: NVML reports a MIG GPU's memory as the whole"
            " device's, so its slices cannot be planned; turn MIG off, or leave those GPUs out"
            " with gpu.devices"
        )
    return monitor


class Use(enum.Enum):
    """What the holder of a device's lock does to the device's memory; `BESIDE` says which
    uses may hold one device's lock at once."""

    #: A start whose vLLM measures the device's memory (from its first snapshot,
    #: ``v1/worker/gpu_worker.py:541``, to "Available KV cache memory", ``:772-775``): any
    #: other process's allocation shrinks its KV cache, any release fails it ("Error in
    #: memory profiling", ``:730-740``). Nothing runs beside it.
    MEASURE = "measure"
    #: A start told its KV cache size (``--kv-cache-memory-bytes``: "skipped memory
    #: profiling", ``gpu_worker.py:656-680``; its start-up check wants only
    #: ``gpu_memory_utilization x total`` free, ``v1/worker/utils.py:716-746``, which the
    #: claims guarantee), a start past its profiling, a wake (``wake_up`` checks nothing
    #: device-wide, ``gpu_worker.py:341-352``): they allocate.
    ALLOC = "alloc"
    #: A sleep: vLLM asserts that the device's free memory did not drop over it ("Memory
    #: usage increased after sleeping.", ``gpu_worker.py:301-334``), so nothing allocates
    #: beside it. Where the proxy measures what it leaves by the device's delta (no
    #: per-process NVML readings), `Memory.device_lock` takes it as MEASURE instead.
    SLEEP = "sleep"
    #: A stop: the proxy waits for the engine's own processes to leave NVML's list.
    STOP = "stop"


#: The uses that may hold one device's lock together (the relation is symmetric).
BESIDE: frozenset[frozenset[Use]] = frozenset(
    frozenset(pair)
    for pair in [
        (Use.ALLOC, Use.ALLOC),
        (Use.ALLOC, Use.STOP),
        (Use.SLEEP, Use.SLEEP),
        (Use.SLEEP, Use.STOP),
        (Use.STOP, Use.STOP),
    ]
)


def beside(a: Use, b: Use) -> bool:
    """Whether uses `a` and `b` may hold one device's lock at once (`BESIDE`)."""
    return frozenset((a, b)) in BESIDE


class StopPath(enum.Enum):
    """How an engine's stop deals with its devices' lock (`stop_path`), as (it takes the lock
    in `Use.STOP`, it waits until the driver has taken the engine's memory back)."""

    #: The engine has exited already: its memory went with it.
    EXITED = (False, False)
    #: Its own start, wake or sleep holds the lock and waits for the stop before it lets go.
    OWN_LOCK = (False, True)
    #: Under the lock, kept until the memory is back: memory given back while a neighbour
    #: profiles its start fails that start (vLLM's "Error in memory profiling"); beside wakes
    #: and other stops.
    UNDER_LOCK = (True, True)

    @property
    def locks(self) -> bool:
        """It takes its devices' lock itself."""
        return self.value[0]

    @property
    def waits(self) -> bool:
        """It reads the engine's memory before the stop and waits for it to come back."""
        return self.value[1]


def stop_path(exited: bool, holds_lock: bool) -> StopPath:
    """The stop of an engine that has `exited` or not, whose instance `holds_lock` (its
    devices' lock, for its own start, wake or sleep) or not."""
    if exited:
        return StopPath.EXITED
    return StopPath.OWN_LOCK if holds_lock else StopPath.UNDER_LOCK


class DeviceLock:
    """One device's lock, held in a `Use` (see `BESIDE` for which run together).

    Granted in order of arrival: a request goes once it may run beside every holder and beside
    every earlier request still waiting, so a start is not starved by a stream of wakes, and a
    stop need not wait behind a sleep. A holder may `relax` its use (a start whose profiling
    has ended: MEASURE to ALLOC). Devices are always taken in ascending order, so several
    engines on several devices cannot wait for each other in a circle."""

    def __init__(self) -> None:
        self._held: collections.Counter[Use] = collections.Counter()
        self._waiting: collections.deque[tuple[Use, asyncio.Future[None]]] = collections.deque()
        #: Grants so far: a holder alone from its grant to its release saw this move by none.
        self.grants = 0

    @property
    def holders(self) -> int:
        return sum(self._held.values())

    def held(self) -> dict[Use, int]:
        """The uses held now, with how many hold each."""
        return {u: n for u, n in self._held.items() if n}

    async def acquire(self, use: Use) -> None:
        if self._may_go(use, ()) and all(beside(use, u) for u, _ in self._waiting):
            self._take(use)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (use, fut)
        self._waiting.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(use)  # granted in the moment it was cancelled
            else:
                with contextlib.suppress(ValueError):
                    self._waiting.remove(entry)
                self._grant()  # what waited behind it may run now
            raise

    def release(self, use: Use) -> None:
        self._held[use] -= 1
        self._grant()

    def relax(self, old: Use, new: Use) -> None:
        """A holder's use becomes `new` (which must run beside no fewer uses than `old`)."""
        self._held[old] -= 1
        self._held[new] += 1
        self._grant()

    def _may_go(self, use: Use, earlier: Iterable[Use]) -> bool:
        held = [u for u, n in self._held.items() if n]
        return all(beside(use, u) for u in (*held, *earlier))

    def _take(self, use: Use) -> None:
        self._held[use] += 1
        self.grants += 1

    def _grant(self) -> None:
        earlier: list[Use] = []
        for entry in list(self._waiting):
            use, fut = entry
            if fut.done():
                self._waiting.remove(entry)
                continue
            if self._may_go(use, earlier):
                self._waiting.remove(entry)
                self._take(use)
                fut.set_result(None)
            else:
                earlier.append(use)


class Held:
    """A holder's grip on its devices' locks (`Memory.device_lock`): the use it holds them in,
    which a start whose profiling ended relaxes (`profiled`), and whether it held them alone."""

    def __init__(
        self,
        locks: list[DeviceLock],
        use: Use,
        learned: Callable[[int], None] = lambda _kv: None,
        failed: Callable[[], None] = lambda: None,
    ) -> None:
        self.locks = locks
        self.use = use
        #: The start measured this much KV cache (bytes) / the start failed (see `starting_on`).
        self.learned = learned
        self.failed = failed
        self._marks: list[int] | None = None

    def mark(self) -> None:
        """Called once every lock is held: from here `alone` watches for other holders."""
        alone = all(lock.holders == 1 for lock in self.locks)
        self._marks = [lock.grants for lock in self.locks] if alone else None

    def alone(self) -> bool:
        """Whether nobody else held these devices from the grant until now."""
        marks = self._marks
        if marks is None:
            return False
        pairs = zip(self.locks, marks, strict=True)
        return all(lock.grants == m and lock.holders == 1 for lock, m in pairs)

    def profiled(self) -> None:
        """The start's vLLM has measured its memory: allocations may run beside the rest."""
        if self.use is Use.MEASURE:
            for lock in self.locks:
                lock.relax(Use.MEASURE, Use.ALLOC)
            self.use = Use.ALLOC

    def release(self, lock: DeviceLock) -> None:
        lock.release(self.use)


class Memory:
    """Footprints, the GPU source and the device locks; one per proxy."""

    def __init__(
        self,
        source: GpuSource,
        kind: str,
        config: Config,
        specs: dict[str, ModelSpec],
        metrics: Metrics,
    ) -> None:
        self.source = source
        self.kind = kind
        reserve = config.gpu.reserve_mb
        self.reserve_mb = (
            reserve if reserve is not None else (NVML_RESERVE_MB if kind == "nvml" else 0)
        )
        self.context_mb = config.gpu.context_mb
        self.nccl_mb = config.gpu.nccl_mb
        self.free_timeout_s = config.gpu.free_timeout_s
        self.poll_interval_s = config.gpu.poll_interval_s
        self.metrics = metrics
        self._locks: dict[int, DeviceLock] = {}
        #: Whether starts are told the KV cache size a measured start found (`kv_bytes`): where
        #: the proxy sizes the budget (NVML), so that starts need not hold their devices alone.
        self.sizes_kv = kind == "nvml"
        #: Per model: (engine key, budget MiB, KV cache bytes) of its last measured start.
        self.kv_learned: dict[str, tuple[tuple[object, ...], int, int]] = {}
        self.snapshots = source.read()
        self.totals = {s.id: s.total_mb for s in self.snapshots}
        #: Device names where NVML gives them: vLLM's batch defaults depend on the device.
        self.names: dict[int, str] = source.names() if isinstance(source, NvmlMonitor) else {}
        #: Memory claimed by each placed instance (admitted and not yet down), by instance id.
        self.claims: dict[str, Placement] = {}
        #: Instances asleep (their /sleep call returned): what each still holds per device ...
        self.asleep: dict[str, int] = {}
        #: ... and the level each was put to sleep at, where known.
        self.slept_level: dict[str, int] = {}
        #: Device usage (NVML) when an instance began to allocate (a start under its device
        #: lock, a wake): what it has allocated since is the growth over this.
        self.baseline: dict[str, dict[int, int]] = {}
        #: Planned footprint per model name (a property of its spec).
        self.estimates: dict[str, Footprint] = {}
        #: What each live instance was measured to hold, by instance id.
        self.measured: dict[str, int] = {}
        #: Instances whose measurement comes from NVML per-process memory (else: device delta).
        self.by_process: set[str] = set()
        #: Per model, with the engine it was measured of: the largest overhead outside the budget
        #: seen (measured minus budget) and what its last sleep left on the device. The next
        #: instance of the same engine is accounted with them; neither changes its budget.
        self.overheads: dict[str, tuple[tuple[object, ...], int]] = {}
        self.residues: dict[str, tuple[tuple[object, ...], int]] = {}
        #: Budget added to a model whose engine found no room for its KV cache.
        self.boosts: dict[str, tuple[tuple[object, ...], int]] = {}
        #: Devices a model's env pins (``CUDA_VISIBLE_DEVICES``), as NVML indices.
        self.pinned_devices: dict[str, tuple[int, ...]] = {}
        self._keys: dict[str, tuple[object, ...]] = {}
        self._specs: dict[str, ModelSpec] = {}
        self.set_specs(specs)

    def set_specs(self, specs: dict[str, ModelSpec]) -> None:
        """Compute every model's footprint; `ConfigError` for one that can never fit."""
        problems = []
        estimates: dict[str, Footprint] = {}
        pinned: dict[str, tuple[int, ...]] = {}
        for name, spec in specs.items():
            try:
                devices = self._env_devices(spec)
            except ValueError as err:
                problems.append(f"models.{name}.env.CUDA_VISIBLE_DEVICES: {err}")
                continue
            allowed = [d for d in (devices or spec.devices or self.totals) if d in self.totals]
            smallest = min(allowed, key=lambda d: self.totals[d], default=None)
            total = self.totals[smallest] if smallest is not None else None
            device = self.names.get(smallest) if smallest is not None else None
            try:
                fp = footprint_for_spec(spec, total, spec.params_b, self.context_mb,
                                        self.nccl_mb, device)  # fmt: skip
            except (ValueError, OSError) as err:
                problems.append(f"models.{name}: cannot size its GPU memory: {err}")
                continue
            if fp.detail.get("batch_from") == "tight":
                log.info(
                    "%s: planned and started with %s sequences and %s batched tokens: at the"
                    " device's default batch vLLM's sampler would crowd its memory (set"
                    " args.max_num_seqs to choose)",
                    name, fp.detail["max_num_seqs"], fp.detail["activation_tokens"],
                )  # fmt: skip
            why = _reload_misfit(spec, fp)
            if why:
                problems.append(f"models.{name}.sleep.level: {why}")
                continue
            if self.kind == "nvml" and fp.budget_mb <= 0:
                problems.append(
                    f"models.{name}.memory_mb: {spec.memory_mb} MiB leaves no budget for vLLM"
                    f" after the {fp.overhead_mb} MiB the engine holds outside it (CUDA context"
                    " and libraries, gpu.context_mb); raise it"
                )
                continue
            if devices is not None:
                if spec.devices is not None and set(devices) != set(spec.devices):
                    problems.append(
                        f"models.{name}.devices: {list(spec.devices)} contradicts its env's"
                        f" CUDA_VISIBLE_DEVICES (GPUs {list(devices)}); keep one"
                    )
                    continue
                if len(devices) < fp.gpus:
                    problems.append(
                        f"models.{name}.env.CUDA_VISIBLE_DEVICES: shows {len(devices)} GPU(s)"
                        f" but the engine needs {fp.gpus} (parallel sizes)"
                    )
                    continue
                pinned[name] = devices[: fp.gpus]  # vLLM uses the first world-size ones
            estimates[name] = fp
            demand = Demand(name, fp.per_device_mb, fp.gpus, pinned.get(name) or spec.devices,
                            self.reserve_mb)  # fmt: skip
            why = never_fits(demand, self.totals)
            if why:
                problems.append(f"models.{name}: {why}")
        if problems:
            raise ConfigError("\n".join(problems))
        for name in set(self.estimates) - set(estimates):
            with contextlib.suppress(KeyError):
                self.metrics.memory_estimate.remove(name)
        self.estimates = estimates
        self.pinned_devices = pinned
        self._specs = dict(specs)
        self._keys = {name: spec.engine_key() for name, spec in specs.items()}
        for learned in (self.overheads, self.residues, self.boosts):
            for n, v in list(learned.items()):
                if self._keys.get(n) != v[0]:
                    del learned[n]
        for name, fp in self.estimates.items():
            self.metrics.memory_estimate.labels(name).set(fp.per_device_mb)

    def _env_devices(self, spec: ModelSpec) -> tuple[int, ...] | None:
        """The NVML indices a model's own ``CUDA_VISIBLE_DEVICES`` pins it to (None: not set,
        or no NVML devices to map them to)."""
        value = dict(spec.env).get("CUDA_VISIBLE_DEVICES")
        if value is None or self.kind != "nvml" or not isinstance(self.source, NvmlMonitor):
            return None
        order = dict(spec.env).get("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        return self.source.visible(value, order)

    def budget(self, name: str) -> int:
        """MiB per device inside vLLM's budget: from the config (and a KV boost) only."""
        boost = self.boosts.get(name)
        return self.estimates[name].budget_mb + (boost[1] if boost else 0)

    def overhead(self, name: str) -> int:
        """MiB per device outside the budget: the config's guess, or more where a measurement
        showed more. A measurement never lowers it: vLLM frees its transient peak after
        profiling and at every sleep and wake and takes it back on its first full batch, so an
        engine read below budget + overhead may only not have regrown yet."""
        learned = self.overheads.get(name)
        guess = self.estimates[name].overhead_mb
        return max(learned[1], guess) if learned is not None else guess

    def footprint(self, name: str) -> int:
        """What one engine of the model holds on each device: budget plus overhead."""
        return self.budget(name) + self.overhead(name)

    def sleep_mb(self, spec: ModelSpec) -> int:
        """What one engine of the model is expected to hold per device asleep: its last measured
        sleep, else ``sleep_memory_mb``, else the overhead plus `SLEEP_GUESS_MB`."""
        learned = self.residues.get(spec.name)
        if learned:
            return learned[1]
        if spec.sleep_memory_mb is not None:
            return spec.sleep_memory_mb
        return self.overhead(spec.name) + SLEEP_GUESS_MB if spec.name in self.estimates else 0

    def demand_mb(self, spec: ModelSpec) -> int:
        return self.footprint(spec.name)

    def devices_for(self, spec: ModelSpec) -> tuple[int, ...] | None:
        """The devices a model may be placed on (its env's or its config's), None for any."""
        return self.pinned_devices.get(spec.name) or spec.devices

    def demand(self, spec: ModelSpec, instance_id: str, avoid: tuple[int, ...] = ()) -> Demand:
        """What starting instance `instance_id` of `spec` asks of the planner; `avoid` are the
        devices of the model's other replicas."""
        fp = self.estimates[spec.name]
        mb = self.footprint(spec.name)
        allowed = self.devices_for(spec)
        return Demand(instance_id, mb, fp.gpus, allowed, self.reserve_mb, avoid)

    def grow_budget(self, spec: ModelSpec) -> str | None:
        """After vLLM found no room for the KV cache in the model's budget: raise the budget of
        an estimated footprint by a quarter (at least `KV_BOOST_MIN_MB`) for its next start and
        return None, or say why not (the operator set the size, or it would never fit)."""
        fp = self.estimates.get(spec.name)
        if fp is None or self.kind != "nvml":
            return NOT_SIZED
        if fp.source != "estimate":
            key = "memory_mb" if fp.source == "config" else "args.gpu_memory_utilization"
            return (
                f"its budget ({self.budget(spec.name)} MiB per GPU, from {key}) leaves no room for"
                " the KV cache after the weights, activations and CUDA graphs; raise " + key +
                " or lower max_model_len / max_num_seqs"
            )  # fmt: skip
        boost = self.boosts.get(spec.name, (spec.engine_key(), 0))[1]
        grown = boost + max(self.budget(spec.name) // 4, KV_BOOST_MIN_MB)
        demand = Demand(spec.name, fp.per_device_mb + grown, fp.gpus, self.devices_for(spec),
                        self.reserve_mb)  # fmt: skip
        if never_fits(demand, self.totals):
            return (
                f"its budget grew to {self.budget(spec.name)} MiB per GPU and vLLM still found no"
                " room for the KV cache; a larger one does not fit the GPUs: set memory_mb, or"
                " lower max_model_len / max_num_seqs"
            )
        self.boosts[spec.name] = (spec.engine_key(), grown)
        log.warning(
            "%s: no room for the KV cache in a %d MiB budget; the next start gets %d MiB",
            spec.name, self.budget(spec.name) - grown + boost, self.budget(spec.name),
        )  # fmt: skip
        self.metrics.memory_estimate.labels(spec.name).set(self.footprint(spec.name))
        return None

    async def read_fresh(self) -> list[GpuSnapshot]:
        """Snapshots read now (NVML in a worker thread; the refresher's copy if that fails):
        admission never plans on a reading that predates an engine's allocation."""
        if isinstance(self.source, NvmlMonitor):
            try:
                self.snapshots = await asyncio.to_thread(self.source.read)
            except Exception as err:  # pynvml's NVMLError, or a driver gone away
                log.warning("GPU read failed, planning on the last snapshot: %s", err)
                self.snapshots = self.source.latest or self.snapshots
            return self.snapshots
        return self.refresh()

    def held_mb(self, instance_id: str) -> int:
        """What a placed instance holds (or is promised) on each of its devices: asleep, what
        its sleep left; awake, its claim or what it was measured to hold, the larger. A running
        engine is never counted at what it holds now alone: vLLM reserves its transient peak
        inside the budget but frees it after profiling and at every sleep and wake, and takes
        it back on the first full batch (vLLM 0.33 ``utils/mem_utils.py:298-321``,
        ``device_allocator/cumem.py:297-298,342-343``)."""
        if instance_id in self.asleep:
            return self.asleep[instance_id]
        claim = self.claims[instance_id].footprint_mb
        measured = self.measured.get(instance_id)
        return claim if measured is None else max(claim, measured)

    def unrealised_mb(self, instance_id: str, pgid: int | None, device: int) -> int:
        """What an awake instance may still take on `device` beyond what it holds now (its
        transient peak, freed and not yet regrown): its claim less its processes' memory where
        NVML reports it per process, else less what it was measured to hold at its start (an
        upper bound: the engine may have regrown since)."""
        held = self.held_mb(instance_id)
        snap = next((s for s in self.snapshots if s.id == device), None)
        mine = _group_mb(snap, pgid) if snap is not None else 0
        if mine:
            return max(held - mine, 0)
        measured = self.measured.get(instance_id)
        return max(held - measured, 0) if measured is not None else 0

    def wake_need(self, instance_id: str) -> int:
        """What a sleeping instance adds per device when it wakes: the model's footprint (with
        the overhead measured so far) less what it still holds."""
        return max(self._awake_mb(instance_id) - self.held_mb(instance_id), 0)

    def _awake_mb(self, instance_id: str) -> int:
        """What the instance holds once awake: its model's footprint. A level-2 wake needs no
        reload buffer beyond it: the reload's temporaries sit where the KV cache will be, and
        the KV wake frees them first (`reload_peak_mb`)."""
        return self.footprint(_model_of(instance_id))

    def allocated_mb(self, instance_id: str, pgid: int | None, device: int) -> int:
        """How much of its claim an instance that is starting or waking has allocated on
        `device` so far: its processes' memory where NVML reports it per process, else the
        device's growth since it began (starts are serialised per device)."""
        snap = next((s for s in self.snapshots if s.id == device), None)
        if snap is None:
            return 0
        mine = _group_mb(snap, pgid)
        if mine:
            return mine
        base = self.baseline.get(instance_id, {}).get(device)
        return max(snap.used_mb - base, 0) if base is not None else 0

    def sleep_claim(self, instance_id: str, mb: int | None, level: int | None = None) -> None:
        """The instance's /sleep call returned (at `level`, when given): from now on its claim
        is `mb` per device (measured after the call), or the model's expected sleep memory when
        nothing could be measured. Also what a wake gives back when its memory did not come."""
        claim = self.claims.get(instance_id)
        if claim is None:
            return
        if level is not None:
            self.slept_level[instance_id] = level
        name = _model_of(instance_id)
        if mb is not None and name in self._keys:
            self.residues[name] = (self._keys[name], mb)
        spec = self._specs.get(name)
        expected = self.sleep_mb(spec) if spec is not None else 0
        held = min(mb if mb is not None else expected, claim.footprint_mb)
        self.asleep[instance_id] = held
        if isinstance(self.source, StaticBudget):
            self.source.set_usage(instance_id, claim.devices, held)

    def wake_claim(self, instance_id: str) -> None:
        """A wake was admitted: the instance claims its model's whole footprint again (measured
        anew once it runs)."""
        claim = self.claims.get(instance_id)
        self.asleep.pop(instance_id, None)
        if claim is None:
            return
        claim = dataclasses.replace(claim, footprint_mb=self._awake_mb(instance_id))
        self.claims[instance_id] = claim
        self.slept_level.pop(instance_id, None)
        self.measured.pop(instance_id, None)
        self.baseline[instance_id] = {s.id: s.used_mb for s in self.snapshots}
        if isinstance(self.source, StaticBudget):
            self.source.set_usage(instance_id, claim.devices, claim.footprint_mb)

    def refresh(self) -> list[GpuSnapshot]:
        """Current snapshots: static budgets are read now, NVML's come from the refresher."""
        if isinstance(self.source, NvmlMonitor):
            self.snapshots = self.source.latest or self.snapshots
        else:
            self.snapshots = self.source.read()
        return self.snapshots

    def device_views(self, pending: dict[int, int]) -> list[DeviceView]:
        """Each device for the planner, from the last read (`read_fresh` first).

        Free memory is the smaller of two readings: what the device reports free less what
        starting and waking instances have yet to allocate (`pending`), and the device total
        less everything the proxy's instances hold or were promised. The first sees other users
        of the GPU; the second sees an engine that has not allocated yet even when the device
        reading lags. A starting instance is never counted twice: `pending` is only its
        not-yet-allocated part.
        """
        claimed = self.claimed_by_device()
        views = []
        for s in self.snapshots:
            wait = pending.get(s.id, 0)
            used = max(s.used_mb, claimed.get(s.id, 0) - wait)
            views.append(DeviceView(s.id, s.total_mb, used, wait))
        return views

    def claimed_by_device(self) -> dict[int, int]:
        """What the proxy's instances hold or were promised, per device (MiB)."""
        claimed: dict[int, int] = {}
        for iid, claim in self.claims.items():
            for d in claim.devices:
                claimed[d] = claimed.get(d, 0) + self.held_mb(iid)
        return claimed

    def room_for_all(self) -> bool:
        """Whether an engine of every configured model (each of its replicas, an autoscaled
        model's most) fits awake at once on the managed devices, beside what programs other
        than the proxy's engines hold now (`all_fit`)."""
        claimed = self.claimed_by_device()
        room = {
            s.id: s.total_mb - self.reserve_mb - max(0, s.used_mb - claimed.get(s.id, 0))
            for s in self.refresh()  # NVML: the refresher's latest reading
        }
        engines = [
            (self.footprint(name), self.estimates[name].gpus, self.devices_for(spec))
            for name, spec in self._specs.items()
            if name in self.estimates
            for _ in range(engines_of(spec))
        ]
        return all_fit(engines, room)

    def placement(self, spec: ModelSpec, devices: tuple[int, ...]) -> Placement:
        """What the engine is started with on `devices`, and the memory it claims there.

        On NVML-managed GPUs the engine gets ``CUDA_VISIBLE_DEVICES`` (NVML indices in PCI bus
        order; a model whose env pins devices keeps its own, and is only ever placed on them)
        and, unless its args set a fraction themselves, ``--gpu-memory-utilization`` =
        budget / device total, rounded down: vLLM's budget never exceeds the planned one. The
        claim is the budget plus the overhead outside it.
        """
        mb = self.footprint(spec.name)
        overrides: dict[str, ArgValue] = {}
        env: dict[str, str] = {}
        if self.kind == "nvml":
            if "CUDA_VISIBLE_DEVICES" not in dict(spec.env):
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
            if "CUDA_DEVICE_ORDER" not in dict(spec.env):
                env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            est = self.estimates[spec.name]
            if est.source != "utilization":
                total = min(self.totals[d] for d in devices)
                overrides["gpu_memory_utilization"] = utilization_for(self.budget(spec.name), total)
            if est.source == "estimate":
                overrides |= _batch_overrides(spec, est)
        kv = self.kv_bytes(spec)
        if kv is not None:
            overrides["kv_cache_memory_bytes"] = kv
        return Placement(devices, mb, overrides, env)

    def claim(self, instance_id: str, placement: Placement) -> None:
        """Claim the placement's memory for the instance (replacing an earlier claim); the
        planner counts every claim, and the static budget's "used" is their sum. An asleep
        instance keeps holding only its sleep memory until it wakes."""
        self.claims[instance_id] = placement
        if isinstance(self.source, StaticBudget):
            mb = self.asleep.get(instance_id, placement.footprint_mb)
            self.source.set_usage(instance_id, placement.devices, mb)

    def release_claim(self, instance_id: str) -> None:
        """The instance is down (or its start gave its turn back): its claim and measurement
        go."""
        self.claims.pop(instance_id, None)
        self.asleep.pop(instance_id, None)
        self.slept_level.pop(instance_id, None)
        self.baseline.pop(instance_id, None)
        if isinstance(self.source, StaticBudget):
            self.source.clear_usage(instance_id)
        self.by_process.discard(instance_id)
        if self.measured.pop(instance_id, None) is not None:
            with contextlib.suppress(KeyError):
                self.metrics.memory_measured.remove(_model_of(instance_id), instance_id)

    def describe(self, spec: ModelSpec) -> dict[str, object]:
        """The model's planned footprint, for the admin view."""
        est = self.estimates.get(spec.name)
        if est is None:
            return {"estimate_mb": None, "planned_mb": None, "source": None}
        return {
            "estimate_mb": est.per_device_mb,
            "planned_mb": self.footprint(spec.name),
            "budget_mb": self.budget(spec.name),
            "overhead_mb": self.overhead(spec.name),
            "sleep_mb": self.sleep_mb(spec) if spec.sleep is not None else None,
            "gpus": est.gpus,
            "devices": list(self.devices_for(spec) or []) or None,
            "source": est.source,
            "detail": est.detail,
        }

    def describe_instance(self, instance_id: str) -> dict[str, object]:
        """What one instance was measured to hold, and how."""
        mb = self.measured.get(instance_id)
        how = "process" if instance_id in self.by_process else "device delta"
        return {
            "measured_mb": mb,
            "measured_from": how if mb is not None else None,
            "held_mb": self.held_mb(instance_id) if instance_id in self.claims else None,
            "asleep_mb": self.asleep.get(instance_id),
        }

    @contextlib.asynccontextmanager
    async def device_lock(
        self, devices: tuple[int, ...], use: Use, owner: str | None = None
    ) -> AsyncIterator[Held]:
        """The per-device locks, without a measurement, held in `use` by every memory change an
        engine makes there that the proxy orders (`Use`): a wake allocates, a sleep or a stop
        frees. A sleep of `owner` that the proxy can measure only by the device's delta (no
        per-process NVML readings) holds the devices alone. `starting_on` takes the same locks
        for a start."""
        if use is Use.SLEEP and self.kind == "nvml" and owner not in self.by_process:
            use = Use.MEASURE
        locks = [self._locks.setdefault(d, DeviceLock()) for d in sorted(devices)]
        held = Held(locks, use)
        async with contextlib.AsyncExitStack() as stack:
            for lock in locks:
                await lock.acquire(use)
                stack.callback(held.release, lock)
            held.mark()
            yield held

    @contextlib.asynccontextmanager
    async def starting_on(
        self, devices: tuple[int, ...], owner: str, sized: bool = False
    ) -> AsyncIterator[Held]:
        """The devices' locks for a start: alone (`Use.MEASURE`) while its vLLM profiles their
        memory, which `Held.profiled` ends; beside other allocations from the start when it is
        `sized` (told its KV cache size: vLLM skips the profiling).

        On NVML, the device memory taken while the start held the devices alone throughout (no
        other use granted meanwhile) is recorded as the owner's measured footprint, unless
        per-process readings give one.
        """
        async with self.device_lock(devices, Use.ALLOC if sized else Use.MEASURE) as held:
            held.learned = lambda kv: self.learn_kv(owner, kv)
            held.failed = lambda: self.forget_kv(owner)
            before = await self.usage(None, devices)
            if before is not None and before.used:
                self.baseline[owner] = before.used
            yield held
            after = await self.usage(None, devices)
            alone = held.alone()
            if before and after and before.used and owner not in self.by_process and alone:
                grown = [after.used[d] - before.used[d] for d in before.used if d in after.used]
                delta = max(grown, default=0)
                if delta > 0:
                    self._set_measured(owner, delta)

    def learn_kv(self, instance_id: str, kv_bytes: int) -> None:
        """A start of `instance_id` that measured its memory found room for `kv_bytes` of KV
        cache within its budget: later starts of the model with the same engine and budget are
        told that size (`placement`) and skip vLLM's profiling."""
        name = _model_of(instance_id)
        if self.sizes_kv and name in self._keys and kv_bytes > 0:
            self.kv_learned[name] = (self._keys[name], self.budget(name), kv_bytes)
            log.info("%s: %d MiB of KV cache measured; later starts are told it", instance_id,
                     kv_bytes // (1 << 20))  # fmt: skip

    def forget_kv(self, instance_id: str) -> None:
        """A start told its KV cache size failed: the model's next start measures again."""
        if self.kv_learned.pop(_model_of(instance_id), None) is not None:
            log.warning("%s: a start told its KV cache size failed; the next start measures it",
                        instance_id)  # fmt: skip

    def kv_bytes(self, spec: ModelSpec) -> int | None:
        """The KV cache size a start of `spec` is told, where its engine and budget are those a
        measured start found it for (None: it measures)."""
        if not self.sizes_kv or "kv_cache_memory_bytes" in _arg_names(spec):
            return None
        learned = self.kv_learned.get(spec.name)
        if learned is None or spec.name not in self._keys:
            return None
        key, budget, kv = learned
        if key != self._keys[spec.name] or budget != self.budget(spec.name):
            return None
        return kv

    def _set_measured(self, instance_id: str, mb: int) -> None:
        """Record what a running instance holds (accounting), and the overhead outside its
        budget that this shows; the budget itself never changes with it."""
        self.measured[instance_id] = mb
        name = _model_of(instance_id)
        if name in self._keys and name in self.estimates:
            overhead = max(mb - self.budget(name), 0)
            known = self.overheads.get(name)
            if known is None or known[0] != self._keys[name] or overhead > known[1]:
                self.overheads[name] = (self._keys[name], overhead)
        self.metrics.memory_measured.labels(name, instance_id).set(mb)

    async def usage(self, pgid: int | None, devices: tuple[int, ...]) -> Usage | None:
        """A fresh reading of `devices` and of what the engine (process group `pgid`) holds on
        them; None where there is no NVML."""
        if not isinstance(self.source, NvmlMonitor) or not devices:
            return None
        snaps = await self.read_fresh()
        used, own, pids = {}, {}, set()
        for snap in snaps:
            if snap.id not in devices:
                continue
            used[snap.id] = snap.used_mb
            mine = {pid: mb for pid, mb in snap.processes.items() if pgid and _pgid(pid) == pgid}
            if mine:
                own[snap.id] = sum(mine.values())
                pids |= set(mine)
        return Usage(used, own, frozenset(pids))

    def residue(self, instance_id: str, before: Usage | None, after: Usage | None) -> int | None:
        """What an instance still holds per device after its /sleep returned (the largest over
        its devices): its processes' memory where NVML reports it, else what it held less what
        the devices' usage dropped by (the sleep held the device lock). None: not measurable."""
        if before is None or after is None or instance_id not in self.claims:
            return None
        if after.own:
            return max(after.own.values())
        held = self.held_mb(instance_id)
        drops = [before.used[d] - after.used[d] for d in before.used if d in after.used]
        return max(held - min(drops), 0) if drops else None

    async def wait_released(self, before: Usage | None) -> bool:
        """After an engine stopped: poll until NVML lists none of its processes (the driver
        has taken their memory back), bounded by ``free_timeout_s``. True when nothing was to
        wait for or it came back."""
        if before is None or not before.pids or not isinstance(self.source, NvmlMonitor):
            return True
        deadline = time.monotonic() + self.free_timeout_s
        while True:
            snaps = await asyncio.to_thread(self.source.read)
            listed = {pid for s in snaps if s.id in before.used for pid in s.processes}
            if not listed & before.pids:
                return True
            if time.monotonic() > deadline:
                log.warning("processes %s still hold GPU memory after their engine stopped",
                            sorted(listed & before.pids))  # fmt: skip
                return False
            await asyncio.sleep(FREE_POLL_S)

    def weights_mb(self, spec: ModelSpec) -> int | None:
        """Host RAM a level-1 sleep of `spec` pins for its weights (`footprint.host_weights_mb`
        of its estimate)."""
        return host_weights_mb(spec, self.estimates.get(spec.name))

    def runtime_mb(self, spec: ModelSpec) -> int:
        """Host RAM a sleep of `spec` pins for its runtime pool (`footprint.host_runtime_mb`)."""
        return host_runtime_mb(self.estimates.get(spec.name))

    def start_host_mb(self, spec: ModelSpec) -> int:
        """Host RAM an engine of `spec` pins as it starts (`footprint.host_start_mb`)."""
        return host_start_mb(self.estimates.get(spec.name))

    async def wait_free(self, devices: tuple[int, ...], need_mb: int) -> bool:
        """After evictions: poll until `need_mb` (+ reserve) is free on every device, bounded."""
        if not isinstance(self.source, NvmlMonitor):
            return True
        deadline = time.monotonic() + self.free_timeout_s
        while True:
            snaps = {s.id: s for s in await asyncio.to_thread(self.source.read)}
            if all(snaps[d].free_mb >= need_mb + self.reserve_mb for d in devices):
                return True
            if time.monotonic() > deadline:
                log.warning(
                    "memory on GPU(s) %s not free after %.0fs", devices, self.free_timeout_s
                )
                return False
            await asyncio.sleep(FREE_POLL_S)

    def measure(self, groups: dict[str, tuple[int, float]], read_at: float | None = None) -> None:
        """Record what each running instance (id -> (process group, RUNNING since)) holds, from
        NVML per-process readings taken at `read_at` (monotonic; None: now).

        Per-process readings win over the device delta taken at start when the driver has them.
        A reading that began before the instance became RUNNING may show it mid-start or
        mid-wake, holding far less than it will: it is not a measurement of it.
        """
        if self.kind != "nvml":
            return
        for iid, (pgid, since) in groups.items():
            if read_at is not None and read_at < since:
                continue
            per_device = []
            for snap in self.snapshots:
                mb = _group_mb(snap, pgid)
                if mb:
                    per_device.append(mb)
            if per_device:
                self.by_process.add(iid)
                self._set_measured(iid, max(per_device))

    async def run(self, groups: Callable[[], dict[str, tuple[int, float]]]) -> None:
        """Keep NVML snapshots fresh (in a thread) and measure running engines."""
        if not isinstance(self.source, NvmlMonitor):
            return
        source = self.source
        refresher = asyncio.ensure_future(source.run(self.poll_interval_s))
        try:
            while True:
                await asyncio.sleep(self.poll_interval_s)
                self.snapshots = source.latest or self.snapshots
                self.measure(groups(), source.updated_at)
        finally:
            refresher.cancel()

    def update_metrics(self) -> None:
        for s in self.refresh():
            gid = str(s.id)
            self.metrics.gpu_total.labels(gid).set(s.total_mb)
            self.metrics.gpu_used.labels(gid).set(s.used_mb)
            if s.util_percent is not None:
                self.metrics.gpu_util.labels(gid).set(s.util_percent)

    def close(self) -> None:
        if isinstance(self.source, NvmlMonitor):
            self.source.close()


def _reload_misfit(spec: ModelSpec, fp: Footprint) -> str | None:
    """Why a level-2 sleep policy cannot wake in its footprint: the reload's largest buffer
    does not fit in the room its KV cache will take (None: it fits, or the KV size is unknown)."""
    if spec.sleep is None or spec.sleep.level != 2:
        return None
    kv = fp.detail.get("kv_cache_mb")
    if not isinstance(kv, int):
        return None
    act = fp.detail.get("activations_mb")
    room = kv + (act if isinstance(act, int) else 0)
    peak = reload_peak_mb(spec)
    if peak <= room:
        return None
    return (
        f"a level-2 wake reloads the weights before the KV cache is mapped, in its room: the"
        f" largest module ({peak} MiB per GPU: a MoE layer holds all of its experts) does not"
        f" fit in the {room} MiB planned for the KV cache and the transient peak; use level 1,"
        " or a longer max_model_len / memory_mb"
    )


def _batch_overrides(spec: ModelSpec, est: Footprint) -> dict[str, ArgValue]:
    """The batch an estimate was made for, where the model's args leave it to vLLM: the
    sampler's state and passes, the activations and the KV sizing assume it, so vLLM must
    agree whatever device it believes it runs on, in ``performance_mode: throughput`` (which
    doubles vLLM's defaults, ``engine/arg_utils.py:3184-3188``) and where the estimate chose a
    smaller batch than the device's default (``detail["batch_from"] == "tight"``). A pooling
    model keeps vLLM's own token budget (without chunked prefill it is at least its length),
    and so does a multimodal one (vLLM raises it to hold one item of a prefix-LM model,
    ``:3201-3218``, but never a budget it was given)."""
    names = _arg_names(spec)
    out: dict[str, ArgValue] = {}
    if "max_num_seqs" not in names:
        out["max_num_seqs"] = int(est.detail["max_num_seqs"])
    own = spec.pooling or est.detail.get("multimodal")
    if "max_num_batched_tokens" not in names and not own:
        out["max_num_batched_tokens"] = int(est.detail["activation_tokens"])
    return out


def _arg_names(spec: ModelSpec) -> set[str]:
    return {k.replace("-", "_") for k, _ in spec.args}


def same_engine(a: Placement, b: Placement) -> bool:
    """Whether engines started with placements `a` and `b` are the same engine: the same
    devices' environment and the same overrides, but for a KV cache size learned from a measured
    start (which its budget gave that engine anyway)."""
    learned = "kv_cache_memory_bytes"
    first = {k: v for k, v in a.overrides.items() if k != learned}
    second = {k: v for k, v in b.overrides.items() if k != learned}
    return (first, a.env) == (second, b.env)


def sized(spec: ModelSpec, placement: Placement | None) -> bool:
    """Whether a start is told its KV cache size (by its args or its placement): its vLLM then
    skips profiling the device's memory (``v1/worker/gpu_worker.py:656-680``)."""
    given = placement.overrides if placement is not None else {}
    return "kv_cache_memory_bytes" in _arg_names(spec) or "kv_cache_memory_bytes" in given


def _model_of(instance_id: str) -> str:
    return instance_id.rpartition("#")[0]


def _group_mb(snap: GpuSnapshot, pgid: int | None) -> int:
    """MiB the processes of group `pgid` hold on the snapshot's device (0: none listed)."""
    if pgid is None:
        return 0
    return sum(mb for pid, mb in snap.processes.items() if _pgid(pid) == pgid)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None
