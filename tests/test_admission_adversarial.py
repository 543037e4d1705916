"""The admission queue under hostile traffic: clients that hang up, reloads and unloads while
requests wait, priority inversion, bursts on many models, replicas, sleepers and pinned models.

Every test runs the fake engine as real processes on a static GPU budget and checks invariants
rather than one schedule: no ticket outlives its request, no engine is stopped or put to sleep
under a lease, the memory handed out never exceeds the budget, every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
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
from kit.watch import Watch, held

from vllm_proxy.config import parse_config
from vllm_proxy.engines.model import Model
from vllm_proxy.engines.states import State
from vllm_proxy.planning.planner import Demand, DeviceView, InstanceView, NoFit, Phase, Plan, plan
from vllm_proxy.planning.queueing import Rank

#: Replies of up to 100 tokens, 30 ms each: `max_tokens` sets a request's length.
SLOW = FakeEngine(tokens=100, token_delay=0.03).env()
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


# -- answers ----------------------------------------------------------------------------------


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


def busy(proxy: RunningProxy, name: str) -> bool:
    inst = proxy.model(name).serving()
    return inst is not None and inst.leases > 0


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


# -- clients that leave -----------------------------------------------------------------------


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


# -- a held request whose model goes ----------------------------------------------------------


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


# -- reloads while requests wait --------------------------------------------------------------


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


# -- priorities and the reorder window --------------------------------------------------------


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


# -- many models ------------------------------------------------------------------------------


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


# -- replicas, sleepers, pinned ---------------------------------------------------------------


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
