"""A ready-to-call proxy on a machine without a GPU: ``make demo`` / ``make demo-fake``.

Generates two tiny random-weight Llama models (``tiny_llama``), writes a config that serves them
through the CPU build of vLLM, and runs the proxy. With ``--fake`` no model is generated: the fake
engine (``fake_vllm``) serves both names, and neither torch nor vLLM is needed. The engines start
on the first request for each model; watch them in the proxy's log.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from tiny_llama import ensure_tiny_model

MODELS = ("tiny-chat", "tiny-story")

#: Flags that make vLLM's CPU build serve the tiny models (see docs/real-vllm-cpu.md).
CPU_ARGS: dict[str, Any] = {
    "max_model_len": 256,
    "enforce_eager": True,  # no torch.compile: starts in ~20 s instead of ~40 s
    "kv_cache_memory_bytes": "64M",  # skips the memory-fraction check and profiling pass
    "disable_log_stats": True,
}
CPU_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # two engines would otherwise share core 0
}

SNIPPET = """
vllm-proxy demo: {n} models on http://127.0.0.1:{port}/v1  ({kind})
  curl http://127.0.0.1:{port}/v1/models
  python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="http://127.0.0.1:{port}/v1", api_key="unused")
r = client.chat.completions.create(model="{first}", messages=[{{"role": "user", "content": "hi"}}])
print(r.choices[0].message.content)
PY
The first request for each model starts its engine ({cold}); later ones are served hot.
Console: http://127.0.0.1:{port}/   (live state, start/sleep/wake/stop, engine logs, recent
  requests, memory over time, a playground; open on loopback: no key asked)
  the admin API: curl http://127.0.0.1:{port}/admin/models
  from a shell:  VLLM_PROXY_URL=http://127.0.0.1:{port} {python} -m vllm_proxy ctl ps
Engine logs: {logs}
"""


def build_config(root: Path, port: int, fake: bool) -> dict[str, Any]:
    models: dict[str, Any] = {}
    for i, name in enumerate(MODELS):
        if fake:
            models[name] = {"model": f"demo/{name}", "env": {"FAKE_ENGINE_STARTUP_DELAY": "2"}}
            continue
        path = ensure_tiny_model(root / "models" / name, seed=i)
        models[name] = {"model": str(path.resolve())}
    engine: dict[str, Any] = {"idle_timeout_s": 300, "port_range": [8001, 8999]}
    if fake:
        engine["command"] = [sys.executable, "-m", "fake_vllm"]
    else:
        engine.update(args=CPU_ARGS, env=CPU_ENV, startup_timeout_s=300)
    return {
        "server": {
            "host": "127.0.0.1",
            "port": port,
            "state_dir": str(root.resolve() / "state"),
            # The demo listens on loopback only: its admin API and status page need no key.
            "admin_open": True,
        },
        "engine": engine,
        "models": models,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_proxy_demo", description=__doc__)
    p.add_argument("--dir", default=".demo", help="where models, config and state go")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--fake", action="store_true", help="use the fake engine instead of vLLM")
    args = p.parse_args(argv)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    config = build_config(root, args.port, args.fake)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    print(
        SNIPPET.format(
            n=len(MODELS),
            port=args.port,
            first=MODELS[0],
            kind="fake engine" if args.fake else "vLLM CPU build",
            cold="~2 s" if args.fake else "20-30 s on 2 cores",
            logs=root.resolve() / "state" / "logs",
            python=sys.executable,
        ),
        flush=True,
    )
    argv_exec = [sys.executable, "-m", "vllm_proxy", "--config", str(path)]
    os.execv(sys.executable, argv_exec)
    return 0  # pragma: no cover
