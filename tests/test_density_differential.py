"""The density benchmark's engine model against the real proxy: one small trace, two worlds.

The same trace (three models on one static GPU budget, a dozen requests) runs through
benchmarks/vproxy.py, where the proxy's own Manager and Admission drive virtual engines in
virtual time, and through the proxy on fake engines. The trace is released step by step: a step's
requests go in order, each once the one before it is visible (queued or in flight), and the next
step waits until the proxy is still (no request, no ticket, no engine starting, waking, falling
asleep or stopping). Each engine's restore time is under the planner's smallest price step, so
recency alone orders victims, and the timing of either world cannot change a decision. Compared:
each model's ordered starts, sleeps, wakes and stops, and each request's status.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from kit import FakeEngine, RunningProxy, StartProxy, make_config

from vllm_proxy.engines.instance import Instance
from vllm_proxy.engines.states import State

ROOT = Path(__file__).resolve().parent.parent

#: Replies of up to 100 tokens, 30 ms each: a short request asks for 1, a long one for 100.
TOKEN_S = 0.03
LONG_TOKENS = 100
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
    out: dict[str, dict[str, Any]] = {}
    for name, mb in SIZES.items():
        out[name] = {"model": "x", "memory_mb": mb,
                     "sleep": {"level": 1, "memory_mb": ASLEEP_MB, "after_idle_s": 0,
                               "verify_wake": False}}  # fmt: skip
        if env is not None:
            out[name]["env"] = env
    return out


ENGINE = {"min_resident_s": 0, "idle_timeout_s": 0, "health_interval_s": 0}
ADMISSION = {"queue_timeout_s": QUEUE_TIMEOUT_S, "max_wait_s": QUEUE_TIMEOUT_S, "max_reorder_s": 10,
             "idle_grace_s": 0}  # fmt: skip
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


def virtual(tmp_path: Path) -> list[int]:
    """The trace through the benchmark's world; each request's status (200 or 503)."""
    vproxy = _vproxy()
    timing = {}
    for name, mb in SIZES.items():
        timing[name] = vproxy.Timing(start_s=1.0, stop_s=0.1, wake_s=lambda _level: 0.2,
                                     sleep_s=lambda _level, _first: 0.2, weights_mib=mb,
                                     footprint_mib=mb, residue_mib=ASLEEP_MB)  # fmt: skip
    world = vproxy.World(timing, 1 << 30, capacity_mib=1000)
    cfg = vproxy.config(models(), 1000, 0, str(tmp_path / "virtual"), ADMISSION, ENGINE)
    cfg = cfg.model_copy(update={"gpu": cfg.gpu.model_copy(update={"context_mb": 0})})
    requests = []
    for k, step in enumerate(TRACE):
        for j, (model, long) in enumerate(step):
            decode = (LONG_TOKENS if long else 1) * TOKEN_S
            requests.append(vproxy.Request(30.0 * k + 0.01 * j, model, 0.0, decode))
    outcomes = vproxy.run(cfg, world, requests)
    assert world.over_commits == 0 and world.busy_evictions == 0
    by_request = {id(o.request): o for o in outcomes}
    return [503 if by_request[id(r)].failed else 200 for r in requests]


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


async def real(proxy: RunningProxy) -> list[int]:
    """The trace through the proxy on fake engines; each request's status."""
    statuses: list[int] = []
    for step in TRACE:
        tasks = []
        for model, long in step:
            tokens = LONG_TOKENS if long else 1
            task = asyncio.ensure_future(proxy.status(model, max_tokens=tokens))
            tasks.append(task)
            await _until(lambda m=model, t=task: _visible(proxy, m) or t.done(), model)
        statuses.extend(await asyncio.gather(*tasks))
        await _until(lambda: _still(proxy), "a still proxy")
    return statuses


async def test_the_benchmark_and_the_proxy_decide_alike(
    tmp_path: Path, start_proxy: StartProxy, transitions: list[tuple[str, str, str]]
) -> None:
    expected = await asyncio.to_thread(virtual, tmp_path)
    modelled = decisions(transitions)
    transitions.clear()
    env = FakeEngine(tokens=LONG_TOKENS, token_delay=TOKEN_S, sleep_delay=0.05,
                     wake_delay=0.05).env()  # fmt: skip
    cfg = make_config(tmp_path, models(env), server={"admin_open": True}, engine=ENGINE,
                      budget_mb=1000, gpu=GPU, admission=ADMISSION)  # fmt: skip
    proxy = await start_proxy(cfg)
    got = await real(proxy)
    print("statuses", got, "decisions", modelled)
    assert got == expected
    assert decisions(transitions) == modelled
    # The trace exercises what it is for: starts, sleeps, wakes, and a 503.
    kinds = {k for ks in modelled.values() for k in ks}
    assert {"start", "sleep", "wake"} <= kinds and 503 in got
