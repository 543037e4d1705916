"""Pure placement decisions: where a model starts and which idle models make room for it.

Everything here is a function of a snapshot (devices, instances, the demand) and returns a
value: no asyncio, no I/O, no clock. Admission (`admission.py`) builds the snapshot (one
`InstanceView` per placed instance, its `Phase` read from the instance's state), calls `plan()`,
puts to sleep and stops the instances named in `Plan.sleep` and `Plan.evict`, waits for their
memory to come back and then starts the engine on `Plan.devices`.

Memory rule, per device: ``free = total - used - pending - reserve``; a demand fits a device set
when ``free >= footprint`` on every device of the set. ``used`` is what the device reports now
(other users of the GPU included), ``pending`` is memory promised to engines that have not
allocated it yet, ``reserve`` is headroom the proxy never hands out.

Reclaim policy (sleep before stop, never a busy engine):

* only idle instances (`Phase.RUNNING` with no lease and nothing queued, or `Phase.ASLEEP`),
  not pinned, may be touched; starting, waking, stopping and falling-asleep ones (`MOVING`)
  hold memory that comes back (or is needed) soon, so a demand that needs it waits;
* instances inside their minimum residency that are still in use (``protected``: the caller
  decides, see `admission`) are not touched either;
* victims are taken cheapest first. The price of a victim is what bringing it back costs per
  second it has been idle: ``restore_s / idle_s``, where ``restore_s`` is its measured wake time
  plus its measured sleep time for a sleep (the waiter waits for the sleep: a fresh engine's
  first level-1 sleep, which allocates its pinned host buffers, can take many seconds) and
  its measured cold start for a stop (the cold start less the wake for one
  already asleep; to the nearest power of two, 4 s at least, so that noise between alike
  models does not outweigh recency), so a model that takes a minute to come back is kept over
  one that wakes in seconds unless it has been idle far longer. Lower priority (a higher
  ``priority`` value) goes before any price; with no clock given (``now=None``) or nothing
  measured the order is least recently used first;
* first, idle RUNNING instances with a sleep policy are put to sleep, cheapest first, each
  freeing ``footprint - sleep_mb``;
* then, if memory is still short, instances are stopped cheapest first: asleep ones (freeing
  what they still hold), RUNNING ones without a sleep policy, and ones chosen to sleep above
  (stopped instead); an instance is only taken when it frees memory on a device of the set that
  still lacks some, and a model on several devices frees its memory on each of them;
* once the demand fits, actions that are not needed after all are undone, the dearest first (a
  stop becomes a sleep again where that is enough, then goes);
* among device sets that can be made to fit, the winner is the one that shares the fewest
  devices with the model's other replicas (a replica on a GPU of its own adds compute), then the
  one with the fewest megabytes stopped (an instance counts ``what it holds x number of its
  devices``), then the fewest instances stopped, then the fewest megabytes put to sleep, then
  the least free memory left on the set after the start (best fit: big holes stay for big
  models), then the lowest device ids.

Among sets that share as many devices with the model's other replicas, one that fits without
reclaiming anything always beats one that needs it, and best fit decides among those. A set that
shares fewer devices wins even when it takes putting idle instances to sleep or stopping them.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import combinations


@dataclass(frozen=True)
class DeviceView:
    """One GPU as the planner sees it, in MiB.

    ``used_mb`` is everything in use now, including processes the proxy does not own.
    ``pending_mb`` is memory promised to engines that are starting but have not allocated it yet
    (their footprint minus what their processes hold now); it counts as used.
    """

    id: int
    total_mb: int
    used_mb: int
    pending_mb: int = 0


class Phase(enum.Enum):
    """Where an instance is, as far as memory goes."""

    #: Awake (serving, or draining): holds its footprint; idle, it may be put to sleep or stopped.
    RUNNING = "running"
    #: Admitted, allocating: holds (or is promised) its footprint; never touched.
    STARTING = "starting"
    #: Being stopped: its memory comes back soon, so a demand that needs it waits.
    STOPPING = "stopping"
    #: Asleep (its /sleep call returned): `footprint_mb` is what it still holds; it may be
    #: stopped.
    ASLEEP = "asleep"
    #: Its /sleep call is in flight: its memory still counts as awake; never touched.
    FALLING_ASLEEP = "falling_asleep"
    #: A wake waiting for memory or in flight: holds what it holds; never touched.
    WAKING = "waking"


#: Phases whose memory is about to change: never touched, and a demand that needs it waits.
MOVING = frozenset({Phase.STARTING, Phase.STOPPING, Phase.FALLING_ASLEEP, Phase.WAKING})


@dataclass(frozen=True)
class InstanceView:
    """One placed instance: its per-device footprint, where it runs and whether it may go."""

    #: The instance id (``<model>#<n>``).
    name: str
    footprint_mb: int
    devices: tuple[int, ...]
    phase: Phase
    leases: int
    #: When it was last used (any clock, the one `plan()`'s ``now`` is on).
    last_used: float
    pinned: bool
    #: What it would hold asleep, per device, when it may be put to sleep (None: it may not).
    sleep_mb: int | None = None
    #: Lower values matter more (vLLM's rule for request priorities): among the idle, the
    #: highest value is put to sleep or stopped first.
    priority: int = 0
    #: Inside its minimum residency and in use: not put to sleep or stopped for this demand.
    protected: bool = False
    #: Measured seconds to bring it back after a stop (a cold start) and after a sleep (a
    #: wake); None: not measured yet (the defaults below stand in).
    start_s: float | None = None
    wake_s: float | None = None
    #: Measured seconds its /sleep call takes (the waiter for its memory waits that long; the
    #: first level-1 sleep of an engine, which allocates its pinned host buffers, is the
    #: slowest); None: not measured yet (no price added).
    sleep_s: float | None = None


@dataclass(frozen=True)
class Demand:
    """A model that wants to start: `footprint_mb` on each of `tp` devices (vLLM's world size on
    this node: tensor x pipeline x context x local data parallel).

    ``allowed_devices`` restricts placement to those device ids (None: any device);
    ``reserve_mb`` is headroom left free on every device.
    """

    name: str
    footprint_mb: int
    tp: int
    allowed_devices: tuple[int, ...] | None
    reserve_mb: int
    #: Devices the model's other replicas use: a set without them is preferred (a replica on
    #: a GPU of its own adds compute), even when that takes reclaiming idle memory.
    avoid_devices: tuple[int, ...] = ()
    #: The model's other replicas: never taken for it (stopping one to start another gains
    #: nothing and leaves the model with fewer engines meanwhile).
    siblings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    """Start on `devices` after putting the instances in `sleep` to sleep and stopping those
    in `evict` (each in that order, cheapest first)."""

    devices: tuple[int, ...]
    evict: tuple[str, ...]
    sleep: tuple[str, ...] = ()


@dataclass(frozen=True)
class NoFit:
    """The demand cannot be placed now (or ever); `blockers` name the models holding memory."""

    reason: str
    blockers: tuple[str, ...]


def never_fits(demand: Demand, devices_total: Mapping[int, int]) -> str | None:
    """Why `demand` can never be placed on these devices (id -> total MiB), or None.

    Used at config load and by `plan()`: a demand never fits when ``tp < 1``, when fewer than
    ``tp`` allowed devices exist, or when fewer than ``tp`` of them have
    ``total - reserve >= footprint`` even with nothing else running.
    """
    if demand.tp < 1:
        return f"model '{demand.name}': its GPU count must be at least 1, got {demand.tp}"
    allowed = _allowed(demand, devices_total)
    if demand.tp > len(allowed):
        where = _device_list(allowed) if allowed else "none"
        wanted = demand.allowed_devices if demand.allowed_devices is not None else "any"
        return (
            f"model '{demand.name}' needs {demand.tp} GPU(s) but only {len(allowed)} can be used "
            f"(allowed: {wanted}; present and allowed: {where})"
        )
    big = [d for d in allowed if devices_total[d] - demand.reserve_mb >= demand.footprint_mb]
    if len(big) < demand.tp:
        largest = max(devices_total[d] for d in allowed)
        return (
            f"model '{demand.name}' needs {demand.footprint_mb} MiB on each of {demand.tp} GPU(s) "
            f"but only {len(big)} allowed GPU(s) are large enough (largest: {largest} MiB, "
            f"reserve {demand.reserve_mb} MiB); lower its memory or max_model_len, or raise "
            "tensor_parallel_size or pipeline_parallel_size"
        )
    return None


#: Stand-ins for restore times not measured yet (equal for every model: the order stays LRU).
DEFAULT_START_S = 60.0
DEFAULT_WAKE_S = 5.0
#: Idle time below this counts as this much (a model used a moment ago is not infinitely dear).
MIN_IDLE_S = 1.0
#: Restore times below this count as this much (see `_coarse`).
MIN_RESTORE_S = 4.0


def plan(
    demand: Demand,
    devices: Sequence[DeviceView],
    instances: Sequence[InstanceView],
    now: float | None = None,
) -> Plan | NoFit:
    """Choose devices for `demand`, evicting idle models if needed (see the module docstring).

    `now` (on the clock of ``last_used``; admission uses ``time.monotonic()``) turns on the
    price order of victims; without it they are taken least recently used first. Returns a
    `Plan`, or a `NoFit` whose reason says what is missing and whose blockers name the busy,
    pinned, protected, starting, waking or stopping instances that hold memory on the allowed
    devices.
    """
    by_id = {d.id: d for d in devices}
    reason = never_fits(demand, {d.id: d.total_mb for d in devices})
    if reason is not None:
        return NoFit(reason, ())
    free = {i: _free(d, demand.reserve_mb) for i, d in by_id.items()}
    evictable = _evictable(demand, instances)
    prices = _Prices(now)
    best: tuple[tuple[int, int, int, int, int, tuple[int, ...]], Plan] | None = None
    for ids in combinations(_allowed(demand, by_id), demand.tp):
        chosen = _reclaim(demand.footprint_mb, {i: free[i] for i in ids}, evictable, prices)
        if chosen is None:
            continue
        slept, stopped = chosen
        shared = len(set(ids) & set(demand.avoid_devices))
        key = (shared, *_cost(demand.footprint_mb, ids, free, slept, stopped))
        if best is None or key < best[0]:
            plan_ = Plan(ids, tuple(m.name for m in stopped), tuple(m.name for m in slept))
            best = (key, plan_)
    if best is not None:
        return best[1]
    return _no_fit(demand, _allowed(demand, by_id), free, instances, evictable)


def after(
    demand: Demand,
    decision: Plan,
    devices: Sequence[DeviceView],
    instances: Sequence[InstanceView],
) -> tuple[list[DeviceView], list[InstanceView]]:
    """The snapshot once `decision` for `demand` has been carried out: the instances it puts
    to sleep are asleep at their ``sleep_mb``, those it stops are gone, and the demand holds
    its footprint on ``decision.devices``, starting (a wake's demand, whose instance is in the
    snapshot already, adds its footprint to what that instance holds). What a waiter behind
    the first one leaves to the first is judged on this (see `queueing.turn`)."""
    used = {d.id: d.used_mb for d in devices}
    out: list[InstanceView] = []
    own: InstanceView | None = None
    for m in instances:
        if m.name in decision.evict:
            _release(used, m, m.footprint_mb)
            continue
        if m.name in decision.sleep and m.sleep_mb is not None:
            m = _asleep(used, m)
        if m.name == demand.name:
            own = m
            continue
        out.append(m)
    for i in decision.devices:
        used[i] = used.get(i, 0) + demand.footprint_mb
    held = own.footprint_mb if own is not None else 0
    out.append(
        InstanceView(demand.name, held + demand.footprint_mb, decision.devices, Phase.STARTING,
                     0, own.last_used if own is not None else 0.0,
                     own.pinned if own is not None else False)
    )  # fmt: skip
    return [replace(d, used_mb=used[d.id]) for d in devices], out


def settled(
    demand: Demand, devices: Sequence[DeviceView], instances: Sequence[InstanceView]
) -> tuple[list[DeviceView], list[InstanceView]]:
    """The snapshot once every engine in motion has arrived and every request has ended: a
    start or wake is awake and idle, a sleep has left its ``sleep_mb``, a stop has given its
    memory back, and no engine holds a lease (the demand's own instance is left as it is).
    What `demand` could take by waiting, rather than by stopping engines now."""
    used = {d.id: d.used_mb for d in devices}
    out: list[InstanceView] = []
    for m in instances:
        if m.name == demand.name:
            out.append(m)
            continue
        if m.phase is Phase.STOPPING:
            _release(used, m, m.footprint_mb)
            continue
        if m.phase is Phase.FALLING_ASLEEP and m.sleep_mb is not None:
            m = _asleep(used, m)
        elif m.phase in (Phase.STARTING, Phase.WAKING, Phase.FALLING_ASLEEP):
            m = replace(m, phase=Phase.RUNNING)
        out.append(replace(m, leases=0, protected=False))
    return [replace(d, used_mb=used[d.id], pending_mb=0) for d in devices], out


def _release(used: dict[int, int], m: InstanceView, mb: int) -> None:
    """`used` once `m` has given back `mb` on each of its devices."""
    for i in m.devices:
        used[i] = used.get(i, 0) - mb


def _asleep(used: dict[int, int], m: InstanceView) -> InstanceView:
    """`m` asleep at its ``sleep_mb`` (with no lease), `used` updated for what it gave back."""
    assert m.sleep_mb is not None
    _release(used, m, m.footprint_mb - m.sleep_mb)
    return replace(m, footprint_mb=m.sleep_mb, phase=Phase.ASLEEP, leases=0)


def _allowed(demand: Demand, present: Iterable[int]) -> list[int]:
    ids = sorted(present)
    if demand.allowed_devices is None:
        return ids
    return [i for i in ids if i in demand.allowed_devices]


def _free(device: DeviceView, reserve_mb: int) -> int:
    return device.total_mb - device.used_mb - device.pending_mb - reserve_mb


def _evictable(demand: Demand, instances: Sequence[InstanceView]) -> list[InstanceView]:
    """Instances that may be put to sleep or stopped, least recently used first (name breaks
    ties): idle RUNNING ones and asleep ones, never pinned or protected ones, the demand
    itself or its siblings."""
    ok = [
        m
        for m in instances
        if ((m.phase is Phase.RUNNING and m.leases == 0) or m.phase is Phase.ASLEEP)
        and not (m.pinned or m.protected)
        and m.name != demand.name
        and m.name not in demand.siblings
    ]
    return sorted(ok, key=lambda m: (m.last_used, m.name))


def _coarse(seconds: float) -> float:
    """A restore time to the nearest power of two, `MIN_RESTORE_S` at least: the noise between
    two starts of the same model (or of two alike) does not outweigh recency, and a few
    seconds' wake or start are alike."""
    return 2.0 ** round(math.log2(max(seconds, MIN_RESTORE_S)))


class _Prices:
    """The order victims are taken in: lower priority first, then the lower price (restore
    seconds per idle second), then least recently used."""

    def __init__(self, now: float | None) -> None:
        self.now = now

    def key(self, m: InstanceView, stop: bool) -> tuple[int, float, float, str]:
        if self.now is None:
            return (-m.priority, 0.0, m.last_used, m.name)
        wake = m.wake_s if m.wake_s is not None else DEFAULT_WAKE_S
        start = m.start_s if m.start_s is not None else DEFAULT_START_S
        if not stop:
            restore = wake + (m.sleep_s or 0.0)
        elif m.phase is Phase.ASLEEP:
            restore = max(start - wake, 0.0)  # it would have needed a wake anyway
        else:
            restore = start
        idle = max(self.now - m.last_used, MIN_IDLE_S)
        return (-m.priority, _coarse(restore) / idle, m.last_used, m.name)

    def order(self, models: Iterable[InstanceView], stop: bool) -> list[InstanceView]:
        return sorted(models, key=lambda m: self.key(m, stop))


def _sleep_gain(m: InstanceView) -> int:
    """MiB per device that putting `m` to sleep frees (0 when it cannot sleep)."""
    if m.phase is not Phase.RUNNING or m.sleep_mb is None:
        return 0
    return max(m.footprint_mb - m.sleep_mb, 0)


Reclaim = tuple[tuple[InstanceView, ...], tuple[InstanceView, ...]]


def _reclaim(
    footprint: int, free: dict[int, int], evictable: list[InstanceView], prices: _Prices
) -> Reclaim | None:
    """(to sleep, to stop) so that `footprint` fits on every device of `free`, or None."""
    deficit = {i: footprint - f for i, f in free.items()}

    def short() -> bool:
        return any(v > 0 for v in deficit.values())

    def touches(m: InstanceView) -> bool:
        return any(deficit.get(i, 0) > 0 for i in m.devices)

    def gain(m: InstanceView, mb: int) -> None:
        for i in m.devices:
            if i in deficit:
                deficit[i] -= mb

    slept: list[InstanceView] = []
    for m in prices.order(evictable, stop=False):  # first: sleep, cheapest first
        if not short():
            break
        if _sleep_gain(m) > 0 and touches(m):
            slept.append(m)
            gain(m, _sleep_gain(m))
    stopped: list[InstanceView] = []
    for m in prices.order(evictable, stop=True):  # then: stop, cheapest first
        if not short():
            break
        if not touches(m):
            continue
        if m in slept:
            slept.remove(m)
            gain(m, m.footprint_mb - _sleep_gain(m))
        else:
            gain(m, m.footprint_mb)
        stopped.append(m)
    if short():
        return None
    return _prune(footprint, free, slept, stopped, prices)


def _prune(
    footprint: int,
    free: dict[int, int],
    slept: list[InstanceView],
    stopped: list[InstanceView],
    prices: _Prices,
) -> Reclaim:
    """Undo actions the plan does not need, sparing the dearest first: a stop becomes a sleep
    where that is enough, or goes; then sleeps go."""
    sleep, stop = list(slept), list(stopped)
    for m in reversed(prices.order(stopped, stop=True)):
        rest = [k for k in stop if k is not m]
        if _fits_after(footprint, free, sleep, rest):
            stop = rest
        elif _sleep_gain(m) > 0 and _fits_after(footprint, free, [*sleep, m], rest):
            stop, sleep = rest, [*sleep, m]
    for m in reversed(prices.order(sleep, stop=False)):
        rest = [k for k in sleep if k is not m]
        if _fits_after(footprint, free, rest, stop):
            sleep = rest
    order = {id(m): n for n, m in enumerate(prices.order(slept + stopped, stop=True))}
    return (tuple(sorted(sleep, key=lambda m: order[id(m)])),
            tuple(sorted(stop, key=lambda m: order[id(m)])))  # fmt: skip


def _fits_after(
    footprint: int,
    free: dict[int, int],
    slept: Iterable[InstanceView],
    stopped: Iterable[InstanceView],
) -> bool:
    room = dict(free)
    for m, mb in [*((m, _sleep_gain(m)) for m in slept), *((m, m.footprint_mb) for m in stopped)]:
        for i in m.devices:
            if i in room:
                room[i] += mb
    return all(v >= footprint for v in room.values())


def _cost(
    footprint: int,
    ids: tuple[int, ...],
    free: dict[int, int],
    slept: tuple[InstanceView, ...],
    stopped: tuple[InstanceView, ...],
) -> tuple[int, int, int, int, tuple[int, ...]]:
    """Sort key: MiB stopped, instances stopped, MiB put to sleep, free MiB left on the set
    afterwards, device ids."""
    stopped_mb = sum(m.footprint_mb * len(m.devices) for m in stopped)
    slept_mb = sum(_sleep_gain(m) * len(m.devices) for m in slept)
    left = sum(free[i] - footprint for i in ids)
    left += sum(m.footprint_mb for m in stopped for i in m.devices if i in ids)
    left += sum(_sleep_gain(m) for m in slept for i in m.devices if i in ids)
    return (stopped_mb, len(stopped), slept_mb, left, ids)


def _no_fit(
    demand: Demand,
    allowed: list[int],
    free: dict[int, int],
    instances: Sequence[InstanceView],
    evictable: list[InstanceView],
) -> NoFit:
    """Explain a miss: the most each device could offer and who holds the rest."""
    best = dict(free)
    for m in evictable:
        for i in m.devices:
            if i in best:
                best[i] += m.footprint_mb
    held = [
        m
        for m in instances
        if m.name != demand.name and m not in evictable and any(i in allowed for i in m.devices)
    ]
    held.sort(key=lambda m: (-m.footprint_mb * len(m.devices), m.name))
    offer = ", ".join(f"GPU{i} {max(best[i], 0)} MiB" for i in allowed)
    reason = (
        f"not enough GPU memory for model '{demand.name}': it needs {demand.footprint_mb} MiB "
        f"on each of {demand.tp} GPU(s); after stopping every idle model the most free would be "
        f"{offer}"
    )
    if held:
        reason += "; memory is held by " + ", ".join(_why_held(m, demand) for m in held)
    else:
        reason += "; the rest is used outside the proxy"
    return NoFit(reason, tuple(m.name for m in held))


_MOVING_WHY = {
    Phase.STARTING: "starting",
    Phase.WAKING: "waking",
    Phase.FALLING_ASLEEP: "going to sleep",
    Phase.STOPPING: "stopping",
}


def _why_held(m: InstanceView, demand: Demand) -> str:
    if m.phase in MOVING:
        why = _MOVING_WHY[m.phase]
    elif m.leases:
        why = f"{m.leases} request(s) in flight"
    elif m.protected:
        why = "inside its minimum residency"
    elif m.name in demand.siblings:
        why = "another replica of the same model"
    else:
        why = "pinned"
    return f"'{m.name}' ({m.footprint_mb} MiB on {_device_list(m.devices)}, {why})"


def _device_list(ids: Iterable[int]) -> str:
    return ",".join(f"GPU{i}" for i in ids)
