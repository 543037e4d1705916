"""LoRA adapters through the proxy: write an adapter folder, complete with it, read the fake
engine's per-adapter series (loads, uses), and a clean OpenAI-shaped error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_proxy.engines.instance import Instance

from . import RunningProxy, make_config
from .metrics import engine_samples


def adapter(root: Path, name: str, rank: int = 8, size: int = 0) -> Path:
    """A PEFT-style adapter folder (only what the proxy and the fake read)."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
    (path / "adapter_model.safetensors").write_bytes(b"\0" * size)
    return path


async def complete(proxy: RunningProxy, model: str, **extra: Any) -> tuple[int, Any]:
    body = {"model": model, "prompt": "hi", "max_tokens": 2, **extra}
    async with proxy.http.post(proxy.url + "/v1/completions", json=body) as resp:
        if extra.get("stream"):
            return resp.status, await resp.text()
        return resp.status, await resp.json()


def text(data: Any) -> str:
    return str(data["choices"][0]["text"])


async def engine_series(proxy: RunningProxy, inst: Instance, name: str) -> dict[str, float]:
    """A fake-only series of the instance's engine, by ``lora_name``."""
    samples = await engine_samples(proxy, inst)
    return {s.labels["lora_name"]: s.value for s in samples.find(name)}


async def loads(proxy: RunningProxy, inst: Instance) -> dict[str, float]:
    return await engine_series(proxy, inst, "fake_engine:lora_loads_total")


#: What marks an engine's log line or command line (the fake prints vLLM's shapes).
LOG_MARKS = ("[fake_vllm.py]", "APIServer pid", "EngineCore", "RuntimeError", "Traceback",
             "--enable-lora", "--port", "--max-lora-rank", "non-default args")  # fmt: skip


def assert_clean_error(status: int, body: Any, expected: int, code: str | None = None) -> None:
    """An OpenAI-shaped error of the expected status, with no engine log or command line."""
    assert status == expected, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    if code is not None:
        assert err["code"] == code, err
    for mark in LOG_MARKS:
        assert mark not in err["message"], err


def lora_config(
    tmp_path: Path, models: dict[str, dict[str, Any]], queue_timeout_s: float = 5, **server: Any
) -> Any:
    cfg = make_config(
        tmp_path, models, server={"admin_open": True, **server}, engine={"health_interval_s": 0}
    )
    return cfg.model_copy(
        update={"admission": cfg.admission.model_copy(update={"queue_timeout_s": queue_timeout_s})}
    )
