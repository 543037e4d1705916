"""Which server each model of the fleet goes to: a pure function of what the proxies say they
hold (their ``/placement`` views) and of the last decision (no clock, no I/O).

Per model, among the live servers that configure it, in this order of preference:

1. a server where it is awake (or starting, or waking): the least loaded of them;
2. a server where it is asleep (a wake is cheaper than a start): the lightest sleep;
3. a server where it fits without evicting anyone, counting what this round has already placed
   there (models stopped everywhere, largest first, each on the server it fits best: bin
   packing by footprint per GPU);
4. the server where its start costs least: the fewest MiB stopped, then put to sleep.

Stable: a model keeps its server while that server is among the best of the first tier that
has any (a model moves only to a better tier, or off a server that left), and ties break by
server name, so equal servers never take turns. A model placed last round that has not started
yet keeps its room on its server in step 3.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The ``/placement`` shape this reads.
VERSION = 1
ACTIVE = frozenset({"awake", "starting", "waking"})


class BadView(ValueError):
    """A proxy's ``/placement`` answer that this version cannot read."""


@dataclass(frozen=True)
class Held:
    """One model on one server, as that server's proxy sees it."""

    names: tuple[str, ...]
    state: str = "stopped"
    sleep_level: int | None = None
    load: int = 0
    footprint_mb: int | None = None
    gpus: int = 1
    fits_now: bool = True
    #: Whether a start would find room by evicting (False: it would wait for busy engines).
    possible: bool = True
    evict_mb: int = 0
    sleep_mb: int = 0


@dataclass(frozen=True)
class Server:
    """One live server: its models by name, the free MiB of each GPU, requests in flight."""

    name: str
    models: Mapping[str, Held]
    free_mb: tuple[int, ...] = ()
    active: int = 0
    managed: bool = True


@dataclass(frozen=True)
class Decision:
    server: str
    why: str


@dataclass
class _Room:
    """A server's free MiB per GPU during one round (what the round has placed taken off)."""

    free: list[int] = field(default_factory=list)

    def take(self, need: int, gpus: int) -> int | None:
        """Take `need` on each of `gpus` devices (the ones it fits best); the MiB left on
        them, or None when it does not fit."""
        fitting = sorted((f, i) for i, f in enumerate(self.free) if f >= need)
        if len(fitting) < gpus:
            return None
        chosen = fitting[:gpus]
        for _, i in chosen:
            self.free[i] -= need
        return sum(f - need for f, _ in chosen)

    def peek(self, need: int, gpus: int) -> int | None:
        fitting = sorted(f for f in self.free if f >= need)
        return sum(f - need for f in fitting[:gpus]) if len(fitting) >= gpus else None


def server_from_view(name: str, view: Mapping[str, Any]) -> Server:
    """A `Server` from a proxy's ``/placement`` JSON; `BadView` for another version or shape."""
    if view.get("version") != VERSION:
        raise BadView(f"{name}: /placement version {view.get('version')!r}, expected {VERSION}")
    try:
        models = {}
        for row in view["models"]:
            cost = row.get("evict_cost") or {}
            models[str(row["name"])] = Held(
                names=tuple(str(n) for n in row["names"]),
                state=str(row["state"]),
                sleep_level=row.get("sleep_level"),
                load=int(row.get("load") or 0),
                footprint_mb=row.get("footprint_mb"),
                gpus=int(row.get("gpus") or 1),
                fits_now=bool(row["fits_now"]),
                possible=bool(cost.get("possible", True)),
                evict_mb=int(cost.get("evict_mb") or 0),
                sleep_mb=int(cost.get("sleep_mb") or 0),
            )
        return Server(
            name,
            models,
            tuple(int(g["free_mb"]) for g in view["gpus"]),
            int(view.get("active_requests") or 0),
            managed=bool(view["gpus"]),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise BadView(f"{name}: unreadable /placement: {err!r}") from None


def place(servers: Sequence[Server], previous: Mapping[str, str]) -> dict[str, Decision]:
    """Every model of the fleet -> its server (see the module docstring); `previous` is the last
    round's model -> server."""
    by_name = {s.name: s for s in servers}
    models = sorted({m for s in servers for m in s.models})
    out: dict[str, Decision] = {}
    cold: list[str] = []
    for model in models:
        here = [s for s in servers if model in s.models]
        prev = by_name.get(previous.get(model, ""))
        prev = prev if prev is not None and model in prev.models else None
        awake = [s for s in here if s.models[model].state in ACTIVE]
        asleep = [s for s in here if s.models[model].state == "asleep"]
        if awake:
            keys = {s.name: (s.models[model].load, s.active) for s in awake}
            out[model] = _pick(keys, prev, "awake")
        elif asleep:
            keys = {s.name: (s.models[model].sleep_level or 1, s.active) for s in asleep}
            out[model] = _pick(keys, prev, "asleep")
        else:
            cold.append(model)
    rooms = {s.name: _Room(list(s.free_mb)) for s in servers}
    placed = set()
    # Stopped models placed last round keep their server (and its room) while they fit there.
    for model in sorted(cold, key=lambda m: _size(servers, m), reverse=True):
        prev = by_name.get(previous.get(model, ""))
        if prev is None or model not in prev.models:
            continue
        held = prev.models[model]
        if held.fits_now and _take(rooms[prev.name], prev, held) is not None:
            out[model] = Decision(prev.name, "room (kept)")
            placed.add(model)
    for model in sorted(cold, key=lambda m: (-_size(servers, m), m)):
        if model in placed:
            continue
        here = [s for s in servers if model in s.models]
        fits = []
        for s in here:
            held = s.models[model]
            left = _peek(rooms[s.name], s, held) if held.fits_now else None
            if left is not None:
                fits.append((left, s.active, s.name))
        if fits:
            _, _, best = min(fits)
            _take(rooms[best], by_name[best], by_name[best].models[model])
            out[model] = Decision(best, "room")
            continue
        out[model] = _costliest_last(model, here, by_name.get(previous.get(model, "")))
    return out


def _pick(keys: Mapping[str, tuple[int, int]], prev: Server | None, why: str) -> Decision:
    """The previous server if it is a candidate, else the one of least key (then name)."""
    if prev is not None and prev.name in keys:
        return Decision(prev.name, why)
    return Decision(min(keys, key=lambda name: (*keys[name], name)), why)


def _costliest_last(model: str, here: list[Server], prev: Server | None) -> Decision:
    """No server has room: where the start evicts least (the previous one while it can
    evict at all), else (every server busy) the previous one or the least busy."""
    possible = [s for s in here if s.models[model].possible]
    if prev is not None and prev in possible:
        return Decision(prev.name, "eviction (kept)")
    if possible:
        best = min(possible, key=lambda s: (s.models[model].evict_mb, s.models[model].sleep_mb,
                                            s.active, s.name))  # fmt: skip
        return Decision(best.name, "eviction")
    if prev is not None and prev in here:
        return Decision(prev.name, "busy (kept)")
    return Decision(min(here, key=lambda s: (s.active, s.name)).name, "busy")


def _size(servers: Sequence[Server], model: str) -> int:
    return max(
        ((s.models[model].footprint_mb or 0) * s.models[model].gpus for s in servers
         if model in s.models),
        default=0,
    )  # fmt: skip


def _peek(room: _Room, server: Server, held: Held) -> int | None:
    if not server.managed or held.footprint_mb is None:
        return 0  # memory is not managed there: any model fits
    return room.peek(held.footprint_mb, held.gpus)


def _take(room: _Room, server: Server, held: Held) -> int | None:
    if not server.managed or held.footprint_mb is None:
        return 0
    return room.take(held.footprint_mb, held.gpus)


def mappable(name: str) -> bool:
    """Whether a name can be a key of HAProxy's map, on its runtime API and in its file."""
    return bool(name) and not name.startswith("#") and not any(c.isspace() or c == "\\"
                                                               for c in name)  # fmt: skip


def entries(servers: Iterable[Server], decisions: Mapping[str, Decision]) -> dict[str, str]:
    """Every name a request may give (model names, aliases, adapters) -> the server of its
    model; names HAProxy's map cannot hold are left to the hash."""
    by_name = {s.name: s for s in servers}
    out: dict[str, str] = {}
    for model, decision in sorted(decisions.items()):
        held = by_name[decision.server].models[model]
        for name in (model, *held.names):
            if mappable(name):
                out.setdefault(name, decision.server)
    return out
