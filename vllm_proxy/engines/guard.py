"""Per-engine guard: the process that makes an engine tree impossible to orphan.

The proxy starts ``python -m vllm_proxy.engines.guard --parent PID --log FILE ... -- ENGINE
ARGV`` in a new session, so the guard leads a process group that the engine and everything it
forks (vLLM's ``VLLM::EngineCore`` and ``VLLM::Worker`` processes) inherit. The guard:

* asks the kernel for a parent-death signal (``PR_SET_PDEATHSIG``): when the proxy dies, even by
  ``kill -9``, the guard SIGKILLs its whole process group, engine tree and itself included;
* drains the engine's stdout/stderr into a size-bounded, rotated log file (never a full pipe);
* when the engine's main process exits, SIGKILLs whatever it left behind in the group (vLLM's
  engine core survives a crashed API server and keeps holding GPU memory) and exits with the
  engine's exit code (128+N for a signal), so the proxy sees the engine's status as its own.

A SIGTERM sent by the proxy to the whole group reaches the engine directly; the guard itself only
notes it and keeps draining output until the engine is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import io
import os
import signal
import subprocess
import sys
import threading
import time
from types import FrameType

PR_SET_PDEATHSIG = 1
#: Orphans of the engine tree are reparented to the guard, not to init: they stay in its tree.
PR_SET_CHILD_SUBREAPER = 36
#: The parent-death signal; distinct from SIGTERM, which the proxy uses for graceful stops.
DEATH_SIGNAL = signal.SIGUSR1
MARKER = "vllm_proxy.engines.guard"
#: What a guard's command line carries: its module, and the path it had before 0.2.0, so the
#: start-up sweep after an upgrade still finds an older proxy's leftover guards.
MARKERS = (MARKER, "vllm_proxy.guard")


def _open_log(path: str, flag: int) -> io.FileIO:
    """The log file, never through a link in its place (ELOOP), mode 0600 when made."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | flag, 0o600)
    return open(fd, "ab" if flag == os.O_APPEND else "wb", buffering=0)


class RotatingLog:
    """Append bytes to a file, rotating it to ``.1`` ... ``.N`` when it grows past a bound."""

    def __init__(self, path: str, max_bytes: int, backups: int) -> None:
        self.path, self.max_bytes, self.backups = path, max_bytes, backups
        self._lock = threading.Lock()
        self._fh = _open_log(path, os.O_APPEND)
        self._size = self._fh.tell()

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._size + len(data) > self.max_bytes and self._size > 0:
                self._rotate()
            self._fh.write(data)
            self._size += len(data)

    def _rotate(self) -> None:
        self._fh.close()
        if self.backups > 0:
            for i in range(self.backups - 1, 0, -1):
                src = f"{self.path}.{i}"
                if os.path.exists(src):
                    os.replace(src, f"{self.path}.{i + 1}")
            os.replace(self.path, f"{self.path}.1")
        self._fh = _open_log(self.path, os.O_TRUNC)
        self._size = 0

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def set_parent_death_signal(sig: int) -> bool:
    """Linux only: deliver `sig` to this process when its parent thread exits."""
    return _prctl(PR_SET_PDEATHSIG, int(sig))


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, value, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def group_members(pgid: int, exclude: int) -> list[int]:
    """Pids in process group `pgid`, read from /proc (the engine's children rename themselves)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == exclude:
            continue
        try:
            if os.getpgid(int(entry)) == pgid:
                pids.append(int(entry))
        except (ProcessLookupError, PermissionError):
            continue
    return pids


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rpartition(b")")[2].split()
    except OSError:
        return None
    if not fields or fields[0] == b"Z":
        return None
    return int(fields[1]), int(fields[19])


class Tree:
    """Every process that descended from the guard, remembered with its start time.

    An engine may leave the process group (``setsid()``, a daemonising helper): the group kill
    misses it, but it was seen as a descendant while its parent lived. `kill()` signals what is
    still alive with the same start time (never a stranger that got a reused pid).
    """

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, int] = {}
        # Reentrant: the parent-death handler runs in the main thread between any two
        # bytecodes, also while that thread is inside `refresh()` or `kill()`.
        self._lock = threading.RLock()

    def refresh(self) -> None:
        parents: dict[int, tuple[int, int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (st := _stat(int(entry))) is not None:
                parents[int(entry)] = st
        found, frontier = {}, [self.root]
        while frontier:
            parent = frontier.pop()
            for pid, (ppid, started) in parents.items():
                if ppid == parent and pid not in found:
                    found[pid] = started
                    frontier.append(pid)
        with self._lock:
            self.seen.update(found)

    def kill(self) -> int:
        """SIGKILL every remembered descendant still alive as itself; how many there were."""
        with self._lock:
            seen = dict(self.seen)
        hit = 0
        for pid, started in seen.items():
            st = _stat(pid)
            if st is not None and st[1] == started:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    hit += 1
        return hit

    def watch(self, stop: threading.Event, interval_s: float = 0.5) -> None:
        while not stop.wait(interval_s):
            self.refresh()


def kill_leftovers(pgid: int, grace_s: float = 2.0, deadline_s: float = 5.0) -> int:
    """Stop every member of the group but this process: SIGTERM, `grace_s`, then SIGKILL.

    Returns how many processes were still there when the engine's main process had exited.
    """
    me = os.getpid()
    left = group_members(pgid, exclude=me)
    _signal_all(left, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while time.monotonic() < end and group_members(pgid, exclude=me):
        time.sleep(0.02)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        pids = group_members(pgid, exclude=me)
        if not pids:
            break
        _signal_all(pids, signal.SIGKILL)
        time.sleep(0.02)
    return len(left)


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _pump(fd: int, log: RotatingLog) -> None:
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            return
        if not data:
            return
        log.write(data)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=MARKER)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--log-max-bytes", type=int, default=20 * 1024 * 1024)
    p.add_argument("--log-backups", type=int, default=2)
    p.add_argument("--tag", default="", help="identifies the proxy instance for start-up sweeps")
    p.add_argument("command", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    if ns.command[:1] == ["--"]:
        ns.command = ns.command[1:]
    if not ns.command:
        p.error("no engine command given")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = _parse(sys.argv[1:] if argv is None else argv)
    pgid = os.getpgid(0)

    tree = Tree(os.getpid())
    _prctl(PR_SET_CHILD_SUBREAPER, 1)

    dying = False

    def on_parent_death(_sig: int, _frame: FrameType | None) -> None:
        # A multithreaded parent's death can deliver the signal once per exiting thread (the
        # guard is handed from thread to thread as each exits): act once, whatever it interrupts.
        nonlocal dying
        if dying:
            return
        dying = True
        tree.kill()
        os.killpg(pgid, signal.SIGKILL)

    signal.signal(DEATH_SIGNAL, on_parent_death)
    # Python-level handlers (not SIG_IGN) so that the engine starts with default dispositions.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    set_parent_death_signal(DEATH_SIGNAL)
    if os.getppid() != ns.parent:  # the proxy died before the death signal was armed
        os.killpg(pgid, signal.SIGKILL)

    log = RotatingLog(ns.log, ns.log_max_bytes, ns.log_backups)
    log.write(f"[vllm-proxy] starting engine: {' '.join(ns.command)}\n".encode())
    try:
        proc = subprocess.Popen(
            ns.command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
    except OSError as err:
        log.write(f"[vllm-proxy] cannot start engine: {err}\n".encode())
        log.close()
        return 127
    assert proc.stdout is not None
    pump = threading.Thread(target=_pump, args=(proc.stdout.fileno(), log), daemon=True)
    pump.start()
    stop_watching = threading.Event()
    tree.refresh()
    threading.Thread(target=tree.watch, args=(stop_watching,), daemon=True).start()
    while True:
        try:
            code = proc.wait()
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for clarity
            continue
    stop_watching.set()
    killed = kill_leftovers(pgid)
    tree.refresh()  # orphans that left the group are ours as the subreaper
    killed += tree.kill()
    pump.join(timeout=2.0)
    status = exit_status(code)
    note = f", stopped {killed} leftover process(es)" if killed else ""
    log.write(f"[vllm-proxy] engine exited with code {status}{note}\n".encode())
    log.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
