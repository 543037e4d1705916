"""The density benchmark's engine model against the real proxy: one small trace, two worlds.

The same trace (three models on one static GPU budget, a dozen requests) runs through
benchmarks/vproxy.py, where the proxy's own Manager and Admission drive virtual engines in
virtual time, and through the proxy on fake engines, both with the shipped defaults (minimum
residency, idle grace, reorder window, idle and sleep timers, device locks, the queue rule)
but for a short queue timeout and patience (a 503 in a second, not thirty). The trace is
released step by step to the proxy first: a step's requests go in order, each `APART_S` after
the one before it is visible (queued or in flight), and the next step waits until the proxy is
still (no request, no ticket, no engine starting, waking, falling asleep or stopping) and then
for longer than the idle grace. The benchmark's world is then sent each request when the real
run sent it, so idle times (which residencies and prices follow) are alike in both. Each
engine's restore time is under the planner's smallest price step, so recency alone orders
victims, and the timing of either world cannot change a decision; no model is idle for the
sleep timer's minute in either world.

Compared: each model's ordered starts, sleeps, wakes and stops, and each request's status; and
each served request's time to first token. The fake engines take at least the virtual engines'
times (a start, a wake, a sleep, each token; a stop takes none in the benchmark's world), so a
request's virtual TTFT is at most its real one; and it is at least what the real proxy showed
it must wait for when it was sent: a start for a model with no engine, a wake for one asleep.
So an engine model that starts at once, wakes at once, leaves the wait out of the TTFT or is
slower than the fake engines fails here; one whose sleeps or stops free nothing over-commits
the GPU, which its world counts.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from kit import FakeEngine, RunningProxy, StartProxy, chat_body, make_config

from vllm_proxy.engines.instance import Instance
from vllm_proxy.engines.states import State

ROOT = Path(__file__).resolve().parents[2]

#: Replies of up to 100 tokens, 30 ms each: a short request asks for 1, a long one for 100.
TOKEN_S = 0.03
LONG_TOKENS = 100
#: The engines' times (seconds), the same in both worlds (a real stop takes what it takes).
#: A sleep is long beside the test's polling: in a step whose first request puts engines to
#: sleep, the later requests must come while those sleeps last, as they do in virtual time.
START_S = 1.0
WAKE_S = 0.2
SLEEP_S = 0.5
STOP_S = 0.0
#: Virtual seconds from one step to the next; real seconds of stillness before the next step
#: (both longer than the idle grace, so that an engine of the step before is idle in both).
STEP_S = 5.0
STILL_S = 1.5
#: Seconds between the requests of one step (in both worlds: the virtual one is sent them when
#: the real run sent them), so that each finds the change the one before made.
APART_S = 0.3
#: How far a virtual TTFT may exceed the real one (the virtual clock has no overheads).
SLACK_S = 0.05
#: MiB awake, on a 1000 MiB GPU: two of the small ones fit awake, not all three.
SIZES = {"a": 400, "b": 400, "c": 600}
ASLEEP_MB = 100
#: The trace: steps of (model, long?).
TRACE: list[list[tuple[str, bool]]] = [
    [("a", False)],
    [("b", False)],
    [("a", False)],
    [("c", False)],
    [("b", False)],
    [("a", False)],
    # `a` wakes beside the busy `c` (by stopping `b`); then `b` finds both busy: a 503 after
    # its queue timeout.
    [("c", True), ("a", True), ("b", False)],
    [("b", False)],
    [("c", False)],
    [("a", False), ("b", False)],
]
QUEUE_TIMEOUT_S = 1.0
#: What a transition means, as the proxy's log names it.
DECISIONS = {
    ("NEW", "STARTING"): "start",
    ("RUNNING", "FALLING_ASLEEP"): "sleep",
    ("SLEEPING", "WAKE_WAITING"): "wake",
}
BUSY = {
    State.STARTING, State.FALLING_ASLEEP, State.WAKE_WAITING, State.WAKING, State.STOPPING,
    State.DRAINING,
}  # fmt: skip


def _vproxy() -> ModuleType:
    if "vproxy" in sys.modules:  # loaded by benchmarks/density.py
        return sys.modules["vproxy"]
    spec = importlib.util.spec_from_file_location("vproxy", ROOT / "benchmarks" / "vproxy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["vproxy"] = module
    spec.loader.exec_module(module)
    return module


def models(env: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """The three models; sleeps as shipped (level 1, the sleep timer's default) but without the
    check after a wake (a virtual engine answers no completion)."""
    out: dict[str, dict[str, Any]] = {}
    for name, mb in SIZES.items():
        out[name] = {"model": "x", "memory_mb": mb,
                     "sleep": {"memory_mb": ASLEEP_MB, "verify_wake": False}}  # fmt: skip
        if env is not None:
            out[name]["env"] = env
    return out


#: The shipped defaults but for the health probes (the test drives every change) and the queue
#: timeout, with the clients' patience as short: `b`'s wait in step 7 ends in its 503 then.
ENGINE = {"health_interval_s": 0}
ADMISSION = {"queue_timeout_s": QUEUE_TIMEOUT_S, "max_wait_s": QUEUE_TIMEOUT_S}
GPU = {"reserve_mb": 0, "context_mb": 0}


@pytest.fixture
def transitions(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str, str]]]:
    """Every state change of every instance, in order: (model, old, new)."""
    seen: list[tuple[str, str, str]] = []
    original = Instance._set_state

    def record(self: Instance, new: State) -> None:
        old = self.state
        original(self, new)
        seen.append((self.name, old.name, new.name))

    monkeypatch.setattr(Instance, "_set_state", record)
    yield seen


def decisions(seen: list[tuple[str, str, str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {name: [] for name in SIZES}
    for model, old, new in seen:
        kind = "stop" if new == "STOPPING" else DECISIONS.get((old, new))
        if kind is not None:
            out[model].append(kind)
    return out


def virtual(tmp_path: Path, sent: list[float] | None = None) -> tuple[list[int], list[float]]:
    """The trace through the benchmark's world; each request's status (200 or 503) and TTFT.
    `sent`: when each request is sent (seconds from the first), as the real proxy's run sent
    them (the minimum residencies and the planner's prices follow idle times); else the steps
    `STEP_S` apart."""
    vproxy = _vproxy()
    timing = {}
    for name, mb in SIZES.items():
        timing[name] = vproxy.Timing(start_s=START_S, stop_s=STOP_S,
                                     wake_s=lambda _level: WAKE_S,
                                     sleep_s=lambda _level, _first: SLEEP_S, weights_mib=mb,
                                     footprint_mib=mb, residue_mib=ASLEEP_MB)  # fmt: skip
    world = vproxy.World(timing, 1 << 30, capacity_mib=1000)
    cfg = vproxy.config(models(), 1000, 0, str(tmp_path / "virtual"), ADMISSION, ENGINE)
    cfg = cfg.model_copy(update={"gpu": cfg.gpu.model_copy(update={"context_mb": 0})})
    requests = []
    for k, step in enumerate(TRACE):
        for j, (model, long) in enumerate(step):
            decode = (LONG_TOKENS if long else 1) * TOKEN_S
            at = STEP_S * k + 0.01 * j if sent is None else sent[len(requests)]
            requests.append(vproxy.Request(at, model, 0.0, decode))
    outcomes = vproxy.run(cfg, world, requests)
    assert world.over_commits == 0, "the engine model over-committed the GPU"
    assert world.busy_evictions == 0
    by_request = {id(o.request): o for o in outcomes}
    statuses = [503 if by_request[id(r)].failed else 200 for r in requests]
    return statuses, [by_request[id(r)].ttft for r in requests]


async def _until(check: Any, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _visible(proxy: RunningProxy, model: str) -> bool:
    queue = proxy.manager.ctx.queue
    if any(t.model == model for t in queue.tickets.values()):
        return True
    return any(i.leases > 0 for i in proxy.model(model).instances)


def _still(proxy: RunningProxy) -> bool:
    if proxy.manager.ctx.queue.tickets:
        return False
    insts = [i for name in SIZES for i in proxy.model(name).instances]
    return all(i.state not in BUSY and i.leases == 0 for i in insts)


async def _timed(proxy: RunningProxy, model: str, tokens: int) -> tuple[int, float]:
    """A streamed chat read to its end: its status and its time to first token (to its first
    event; inf when refused)."""
    loop = asyncio.get_running_loop()
    sent = loop.time()
    body = chat_body(model, max_tokens=tokens, stream=True)
    async with proxy.http.post(proxy.url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            await resp.read()
            return resp.status, math.inf
        await resp.content.readany()
        first = loop.time() - sent
        await resp.read()
        return resp.status, first


def _must_wait(proxy: RunningProxy, model: str) -> float:
    """What a request for `model` sent now must wait for at least: a wake when its engine is
    asleep, a start when it has none, nothing otherwise."""
    states = {i.state for i in proxy.model(model).instances}
    if states & {State.RUNNING, State.STARTING, State.WAKE_WAITING, State.WAKING}:
        return 0.0
    if states & {State.SLEEPING, State.FALLING_ASLEEP}:
        return WAKE_S
    if states <= {State.NEW, State.STOPPING, State.STOPPED, State.UNHEALTHY, State.ERROR}:
        return START_S
    return 0.0


async def real(proxy: RunningProxy) -> tuple[list[int], list[float], list[float], list[float]]:
    """The trace through the proxy on fake engines; each request's status, TTFT, what it had
    to wait for at least when it was sent, and when it was sent (seconds from the first)."""
    statuses: list[int] = []
    ttfts: list[float] = []
    bounds: list[float] = []
    sent: list[float] = []
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for step in TRACE:
        tasks = []
        for j, (model, long) in enumerate(step):
            tokens = LONG_TOKENS if long else 1
            if j:  # the request before it has made its change (a wake takes WAKE_S)
                await asyncio.sleep(APART_S)
            bounds.append(_must_wait(proxy, model))
            sent.append(loop.time() - t0)
            task = asyncio.ensure_future(_timed(proxy, model, tokens))
            tasks.append(task)
            await _until(lambda m=model, t=task: _visible(proxy, m) or t.done(), model)
        for status, ttft in await asyncio.gather(*tasks):
            statuses.append(status)
            ttfts.append(ttft)
        await _until(lambda: _still(proxy), "a still proxy")
        await asyncio.sleep(STILL_S)  # idle for longer than the idle grace
    return statuses, ttfts, bounds, sent


async def test_the_benchmark_and_the_proxy_decide_alike(
    tmp_path: Path, start_proxy: StartProxy, transitions: list[tuple[str, str, str]]
) -> None:
    env = FakeEngine(tokens=LONG_TOKENS, token_delay=TOKEN_S, startup_delay=START_S,
                     sleep_delay=SLEEP_S, wake_delay=WAKE_S).env()  # fmt: skip
    cfg = make_config(tmp_path, models(env), server={"admin_open": True}, engine=ENGINE,
                      budget_mb=1000, gpu=GPU, admission=ADMISSION)  # fmt: skip
    proxy = await start_proxy(cfg)
    got, ttft, bounds, sent = await real(proxy)
    seen = list(transitions)
    transitions.clear()
    # The same requests through the benchmark's world, sent when the real run sent them.
    expected, modelled_ttft = await asyncio.to_thread(virtual, tmp_path, sent)
    modelled = decisions(transitions)
    transitions[:] = seen
    print("statuses", got, "decisions", modelled)
    print("TTFT virtual", [round(x, 3) for x in modelled_ttft])
    print("TTFT real   ", [round(x, 3) for x in ttft])
    print("at least    ", bounds)
    assert got == expected
    assert decisions(transitions) == modelled
    for k, (v, r, least) in enumerate(zip(modelled_ttft, ttft, bounds, strict=True)):
        if got[k] != 200:
            continue
        assert r >= least, (k, r, least)  # what the bound says of the real proxy
        assert v >= least - 1e-9, f"request {k}: virtual TTFT {v:.3f} s < {least} s it waits for"
        assert v <= r + SLACK_S, f"request {k}: virtual TTFT {v:.3f} s > real {r:.3f} s"
    # The first request finds the GPU empty: its wait is one start, exactly as long as the
    # engine model's (the fake engine's own start-up adds its process's, so the bound above
    # alone would let a slower model start pass).
    assert bounds[0] == START_S and modelled_ttft[0] == pytest.approx(START_S)
    # The trace exercises what it is for: starts, sleeps, wakes, stops, and a 503; requests
    # that wait for a start and for a wake.
    kinds = {k for ks in modelled.values() for k in ks}
    assert {"start", "sleep", "wake", "stop"} <= kinds and 503 in got
    assert {START_S, WAKE_S} <= set(bounds)
