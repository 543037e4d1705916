"""Constants, the Settings of one fake engine, and its command line and environment."""

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

VERSION = "0.0.0-fake"
FINGERPRINT = f"vllm-{VERSION}"
EMBEDDING_DIM = 8
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
SLEEP_MODES = ("abort", "wait", "keep")
SLEEP_LEVELS = (0, 1, 2)
ASLEEP_POLICIES = ("reject", "park")
MEMORY_TAGS = ("weights", "kv_cache")
CLIENT_MAX_SIZE = 64 * 1024 * 1024
KEEPALIVE_TIMEOUT = 5.0
SHUTDOWN_GRACE = 0.5
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DONE = b"data: [DONE]\n\n"


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True)
class SimKnobs:
    """Simulated-GPU mode (``FAKE_ENGINE_SIM_*``): the ledger and the sizes vLLM would measure.

    MiB per device unless named ``_s`` (seconds), ``_mb_s`` (MiB per second) or ``_tokens``.
    """

    ledger: str
    context_mb: int = 512
    weights_mb: int = 1024
    #: The weights' tensors as torch allocates them (they sum to ``weights_mb``; empty: one),
    #: packed into torch's segments, one CuMem allocation each.
    weight_segments_mb: tuple[int, ...] = ()
    #: The vocabulary of Model Runner V2's sampler state (``--max-num-seqs`` rows of int32 in the
    #: weights pool); 0: no sampler state.
    vocab: int = 0
    #: The CuMem ``runtime`` pool: model-runner state and LoRA slots.
    runtime_mb: int = 64
    #: The CuMem ``workspace`` pool: scratch, discarded by every sleep, never pinned.
    workspace_mb: int = 0
    #: Model buffers and preserved parameters a level-2 sleep copies to pageable host memory.
    buffers_mb: int = 0
    #: The transient peak of a full batch, held in torch's cache.
    peak_mb: int = 256
    #: The batch (tokens of the running requests) that regrows the peak; 0: any request.
    peak_tokens: int = 0
    graphs_mb: int = 256
    #: What the profile estimates the CUDA graphs to take (None: ``graphs_mb``, exact).
    graphs_estimate_mb: int | None = None
    profile_s: float = 0.3
    #: From the end of profiling to ready (the KV cache and CUDA-graph capture).
    after_profile_s: float = 0.0
    min_kv_mb: int = 64
    sleep_s: float = 0.2
    reload_temp_mb: int = 128
    reload_mb_s: float = 4096.0

    @property
    def segments(self) -> tuple[int, ...]:
        """The weights' allocations, in the order they are made."""
        return self.weight_segments_mb or (self.weights_mb,)


@dataclass(frozen=True, slots=True)
class Settings:
    """Command line and environment of one fake engine."""

    model: str = "fake-model"
    served_names: tuple[str, ...] = ("fake-model",)
    host: str = "127.0.0.1"
    port: int = 8000
    #: ``--uds PATH``: serve on this Unix socket only (host and port are ignored).
    uds: str | None = None
    max_model_len: int = 2048
    max_num_seqs: int = 256
    #: ``--scheduling-policy``: with fcfs a request's non-zero ``priority`` is refused (vLLM).
    scheduling_policy: str = "fcfs"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    sleep_mode_offload_cudagraph: bool = False
    cuda_visible_devices: str | None = None
    api_keys: tuple[str, ...] = ()
    dev_mode: bool = False
    enable_sleep_mode: bool = False
    #: A pooling model (``--runner pooling`` or ``--convert embed|classify``): no completion
    #: routes, as in vLLM, which registers them only for generating models.
    pooling: bool = False
    startup_delay: float = 0.0
    tokens: int = 8
    token_delay: float = 0.0
    crash_after: int | None = None
    crash_code: int = 3
    stall_after: int | None = None
    exit_code: int | None = None
    ignore_sigterm: bool = False
    spawn_child: bool = False
    port_in_use_once: str | None = None
    sleep_delay: float = 0.0
    wake_delay: float = 0.0
    asleep: str = "park"
    sleep_fail: bool = False
    wake_fail: bool = False
    wake_hang: bool = False
    wake_lies: bool = False
    gpu_mb: int = 0
    gpu_device: str = "cuda:0"
    sim: SimKnobs | None = None
    #: LoRA (see ``fake_vllm.lora``): ``--enable-lora``, its bounds, the runtime routes
    #: (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) and the knobs.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    runtime_lora: bool = False
    lora_fail: frozenset[str] = frozenset()
    lora_load_delay: float = 0.0
    #: A pooling model's task when the command line names it (``--pooler-config`` task, else
    #: ``--convert``): only that task's routes are served, as in vLLM (None: every pooling
    #: route, for ``--runner pooling`` alone).
    pooling_task: str | None = None
    #: ``FAKE_ENGINE_WAKE_CORRUPTS``: the sleep levels after whose wake every answer is wrong
    #: (HTTP 200, other tokens and log-probabilities, other pooling numbers).
    wake_corrupts: frozenset[int] = frozenset()

    @property
    def world_size(self) -> int:
        """GPUs one engine needs: tp x pp x pcp, as vLLM's ``ParallelConfig.world_size``."""
        return (
            self.tensor_parallel_size
            * self.pipeline_parallel_size
            * self.prefill_context_parallel_size
        )


def _model_len(text: str) -> int:
    value = text.strip()
    if value.lower() in ("auto", "-1"):
        return 2048
    units = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}
    if value[-1:] in units:
        return int(float(value[:-1]) * units[value[-1]])
    return int(value)


def _human_int(text: str) -> int:
    """vLLM's human-readable sizes: ``k``/``m``/``g`` are powers of 1000, ``K``/``M``/``G``
    of 1024."""
    value = text.strip()
    units = {"k": 1000, "m": 1000**2, "g": 1000**3, "K": 1024, "M": 1024**2, "G": 1024**3}
    if value[-1:] in units:
        return int(float(value[:-1]) * units[value[-1]])
    return int(value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fake_vllm", allow_abbrev=False)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--served-model-name", nargs="+", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--uds", default=None)
    parser.add_argument("--max-model-len", type=_model_len, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--prefill-context-parallel-size", type=int, default=1)
    parser.add_argument(
        "--gpu-memory-utilization", "--device-memory-utilization", type=float, default=0.9
    )
    parser.add_argument("--kv-cache-memory-bytes", type=_human_int, default=None)
    parser.add_argument("--sleep-mode-offload-cudagraph", action=argparse.BooleanOptionalAction)
    parser.add_argument("--api-key", nargs="+", default=None)
    parser.add_argument("--enable-sleep-mode", action=argparse.BooleanOptionalAction)
    parser.add_argument("--runner", default="auto")
    parser.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    parser.add_argument("--convert", default="auto")
    parser.add_argument("--enable-lora", action=argparse.BooleanOptionalAction)
    parser.add_argument("--max-loras", type=int, default=1)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--max-cpu-loras", type=int, default=None)
    parser.add_argument("--pooler-config", default=None)
    return parser


def _normalize_flag(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value


def _env_number(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _env_choice(environ: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    raw = environ.get(name, "").strip()
    if not raw:
        return choices[0]
    if raw not in choices:
        raise ValueError(f"{name}={raw!r} is not one of {', '.join(choices)}")
    return raw


def _env_mb(environ: Mapping[str, str], name: str, default: int) -> int:
    value = _env_int(environ, name)
    if value is None:
        return default
    if value < 0:
        raise ValueError(f"{name}={value} is negative")
    return value


def _segments(environ: Mapping[str, str], weights_mb: int | None) -> tuple[int, ...]:
    """``FAKE_ENGINE_SIM_WEIGHT_SEGMENTS_MB``: whole MiB, comma-separated; () when unset."""
    name = "FAKE_ENGINE_SIM_WEIGHT_SEGMENTS_MB"
    raw = environ.get(name, "").strip()
    if not raw:
        return ()
    try:
        segments = tuple(int(part) for part in raw.split(","))
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a list of whole MiB") from None
    if any(mb <= 0 for mb in segments):
        raise ValueError(f"{name}={raw!r}: every segment must be positive")
    if weights_mb is not None and weights_mb != sum(segments):
        raise ValueError(f"{name}={raw!r} does not sum to FAKE_ENGINE_SIM_WEIGHTS_MB={weights_mb}")
    return segments


def _sim_knobs(environ: Mapping[str, str]) -> SimKnobs | None:
    """The simulated-GPU knobs, or None when ``FAKE_ENGINE_SIM_GPU`` is unset.

    ``FAKE_ENGINE_SIM_ACTIVATION_MB`` is the older name of ``FAKE_ENGINE_SIM_PEAK_MB``."""
    ledger = environ.get("FAKE_ENGINE_SIM_GPU", "").strip()
    if not ledger:
        return None
    if environ.get("FAKE_ENGINE_GPU_MB", "").strip():
        raise ValueError("FAKE_ENGINE_SIM_GPU and FAKE_ENGINE_GPU_MB are mutually exclusive")
    defaults = SimKnobs(ledger)
    rate = _env_number(environ, "FAKE_ENGINE_SIM_RELOAD_MB_S", defaults.reload_mb_s)
    if rate <= 0:
        raise ValueError(f"FAKE_ENGINE_SIM_RELOAD_MB_S={rate} must be positive")
    weights = _env_int(environ, "FAKE_ENGINE_SIM_WEIGHTS_MB")
    segments = _segments(environ, weights)
    peak_name = "FAKE_ENGINE_SIM_PEAK_MB"
    if not environ.get(peak_name, "").strip():
        peak_name = "FAKE_ENGINE_SIM_ACTIVATION_MB"
    return SimKnobs(
        ledger=ledger,
        context_mb=_env_mb(environ, "FAKE_ENGINE_SIM_CONTEXT_MB", defaults.context_mb),
        weights_mb=sum(segments)
        or _env_mb(environ, "FAKE_ENGINE_SIM_WEIGHTS_MB", defaults.weights_mb),
        weight_segments_mb=segments,
        vocab=_env_mb(environ, "FAKE_ENGINE_SIM_VOCAB", defaults.vocab),
        runtime_mb=_env_mb(environ, "FAKE_ENGINE_SIM_RUNTIME_MB", defaults.runtime_mb),
        workspace_mb=_env_mb(environ, "FAKE_ENGINE_SIM_WORKSPACE_MB", defaults.workspace_mb),
        buffers_mb=_env_mb(environ, "FAKE_ENGINE_SIM_BUFFERS_MB", defaults.buffers_mb),
        peak_mb=_env_mb(environ, peak_name, defaults.peak_mb),
        peak_tokens=_env_mb(environ, "FAKE_ENGINE_SIM_PEAK_TOKENS", defaults.peak_tokens),
        graphs_mb=_env_mb(environ, "FAKE_ENGINE_SIM_GRAPHS_MB", defaults.graphs_mb),
        graphs_estimate_mb=_env_int(environ, "FAKE_ENGINE_SIM_GRAPHS_ESTIMATE_MB"),
        profile_s=_env_number(environ, "FAKE_ENGINE_SIM_PROFILE_S", defaults.profile_s),
        after_profile_s=_env_number(
            environ, "FAKE_ENGINE_SIM_AFTER_PROFILE_S", defaults.after_profile_s
        ),
        min_kv_mb=_env_mb(environ, "FAKE_ENGINE_SIM_MIN_KV_MB", defaults.min_kv_mb),
        sleep_s=_env_number(environ, "FAKE_ENGINE_SIM_SLEEP_S", defaults.sleep_s),
        reload_temp_mb=_env_mb(environ, "FAKE_ENGINE_SIM_RELOAD_TEMP_MB", defaults.reload_temp_mb),
        reload_mb_s=rate,
    )


def _asleep_policy(environ: Mapping[str, str]) -> str:
    """Requests to a sleeping engine: ``FAKE_ENGINE_ASLEEP``; unset, they park until the wake,
    as vLLM 0.33 queues them ("All pause modes queue new adds", ``v1/engine/core.py:
    2186``); ``reject`` answers 503 instead."""
    if not environ.get("FAKE_ENGINE_ASLEEP", "").strip():
        return "park"
    return _env_choice(environ, "FAKE_ENGINE_ASLEEP", ASLEEP_POLICIES)


def load_settings(argv: Sequence[str], environ: Mapping[str, str]) -> Settings:
    """Parse a vLLM-style command line (unknown flags ignored) and the FAKE_ENGINE_* knobs."""
    args, _unknown = _parser().parse_known_args([_normalize_flag(a) for a in argv])
    keys = args.api_key or ([environ["VLLM_API_KEY"]] if environ.get("VLLM_API_KEY") else [])
    crash_code = _env_int(environ, "FAKE_ENGINE_CRASH_CODE")
    gpu_mb = _env_int(environ, "FAKE_ENGINE_GPU_MB") or 0
    if gpu_mb < 0:
        raise ValueError(f"FAKE_ENGINE_GPU_MB={gpu_mb} is negative")
    sim = _sim_knobs(environ)
    utilization = args.gpu_memory_utilization
    if sim is not None and not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization={utilization} is not in (0, 1]")
    return Settings(
        model=args.model,
        served_names=tuple(args.served_model_name or [args.model]),
        host=args.host,
        port=args.port,
        uds=args.uds or None,
        max_model_len=args.max_model_len,
        max_num_seqs=max(1, args.max_num_seqs),
        scheduling_policy=args.scheduling_policy,
        tensor_parallel_size=max(1, args.tensor_parallel_size),
        pipeline_parallel_size=max(1, args.pipeline_parallel_size),
        prefill_context_parallel_size=max(1, args.prefill_context_parallel_size),
        gpu_memory_utilization=utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        sleep_mode_offload_cudagraph=bool(args.sleep_mode_offload_cudagraph),
        cuda_visible_devices=environ.get("CUDA_VISIBLE_DEVICES"),
        api_keys=tuple(keys),
        dev_mode=environ.get("VLLM_SERVER_DEV_MODE") == "1",
        enable_sleep_mode=bool(args.enable_sleep_mode),
        pooling=args.runner == "pooling" or args.convert in ("embed", "classify"),
        startup_delay=_env_number(environ, "FAKE_ENGINE_STARTUP_DELAY", 0.0),
        tokens=max(0, int(_env_number(environ, "FAKE_ENGINE_TOKENS", 8))),
        token_delay=_env_number(environ, "FAKE_ENGINE_TOKEN_DELAY", 0.0),
        crash_after=_env_int(environ, "FAKE_ENGINE_CRASH_AFTER"),
        stall_after=_env_int(environ, "FAKE_ENGINE_STALL_AFTER"),
        crash_code=3 if crash_code is None else crash_code,
        exit_code=_env_int(environ, "FAKE_ENGINE_EXIT_CODE"),
        ignore_sigterm=environ.get("FAKE_ENGINE_IGNORE_SIGTERM") == "1",
        spawn_child=environ.get("FAKE_ENGINE_SPAWN_CHILD") == "1",
        port_in_use_once=environ.get("FAKE_ENGINE_PORT_IN_USE_ONCE") or None,
        sleep_delay=_env_number(environ, "FAKE_ENGINE_SLEEP_DELAY", 0.0),
        wake_delay=_env_number(environ, "FAKE_ENGINE_WAKE_DELAY", 0.0),
        asleep=_asleep_policy(environ),
        sleep_fail=environ.get("FAKE_ENGINE_SLEEP_FAIL") == "1",
        wake_fail=environ.get("FAKE_ENGINE_WAKE_FAIL") == "1",
        wake_hang=environ.get("FAKE_ENGINE_WAKE_HANG") == "1",
        wake_lies=environ.get("FAKE_ENGINE_WAKE_LIES") == "1",
        gpu_mb=gpu_mb,
        gpu_device=environ.get("FAKE_ENGINE_GPU_DEVICE", "").strip() or "cuda:0",
        sim=sim,
        enable_lora=bool(args.enable_lora),
        max_loras=max(1, args.max_loras),
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        runtime_lora=environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower()
        in ("1", "true"),
        lora_fail=frozenset(
            n.strip() for n in environ.get("FAKE_ENGINE_LORA_FAIL", "").split(",") if n.strip()
        ),
        lora_load_delay=_env_number(environ, "FAKE_ENGINE_LORA_LOAD_DELAY", 0.0),
        pooling_task=_pooling_task(args),
        wake_corrupts=_wake_corrupts(environ),
    )


def _pooling_task(args: argparse.Namespace) -> str | None:
    """The pooling task the command line names, if any (vLLM: ``pooler_config.task`` wins)."""
    if args.runner == "generate":
        return None
    try:
        pooler = json.loads(args.pooler_config) if args.pooler_config else {}
    except ValueError:
        raise ValueError(f"--pooler-config={args.pooler_config!r} is not JSON") from None
    task = pooler.get("task") if isinstance(pooler, dict) else None
    if task:
        return str(task)
    return str(args.convert) if args.convert in ("embed", "classify") else None


def _wake_corrupts(environ: Mapping[str, str]) -> frozenset[int]:
    """``FAKE_ENGINE_WAKE_CORRUPTS``: ``1``, ``2``, ``1,2`` or ``all`` (every level)."""
    raw = environ.get("FAKE_ENGINE_WAKE_CORRUPTS", "").strip()
    if raw == "all":
        return frozenset(SLEEP_LEVELS)
    levels = {part.strip() for part in raw.split(",") if part.strip()}
    if not levels <= {str(level) for level in SLEEP_LEVELS}:
        raise ValueError(f"FAKE_ENGINE_WAKE_CORRUPTS={raw!r} is not levels (0,1,2) or all")
    return frozenset(int(level) for level in levels)
