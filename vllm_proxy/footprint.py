"""Footprints: how much GPU memory one engine of a model takes on each of its devices.

`footprint_for_spec()` applies the rules in order (``memory_mb``, ``gpu_memory_utilization`` x
device total, else `estimate_footprint_mb()` from the model's config.json and safetensors
headers, or ``params_b``); `utilization_for()` turns a footprint into vLLM's
``--gpu-memory-utilization``. Pure arithmetic and file reads: no GPU access.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ModelSpec

MIB = 1024 * 1024

#: Memory the CUDA context and its libraries take on every device, whatever the model.
CUDA_CONTEXT_MB = 512
#: Fixed part of the activation estimate (workspace, sampler, CUDA graphs).
ACTIVATION_BASE_MB = 512
#: vLLM's default number of sequences in one batch.
DEFAULT_MAX_NUM_SEQS = 256
#: Full-length sequences the KV cache is sized for when ``max_num_seqs`` is not given. Planning
#: for vLLM's 256 would ask for hundreds of GiB on any long-context model; vLLM itself only needs
#: room for one ``max_model_len`` sequence to start, and packs more into whatever it is given.
DEFAULT_KV_SEQUENCES = 4
#: Tokens in one forward pass when max_num_batched_tokens is not given (vLLM's chunked prefill
#: never schedules more than that per step, so activations do not grow with the whole batch).
DEFAULT_MAX_BATCHED_TOKENS = 8192
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
    """What one engine takes on each of its `tp` devices, and how that number was found.

    ``source`` is "config" (memory_mb), "utilization" (gpu_memory_utilization x device total)
    or "estimate" (the formula; ``detail`` holds its terms in MiB).
    """

    per_device_mb: int
    source: str
    detail: dict[str, Any]
    tp: int = 1


def estimate_footprint_mb(
    *,
    memory_mb: int | None = None,
    gpu_memory_utilization: float | None = None,
    device_total_mb: int | None = None,
    tensor_parallel_size: int = 1,
    model_path: str | Path | None = None,
    model_config: Mapping[str, Any] | None = None,
    params_b: float | None = None,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
) -> Footprint:
    """The memory one engine takes on each of its devices; the first rule that applies wins.

    1. ``memory_mb`` (per device) is taken as given.
    2. ``gpu_memory_utilization`` x ``device_total_mb``, rounded up: vLLM sizes itself to that
       fraction of the device's total memory on each of its ``tensor_parallel_size`` devices.
    3. The estimate, per device: ``weights / tp + kv_cache / tp + activations + 512 MiB`` of
       CUDA context, where

       * weights = parameters x bytes per parameter. With ``params_b`` (billions) they are
         ``params_b x dtype``; otherwise, for a local model directory, the safetensors headers
         are summed (only the headers are read). Floating-point tensors count at the serving
         dtype, other tensors (quantised weights, packed ints) at their own size. ``dtype="auto"``
         serves at the checkpoint's ``torch_dtype``, and float32 checkpoints at 16 bits as
         vLLM does;
       * kv_cache = 2 x layers x kv_heads x head_dim x max_model_len x max_num_seqs x kv bytes
         (kv_heads defaults to attention heads, head_dim to hidden_size / heads, max_model_len to
         max_position_embeddings; with ``tp`` larger than kv_heads the heads are replicated, so
         each device holds ``ceil(kv_heads / tp)``). With ``max_num_seqs`` given this is room for
         every sequence at full length at once; without it, for ``DEFAULT_KV_SEQUENCES`` (4)
         full-length sequences, since vLLM's default of 256 would be hundreds of GiB;
       * activations = 512 MiB + tokens x hidden_size x 2 bytes, with tokens =
         max_num_seqs x max_model_len capped at max_num_batched_tokens (default 8192), since
         vLLM runs at most that many tokens per step.

       The architecture comes from ``model_config`` or ``config.json`` in ``model_path``
       (``text_config`` of multimodal models is used when present).

    Raises ValueError when no rule applies, naming what is missing.
    """
    tp = tensor_parallel_size
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tp}")
    if memory_mb is not None:
        return Footprint(int(memory_mb), "config", {"memory_mb": memory_mb}, tp)
    if gpu_memory_utilization is not None:
        return _from_utilization(gpu_memory_utilization, device_total_mb, tp)
    model_dir = _local_dir(model_path)
    arch = _architecture(model_config, model_dir)
    serve_bytes = _serving_dtype_bytes(dtype, arch)
    weights, params, how = _weights_bytes(params_b, serve_bytes, model_dir)
    max_len = max_model_len or _arch_int(arch, "max_position_embeddings")
    seqs = max_num_seqs or DEFAULT_MAX_NUM_SEQS
    kv_seqs = max_num_seqs or DEFAULT_KV_SEQUENCES
    kv_bytes = _kv_dtype_bytes(kv_cache_dtype, serve_bytes)
    kv = _kv_bytes_per_device(arch, tp, max_len, kv_seqs, kv_bytes)
    tokens = min(seqs * max_len, max_num_batched_tokens or DEFAULT_MAX_BATCHED_TOKENS)
    act = ACTIVATION_BASE_MB * MIB + tokens * _arch_int(arch, "hidden_size") * 2
    parts = {
        "weights_mb": _ceil_mb(weights / tp),
        "kv_cache_mb": _ceil_mb(kv),
        "activations_mb": _ceil_mb(act),
        "cuda_context_mb": CUDA_CONTEXT_MB,
    }
    detail = {**parts, "params": params, "weights_from": how, "max_model_len": max_len}
    detail |= {"max_num_seqs": seqs, "kv_sequences": kv_seqs, "activation_tokens": tokens, "tp": tp}
    return Footprint(sum(parts.values()), "estimate", detail, tp)


def utilization_for(footprint_mb: int, total_mb: int) -> float:
    """The ``--gpu-memory-utilization`` that gives vLLM `footprint_mb` of a `total_mb` device.

    Rounded up to 3 decimals (vLLM then takes at most total/1000 MiB more than planned) and
    clamped to (0, 0.99]: 0.001 at least, 0.99 at most.
    """
    if total_mb <= 0:
        raise ValueError(f"device total must be positive, got {total_mb} MiB")
    thousandths = -(-max(footprint_mb, 0) * 1000 // total_mb)
    return min(max(thousandths, 1), 990) / 1000


def footprint_for_spec(
    spec: ModelSpec, device_total_mb: int | None, params_b: float | None = None
) -> Footprint:
    """`estimate_footprint_mb` fed from a model's config: ``memory_mb`` and its vLLM ``args``.

    Reads ``gpu_memory_utilization`` (or ``device_memory_utilization``),
    ``tensor_parallel_size``, ``dtype``, ``kv_cache_dtype``, ``max_model_len``,
    ``max_num_seqs`` and ``max_num_batched_tokens``; the model path is ``spec.model``.
    """
    args = {k.replace("-", "_"): v for k, v in spec.args}
    util = args.get("gpu_memory_utilization", args.get("device_memory_utilization"))
    return estimate_footprint_mb(
        memory_mb=spec.memory_mb,
        gpu_memory_utilization=float(str(util)) if util is not None else None,
        device_total_mb=device_total_mb,
        tensor_parallel_size=_arg_int(args.get("tensor_parallel_size")) or 1,
        model_path=spec.model,
        params_b=params_b,
        dtype=str(args.get("dtype") or "auto"),
        kv_cache_dtype=str(args.get("kv_cache_dtype") or "auto"),
        max_model_len=_arg_int(args.get("max_model_len")),
        max_num_seqs=_arg_int(args.get("max_num_seqs")),
        max_num_batched_tokens=_arg_int(args.get("max_num_batched_tokens")),
    )


def _arg_int(value: Any) -> int | None:
    """vLLM's integer flags: ``8192``, ``"8k"`` (8000), ``"8K"`` (8192); -1/"auto" -> None."""
    if value is None or value is False or str(value).lower() in ("-1", "auto", ""):
        return None
    text = str(value).strip()
    scale = {"k": 1000, "K": 1024, "m": 10**6, "M": 1024**2}.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    return int(float(number) * scale)


def _from_utilization(util: float, total_mb: int | None, tp: int) -> Footprint:
    if not 0 < util <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util}")
    if total_mb is None:
        raise ValueError("gpu_memory_utilization needs the device's total memory")
    detail = {"gpu_memory_utilization": util, "device_total_mb": total_mb}
    return Footprint(math.ceil(util * total_mb), "utilization", detail, tp)


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
    for path in files:
        for dtype, numel in tensor_sizes(path):
            size = serve_bytes if dtype in _CAST_DTYPES else DTYPE_BYTES[dtype]
            total += numel * size
            params += numel
    return total, params, "safetensors"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint files vLLM would load: those named by ``model.safetensors.index.json``
    when it exists, otherwise every ``*.safetensors`` file in the directory."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = set(json.loads(index.read_text()).get("weight_map", {}).values())
        return sorted(model_dir / n for n in names)
    return sorted(model_dir.glob("*.safetensors"))


def tensor_sizes(path: Path) -> list[tuple[str, int]]:
    """(dtype, element count) of every tensor in a safetensors file, from its header alone.

    The format: an 8-byte little-endian header length, then a JSON object mapping tensor names
    to ``{"dtype", "shape", "data_offsets"}`` (plus an optional ``__metadata__``).
    """
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: safetensors header of {length} bytes, file is corrupt")
        header = json.loads(f.read(length))
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPE_BYTES:
            raise ValueError(f"{path}: tensor {name} has unknown dtype {info['dtype']}")
        out.append((info["dtype"], math.prod(int(n) for n in info["shape"])))
    return out
