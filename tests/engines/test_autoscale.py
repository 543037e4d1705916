"""The replica count: its rules as tables, and the autoscaler on a model of plain objects."""

from __future__ import annotations

import time
from typing import Any

import pytest
from kit import wait_for

from vllm_proxy.config import ModelSpec, parse_config
from vllm_proxy.engines.autoscale import Autoscaler, desired, may_shrink, scaled, surplus_count
from vllm_proxy.engines.states import State


def spec(**keys: Any) -> ModelSpec:
    return parse_config({"models": {"m": {"model": "x", **keys}}}).specs()["m"]


def auto(**keys: Any) -> ModelSpec:
    return spec(autoscale=keys)


SINGLE = spec()
FIXED = spec(replicas=3)


@pytest.mark.parametrize(
    ("model", "want"),
    [(SINGLE, False), (FIXED, True), (auto(max_replicas=1), False), (auto(max_replicas=2), True)],
)
def test_scaled_is_more_than_one_engine(model: ModelSpec, want: bool) -> None:
    assert scaled(model) is want


DESIRED = [
    pytest.param(SINGLE, 0, 1, id="single, idle"),
    pytest.param(SINGLE, 50, 1, id="single, busy"),
    pytest.param(FIXED, 0, 3, id="fixed, idle"),
    pytest.param(auto(max_replicas=4, target_ongoing_requests=2), 0, 1, id="at least one"),
    pytest.param(auto(max_replicas=4, target_ongoing_requests=2), 2, 1, id="at the target"),
    pytest.param(auto(max_replicas=4, target_ongoing_requests=2), 3, 2, id="above: rounds up"),
    pytest.param(auto(max_replicas=4, target_ongoing_requests=2), 100, 4, id="the ceiling"),
    pytest.param(auto(min_replicas=2, max_replicas=4), 0, 2, id="the floor"),
]


@pytest.mark.parametrize(("model", "ongoing", "want"), DESIRED)
def test_desired_replicas_follow_the_load_within_the_bounds(
    model: ModelSpec, ongoing: int, want: int
) -> None:
    assert desired(model, ongoing) == want


SHRINK = [
    pytest.param(SINGLE, 2, 1, 0, False, id="no autoscaler"),
    pytest.param(FIXED, 3, 1, 0, False, id="fixed replicas"),
    pytest.param(auto(max_replicas=3), 2, 1, 0, True, id="more awake than wanted"),
    pytest.param(auto(max_replicas=3), 2, 2, 0, False, id="the load wants them"),
    pytest.param(auto(min_replicas=2, max_replicas=3), 2, 1, 0, False, id="at the floor"),
    pytest.param(auto(max_replicas=3), 3, 1, 1, False, id="one leaving already"),
]


@pytest.mark.parametrize(("model", "awake", "wanted", "leaving", "want"), SHRINK)
def test_an_idle_replica_may_leave_one_at_a_time_down_to_the_floor_and_the_load(
    model: ModelSpec, awake: int, wanted: int, leaving: int, want: bool
) -> None:
    assert may_shrink(model, awake, wanted, leaving) is want


@pytest.mark.parametrize(
    ("model", "kept", "want"),
    [(FIXED, 3, 0), (FIXED, 5, 2), (auto(max_replicas=2), 1, 0), (SINGLE, 2, 1)],
)
def test_surplus_is_what_sits_above_the_ceiling(model: ModelSpec, kept: int, want: int) -> None:
    assert surplus_count(model, kept) == want


class Replica:
    """What the autoscaler reads of an instance, and the two requests it makes of one."""

    def __init__(
        self,
        state: State = State.RUNNING,
        leases: int = 0,
        last_used: float = 0.0,
        retired: bool = False,
        sleeps: bool = False,
    ) -> None:
        self.id = "m#?"
        if retired and state is State.RUNNING:
            state = State.DRAINING  # as `Instance.retire` does
        self.state, self.leases, self.last_used = state, leases, last_used
        self.retired, self._sleeps = retired, sleeps
        self.asked: list[str] = []

    @property
    def routable(self) -> bool:
        return self.state is State.RUNNING

    def sleep(self, reason: str) -> object | None:
        self.asked.append(f"sleep:{reason}")
        return object() if self._sleeps else None

    def evict(self, reason: str) -> None:
        self.asked.append(f"evict:{reason}")


class Owner:
    """A model as the autoscaler sees it (`autoscale.Replicas`)."""

    def __init__(self, model: ModelSpec, *instances: Replica, waiting: int = 0) -> None:
        self.spec = model
        self.instances: list[Any] = list(instances)
        self.waiting = waiting
        self.closed = self.removed = self.draining = False
        self.grown: list[int] = []
        #: Whether each growth may wake asleep replicas.
        self.waking: list[bool] = []

    def serving(self) -> Any:
        running = [i for i in self.instances if i.routable]
        return running[0] if running else None

    def grow(self, count: int, wake: bool = True) -> None:
        self.grown.append(count)
        self.waking.append(wake)


def scaler(owner: Owner) -> Autoscaler:
    return Autoscaler(owner)


def test_load_counts_running_replicas_and_waiting_requests() -> None:
    model = auto(max_replicas=8, target_ongoing_requests=2)
    owner = Owner(
        model,
        Replica(leases=3),
        Replica(leases=1),
        Replica(state=State.STARTING, leases=0),
        Replica(leases=9, retired=True),
        waiting=2,
    )
    a = scaler(owner)
    assert a.desired() == 3, "(3 + 1 in flight + 2 waiting) / 2"
    assert len(a.replicas()) == 3, "starting ones count, retired ones do not"


def test_missing_replicas_are_added_at_once_without_an_upscale_delay() -> None:
    owner = Owner(auto(max_replicas=4, target_ongoing_requests=1), Replica(leases=3))
    a = scaler(owner)
    a.check_load()
    assert owner.grown == [2]
    owner.instances += [Replica(state=State.STARTING), Replica(state=State.WAKING)]
    a.check_load()
    assert owner.grown == [2], "starting and waking replicas count"


def test_idle_fixed_replicas_asleep_are_not_woken_by_a_replica_coming_up() -> None:
    """Fixed replicas, no request anywhere: a replica that comes up (a wake just done) finds
    the other asleep and leaves it so; woken, it would fall asleep again and wake this one in
    turn, for ever."""
    owner = Owner(FIXED, Replica(), Replica(state=State.SLEEPING), Replica(state=State.SLEEPING))
    scaler(owner).check_load()
    assert owner.grown == []


def test_fixed_replicas_asleep_are_woken_while_requests_wait_or_run() -> None:
    waiting = Owner(FIXED, Replica(), Replica(state=State.SLEEPING), Replica(state=State.SLEEPING),
                    waiting=1)  # fmt: skip
    scaler(waiting).check_load()
    assert (waiting.grown, waiting.waking) == ([2], [True])
    busy = Owner(FIXED, Replica(leases=1), Replica(state=State.SLEEPING))
    scaler(busy).check_load()
    assert (busy.grown, busy.waking) == ([2], [True])


def test_a_missing_replica_of_an_idle_model_is_started_not_woken() -> None:
    """The count of fixed replicas (or the floor) still holds when idle: a replica that is gone
    is started again; the asleep ones stay asleep."""
    owner = Owner(FIXED, Replica(), Replica(state=State.SLEEPING))
    scaler(owner).check_load()
    assert (owner.grown, owner.waking) == ([1], [False])


@pytest.mark.parametrize("why", ["closed", "removed", "draining"])
def test_nothing_is_added_to_a_model_on_its_way_out(why: str) -> None:
    owner = Owner(auto(max_replicas=4, target_ongoing_requests=1), Replica(leases=3))
    setattr(owner, why, True)
    scaler(owner).check_load()
    assert owner.grown == []


def test_a_single_engine_model_never_grows() -> None:
    owner = Owner(SINGLE, Replica(retired=True), waiting=5)
    scaler(owner).check_load()
    assert owner.grown == []


async def test_an_upscale_delay_adds_replicas_later_if_the_load_still_asks() -> None:
    model = auto(max_replicas=2, target_ongoing_requests=1, upscale_delay_s=0.05)
    owner = Owner(model, Replica(leases=2))
    a = scaler(owner)
    a.check_load()
    assert owner.grown == [] and a.upscale_pending
    a.check_load()  # the same delay: no second check
    await wait_for(lambda: not a.upscale_pending, what="the upscale delay over")
    assert owner.grown == [1]


async def test_a_due_upscale_adds_nothing_once_nothing_serves() -> None:
    model = auto(max_replicas=2, target_ongoing_requests=1, upscale_delay_s=0.05)
    owner = Owner(model, Replica(leases=2))
    a = scaler(owner)
    a.check_load()
    owner.instances = []  # unloaded meanwhile
    await wait_for(lambda: not a.upscale_pending, what="the upscale delay over")
    assert owner.grown == []


def test_idle_stops_keep_the_floor() -> None:
    model = auto(min_replicas=1, max_replicas=3)
    first, second = Replica(), Replica(state=State.SLEEPING)
    a = scaler(Owner(model, first, second))
    assert a.may_idle_stop(first), "an asleep replica keeps the floor"
    assert not scaler(Owner(model, first)).may_idle_stop(first)
    alone = scaler(Owner(model, first, Replica(retired=True)))
    assert not alone.may_idle_stop(first), "a retired one does not"
    assert scaler(Owner(SINGLE, first)).may_idle_stop(first)


def test_fixed_replicas_stop_together_once_none_has_served_for_the_idle_timeout() -> None:
    model = spec(replicas=2, idle_timeout_s=60)
    old = time.monotonic() - 120
    quiet, busy = Replica(last_used=old), Replica(last_used=time.monotonic())
    assert not scaler(Owner(model, quiet, busy)).may_idle_stop(quiet)
    assert scaler(Owner(model, quiet, Replica(last_used=old))).may_idle_stop(quiet)
    assert not scaler(Owner(model, quiet, Replica(last_used=old, leases=1))).may_idle_stop(quiet)


def test_downscale_sleeps_or_stops_a_replica_the_load_does_not_ask_for() -> None:
    model = auto(max_replicas=3, target_ongoing_requests=1)
    idle, other = Replica(), Replica(leases=1)
    assert scaler(Owner(model, idle, other, Replica())).downscale(idle)
    assert idle.asked == ["sleep:downscale", "evict:downscale"], "no sleep policy: stopped"
    napper = Replica(sleeps=True)
    assert scaler(Owner(model, napper, other, Replica())).downscale(napper)
    assert napper.asked == ["sleep:downscale"]


def test_downscale_keeps_a_replica_the_load_asks_for_and_goes_one_at_a_time() -> None:
    model = auto(max_replicas=3, target_ongoing_requests=1)
    idle = Replica()
    assert not scaler(Owner(model, idle, Replica(leases=2))).downscale(idle), "2 in flight: 2"
    falling_asleep = Replica(state=State.FALLING_ASLEEP)
    assert not scaler(Owner(model, idle, Replica(), falling_asleep)).downscale(idle)
    assert not scaler(Owner(model, idle, Replica(), Replica(state=State.STOPPING))).downscale(idle)
    assert idle.asked == []


def test_downscale_lets_go_of_a_replica_it_has_no_say_over() -> None:
    busy = Replica(leases=1)
    assert scaler(Owner(auto(max_replicas=3), busy, Replica())).downscale(busy)
    assert scaler(Owner(FIXED, Replica(), Replica())).downscale(Replica())
    assert busy.asked == []


def test_surplus_retires_asleep_then_least_busy_never_the_one_being_brought_up() -> None:
    model = spec(replicas=2)
    busy, quiet, asleep, bringing = (
        Replica(leases=5),
        Replica(leases=0, last_used=1.0),
        Replica(state=State.SLEEPING),
        Replica(state=State.STARTING),
    )
    owner = Owner(model, busy, quiet, asleep, bringing, Replica(retired=True))
    assert scaler(owner).surplus(keep=bringing) == [asleep, quiet]


def test_status_shows_the_bounds_and_counts() -> None:
    model = auto(min_replicas=1, max_replicas=3, target_ongoing_requests=1)
    owner = Owner(model, Replica(leases=2))
    assert scaler(owner).status() == {"mode": "autoscale", "min": 1, "max": 3, "desired": 2,
                                      "live": 1}  # fmt: skip
    assert scaler(Owner(model)).status()["desired"] == 1, "nothing serves: the floor"
    assert scaler(Owner(FIXED)).status()["mode"] == "fixed"
    assert scaler(Owner(SINGLE)).status()["mode"] == "single"
