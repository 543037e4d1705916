"""The simulated GPU: the ledger, the pynvml stand-in, and the fake engine's vLLM 0.33 memory rules.

Pure tests use the ledger and ``nvml_module`` in-process. Component tests run the fake engine as a
real subprocess with ``FAKE_ENGINE_SIM_GPU=<ledger>``; the test process plays the neighbour on
the same device by allocating in the ledger under its own pid. Windows the engine measures across
(profiling, sleep) are found through the ledger's history, never by sleeping.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kit import FakeEngine, free_port, wait_for

from fake_vllm.simgpu import (
    MIB,
    Ledger,
    NVMLError,
    NVMLError_InvalidArgument,
    NVMLError_Uninitialized,
    SimOutOfMemory,
    device_uuid,
    nvml_module,
)
from vllm_proxy.planning.gpu import NvmlMonitor

ROOT = Path(__file__).resolve().parents[2]
NVML_DIR = ROOT / "fake_vllm" / "simgpu_nvml"
ME = os.getpid()
CONTEXT, WEIGHTS, RUNTIME, PEAK, GRAPHS = 512, 1024, 64, 256, 256
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
NORMAL_TEXT = "".join(f"tok{i} " for i in range(8))
GARBAGE_TEXT = "<garbage> " * 8
FAST = FakeEngine(sim_profile_s=0, sim_sleep_s=0).env()


def make_ledger(tmp_path: Path, *totals: int, **options: Any) -> Ledger:
    return Ledger.create(tmp_path / "gpus.json", [{"total_mb": t} for t in totals], **options)


def holder() -> subprocess.Popen[bytes]:
    """A live process that exits when its stdin closes: a pid the ledger can see die."""
    code = "import sys; sys.stdin.read()"
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)


# --------------------------------------------------------------------------- ledger


def test_ledger_allocates_frees_and_keeps_a_history(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path, 8192, 4096)
    ledger.allocate(ME, 0, 1000, "weights")
    ledger.allocate(ME, 0, 500, "weights")
    ledger.allocate(ME, 1, 300, "kv_cache")
    assert ledger.held(ME) == {0: 1500, 1: 300}
    assert ledger.tags(ME, 0) == {"weights": 1500}
    assert ledger.free(ME, 0, "weights", 200) == 200
    assert ledger.free(ME, 1, "kv_cache") == 300
    assert ledger.free(ME, 1, "kv_cache") == 0
    readings = ledger.read()
    assert [(r.id, r.total_mb, r.used_mb, r.free_mb) for r in readings] == [
        (0, 8192, 1300, 6892),
        (1, 4096, 0, 4096),
    ]
    assert readings[0].processes == {ME: 1300}
    events = ledger.history(0)
    assert [(e.pid, e.delta_mb, e.tag) for e in events] == [
        (ME, 1000, "weights"),
        (ME, 500, "weights"),
        (ME, -200, "weights"),
    ]
    assert events == sorted(events, key=lambda e: e.time)
    assert Ledger(ledger.path).held(ME) == {0: 1300}


def test_an_allocation_that_does_not_fit_is_refused_like_cuda(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path, 2048)
    ledger.allocate(ME, 0, 1536, "weights")
    with pytest.raises(SimOutOfMemory) as caught:
        ledger.allocate(ME, 0, 1024, "kv_cache")
    assert str(caught.value).startswith(
        "CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 2.00 GiB "
        "of which 512.00 MiB is free."
    )
    assert ledger.held(ME) == {0: 1536}
    with pytest.raises(ValueError):
        ledger.allocate(ME, 0, -1, "weights")
    with pytest.raises(IndexError):
        ledger.allocate(ME, 1, 1, "weights")
    with pytest.raises(FileNotFoundError):
        Ledger(tmp_path / "missing.json")


def test_memory_of_a_dead_or_zombie_process_is_dropped(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path, 8192)
    zombie, exited = holder(), holder()
    try:
        ledger.allocate(zombie.pid, 0, 1000, "weights")
        ledger.allocate(exited.pid, 0, 2000, "kv_cache")
        ledger.pin(exited.pid, 700, "weights")
        assert ledger.read()[0].used_mb == 3000
        os.kill(zombie.pid, signal.SIGKILL)  # not reaped yet: a zombie
        wait_for_exit_without_reaping(zombie)
        assert ledger.held(zombie.pid) == {}
        assert exited.stdin is not None
        exited.stdin.close()
        exited.wait(10)
        assert ledger.read()[0].used_mb == 0
        assert ledger.pinned_mb() == 0
        freed = [(e.pid, e.delta_mb, e.tag) for e in ledger.history(0) if e.delta_mb < 0]
        assert sorted(freed) == sorted(
            [(zombie.pid, -1000, "weights"), (exited.pid, -2000, "kv_cache")]
        )
    finally:
        for proc in (zombie, exited):
            proc.kill()
            proc.wait(10)
            if proc.stdin is not None:
                proc.stdin.close()


def wait_for_exit_without_reaping(proc: subprocess.Popen[bytes]) -> None:
    """Block until ``proc`` has exited, leaving it a zombie."""
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)


def test_release_and_host_pinning(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path, 8192, 8192, host_mb=2048)
    ledger.allocate(ME, 0, 100, "weights")
    ledger.allocate(ME, 1, 100, "weights")
    ledger.pin(ME, 1500, "weights")
    assert ledger.pinned_mb() == ledger.pinned_mb(ME) == 1500
    with pytest.raises(SimOutOfMemory, match="out of memory"):
        ledger.pin(ME, 600, "runtime")
    assert ledger.unpin(ME, "weights") == 1500
    ledger.pin(ME, 600, "runtime")
    ledger.release(ME)
    assert ledger.held(ME) == {}
    assert ledger.pinned_mb() == 0
    assert [e.delta_mb for e in ledger.history(1)] == [100, -100]


def test_processes_sharing_a_ledger_lose_no_update(tmp_path: Path) -> None:
    """Read-modify-writes from several processes at once are serialised by the lock."""
    ledger = make_ledger(tmp_path, 65536)
    code = (
        "import sys; from fake_vllm.simgpu import Ledger\n"
        "ledger = Ledger(sys.argv[1])\n"
        "for _ in range(50): ledger.allocate(int(sys.argv[2]), 0, 10, sys.argv[3])\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(ledger.path), str(ME), f"p{i}"], cwd=ROOT)
        for i in range(4)
    ]
    assert [p.wait(30) for p in procs] == [0, 0, 0, 0]
    assert ledger.tags(ME, 0) == {f"p{i}": 500 for i in range(4)}
    assert len(ledger.history(0)) == 200


# --------------------------------------------------------------------------- pynvml stand-in


def test_nvml_module_reads_the_ledger_in_bytes(tmp_path: Path) -> None:
    ledger = Ledger.create(
        tmp_path / "gpus.json",
        [{"total_mb": 8192, "name": "Sim H100"}, {"total_mb": 4096, "mig": True, "uuid": "GPU-x"}],
    )
    ledger.allocate(ME, 0, 1000, "weights")
    nvml = nvml_module(ledger.path)
    nvml.nvmlInit()
    assert nvml.nvmlDeviceGetCount() == 2
    h0, h1 = (nvml.nvmlDeviceGetHandleByIndex(i) for i in range(2))
    mem = nvml.nvmlDeviceGetMemoryInfo(h0)
    assert (mem.total, mem.used, mem.free) == (8192 * MIB, 1000 * MIB, 7192 * MIB)
    procs = nvml.nvmlDeviceGetComputeRunningProcesses(h0)
    assert [(p.pid, p.usedGpuMemory) for p in procs] == [(ME, 1000 * MIB)]
    assert nvml.nvmlDeviceGetComputeRunningProcesses(h1) == []
    assert nvml.nvmlDeviceGetUtilizationRates(h0).gpu == 0
    assert nvml.nvmlDeviceGetName(h0) == "Sim H100"
    assert nvml.nvmlDeviceGetName(h1) == "Simulated GPU"
    assert nvml.nvmlDeviceGetUUID(h0) == device_uuid(0)
    assert re.fullmatch(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", device_uuid(0))
    assert nvml.nvmlDeviceGetUUID(h1) == "GPU-x"
    assert nvml.nvmlDeviceGetIndex(nvml.nvmlDeviceGetHandleByUUID("GPU-x")) == 1
    assert nvml.nvmlDeviceGetMigMode(h0) == [nvml.NVML_DEVICE_MIG_DISABLE] * 2
    assert nvml.nvmlDeviceGetMigMode(h1) == [nvml.NVML_DEVICE_MIG_ENABLE] * 2
    other = Ledger.create(tmp_path / "other.json", [{"total_mb": 1}])
    again = nvml_module(other.path)
    again.nvmlInit()
    assert again.nvmlDeviceGetUUID(again.nvmlDeviceGetHandleByIndex(0)) == device_uuid(0)
    nvml.nvmlShutdown()


def test_nvml_module_errors_like_pynvml(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path, 8192)
    nvml = nvml_module(ledger.path)
    with pytest.raises(NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()
    with pytest.raises(NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(nvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetHandleByUUID("GPU-nope")
    nvml.nvmlShutdown()
    with pytest.raises(nvml.NVMLError) as caught:
        nvml.nvmlDeviceGetCount()
    assert str(caught.value) == "Uninitialized"
    missing = nvml_module(tmp_path / "missing.json")
    with pytest.raises(NVMLError):
        missing.nvmlInit()
    assert not NvmlMonitor.available(missing)


def test_containers_without_per_process_memory_list_no_process(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path, 8192, per_process=False)
    ledger.allocate(ME, 0, 1000, "weights")
    snapshot = NvmlMonitor(nvml=nvml_module(ledger.path)).read()[0]
    assert (snapshot.used_mb, snapshot.free_mb, snapshot.processes) == (1000, 7192, {})


def test_the_proxy_monitor_reads_the_ledger_in_process(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path, 8192, 4096)
    ledger.allocate(ME, 1, 300, "weights")
    monitor = NvmlMonitor(nvml=nvml_module(ledger.path))
    snapshots = monitor.read()
    monitor.close()
    assert [(s.id, s.total_mb, s.used_mb, s.free_mb) for s in snapshots] == [
        (0, 8192, 0, 8192),
        (1, 4096, 300, 3796),
    ]
    assert snapshots[1].processes == {ME: 300}


def test_a_subprocess_imports_the_stand_in_as_pynvml(tmp_path: Path) -> None:
    """PYTHONPATH=fake_vllm/simgpu_nvml and SIMGPU_LEDGER make the proxy's NVML code read it."""
    ledger = make_ledger(tmp_path, 8192)
    ledger.allocate(ME, 0, 1000, "weights")
    code = (
        "import json, pynvml\n"
        "from vllm_proxy.planning.gpu import NvmlMonitor\n"
        "s = NvmlMonitor().read()[0]\n"
        "print(json.dumps([pynvml.__file__, s.used_mb, s.processes]))\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(NVML_DIR), str(ROOT)]),
        "SIMGPU_LEDGER": str(ledger.path),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, timeout=30
    )
    assert out.returncode == 0, out.stderr.decode()
    assert json.loads(out.stdout) == [str(NVML_DIR / "pynvml.py"), 1000, {str(ME): 1000}]


# --------------------------------------------------------------------------- the engine


@dataclass
class SimEngine:
    proc: subprocess.Popen[bytes]
    port: int
    logs: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        return (self.logs / "stderr.log").read_text()

    def stdout(self) -> str:
        return (self.logs / "stdout.log").read_text()


StartEngine = Callable[..., SimEngine]


@pytest.fixture
def start_engine(tmp_path: Path) -> Iterator[StartEngine]:
    """Start fake engines on a ledger: ``start(ledger, *args, **env)``; killed after the test."""
    started: list[SimEngine] = []

    def start(ledger: Ledger, *args: str, **env: str) -> SimEngine:
        prefixes = ("FAKE_ENGINE_", "VLLM_", "CUDA_VISIBLE_DEVICES", "SIMGPU_")
        base = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
        port = free_port()
        logs = tmp_path / f"engine{len(started)}"
        logs.mkdir()
        command = [sys.executable, "-m", "fake_vllm", "--model", "m", "--port", str(port)]
        full_env = {
            **base,
            "PYTHONPATH": str(ROOT),
            **FakeEngine(sim_gpu=ledger.path).env(),
            "VLLM_SERVER_DEV_MODE": "1",
            **env,
        }
        with open(logs / "stdout.log", "wb") as out, open(logs / "stderr.log", "wb") as err:
            proc = subprocess.Popen(
                [*command, *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=full_env,
                cwd=ROOT,
                start_new_session=True,
            )
        engine = SimEngine(proc, port, logs)
        started.append(engine)
        return engine

    try:
        yield start
    finally:
        for engine in started:
            try:
                os.killpg(engine.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            engine.proc.wait(10)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def wait_ready(http: aiohttp.ClientSession, engine: SimEngine) -> None:
    async def ready() -> bool:
        if engine.proc.poll() is not None:
            raise AssertionError(f"engine exited {engine.proc.returncode}: {engine.stderr()}")
        try:
            async with http.get(f"{engine.url}/health") as resp:
                return resp.status == 200
        except aiohttp.ClientConnectionError:
            return False

    await wait_for(ready, 20, "the engine to answer /health")


async def wait_exit(engine: SimEngine) -> int:
    await wait_for(lambda: engine.proc.poll() is not None, 20, "the engine to exit")
    return engine.proc.wait()


async def wait_event(ledger: Ledger, pid: int, tag: str, device: int = 0) -> None:
    """Until ``pid`` has an event tagged ``tag`` on ``device``: the engine's progress."""
    await wait_for(
        lambda: any(e.pid == pid and e.tag == tag for e in ledger.history(device)),
        20,
        f"a {tag!r} event of pid {pid}",
    )


async def post(http: aiohttp.ClientSession, url: str, body: Any = None) -> tuple[int, Any]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def chat_text(http: aiohttp.ClientSession, engine: SimEngine) -> str:
    status, body = await post(http, f"{engine.url}/v1/chat/completions", CHAT)
    assert status == 200, body
    text: str = body["choices"][0]["message"]["content"]
    return text


async def calls(http: aiohttp.ClientSession, engine: SimEngine) -> list[dict[str, Any]]:
    async with http.get(f"{engine.url}/sim/calls") as resp:
        assert resp.status == 200
        result: list[dict[str, Any]] = await resp.json()
        return result


async def started(
    http: aiohttp.ClientSession, start_engine: StartEngine, ledger: Ledger, *args: str, **env: str
) -> SimEngine:
    engine = start_engine(ledger, *args, **{**FAST, **env})
    await wait_ready(http, engine)
    return engine


# --------------------------------------------------------------------------- start


async def test_context_is_outside_the_utilization_budget(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    """The context is made before the snapshot (vLLM ``v1/worker/gpu_worker.py:499-547``);
    the KV cache is the budget less the non-KV memory, which counts the transient peak
    although profiling ends by emptying torch's cache (``utils/mem_utils.py:298-321``,
    ``gpu_worker.py:753-757``), and the CUDA graphs' estimate: the graphs are captured after
    the KV cache (``gpu_worker.py:705-757,995-1010``). The ready engine holds its budget less
    the peak."""
    ledger = make_ledger(tmp_path, 16384)
    engine = await started(http, start_engine, ledger, "--gpu-memory-utilization", "0.5")
    budget = 8192  # ceil(0.5 x 16384)
    assert ledger.held(engine.pid) == {0: CONTEXT + budget - PEAK}
    assert ledger.tags(engine.pid, 0) == {
        "context": CONTEXT,
        "weights": WEIGHTS,
        "runtime": RUNTIME,
        "cudagraph": GRAPHS,
        "kv_cache": budget - WEIGHTS - RUNTIME - PEAK - GRAPHS,
    }
    events = [(e.tag, e.delta_mb) for e in ledger.history(0) if e.pid == engine.pid]
    assert [tag for tag, _ in events] == [
        "context", "weights", "runtime", "activation", "activation", "profiled", "kv_cache",
        "cudagraph",
    ]  # fmt: skip
    assert events[3] == ("activation", PEAK) and events[4] == ("activation", -PEAK)


async def test_start_fails_when_free_memory_after_the_context_is_below_util_x_total(
    tmp_path: Path, start_engine: StartEngine
) -> None:
    """Free memory equal to the budget is not enough: the context comes out of it first."""
    ledger = make_ledger(tmp_path, 16384)
    ledger.allocate(ME, 0, 8192, "neighbour")
    engine = start_engine(ledger, "--gpu-memory-utilization", "0.5", **FAST)
    assert await wait_exit(engine) == 1
    assert (
        "ValueError: Free memory on device cuda:0 (7.50/16.00 GiB) on startup is less than "
        "desired GPU memory utilization (0.5, 8.00 GiB). Decrease GPU memory utilization or "
        "reduce GPU memory used by other processes."
    ) in engine.stderr()
    assert "Engine core initialization failed" in engine.stderr()
    assert ledger.held(engine.pid) == {}


async def test_a_neighbour_freeing_memory_while_vllm_profiles_fails_the_start(
    tmp_path: Path, start_engine: StartEngine
) -> None:
    ledger = make_ledger(tmp_path, 16384)
    ledger.allocate(ME, 0, 4096, "neighbour")
    engine = start_engine(
        ledger, "--gpu-memory-utilization", "0.5", **FakeEngine(sim_profile_s=1.5).env()
    )
    await wait_event(ledger, engine.pid, "weights")
    ledger.free(ME, 0, "neighbour")
    assert await wait_exit(engine) == 1
    assert re.search(
        r"AssertionError: Error in memory profiling\. Initial free memory \d+\.\d\d GiB, current "
        r"free memory \d+\.\d\d GiB\. This happens when other processes sharing the same "
        r"container release GPU memory while vLLM is profiling",
        engine.stderr(),
    ), engine.stderr()
    assert ledger.held(engine.pid) == {}


@pytest.mark.parametrize(("neighbour_mb", "kv_change"), [(1000, -1000), (-500, 500)])
async def test_profiling_measures_device_wide_so_neighbours_resize_the_kv_cache(
    tmp_path: Path,
    http: aiohttp.ClientSession,
    start_engine: StartEngine,
    neighbour_mb: int,
    kv_change: int,
) -> None:
    """A neighbour allocating in the window shrinks the KV cache; one freeing less than the
    engine consumed enlarges it, so the engine ends above its budget."""
    ledger = make_ledger(tmp_path, 16384)
    ledger.allocate(ME, 0, 2000, "neighbour")
    engine = start_engine(
        ledger, "--gpu-memory-utilization", "0.5", **FakeEngine(sim_profile_s=1.5).env()
    )
    await wait_event(ledger, engine.pid, "weights")
    if neighbour_mb > 0:
        ledger.allocate(ME, 0, neighbour_mb, "neighbour")
    else:
        ledger.free(ME, 0, "neighbour", -neighbour_mb)
    await wait_ready(http, engine)
    kv = 8192 - WEIGHTS - RUNTIME - PEAK - GRAPHS + kv_change
    assert ledger.tags(engine.pid, 0)["kv_cache"] == kv
    assert ledger.held(engine.pid) == {0: CONTEXT + 8192 - PEAK + kv_change}


async def test_no_kv_cache_when_activations_and_graphs_fill_the_budget(
    tmp_path: Path, start_engine: StartEngine
) -> None:
    """The transient peak counts in the non-KV memory (``utils/mem_utils.py:318-321``): a
    3000 MiB peak leaves a 4 GiB budget no KV cache ("No available memory for the cache
    blocks", ``v1/core/kv_cache_planning.py:56-85``), though it is released after profiling."""
    ledger = make_ledger(tmp_path, 16384)
    engine = start_engine(
        ledger, "--gpu-memory-utilization", "0.25", **FakeEngine(sim_peak_mb=3000).env(), **FAST
    )
    assert await wait_exit(engine) == 1
    assert (
        "ValueError: No available memory for the cache blocks. Try increasing "
        "`gpu_memory_utilization` when initializing the engine."
    ) in engine.stderr()
    assert ledger.read()[0].used_mb == 0


async def test_kv_cache_memory_bytes_replaces_the_budget_but_not_the_startup_check(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    ledger = make_ledger(tmp_path, 16384)
    args = ("--gpu-memory-utilization", "0.9", "--kv-cache-memory-bytes", "1G")
    engine = await started(http, start_engine, ledger, *args)
    assert ledger.tags(engine.pid, 0)["kv_cache"] == 1024
    ledger.allocate(ME, 0, 4096, "neighbour")
    second = start_engine(ledger, *args, **FAST)
    assert await wait_exit(second) == 1
    assert "less than desired GPU memory utilization (0.9, 14.40 GiB)" in second.stderr()


async def test_world_size_needs_that_many_visible_gpus(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    ledger = make_ledger(tmp_path, 8192, 8192, 8192)
    refused = start_engine(ledger, "-tp", "2", CUDA_VISIBLE_DEVICES="2", **FAST)
    assert await wait_exit(refused) == 1
    assert (
        "ValueError: World size (2) is larger than the number of available GPUs (1) in this node."
    ) in refused.stderr()
    engine = await started(
        http,
        start_engine,
        ledger,
        "-pp",
        "2",
        "--gpu-memory-utilization",
        "0.5",
        CUDA_VISIBLE_DEVICES="2,0",
    )
    assert ledger.held(engine.pid) == {0: CONTEXT + 4096 - PEAK, 2: CONTEXT + 4096 - PEAK}


# --------------------------------------------------------------------------- the transient peak


async def test_the_peak_is_released_after_profiling_and_regrown_by_the_first_request(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    """vLLM counts the transient peak in its budget but frees it with torch's cache at the end
    of profiling (``utils/mem_utils.py:298-321``); the first full batch takes it back."""
    ledger = make_ledger(tmp_path, 16384)
    engine = await started(http, start_engine, ledger, "--gpu-memory-utilization", "0.5")
    assert "activation" not in ledger.tags(engine.pid, 0)
    assert ledger.held(engine.pid) == {0: CONTEXT + 8192 - PEAK}
    assert await chat_text(http, engine) == NORMAL_TEXT
    assert ledger.tags(engine.pid, 0)["activation"] == PEAK
    assert ledger.held(engine.pid) == {0: CONTEXT + 8192}
    assert await chat_text(http, engine) == NORMAL_TEXT  # held in torch's cache: no growth
    assert ledger.held(engine.pid) == {0: CONTEXT + 8192}


async def test_only_a_batch_of_peak_tokens_regrows_the_peak(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    """The peak is the ``max_num_batched_tokens`` forward plus the sampler passes
    (``v1/worker/gpu/model_runner.py:993-1048``): with ``FAKE_ENGINE_SIM_PEAK_TOKENS`` only a
    batch that large takes it back."""
    ledger = make_ledger(tmp_path, 16384)
    knobs = FakeEngine(sim_peak_tokens=500).env()
    engine = await started(http, start_engine, ledger, "--gpu-memory-utilization", "0.5", **knobs)
    assert await chat_text(http, engine) == NORMAL_TEXT
    assert "activation" not in ledger.tags(engine.pid, 0)
    long_chat = {"model": "m", "messages": [{"role": "user", "content": "w " * 500}]}
    status, _ = await post(http, f"{engine.url}/v1/chat/completions", long_chat)
    assert status == 200
    assert ledger.tags(engine.pid, 0)["activation"] == PEAK


async def test_an_engine_that_cannot_regrow_its_peak_dies_like_vllms_engine_core(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    """A neighbour took the memory the peak was released into: the forward pass raises
    ``torch.OutOfMemoryError``, vLLM's EngineCore dies ("EngineCore encountered a fatal error.",
    ``v1/engine/core.py:1582-1587``), the request gets a 500 and the server shuts down."""
    ledger = make_ledger(tmp_path, 16384)
    engine = await started(http, start_engine, ledger, "--gpu-memory-utilization", "0.5")
    ledger.allocate(ME, 0, ledger.free_mb(0) - PEAK + 1, "neighbour")
    status, body = await post(http, f"{engine.url}/v1/chat/completions", CHAT)
    assert (status, body["error"]["type"]) == (500, "InternalServerError")
    assert body["error"]["message"] == "The server had an error while processing your request."
    assert await wait_exit(engine) == 1
    stderr = engine.stderr()
    assert "EngineCore encountered a fatal error." in stderr
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 256.00 MiB" in stderr
    assert ledger.held(engine.pid) == {}


# --------------------------------------------------------------------------- sleep and wake


SLEEP_ARGS = ("--enable-sleep-mode", "--gpu-memory-utilization", "0.5")


@pytest.mark.parametrize("offload_graphs", [False, True])
async def test_sleep_leaves_the_context_and_cuda_graphs_on_the_device(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine, offload_graphs: bool
) -> None:
    """Asleep, what is outside the CuMem pools stays: the context, and the CUDA graphs unless
    ``--sleep-mode-offload-cudagraph`` (``config/model.py:384-390``). The sleep also empties
    torch's cache (``device_allocator/cumem.py:297-298``), so the peak goes, and the wake does
    not bring it back (``cumem.py:342-343``): the first batch after it does."""
    ledger = make_ledger(tmp_path, 16384)
    extra = ("--sleep-mode-offload-cudagraph",) if offload_graphs else ()
    engine = await started(http, start_engine, ledger, *SLEEP_ARGS, *extra)
    assert await chat_text(http, engine) == NORMAL_TEXT  # the peak regrown
    assert await post(http, f"{engine.url}/sleep?level=1") == (
        200,
        {"status": "sleeping", "level": 1},
    )
    residue = CONTEXT if offload_graphs else CONTEXT + GRAPHS
    assert ledger.held(engine.pid) == {0: residue}
    freed = (CONTEXT + 8192 - residue) / 1024
    assert f"Sleep mode freed {freed:.2f} GiB memory, {residue / 1024:.2f} GiB" in engine.stdout()
    status, body = await post(http, f"{engine.url}/wake_up")
    assert (status, body["status"]) == (200, "awake")
    assert ledger.held(engine.pid) == {0: CONTEXT + 8192 - PEAK}
    assert "activation" not in ledger.tags(engine.pid, 0)
    assert await chat_text(http, engine) == NORMAL_TEXT
    assert ledger.held(engine.pid) == {0: CONTEXT + 8192}


@pytest.mark.parametrize("offload_graphs", [False, True])
async def test_sleeps_pin_each_allocation_at_a_power_of_two_and_keep_it_pinned(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine, offload_graphs: bool
) -> None:
    """Each offloaded CuMem allocation gets its own pinned backup (``device_allocator/cumem.py:
    256-276``) from torch's caching host allocator, which rounds it to a power of two and keeps
    it cached once the wake drops the backup (``cumem.py:360``); vLLM never empties that cache.
    Level 1 offloads weights, ``runtime`` and pooled graphs, level 2 only the last two
    (``device_allocator/sleep_mode_backend.py:133-137``). A later sleep reuses the blocks."""
    ledger = make_ledger(tmp_path, 16384)
    extra = ("--sleep-mode-offload-cudagraph",) if offload_graphs else ()
    segments = FakeEngine(sim_weight_segments_mb=(600, 300, 124)).env()
    engine = await started(http, start_engine, ledger, *SLEEP_ARGS, *extra, **segments)
    assert ledger.tags(engine.pid, 0)["weights"] == WEIGHTS
    graphs = GRAPHS if offload_graphs else 0
    pooled = RUNTIME + graphs  # 64 and 256: powers of two already
    assert (await post(http, f"{engine.url}/sleep?level=2"))[0] == 200
    assert ledger.pinned_mb(engine.pid) == pooled
    for tags in (["weights"], ["kv_cache"]):
        assert (await post(http, f"{engine.url}/wake_up?tags={tags[0]}"))[0] == 200
    assert ledger.pinned_mb(engine.pid) == pooled  # kept by torch's host cache

    level_1 = 1024 + 512 + 128 + pooled  # 600, 300 and 124 MiB rounded up
    for _ in range(2):
        assert (await post(http, f"{engine.url}/sleep?level=1"))[0] == 200
        assert ledger.pinned_mb(engine.pid) == level_1
        assert (await post(http, f"{engine.url}/wake_up"))[0] == 200
        assert ledger.pinned_mb(engine.pid) == level_1
    assert await chat_text(http, engine) == GARBAGE_TEXT  # level 2 was never reloaded


async def test_v2_sampler_state_is_in_the_weights_pool_pinned_at_level_1_and_discarded_at_2(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    """Model Runner V2 builds its sampler in ``load_model``, inside the ``weights`` pool
    (``v1/worker/gpu_worker.py:594-600``, ``v1/worker/gpu/model_runner.py:467-495``):
    ``prompt_bin_mask`` then ``output_bin_counts``, ``max_num_seqs x vocab`` int32
    (``v1/worker/gpu/sample/penalties.py:43-50``). It takes KV cache, a level-1 sleep pins it
    with the weights (a power of two per torch segment) and level 2 discards it."""
    ledger = make_ledger(tmp_path, 16384)
    env = FakeEngine(sim_vocab=151_936).env()
    engine = await started(http, start_engine, ledger, *SLEEP_ARGS, "--max-num-seqs", "256", **env)
    # 256 x 4748 x 4 B = 4.6 MiB: a 20 MiB segment; 256 x 151936 x 4 B = 148.4 MiB: 150 MiB
    state = 20 + 150
    tags = ledger.tags(engine.pid, 0)
    assert tags["weights"] == WEIGHTS + state
    assert tags["kv_cache"] == 8192 - WEIGHTS - state - RUNTIME - PEAK - GRAPHS
    assert (await post(http, f"{engine.url}/sleep?level=1"))[0] == 200
    assert ledger.pinned_mb(engine.pid) == 1024 + 32 + 256 + RUNTIME
    assert (await post(http, f"{engine.url}/wake_up"))[0] == 200
    assert ledger.tags(engine.pid, 0)["weights"] == WEIGHTS + state

    args = ("--enable-sleep-mode", "--gpu-memory-utilization", "0.3", "--max-num-seqs", "256")
    other = await started(http, start_engine, ledger, *args, **env)
    assert (await post(http, f"{other.url}/sleep?level=2"))[0] == 200
    assert "weights" not in ledger.tags(other.pid, 0)
    assert ledger.pinned_mb(other.pid) == RUNTIME, "the sampler state is discarded, not pinned"


async def test_weight_tensors_share_torchs_segments_and_pin_by_segment(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    """The weights pool is loaded with ``max_split_size_mb=20`` (``v1/worker/gpu_worker.py:
    599``): tensors under 10 MiB share 20 MiB segments, larger ones get their own rounded to
    2 MiB. A CuMem allocation, and so a pinned block, is a segment: four 4 MiB tensors pin one
    32 MiB block, not four 4 MiB ones."""
    ledger = make_ledger(tmp_path, 16384)
    env = FakeEngine(sim_weight_segments_mb=(4, 4, 4, 4, 601)).env()
    engine = await started(http, start_engine, ledger, *SLEEP_ARGS, **env)
    assert ledger.tags(engine.pid, 0)["weights"] == 20 + 602
    assert (await post(http, f"{engine.url}/sleep?level=1"))[0] == 200
    assert ledger.pinned_mb(engine.pid) == 32 + 1024 + RUNTIME


async def test_the_workspace_pool_is_discarded_by_every_sleep_and_never_pinned(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    """vLLM allocates its scratch in a ``workspace`` CuMem pool that no sleep offloads
    (``v1/worker/gpu_worker.py:557-564``, ``device_allocator/sleep_mode_backend.py:133-137``):
    it is freed and not backed up at either level, and mapped again by every wake
    (``device_allocator/cumem.py:342-364``)."""
    ledger = make_ledger(tmp_path, 16384)
    engine = await started(
        http, start_engine, ledger, *SLEEP_ARGS, **FakeEngine(sim_workspace_mb=100).env()
    )
    assert ledger.tags(engine.pid, 0)["workspace"] == 100
    kv = 8192 - WEIGHTS - RUNTIME - 100 - PEAK - GRAPHS
    assert ledger.tags(engine.pid, 0)["kv_cache"] == kv
    for level, pinned in ((1, WEIGHTS + RUNTIME), (2, WEIGHTS + RUNTIME)):
        assert (await post(http, f"{engine.url}/sleep?level={level}"))[0] == 200
        assert "workspace" not in ledger.tags(engine.pid, 0)
        assert ledger.pinned_mb(engine.pid) == pinned  # level 2 reuses the cached blocks
        assert (await post(http, f"{engine.url}/wake_up"))[0] == 200
        assert ledger.tags(engine.pid, 0)["workspace"] == 100


async def test_a_level_2_sleep_copies_the_model_buffers_to_pageable_memory(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    """A level-2 sleep copies the model's buffers (and parameters kept by
    ``sleep_preserve_parameter_names``) to pageable host memory, dropped once the weights wake
    (``v1/worker/gpu_worker.py:287-312,352-357``): resident, but not pinned."""
    ledger = make_ledger(tmp_path, 16384)
    env = FakeEngine(sim_buffers_mb=40).env()
    engine = await started(http, start_engine, ledger, *SLEEP_ARGS, **env)
    assert (await post(http, f"{engine.url}/sleep?level=2"))[0] == 200
    assert ledger.pinned_mb(engine.pid) == RUNTIME
    assert ledger.host_mb(engine.pid) == RUNTIME + 40
    assert (await post(http, f"{engine.url}/wake_up?tags=kv_cache"))[0] == 200
    assert ledger.host_mb(engine.pid) == RUNTIME + 40, "the weights are still asleep"
    assert (await post(http, f"{engine.url}/wake_up?tags=weights"))[0] == 200
    assert ledger.host_mb(engine.pid) == RUNTIME


async def test_cuda_graphs_are_captured_after_the_kv_cache_beyond_their_estimate(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    """vLLM subtracts an estimate of the CUDA graphs from the KV cache and captures them after
    allocating it (``v1/worker/gpu_worker.py:705-757,995-1010``): graphs larger than their
    estimate take memory beyond the budget, and a device without that room fails the start."""
    ledger = make_ledger(tmp_path, 16384)
    env = FakeEngine(sim_graphs_estimate_mb=128).env()
    engine = await started(http, start_engine, ledger, "--gpu-memory-utilization", "0.5", **env)
    assert ledger.tags(engine.pid, 0)["kv_cache"] == 8192 - WEIGHTS - RUNTIME - PEAK - 128
    assert ledger.held(engine.pid) == {0: CONTEXT + 8192 - PEAK + GRAPHS - 128}
    assert "CUDA graph pool memory: 0.25 GiB (actual), 0.12 GiB (estimated)" in engine.stdout()

    (tmp_path / "full").mkdir()
    full = make_ledger(tmp_path / "full", 9000)
    more = FakeEngine(sim_graphs_mb=600, sim_graphs_estimate_mb=128).env()
    failed = start_engine(full, "--gpu-memory-utilization", "0.93", **FAST, **more)
    assert await wait_exit(failed) == 1
    assert "torch.OutOfMemoryError: CUDA out of memory" in failed.stderr()


async def test_sleep_without_enable_sleep_mode_pauses_but_frees_nothing(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    ledger = make_ledger(tmp_path, 16384)
    engine = await started(http, start_engine, ledger, "--gpu-memory-utilization", "0.5")
    assert (await post(http, f"{engine.url}/sleep?level=2"))[0] == 200
    async with http.get(f"{engine.url}/is_sleeping") as resp:
        assert await resp.json() == {"is_sleeping": True}
    assert ledger.held(engine.pid) == {0: CONTEXT + 8192 - PEAK}
    assert ledger.pinned_mb() == 0
    assert (await post(http, f"{engine.url}/wake_up"))[0] == 200
    assert await chat_text(http, engine) == NORMAL_TEXT


async def test_a_neighbour_allocating_during_sleep_fails_it_and_the_engine_is_lost(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    """The sleep asserts "Memory usage increased after sleeping." (``v1/worker/gpu_worker.py:
    334``) after the allocator unmapped the memory, so the executor never records its sleeping
    tags (``v1/executor/abstract.py:400-407``): ``/is_sleeping`` stays true (the scheduler is
    paused, ``v1/engine/core.py:1078-1080``), ``/wake_up`` maps nothing ("Executor is not
    sleeping", ``abstract.py:412-415``) but resumes scheduling, and the next batch runs on
    unmapped memory: the engine dies. It must be replaced, never woken."""
    ledger = make_ledger(tmp_path, 16384)
    args = ("--enable-sleep-mode", "--gpu-memory-utilization", "0.4")
    engine = await started(http, start_engine, ledger, *args, **FakeEngine(sim_sleep_s=1.5).env())
    sleep = asyncio.create_task(post(http, f"{engine.url}/sleep?level=1"))
    await wait_event(ledger, engine.pid, "sleep_begin")
    ledger.allocate(ME, 0, 7000, "neighbour")  # more than the 6554 - 512 MiB the sleep frees
    status, body = await sleep
    assert status == 500
    assert "AssertionError: Memory usage increased after sleeping." in body["error"]["message"]
    assert "Memory usage increased after sleeping." in engine.stderr()
    assert engine.proc.poll() is None
    assert ledger.held(engine.pid) == {0: CONTEXT + GRAPHS}
    async with http.get(f"{engine.url}/is_sleeping") as resp:
        assert await resp.json() == {"is_sleeping": True}
    ledger.free(ME, 0, "neighbour")
    assert await post(http, f"{engine.url}/wake_up") == (200, {"status": "awake", "tags": None})
    assert ledger.held(engine.pid) == {0: CONTEXT + GRAPHS}, "the wake mapped nothing"
    status, body = await post(http, f"{engine.url}/v1/chat/completions", CHAT)
    assert (status, body["error"]["type"]) == (500, "InternalServerError")
    assert await wait_exit(engine) == 1
    assert "CUDA error: an illegal memory access was encountered" in engine.stderr()


async def test_a_sleep_that_cannot_pin_its_runtime_pool_loses_the_weights_it_unmapped(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    """The allocator backs up and unmaps allocation after allocation (``device_allocator/
    cumem.py:256-280``): when pinning the ``runtime`` pool fails, the weights are already
    unmapped and the executor never set its sleeping tags (``v1/executor/abstract.py:
    400-407``), so the engine cannot be woken into a working state."""
    ledger = make_ledger(tmp_path, 16384, host_mb=WEIGHTS + RUNTIME // 2)
    engine = await started(http, start_engine, ledger, *SLEEP_ARGS)
    status, body = await post(http, f"{engine.url}/sleep?level=1")
    assert status == 500
    assert "out of memory (pinning 64.00 MiB of host memory" in body["error"]["message"]
    assert "weights" not in ledger.tags(engine.pid, 0)
    assert (await post(http, f"{engine.url}/wake_up"))[0] == 200
    assert "weights" not in ledger.tags(engine.pid, 0)
    assert (await post(http, f"{engine.url}/v1/chat/completions", CHAT))[0] == 500
    assert await wait_exit(engine) == 1


async def test_requests_park_while_asleep_and_are_answered_after_wake(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    """vLLM queues requests sent to a sleeping engine: "All pause modes queue new adds"
    (``v1/engine/core.py:2186``)."""
    ledger = make_ledger(tmp_path, 16384)
    engine = await started(http, start_engine, ledger, *SLEEP_ARGS)
    assert (await post(http, f"{engine.url}/sleep?level=1"))[0] == 200
    request = asyncio.create_task(chat_text(http, engine))

    async def parked() -> bool:
        async with http.get(f"{engine.url}/metrics") as resp:
            text = await resp.text()
        return bool(re.search(r"^fake_engine:requests_while_asleep_total\S* 1\.0$", text, re.M))

    await wait_for(parked, 10, "the request to park")
    assert not request.done()
    assert (await post(http, f"{engine.url}/wake_up"))[0] == 200
    assert await asyncio.wait_for(request, 10) == NORMAL_TEXT


async def test_a_failed_wake_keeps_what_it_mapped(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    """``CuMemAllocator.wake_up`` maps allocation after allocation and rolls nothing back
    (``device_allocator/cumem.py:345-364``): the weights and ``runtime`` stay mapped when the
    KV cache does not fit, and the engine stays asleep."""
    ledger = make_ledger(tmp_path, 16384)
    engine = await started(http, start_engine, ledger, *SLEEP_ARGS)
    assert (await post(http, f"{engine.url}/sleep?level=1"))[0] == 200
    ledger.allocate(ME, 0, ledger.free_mb(0) - WEIGHTS - RUNTIME - 100, "neighbour")
    status, body = await post(http, f"{engine.url}/wake_up")
    assert status == 500
    assert "CUDA out of memory" in body["error"]["message"]
    assert ledger.tags(engine.pid, 0) == {
        "context": CONTEXT,
        "cudagraph": GRAPHS,
        "weights": WEIGHTS,
        "runtime": RUNTIME,
    }
    async with http.get(f"{engine.url}/is_sleeping") as resp:
        assert await resp.json() == {"is_sleeping": True}


async def tight_level2_sleep(
    http: aiohttp.ClientSession, start_engine: StartEngine, ledger: Ledger, **env: str
) -> SimEngine:
    """An engine asleep at level 2 on a device a neighbour filled so that waking its weights,
    runtime and KV cache leaves 64 MiB: less than the 128 MiB a reload takes."""
    engine = await started(
        http, start_engine, ledger, *SLEEP_ARGS, **FakeEngine(sim_reload_mb_s=1000000).env(), **env
    )
    assert (await post(http, f"{engine.url}/sleep?level=2"))[0] == 200
    awake_need = 4096 - PEAK - GRAPHS  # weights + runtime + KV cache
    ledger.allocate(ME, 0, ledger.read()[0].free_mb - awake_need - 64, "neighbour")
    return engine


async def test_level2_wake_in_vllm_order_fits_where_wake_all_then_reload_does_not(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    """vLLM's documented order (weights, ``reload_weights``, KV cache) peaks lower than waking
    everything before the reload: the reload's temporaries (``v1/worker/gpu_worker.py:636-638``,
    ``model_executor/model_loader/reload/layerwise.py:344-402``) sit where the KV cache goes."""
    right_ledger = Ledger.create(tmp_path / "right.json", [{"total_mb": 8192}])
    right = await tight_level2_sleep(http, start_engine, right_ledger)
    assert (await post(http, f"{right.url}/wake_up?tags=weights"))[0] == 200
    rpc = f"{right.url}/collective_rpc"
    assert await post(http, rpc, {"method": "reload_weights"}) == (200, {"results": [None]})
    assert (await post(http, f"{right.url}/wake_up?tags=kv_cache"))[0] == 200
    assert right_ledger.held(right.pid) == {0: CONTEXT + 4096 - PEAK}
    assert [
        (c["call"], c.get("tags") or c.get("method"), c["status"]) for c in await calls(http, right)
    ] == [
        ("sleep", None, 200),
        ("wake_up", ["weights"], 200),
        ("collective_rpc", "reload_weights", 200),
        ("wake_up", ["kv_cache"], 200),
    ]

    wrong_ledger = Ledger.create(tmp_path / "wrong.json", [{"total_mb": 8192}])
    wrong = await tight_level2_sleep(http, start_engine, wrong_ledger)
    assert (await post(http, f"{wrong.url}/wake_up"))[0] == 200
    status, body = await post(http, f"{wrong.url}/collective_rpc", {"method": "reload_weights"})
    assert status == 500
    assert "CUDA out of memory. Tried to allocate 128.00 MiB" in body["error"]["message"]


async def test_the_kv_wake_frees_the_reload_temporaries_before_mapping(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    """The reload's per-module temporaries stay in torch's cache after ``reload_weights``;
    ``wake_up(tags=kv_cache)`` runs ``gc.collect(); empty_cache()`` before it maps anything
    (``device_allocator/cumem.py:342-343``), so on a device with 64 MiB to spare it fits."""
    ledger = make_ledger(tmp_path, 8192)
    engine = await tight_level2_sleep(http, start_engine, ledger)
    assert (await post(http, f"{engine.url}/wake_up?tags=weights"))[0] == 200
    rpc = f"{engine.url}/collective_rpc"
    assert (await post(http, rpc, {"method": "reload_weights"}))[0] == 200
    assert ledger.tags(engine.pid, 0)["reload_temp"] == 128
    assert (await post(http, f"{engine.url}/wake_up?tags=kv_cache"))[0] == 200
    assert "reload_temp" not in ledger.tags(engine.pid, 0)
    assert ledger.free_mb(0) == 64
    moves = [(e.tag, e.delta_mb) for e in ledger.history(0) if e.pid == engine.pid][-2:]
    assert moves == [("reload_temp", -128), ("kv_cache", 4096 - WEIGHTS - RUNTIME - PEAK - GRAPHS)]
    ledger.free(ME, 0, "neighbour", PEAK)  # room for the peak the first batch takes back
    assert await chat_text(http, engine) == NORMAL_TEXT
    assert ledger.free_mb(0) == 64


async def test_reload_needs_the_weights_awake_and_takes_time(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    ledger = make_ledger(tmp_path, 16384)
    engine = await started(
        http, start_engine, ledger, *SLEEP_ARGS, **FakeEngine(sim_reload_mb_s=2048).env()
    )
    assert (await post(http, f"{engine.url}/sleep?level=2"))[0] == 200
    rpc = f"{engine.url}/collective_rpc"
    assert (await post(http, rpc, {"method": "reload_weights"}))[0] == 500
    assert (await post(http, f"{engine.url}/wake_up?tags=weights"))[0] == 200
    loop = asyncio.get_running_loop()
    began = loop.time()
    assert (await post(http, rpc, {"method": "reload_weights"}))[0] == 200
    assert loop.time() - began >= WEIGHTS / 2048
    assert ledger.tags(engine.pid, 0)["reload_temp"] == 128


async def test_lora_adapters_stay_registered_across_a_level_2_sleep(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    """vLLM's API registry of adapters is untouched by sleeps (``entrypoints/openai/models/
    serving.py:167-230``); after ``reload_weights`` reset them the worker loads an adapter again
    when a request names it (``v1/worker/lora_model_runner_mixin.py:31-41``). No
    re-registration is needed."""
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))
    ledger = make_ledger(tmp_path, 16384)
    lora = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    engine = await started(http, start_engine, ledger, *SLEEP_ARGS, "--enable-lora", **lora)
    load = {"lora_name": "a", "lora_path": str(folder)}
    async with http.post(f"{engine.url}/v1/load_lora_adapter", json=load) as resp:
        assert resp.status == 200, await resp.text()
    assert (await post(http, f"{engine.url}/sleep?level=2"))[0] == 200
    async with http.get(f"{engine.url}/v1/models") as resp:
        assert "a" in [card["id"] for card in (await resp.json())["data"]]
    assert (await post(http, f"{engine.url}/wake_up?tags=weights"))[0] == 200
    rpc = f"{engine.url}/collective_rpc"
    assert (await post(http, rpc, {"method": "reload_weights"}))[0] == 200
    assert (await post(http, f"{engine.url}/wake_up?tags=kv_cache"))[0] == 200
    status, body = await post(http, f"{engine.url}/v1/chat/completions", {**CHAT, "model": "a"})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"].startswith("a:tok0 ")


# --------------------------------------------------------------------------- exit


async def test_memory_is_given_back_on_sigterm_and_on_sigkill(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    ledger = make_ledger(tmp_path, 16384)
    half = ("--gpu-memory-utilization", "0.4")
    engine = await started(http, start_engine, ledger, *half)
    killed = await started(http, start_engine, ledger, *half)
    assert set(ledger.read()[0].processes) == {engine.pid, killed.pid}
    engine.proc.send_signal(signal.SIGTERM)
    assert await wait_exit(engine) == 0
    killed.proc.kill()
    assert await wait_exit(killed) == -signal.SIGKILL
    assert ledger.read()[0].used_mb == 0


async def test_memory_is_charged_to_the_engine_core_child(
    tmp_path: Path, http: aiohttp.ClientSession, start_engine: StartEngine
) -> None:
    """NVML shows vLLM's EngineCore; killing the API server alone leaves its memory held."""
    ledger = make_ledger(tmp_path, 16384)
    engine = await started(http, start_engine, ledger, **FakeEngine(spawn_child=1).env())
    match = re.search(r"EngineCore pid=(\d+)", engine.stdout())
    assert match, engine.stdout()
    core = int(match[1])
    assert set(ledger.read()[0].processes) == {core}
    engine.proc.kill()
    await wait_exit(engine)
    assert ledger.held(core) != {}
    os.killpg(engine.pid, signal.SIGKILL)
    await wait_for(lambda: ledger.held(core) == {}, 10, "the EngineCore's memory to go")
