"""Weights read ahead into the page cache: which files, when host RAM allows, and when the proxy
asks (an engine stopped, asleep at level 2, a start waiting), with the fake engine."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
from kit import StartProxy, make_config, sleepy, wait_for
from kit import sleep_config as config
from kit.metrics import proxy_metric

from vllm_proxy.engines import readahead
from vllm_proxy.engines.instance import Instance
from vllm_proxy.engines.readahead import ReadAhead, fits, model_path, weight_files
from vllm_proxy.engines.states import State

MIB = 1024 * 1024


def safetensors(path: Path, size: int = 4096) -> Path:
    """A safetensors file `size` bytes long: a short header (no tensors), then data that
    nothing but a read-ahead reads (the planner reads headers)."""
    header = json.dumps({"__metadata__": {}}).encode().ljust(56)
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x01" * (size - 64))
    return path


#: Each weight file of `checkpoint`.
FILE_BYTES = 2 * MIB


def checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    safetensors(folder / "model-00001-of-00002.safetensors", FILE_BYTES)
    safetensors(folder / "model-00002-of-00002.safetensors", FILE_BYTES)
    return folder


def resident(path: Path) -> int:
    """Bytes of `path` in the page cache now."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return readahead.resident_bytes(fd)
    finally:
        os.close(fd)


def evict(path: Path) -> None:
    """Write `path` back and drop it from the page cache (skips where the file system keeps it,
    as tmpfs does)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if resident(path) > os.stat(path).st_size // 10:
        pytest.skip(f"{path.parent} cannot be dropped from the page cache")


def cold(folder: Path) -> Path:
    """`folder`'s weight files written back and dropped from the page cache."""
    for f in weight_files(folder):
        evict(f)
    return folder


def cached(folder: Path) -> list[str]:
    """`folder`'s weight files in the page cache (at least 90 % of each)."""
    return [str(f) for f in weight_files(folder) if resident(f) >= f.stat().st_size * 9 // 10]


# -- which files ------------------------------------------------------------------------------


def test_a_local_folder_gives_its_weight_files_safetensors_first(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path / "m")
    (folder / "pytorch_model.bin").write_bytes(b"x" * 10)  # vLLM reads the safetensors alone
    assert model_path(str(folder), {}) == folder
    assert [f.name for f in weight_files(folder)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    old = tmp_path / "old"
    old.mkdir()
    (old / "pytorch_model.bin").write_bytes(b"x")
    (old / "tokenizer.json").write_text("{}")
    assert [f.name for f in weight_files(old)] == ["pytorch_model.bin"]
    gguf = tmp_path / "q4.gguf"
    gguf.write_bytes(b"GGUF")
    assert weight_files(gguf) == [gguf]


def test_a_hub_id_is_found_in_the_local_hub_cache_without_the_network(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    repo = hub / "models--org--name"
    old, new = repo / "snapshots" / "aaa", repo / "snapshots" / "bbb"
    checkpoint(old)
    checkpoint(new)
    env = {"HF_HUB_CACHE": str(hub)}
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("aaa\n")
    assert model_path("org/name", env) == old  # the snapshot refs/main names
    (repo / "refs" / "main").unlink()
    os.utime(old, (1, 1))
    assert model_path("org/name", env) == new  # else the newest
    assert model_path("org/name", {"HF_HOME": str(tmp_path)}) == new  # HF_HOME/hub
    assert model_path("org/other", env) is None
    assert model_path("not-a-repo-id", env) is None
    assert readahead.hub_cache({}) == Path.home() / ".cache" / "huggingface" / "hub"


def test_nothing_is_read_ahead_when_host_ram_is_short(tmp_path: Path) -> None:
    folder = cold(checkpoint(tmp_path / "m"))
    assert not fits(8 * 1024 * MIB, 9 * 1024, margin_mb=2048)
    assert fits(8 * 1024 * MIB, 11 * 1024, margin_mb=2048)
    assert not fits(0, 10**6), "no files: nothing to do"
    out = readahead.read_ahead(str(folder), {}, room_mb=100, margin_mb=2048)
    assert out.skipped and out.files == 0 and not cached(folder)
    out = readahead.read_ahead(str(folder), {}, room_mb=10_000, margin_mb=2048)
    assert (out.files, out.skipped) == (2, "") and cached(folder) == [
        str(f) for f in weight_files(folder)
    ]
    assert 2 * FILE_BYTES * 9 // 10 <= out.bytes <= 2 * FILE_BYTES
    again = readahead.read_ahead(str(folder), {}, room_mb=10_000, margin_mb=2048)
    assert (again.files, again.bytes) == (2, 0), "already resident: nothing new counted"
    assert readahead.read_ahead("org/absent", {"HF_HUB_CACHE": str(tmp_path)}, 10**6, 0).skipped


def test_a_read_ahead_reads_the_whole_file_and_counts_what_became_resident(
    tmp_path: Path,
) -> None:
    """Regression (F3): one whole-file ``posix_fadvise(WILLNEED)`` read a few MiB of each file
    (the kernel caps one call at the device's read-ahead size) while the metric counted the
    file's size. A real file, evicted first; nothing monkeypatched."""
    size = 96 * MIB
    path = tmp_path / "big.safetensors"
    with path.open("wb") as f:
        for _ in range(size // MIB):
            f.write(os.urandom(MIB))
    evict(path)
    half = resident(path)
    got = readahead.advise([path])
    after = resident(path)
    assert after >= size * 9 // 10, f"{after} of {size} bytes resident"
    assert got <= after - half + readahead.PAGE, "never more than became resident"
    assert got >= size * 8 // 10


async def test_a_read_ahead_runs_in_its_own_thread(tmp_path: Path) -> None:
    """A long read must not queue the loop's default executor (NVML and RSS readings)."""
    import threading

    seen: list[str] = []
    real = readahead.advise

    def spy(files: list[Path], stop: threading.Event | None = None) -> int:
        seen.append(threading.current_thread().name)
        return real(files, stop)

    ahead = ReadAhead(margin_mb=0)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(readahead, "advise", spy)
            task = ahead.start(str(checkpoint(tmp_path / "m")), {}, lambda: 10**6, lambda _o: None)
            assert task is not None
            assert (await task).files == 2
    finally:
        ahead.close()
    assert seen and seen[0].startswith("read-ahead")


async def test_a_failing_read_ahead_fails_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: Any) -> None:
        raise OSError("no")

    monkeypatch.setattr(os, "preadv", broken)
    done: list[Any] = []
    ahead = ReadAhead(margin_mb=0)
    folder = cold(checkpoint(tmp_path / "m"))
    task = ahead.start(str(folder), {}, lambda: 10**6, done.append)
    assert task is not None
    assert ahead.start(str(folder), {}, lambda: 10**6, done.append) is None, "one at once"
    assert (await task).skipped.startswith("failed") and not done
    ahead.close()


# -- when the proxy asks ----------------------------------------------------------------------


async def settled(inst: Instance) -> None:
    ahead = inst.ctx.read_ahead
    assert ahead is not None
    await ahead.wait()


async def test_a_start_reads_the_weights_ahead_and_counts_them(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    folder = cold(checkpoint(tmp_path / "m"))
    proxy, inst = await start_proxy.serving(
        make_config(tmp_path, {"m": {"model": str(folder)}}), "m"
    )
    await settled(inst)
    assert cached(folder) == [str(f) for f in weight_files(folder)]
    assert await proxy_metric(proxy, "vllm_proxy_read_ahead_files_total", model_id="m") == 2
    counted = await proxy_metric(proxy, "vllm_proxy_read_ahead_bytes_total", model_id="m")
    assert counted is not None and 2 * FILE_BYTES * 9 // 10 <= counted <= 2 * FILE_BYTES


async def test_an_idle_stop_reads_the_weights_ahead(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    folder = checkpoint(tmp_path / "m")
    cfg = make_config(tmp_path, {"m": {"model": str(folder), "idle_timeout_s": 0.5}})
    _, inst = await start_proxy.serving(cfg, "m")
    await settled(inst)
    cold(folder)
    await wait_for(lambda: inst.state is State.STOPPED, what="idle stop")
    await wait_for(lambda: len(cached(folder)) == 2, what="read-ahead after the stop")


async def test_an_engine_stopped_to_make_room_is_not_read_ahead(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Its reads would compete with the load of the model it made room for."""
    folder = checkpoint(tmp_path / "m")
    _, inst = await start_proxy.serving(make_config(tmp_path, {"m": {"model": str(folder)}}), "m")
    await settled(inst)
    cold(folder)
    task = inst.evict("memory")
    assert task is not None
    await task
    assert inst.state is State.STOPPED
    await settled(inst)
    assert cached(folder) == []


async def test_a_level_2_sleep_reads_the_weights_ahead_and_level_1_does_not(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    folder = checkpoint(tmp_path / "m")
    models = {
        "m": sleepy(sleep={"level": 2, "after_idle_s": 60}, model=str(folder)),
        "one": sleepy(sleep={"level": 1, "after_idle_s": 60}, model=str(folder)),
    }
    proxy, inst = await start_proxy.serving(config(tmp_path, models), "m")
    await asleep_after_read_ahead(inst, folder)
    assert inst.sleep_level == 2 and len(cached(folder)) == 2
    assert (await proxy.reply("one", max_tokens=2))[0] == 200
    one = proxy.instance("one")
    await asleep_after_read_ahead(one, folder)
    assert one.sleep_level == 1 and not cached(folder)


async def asleep_after_read_ahead(inst: Instance, folder: Path) -> None:
    """`inst` put to sleep, with what its start read ahead done and evicted, and what its
    sleep read ahead (if anything) done."""
    await settled(inst)
    cold(folder)
    task = inst.sleep("test")
    assert task is not None
    await task
    await settled(inst)


async def test_read_ahead_false_turns_it_off(tmp_path: Path, start_proxy: StartProxy) -> None:
    folder = cold(checkpoint(tmp_path / "m"))
    cfg = make_config(tmp_path, {"m": {"model": str(folder), "read_ahead": False}})
    _, inst = await start_proxy.serving(cfg, "m")
    await settled(inst)
    await inst.stop()
    assert inst.read_ahead("test") is None and not cached(folder)
