"""The admission queue: its pure rules, and each rule on the proxy with fake engines.

One GPU slot (a static budget that holds one model) makes every rule visible: which request
is served first, which engine is put to sleep or stopped, how long a waiter can be passed.

The last section, the queue under hostile traffic: clients that hang up, reloads and unloads
while requests wait, priority inversion, bursts on many models, replicas, sleepers and pinned
models.

Every test runs the fake engine as real processes on a static GPU budget and checks invariants
rather than one schedule: no ticket outlives its request, no engine is stopped or put to sleep
under a lease, the memory handed out never exceeds the budget, every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kit import (
    FakeEngine,
    RunningProxy,
    StartProxy,
    chat_body,
    config_data,
    free_port,
    wait_for,
    write_config,
)
from kit.load import SLOW, Served, busy, one_slot
from kit.watch import Watch, held

from vllm_proxy.config import parse_config
from vllm_proxy.engines.model import Model
from vllm_proxy.engines.states import State
from vllm_proxy.frontend.bytes.body import model_of
from vllm_proxy.metrics import Metrics
from vllm_proxy.planning.planner import Demand, DeviceView, InstanceView, NoFit, Phase, Plan, plan
from vllm_proxy.planning.queueing import (
    GO,
    IF_FIRST_STILL_FITS,
    WAIT,
    Queue,
    Rank,
    Rules,
    Waiter,
    give_up_at,
    holds,
    in_use,
    next_deadline,
    order,
    overdue,
    protected,
    spare_s,
    turn,
)
from vllm_proxy.pool.admission import MIN_WAIT_S, Admission

# -- pure rules -------------------------------------------------------------------------------

RULES = Rules(max_reorder_s=5.0, idle_grace_s=2.0, queue_timeout_s=30.0)


def test_queue_order_is_rank_then_arrival() -> None:
    a = Waiter("a", (0, 0), since=10.0, seq=1)
    b = Waiter("b", (0, 0), since=5.0, seq=2)
    c = Waiter("c", (-1, 0), since=20.0, seq=3)  # a lower value ranks first
    d = Waiter("d", (0, -5), since=30.0, seq=4)  # then the rank's second place
    assert [w.model for w in order([a, b, c, d])] == ["c", "d", "b", "a"]


def test_window_is_capped_by_half_the_queue_timeout() -> None:
    w = Waiter("b", (0, 0), since=100.0)
    assert not overdue(w, 104.9, RULES) and overdue(w, 105.0, RULES)
    short = Rules(max_reorder_s=5.0, queue_timeout_s=4.0)
    assert short.window_s == 2.0 and overdue(w, 102.0, short)
    assert overdue(w, 100.0, Rules(max_reorder_s=0.0))  # strict FIFO: no window


def test_a_waiter_spares_stops_for_its_queue_timeout_less_one_window() -> None:
    assert spare_s(30.0, RULES) == 25.0
    assert spare_s(30.0, Rules(max_reorder_s=20.0, queue_timeout_s=30.0)) == 15.0
    assert spare_s(0.0, Rules(queue_timeout_s=0.0)) == 0.0


def test_in_use_counts_the_idle_grace() -> None:
    assert in_use(1, 0, 0.0, 100.0, RULES)
    assert in_use(0, 1, 0.0, 100.0, RULES)
    assert in_use(0, 0, 98.5, 100.0, RULES)
    assert not in_use(0, 0, 98.0, 100.0, RULES)


@pytest.mark.parametrize(
    ("since", "minimum", "busy", "waiter_since", "expected"),
    [
        (90.0, 30.0, True, 99.0, True),  # inside residency, in use, window open
        (60.0, 30.0, True, 99.0, False),  # residency over
        (90.0, 30.0, False, 99.0, False),  # idle: nothing to protect
        (90.0, 30.0, True, 90.0, False),  # the waiter's window has run out
        (90.0, 0.0, True, 99.0, False),  # no minimum residency
    ],
)
def test_protected(
    since: float, minimum: float, busy: bool, waiter_since: float, expected: bool
) -> None:
    waiter = Waiter("b", (0, 0), waiter_since)
    assert protected(since, minimum, busy, 100.0, waiter, RULES) is expected


def test_holds_needs_an_overdue_waiter_before_the_request_that_takes_the_engine() -> None:
    w = Waiter("b", (0, 0), since=90.0)
    assert holds(w, (0, 0), 99.0, ["a#1"], "a#1", 100.0, RULES)
    assert not holds(w, (0, 0), 99.0, ["c#1"], "a#1", 100.0, RULES)  # it does not need a#1
    assert not holds(w, (-1, 0), 99.0, ["a#1"], "a#1", 100.0, RULES)  # the request ranks higher
    assert not holds(w, (0, 0), 80.0, ["a#1"], "a#1", 100.0, RULES)  # the request came first
    assert holds(w, (1, 0), 80.0, ["a#1"], "a#1", 100.0, RULES)  # ... but ranks lower
    young = Waiter("b", (0, 0), since=97.0)
    assert not holds(young, (0, 0), 99.0, ["a#1"], "a#1", 100.0, RULES)  # window still open


@pytest.mark.parametrize(
    ("since", "placeable", "reclaims", "quick", "expected"),
    [
        (200.0, True, False, False, IF_FIRST_STILL_FITS),  # free memory: whenever it came
        (200.0, True, True, True, IF_FIRST_STILL_FITS),  # a quick wake: idle engines too
        (101.0, True, True, False, WAIT),  # a slow start waits behind a head that waits
        (101.0, False, True, False, GO),  # the head waits for something else: within the window
        (200.0, False, True, True, WAIT),  # ... never after it
        (200.0, False, False, False, GO),
    ],
)
def test_turn(since: float, placeable: bool, reclaims: bool, quick: bool, expected: str) -> None:
    first = Waiter("a", (0, 0), since=100.0)
    me = Waiter("b", (0, 0), since=since)
    answer = turn(me, first, RULES, first_placeable=placeable, reclaims=reclaims, quick=quick)
    assert answer == expected
    assert turn(first, first, RULES, first_placeable=True, reclaims=True) == GO


def test_next_deadline_is_the_earliest_future_change() -> None:
    waiters = [Waiter("b", (0, 0), since=98.0)]
    residents = [(90.0, 30.0, 99.5)]  # residency ends at 120, the grace at 101.5
    assert next_deadline(waiters, residents, 100.0, RULES) == 101.5
    assert next_deadline([], [(90.0, 0.0, 99.5)], 100.0, RULES) is None


@pytest.mark.parametrize(
    ("expected_end", "timeout_s", "max_wait_s", "gives_up"),
    [
        (100.0, 30.0, 300.0, 130.0),  # nothing ahead: the plain queue timeout
        (160.0, 30.0, 300.0, 190.0),  # a cold start ahead ends at 160: a timeout after it
        (500.0, 30.0, 300.0, 400.0),  # never past the client's patience
        (500.0, 30.0, 10.0, 130.0),  # a patience below the timeout: the timeout
        (160.0, 0.0, 300.0, 100.0),  # 0: at once, whatever is ahead
    ],
)
def test_a_waiter_gives_up_a_timeout_after_the_bring_ups_ahead_of_it(
    expected_end: float, timeout_s: float, max_wait_s: float, gives_up: float
) -> None:
    rules = Rules(queue_timeout_s=timeout_s, max_wait_s=max_wait_s)
    assert give_up_at(100.0, expected_end, timeout_s, rules) == gives_up


def test_a_waiter_behind_bring_ups_spares_stops_until_a_window_before_it_gives_up() -> None:
    """A plan that stops engines which waiting would spare waits for busy ones until the queue
    timeout less a window after the waiter began; where bring-ups ahead of it pushed its
    give-up time back, until one window before that."""
    from types import SimpleNamespace

    from vllm_proxy.pool.admission import Admission

    adm = Admission.__new__(Admission)
    adm.queue = Queue(Rules(max_reorder_s=5.0, queue_timeout_s=30.0))
    adm._give_up = {}
    inst: Any = SimpleNamespace(id="b#1", spec=SimpleNamespace(queue_timeout_s=None))
    waiter = Waiter("b", (0, 0), since=100.0)
    assert adm._spare_until(inst, waiter) == 125.0
    adm._give_up["b#1"] = 200.0  # a cold start ahead of it
    assert adm._spare_until(inst, waiter) == 195.0
    adm._give_up["b#1"] = 110.0  # never earlier than the plain rule
    assert adm._spare_until(inst, waiter) == 125.0


def test_a_deadline_a_float_step_ahead_is_waited_for_long_enough_to_pass() -> None:
    """A window that ends one float step after now: the waiter waits `MIN_WAIT_S`, so the plan
    it makes when woken sees the window ended (a wait of one step would wake it again and
    again, on uvloop at once, until the clock moved past it)."""
    now = 100.0
    queue = Queue(RULES, clock=lambda: now)
    due = math.nextafter(now, math.inf)
    queue.enter("b", (0, 0), since=due - RULES.window_s)
    assert next_deadline(queue.waiters(), [], now, RULES) == due
    adm = Admission(queue, Metrics(), None, lambda: [], lambda: {})  # type: ignore[arg-type]
    assert adm._next_change() == MIN_WAIT_S
    assert adm._next_change() > due - now
    # A deadline further off is waited for as it is.
    queue.enter("c", (0, 0), since=now + 2.0 - RULES.window_s)
    now = math.nextafter(due, math.inf)  # the first one has passed
    assert adm._next_change() == pytest.approx(2.0)


async def test_queue_groups_tickets_by_model_and_skips_held_ones() -> None:
    queue = Queue(RULES)
    queue.enter("a", (0, 0), since=5.0)
    queue.enter("b", (0, 0), since=3.0)
    later_a = queue.enter("a", (0, 0), since=1.0)
    queue.enter("c", (0, 0), since=0.0, held=True)
    assert [(w.model, w.since) for w in queue.waiters()] == [("a", 1.0), ("b", 3.0)]
    assert queue.waiting("a") == 2 and queue.waiting("c") == 0
    queue.leave(later_a)
    assert [w.model for w in queue.waiters()] == ["b", "a"]
    assert [w.model for w in queue.waiters(bringing=["a"])] == ["a"]


def view(name: str, last: float, **kw: Any) -> InstanceView:
    return InstanceView(name, 400, (0,), Phase.RUNNING, 0, last, False, **kw)


def test_the_victim_is_the_cheapest_to_bring_back_not_the_least_recently_used() -> None:
    devices = [DeviceView(0, 1000, 800)]
    demand = Demand("z#1", 400, 1, None, 0)
    slow = view("slow#1", last=90.0, start_s=60.0)  # least recently used, a minute to return
    fast = view("fast#1", last=95.0, start_s=2.0)
    assert plan(demand, devices, [slow, fast]) == Plan((0,), ("slow#1",))  # no clock: LRU
    assert plan(demand, devices, [slow, fast], now=100.0) == Plan((0,), ("fast#1",))
    # Idle far longer, the dear one goes after all: 64 s / 3000 s idle < 4 s / 5 s idle.
    old = view("slow#1", last=-2900.0, start_s=60.0)
    assert plan(demand, devices, [old, fast], now=100.0) == Plan((0,), ("slow#1",))


def test_a_victim_slow_to_fall_asleep_is_dearer() -> None:
    """The waiter waits for its victims' sleeps: an engine whose first level-1 sleep (its
    pinned host buffers allocated) takes 15 s is priced by its wake and that sleep, so the
    one that falls asleep at once goes, though it was used more recently."""
    devices = [DeviceView(0, 1000, 800)]
    demand = Demand("z#1", 300, 1, None, 0)
    fresh = view("fresh#1", last=95.0, sleep_mb=50, wake_s=2.0, sleep_s=15.0)
    used = view("used#1", last=96.0, sleep_mb=50, wake_s=2.0, sleep_s=0.5)
    assert plan(demand, devices, [fresh, used], now=100.0) == Plan((0,), (), ("used#1",))
    unmeasured = view("fresh#1", last=95.0, sleep_mb=50, wake_s=2.0)  # LRU among equals
    assert plan(demand, devices, [unmeasured, used], now=100.0) == Plan((0,), (), ("fresh#1",))


def test_priority_goes_before_price_and_protected_engines_are_never_taken() -> None:
    devices = [DeviceView(0, 1000, 800)]
    demand = Demand("z#1", 400, 1, None, 0)
    keep = view("keep#1", last=0.0, start_s=1.0, priority=-1)
    spare = view("spare#1", last=99.0, start_s=60.0, priority=0)
    assert plan(demand, devices, [keep, spare], now=100.0) == Plan((0,), ("spare#1",))
    guarded = view("spare#1", last=99.0, protected=True)
    decision = plan(demand, devices, [guarded], now=100.0)
    assert not isinstance(decision, Plan)
    assert decision.blockers == ("spare#1",) and "minimum residency" in decision.reason


# -- the proxy with fake engines --------------------------------------------------------------


async def served_then_asleep(proxy: RunningProxy, name: str) -> None:
    """One answer from `name`, then its engine put to sleep."""
    assert (await proxy.chat(name, max_tokens=1)).status == 200
    nap_task = proxy.instance(name).sleep("test")
    assert nap_task is not None
    await nap_task


async def test_a_burst_a_b_a_a_c_is_served_a_a_a_b_c(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """A serves; B (a swap) waits; more A requests are not held behind B's swap while B's
    window is open, and C, which came after B, waits behind it."""
    cfg = one_slot(
        tmp_path, {"a": {}, "b": {}, "c": {}}, {"max_reorder_s": 5, "idle_grace_s": 1.5},
        min_resident_s=30,
    )  # fmt: skip
    proxy = await start_proxy(cfg)
    served = Served(proxy)
    served.send("a1", "a", tokens=30)  # ~1 s on A
    await wait_for(lambda: busy(proxy, "a"), what="a1 in flight")
    served.send("b", "b")
    await wait_for(lambda: proxy.manager.queue.waiting("b") > 0, what="b queued")
    await wait_for(lambda: "a1" in served.order, what="a1 answered")
    # a1 has ended: A is idle, but in use within its grace; B may not take it yet.
    served.send("a2", "a")
    served.send("a3", "a")
    await wait_for(lambda: {"a2", "a3"} <= set(served.order), what="a2, a3 answered")
    served.send("c", "c")
    assert await served.statuses() == [200] * 5
    assert served.order == ["a1", "a2", "a3", "b", "c"]
    assert proxy.engine_starts("a") == 1, "A was never swapped out and back in"


async def test_strict_fifo_holds_the_resident_model_behind_a_waiter(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """max_reorder_s 0: a request for A that comes after B waits for B's turn."""
    cfg = one_slot(tmp_path, {"a": {}, "b": {}}, {"max_reorder_s": 0}, min_resident_s=30)
    proxy = await start_proxy(cfg)
    served = Served(proxy)
    served.send("a1", "a", tokens=30)
    await wait_for(lambda: busy(proxy, "a"), what="a1 in flight")
    served.send("b", "b")
    await wait_for(lambda: proxy.manager.queue.waiting("b") > 0, what="b queued")
    served.send("a2", "a")
    await wait_for(
        lambda: any(t.held for t in proxy.manager.queue.tickets.values()), what="a2 held"
    )
    assert await served.statuses() == [200] * 3
    assert served.order == ["a1", "b", "a2"]


async def test_back_to_back_clients_of_two_models_do_not_thrash(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Two clients, one model each, one slot: each side keeps the GPU for its window instead
    of a swap after every answer (without the rules: a swap per request pair). The window is
    long beside one answer's time even on a busy machine, so a turn holds several answers."""
    window = 3.0
    cfg = one_slot(
        tmp_path, {"a": {}, "b": {}}, {"max_reorder_s": window, "idle_grace_s": 1},
        min_resident_s=30,
    )  # fmt: skip
    proxy = await start_proxy(cfg)
    began = time.monotonic()
    # At least 12 s of traffic, and on until each side has had 2 answers (a slow machine
    # stretches every start; the bound below scales with the time taken).
    deadline = began + 120.0
    answered = {"a": 0, "b": 0}

    def done() -> bool:
        return time.monotonic() - began >= 12.0 and min(answered.values()) >= 2

    async def client(model: str) -> None:
        while not done():
            assert time.monotonic() < deadline, f"one side starves: {answered}"
            resp = await proxy.chat(model, max_tokens=3)
            await resp.read()
            assert resp.status == 200
            answered[model] += 1

    await asyncio.gather(client("a"), client("b"))
    elapsed = time.monotonic() - began
    starts = proxy.engine_starts("a") + proxy.engine_starts("b")
    answers = list(answered.values())
    # Each turn lasts about a window plus a start: far fewer starts than answers.
    assert starts <= 3 + elapsed / window, (starts, answers, elapsed)
    assert sum(answers) >= 2 * starts, (starts, answers)


async def test_a_model_inside_its_minimum_residency_is_not_taken_while_in_use(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    cfg = one_slot(
        tmp_path, {"a": {}, "b": {}}, {"max_reorder_s": 3, "idle_grace_s": 1},
        min_resident_s=30,
    )  # fmt: skip
    proxy = await start_proxy(cfg)
    assert (await proxy.chat("a", max_tokens=2)).status == 200
    a = proxy.instance("a")
    served = Served(proxy)
    served.send("b", "b")
    sent = time.monotonic()
    await wait_for(lambda: proxy.manager.queue.waiting("b") > 0, what="b queued")
    # Keep A in use (gaps shorter than the grace) until B's window runs out.
    while a.state is State.RUNNING and time.monotonic() - sent < 2.5:
        resp = await proxy.chat("a", max_tokens=2)
        await resp.read()
        assert resp.status == 200
    assert a.state is State.RUNNING, "evicted inside its minimum residency while in use"
    assert await served.statuses() == [200]
    assert a.state in (State.STOPPED, State.STOPPING)


async def test_an_idle_model_is_taken_at_once_despite_its_minimum_residency(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    cfg = one_slot(
        tmp_path, {"a": {}, "b": {}}, {"max_reorder_s": 20, "idle_grace_s": 0.2},
        min_resident_s=60,
    )  # fmt: skip
    proxy = await start_proxy(cfg)
    assert (await proxy.chat("a", max_tokens=2)).status == 200
    a = proxy.instance("a")
    await wait_for(lambda: time.monotonic() - a.last_used > 0.2, what="a idle past its grace")
    sent = time.monotonic()
    assert (await proxy.chat("b", max_tokens=2)).status == 200
    assert time.monotonic() - sent < 10, "b did not wait for a's residency or its window"


async def test_the_cheap_to_bring_back_victim_is_chosen(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """slow (a 6 s start) was used before fast (under a second): LRU would stop slow; the
    price (restore seconds per idle second; below 4 s all starts count alike) stops fast."""
    models = {
        "slow": {"memory_mb": 400, "env": FakeEngine(startup_delay=6).env()},
        "fast": {"memory_mb": 400},
        "z": {"memory_mb": 400},
    }
    cfg = one_slot(tmp_path, models, min_resident_s=0)
    proxy = await start_proxy(cfg)
    assert (await proxy.chat("slow", max_tokens=1)).status == 200
    assert (await proxy.chat("fast", max_tokens=1)).status == 200
    slow, fast = proxy.instance("slow"), proxy.instance("fast")
    assert (await proxy.chat("z", max_tokens=1)).status == 200
    assert slow.state is State.RUNNING
    assert fast.state in (State.STOPPED, State.STOPPING)
    timings = proxy.manager.admission.timings
    measured = {name: kinds["start"] for (name, _), kinds in timings.items()}
    assert measured["slow"] > 6.0 > measured["fast"]


async def test_an_engines_first_sleep_is_timed_apart_from_its_later_ones(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """The first level-1 sleep of an engine allocates its pinned host buffers and is the
    slowest; the planner prices a victim by the sleep it would take next, measured apart."""
    nap = {"level": 1, "after_idle_s": 600, "memory_mb": 50}
    models = {"s": {"memory_mb": 300, "sleep": nap}}
    proxy = await start_proxy(one_slot(tmp_path, models, min_resident_s=0))
    timings = proxy.manager.admission.timings
    await served_then_asleep(proxy, "s")
    inst = proxy.instance("s")
    [kinds] = [k for (name, _), k in timings.items() if name == "s"]
    assert "first sleep" in kinds and "sleep" not in kinds
    assert inst.next_sleep_kind == "sleep"
    await served_then_asleep(proxy, "s")  # woken by the request, then asleep again
    assert "sleep" in kinds
    [seen] = [v for v in proxy.manager.admission._views()[0] if v.name == inst.id]
    assert seen.sleep_s == kinds["sleep"]


async def test_priorities_order_the_queue(tmp_path: Path, start_proxy: StartProxy) -> None:
    """low (priority 5) asks first, high (priority -1) second: high is served first. Between
    models of equal priority the request's own priority does not decide, even where the
    engines rank requests by it: it orders requests within a model, so r1 (10) goes before
    r2 (-3), which came after it."""
    ranked = {"args": {"scheduling_policy": "priority"}}
    models = {"a": {}, "low": {"priority": 5}, "high": {"priority": -1}, "r1": ranked, "r2": ranked}
    cfg = one_slot(tmp_path, models, {"max_reorder_s": 0}, min_resident_s=0)
    proxy = await start_proxy(cfg)
    served = Served(proxy)
    served.send("a", "a", tokens=40)
    await wait_for(lambda: busy(proxy, "a"), what="a in flight")
    served.send("low", "low")
    await wait_for(lambda: proxy.manager.queue.waiting("low") > 0, what="low queued")
    served.send("high", "high")
    await wait_for(lambda: proxy.manager.queue.waiting("high") > 0, what="high queued")
    served.send("r1", "r1", priority=10)
    await wait_for(lambda: proxy.manager.queue.waiting("r1") > 0, what="r1 queued")
    served.send("r2", "r2", priority=-3)
    await wait_for(lambda: proxy.manager.queue.waiting("r2") > 0, what="r2 queued")
    assert await served.statuses() == [200] * 5
    assert served.order == ["a", "high", "r1", "r2", "low"]


async def test_a_stuck_queue_is_bounded_by_its_timeout(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """A never drains (a long stream): B gives up after queue_timeout_s with a 503 naming the
    cause, and the A request held behind B is then served, not failed."""
    cfg = one_slot(
        tmp_path, {"a": {}, "b": {}}, {"max_reorder_s": 0, "queue_timeout_s": 1.5},
        min_resident_s=0,
    )  # fmt: skip
    proxy = await start_proxy(cfg)
    stream = await proxy.chat("a", max_tokens=100, stream=True)  # 3 s
    await stream.content.readany()
    sent = time.monotonic()
    b = asyncio.ensure_future(proxy.chat("b", max_tokens=1))
    await wait_for(lambda: proxy.manager.queue.waiting("b") > 0, what="b queued")
    a2 = asyncio.ensure_future(proxy.chat("a", max_tokens=1))
    resp = await b
    assert resp.status == 503
    err = (await resp.json())["error"]
    assert err["code"] == "insufficient_gpu_memory" and "'a#1'" in err["message"]
    assert time.monotonic() - sent < 1.5 + 1.0
    assert (await a2).status == 200
    assert not proxy.manager.queue.tickets
    await stream.read()


@pytest.mark.parametrize("max_wait_s", [300.0, 1.5])
async def test_a_request_behind_a_cold_start_waits_past_the_queue_timeout_within_patience(
    tmp_path: Path, start_proxy: StartProxy, max_wait_s: float
) -> None:
    """b waits for the one slot while a cold-starts (3 s, longer than the 1 s queue timeout):
    that wait is for a bring-up under way, so b is served once a is done with its request,
    not refused at 1 s. With a patience (max_wait_s) of 1.5 s it gets its 503 then."""
    cold = FakeEngine(startup_delay=3).env()
    models = {"a": {"env": cold}, "b": {}}
    admission = {"max_reorder_s": 0, "queue_timeout_s": 1, "max_wait_s": max_wait_s}
    proxy = await start_proxy(one_slot(tmp_path, models, admission, min_resident_s=0))
    a = asyncio.ensure_future(proxy.chat("a", max_tokens=1))
    await wait_for(lambda: proxy.model("a").instances, what="a starting")
    sent = time.monotonic()
    resp = await proxy.chat("b", max_tokens=1)
    waited = time.monotonic() - sent
    assert (await a).status == 200
    if max_wait_s > 3:
        assert resp.status == 200, await resp.text()
        assert waited > 1
    else:
        assert resp.status == 503
        err = (await resp.json())["error"]
        assert err["code"] == "insufficient_gpu_memory"
        assert waited < 3, "the patience did not bound the wait"


async def test_a_start_that_only_pinned_engines_keep_out_gets_503_at_once(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """big needs what the pinned model holds, so it cannot be placed however long it waits:
    503 at once (not after the queue timeout), naming the pinned engine; small, after it,
    stops the idle x and starts."""
    models = {
        "pinned": {"memory_mb": 500, "pinned": True},
        "x": {"memory_mb": 300},
        "big": {"memory_mb": 800},
        "small": {"memory_mb": 400},
    }
    cfg = one_slot(tmp_path, models, {"queue_timeout_s": 20}, min_resident_s=0)
    proxy = await start_proxy(cfg)
    for name in ("pinned", "x"):
        assert (await proxy.chat(name, max_tokens=1)).status == 200
    sent = time.monotonic()
    resp = await proxy.chat("big", max_tokens=1)
    assert resp.status == 503
    assert time.monotonic() - sent < 3, "big waited for memory it can never get"
    message = (await resp.json())["error"]["message"]
    assert "'pinned#1'" in message and "waiting cannot help" in message, message
    assert (await proxy.chat("small", max_tokens=1)).status == 200
    assert proxy.instance("x").state in (State.STOPPED, State.STOPPING)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"model": "m", "priority": -3}', -3),
        (b'{"priority": 7, "model": "m"}', 7),
        (b'{"model": "m", "priority": 1.5}', None),
        (b'{"model": "m", "priority": true}', None),
        (b'{"model": "m", "priority": "1"}', None),
        (b'{"model": "m", "priority": 3, "priority": null}', None),  # the last one wins
        (b'{"model": "m", "extra": {"priority": 4}}', None),  # only the top level
        (b'{"model": "m", "priority": 99999999999}', None),  # out of range
        (b'{"model": "m"}', None),
    ],
)
def test_the_request_priority_is_read_from_parsed_and_scanned_bodies(
    body: bytes, expected: int | None
) -> None:
    """vLLM's own field, found both where a small body is parsed and where a large one is
    scanned as it arrives (padded past the scan threshold here)."""
    assert model_of(body).priority == expected
    padded = body[:-1] + b', "pad": "' + b"x" * 300_000 + b'"}'
    assert model_of(padded).priority == expected


async def test_a_stuck_head_does_not_hold_back_a_start_that_fits_at_once(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """a serves one long stream; b (600 MiB) waits for a's memory, its window over; s (300
    MiB) fits in the free memory and leaves b's plan intact: it starts at once (it waited
    until b's queue timeout), and b still gets its turn once the stream ends."""
    long = FakeEngine(tokens=200, token_delay=0.03).env()
    models = {"a": {"env": long}, "b": {}, "s": {"memory_mb": 300}}
    cfg = one_slot(
        tmp_path, models, {"max_reorder_s": 0.2, "queue_timeout_s": 12}, min_resident_s=0
    )
    proxy = await start_proxy(cfg)
    stream = await proxy.chat("a", max_tokens=200, stream=True)  # 6 s
    await stream.content.readany()
    b = asyncio.ensure_future(proxy.chat("b", max_tokens=1))
    await wait_for(lambda: proxy.manager.queue.waiting("b") > 0, what="b queued")
    await wait_for(
        lambda: time.monotonic() - proxy.manager.queue.waiters()[0].since > 0.4,
        what="b's window over",
    )
    sent = time.monotonic()
    assert (await proxy.chat("s", max_tokens=1)).status == 200
    assert time.monotonic() - sent < 3.0, "s waited for b's turn"
    assert not b.done(), "b still waits for a's stream"
    await stream.read()
    assert (await b).status == 200


async def test_a_quick_wake_behind_a_head_that_waits_for_a_stream_puts_an_idle_engine_to_sleep(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """a streams; b (600 MiB), first in the queue, waits for a's memory. w, asleep, wakes
    behind it by putting the idle i to sleep: b's plan still fits once a drains and waits
    for nothing more, so w is served at once instead of after the stream (and b after it)."""
    long = FakeEngine(tokens=200, token_delay=0.03).env()
    nap = {"level": 1, "after_idle_s": 60, "memory_mb": 50}
    models = {
        "a": {"memory_mb": 500, "env": long},
        "i": {"memory_mb": 300, "sleep": nap},
        "w": {"memory_mb": 300, "sleep": nap},
        "b": {},
    }
    cfg = one_slot(tmp_path, models, {"max_reorder_s": 6, "queue_timeout_s": 30},
                   min_resident_s=0)  # fmt: skip
    proxy = await start_proxy(cfg)
    await served_then_asleep(proxy, "w")
    assert (await proxy.chat("i", max_tokens=1)).status == 200
    stream = await proxy.chat("a", max_tokens=200, stream=True)  # 6 s
    await stream.content.readany()
    b = asyncio.ensure_future(proxy.chat("b", max_tokens=1))
    await wait_for(lambda: proxy.manager.queue.waiting("b") > 0, what="b queued")
    sent = time.monotonic()
    assert (await proxy.chat("w", max_tokens=1)).status == 200
    assert time.monotonic() - sent < 3.0, "w waited for the stream that b waits for"
    assert proxy.instance("i").asleep
    assert not b.done(), "b still waits for a's stream"
    await stream.read()
    assert (await b).status == 200


async def test_a_model_s_own_queue_timeout_bounds_its_wait_for_memory(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """b's queue_timeout_s (1 s) ends its wait for a's stream long before the admission
    section's 30 s: 503 naming the busy engine."""
    long = FakeEngine(tokens=200, token_delay=0.03).env()
    models = {"a": {"env": long}, "b": {"queue_timeout_s": 1}}
    cfg = one_slot(tmp_path, models, {"queue_timeout_s": 30}, min_resident_s=0)
    proxy = await start_proxy(cfg)
    stream = await proxy.chat("a", max_tokens=200, stream=True)
    await stream.content.readany()
    sent = time.monotonic()
    resp = await proxy.chat("b", max_tokens=1)
    assert resp.status == 503
    assert time.monotonic() - sent < 3.0
    message = (await resp.json())["error"]["message"]
    assert "'a#1'" in message and "in flight" in message, message
    await stream.read()


async def test_a_hold_ends_exactly_at_its_deadline(tmp_path: Path) -> None:
    """Regression: a held request whose deadline rounding puts a hair after the time its
    wait ends (0.1 + 0.2 > 0.3) waited again and again without the clock moving (a virtual
    clock hung there). The hold is over once its wait has timed out."""
    from unittest.mock import MagicMock

    from vllm_proxy.config import parse_config
    from vllm_proxy.engines.model import Model
    from vllm_proxy.engines.ports import EngineContext, NoAdmission

    class Holding(NoAdmission):
        def holds(self, inst: Any, rank: Any, arrived: float) -> bool:
            return True

    readings = iter([0.1])
    clock = lambda: next(readings, 0.3)  # noqa: E731  arrived at 0.1, then 0.3 for good
    queue = Queue(Rules(queue_timeout_s=0.2), clock=clock)
    cfg = parse_config({"server": {"state_dir": str(tmp_path)}, "models": {"m": {"model": "x"}}})
    ctx = EngineContext(session=MagicMock(), ports=MagicMock(), registry=MagicMock(),
                        metrics=Metrics(), queue=queue, admission=Holding())  # fmt: skip
    model = Model(cfg.specs()["m"], ctx, lambda name: f"{name}#1")
    inst = model._new_instance()
    inst.state = State.RUNNING
    inst.engine = MagicMock()
    async with asyncio.timeout(5):
        got, _ = await model.acquire()
    assert got is inst and inst.leases == 1
    assert not queue.tickets


@pytest.mark.parametrize("queue_timeout_s", [30.0, 8.0])
async def test_a_wake_waits_for_a_busy_engine_rather_than_stop_asleep_ones(
    tmp_path: Path, start_proxy: StartProxy, queue_timeout_s: float
) -> None:
    """w (asleep) needs 400 MiB more: stopping the asleep x and y gives it now, putting a to
    sleep once its stream ends gives it later. Two cold starts later cost more than a wait,
    so w waits for the stream while its queue time allows (30 s: x and y stay asleep); with
    a short queue timeout (8 s: it waits 4 s) it stops them rather than answer 503."""
    long = FakeEngine(tokens=200, token_delay=0.03).env()  # 6 s
    nap = {"level": 1, "after_idle_s": 600, "memory_mb": 100}
    models = {
        "a": {"memory_mb": 500, "env": long, "sleep": {**nap, "memory_mb": 50}},
        "w": {"memory_mb": 500, "sleep": nap},
        "x": {"memory_mb": 300, "sleep": nap},
        "y": {"memory_mb": 300, "sleep": nap},
    }
    cfg = one_slot(tmp_path, models, {"max_reorder_s": 6, "queue_timeout_s": queue_timeout_s},
                   min_resident_s=0)  # fmt: skip
    proxy = await start_proxy(cfg)
    for name in ("w", "x", "y"):
        await served_then_asleep(proxy, name)
    stream = await proxy.chat("a", max_tokens=200, stream=True)
    await stream.content.readany()
    sent = time.monotonic()
    woken = asyncio.ensure_future(proxy.chat("w", max_tokens=1))
    if queue_timeout_s == 30.0:
        await stream.read()
        assert (await woken).status == 200
        assert proxy.instance("a").asleep, "a was put to sleep once its stream ended"
        for name in ("x", "y"):
            assert proxy.instance(name).asleep, f"{name} was stopped"
            assert proxy.engine_starts(name) == 1
    else:
        assert (await woken).status == 200
        assert time.monotonic() - sent < 5.5, "w waited for the whole stream"
        assert not stream.content.at_eof()
        for name in ("x", "y"):
            assert proxy.model(name).sleeper() is None, f"{name} is still asleep"
        await stream.read()


async def test_a_wake_waits_for_a_waking_engine_rather_than_stop_asleep_ones(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """As above, with the memory held by an engine that is waking rather than serving: w
    (asleep) needs 400 MiB more while a wakes; stopping the asleep x and y gives it now,
    putting a back to sleep once it has woken and served gives it seconds later. An engine
    that is waking (or starting, or falling asleep) can be put to sleep once it has settled,
    so w waits for it and x and y stay asleep."""
    nap = {"level": 1, "after_idle_s": 600, "memory_mb": 100}
    slow_wake = {**SLOW, **FakeEngine(wake_delay=2).env()}
    models = {
        "a": {"memory_mb": 500, "env": slow_wake, "sleep": {**nap, "memory_mb": 50}},
        "w": {"memory_mb": 500, "sleep": nap},
        "x": {"memory_mb": 300, "sleep": nap},
        "y": {"memory_mb": 300, "sleep": nap},
    }
    cfg = one_slot(tmp_path, models, {"max_reorder_s": 6, "queue_timeout_s": 30},
                   min_resident_s=0)  # fmt: skip
    proxy = await start_proxy(cfg)
    for name in ("w", "x", "y", "a"):
        await served_then_asleep(proxy, name)
    a = asyncio.ensure_future(proxy.chat("a", max_tokens=1))
    await wait_for(lambda: proxy.instance("a").state is State.WAKING, what="a waking")
    woken = await proxy.chat("w", max_tokens=1)
    assert woken.status == 200 and (await a).status == 200
    assert proxy.instance("a").asleep, "a was put to sleep once it had woken and served"
    for name in ("x", "y"):
        assert proxy.instance(name).asleep, f"{name} was stopped"
        assert proxy.engine_starts(name) == 1


async def test_requests_for_an_engine_are_not_held_behind_a_waiter_that_can_go_without_it(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """w waits to spare the asleep s (a stop) for b's stream; its window runs out. A request
    for the idle x is not held behind it: w could be placed without x (by stopping s), so
    holding x's requests would only slow x."""
    long = FakeEngine(tokens=400, token_delay=0.03).env()  # 12 s
    nap = {"level": 1, "after_idle_s": 600, "memory_mb": 50}
    models = {
        "s": {"memory_mb": 600, "sleep": {**nap, "memory_mb": 300}},
        "x": {"memory_mb": 300, "sleep": nap},
        "b": {"memory_mb": 300, "sleep": nap, "env": long},
        "w": {"memory_mb": 400},
    }
    cfg = one_slot(tmp_path, models, {"max_reorder_s": 1, "queue_timeout_s": 30},
                   min_resident_s=0)  # fmt: skip
    proxy = await start_proxy(cfg)
    await served_then_asleep(proxy, "s")
    assert (await proxy.chat("x", max_tokens=1)).status == 200
    stream = await proxy.chat("b", max_tokens=400, stream=True)
    await stream.content.readany()
    w = asyncio.ensure_future(proxy.chat("w", max_tokens=1))
    await wait_for(lambda: proxy.manager.queue.waiting("w") > 0, what="w queued")
    queue = proxy.manager.queue

    def w_overdue() -> bool:
        waiter = next((x for x in queue.waiters() if x.model == "w"), None)
        return waiter is not None and overdue(waiter, queue.clock(), queue.rules)

    await wait_for(w_overdue, what="w's window used up")
    assert not w.done(), "w did not wait for b's stream"
    assert (await proxy.chat("x", max_tokens=1)).status == 200
    assert not stream.content.at_eof(), "x's request was held until b's stream ended"
    assert not w.done()
    await stream.read()
    assert (await w).status == 200
    assert proxy.instance("s").asleep, "s was stopped although b's stream ended in time"


# -- the queue under hostile traffic -----------------------------------------------------------


#: A stream that outlasts every scenario around it (up to 20 s).
ENDLESS = FakeEngine(tokens=400, token_delay=0.05).env()


def settings(
    tmp_path: Path,
    models: dict[str, dict[str, Any]],
    admission: dict[str, Any] | None = None,
    budget_mb: int = 1000,
    **engine: Any,
) -> dict[str, Any]:
    """A config file's contents: models of 600 MiB (one at a time on the default budget)."""
    specs = {}
    for name, extra in models.items():
        spec = {"model": "x", "memory_mb": 600, **extra}
        spec["env"] = {**SLOW, **extra.get("env", {})}
        specs[name] = spec
    return config_data(
        tmp_path,
        specs,
        server={"drain_timeout_s": 3},
        engine={"health_interval_s": 0, **engine},
        budget_mb=budget_mb,
        admission=admission or {},
    )


async def start(start_proxy: StartProxy, data: dict[str, Any]) -> RunningProxy:
    return await start_proxy(parse_config(data))


async def reload(proxy: RunningProxy, tmp_path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """A hot reload from a file with `data`, as ``POST /admin/reload`` does it."""
    return await proxy.reload(tmp_path / "proxy.yaml", data)


@dataclass
class Answer:
    model: str
    status: int
    code: str | None
    sent: float
    done: float
    #: A 200 whose reply ran to its length (no error event, no cut stream).
    complete: bool

    @property
    def took(self) -> float:
        return self.done - self.sent


def _complete(body: bytes, stream: bool, tokens: int) -> bool:
    if not stream:
        reply = json.loads(body)
        finish = reply["choices"][0]["finish_reason"]
        return bool(finish == "length" and reply["usage"]["completion_tokens"] == tokens)
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return False
    chunks = [json.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks):
        return False
    return any(ch.get("finish_reason") == "length" for c in chunks for ch in c["choices"])


async def ask(
    proxy: RunningProxy, model: str, tokens: int = 2, stream: bool = False, **extra: Any
) -> Answer:
    """One request, read to its end."""
    sent = time.monotonic()
    async with await proxy.chat(model, max_tokens=tokens, stream=stream, **extra) as resp:
        body = await resp.read()
        status = resp.status
    done = time.monotonic()
    if status != 200:
        return Answer(model, status, json.loads(body)["error"]["code"], sent, done, False)
    return Answer(model, status, None, sent, done, _complete(body, stream, tokens))


def later(proxy: RunningProxy, model: str, tokens: int = 2, **extra: Any) -> asyncio.Task[Answer]:
    return asyncio.ensure_future(ask(proxy, model, tokens, **extra))


async def hang_up(task: asyncio.Task[Answer]) -> None:
    """The client goes away: its connection is closed while it waits."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def waiting(proxy: RunningProxy, name: str) -> bool:
    """A request of `name` waits for a start whose memory is not there yet."""
    reclaiming = proxy.manager.admission._reclaiming  # type: ignore[union-attr]
    return proxy.manager.queue.waiting(name) > 0 and any(
        i.name == name for i in reclaiming.values()
    )


async def no_tickets(proxy: RunningProxy, timeout: float = 3.0) -> None:
    """Every ticket gone within `timeout` (far below the queue timeout of the scenarios)."""
    tickets = proxy.manager.queue.tickets
    try:
        await wait_for(lambda: not tickets, timeout=timeout, what="an empty queue")
    except AssertionError:
        raise AssertionError(f"tickets left: {list(tickets.values())}") from None


@dataclass
class Admitted:
    """One call of `Model.acquire`: when it came, and when it got its lease (or gave up)."""

    model: str
    rank: Rank
    arrived: float
    ended: float = 0.0
    ok: bool = False


@dataclass
class Admissions:
    calls: list[Admitted] = field(default_factory=list)

    def passed(self, window: float, slack: float) -> list[str]:
        """Requests sent straight to a serving engine while an earlier one of equal rank (of
        another model) waited, more than `window` + `slack` after that one arrived."""
        out = []
        for early in self.calls:
            for late in self.calls:
                if late.model == early.model or late.rank != early.rank or not late.ok:
                    continue
                at_once = late.ended - late.arrived < 0.2
                if (
                    at_once
                    and late.arrived > early.arrived
                    and late.ended < early.ended
                    and late.ended > early.arrived + window + slack
                ):
                    out.append(
                        f"{late.model} admitted {late.ended - early.arrived:.2f}s after"
                        f" {early.model} began to wait"
                    )
        return out


@pytest.fixture
def admissions(monkeypatch: pytest.MonkeyPatch) -> Iterator[Admissions]:
    """Every `Model.acquire` of the test, timed."""
    record = Admissions()
    original = Model.acquire

    async def acquire(
        self: Model, session: Any = None, adapter: Any = None, priority: int = 0
    ) -> Any:
        call = Admitted(self.name, self.rank(priority), time.monotonic())
        record.calls.append(call)
        try:
            result = await original(self, session, adapter, priority)
        finally:
            call.ended = time.monotonic()
        call.ok = True
        return result

    monkeypatch.setattr(Model, "acquire", acquire)
    yield record


async def clients(proxy: RunningProxy, model: str, count: int, until: asyncio.Event,
                  tokens: int | list[int] = 4) -> list[Answer]:  # fmt: skip
    """`count` clients sending back-to-back requests for `model` until `until` is set (the
    length of each client's requests from `tokens`)."""
    lengths = tokens if isinstance(tokens, list) else [tokens] * count

    async def one(length: int) -> list[Answer]:
        answers = []
        while not until.is_set():
            answers.append(await ask(proxy, model, length))
        return answers

    runs = await asyncio.gather(*(one(lengths[i]) for i in range(count)))
    return [a for run in runs for a in run]


@dataclass
class Load:
    """Clients that keep a model busy until `finish()`."""

    stop: asyncio.Event
    task: asyncio.Future[list[Answer]]

    async def finish(self) -> list[Answer]:
        """Stop the clients; every answer they got."""
        self.stop.set()
        return await self.task


async def busy_and_watched(
    start_proxy: StartProxy, data: dict[str, Any], model: str
) -> tuple[RunningProxy, Watch, Load]:
    """A proxy from `data` under a `Watch`, with two clients keeping `model` busy."""
    proxy = await start(start_proxy, data)
    watch = Watch(proxy)
    stop = asyncio.Event()
    load = Load(stop, asyncio.ensure_future(clients(proxy, model, 2, stop)))
    await wait_for(lambda: busy(proxy, model), what=f"{model} busy")
    return proxy, watch, load


async def test_clients_that_hang_up_while_held_or_waiting_leave_no_ticket_and_start_nothing(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """A streams; B's start waits for A's memory (strict FIFO: A's next requests are held).
    The held A clients (one streamed: the keep-alive path), B's client and a streamed B
    client all hang up: every ticket goes at once (B's start too: nobody waits for it any
    more, and it would have stopped A for nobody), B is never started, A's stream runs on."""
    data = settings(
        tmp_path, {"a": {"env": ENDLESS}, "b": {}}, {"max_reorder_s": 0, "queue_timeout_s": 20},
        min_resident_s=0, loading_keepalive_interval_s=0.2,
    )  # fmt: skip
    proxy = await start(start_proxy, data)
    watch = Watch(proxy)
    stream = later(proxy, "a", tokens=60, stream=True)  # 3 s
    await wait_for(lambda: busy(proxy, "a"), what="a streaming")
    b = later(proxy, "b")
    await wait_for(lambda: waiting(proxy, "b"), what="b's start waits for memory")
    a2 = later(proxy, "a")
    await wait_for(lambda: held(proxy, "a") == 1, what="a2 held behind b")
    # Streams that wait get keep-alives: the 200 and the first comment come before the engine.
    a_stream = await proxy.chat("a", max_tokens=2, stream=True)
    assert b"loading a" in await a_stream.content.readany()
    assert held(proxy, "a") == 2
    b_stream = await proxy.chat("b", max_tokens=2, stream=True)
    assert b"loading b" in await b_stream.content.readany()
    assert proxy.manager.queue.waiting("b") == 3
    for task in (a2, b):
        await hang_up(task)
    a_stream.close()
    b_stream.close()
    await no_tickets(proxy)
    assert proxy.model("b").instances == [] and proxy.engine_starts("b") == 0
    answer = await stream
    assert answer.complete, answer
    assert proxy.instance("a").state is State.RUNNING
    await watch.close()


@pytest.mark.parametrize("how", ["removed", "unloaded", "shutdown"])
async def test_a_held_request_is_answered_at_once_when_its_model_goes(
    tmp_path: Path, start_proxy: StartProxy, how: str
) -> None:
    """A streams for long; B waits for its memory; A's next request is held behind B. The
    model removed by a reload: 404 at once; unloaded: served again once the unload is over
    (after B's turn); the proxy shutting down: 503 at once. Never the queue timeout."""
    data = settings(
        tmp_path, {"a": {"env": ENDLESS}, "b": {}}, {"max_reorder_s": 0, "queue_timeout_s": 30},
        min_resident_s=0,
    )  # fmt: skip
    proxy = await start(start_proxy, data)
    watch = Watch(proxy, leases=False)  # the unload, the removal, the shutdown cut A's stream
    stream = later(proxy, "a", tokens=300, stream=True)  # 15 s
    await wait_for(lambda: busy(proxy, "a"), what="a streaming")
    b = later(proxy, "b")
    await wait_for(lambda: waiting(proxy, "b"), what="b waits for a's memory")
    a2 = later(proxy, "a")
    await wait_for(lambda: held(proxy, "a") == 1, what="a2 held")
    began = time.monotonic()
    if how == "removed":
        del data["models"]["a"]
        assert (await reload(proxy, tmp_path, data))["removed"] == ["a"]
        answer = await a2
        assert (answer.status, answer.code) == (404, "model_removed")
        assert time.monotonic() - began < 1.5
    elif how == "unloaded":
        unload = asyncio.ensure_future(proxy.model("a").unload(0.2))
        answer = await a2
        assert answer.status == 200 and answer.complete
        assert time.monotonic() - began < 8, "a2 waited for more than b's turn and a's start"
        await unload
    else:
        shutdown = asyncio.ensure_future(proxy.server.shutdown())
        answer = await a2
        assert (answer.status, answer.code) == (503, "shutting_down")
        assert time.monotonic() - began < 1.5
        await shutdown
    assert (await b).status in (200, 503)
    await hang_up(stream)
    if how != "shutdown":
        await no_tickets(proxy)
    assert not proxy.manager.queue.tickets
    await watch.close()


async def test_requests_held_behind_a_waiter_go_at_once_when_the_waiter_is_removed(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """A streams; B waits for its memory and A's next request is held behind B. A reload
    removes B: B's client gets 404 and the held request goes to A at once."""
    data = settings(
        tmp_path, {"a": {"env": ENDLESS}, "b": {}}, {"max_reorder_s": 0, "queue_timeout_s": 30},
        min_resident_s=0,
    )  # fmt: skip
    proxy = await start(start_proxy, data)
    watch = Watch(proxy)
    stream = later(proxy, "a", tokens=300, stream=True)
    await wait_for(lambda: busy(proxy, "a"), what="a streaming")
    b = later(proxy, "b")
    await wait_for(lambda: waiting(proxy, "b"), what="b waits for a's memory")
    a2 = later(proxy, "a")
    await wait_for(lambda: held(proxy, "a") == 1, what="a2 held")
    del data["models"]["b"]
    assert (await reload(proxy, tmp_path, data))["removed"] == ["b"]
    began = time.monotonic()
    answer = await a2
    assert answer.complete and time.monotonic() - began < 1.5, answer
    assert ((await b).status, proxy.engine_starts("a")) == (404, 1)
    await no_tickets(proxy)
    await hang_up(stream)
    await watch.close()


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ({"max_reorder_s": 20, "queue_timeout_s": 60}, {"max_reorder_s": 0.3}),
        ({"max_reorder_s": 20, "queue_timeout_s": 60, "idle_grace_s": 30}, {"idle_grace_s": 0.1}),
    ],
    ids=["max_reorder_s", "idle_grace_s"],
)
async def test_a_reloaded_admission_section_applies_to_requests_already_waiting(
    tmp_path: Path, start_proxy: StartProxy, before: dict[str, Any], after: dict[str, Any]
) -> None:
    """B waits behind a busy A (a long reorder window; or a long idle grace that keeps A
    inside its minimum residency). A reload that shortens it lets B in within seconds."""
    grace = "idle_grace_s" in after
    data = settings(tmp_path, {"a": {}, "b": {}}, before, min_resident_s=60)
    proxy = await start(start_proxy, data)
    watch = Watch(proxy)
    stop = asyncio.Event()
    if grace:  # A idle but within its grace; the window still open
        assert (await ask(proxy, "a")).complete
        load: asyncio.Future[list[Answer]] = asyncio.ensure_future(asyncio.sleep(0, []))
    else:
        load = asyncio.ensure_future(clients(proxy, "a", 2, stop))
        await wait_for(lambda: busy(proxy, "a"), what="a busy")
    b = later(proxy, "b")
    await wait_for(lambda: waiting(proxy, "b"), what="b waits")
    data["admission"] = {**before, **after}
    await reload(proxy, tmp_path, data)
    began = time.monotonic()
    answer = await b
    assert answer.complete, answer
    assert time.monotonic() - began < 5, "the old setting still held b back"
    stop.set()
    assert all(a.status == 200 for a in await load)
    await no_tickets(proxy)
    await watch.close()


async def test_a_reloaded_queue_timeout_bounds_a_start_already_waiting(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """B waits for memory a long stream holds (queue_timeout_s 60). A reload that lowers
    the timeout to 1 s answers B within about that, not after 60 s or the stream's end."""
    data = settings(
        tmp_path, {"a": {"env": ENDLESS}, "b": {}}, {"max_reorder_s": 0, "queue_timeout_s": 60},
        min_resident_s=0,
    )  # fmt: skip
    proxy = await start(start_proxy, data)
    stream = later(proxy, "a", tokens=300, stream=True)
    await wait_for(lambda: busy(proxy, "a"), what="a streaming")
    b = later(proxy, "b")
    await wait_for(lambda: waiting(proxy, "b"), what="b waits")
    data["admission"]["queue_timeout_s"] = 1
    await reload(proxy, tmp_path, data)
    began = time.monotonic()
    answer = await b
    assert (answer.status, answer.code) == (503, "insufficient_gpu_memory")
    assert time.monotonic() - began < 3
    await hang_up(stream)
    await no_tickets(proxy)


async def test_a_reloaded_minimum_residency_and_priority_apply_to_waiters(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """A is kept inside its minimum residency (60 s, in use within its grace); L and then M
    wait. A reload gives M a better priority and A no minimum residency: M goes first."""
    admission = {"max_reorder_s": 20, "queue_timeout_s": 60, "idle_grace_s": 30}
    models = {"a": {"min_resident_s": 60}, "l": {}, "m": {}}
    data = settings(tmp_path, models, admission, min_resident_s=0)
    proxy = await start(start_proxy, data)
    watch = Watch(proxy)
    assert (await ask(proxy, "a")).complete
    order: list[str] = []

    async def one(model: str) -> Answer:
        answer = await ask(proxy, model)
        order.append(model)
        return answer

    l_req = asyncio.ensure_future(one("l"))
    await wait_for(lambda: waiting(proxy, "l"), what="l waits")
    m_req = asyncio.ensure_future(one("m"))
    await wait_for(lambda: proxy.manager.queue.waiting("m") > 0, what="m waits")
    data["models"]["a"]["min_resident_s"] = 0
    data["models"]["m"]["priority"] = -1
    report = await reload(proxy, tmp_path, data)
    assert set(report["kept"]) == {"a", "l", "m"}
    began = time.monotonic()
    answers = await asyncio.gather(l_req, m_req)
    assert all(a.complete for a in answers), answers
    assert order == ["m", "l"]
    assert time.monotonic() - began < 8
    await no_tickets(proxy)
    await watch.close()


async def test_a_low_priority_waiter_behind_high_priority_traffic_gets_a_bounded_503(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Two clients keep H (priority -1) busy; L (priority 5) waits for its memory. H's
    requests are never held for L; L is served in a gap between H's requests or gets its 503
    within the queue timeout: no hang, and never a start of L taken away before it served
    (that answered 502 "failed to start" after two wasted starts)."""
    models = {"h": {"priority": -1}, "l": {"priority": 5}}
    data = settings(tmp_path, models, {"max_reorder_s": 0, "queue_timeout_s": 2},
                    min_resident_s=0)  # fmt: skip
    proxy, watch, load = await busy_and_watched(start_proxy, data, "h")
    answer = await ask(proxy, "l")
    assert answer.complete or (answer.status, answer.code) == (503, "insufficient_gpu_memory")
    assert answer.took < 2 + 2.0, answer
    h_answers = await load.finish()
    assert all(a.complete for a in h_answers)
    assert watch.peak_held["h"] == 0, "h was held behind a lower priority"
    assert proxy.engine_starts("l") <= 1
    assert (await ask(proxy, "l")).complete, "l is served once h is idle"
    await no_tickets(proxy)
    await watch.close()


@pytest.mark.parametrize(
    ("window", "min_resident"), [(1.0, 30.0), (0.0, 0.0)], ids=["window", "strict-fifo"]
)
async def test_equal_ranks_are_never_passed_for_longer_than_the_window(
    tmp_path: Path,
    start_proxy: StartProxy,
    admissions: Admissions,
    window: float,
    min_resident: float,
) -> None:
    """Back-to-back clients of A (three: A is never idle) and B (equal rank) on one slot for
    6 s: a request sent straight to a serving engine never passes a waiting request of the
    other model by more than the reorder window; both sides are served, nothing fails."""
    admission = {"max_reorder_s": window, "queue_timeout_s": 10, "idle_grace_s": 0.5}
    data = settings(tmp_path, {"a": {}, "b": {}}, admission, min_resident_s=min_resident)
    proxy = await start(start_proxy, data)
    watch = Watch(proxy)
    stop = asyncio.Event()
    # Requests of three lengths that keep overlapping: A is (almost) never idle.
    a_load = asyncio.ensure_future(clients(proxy, "a", 3, stop, tokens=[7, 11, 13]))
    await wait_for(lambda: busy(proxy, "a"), what="a busy")
    b_load = asyncio.ensure_future(clients(proxy, "b", 1, stop))
    await wait_for(lambda: time.monotonic() - admissions.calls[0].arrived > 6, timeout=20)
    stop.set()
    a_answers, b_answers = await a_load, await b_load
    assert admissions.passed(window, slack=0.5) == []
    assert all(a.complete for a in a_answers + b_answers)
    assert len(a_answers) >= 2 and len(b_answers) >= 2, "one side starved"
    await no_tickets(proxy)
    await watch.close()


async def test_bursts_on_six_models_in_random_order_keep_every_invariant(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Six models of 300 MiB on 1000 MiB (three fit): priorities, a sleeper, a pinned one,
    an autoscaled one.
    Bursts of requests in a seeded random order, the next burst once half the last one is
    answered: every request gets a complete 200 or a 503 within the queue timeout, no engine
    goes under a lease, the budget is never over-committed, the starts stay bounded. A wait
    behind bring-ups may outlast the queue timeout, never the clients' patience (max_wait_s)."""
    rng = random.Random(20240607)
    models: dict[str, dict[str, Any]] = {f"m{i}": {"memory_mb": 300} for i in range(6)}
    models["m0"]["priority"] = -1
    models["m1"]["priority"] = 1
    models["m2"]["sleep"] = {"level": 1, "after_idle_s": 60}
    models["m3"]["pinned"] = True
    models["m4"]["autoscale"] = {"max_replicas": 2, "target_ongoing_requests": 1}
    admission = {"max_reorder_s": 1, "queue_timeout_s": 6, "max_wait_s": 9, "idle_grace_s": 0.3}
    data = settings(tmp_path, models, admission, min_resident_s=2)
    proxy = await start(start_proxy, data)
    watch = Watch(proxy)
    names = sorted(models)
    tasks: list[asyncio.Task[Answer]] = []
    for _burst in range(6):
        burst = [
            later(proxy, rng.choice(names), rng.randint(1, 8), stream=rng.random() < 0.3)
            for _ in range(6)
        ]
        tasks += burst
        await wait_for(lambda b=burst: sum(t.done() for t in b) >= 3, timeout=30)  # type: ignore[misc]
    answers = await asyncio.gather(*tasks)
    for a in answers:
        assert a.complete or (a.status, a.code) == (503, "insufficient_gpu_memory"), a
        assert a.took < 9 + 4, a
    served = sum(a.complete for a in answers)
    assert served >= len(answers) * 2 // 3, [(a.model, a.status) for a in answers]
    starts = sum(proxy.engine_starts(n) for n in names)
    assert starts <= 20, starts
    await no_tickets(proxy)
    await watch.close()


async def test_replicas_under_a_hold_keep_serving_and_give_one_engine_up(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """R has two replicas of 300 MiB busy with clients; B (600 MiB) needs one of them. B is
    served within its window plus a start, R's clients never fail, R keeps a replica, and
    the replica started again to make up the count never stops its sibling for its memory."""
    models = {"r": {"memory_mb": 300, "replicas": 2}, "b": {}}
    admission = {"max_reorder_s": 0.5, "queue_timeout_s": 10, "idle_grace_s": 0.3}
    data = settings(tmp_path, models, admission, min_resident_s=0)
    proxy = await start(start_proxy, data)
    watch = Watch(proxy)
    assert (await ask(proxy, "r")).complete
    replicas = lambda: [i for i in proxy.model("r").instances if i.state is State.RUNNING]  # noqa: E731
    await wait_for(lambda: len(replicas()) == 2, timeout=20, what="two replicas")
    stop = asyncio.Event()
    load = asyncio.ensure_future(clients(proxy, "r", 3, stop))
    await wait_for(lambda: busy(proxy, "r"), what="r busy")
    answer = await ask(proxy, "b")
    assert answer.complete and answer.took < 0.5 + 5, answer
    assert len(replicas()) >= 1
    stop.set()
    r_answers = await load
    assert all(a.complete for a in r_answers), [a for a in r_answers if not a.complete]
    # r#1, r#2 and the one that replaces the replica B took: no replica stopped for another.
    assert proxy.engine_starts("r") <= 3
    await no_tickets(proxy)
    await watch.close()


def test_a_replica_is_never_the_victim_of_its_own_model() -> None:
    """Stopping r#2 to start r#3 gains nothing: the plan takes the other model, or waits."""
    devices = [DeviceView(0, 1000, 900)]
    r2 = InstanceView("r#2", 300, (0,), Phase.RUNNING, 0, 10.0, False)
    b1 = InstanceView("b#1", 600, (0,), Phase.RUNNING, 0, 20.0, False)
    demand = Demand("r#3", 300, 1, None, 0, siblings=("r#2",))
    assert plan(demand, devices, [r2, b1], now=30.0) == Plan((0,), ("b#1",))
    busy_b = InstanceView("b#1", 600, (0,), Phase.RUNNING, 1, 20.0, False)
    decision = plan(demand, devices, [r2, busy_b], now=30.0)
    assert isinstance(decision, NoFit) and "another replica of the same model" in decision.reason


async def test_a_replica_started_to_make_up_the_count_waits_rather_than_stop_its_sibling(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """R's two replicas are up; B takes one of them. The replacement replica, waiting for
    memory, could take its idle sibling at once: it waits for B's request to end instead."""
    models = {"r": {"memory_mb": 300, "replicas": 2}, "b": {}}
    data = settings(tmp_path, models, {"max_reorder_s": 0.5, "queue_timeout_s": 10},
                    min_resident_s=0)  # fmt: skip
    proxy = await start(start_proxy, data)
    watch = Watch(proxy)
    assert (await ask(proxy, "r")).complete
    running = lambda: [i for i in proxy.model("r").instances if i.state is State.RUNNING]  # noqa: E731
    await wait_for(lambda: len(running()) == 2, timeout=20, what="two replicas")
    b = later(proxy, "b", tokens=40)  # 1.2 s
    await wait_for(lambda: busy(proxy, "b"), what="b serving")
    (kept,) = running()
    assert (await ask(proxy, "r")).complete  # its lease asks for the second replica again
    await wait_for(lambda: waiting(proxy, "r"), what="a new replica waits for memory")
    assert (await b).complete
    await wait_for(lambda: len(running()) == 2, timeout=20, what="two replicas again")
    assert kept.state is State.RUNNING and kept in running()
    assert proxy.engine_starts("r") == 3
    await no_tickets(proxy)
    await watch.close()


async def test_a_sleeping_victim_is_woken_not_started_again(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """S (a sleep policy) and B share one slot; requests alternate, some while the other
    streams (strict FIFO: held). S is put to sleep for B and woken for its next request:
    one engine start for S, every request complete, the budget kept. A wake whose client
    hangs up while it waits for memory is given up, leaving S asleep."""
    models = {"s": {"sleep": {"level": 1, "after_idle_s": 60, "memory_mb": 100}}, "b": {}}
    data = settings(tmp_path, models, {"max_reorder_s": 0, "queue_timeout_s": 10},
                    min_resident_s=0)  # fmt: skip
    proxy = await start(start_proxy, data)
    watch = Watch(proxy)
    for model in ("s", "b", "s"):
        assert (await ask(proxy, model)).complete, model
    first = later(proxy, "s", tokens=20, stream=True)
    await wait_for(lambda: busy(proxy, "s"), what="s streaming")
    rest = [later(proxy, "b"), later(proxy, "s"), later(proxy, "b")]
    answers = await asyncio.gather(first, *rest)
    assert all(a.complete for a in answers), answers
    # S asleep, B streams; a request for S whose wake waits for B's memory hangs up: the
    # wake is given up (S stays asleep, B is not stopped), and the next one wakes S.
    s1 = proxy.instance("s")
    await wait_for(lambda: s1.asleep, what="s asleep")
    stream = later(proxy, "b", tokens=30, stream=True)
    await wait_for(lambda: busy(proxy, "b"), what="b streaming")
    gone = later(proxy, "s")
    await wait_for(lambda: waiting(proxy, "s"), what="s's wake waits for memory")
    await hang_up(gone)
    await no_tickets(proxy)
    assert s1.asleep and busy(proxy, "b")
    assert (await stream).complete
    assert (await ask(proxy, "s")).complete
    assert proxy.engine_starts("s") == 1, "s was stopped rather than put to sleep"
    await no_tickets(proxy)
    await watch.close()


async def test_a_pinned_model_is_never_held_nor_taken(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """P (pinned, 500 MiB) is busy; big (600) cannot fit beside it: 503 within the queue
    timeout, and P's requests are never held for it (nor is P taken); small (400) fits."""
    models = {"p": {"memory_mb": 500, "pinned": True}, "big": {}, "small": {"memory_mb": 400}}
    data = settings(tmp_path, models, {"max_reorder_s": 0, "queue_timeout_s": 2},
                    min_resident_s=0)  # fmt: skip
    proxy, watch, load = await busy_and_watched(start_proxy, data, "p")
    answer = await ask(proxy, "big")
    assert (answer.status, answer.code) == (503, "insufficient_gpu_memory")
    assert answer.took < 2 + 1
    assert (await ask(proxy, "small")).complete
    assert all(a.complete for a in await load.finish())
    assert watch.peak_held["p"] == 0
    assert proxy.instance("p").state is State.RUNNING
    await no_tickets(proxy)
    await watch.close()


async def test_queue_timeout_zero_answers_at_once_and_holds_nothing(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """queue_timeout_s 0: B gets 503 at once while A streams, A's next request is not held;
    with A idle, B takes its place."""
    data = settings(tmp_path, {"a": {}, "b": {}}, {"queue_timeout_s": 0, "max_reorder_s": 5},
                    min_resident_s=30)  # fmt: skip
    proxy = await start(start_proxy, data)
    watch = Watch(proxy)
    stream = later(proxy, "a", tokens=40, stream=True)
    await wait_for(lambda: busy(proxy, "a"), what="a streaming")
    answer = await ask(proxy, "b")
    assert (answer.status, answer.code) == (503, "insufficient_gpu_memory")
    assert answer.took < 1
    a2 = await ask(proxy, "a")
    assert a2.complete and a2.took < 1
    assert (await stream).complete
    await no_tickets(proxy)
    await wait_for(lambda: time.monotonic() - proxy.instance("a").last_used > 2.5, what="a idle")
    assert (await ask(proxy, "b")).complete
    assert watch.peak_held["a"] == 0
    await watch.close()


async def test_a_clients_own_priority_never_starves_another_model(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """With ``scheduling_policy: priority``, clients of a wrote ``"priority": -1000000`` and
    kept a busy: b (the same model priority, no room beside a) was never held for, and got
    503 after 503. The request's priority orders requests within its model only: once b's
    reorder window is over, a's requests are held, a drains, and b is served. The proxy runs
    as a process of its own, the clients over plain HTTP, as they would."""
    port = free_port()
    slow = FakeEngine(tokens=8, token_delay=0.04).env()
    ranked = {"args": {"scheduling_policy": "priority"}, "memory_mb": 600, "env": slow}
    data = config_data(
        tmp_path,
        {"a": {"model": "x", **ranked}, "b": {"model": "x", **ranked}},
        server={"port": port},
        engine={"health_interval_s": 0, "min_resident_s": 0},
        budget_mb=1000,
        admission={"max_reorder_s": 1, "queue_timeout_s": 8},
    )
    path = write_config(tmp_path / "config.yaml", data)
    proc = start_proxy.process(path, port, tmp_path / "proxy.log")
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as http:
        await proc.listening(http)
        url = proc.url + "/v1/chat/completions"

        served = [0]

        async def one() -> None:
            body = chat_body("a", max_tokens=8, priority=-1_000_000)
            async with http.post(url, json=body) as r:
                await r.read()
                served[0] += r.status == 200

        async def greedy() -> None:
            # A request of 0.32 s every 0.1 s: a is never without one in flight.
            sent: list[asyncio.Future[None]] = []
            while not stop.is_set():
                sent.append(asyncio.ensure_future(one()))
                await asyncio.sleep(0.1)  # the pace of the load, not a wait for a state
            await asyncio.gather(*sent)

        async with http.post(url, json=chat_body("a", max_tokens=1)) as r:
            assert r.status == 200, await r.text()
        clients = [asyncio.ensure_future(greedy())]
        try:
            await wait_for(lambda: served[0] >= 6, what="a kept busy")
            for _ in range(2):
                async with http.post(url, json=chat_body("b", max_tokens=1)) as r:
                    assert r.status == 200, await r.text()
        finally:
            stop.set()
            await asyncio.gather(*clients)
