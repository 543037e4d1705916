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

A measurement is trusted where it is near the estimate, or where something else corroborates it:
RSS may miss pinned pages (drivers differ in where they account ``cudaHostAlloc`` memory), and a
sleep measured at 0 must not switch the host check off for every later sleep of its model. The
corroboration is the larger of the growth of ``shmem`` (the cgroup's ``memory.stat``, else
``Shmem`` in ``/proc/meminfo``) across the sleep, where current kernels account
``pin_memory=True`` pages, and what vLLM says it backed up (``CuMemAllocator: sleep freed ...
of which X GiB is backed up in CPU``, one line per rank, ``device_allocator/cumem.py:282-289``)
in the engine's log since the sleep began. Without either, a figure far below the estimate is
learned as ``max(estimate, measured)``.

Whether a sleep fits is judged against the smaller of the host's available memory and the room
left in the proxy's cgroup and every cgroup above it (in a container, or under systemd's
``MemoryMax=`` on the proxy's own unit, the host's figure is not the limit), less what sleeps
already under way were promised: two victims put to sleep together must not both count the same
free memory. A cgroup's usage counts its page cache (the engines' checkpoint reads, the proxy's
read-ahead), which the kernel reclaims before it fails an allocation; the room adds it back, as
the host's ``MemAvailable`` does: ``active_file + inactive_file`` from ``memory.stat`` (v1:
``total_active_file + total_inactive_file``). Shared memory (pinned backups among it) is not
file cache there, and is not added.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from ..engine_args import BACKED_UP
from ..errors import Unavailable

log = logging.getLogger(__name__)

MIB = 1024 * 1024
#: Where the cgroup hierarchy is mounted (v2; v1 mounts each controller below it).
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: This process's cgroup membership.
PROC_CGROUP = Path("/proc/self/cgroup")
#: Host RAM left free beyond what a sleep pins when choosing its level.
HOST_RAM_MARGIN_MB = 1024
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


#: The page cache a cgroup's ``memory.stat`` counts, by version: reclaimable before an
#: allocation fails.
FILE_CACHE_KEYS = {
    "memory.current": ("active_file", "inactive_file"),
    "memory.usage_in_bytes": ("total_active_file", "total_inactive_file"),
}


def read_stat(path: Path) -> dict[str, int]:
    """A ``memory.stat`` file as {key: bytes} ({} when unreadable)."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _room(directory: Path, limit_file: str, usage_file: str) -> int | None:
    """MiB a cgroup may still take, its reclaimable page cache counted as room; None when
    unlimited or unreadable."""
    try:
        limit = (directory / limit_file).read_text().strip()
        usage = (directory / usage_file).read_text().strip()
    except OSError:
        return None
    if limit == "max" or not limit.isdigit() or not usage.isdigit():
        return None
    if int(limit) >= 2**60:  # v1 writes "no limit" as a huge number
        return None
    stat = read_stat(directory / "memory.stat")
    cache = sum(stat.get(k, 0) for k in FILE_CACHE_KEYS[usage_file])
    used = max(int(usage) - min(cache, int(usage)), 0)
    return max(int(limit) - used, 0) // MIB


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


def shmem_mb(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """Shared memory (where pinned host pages are accounted) of the proxy's own cgroup (v2
    ``shmem``, v1 ``total_shmem``), else the host's (``Shmem`` in /proc/meminfo), in MiB."""
    v2, v1 = own_cgroups(proc_cgroup)
    for directory, key in ((_levels(root, v2)[0], "shmem"),
                           (_levels(root / "memory", v1)[0], "total_shmem")):  # fmt: skip
        stat = read_stat(directory / "memory.stat")
        if key in stat and (v2 if key == "shmem" else v1) not in (None, "/"):
            return stat[key] // MIB
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("Shmem:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


#: At most this much of an engine's log is read for one sleep's lines.
LOG_READ_BYTES = 256 * 1024


def log_size(path: Path) -> tuple[int, int]:
    """Where an engine's log ends now, as (inode, size) ((0, 0) when unreadable): where a
    sleep's lines begin."""
    try:
        st = path.stat()
    except OSError:
        return 0, 0
    return st.st_ino, st.st_size


def backed_up_mb(path: Path, mark: tuple[int, int]) -> int | None:
    """MiB vLLM says its ranks backed up in host memory, from the lines written to the log at
    `path` since `mark` (`log_size`; all ranks together); None when it said nothing there."""
    try:
        with path.open("rb") as f:
            st = os.fstat(f.fileno())
            same = (st.st_ino, min(st.st_size, mark[1])) == mark
            f.seek(mark[1] if same else 0)  # rotated meanwhile: from its start
            text = f.read(LOG_READ_BYTES).decode("utf-8", "replace")
    except OSError:
        return None
    found = [float(g) for g in BACKED_UP.findall(text)]
    return round(sum(found) * 1024) if found else None


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


#: A measurement below this share of the estimate needs corroboration to be learned.
TRUST_SHARE = 0.5


def trusted(measured_mb: int, guess_mb: int | None, corroborated_mb: int | None) -> int:
    """What a sleep is learned to pin: `measured_mb` where it is near the estimate (or there
    is none); where it is far below, the larger of it and an independent reading when one was
    had (it confirms a small pin or shows what RSS missed), else the estimate. Never 0 for a
    model whose estimate is not."""
    if guess_mb is None or measured_mb >= guess_mb * TRUST_SHARE:
        return measured_mb
    if corroborated_mb is not None and corroborated_mb > 0:
        return max(measured_mb, corroborated_mb)
    return max(guess_mb, measured_mb)


def sleep_levels(asked: int, reloadable: bool) -> list[int]:
    """The levels a sleep asked at `asked` may take, in order: level 1 falls back to level 2
    only where the model can reload its weights (a level-2 wake reads them again)."""
    return [1, 2] if asked == 1 and reloadable else [asked]


def sleep_guess(level: int, weights_mb: int | None, runtime_mb: int) -> int | None:
    """What a sleep at `level` pins in host RAM before it was measured, all devices together:

    - level 1: the weights and the runtime pool (None: the weights' size is not known);
    - level 2: the runtime pool alone."""
    if level != 1:
        return runtime_mb
    return None if weights_mb is None else weights_mb + runtime_mb


@dataclass(frozen=True)
class SleepMark:
    """Readings taken before a sleep (`HostRam.before_sleep`): the engine's resident memory,
    shared memory, and where its log ended."""

    rss_mb: int | None
    shmem_mb: int | None
    log_at: tuple[int, int]


class HostRam:
    """The one owner of host RAM figures for sleeps: what sleeps in flight were promised, what
    each engine keeps pinned, and what a sleep of each model was measured to pin."""

    def __init__(
        self,
        reader: Callable[[], int] | None = None,
        rss: Callable[[int | None], int | None] | None = None,
        shmem: Callable[[], int | None] | None = None,
    ) -> None:
        self._read = reader or available_mb
        #: The host memory of an engine's process tree (by its pid), for measurements ...
        self.rss = rss or tree_rss_mb
        #: ... and the shared memory that corroborates them (None: unknown).
        self.shmem = shmem or shmem_mb
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

    def choose_level(
        self,
        instance_id: str,
        key: LearnKey,
        asked: int,
        guesses: dict[int, int | None],
        free: Callable[[int], bool],
    ) -> int | None:
        """The first of `guesses`' levels (in order, each with what it pins: `sleep_guess`)
        whose pin fits, promised until `settle()`; None when none fits:

        - a level whose pin is not known is taken as it is;
        - a level is taken when what it pins beyond what the engine already keeps (`need_mb`)
          plus `HOST_RAM_MARGIN_MB` fits in `room_mb()`, or when `free(short)` stops engines
          asleep to free what is short;
        - else the next level is tried."""
        room = self.room_mb()
        for level, guess in guesses.items():
            if guess is None:  # nothing known of what it pins: as asked
                return level
            need = self.need_mb(instance_id, key, level, guess)
            short = need + HOST_RAM_MARGIN_MB - room if need else 0
            if short > 0 and not free(short):
                log.warning(
                    "%s: sleep level %d would pin ~%d MiB more in host RAM but only %d MiB are"
                    " available (cgroup limits and sleeps in flight counted)",
                    instance_id, level, need, room,
                )  # fmt: skip
                continue
            if level != asked:
                log.warning("%s: using level %d (the weights are reloaded from disk on wake)",
                            instance_id, level)  # fmt: skip
            if need:
                self.promise(instance_id, need)
            return level
        log.warning("%s: no sleep level fits in host RAM; stopping the engine instead",
                    instance_id)  # fmt: skip
        return None

    def promise_start(self, model: str, instance_id: str, need_mb: int) -> None:
        """An engine of `model` pins `need_mb` as it starts (V2's token buffer): promised until
        `settle()`, so that sleeps meanwhile count it; `Unavailable` when it is not there (vLLM
        would fail to pin it, or the kernel would kill something to make room)."""
        room = self.room_mb()
        if need_mb > room:
            raise Unavailable(
                f"model '{model}': not enough host memory to start: its engine pins "
                f"{need_mb} MiB for its token buffer (max_num_seqs x max_model_len x 4 bytes per "
                f"GPU), {room} MiB are available",
                code="insufficient_host_memory",
            )
        self.promise(instance_id, need_mb)

    def before_sleep(self, pid: int | None, log_path: Path) -> SleepMark:
        """Readings before a sleep of the engine `pid` (blocking: run it in a thread)."""
        return SleepMark(self.rss(pid), self.shmem(), log_size(log_path))

    def after_sleep(
        self, mark: SleepMark, pid: int | None, log_path: Path
    ) -> tuple[int | None, int | None]:
        """After the sleep (blocking): how much the engine's resident memory grew, and the
        larger of shared memory's growth and what vLLM says it backed up (None: unknown)."""
        rss, shmem = self.rss(pid), self.shmem()
        backed = backed_up_mb(log_path, mark.log_at)
        grown = None if mark.rss_mb is None or rss is None else rss - mark.rss_mb
        shared = None if mark.shmem_mb is None or shmem is None else shmem - mark.shmem_mb
        return grown, max((v for v in (shared, backed) if v is not None), default=None)

    @contextlib.contextmanager
    def start_promised(self, model: str, instance_id: str, need_mb: int) -> Iterator[None]:
        """`promise_start` for the block (nothing where its engine pins nothing)."""
        if need_mb <= 0:
            yield
            return
        self.promise_start(model, instance_id, need_mb)
        try:
            yield
        finally:
            self.settle(instance_id)

    def settle(self, instance_id: str) -> None:
        """The sleep returned (its pinned memory now shows as used) or failed."""
        self.promised.pop(instance_id, None)

    def slept(
        self,
        instance_id: str,
        key: LearnKey,
        level: int,
        grown_mb: int | None,
        guess_mb: int | None = None,
        corroborated_mb: int | None = None,
    ) -> None:
        """`instance_id`'s sleep at `level` returned, its host memory grown by `grown_mb` (None:
        not measured): that stays pinned for the engine's life, and what the engine now keeps
        is what a sleep at that level pins for its model. A figure far below `guess_mb` (the
        estimate) is learned only where an independent reading across the sleep,
        `corroborated_mb` (shared memory's growth, vLLM's own count), confirms it (the larger
        of the two is then learned); else the estimate is kept (`trusted`)."""
        if grown_mb is None:
            return
        before = self.retained.get(instance_id, 0)
        kept = before + max(grown_mb, 0)
        self.retained[instance_id] = kept
        # A first sleep shows its level's figure; a later one only level 1's (it pins all a
        # level-2 sleep does and the weights), a later level-2 sleep reuses what is cached.
        if before == 0 or level == 1:
            self.learned[(key, level)] = trusted(kept, guess_mb, corroborated_mb)

    def forget(self, instance_id: str) -> None:
        """The engine is gone: its pinned memory went with its process."""
        self.retained.pop(instance_id, None)
        self.promised.pop(instance_id, None)
