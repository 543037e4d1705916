"""What one engine holds on the GPU and on the host, read from outside it, for the GPU check.

`measure` reads NVML (per process and the whole device), the resident memory of the engine's
process tree (psutil), the kernel's pinned and locked counts (``VmPin``/``VmLck`` in
``/proc/<pid>/status``), the cgroup's ``memory.current`` and ``MemAvailable``, and where
pinned pages are accounted (``RssShmem``, ``/proc/meminfo`` ``Shmem``, the cgroup's
``shmem``); the pinned bytes PyTorch's host allocator holds are read from the engine's own log
(the fake engine's GPU mode logs them after each sleep and wake). `Record` collects the
readings and writes them as JSON to ``GPU_CHECK_OUT`` after every step, so a failed assertion
still leaves what was measured.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from vllm_proxy.planning.gpu import NvmlMonitor

MIB = 1024 * 1024
OUT_ENV = "GPU_CHECK_OUT"
_STATE_LINE = re.compile(r"fake GPU memory after ([^:]+): (\{.*\})")


@dataclass
class Reading:
    """One moment. MiB unless named ``_kb``; None where this host cannot say."""

    step: str
    device_used_mb: int
    nvml_process_mb: int | None
    engine_gpu_mb: float | None
    rss_mb: float
    vm_pin_kb: int | None
    vm_lck_kb: int | None
    cgroup_mb: float | None
    mem_available_mb: float | None
    pinned_mb: float | None
    pinned_in_use_mb: float | None
    seconds: float | None = None
    #: Where ``pin_memory=True`` pages are accounted on current kernels: the engine tree's
    #: ``RssShmem``, the host's ``Shmem`` (``/proc/meminfo``) and the cgroup's ``shmem``.
    rss_shmem_kb: int | None = None
    shmem_kb: int | None = None
    cgroup_shmem_mb: float | None = None


@dataclass
class Record:
    """The readings of one run and the facts they need; JSON at ``path`` after each step."""

    path: Path | None
    device: dict[str, Any]
    engine: dict[str, Any]
    readings: list[Reading] = field(default_factory=list)
    started: float = field(default_factory=time.time)

    def add(self, reading: Reading) -> Reading:
        self.readings.append(reading)
        self.write()
        return reading

    def write(self) -> None:
        if self.path is None:
            return
        data = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started)),
            "device": self.device,
            "engine": self.engine,
            "readings": [asdict(r) for r in self.readings],
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(self.path)

    def at(self, step: str) -> Reading:
        return next(r for r in self.readings if r.step == step)


def out_path() -> Path | None:
    raw = os.environ.get(OUT_ENV, "").strip()
    return Path(raw) if raw else None


def device_facts(index: int) -> dict[str, Any]:
    """Name, memory and driver of an NVIDIA device, as NVML says."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        driver = pynvml.nvmlSystemGetDriverVersion()
        total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
        return {
            "index": index,
            "name": name.decode() if isinstance(name, bytes) else str(name),
            "memory_mb": int(total) // MIB,
            "driver": driver.decode() if isinstance(driver, bytes) else str(driver),
        }
    finally:
        pynvml.nvmlShutdown()


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _status_kb(proc: psutil.Process, key: str) -> int | None:
    try:
        text = Path(f"/proc/{proc.pid}/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) if match else None


def _sum(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _cgroup_mb() -> float | None:
    try:
        return round(int(Path("/sys/fs/cgroup/memory.current").read_text()) / MIB, 1)
    except (OSError, ValueError):
        return None


def _cgroup_shmem_mb() -> float | None:
    """The cgroup's ``shmem`` (v2 ``memory.stat``; v1 ``total_shmem``)."""
    for path, key in (("/sys/fs/cgroup/memory.stat", "shmem"),
                      ("/sys/fs/cgroup/memory/memory.stat", "total_shmem")):  # fmt: skip
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        match = re.search(rf"^{key} (\d+)$", text, re.M)
        if match:
            return round(int(match.group(1)) / MIB, 1)
    return None


def _meminfo_kb(key: str) -> int | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) if match else None


def _available_mb() -> float | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    match = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) / 1024 if match else None


def pinned_from_log(log_text: str) -> tuple[float | None, float | None]:
    """(held, in use) MiB of PyTorch's pinned host allocator at the engine's last sleep or
    wake; None where it did not say (no sleep yet, or a torch without host statistics)."""
    found = _STATE_LINE.findall(log_text)
    if not found:
        return None, None
    state = json.loads(found[-1][1])
    held, used = state.get("pinned_bytes"), state.get("pinned_in_use_bytes")
    return (
        None if held is None else held / MIB,
        None if used is None else used / MIB,
    )


def measure(
    step: str,
    device: int,
    engine_pid: int,
    engine_gpu_mb: float | None,
    log_text: str,
    seconds: float | None = None,
) -> Reading:
    procs = tree(engine_pid)
    pids = {p.pid for p in procs}
    monitor = NvmlMonitor(devices=[device])
    try:
        snapshot = monitor.read()[0]
    finally:
        monitor.close()
    per_process = [mb for pid, mb in snapshot.processes.items() if pid in pids]
    rss = 0
    for proc in procs:
        try:
            rss += proc.memory_info().rss
        except psutil.Error:
            pass
    pinned, in_use = pinned_from_log(log_text)
    return Reading(
        step=step,
        device_used_mb=snapshot.used_mb,
        nvml_process_mb=sum(per_process) if any(per_process) else None,
        engine_gpu_mb=engine_gpu_mb,
        rss_mb=round(rss / MIB, 1),
        vm_pin_kb=_sum([_status_kb(p, "VmPin") for p in procs]),
        vm_lck_kb=_sum([_status_kb(p, "VmLck") for p in procs]),
        cgroup_mb=_cgroup_mb(),
        mem_available_mb=_available_mb(),
        pinned_mb=pinned,
        pinned_in_use_mb=in_use,
        seconds=None if seconds is None else round(seconds, 3),
        rss_shmem_kb=_sum([_status_kb(p, "RssShmem") for p in procs]),
        shmem_kb=_meminfo_kb("Shmem"),
        cgroup_shmem_mb=_cgroup_shmem_mb(),
    )
