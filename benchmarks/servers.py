"""Start and stop every server a benchmark run needs, each on 127.0.0.1, each in its own group.

Everything started here goes through `Procs`, which starts each program in a new session (its
own process group) and, on `stop_all()`, SIGTERMs every group, waits a bounded time, SIGKILLs
what is left, and finally sweeps any process whose command line mentions the run's temporary
directory (engines started by a proxy live in the proxy's state dir under it).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "benchmarks"
PYTHON = sys.executable
#: ``<model>#<n>: ready on port P after Ss`` (one line per engine instance).
READY_RE = re.compile(r"(\S+)#\d+: ready on port (\d+) after ([0-9.]+)s")

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


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- ports


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_ports(n: int) -> list[int]:
    """`n` free loopback ports below the ephemeral range.

    Ports for engines started minutes later must not be taken meanwhile by one of the many
    client sockets wrk opens, so they come from 20000-31999, not from the kernel's range.
    """
    lo, hi = 20000, 31999
    out: list[int] = []
    port = random.randrange(lo, hi - 2000)
    while len(out) < n:
        if _free(port):
            out.append(port)
        port += 1
        if port > hi:
            raise RuntimeError("no free ports in 20000-31999")
    return out


def wait_port(port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {timeout:g}s")


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} (waiting for {url})")
        try:
            status, _ = http_get(url, 1.0)
            if status == 200:
                return
            last = f"HTTP {status}"
        except OSError as err:
            last = str(err)
        time.sleep(0.1)
    raise RuntimeError(f"{url} not answering 200 after {timeout:g}s ({last})")


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# --------------------------------------------------------------------------- processes


class Procs:
    """Every process group this run started; `stop_all()` is safe to call more than once."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.items: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(
        self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        fh = open(log_path, "ab")
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
                cwd=str(self.tmp),
            )
        finally:
            fh.close()
        self.items.append((name, proc))
        return proc

    @staticmethod
    def stop(proc: subprocess.Popen[bytes], grace: float = 8.0) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        # The group may outlive its leader (nginx workers, uvicorn children): kill it whole.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)

    def stop_all(self) -> None:
        for _name, proc in reversed(self.items):
            self.stop(proc)
        self.items.clear()
        self.sweep()

    def sweep(self) -> None:
        """Kill any process group left behind whose command line mentions our temp dir."""
        marker = str(self.tmp)
        me = os.getpid()
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                cmd = " ".join(p.info["cmdline"] or [])
                if marker in cmd and p.info["pid"] != me:
                    pgid = os.getpgid(p.info["pid"])
                    if pgid != os.getpgid(me):
                        os.killpg(pgid, signal.SIGKILL)
                    else:
                        p.kill()
            except (psutil.Error, ProcessLookupError, PermissionError):
                continue


def tree_rss(pid: int) -> int:
    """RSS in bytes of a process and all its descendants (0 when it is gone)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def proc_rss(pid: int) -> int:
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0


# --------------------------------------------------------------------------- vllm-proxy


@dataclass
class ProxyHandle:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready_lines(self) -> list[tuple[str, int, float]]:
        text = self.log_path.read_text(errors="replace")
        return [(m[1], int(m[2]), float(m[3])) for m in READY_RE.finditer(text)]

    def engine_port(self, model: str, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, port, _ in self.ready_lines():
                if name == model:
                    return port
            time.sleep(0.02)
        raise RuntimeError(f"no 'ready on port' line for {model}; log:\n{tail(self.log_path)}")

    def starts(self, model: str) -> int:
        text = self.log_path.read_text(errors="replace")
        return len(re.findall(rf"\b{re.escape(model)}#\d+: STOPPED -> STARTING", text))


def tcp_engines(tree: Path | None) -> dict[str, str]:
    """``transport: tcp`` where the checkout at `tree` (None: this one) knows the key: the
    benchmarks measure engines on loopback ports (nginx, the port read from the proxy's log),
    and older revisions served engines on ports only."""
    config = (tree or BENCH_DIR.parent) / "vllm_proxy" / "config.py"
    return {"transport": "tcp"} if "transport" in config.read_text() else {}


def start_proxy(
    procs: Procs,
    tmp: Path,
    name: str,
    port: int,
    key: str,
    models: dict[str, dict[str, object]],
    tree: Path | None = None,
) -> ProxyHandle:
    """vllm-proxy with `models`; from the checkout at `tree` (through ``PYTHONPATH``) if given."""
    state = tmp / f"{name}-state"
    config = {
        "server": {
            "host": "127.0.0.1",
            "port": port,
            "state_dir": str(state),
            "api_keys": [key],
            "drain_timeout_s": 2,
            "access_log": False,  # like nginx's `access_log off` here
        },
        "engine": {
            "command": [PYTHON, "-m", "fake_vllm"],
            "idle_timeout_s": 0,
            "stop_timeout_s": 3,
            "startup_timeout_s": 60,
            **tcp_engines(tree),
        },
        "models": models,
    }
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(json.dumps(config, indent=2))  # JSON is YAML
    log_path = tmp / f"{name}.log"
    exe = str(Path(PYTHON).parent / "vllm-proxy")
    argv = [exe] if os.path.exists(exe) and tree is None else [PYTHON, "-m", "vllm_proxy"]
    env = {"PYTHONPATH": str(tree)} if tree is not None else None
    proc = procs.start(name, [*argv, "--config", str(cfg), "--log-level", "info"], log_path, env)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 30, proc)
    except RuntimeError as err:
        raise RuntimeError(f"{name} did not start: {err}\n{tail(log_path)}") from None
    return ProxyHandle(proc, port, log_path)


# --------------------------------------------------------------------------- nginx


NGINX_PROXY_CONF = """\
worker_processes 1;
worker_rlimit_nofile 20000;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 16384; multi_accept on; }}
http {{
    access_log off;
    client_body_temp_path {d}/client_body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    keepalive_requests 10000000;
    keepalive_timeout 75s;
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_read_timeout 600s;
    client_max_body_size 0;  # the large-body benchmark (streams.py) sends 10 MB requests:
    client_body_buffer_size 40m;  # buffered in memory, not in a temp file
{blocks}
}}
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
    conf = d / "nginx.conf"
    conf.write_text(NGINX_PROXY_CONF.format(d=d, blocks=blocks))
    argv = ["nginx", "-p", str(d), "-e", str(d / "error.log"), "-c", str(conf)]
    proc = procs.start("nginx-proxy", [*argv, "-g", "daemon off;"], tmp / "nginx-proxy.log")
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
    cfg = tmp / "litellm.yaml"
    cfg.write_text(
        json.dumps({"model_list": model_list, "litellm_settings": {"telemetry": False}}, indent=2)
    )
    log_cfg = tmp / "litellm-log.json"
    log_cfg.write_text(json.dumps(LITELLM_LOG_CONFIG))
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


def static_proxy_config(tmp: Path, port: int, upstream: int, key: str) -> Path:
    """A vllm-proxy config with one model, ``bench``, whose engine is the static nginx upstream
    (`nginx_engine.py`) on port `upstream`; written to ``tmp/proxy.yaml``."""
    body = tmp / "static.json"
    body.write_text(json.dumps(STATIC_BODY, separators=(",", ":")))
    config = {
        "server": {
            "host": "127.0.0.1",
            "port": port,
            "state_dir": str(tmp / "state"),
            "api_keys": [key],
            "drain_timeout_s": 2,
        },
        "engine": {"idle_timeout_s": 0, "stop_timeout_s": 3, **tcp_engines(None)},
        "models": {
            "bench": {
                "model": "static/bench",
                "command": [PYTHON, str(BENCH_DIR / "nginx_engine.py")],
                "port_range": [upstream, upstream],
                "env": {
                    "NGINX_ENGINE_DIR": str(tmp / "nginx-engine"),
                    "NGINX_ENGINE_BODY": str(body),
                },
            }
        },
    }
    path = tmp / "proxy.yaml"
    path.write_text(json.dumps(config))
    return path
