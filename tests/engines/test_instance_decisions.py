"""The decisions an instance takes from the modules that hold their facts: which device lock a
stop takes (`memory.stop_path`), what a failed wake or sleep counts as (`failures`), the level a
sleep takes and the log line of a barred level (`breaker`), where a start or wake ends
(`states.awake_state`), when its idle timers run (`idle.idles`) and its admin row (`rows`).
Tables, no event loop, no process."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_proxy.engines.breaker import WakeBreaker, barred_note
from vllm_proxy.engines.engine import CallFailed
from vllm_proxy.engines.failures import (
    CallFailure,
    Stopped,
    WrongAnswer,
    classify_start,
    sleep_failure,
    stopped_while,
    wake_failure,
)
from vllm_proxy.engines.idle import idles
from vllm_proxy.engines.rows import instance_row, wall_time
from vllm_proxy.engines.states import State, awake_state
from vllm_proxy.errors import EngineFailed, consume_exception
from vllm_proxy.planning.memory import StopPath, stop_path

# -- which lock a stop takes ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("exited", "holds_lock", "path", "locks", "waits"),
    [
        (True, False, StopPath.EXITED, False, False),  # its memory went with it
        (True, True, StopPath.EXITED, False, False),
        (False, True, StopPath.OWN_LOCK, False, True),  # its start/wake/sleep holds the lock
        (False, False, StopPath.UNDER_LOCK, True, True),  # a neighbour may be profiling
    ],
)
def test_the_stop_path_by_exit_and_lock(
    exited: bool, holds_lock: bool, path: StopPath, locks: bool, waits: bool
) -> None:
    got = stop_path(exited, holds_lock)
    assert got is path
    assert (got.locks, got.waits) == (locks, waits)


# -- a failed wake or sleep ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("err", "expected"),
    [
        (
            WrongAnswer("t3"),
            CallFailure("oracle mismatch: t3", "wake_verify_failed", wrong_answer=True),
        ),
        (CallFailed("/wake_up answered 500"), CallFailure("/wake_up answered 500", "wake_failed")),
        (TimeoutError(), CallFailure("not awake within 30s", "wake_failed")),
        (RuntimeError("boom"), CallFailure("RuntimeError", "wake_failed", bug=True)),
    ],
)
def test_a_failed_wake_by_what_it_raised(err: Exception, expected: CallFailure) -> None:
    assert wake_failure(err, 30.0) == expected


@pytest.mark.parametrize(
    ("err", "expected"),
    [
        (CallFailed("/sleep answered 500"), CallFailure("/sleep answered 500", "sleep_failed")),
        (TimeoutError(), CallFailure("no answer within 12.5s", "sleep_failed")),
        (OSError("disk full"), CallFailure("disk full", "sleep_failed", bug=True)),
        (KeyError(), CallFailure("no answer within 12.5s", "sleep_failed", bug=True)),
    ],
)
def test_a_failed_sleep_by_what_it_raised(err: Exception, expected: CallFailure) -> None:
    assert sleep_failure(err, 12.5) == expected


def test_a_start_is_classified_only_when_placed_and_spawned() -> None:
    err = EngineFailed("model 'm': engine exited while starting")
    assert classify_start(err, (), None) is err
    assert classify_start(err, (0,), None) is err  # admitted, never spawned
    engine: Any = SimpleNamespace(log_path=Path("/nonexistent/m.1.log"))
    assert classify_start(err, (), engine) is err  # memory not managed: nothing to classify


def test_stopped_while_names_the_model_and_the_step() -> None:
    err = stopped_while("qwen", "waking")
    assert isinstance(err, Stopped) and err.code == "stopped"
    assert err.message == "model 'qwen' was stopped while waking"


# -- the level a sleep takes ---------------------------------------------------------------

KEY = ("m", "engine")


@pytest.mark.parametrize(
    ("barred", "policy", "asked", "reloadable", "usable"),
    [
        (set(), None, None, True, None),  # no sleep policy: no sleep
        (set(), None, 1, True, None),
        (set(), 1, None, False, 1),  # the policy's level
        (set(), 1, 2, True, 2),  # asked for another one
        ({1}, 1, None, True, 2),  # level 1 barred: level 2 where the weights reload
        ({1}, 1, None, False, None),
        ({1, 2}, 1, None, True, None),
        ({2}, 2, None, True, None),
    ],
)
def test_the_usable_level(
    barred: set[int], policy: int | None, asked: int | None, reloadable: bool, usable: int | None
) -> None:
    breaker = WakeBreaker(barred={KEY: barred})
    assert breaker.usable(KEY, policy, asked, reloadable) == usable


@pytest.mark.parametrize(
    ("usable", "then"),
    [(None, "it no longer sleeps until"), (2, "it sleeps at level 2 instead until")],
)
def test_the_note_of_a_barred_level(usable: int | None, then: str) -> None:
    note = barred_note("qwen", 1, usable)
    assert note.startswith("model qwen: its wakes from sleep level 1 kept failing the wake check")
    assert then in note and "POST /admin/models/qwen/wake_check/clear" in note


# -- where a start or a wake ends, and when the idle timers run -----------------------------


@pytest.mark.parametrize(("retired", "state"), [(False, State.RUNNING), (True, State.DRAINING)])
def test_a_start_or_wake_ends_running_unless_retired(retired: bool, state: State) -> None:
    assert awake_state(retired) is state


@pytest.mark.parametrize(
    ("state", "leases", "retired", "wake_asked", "runs"),
    [
        (State.RUNNING, 0, False, False, True),
        (State.FALLING_ASLEEP, 0, False, False, True),
        (State.SLEEPING, 0, False, False, True),
        (State.RUNNING, 1, False, False, False),  # serving
        (State.SLEEPING, 0, True, False, False),  # retired: it drains and stops
        (State.SLEEPING, 0, False, True, False),  # a request waits for its wake
        (State.DRAINING, 0, False, False, False),
        (State.STARTING, 0, False, False, False),
        (State.WAKING, 0, False, False, False),
        (State.STOPPED, 0, False, False, False),
    ],
)
def test_when_the_idle_timers_run(
    state: State, leases: int, retired: bool, wake_asked: bool, runs: bool
) -> None:
    assert idles(state, leases, retired, wake_asked) is runs


# -- the admin row -------------------------------------------------------------------------


def test_wall_time_of_a_monotonic_reading() -> None:
    assert wall_time(0.0, lambda: 100.0) is None  # never used
    got = wall_time(90.0, lambda: 100.0)
    assert got is not None
    assert abs((time.time() - got) - 10.0) < 1.0


def shown(state: State, exit_code: int | None = None, sleep_level: int = 0) -> Any:
    engine = SimpleNamespace(pid=42, tcp_port=8001, socket_path=None, exit_code=exit_code)
    ctx = SimpleNamespace(
        queue=SimpleNamespace(clock=lambda: 50.0), host=SimpleNamespace(retained={"m#1": 900})
    )
    return SimpleNamespace(
        id="m#1", state=state, engine=engine, sleep_level=sleep_level, devices=(0, 1), leases=2,
        ready_at=20.0, retired=False, last_error=None, last_used=0.0, log_path=Path("/l/m.1.log"),
        adapters=SimpleNamespace(status=lambda: {"a": "loaded"}), ctx=ctx,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("state", "exit_code", "sleep_level", "live", "uptime", "level", "devices"),
    [
        (State.RUNNING, None, 0, True, 30.0, 0, [0, 1]),
        (State.DRAINING, None, 0, True, 30.0, 0, [0, 1]),
        (State.SLEEPING, None, 2, True, None, 2, [0, 1]),
        (State.WAKING, None, 2, True, None, 0, [0, 1]),  # waking: not asleep any more
        (State.RUNNING, 1, 0, False, None, 0, [0, 1]),  # exited, not yet seen by its monitor
        (State.ERROR, 1, 0, False, None, 0, []),
    ],
)
def test_the_admin_row(
    state: State,
    exit_code: int | None,
    sleep_level: int,
    live: bool,
    uptime: float | None,
    level: int,
    devices: list[int],
) -> None:
    row = instance_row(shown(state, exit_code, sleep_level))
    assert row["state"] == state.public.value and row["phase"] == state.value
    assert (row["pid"], row["port"]) == ((42, 8001) if live else (None, None))
    assert row["uptime_s"] == uptime
    assert row["sleep_level"] == level
    assert row["devices"] == devices
    assert row["host_pinned_mb"] == 900 and row["adapters"] == {"a": "loaded"}
    assert row["last_used"] is None and row["log"] == "/l/m.1.log"


def test_a_background_task_s_exception_is_taken() -> None:
    task: Any = SimpleNamespace(cancelled=lambda: False, exception=lambda: None)
    consume_exception(task)  # nothing to take
    cancelled: Any = SimpleNamespace(cancelled=lambda: True)
    consume_exception(cancelled)
