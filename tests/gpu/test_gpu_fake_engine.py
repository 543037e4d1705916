"""The fake engine's GPU mode (FAKE_ENGINE_GPU_MB), through a stand-in torch that logs each call.

Start-up errors, and what sleep and wake do to the device memory; one test runs real torch on a
real GPU where there is one.
"""

import importlib.util
import json
import os
import types
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kit import FakeEngine
from kit.fakeproc import (
    CHAT,
    GARBAGE_TEXT,
    LABELS,
    NORMAL_TEXT,
    ROOT,
    SLEEP_ARGS,
    SLEEP_ENV,
    Fake,
    StartFake,
    assert_refused,
    chat_text,
    is_sleeping,
    metric,
    post,
    wait_ready,
)
from kit.gpumeasure import pinned_from_log

from fake_vllm.gpu import layout

MIB = 1024 * 1024
#: Bound for an engine that imports the real torch (seconds on an idle machine; much more on a
#: busy one). Waits return as soon as the engine is done.
TORCH_IMPORT_S = 120.0
#: The same for an engine on the stand-in torch (under a second on an idle machine).
START_S = 60.0
GPU_BYTES = f"fake_engine:gpu_bytes{{{LABELS}}}"

# The calls gpu.py makes, on a pretend device with STUB_TORCH_LIMIT_FILE bytes (read on each
# allocation); device bytes go down when a tensor is garbage-collected, so a reference kept by
# mistake shows as memory still held at empty_cache.
STUB_TORCH = """
import json, os, types

__version__ = "0.0-stub"
uint8 = "uint8"
_held = 0
# Pinned host blocks as PyTorch's caching host allocator keeps them: rounded up to a power of
# two, cached when freed, reused by size.
_pinned = {"held": 0, "active": 0}
_cached = {}


def _log(event, **fields):
    with open(os.environ["STUB_TORCH_LOG"], "a") as out:
        out.write(json.dumps({"event": event, "device_bytes": _held, **fields}) + "\\n")


class OutOfMemoryError(RuntimeError):
    pass


class device:
    def __init__(self, spec):
        kind, _, index = str(spec).partition(":")
        if kind not in ("cuda", "cpu") or (index and not index.isdigit()):
            raise RuntimeError(f"Invalid device string: {spec!r}")
        self.type = kind

    def __str__(self):
        return self.type


class Tensor:
    def __init__(self, size, where, pinned=False):
        global _held
        self.block = 1 << (size - 1).bit_length() if pinned else 0
        if self.block:
            if _cached.get(self.block):
                _cached[self.block] -= 1
            else:
                _pinned["held"] += self.block
            _pinned["active"] += self.block
        if where == "cuda":
            with open(os.environ["STUB_TORCH_LIMIT_FILE"]) as limit:
                if _held + size > int(limit.read()):
                    raise OutOfMemoryError("CUDA out of memory (stub)")
            _held += size
        self.size, self.where = size, where

    def __del__(self):
        global _held
        if self.where == "cuda":
            _held -= self.size
        if self.block:
            _pinned["active"] -= self.block
            _cached[self.block] = _cached.get(self.block, 0) + 1

    def copy_(self, other):
        _log("copy", src=other.where, dst=self.where, bytes=self.size)
        return self

    def fill_(self, value):
        _log("fill", where=self.where, bytes=self.size)
        return self


def empty(size, dtype=None, device=None, pin_memory=False):
    where = "cuda" if device is not None and device.type == "cuda" else "host"
    tensor = Tensor(size, where, pin_memory)
    _log("empty", where=where, bytes=size, pinned=pin_memory)
    return tensor


cuda = types.SimpleNamespace(
    is_available=lambda: os.environ.get("STUB_TORCH_CUDA") == "1",
    empty_cache=lambda: _log("empty_cache"),
    host_memory_stats=lambda: {
        "allocated_bytes.current": _pinned["held"], "active_bytes.current": _pinned["active"],
    },
    synchronize=lambda device=None: None,
    OutOfMemoryError=OutOfMemoryError,
)
_log("import")
"""


class StubTorch:
    def __init__(self, root: Path) -> None:
        (root / "torch").mkdir(parents=True)
        (root / "torch" / "__init__.py").write_text(STUB_TORCH)
        self.root = root
        self.log = root / "calls.jsonl"
        self.limit = root / "limit"
        self.set_limit_mb(1024)

    def set_limit_mb(self, megabytes: int) -> None:
        self.set_limit_bytes(megabytes * MIB)

    def set_limit_bytes(self, limit: int) -> None:
        self.limit.write_text(str(limit))

    def env(self, cuda: bool = True) -> dict[str, str]:
        return {
            "PYTHONPATH": os.pathsep.join([str(self.root), str(ROOT)]),
            "STUB_TORCH_LOG": str(self.log),
            "STUB_TORCH_LIMIT_FILE": str(self.limit),
            "STUB_TORCH_CUDA": "1" if cuda else "0",
        }

    def calls(self) -> list[dict[str, Any]]:
        """The calls logged since the last time this was asked."""
        if not self.log.exists():
            return []
        lines = self.log.read_text().splitlines()
        self.log.unlink()
        return [json.loads(line) for line in lines]


@pytest.fixture
def stub(tmp_path: Path) -> StubTorch:
    return StubTorch(tmp_path / "stub")


def start_gpu(start_fake: StartFake, stub: StubTorch, megabytes: int = 10) -> Fake:
    env = {**SLEEP_ENV, **stub.env(), **FakeEngine(gpu_mb=megabytes).env()}
    fake = start_fake(env=env, args=SLEEP_ARGS)
    wait_ready(fake, timeout=START_S)
    return fake


# --------------------------------------------------------------------------- start-up


def test_gpu_mode_without_cuda_exits_with_a_clear_message(
    start_fake: StartFake, stub: StubTorch
) -> None:
    fake = start_fake(env={**stub.env(cuda=False), **FakeEngine(gpu_mb=10).env()})
    assert fake.wait_exit(START_S) == 1
    assert "FAKE_ENGINE_GPU_MB=10: GPU mode needs CUDA, but torch 0.0-stub sees no CUDA device" in (
        fake.stderr()
    )
    assert "Application startup complete." not in fake.stdout()


def test_gpu_mode_here_without_cuda_or_torch_exits_with_a_clear_message(
    start_fake: StartFake,
) -> None:
    """The real environment with no device visible: no torch, or torch without CUDA."""
    fake = start_fake(env={**FakeEngine(gpu_mb=10).env(), "CUDA_VISIBLE_DEVICES": ""})
    assert fake.wait_exit(TORCH_IMPORT_S) == 1
    if importlib.util.find_spec("torch") is None:
        expected = "FAKE_ENGINE_GPU_MB=10: GPU mode needs torch, which cannot be imported"
    else:
        expected = "FAKE_ENGINE_GPU_MB=10: GPU mode needs CUDA"
    assert expected in fake.stderr()


def test_gpu_mode_fails_start_up_when_the_memory_is_not_there(
    start_fake: StartFake, stub: StubTorch
) -> None:
    stub.set_limit_mb(5)
    fake = start_fake(env={**stub.env(), **FakeEngine(gpu_mb=10).env()})
    assert fake.wait_exit(START_S) == 1
    assert "FAKE_ENGINE_GPU_MB=10: cannot hold 10 MiB on cuda:0" in fake.stderr()
    assert "Application startup complete." not in fake.stdout()


def test_torch_is_not_imported_without_gpu_mode(start_fake: StartFake, stub: StubTorch) -> None:
    fake = start_fake(env={**SLEEP_ENV, **stub.env()}, args=SLEEP_ARGS)
    wait_ready(fake, timeout=START_S)
    assert not stub.log.exists()


# --------------------------------------------------------------------------- sleep and wake

LAYOUT = layout(10)
TOTAL = LAYOUT.total
READY = TOTAL - LAYOUT.peak
RUNTIME, WEIGHTS, KV = LAYOUT.runtime, sum(LAYOUT.weights), LAYOUT.kv_cache


def moves(calls: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """The calls as (event, where or src->dst, bytes), in order."""
    out: list[tuple[Any, ...]] = []
    for call in calls:
        where = call.get("where") or (f"{call['src']}->{call['dst']}" if "src" in call else None)
        out.append((call["event"], where, call.get("bytes")))
    return out


def test_the_layout_splits_the_total_into_uneven_weights_kv_runtime_and_peak() -> None:
    big = layout(4096)
    assert big.total == 4096 * MIB
    assert len(big.weights) == 2 + 4 * 8
    assert len(set(big.weights[1:-1])) == 4, "four tensors per layer"
    assert abs(big.weights[0] - big.weights[-1]) < MIB, "embedding and LM head"
    assert abs(sum(big.weights) - 0.6 * big.total) < MIB
    assert big.peak > 0.1 * big.total and big.runtime > 0


async def test_start_frees_the_profiled_peak_and_the_first_request_takes_it_back(
    start_fake: StartFake, stub: StubTorch, session: aiohttp.ClientSession
) -> None:
    fake = start_gpu(start_fake, stub)
    startup = moves(stub.calls())
    weights = [("empty", "cuda", n) for n in LAYOUT.weights]
    fills = [("fill", "cuda", n) for n in LAYOUT.weights]
    assert startup == [
        ("import", None, None), ("empty", "cuda", RUNTIME), *weights, *fills,
        ("empty", "cuda", LAYOUT.peak), ("empty_cache", None, None), ("empty", "cuda", KV),
    ]  # fmt: skip
    assert await metric(session, fake, GPU_BYTES) == READY, "ready without the peak"
    assert await chat_text(session, fake) == NORMAL_TEXT
    assert moves(stub.calls()) == [("empty", "cuda", LAYOUT.peak)]
    assert await metric(session, fake, GPU_BYTES) == TOTAL
    assert await chat_text(session, fake) == NORMAL_TEXT
    assert stub.calls() == [], "the peak is taken back once"


async def test_a_request_without_room_for_the_peak_fails_and_the_engine_stays_up(
    start_fake: StartFake, stub: StubTorch, session: aiohttp.ClientSession
) -> None:
    fake = start_gpu(start_fake, stub)
    stub.set_limit_mb(9)
    status, body = await post(session, f"{fake.url}/v1/chat/completions", CHAT)
    assert status == 500, body
    assert "CUDA out of memory" in body["error"]["message"]
    stub.set_limit_mb(1024)
    assert await chat_text(session, fake) == NORMAL_TEXT
    assert await metric(session, fake, GPU_BYTES) == TOTAL


async def test_level_1_backs_up_each_weights_tensor_and_the_runtime_pool_in_pinned_memory(
    start_fake: StartFake, stub: StubTorch, session: aiohttp.ClientSession
) -> None:
    fake = start_gpu(start_fake, stub)
    assert await chat_text(session, fake) == NORMAL_TEXT
    stub.calls()
    assert (await post(session, f"{fake.url}/sleep?level=1", None))[0] == 200
    assert await metric(session, fake, GPU_BYTES) == 0.0
    calls = stub.calls()
    pinned = [c for c in calls if c["event"] == "empty"]
    assert all(c["where"] == "host" and c["pinned"] for c in pinned)
    assert [c["bytes"] for c in pinned] == [RUNTIME, *LAYOUT.weights], "one backup each"
    copies = [m for m in moves(calls) if m[0] == "copy"]
    assert copies == [("copy", "cuda->host", n) for n in (RUNTIME, *LAYOUT.weights)]
    assert calls[-1] == {"event": "empty_cache", "device_bytes": 0}, "all freed, then handed back"
    await assert_refused(session, fake)

    assert (await post(session, f"{fake.url}/wake_up", None))[0] == 200
    woken = moves(stub.calls())
    assert woken[0] == ("empty_cache", None, None), "the wake empties torch's cache first"
    assert [m for m in woken if m[0] == "copy"] == [
        ("copy", "host->cuda", n) for n in (RUNTIME, *LAYOUT.weights)
    ]
    assert ("empty", "cuda", LAYOUT.peak) not in woken
    assert await metric(session, fake, GPU_BYTES) == READY, "woken without the peak"
    assert await chat_text(session, fake) == NORMAL_TEXT
    assert await metric(session, fake, GPU_BYTES) == TOTAL
    assert "CuMemAllocator: sleep freed" in fake.stdout()


async def test_pinned_backups_are_dropped_at_the_wake_and_their_blocks_stay_cached(
    start_fake: StartFake, stub: StubTorch, session: aiohttp.ClientSession
) -> None:
    """The engine logs what torch's host allocator holds after each sleep and wake; the GPU
    check reads it back (`kit.gpumeasure.pinned_from_log`)."""
    fake = start_gpu(start_fake, stub)
    blocks = sum(1 << (n - 1).bit_length() for n in (RUNTIME, *LAYOUT.weights)) / MIB
    runtime_block = (1 << (RUNTIME - 1).bit_length()) / MIB
    expected = (
        (1, blocks, blocks), ("wake", blocks, 0.0), (1, blocks, blocks), ("wake", blocks, 0.0),
        (2, blocks, runtime_block), ("wake", blocks, 0.0),
    )  # fmt: skip
    for level, held, in_use in expected:
        if level == "wake":
            assert (await post(session, f"{fake.url}/wake_up", None))[0] == 200
        else:
            assert (await post(session, f"{fake.url}/sleep?level={level}", None))[0] == 200
        assert pinned_from_log(fake.stdout()) == (held, in_use), level
    assert blocks > (RUNTIME + WEIGHTS) / MIB, "rounded up to powers of two"


async def test_level_2_keeps_only_the_runtime_pool_and_reload_rewrites_the_weights(
    start_fake: StartFake, stub: StubTorch, session: aiohttp.ClientSession
) -> None:
    fake = start_gpu(start_fake, stub)
    stub.calls()
    assert (await post(session, f"{fake.url}/sleep?level=2", None))[0] == 200
    slept = moves(stub.calls())
    assert [m for m in slept if m[0] in ("empty", "copy")] == [
        ("empty", "host", RUNTIME), ("copy", "cuda->host", RUNTIME),
    ]  # fmt: skip
    assert slept[-1] == ("empty_cache", None, None)
    assert await metric(session, fake, GPU_BYTES) == 0.0

    woken = await post(session, f"{fake.url}/wake_up?tags=weights", None)
    assert woken == (200, {"status": "sleeping", "tags": ["weights"]})
    assert await metric(session, fake, GPU_BYTES) == RUNTIME + WEIGHTS, "runtime comes back too"
    assert [m for m in moves(stub.calls()) if m[0] == "copy"] == [("copy", "host->cuda", RUNTIME)]
    assert (await post(session, f"{fake.url}/wake_up", None))[0] == 200
    assert await metric(session, fake, GPU_BYTES) == READY
    assert await chat_text(session, fake) == GARBAGE_TEXT
    stub.calls()

    rpc = await post(session, f"{fake.url}/collective_rpc", {"method": "reload_weights"})
    assert rpc == (200, {"results": [None]})
    assert moves(stub.calls()) == [("fill", "cuda", n) for n in LAYOUT.weights]
    assert await chat_text(session, fake) == NORMAL_TEXT


async def test_wake_without_room_on_the_device_fails_and_stays_asleep(
    start_fake: StartFake, stub: StubTorch, session: aiohttp.ClientSession
) -> None:
    fake = start_gpu(start_fake, stub)
    assert (await post(session, f"{fake.url}/sleep?level=1", None))[0] == 200
    stub.set_limit_bytes(RUNTIME + WEIGHTS + KV // 2)
    status, body = await post(session, f"{fake.url}/wake_up", None)
    assert status == 500
    assert body["error"]["type"] == "InternalServerError"
    assert "out of memory" in body["error"]["message"]
    assert await is_sleeping(session, fake)
    await assert_refused(session, fake)
    assert await metric(session, fake, GPU_BYTES) == RUNTIME + WEIGHTS, "the weights came back"

    stub.set_limit_mb(1024)
    assert await post(session, f"{fake.url}/wake_up", None) == (
        200, {"status": "awake", "tags": None}
    )  # fmt: skip
    assert await metric(session, fake, GPU_BYTES) == READY
    assert await chat_text(session, fake) == NORMAL_TEXT


# --------------------------------------------------------------------------- a real GPU


def _cuda_device_count() -> int:
    if importlib.util.find_spec("torch") is None:
        return 0
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return 0
    try:
        count: int = pynvml.nvmlDeviceGetCount()
        return count
    finally:
        pynvml.nvmlShutdown()


def _device_used_bytes() -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        used: int = pynvml.nvmlDeviceGetMemoryInfo(handle).used
        return used
    finally:
        pynvml.nvmlShutdown()


@pytest.mark.skipif(_cuda_device_count() == 0, reason="needs torch and an NVIDIA GPU")
async def test_real_gpu_memory_is_freed_by_sleep_and_taken_back_by_wake(
    start_fake: StartFake, session: aiohttp.ClientSession
) -> None:
    megabytes = 2048
    env = {**SLEEP_ENV, **FakeEngine(gpu_mb=megabytes).env(), "CUDA_VISIBLE_DEVICES": "0"}
    fake = start_fake(env=env, args=SLEEP_ARGS)
    wait_ready(fake, timeout=TORCH_IMPORT_S)  # importing torch and starting CUDA come first
    sizes = layout(megabytes)
    assert await metric(session, fake, GPU_BYTES) == sizes.total - sizes.peak
    ready = _device_used_bytes()
    assert await chat_text(session, fake) == NORMAL_TEXT
    assert await metric(session, fake, GPU_BYTES) == sizes.total
    awake = _device_used_bytes()
    assert awake - ready >= 0.9 * sizes.peak, "the first request takes the peak back"
    for level in (1, 2):
        assert (await post(session, f"{fake.url}/sleep?level={level}", None))[0] == 200
        assert await metric(session, fake, GPU_BYTES) == 0.0
        asleep = _device_used_bytes()
        assert awake - asleep >= 0.9 * sizes.total, (level, awake, asleep)
        assert (await post(session, f"{fake.url}/wake_up", None))[0] == 200
        woken = _device_used_bytes() - asleep
        assert woken >= 0.9 * (sizes.total - sizes.peak), (level, woken)
        # Not the peak (half of it leaves room for torch's rounding of 36 allocations).
        assert woken <= sizes.total - 0.5 * sizes.peak, (level, "woken without the peak")
        text = await chat_text(session, fake)
        assert text == (NORMAL_TEXT if level == 1 else GARBAGE_TEXT)
        awake = _device_used_bytes()
    assert (await post(session, f"{fake.url}/collective_rpc", {"method": "reload_weights"}))[
        0
    ] == 200
    assert await chat_text(session, fake) == NORMAL_TEXT


@pytest.mark.parametrize(
    ("stats", "expected"),
    [
        # Newer torch: allocated = held (in use and cached), active = in use.
        ({"allocated_bytes.current": 8, "active_bytes.current": 2, "reserved_bytes.current": 9},
         {"pinned_bytes": 8, "pinned_in_use_bytes": 2}),
        # Older torch: reserved = held, allocated = in use (no active_bytes).
        ({"allocated_bytes.current": 2, "reserved_bytes.current": 8},
         {"pinned_bytes": 8, "pinned_in_use_bytes": 2}),
        ({}, {}),
    ],
)  # fmt: skip
def test_host_memory_stats_keys_are_read_by_presence(
    stats: dict[str, int], expected: dict[str, int]
) -> None:
    """Regression (review 3, section 4): the keys were those of one PyTorch version only."""
    from fake_vllm.gpu import GpuMemory

    gpu = GpuMemory.__new__(GpuMemory)
    gpu.torch = types.SimpleNamespace(cuda=types.SimpleNamespace(host_memory_stats=lambda: stats))
    assert gpu.pinned_bytes() == expected
    assert gpu.host_memory_stats() == stats
