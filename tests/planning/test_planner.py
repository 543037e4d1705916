"""The placement planner: tables of snapshots and the plans they must produce."""

from __future__ import annotations

import pytest

from vllm_proxy.planning.planner import (
    Demand,
    DeviceView,
    InstanceView,
    NoFit,
    Phase,
    Plan,
    after,
    never_fits,
    plan,
    settled,
)


def dev(id: int, total: int, used: int = 0, pending: int = 0) -> DeviceView:
    return DeviceView(id=id, total_mb=total, used_mb=used, pending_mb=pending)


def mdl(
    name: str,
    mb: int,
    devices: tuple[int, ...] = (0,),
    last: float = 0.0,
    leases: int = 0,
    pinned: bool = False,
    phase: Phase = Phase.RUNNING,
) -> InstanceView:
    return InstanceView(name, mb, devices, phase, leases, last, pinned)


def want(mb: int, tp: int = 1, allowed: tuple[int, ...] | None = None, reserve: int = 0) -> Demand:
    return Demand(name="new", footprint_mb=mb, tp=tp, allowed_devices=allowed, reserve_mb=reserve)


PLANS = [
    pytest.param(
        [dev(0, 80_000, 10_000)], [], want(20_000), Plan((0,), ()), id="fits-without-eviction"
    ),
    pytest.param(
        [dev(0, 80_000, 30_000), dev(1, 80_000, 55_000), dev(2, 80_000, 70_000)],
        [],
        want(20_000),
        Plan((1,), ()),
        id="best-fit-among-devices",
    ),
    pytest.param(
        [dev(0, 24_000, 20_000)],
        [mdl("a", 10_000, last=1), mdl("b", 10_000, last=2)],
        want(10_000),
        Plan((0,), ("a",)),
        id="evict-lru",
    ),
    pytest.param(
        [dev(0, 24_000, 20_000)],
        [mdl("a", 10_000, last=1, leases=2), mdl("b", 10_000, last=2)],
        want(10_000),
        Plan((0,), ("b",)),
        id="skip-leased",
    ),
    pytest.param(
        [dev(0, 24_000, 20_000)],
        [mdl("a", 10_000, last=1, pinned=True), mdl("b", 10_000, last=2)],
        want(10_000),
        Plan((0,), ("b",)),
        id="skip-pinned",
    ),
    pytest.param(
        [dev(0, 24_000, 20_000)],
        [mdl("a", 10_000, last=1, phase=Phase.STARTING), mdl("b", 10_000, last=2)],
        want(10_000),
        Plan((0,), ("b",)),
        id="skip-starting",
    ),
    pytest.param(
        [dev(0, 30_000, 30_000)],
        [mdl("c", 10_000, last=3), mdl("a", 10_000, last=1), mdl("b", 10_000, last=2)],
        want(20_000),
        Plan((0,), ("a", "b")),
        id="cumulative-eviction-lru-order",
    ),
    pytest.param(
        [dev(0, 40_000, 36_000)],
        [mdl("small", 4_000, last=1), mdl("big", 32_000, last=2)],
        want(30_000),
        Plan((0,), ("big",)),
        id="unneeded-lru-model-put-back",
    ),
    pytest.param(
        [dev(0, 40_000, 40_000), dev(1, 40_000, 40_000)],
        [mdl("big", 30_000, (0,), last=1), mdl("small", 5_000, (1,), last=2)],
        want(5_000),
        Plan((1,), ("small",)),
        id="fewest-bytes-evicted-wins-over-lru",
    ),
    pytest.param(
        [dev(0, 40_000, 30_000), dev(1, 40_000, 30_000)],
        [mdl("a", 10_000, (0,), last=1), mdl("b", 10_000, (1,), last=2)],
        want(15_000),
        Plan((0,), ("a",)),
        id="equal-cost-lowest-device-id",
    ),
    pytest.param(
        [dev(0, 80_000, 20_000), dev(1, 80_000, 40_000), dev(2, 80_000, 10_000)],
        [],
        want(30_000, tp=2),
        Plan((0, 1), ()),
        id="tp-best-fit-pair",
    ),
    pytest.param(
        [dev(0, 20_000, 10_000), dev(1, 20_000, 10_000)],
        [mdl("tp2", 10_000, (0, 1), last=1)],
        want(15_000, tp=2),
        Plan((0, 1), ("tp2",)),
        id="tp-model-frees-on-each-device",
    ),
    pytest.param(
        [dev(0, 20_000, 10_000), dev(1, 20_000, 20_000)],
        [mdl("x", 10_000, (1,), last=1), mdl("y", 10_000, (0,), last=2)],
        want(15_000),
        Plan((0,), ("y",)),
        id="model-off-the-set-is-not-evicted",
    ),
    pytest.param(
        [dev(0, 80_000, 0), dev(1, 20_000, 10_000)],
        [mdl("a", 10_000, (1,), last=1)],
        want(15_000, allowed=(1,)),
        Plan((1,), ("a",)),
        id="pinned-devices-honoured",
    ),
    pytest.param(
        [dev(0, 30_000, 10_000, pending=10_000)],
        [mdl("a", 10_000, last=1)],
        want(15_000),
        Plan((0,), ("a",)),
        id="pending-memory-counts-as-used",
    ),
    pytest.param(
        [dev(0, 30_000, 10_000)],
        [mdl("a", 10_000, last=1)],
        want(15_000, reserve=6_000),
        Plan((0,), ("a",)),
        id="reserve-kept-free",
    ),
    pytest.param(
        [dev(0, 30_000, 20_000)],
        [mdl("new", 10_000, last=0), mdl("a", 10_000, last=1)],
        want(20_000),
        Plan((0,), ("a",)),
        id="never-evicts-itself",
    ),
    pytest.param(
        [dev(0, 30_000, 20_000)],
        [mdl("idle", 10_000, last=0, phase=Phase.STOPPING), mdl("a", 10_000, last=1)],
        want(20_000),
        Plan((0,), ("a",)),
        id="stopping-instances-are-not-taken",
    ),
]


@pytest.mark.parametrize(("devices", "models", "demand", "expected"), PLANS)
def test_plan(
    devices: list[DeviceView], models: list[InstanceView], demand: Demand, expected: Plan
) -> None:
    assert plan(demand, devices, models) == expected


NO_FITS = [
    pytest.param(
        [dev(0, 24_000, 20_000)],
        [mdl("a", 10_000, last=1, leases=1), mdl("b", 10_000, last=2, pinned=True)],
        want(10_000),
        ("a", "b"),
        ["'a' (10000 MiB on GPU0, 1 request(s) in flight)", "'b'", "pinned", "GPU0 4000 MiB"],
        id="nothing-evictable-names-blockers",
    ),
    pytest.param(
        [dev(0, 30_000, 30_000)],
        [mdl("idle", 5_000, last=1), mdl("busy", 25_000, last=2, leases=3)],
        want(20_000),
        ("busy",),
        ["GPU0 5000 MiB", "'busy'", "3 request(s)"],
        id="evicting-all-idle-is-not-enough",
    ),
    pytest.param(
        [dev(0, 30_000, 20_000)],
        [mdl("warming", 10_000, last=1, phase=Phase.STARTING)],
        want(15_000),
        ("warming",),
        ["starting"],
        id="starting-model-blocks",
    ),
    pytest.param(
        [dev(0, 30_000, 25_000)],
        [],
        want(10_000),
        (),
        ["used outside the proxy"],
        id="foreign-memory",
    ),
    pytest.param(
        [dev(0, 80_000, 0), dev(1, 20_000, 10_000)],
        [mdl("a", 10_000, (1,), last=1, pinned=True), mdl("b", 10_000, (0,), leases=1)],
        want(15_000, allowed=(1,)),
        ("a",),
        ["GPU1 10000 MiB", "'a'"],
        id="blockers-only-on-allowed-devices",
    ),
    pytest.param(
        [dev(0, 20_000, 0)],
        [],
        want(30_000),
        (),
        ["largest: 20000 MiB"],
        id="never-fits",
    ),
]


@pytest.mark.parametrize(("devices", "models", "demand", "blockers", "phrases"), NO_FITS)
def test_no_fit(
    devices: list[DeviceView],
    models: list[InstanceView],
    demand: Demand,
    blockers: tuple[str, ...],
    phrases: list[str],
) -> None:
    result = plan(demand, devices, models)
    assert isinstance(result, NoFit)
    assert result.blockers == blockers
    assert "'new'" in result.reason
    for phrase in phrases:
        assert phrase in result.reason


NEVER = [
    pytest.param(want(20_000), {0: 24_000}, None, id="fits"),
    pytest.param(want(20_000, reserve=5_000), {0: 24_000}, "reserve 5000", id="reserve"),
    pytest.param(want(30_000), {0: 24_000, 1: 24_000}, "largest: 24000", id="too-big"),
    pytest.param(want(10_000, tp=2), {0: 24_000}, "needs 2 GPU(s)", id="tp-exceeds-devices"),
    pytest.param(want(10_000, tp=2, allowed=(0, 7)), {0: 24_000, 1: 24_000}, "GPU0", id="absent"),
    pytest.param(want(30_000, tp=2), {0: 40_000, 1: 24_000}, "only 1", id="one-big-device"),
    pytest.param(want(10_000, tp=0), {0: 24_000}, "at least 1", id="tp-zero"),
    pytest.param(want(10_000, allowed=()), {0: 24_000}, "none", id="no-allowed-device"),
]


@pytest.mark.parametrize(("demand", "totals", "phrase"), NEVER)
def test_never_fits(demand: Demand, totals: dict[int, int], phrase: str | None) -> None:
    reason = never_fits(demand, totals)
    if phrase is None:
        assert reason is None
    else:
        assert reason is not None and phrase in reason and "'new'" in reason


def test_handover_counts_the_old_and_the_new_instance() -> None:
    """A reload's new instance of a model is planned beside the old one, which still holds its
    memory while it drains: busy, it blocks; idle, it is the one evicted."""
    devices = [dev(0, 1000, used=600)]  # m#1 (the old instance) holds 600 MiB
    demand = Demand("m#2", footprint_mb=600, tp=1, allowed_devices=None, reserve_mb=0)
    busy = plan(demand, devices, [mdl("m#1", 600, leases=1)])
    assert isinstance(busy, NoFit) and busy.blockers == ("m#1",)
    idle = plan(demand, devices, [mdl("m#1", 600, leases=0)])
    assert idle == Plan(devices=(0,), evict=("m#1",))
    # Room for both: no eviction, the old one keeps serving until it has drained.
    roomy = plan(demand, [dev(0, 2000, used=600)], [mdl("m#1", 600, leases=1)])
    assert roomy == Plan(devices=(0,), evict=())


def test_a_stopping_model_blocks_rather_than_reads_as_foreign_memory() -> None:
    """Memory of an engine being stopped comes back soon: wait for it (a blocker), never answer
    at once as if someone outside the proxy held it."""
    stopping = InstanceView("a#1", 600, (0,), Phase.STOPPING, 0, 0.0, False)
    decision = plan(want(600), [dev(0, 1000, used=600)], [stopping])
    assert isinstance(decision, NoFit) and decision.blockers == ("a#1",)
    assert "stopping" in decision.reason and "outside the proxy" not in decision.reason


# -- the sleep tier: sleep before stop, stop sleepers LRU, never a busy one --------------------


def sleeper(name: str, held: int, last: float = 0.0, **kw: object) -> InstanceView:
    """An asleep instance holding `held` MiB."""
    return InstanceView(name, held, (0,), Phase.ASLEEP, 0, last, False, **kw)  # type: ignore[arg-type]


def sleepable(
    name: str, mb: int, sleep_mb: int, last: float = 0.0, leases: int = 0
) -> InstanceView:
    """A RUNNING instance with a sleep policy: asleep it would hold `sleep_mb`."""
    return InstanceView(name, mb, (0,), Phase.RUNNING, leases, last, False, sleep_mb=sleep_mb)


SLEEP_PLANS = [
    pytest.param(
        [mdl("old", 300, last=1), sleepable("a", 300, 100, last=2)],
        want(500),
        Plan((0,), (), ("a",)),
        id="sleep-before-stopping-anything-even-if-not-lru",
    ),
    pytest.param(
        [sleepable("a", 300, 100, last=1), sleepable("b", 300, 100, last=2)],
        want(700),
        Plan((0,), (), ("a", "b")),
        id="sleep-lru-first-as-many-as-needed",
    ),
    pytest.param(
        [sleeper("s1", 100, last=1), sleeper("s2", 100, last=2), mdl("r", 300, last=3)],
        want(550),
        Plan((0,), ("s1",)),
        id="stop-the-lru-sleeper-when-its-memory-is-needed",
    ),
    pytest.param(
        [sleepable("busy", 300, 100, last=0, leases=1), sleepable("a", 300, 100, last=5)],
        want(500),
        Plan((0,), (), ("a",)),
        id="never-a-busy-one",
    ),
    pytest.param(
        [sleepable("a", 500, 400, last=1)],
        want(700),
        Plan((0,), ("a",)),
        id="a-sleep-that-frees-too-little-becomes-a-stop",
    ),
]


@pytest.mark.parametrize(("models", "demand", "expected"), SLEEP_PLANS)
def test_sleep_tier_plans(models: list[InstanceView], demand: Demand, expected: Plan) -> None:
    used = sum(m.footprint_mb for m in models)
    assert plan(demand, [dev(0, 1000, used)], models) == expected


@pytest.mark.parametrize(
    ("phase", "why"),
    [
        (Phase.STARTING, "starting"),
        (Phase.WAKING, "waking"),
        (Phase.FALLING_ASLEEP, "going to sleep"),
        (Phase.STOPPING, "stopping"),
    ],
)
def test_instances_on_the_move_hold_their_memory(phase: Phase, why: str) -> None:
    """Starting, waking, falling asleep or stopping: never taken, the demand waits for it."""
    moving = InstanceView("w", 600, (0,), phase, 0, 0.0, False)
    result = plan(want(600), [dev(0, 1000, 600)], [moving])
    assert isinstance(result, NoFit) and result.blockers == ("w",)
    assert why in result.reason


def test_a_replica_prefers_a_device_of_its_own_even_at_the_cost_of_an_idle_model() -> None:
    """GPU0 holds a sibling replica and has room; GPU1 holds an idle model of another kind:
    the new replica takes GPU1 (sleeping the idle one there) rather than share GPU0."""
    devices = [dev(0, 1000, 400), dev(1, 1000, 700)]
    other = InstanceView("other", 700, (1,), Phase.RUNNING, 0, 1.0, False, sleep_mb=100)
    models = [mdl("sibling", 400, (0,), leases=1), other]
    demand = Demand("new", 400, 1, None, 0, avoid_devices=(0,))
    assert plan(demand, devices, models) == Plan((1,), (), ("other",))
    # Without siblings, the same snapshot fits on GPU0 with nothing touched.
    assert plan(want(400), devices, models) == Plan((0,), ())
    # A busy model on the other device: sharing is better than waiting.
    busy = [models[0], InstanceView("other", 700, (1,), Phase.RUNNING, 2, 1.0, False, sleep_mb=100)]
    assert plan(demand, devices, busy) == Plan((0,), ())


# -- after: the snapshot once a plan has been carried out ------------------------------------


def test_after_puts_the_sleepers_to_sleep_drops_the_stopped_and_adds_the_demand() -> None:
    devices = [dev(0, 1000, used=900)]
    views = [
        sleepable("i#1", 300, 50, last=1.0),
        mdl("x#1", 200, last=2.0),
        mdl("a#1", 400, last=3.0, leases=1),
    ]
    after_devices, after_views = after(want(450), Plan((0,), ("x#1",), ("i#1",)), devices, views)
    assert after_devices == [dev(0, 1000, used=900 - 250 - 200 + 450)]
    by_name = {v.name: v for v in after_views}
    assert set(by_name) == {"i#1", "a#1", "new"}
    assert (by_name["i#1"].phase, by_name["i#1"].footprint_mb) == (Phase.ASLEEP, 50)
    assert by_name["a#1"] == views[2]  # untouched, busy as before
    assert (by_name["new"].phase, by_name["new"].footprint_mb) == (Phase.STARTING, 450)


def test_after_a_wake_adds_what_it_takes_to_what_the_sleeper_holds() -> None:
    devices = [dev(0, 1000, used=700)]
    views = [sleeper("w#1", 50), sleepable("i#1", 300, 50)]
    demand = Demand("w#1", 250, 1, (0,), 0)
    after_devices, after_views = after(demand, Plan((0,), (), ("i#1",)), devices, views)
    assert after_devices[0].used_mb == 700
    (woken,) = [v for v in after_views if v.name == "w#1"]
    assert (woken.phase, woken.footprint_mb) == (Phase.STARTING, 300)


# -- settled: the snapshot once what moves has arrived and requests have ended ----------------


def test_settled_lands_every_engine_in_motion_and_drains_the_busy() -> None:
    """Starts and wakes are awake and idle, a sleep has left its residue, a stop has given
    its memory back, busy engines have no lease; the demand's own instance is left alone."""
    devices = [dev(0, 1000, used=950, pending=40)]
    falling = InstanceView("f#1", 300, (0,), Phase.FALLING_ASLEEP, 0, 1.0, False, sleep_mb=50)
    views = [
        mdl("s#1", 100, phase=Phase.STARTING, leases=2),
        mdl("w#1", 200, phase=Phase.WAKING, leases=1),
        falling,
        mdl("x#1", 150, phase=Phase.STOPPING),
        sleepable("b#1", 100, 20, leases=3),
        sleeper("new", 30),
    ]
    devs, out = settled(Demand("new", 200, 1, (0,), 0), devices, views)
    assert devs == [dev(0, 1000, used=950 - 250 - 150)]
    by_name = {v.name: v for v in out}
    assert set(by_name) == {"s#1", "w#1", "f#1", "b#1", "new"}
    assert all(by_name[n].phase is Phase.RUNNING and by_name[n].leases == 0
               for n in ("s#1", "w#1", "b#1"))  # fmt: skip
    assert (by_name["f#1"].phase, by_name["f#1"].footprint_mb) == (Phase.ASLEEP, 50)
    assert by_name["new"] == views[-1]


def test_settled_lets_a_plan_sleep_the_busy_instead_of_stopping_the_asleep() -> None:
    """Now, room for the demand takes stopping two asleep engines; once the busy one has
    drained, putting it to sleep is enough."""
    devices = [dev(0, 1000, used=1000)]
    views = [sleepable("busy#1", 600, 50, leases=1), sleeper("a#1", 200, last=1.0),
             sleeper("b#1", 200, last=2.0)]  # fmt: skip
    demand = want(400)
    assert plan(demand, devices, views, now=10.0) == Plan((0,), ("a#1", "b#1"))
    assert plan(demand, *settled(demand, devices, views), now=10.0) == Plan((0,), (), ("busy#1",))
