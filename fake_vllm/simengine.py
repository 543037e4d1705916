"""Simulated-GPU mode of the fake engine: vLLM 0.33's memory behaviour played on a ledger.

``FAKE_ENGINE_SIM_GPU=<ledger>`` turns it on. The rules and their vLLM sources are listed in
``simgpu``'s docstring. Every method blocks (it waits through the windows vLLM measures across),
so the engine calls them from a worker thread; start-up runs before the port is bound.

Memory is held under vLLM's CuMem tags: ``context`` (outside the budget, never released),
``weights``, ``runtime`` (the activation peak), ``cudagraph``, ``kv_cache``, and ``reload_temp``
(what torch keeps cached after a ``reload_weights``). It is charged to the ``owner`` pid: the
engine itself, or its EngineCore child with ``FAKE_ENGINE_SPAWN_CHILD=1``, the process NVML
shows for vLLM.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable

from .gpu import MIB, GpuError
from .log import log
from .settings import Settings, SimKnobs
from .simgpu import DeviceSpec, Ledger, SimOutOfMemory, ceil_mb

GROUPS = {"weights": ("weights", "runtime", "cudagraph"), "kv_cache": ("kv_cache",)}
"""What ``/wake_up?tags=X`` brings back: the runtime pool (and pooled graphs) come with weights."""


class SimStartError(Exception):
    """A start vLLM would abort; ``str()`` is vLLM's error line, exception type included."""


class SimGpu:
    """The memory of one engine on its simulated devices, moved by start, sleep, wake, reload."""

    def __init__(self, settings: Settings, owner: int) -> None:
        assert settings.sim is not None
        self.settings = settings
        self.knobs: SimKnobs = settings.sim
        self.owner = owner
        try:
            self.ledger = Ledger(self.knobs.ledger)
        except FileNotFoundError:
            raise SimStartError(
                "RuntimeError: No CUDA GPUs are available "
                f"(fake: no simulated-GPU ledger at {self.knobs.ledger})"
            ) from None
        self.devices: list[int] = []
        self.sizes: dict[str, int] = {}
        self.asleep: set[str] = set()
        self.temp_held = False

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Create contexts, check free memory, profile, then size and allocate the KV cache."""
        self.devices = self._choose_devices()
        for device in self.devices:
            self._allocate_at_start(device, self.knobs.context_mb, "context")
        requested = {d: self._check_free(rank, d) for rank, d in enumerate(self.devices)}
        consumed = self._profile()
        kv_mb = self._kv_size(requested, consumed)
        for device in self.devices:
            self._allocate_at_start(device, kv_mb, "kv_cache")
        self.sizes["kv_cache"] = kv_mb
        log(f"Available KV cache memory: {kv_mb / 1024:.2f} GiB")

    def _choose_devices(self) -> list[int]:
        """The first world-size devices of ``CUDA_VISIBLE_DEVICES`` (ledger indices or UUIDs)."""
        visible = visible_devices(self.settings.cuda_visible_devices, self.ledger.devices())
        world = self.settings.world_size
        if len(visible) < world:
            raise SimStartError(
                f"ValueError: World size ({world}) is larger than the number of available GPUs "
                f"({len(visible)}) in this node. If this is intentional and you are using: "
                "- ray, set '--distributed-executor-backend ray'. "
                "- multiprocessing, set '--nnodes' appropriately."
            )
        return visible[:world]

    def _check_free(self, rank: int, device: int) -> int:
        """vLLM's ``request_memory``: free memory after the context must hold util x total."""
        reading = self.ledger.read()[device]
        util = self.settings.gpu_memory_utilization
        requested = math.ceil(util * reading.total_mb)
        if reading.free_mb < requested:
            raise SimStartError(
                f"ValueError: Free memory on device cuda:{rank} ({reading.free_mb / 1024:.2f}/"
                f"{reading.total_mb / 1024:.2f} GiB) on startup is less than desired GPU memory "
                f"utilization ({util}, {requested / 1024:.2f} GiB). Decrease GPU memory "
                "utilization or reduce GPU memory used by other processes."
            )
        return requested

    def _profile(self) -> dict[int, int]:
        """Load weights, run the profile and estimate graphs; MiB consumed, device-wide."""
        before = self._free()
        knobs = self.knobs
        for tag, mb in (
            ("weights", knobs.weights_mb),
            ("runtime", knobs.activation_mb),
            ("cudagraph", knobs.graphs_mb),
        ):
            for device in self.devices:
                self._allocate_at_start(device, mb, tag)
            self.sizes[tag] = mb
            if tag == "weights":
                log(f"Model loading took {mb / 1024:.4f} GiB memory (simulated)")
        time.sleep(knobs.profile_s)
        after = self._free()
        for device in self.devices:
            if after[device] > before[device]:
                raise SimStartError(
                    "AssertionError: Error in memory profiling. Initial free memory "
                    f"{before[device] / 1024:.2f} GiB, current free memory "
                    f"{after[device] / 1024:.2f} GiB. This happens when other processes sharing "
                    "the same container release GPU memory while vLLM is profiling during "
                    "initialization. To fix this, ensure consistent GPU memory allocation or "
                    "isolate vLLM in its own container."
                )
        return {d: before[d] - after[d] for d in self.devices}

    def _kv_size(self, requested: dict[int, int], consumed: dict[int, int]) -> int:
        """KV MiB per device: ``--kv-cache-memory-bytes``, else the smallest budget left."""
        if self.settings.kv_cache_memory_bytes is not None:
            kv_mb = ceil_mb(self.settings.kv_cache_memory_bytes)
        else:
            kv_mb = min(requested[d] - consumed[d] for d in self.devices)
        if kv_mb < self.knobs.min_kv_mb:
            raise SimStartError(
                "ValueError: No available memory for the cache blocks. Try increasing "
                "`gpu_memory_utilization` when initializing the engine."
            )
        return kv_mb

    def _allocate_at_start(self, device: int, mb: int, tag: str) -> None:
        try:
            self.ledger.allocate(self.owner, device, mb, tag)
        except SimOutOfMemory as exc:
            raise SimStartError(f"torch.OutOfMemoryError: {exc}") from None

    def _free(self) -> dict[int, int]:
        readings = self.ledger.read()
        return {d: readings[d].free_mb for d in self.devices}

    # ------------------------------------------------------------------ sleep / wake / reload

    def held_bytes(self) -> int:
        return sum(self.ledger.held(self.owner).values()) * MIB

    def asleep_tags(self) -> set[str]:
        return {group for group, tags in GROUPS.items() if tags[0] in self.asleep}

    def sleep(self, level: int, offload: bool = True) -> None:
        """vLLM's ``Worker.sleep``: offload and discard (only with ``offload``), then assert
        that device-wide free memory did not shrink and log what was freed."""
        if level == 0 or self.asleep:
            return  # vLLM's executor ignores a sleep while it already sleeps
        before = self._free()
        for device in self.devices:
            self.ledger.mark(self.owner, device, "sleep_begin")
        time.sleep(self.knobs.sleep_s)
        if offload:
            self._offload(level)
        after = self._free()
        if any(after[d] < before[d] for d in self.devices):
            message = "AssertionError: Memory usage increased after sleeping."
            log(message, "ERROR", sys.stderr)
            raise GpuError(message)
        readings = self.ledger.read()
        for device in self.devices:
            freed = (after[device] - before[device]) / 1024
            used = readings[device].used_mb / 1024
            log(f"Sleep mode freed {freed:.2f} GiB memory, {used:.2f} GiB memory is still in use.")

    def _offload(self, level: int) -> None:
        """Pin the offloaded tags to host memory, then release every pooled tag and torch's
        cache (``CuMemAllocator.sleep`` ends with ``empty_cache``)."""
        keep = ["weights", "runtime"] if level == 1 else ["runtime"]
        drop = ["weights", "runtime", "kv_cache"]
        if self.settings.sleep_mode_offload_cudagraph:
            drop.append("cudagraph")
            if level == 1:
                keep.append("cudagraph")
        pinned: list[str] = []
        try:
            for tag in keep:
                self.ledger.pin(self.owner, self.sizes[tag] * len(self.devices), tag)
                pinned.append(tag)
        except SimOutOfMemory as exc:
            for tag in pinned:
                self.ledger.unpin(self.owner, tag)
            raise GpuError(str(exc)) from None
        for device in self.devices:
            for tag in drop:
                self.ledger.free(self.owner, device, tag)
            self.ledger.free(self.owner, device, "reload_temp")
        self.temp_held = False
        self.asleep.update(drop)

    def wake(self, tags: Iterable[str]) -> None:
        """Map the woken tags back, all or none (``CuMemAllocator.wake_up`` rolls back);
        offloaded ones come back from their pinned host copy."""
        waking = [t for group in tags for t in GROUPS[group] if t in self.asleep]
        mapped: list[tuple[int, str]] = []
        try:
            for tag in waking:
                for device in self.devices:
                    self.ledger.allocate(self.owner, device, self.sizes[tag], tag)
                    mapped.append((device, tag))
        except SimOutOfMemory as exc:
            for device, tag in mapped:
                self.ledger.free(self.owner, device, tag, self.sizes[tag])
            log(f"Failed to wake up allocator: {exc}", "ERROR", sys.stderr)
            raise GpuError(str(exc)) from None
        for tag in waking:
            self.asleep.discard(tag)
            self.ledger.unpin(self.owner, tag)

    def reload(self) -> None:
        """Re-read the checkpoint: a transient per-module allocation on top of what is mapped,
        which torch keeps cached afterwards, and weights / rate seconds of reading."""
        temp = self.knobs.reload_temp_mb
        if temp and not self.temp_held:
            for device in self.devices:
                try:
                    self.ledger.allocate(self.owner, device, temp, "reload_temp")
                except SimOutOfMemory as exc:
                    raise GpuError(str(exc)) from None
            self.temp_held = True
        time.sleep(self.sizes.get("weights", 0) / self.knobs.reload_mb_s)
        if not self.knobs.reload_temp_cached and self.temp_held:
            for device in self.devices:
                self.ledger.free(self.owner, device, "reload_temp")
            self.temp_held = False

    def release(self) -> None:
        """Give everything back, as the driver does when the engine's process exits."""
        self.ledger.release(self.owner)


def visible_devices(raw: str | None, devices: list[DeviceSpec]) -> list[int]:
    """Ledger indices CUDA would show for ``CUDA_VISIBLE_DEVICES`` (None: all, in order).

    Entries are indices or UUID prefixes; as in CUDA, an unknown or repeated entry hides itself
    and every entry after it.
    """
    if raw is None:
        return [d.index for d in devices]
    out: list[int] = []
    for item in (part.strip() for part in raw.split(",")):
        index = _lookup(item, devices)
        if index is None or index in out:
            break
        out.append(index)
    return out


def _lookup(item: str, devices: list[DeviceSpec]) -> int | None:
    if item.isdigit():
        return int(item) if int(item) < len(devices) else None
    if item.startswith(("GPU-", "MIG-")):
        matches = [d.index for d in devices if d.uuid.startswith(item)]
        return matches[0] if len(matches) == 1 else None
    return None
