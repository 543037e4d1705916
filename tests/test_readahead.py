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
    """A valid safetensors file with no tensors, `size` bytes long (the header padded)."""
    header = json.dumps({"__metadata__": {}}).encode().ljust(size - 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    return path


def checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    safetensors(folder / "model-00001-of-00002.safetensors")
    safetensors(folder / "model-00002-of-00002.safetensors")
    return folder


@pytest.fixture
def advised(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files `posix_fadvise(WILLNEED)` was called on (the call itself is not made)."""
    calls: list[str] = []

    def fake(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_WILLNEED and (offset, length) == (0, 0)
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(os, "posix_fadvise", fake)
    return calls


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


def test_nothing_is_read_ahead_when_host_ram_is_short(tmp_path: Path, advised: list[str]) -> None:
    folder = checkpoint(tmp_path / "m")
    assert not fits(8 * 1024 * MIB, 9 * 1024, margin_mb=2048)
    assert fits(8 * 1024 * MIB, 11 * 1024, margin_mb=2048)
    assert not fits(0, 10**6), "no files: nothing to do"
    out = readahead.read_ahead(str(folder), {}, room_mb=100, margin_mb=2048)
    assert out.skipped and out.files == 0 and not advised
    out = readahead.read_ahead(str(folder), {}, room_mb=10_000, margin_mb=2048)
    assert (out.files, out.bytes, out.skipped) == (2, 8192, "")
    assert sorted(Path(p).name for p in advised) == [f.name for f in weight_files(folder)]
    assert readahead.read_ahead("org/absent", {"HF_HUB_CACHE": str(tmp_path)}, 10**6, 0).skipped


async def test_a_failing_read_ahead_fails_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: Any) -> None:
        raise OSError("no")

    monkeypatch.setattr(os, "posix_fadvise", broken)
    done: list[Any] = []
    ahead = ReadAhead(margin_mb=0)
    task = ahead.start(str(checkpoint(tmp_path / "m")), {}, lambda: 10**6, done.append)
    assert task is not None
    assert ahead.start(str(tmp_path / "m"), {}, lambda: 10**6, done.append) is None, "one at once"
    assert (await task).skipped.startswith("failed") and not done


# -- when the proxy asks ----------------------------------------------------------------------


async def settled(inst: Instance) -> None:
    ahead = inst.ctx.read_ahead
    assert ahead is not None
    await ahead.wait()


async def test_a_start_reads_the_weights_ahead_and_counts_them(
    tmp_path: Path, start_proxy: StartProxy, advised: list[str]
) -> None:
    folder = checkpoint(tmp_path / "m")
    proxy, inst = await start_proxy.serving(
        make_config(tmp_path, {"m": {"model": str(folder)}}), "m"
    )
    await settled(inst)
    assert sorted(advised) == [str(f) for f in weight_files(folder)]
    assert await proxy_metric(proxy, "vllm_proxy_read_ahead_files_total", model_id="m") == 2
    assert await proxy_metric(proxy, "vllm_proxy_read_ahead_bytes_total", model_id="m") == 8192


async def test_an_idle_stop_reads_the_weights_ahead(
    tmp_path: Path, start_proxy: StartProxy, advised: list[str]
) -> None:
    folder = checkpoint(tmp_path / "m")
    cfg = make_config(tmp_path, {"m": {"model": str(folder), "idle_timeout_s": 0.5}})
    _, inst = await start_proxy.serving(cfg, "m")
    await settled(inst)
    advised.clear()
    await wait_for(lambda: inst.state is State.STOPPED, what="idle stop")
    await wait_for(lambda: len(advised) == 2, what="read-ahead after the stop")


async def test_an_engine_stopped_to_make_room_is_not_read_ahead(
    tmp_path: Path, start_proxy: StartProxy, advised: list[str]
) -> None:
    """Its reads would compete with the load of the model it made room for."""
    folder = checkpoint(tmp_path / "m")
    _, inst = await start_proxy.serving(make_config(tmp_path, {"m": {"model": str(folder)}}), "m")
    await settled(inst)
    advised.clear()
    task = inst.evict("memory")
    assert task is not None
    await task
    assert inst.state is State.STOPPED
    await settled(inst)
    assert advised == []


async def test_a_level_2_sleep_reads_the_weights_ahead_and_level_1_does_not(
    tmp_path: Path, start_proxy: StartProxy, advised: list[str]
) -> None:
    folder = checkpoint(tmp_path / "m")
    models = {
        "m": sleepy(sleep={"level": 2, "after_idle_s": 60}, model=str(folder)),
        "one": sleepy(sleep={"level": 1, "after_idle_s": 60}, model=str(folder)),
    }
    proxy, inst = await start_proxy.serving(config(tmp_path, models), "m")
    await asleep_after_read_ahead(inst, advised)
    assert inst.sleep_level == 2 and len(advised) == 2
    assert (await proxy.reply("one", max_tokens=2))[0] == 200
    one = proxy.instance("one")
    await asleep_after_read_ahead(one, advised)
    assert one.sleep_level == 1 and not advised


async def asleep_after_read_ahead(inst: Instance, advised: list[str]) -> None:
    """`inst` put to sleep, with what its start read ahead done and forgotten, and what its
    sleep read ahead (if anything) done."""
    await settled(inst)
    advised.clear()
    task = inst.sleep("test")
    assert task is not None
    await task
    await settled(inst)


async def test_read_ahead_false_turns_it_off(
    tmp_path: Path, start_proxy: StartProxy, advised: list[str]
) -> None:
    folder = checkpoint(tmp_path / "m")
    cfg = make_config(tmp_path, {"m": {"model": str(folder), "read_ahead": False}})
    _, inst = await start_proxy.serving(cfg, "m")
    await settled(inst)
    await inst.stop()
    assert inst.read_ahead("test") is None and not advised
