"""GPU mode: real device memory held through torch, freed and restored by sleep and wake.

torch is imported only here, and only when ``FAKE_ENGINE_GPU_MB`` is set; every method blocks
(device copies and allocations), so the engine calls them from a worker thread.
"""

from collections.abc import Iterable
from typing import Any, Protocol

MIB = 1024 * 1024
WEIGHTS_SHARE = 0.7
WEIGHT_BYTE = 0x5A


class GpuError(Exception):
    """torch or CUDA is missing, the device is wrong, or memory cannot be had."""


class DeviceMemory(Protocol):
    """Memory an engine holds and sleep/wake/reload move: torch (`GpuMemory`) or simulated.

    Every method may block; the engine calls them from a worker thread. Failures raise
    `GpuError` with a message fit for the 500 answer.
    """

    def held_bytes(self) -> int: ...

    def asleep_tags(self) -> set[str]: ...

    def sleep(self, level: int, offload: bool = True) -> None: ...

    def wake(self, tags: Iterable[str]) -> None: ...

    def reload(self) -> None: ...


class GpuMemory:
    """``megabytes`` MiB on one CUDA device, split as weights (70 %) and KV cache (30 %).

    Level-1 sleep copies the weights to pinned host memory and frees both device tensors;
    level 2 frees both without a copy. Waking a tag reallocates it: the weights come back from
    the host copy, or stay uninitialised ("garbage") until ``reload``. A freed tensor goes back
    to the driver (``torch.cuda.empty_cache``), so NVML sees the memory free.
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
        total = megabytes * MIB
        self.sizes = {"weights": int(total * WEIGHTS_SHARE)}
        self.sizes["kv_cache"] = total - self.sizes["weights"]
        self.tensors: dict[str, Any] = {}
        self.host: Any = None
        try:
            self._allocate("weights")
            self._allocate("kv_cache")
            self.reload()
        except GpuError as exc:
            raise GpuError(f"cannot hold {megabytes} MiB on {device}: {exc}") from None

    def _allocate(self, tag: str) -> Any:
        torch = self.torch
        try:
            tensor = torch.empty(self.sizes[tag], dtype=torch.uint8, device=self.device)
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
            raise GpuError(f"allocating {tag}: {exc}") from None
        self.tensors[tag] = tensor
        return tensor

    def held_bytes(self) -> int:
        return sum(self.sizes[tag] for tag in tuple(self.tensors))

    def asleep_tags(self) -> set[str]:
        return set(self.sizes) - set(tuple(self.tensors))

    def sleep(self, level: int, offload: bool = True) -> None:
        """Free the device memory (level 1 keeps a pinned host copy of the weights).

        Without ``offload`` (no ``--enable-sleep-mode``: vLLM has no CuMem pool) nothing moves.
        """
        if level == 0 or not offload:
            return
        torch = self.torch
        weights = self.tensors.get("weights")
        if level == 1 and weights is not None:
            try:
                host = torch.empty(self.sizes["weights"], dtype=torch.uint8, pin_memory=True)
                host.copy_(weights)
            except RuntimeError as exc:
                raise GpuError(f"offloading the weights to host memory: {exc}") from None
            self.host = host
        elif level == 2:
            self.host = None
        del weights
        self.tensors.clear()
        torch.cuda.empty_cache()

    def wake(self, tags: Iterable[str]) -> None:
        """Reallocate the given tags; the weights come back from the host copy if there is one."""
        for tag in tags:
            if tag in self.tensors:
                continue
            tensor = self._allocate(tag)
            if tag == "weights" and self.host is not None:
                try:
                    tensor.copy_(self.host)
                except RuntimeError as exc:
                    del self.tensors[tag]
                    raise GpuError(f"restoring the weights: {exc}") from None
                self.host = None
        self.torch.cuda.synchronize(self.device)

    def reload(self) -> None:
        """Write the weights again (the "load from disk" of ``reload_weights``)."""
        weights = self.tensors.get("weights")
        if weights is None:
            return
        try:
            weights.fill_(WEIGHT_BYTE)
            self.torch.cuda.synchronize(self.device)
        except RuntimeError as exc:
            raise GpuError(f"writing the weights: {exc}") from None
