"""The servers the comparative benchmarks run: vllm-proxy with fake engines or the static nginx
engine, nginx ``proxy_pass`` and the LiteLLM proxy, each on 127.0.0.1 and started through
`harness.Procs` (its own process group, stopped at the end of the run); and the versions of
everything measured, for the report.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import loadgen
import nginx_conf
import psutil
from harness import (
    BENCH_DIR,
    FAKE_ENGINE,
    PYTHON,
    ROOT,
    Procs,
    ProxyHandle,
    proxy_config,
    start_proxy,
    tail,
    wait_http,
    wait_port,
    write_config,
)

#: The API key of every proxy a benchmark starts (a new one each run).
KEY = "sk-bench-" + os.urandom(16).hex()

# A real (16-token) vLLM chat.completion as the fake engine renders it: every upstream answers
# with this much JSON, so the proxies copy the same bytes whichever upstream they are in front of.
STATIC_BODY = {
    "id": "chatcmpl-94f0d9178c4f2dba",
    "object": "chat.completion",
    "created": 1795251409,
    "model": "bench",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "tok0 tok1 tok2 tok3 tok4 tok5 tok6 tok7 tok8 tok9 tok10 tok11 tok12 "
                "tok13 tok14 tok15 ",
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            },
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": None,
            "token_ids": None,
            "routed_experts": None,
        }
    ],
    "service_tier": None,
    "system_fingerprint": "vllm-0.0.0-fake",
    "usage": {
        "prompt_tokens": 2,
        "total_tokens": 18,
        "completion_tokens": 16,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    },
    "prompt_logprobs": None,
    "prompt_token_ids": None,
    "prompt_text": None,
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "metrics": None,
}


async def first_requests(urls: list[tuple[str, str]]) -> list[tuple[int, bytes]]:
    """One small request to each (base URL, model), in turn: a proxy starts the engine on it."""
    headers = {"Authorization": f"Bearer {KEY}"}
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        for url, model in urls:
            # max_tokens 1: the "slow" model would otherwise take 16 x 0.5 s to answer.
            body = {"model": model, "messages": loadgen.PROMPT, "max_tokens": 1}
            async with s.post(url + loadgen.CHAT, json=body, headers=headers) as resp:
                out.append((resp.status, await resp.read()))
    return out


# --------------------------------------------------------------------------- vllm-proxy


def tcp_engines(tree: Path | None) -> dict[str, str]:
    """``transport: tcp`` where the checkout at `tree` (None: this one) knows the key: the
    benchmarks measure engines on loopback ports (nginx, the port read from the proxy's log),
    and older revisions served engines on ports only."""
    config = (tree or BENCH_DIR.parent) / "vllm_proxy" / "config.py"
    return {"transport": "tcp"} if "transport" in config.read_text() else {}


def bench_config(
    tmp: Path,
    name: str,
    port: int,
    models: dict[str, dict[str, object]],
    tree: Path | None = None,
    **engine: object,
) -> dict[str, Any]:
    """The config of a proxy under test: `models`, the key `KEY`, engines never stopped for
    idling; `engine` adds to (or replaces) the engine defaults."""
    return proxy_config(
        port,
        tmp / f"{name}-state",
        models,
        server={"api_keys": [KEY], "drain_timeout_s": 2},
        engine={"idle_timeout_s": 0, "stop_timeout_s": 3, **tcp_engines(tree), **engine},
    )


def start_fake_proxy(
    procs: Procs,
    name: str,
    port: int,
    models: dict[str, dict[str, object]],
    tree: Path | None = None,
) -> ProxyHandle:
    """vllm-proxy with `models` of the fake engine (unless a model names its own command);
    from the checkout at `tree` if given."""
    config = bench_config(procs.tmp, name, port, models, tree,
                          command=FAKE_ENGINE, startup_timeout_s=60)  # fmt: skip
    config["server"]["access_log"] = False  # like nginx's `access_log off` here
    return start_proxy(procs, name, config, tree=tree)


# --------------------------------------------------------------------------- nginx


NGINX_PROXY_HTTP = """\
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_read_timeout 600s;
    client_max_body_size 0;  # the large-body benchmark (streams.py) sends 10 MB requests:
    client_body_buffer_size 40m;  # buffered in memory, not in a temp file
"""

NGINX_BLOCK = """\
    upstream up_{name} {{ server 127.0.0.1:{up}; keepalive 1024; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://up_{name};
            proxy_buffering {buffering};
        }}
    }}
"""


def start_nginx_proxy(
    procs: Procs, tmp: Path, routes: dict[str, tuple[int, int, bool]]
) -> subprocess.Popen[bytes]:
    """nginx ``proxy_pass``: for each name, listen port -> upstream port (buffering off/on)."""
    d = tmp / "nginx-proxy"
    d.mkdir()
    blocks = "".join(
        NGINX_BLOCK.format(name=n, port=p, up=u, buffering="on" if buf else "off")
        for n, (p, u, buf) in routes.items()
    )
    conf = nginx_conf.write(d, NGINX_PROXY_HTTP + blocks, main="worker_rlimit_nofile 20000;\n")
    proc = procs.start("nginx-proxy", nginx_conf.argv(d, conf), tmp / "nginx-proxy.log")
    for port, _, _ in routes.values():
        wait_port(port, 10, proc)
    return proc


# --------------------------------------------------------------------------- LiteLLM


LITELLM_LOG_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {
        "err": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "stream": "ext://sys.stderr",
        }
    },
    "loggers": {
        "uvicorn": {"handlers": ["err"], "level": "WARNING", "propagate": False},
        "uvicorn.error": {"handlers": ["err"], "level": "WARNING", "propagate": False},
        "uvicorn.access": {"handlers": ["err"], "level": "WARNING", "propagate": False},
    },
}


def litellm_version(venv: Path) -> str | None:
    py = venv / "bin" / "python"
    if not py.exists():
        return None
    try:
        out = subprocess.run(
            [str(py), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    except (subprocess.SubprocessError, OSError):
        return None
    return out.stdout.strip() or None


def start_litellm(
    procs: Procs, tmp: Path, venv: Path, port: int, key: str, upstreams: dict[str, int]
) -> subprocess.Popen[bytes]:
    """LiteLLM proxy (one uvicorn worker) with an ``openai/<name>`` model per upstream."""
    model_list = [
        {
            "model_name": name,
            "litellm_params": {
                "model": f"openai/{name}",
                "api_base": f"http://127.0.0.1:{up}/v1",
                "api_key": "none",
            },
        }
        for name, up in upstreams.items()
    ]
    settings = {"model_list": model_list, "litellm_settings": {"telemetry": False}}
    cfg = write_config(tmp / "litellm.yaml", settings)
    log_cfg = write_config(tmp / "litellm-log.json", LITELLM_LOG_CONFIG)
    exe = venv / "bin" / "litellm"
    argv = [str(exe), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--num_workers", "1", "--log_config", str(log_cfg)]
    env = {
        "LITELLM_MASTER_KEY": key,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOG": "ERROR",
        "PYTHONUNBUFFERED": "1",
        "NO_PROXY": "*",
        # LiteLLM's aiohttp transport allows 500 connections per upstream host by default; give
        # it the same 4096 that vllm-proxy's max_upstream_connections allows.
        "AIOHTTP_CONNECTOR_LIMIT": "4096",
        "AIOHTTP_CONNECTOR_LIMIT_PER_HOST": "4096",
    }
    log_path = tmp / "litellm.log"
    proc = procs.start("litellm", argv, log_path, env)
    try:
        wait_http(f"http://127.0.0.1:{port}/health/liveliness", 180, proc)
    except RuntimeError as err:
        raise RuntimeError(f"{err}; last log lines:\n{tail(log_path, 25)}") from None
    return proc


# --------------------------------------------------------------------------- versions


def _first_line(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        return f"unavailable ({err})"
    text = (out.stdout + out.stderr).strip().splitlines()
    return text[0].strip() if text else "unknown"


def versions(litellm_venv: Path) -> dict[str, str]:
    import aiohttp
    import uvloop

    import vllm_proxy

    rev = _first_line(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--", "vllm_proxy"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "vllm-proxy": f"{getattr(vllm_proxy, '__version__', '?')} (git {rev}"
        + (", vllm_proxy/ has uncommitted changes)" if dirty else ")"),
        "python": sys.version.split()[0],
        "aiohttp": aiohttp.__version__,
        "uvloop": uvloop.__version__,
        "nginx": _first_line(["nginx", "-v"]).replace("nginx version: nginx/", ""),
        "wrk": _first_line(["wrk", "-v"]).split(" [")[0].removeprefix("wrk "),
        "litellm": litellm_version(litellm_venv) or "not installed",
        "cpu": f"{cpu}, {os.cpu_count()} cores",
        "memory": f"{psutil.virtual_memory().total / 2**30:.0f} GiB",
        "kernel": os.uname().release,
    }


def static_model(tmp: Path, port: int) -> dict[str, object]:
    """Model ``bench``: the static nginx upstream (`nginx_engine.py`) as its engine, on `port`,
    answering every request with `STATIC_BODY`."""
    body = tmp / "static.json"
    body.write_text(json.dumps(STATIC_BODY, separators=(",", ":")))
    return {
        "model": "static/bench",
        "command": [PYTHON, str(BENCH_DIR / "nginx_engine.py")],
        "port_range": [port, port],
        "env": {"NGINX_ENGINE_DIR": str(tmp / "nginx-engine"), "NGINX_ENGINE_BODY": str(body)},
    }


def static_proxy_config(
    tmp: Path, port: int, upstream: int, tree: Path | None = None
) -> dict[str, Any]:
    """A vllm-proxy config with one model, ``bench``, whose engine is the static nginx upstream
    on port `upstream`."""
    return bench_config(tmp, "proxy", port, {"bench": static_model(tmp, upstream)}, tree)
