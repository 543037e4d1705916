"""Config builders: the shapes tests start proxies with, as the YAML file would hold them."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from vllm_proxy.config import Config, parse_config

#: The engine command that runs the fake engine.
FAKE_ENGINE = [sys.executable, "-m", "fake_vllm"]
#: A sleep policy that puts an idle engine to sleep soon.
SLEEPY = {"level": 1, "after_idle_s": 0.3}


def static_gpu(budget_mb: int | Mapping[int, int]) -> dict[str, Any]:
    """The ``gpu`` section of a static budget: one device of `budget_mb`, or {id: MiB}."""
    sizes = budget_mb if isinstance(budget_mb, Mapping) else {0: budget_mb}
    return {"monitor": "static", "devices": [{"id": i, "memory_mb": mb} for i, mb in sizes.items()]}


def config_data(
    tmp_path: Path,
    models: dict[str, dict[str, Any]] | None = None,
    server: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    *,
    budget_mb: int | Mapping[int, int] | None = None,
    admission: dict[str, Any] | None = None,
    gpu: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A config file's contents that run the fake engine with short timeouts and a private state
    dir; `budget_mb` adds a static GPU budget, `gpu` and `admission` their sections' keys."""
    data: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": 0, "state_dir": str(tmp_path / "state")},
        "engine": {
            "command": FAKE_ENGINE,
            "startup_timeout_s": 20,
            "stop_timeout_s": 5,
            "idle_timeout_s": 0,
            "port_range": [20000, 29999],
        },
        "models": models if models is not None else {"m1": {"model": "fake/m1"}},
    }
    data["server"].update(server or {})
    data["engine"].update(engine or {})
    if budget_mb is not None or gpu:
        data["gpu"] = {**(static_gpu(budget_mb) if budget_mb is not None else {}), **(gpu or {})}
    if admission:
        data["admission"] = admission
    return data


def make_config(
    tmp_path: Path,
    models: dict[str, dict[str, Any]] | None = None,
    server: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    **sections: Any,
) -> Config:
    """`config_data`, parsed."""
    return parse_config(config_data(tmp_path, models, server, engine, **sections))


def write_config(path: Path, data: dict[str, Any]) -> Path:
    """`data` as a YAML config file at `path`."""
    path.write_text(yaml.safe_dump(data))
    return path


def sleepy(sleep: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A model with a sleep policy (`SLEEPY` unless given) and `extra` keys."""
    return {"model": "x", "sleep": dict(sleep or SLEEPY), **extra}


def sleep_config(
    tmp_path: Path,
    models: dict[str, dict[str, Any]],
    budget_mb: int | None = None,
    queue_timeout_s: float | None = None,
    sleep_memory_mb: int | None = None,
    **engine: Any,
) -> Config:
    """The sleep tier's shape: admin API open, no health probes (the test drives every change),
    optionally a static budget of `budget_mb`, the admission queue's timeout and, for every
    model with a sleep policy, the memory it is planned to keep asleep (``sleep.memory_mb``)."""
    admission = {"queue_timeout_s": queue_timeout_s} if queue_timeout_s is not None else None
    if sleep_memory_mb is not None:
        models = {
            name: {**m, "sleep": {"memory_mb": sleep_memory_mb, **m["sleep"]}}
            if isinstance(m.get("sleep"), dict)
            else m
            for name, m in models.items()
        }
    return make_config(
        tmp_path,
        models,
        server={"admin_open": True},
        engine={"health_interval_s": 0, **engine},
        budget_mb=budget_mb,
        admission=admission,
    )


def replicas_config(
    tmp_path: Path, model: dict[str, Any], devices: int = 3, **engine: Any
) -> Config:
    """Model ``m`` of 600 MiB (and `model`'s keys) on `devices` static GPUs of 1000 MiB each,
    one replica per GPU; admin API open."""
    return make_config(
        tmp_path,
        {"m": {"model": "x", "memory_mb": 600, **model}},
        server={"admin_open": True},
        engine=engine,
        budget_mb=dict.fromkeys(range(devices), 1000),
    )


def budget_config(
    tmp_path: Path,
    models: dict[str, dict[str, Any]],
    budget_mb: int | Mapping[int, int] = 1000,
    **admission: Any,
) -> Config:
    """`models` on a static GPU budget (one 1000 MiB device unless given), with `admission`."""
    return make_config(tmp_path, models, budget_mb=budget_mb, admission=admission)
