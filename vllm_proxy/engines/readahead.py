"""Weights read ahead into the page cache, so that the next start (or level-2 wake) of a model
reads them from RAM instead of disk.

When an engine of a model stops for idleness, is put to sleep at level 2 (its wake reads the
weights again) or its start waits in admission, the proxy reads the model's weight files into
the page cache (the kernel may drop them again under memory pressure). Only when host RAM has
room for the files and a margin: a read ahead must never push out what engines asleep at level
1 keep in host memory.

The files are read, window by window, into one reused buffer; windows already in the page
cache are skipped. A single ``posix_fadvise(WILLNEED)`` (or ``madvise``, or ``readahead(2)``)
over a whole file does not do it: Linux's ``force_page_cache_ra()`` caps what one call reads
at the device's read-ahead size (``read_ahead_kb``: 128 KiB by default, a few MiB at most), so
a 512 MiB file was 1.6 % resident 30 s later. What counts is what became resident: the bytes of
the files in the page cache afterwards less before (``mincore(2)``), never their sizes.

The reads run in an executor of their own (one thread): a 140 GB read must never hold up the
NVML and RSS readings that admission makes in the loop's default executor.

The pure part (which files, whether they fit) is plain functions; `ReadAhead` runs them off the
event loop, one at a time, and never fails the caller.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import mmap
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ..config import ModelSpec
from ..engine_args import CHECKPOINT_SUFFIXES
from ..metrics import Metrics

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
    """What one read-ahead did: the files read, the bytes that became resident in the page
    cache, or why none (``skipped``)."""

    files: int = 0
    bytes: int = 0
    skipped: str = ""


#: Bytes read per call into the reused buffer (also the unit of `resident_bytes`' vector).
WINDOW = 8 * MIB
PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]  # fmt: skip
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value
#: Bytes of a file mapped at once to ask `mincore` about it.
_SPAN = 1024 * MIB


def resident_bytes(fd: int, offset: int = 0, length: int | None = None) -> int:
    """Bytes of the open file `fd` from `offset` (page-aligned) for `length` bytes (default: to
    its end) that are in the page cache now (``mincore(2)`` on a read-only mapping that
    touches no page)."""
    size = os.fstat(fd).st_size
    end = size if length is None else min(size, offset + length)
    total = 0
    while offset < end:
        span = min(_SPAN, end - offset)
        addr = _libc.mmap(None, span, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        try:
            pages = (span + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, span, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
            total += (pages - bytes(vec).count(0)) * PAGE  # (only bit 0 is ever set)
        finally:
            _libc.munmap(addr, span)
        offset += span
    return min(total, max(size, 0))


def read_into_cache(path: Path, buffer: bytearray, stop: threading.Event | None = None) -> int:
    """Read `path` into the page cache through `buffer`, skipping windows already there; returns
    the bytes that became resident (never more than the file's size). Blocking."""
    fd = os.open(path, os.O_RDONLY)
    try:
        before = resident_bytes(fd)
        size = os.fstat(fd).st_size
        view = memoryview(buffer)
        offset = 0
        while offset < size and not (stop is not None and stop.is_set()):
            window = min(len(buffer), size - offset)
            if resident_bytes(fd, offset, window) < window:
                os.preadv(fd, [view[:window]], offset)
            offset += window
        return max(resident_bytes(fd) - before, 0)
    finally:
        os.close(fd)


def advise(files: list[Path], stop: threading.Event | None = None) -> int:
    """Read `files` into the page cache; returns the bytes that became resident. Blocking."""
    buffer = bytearray(WINDOW)
    return sum(read_into_cache(f, buffer, stop) for f in files)


def read_ahead(
    model: str,
    env: Mapping[str, str],
    room_mb: int,
    margin_mb: int,
    stop: threading.Event | None = None,
) -> Outcome:
    """Find `model`'s weight files and, where they fit in `room_mb`, read them ahead (until
    `stop` is set)."""
    path = model_path(model, env)
    if path is None:
        return Outcome(skipped="not on this host")
    files = weight_files(path)
    if not files:
        return Outcome(skipped="no weight files")
    total = sum(f.stat().st_size for f in files)
    if not fits(total, room_mb, margin_mb):
        return Outcome(skipped=f"{total // MIB} MiB do not fit in {room_mb} MiB of host RAM")
    return Outcome(files=len(files), bytes=advise(files, stop))


class ReadAhead:
    """Read-aheads in flight, one per model folder (a second ask while one runs is dropped)."""

    def __init__(self, margin_mb: int = MARGIN_MB) -> None:
        self.margin_mb = margin_mb
        self._running: dict[str, asyncio.Task[Outcome]] = {}
        #: Its own thread: never queued with (or ahead of) the NVML and RSS readings.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-ahead")
        #: Set at close: a read under way ends at its next window.
        self._stop = threading.Event()

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

    def for_instance(
        self, spec: ModelSpec, metrics: Metrics, room_mb: Callable[[], int], who: str, why: str
    ) -> asyncio.Task[Outcome] | None:
        """`start` for an engine of `spec` (instance `who`, for `why`): its weights where
        ``read_ahead`` is on, counted in `metrics`; never fails, None when nothing was begun."""
        if not spec.read_ahead:
            return None
        name = spec.name

        def done(outcome: Outcome) -> None:
            if outcome.skipped:
                log.debug("%s: no read-ahead (%s): %s", who, why, outcome.skipped)
                return
            metrics.read_ahead_bytes.labels(name).inc(outcome.bytes)
            metrics.read_ahead_files.labels(name).inc(outcome.files)
            log.debug("%s: read ahead %d files, %d MiB (%s)", who, outcome.files,
                      outcome.bytes >> 20, why)  # fmt: skip

        try:
            return self.start(spec.model, spec.engine_env(), room_mb, done)
        except Exception as err:  # a hint only
            log.debug("%s: read-ahead not begun: %r", who, err)
            return None

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
            job = partial(read_ahead, model, env, room, self.margin_mb, self._stop)
            outcome = await loop.run_in_executor(self._executor, job)
            done(outcome)
        except Exception as err:  # a read-ahead is a hint: it never fails anything
            log.debug("read-ahead of %s failed: %r", model, err)
            return Outcome(skipped=f"failed: {err!r}")
        return outcome

    async def wait(self, timeout: float | None = None) -> None:
        """Until the read-aheads in flight now have ended, or `timeout` (tests, shutdown)."""
        if self._running:
            await asyncio.wait(list(self._running.values()), timeout=timeout)

    def close(self) -> None:
        """Stop the reads (the one under way at its next window) and the thread (shutdown)."""
        self._stop.set()
        self._executor.shutdown(wait=False, cancel_futures=True)
