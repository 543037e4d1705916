"""GPU snapshots (NVML through a fake module, static budget) and footprint estimates."""

from __future__ import annotations

import asyncio
import json
import math
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kit import wait_for

from vllm_proxy.config import parse_config
from vllm_proxy.errors import ConfigError
from vllm_proxy.planning.footprint import (
    Footprint,
    estimate_footprint_mb,
    footprint_for_spec,
    pinned_weights_mb,
    sampler_state_bytes,
    sampler_state_tensors,
    tensor_sizes,
    token_buffer_mb,
    torch_segments,
    utilization_for,
)
from vllm_proxy.planning.gpu import GpuSnapshot, NvmlMonitor, StaticBudget
from vllm_proxy.planning.memory import DeviceLock, Use

MIB = 1024 * 1024


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class FakeNvml:
    """The slice of pynvml the monitor uses; devices are (total, used) in MiB."""

    NVMLError = NVMLError

    def __init__(self, devices: list[tuple[int, int]], fail_init: bool = False) -> None:
        self.devices = devices
        self.fail_init = fail_init
        self.init_calls = 0
        self.shutdown_calls = 0
        self.util: dict[int, int | None] = {}
        self.procs: dict[int, list[tuple[int, int | None]] | None] = {}
        self.memory_error: Exception | None = None
        self.uuids: list[str] = [f"GPU-{i:08x}" for i in range(len(devices))]
        self.mig: set[int] = set()
        self.names: list[str] | None = None

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.fail_init:
            raise NVMLError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        if self.memory_error is not None:
            raise self.memory_error
        total, used = self.devices[handle]
        return SimpleNamespace(total=total * MIB, used=used * MIB, free=(total - used) * MIB)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        gpu = self.util.get(handle, 0)
        if gpu is None:
            raise NVMLError_NotSupported("Not Supported")
        return SimpleNamespace(gpu=gpu, memory=0)

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self.uuids[handle]

    def nvmlDeviceGetName(self, handle: int) -> str:
        if self.names is None:
            raise NVMLError_NotSupported("Not Supported")
        return self.names[handle]

    def nvmlDeviceGetMigMode(self, handle: int) -> list[int]:
        if not self.mig:
            raise NVMLError_NotSupported("Not Supported")  # a GPU without MIG
        return [1, 1] if handle in self.mig else [0, 0]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        procs = self.procs.get(handle, [])
        if procs is None:
            raise NVMLError_NotSupported("Not Supported")
        return [SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in procs]


# -- NVML -----------------------------------------------------------------------------------


def test_nvml_reads_memory_utilisation_and_processes() -> None:
    fake = FakeNvml([(81_559, 10_000), (81_559, 0)])
    fake.util = {0: 37, 1: 0}
    fake.procs = {0: [(100, 6_000 * MIB), (101, 4_000 * MIB), (100, 1 * MIB)], 1: []}
    snaps = NvmlMonitor(nvml=fake).read()
    assert snaps == [
        GpuSnapshot(0, 81_559, 10_000, 71_559, 37.0, {100: 6_001, 101: 4_000}),
        GpuSnapshot(1, 81_559, 0, 81_559, 0.0, {}),
    ]
    assert fake.init_calls == 1


def test_nvml_not_supported_processes_and_utilisation() -> None:
    fake = FakeNvml([(24_000, 1_000), (24_000, 2_000)])
    fake.util = {0: None}
    fake.procs = {0: None, 1: [(7, None)]}
    first, second = NvmlMonitor(nvml=fake).read()
    assert (first.util_percent, first.processes) == (None, {})
    assert second.processes == {7: 0}


def test_nvml_device_filter_skips_unknown_ids() -> None:
    fake = FakeNvml([(10_000, 1), (20_000, 2), (30_000, 3)])
    snaps = NvmlMonitor(devices=[2, 0, 9], nvml=fake).read()
    assert [(s.id, s.total_mb) for s in snaps] == [(2, 30_000), (0, 10_000)]


def test_nvml_initialises_once_and_closes_once() -> None:
    fake = FakeNvml([(10_000, 0)])
    mon = NvmlMonitor(nvml=fake)
    mon.read()
    mon.read()
    mon.close()
    mon.close()
    assert (fake.init_calls, fake.shutdown_calls) == (1, 1)


def test_nvml_memory_error_propagates() -> None:
    fake = FakeNvml([(10_000, 0)])
    fake.memory_error = NVMLError("GPU is lost")
    with pytest.raises(NVMLError, match="lost"):
        NvmlMonitor(nvml=fake).read()


@pytest.mark.parametrize(
    ("fake", "expected"),
    [
        pytest.param(FakeNvml([(10_000, 0)]), True, id="driver"),
        pytest.param(FakeNvml([(10_000, 0)], fail_init=True), False, id="no-driver"),
        pytest.param(FakeNvml([]), False, id="no-devices"),
    ],
)
def test_available(fake: FakeNvml, expected: bool) -> None:
    assert NvmlMonitor.available(nvml=fake) is expected
    assert fake.shutdown_calls == (1 if fake.init_calls and not fake.fail_init else 0)


async def test_run_refreshes_latest_and_survives_errors() -> None:
    fake = FakeNvml([(10_000, 1_000)])
    mon = NvmlMonitor(nvml=fake)
    assert mon.latest == []
    task = asyncio.create_task(mon.run(interval_s=0.01))
    try:
        await wait_for(lambda: bool(mon.latest), what="first snapshot")
        fake.memory_error = NVMLError("GPU is lost")
        await wait_for(lambda: mon.last_error is not None, what="error recorded")
        assert mon.latest[0].used_mb == 1_000
        fake.memory_error = None
        fake.devices = [(10_000, 3_000)]
        await wait_for(lambda: mon.latest[0].used_mb == 3_000, what="recovery")
        assert mon.last_error is None and mon.updated_at is not None
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


# -- static budget --------------------------------------------------------------------------


def test_static_budget_accounting() -> None:
    budget = StaticBudget({1: 16_000, 0: 24_000})
    budget.set_usage("a", (0,), 10_000)
    budget.set_usage("b", (0, 1), 6_000)
    assert budget.read() == [
        GpuSnapshot(0, 24_000, 16_000, 8_000, None, {}),
        GpuSnapshot(1, 16_000, 6_000, 10_000, None, {}),
    ]
    budget.set_usage("a", (1,), 12_000)
    assert [s.free_mb for s in budget.read()] == [18_000, 0]
    budget.clear_usage("a")
    budget.clear_usage("never-seen")
    assert [s.used_mb for s in budget.read()] == [6_000, 6_000]


@pytest.mark.parametrize(
    ("devices", "mb", "message"),
    [((3,), 1, "unknown device"), ((0,), -1, "negative")],
)
def test_static_budget_rejects_bad_usage(devices: tuple[int, ...], mb: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StaticBudget({0: 1_000}).set_usage("m", devices, mb)


# -- footprints -----------------------------------------------------------------------------

CONFIG = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "max_position_embeddings": 128,
    "torch_dtype": "float32",
}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A valid safetensors file with zeroed data: header length, JSON header, raw bytes."""
    sizes = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I8": 1}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for dim in shape:
            n *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    write_safetensors(
        tmp_path / "model.safetensors",
        {"embed": ("F32", [1000, 64]), "w": ("F32", [64, 64]), "qweight": ("I32", [8, 64])},
    )
    return tmp_path


def test_tensor_sizes_reads_header_only(model_dir: Path) -> None:
    assert tensor_sizes(model_dir / "model.safetensors") == [
        ("F32", 64_000),
        ("F32", 4_096),
        ("I32", 512),
    ]


def test_memory_mb_wins() -> None:
    fp = estimate_footprint_mb(memory_mb=9_000, gpu_memory_utilization=0.5, device_total_mb=80)
    assert fp == Footprint(9_000, "config", {"memory_mb": 9_000, "overhead_mb": 768}, 1, 768)
    assert fp.budget_mb == 9_000 - 768  # memory_mb is all the engine holds, context included


def test_utilization_times_total_per_device() -> None:
    fp = estimate_footprint_mb(
        gpu_memory_utilization=0.25, device_total_mb=81_559, tensor_parallel_size=2
    )
    # The budget, plus the context and NCCL outside it on each device (two GPUs).
    assert (fp.budget_mb, fp.source, fp.gpus) == (20_390, "utilization", 2)
    assert fp.per_device_mb == 20_390 + 768 + 512


def test_utilization_needs_total() -> None:
    with pytest.raises(ValueError, match="total memory"):
        estimate_footprint_mb(gpu_memory_utilization=0.5)


def test_estimate_from_local_dir(model_dir: Path) -> None:
    fp = estimate_footprint_mb(model_path=model_dir, max_num_seqs=4)
    # float32 checkpoint served at 16 bits: (64000 + 4096) x 2 + 512 int32 x 4 bytes
    assert fp.detail["params"] == 68_608
    assert fp.detail["weights_from"] == "safetensors"
    assert fp.detail["weights_mb"] == 1  # 138240 bytes, rounded up
    # 2 x 2 layers x 2 kv heads x 16 head_dim x 128 tokens x 4 seqs x 2 bytes = 128 KiB
    assert fp.detail["kv_cache_mb"] == 1
    # 512 MiB + 512 tokens x 64 hidden x 2 bytes
    assert fp.detail["activations_mb"] == 513
    assert fp == Footprint(1 + 1 + 513 + 768, "estimate", fp.detail, 1, 768)


def test_estimate_from_params_b_with_explicit_dtype() -> None:
    config = {**CONFIG, "num_hidden_layers": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    config |= {"num_attention_heads": 32, "max_position_embeddings": 131_072}
    fp = estimate_footprint_mb(
        model_config=config,
        params_b=8,
        dtype="bfloat16",
        max_model_len=8192,
        max_num_seqs=16,
        kv_cache_dtype="fp8",
    )
    assert fp.detail["weights_mb"] == 15_259  # 8e9 x 2 bytes
    # Room for 4 full-length sequences, whatever max_num_seqs lets run at once:
    # 2 x 32 x 8 x 128 x 8192 x 4 x 1 byte = 2 GiB
    assert (fp.detail["kv_cache_mb"], fp.detail["kv_sequences"]) == (2_048, 4)
    # An unknown device: vLLM's small-GPU default of 2048 batched tokens; no vocabulary known.
    assert fp.detail["activation_tokens"] == 2_048
    assert fp.detail["activations_mb"] == 512 + 16  # 2048 tokens x 4096 x 2 bytes
    assert fp.per_device_mb == 15_259 + 2_048 + 528 + 768


VOCAB_128K = {**CONFIG, "hidden_size": 2048, "num_attention_heads": 16, "vocab_size": 131_072}
VOCAB_128K |= {"num_key_value_heads": 16, "num_hidden_layers": 24, "max_position_embeddings": 4096}


@pytest.mark.parametrize(
    ("total", "name", "seqs", "tokens"),
    [
        pytest.param(81_559, "NVIDIA H100 80GB HBM3", 1_024, 8_192, id="h100"),
        pytest.param(143_771, "NVIDIA H200", 1_024, 8_192, id="h200"),
        pytest.param(183_359, "NVIDIA B200", 1_024, 16_384, id="b200"),
        pytest.param(81_920, "NVIDIA A100-SXM4-80GB", 256, 2_048, id="a100-80g"),
        pytest.param(46_068, "NVIDIA L40S", 256, 2_048, id="l40s"),
        pytest.param(None, None, 256, 2_048, id="unknown"),
    ],
)
def test_estimate_follows_vllms_batch_defaults_for_the_device(
    total: int | None, name: str | None, seqs: int, tokens: int
) -> None:
    """vLLM 0.33 defaults max_num_seqs and max_num_batched_tokens by device
    (engine/arg_utils.py:2970-3006). It runs Model Runner V2 (config/vllm.py:731-767), whose
    profile samples min(max_num_seqs, max_num_batched_tokens) rows x the vocabulary twice, the
    second time in fp32 (v1/worker/gpu/model_runner.py:1010-1034): an H100 or H200 profiles 1024
    rows. Its sampler state, max_num_seqs x (vocab + vocab / 32) int32, sits in the weights pool
    (v1/worker/gpu/sample/penalties.py:43-50), and a chunk of 1024 rows of prompt
    log-probabilities (v1/worker/gpu/sample/prompt_logprob.py:20) is room beyond the profile
    where fewer rows were profiled."""
    fp = estimate_footprint_mb(
        model_config=VOCAB_128K, params_b=1.75, device_total_mb=total, device_name=name
    )
    assert (fp.detail["max_num_seqs"], fp.detail["activation_tokens"]) == (seqs, tokens)
    assert fp.detail["batch_from"] == "device default"
    # rows x 131072 x 8 bytes: 1 GiB for 1024 rows, a quarter of that for 256
    assert fp.detail["sampler_mb"] == seqs * 131_072 * 8 // MIB
    assert fp.detail["sampler_state_mb"] == seqs * (131_072 + 4_096) * 4 // MIB  # 528 or 132
    # 1024 rows x 131072 x 4 bytes of prompt logits, less the sampler's 256 profiled rows
    assert fp.detail["prompt_logprobs_mb"] == (0 if seqs == 1_024 else 512 - 256)
    act = 512 + tokens * 2048 * 2 // MIB + fp.detail["sampler_mb"]
    assert fp.detail["activations_mb"] == act + fp.detail["prompt_logprobs_mb"]
    assert fp.detail["kv_sequences"] == 4  # not max_num_seqs: 1024 x 4096 tokens would be 48 GiB
    parts = ("weights_mb", "sampler_state_mb", "kv_cache_mb", "activations_mb", "overhead_mb")
    assert fp.per_device_mb == sum(fp.detail[k] for k in parts)


def test_estimate_defaults_are_bounded_by_the_model_length() -> None:
    """Defaults shrink to what the length allows: max_num_batched_tokens is at most
    max_num_seqs x max_model_len, and max_num_seqs at most that (engine/arg_utils.py:3177-3234)."""
    fp = estimate_footprint_mb(
        model_config=VOCAB_128K, params_b=10, max_model_len=4, device_total_mb=81_559,
        device_name="NVIDIA H100",
    )  # fmt: skip
    assert (fp.detail["activation_tokens"], fp.detail["max_num_seqs"]) == (4_096, 1_024)
    given = estimate_footprint_mb(
        model_config=VOCAB_128K, params_b=1, max_num_seqs=2, max_num_batched_tokens=512,
        device_total_mb=81_559, device_name="NVIDIA H100",
    )  # fmt: skip
    assert (given.detail["activation_tokens"], given.detail["max_num_seqs"]) == (512, 2)
    assert given.detail["kv_sequences"] == 2, "never more sequences than may run at once"
    assert given.detail["sampler_mb"] == 2  # 2 rows x 131072 x 8 bytes


#: A Qwen2.5-0.5B-like model: 152k vocabulary, 494M parameters, 24 layers, 2 KV heads.
QWEN_05B = {**CONFIG, "hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2}
QWEN_05B |= {"num_hidden_layers": 24, "vocab_size": 151_936, "max_position_embeddings": 32_768}


def test_model_runner_v2_sampler_state_is_in_the_estimate() -> None:
    """Regression: the estimate modelled the deprecated V1 runner. Model Runner V2 keeps
    output_bin_counts, max_num_seqs x vocab int32, and prompt_bin_mask (1/32 of it) in the
    weights pool (v1/worker/gpu/sample/penalties.py:43-50): 594 + 19 MiB per rank at a 152k
    vocabulary and 1024 sequences, which were missing from the plan (less KV cache than
    planned)."""
    assert sampler_state_tensors(1_024, 151_936) == [1_024 * 4_748 * 4, 1_024 * 151_936 * 4]
    assert math.ceil(1_024 * 151_936 * 4 / MIB) == 594
    assert math.ceil(sampler_state_bytes(1_024, 151_936) / MIB) == 613
    big = {**QWEN_05B, "hidden_size": 3584, "num_attention_heads": 28, "num_hidden_layers": 28}
    big |= {"num_key_value_heads": 4}
    fp = estimate_footprint_mb(
        model_config=big, params_b=7.6, device_total_mb=81_559, device_name="NVIDIA H100"
    )
    assert (fp.detail["max_num_seqs"], fp.detail["batch_from"]) == (1_024, "device default")
    assert fp.detail["sampler_state_mb"] == 613
    assert fp.per_device_mb == 613 + sum(
        fp.detail[k] for k in ("weights_mb", "kv_cache_mb", "activations_mb", "overhead_mb")
    )


def test_a_tight_estimate_plans_the_small_batch_rather_than_the_device_default() -> None:
    """Regression: a 0.5B model with a 152k vocabulary was planned, and started, at the H100's
    1024 sequences: V2's sampler would take 1.8 GiB (612 MiB of state, 1.2 GiB of profiling
    passes) next to 0.9 GiB of weights, and "No available memory for the cache blocks"
    followed from every underestimate. Where the sampler takes more than SAMPLER_SHARE of the
    weights and KV cache, the estimate plans vLLM's small-GPU batch (256 sequences, 2048
    tokens), which the proxy then passes."""
    fp = estimate_footprint_mb(
        model_config=QWEN_05B, params_b=0.494, device_total_mb=81_559, device_name="NVIDIA H100"
    )
    assert fp.detail["batch_from"] == "tight"
    assert (fp.detail["max_num_seqs"], fp.detail["activation_tokens"]) == (256, 2_048)
    assert fp.detail["sampler_state_mb"] == 154  # 256 x (151936 + 4748) x 4 bytes
    assert fp.detail["sampler_mb"] == 297  # 256 rows x 151936 x 8 bytes
    # room for a 1024-row chunk of prompt log-probabilities: 1024 x 151936 x 4 less 297 MiB
    assert fp.detail["prompt_logprobs_mb"] == 297
    # what the args give is kept, tight or not
    given = estimate_footprint_mb(
        model_config=QWEN_05B, params_b=0.494, max_num_seqs=1_024, device_total_mb=81_559,
        device_name="NVIDIA H100",
    )  # fmt: skip
    assert (given.detail["max_num_seqs"], given.detail["batch_from"]) == (1_024, "args")
    assert given.detail["sampler_state_mb"] == 613


def test_a_pooling_model_or_the_v1_runner_has_no_v2_sampler_state() -> None:
    """A pooling model builds no sampler and runs the pooler in its profile (v1/worker/gpu/
    model_runner.py:467, 1050-1053); prefill context parallel runs the V1 runner
    (config/vllm.py:3093-3094), which has no such state."""
    kw = {"model_config": QWEN_05B, "params_b": 0.494, "device_total_mb": 81_559}
    pooling = estimate_footprint_mb(**kw, generates=False)
    assert (pooling.detail["sampler_state_mb"], pooling.detail["sampler_mb"]) == (0, 0)
    assert pooling.detail["batch_from"] == "device default"
    v1 = estimate_footprint_mb(**kw, max_num_seqs=1_024, model_runner_v2=False)
    assert v1.detail["sampler_state_mb"] == 0 and v1.detail["sampler_mb"] == 1_187


def test_v2_pins_a_token_buffer_in_host_ram_at_start() -> None:
    """V2 keeps every request's token ids in a pinned host buffer, max_num_seqs x max_model_len
    int32 per rank (v1/worker/gpu/states.py:32-42, v1/worker/gpu/buffer_utils.py:32-38): 4 GiB
    per rank at 1024 sequences and a 1M context, rounded up to a power of two by torch."""
    assert token_buffer_mb(1_024, 1_048_576) == 4_096
    assert token_buffer_mb(256, 40_000) == 64  # 39 MiB rounded up
    fp = estimate_footprint_mb(
        model_config=VOCAB_128K, params_b=7, tensor_parallel_size=2, max_num_seqs=1_024,
        device_total_mb=81_559, device_name="NVIDIA H100",
    )  # fmt: skip
    assert fp.detail["token_buffer_mb"] == 2 * 16  # 1024 x 4096 x 4 bytes on each of 2 ranks


@pytest.mark.parametrize(
    ("sizes_mb", "segments_mb"),
    [
        pytest.param([600, 300, 124], [600, 300, 124], id="large-own-segments"),
        pytest.param([4, 4, 4, 4], [20], id="medium-share-20"),
        pytest.param([4] * 6, [20, 20], id="medium-overflow"),
        pytest.param([0.25] * 8 + [0.5], [2, 2], id="small-share-2"),
        pytest.param([4, 12], [20], id="large-in-remainder"),
        pytest.param([11, 25], [12, 26], id="rounded-to-2"),
        pytest.param([594, 18.55], [594, 20], id="sampler-state"),
    ],
)
def test_torch_segments_follow_the_caching_allocator(
    sizes_mb: list[float], segments_mb: list[int]
) -> None:
    """CuMem allocations are torch's segments, not tensors: vLLM loads the weights pool with
    max_split_size_mb=20 (v1/worker/gpu_worker.py:594-600), and torch puts requests up to 1 MiB
    in 2 MiB segments, up to 10 MiB in 20 MiB ones, larger ones alone rounded to 2 MiB, and
    reuses a remainder under 20 MiB."""
    got = torch_segments([int(mb * MIB) for mb in sizes_mb])
    assert [math.ceil(b / MIB) for b in got] == segments_mb


def test_the_level_1_pinned_guess_counts_segments_and_the_sampler_state(tmp_path: Path) -> None:
    """Regression: the level-1 pinned guess rounded each checkpoint tensor to a power of two and
    left out V2's sampler state, pinned with the weights: 594 MiB of output_bin_counts pins a
    1 GiB block per rank at 1024 sequences (and 20 MiB segments pin 32 MiB)."""
    tensors = {"embed": ("BF16", [151_936, 896]), **{f"n{i}": ("F32", [448]) for i in range(64)}}
    write_header_only(tmp_path / "model.safetensors", tensors)
    config = {**QWEN_05B, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = parse_config({"models": {"m": {"model": str(tmp_path)}}}).specs()["m"]
    # embed: 259.6 MiB, its own segment (260 MiB) -> 512; the 64 norms (1792 B each) share one
    # 2 MiB segment -> 2; prompt_bin_mask (18.5 MiB) -> 32; output_bin_counts (594 MiB) -> 1024
    assert pinned_weights_mb(spec, 1_024) == 512 + 2 + 32 + 1_024
    # 256 sequences: prompt_bin_mask (4.6 MiB) takes a 20 MiB segment, output_bin_counts 148.4
    assert pinned_weights_mb(spec, 256) == 512 + 2 + 32 + 256
    pooling = parse_config(
        {"models": {"e": {"model": str(tmp_path), "args": {"runner": "pooling"}}}}
    )
    assert pinned_weights_mb(pooling.specs()["e"], 1_024) == 512 + 2, "no sampler"


def test_the_level_1_guess_pins_the_sampler_state_of_the_batch_the_estimate_planned(
    tmp_path: Path,
) -> None:
    """The manager's level-1 guess counts V2's sampler state for the max_num_seqs the engine is
    started with: a tight estimate's 256, not the H100's 1024."""
    from vllm_proxy.planning.footprint import host_weights_mb

    tensors = {"embed": ("BF16", [151_936, 896]), **{f"n{i}": ("F32", [448]) for i in range(64)}}
    write_header_only(tmp_path / "model.safetensors", tensors)
    (tmp_path / "config.json").write_text(json.dumps({**QWEN_05B, "torch_dtype": "bfloat16"}))
    spec = parse_config({"models": {"m": {"model": str(tmp_path)}}}).specs()["m"]
    fp = footprint_for_spec(spec, 81_559, device_name="NVIDIA H100 80GB HBM3")
    assert (fp.detail["batch_from"], fp.detail["max_num_seqs"]) == ("tight", 256)
    assert host_weights_mb(spec, fp) == 512 + 2 + 32 + 256


def write_header_only(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file whose data is a sparse hole: only its header is ever read."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * {"BF16": 2, "F32": 4}[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


def test_kv_cache_memory_bytes_replaces_the_kv_estimate(tmp_path: Path) -> None:
    """--kv-cache-memory-bytes sizes vLLM's cache exactly, per GPU (v1/worker/gpu_worker.py:
    659-680): the estimate takes it as the KV part."""
    (tmp_path / "config.json").write_text(json.dumps(VOCAB_128K))
    models = {"m": {"model": str(tmp_path), "params_b": 1,
                    "args": {"kv_cache_memory_bytes": "3G", "max_model_len": 4096}}}  # fmt: skip
    spec = parse_config({"models": models}).specs()["m"]
    fp = footprint_for_spec(spec, 81_559, spec.params_b, device_name="NVIDIA H100")
    assert fp.detail["kv_from"] == "kv_cache_memory_bytes"
    assert fp.detail["kv_cache_mb"] == 3 * 1024


def llama_8b(tp: int) -> Footprint:
    config = {**CONFIG, "num_hidden_layers": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    config["num_attention_heads"] = 32
    return estimate_footprint_mb(
        model_config=config,
        params_b=8,
        dtype="bfloat16",
        max_model_len=8192,
        max_num_seqs=16,
        tensor_parallel_size=tp,
    )


def test_tensor_parallel_divides_weights_and_kv() -> None:
    one, four, sixteen = llama_8b(1), llama_8b(4), llama_8b(16)
    assert (one.detail["weights_mb"], four.detail["weights_mb"]) == (15_259, 3_815)
    assert (one.detail["kv_cache_mb"], four.detail["kv_cache_mb"]) == (4_096, 1_024)
    assert four.detail["activations_mb"] == one.detail["activations_mb"]
    assert four.gpus == 4 and four.per_device_mb == 3_815 + 1_024 + 528 + 768 + 512
    # 8 kv heads on 16 devices: each device still holds one head
    assert sixteen.detail["kv_cache_mb"] == 512


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({}, "config.json", id="nothing-known"),
        pytest.param({"model_config": CONFIG}, "params_b", id="no-weights"),
        pytest.param({"model_config": CONFIG, "params_b": 1, "dtype": "int3"}, "dtype", id="dt"),
        pytest.param({"params_b": 1, "tensor_parallel_size": 0}, "at least 1", id="tp0"),
    ],
)
def test_estimate_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        estimate_footprint_mb(**kwargs)


def test_footprint_for_spec_reads_args(model_dir: Path) -> None:
    models = {
        "util": {"model": "x", "args": {"gpu-memory-utilization": 0.5, "tensor_parallel_size": 2}},
        "local": {"model": str(model_dir), "args": {"max_model_len": "1k", "max_num_seqs": 2}},
        "fixed": {"model": "x", "memory_mb": 1234},
    }
    specs = parse_config({"models": models}).specs()
    util = footprint_for_spec(specs["util"], 80_000)
    assert (util.budget_mb, util.gpus) == (40_000, 2)
    local = footprint_for_spec(specs["local"], None)
    assert (local.detail["max_model_len"], local.detail["max_num_seqs"]) == (1_000, 2)
    assert footprint_for_spec(specs["fixed"], None).per_device_mb == 1_234
    assert footprint_for_spec(specs["fixed"], None).budget_mb == 1_234 - 768


@pytest.mark.parametrize(
    ("footprint", "total", "expected"),
    [
        (40_079, 80_000, 0.500987),  # rounded down: vLLM's ceil(util x total) stays inside
        (40_000, 80_000, 0.5),
        (20_390, 81_559, 0.250003),
        (1, 80_000, 0.000012),
        (0, 80_000, 0.000001),
        (80_000, 80_000, 0.99),
        (99_000, 80_000, 0.99),
    ],
)
def test_utilization_for_rounds_down_and_clamps(
    footprint: int, total: int, expected: float
) -> None:
    util = utilization_for(footprint, total)
    assert util == expected
    assert math.ceil(util * total) <= max(footprint, 1) or footprint >= 0.99 * total


def test_utilization_loses_at_most_a_fraction_of_a_mib_of_the_budget() -> None:
    """vLLM accepts any float: the proxy's rounding costs the KV cache under 0.2 MiB on an
    H200, where three decimals cost up to 143 MiB."""
    for budget in range(1_000, 140_000, 997):
        util = utilization_for(budget, 143_771)
        assert 0 <= budget - util * 143_771 < 0.2


# -- Memory on NVML (fake driver) -----------------------------------------------------------


def _nvml_memory(tmp_path: Path, fake: FakeNvml, models: dict[str, Any]) -> Any:
    from vllm_proxy.config import parse_config
    from vllm_proxy.metrics import Metrics
    from vllm_proxy.planning.memory import Memory

    cfg = parse_config({"server": {"state_dir": str(tmp_path)}, "models": models})
    return Memory(NvmlMonitor(nvml=fake), "nvml", cfg, cfg.specs(), Metrics())


def test_memory_on_nvml_places_engines_inside_their_share(tmp_path: Path) -> None:
    fake = FakeNvml([(80_000, 1_000), (80_000, 0)])
    models = {
        "planned": {"model": "x", "memory_mb": 20_000},
        "fraction": {"model": "y", "args": {"gpu_memory_utilization": 0.25}},
        "own-gpu": {"model": "z", "memory_mb": 1_000, "env": {"CUDA_VISIBLE_DEVICES": "1"}},
    }
    memory = _nvml_memory(tmp_path, fake, models)
    specs = {n: s for n, s in memory_specs(tmp_path, models).items()}
    p = memory.placement(specs["planned"], (1,))
    assert p.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"}
    # The budget is memory_mb less the context outside it: (20000 - 768) / 80000, rounded down.
    assert p.overrides == {"gpu_memory_utilization": 0.2404}
    argv = specs["planned"].engine_argv(8001, p.overrides)
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.2404"
    q = memory.placement(specs["fraction"], (0,))
    assert q.footprint_mb == 20_000 + 768 and q.overrides == {}  # the user's own fraction stays
    # A model whose env pins a GPU keeps it, in PCI bus order, and is planned there only.
    assert memory.placement(specs["own-gpu"], (1,)).env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert memory.demand(specs["own-gpu"], "own-gpu#1").allowed_devices == (1,)


def memory_specs(tmp_path: Path, models: dict[str, Any]) -> dict[str, Any]:
    from vllm_proxy.config import parse_config

    return parse_config({"server": {"state_dir": str(tmp_path)}, "models": models}).specs()


def test_memory_measures_an_engine_by_its_process_group(tmp_path: Path) -> None:
    import os

    fake = FakeNvml([(80_000, 30_000)])
    me = os.getpid()
    fake.procs = {0: [(me, 25_000 * MIB), (1, 5_000 * MIB)]}  # pid 1 is not in our group
    memory = _nvml_memory(tmp_path, fake, {"m": {"model": "x", "memory_mb": 20_000}})
    memory.snapshots = memory.source.read()
    memory.measure({"m#1": (os.getpgid(0), 0.0)})
    assert memory.measured == {"m#1": 25_000}
    # The measurement is accounting: what it holds beyond its budget is overhead outside it.
    assert memory.budget("m") == 20_000 - 768
    assert memory.overhead("m") == 25_000 - (20_000 - 768)
    assert memory.footprint("m") == 25_000
    labels = {"model_id": "m", "instance": "m#1"}
    sample = memory.metrics.registry.get_sample_value
    assert sample("vllm_proxy_instance_memory_measured_mb", labels) == 25_000
    memory.release_claim("m#1")  # the instance is gone: its measurement and series go
    assert memory.measured == {}
    assert sample("vllm_proxy_instance_memory_measured_mb", labels) is None
    assert memory.footprint("m") == 25_000  # the next instance of the same engine plans with it
    # ... and is started with the same budget: a measurement never grows the budget.
    assert memory.placement(memory._specs["m"], (0,)).overrides == {
        "gpu_memory_utilization": utilization_for(20_000 - 768, 80_000)
    }


async def test_wait_free_polls_until_the_memory_is_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm_proxy.planning.memory as memory_module

    fake = FakeNvml([(80_000, 70_000)])
    memory = _nvml_memory(tmp_path, fake, {"m": {"model": "x", "memory_mb": 20_000}})
    reads = 0
    real_read = memory.source.read

    def read() -> list[GpuSnapshot]:
        nonlocal reads
        reads += 1
        if reads == 3:  # the stopped engine's memory shows up as free on the third look
            fake.devices = [(80_000, 10_000)]
        return real_read()

    monkeypatch.setattr(memory.source, "read", read)
    monkeypatch.setattr(memory_module, "FREE_POLL_S", 0.001)
    assert await memory.wait_free((0,), 20_000) is True
    assert reads == 3
    fake.devices = [(80_000, 70_000)]
    memory.free_timeout_s = 0.05
    assert await memory.wait_free((0,), 20_000) is False  # bounded: gives up after the timeout


async def test_device_delta_measures_an_engine_without_per_process_readings(
    tmp_path: Path,
) -> None:
    fake = FakeNvml([(80_000, 10_000), (80_000, 0)])
    memory = _nvml_memory(tmp_path, fake, {"m": {"model": "x", "memory_mb": 8_000}})
    async with memory.starting_on((0,), "m#1"):
        fake.devices = [(80_000, 22_000), (80_000, 0)]  # the engine allocated 12 GB meanwhile
    assert memory.measured == {"m#1": 12_000}
    assert memory.footprint("m") == 12_000  # budget 8000 - 768, overhead 12000 - 7232
    # A failed start records nothing.
    memory.measured.clear()
    with pytest.raises(RuntimeError):
        async with memory.starting_on((0,), "m#2"):
            fake.devices = [(80_000, 40_000), (80_000, 0)]
            raise RuntimeError("engine died")
    assert memory.measured == {}
    # Per-process readings, once seen, are not overwritten by a later delta.
    memory.by_process.add("m#3")
    memory.measured["m#3"] = 9_000
    async with memory.starting_on((0,), "m#3"):
        fake.devices = [(80_000, 60_000), (80_000, 0)]
    assert memory.measured == {"m#3": 9_000}


def test_budgets_stay_constant_across_restarts_whatever_is_measured(tmp_path: Path) -> None:
    """Regression: a measurement fed back into the budget grew --gpu-memory-utilization at every
    restart (vLLM's KV cache fills any budget, and its context sits outside it): 0.492, 0.514,
    0.536 ... over seven starts of one model on a 24000 MiB device."""
    import os

    fake = FakeNvml([(24_000, 0)])
    memory = _nvml_memory(tmp_path, fake, {"a": {"model": "x", "memory_mb": 11_800}})
    spec = memory._specs["a"]
    utils = []
    for n in range(1, 21):
        placement = memory.placement(spec, (0,))
        memory.claim(f"a#{n}", placement)
        util = placement.overrides["gpu_memory_utilization"]
        utils.append(util)
        # What vLLM really holds: its whole budget (KV fills it) plus a context outside it.
        held = math.ceil(float(str(util)) * 24_000) + 900
        fake.procs = {0: [(os.getpid(), held * MIB)]}
        memory.snapshots = memory.source.read()
        memory.measure({f"a#{n}": (os.getpgid(0), 0.0)})
        memory.release_claim(f"a#{n}")
    assert len(set(utils)) == 1, utils
    # Accounting follows the measurement: the planner now expects what the engine really holds.
    assert memory.footprint("a") == math.ceil(utils[0] * 24_000) + 900


def test_visible_devices_map_cuda_names_to_nvml_indices() -> None:
    fake = FakeNvml([(80_000, 0), (80_000, 0), (80_000, 0)])
    fake.uuids = ["GPU-aaaa-0", "GPU-bbbb-1", "GPU-cccc-2"]
    monitor = NvmlMonitor(nvml=fake)
    assert monitor.visible("2,0", "PCI_BUS_ID") == (2, 0)
    assert monitor.visible("GPU-cccc,GPU-aaaa-0", "FASTEST_FIRST") == (2, 0)  # UUIDs: any order
    for value, order, message in [
        ("1", "FASTEST_FIRST", "CUDA_DEVICE_ORDER=PCI_BUS_ID"),
        ("5", "PCI_BUS_ID", "does not exist"),
        ("MIG-1234", "PCI_BUS_ID", "MIG"),
        ("GPU-zz", "PCI_BUS_ID", "matches 0 GPUs"),
        ("0,0", "PCI_BUS_ID", "twice"),
    ]:
        with pytest.raises(ValueError, match=message):
            monitor.visible(value, order)


def test_the_proxys_own_cuda_visible_devices_limits_planning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: an inherited CUDA_VISIBLE_DEVICES was overwritten with NVML indices and the
    planner used every GPU the driver sees."""
    from vllm_proxy.planning import memory as memory_module

    fake = FakeNvml([(80_000, 0), (80_000, 0), (80_000, 0)])
    monkeypatch.setattr("vllm_proxy.planning.gpu._import_pynvml", lambda: fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,1")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert memory_module._nvml_source(None).devices == (2, 1)
    with pytest.raises(ConfigError, match="not all among"):
        memory_module._nvml_source([0])
    monkeypatch.delenv("CUDA_DEVICE_ORDER")
    with pytest.raises(ConfigError, match="CUDA_DEVICE_ORDER=PCI_BUS_ID"):
        memory_module._nvml_source(None)


def test_mig_gpus_are_refused_with_a_clear_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_proxy.planning import memory as memory_module

    fake = FakeNvml([(80_000, 0), (80_000, 0)])
    fake.mig = {1}
    monkeypatch.setattr("vllm_proxy.planning.gpu._import_pynvml", lambda: fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ConfigError, match=r"GPU\(s\) \[1\] are in MIG mode"):
        memory_module._nvml_source(None)
    assert memory_module._nvml_source([0]).devices == (0,)  # left out: fine


def test_a_model_env_pinning_gpus_is_planned_on_them(tmp_path: Path) -> None:
    """Regression: the planner charged a GPU of its own choosing while the engine obeyed the
    model's CUDA_VISIBLE_DEVICES."""
    fake = FakeNvml([(80_000, 0), (80_000, 0), (80_000, 0)])
    models = {
        "pinned": {"model": "x", "memory_mb": 9_000, "env": {"CUDA_VISIBLE_DEVICES": "2"}},
        "tp2": {
            "model": "x", "memory_mb": 9_000, "args": {"tensor_parallel_size": 2},
            "env": {"CUDA_VISIBLE_DEVICES": "2,0,1"},
        },
    }  # fmt: skip
    memory = _nvml_memory(tmp_path, fake, models)
    assert memory.demand(memory._specs["pinned"], "pinned#1").allowed_devices == (2,)
    assert memory.demand(memory._specs["tp2"], "tp2#1").allowed_devices == (2, 0)
    bad = {"m": {"model": "x", "memory_mb": 9_000, "devices": [0],
                 "env": {"CUDA_VISIBLE_DEVICES": "1"}}}  # fmt: skip
    with pytest.raises(ConfigError, match="contradicts its env"):
        _nvml_memory(tmp_path, fake, bad)


def test_world_size_counts_every_parallel_dimension() -> None:
    from vllm_proxy.planning.footprint import parallel_sizes

    specs = parse_config(
        {
            "models": {
                "pp": {"model": "x", "memory_mb": 9_000,
                       "args": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}},
                "dp": {"model": "x", "memory_mb": 9_000,
                       "args": {"data_parallel_size": 2, "prefill_context_parallel_size": 2}},
                "dpl": {"model": "x", "memory_mb": 9_000,
                        "args": {"data_parallel_size": 4, "data_parallel_size_local": 1}},
            }
        }
    ).specs()  # fmt: skip
    assert parallel_sizes(specs["pp"]) == (2, 2, 1, 1)
    assert footprint_for_spec(specs["pp"], None).gpus == 4
    assert footprint_for_spec(specs["dp"], None).gpus == 4
    assert footprint_for_spec(specs["dpl"], None).gpus == 1  # the other ranks run elsewhere
    # Pipeline stages split the layers: weights and KV per device shrink with pp too.
    config = {**CONFIG, "num_hidden_layers": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    config["num_attention_heads"] = 32
    one = estimate_footprint_mb(
        model_config=config, params_b=8, max_model_len=8192, max_num_seqs=16
    )
    two = estimate_footprint_mb(
        model_config=config, params_b=8, max_model_len=8192, max_num_seqs=16,
        pipeline_parallel_size=2,
    )  # fmt: skip
    assert two.detail["weights_mb"] * 2 >= one.detail["weights_mb"] > two.detail["weights_mb"]
    assert two.gpus == 2 and two.overhead_mb == 768 + 512


def test_no_room_for_the_kv_cache_grows_an_estimated_budget_only(tmp_path: Path) -> None:
    fake = FakeNvml([(80_000, 0)])
    models = {
        "est": {"model": "x", "params_b": 8, "args": {"max_model_len": 4096}},
        "fixed": {"model": "x", "memory_mb": 20_000},
    }
    cfg_dir = tmp_path / "m"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text(json.dumps(CONFIG))
    models["est"]["model"] = str(cfg_dir)
    memory = _nvml_memory(tmp_path, fake, models)
    before = memory.budget("est")
    assert memory.grow_budget(memory._specs["est"]) is None
    assert memory.budget("est") == before + max(before // 4, 512)
    why = memory.grow_budget(memory._specs["fixed"])
    assert why is not None and "memory_mb" in why and memory.budget("fixed") == 20_000 - 768


# -- what a running engine may take (vLLM 0.33 frees its transient peak and takes it back) --


def _claimed(memory: Any, iid: str, mb: int) -> None:
    from vllm_proxy.planning.memory import Placement

    memory.claim(iid, Placement((0,), mb))


def test_a_running_engine_below_its_claim_is_planned_at_its_claim(tmp_path: Path) -> None:
    """vLLM reserves its transient peak inside the budget but frees it after profiling and at
    every wake (utils/mem_utils.py:298-321, device_allocator/cumem.py:297-298,342-343), and
    takes it back on its first full batch. An engine of 13500 MiB read at 10500 still needs its
    3000: a neighbour of 11500 must not be admitted into them on a 24000 MiB GPU (it was:
    13500 - 256 looked free, and the first engine's next large batch died of CUDA OOM)."""
    import os

    fake = FakeNvml([(24_000, 10_500)])
    fake.procs = {0: [(os.getpid(), 10_500 * MIB)]}
    memory = _nvml_memory(tmp_path, fake, {"a": {"model": "x", "memory_mb": 13_500}})
    _claimed(memory, "a#1", memory.footprint("a"))
    memory.snapshots = memory.source.read()
    memory.measure({"a#1": (os.getpgid(0), 0.0)})
    assert memory.measured == {"a#1": 10_500}
    assert memory.held_mb("a#1") == 13_500, "planned at what it may take, not what it holds"
    assert memory.unrealised_mb("a#1", os.getpgid(0), 0) == 3_000
    (view,) = memory.device_views({0: memory.unrealised_mb("a#1", os.getpgid(0), 0)})
    free = view.total_mb - view.used_mb - view.pending_mb - memory.reserve_mb
    assert free == 24_000 - 13_500 - 256 < 11_500
    # A measurement above the claim wins (the engine holds more than planned).
    fake.procs = {0: [(os.getpid(), 14_000 * MIB)]}
    fake.devices = [(24_000, 14_000)]
    memory.snapshots = memory.source.read()
    memory.measure({"a#1": (os.getpgid(0), 0.0)})
    assert memory.held_mb("a#1") == 14_000
    assert memory.unrealised_mb("a#1", os.getpgid(0), 0) == 0


def test_a_measurement_below_the_budget_never_lowers_the_overhead(tmp_path: Path) -> None:
    """An engine read below budget + overhead may only not have regrown its peak yet: the
    overhead stays at the guess; only a reading above it teaches a larger one."""
    import os

    fake = FakeNvml([(80_000, 5_000)])
    fake.procs = {0: [(os.getpid(), 5_000 * MIB)]}
    memory = _nvml_memory(tmp_path, fake, {"m": {"model": "x", "memory_mb": 20_000}})
    memory.snapshots = memory.source.read()
    memory.measure({"m#1": (os.getpgid(0), 0.0)})
    assert memory.overhead("m") == 768 and memory.footprint("m") == 20_000


def test_the_sleep_residue_without_per_process_readings_keeps_what_the_engine_held(
    tmp_path: Path,
) -> None:
    """Without per-process NVML (containers, MPS) the residue is what the engine held less what
    the device dropped by. Measured at readiness (peak released), then regrown by a batch the
    proxy cannot see, the engine dropped more than its start reading: the residue came out as
    0 while it still held its context (and later wakes or starts over-committed). Counted from
    its claim it is exact."""
    from vllm_proxy.planning.memory import Usage

    fake = FakeNvml([(24_000, 10_500)])
    memory = _nvml_memory(tmp_path, fake, {"a": {"model": "x", "memory_mb": 13_500}})
    _claimed(memory, "a#1", memory.footprint("a"))
    memory._set_measured("a#1", 10_500)  # the device delta across its start
    before = Usage({0: 13_500}, {}, frozenset())  # the peak came back meanwhile
    after = Usage({0: 1_000}, {}, frozenset())  # context and graphs stay asleep
    assert memory.residue("a#1", before, after) == 1_000


def test_placement_passes_the_max_num_seqs_the_estimate_assumed(
    tmp_path: Path, model_dir: Path
) -> None:
    """The estimate's sampler pass depends on max_num_seqs, which vLLM defaults by device: the
    engine is started with the value the estimate used, whatever device vLLM believes it is on
    (an operator's own value is left alone)."""
    fake = FakeNvml([(81_559, 0)])
    fake.names = ["NVIDIA H100 80GB HBM3"]
    models = {"est": {"model": str(model_dir)},
              "own": {"model": str(model_dir), "args": {"max_num_seqs": 8}}}  # fmt: skip
    memory = _nvml_memory(tmp_path, fake, models)
    specs = memory_specs(tmp_path, models)
    assert memory.estimates["est"].detail["max_num_seqs"] == 1_024  # the H100 default
    assert memory.placement(specs["est"], (0,)).overrides["max_num_seqs"] == 1_024
    assert "max_num_seqs" not in memory.placement(specs["own"], (0,)).overrides


def test_placement_passes_the_tight_batch_and_its_token_budget(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: only max_num_seqs was passed, at the device default, so a small model with a
    large vocabulary started with 1024 sequences and V2's sampler took its KV cache; and vLLM's
    own token budget could differ from the estimate's (``performance_mode: throughput``
    doubles it, engine/arg_utils.py:3184-3188). Where the estimate is tight the engine gets the
    small batch, and every estimated engine gets the token budget it was planned for; a pooling
    model keeps vLLM's (without chunked prefill it is at least the model's length), and so does
    a multimodal one (vLLM raises it to hold one item, engine/arg_utils.py:3201-3218)."""
    small = tmp_path / "qwen-0.5b"
    small.mkdir()
    (small / "config.json").write_text(json.dumps(QWEN_05B))
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    (vlm / "config.json").write_text(json.dumps({"text_config": QWEN_05B, "vision_config": {}}))
    fake = FakeNvml([(81_559, 0)])
    fake.names = ["NVIDIA H100 80GB HBM3"]
    models = {
        "small": {"model": str(small), "params_b": 0.494},
        "own": {"model": str(small), "params_b": 0.494, "args": {"max_num_batched_tokens": 4096}},
        "embed": {"model": str(small), "params_b": 0.494, "args": {"runner": "pooling"}},
        "vlm": {"model": str(vlm), "params_b": 0.494},
    }
    caplog.set_level("INFO", "vllm_proxy.planning.memory")
    memory = _nvml_memory(tmp_path, fake, models)
    specs = memory_specs(tmp_path, models)
    assert memory.estimates["small"].detail["batch_from"] == "tight"
    assert "small: planned and started with 256 sequences and 2048 batched tokens" in caplog.text
    overrides = memory.placement(specs["small"], (0,)).overrides
    assert (overrides["max_num_seqs"], overrides["max_num_batched_tokens"]) == (256, 2_048)
    own = memory.placement(specs["own"], (0,)).overrides
    assert own["max_num_seqs"] == 256 and "max_num_batched_tokens" not in own
    embed = memory.placement(specs["embed"], (0,)).overrides
    assert embed["max_num_seqs"] == 1_024 and "max_num_batched_tokens" not in embed
    assert memory.estimates["embed"].detail["sampler_state_mb"] == 0
    # a multimodal model: the small batch, vLLM's token budget (it may raise it for an item)
    assert memory.estimates["vlm"].detail["batch_from"] == "tight"
    assert memory.estimates["vlm"].detail["activation_tokens"] == 8_192
    vlm_args = memory.placement(specs["vlm"], (0,)).overrides
    assert vlm_args["max_num_seqs"] == 256 and "max_num_batched_tokens" not in vlm_args


def test_a_level_2_model_claims_no_reload_buffer(tmp_path: Path) -> None:
    """The final wake_up(tags=kv_cache) empties torch's cache before it maps the KV cache
    (device_allocator/cumem.py:342-343): the reload's temporaries are gone once the wake ends,
    so a level-2 model's footprint is its budget and overhead, as any model's, and a level-1
    model woken from level 2 needs no more than its footprint either."""
    fake = FakeNvml([(24_000, 0)])
    models = {"l2": {"model": "x", "memory_mb": 20_000, "sleep": {"level": 2}},
              "l1": {"model": "x", "memory_mb": 10_000, "sleep": {"level": 1}}}  # fmt: skip
    memory = _nvml_memory(tmp_path, fake, models)
    assert memory.footprint("l2") == 20_000 and memory.budget("l2") == 20_000 - 768
    _claimed(memory, "l1#1", memory.footprint("l1"))
    memory.sleep_claim("l1#1", 1_000, level=2)  # demoted for host RAM
    assert memory.wake_need("l1#1") == 10_000 - 1_000


def write_sparse_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """`write_safetensors` with the data a hole (the planner reads headers only)."""
    sizes = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I8": 1}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


def test_a_level_2_policy_whose_reload_cannot_fit_in_its_kv_room_is_refused(
    tmp_path: Path,
) -> None:
    """The reload materialises each module while the KV cache is unmapped, in the room of the
    KV cache and the transient peak (model_loader/reload/layerwise.py:344-402): a module larger
    than that would fail every wake. Refused at load, naming the key; level 1 is fine."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    write_sparse_safetensors(model / "model.safetensors", {"huge": ("F32", [1024, 160_000])})
    fake = FakeNvml([(24_000, 0)])
    with pytest.raises(ConfigError, match=r"models\.m\.sleep\.level: .*largest module \(625 MiB"):
        _nvml_memory(tmp_path, fake, {"m": {"model": str(model), "sleep": {"level": 2}}})
    memory = _nvml_memory(tmp_path, fake, {"m": {"model": str(model), "sleep": {"level": 1}}})
    detail = memory.estimates["m"].detail
    assert detail["kv_cache_mb"] + detail["activations_mb"] < 625


def test_the_level_2_reload_peak_is_a_whole_moe_layer_not_its_largest_tensor(
    tmp_path: Path,
) -> None:
    """Regression (F6): the reload's peak was the largest tensor, but vLLM materialises a whole
    module: a fused MoE layer holds every local expert at once (Mixtral-8x7B at TP2: about 56
    MiB checked against about 1.3 GiB needed), so every level-2 wake of such a model with
    little KV room failed and cold-started. Each expert tensor here fits; the layer does not."""
    from vllm_proxy.planning.footprint import module_bytes, module_of, reload_peak_mb

    model = tmp_path / "moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    experts = {
        f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight": ("BF16", [4096, 8192])
        for e in range(8)
        for w in ("w1", "w2", "w3")
    }  # 64 MiB each, 1536 MiB the layer
    experts["model.layers.0.self_attn.q_proj.weight"] = ("BF16", [1024, 1024])
    experts["model.layers.0.self_attn.k_proj.weight"] = ("BF16", [1024, 1024])
    write_sparse_safetensors(model / "model.safetensors", experts)
    assert module_of("model.layers.0.block_sparse_moe.experts.3.w1.weight") == (
        "model.layers.0.block_sparse_moe.experts"
    )
    assert (
        module_of("model.layers.0.self_attn.k_proj.weight") == "model.layers.0.self_attn.qkv_proj"
    )
    modules, floating = module_bytes([model / "model.safetensors"])
    assert modules["model.layers.0.self_attn.qkv_proj"] == 4 * MIB and floating
    kv = {"kv_cache_memory_bytes": 600 * MIB}
    level2 = {"model": str(model), "sleep": {"level": 2}, "args": kv}
    fake = FakeNvml([(80_000, 0)])
    with pytest.raises(ConfigError, match=r"largest module \(1536 MiB per GPU"):
        _nvml_memory(tmp_path, fake, {"m": level2})
    spec = parse_config({"models": {"m": {**level2, "sleep": {"level": 1}}}}).specs()["m"]
    assert reload_peak_mb(spec) == 1536
    quantised = {**level2, "sleep": {"level": 1}, "args": {**kv, "quantization": "fp8"}}
    spec = parse_config({"models": {"m": quantised}}).specs()["m"]
    assert reload_peak_mb(spec) == 2 * 1536, "online quantisation holds both copies"
    tp2 = {**level2, "sleep": {"level": 1}, "args": {**kv, "tensor_parallel_size": 2}}
    assert reload_peak_mb(parse_config({"models": {"m": tp2}}).specs()["m"]) == 768


# -- the device lock: what runs beside what ---------------------------------------------------


async def _entered(lock: DeviceLock, use: Use, log: list[str], name: str) -> None:
    await lock.acquire(use)
    log.append(name)


@pytest.mark.parametrize(
    ("a", "b", "together"),
    [
        (Use.MEASURE, Use.MEASURE, False),
        (Use.MEASURE, Use.ALLOC, False),
        (Use.MEASURE, Use.SLEEP, False),
        (Use.MEASURE, Use.STOP, False),
        (Use.ALLOC, Use.ALLOC, True),
        (Use.ALLOC, Use.STOP, True),
        (Use.ALLOC, Use.SLEEP, False),
        (Use.SLEEP, Use.SLEEP, True),
        (Use.SLEEP, Use.STOP, True),
        (Use.STOP, Use.STOP, True),
    ],
)
async def test_device_lock_runs_together_only_what_vllm_allows(
    a: Use, b: Use, together: bool
) -> None:
    """The table: a profiling start alone; allocations (sized starts, wakes) beside each other
    and stops; sleeps beside sleeps and stops, never beside an allocation. Symmetric."""
    for first, second in [(a, b), (b, a)]:
        lock = DeviceLock()
        log: list[str] = []
        await _entered(lock, first, log, "first")
        other = asyncio.ensure_future(_entered(lock, second, log, "second"))
        await asyncio.sleep(0)
        assert other.done() is together, (first, second)
        lock.release(first)
        await other
        lock.release(second)
        assert lock.holders == 0


async def test_device_lock_grants_in_order_past_what_may_run_beside_every_earlier_waiter() -> None:
    lock = DeviceLock()
    log: list[str] = []
    await _entered(lock, Use.ALLOC, log, "wake")
    await _entered(lock, Use.STOP, log, "stop")  # beside the wake
    assert lock.holders == 2
    start = asyncio.ensure_future(_entered(lock, Use.MEASURE, log, "start"))
    later_wake = asyncio.ensure_future(_entered(lock, Use.ALLOC, log, "later wake"))
    await asyncio.sleep(0)
    # The start waits for both; the wake that came after it waits behind it (no starving).
    assert log == ["wake", "stop"]
    lock.release(Use.ALLOC)
    lock.release(Use.STOP)
    await start
    assert log == ["wake", "stop", "start"] and not later_wake.done()
    # Its profiling over, the start allocates like a wake: the later wake runs beside it.
    lock.relax(Use.MEASURE, Use.ALLOC)
    await later_wake
    assert lock.held() == {Use.ALLOC: 2}
    sleep = asyncio.ensure_future(_entered(lock, Use.SLEEP, log, "sleep"))
    stop = asyncio.ensure_future(_entered(lock, Use.STOP, log, "second stop"))
    await asyncio.sleep(0)
    assert not sleep.done(), "a sleep ran beside allocations"
    assert stop.done(), "a stop waited behind a sleep it may run beside"
    lock.release(Use.ALLOC)
    lock.release(Use.ALLOC)
    await sleep
    lock.release(Use.SLEEP)
    lock.release(Use.STOP)
    assert lock.holders == 0


async def test_device_lock_forgets_a_waiter_that_gave_up() -> None:
    lock = DeviceLock()
    log: list[str] = []
    await _entered(lock, Use.ALLOC, log, "wake")
    start = asyncio.ensure_future(_entered(lock, Use.MEASURE, log, "start"))
    behind = asyncio.ensure_future(_entered(lock, Use.ALLOC, log, "second wake"))
    await asyncio.sleep(0)
    assert not behind.done()
    start.cancel()  # the start was stopped while it waited for the device
    await asyncio.gather(start, return_exceptions=True)
    await behind  # nothing exclusive waits before it any more: it runs beside the first wake
    assert log == ["wake", "second wake"] and lock.holders == 2
    lock.release(Use.ALLOC)
    lock.release(Use.ALLOC)
    # A waiter cancelled in the moment it was granted gives the lock back.
    await _entered(lock, Use.SLEEP, log, "sleep")
    granted = asyncio.ensure_future(_entered(lock, Use.MEASURE, log, "start"))
    await asyncio.sleep(0)
    lock.release(Use.SLEEP)  # grants `granted` ...
    granted.cancel()  # ... which is cancelled before it runs
    await asyncio.gather(granted, return_exceptions=True)
    assert lock.holders == 0
    await asyncio.wait_for(_entered(lock, Use.MEASURE, log, "free again"), 1)
