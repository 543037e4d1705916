"""The GPU tier: the proxy on NVML (``gpu.monitor: nvml``) in front of fake engines that hold
real device memory (`FakeEngine.gpu_mb`, through torch).

Runs only where NVML sees an NVIDIA device and torch sees CUDA; everywhere else (CI) every test
here is skipped with the reason. ``pytest -m gpu`` runs just this tier; docs/gpu.md says how,
also on a machine without network. Everything uses device 0. Sizes come from the device's free
memory when the test starts, so the tests hold on any GPU size:

* the tracking and sleep tests use a moderate size (a tenth of the device, at most 4 GiB);
* the admission and swap tests size each engine so that the device *physically* cannot hold
  one more (three of 40 %, two of 60 %): admitting too much would be a real CUDA out-of-memory
  error in an engine, which the proxy would see as a failed start or a failed wake and a second
  engine process. The swap uses sleep level 2, which frees the memory without a host copy.

Every engine holds up to ``CONTEXT_MB`` beyond its ``gpu_mb`` for torch's CUDA
context; each model's ``memory_mb`` counts it (memory_mb is everything an engine holds), and
``sleep.memory_mb`` is the planner's guess until the proxy has measured what a sleeping engine
keeps (its context).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kit import FAKE_ENGINE, FakeEngine, RunningProxy, StartProxy, wait_for
from kit.gpumeasure import Reading, Record, device_facts, measure, out_path
from kit.metrics import engine_metric, proxy_metric, proxy_samples

from fake_vllm.gpu import MIB, layout
from vllm_proxy.config import Config, parse_config
from vllm_proxy.engines.engine import instance_logs
from vllm_proxy.engines.states import DOWN, State
from vllm_proxy.planning.gpu import GpuSnapshot, NvmlMonitor

DEVICE = 0
#: What a fake engine holds on the device beyond its `gpu_mb` (torch's CUDA context).
CONTEXT_MB = 1024
#: Bounds for starts and waits: each engine imports torch and creates a CUDA context.
START_S = 300.0


def _why_no_gpu() -> str | None:
    """Why this tier cannot run here (None: it can). NVML first: it is cheap, and without a
    device there is no point importing torch."""
    if not NvmlMonitor.available():
        return "needs an NVIDIA GPU: NVML does not initialise or sees no device"
    if importlib.util.find_spec("torch") is None:
        return "needs torch with CUDA (the fake engine's GPU mode); torch is not installed"
    # In a child process: the test process itself never loads torch or makes a CUDA context.
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True,
        text=True,
        timeout=START_S,
        check=False,
    )
    if probe.stdout.strip() != "True":
        return "needs torch with CUDA: torch.cuda.is_available() is not True in this environment"
    return None


WHY_NOT = _why_no_gpu()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]


def device() -> GpuSnapshot:
    """Device 0 read through NVML now, independently of the proxy's own monitor."""
    monitor = NvmlMonitor(devices=[DEVICE])
    try:
        return monitor.read()[0]
    finally:
        monitor.close()


def moderate_mb() -> int:
    return min(4096, device().total_mb // 10)


def shares(fraction: float) -> tuple[int, int]:
    """(memory_mb, gpu_mb) of an engine that takes `fraction` of the free memory."""
    memory_mb = int(device().free_mb * fraction)
    if memory_mb - CONTEXT_MB < 256:
        pytest.skip(f"device {DEVICE} has too little free memory for engines of {fraction:.0%}")
    return memory_mb, memory_mb - CONTEXT_MB


def gpu_config(tmp_path: Path, models: dict[str, dict[str, Any]]) -> Config:
    return parse_config(
        {
            "server": {
                "host": "127.0.0.1",
                "port": 0,
                "state_dir": str(tmp_path / "state"),
                "admin_open": True,
            },
            "engine": {
                "command": FAKE_ENGINE,
                "startup_timeout_s": START_S,
                "stop_timeout_s": 10,
                "idle_timeout_s": 0,
                "port_range": [20000, 29999],
            },
            "gpu": {
                "monitor": "nvml",
                "devices": [DEVICE],
                "poll_interval_s": 0.25,
                "free_timeout_s": 60,
            },
            "admission": {"queue_timeout_s": START_S},
            "models": models,
        }
    )


def engine(memory_mb: int, gpu_mb: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "fake/gpu",
        "memory_mb": memory_mb,
        "env": FakeEngine(gpu_mb=gpu_mb).env(),
        **extra,
    }


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    timeout = aiohttp.ClientTimeout(total=2 * START_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        yield session


async def chat(http: aiohttp.ClientSession, proxy: RunningProxy, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with http.post(proxy.url + "/v1/chat/completions", json=body) as resp:
        text = await resp.text()
        assert resp.status == 200, f"{model}: {resp.status} {text}"
    content: str = json.loads(text)["choices"][0]["message"]["content"]
    assert content.startswith("tok0") and "<garbage>" not in content, content
    return content


async def admin(http: aiohttp.ClientSession, proxy: RunningProxy, path: str) -> None:
    async with http.post(f"{proxy.url}/admin/models/{path}") as resp:
        assert resp.status == 200, f"{path}: {resp.status} {await resp.text()}"


def engine_log_text(proxy: RunningProxy, name: str) -> str:
    logs = instance_logs(proxy.model(name).spec).values()
    return "".join(path.read_text(errors="replace") for path in logs)


@contextlib.asynccontextmanager
async def peak_engines(proxy: RunningProxy) -> AsyncIterator[list[int]]:
    """Sample, every 20 ms, how many engine processes are alive; yields [peak so far]."""
    peak = [0]

    async def sample() -> None:
        while True:
            live = [
                i
                for i in proxy.manager.all_instances()
                if i.engine is not None and i.engine.exit_code is None and i.state not in DOWN
            ]
            peak[0] = max(peak[0], len(live))
            await asyncio.sleep(0.02)

    task = asyncio.ensure_future(sample())
    try:
        yield peak
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# -- NVML tracks what an engine holds ----------------------------------------------------------


async def test_nvml_readings_track_an_engines_allocation(
    tmp_path: Path, start_proxy: StartProxy, http: aiohttp.ClientSession
) -> None:
    size = moderate_mb()
    peak = layout(size).peak // MIB
    before = device().used_mb
    proxy = await start_proxy(gpu_config(tmp_path, {"m": engine(size + CONTEXT_MB, size)}))
    await admin(http, proxy, "m/load")
    ready = device().used_mb
    assert ready - before >= 0.9 * (size - peak), "ready, the engine holds all but its peak"
    await chat(http, proxy, "m")
    inst = proxy.instance("m")
    assert device().used_mb - ready >= 0.9 * peak, "the first request takes the peak back"
    assert device().used_mb - before >= 0.9 * size, "the engine holds its memory"

    memory = proxy.manager.memory
    assert memory is not None and memory.kind == "nvml"
    # The proxy measured the instance (NVML per process, or the device delta across its start)
    # and its exported reading moved with the device.
    await wait_for(
        lambda: memory.measured.get(inst.id, 0) >= 0.9 * size,
        timeout=30,
        what=f"{inst.id} measured at >= 90% of {size} MiB",
    )

    async def exported_shows_it() -> bool:
        used = await proxy_metric(proxy, "vllm_gpu_memory_used_mb", gpu_id=str(DEVICE))
        return (used or 0.0) >= before + 0.9 * size

    await wait_for(exported_shows_it, timeout=30, what="vllm_gpu_memory_used_mb to show it")

    await admin(http, proxy, "m/unload")
    assert inst.state is State.STOPPED
    await wait_for(
        lambda: device().used_mb <= before + size // 10,
        timeout=60,
        what="the engine's memory free again after the unload",
    )
    assert inst.id not in memory.measured and inst.id not in memory.claims


# -- admission by real memory ------------------------------------------------------------------


async def test_three_models_that_fit_two_at_a_time_start_without_out_of_memory(
    tmp_path: Path, start_proxy: StartProxy, http: aiohttp.ClientSession
) -> None:
    """Each engine takes 40 % of the device: any two fit, three cannot. Every request is
    answered by an engine that started at the first try; the least recently used one is
    stopped for the next, never an out-of-memory start."""
    memory_mb, gpu_mb = shares(0.4)
    models = {name: engine(memory_mb, gpu_mb) for name in "abc"}
    proxy = await start_proxy(gpu_config(tmp_path, models))
    async with peak_engines(proxy) as peak:
        for name in "abca":
            await chat(http, proxy, name)
    assert [proxy.engine_starts(n) for n in "abc"] == [2, 1, 1], "one start per admission"
    assert peak[0] <= 2, f"{peak[0]} engines held memory at once"
    assert proxy.model("b").state() is State.STOPPED, "b was the least recently used for a"
    assert proxy.model("a").state() is State.RUNNING
    assert proxy.model("c").state() is State.RUNNING
    for name, evicted in (("a", 1), ("b", 1), ("c", None)):
        count = await proxy_metric(
            proxy, "vllm_proxy_evictions_total", model_id=name, reason="memory"
        )
        assert count == evicted, (name, count)
    metrics = await proxy_samples(proxy)
    assert not metrics.find("vllm_proxy_engine_restarts_total"), "no failed start, no retry"
    for name in "abc":
        logs = engine_log_text(proxy, name)
        assert "out of memory" not in logs.lower() and "cannot hold" not in logs, logs[-2000:]


# -- sleep gives the memory back ---------------------------------------------------------------


async def test_sleep_levels_1_and_2_free_the_memory_nvml_sees(
    tmp_path: Path, start_proxy: StartProxy, http: aiohttp.ClientSession
) -> None:
    size = moderate_mb()
    policy = {"level": 1, "after_idle_s": 3600, "memory_mb": CONTEXT_MB}
    proxy = await start_proxy(
        gpu_config(tmp_path, {"m": engine(size + CONTEXT_MB, size, sleep=policy)})
    )
    await chat(http, proxy, "m")
    inst = proxy.instance("m")
    memory = proxy.manager.memory
    assert memory is not None
    for level in (1, 2):
        awake = device().used_mb
        await admin(http, proxy, f"m/sleep?level={level}")
        assert inst.asleep and inst.sleep_level == level
        asleep = device().used_mb
        assert awake - asleep >= 0.9 * size, (level, awake, asleep)
        # The proxy's own reading and its claim both show the memory back.
        snapshot = (await memory.read_fresh())[0]
        assert snapshot.used_mb <= asleep + size // 10, (level, snapshot.used_mb, asleep)
        # What the sleeping engine keeps (its context), as the proxy measured it.
        assert 0 < memory.held_mb(inst.id) <= CONTEXT_MB, memory.held_mb(inst.id)
        await chat(http, proxy, "m")  # wakes it; after level 2 the weights are reloaded
        assert inst.state is State.RUNNING and proxy.instance("m") is inst
        assert device().used_mb - asleep >= 0.9 * size, (level, "awake again")
    assert proxy.engine_starts("m") == 1, "woken each time, never restarted"
    assert await engine_metric(proxy, inst, "fake_engine:wakes_total") == 2
    assert await engine_metric(proxy, inst, "fake_engine:reload_weights_total") == 1
    assert await engine_metric(proxy, inst, "fake_engine:garbage_completions_total") == 0


# -- swap by sleep and wake --------------------------------------------------------------------


async def test_two_models_that_fit_one_awake_swap_by_sleep_and_wake(
    tmp_path: Path, start_proxy: StartProxy, http: aiohttp.ClientSession
) -> None:
    """Each engine takes 60 % of the device: one awake and one asleep fit, two awake cannot.
    Alternate requests put one to sleep and wake the other, with exactly two engine processes
    ever started; a wake before the other's memory is free would fail in the engine."""
    memory_mb, gpu_mb = shares(0.6)
    policy = {"level": 2, "after_idle_s": 3600, "memory_mb": CONTEXT_MB}
    models = {name: engine(memory_mb, gpu_mb, sleep=policy) for name in "ab"}
    proxy = await start_proxy(gpu_config(tmp_path, models))
    async with peak_engines(proxy) as peak:
        await chat(http, proxy, "a")
        for name, other in (("b", "a"), ("a", "b"), ("b", "a")):
            await chat(http, proxy, name)
            assert proxy.instance(name).state is State.RUNNING
            assert proxy.instance(other).asleep, f"{other} was put to sleep for {name}"
    assert proxy.engine_starts("a") == 1 and proxy.engine_starts("b") == 1
    assert peak[0] == 2
    a, b = proxy.instance("a"), proxy.instance("b")
    assert b.state is State.RUNNING and a.asleep
    for inst, wakes in ((a, 1), (b, 1)):
        assert await engine_metric(proxy, inst, "fake_engine:wakes_total") == wakes
        assert await engine_metric(proxy, inst, "fake_engine:requests_while_asleep_total") == 0
        assert await engine_metric(proxy, inst, "fake_engine:garbage_completions_total") == 0
    metrics = await proxy_samples(proxy)
    assert not metrics.find("vllm_proxy_evictions_total"), "nothing was stopped"
    assert not metrics.find("vllm_proxy_engine_restarts_total"), "no failed wake or start"


# -- what one engine holds through start, sleep and wake (the GPU check's figures) -------------


def pinned_blocks_mb(sizes: list[int]) -> float:
    """What PyTorch's caching host allocator takes for these backups: each rounded up to a
    power of two."""
    return sum(1 << (n - 1).bit_length() for n in sizes) / MIB


async def test_an_engines_device_and_host_memory_through_start_sleep_and_wake(
    tmp_path: Path, start_proxy: StartProxy, http: aiohttp.ClientSession
) -> None:
    """The rules of vLLM's CuMem path, played by the fake engine on a real device: ready
    without the activation peak, which the first request takes back (also after each wake);
    a sleep frees the whole allocation; level 1 pins at least the weights and the runtime pool
    on the host, level 2 the runtime pool; pinned blocks stay cached after the wake and are
    reused by the next sleep. Every reading goes to ``GPU_CHECK_OUT`` (JSON) when it is set."""
    size = moderate_mb()
    sizes = layout(size)
    peak, runtime = sizes.peak / MIB, sizes.runtime / MIB
    weights = sum(sizes.weights) / MIB
    policy = {"level": 1, "after_idle_s": 3600, "memory_mb": CONTEXT_MB}
    before = device().used_mb
    proxy = await start_proxy(
        gpu_config(tmp_path, {"m": engine(size + CONTEXT_MB, size, sleep=policy)})
    )
    facts = {
        "mb": size,
        "weights_mb": round(weights, 1),
        "weights_tensors": len(sizes.weights),
        "weights_pinned_blocks_mb": pinned_blocks_mb(list(sizes.weights)),
        "kv_cache_mb": round(sizes.kv_cache / MIB, 1),
        "runtime_mb": round(runtime, 1),
        "runtime_pinned_blocks_mb": pinned_blocks_mb([sizes.runtime]),
        "peak_mb": round(peak, 1),
        "device_used_before_mb": before,
    }
    record = Record(out_path(), device_facts(DEVICE), facts)

    async def step(name: str, seconds: float | None = None) -> Reading:
        inst = proxy.instance("m")
        assert inst.engine is not None and inst.engine.pid is not None
        held = await engine_metric(proxy, inst, "fake_engine:gpu_bytes") / MIB
        log = engine_log_text(proxy, "m")
        return record.add(measure(name, DEVICE, inst.engine.pid, held, log, seconds))

    async def timed(path: str) -> float:
        started = time.monotonic()
        await admin(http, proxy, path)
        return time.monotonic() - started

    async def first_request(name: str, woken: Reading) -> Reading:
        await chat(http, proxy, "m")
        full = await step(name)
        assert full.device_used_mb - woken.device_used_mb >= 0.9 * peak, (name, "peak back")
        assert full.engine_gpu_mb == size, name
        return full

    ready = await step("ready", await timed("m/load"))
    assert ready.engine_gpu_mb == pytest.approx(size - peak), "ready without the activation peak"
    assert ready.device_used_mb - before >= 0.9 * (size - peak)
    full = await first_request("first request", ready)

    pinned: float | None = None
    for name, level in (("level 1", 1), ("level 1 again", 1), ("level 2", 2)):
        asleep = await step(f"sleep {name}", await timed(f"m/sleep?level={level}"))
        assert full.device_used_mb - asleep.device_used_mb >= 0.9 * size, (name, "all freed")
        assert asleep.engine_gpu_mb == 0
        if asleep.pinned_mb is not None and asleep.pinned_in_use_mb is not None:
            kept = weights + runtime if level == 1 else runtime
            assert asleep.pinned_in_use_mb >= kept, (name, "backups in pinned host memory")
            if pinned is not None:
                assert asleep.pinned_mb <= pinned, (name, "cached pinned blocks are reused")
            pinned = asleep.pinned_mb
        woken = await step(f"wake {name}", await timed("m/wake"))
        back = woken.device_used_mb - asleep.device_used_mb
        assert back >= 0.9 * (size - peak), (name, "awake again")
        # Not the peak (half of it leaves room for torch's rounding of 36 allocations).
        assert back <= size - 0.5 * peak, (name, "woken without the activation peak")
        if woken.pinned_mb is not None and pinned is not None:
            assert woken.pinned_mb >= pinned, (name, "pinned blocks stay cached after the wake")
        full = await first_request(f"first request after {name}", woken)
    inst = proxy.instance("m")
    assert proxy.engine_starts("m") == 1, "woken each time, never restarted"
    assert await engine_metric(proxy, inst, "fake_engine:reload_weights_total") == 1
    assert await engine_metric(proxy, inst, "fake_engine:garbage_completions_total") == 0
