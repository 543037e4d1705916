"""The fake engine's GPU mode (FAKE_ENGINE_GPU_MB), through a stand-in torch that logs each call.

Start-up errors, and what sleep and wake do to the device memory; one test runs real torch on a
real GPU where there is one.
"""

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kit import FakeEngine
from test_fake_engine import (
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
    session,
    start_fake,
    wait_ready,
)

__all__ = ["session", "start_fake"]  # fixtures shared with test_fake_engine

MIB = 1024 * 1024
GPU_BYTES = f"fake_engine:gpu_bytes{{{LABELS}}}"

# The calls gpu.py makes, on a pretend device with STUB_TORCH_LIMIT_FILE bytes (read on each
# allocation); device bytes go down when a tensor is garbage-collected, so a reference kept by
# mistake shows as memory still held at empty_cache.
STUB_TORCH = """
import json, os, types

__version__ = "0.0-stub"
uint8 = "uint8"
_held = 0


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
    def __init__(self, size, where):
        global _held
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

    def copy_(self, other):
        _log("copy", src=other.where, dst=self.where, bytes=self.size)
        return self

    def fill_(self, value):
        _log("fill", where=self.where, bytes=self.size)
        return self


def empty(size, dtype=None, device=None, pin_memory=False):
    where = "cuda" if device is not None and device.type == "cuda" else "host"
    tensor = Tensor(size, where)
    _log("empty", where=where, bytes=size, pinned=pin_memory)
    return tensor


cuda = types.SimpleNamespace(
    is_available=lambda: os.environ.get("STUB_TORCH_CUDA") == "1",
    empty_cache=lambda: _log("empty_cache"),
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
        self.limit.write_text(str(megabytes * MIB))

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
    wait_ready(fake)
    return fake


# --------------------------------------------------------------------------- start-up


def test_gpu_mode_without_cuda_exits_with_a_clear_message(
    start_fake: StartFake, stub: StubTorch
) -> None:
    fake = start_fake(env={**stub.env(cuda=False), **FakeEngine(gpu_mb=10).env()})
    assert fake.wait_exit() == 1
    assert "FAKE_ENGINE_GPU_MB=10: GPU mode needs CUDA, but torch 0.0-stub sees no CUDA device" in (
        fake.stderr()
    )
    assert "Application startup complete." not in fake.stdout()


def test_gpu_mode_here_without_cuda_or_torch_exits_with_a_clear_message(
    start_fake: StartFake,
) -> None:
    """The real environment with no device visible: no torch, or torch without CUDA."""
    fake = start_fake(env={**FakeEngine(gpu_mb=10).env(), "CUDA_VISIBLE_DEVICES": ""})
    assert fake.wait_exit() == 1
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
    assert fake.wait_exit() == 1
    assert "FAKE_ENGINE_GPU_MB=10: cannot hold 10 MiB on cuda:0" in fake.stderr()
    assert "Application startup complete." not in fake.stdout()


def test_torch_is_not_imported_without_gpu_mode(start_fake: StartFake, stub: StubTorch) -> None:
    fake = start_fake(env={**SLEEP_ENV, **stub.env()}, args=SLEEP_ARGS)
    wait_ready(fake)
    assert not stub.log.exists()


# --------------------------------------------------------------------------- sleep and wake


async def test_level_1_offloads_weights_to_pinned_memory_and_frees_the_device(
    start_fake: StartFake, stub: StubTorch, session: aiohttp.ClientSession
) -> None:
    fake = start_gpu(start_fake, stub)
    weights, kv = 7 * MIB, 3 * MIB
    startup = stub.calls()
    assert [(c["event"], c.get("where"), c.get("bytes")) for c in startup] == [
        ("import", None, None), ("empty", "cuda", weights), ("empty", "cuda", kv),
        ("fill", "cuda", weights),
    ]  # fmt: skip
    assert await metric(session, fake, GPU_BYTES) == 10 * MIB

    assert (await post(session, f"{fake.url}/sleep?level=1", None))[0] == 200
    assert await metric(session, fake, GPU_BYTES) == 0.0
    calls = stub.calls()
    assert calls[0] == {
        "event": "empty", "device_bytes": 10 * MIB, "where": "host", "bytes": weights,
        "pinned": True,
    }  # fmt: skip
    assert calls[1]["event"] == "copy"
    assert (calls[1]["src"], calls[1]["dst"], calls[1]["bytes"]) == ("cuda", "host", weights)
    assert calls[2:] == [{"event": "empty_cache", "device_bytes": 0}]
    await assert_refused(session, fake)

    assert (await post(session, f"{fake.url}/wake_up", None))[0] == 200
    assert await metric(session, fake, GPU_BYTES) == 10 * MIB
    copies = [c for c in stub.calls() if c["event"] == "copy"]
    assert [(c["src"], c["dst"], c["bytes"]) for c in copies] == [("host", "cuda", weights)]
    assert await chat_text(session, fake) == NORMAL_TEXT


async def test_level_2_discards_everything_and_reload_rewrites_the_weights(
    start_fake: StartFake, stub: StubTorch, session: aiohttp.ClientSession
) -> None:
    fake = start_gpu(start_fake, stub)
    stub.calls()
    assert (await post(session, f"{fake.url}/sleep?level=2", None))[0] == 200
    assert stub.calls() == [{"event": "empty_cache", "device_bytes": 0}]
    assert await metric(session, fake, GPU_BYTES) == 0.0

    woken = await post(session, f"{fake.url}/wake_up?tags=weights", None)
    assert woken == (200, {"status": "sleeping", "tags": ["weights"]})
    assert await metric(session, fake, GPU_BYTES) == 7 * MIB
    assert [c["event"] for c in stub.calls()] == ["empty"]
    assert (await post(session, f"{fake.url}/wake_up", None))[0] == 200
    assert await metric(session, fake, GPU_BYTES) == 10 * MIB
    assert await chat_text(session, fake) == GARBAGE_TEXT
    stub.calls()

    rpc = await post(session, f"{fake.url}/collective_rpc", {"method": "reload_weights"})
    assert rpc == (200, {"results": [None]})
    [fill] = stub.calls()
    assert (fill["event"], fill["where"], fill["bytes"]) == ("fill", "cuda", 7 * MIB)
    assert await chat_text(session, fake) == NORMAL_TEXT


async def test_wake_without_room_on_the_device_fails_and_stays_asleep(
    start_fake: StartFake, stub: StubTorch, session: aiohttp.ClientSession
) -> None:
    fake = start_gpu(start_fake, stub)
    assert (await post(session, f"{fake.url}/sleep?level=1", None))[0] == 200
    stub.set_limit_mb(8)
    status, body = await post(session, f"{fake.url}/wake_up", None)
    assert status == 500
    assert body["error"]["type"] == "InternalServerError"
    assert "out of memory" in body["error"]["message"]
    assert await is_sleeping(session, fake)
    await assert_refused(session, fake)
    assert await metric(session, fake, GPU_BYTES) == 7 * MIB  # the weights came back first

    stub.set_limit_mb(1024)
    assert await post(session, f"{fake.url}/wake_up", None) == (
        200, {"status": "awake", "tags": None}
    )  # fmt: skip
    assert await metric(session, fake, GPU_BYTES) == 10 * MIB
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
    wait_ready(fake, timeout=120.0)  # importing torch and starting CUDA come first
    assert await metric(session, fake, GPU_BYTES) == megabytes * MIB
    awake = _device_used_bytes()
    for level in (1, 2):
        assert (await post(session, f"{fake.url}/sleep?level={level}", None))[0] == 200
        assert await metric(session, fake, GPU_BYTES) == 0.0
        asleep = _device_used_bytes()
        assert awake - asleep >= 0.9 * megabytes * MIB, (level, awake, asleep)
        assert (await post(session, f"{fake.url}/wake_up", None))[0] == 200
        assert _device_used_bytes() - asleep >= 0.9 * megabytes * MIB
    assert await chat_text(session, fake) == GARBAGE_TEXT
    assert (await post(session, f"{fake.url}/collective_rpc", {"method": "reload_weights"}))[
        0
    ] == 200
    assert await chat_text(session, fake) == NORMAL_TEXT
