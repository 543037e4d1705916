"""The C heap's settings for a process that receives large request bodies.

A large body is kept as the pieces it arrived in (`body.Pieces`, up to 256 KiB each) until it
has gone to the engine. glibc's defaults hand pieces of that size fresh pages from the kernel
(mmap, or a heap that was given back after the previous request), and touching fresh pages
cost more than copying the body: a 10 MB request took 2.5-3.5 ms longer through the proxy than
with the pages kept. `tune` keeps them: allocations below `MMAP_THRESHOLD` come from the heap,
and up to `TRIM_THRESHOLD` of free heap is kept for the next request instead of being given
back (the proxy's resident memory can stay that much above its low after a burst of large
bodies). Setting either turns off glibc's own adjustment of both, so both are set. Elsewhere
than glibc, nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

#: mallopt(3) parameters.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's own ceiling for its adjusted threshold
TRIM_THRESHOLD = 128 * 1024 * 1024


def tune() -> bool:
    """Apply the settings; False where the C library has no mallopt (not glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018  # glibc only: musl has a mallopt that ignores these
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        log.warning("could not set the C heap's thresholds; large bodies may be slower")
    return ok
