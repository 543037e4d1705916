"""The C heap's settings for a process that receives large request bodies.

A large body is kept as the pieces it arrived in (`body.Pieces`, up to 256 KiB each) until it
has gone to the engine. glibc's defaults hand pieces of that size fresh pages from the kernel
(mmap, or a heap that was given back after the previous request), and touching fresh pages costs
more than copying the body (the figures: docs/benchmarks.md, "Measurements behind the design").
`tune` keeps them: allocations below `MMAP_THRESHOLD` come from the heap, and up to
`TRIM_THRESHOLD` of free heap is kept for the next request instead of being given back. Setting
either turns off glibc's own adjustment of both, so both are set. Elsewhere than glibc, nothing
is done.

glibc's trim threshold only gives back the top of the heap: pages freed below a chunk still in
use stay resident, and after bursts of large bodies the proxy stays hundreds of MiB above its
low, however long it then idles. So the bodies'
accounting (`intake.Bodies`) calls `give_back` once the bytes of bodies held have fallen more
than `TRIM_THRESHOLD` below their high mark since the last call: ``malloc_trim`` gives back
every free page wherever it lies, and about ``TRIM_THRESHOLD`` of freed heap at most is kept.
Its cost grows with what it gives back and is paid on the event loop: in a thread it would not
help, glibc holds the heap's lock meanwhile. A steady
flow of large bodies, each reusing the pages of the last, is never trimmed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: mallopt(3) parameters.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's own ceiling for its adjusted threshold
TRIM_THRESHOLD = 128 * 1024 * 1024


def _glibc() -> Any:
    """The C library when it is glibc (musl has a mallopt that ignores these), else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt  # noqa: B018
        libc.malloc_trim  # noqa: B018
        libc.gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def tune() -> bool:
    """Apply the settings; False where the C library has no mallopt (not glibc)."""
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        log.warning("could not set the C heap's thresholds; large bodies may be slower")
    return ok


def give_back() -> Callable[[], None] | None:
    """A function that gives every free page of the heap back to the kernel; None where the
    C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return None
    trim = libc.malloc_trim
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def run() -> None:
        began = time.perf_counter()
        trim(0)
        log.debug("free heap given back in %.1f ms", (time.perf_counter() - began) * 1000)

    return run
