"""Host RAM for sleeps: what is available to the proxy's engines, what a sleep pins, what stays.

A sleep copies CuMem pools into pinned host memory: level 1 the weights and the ``runtime`` pool,
level 2 the ``runtime`` pool alone (vLLM 0.33 ``device_allocator/sleep_mode_backend.py:127-137``),
one ``torch.empty(..., pin_memory=True)`` backup per allocation (``device_allocator/cumem.py:
256-276``). The backups come from PyTorch's caching host allocator, which rounds each block up
to a power of two and keeps freed blocks cached; at the wake vLLM drops its references
(``cumem.py:360``) but never empties that cache, so the blocks stay with the engine for the rest
of its life and its next sleep reuses them. How much that is for a given engine is not assumed:
each engine's host memory (the resident set of its process tree) is measured across its sleeps,
what it grew by stays counted against that engine (`HostRam.retained`), and what the first sleep
of a model at a level pinned becomes the figure its later sleeps are planned with.

Whether a sleep fits is judged against the smaller of the host's available memory and the room
left in the proxy's cgroup and every cgroup above it (in a container, or under systemd's
``MemoryMax=`` on the proxy's own unit, the host's figure is not the limit), less what sleeps
already under way were promised: two victims put to sleep together must not both count the same
free memory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import psutil

MIB = 1024 * 1024
#: Where the cgroup hierarchy is mounted (v2; v1 mounts each controller below it).
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: This process's cgroup membership.
PROC_CGROUP = Path("/proc/self/cgroup")
#: What a sleep of a model pins is learned by: its name and its engine (`Instance.host_key`).
LearnKey = tuple[str, str]


def own_cgroups(proc_cgroup: Path = PROC_CGROUP) -> tuple[str | None, str | None]:
    """This process's cgroup paths (v2 unified, v1 memory controller), None where absent."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    v2 = v1 = None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _levels(base: Path, path: str | None) -> list[Path]:
    """`base`/`path` and every directory above it up to `base`, innermost first."""
    parts = [p for p in (path or "").split("/") if p and p not in (".", "..")]
    return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _room(directory: Path, limit_file: str, usage_file: str) -> int | None:
    """MiB a cgroup may still take, None when unlimited or unreadable."""
    try:
        limit = (directory / limit_file).read_text().strip()
        usage = (directory / usage_file).read_text().strip()
    except OSError:
        return None
    if limit == "max" or not limit.isdigit() or not usage.isdigit():
        return None
    if int(limit) >= 2**60:  # v1 writes "no limit" as a huge number
        return None
    return max(int(limit) - int(usage), 0) // MIB


def cgroup_room_mb(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """MiB the proxy's cgroup may still take: the tightest of its own cgroup and every one above
    it (v2; else v1's memory controller), None when none of them is limited or readable."""
    v2, v1 = own_cgroups(proc_cgroup)
    rooms = [_room(d, "memory.max", "memory.current") for d in _levels(root, v2)]
    rooms += [
        _room(d, "memory.limit_in_bytes", "memory.usage_in_bytes")
        for d in _levels(root / "memory", v1)
    ]
    known = [r for r in rooms if r is not None]
    return min(known) if known else None


def available_mb(root: Path = CGROUP_ROOT) -> int:
    """Host RAM available to new allocations of the proxy's engines, in MiB."""
    host = int(psutil.virtual_memory().available) // MIB
    room = cgroup_room_mb(root)
    return host if room is None else min(host, room)


def tree_rss_mb(pid: int | None) -> int | None:
    """The resident memory of process `pid` and all its descendants, in MiB (None: gone).

    Pinned host memory is resident in the process that pinned it, so an engine's pinned
    backups show here (with whatever else it allocated meanwhile, which is host memory too)."""
    if pid is None:
        return None
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for proc in procs:
        try:
            total += int(proc.memory_info().rss)
        except psutil.Error:
            continue
    return total // MIB


class HostRam:
    """The one owner of host RAM figures for sleeps: what sleeps in flight were promised, what
    each engine keeps pinned, and what a sleep of each model was measured to pin."""

    def __init__(
        self,
        reader: Callable[[], int] | None = None,
        rss: Callable[[int | None], int | None] | None = None,
    ) -> None:
        self._read = reader or available_mb
        #: The host memory of an engine's process tree (by its pid), for measurements.
        self.rss = rss or tree_rss_mb
        self.promised: dict[str, int] = {}
        #: Host MiB each live instance keeps pinned (grown across its sleeps), by instance id.
        self.retained: dict[str, int] = {}
        #: What an engine of the model keeps pinned once it slept at a level, as measured.
        self.learned: dict[tuple[LearnKey, int], int] = {}

    def room_mb(self) -> int:
        """Available host RAM less what sleeps in flight were promised."""
        return int(self._read()) - sum(self.promised.values())

    def need_mb(self, instance_id: str, key: LearnKey, level: int, guess: int) -> int:
        """What a sleep of `instance_id` at `level` pins beyond what it already keeps pinned:
        the model's measured figure for that level, else `guess`."""
        expected = self.learned.get((key, level), guess)
        return max(expected - self.retained.get(instance_id, 0), 0)

    def promise(self, instance_id: str, mb: int) -> None:
        """`instance_id`'s sleep will pin `mb`: later decisions count it until `settle()`."""
        self.promised[instance_id] = mb

    def settle(self, instance_id: str) -> None:
        """The sleep returned (its pinned memory now shows as used) or failed."""
        self.promised.pop(instance_id, None)

    def slept(self, instance_id: str, key: LearnKey, level: int, grown_mb: int | None) -> None:
        """`instance_id`'s sleep at `level` returned, its host memory grown by `grown_mb` (None:
        not measured): that stays pinned for the engine's life, and what the engine now keeps
        is what a sleep at that level pins for its model."""
        if grown_mb is None:
            return
        before = self.retained.get(instance_id, 0)
        kept = before + max(grown_mb, 0)
        self.retained[instance_id] = kept
        # A first sleep shows its level's figure; a later one only level 1's (it pins all a
        # level-2 sleep does and the weights), a later level-2 sleep reuses what is cached.
        if before == 0 or level == 1:
            self.learned[(key, level)] = kept

    def forget(self, instance_id: str) -> None:
        """The engine is gone: its pinned memory went with its process."""
        self.retained.pop(instance_id, None)
        self.promised.pop(instance_id, None)
