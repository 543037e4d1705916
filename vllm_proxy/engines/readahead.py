"""Weights read ahead into the page cache, so that the next start (or level-2 wake) of a model
reads them from RAM instead of disk.

When an engine of a model stops for idleness, is put to sleep at level 2 (its wake reads the
weights again) or its start waits in admission, the proxy asks the kernel to read the model's
weight files ahead (``posix_fadvise(WILLNEED)``; the kernel reads them in the background and may
drop them again under memory pressure). Only when host RAM has room for the files and a
margin: a read ahead must never push out what engines asleep at level 1 keep in host memory.

The pure part (which files, whether they fit) is plain functions; `ReadAhead` runs them off the
event loop, one at a time per model folder, and never fails the caller.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ..engine_args import CHECKPOINT_SUFFIXES

log = logging.getLogger(__name__)

MIB = 1024 * 1024
#: Weight files: the checkpoint's (``engine_args``) and tensorizer's serialised ones.
WEIGHT_SUFFIXES = (*CHECKPOINT_SUFFIXES, ".tensors")
#: Host RAM (MiB) left free beyond the files themselves.
MARGIN_MB = 2048


def hub_cache(env: Mapping[str, str]) -> Path:
    """The Hugging Face hub cache the engine reads (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``~/.cache/huggingface/hub``), from the engine's environment `env`."""
    given = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if given:
        return Path(given).expanduser()
    home = env.get("HF_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "huggingface") / "hub"


def _snapshot(repo: Path) -> Path | None:
    """The snapshot ``refs/main`` names, else the newest one; None when there is none."""
    snapshots = repo / "snapshots"
    try:
        ref = (repo / "refs" / "main").read_text().strip()
        if ref and (snapshots / ref).is_dir():
            return snapshots / ref
    except OSError:
        pass
    try:
        found = [p for p in snapshots.iterdir() if p.is_dir()]
    except OSError:
        return None
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def model_path(model: str, env: Mapping[str, str]) -> Path | None:
    """Where `model`'s weights are on this host without asking the network: a local folder or
    file as it is, a hub repo id (``org/name``) as its snapshot in the local hub cache; None
    when neither is here."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    parts = model.split("/")
    if len(parts) != 2 or not all(parts) or model.startswith((".", "~")):
        return None
    return _snapshot(hub_cache(env) / ("models--" + model.replace("/", "--")))


def weight_files(path: Path) -> list[Path]:
    """The weight files vLLM reads from `path` (a file, or the files in a folder). Where a folder
    holds safetensors, vLLM reads those alone (its default loader prefers them), so only those."""
    if path.is_file():
        return [path] if path.suffix in WEIGHT_SUFFIXES else []
    try:
        files = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    except OSError:
        return []
    safetensors = [p for p in files if p.suffix == ".safetensors"]
    return safetensors or files


def fits(total_bytes: int, room_mb: int, margin_mb: int = MARGIN_MB) -> bool:
    """Host RAM with `room_mb` free holds `total_bytes` of files and the margin."""
    return total_bytes > 0 and room_mb * MIB > total_bytes + margin_mb * MIB


@dataclass(frozen=True)
class Outcome:
    """What one read-ahead did: the files and bytes asked for, or why none (``skipped``)."""

    files: int = 0
    bytes: int = 0
    skipped: str = ""


def advise(files: list[Path]) -> int:
    """Ask the kernel to read `files` ahead; returns the bytes asked for. Blocking."""
    total = 0
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def read_ahead(model: str, env: Mapping[str, str], room_mb: int, margin_mb: int) -> Outcome:
    """Find `model`'s weight files and, where they fit in `room_mb`, read them ahead."""
    path = model_path(model, env)
    if path is None:
        return Outcome(skipped="not on this host")
    files = weight_files(path)
    if not files:
        return Outcome(skipped="no weight files")
    total = sum(f.stat().st_size for f in files)
    if not fits(total, room_mb, margin_mb):
        return Outcome(skipped=f"{total // MIB} MiB do not fit in {room_mb} MiB of host RAM")
    return Outcome(files=len(files), bytes=advise(files))


class ReadAhead:
    """Read-aheads in flight, one per model folder (a second ask while one runs is dropped)."""

    def __init__(self, margin_mb: int = MARGIN_MB) -> None:
        self.margin_mb = margin_mb
        self._running: dict[str, asyncio.Task[Outcome]] = {}

    def start(
        self,
        model: str,
        env: Mapping[str, str],
        room_mb: Callable[[], int],
        done: Callable[[Outcome], None],
    ) -> asyncio.Task[Outcome] | None:
        """Read `model`'s weights ahead in a worker thread if host RAM (`room_mb`, read now, on
        the loop) allows; `done` gets the outcome. None when one for `model` runs already."""
        if model in self._running:
            return None
        task = asyncio.ensure_future(self._run(model, dict(env), room_mb, done))
        self._running[model] = task
        task.add_done_callback(lambda _t: self._running.pop(model, None))
        return task

    async def _run(
        self,
        model: str,
        env: dict[str, str],
        room_mb: Callable[[], int],
        done: Callable[[Outcome], None],
    ) -> Outcome:
        try:
            room = room_mb()
            loop = asyncio.get_running_loop()
            job = partial(read_ahead, model, env, room, self.margin_mb)
            outcome = await loop.run_in_executor(None, job)
            done(outcome)
        except Exception as err:  # a read-ahead is a hint: it never fails anything
            log.debug("read-ahead of %s failed: %r", model, err)
            return Outcome(skipped=f"failed: {err!r}")
        return outcome

    async def wait(self, timeout: float | None = None) -> None:
        """Until the read-aheads in flight now have ended, or `timeout` (tests, shutdown)."""
        if self._running:
            await asyncio.wait(list(self._running.values()), timeout=timeout)
