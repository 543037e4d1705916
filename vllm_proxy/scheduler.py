"""Pure placement decisions: where a model starts and which idle models make room for it.

Everything here is a function of a snapshot (devices, models, the demand) and returns a value:
no asyncio, no I/O, no clock. The manager builds the snapshot, calls `plan()`, stops the models
named in `Plan.evict` (least recently used first), waits for their memory to come back and then
starts the engine on `Plan.devices`.

Memory rule, per device: ``free = total - used - pending - reserve``; a demand fits a device set
when ``free >= footprint`` on every device of the set. ``used`` is what the device reports now
(other users of the GPU included), ``pending`` is memory promised to engines that have not
allocated it yet, ``reserve`` is headroom the proxy never hands out.

Eviction policy:

* only RUNNING models with no lease, not pinned and not starting may be evicted;
* they are taken least recently used first, and only when they free memory on a device of the
  set that still lacks some; a model on several devices frees its footprint on each of them;
* once the demand fits, chosen models that are not needed after all are put back, the most
  recently used first;
* among device sets that can be made to fit, the winner is the one with the fewest megabytes
  evicted (a model counts ``footprint x number of its devices``), then the fewest models evicted,
  then the least free memory left on the set after the start (best fit: big holes stay for big
  models), then the lowest device ids.

A set that fits without eviction evicts zero megabytes, so it always beats one that needs
eviction, and best fit decides among those.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ModelView:
    """One configured model: its per-device footprint, where it runs and whether it may go."""

    name: str
    footprint_mb: int
    devices: tuple[int, ...]
    running: bool
    leases: int
    last_used: float
    pinned: bool
    starting: bool = False
    #: Being stopped: its memory comes back soon, so a demand that needs it waits.
    stopping: bool = False


@dataclass(frozen=True)
class Demand:
    """A model that wants to start: `footprint_mb` on each of `tp` devices.

    ``allowed_devices`` restricts placement to those device ids (None: any device);
    ``reserve_mb`` is headroom left free on every device.
    """

    name: str
    footprint_mb: int
    tp: int
    allowed_devices: tuple[int, ...] | None
    reserve_mb: int


@dataclass(frozen=True)
class Plan:
    """Start on `devices` after stopping the models in `evict` (in that order, LRU first)."""

    devices: tuple[int, ...]
    evict: tuple[str, ...]


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
        return f"model '{demand.name}': tensor parallel size must be at least 1, got {demand.tp}"
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
            "tensor_parallel_size"
        )
    return None


def plan(
    demand: Demand, devices: Sequence[DeviceView], models: Sequence[ModelView]
) -> Plan | NoFit:
    """Choose devices for `demand`, evicting idle models if needed (see the module docstring).

    Returns a `Plan`, or a `NoFit` whose reason says what is missing and whose blockers name the
    busy, pinned, starting or stopping models that hold memory on the allowed devices.
    """
    by_id = {d.id: d for d in devices}
    reason = never_fits(demand, {d.id: d.total_mb for d in devices})
    if reason is not None:
        return NoFit(reason, ())
    free = {i: _free(d, demand.reserve_mb) for i, d in by_id.items()}
    evictable = _evictable(demand, models)
    best: tuple[tuple[int, int, int, tuple[int, ...]], Plan] | None = None
    for ids in combinations(_allowed(demand, by_id), demand.tp):
        chosen = _evictions(demand.footprint_mb, {i: free[i] for i in ids}, evictable)
        if chosen is None:
            continue
        key = _cost(demand.footprint_mb, ids, free, chosen)
        if best is None or key < best[0]:
            best = (key, Plan(ids, tuple(m.name for m in chosen)))
    if best is not None:
        return best[1]
    return _no_fit(demand, _allowed(demand, by_id), free, models, evictable)


def _allowed(demand: Demand, present: Iterable[int]) -> list[int]:
    ids = sorted(present)
    if demand.allowed_devices is None:
        return ids
    return [i for i in ids if i in demand.allowed_devices]


def _free(device: DeviceView, reserve_mb: int) -> int:
    return device.total_mb - device.used_mb - device.pending_mb - reserve_mb


def _evictable(demand: Demand, models: Sequence[ModelView]) -> list[ModelView]:
    """Models that may be stopped, least recently used first (name breaks ties)."""
    ok = [
        m
        for m in models
        if m.running and m.leases == 0 and not m.pinned and not m.starting and m.name != demand.name
    ]
    return sorted(ok, key=lambda m: (m.last_used, m.name))


def _evictions(
    footprint: int, free: dict[int, int], evictable: list[ModelView]
) -> tuple[ModelView, ...] | None:
    """The models to stop so `footprint` fits on every device of `free`, or None if impossible."""
    deficit = {i: footprint - f for i, f in free.items()}
    chosen: list[ModelView] = []
    for m in evictable:
        if all(v <= 0 for v in deficit.values()):
            break
        if not any(deficit.get(i, 0) > 0 for i in m.devices):
            continue
        chosen.append(m)
        for i in m.devices:
            if i in deficit:
                deficit[i] -= m.footprint_mb
    if any(v > 0 for v in deficit.values()):
        return None
    return _prune(footprint, free, chosen)


def _prune(footprint: int, free: dict[int, int], chosen: list[ModelView]) -> tuple[ModelView, ...]:
    """Put back chosen models the plan does not need, sparing the most recently used first."""
    kept = list(chosen)
    for m in sorted(chosen, key=lambda m: (m.last_used, m.name), reverse=True):
        trial = [k for k in kept if k is not m]
        if _fits_after(footprint, free, trial):
            kept = trial
    return tuple(kept)


def _fits_after(footprint: int, free: dict[int, int], evicted: Iterable[ModelView]) -> bool:
    room = dict(free)
    for m in evicted:
        for i in m.devices:
            if i in room:
                room[i] += m.footprint_mb
    return all(v >= footprint for v in room.values())


def _cost(
    footprint: int, ids: tuple[int, ...], free: dict[int, int], chosen: tuple[ModelView, ...]
) -> tuple[int, int, int, tuple[int, ...]]:
    """Sort key: MiB evicted, models evicted, free MiB left on the set afterwards, device ids."""
    evicted_mb = sum(m.footprint_mb * len(m.devices) for m in chosen)
    left = sum(free[i] - footprint for i in ids)
    left += sum(m.footprint_mb for m in chosen for i in m.devices if i in ids)
    return (evicted_mb, len(chosen), left, ids)


def _no_fit(
    demand: Demand,
    allowed: list[int],
    free: dict[int, int],
    models: Sequence[ModelView],
    evictable: list[ModelView],
) -> NoFit:
    """Explain a miss: the most each device could offer and who holds the rest."""
    best = dict(free)
    for m in evictable:
        for i in m.devices:
            if i in best:
                best[i] += m.footprint_mb
    held = [
        m
        for m in models
        if (m.running or m.starting or m.stopping)
        and m.name != demand.name
        and m not in evictable
        and any(i in allowed for i in m.devices)
    ]
    held.sort(key=lambda m: (-m.footprint_mb * len(m.devices), m.name))
    offer = ", ".join(f"GPU{i} {max(best[i], 0)} MiB" for i in allowed)
    reason = (
        f"not enough GPU memory for model '{demand.name}': it needs {demand.footprint_mb} MiB "
        f"on each of {demand.tp} GPU(s); after stopping every idle model the most free would be "
        f"{offer}"
    )
    if held:
        reason += "; memory is held by " + ", ".join(_why_held(m) for m in held)
    else:
        reason += "; the rest is used outside the proxy"
    return NoFit(reason, tuple(m.name for m in held))


def _why_held(m: ModelView) -> str:
    if m.starting:
        why = "starting"
    elif m.stopping:
        why = "stopping"
    elif m.leases:
        why = f"{m.leases} request(s) in flight"
    else:
        why = "pinned"
    return f"'{m.name}' ({m.footprint_mb} MiB on {_device_list(m.devices)}, {why})"


def _device_list(ids: Iterable[int]) -> str:
    return ",".join(f"GPU{i}" for i in ids)
