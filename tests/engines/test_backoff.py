"""The crash-loop back-off: failures in a row, probation and delays on a clock of the test's own."""

from __future__ import annotations

import pytest

from vllm_proxy.engines.backoff import STABLE_S, Backoff, delay_for


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def backoff() -> tuple[Backoff, Clock]:
    clock = Clock()
    return Backoff("m", clock), clock


def failed_start(b: Backoff, key: str, max_s: float = 60) -> None:
    """An instance that never became ready."""
    b.ended(key, failed=True, ran=False, stopped=False, max_s=max_s)


def died(b: Backoff, key: str) -> None:
    """An instance that was ready, then crashed."""
    b.ended(key, failed=True, ran=True, stopped=False, max_s=60)


DELAYS = [
    pytest.param(0, 60, 0, 0.0, id="no failure"),
    pytest.param(1, 60, 0, 1.0, id="first"),
    pytest.param(2, 60, 0, 2.0, id="second"),
    pytest.param(4, 60, 0, 8.0, id="doubling"),
    pytest.param(10, 60, 0, 60.0, id="capped"),
    pytest.param(3, 0, 0, 0.0, id="no back-off configured"),
    pytest.param(1, 60, 1, 0.0, id="a free one"),
    pytest.param(2, 60, 1, 1.0, id="after the free one"),
    pytest.param(3, 60, 1, 2.0, id="after the free one, doubling"),
]


@pytest.mark.parametrize(("failures", "max_s", "grace", "delay"), DELAYS)
def test_delay_doubles_up_to_the_cap(failures: int, max_s: float, grace: int, delay: float) -> None:
    assert delay_for(failures, max_s, grace) == delay


def test_a_failed_start_backs_off_and_refuses_until_the_delay_is_over() -> None:
    b, clock = backoff()
    assert b.refusal("boom") is None
    failed_start(b, "m#1")
    assert b.failures == 1 and b.remaining() == 1.0
    err = b.refusal("exit code 7")
    assert err is not None
    assert err.status == 503 and err.code == "engine_backoff"
    assert err.headers["Retry-After"] == "1"
    assert "1 failed start(s) in a row" in err.message and "exit code 7" in err.message
    clock.now += 0.4
    refused = b.refusal(None)
    assert refused is not None and refused.headers["Retry-After"] == "1", "rounded up"
    clock.now += 0.6
    assert b.remaining() == 0 and b.refusal("exit code 7") is None
    failed_start(b, "m#2")
    assert b.failures == 2 and b.remaining() == 2.0


def test_the_cap_is_the_models_as_reloaded() -> None:
    b, _ = backoff()
    for n in range(1, 4):
        failed_start(b, f"m#{n}")
    assert b.remaining() == 4.0
    failed_start(b, "m#4", max_s=3)
    assert b.failures == 4 and b.remaining() == 3.0


def test_a_start_that_comes_up_lets_the_next_go_at_once_but_keeps_the_count() -> None:
    b, _ = backoff()
    failed_start(b, "m#1")
    b.up("m#2", started=True)
    assert b.remaining() == 0 and b.failures == 1


def test_the_first_death_on_probation_is_free_the_second_backs_off() -> None:
    b, clock = backoff()
    b.up("m#1", started=True)
    clock.now += STABLE_S - 1
    died(b, "m#1")
    assert b.failures == 1 and b.remaining() == 0, "one quick crash is retried at once"
    b.up("m#2", started=True)
    clock.now += 5
    died(b, "m#2")
    assert b.failures == 2 and b.remaining() == 1.0


def test_a_death_on_probation_after_a_failed_start_backs_off() -> None:
    b, _ = backoff()
    failed_start(b, "m#1")
    b.up("m#2", started=True)
    died(b, "m#2")
    assert b.failures == 2 and b.remaining() == 1.0


def test_living_through_probation_ends_the_loop() -> None:
    b, clock = backoff()
    failed_start(b, "m#1")
    b.up("m#2", started=True)
    clock.now += STABLE_S - 0.1
    assert b.failures == 1
    clock.now += 0.1
    assert b.failures == 0 and b.remaining() == 0


def test_probation_over_clears_a_back_off_begun_meanwhile() -> None:
    """A replica that lives through its probation ends the loop, even if another replica's
    start failed after it came up."""
    b, clock = backoff()
    b.up("m#1", started=True)
    clock.now += 10
    failed_start(b, "m#2")
    assert b.remaining() == 1.0
    clock.now += 0.5
    failed_start(b, "m#3")
    assert b.failures == 2 and b.remaining() == 2.0
    clock.now += STABLE_S - 10.5
    assert b.failures == 0 and b.remaining() == 0


def test_a_failure_after_probation_is_over_counts_from_zero() -> None:
    b, clock = backoff()
    failed_start(b, "m#1")
    b.up("m#2", started=True)
    clock.now += STABLE_S + 1
    failed_start(b, "m#3")
    assert b.failures == 1 and b.remaining() == 1.0


def test_a_death_after_probation_ends_the_loop() -> None:
    b, clock = backoff()
    b.up("m#1", started=True)
    clock.now += STABLE_S + 1
    failed_start(b, "m#2")
    died(b, "m#1")
    assert b.failures == 0


def test_a_woken_instance_is_not_on_probation() -> None:
    b, _ = backoff()
    failed_start(b, "m#1")
    b.up("m#2", started=False)
    died(b, "m#2")
    assert b.failures == 0, "a woken engine that dies is no failed start"


def test_a_stop_after_it_ran_ends_the_loop_a_refused_start_does_not() -> None:
    b, _ = backoff()
    failed_start(b, "m#1")
    b.ended("m#2", failed=False, ran=False, stopped=False, max_s=60)  # admission refused
    assert b.failures == 1
    b.up("m#3", started=True)
    b.ended("m#3", failed=False, ran=True, stopped=True, max_s=60)
    assert b.failures == 0
