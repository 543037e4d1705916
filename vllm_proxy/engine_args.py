"""vLLM's command line and checkpoints as the proxy reads them: how a config key becomes a flag,
the flags with no ``--no-`` form, which architectures and ``convert`` values make a pooling
model (and its task), which load formats cannot reload weights, how large a checkpoint is on
disk and the timeouts that follow from it.

This is the part of the configuration that follows vLLM's releases rather than the proxy's own
keys: each table names the vLLM source it mirrors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

ArgValue = bool | int | float | str | list[Any] | dict[str, Any] | None


#: Load formats whose loader cannot read the checkpoint again (no ``get_all_weights``), so a
#: level-2 wake's ``reload_weights`` raises NotImplementedError (vLLM 0.33
#: ``model_executor/model_loader/reload/inplace.py:74-79``).
NO_RELOAD_FORMATS = frozenset(
    {"dummy", "sharded_state", "runai_streamer_sharded", "tensorizer", "modelexpress", "ipc_cache"}
)


def arg_name(key: str) -> str:
    return key.replace("-", "_")


def flag(key: str, value: ArgValue) -> list[str]:
    """`max_model_len: 8192` -> ``--max-model-len 8192``; True -> bare flag; False ->
    ``--no-<flag>`` (vLLM's boolean flags are argparse's BooleanOptionalAction, and several
    default to on, such as ``--enable-prefix-caching``); None -> none."""
    flag = "--" + key.replace("_", "-")
    if value is True:
        return [flag]
    if value is False:
        return [] if arg_name(key) in STORE_TRUE_FLAGS else ["--no-" + key.replace("_", "-")]
    if value is None:
        return []
    if isinstance(value, list):
        return [flag, *(scalar(v) for v in value)] if value else []
    return [flag, scalar(value)]


def scalar(value: Any) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


#: ``convert`` values that make vLLM run a model as a pooling model.
POOLING_TASKS = frozenset({"embed", "classify"})


#: vLLM's boolean flags that are plain ``store_true`` (no ``--no-`` form): false omits them.
STORE_TRUE_FLAGS = frozenset(
    {"headless", "grpc", "data_parallel_multi_port_external_lb", "disable_log_stats",
     "aggregate_engine_logging"}
)  # fmt: skip


#: Architecture name endings vLLM runs as pooling models when the runner is left to "auto".
POOLING_ARCHITECTURES = (
    "ForSequenceClassification", "ForTokenClassification", "ForRewardModeling", "RewardModel",
    "EmbeddingModel", "BertModel", "RobertaModel", "XLMRobertaModel", "BertSpladeSparseEmbedding",
)  # fmt: skip


#: The pooling task of an architecture, by name ending (first match; vLLM's
#: ``_SUFFIX_TO_DEFAULTS`` and ``get_pooling_task``); other pooling architectures: `pooling`.
ARCHITECTURE_TASKS = (
    ("ForTokenClassification", "token_classify"), ("RewardModel", "token_classify"),
    ("ForSequenceClassification", "classify"), ("ClassificationModel", "classify"),
    ("EmbeddingModel", "embed"), ("BertModel", "embed"), ("RobertaModel", "embed"),
    ("BertSpladeSparseEmbedding", "embed"),
)  # fmt: skip


def pooler_task(value: ArgValue) -> str | None:
    """``task`` of a ``pooler_config`` arg (a mapping or its JSON), if it names one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    task = value.get("task") if isinstance(value, dict) else None
    return str(task) if task else None


def architectures(model: str) -> list[str]:
    """``architectures`` from a local checkpoint's config.json (empty when not readable)."""
    try:
        data = json.loads((Path(model).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return []
    names = data.get("architectures") if isinstance(data, dict) else None
    return [str(n) for n in names] if isinstance(names, list) else []


#: Timeouts left unset: a fixed part plus seconds per GiB of checkpoint on disk. These are
#: allowances, not measurements: a start reads the checkpoint (0.5 GiB/s leaves 2 s per GiB),
#: compiles and captures CUDA graphs; a level-2 wake reads it again; a level-1 sleep copies the
#: weights into newly pinned host memory. A 140 GB checkpoint gets 440 s to start.
AUTO_TIMEOUTS = {
    "startup_timeout_s": (180.0, 2.0),
    "sleep_timeout_s": (60.0, 1.0),
    "wake_timeout_s": (60.0, 2.0),
}


#: Files that hold a checkpoint's weights.
CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def checkpoint_gib(model: str, params_b: float | None) -> float:
    """The checkpoint's size in GiB: its weight files when `model` is a local path, else 16-bit
    weights of ``params_b`` billion parameters, else 0 (unknown)."""
    path = Path(model).expanduser()
    try:
        if path.is_file():
            return path.stat().st_size / 2**30
        if path.is_dir():
            files = [f for f in path.iterdir() if f.suffix in CHECKPOINT_SUFFIXES]
            return sum(f.stat().st_size for f in files if f.is_file()) / 2**30
    except OSError:
        pass
    return params_b * 2e9 / 2**30 if params_b else 0.0


def auto_timeouts(gib: float) -> dict[str, float]:
    """The default startup, sleep and wake timeouts for a checkpoint of `gib` GiB."""
    return {key: round(base + per_gib * gib, 1) for key, (base, per_gib) in AUTO_TIMEOUTS.items()}


#: vLLM's log line once a worker has measured its memory (``v1/worker/gpu_worker.py:772-775``,
#: ``format_gib``: GiB rounded to 2 decimals, ``utils/mem_utils.py:30-31``), and the line of a
#: worker told its KV cache size, which skips the measurement (``gpu_worker.py:664-676``):
#: each worker's profiling window ends there.
KV_MEASURED = re.compile(r"Available KV cache memory: ([0-9]+(?:\.[0-9]+)?) GiB")
KV_GIVEN_MARKER = "skipped memory profiling"


def profiled_lines(text: str) -> tuple[int, int | None]:
    """In `text` (lines of an engine's log): how many workers have ended their profiling
    window, and the smallest KV cache (bytes, rounded down past vLLM's rounding) that one of
    them measured (None: none measured)."""
    ended = 0
    smallest: int | None = None
    for line in text.splitlines():
        m = KV_MEASURED.search(line)
        if m:
            ended += 1
            kv = max(int((float(m.group(1)) - 0.005) * (1 << 30)), 0)
            smallest = kv if smallest is None else min(smallest, kv)
        elif KV_GIVEN_MARKER in line:
            ended += 1
    return ended, smallest


#: vLLM's log lines for a start that ran out of device memory.
OOM_MARKERS = ("out of memory", "OutOfMemoryError", "Free memory on device", "less than desired")
#: vLLM's log lines for a budget that holds the weights but leaves no room for the KV cache
#: (activations, the sampler or CUDA graphs took more than planned): a larger budget may work,
#: evicting others does not help (vLLM 0.33 ``v1/core/kv_cache_utils.py``).
KV_SHORT_MARKERS = (
    "No available memory for the cache blocks",
    "which is larger than the available KV cache memory",
)
#: vLLM's assertion when another process freed memory while it profiled: retry the start.
PROFILING_MARKERS = ("Error in memory profiling",)
#: vLLM's line at each rank's sleep (``device_allocator/cumem.py:282-289``): what it backed up
#: in host memory.
BACKED_UP = re.compile(
    r"CuMemAllocator: sleep freed [\d.]+ GiB memory in total, of which ([\d.]+) GiB is backed"
    r" up in CPU"
)
#: vLLM's (or the OS's) words for a listener whose port was taken.
PORT_IN_USE = re.compile(rb"Errno 98|Address already in use|EADDRINUSE")

#: Why a start failed, by its log (`start_failure`).
StartFailure = Literal["kv_short", "profiling", "oom"]


def start_failure(tail: str) -> StartFailure | None:
    """Why a start failed, from the end of its engine's log, first match wins:

    - ``kv_short``: its budget holds the weights but no KV cache (`KV_SHORT_MARKERS`);
    - ``profiling``: another process freed memory while it profiled (`PROFILING_MARKERS`);
    - ``oom``: out of device memory (`OOM_MARKERS`);
    - None: none of these (the failure stands as it is)."""
    if any(marker in tail for marker in KV_SHORT_MARKERS):
        return "kv_short"
    if any(marker in tail for marker in PROFILING_MARKERS):
        return "profiling"
    if any(marker in tail for marker in OOM_MARKERS):
        return "oom"
    return None
