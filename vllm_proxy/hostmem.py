"""Host RAM for level-1 sleeps: what is available to the proxy's engines, and what is promised.

A level-1 sleep copies an engine's weights and its ``runtime`` pool into pinned host memory
(vLLM 0.33 ``device_allocator/cumem.py:268-273``). Whether that fits is judged against the
smaller of the host's available memory and what the proxy's cgroup may still take (in a
container or under systemd's ``MemoryMax=`` the host's figure is not the limit), less what
sleeps already under way have been promised: two victims put to sleep together must not both
count the same free memory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import psutil

MIB = 1024 * 1024
#: Where the cgroup (v2) of this process is mounted.
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_room_mb(root: Path = CGROUP_ROOT) -> int | None:
    """MiB the cgroup may still take (limit less usage; v2, else v1), None when unlimited or
    unreadable."""
    for limit_file, usage_file in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        try:
            limit = (root / limit_file).read_text().strip()
            usage = (root / usage_file).read_text().strip()
        except OSError:
            continue
        if limit == "max" or not limit.isdigit() or not usage.isdigit():
            return None
        if int(limit) >= 2**60:  # v1 writes "no limit" as a huge number
            return None
        return max(int(limit) - int(usage), 0) // MIB
    return None


def available_mb(root: Path = CGROUP_ROOT) -> int:
    """Host RAM available to new allocations of the proxy's engines, in MiB."""
    host = int(psutil.virtual_memory().available) // MIB
    room = cgroup_room_mb(root)
    return host if room is None else min(host, room)


class HostRam:
    """The one owner of host RAM promised to level-1 sleeps in flight, by instance id."""

    def __init__(self, reader: Callable[[], int] | None = None) -> None:
        self._read = reader or available_mb
        self.promised: dict[str, int] = {}

    def room_mb(self) -> int:
        """Available host RAM less what sleeps in flight were promised."""
        return int(self._read()) - sum(self.promised.values())

    def promise(self, instance_id: str, mb: int) -> None:
        """`instance_id`'s sleep will pin `mb`: later decisions count it until `settle()`."""
        self.promised[instance_id] = mb

    def settle(self, instance_id: str) -> None:
        """The sleep returned (its pinned memory now shows as used) or failed."""
        self.promised.pop(instance_id, None)
