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

from ..names import carriable, name_problem

#: The ``/placement`` shape this reads.
VERSION = 1
ACTIVE = frozenset({"awake", "starting", "waking"})
STATES = ACTIVE | {"asleep", "stopped"}


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
    #: Names in its answer that HAProxy cannot carry (names.py), each with why: left out.
    dropped: tuple[str, ...] = ()


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


def _int(value: Any, where: str, field: str = "", *, low: int = 0, none: bool = False) -> Any:
    """`value` when it is an integer >= `low` (or None with `none`); else `BadView` naming
    ``where.field`` (made only then: a view of 20 000 rows is checked each round)."""
    if type(value) is int and value >= low:
        return value
    if value is None and none:
        return None
    at = f"{where}.{field}" if field else where
    raise BadView(f"{at}: {_shown(value)} is not an integer >= {low}")


def _bool(value: Any, where: str, field: str) -> bool:
    if type(value) is not bool:
        raise BadView(f"{where}.{field}: {_shown(value)} is not true or false")
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _dict(value: Any, where: str) -> dict[str, Any]:
    if type(value) is not dict:
        raise BadView(f"{where}: {_shown(value)} is not an object")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if type(value) is not list:
        raise BadView(f"{where}: {_shown(value)} is not a list")
    return value


def _held(row: Any, n: int, dropped: list[str]) -> tuple[str, Held] | None:
    """Row `n` of ``models``: (its name, what it holds), or None when its own name cannot be
    carried (noted in `dropped`)."""
    if type(row) is not dict:
        raise BadView(f"models[{n}]: {_shown(row)} is not an object")
    where = f"models[{n}]"
    name = row.get("name")
    if type(name) is not str:
        raise BadView(f"{where}.name: {_shown(name)} is not a string")
    names = row.get("names")
    if type(names) is not list or any(type(x) is not str for x in names):
        raise BadView(f"{where}.names: {_shown(names)} is not a list of strings")
    state = row.get("state")
    if type(state) is not str or state not in STATES:
        raise BadView(f"{where}.state: {_shown(state)} is none of {sorted(STATES)}")
    cost = row.get("evict_cost") or {}
    if type(cost) is not dict:
        raise BadView(f"{where}.evict_cost: {_shown(cost)} is not an object")
    held = Held(
        names=tuple(x for x in names if x == name or _keep(x, dropped)),
        state=state,
        sleep_level=_int(row.get("sleep_level"), where, "sleep_level", low=1, none=True),
        load=_int(row.get("load", 0), where, "load"),
        footprint_mb=_int(row.get("footprint_mb"), where, "footprint_mb", none=True),
        gpus=_int(row.get("gpus"), where, "gpus", low=1, none=True) or 1,
        fits_now=_bool(row.get("fits_now"), where, "fits_now"),
        possible=_bool(cost.get("possible", True), where, "evict_cost.possible"),
        evict_mb=_int(cost.get("evict_mb", 0), where, "evict_cost.evict_mb"),
        sleep_mb=_int(cost.get("sleep_mb", 0), where, "evict_cost.sleep_mb"),
    )
    if not _keep(name, dropped):
        return None
    return name, held


def _keep(name: str, dropped: list[str]) -> bool:
    why = name_problem(name)
    if why is not None:
        dropped.append(f"{_shown(name)}: {why}")
    return why is None


def server_from_view(name: str, view: Any) -> Server:
    """A `Server` from a proxy's ``/placement`` JSON, every field checked against the shape
    this reads (`BadView` for another version or shape). Names HAProxy cannot carry are left
    out and listed in `Server.dropped`: a neighbour's answer never reaches HAProxy's command
    line unchecked."""
    try:
        view = _dict(view, "/placement")
        if view.get("version") != VERSION or type(view.get("version")) is not int:
            raise BadView(f"/placement version {_shown(view.get('version'))}, expected {VERSION}")
        dropped: list[str] = []
        models: dict[str, Held] = {}
        for n, row in enumerate(_list(view.get("models"), "models")):
            got = _held(row, n, dropped)
            if got is not None and got[0] not in models:
                models[got[0]] = got[1]
        gpus = _list(view.get("gpus"), "gpus")
        free = tuple(
            _int(_dict(g, f"gpus[{n}]").get("free_mb"), f"gpus[{n}]", "free_mb")
            for n, g in enumerate(gpus)
        )
        active = _int(view.get("active_requests", 0), "active_requests")
        return Server(name, models, free, active, managed=bool(gpus), dropped=tuple(dropped))
    except BadView as err:
        raise BadView(f"{name}: unreadable /placement: {err}") from None


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
    return carriable(name)


def routes(
    servers: Iterable[Server], decisions: Mapping[str, Decision]
) -> tuple[dict[str, str], list[str]]:
    """Every name a request may give (model names, aliases, adapters) -> the server of its
    model, and the conflicts found. A model's own name wins over any alias of another model
    (whatever order they sort in); an alias two models give goes to the first by name."""
    by_name = {s.name: s for s in servers}
    out = {model: d.server for model, d in sorted(decisions.items()) if carriable(model)}
    owner = {model: model for model in out}
    conflicts = []
    for model, decision in sorted(decisions.items()):
        for name in by_name[decision.server].models[model].names:
            if not carriable(name) or name == model:
                continue
            if name in owner:
                if owner[name] != model:
                    conflicts.append(
                        f"{name!r}, a name of {model} on {decision.server}, is already "
                        f"{'the model' if owner[name] == name else 'a name of ' + owner[name]}"
                        f" on {out[name]}"
                    )
                continue
            out[name] = decision.server
            owner[name] = model
    return out, conflicts


def entries(servers: Iterable[Server], decisions: Mapping[str, Decision]) -> dict[str, str]:
    """`routes` without its conflicts."""
    return routes(servers, decisions)[0]
