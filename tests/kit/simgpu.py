"""The simulated GPU (``fake_vllm.simgpu``) under an in-process proxy: the ledger, configs whose
engines hold memory there, and readings of what they hold."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import psutil
import pytest

from fake_vllm.simgpu import Ledger, nvml_module
from kit.configs import make_config
from kit.fake import FakeEngine
from kit.harness import RunningProxy
from vllm_proxy.config import Config
from vllm_proxy.engines.engine import instance_logs

#: What the simulated engines hold outside their budget (a real H100 context is of this order).
CONTEXT_MB = 512
#: vLLM's startup check, as the simulated engine prints it.
STARTUP_REFUSAL = "less than desired GPU memory utilization"


def sim_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, devices: int = 2, per_process: bool = True
) -> Ledger:
    """Simulated 24000 MiB GPUs; the proxy's NVML import gets the stand-in over them (which lists
    no per-process memory without `per_process`, as in a container)."""
    path = tmp_path / "gpu.json"
    ledger = Ledger.create(
        path, [{"total_mb": 24_000} for _ in range(devices)], per_process=per_process
    )
    monkeypatch.setattr("vllm_proxy.planning.gpu._import_pynvml", lambda: nvml_module(path))
    monkeypatch.setattr(
        "vllm_proxy.planning.hostmem.tree_rss_mb", lambda pid: pinned_rss(ledger, pid)
    )
    # Pinned pages are shared memory to the kernel (RssShmem, Shmem): what corroborates a
    # measured pin.
    monkeypatch.setattr("vllm_proxy.planning.hostmem.shmem_mb", lambda: ledger.pinned_mb())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return ledger


def pinned_rss(ledger: Ledger, pid: int | None) -> int | None:
    """What the proxy reads as an engine's host memory on the simulated GPU: the host memory
    its process tree pinned or copied in the ledger (a real engine's pinned blocks and pageable
    copies are resident in it)."""
    if pid is None:
        return None
    try:
        root = psutil.Process(pid)
        pids = {root.pid, *(c.pid for c in root.children(recursive=True))}
    except psutil.Error:
        return None
    return sum(ledger.host_mb(p) for p in pids)


def sim_config(
    tmp_path: Path,
    ledger: Ledger,
    models: dict[str, dict[str, Any]],
    devices: list[int] | None = None,
    queue_timeout_s: float = 15,
    **gpu: Any,
) -> Config:
    """Models whose fake engines hold memory in `ledger` (a short profiling window unless their
    own env says otherwise), the proxy reading it through NVML on `devices` (GPU 0)."""
    sim = FakeEngine(sim_gpu=ledger.path, sim_context_mb=CONTEXT_MB, sim_profile_s=0.05).env()
    for model in models.values():
        model["env"] = {**sim, **model.get("env", {})}
    return make_config(
        tmp_path,
        models,
        server={"admin_open": True},
        engine={"health_interval_s": 0},
        gpu={"monitor": "nvml", "poll_interval_s": 0.1, "devices": devices or [0], **gpu},
        admission={"queue_timeout_s": queue_timeout_s},
    )


async def chat(proxy: RunningProxy, model: str) -> tuple[int, str]:
    """A two-token chat: its status and body."""
    resp = await proxy.chat(model, max_tokens=2)
    return resp.status, await resp.text()


def utils_started(proxy: RunningProxy, name: str) -> list[float]:
    """The --gpu-memory-utilization of every engine the model was started with, in order."""
    out = []
    logs = instance_logs(proxy.model(name).spec)
    for n in sorted(logs):
        for line in logs[n].read_text().splitlines():
            if "[vllm-proxy] starting engine" in line:
                out.append(float(re.findall(r"--gpu-memory-utilization (\S+)", line)[0]))
    return out


def engine_pids(ledger: Ledger, device: int = 0) -> set[int]:
    """The processes holding memory on `device`, this test process (an outsider) left out."""
    return {pid for r in ledger.read() if r.id == device for pid in r.processes} - {os.getpid()}


def profiling(ledger: Ledger, skip: set[int], device: int = 0) -> bool:
    """A starting engine (not in `skip`) has loaded its weights but not yet its KV cache."""
    for pid in engine_pids(ledger, device) - skip:
        tags = ledger.tags(pid, device)
        if "weights" in tags and "kv_cache" not in tags:
            return True
    return False


def outsider(ledger: Ledger, device: int, mb: int) -> None:
    """Another program on the GPU (this test process) holding `mb`."""
    ledger.allocate(os.getpid(), device, mb, "outsider")


def tiny_checkpoint(tmp_path: Path) -> str:
    """A local config.json for the estimate: a small budget (weights from params_b)."""
    path = tmp_path / "ckpt"
    path.mkdir()
    config: dict[str, Any] = {"num_hidden_layers": 2, "num_attention_heads": 4}
    config |= {"num_key_value_heads": 4}
    config |= {"hidden_size": 256, "max_position_embeddings": 1024, "torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)
