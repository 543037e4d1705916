"""The record of engine process groups this proxy runs, and the start-up sweep.

A proxy that was killed hard leaves nothing behind in the normal case: every engine guard gets a
parent-death signal and kills its group. The sweep covers the rest (a guard that was killed
itself, a kernel without the signal): at start the proxy kills every process group recorded in
``engines.json`` and every guard whose command line carries this instance's tag, before it
allocates a single port.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path

import psutil

from .guard import MARKER

log = logging.getLogger(__name__)


class EngineRegistry:
    """Persists ``{pgid: model}`` for the engines alive now; one writer (the manager)."""

    def __init__(self, state_dir: str) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / "engines.json"
        self.tag = str(self.dir.resolve())
        self._groups: dict[int, str] = {}

    def add(self, pgid: int, model: str) -> None:
        self._groups[pgid] = model
        self._save()

    def remove(self, pgid: int) -> None:
        if self._groups.pop(pgid, None) is not None:
            self._save()

    def _save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({str(k): v for k, v in self._groups.items()}))
        os.replace(tmp, self.path)

    def sweep(self, timeout_s: float = 10.0) -> list[int]:
        """Kill engine groups left by a previous proxy with this state dir; returns their pgids."""
        pgids = set(self._recorded()) | set(self._tagged_guards())
        pgids.discard(os.getpgid(0))
        live = [g for g in pgids if _group_alive(g)]
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
        try:
            return [int(k) for k in json.loads(self.path.read_text())]
        except (OSError, ValueError, AttributeError):
            return []

    def _tagged_guards(self) -> list[int]:
        found = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info.get("cmdline") or []
            if MARKER in cmd and _tag_of(cmd) == self.tag:
                with contextlib.suppress(psutil.Error, ProcessLookupError):
                    found.append(os.getpgid(p.pid))
        return found


def _tag_of(cmdline: list[str]) -> str | None:
    with contextlib.suppress(ValueError, IndexError):
        return cmdline[cmdline.index("--tag") + 1]
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
