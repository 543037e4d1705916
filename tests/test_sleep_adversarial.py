"""Adversarial tests of the sleep tier: hostile interleavings of sleep and wake calls with requests,
stops, eviction, reloads, crashes and shutdown, with the fake engine as a real subprocess.

Every test pins an invariant of docs/design.md ("Sleep tiers"): no request reaches a sleeping or
waking engine (the fake counts them), nothing is put to sleep with a request in flight or
queued, memory counts as awake until the /sleep call returned, a failed wake is never served
from, and no stop leaves an instance stuck in SLEEPING, WAKING or STOPPING or an engine alive.
Slow sleep and wake calls (`FakeEngine.sleep_delay`/`wake_delay`) open the
windows; each test waits on states with deadlines, never on time.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kit import SLEEPY, FakeEngine, RunningProxy, StartProxy, alive, sleepy, wait_for
from kit import sleep_config as config
from kit.metrics import engine_metric, proxy_samples
from kit.watch import watching

from vllm_proxy.engines.engine import EngineProcess
from vllm_proxy.engines.instance import Instance
from vllm_proxy.engines.states import DOWN, State

#: States an instance may be left in once everything has settled.
SETTLED = frozenset({State.RUNNING, State.STOPPED, State.ERROR})


async def chat(proxy: RunningProxy, model: str, **extra: Any) -> tuple[int, str]:
    return await proxy.reply(model, max_tokens=4, **extra)


async def falling_asleep_after(
    start_proxy: StartProxy, tmp_path: Path, sleep_delay: float
) -> tuple[RunningProxy, Instance]:
    """Model m served once, then its idle sleep under way: its /sleep call takes `sleep_delay`."""
    models = {"m": sleepy(env=FakeEngine(sleep_delay=sleep_delay).env())}
    proxy, inst = await start_proxy.serving(config(tmp_path, models), "m")
    await wait_for(lambda: falling_asleep(inst), what="the /sleep call in flight")
    return proxy, inst


def falling_asleep(inst: Instance) -> bool:
    return inst.state is State.FALLING_ASLEEP


def engine_pid(inst: Instance) -> int:
    assert inst.engine is not None and inst.engine.pid is not None
    return inst.engine.pid


def settled(proxy: RunningProxy) -> bool:
    """Nothing is half-way: every instance is RUNNING, asleep, or done."""
    return all(i.state in SETTLED or i.asleep for i in proxy.manager.all_instances())


def engine_mb(proxy: RunningProxy, waking: set[int], device: int = 0) -> int:
    """What the engines alive now may hold on `device`: an instance whose engine process lives
    counts at its full claim unless its /sleep call has returned (then its sleep memory); a
    waking one counts in full only once its /wake_up call went out (`waking`: engine ports)."""
    memory = proxy.manager.memory
    assert memory is not None
    total = 0
    for inst in proxy.manager.all_instances():
        engine = inst.engine
        if engine is None or engine.exit_code is not None or inst.state in DOWN:
            continue
        claim = memory.claims.get(inst.id)
        if claim is None:
            total += memory.footprint(inst.name)  # an engine alive without a claim: a bug
        elif device in claim.devices:
            if inst.state.public is State.WAKING and engine.port not in waking:
                total += min(inst.spec.sleep_memory_mb, claim.footprint_mb)
            else:
                total += memory.asleep.get(inst.id, claim.footprint_mb)
    return total


@pytest.fixture
def waking(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """Ports of the engines whose /wake_up call is under way (they allocate from then on)."""
    ports: set[int] = set()
    original = EngineProcess.wake

    async def wake(self: EngineProcess, session: aiohttp.ClientSession, level: int) -> None:
        ports.add(self.port)
        try:
            await original(self, session, level)
        finally:
            ports.discard(self.port)

    monkeypatch.setattr(EngineProcess, "wake", wake)
    return ports


def over_budget(proxy: RunningProxy, waking: set[int], budget: int = 1000) -> str | None:
    held = engine_mb(proxy, waking)
    if held <= budget:
        return None
    memory = proxy.manager.memory
    assert memory is not None
    return f"engines may hold {held} MiB of {budget}: " + ", ".join(
        f"{i.id} {i.state.name} asleep={i.asleep} held={memory.asleep.get(i.id)}"
        for i in proxy.manager.all_instances()
    )


def no_lease_unless_running(proxy: RunningProxy) -> str | None:
    for inst in proxy.manager.all_instances():
        if inst.leases and inst.state is not State.RUNNING and inst.state is not State.STOPPING:
            return f"{inst.id} holds {inst.leases} lease(s) while {inst.state.name}"
    return None


# -- bugs -------------------------------------------------------------------------------------


async def test_an_admin_sleep_whose_client_hangs_up_still_wakes_with_the_weights(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """The admin client gives up while the level-2 /sleep call is in flight. The engine still
    goes to sleep and discards its weights; the wake must reload them, never serve garbage."""
    env = FakeEngine(sleep_delay=1.0).env()
    policy = {"level": 1, "after_idle_s": 60}
    proxy, inst = await start_proxy.serving(config(tmp_path, {"m": sleepy(policy, env=env)}), "m")
    impatient = aiohttp.ClientTimeout(total=0.3)
    try:
        async with aiohttp.ClientSession(timeout=impatient) as admin:
            await admin.post(proxy.url + "/admin/models/m/sleep?level=2")
    except (TimeoutError, aiohttp.ClientError):
        pass  # the admin client gave up
    await wait_for(lambda: inst.state is State.SLEEPING and inst.asleep, what="asleep")
    await wait_for(
        lambda: engine_metric(proxy, inst, "fake_engine:sleeps_total"), what="the engine slept"
    )
    status, text = await chat(proxy, "m")
    assert status == 200
    assert "<garbage>" not in text, "served from an engine woken without its weights"
    assert await engine_metric(proxy, inst, "fake_engine:garbage_completions_total") == 0


async def test_idle_timeout_never_stops_an_engine_a_request_waits_to_wake(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """A request arrives while the /sleep call is in flight and waits to wake the engine; the
    idle timeout (total idleness) expires meanwhile. The engine is not idle: it must be woken,
    not stopped and replaced by a cold start."""
    env = FakeEngine(sleep_delay=1.5).env()
    proxy, inst = await start_proxy.serving(
        config(tmp_path, {"m": sleepy(env=env, idle_timeout_s=1.0)}), "m"
    )
    await wait_for(lambda: falling_asleep(inst), what="the /sleep call in flight")
    status, _ = await chat(proxy, "m")  # waits for the sleep call, then for the wake
    assert status == 200
    assert proxy.instance("m") is inst, "the waiting request's engine was stopped as idle"
    assert proxy.engine_starts("m") == 1
    assert await engine_metric(proxy, inst, "fake_engine:wakes_total") == 1


async def test_an_unload_during_a_wake_starts_no_engine_while_it_drains(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Unload while a request's wake is in flight: the waking engine stops, and no new engine
    may start until the unload is over; then the waiting request gets one cold start."""
    engine = FakeEngine(wake_delay=1.0)
    proxy = await start_proxy(config(tmp_path, {"m": sleepy(env=engine.env())}))
    assert (await chat(proxy, "m"))[0] == 200
    model, first = proxy.model("m"), proxy.instance("m")
    await wait_for(lambda: first.asleep, what="asleep")
    request = asyncio.ensure_future(chat(proxy, "m"))
    await wait_for(lambda: first.state is State.WAKING, what="waking")

    def no_start_while_draining() -> str | None:
        if model.draining:
            fresh = [i.id for i in model.instances if i is not first]
            if fresh:
                return f"{fresh} created while the unload drained"
        return None

    async with watching(no_start_while_draining, at_end=True) as problems:
        resp = await proxy.http.post(proxy.url + "/admin/models/m/unload")
        assert resp.status == 200
        assert first.state is State.STOPPED
    got = await request
    assert got[0] == 200, got
    assert problems == []
    assert proxy.engine_starts("m") == 2, "the sleeper, then one cold start after the unload"


async def test_a_reload_that_changes_a_preloaded_pool_preloads_the_new_engine(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """A preloaded model whose pool is asleep gets a new engine by a reload: the old engine
    stops, and the new one is preloaded (put to sleep) like the first, so that the next
    request still pays only a wake."""
    policy = {"level": 1, "after_idle_s": 60}
    proxy = await start_proxy(config(tmp_path, {"m": sleepy(policy, preload=True)}))
    await wait_for(lambda: not proxy.manager.preloading, what="preloaded")
    old = proxy.instance("m")
    assert old.asleep
    specs = config(tmp_path, {"m": sleepy(policy, preload=True, args={"seed": 1})}).specs()
    assert proxy.manager.reload(specs, 5.0)["restarted"] == ["m"]
    await wait_for(lambda: old.state is State.STOPPED, what="the old engine stopped")
    model = proxy.model("m")
    await wait_for(lambda: any(i.asleep for i in model.instances), what="the new pool asleep")
    status, _ = await chat(proxy, "m")
    assert status == 200 and proxy.engine_starts("m") == 2


async def test_an_unexpected_error_in_a_wake_never_leaves_the_instance_waking(
    tmp_path: Path, start_proxy: StartProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wake call that fails in a way nobody planned for (a bug, an error the HTTP client does
    not wrap): like a start, the wake must end with the engine stopped and the request served
    by a cold start, not with an instance stuck in WAKING that holds its memory forever."""
    proxy = await start_proxy(config(tmp_path, {"m": sleepy()}))
    assert (await chat(proxy, "m"))[0] == 200
    first = proxy.instance("m")
    await wait_for(lambda: first.asleep, what="asleep")

    async def broken(self: EngineProcess, session: aiohttp.ClientSession, level: int) -> None:
        raise ConnectionResetError("unexpected")

    monkeypatch.setattr(EngineProcess, "wake", broken)
    status, _ = await chat(proxy, "m")
    assert first.state is not State.WAKING, "left half-woken"
    assert status == 200 and proxy.instance("m") is not first
    await wait_for(lambda: first.state is State.STOPPED, what="the engine stopped")


async def test_a_wake_never_allocates_while_an_engine_starts_on_the_same_device(
    tmp_path: Path, start_proxy: StartProxy, waking: set[int]
) -> None:
    """Starts on one device are serialised because an engine profiling its memory counts
    whatever else allocates meanwhile as its own. A wake reallocates the weights and the KV
    cache: it must not run while another engine starts on the same device (either order)."""
    policy = {"level": 1, "after_idle_s": 60}
    models = {
        "a": sleepy(policy, memory_mb=600, env=FakeEngine(wake_delay=0.5).env()),
        "b": {"model": "x", "memory_mb": 600, "env": FakeEngine(startup_delay=1.0).env()},
    }
    proxy = await start_proxy(config(tmp_path, models, budget_mb=2000, sleep_memory_mb=100))
    assert (await chat(proxy, "a"))[0] == 200
    a = proxy.instance("a")
    task = a.sleep("test")
    assert task is not None
    await task

    def overlap() -> str | None:
        starting = [
            i.id
            for i in proxy.manager.all_instances()
            if i.state is State.STARTING and i.engine is not None and i.engine.exit_code is None
        ]
        if waking and starting:
            return f"a wake runs while {starting} start(s) on the same device"
        return None

    cold = asyncio.ensure_future(chat(proxy, "b"))
    await wait_for(lambda: proxy.model("b").instances and proxy.instance("b").engine, what="b")
    async with watching(overlap, at_end=True) as problems:
        results = await asyncio.gather(cold, chat(proxy, "a"))
    assert [s for s, _ in results] == [200, 200]
    assert problems == []


# -- invariants that hold ---------------------------------------------------------------------


async def test_memory_counts_as_awake_until_the_sleep_call_returned(
    tmp_path: Path, start_proxy: StartProxy, waking: set[int]
) -> None:
    """b needs the memory a holds awake: a is put to sleep for it, and b's engine is spawned
    only once a's slow /sleep call has returned."""
    policy = {"level": 1, "after_idle_s": 60}
    models = {
        "a": sleepy(policy, memory_mb=600, env=FakeEngine(sleep_delay=1.0).env()),
        "b": {"model": "x", "memory_mb": 600},
    }
    proxy = await start_proxy(config(tmp_path, models, budget_mb=1000, sleep_memory_mb=100))
    assert (await chat(proxy, "a"))[0] == 200
    a = proxy.instance("a")

    async with watching(lambda: over_budget(proxy, waking), at_end=True) as problems:
        status, _ = await chat(proxy, "b")
    assert status == 200 and a.asleep
    assert problems == []
    assert await engine_metric(proxy, a, "fake_engine:sleeps_total") == 1


async def test_a_request_during_the_sleep_call_gets_one_wake_of_the_same_engine(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy, inst = await falling_asleep_after(start_proxy, tmp_path, 0.8)
    async with watching(lambda: no_lease_unless_running(proxy), at_end=True) as problems:
        results = await asyncio.gather(*(chat(proxy, "m") for _ in range(10)))
    assert [s for s, _ in results] == [200] * 10
    assert problems == []
    assert proxy.instance("m") is inst and proxy.engine_starts("m") == 1
    assert await engine_metric(proxy, inst, "fake_engine:wakes_total") == 1
    assert await engine_metric(proxy, inst, "fake_engine:requests_while_asleep_total") == 0


async def test_a_failed_sleep_with_a_request_waiting_falls_back_to_a_cold_start(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    env = FakeEngine(sleep_fail=True, sleep_delay=0.8).env()
    proxy = await start_proxy(config(tmp_path, {"m": sleepy(env=env)}))
    assert (await chat(proxy, "m"))[0] == 200
    first = proxy.instance("m")
    await wait_for(lambda: falling_asleep(first), what="the /sleep call in flight")
    status, text = await chat(proxy, "m")
    assert status == 200 and text.startswith("tok0")
    assert first.state is State.STOPPED and proxy.instance("m") is not first
    assert first.engine is not None and not alive(engine_pid(first))


async def test_a_stop_during_the_sleep_call_leaves_nothing_half_way(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy, inst = await falling_asleep_after(start_proxy, tmp_path, 2.0)
    resp = await proxy.http.post(proxy.url + "/admin/models/m/unload")
    assert resp.status == 200
    assert inst.state is State.STOPPED and not alive(engine_pid(inst))
    await wait_for(lambda: inst._sleep_call is None, what="the sleep call over")
    samples = await proxy_samples(proxy)
    assert all(s.value >= 0 for s in samples.find("vllm_proxy_instances"))
    assert (await chat(proxy, "m"))[0] == 200


async def test_a_waking_instance_is_never_evicted_and_both_models_are_served(
    tmp_path: Path, start_proxy: StartProxy, waking: set[int]
) -> None:
    """a is waking (slow) when b needs the memory a would hold awake: b waits for a (a waking
    instance is never a victim), then takes it by putting a back to sleep once a is idle."""
    policy = {"level": 1, "after_idle_s": 60}
    models = {
        "a": sleepy(policy, memory_mb=600, env=FakeEngine(wake_delay=1.0).env()),
        "b": {"model": "x", "memory_mb": 600},
    }
    proxy = await start_proxy(
        config(tmp_path, models, budget_mb=1000, sleep_memory_mb=100, queue_timeout_s=10)
    )
    assert (await chat(proxy, "a"))[0] == 200
    a = proxy.instance("a")
    task = a.sleep("test")
    assert task is not None
    await task
    woken = asyncio.ensure_future(chat(proxy, "a"))
    await wait_for(lambda: a.state is State.WAKING, what="a waking")
    states: list[State] = []

    def a_never_stopped_while_waking() -> str | None:
        if not states or states[-1] is not a.state:
            states.append(a.state)
        if State.STOPPING in states:
            return f"a went {' -> '.join(s.name for s in states)}"
        return over_budget(proxy, waking)

    async with watching(a_never_stopped_while_waking, at_end=True) as problems:
        results = await asyncio.gather(woken, chat(proxy, "b"))
    assert [s for s, _ in results] == [200, 200]
    assert problems == []
    assert a.asleep and proxy.engine_starts("a") == 1
    assert await engine_metric(proxy, a, "fake_engine:requests_while_asleep_total") == 0


async def test_two_models_swap_under_concurrent_load_from_both(
    tmp_path: Path, start_proxy: StartProxy, waking: set[int]
) -> None:
    """A budget that holds one awake, clients hammering both: they take turns by sleep and
    wake; no request reaches a sleeping engine, the engines never hold more than the budget,
    no lease is ever held on a sleeping or waking instance, and nothing is stopped."""
    policy = {"level": 1, "after_idle_s": 60}
    models = {n: sleepy(policy, memory_mb=600) for n in "ab"}
    proxy = await start_proxy(
        config(tmp_path, models, budget_mb=1000, sleep_memory_mb=100, queue_timeout_s=10)
    )

    def check() -> str | None:
        return over_budget(proxy, waking) or no_lease_unless_running(proxy)

    async def client(name: str) -> list[int]:
        return [(await chat(proxy, name))[0] for _ in range(6)]

    async with watching(check, at_end=True) as problems:
        results = await asyncio.gather(*(client(n) for n in "aabb"))
    assert [set(r) for r in results] == [{200}] * 4
    assert problems == []
    a, b = proxy.instance("a"), proxy.instance("b")
    assert proxy.engine_starts("a") == 1 and proxy.engine_starts("b") == 1
    for inst in (a, b):
        assert await engine_metric(proxy, inst, "fake_engine:requests_while_asleep_total") == 0
    # Both engines ran on a budget that holds one awake: at least one went to sleep for the
    # other (which one, and whether it was woken again, depends on how the clients interleave).
    sleeps = [await engine_metric(proxy, i, "fake_engine:sleeps_total") for i in (a, b)]
    assert sum(sleeps) >= 1
    await wait_for(lambda: settled(proxy), what="nothing half-way")


async def test_an_engine_killed_while_asleep_is_replaced_by_a_cold_start(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy, inst = await start_proxy.serving(config(tmp_path, {"m": sleepy()}), "m")
    await wait_for(lambda: inst.asleep, what="asleep")
    os.killpg(engine_pid(inst), signal.SIGKILL)
    await wait_for(lambda: inst.state is State.ERROR, what="the crash seen")
    status, text = await chat(proxy, "m")
    assert status == 200 and text.startswith("tok0")
    assert proxy.instance("m") is not inst
    samples = await proxy_samples(proxy)
    assert all(s.value >= 0 for s in samples.find("vllm_proxy_instances"))
    assert not samples.find("vllm_proxy_instance_sleep_level", instance="m#1", model_id="m")


async def test_an_engine_killed_while_waking_is_replaced_by_a_cold_start(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    env = FakeEngine(wake_delay=2.0).env()
    proxy, inst = await start_proxy.serving(config(tmp_path, {"m": sleepy(env=env)}), "m")
    await wait_for(lambda: inst.asleep, what="asleep")
    request = asyncio.ensure_future(chat(proxy, "m"))
    await wait_for(lambda: inst.state is State.WAKING, what="waking")
    os.killpg(engine_pid(inst), signal.SIGKILL)
    status, text = await request
    assert status == 200 and text.startswith("tok0")
    # The monitor saw the exit (ERROR) or the wake call broke first (stopped): either way
    # the engine is gone and was never served from.
    assert inst.state in DOWN and proxy.instance("m") is not inst
    assert proxy.engine_starts("m") == 2


async def test_a_reload_that_changes_the_engine_during_a_wake_serves_the_new_engine(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    engine = FakeEngine(wake_delay=1.0)
    proxy = await start_proxy(config(tmp_path, {"m": sleepy(env=engine.env())}))
    assert (await chat(proxy, "m"))[0] == 200
    old = proxy.instance("m")
    await wait_for(lambda: old.asleep, what="asleep")
    request = asyncio.ensure_future(chat(proxy, "m"))
    await wait_for(lambda: old.state is State.WAKING, what="waking")
    new_env = engine.but(tokens=2).env()
    specs = config(tmp_path, {"m": sleepy(env=new_env)}).specs()
    report = proxy.manager.reload(specs, 5.0)
    assert report["restarted"] == ["m"]
    status, text = await request
    assert status == 200 and text == "tok0 tok1 ", "served by the new spec's engine"
    await wait_for(lambda: old.state is State.STOPPED, what="the old engine stopped")
    assert not alive(engine_pid(old))
    await wait_for(lambda: settled(proxy), what="nothing half-way")


async def test_shutdown_while_asleep_and_while_a_wake_hangs_leaves_no_engine(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    models = {
        "a": sleepy(),
        "b": sleepy({**SLEEPY, "wake_timeout_s": 30}, env=FakeEngine(wake_hang=True).env()),
    }
    proxy = await start_proxy(config(tmp_path, models))
    for name in "ab":
        assert (await chat(proxy, name))[0] == 200
    a, b = proxy.instance("a"), proxy.instance("b")
    await wait_for(lambda: a.asleep and b.asleep, what="both asleep")
    pids = [engine_pid(a), engine_pid(b)]
    hanging = asyncio.ensure_future(chat(proxy, "b"))
    await wait_for(lambda: b.state is State.WAKING, what="b's wake in flight")
    await proxy.server.shutdown()
    try:
        status = (await hanging)[0]
    except aiohttp.ClientError:
        status = 0  # the connection closed with the server
    assert status in (0, 503)
    assert a.state is State.STOPPED and b.state is State.STOPPED
    await wait_for(lambda: not any(alive(p) for p in pids), what="no engine left")
