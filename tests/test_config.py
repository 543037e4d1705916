"""Unit tests: config schema, defaults, errors with key paths, engine command building."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vllm_proxy.config import ModelConfig, default_engine_command, load_config, parse_config
from vllm_proxy.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_example_config_loads_and_documents_every_default() -> None:
    cfg = load_config(ROOT / "config.example.yaml")
    raw = yaml.safe_load((ROOT / "config.example.yaml").read_text())
    spec = cfg.specs()["qwen3-vl-2b-vad"]
    assert spec.aliases == ("vad",)
    assert spec.memory_mb == 9000
    assert spec.idle_timeout_s == 1800
    assert spec.pinned is False and spec.devices is None and spec.params_b is None
    documented = set(raw["models"]["qwen3-vl-2b-vad"]) | set(raw["engine"])
    assert documented >= set(ModelConfig.model_fields), "every model key is documented"
    # The example states every default: its server/engine sections equal the built-in defaults.

    defaults = parse_config({}).model_dump()
    assert raw["server"] == defaults["server"]
    assert raw["admission"] == defaults["admission"]
    assert raw["gpu"] == defaults["gpu"]
    assert {k: (list(v) if isinstance(v, tuple) else v) for k, v in raw["engine"].items()} == {
        k: (list(v) if isinstance(v, tuple) else v) for k, v in defaults["engine"].items()
    }


def test_args_map_to_vllm_flags() -> None:
    cfg = parse_config(
        {
            "models": {
                "q": {
                    "model": "Qwen/Qwen3-0.6B",
                    "args": {
                        "max_model_len": 8192,
                        "gpu_memory_utilization": 0.3,
                        "enforce_eager": True,
                        "trust_remote_code": False,
                        "allowed_local_media_path": None,
                        "middleware": ["a", "b"],
                        "hf_overrides": {"x": 1},
                    },
                    "extra_args": ["--some-new-flag", "v"],
                }
            }
        }
    )
    argv = cfg.specs()["q"].engine_argv(8123)
    assert argv[:3] == default_engine_command()
    assert argv[3:] == [
        "--model", "Qwen/Qwen3-0.6B", "--served-model-name", "q",
        "--host", "127.0.0.1", "--port", "8123",
        "--max-model-len", "8192", "--gpu-memory-utilization", "0.3", "--enforce-eager",
        "--middleware", "a", "b", "--hf-overrides", '{"x":1}',
        "--some-new-flag", "v",
    ]  # fmt: skip


def test_engine_defaults_merge_under_model_values() -> None:
    cfg = parse_config(
        {
            "engine": {
                "command": ["vllm-x"],
                "env": {"A": "1", "B": "1"},
                "args": {"enforce_eager": True, "dtype": "half"},
                "idle_timeout_s": 5,
            },
            "models": {"m": {"model": "p", "env": {"B": "2"}, "args": {"dtype": "bfloat16"}}},
        }
    )
    spec = cfg.specs()["m"]
    assert spec.command == ("vllm-x",)
    assert dict(spec.env) == {"A": "1", "B": "2"}
    assert dict(spec.args) == {"enforce_eager": True, "dtype": "bfloat16"}
    assert spec.idle_timeout_s == 5
    env = spec.engine_env()
    assert env["B"] == "2" and "PATH" in env


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"models": {"q": {"model": "x", "args": {"port": 1}}}}, "models.q.args.port: reserved"),
        ({"models": {"q": {"model": "x", "args": {"host": "h"}}}}, "models.q.args.host: reserved"),
        (
            {"models": {"q": {"model": "x", "args": {"served-model-name": "h"}}}},
            "models.q.args.served-model-name: reserved",
        ),
        ({"models": {"q": {"model": "x", "extra_args": ["--port=9"]}}}, "models.q.extra_args"),
        ({"models": {"q": {}}}, "models.q.model: required key is missing"),
        ({"models": {"q": {"model": "x", "colour": 1}}}, "models.q.colour: unknown key"),
        ({"server": {"port": "http"}}, "server.port:"),
        ({"serverr": {}}, "serverr: unknown key"),
        ({"engine": {"port_range": [9000, 8000]}}, "engine.port_range"),
        (
            {"models": {"a": {"model": "x", "aliases": ["b"]}, "b": {"model": "y"}}},
            "'b' already used",
        ),
        ([1, 2], "top level must be a mapping"),
    ],
)
def test_bad_config_names_the_key_path(data: object, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert expected in str(err.value)


def test_cli_exits_2_on_bad_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  q:\n    model: x\n    args: {port: 8000}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_proxy", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "models.q.args.port: reserved" in proc.stderr


def test_cli_exits_2_on_unreadable_or_invalid_yaml(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [unclosed\n")
    for path in (bad, tmp_path / "missing.yaml"):
        proc = subprocess.run(
            [sys.executable, "-m", "vllm_proxy", "--config", str(path), "--check"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc.stderr
        assert str(path) in proc.stderr


def test_check_exits_2_naming_a_model_that_cannot_fit(tmp_path: Path) -> None:
    """``--check`` applies the same memory rules as a start: a model larger than every device it
    may use is named, with exit code 2; one that fits passes."""
    data = {
        "gpu": {"monitor": "static", "devices": [{"id": 0, "memory_mb": 1000}]},
        "models": {
            "small": {"model": "x", "memory_mb": 500},
            "huge": {"model": "y", "memory_mb": 5000},
        },
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    argv = [sys.executable, "-m", "vllm_proxy", "--config", str(path), "--check"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout
    assert "models.huge" in proc.stderr and "5000 MiB" in proc.stderr
    del data["models"]["huge"]  # type: ignore[attr-defined]
    path.write_text(yaml.safe_dump(data))
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "every model fits" in proc.stdout
