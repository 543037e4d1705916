"""`vllm-proxy-fleet`'s placement, as tables of what the servers hold and where each model goes
(pure: no HAProxy, no proxy, no clock)."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_proxy.fleet.placement import (
    BadView,
    Held,
    Server,
    entries,
    mappable,
    place,
    server_from_view,
)

MB = 3000


def held(state: str = "stopped", **kw: Any) -> Held:
    return Held(names=(), state=state, footprint_mb=kw.pop("footprint_mb", MB), **kw)


def server(name: str, free: int = 10000, active: int = 0, **models: Held) -> Server:
    return Server(name, models, (free,), active)


def where(servers: list[Server], previous: dict[str, str] | None = None) -> dict[str, str]:
    return {m: d.server for m, d in place(servers, previous or {}).items()}


def nine() -> dict[str, Held]:
    return {f"m{i}": held() for i in range(1, 10)}


CASES = [
    pytest.param(
        [server("a", m=held("awake", load=3)), server("b", m=held("awake", load=1))],
        {},
        {"m": "b"},
        id="awake on two: the least loaded",
    ),
    pytest.param(
        [server("a", m=held("awake", load=3)), server("b", m=held("awake", load=1))],
        {"m": "a"},
        {"m": "a"},
        id="awake on two: stays where it was",
    ),
    pytest.param(
        [server("a", m=held("asleep", sleep_level=1)), server("b", m=held())],
        {"m": "b"},
        {"m": "a"},
        id="asleep beats a server with room",
    ),
    pytest.param(
        [
            server("a", m=held("asleep", sleep_level=2)),
            server("b", m=held("asleep", sleep_level=1)),
        ],
        {},
        {"m": "b"},
        id="the lighter sleep",
    ),
    pytest.param(
        [server("a", m=held("starting")), server("b", m=held("asleep", sleep_level=1))],
        {},
        {"m": "a"},
        id="starting counts as awake",
    ),
    pytest.param(
        [server("a", m=held(), x=held()), server("b", m=held(), x=held())],
        {},
        {"m": "a", "x": "a"},
        id="equal servers: by name, both on the first (best fit)",
    ),
    pytest.param(
        [server("a", free=4000, m=held(), x=held()), server("b", m=held(), x=held())],
        {},
        {"m": "a", "x": "b"},
        id="the round's placements count: the second no longer fits on a",
    ),
    pytest.param(
        [server("a", m=held()), server("b", m=held())],
        {"m": "b"},
        {"m": "b"},
        id="stopped, placed last round: keeps its server while it fits",
    ),
    pytest.param(
        [server("a", m=held()), server("b", free=1000, m=held(fits_now=False, evict_mb=3000))],
        {"m": "b"},
        {"m": "a"},
        id="placed last round but no room there any more: moves to room",
    ),
    pytest.param(
        [
            server("a", free=0, m=held(fits_now=False, evict_mb=6000)),
            server("b", free=0, m=held(fits_now=False, evict_mb=3000, sleep_mb=100)),
            server("c", free=0, m=held(fits_now=False, evict_mb=3000)),
        ],
        {},
        {"m": "c"},
        id="no room anywhere: the least eviction (stops first, then sleeps)",
    ),
    pytest.param(
        [
            server("a", free=0, m=held(fits_now=False, possible=False)),
            server("b", free=0, active=1, m=held(fits_now=False, possible=False)),
        ],
        {"m": "b"},
        {"m": "b"},
        id="every server busy: stays",
    ),
    pytest.param(
        [server("a", m=held()), server("b", other=held())],
        {},
        {"m": "a", "other": "b"},
        id="a model only some servers configure",
    ),
    pytest.param(
        [server("b", m=held("asleep"))],
        {"m": "a"},
        {"m": "b"},
        id="its server left (dead, drained): placed on the others",
    ),
]


@pytest.mark.parametrize(("servers", "previous", "expected"), CASES)
def test_placement(
    servers: list[Server], previous: dict[str, str], expected: dict[str, str]
) -> None:
    assert where(servers, previous) == expected


def test_nine_models_on_three_servers_fill_each_with_three() -> None:
    servers = [server(name, **nine()) for name in ("gpu1", "gpu2", "gpu3")]
    got = where(servers)
    assert sorted(got) == [f"m{i}" for i in range(1, 10)]
    counts = {s: list(got.values()).count(s) for s in ("gpu1", "gpu2", "gpu3")}
    assert counts == {"gpu1": 3, "gpu2": 3, "gpu3": 3}
    # The next round, nothing started yet: the same map (no flapping).
    assert where(servers, got) == got
    # Some started: still the same.
    started = [
        Server(s.name, {m: held("awake") if got[m] == s.name else h for m, h in s.models.items()},
               (10000 - 3000 * counts[s.name],))
        for s in servers
    ]  # fmt: skip
    assert where(started, got) == got


def test_a_server_that_leaves_gives_its_models_to_the_others() -> None:
    models = {f"m{i}": held() for i in range(1, 7)}
    servers = [server(name, **models) for name in ("gpu1", "gpu2", "gpu3")]
    first = where(servers)
    gone = first["m1"]
    rest = [s for s in servers if s.name != gone]
    second = where(rest, first)
    assert gone not in second.values()
    assert {m: s for m, s in second.items() if first[m] != gone} == {
        m: s for m, s in first.items() if s != gone
    }, "the others' models stay"


def test_entries_map_every_name_of_a_model_to_its_server() -> None:
    servers = [
        Server("a", {"m": Held(names=("m", "m-alias", "lora-1", "bad name", "#x"))}, (10000,)),
        Server("b", {"n": Held(names=("n",))}, (10000,)),
    ]
    decisions = place(servers, {})
    assert entries(servers, decisions) == {"m": "a", "m-alias": "a", "lora-1": "a", "n": "b"}
    assert not mappable("with space") and not mappable("back\\slash") and mappable("org/m:1")


def test_a_proxy_view_is_read_or_refused() -> None:
    view = {
        "version": 1,
        "closing": False,
        "active_requests": 2,
        "gpus": [{"id": 0, "total_mb": 10000, "used_mb": 3000, "claimed_mb": 3000,
                  "free_mb": 7000}],
        "models": [
            {"name": "m", "names": ["m"], "state": "asleep", "sleep_level": 1, "load": 0,
             "footprint_mb": 3000, "gpus": 1, "fits_now": False,
             "evict_cost": {"possible": True, "sleep_mb": 0, "evict_mb": 3000}},
        ],
    }  # fmt: skip
    s = server_from_view("gpu1", view)
    assert s.free_mb == (7000,) and s.active == 2
    assert s.models["m"] == Held(("m",), "asleep", 1, 0, 3000, 1, False, True, 3000, 0)
    with pytest.raises(BadView, match="version 2"):
        server_from_view("gpu1", {**view, "version": 2})
    with pytest.raises(BadView, match="unreadable"):
        server_from_view("gpu1", {**view, "models": [{"name": "m"}]})
