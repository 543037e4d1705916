"""Unit tests: the transition table and the single place that applies it."""

from __future__ import annotations

import itertools
from pathlib import Path
from unittest.mock import MagicMock

import pytest

from vllm_proxy.config import parse_config
from vllm_proxy.instance import TRANSITIONS, EngineContext, Instance, InvalidTransition, State
from vllm_proxy.metrics import Metrics

ALLOWED = {
    (State.STOPPED, State.STARTING),
    (State.STARTING, State.RUNNING),
    (State.STARTING, State.STOPPING),
    (State.STARTING, State.ERROR),
    (State.STARTING, State.STOPPED),  # admission refused: no process was started
    (State.RUNNING, State.STOPPING),
    (State.RUNNING, State.ERROR),
    # Sleep: RUNNING -> SLEEPING (the /sleep call, then asleep) -> WAKING -> RUNNING.
    (State.RUNNING, State.SLEEPING),
    (State.SLEEPING, State.WAKING),
    (State.SLEEPING, State.STOPPING),  # evicted or idle while asleep; a failed /sleep
    (State.SLEEPING, State.ERROR),  # died while asleep
    (State.WAKING, State.RUNNING),
    (State.WAKING, State.SLEEPING),  # no memory for the wake in time: nothing was sent
    (State.WAKING, State.STOPPING),  # a failed wake: never serve from a half-woken engine
    (State.WAKING, State.ERROR),
    (State.STOPPING, State.STOPPED),
    # ERROR is final: the next start is a new instance with a new id.
}


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
    """The shape of the table, whatever its rows: an instance starts once from STOPPED, every
    state is reachable from there, ERROR is final, and nothing goes back to STARTING."""
    reachable, frontier = {State.STOPPED}, [State.STOPPED]
    while frontier:
        for nxt in TRANSITIONS[frontier.pop()]:
            if nxt not in reachable:
                reachable.add(nxt)
                frontier.append(nxt)
    assert reachable == set(State)
    assert TRANSITIONS[State.ERROR] == frozenset()
    assert [a for a, targets in TRANSITIONS.items() if State.STARTING in targets] == [State.STOPPED]
    assert State.STOPPED not in TRANSITIONS[State.RUNNING], "a running engine stops via STOPPING"


def test_table_is_exactly_the_documented_one() -> None:
    table = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    assert table == ALLOWED
    assert set(TRANSITIONS) == set(State)


@pytest.mark.parametrize(("old", "new"), list(itertools.product(State, State)))
async def test_set_state_enforces_the_table(tmp_path: Path, old: State, new: State) -> None:
    inst, metrics = _instance(tmp_path)
    inst.state = old
    if (old, new) in ALLOWED:
        inst._set_state(new)
        assert inst.state is new
        assert HOOKED == [("m#7", old, new)], "the model hears of every change"
        value = metrics.registry.get_sample_value(
            "vllm_proxy_instance_state", {"model_id": "m", "instance": "m#7", "state": new.value}
        )
        # A live instance has one state series; an ended one has none (ids are not reused).
        assert value == (None if new in (State.STOPPED, State.ERROR) else 1)
        old_value = metrics.registry.get_sample_value(
            "vllm_proxy_instance_state", {"model_id": "m", "instance": "m#7", "state": old.value}
        )
        assert old_value is None
    else:
        with pytest.raises(InvalidTransition):
            inst._set_state(new)
        assert inst.state is old
        assert HOOKED == []


async def test_transition_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    inst, _ = _instance(tmp_path)
    with caplog.at_level("INFO", logger="vllm_proxy.instance"):
        inst._set_state(State.STARTING)
    assert "m#7: STOPPED -> STARTING" in caplog.text


async def test_waiters_wake_on_every_change(tmp_path: Path) -> None:
    import asyncio

    inst, _ = _instance(tmp_path)
    waiter = asyncio.ensure_future(inst.wait_change())
    await asyncio.sleep(0)
    assert not waiter.done()
    inst._set_state(State.STARTING)
    await asyncio.wait_for(waiter, 1)
