"""Real vLLM 0.33 on one NVIDIA GPU: the memory figures the proxy plans with, measured.

For an operator's GPU host with vLLM 0.33.0 installed (with its torch, transformers,
safetensors, tokenizers, aiohttp and nvidia-ml-py), run from the checkout; no network is
needed. It generates a model with random weights on the GPU (a Llama of 1.75 B parameters,
vocabulary 131072, 3341 MiB in bfloat16, with the tokenizer of ``tiny_llama``), sizes its
``--gpu-memory-utilization`` with the proxy's own estimate (`footprint_for_spec`,
`utilization_for`), serves it with ``python -m vllm.entrypoints.cli.main serve`` and measures:

0. the device at rest (nvidia-smi, NVML, and CUDA's total as torch sees it);
1. the start: what vLLM's profiling logs (non-KV memory, torch peak, KV cache, CUDA graphs)
   and what the engine holds when ready, per process (NVML);
2. the transient peak: what a burst of 1024 sampled requests and one long prompt add;
3. level-1 sleep: what stays on the device, the pinned host memory it takes and keeps after the
   wake, what the engine holds right after a wake and after the next burst, a second sleep;
4. level-2 sleep and its three-step wake (``wake_up?tags=weights``, ``collective_rpc
   reload_weights``, ``wake_up?tags=kv_cache``), and that greedy output is unchanged.

``results.json`` in ``--out`` is rewritten after every step, so a run cut short still leaves
what it measured. About 6 to 8 minutes on an H100 or H200 (the first start compiles)::

    python scripts/gpu_check_vllm.py --out gpu-check-vllm

Without a GPU, ``--prepare-only --small --device cpu --total-mb 81559`` generates a small model
and prints the utilisation the proxy would give it (a check of the script itself).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MIB = 1024 * 1024
GIB = 1024 * MIB
MAX_MODEL_LEN = 4096
SERVE_TIMEOUT_S = 240.0
ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_LOGGING_LEVEL": "DEBUG",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
#: vLLM 0.33's log lines and what to keep of each (GiB unless named).
LOG_LINES = {
    "profiling": re.compile(
        r"Memory profiling takes ([\d.]+) seconds\. Total non KV cache memory: ([\d.]+)GiB; "
        r"torch peak memory increase: ([\d.]+)GiB; total consumed \(from mem_get_info\): "
        r"([\d.]+)GiB; weights memory: ([\d.]+)GiB"
    ),
    "available_kv_gib": re.compile(r"Available KV cache memory: ([\d.]+) GiB"),
    "kv_tokens": re.compile(r"KV cache size: ([\d,]+) tokens"),
    "graphs": re.compile(r"Graph capturing finished in (\d+) secs, took ([\d.]+) GiB"),
    "loading": re.compile(r"Model loading took ([\d.]+) GiB memory and ([\d.]+) seconds"),
    "cumem_sleep": re.compile(
        r"CuMemAllocator: sleep freed ([\d.]+) GiB memory in total, of which ([\d.]+) GiB is "
        r"backed up in CPU"
    ),
    "sleep_freed": re.compile(
        r"Sleep mode freed ([\d.]+) GiB memory, ([\d.]+) GiB memory is still in use"
    ),
}


# -- the model ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A Llama's shape: the check's model, or a small one to check the script on a CPU."""

    hidden: int = 2048
    intermediate: int = 5504
    layers: int = 24
    heads: int = 16
    kv_heads: int = 16
    vocab: int = 131072
    max_positions: int = MAX_MODEL_LEN


FULL = Shape()
SMALL = Shape(hidden=256, intermediate=688, layers=2, heads=4, kv_heads=4, vocab=4096)


def tensor_shapes(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint (untied embeddings), as vLLM's Llama loader names them."""
    h, i, head_dim = shape.hidden, shape.intermediate, shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (shape.vocab, h))]
    for n in range(shape.layers):
        p = f"model.layers.{n}."
        out += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    return [*out, ("model.norm.weight", (h,)), ("lm_head.weight", (shape.vocab, h))]


def parameters(shape: Shape) -> int:
    total = 0
    for _, dims in tensor_shapes(shape):
        count = 1
        for d in dims:
            count *= d
        total += count
    return total


def model_config(shape: Shape, token_ids: dict[str, int]) -> dict[str, Any]:
    """``config.json``: the vocabulary is larger than the tokenizer's, which vLLM allows."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.hidden // shape.heads,
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.max_positions,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "attention_bias": False,
        "mlp_bias": False,
        **token_ids,
    }


def write_model(shape: Shape, out: Path, device: str, seed: int = 0) -> dict[str, Any]:
    """The tokenizer of ``tiny_llama``, ``config.json`` and random bfloat16 weights in ``out``."""
    import torch
    from safetensors.torch import save_file

    import tiny_llama

    started = time.monotonic()
    tok = out.parent / f"{out.name}-tokenizer"
    tiny_llama.ensure_tiny_model(tok)
    out.mkdir(parents=True, exist_ok=True)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        shutil.copy(tok / name, out / name)
    tiny = json.loads((tok / "config.json").read_text())
    ids = {k: tiny[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in tiny}
    (out / "config.json").write_text(json.dumps(model_config(shape, ids), indent=2) + "\n")
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, dims in tensor_shapes(shape):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(dims, dtype=torch.bfloat16)
        else:
            drawn = torch.randn(dims, generator=generator, device=device, dtype=torch.float32)
            tensors[name] = (drawn * 0.02).to(torch.bfloat16).cpu()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    size = (out / "model.safetensors").stat().st_size
    return {
        "path": str(out),
        "parameters": parameters(shape),
        "weights_mib": round(size / MIB, 1),
        "shape": asdict(shape),
        "seconds": round(time.monotonic() - started, 1),
    }


def planned(model_dir: Path, total_mb: int, boost_mb: int = 0) -> dict[str, Any]:
    """What the proxy plans for the model on a device of ``total_mb`` MiB (NVML's total)."""
    from vllm_proxy.config import parse_config
    from vllm_proxy.planning.footprint import footprint_for_spec, utilization_for

    data = {"models": {"m": {"model": str(model_dir), "args": {"max_model_len": MAX_MODEL_LEN}}}}
    spec = parse_config(data).specs()["m"]
    fp = footprint_for_spec(spec, total_mb)
    budget = fp.budget_mb + boost_mb
    return {
        "total_mb": total_mb,
        "budget_mb": budget,
        "overhead_mb": fp.overhead_mb,
        "footprint_mb": budget + fp.overhead_mb,
        "detail": fp.detail,
        "util": utilization_for(budget, total_mb),
    }


# -- readings -----------------------------------------------------------------------------------


def run(command: list[str], timeout: float = 60) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    return (done.stdout + done.stderr).strip()


def nvml(pids: set[int] | None = None) -> dict[str, Any]:
    """Device 0: used MiB, and the MiB of ``pids`` (None where NVML has no per-process data)."""
    from vllm_proxy.planning.gpu import NvmlMonitor

    monitor = NvmlMonitor(devices=[0])
    try:
        snap = monitor.read()[0]
    finally:
        monitor.close()
    mine = [mb for pid, mb in snap.processes.items() if pids and pid in pids]
    return {
        "total_mb": snap.total_mb,
        "used_mb": snap.used_mb,
        "engine_mb": sum(mine) if any(mine) else None,
    }


def host(pids: set[int]) -> dict[str, Any]:
    """Resident memory of the engine's processes, the cgroup's usage and MemAvailable (MiB)."""
    import psutil

    rss = 0
    for pid in pids:
        try:
            rss += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    out: dict[str, Any] = {"rss_mb": round(rss / MIB, 1)}
    try:
        out["cgroup_mb"] = round(int(Path("/sys/fs/cgroup/memory.current").read_text()) / MIB, 1)
    except (OSError, ValueError):
        out["cgroup_mb"] = None
    meminfo = Path("/proc/meminfo").read_text()
    found = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.M)
    out["mem_available_mb"] = round(int(found.group(1)) / 1024, 1) if found else None
    return out


def log_figures(text: str) -> dict[str, Any]:
    """The last of each of vLLM's memory log lines in ``text``."""
    out: dict[str, Any] = {}
    for key, pattern in LOG_LINES.items():
        found = pattern.findall(text)
        if found:
            last = found[-1]
            out[key] = [
                float(v.replace(",", "")) for v in (last if isinstance(last, tuple) else (last,))
            ]
    return out


# -- the engine ---------------------------------------------------------------------------------


class Engine:
    """One ``vllm serve`` in its own process group, its log in a file."""

    def __init__(
        self, model: Path, util: float, port: int, log: Path, seqs: int, tokens: int
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log
        command = [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
            "--served-model-name", "m", "--enable-sleep-mode",
            "--gpu-memory-utilization", f"{util}", "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", str(seqs), "--max-num-batched-tokens", str(tokens),
            "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
        self.command = command
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                command, env={**os.environ, **ENV}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def log(self, since: int = 0) -> str:
        return self.log_path.read_bytes()[since:].decode(errors="replace")

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def pids(self) -> set[int]:
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            return {root.pid, *(c.pid for c in root.children(recursive=True))}
        except psutil.Error:
            return set()

    def wait_healthy(self, timeout: float = SERVE_TIMEOUT_S) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise TimeoutError(f"vllm serve not healthy after {timeout:.0f} s")

    def post(self, path: str, body: Any = None, timeout: float = 300) -> tuple[float, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method="POST")
        request.add_header("Content-Type", "application/json")
        started = time.monotonic()
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            raw = resp.read()
        took = round(time.monotonic() - started, 3)
        try:
            return took, json.loads(raw) if raw else None
        except ValueError:
            return took, raw.decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


def completion(prompt: str | list[int], max_tokens: int, **sampling: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, **sampling}


async def burst(url: str, count: int = 1024, long_prompt: int = 3500) -> dict[str, Any]:
    """``count`` sampled one-token requests and one long prompt, all at once."""
    import aiohttp

    sampled = completion("the model says hello to the", 1, temperature=0.7, top_p=0.9, top_k=50)
    long = completion([5] * long_prompt, 1, temperature=0.0)
    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=count + 8)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def one(body: dict[str, Any]) -> int:
            async with session.post(url + "/v1/completions", json=body) as resp:
                await resp.read()
                return resp.status

        started = time.monotonic()
        statuses = await asyncio.gather(*[one(sampled) for _ in range(count)], one(long))
    failed = sum(1 for s in statuses if s != 200)
    return {"requests": len(statuses), "failed": failed, "seconds": time.monotonic() - started}


def greedy_ids(engine: Engine) -> list[int] | str:
    body = completion("one two three four", 16, temperature=0.0, return_token_ids=True)
    _, answer = engine.post("/v1/completions", body)
    choice = answer["choices"][0]
    return choice.get("token_ids") or choice.get("text", "")


def _get(data: dict[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def _minus(a: Any, b: Any) -> Any:
    return None if a is None or b is None else round(a - b, 1)


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """The figures docs/gpu.md names, from the steps' results (None where a step is missing).
    Device figures are NVML per process (MiB); host figures are the engine tree's RSS and the
    drop in MemAvailable (MiB), since pinned memory shows in one or the other by driver."""
    engine = ("engine_mb",)
    l1, l2 = results.get("level1") or {}, results.get("level2") or {}
    first = l1.get("first") or {}
    sleep2 = l2.get("sleep") or {}
    profiling = _get(results, "start", "log", "profiling")
    return {
        "P_ready": _get(results, "start", "P_ready", *engine),
        "overhead": _get(results, "start", "overhead_mb"),
        "available_kv_gib": (_get(results, "start", "log", "available_kv_gib") or [None])[0],
        "kv_tokens": (_get(results, "start", "log", "kv_tokens") or [None])[0],
        "torch_peak_gib": profiling[2] if profiling else None,
        "P_full": _get(results, "peak", "P_full", *engine),
        "P_woken": _get(l1, "P_woken", *engine),
        "P_full2": _get(l1, "P_full2", *engine),
        "R1": _get(l1, "R1", *engine),
        "H1_rss": l1.get("H1_mb"),
        "H1_mem_available": _minus(
            _get(first, "awake", "mem_available_mb"), _get(first, "asleep", "mem_available_mb")
        ),
        "H1w_rss": l1.get("H1w_mb"),
        "H1b_rss": l1.get("H1b_mb"),
        "wake_l1_s": _get(l1, "P_woken", "seconds"),
        "R2": _get(l2, "R2", *engine),
        "H2_rss": l2.get("host_increase_mb"),
        "H2_mem_available": _minus(
            _get(sleep2, "awake", "mem_available_mb"), _get(sleep2, "asleep", "mem_available_mb")
        ),
        "W": _minus(_get(l2, "after_weights", *engine), _get(l2, "R2", *engine)),
        "T": _minus(_get(l2, "after_reload", *engine), _get(l2, "after_weights", *engine)),
        "P_l2": _get(l2, "P_l2", *engine),
        "wake_l2_s": [_get(l2, k, "seconds") for k in ("after_weights", "after_reload", "P_l2")],
        "greedy_same": l2.get("greedy_same"),
    }


# -- the steps ----------------------------------------------------------------------------------


class Check:
    """The steps, each writing ``results.json``; an engine left running is stopped at the end."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.work: Path = args.work
        self.results: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        }
        self.engine: Engine | None = None

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=2, default=str) + "\n")
        tmp.replace(self.out / "results.json")

    def step(self, name: str, body: Callable[[], dict[str, Any]]) -> bool:
        started = time.monotonic()
        print(f"gpu-check-vllm: {name} ...", flush=True)
        try:
            self.results[name] = body()
            ok = True
        except Exception as exc:
            self.results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            ok = False
        self.results[name]["step_seconds"] = round(time.monotonic() - started, 1)
        self.save()
        print(f"gpu-check-vllm: {name}: {json.dumps(self.results[name], default=str)}", flush=True)
        return ok

    def reading(self, **more: Any) -> dict[str, Any]:
        assert self.engine is not None
        pids = self.engine.pids()
        return {**nvml(pids), **host(pids), **more}

    def baseline(self) -> dict[str, Any]:
        query = "name,memory.total,memory.used,memory.reserved"
        smi = run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"])
        if "Field" in smi or "not a valid" in smi:
            smi = run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used", "--format=csv"])
        probe = "import torch; f, t = torch.cuda.mem_get_info(); print(f, t, torch.__version__)"
        free, total, version = run([sys.executable, "-c", probe], timeout=120).split()[-3:]
        device = nvml()
        return {
            "nvidia_smi": smi,
            "nvml": device,
            "cuda_free_mb": int(free) // MIB,
            "cuda_total_mb": int(total) // MIB,
            "nvml_minus_cuda_total_mb": device["total_mb"] - int(total) // MIB,
            "torch": version,
            "vllm": run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], 120),
        }

    def start(self) -> dict[str, Any]:
        from vllm_proxy.planning.memory import KV_BOOST_MIN_MB, KV_SHORT_MARKERS

        model = self.work / "M"
        made = write_model(FULL, model, "cuda")
        total = self.results["baseline"]["nvml"]["total_mb"]
        plan = planned(model, total)
        out: dict[str, Any] = {"model": made, "planned": plan, "attempts": []}
        for attempt in range(2):
            log = self.out / f"serve-{attempt}.log"
            seqs = int(plan["detail"]["max_num_seqs"])  # as the proxy passes them
            tokens = int(plan["detail"]["activation_tokens"])
            self.engine = Engine(model, plan["util"], self.args.port, log, seqs, tokens)
            try:
                ready_s = self.engine.wait_healthy()
            except (RuntimeError, TimeoutError) as exc:
                text = self.engine.log()
                self.engine.stop()
                short = any(marker in text for marker in KV_SHORT_MARKERS)
                out["attempts"].append(
                    {"util": plan["util"], "failed": str(exc), "kv_short": short}
                )
                if not short or attempt:
                    raise
                boost = max(plan["budget_mb"] // 4, KV_BOOST_MIN_MB)
                plan = planned(model, total, boost_mb=boost)
                out["planned_boosted"] = plan
                continue
            # vLLM's budget: ceil(util x CUDA's total), outside it the overhead.
            budget_mb = math.ceil(plan["util"] * self.results["baseline"]["cuda_total_mb"])
            ready = self.reading(seconds=round(ready_s, 1))
            out["attempts"].append({"util": plan["util"], "ready_s": round(ready_s, 1)})
            out["log"] = log_figures(self.engine.log())
            out["P_ready"] = ready
            if ready["engine_mb"] is not None:
                out["overhead_mb"] = ready["engine_mb"] - budget_mb
            return out
        raise RuntimeError("no start")

    def peak(self) -> dict[str, Any]:
        assert self.engine is not None
        done = asyncio.run(burst(self.engine.url))
        return {"burst": done, "P_full": self.reading()}

    def sleep_and_read(self, level: int) -> dict[str, Any]:
        assert self.engine is not None
        since = self.engine.log_size()
        awake = self.reading()
        slept, _ = self.engine.post(f"/sleep?level={level}")
        asleep = self.reading(seconds=slept)
        figures = log_figures(self.engine.log(since))
        return {"awake": awake, "asleep": asleep, "log": figures}

    def level1(self) -> dict[str, Any]:
        assert self.engine is not None
        first = self.sleep_and_read(1)
        woke, _ = self.engine.post("/wake_up")
        self.engine.post("/v1/completions", completion("hello", 1))
        woken = self.reading(seconds=woke)
        full2 = asyncio.run(burst(self.engine.url))
        after_burst = self.reading()
        again = self.sleep_and_read(1)
        woke2, _ = self.engine.post("/wake_up")
        rss0 = first["awake"]["rss_mb"]
        return {
            "first": first,
            "R1": first["asleep"],
            "H1_mb": first["asleep"]["rss_mb"] - rss0,
            "P_woken": woken,
            "H1w_mb": woken["rss_mb"] - rss0,
            "burst_after_wake": full2,
            "P_full2": after_burst,
            "second": again,
            "H1b_mb": again["asleep"]["rss_mb"] - first["asleep"]["rss_mb"],
            "second_wake_s": woke2,
        }

    def level2(self) -> dict[str, Any]:
        assert self.engine is not None
        before = greedy_ids(self.engine)
        slept = self.sleep_and_read(2)
        took_w, _ = self.engine.post("/wake_up?tags=weights")
        weights = self.reading(seconds=took_w)
        took_r, _ = self.engine.post("/collective_rpc", {"method": "reload_weights"})
        reloaded = self.reading(seconds=took_r)
        took_kv, _ = self.engine.post("/wake_up?tags=kv_cache")
        awake = self.reading(seconds=took_kv)
        after = greedy_ids(self.engine)
        return {
            "sleep": slept,
            "R2": slept["asleep"],
            "host_increase_mb": slept["asleep"]["rss_mb"] - slept["awake"]["rss_mb"],
            "after_weights": weights,
            "after_reload": reloaded,
            "P_l2": awake,
            "greedy_before": before,
            "greedy_after": after,
            "greedy_same": before == after,
        }

    def run(self) -> int:
        steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("baseline", self.baseline),
            ("start", self.start),
            ("peak", self.peak),
            ("level1", self.level1),
            ("level2", self.level2),
        ]
        try:
            for name, body in steps:
                if not self.step(name, body):
                    return 1
            return 0
        finally:
            if self.engine is not None:
                self.engine.stop()
            self.results["summary"] = summarize(self.results)
            self.save()
            print(f"gpu-check-vllm: summary: {json.dumps(self.results['summary'])}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-check-vllm"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-check-vllm"))
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--prepare-only", action="store_true", help="the model and util only")
    parser.add_argument("--small", action="store_true", help="a small model (with --prepare-only)")
    parser.add_argument("--device", default="cuda", help="where weights are drawn (cpu: slow)")
    parser.add_argument("--total-mb", type=int, default=None, help="device total, without NVML")
    args = parser.parse_args(argv)
    if args.prepare_only:
        made = write_model(SMALL if args.small else FULL, args.work / "M", args.device)
        total = args.total_mb or nvml()["total_mb"]
        print(json.dumps({"model": made, "planned": planned(args.work / "M", total)}, indent=2))
        return 0
    return Check(args).run()


if __name__ == "__main__":
    sys.exit(main())
