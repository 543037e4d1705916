"""The record of engine process groups this proxy runs, and the start-up sweep.

A proxy that was killed hard leaves nothing behind in the normal case: every engine guard gets a
parent-death signal and kills its group. The sweep covers the rest (a guard that was killed
itself, a kernel without the signal): at start the proxy kills every process group recorded in
``engines.json`` and every guard whose command line carries this instance's tag, before it
allocates a single port. A guard whose proxy is still alive (its parent is still the process
that started it) is never swept: it belongs to a running proxy.

`StateLock` keeps two proxies off one state directory: the second one stops before it reads
``engines.json``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil

from .guard import MARKERS
from .statedir import open_nofollow, secure_state_dir

log = logging.getLogger(__name__)

LOCK_FILE = "proxy.lock"


class StateDirBusy(Exception):
    """Another live process holds the state directory's lock."""

    def __init__(self, path: str, holder: int | None) -> None:
        who = f"pid {holder}" if holder else "another process"
        super().__init__(f"state dir {path} is in use by another vllm-proxy ({who})")
        self.path = path
        self.holder = holder


class StateLock:
    """An exclusive lock on a state directory (``flock`` on ``proxy.lock``, holding our pid).

    The kernel drops it when the process ends, however it ends: a proxy killed with ``kill -9``
    never leaves its successor locked out. The descriptor is not inherited by engines.
    """

    def __init__(self, state_dir: str) -> None:
        """Take the lock now; `StateDirBusy` when a live process holds it, `OSError` when the
        directory cannot be made or written, `UnsafeStateDir` when another user could write it
        or a folder above it (statedir.py)."""
        self.path = Path(state_dir)
        secure_state_dir(self.path)
        fd = open_nofollow(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BlockingIOError:
            holder = _pid_in(fd)
            os.close(fd)
            raise StateDirBusy(str(self.path), holder) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd

    def release(self) -> None:
        """Give the lock up (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _pid_in(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError):
        return None


class EngineRegistry:
    """Persists the engine instances alive now and the last instance number of every model.

    ``engines.json`` holds ``{"engines": {pgid: {"instance", "started"}}, "last_ids": {model: n}}``.
    ``started`` is the guard process's start time, so the sweep can tell our process from a
    stranger that got the same pid later. One writer: the instances, through `add`/`remove`.
    """

    def __init__(self, state_dir: str) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / "engines.json"
        self.tag = str(self.dir.resolve())
        self._groups: dict[int, dict[str, Any]] = {}
        self._last_ids: dict[str, int] = self._load().get("last_ids", {})

    def new_id(self, model: str) -> str:
        """A fresh instance id ``<model>#<n>``; never handed out twice, across restarts too."""
        n = int(self._last_ids.get(model, 0)) + 1
        self._last_ids[model] = n
        self._save()
        return f"{model}#{n}"

    def add(self, pgid: int, instance_id: str) -> None:
        started = None
        with contextlib.suppress(psutil.Error):
            started = psutil.Process(pgid).create_time()
        self._groups[pgid] = {"instance": instance_id, "started": started}
        self._save()

    def remove(self, pgid: int) -> None:
        if self._groups.pop(pgid, None) is not None:
            self._save()

    def entries(self) -> dict[int, str]:
        """Live engine process groups: pgid -> instance id."""
        return {pgid: e["instance"] for pgid, e in self._groups.items()}

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        data = {
            "engines": {str(k): v for k, v in self._groups.items()},
            "last_ids": self._last_ids,
        }
        os.makedirs(self.dir, mode=0o700, exist_ok=True)  # (the lock made it, when it ran)
        with contextlib.suppress(FileNotFoundError):  # (left by a proxy that died writing it)
            os.unlink(tmp)
        fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data))
        os.replace(tmp, self.path)

    def _load(self) -> dict[str, Any]:
        try:
            with os.fdopen(open_nofollow(self.path, os.O_RDONLY), "rb") as f:
                data = json.loads(f.read())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def sweep(self, timeout_s: float = 10.0) -> list[int]:
        """Kill engine groups left by a previous proxy with this state dir; returns their pgids.

        A recorded group is killed only when its leader is still the process we started (same
        start time, our guard's command line); a pid reused by someone else is left alone, and
        so is a guard whose proxy is alive.
        """
        pgids = set(self._recorded()) | set(self._tagged_guards())
        pgids.discard(os.getpgid(0))
        owned = {g: owner for g in pgids if (owner := _live_owner(g)) is not None}
        for pgid, owner in sorted(owned.items()):
            log.warning(
                "engine process group %d belongs to the live process %d: left alone", pgid, owner
            )
        live = [g for g in pgids if g not in owned and _group_alive(g)]
        for pgid in live:
            log.warning("stopping engine process group %d left by a previous proxy", pgid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(_group_alive(g) for g in live):
            time.sleep(0.05)
        self._groups.clear()
        self._save()
        return live

    def _recorded(self) -> list[int]:
        engines = self._load().get("engines", {})
        ours = []
        for key, entry in engines.items() if isinstance(engines, dict) else ():
            try:
                pgid = int(key)
            except ValueError:
                continue
            if _is_our_guard(pgid, entry.get("started") if isinstance(entry, dict) else None):
                ours.append(pgid)
            elif psutil.pid_exists(pgid):
                log.warning(
                    "engines.json names pid %d, which is not our engine now: left alone", pgid
                )
        return ours

    def _tagged_guards(self) -> list[int]:
        found = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info.get("cmdline") or []
            if any(m in cmd for m in MARKERS) and _tag_of(cmd) == self.tag:
                with contextlib.suppress(psutil.Error, ProcessLookupError):
                    found.append(os.getpgid(p.pid))
        return found


def _is_our_guard(pid: int, started: float | None) -> bool:
    """The process is a guard of ours that started when we recorded it."""
    try:
        proc = psutil.Process(pid)
        if started is not None and abs(proc.create_time() - started) > 0.01:
            return False
        return any(m in proc.cmdline() for m in MARKERS)
    except psutil.Error:
        return False


def _live_owner(guard: int) -> int | None:
    """The proxy that started this guard, while it is alive.

    The guard's ``--parent`` is that proxy's pid. A process keeps its parent until the parent
    dies (then it is reparented), so a parent that still equals ``--parent`` is that proxy, never
    a stranger with a reused pid.
    """
    try:
        proc = psutil.Process(guard)
        cmd = proc.cmdline()
        parent = int(_arg(cmd, "--parent") or 0)
        ours = any(m in cmd for m in MARKERS)
        return parent if parent > 1 and ours and proc.ppid() == parent else None
    except (psutil.Error, ValueError):
        return None


def _tag_of(cmdline: list[str]) -> str | None:
    return _arg(cmdline, "--tag")


def _arg(cmdline: list[str], flag: str) -> str | None:
    with contextlib.suppress(ValueError, IndexError):
        return cmdline[cmdline.index(flag) + 1]
    return None


def _group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is still in group `pgid`."""
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, PermissionError):
            continue
    return False
