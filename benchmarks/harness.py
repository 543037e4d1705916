"""The plumbing every benchmark script runs on: a run's temp dir and process groups, free
ports, waits for a port, a health check or any condition, vllm-proxy from a config, and a
revision's tree.

Everything started here goes through `Procs`, which starts each program in a new session (its
own process group) and, on `stop_all()`, SIGTERMs every group, waits a bounded time, SIGKILLs
what is left, and finally sweeps any process whose command line mentions the run's temporary
directory (engines started by a proxy live in the proxy's state dir under it). `session()`
wraps a run in that: on a normal end, an error, Ctrl-C or SIGTERM, every group is stopped and
the temp dir removed (or kept, to read its configs and logs).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import platform
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "benchmarks"
RESULTS = BENCH_DIR / "results"
PYTHON = sys.executable
#: ``<model>#<n>: ready on port P after Ss`` (one line per engine instance).
READY_RE = re.compile(r"(\S+)#\d+: ready on port (\d+) after ([0-9.]+)s")

T = TypeVar("T")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def arun(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on uvloop, the loop the proxy itself runs on."""
    import uvloop

    return uvloop.run(coro)


def command_line(script: str, argv: list[str] | None = None) -> str:
    """The command that reproduces this run, as the scripts print it under their tables."""
    return " ".join([".venv/bin/python", f"benchmarks/{script}", *(argv or sys.argv[1:])])


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


async def until(
    predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 15.0, what: str = ""
) -> None:
    """Poll `predicate` (plain or async) every 20 ms until true; AssertionError after
    `timeout` seconds (the test tier's `wait_for`, for code that both share)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        await asyncio.sleep(0.02)


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

    def drop(self, proc: subprocess.Popen[bytes], grace: float = 8.0) -> None:
        """Stop one of this run's groups before the end of the run."""
        self.stop(proc, grace)
        self.items = [(n, p) for n, p in self.items if p is not proc]

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


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def session(prefix: str, keep: bool = False) -> Iterator[tuple[Path, Procs]]:
    """A run's temp dir and its process groups. On leaving (a normal end, an error, Ctrl-C or
    SIGTERM, which is raised as KeyboardInterrupt meanwhile) every group is stopped, then the
    dir is removed unless `keep`."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    procs = Procs(tmp)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield tmp, procs
    finally:
        procs.stop_all()
        signal.signal(signal.SIGTERM, previous)
        if keep:
            log(f"kept {tmp} (configs and logs)")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def attempt(notes: list[str], step: Callable[[], None]) -> BaseException | None:
    """Run `step`; an error or an interrupt ends it, is added to `notes` and returned, so that
    the run still writes out what it measured before."""
    try:
        step()
    except (Exception, KeyboardInterrupt) as err:
        notes.append(f"run aborted: {type(err).__name__}: {err}")
        log(f"ABORTED: {type(err).__name__}: {err}")
        return err
    return None


def exit_code(failed: BaseException | None) -> int:
    """0, 1 after an error, 130 after an interrupt (Ctrl-C or SIGTERM)."""
    if isinstance(failed, KeyboardInterrupt):
        return 130
    return 1 if failed else 0


def raise_nofile() -> None:
    """Raise this process's open-file limit to the hard limit: thousands of client sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


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


def cpu_times(pids: list[int]) -> tuple[float, float]:
    """(user, system) CPU seconds of `pids`, from /proc/<pid>/stat."""
    tck = os.sysconf("SC_CLK_TCK")
    user = system = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            user += int(fields[11]) / tck
            system += int(fields[12]) / tck
    return user, system


def machine() -> str:
    """The CPU model, its cores and the kernel, for the line under a table."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} cores, Linux {platform.release()}"


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
        return len(re.findall(rf"\b{re.escape(model)}#\d+: NEW -> STARTING", text))

    def log_errors(self, most: int = 20) -> list[str]:
        """The first ERROR and Traceback lines of the proxy's log."""
        text = self.log_path.read_text(errors="replace")
        return [ln for ln in text.splitlines() if " ERROR " in ln or "Traceback" in ln][:most]


#: The fake engine (``fake_vllm``) as an engine command.
FAKE_ENGINE = [PYTHON, "-m", "fake_vllm"]


def proxy_config(
    port: int,
    state_dir: Path,
    models: dict[str, Any],
    *,
    server: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    **sections: Any,
) -> dict[str, Any]:
    """A vllm-proxy config listening on 127.0.0.1:`port`, its state in `state_dir`; `server`
    and `engine` add keys to those sections, `sections` adds others (``gpu``, ``admission``)."""
    return {
        "server": {
            "host": "127.0.0.1",
            "port": port,
            "state_dir": str(state_dir),
            **(server or {}),
        },
        "engine": engine or {},
        "models": models,
        **sections,
    }


def static_gpu(*memory_mb: int) -> dict[str, Any]:
    """The ``gpu`` section of a static budget: one device of each size, in MiB."""
    devices = [{"id": i, "memory_mb": mb} for i, mb in enumerate(memory_mb)]
    return {"monitor": "static", "devices": devices}


def write_config(path: Path, config: dict[str, Any]) -> Path:
    """`config` as a vllm-proxy (or LiteLLM) config file at `path` (JSON is YAML)."""
    path.write_text(json.dumps(config, indent=2))
    return path


def start_proxy(
    procs: Procs,
    name: str,
    config: dict[str, Any],
    *,
    tree: Path | None = None,
    log_level: str = "info",
    argv: list[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> ProxyHandle:
    """vllm-proxy (``python -m vllm_proxy``, or `argv`) with `config`, written to
    ``<tmp>/<name>.yaml``, logging to ``<tmp>/<name>.log``; returns once its /health answers.

    The code is the checkout at `tree` (default: this one), put first on ``PYTHONPATH`` so that
    neither an installed copy nor the current directory decides which proxy runs."""
    cfg = write_config(procs.tmp / f"{name}.yaml", config)
    log_path = procs.tmp / f"{name}.log"
    argv = argv or [PYTHON, "-m", "vllm_proxy"]
    if tree is not None:  # another revision: none of this checkout's code
        path = str(tree)
    else:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = procs.start(
        name,
        [*argv, "--config", str(cfg), "--log-level", log_level],
        log_path,
        {"PYTHONPATH": path, **(env or {})},
    )
    port = config["server"]["port"]
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout, proc)
    except RuntimeError as err:
        raise RuntimeError(f"{name} did not start: {err}\n{tail(log_path)}") from None
    return ProxyHandle(proc, port, log_path)


# --------------------------------------------------------------------------- revisions


def git_head() -> str:
    """The short name of this checkout's HEAD."""
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return out.stdout.strip() or "unknown"


def checkout(rev: str, into: Path) -> Path:
    """The files of revision `rev` (a commit, tag or branch) unpacked into the new folder
    `into`, to run that revision's proxy beside this one (``start_proxy(tree=into)``).

    Read from the repository with ``git archive``: nothing is registered in it (no worktree),
    and removing `into` (with the run's temp dir) is all the cleaning up there is."""
    into.mkdir(parents=True)
    archive = subprocess.Popen(
        ["git", "archive", "--format=tar", rev],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert archive.stdout is not None and archive.stderr is not None
    untar = subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, check=False)
    archive.stdout.close()
    err = archive.stderr.read().decode(errors="replace").strip()
    if archive.wait() != 0 or untar.returncode != 0:
        raise RuntimeError(f"cannot check out {rev!r}: {err or 'tar failed'}")
    return into
