"""Polling with deadlines, and the processes and ports tests look at."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import psutil

#: How often the pollers look again.
POLL_S = 0.02


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_for(
    predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 15.0, what: str = ""
) -> None:
    """Poll `predicate` (plain or async) until true, failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        await asyncio.sleep(POLL_S)


def wait_for_sync(predicate: Callable[[], bool], timeout: float = 15.0, what: str = "") -> None:
    """`wait_for` for code outside an event loop."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(POLL_S)


def heap_probe(code: str) -> int:
    """Run `code` in a fresh interpreter and return the number it prints; the test is skipped
    where it exits 3 (no glibc: the heap cannot be tuned)."""
    import pytest

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if out.returncode == 3:
        pytest.skip("not glibc: mallopt is not available")
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def alive(pid: int) -> bool:
    """True for a live, non-zombie process."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def group_alive(pgid: int) -> list[int]:
    """Live (non-zombie) members of a process group."""
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return out


def kill_group(pgid: int) -> None:
    """SIGKILL a process group that may be gone already."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
