"""GPU memory as the admission path sees it: the source, footprints, placements, device locks.

`Memory` answers "how much does this model take", "what is used where now" and "where may it go";
the decision itself is `scheduler.plan()` (pure). The manager drives admission with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from .config import ArgValue, Config, GpuDevice, ModelSpec
from .errors import ConfigError
from .footprint import Footprint, footprint_for_spec, utilization_for
from .gpu import GpuSnapshot, GpuSource, NvmlMonitor, StaticBudget
from .metrics import Metrics
from .scheduler import Demand, DeviceView, never_fits

log = logging.getLogger(__name__)

#: How often `wait_free` re-reads the GPUs while waiting for a stopped engine's memory.
FREE_POLL_S = 0.2
#: vLLM's log lines for a start that ran out of device memory.
OOM_MARKERS = ("out of memory", "OutOfMemoryError", "Free memory on device", "less than desired")


@dataclass(frozen=True)
class Placement:
    """Where an admitted engine runs and what it is given there."""

    devices: tuple[int, ...]
    footprint_mb: int
    overrides: dict[str, ArgValue] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


def make_source(config: Config) -> tuple[GpuSource | None, str]:
    """The GPU source the config asks for, and its kind ("nvml", "static" or "none")."""
    gpu = config.gpu
    listed: list[int | GpuDevice] = [] if gpu.devices == "all" else list(gpu.devices)
    ids = [d.id if isinstance(d, GpuDevice) else d for d in listed] or None
    sizes = {d.id: d.memory_mb for d in listed if isinstance(d, GpuDevice)}
    mode = gpu.monitor
    if mode == "auto":
        mode = "nvml" if NvmlMonitor.available() else ("static" if sizes else "none")
    if mode == "none":
        return None, "none"
    if mode == "static":
        if not sizes or len(sizes) != len(listed):
            raise ConfigError("gpu.devices: the static monitor needs [{id: N, memory_mb: M}, ...]")
        return StaticBudget(sizes), "static"
    if not NvmlMonitor.available():
        raise ConfigError("gpu.monitor: nvml was requested but NVML does not answer (no driver?)")
    return NvmlMonitor(devices=ids), "nvml"


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
        self.reserve_mb = config.gpu.reserve_mb
        self.free_timeout_s = config.gpu.free_timeout_s
        self.poll_interval_s = config.gpu.poll_interval_s
        self.metrics = metrics
        self._locks: dict[int, asyncio.Lock] = {}
        self.snapshots = source.read()
        self.totals = {s.id: s.total_mb for s in self.snapshots}
        #: Memory claimed by each placed instance (admitted and not yet down), by instance id.
        self.claims: dict[str, Placement] = {}
        #: Instances asleep (their /sleep call returned): what each still holds per device.
        self.asleep: dict[str, int] = {}
        #: Device usage (NVML) when an instance began to allocate (a start under its device
        #: lock, a wake): what it has allocated since is the growth over this.
        self.baseline: dict[str, dict[int, int]] = {}
        #: Planned footprint per model name (a property of its spec).
        self.estimates: dict[str, Footprint] = {}
        #: What each live instance was measured to hold, by instance id.
        self.measured: dict[str, int] = {}
        #: Instances whose measurement comes from NVML per-process memory (else: device delta).
        self.by_process: set[str] = set()
        #: The last measurement of a model's engine, with the engine it was taken of: the next
        #: instance of the same engine is planned with it.
        self.learned: dict[str, tuple[tuple[object, ...], int]] = {}
        self._keys: dict[str, tuple[object, ...]] = {}
        self.set_specs(specs)

    def set_specs(self, specs: dict[str, ModelSpec]) -> None:
        """Compute every model's footprint; `ConfigError` for one that can never fit."""
        problems = []
        estimates: dict[str, Footprint] = {}
        for name, spec in specs.items():
            allowed = [d for d in (spec.devices or self.totals) if d in self.totals]
            total = min((self.totals[d] for d in allowed), default=None)
            try:
                fp = footprint_for_spec(spec, total, spec.params_b)
            except (ValueError, OSError) as err:
                problems.append(f"models.{name}: cannot size its GPU memory: {err}")
                continue
            estimates[name] = fp
            demand = Demand(name, fp.per_device_mb, fp.tp, spec.devices, self.reserve_mb)
            why = never_fits(demand, self.totals)
            if why:
                problems.append(f"models.{name}: {why}")
        if problems:
            raise ConfigError("\n".join(problems))
        for name in set(self.estimates) - set(estimates):
            with contextlib.suppress(KeyError):
                self.metrics.memory_estimate.remove(name)
        self.estimates = estimates
        self._keys = {name: spec.engine_key() for name, spec in specs.items()}
        self.learned = {n: v for n, v in self.learned.items() if self._keys.get(n) == v[0]}
        for name, fp in self.estimates.items():
            self.metrics.memory_estimate.labels(name).set(fp.per_device_mb)

    def footprint(self, name: str) -> int:
        """The larger of the estimate and what the model's engine was last measured to take."""
        learned = self.learned.get(name)
        return max(self.estimates[name].per_device_mb, learned[1] if learned else 0)

    def demand_mb(self, spec: ModelSpec) -> int:
        return self.footprint(spec.name)

    def demand(self, spec: ModelSpec, instance_id: str, avoid: tuple[int, ...] = ()) -> Demand:
        """What starting instance `instance_id` of `spec` asks of the planner; `avoid` are the
        devices of the model's other replicas."""
        fp = self.estimates[spec.name]
        mb = self.footprint(spec.name)
        return Demand(instance_id, mb, fp.tp, spec.devices, self.reserve_mb, avoid)

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
        """What a placed instance holds (or is promised) on each of its devices."""
        if instance_id in self.asleep:
            return self.asleep[instance_id]
        claim = self.claims[instance_id]
        return max(claim.footprint_mb, self.measured.get(instance_id, 0))

    def allocated_mb(self, instance_id: str, pgid: int | None, device: int) -> int:
        """How much of its claim an instance that is starting or waking has allocated on
        `device` so far: its processes' memory where NVML reports it per process, else the
        device's growth since it began (starts are serialised per device)."""
        snap = next((s for s in self.snapshots if s.id == device), None)
        if snap is None:
            return 0
        if pgid is not None and snap.processes:
            mine = sum(mb for pid, mb in snap.processes.items() if _pgid(pid) == pgid)
            if mine:
                return mine
        base = self.baseline.get(instance_id, {}).get(device)
        return max(snap.used_mb - base, 0) if base is not None else 0

    def doze(self, instance_id: str, mb: int) -> None:
        """The instance is asleep: from now on it holds only `mb` per device."""
        claim = self.claims.get(instance_id)
        if claim is None:
            return
        held = min(mb, claim.footprint_mb)
        self.asleep[instance_id] = held
        if isinstance(self.source, StaticBudget):
            self.source.set_usage(instance_id, claim.devices, held)

    def rouse(self, instance_id: str) -> None:
        """A wake was admitted: the instance claims its whole footprint again."""
        claim = self.claims.get(instance_id)
        self.asleep.pop(instance_id, None)
        if claim is None:
            return
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
        claimed: dict[int, int] = {}
        for iid, claim in self.claims.items():
            for d in claim.devices:
                claimed[d] = claimed.get(d, 0) + self.held_mb(iid)
        views = []
        for s in self.snapshots:
            wait = pending.get(s.id, 0)
            used = max(s.used_mb, claimed.get(s.id, 0) - wait)
            views.append(DeviceView(s.id, s.total_mb, used, wait))
        return views

    def placement(self, spec: ModelSpec, devices: tuple[int, ...]) -> Placement:
        """What the engine is started with on `devices`.

        On NVML-managed GPUs the engine gets ``CUDA_VISIBLE_DEVICES`` (unless its env sets one)
        and, unless its args set one, ``--gpu-memory-utilization`` = footprint / device total,
        so that vLLM stays inside the share the planner gave it.
        """
        mb = self.footprint(spec.name)
        overrides: dict[str, ArgValue] = {}
        env: dict[str, str] = {}
        if self.kind == "nvml":
            if "CUDA_VISIBLE_DEVICES" not in dict(spec.env):
                env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
            if self.estimates[spec.name].source != "utilization":
                total = min(self.totals[d] for d in devices)
                overrides["gpu_memory_utilization"] = utilization_for(mb, total)
        return Placement(devices, mb, overrides, env)

    def occupy(self, instance_id: str, placement: Placement) -> None:
        """Claim the placement's memory for the instance (replacing an earlier claim); the
        planner counts every claim, and the static budget's "used" is their sum. An asleep
        instance keeps holding only its sleep memory until it wakes."""
        self.claims[instance_id] = placement
        if isinstance(self.source, StaticBudget):
            mb = self.asleep.get(instance_id, placement.footprint_mb)
            self.source.set_usage(instance_id, placement.devices, mb)

    def vacate(self, instance_id: str) -> None:
        """The instance is down: its claim and measurement go."""
        self.claims.pop(instance_id, None)
        self.asleep.pop(instance_id, None)
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
    async def device_lock(self, devices: tuple[int, ...]) -> AsyncIterator[None]:
        """The per-device start locks, without a measurement: a wake reallocates its memory and
        must not overlap another engine's start (and its memory profiling) on those devices."""
        locks = [self._locks.setdefault(d, asyncio.Lock()) for d in sorted(devices)]
        async with contextlib.AsyncExitStack() as stack:
            for lock in locks:
                await stack.enter_async_context(lock)
            yield

    @contextlib.asynccontextmanager
    async def starting_on(self, devices: tuple[int, ...], owner: str) -> AsyncIterator[None]:
        """Serialise engine starts per device (two vLLMs profiling one GPU at once both fail).

        On NVML, the device memory taken while the lock was held (a start that succeeded) is
        recorded as the owner's measured footprint, unless per-process readings give one: no
        other start can have run on those devices in between.
        """
        locks = [self._locks.setdefault(d, asyncio.Lock()) for d in sorted(devices)]
        async with contextlib.AsyncExitStack() as stack:
            for lock in locks:
                await stack.enter_async_context(lock)
            before = await self._used(devices)
            if before:
                self.baseline[owner] = before
            yield
            after = await self._used(devices)
            if before and after and owner not in self.by_process:
                delta = max(after[d] - before[d] for d in devices)
                if delta > 0:
                    self._set_measured(owner, delta)

    async def _used(self, devices: tuple[int, ...]) -> dict[int, int] | None:
        if not isinstance(self.source, NvmlMonitor) or not devices:
            return None
        snaps = {s.id: s.used_mb for s in await asyncio.to_thread(self.source.read)}
        return {d: snaps[d] for d in devices if d in snaps} if snaps else None

    def _set_measured(self, instance_id: str, mb: int) -> None:
        self.measured[instance_id] = mb
        name = _model_of(instance_id)
        if name in self._keys:
            self.learned[name] = (self._keys[name], mb)
        self.metrics.memory_measured.labels(name, instance_id).set(mb)

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

    def measure(self, groups: dict[str, int]) -> None:
        """Record what each running instance (id -> process group) holds, from NVML per-process.

        Per-process readings win over the device delta taken at start when the driver has them.
        """
        if self.kind != "nvml":
            return
        for iid, pgid in groups.items():
            per_device = []
            for snap in self.snapshots:
                mb = sum(m for pid, m in snap.processes.items() if _pgid(pid) == pgid)
                if mb:
                    per_device.append(mb)
            if per_device:
                self.by_process.add(iid)
                self._set_measured(iid, max(per_device))

    async def run(self, groups: Callable[[], dict[str, int]]) -> None:
        """Keep NVML snapshots fresh (in a thread) and measure running engines."""
        if not isinstance(self.source, NvmlMonitor):
            return
        source = self.source
        refresher = asyncio.ensure_future(source.run(self.poll_interval_s))
        try:
            while True:
                await asyncio.sleep(self.poll_interval_s)
                self.snapshots = source.latest or self.snapshots
                self.measure(groups())
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


def _model_of(instance_id: str) -> str:
    return instance_id.rpartition("#")[0]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None
