"""Footprints: how much GPU memory one engine of a model takes on each of its devices.

`footprint_for_spec()` applies the rules in order (``memory_mb``, ``gpu_memory_utilization`` x
device total, else `estimate_footprint_mb()` from the model's config.json and safetensors
headers, or ``params_b``); `utilization_for()` turns a budget into vLLM's
``--gpu-memory-utilization``. Pure arithmetic and file reads: no GPU access.

A footprint has two parts, as vLLM uses memory (vLLM 0.33 ``v1/worker/gpu_worker.py:495-547``,
``v1/worker/utils.py:716-770``, ``gpu_worker.py:753``):

* the **budget**, ``gpu_memory_utilization x device total``: weights, activations, CUDA graphs
  and a KV cache that grows to fill whatever is left of it. vLLM refuses to start unless that
  much is free *after* its own CUDA context exists;
* the **overhead** outside the budget: the CUDA context, cuBLAS handles and (on more than one
  GPU) NCCL buffers, created before vLLM takes its free-memory snapshot.

An engine therefore holds ``budget + overhead`` on each device, and the planner must find that
much free before it starts one.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..adapters import largest_sizes_mb, list_folder, slots_mb
from ..config import ModelSpec

MIB = 1024 * 1024

#: Memory outside vLLM's budget on every device (CUDA context, cuBLAS): a planning guess that the
#: first measured start of the model replaces (`gpu.context_mb` in the config).
CUDA_CONTEXT_MB = 768
#: ... and on each device of an engine on more than one GPU, NCCL's buffers (`gpu.nccl_mb`).
NCCL_MB = 512
#: Fixed part of the activation estimate (workspace, CUDA graphs).
ACTIVATION_BASE_MB = 512
#: Bytes per (row x vocabulary) element of the profiling sampler passes. vLLM 0.33 runs Model
#: Runner V2 (``config/vllm.py:731-767``), whose profile samples the logits of
#: ``min(max_num_seqs, max_num_batched_tokens)`` rows twice, the logits kept across both passes
#: (at most fp32: 4 B): a default pass, then one with ``SamplingParams.for_sampler_warmup()``
#: (penalties, bias, top-k/p, min-p, logprobs), which copies the logits to fp32 (4 B)
#: (``v1/worker/gpu/model_runner.py:1010-1034``, ``v1/worker/gpu/sample/sampler.py:241-242``,
#: ``sampling_params.py:1477-1493``). Read from the source, not measured.
SAMPLER_BYTES = 8
#: Bytes per (row x vocabulary) element of V2's sampler state, built by ``load_model`` inside
#: the CuMem ``weights`` pool (``v1/worker/gpu_worker.py:594-600``, ``v1/worker/gpu/
#: model_runner.py:467-495``): ``output_bin_counts``, ``max_num_seqs x vocab`` int32, and
#: ``prompt_bin_mask``, ``max_num_seqs x ceil(vocab / 32)`` int32 (``v1/worker/gpu/sample/
#: penalties.py:43-50``), on every rank of the last pipeline stage. A level-1 sleep pins it with
#: the weights.
SAMPLER_STATE_BYTES = 4
#: Rows of one chunk of prompt log-probabilities: V2 computes a request's ``prompt_logprobs``
#: over the logits of 1024 prompt tokens at a time (``v1/worker/gpu/sample/prompt_logprob.py:
#: 20,283-305``), outside what the profile ran. Where the profiled sampler rows are fewer, the
#: estimate leaves room for the difference (4 B per element, fp32 logits at most).
PROMPT_LOGPROB_ROWS = 1024
#: Where V2's sampler (state and profiling passes) would take more than this share of the rest
#: of the estimate (weights and KV cache per device) at vLLM's device defaults, the estimate
#: plans, and the proxy passes, the small-GPU batch (`SMALL_GPU_DEFAULTS`) instead: at 1024
#: sequences a 0.5B model with a 152k vocabulary would spend 1.8 GiB on the sampler beside 2.4
#: GiB of weights and KV cache.
SAMPLER_SHARE = 0.25
#: A level-2 wake's reload peak per device when the checkpoint's tensors cannot be read.
RELOAD_PEAK_MB = 512
#: Full-length sequences the KV cache is sized for. Planning for vLLM's ``max_num_seqs`` (256 or
#: 1024) would ask for hundreds of GiB on any long-context model; vLLM itself only needs room
#: for one ``max_model_len`` sequence to start, and packs more into whatever it is given.
DEFAULT_KV_SEQUENCES = 4
#: vLLM's API-server batch defaults by device, (max_num_seqs, max_num_batched_tokens): at least
#: 160 GiB (B200, B300); at least 70 GiB other than an A100 or a GB10 (H100, H200); the rest
#: (vLLM 0.33 ``engine/arg_utils.py:2970-3006``). Devices are compared in GiB of CUDA's total.
LARGE_GPU_DEFAULTS = (1024, 16384)
BIG_GPU_DEFAULTS = (1024, 8192)
SMALL_GPU_DEFAULTS = (256, 2048)
#: Bytes per element, keyed by vLLM ``--dtype`` names and safetensors dtype codes.
DTYPE_BYTES: dict[str, float] = {
    "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1,
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
    "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1,
    "BOOL": 1, "F6_E2M3": 0.75, "F6_E3M2": 0.75, "F4": 0.5,
}  # fmt: skip
#: Floating-point checkpoint dtypes that vLLM casts to the serving dtype when it loads them.
_CAST_DTYPES = {"F32", "F16", "BF16"}
#: A safetensors header larger than this is treated as a corrupt file.
_MAX_HEADER_BYTES = 100 * MIB


@dataclass(frozen=True)
class Footprint:
    """What one engine takes on each of its `gpus` devices, and how that number was found.

    ``per_device_mb`` is everything the engine holds on a device: its budget (what
    ``--gpu-memory-utilization`` gives it) plus ``overhead_mb`` outside the budget.
    ``source`` is "config" (memory_mb), "utilization" (gpu_memory_utilization x device total)
    or "estimate" (the formula; ``detail`` holds its terms in MiB). ``gpus`` is vLLM's world
    size on this node: pipeline x tensor x prefill-context parallel x local data parallel.
    """

    per_device_mb: int
    source: str
    detail: dict[str, Any]
    gpus: int = 1
    overhead_mb: int = 0

    @property
    def budget_mb(self) -> int:
        """The part inside vLLM's ``--gpu-memory-utilization`` budget."""
        return self.per_device_mb - self.overhead_mb


def estimate_footprint_mb(
    *,
    memory_mb: int | None = None,
    gpu_memory_utilization: float | None = None,
    device_total_mb: int | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    context_parallel_size: int = 1,
    data_parallel_local: int = 1,
    model_path: str | Path | None = None,
    model_config: Mapping[str, Any] | None = None,
    params_b: float | None = None,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    device_name: str | None = None,
    context_mb: int = CUDA_CONTEXT_MB,
    nccl_mb: int = NCCL_MB,
    generates: bool = True,
    chunked_prefill: bool = True,
    model_runner_v2: bool = True,
) -> Footprint:
    """The memory one engine takes on each of its devices; the first rule that applies wins.

    The overhead outside vLLM's budget is ``context_mb``, plus ``nccl_mb`` when the engine
    spans more than one GPU. Then:

    1. ``memory_mb`` (per device) is everything the engine takes there, overhead included: its
       budget is ``memory_mb - overhead``.
    2. ``gpu_memory_utilization`` x ``device_total_mb``, rounded up, is the budget: vLLM sizes
       itself to that fraction of the device's total memory on each of its devices, and holds
       the overhead on top.
    3. The estimate of the budget, per device: ``weights / (tp x pp) + sampler state +
       kv_cache / (tp x pp x pcp) + activations``, where

       * weights = parameters x bytes per parameter. With ``params_b`` (billions) they are
         ``params_b x dtype``; otherwise, for a local model directory, the safetensors headers
         are summed (only the headers are read). Floating-point tensors count at the serving
         dtype, other tensors (quantised weights, packed ints) at their own size. ``dtype="auto"``
         serves at the checkpoint's ``torch_dtype``, and float32 checkpoints at 16 bits as
         vLLM does;
       * kv_cache = 2 x layers x kv_heads x head_dim x max_model_len x kv_sequences x kv bytes
         (kv_heads defaults to attention heads, head_dim to hidden_size / heads, max_model_len to
         max_position_embeddings; with ``tp`` larger than kv_heads the heads are replicated, so
         each device holds ``ceil(kv_heads / tp)``): room for ``DEFAULT_KV_SEQUENCES`` (4)
         full-length sequences (fewer when ``max_num_seqs`` is smaller), whatever
         ``max_num_seqs`` allows to run at once. ``kv_cache_memory_bytes`` (vLLM's
         ``--kv-cache-memory-bytes``) replaces it: vLLM then sizes the cache to exactly that;
       * sampler state (Model Runner V2, `SAMPLER_STATE_BYTES`) = max_num_seqs x (vocab_size
         + vocab_size / 32) x 4 bytes, in the weights pool: 613 MiB at 1024 sequences and a
         152k vocabulary. None for a pooling model, or where vLLM runs the V1 runner
         (``model_runner_v2=False``: prefill context parallel, ``VLLM_USE_V2_MODEL_RUNNER=0``);
       * activations = 512 MiB (workspace, CUDA graphs) + tokens x hidden_size x 2 bytes + the
         profiling sampler passes, ``min(max_num_seqs, tokens) x vocab_size x SAMPLER_BYTES``,
         + room for a chunk of prompt log-probabilities beyond them (`PROMPT_LOGPROB_ROWS`),
         with tokens = ``max_num_batched_tokens``, at most max_num_seqs x max_model_len.
         Where they are not given, ``max_num_seqs`` and ``max_num_batched_tokens`` are vLLM's
         defaults for the device (`batch_defaults`: 1024 and 8192 on an H100 or H200), or the
         small-GPU ones where the sampler would take more than `SAMPLER_SHARE` of the weights
         and KV cache (``detail["batch_from"]`` is then "tight"; a multimodal model keeps the
         device's token budget, which vLLM may raise for it); without ``chunked_prefill`` the
         tokens are at least max_model_len, as in vLLM.

       ``detail["token_buffer_mb"]`` is the host RAM V2 pins at start, all devices together
       (`token_buffer_mb`).

       The architecture comes from ``model_config`` or ``config.json`` in ``model_path``
       (``text_config`` of multimodal models is used when present).

    Data parallel ranks on this node each hold a whole copy: they multiply the GPU count, not
    the memory per device. Raises ValueError when no rule applies, naming what is missing.
    """
    tp, pp, pcp = tensor_parallel_size, pipeline_parallel_size, context_parallel_size
    for flag, value in (("tensor", tp), ("pipeline", pp), ("context", pcp)):
        if value < 1:
            raise ValueError(f"{flag}_parallel_size must be at least 1, got {value}")
    if data_parallel_local < 1:
        raise ValueError(f"data_parallel_size_local must be at least 1, got {data_parallel_local}")
    gpus = tp * pp * pcp * data_parallel_local
    overhead = context_mb + (nccl_mb if gpus > 1 else 0)
    if memory_mb is not None:
        given = {"memory_mb": memory_mb, "overhead_mb": overhead}
        return Footprint(int(memory_mb), "config", given, gpus, overhead)
    if gpu_memory_utilization is not None:
        return _from_utilization(gpu_memory_utilization, device_total_mb, gpus, overhead)
    model_dir = _local_dir(model_path)
    arch = _architecture(model_config, model_dir)
    serve_bytes = _serving_dtype_bytes(dtype, arch)
    weights, params, how = _weights_bytes(params_b, serve_bytes, model_dir)
    max_len = max_model_len or _arch_int(arch, "max_position_embeddings")
    vocab = int(arch.get("vocab_size") or 0) if generates else 0
    batch_from = "args" if max_num_seqs else "device default"
    defaults = batch_defaults(device_total_mb, device_name)
    seqs, tokens = _batch(defaults, max_num_seqs, max_num_batched_tokens, max_len, chunked_prefill)
    kv_bytes = _kv_dtype_bytes(kv_cache_dtype, serve_bytes)

    def kv_for(seqs: int) -> float:
        if kv_cache_memory_bytes is not None:
            return float(kv_cache_memory_bytes)
        kv_seqs = min(DEFAULT_KV_SEQUENCES, seqs)
        return _kv_bytes_per_device(arch, tp, max_len, kv_seqs, kv_bytes) / (pp * pcp)

    # vLLM keeps its own token budget for a multimodal model (the proxy passes none)
    multimodal = any(k in arch for k in ("vision_config", "audio_config", "text_config"))
    rest = weights / (tp * pp) + kv_for(seqs)
    if max_num_seqs is None and _sampler_bytes(seqs, tokens, vocab) > SAMPLER_SHARE * rest:
        small_seqs = SMALL_GPU_DEFAULTS[0] if multimodal else None
        small = _batch(
            defaults if multimodal else SMALL_GPU_DEFAULTS,
            small_seqs, max_num_batched_tokens, max_len, chunked_prefill,
        )  # fmt: skip
        if small[0] < seqs:
            (seqs, tokens), batch_from = small, "tight"
    kv = kv_for(seqs)
    state = sampler_state_bytes(seqs, vocab) if model_runner_v2 else 0
    sampler = min(seqs, tokens) * vocab * SAMPLER_BYTES
    logprobs = max(min(PROMPT_LOGPROB_ROWS, tokens) * vocab * 4 - sampler, 0)
    act = ACTIVATION_BASE_MB * MIB + tokens * _arch_int(arch, "hidden_size") * 2 + sampler
    parts = {
        "weights_mb": _ceil_mb(weights / (tp * pp)),
        "sampler_state_mb": _ceil_mb(state),
        "kv_cache_mb": _ceil_mb(kv),
        "activations_mb": _ceil_mb(act + logprobs),
    }
    detail: dict[str, Any] = {**parts, "overhead_mb": overhead, "params": params}
    detail["weights_from"] = how
    detail |= {"max_model_len": max_len, "max_num_seqs": seqs}
    detail |= {"kv_sequences": min(DEFAULT_KV_SEQUENCES, seqs), "batch_from": batch_from}
    detail |= {"activation_tokens": tokens, "sampler_mb": _ceil_mb(sampler)}
    detail |= {"prompt_logprobs_mb": _ceil_mb(logprobs), "vocab_size": vocab}
    detail["token_buffer_mb"] = token_buffer_mb(seqs, max_len) * gpus
    detail["multimodal"] = multimodal
    detail |= {"tp": tp, "pp": pp, "pcp": pcp, "gpus": gpus}
    if kv_cache_memory_bytes is not None:
        detail["kv_from"] = "kv_cache_memory_bytes"
    return Footprint(sum(parts.values()) + overhead, "estimate", detail, gpus, overhead)


def _batch(
    defaults: tuple[int, int],
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    max_len: int,
    chunked_prefill: bool,
) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) as vLLM settles them from the args and the
    `defaults`: each default bounded by the other and the length, and without chunked prefill
    at least one full-length sequence of tokens (vLLM 0.33 ``engine/arg_utils.py:3166-3234``)."""
    default_seqs, default_tokens = defaults
    tokens = max_num_batched_tokens
    if tokens is None:
        tokens = default_tokens if chunked_prefill else max(default_tokens, max_len)
        tokens = min(tokens, (max_num_seqs or default_seqs) * max_len)
    return max_num_seqs or min(default_seqs, tokens), tokens


def _sampler_bytes(seqs: int, tokens: int, vocab: int) -> float:
    """V2's sampler on one device: its state and its profiling passes."""
    return sampler_state_bytes(seqs, vocab) + min(seqs, tokens) * vocab * SAMPLER_BYTES


def sampler_state_bytes(max_num_seqs: int, vocab: int) -> int:
    """Model Runner V2's sampler state per rank of the last pipeline stage, in the ``weights``
    pool: ``output_bin_counts`` and ``prompt_bin_mask`` (`SAMPLER_STATE_BYTES`)."""
    return max_num_seqs * (vocab + -(-vocab // 32)) * SAMPLER_STATE_BYTES


def sampler_state_tensors(max_num_seqs: int, vocab: int) -> list[int]:
    """The bytes of V2's two sampler-state tensors, in the order ``PenaltiesState`` allocates
    them (``v1/worker/gpu/sample/penalties.py:43-50``); [] without a vocabulary."""
    if not vocab:
        return []
    return [max_num_seqs * -(-vocab // 32) * 4, max_num_seqs * vocab * 4]


def token_buffer_mb(max_num_seqs: int, max_model_len: int) -> int:
    """Host RAM Model Runner V2 pins at start on each rank for every request's token ids:
    ``all_token_ids``, ``max_num_seqs x max_model_len`` int32 in a pinned UVA buffer
    (``v1/worker/gpu/states.py:32-42``, ``v1/worker/gpu/buffer_utils.py:32-38``), a block that
    PyTorch's host allocator rounds up to a power of two."""
    return _ceil_mb(_pow2(max_num_seqs * max_model_len * 4))


def batch_defaults(total_mb: int | None, name: str | None = None) -> tuple[int, int]:
    """vLLM's API-server defaults (max_num_seqs, max_num_batched_tokens) on a device of
    `total_mb` named `name` (vLLM 0.33 ``engine/arg_utils.py:2970-3006``): the H100/H200 tier
    from 70 GiB on, except an A100 or a GB10; from 160 GiB on, the B200 tier. Unknown: the
    small tier."""
    gib = (total_mb or 0) / 1024
    lowered = (name or "").lower()
    if gib >= 160:
        return LARGE_GPU_DEFAULTS
    if gib >= 70 and "a100" not in lowered and "gb10" not in lowered:
        return BIG_GPU_DEFAULTS
    return SMALL_GPU_DEFAULTS


#: Decimals of the ``--gpu-memory-utilization`` the proxy passes (vLLM takes any float).
UTIL_DECIMALS = 6


def utilization_for(budget_mb: int, total_mb: int) -> float:
    """The ``--gpu-memory-utilization`` that gives vLLM at most `budget_mb` of a `total_mb`
    device.

    Rounded down to `UTIL_DECIMALS` decimals (under 0.2 MiB of an 80 GiB device), so that vLLM's
    own ``ceil(util x total)`` (its startup check and its KV sizing, against CUDA's total,
    which is smaller than NVML's) never asks for more than the planner set aside; clamped to
    [0.000001, 0.99].
    """
    if total_mb <= 0:
        raise ValueError(f"device total must be positive, got {total_mb} MiB")
    scale = 10**UTIL_DECIMALS
    units = max(budget_mb, 0) * scale // total_mb
    return min(max(units, 1), scale * 99 // 100) / scale


def footprint_for_spec(
    spec: ModelSpec,
    device_total_mb: int | None,
    params_b: float | None = None,
    context_mb: int = CUDA_CONTEXT_MB,
    nccl_mb: int = NCCL_MB,
    device_name: str | None = None,
) -> Footprint:
    """`estimate_footprint_mb` fed from a model's config: ``memory_mb`` and its vLLM ``args``.

    Reads ``gpu_memory_utilization`` (or ``device_memory_utilization``), the parallel sizes
    (`parallel_sizes`), ``dtype``, ``kv_cache_dtype``, ``max_model_len``, ``max_num_seqs`` and
    ``max_num_batched_tokens`` and ``kv_cache_memory_bytes``; the model path is ``spec.model``.
    `device_total_mb` and `device_name` choose vLLM's batch defaults (`batch_defaults`).
    """
    args = {k.replace("-", "_"): v for k, v in spec.args}
    util = args.get("gpu_memory_utilization", args.get("device_memory_utilization"))
    tp, pp, pcp, dp = parallel_sizes(spec)
    chunked = args.get("enable_chunked_prefill")
    chunked_off = chunked is False or str(chunked).lower() in ("false", "0")
    chunked_off = chunked_off or bool(args.get("no_enable_chunked_prefill"))
    runner_v2 = dict(spec.env).get("VLLM_USE_V2_MODEL_RUNNER", "").lower() not in ("0", "false")
    fp = estimate_footprint_mb(
        memory_mb=spec.memory_mb,
        gpu_memory_utilization=float(str(util)) if util is not None else None,
        device_total_mb=device_total_mb,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        context_parallel_size=pcp,
        data_parallel_local=dp,
        model_path=spec.model,
        params_b=params_b,
        dtype=str(args.get("dtype") or "auto"),
        kv_cache_dtype=str(args.get("kv_cache_dtype") or "auto"),
        max_model_len=_arg_int(args.get("max_model_len")),
        max_num_seqs=_arg_int(args.get("max_num_seqs")),
        max_num_batched_tokens=_arg_int(args.get("max_num_batched_tokens")),
        kv_cache_memory_bytes=_arg_bytes(args.get("kv_cache_memory_bytes")),
        device_name=device_name,
        context_mb=context_mb,
        nccl_mb=nccl_mb,
        generates=not spec.pooling,
        chunked_prefill=not chunked_off,
        model_runner_v2=runner_v2 and pcp == 1,
    )
    return _with_lora(spec, fp, tp) if spec.lora else fp


def _with_lora(spec: ModelSpec, fp: Footprint, tp: int) -> Footprint:
    """A model with LoRA adapters: vLLM preallocates ``--max-loras`` slots of
    ``--max-lora-rank`` in its budget (`adapters.slots_mb`, from config.json); at least the
    ``max_adapters`` largest adapters' files must fit there too. An estimate grows by that;
    a budget given by ``memory_mb`` or ``gpu_memory_utilization`` holds it (vLLM takes it
    from the KV cache), so only its detail names it."""
    args = {k.replace("-", "_"): v for k, v in spec.args}
    slots = _arg_int(args.get("max_loras")) or spec.max_adapters
    known = [*spec.adapters, *(list_folder(spec.adapters_dir) if spec.adapters_dir else [])]
    files_mb = math.ceil(largest_sizes_mb(known, spec.max_adapters) / tp)
    model_dir = _local_dir(spec.model)
    try:
        arch = _architecture(None, model_dir)
        preallocated = slots_mb(arch, slots, spec.max_lora_rank, tp)
    except (ValueError, OSError):
        preallocated = 0
    lora = max(preallocated, files_mb)
    detail = {**fp.detail, "lora_mb": lora, "lora_slots": slots, "lora_rank": spec.max_lora_rank}
    grow = lora if fp.source == "estimate" else 0
    return dataclasses.replace(fp, per_device_mb=fp.per_device_mb + grow, detail=detail)


def lora_host_mb(spec: ModelSpec) -> int:
    """Host RAM vLLM's CPU cache of adapters may take (``--max-cpu-loras``, else
    ``--max-loras``, of the largest adapter known): the engine fills it as adapters are
    loaded, also after a level-1 sleep has pinned its weights."""
    if not spec.lora:
        return 0
    args = {k.replace("-", "_"): v for k, v in spec.args}
    cached = _arg_int(args.get("max_cpu_loras")) or _arg_int(args.get("max_loras"))
    known = [*spec.adapters, *(list_folder(spec.adapters_dir) if spec.adapters_dir else [])]
    return largest_sizes_mb(known, 1) * (cached or spec.max_adapters)


def reload_peak_mb(spec: ModelSpec) -> int:
    """The largest buffer a level-2 wake's weight reload materialises on each device.

    vLLM reloads layer by layer: it materialises a whole module, loads all of its buffered
    weights and runs ``process_weights_after_loading`` (vLLM 0.33
    ``model_loader/reload/layerwise.py:344-402``), in torch's default allocator, while the
    weights are mapped and the KV cache is not yet; the final ``wake_up?tags=kv_cache`` empties
    torch's cache before it maps the KV cache (``device_allocator/cumem.py:342-343``). So the
    reload needs no memory beyond the engine's footprint, as long as its peak fits in the room
    the KV cache and the transient peak will take. Sized as the checkpoint's largest module
    (`module_bytes`: a fused MoE layer holds every expert, q/k/v and gate/up are fused) over
    the tensor-parallel size, twice that for online quantisation (``quantization`` set on a
    floating-point checkpoint: the original and the quantised copy), when the safetensors
    headers are local; else `RELOAD_PEAK_MB`.
    """
    model_dir = _local_dir(spec.model)
    files = safetensors_files(model_dir) if model_dir is not None else []
    try:
        modules, floating = module_bytes(files)
    except (ValueError, OSError, KeyError, TypeError):
        modules, floating = {}, False
    largest = max(modules.values(), default=0)
    if not largest:
        return RELOAD_PEAK_MB
    args = {k.replace("-", "_"): v for k, v in spec.args}
    online = floating and args.get("quantization") not in (None, "", False)
    return _ceil_mb(largest * (2 if online else 1) / parallel_sizes(spec)[0])


#: Checkpoint names vLLM fuses into one module (``qkv_proj``, ``gate_up_proj``; Mixtral's
#: ``w1``/``w3``).
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}  # fmt: skip
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


def module_of(tensor: str) -> str:
    """The module a reload materialises `tensor` with: a MoE layer's experts together (the
    part of the name before ``.experts.``), fused projections together, else its own module
    (the name less ``.weight``, ``.bias``, ``.weight_scale``...)."""
    if ".experts." in tensor:
        return tensor.split(".experts.", 1)[0] + ".experts"
    prefix, _, leaf = tensor.rpartition(".")[0].rpartition(".")
    return f"{prefix}.{FUSED.get(leaf, leaf)}"


def module_bytes(files: list[Path]) -> tuple[dict[str, int], bool]:
    """Bytes of each module (`module_of`) in safetensors files, from their headers alone, and
    whether every tensor is floating-point (an unquantised checkpoint)."""
    modules: dict[str, int] = {}
    floating = True
    for path in files:
        header = safetensors_header(path)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = info["dtype"]
            floating = floating and dtype in FLOAT_DTYPES
            size = math.ceil(math.prod(int(n) for n in info["shape"]) * DTYPE_BYTES.get(dtype, 2))
            module = module_of(name)
            modules[module] = modules.get(module, 0) + size
    return modules, floating


def pinned_weights_mb(spec: ModelSpec, max_num_seqs: int | None = None) -> int | None:
    """Host RAM a level-1 sleep pins for the ``weights`` pool, all devices together, before it
    was measured.

    One pinned backup per CuMem allocation (vLLM 0.33 ``device_allocator/cumem.py:256-276``),
    from PyTorch's caching host allocator, which rounds each block up to a power of two. A CuMem
    allocation is one of torch's segments, not one tensor: vLLM loads the weights with
    ``max_split_size_mb=20`` (``v1/worker/gpu_worker.py:594-600``), so tensors share 2 MiB and
    20 MiB segments (`torch_segments`). The pool holds each checkpoint tensor over the
    tensor-parallel size at the serving dtype (vLLM fuses some tensors, so the real segments
    differ; the first sleep is measured and replaces this) and Model Runner V2's sampler state
    (`sampler_state_tensors`, for `max_num_seqs` sequences: the args', else 1024, the most any
    device defaults to). Tensor-parallel ranks each pin their slice; pipeline stages split the
    tensors; local data-parallel ranks each pin a copy. None when the headers are not local."""
    model_dir = _local_dir(spec.model)
    files = safetensors_files(model_dir) if model_dir is not None else []
    if not files:
        return None
    tp, _pp, pcp, dp = parallel_sizes(spec)
    try:
        arch = _architecture(None, model_dir)
        args = {k.replace("-", "_"): v for k, v in spec.args}
        serve = _serving_dtype_bytes(str(args.get("dtype") or "auto"), arch)
        sizes = [math.ceil(n / tp) for n, _ in _served_tensors(files, serve)]
    except (ValueError, OSError):
        return None
    seqs = max_num_seqs or _arg_int(args.get("max_num_seqs")) or BIG_GPU_DEFAULTS[0]
    vocab = int(arch.get("vocab_size") or 0) if not spec.pooling and pcp == 1 else 0
    sizes += sampler_state_tensors(seqs, vocab)
    total = sum(_pow2(segment) for segment in torch_segments(sizes))
    return _ceil_mb(total * tp * dp)


#: The ``runtime`` pool a sleep of either level pins in host RAM per device, when unknown (LoRA
#: slots come on top: `host_runtime_mb`).
RUNTIME_POOL_MB = 512


def host_weights_mb(spec: ModelSpec, fp: Footprint | None) -> int | None:
    """Host RAM a level-1 sleep of `spec` pins for its weights pool, all devices together (the
    caller adds the runtime pool), until a sleep of its engine was measured, from its estimated
    footprint `fp` (None: not estimated, then from the config alone):

    - one pinned block per torch segment of the weights and V2's sampler state, each rounded up
      to a power of two (`pinned_weights_mb`, for the batch the estimate planned), where the
      checkpoint's headers are local;
    - else the estimate's weights and sampler state on every device;
    - else 16-bit weights of ``params_b``;
    - else the whole footprint (an upper bound); None when nothing is known;

    each plus what its CPU cache of adapters may still take (`lora_host_mb`)."""
    if fp is None:
        try:
            fp = footprint_for_spec(spec, None, spec.params_b)
        except (ValueError, OSError):
            fp = None
    lora = lora_host_mb(spec)
    seqs = fp.detail.get("max_num_seqs") if fp is not None else None
    pinned = pinned_weights_mb(spec, seqs if isinstance(seqs, int) else None)
    if pinned is not None:
        return pinned + lora
    weights = fp.detail.get("weights_mb") if fp is not None else None
    if fp is not None and isinstance(weights, int | float):
        state = int(fp.detail.get("sampler_state_mb", 0))
        return (int(weights) + state) * fp.gpus + lora
    if spec.params_b is not None:  # 16-bit weights
        return math.ceil(spec.params_b * 1e9 * 2 / 2**20) + lora
    if fp is not None:  # no breakdown (memory_mb): the whole footprint, an upper bound
        return fp.budget_mb * fp.gpus + lora
    return None


def host_runtime_mb(fp: Footprint | None) -> int:
    """Host RAM a sleep of either level pins for the ``runtime`` pool, all devices together:
    `RUNTIME_POOL_MB` per device plus the preallocated LoRA slots, which live in that pool
    (vLLM 0.33 ``v1/worker/lora_model_runner_mixin.py:57-63``); one device when `fp` is None."""
    gpus = fp.gpus if fp is not None else 1
    slots = int(fp.detail.get("lora_mb", 0)) if fp is not None else 0
    return (RUNTIME_POOL_MB + slots) * gpus


def host_start_mb(fp: Footprint | None) -> int:
    """Host RAM an engine pins as it starts, all ranks together: Model Runner V2's token buffer
    for the batch its estimate `fp` planned (`token_buffer_mb`); 0 where it was not estimated."""
    pinned = fp.detail.get("token_buffer_mb", 0) if fp is not None else 0
    return int(pinned) if isinstance(pinned, int) else 0


#: PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp): requests of at most
#: 1 MiB share 2 MiB segments, requests under 10 MiB share 20 MiB segments, larger ones get a
#: segment of their own rounded up to 2 MiB; a free remainder is split off for later requests
#: only below ``max_split_size_mb`` (20 in vLLM's weights pool) and above 1 MiB (small: 512 B).
_SMALL_SIZE = 1 * MIB
_SMALL_BUFFER = 2 * MIB
_LARGE_BUFFER = 20 * MIB
_MIN_LARGE_ALLOC = 10 * MIB
_ROUND_LARGE = 2 * MIB
_MAX_SPLIT = 20 * MIB


def torch_segments(sizes: Iterable[int]) -> list[int]:
    """The segments (bytes) PyTorch's caching allocator takes from a CuMem pool for requests of
    `sizes` bytes made in that order, with ``max_split_size_mb=20``: each request goes into the
    smallest free remainder that holds it, else into a new segment."""
    segments: list[int] = []
    free: dict[bool, list[int]] = {True: [], False: []}  # sorted free remainders per pool
    for n in sizes:
        size = max(512, -(-n // 512) * 512)
        small = size <= _SMALL_SIZE
        pool = free[small]
        at = bisect.bisect_left(pool, size) if small or size < _MAX_SPLIT else len(pool)
        if at < len(pool):
            block = pool.pop(at)
        else:
            if small:
                block = _SMALL_BUFFER
            elif size < _MIN_LARGE_ALLOC:
                block = _LARGE_BUFFER
            else:
                block = -(-size // _ROUND_LARGE) * _ROUND_LARGE
            segments.append(block)
        rest = block - size
        if rest >= 512 if small else (size < _MAX_SPLIT and rest > _SMALL_SIZE):
            bisect.insort(pool, rest)
    return segments


def _pow2(n: int) -> int:
    """`n` rounded up to a power of two (PyTorch's host allocator's block sizes)."""
    return 1 << max(n - 1, 0).bit_length()


def parallel_sizes(spec: ModelSpec) -> tuple[int, int, int, int]:
    """(tensor, pipeline, prefill-context, local data) parallel sizes from the model's args.

    vLLM's world size is their product on one node (vLLM 0.33 ``config/parallel.py:964-968``;
    data parallel ranks on this node each run a whole copy, ``data_parallel_size_local``
    defaulting to ``data_parallel_size``). Short flags in ``extra_args`` are not read.
    """
    args = {k.replace("-", "_"): v for k, v in spec.args}

    def size(*keys: str) -> int:
        for key in keys:
            value = _arg_int(args.get(key))
            if value is not None:
                return value
        return 1

    tp = size("tensor_parallel_size", "tp")
    pp = size("pipeline_parallel_size", "pp")
    pcp = size("prefill_context_parallel_size", "pcp")
    dp = size("data_parallel_size_local", "dpl", "data_parallel_size", "dp")
    return tp, pp, pcp, dp


def _arg_int(value: Any) -> int | None:
    """vLLM's integer flags: ``8192``, ``"8k"`` (8000), ``"8K"`` (8192); -1/"auto" -> None."""
    if value is None or value is False or str(value).lower() in ("-1", "auto", ""):
        return None
    text = str(value).strip()
    scale = {"k": 1000, "K": 1024, "m": 10**6, "M": 1024**2}.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    return int(float(number) * scale)


def _arg_bytes(value: Any) -> int | None:
    """vLLM's human-readable byte sizes (``--kv-cache-memory-bytes``): ``k``/``m``/``g`` are
    powers of 1000, ``K``/``M``/``G`` of 1024."""
    if value is None or value is False or str(value).strip() == "":
        return None
    text = str(value).strip()
    units = {"k": 1000, "m": 1000**2, "g": 1000**3, "K": 1024, "M": 1024**2, "G": 1024**3}
    scale = units.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    return int(float(number) * scale)


def _from_utilization(util: float, total_mb: int | None, gpus: int, overhead: int) -> Footprint:
    if not 0 < util <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util}")
    if total_mb is None:
        raise ValueError("gpu_memory_utilization needs the device's total memory")
    detail = {"gpu_memory_utilization": util, "device_total_mb": total_mb, "overhead_mb": overhead}
    return Footprint(math.ceil(util * total_mb) + overhead, "utilization", detail, gpus, overhead)


def _ceil_mb(n_bytes: float) -> int:
    return math.ceil(n_bytes / MIB)


def _local_dir(model_path: str | Path | None) -> Path | None:
    if model_path is None:
        return None
    path = Path(model_path).expanduser()
    return path if path.is_dir() else None


def _architecture(config: Mapping[str, Any] | None, model_dir: Path | None) -> dict[str, Any]:
    if config is None and model_dir is not None and (model_dir / "config.json").is_file():
        config = json.loads((model_dir / "config.json").read_text())
    if config is None:
        raise ValueError(
            "cannot estimate the model's memory: no local config.json; "
            "set memory_mb or gpu_memory_utilization"
        )
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, Mapping) else dict(config)


def _arch_int(arch: Mapping[str, Any], key: str) -> int:
    value = arch.get(key)
    if value is None:
        raise ValueError(f"config.json has no {key}; set memory_mb or gpu_memory_utilization")
    return int(value)


def _serving_dtype_bytes(dtype: str, arch: Mapping[str, Any]) -> float:
    """Bytes per floating-point weight as served; "auto" follows the checkpoint, 32-bit -> 16."""
    if dtype != "auto":
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}")
        return DTYPE_BYTES[dtype]
    native = arch.get("torch_dtype") or arch.get("dtype") or "bfloat16"
    return min(DTYPE_BYTES.get(str(native), 2), 2)


def _kv_dtype_bytes(kv_cache_dtype: str, serve_bytes: float) -> float:
    if kv_cache_dtype == "auto":
        return serve_bytes
    if kv_cache_dtype.startswith("fp8"):
        return 1
    if kv_cache_dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}")
    return DTYPE_BYTES[kv_cache_dtype]


def _kv_bytes_per_device(
    arch: Mapping[str, Any], tp: int, max_len: int, seqs: int, kv_bytes: float
) -> float:
    layers = _arch_int(arch, "num_hidden_layers")
    heads = _arch_int(arch, "num_attention_heads")
    kv_heads = int(arch.get("num_key_value_heads") or heads)
    head_dim = int(arch.get("head_dim") or _arch_int(arch, "hidden_size") // heads)
    return 2 * layers * math.ceil(kv_heads / tp) * head_dim * max_len * seqs * kv_bytes


def _weights_bytes(
    params_b: float | None, serve_bytes: float, model_dir: Path | None
) -> tuple[float, int, str]:
    """(bytes, parameter count, where the count came from) for the whole model."""
    if params_b is not None:
        params = round(params_b * 1e9)
        return params * serve_bytes, params, "params_b"
    files = safetensors_files(model_dir) if model_dir is not None else []
    if not files:
        raise ValueError(
            "cannot count the model's parameters: no local *.safetensors files; "
            "set params_b, memory_mb or gpu_memory_utilization"
        )
    total = 0.0
    params = 0
    for nbytes, numel in _served_tensors(files, serve_bytes):
        total += nbytes
        params += numel
    return total, params, "safetensors"


def _served_tensors(files: list[Path], serve_bytes: float) -> Iterator[tuple[float, int]]:
    """(bytes as served, element count) of every checkpoint tensor: floating-point tensors at
    the serving dtype, others (quantised weights, packed ints) at their own size."""
    for path in files:
        for dtype, numel in tensor_sizes(path):
            size = serve_bytes if dtype in _CAST_DTYPES else DTYPE_BYTES[dtype]
            yield numel * size, numel


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint files vLLM would load: those named by ``model.safetensors.index.json``
    when it exists, otherwise every ``*.safetensors`` file in the directory."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = set(json.loads(index.read_text()).get("weight_map", {}).values())
        return sorted(model_dir / n for n in names)
    return sorted(model_dir.glob("*.safetensors"))


def safetensors_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header: an 8-byte little-endian length, then that many bytes of
    JSON mapping tensor names to ``{"dtype", "shape", "data_offsets"}`` (and ``__metadata__``).
    `ValueError` for a file too short or a header too long to be one."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: safetensors header of {length} bytes, file is corrupt")
        header: dict[str, Any] = json.loads(f.read(length))
    return header


def tensor_sizes(path: Path) -> list[tuple[str, int]]:
    """(dtype, element count) of every tensor in a safetensors file, from its header alone.

    The format: an 8-byte little-endian header length, then a JSON object mapping tensor names
    to ``{"dtype", "shape", "data_offsets"}`` (plus an optional ``__metadata__``).
    """
    header = safetensors_header(path)
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPE_BYTES:
            raise ValueError(f"{path}: tensor {name} has unknown dtype {info['dtype']}")
        out.append((info["dtype"], math.prod(int(n) for n in info["shape"])))
    return out
