"""Simulated GPUs: a memory ledger shared between processes, and a pynvml stand-in reading it.

A test kit, not part of the proxy. It lets the proxy's real NVML code and vLLM 0.33's memory rules
run on a machine without a GPU: the fake engine (``FAKE_ENGINE_SIM_GPU=<ledger>``, see
``simengine.py``) holds memory in the ledger the way vLLM 0.33 holds it on a device, test code
plays the neighbours, and the proxy reads the ledger through ``simgpu_nvml/pynvml.py``.

The ledger is one JSON file: the devices (total MiB, name, MIG flag, UUID), allocations keyed by
(pid, device, tag), host memory pinned per (pid, tag), and a per-device history of
``(time.monotonic(), pid, delta_mb, tag)`` events so tests can assert on order. Every
read-modify-write holds ``fcntl.flock`` on ``<ledger>.lock`` and replaces the file atomically.
Like a driver, the ledger forgets the memory of processes that no longer exist (or are zombies)
on every access; any live pid may allocate, so a test process can play a neighbour.

vLLM 0.33 rules the fake engine reproduces (paths under ``vllm/`` in the vLLM 0.33.0 source;
sizes are the ``FAKE_ENGINE_SIM_*`` knobs):

* The CUDA context (and NCCL, cuBLAS) is created before the free-memory snapshot, so it is outside
  the ``--gpu-memory-utilization`` budget (``v1/worker/gpu_worker.py:499-547``).
* Startup check: free memory after the engine's own context must be at least
  ``ceil(util x total)``, else "Free memory on device ... less than desired GPU memory
  utilization" (``v1/worker/utils.py:716-770``).
* Profiling measures a device-wide free-memory delta over weight loading, the profile run and
  the CUDA-graph estimate (``utils/mem_utils.py:312-314``), so a neighbour allocating in that
  window shrinks the KV cache and one freeing memory enlarges it, or, when it frees more than the
  engine took, fails the start with "Error in memory profiling" (``gpu_worker.py:732-740``).
* The transient peak (``FAKE_ENGINE_SIM_PEAK_MB``, tag ``activation``: Model Runner V2's profile,
  the forward pass of ``max_num_batched_tokens`` then a default and a warm-up sampler pass,
  ``v1/worker/gpu/model_runner.py:993-1048``; V2 is the default, ``config/vllm.py:731-767``)
  counts in the non-KV memory (torch's peak less what is allocated, ``utils/mem_utils.py:
  318-321``) but lives in torch's caching allocator: profiling ends by emptying that cache
  (``:298-299``), so the ready engine holds its budget less the peak. Every sleep and every wake
  empties the cache again (``device_allocator/cumem.py:297-298,342-343``); the wake does not
  bring the peak back. The engine's first batch of at least ``FAKE_ENGINE_SIM_PEAK_TOKENS``
  tokens (running requests' prompts and replies; default 0: its first request) regrows it.
  vLLM's start-up warm-up regrows part of it (V2's ``warmup_kernels`` before the graph capture,
  ``gpu_worker.py:984-989``); the fake leaves that out, as every sleep releases it anyway.
* A peak that cannot be regrown (a neighbour took the room) is a ``torch.OutOfMemoryError`` in
  the forward pass: the EngineCore dies ("EngineCore encountered a fatal error.",
  ``v1/engine/core.py:1582-1587``), the request gets vLLM's 500 ("The server had an error while
  processing your request.", ``entrypoints/serve/exception_handling/error_response.py:68-72``),
  and the server shuts down (``entrypoints/serve/exception_handling/handlers/vllm_error.py:
  61-66``): the fake exits 1 after logging the CUDA out-of-memory line.
* KV cache = requested - non-KV - the CUDA graphs' estimate (``FAKE_ENGINE_SIM_GRAPHS_ESTIMATE_MB``,
  default exact; ``gpu_worker.py:705-757``); ``--kv-cache-memory-bytes``
  replaces that size (``gpu_worker.py:659-670``); too little left is "No available memory for
  the cache blocks" (``v1/core/kv_cache_planning.py:56-85``).
* World size = tp x pp x pcp GPUs; fewer visible ones is "World size (N) is larger than the
  number of available GPUs (M)" (``config/parallel.py:964-968,1066-1078``).
* ``/sleep`` is registered by ``VLLM_SERVER_DEV_MODE=1`` alone
  (``entrypoints/launchers/api_server/routers.py:46-49``); only ``--enable-sleep-mode`` (the
  CuMem allocator, ``config/model.py:666-673``) makes it free anything.
* The CUDA graphs are captured after the KV cache is allocated (``gpu_worker.py:995-1010``):
  graphs larger than their estimate take memory beyond the budget, or fail the start with
  torch's out-of-memory error where the device has no room left.
* The CuMem pools hold the weights, ``runtime`` (``FAKE_ENGINE_SIM_RUNTIME_MB``: model-runner
  state and the LoRA slots, ``v1/worker/lora_model_runner_mixin.py:57-63``), ``workspace``
  (``FAKE_ENGINE_SIM_WORKSPACE_MB``: scratch, ``gpu_worker.py:557-564``), the KV cache, and the
  CUDA graphs only with ``--sleep-mode-offload-cudagraph`` (``config/model.py:384-386``,
  ``config/vllm.py:716-727``); the context and unpooled graphs always stay on the device.
* The weights pool is filled inside ``load_model`` with ``max_split_size_mb=20``
  (``gpu_worker.py:594-600``): the checkpoint's tensors (``FAKE_ENGINE_SIM_WEIGHT_SEGMENTS_MB``)
  and Model Runner V2's sampler state, built there too (``v1/worker/gpu/model_runner.py:
  467-495``): ``prompt_bin_mask`` and ``output_bin_counts``, ``--max-num-seqs x vocab`` int32
  (``FAKE_ENGINE_SIM_VOCAB``; ``v1/worker/gpu/sample/penalties.py:43-50``). Each CuMem
  allocation is one of torch's segments, not one tensor: tensors up to 1 MiB share 2 MiB
  segments, under 10 MiB 20 MiB ones, larger ones get their own rounded up to 2 MiB (PyTorch's
  ``CUDACachingAllocator``, as read in its source).
* A sleep goes allocation by allocation: back up the offloaded ones into pinned host memory,
  unmap (``device_allocator/cumem.py:256-280``). Level 1 offloads weights (the sampler state
  with them), ``runtime`` and pooled graphs, level 2 only ``runtime`` and pooled graphs; the KV
  cache and ``workspace`` are discarded, never pinned
  (``device_allocator/sleep_mode_backend.py:133-137``).
* A level-2 sleep first copies the model's buffers and preserved parameters to pageable host
  memory (``FAKE_ENGINE_SIM_BUFFERS_MB`` per rank, ``gpu_worker.py:287-312``; ``Ledger.host_mb``
  counts it, ``pinned_mb`` does not), dropped once the weights wake (``:352-357``).
* Each backup (one per segment) is its own ``torch.empty(..., pin_memory=True)``
  (``cumem.py:268-273``) from
  PyTorch's CachingHostAllocator, which rounds it up to a power of two and keeps freed blocks
  cached: the wake drops the backup (``cumem.py:360``) but the block stays pinned, and a later
  sleep reuses it (vLLM never empties that cache). The rounding is PyTorch's
  ``CachingHostAllocator`` as read in its source, unverified for torch 2.14. ``Ledger.pinned_mb``
  is what an engine pins.
* Sleep measures a device-wide delta too and asserts "Memory usage increased after sleeping."
  (``gpu_worker.py:334``), then logs "Sleep mode freed ... still in use." (``:335-339``).
* A sleep that fails after memory was unmapped (that assertion, or a pinned allocation that
  fails midway) never sets the executor's sleeping tags (``v1/executor/abstract.py:400-407``):
  ``/is_sleeping`` stays true while the scheduler is paused (``v1/engine/core.py:1078-1080``),
  ``/wake_up`` maps nothing ("Executor is not sleeping", ``abstract.py:412-415``) and resumes
  scheduling, and the next forward pass reads unmapped memory: the fake dies as above with
  "CUDA error: an illegal memory access was encountered" (the error CUDA gives for an
  unmapped address; unverified on hardware). Such an engine must be replaced.
* A wake empties torch's cache, then maps the asleep allocations of its tags and every
  non-deferrable one (``runtime``, ``workspace``, pooled graphs:
  ``device_allocator/__init__.py:17``, ``cumem.py:348``) one by one, with no rollback: a failed
  wake keeps what it mapped (``cumem.py:342-364``).
* Requests sent while asleep are queued until the wake ("All pause modes queue new adds",
  ``v1/engine/core.py:2186``; ``v1/core/sched/scheduler.py:1065-1067``).
* A level-2 wake needs ``wake_up?tags=weights``, ``collective_rpc reload_weights`` (re-reads
  the checkpoint: ``gpu_worker.py:636-638``, ``model_executor/model_loader/reload/inplace.py:
  31-100``), then ``wake_up?tags=kv_cache``. The reload materialises each module in torch's
  default allocator (``model_executor/model_loader/reload/layerwise.py:344-402``): its
  temporaries (``FAKE_ENGINE_SIM_RELOAD_TEMP_MB``) can fail a reload on a full device, and stay
  cached until the ``kv_cache`` wake empties the cache before mapping (``cumem.py:342-343``).
* LoRA adapters stay registered across sleeps of both levels (``entrypoints/openai/models/
  serving.py:167-230``; the worker reloads them lazily, ``v1/worker/lora_model_runner_mixin.py:
  31-41``).

Not modelled: MIG slices (only ``nvmlDeviceGetMigMode`` reports the mode), driver-reserved
memory, utilisation, NCCL and model-runner buffers outside the pools, V2's pinned token buffer
(host memory pinned at start), and the peak's dependence on ``max_num_seqs`` and the
vocabulary.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import tempfile
import time
import types
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import psutil

MIB = 1024 * 1024
HISTORY_LIMIT = 10_000
#: The host-memory tag of pageable (not pinned) copies: resident, never counted as pinned.
PAGEABLE = "pageable"
DEFAULT_NAME = "Simulated GPU"
UUID_NAMESPACE = uuid.UUID("6c1b7a52-3e0f-4d8e-9a57-5d2f3c9b0e11")

T = TypeVar("T")


class SimOutOfMemory(Exception):
    """An allocation that does not fit; the message reads like CUDA's (torch's) own."""


class Event(NamedTuple):
    """One change on a device: when (``time.monotonic()``, system-wide), who, MiB (+/-), tag.

    A zero delta is a marker (``Ledger.mark``) a process leaves to say where it stands.
    """

    time: float
    pid: int
    delta_mb: int
    tag: str


@dataclass(frozen=True)
class DeviceSpec:
    """A simulated device as created: its size and what NVML says about it."""

    index: int
    total_mb: int
    name: str = DEFAULT_NAME
    mig: bool = False
    uuid: str = ""


@dataclass(frozen=True)
class DeviceReading:
    """One device now: MiB totals and MiB held by each live process."""

    id: int
    total_mb: int
    used_mb: int
    free_mb: int
    processes: dict[int, int] = field(default_factory=dict)


def device_uuid(index: int) -> str:
    """The stable UUID of device ``index`` when none was given: ``GPU-xxxxxxxx-...``."""
    return f"GPU-{uuid.uuid5(UUID_NAMESPACE, f'simgpu-{index}')}"


def format_size(mb: float) -> str:
    """MiB as torch prints sizes in its out-of-memory message (MiB below 1 GiB, else GiB)."""
    if abs(mb) < 1024:
        return f"{mb:.2f} MiB"
    return f"{mb / 1024:.2f} GiB"


def alive(pid: int) -> bool:
    """True for a process that exists and is not a zombie (whose memory a driver has freed)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


# --------------------------------------------------------------------------- ledger state


@dataclass
class _State:
    """The decoded ledger file; only `Ledger` touches it, under the lock."""

    devices: list[DeviceSpec]
    host_mb: int
    per_process: bool
    allocations: dict[tuple[int, int, str], int]
    pinned: dict[tuple[int, str], int]
    history: list[list[Event]]

    @classmethod
    def decode(cls, data: dict[str, Any]) -> _State:
        return cls(
            devices=[DeviceSpec(**d) for d in data["devices"]],
            host_mb=int(data["host_mb"]),
            per_process=bool(data["per_process"]),
            allocations={(p, d, t): mb for p, d, t, mb in data["allocations"]},
            pinned={(p, t): mb for p, t, mb in data["pinned"]},
            history=[[Event(*e) for e in events] for events in data["history"]],
        )

    def encode(self) -> dict[str, Any]:
        return {
            "devices": [vars(d) for d in self.devices],
            "host_mb": self.host_mb,
            "per_process": self.per_process,
            "allocations": [[p, d, t, mb] for (p, d, t), mb in self.allocations.items()],
            "pinned": [[p, t, mb] for (p, t), mb in self.pinned.items()],
            "history": [[list(e) for e in events[-HISTORY_LIMIT:]] for events in self.history],
        }

    def used_mb(self, device: int) -> int:
        return sum(mb for (_, d, _), mb in self.allocations.items() if d == device)

    def tags(self, pid: int, device: int) -> dict[str, int]:
        return {t: mb for (p, d, t), mb in self.allocations.items() if (p, d) == (pid, device)}

    def record(self, device: int, pid: int, delta_mb: int, tag: str) -> None:
        self.history[device].append(Event(time.monotonic(), pid, delta_mb, tag))

    def drop_dead(self) -> bool:
        """Forget the memory of processes that are gone, as the driver does; True if any."""
        pids = {p for p, _, _ in self.allocations} | {p for p, _ in self.pinned}
        dead = {pid for pid in pids if not alive(pid)}
        for pid in dead:
            self.drop(pid)
        return bool(dead)

    def drop(self, pid: int) -> None:
        """Free all of ``pid``'s device memory (recorded per tag) and unpin its host memory."""
        for key in [k for k in self.allocations if k[0] == pid]:
            self.record(key[1], pid, -self.allocations.pop(key), key[2])
        for pinned in [k for k in self.pinned if k[0] == pid]:
            del self.pinned[pinned]


# --------------------------------------------------------------------------- ledger


class Ledger:
    """The simulated devices in the JSON file at ``path``, shared by every process using it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"no simulated-GPU ledger at {self.path}")
        self._lock_path = self.path.with_name(self.path.name + ".lock")

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        devices: list[dict[str, Any]],
        host_mb: int = 65536,
        per_process: bool = True,
    ) -> Ledger:
        """Write a new ledger with ``devices`` (dicts: total_mb, name, mig, uuid) and open it.

        ``per_process=False`` plays a container where NVML lists no per-process memory.
        """
        specs = [_device_spec(i, d) for i, d in enumerate(devices)]
        state = _State(specs, host_mb, per_process, {}, {}, [[] for _ in specs])
        target = Path(path)
        _write_atomically(target, state.encode())
        return cls(target)

    @contextmanager
    def _locked(self) -> Iterator[_State]:
        """The state under the lock, with dead processes dropped; written back on exit."""
        with open(self._lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = _State.decode(json.loads(self.path.read_text()))
            state.drop_dead()
            yield state
            _write_atomically(self.path, state.encode())

    def _view(self, read: Callable[[_State], T]) -> T:
        """Read the state under the lock, writing only when dead processes were dropped."""
        with open(self._lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = _State.decode(json.loads(self.path.read_text()))
            if state.drop_dead():
                _write_atomically(self.path, state.encode())
            return read(state)

    # -- devices

    def devices(self) -> list[DeviceSpec]:
        return self._view(lambda s: list(s.devices))

    @property
    def per_process(self) -> bool:
        return self._view(lambda s: s.per_process)

    def read(self) -> list[DeviceReading]:
        """Every device now, with the MiB each live process holds there."""
        return self._view(_readings)

    def free_mb(self, device: int) -> int:
        return self.read()[device].free_mb

    def history(self, device: int) -> list[Event]:
        """Every allocation, free and marker on ``device``, oldest first."""
        return self._view(lambda s: list(s.history[_check(s, device)]))

    # -- device memory

    def allocate(self, pid: int, device: int, mb: int, tag: str) -> None:
        """Add ``mb`` MiB to (pid, device, tag); `SimOutOfMemory` when the device is too full."""
        if mb < 0:
            raise ValueError(f"cannot allocate {mb} MiB")
        with self._locked() as state:
            spec = state.devices[_check(state, device)]
            free = spec.total_mb - state.used_mb(device)
            if mb > free:
                mine = sum(state.tags(pid, device).values())
                raise SimOutOfMemory(_oom_message(device, mb, spec.total_mb, free, mine))
            key = (pid, device, tag)
            state.allocations[key] = state.allocations.get(key, 0) + mb
            state.record(device, pid, mb, tag)

    def free(self, pid: int, device: int, tag: str, mb: int | None = None) -> int:
        """Free ``mb`` MiB (all when None) of (pid, device, tag); returns the MiB freed."""
        with self._locked() as state:
            key = (pid, _check(state, device), tag)
            held = state.allocations.get(key, 0)
            freed = held if mb is None else min(mb, held)
            if freed == held:
                state.allocations.pop(key, None)
            else:
                state.allocations[key] = held - freed
            if freed:
                state.record(device, pid, -freed, tag)
            return freed

    def mark(self, pid: int, device: int, tag: str) -> None:
        """Leave a zero-delta event in the history, so others can wait for this moment."""
        with self._locked() as state:
            state.record(_check(state, device), pid, 0, tag)

    def release(self, pid: int) -> None:
        """Drop everything ``pid`` holds, on the devices and pinned on the host."""
        with self._locked() as state:
            state.drop(pid)

    def held(self, pid: int) -> dict[int, int]:
        """MiB ``pid`` holds per device (devices where it holds nothing are left out)."""

        def read(state: _State) -> dict[int, int]:
            out: dict[int, int] = {}
            for (p, d, _), mb in state.allocations.items():
                if p == pid:
                    out[d] = out.get(d, 0) + mb
            return out

        return self._view(read)

    def tags(self, pid: int, device: int) -> dict[str, int]:
        """MiB ``pid`` holds on ``device`` per tag."""

        return self._view(lambda s: s.tags(pid, device))

    # -- pinned host memory

    def pin(self, pid: int, mb: int, tag: str) -> None:
        """Pin ``mb`` MiB of host memory for (pid, tag); `SimOutOfMemory` past ``host_mb``."""
        with self._locked() as state:
            free = state.host_mb - sum(state.pinned.values())
            if mb > free:
                what = "copying" if tag == PAGEABLE else "pinning"
                raise SimOutOfMemory(
                    f"CUDA error: out of memory ({what} {format_size(mb)} of host memory, "
                    f"{format_size(free)} of {format_size(state.host_mb)} free)"
                )
            state.pinned[(pid, tag)] = state.pinned.get((pid, tag), 0) + mb

    def unpin(self, pid: int, tag: str) -> int:
        """Unpin (pid, tag); returns the MiB released."""
        with self._locked() as state:
            return state.pinned.pop((pid, tag), 0)

    def pinned_mb(self, pid: int | None = None) -> int:
        """Pinned host MiB, of ``pid`` or of every process (`PAGEABLE` copies left out)."""
        return self._view(
            lambda s: sum(
                mb for (p, t), mb in s.pinned.items() if (pid is None or p == pid) and t != PAGEABLE
            )
        )

    def host_mb(self, pid: int | None = None) -> int:
        """Resident host MiB the ledger knows of, pinned and `PAGEABLE`, of ``pid`` or all."""
        return self._view(
            lambda s: sum(mb for (p, _), mb in s.pinned.items() if pid is None or p == pid)
        )


def _device_spec(index: int, data: dict[str, Any]) -> DeviceSpec:
    total = int(data["total_mb"])
    if total <= 0:
        raise ValueError(f"device {index}: total_mb must be positive, got {total}")
    return DeviceSpec(
        index=index,
        total_mb=total,
        name=str(data.get("name") or DEFAULT_NAME),
        mig=bool(data.get("mig", False)),
        uuid=str(data.get("uuid") or device_uuid(index)),
    )


def _check(state: _State, device: int) -> int:
    if not 0 <= device < len(state.devices):
        raise IndexError(f"no simulated device {device} (there are {len(state.devices)})")
    return device


def _readings(state: _State) -> list[DeviceReading]:
    out = []
    for spec in state.devices:
        processes: dict[int, int] = {}
        for (pid, device, _), mb in state.allocations.items():
            if device == spec.index:
                processes[pid] = processes.get(pid, 0) + mb
        used = sum(processes.values())
        out.append(DeviceReading(spec.index, spec.total_mb, used, spec.total_mb - used, processes))
    return out


def _oom_message(device: int, mb: int, total: int, free: int, mine: int) -> str:
    return (
        f"CUDA out of memory. Tried to allocate {format_size(mb)}. GPU {device} has a total "
        f"capacity of {format_size(total)} of which {format_size(free)} is free. Including "
        f"non-PyTorch memory, this process has {format_size(mine)} memory in use."
    )


def _write_atomically(path: Path, data: dict[str, Any]) -> None:
    """Write to a temporary file beside ``path`` and rename it over, so readers never see half."""
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(data, out)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def ceil_mb(nbytes: float) -> int:
    """Bytes rounded up to whole MiB."""
    return math.ceil(nbytes / MIB)


# --------------------------------------------------------------------------- pynvml stand-in


class NVMLError(Exception):
    """pynvml's error: ``value`` is the NVML return code, ``str()`` its NVML name."""

    value = 999
    text = "Unknown Error"

    def __str__(self) -> str:
        return self.text


class NVMLError_Uninitialized(NVMLError):
    value = 1
    text = "Uninitialized"


class NVMLError_InvalidArgument(NVMLError):
    value = 2
    text = "Invalid Argument"


class NVMLError_NotSupported(NVMLError):
    value = 3
    text = "Not Supported"


class NVMLError_NotFound(NVMLError):
    value = 6
    text = "Not Found"


class NVMLError_DriverNotLoaded(NVMLError):
    value = 9
    text = "Driver Not Loaded"


@dataclass(frozen=True)
class _Handle:
    """What ``nvmlDeviceGetHandleByIndex`` returns: the device index."""

    index: int


def nvml_module(ledger_path: str | os.PathLike[str]) -> types.SimpleNamespace:
    """An object with the pynvml calls the proxy (and MIG/UUID detection) makes, over a ledger.

    Each call reads the ledger anew, so it sees other processes' allocations. ``nvmlInit``
    raises `NVMLError` (Driver Not Loaded) when the ledger is missing; calls before it raise
    ``NVMLError_Uninitialized``. Inits are counted like NVML's.
    """
    path = Path(ledger_path) if str(ledger_path) else None
    inits = [0]

    def ledger() -> Ledger:
        if inits[0] <= 0 or path is None:
            raise NVMLError_Uninitialized()
        try:
            return Ledger(path)
        except FileNotFoundError:
            raise NVMLError_DriverNotLoaded() from None

    def nvmlInit() -> None:
        if path is None or not path.exists():
            raise NVMLError_DriverNotLoaded()
        inits[0] += 1

    def nvmlShutdown() -> None:
        if inits[0] <= 0:
            raise NVMLError_Uninitialized()
        inits[0] -= 1

    def spec(handle: _Handle) -> DeviceSpec:
        devices = ledger().devices()
        if not isinstance(handle, _Handle) or handle.index >= len(devices):
            raise NVMLError_InvalidArgument()
        return devices[handle.index]

    def reading(handle: _Handle) -> DeviceReading:
        readings = ledger().read()
        if not isinstance(handle, _Handle) or handle.index >= len(readings):
            raise NVMLError_InvalidArgument()
        return readings[handle.index]

    def nvmlDeviceGetCount() -> int:
        return len(ledger().devices())

    def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
        if not 0 <= index < nvmlDeviceGetCount():
            raise NVMLError_InvalidArgument()
        return _Handle(index)

    def nvmlDeviceGetHandleByUUID(text: str | bytes) -> _Handle:
        wanted = text.decode() if isinstance(text, bytes) else text
        for device in ledger().devices():
            if device.uuid == wanted:
                return _Handle(device.index)
        raise NVMLError_NotFound()

    def nvmlDeviceGetIndex(handle: _Handle) -> int:
        return spec(handle).index

    def nvmlDeviceGetMemoryInfo(handle: _Handle) -> types.SimpleNamespace:
        now = reading(handle)
        return types.SimpleNamespace(
            total=now.total_mb * MIB, used=now.used_mb * MIB, free=now.free_mb * MIB
        )

    def nvmlDeviceGetUtilizationRates(handle: _Handle) -> types.SimpleNamespace:
        reading(handle)
        return types.SimpleNamespace(gpu=0, memory=0)

    def nvmlDeviceGetComputeRunningProcesses(handle: _Handle) -> list[types.SimpleNamespace]:
        per_process, readings = ledger()._view(lambda s: (s.per_process, _readings(s)))
        if not isinstance(handle, _Handle) or handle.index >= len(readings):
            raise NVMLError_InvalidArgument()
        if not per_process:
            return []
        now = readings[handle.index]
        return [
            types.SimpleNamespace(pid=pid, usedGpuMemory=mb * MIB)
            for pid, mb in sorted(now.processes.items())
        ]

    def nvmlDeviceGetName(handle: _Handle) -> str:
        return spec(handle).name

    def nvmlDeviceGetUUID(handle: _Handle) -> str:
        return spec(handle).uuid

    def nvmlDeviceGetMigMode(handle: _Handle) -> list[int]:
        mode = int(spec(handle).mig)
        return [mode, mode]

    def nvmlSystemGetDriverVersion() -> str:
        ledger()
        return "999.99-simgpu"

    return types.SimpleNamespace(
        NVMLError=NVMLError,
        NVMLError_Uninitialized=NVMLError_Uninitialized,
        NVMLError_InvalidArgument=NVMLError_InvalidArgument,
        NVMLError_NotSupported=NVMLError_NotSupported,
        NVMLError_NotFound=NVMLError_NotFound,
        NVMLError_DriverNotLoaded=NVMLError_DriverNotLoaded,
        NVML_DEVICE_MIG_DISABLE=0,
        NVML_DEVICE_MIG_ENABLE=1,
        nvmlInit=nvmlInit,
        nvmlShutdown=nvmlShutdown,
        nvmlDeviceGetCount=nvmlDeviceGetCount,
        nvmlDeviceGetHandleByIndex=nvmlDeviceGetHandleByIndex,
        nvmlDeviceGetHandleByUUID=nvmlDeviceGetHandleByUUID,
        nvmlDeviceGetIndex=nvmlDeviceGetIndex,
        nvmlDeviceGetMemoryInfo=nvmlDeviceGetMemoryInfo,
        nvmlDeviceGetUtilizationRates=nvmlDeviceGetUtilizationRates,
        nvmlDeviceGetComputeRunningProcesses=nvmlDeviceGetComputeRunningProcesses,
        nvmlDeviceGetName=nvmlDeviceGetName,
        nvmlDeviceGetUUID=nvmlDeviceGetUUID,
        nvmlDeviceGetMigMode=nvmlDeviceGetMigMode,
        nvmlSystemGetDriverVersion=nvmlSystemGetDriverVersion,
    )
