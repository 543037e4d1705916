"""GPU memory: snapshots from NVML, and a static budget for machines without one.

Sizes are MiB throughout (NVML's bytes divided by 2**20, rounded down).

* `NvmlMonitor` reads every device (or the configured ones) through nvidia-ml-py. `read()` is
  synchronous; `run()` refreshes `latest` in a worker thread so request handling never waits on
  the driver.
* `StaticBudget` stands in where there is no NVIDIA GPU: devices have a configured size and
  "used" is what the proxy says its engines take.

Footprint estimation lives in `footprint.py`.

Device ids are NVML indices. NVML orders devices by PCI bus id; CUDA orders them fastest first
unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` is set, so engines should be started with that variable
for the ids to agree.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger(__name__)

MIB = 1024 * 1024


@dataclass(frozen=True)
class GpuSnapshot:
    """One device at one moment: memory in MiB, utilisation, and per-process memory.

    ``util_percent`` is None where it is unknown (static budget, or NVML cannot say).
    ``processes`` maps pid -> MiB for compute processes; 0 when NVML lists the process but
    cannot tell its usage (for example inside some containers).
    """

    id: int
    total_mb: int
    used_mb: int
    free_mb: int
    util_percent: float | None
    processes: dict[int, int] = field(default_factory=dict)


class GpuSource(Protocol):
    """Anything that reports device snapshots: `NvmlMonitor` or `StaticBudget`."""

    def read(self) -> list[GpuSnapshot]: ...


# -- NVML -----------------------------------------------------------------------------------


def _import_pynvml() -> Any:
    return importlib.import_module("pynvml")


class NvmlMonitor:
    """Device memory and utilisation through NVML.

    ``nvml`` is the pynvml module (imported on first use when not given), so tests can pass a
    fake. ``devices`` limits the snapshots to those NVML indices (None: every device); ids that
    do not exist are skipped. NVML is initialised on the first `read()` and shut down by
    `close()`.
    """

    def __init__(self, devices: Sequence[int] | None = None, nvml: Any | None = None) -> None:
        self.devices = tuple(devices) if devices is not None else None
        self._nvml = nvml
        self._init_lock = threading.Lock()
        self._initialised = False
        self._latest: list[GpuSnapshot] = []
        #: When the read behind `latest` began (monotonic): nothing in it is newer.
        self.updated_at: float | None = None
        self.last_error: str | None = None

    @classmethod
    def available(cls, nvml: Any | None = None) -> bool:
        """True when NVML initialises and sees at least one device; never raises."""
        try:
            lib = nvml if nvml is not None else _import_pynvml()
            lib.nvmlInit()
        except Exception:
            return False
        try:
            return bool(lib.nvmlDeviceGetCount() > 0)
        except Exception:
            return False
        finally:
            try:
                lib.nvmlShutdown()
            except Exception:
                log.debug("nvmlShutdown failed", exc_info=True)

    @property
    def latest(self) -> list[GpuSnapshot]:
        """The last snapshots `run()` took (empty before the first one); never blocks."""
        return self._latest

    def _lib(self) -> Any:
        with self._init_lock:
            if self._nvml is None:
                self._nvml = _import_pynvml()
            if not self._initialised:
                self._nvml.nvmlInit()
                self._initialised = True
        return self._nvml

    def read(self) -> list[GpuSnapshot]:
        """Snapshot the devices now (blocking; NVML calls take about a millisecond each).

        Memory errors propagate (pynvml's ``NVMLError``); utilisation and per-process memory
        are optional and come back as None / {} when NVML refuses them (``NotSupported``).
        """
        lib = self._lib()
        count = int(lib.nvmlDeviceGetCount())
        ids = range(count) if self.devices is None else [i for i in self.devices if i < count]
        return [self._snapshot(lib, i) for i in ids]

    def _snapshot(self, lib: Any, index: int) -> GpuSnapshot:
        handle = lib.nvmlDeviceGetHandleByIndex(index)
        mem = lib.nvmlDeviceGetMemoryInfo(handle)
        return GpuSnapshot(
            id=index,
            total_mb=int(mem.total) // MIB,
            used_mb=int(mem.used) // MIB,
            free_mb=int(mem.free) // MIB,
            util_percent=_utilisation(lib, handle),
            processes=_processes(lib, handle),
        )

    def visible(self, value: str, order: str) -> tuple[int, ...]:
        """The NVML indices of the GPUs a ``CUDA_VISIBLE_DEVICES`` value names, in its order.

        Entries are indices or ``GPU-<uuid>`` (a unique prefix is enough, as for CUDA). Indices
        are NVML's only in PCI bus order: with ``order`` other than ``PCI_BUS_ID`` (CUDA's
        default is fastest first) they are refused on a host with more than one GPU. MIG
        instances (``MIG-<uuid>``) are refused. ValueError says what is wrong.
        """
        lib = self._lib()
        count = int(lib.nvmlDeviceGetCount())
        out: list[int] = []
        for item in (v.strip() for v in value.split(",") if v.strip()):
            if item.startswith("MIG-"):
                raise ValueError(f"{item!r} is a MIG instance; MIG slices are not supported")
            if item.startswith("GPU-"):
                uuids = [_text(lib.nvmlDeviceGetUUID(lib.nvmlDeviceGetHandleByIndex(i)))
                         for i in range(count)]  # fmt: skip
                found = [i for i, u in enumerate(uuids) if u.startswith(item)]
                if len(found) != 1:
                    raise ValueError(f"{item!r} matches {len(found)} GPUs (NVML sees {count})")
                out.append(found[0])
                continue
            if not item.isdigit():
                raise ValueError(f"{item!r} is neither a GPU index nor a GPU-<uuid>")
            if int(item) >= count:
                raise ValueError(f"GPU {item} does not exist (NVML sees {count})")
            if order != "PCI_BUS_ID" and count > 1:
                raise ValueError(
                    f"index {item} counts GPUs in CUDA's {order or 'FASTEST_FIRST'} order, which"
                    " NVML does not use; set CUDA_DEVICE_ORDER=PCI_BUS_ID or name GPUs by UUID"
                )
            out.append(int(item))
        if len(set(out)) != len(out):
            raise ValueError(f"{value!r} names a GPU twice")
        return tuple(out)

    def names(self) -> dict[int, str]:
        """Each device's name (vLLM picks its batch defaults by it); "" where NVML cannot say."""
        lib = self._lib()
        count = int(lib.nvmlDeviceGetCount())
        out = {}
        for i in range(count) if self.devices is None else [i for i in self.devices if i < count]:
            try:
                out[i] = _text(lib.nvmlDeviceGetName(lib.nvmlDeviceGetHandleByIndex(i)))
            except (lib.NVMLError, AttributeError):
                out[i] = ""
        return out

    def mig_devices(self) -> list[int]:
        """Indices of the GPUs with MIG mode on (NVML reports their memory as the parent's)."""
        lib = self._lib()
        out = []
        for i in range(int(lib.nvmlDeviceGetCount())):
            try:
                current = lib.nvmlDeviceGetMigMode(lib.nvmlDeviceGetHandleByIndex(i))[0]
            except (lib.NVMLError, AttributeError):
                continue  # not MIG-capable, or an NVML without the call
            if current == getattr(lib, "NVML_DEVICE_MIG_ENABLE", 1):
                out.append(i)
        return out

    async def run(self, interval_s: float = 1.0) -> None:
        """Refresh `latest` every `interval_s` seconds until cancelled.

        Each read runs in a worker thread. A failed read keeps the previous snapshots, sets
        `last_error` and is logged once per distinct message.
        """
        while True:
            try:
                started = time.monotonic()
                self._latest = await asyncio.to_thread(self.read)
                self.updated_at = started  # the reading shows nothing older than this
                self.last_error = None
            except Exception as err:
                message = f"{type(err).__name__}: {err}"
                if message != self.last_error:
                    log.warning("GPU snapshot failed, keeping the previous one: %s", message)
                self.last_error = message
            await asyncio.sleep(interval_s)

    def close(self) -> None:
        """Shut NVML down if `read()` initialised it; safe to call twice."""
        with self._init_lock:
            if self._initialised and self._nvml is not None:
                self._initialised = False
                self._nvml.nvmlShutdown()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _utilisation(lib: Any, handle: Any) -> float | None:
    try:
        return float(lib.nvmlDeviceGetUtilizationRates(handle).gpu)
    except lib.NVMLError:
        return None


def _processes(lib: Any, handle: Any) -> dict[int, int]:
    try:
        procs = lib.nvmlDeviceGetComputeRunningProcesses(handle)
    except lib.NVMLError:
        return {}
    out: dict[int, int] = {}
    for p in procs:
        used = getattr(p, "usedGpuMemory", None)
        out[int(p.pid)] = out.get(int(p.pid), 0) + (int(used) // MIB if used else 0)
    return out


# -- static budget --------------------------------------------------------------------------


class StaticBudget:
    """Configured device sizes for machines without NVML; usage is what the proxy reports.

    ``devices`` maps device id -> MiB. Each owner (an engine) reports the MiB it takes on each of
    its devices with `set_usage()` when it starts and `clear_usage()` when it stops; "used" on a
    device is the sum over owners.
    """

    def __init__(self, devices: Mapping[int, int]) -> None:
        for dev_id, mb in devices.items():
            if mb <= 0:
                raise ValueError(f"device {dev_id}: memory must be positive, got {mb} MiB")
        self.devices = dict(devices)
        self._usage: dict[str, tuple[tuple[int, ...], int]] = {}

    def set_usage(self, owner: str, devices: tuple[int, ...], mb: int) -> None:
        """Record that `owner` takes `mb` MiB on each of `devices` (replaces its previous entry)."""
        unknown = [d for d in devices if d not in self.devices]
        if unknown:
            raise ValueError(f"{owner}: unknown device(s) {unknown}; known: {sorted(self.devices)}")
        if mb < 0:
            raise ValueError(f"{owner}: usage must not be negative, got {mb} MiB")
        self._usage[owner] = (tuple(devices), mb)

    def clear_usage(self, owner: str) -> None:
        """Forget `owner`'s usage; a no-op for an unknown owner."""
        self._usage.pop(owner, None)

    def used_mb(self, device: int) -> int:
        return sum(mb for devs, mb in self._usage.values() if device in devs)

    def read(self) -> list[GpuSnapshot]:
        """Snapshots in device-id order; free never goes below zero, util is None."""
        out = []
        for dev_id, total in sorted(self.devices.items()):
            used = self.used_mb(dev_id)
            out.append(GpuSnapshot(dev_id, total, used, max(total - used, 0), None, {}))
        return out
