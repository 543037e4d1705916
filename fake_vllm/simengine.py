"""Simulated-GPU mode of the fake engine: vLLM 0.33's memory behaviour played on a ledger.

``FAKE_ENGINE_SIM_GPU=<ledger>`` turns it on. The rules and their vLLM sources are listed in
``simgpu``'s docstring. Every method that touches the ledger blocks (it waits through the
windows vLLM measures across), so the engine calls them from a worker thread; start-up runs
before the port is bound.

Memory is held in the ledger under these tags:

* ``context``: CUDA context, cuBLAS, NCCL; outside the budget, never released;
* CuMem pool allocations, released by a sleep: ``weights`` (one allocation per torch segment of
  the weights' tensors and V2's sampler state), ``runtime`` (the model runner's persistent
  state and LoRA slots), ``workspace`` (scratch, discarded), ``cudagraph`` (pooled only with
  ``--sleep-mode-offload-cudagraph``, else outside the pool and never released) and
  ``kv_cache``;
* torch's caching allocator, emptied by every sleep and wake: ``activation`` (the transient
  peak of a full batch) and ``reload_temp`` (what ``reload_weights`` materialises).

It is charged to the ``owner`` pid: the engine itself, or its EngineCore child with
``FAKE_ENGINE_SPAWN_CHILD=1``, the process NVML shows for vLLM.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from .gpu import MIB, GpuError
from .log import log
from .settings import Settings, SimKnobs
from .simgpu import PAGEABLE, DeviceSpec, Ledger, SimOutOfMemory, ceil_mb

DEFERRABLE = ("weights", "kv_cache")
"""Tags a ``/wake_up?tags=`` may leave asleep; every other pooled tag comes back with any wake
(``device_allocator/__init__.py:17``, ``device_allocator/cumem.py:348``)."""

TORCH_CACHE = ("activation", "reload_temp")
"""Tags held in torch's caching allocator, outside the CuMem pools."""

ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered"


class SimStartError(Exception):
    """A start vLLM would abort; ``str()`` is vLLM's error line, exception type included."""


class MemoryLost(GpuError):
    """A sleep failed after the allocator had unmapped memory: the executor still believes it
    is awake (``v1/executor/abstract.py:400-407`` sets ``sleeping_tags`` only on success)."""


class EngineFault(Exception):
    """A fatal error in the engine's forward pass; ``str()`` is the exception line vLLM's
    EngineCore logs before it dies."""


@dataclass
class Allocation:
    """One CuMem allocation on one device, and the pinned host block backing it while asleep."""

    device: int
    tag: str
    mb: int
    asleep: bool = False
    backup_mb: int = 0


def pinned_size(mb: int) -> int:
    """The host block torch's CachingHostAllocator pins for ``mb`` MiB: the next power of two
    (PyTorch's ``CachingHostAllocator``; unverified for torch 2.14)."""
    return 1 << max(0, mb - 1).bit_length() if mb > 0 else 0


def segments_mb(tensors_mb: Iterable[int]) -> list[int]:
    """The segments torch's CUDA caching allocator takes from the CuMem pool for tensors of
    ``tensors_mb`` made in that order, under vLLM's ``max_split_size_mb=20`` for the weights
    (``v1/worker/gpu_worker.py:594-600``; ``c10/cuda/CUDACachingAllocator.cpp``): up to 1 MiB in
    2 MiB segments, under 10 MiB in 20 MiB ones, larger alone rounded up to 2 MiB; a tensor
    under 20 MiB goes into the smallest free remainder (over 1 MiB) that holds it. Each segment
    is one CuMem allocation, so one pinned block at a level-1 sleep."""
    out: list[int] = []
    free: dict[bool, list[int]] = {True: [], False: []}
    for mb in tensors_mb:
        small = mb <= 1
        fits = [b for b in free[small] if b >= mb] if small or mb < 20 else []
        if fits:
            block = min(fits)
            free[small].remove(block)
        else:
            block = 2 if small else 20 if mb < 10 else mb + mb % 2
            out.append(block)
        rest = block - mb
        if rest > (0 if small else 1) and (small or mb < 20):
            free[small].append(rest)
    return out


def sampler_state_mb(max_num_seqs: int, vocab: int) -> list[int]:
    """Model Runner V2's sampler state, built by ``load_model`` inside the ``weights`` pool
    (``v1/worker/gpu/model_runner.py:467-495``): ``prompt_bin_mask``, ``max_num_seqs x
    ceil(vocab / 32)`` int32, then ``output_bin_counts``, ``max_num_seqs x vocab`` int32
    (``v1/worker/gpu/sample/penalties.py:43-50``), in whole MiB; [] without a vocabulary."""
    if vocab <= 0:
        return []
    mask = max_num_seqs * -(-vocab // 32) * 4
    counts = max_num_seqs * vocab * 4
    return [ceil_mb(mask), ceil_mb(counts)]


class SimGpu:
    """The memory of one engine on its simulated devices, moved by start, sleep, wake, reload
    and the first full batch."""

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
        #: The CuMem pool's allocations, in the order they were made (the allocator's order).
        self.pool: list[Allocation] = []
        #: MiB per device of each torch-cache tag now held.
        self.cached: dict[str, int] = {}
        #: Freed pinned host blocks torch keeps for reuse: block MiB -> count.
        self.host_cache: Counter[int] = Counter()
        #: Memory unmapped by a failed sleep while the executor believes it is awake.
        self.lost = False
        #: Concurrent requests step one at a time, as vLLM runs one batch at a time.
        self._step_lock = threading.Lock()

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Create contexts, check free memory, profile, then size and allocate the KV cache."""
        self.devices = self._choose_devices()
        for device in self.devices:
            self._allocate_at_start(device, self.knobs.context_mb, "context")
        requested = {d: self._check_free(rank, d) for rank, d in enumerate(self.devices)}
        consumed = self._profile()
        kv_mb = self._kv_size(requested, consumed)
        given = self.settings.kv_cache_memory_bytes
        for device in self.devices:  # each worker logs where its profiling window ends
            self.ledger.mark(self.owner, device, "profiled" if given is None else "kv_given")
            if given is None:
                log(f"Available KV cache memory: {round(kv_mb / 1024, 2)} GiB")
            else:
                log(
                    f"Initial free memory (simulated), reserved {round(given / MIB / 1024, 2)}"
                    " GiB memory for KV Cache as specified by kv_cache_memory_bytes config and"
                    " skipped memory profiling."
                )
        time.sleep(self.knobs.after_profile_s)
        for device in self.devices:
            self._allocate_at_start(device, kv_mb, "kv_cache")
            self.pool.append(Allocation(device, "kv_cache", kv_mb))
        self._capture_graphs()

    def _capture_graphs(self) -> None:
        """Capture the CUDA graphs after the KV cache (``v1/worker/gpu_worker.py:995-1010``):
        they take what they take, which may exceed the profile's estimate, the budget, and
        what the device has left."""
        graphs = self.knobs.graphs_mb
        for device in self.devices:
            self._allocate_at_start(device, graphs, "cudagraph")
            if self.settings.sleep_mode_offload_cudagraph:
                self.pool.append(Allocation(device, "cudagraph", graphs))
        estimate = self._graphs_estimate()
        log(
            f"CUDA graph pool memory: {graphs / 1024:.2f} GiB (actual), {estimate / 1024:.2f} "
            f"GiB (estimated), difference: {abs(graphs - estimate) / 1024:.2f} GiB."
        )

    def _graphs_estimate(self) -> int:
        knobs = self.knobs
        return knobs.graphs_mb if knobs.graphs_estimate_mb is None else knobs.graphs_estimate_mb

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
        """Load the weights (with V2's sampler state), the runtime and workspace pools, run the
        profile (the transient peak) and estimate the graphs; then empty torch's cache, which
        frees the peak. Returns the non-KV MiB per device: the device-wide consumption plus the
        peak (``utils/mem_utils.py:298-321``) plus the graphs' estimate
        (``v1/worker/gpu_worker.py:705-757``)."""
        before = self._free()
        knobs = self.knobs
        tensors = [*knobs.segments, *sampler_state_mb(self.settings.max_num_seqs, knobs.vocab)]
        for device in self.devices:
            for mb in segments_mb(tensors):
                self._allocate_at_start(device, mb, "weights")
                self.pool.append(Allocation(device, "weights", mb))
        log(f"Model loading took {knobs.weights_mb / 1024:.4f} GiB memory (simulated)")
        for device in self.devices:
            self._allocate_at_start(device, knobs.runtime_mb, "runtime")
            self.pool.append(Allocation(device, "runtime", knobs.runtime_mb))
            if knobs.workspace_mb:
                self._allocate_at_start(device, knobs.workspace_mb, "workspace")
                self.pool.append(Allocation(device, "workspace", knobs.workspace_mb))
        for device in self.devices:
            self._allocate_at_start(device, knobs.peak_mb, "activation")
        time.sleep(knobs.profile_s)
        for device in self.devices:
            self.ledger.free(self.owner, device, "activation")
        after = self._free()
        for device in self.devices:
            # Told its KV cache size, vLLM runs the profile only to compile and measures nothing
            # (``v1/worker/gpu_worker.py:656-680``).
            if self.settings.kv_cache_memory_bytes is None and after[device] > before[device]:
                raise SimStartError(
                    "AssertionError: Error in memory profiling. Initial free memory "
                    f"{before[device] / 1024:.2f} GiB, current free memory "
                    f"{after[device] / 1024:.2f} GiB. This happens when other processes sharing "
                    "the same container release GPU memory while vLLM is profiling during "
                    "initialization. To fix this, ensure consistent GPU memory allocation or "
                    "isolate vLLM in its own container."
                )
        estimate = self._graphs_estimate()
        return {d: before[d] - after[d] + knobs.peak_mb + estimate for d in self.devices}

    def _kv_size(self, requested: dict[int, int], non_kv: dict[int, int]) -> int:
        """KV MiB per device: ``--kv-cache-memory-bytes``, else the smallest budget left."""
        if self.settings.kv_cache_memory_bytes is not None:
            kv_mb = ceil_mb(self.settings.kv_cache_memory_bytes)
        else:
            kv_mb = min(requested[d] - non_kv[d] for d in self.devices)
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

    # ------------------------------------------------------------------ serving

    def needs_step(self, batch_tokens: int) -> bool:
        """Whether a batch of ``batch_tokens`` must touch the ledger: the peak is to be regrown,
        or the memory under the model is gone (cheap: no ledger access)."""
        peak = self.knobs.peak_mb
        regrow = peak > 0 and "activation" not in self.cached
        return self.lost or (regrow and batch_tokens >= self.knobs.peak_tokens)

    def step(self, batch_tokens: int) -> None:
        """A forward pass over ``batch_tokens``: the first full batch regrows the transient peak
        in torch's cache (released by profiling, every sleep and every wake). Raises
        `EngineFault` when it cannot, or when a failed sleep left the memory unmapped."""
        with self._step_lock:
            if self.lost:
                raise EngineFault(f"torch.AcceleratorError: {ILLEGAL_ACCESS}")
            if not self.needs_step(batch_tokens):
                return
            peak = self.cached["activation"] = self.knobs.peak_mb
            for device in self.devices:
                try:
                    self.ledger.allocate(self.owner, device, peak, "activation")
                except SimOutOfMemory as exc:
                    raise EngineFault(f"torch.OutOfMemoryError: {exc}") from None

    # ------------------------------------------------------------------ sleep / wake / reload

    def held_bytes(self) -> int:
        return sum(self.ledger.held(self.owner).values()) * MIB

    def asleep_tags(self) -> set[str]:
        """The deferrable tags with an allocation still unmapped."""
        return {a.tag for a in self.pool if a.asleep and a.tag in DEFERRABLE}

    def sleep(self, level: int, offload: bool = True) -> None:
        """vLLM's ``Worker.sleep``: offload and discard (only with ``offload``), empty torch's
        cache, then assert that device-wide free memory did not shrink and log what was freed.

        Raises `MemoryLost` when the sleep fails after memory was unmapped, `GpuError` when it
        fails with every allocation still mapped."""
        if level == 0 or ("weights" in self.asleep_tags() and not self.lost):
            return  # vLLM's executor ignores a sleep while it sleeps (abstract.py:401-403)
        before = self._free()
        for device in self.devices:
            self.ledger.mark(self.owner, device, "sleep_begin")
        time.sleep(self.knobs.sleep_s)
        if offload:
            self._offload(level)
            self._empty_torch_cache()
            if level == 2 and self.knobs.buffers_mb and "weights" in self.asleep_tags():
                self._save_buffers()
        after = self._free()
        if any(after[d] < before[d] for d in self.devices):
            message = "AssertionError: Memory usage increased after sleeping."
            log(message, "ERROR", sys.stderr)
            if any(a.asleep for a in self.pool):
                self.lost = True
                raise MemoryLost(message)
            raise GpuError(message)
        self.lost = False
        readings = self.ledger.read()
        for device in self.devices:
            freed = (after[device] - before[device]) / 1024
            used = readings[device].used_mb / 1024
            log(f"Sleep mode freed {freed:.2f} GiB memory, {used:.2f} GiB memory is still in use.")

    def _offload(self, level: int) -> None:
        """``CuMemAllocator.sleep``: allocation by allocation, back up the offloaded tags into
        pinned host memory, then unmap (``device_allocator/cumem.py:256-280``). Level 1
        offloads the weights, ``runtime`` and pooled graphs, level 2 only ``runtime`` and
        pooled graphs (``device_allocator/sleep_mode_backend.py:133-137``); the KV cache and
        the ``workspace`` pool are discarded (``v1/worker/gpu_worker.py:557-564``)."""
        offload = ("runtime", "cudagraph") + (("weights",) if level == 1 else ())
        for allocation in self.pool:
            if allocation.asleep:
                continue
            if allocation.tag in offload:
                try:
                    allocation.backup_mb = self._pin(allocation.mb)
                except SimOutOfMemory as exc:
                    if any(a.asleep for a in self.pool):
                        self.lost = True
                        raise MemoryLost(str(exc)) from None
                    raise GpuError(str(exc)) from None
            self.ledger.free(self.owner, allocation.device, allocation.tag, allocation.mb)
            allocation.asleep = True

    def _save_buffers(self) -> None:
        """A level-2 sleep copies the model's buffers (and parameters named by
        ``sleep_preserve_parameter_names``) to pageable host memory, per rank, until the
        weights wake (``v1/worker/gpu_worker.py:287-312,352-357``)."""
        mb = self.knobs.buffers_mb * len(self.devices)
        try:
            self.ledger.pin(self.owner, mb, PAGEABLE)
        except SimOutOfMemory as exc:
            raise GpuError(str(exc)) from None

    def _pin(self, mb: int) -> int:
        """A pinned host block for ``mb`` MiB: a cached one of the rounded size if torch has
        one free, else a new one. Returns the block's MiB."""
        block = pinned_size(mb)
        if self.host_cache[block] > 0:
            self.host_cache[block] -= 1
        else:
            self.ledger.pin(self.owner, block, "host_cache")
        return block

    def _empty_torch_cache(self) -> None:
        """``gc.collect(); empty_cache()``: the activation peak and reload temporaries go."""
        for tag in self.cached:
            for device in self.devices:
                self.ledger.free(self.owner, device, tag)
        self.cached.clear()

    def wake(self, tags: Iterable[str]) -> None:
        """``CuMemAllocator.wake_up``: empty torch's cache, then map back, one allocation at a
        time, the asleep ones of ``tags`` and every non-deferrable one; offloaded ones are
        copied back and their pinned block returns to torch's host cache, still pinned
        (``device_allocator/cumem.py:342-364``). A failure leaves what was mapped mapped."""
        waking = set(tags)
        self._empty_torch_cache()
        for allocation in self.pool:
            if not allocation.asleep:
                continue
            if allocation.tag in DEFERRABLE and allocation.tag not in waking:
                continue
            try:
                self.ledger.allocate(self.owner, allocation.device, allocation.mb, allocation.tag)
            except SimOutOfMemory as exc:
                log(f"Failed to wake up allocator: {exc}", "ERROR", sys.stderr)
                raise GpuError(str(exc)) from None
            allocation.asleep = False
            if allocation.backup_mb:
                self.host_cache[allocation.backup_mb] += 1
                allocation.backup_mb = 0
        if "weights" in waking:
            self.ledger.unpin(self.owner, PAGEABLE)  # the buffers copied back and dropped

    def reload(self) -> None:
        """Re-read the checkpoint: per-module temporaries in torch's default allocator, which
        stay cached until the next wake empties the cache, and weights / rate seconds."""
        temp = self.knobs.reload_temp_mb
        if temp and "reload_temp" not in self.cached:
            self.cached["reload_temp"] = temp
            for device in self.devices:
                try:
                    self.ledger.allocate(self.owner, device, temp, "reload_temp")
                except SimOutOfMemory as exc:
                    raise GpuError(str(exc)) from None
        time.sleep(self.knobs.weights_mb / self.knobs.reload_mb_s)

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
