"""Unit tests: the transition table and the single place that applies it."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from unittest.mock import MagicMock

import pytest

from vllm_proxy.config import parse_config
from vllm_proxy.engines.instance import Instance
from vllm_proxy.engines.ports import EngineContext
from vllm_proxy.engines.states import DOWN, TRANSITIONS, InvalidTransition, State
from vllm_proxy.metrics import Metrics

ALLOWED = {
    (State.NEW, State.STARTING),
    (State.STARTING, State.RUNNING),
    (State.STARTING, State.DRAINING),  # ready after it was retired
    (State.STARTING, State.STOPPING),
    (State.STARTING, State.ERROR),
    (State.STARTING, State.STOPPED),  # admission refused: no process was started
    (State.RUNNING, State.DRAINING),  # retired: no new request, its leases run out
    (State.RUNNING, State.STOPPING),
    (State.RUNNING, State.UNHEALTHY),
    (State.RUNNING, State.ERROR),
    (State.DRAINING, State.STOPPING),
    (State.DRAINING, State.UNHEALTHY),
    (State.DRAINING, State.ERROR),
    # Sleep: RUNNING -> FALLING_ASLEEP (the /sleep call) -> SLEEPING (asleep) -> WAKE_WAITING
    # (memory for the wake) -> WAKING (/wake_up) -> RUNNING.
    (State.RUNNING, State.FALLING_ASLEEP),
    (State.FALLING_ASLEEP, State.SLEEPING),
    (State.FALLING_ASLEEP, State.STOPPING),  # a failed /sleep; evicted meanwhile
    (State.FALLING_ASLEEP, State.UNHEALTHY),  # health probes missed before the call began
    (State.FALLING_ASLEEP, State.ERROR),  # died during the call
    (State.SLEEPING, State.WAKE_WAITING),
    (State.SLEEPING, State.STOPPING),  # evicted or idle while asleep
    (State.SLEEPING, State.UNHEALTHY),  # no answer to health probes while asleep
    (State.SLEEPING, State.ERROR),  # died while asleep
    (State.WAKE_WAITING, State.WAKING),  # admitted: its memory is claimed and free
    (State.WAKE_WAITING, State.SLEEPING),  # no memory for the wake in time: nothing was sent
    (State.WAKE_WAITING, State.STOPPING),
    (State.WAKE_WAITING, State.ERROR),
    (State.WAKING, State.RUNNING),
    (State.WAKING, State.DRAINING),  # awake after it was retired
    (State.WAKING, State.STOPPING),  # a failed wake: never serve from a half-woken engine
    (State.WAKING, State.ERROR),
    (State.STOPPING, State.STOPPED),
    # STOPPED, UNHEALTHY and ERROR are final: the next start is a new instance with a new id.
}

#: What operators see of each state (metrics labels, the admin API's ``state``).
PUBLIC = {
    State.NEW: "stopped",
    State.STARTING: "starting",
    State.RUNNING: "running",
    State.DRAINING: "running",
    State.FALLING_ASLEEP: "sleeping",
    State.SLEEPING: "sleeping",
    State.WAKE_WAITING: "waking",
    State.WAKING: "waking",
    State.STOPPING: "stopping",
    State.STOPPED: "stopped",
    State.UNHEALTHY: "error",
    State.ERROR: "error",
}
ENDED = {State.STOPPED, State.UNHEALTHY, State.ERROR}


HOOKED: list[tuple[str, State, State]] = []


def _instance(tmp_path: Path) -> tuple[Instance, Metrics]:
    cfg = parse_config({"server": {"state_dir": str(tmp_path)}, "models": {"m": {"model": "x"}}})
    metrics = Metrics()
    ctx = EngineContext(
        session=MagicMock(), ports=MagicMock(), registry=MagicMock(), metrics=metrics
    )
    HOOKED.clear()

    def hook(inst: Instance, old: State) -> None:
        HOOKED.append((inst.id, old, inst.state))

    return Instance(cfg.specs()["m"], "m#7", ctx, hook), metrics


def test_an_instance_lives_once() -> None:
    """The shape of the table, whatever its rows: an instance starts once from NEW, every
    state is reachable from there, the ended states are final, and nothing goes back to
    STARTING or NEW."""
    reachable, frontier = {State.NEW}, [State.NEW]
    while frontier:
        for nxt in TRANSITIONS[frontier.pop()]:
            if nxt not in reachable:
                reachable.add(nxt)
                frontier.append(nxt)
    assert reachable == set(State)
    assert all(TRANSITIONS[s] == frozenset() for s in ENDED)
    assert {s for s in State if not TRANSITIONS[s]} == ENDED == set(DOWN)
    assert [a for a, targets in TRANSITIONS.items() if State.STARTING in targets] == [State.NEW]
    assert all(State.NEW not in targets for targets in TRANSITIONS.values())
    for awake in (State.RUNNING, State.DRAINING):
        assert State.STOPPED not in TRANSITIONS[awake], "a running engine stops via STOPPING"


def test_every_state_shows_as_one_public_value() -> None:
    """Operators' values (metrics labels, the admin API's ``state``) are the seven they have
    always been; the exact state is the admin API's ``phase``."""
    assert {s: s.public.value for s in State} == PUBLIC
    assert {s.public for s in State} == {
        State.STOPPED, State.STARTING, State.RUNNING, State.SLEEPING, State.WAKING,
        State.STOPPING, State.ERROR,
    }  # fmt: skip


def test_table_is_exactly_the_documented_one() -> None:
    table = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    assert table == ALLOWED
    assert set(TRANSITIONS) == set(State)


@pytest.mark.parametrize(("old", "new"), list(itertools.product(State, State)))
async def test_set_state_enforces_the_table(tmp_path: Path, old: State, new: State) -> None:
    inst, metrics = _instance(tmp_path)
    inst.state = old
    metrics.set_instance_state("m", "m#7", State.NEW.public.value, old.public.value)

    def series(state: str) -> float | None:
        labels = {"model_id": "m", "instance": "m#7", "state": state}
        return metrics.registry.get_sample_value("vllm_proxy_instance_state", labels)

    if (old, new) in ALLOWED:
        inst._set_state(new)
        assert inst.state is new
        assert HOOKED == [("m#7", old, new)], "the model hears of every change"
        # A live instance has one state series, by its public value; an ended one has none
        # (ids are not reused).
        assert series(new.public.value) == (None if new in ENDED else 1)
        others = {s.public.value for s in State} - {new.public.value}
        assert all(series(v) is None for v in others)
    else:
        with pytest.raises(InvalidTransition):
            inst._set_state(new)
        assert inst.state is old
        assert HOOKED == []


async def test_transition_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    inst, _ = _instance(tmp_path)
    with caplog.at_level("INFO", logger="vllm_proxy.engines.instance"):
        inst._set_state(State.STARTING)
    assert "m#7: NEW -> STARTING" in caplog.text


async def test_waiters_wake_on_every_change(tmp_path: Path) -> None:
    inst, _ = _instance(tmp_path)
    waiter = asyncio.ensure_future(inst.wait_change())
    await asyncio.sleep(0)
    assert not waiter.done()
    inst._set_state(State.STARTING)
    await asyncio.wait_for(waiter, 1)


async def test_a_change_before_the_waiter_first_runs_is_not_lost(tmp_path: Path) -> None:
    """A task made of `wait_change()` runs a loop turn later: a change in between (an unload
    stopping a start that waits for memory) still ends its wait."""
    inst, _ = _instance(tmp_path)
    waiter = asyncio.ensure_future(inst.wait_change())
    inst._set_state(State.STARTING)  # before the task's first step
    await asyncio.wait_for(waiter, 1)


async def test_the_named_sub_states_read_the_state(tmp_path: Path) -> None:
    """`routable`, `asleep` and `unhealthy` are the state, never a flag beside it."""
    inst, _ = _instance(tmp_path)
    named = {
        "routable": {State.RUNNING},
        "asleep": {State.SLEEPING},
        "unhealthy": {State.UNHEALTHY},
        "done": ENDED,
    }
    for state in State:
        inst.state = state
        for name, states in named.items():
            assert getattr(inst, name) is (state in states), (name, state)


async def test_a_retired_instance_drains_and_a_new_one_stops_at_once(tmp_path: Path) -> None:
    """retire(): a RUNNING instance is DRAINING at once (no new lease); one never started
    has nothing to stop."""
    inst, _ = _instance(tmp_path)
    await inst.stop()
    assert inst.state is State.NEW and not inst.done
    inst.state = State.RUNNING
    inst.engine = MagicMock()
    inst.retired = True  # (retire() would also begin the drain task)
    inst._set_state(State.DRAINING)
    assert not inst.routable
    with pytest.raises(InvalidTransition):
        inst.acquire()


@pytest.mark.parametrize("old", [State.STARTING, State.WAKING])
def test_an_instance_up_after_it_was_retired_is_up_for_the_back_off(
    tmp_path: Path, old: State
) -> None:
    """Regression: a start (or a wake) that ends after a reload retired its instance lands in
    DRAINING, not RUNNING; the model's back-off must still see it come up (a fresh start is
    on probation), as it did when a retired instance was RUNNING."""
    from vllm_proxy.engines.model import Model

    cfg = parse_config({"server": {"state_dir": str(tmp_path)}, "models": {"m": {"model": "x"}}})
    ctx = EngineContext(
        session=MagicMock(), ports=MagicMock(), registry=MagicMock(), metrics=Metrics()
    )
    model = Model(cfg.specs()["m"], ctx, lambda name: f"{name}#1")
    ups: list[tuple[str, bool]] = []
    model.backoff.up = lambda key, started: ups.append((key.id, started))  # type: ignore[method-assign]
    inst = model._new_instance()
    inst.retired = True
    inst.state = State.DRAINING  # what `states.awake_state` gives a retired instance
    model._instance_changed(inst, old)
    assert ups == [("m#1", old is State.STARTING)]
    ups.clear()
    model._instance_changed(inst, State.RUNNING)  # retired while RUNNING: not a new start
    assert ups == []
