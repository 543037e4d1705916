"""GPU mode: real device memory held through torch the way vLLM 0.33's CuMem allocator holds it.

torch is imported only here, and only when ``FAKE_ENGINE_GPU_MB`` is set. ``sleep``, ``wake``
and ``reload`` block on device copies, so the engine calls them from a worker thread;
``regrow_peak`` only allocates and runs on the event loop, on a request's way in.

What is copied, freed and kept follows ``vllm/device_allocator/cumem.py`` (sleep 233-298, wake
331-364) and ``vllm/device_allocator/sleep_mode_backend.py:127-137``:

* one device tensor per allocation: the weights as several tensors of a Llama's uneven sizes,
  the KV cache, and the small ``runtime`` pool (LoRA slots and such in vLLM);
* level 1 backs up each weights tensor and the runtime pool into its own pinned host tensor
  (``torch.empty(n, dtype=torch.uint8, pin_memory=True)``), level 2 the runtime pool alone;
  everything on the device is then freed and ``torch.cuda.empty_cache()`` hands it back;
* a wake empties torch's cache first, maps the tags asked for (the runtime pool at every
  wake: it is not deferrable), copies the backups back and drops them. Dropped backups go back
  to PyTorch's caching host allocator, which keeps them (rounded up to a power of two) for the
  life of the process: vLLM never empties that cache, and neither does this;
* the activation peak that profiling measured is allocated once at start and freed with
  ``empty_cache`` before the engine is ready, so a ready or freshly woken engine holds its
  budget less the peak, until the first request takes it back (`GpuMemory.regrow_peak`).
"""

import gc
import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from .log import log

MIB = 1024 * 1024
GIB = 1024 * MIB
#: Shares of ``FAKE_ENGINE_GPU_MB`` (everything the engine allocates through torch): weights,
#: KV cache and the runtime pool; the transient activation peak is the rest.
WEIGHTS_SHARE = 0.60
KV_SHARE = 0.25
RUNTIME_SHARE = 0.03
#: The weights: an embedding and an LM head of ``EMBED_SHARE`` of them each, and ``LAYERS``
#: decoder layers split like a Llama layer of hidden size 2048 and MLP size 5504 (fused qkv,
#: o, fused gate_up, down: 3, 1, 5.375 and 2.6875 x 2048^2), so that pinned host blocks show
#: the power-of-two rounding of real checkpoints.
EMBED_SHARE = 0.15
LAYERS = 8
LAYER_PARTS = (3.0, 1.0, 5.375, 2.6875)
WEIGHT_BYTE = 0x5A
#: Tags vLLM wakes only when asked (``vllm/device_allocator/__init__.py:17``); others (the
#: runtime pool) come back at every wake.
DEFERRABLE_TAGS = ("weights", "kv_cache")


class GpuError(Exception):
    """torch or CUDA is missing, the device is wrong, or memory cannot be had."""


class DeviceMemory(Protocol):
    """Memory an engine holds and sleep/wake/reload move: torch (`GpuMemory`) or simulated.

    Every method may block; the engine calls them from a worker thread. Failures raise
    `GpuError` with a message fit for the 500 answer. An implementation may also have
    ``regrow_peak()`` (see `GpuMemory`), which the engine calls when it admits a request.
    """

    def held_bytes(self) -> int: ...

    def asleep_tags(self) -> set[str]: ...

    def sleep(self, level: int, offload: bool = True) -> None: ...

    def wake(self, tags: Iterable[str]) -> None: ...

    def reload(self) -> None: ...


@dataclass(frozen=True)
class Layout:
    """Bytes of each allocation of an engine of ``FAKE_ENGINE_GPU_MB`` MiB."""

    weights: tuple[int, ...]
    kv_cache: int
    runtime: int
    peak: int

    @property
    def total(self) -> int:
        return sum(self.weights) + self.kv_cache + self.runtime + self.peak

    def sizes(self) -> dict[str, tuple[int, ...]]:
        """The allocations of each pool tag, in vLLM's allocation order."""
        return {"runtime": (self.runtime,), "weights": self.weights, "kv_cache": (self.kv_cache,)}


def layout(megabytes: int) -> Layout:
    """Split ``megabytes`` MiB by the shares above; the sizes add up to it exactly."""
    total = megabytes * MIB
    weights_total = int(total * WEIGHTS_SHARE)
    embed = int(weights_total * EMBED_SHARE)
    per_layer = (weights_total - 2 * embed) / LAYERS
    parts = sum(LAYER_PARTS)
    layer = [int(per_layer * p / parts) for p in LAYER_PARTS]
    weights = [embed, *(layer * LAYERS), embed]
    weights[-1] += weights_total - sum(weights)
    kv = int(total * KV_SHARE)
    runtime = int(total * RUNTIME_SHARE)
    peak = total - weights_total - kv - runtime
    return Layout(tuple(weights), kv, runtime, peak)


class GpuMemory:
    """``megabytes`` MiB on one CUDA device, laid out and moved as vLLM's CuMem pools are.

    Ready, it holds everything but the activation peak; ``regrow_peak`` takes the peak back.
    Level-1 sleep backs up the weights and the runtime pool into pinned host tensors, level 2
    the runtime pool only; both free the rest. Waking a tag reallocates it: the weights come
    back from their backups, or stay uninitialised ("garbage") until ``reload``.
    """

    def __init__(self, megabytes: int, device: str) -> None:
        try:
            import torch
        except ImportError as exc:
            raise GpuError(f"GPU mode needs torch, which cannot be imported ({exc})") from None
        if not torch.cuda.is_available():
            raise GpuError(
                f"GPU mode needs CUDA, but torch {torch.__version__} sees no CUDA device "
                "(torch.cuda.is_available() is False)"
            )
        try:
            self.device = torch.device(device)
        except RuntimeError as exc:
            raise GpuError(f"FAKE_ENGINE_GPU_DEVICE={device!r} is not a device ({exc})") from None
        if self.device.type != "cuda":
            raise GpuError(f"FAKE_ENGINE_GPU_DEVICE={device!r} is not a CUDA device")
        self.torch: Any = torch
        self.layout = layout(megabytes)
        self.sizes = self.layout.sizes()
        #: Device tensors per tag; a tag is absent while asleep.
        self.tensors: dict[str, list[Any]] = {}
        #: Pinned host backups per tag, while asleep.
        self.backups: dict[str, list[Any]] = {}
        self.peak: Any = None
        self._lock = threading.Lock()
        try:
            self._map("runtime")
            self._map("weights")
            self.reload()
            self._profile()
            self._map("kv_cache")
        except GpuError as exc:
            raise GpuError(f"cannot hold {megabytes} MiB on {device}: {exc}") from None

    # -- allocation ------------------------------------------------------------------------------

    def _empty(self, size: int, what: str) -> Any:
        torch = self.torch
        try:
            return torch.empty(size, dtype=torch.uint8, device=self.device)
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
            raise GpuError(f"allocating {what}: {exc}") from None

    def _map(self, tag: str) -> None:
        """Allocate every tensor of ``tag``, or none of them."""
        made = []
        try:
            for size in self.sizes[tag]:
                made.append(self._empty(size, tag))
        except GpuError:
            made.clear()
            self.torch.cuda.empty_cache()
            raise
        self.tensors[tag] = made

    def _profile(self) -> None:
        """vLLM's profiling run: the activation peak is allocated, then freed and handed back
        before the KV cache is sized (``vllm/utils/mem_utils.py:298-301``)."""
        self.peak = self._empty(self.layout.peak, "the activation peak")
        self.peak = None
        self.torch.cuda.empty_cache()

    # -- the DeviceMemory protocol ---------------------------------------------------------------

    def held_bytes(self) -> int:
        held = sum(sum(self.sizes[tag]) for tag in tuple(self.tensors))
        return held + (self.layout.peak if self.peak is not None else 0)

    def asleep_tags(self) -> set[str]:
        return set(DEFERRABLE_TAGS) - set(tuple(self.tensors))

    def regrow_peak(self) -> None:
        """Take the activation peak back, as vLLM's first full batch after a start or a wake
        does (its torch cache was emptied). A no-op while held or while anything is asleep."""
        if self.peak is not None or len(self.tensors) < len(self.sizes):
            return
        with self._lock:
            if self.peak is None and len(self.tensors) == len(self.sizes):
                self.peak = self._empty(self.layout.peak, "the activation peak")

    def sleep(self, level: int, offload: bool = True) -> None:
        """Back up what ``level`` keeps into pinned host memory and free the device.

        Without ``offload`` (no ``--enable-sleep-mode``: vLLM has no CuMem pool) nothing moves.
        A backup that cannot be had raises before anything is freed.
        """
        if level == 0 or not offload:
            return
        keep = ("runtime", "weights") if level == 1 else ("runtime",)
        with self._lock:
            backups = self._backups(keep)
            self.backups.update(backups)
            backed_up = sum(sum(self.sizes[tag]) for tag in backups)
            freed = self.held_bytes()
            # No reference to a device tensor may outlive this: empty_cache frees only blocks
            # that nothing holds.
            del backups
            self.tensors.clear()
            self.peak = None
            gc.collect()
            self.torch.cuda.empty_cache()
        log(
            f"CuMemAllocator: sleep freed {freed / GIB:.2f} GiB memory in total, of which "
            f"{backed_up / GIB:.2f} GiB is backed up in CPU and the rest "
            f"{(freed - backed_up) / GIB:.2f} GiB is discarded directly."
        )
        self._log_state(f"sleep level {level}")

    def _backups(self, keep: tuple[str, ...]) -> dict[str, list[Any]]:
        """Pinned host copies of the awake tags in ``keep``, one per device tensor."""
        backups: dict[str, list[Any]] = {}
        for tag in keep:
            tensors = self.tensors.get(tag)
            if tensors is not None:
                sizes = self.sizes[tag]
                backups[tag] = [self._backup(tag, tensors[i], sizes[i]) for i in range(len(sizes))]
        return backups

    def _backup(self, tag: str, tensor: Any, size: int) -> Any:
        torch = self.torch
        try:
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            host.copy_(tensor)
        except RuntimeError as exc:
            raise GpuError(f"offloading {tag} to pinned host memory: {exc}") from None
        return host

    def wake(self, tags: Iterable[str]) -> None:
        """Empty torch's cache, then reallocate the runtime pool and the given tags; backups
        are copied back and dropped (their pinned blocks stay in torch's host cache)."""
        wanted = set(tags)
        with self._lock:
            gc.collect()
            self.torch.cuda.empty_cache()
            for tag in self.sizes:
                if tag in self.tensors or (tag in DEFERRABLE_TAGS and tag not in wanted):
                    continue
                self._map(tag)
                self._restore(tag)
            self.torch.cuda.synchronize(self.device)
        self._log_state(f"wake {','.join(sorted(wanted)) or 'runtime'}")

    def _restore(self, tag: str) -> None:
        backups = self.backups.get(tag)
        if backups is None:
            return
        try:
            for tensor, host in zip(self.tensors[tag], backups, strict=True):
                tensor.copy_(host)
        except RuntimeError as exc:
            del self.tensors[tag]
            raise GpuError(f"restoring {tag}: {exc}") from None
        del self.backups[tag]

    def reload(self) -> None:
        """Write the weights again (the "load from disk" of ``reload_weights``)."""
        with self._lock:
            weights = self.tensors.get("weights")
            if weights is None:
                return
            try:
                for tensor in weights:
                    tensor.fill_(WEIGHT_BYTE)
                self.torch.cuda.synchronize(self.device)
            except RuntimeError as exc:
                raise GpuError(f"writing the weights: {exc}") from None

    # -- measurements ----------------------------------------------------------------------------

    def pinned_bytes(self) -> dict[str, int]:
        """PyTorch's pinned host allocator: bytes it holds (in use and cached, rounded up to
        powers of two) and bytes in use; what this torch does not count is left out.

        The keys differ by PyTorch version and are read by presence: newer ones count the
        blocks held in ``allocated_bytes`` and those in use in ``active_bytes``; older ones the
        blocks held in ``reserved_bytes`` and those in use in ``allocated_bytes``."""
        stats = self.host_memory_stats()
        if "active_bytes.current" in stats:
            keys = {"pinned_bytes": "allocated_bytes.current",
                    "pinned_in_use_bytes": "active_bytes.current"}  # fmt: skip
        else:
            keys = {"pinned_bytes": "reserved_bytes.current",
                    "pinned_in_use_bytes": "allocated_bytes.current"}  # fmt: skip
        return {name: int(stats[key]) for name, key in keys.items() if key in stats}

    def host_memory_stats(self) -> dict[str, int]:
        """``torch.cuda.host_memory_stats()``'s current figures, whatever their names ({}
        where this torch has none)."""
        stats_of = getattr(self.torch.cuda, "host_memory_stats", None)
        if stats_of is None:
            return {}
        return {k: int(v) for k, v in stats_of().items() if k.endswith(".current")}

    def _log_state(self, after: str) -> None:
        """One line the GPU check reads back from the engine's log."""
        state: dict[str, object] = {"device_bytes": self.held_bytes(), **self.pinned_bytes()}
        state["host_memory_stats"] = self.host_memory_stats()
        state["backup_bytes"] = sum(sum(self.sizes[tag]) for tag, _ in tuple(self.backups.items()))
        log(f"fake GPU memory after {after}: {json.dumps(state)}")
