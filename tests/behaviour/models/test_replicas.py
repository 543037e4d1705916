"""Component tests: replicas, least-load routing, session affinity and autoscaling, with the fake
engine as a real subprocess on a static multi-device budget (each replica on a GPU of its own).

The last section, replicas and autoscaling under hostile timing: starts that fail beside a
replica that serves, timers that outlive an unload, reloads that change the count while replicas
sleep or wake, bursts against the bounds, and the per-model gauges across remove/add/remove; the
fake engine runs as a real subprocess on a static multi-device budget (each replica on a GPU of
its own)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kit import FakeEngine, RunningProxy, StartProxy, make_config, wait_for
from kit import replicas_config as config
from kit.metrics import engine_metric, proxy_samples
from kit.watch import watching

from vllm_proxy.config import parse_config
from vllm_proxy.engines.instance import Instance
from vllm_proxy.engines.model import Model
from vllm_proxy.engines.states import DOWN, State
from vllm_proxy.errors import ConfigError

LONG = FakeEngine(tokens=40, token_delay=0.05).env()  # ~2 s per stream


async def served(proxy: RunningProxy, inst: Instance) -> float:
    """Requests the instance's engine has finished (its own vllm:request_success_total)."""
    return await engine_metric(proxy, inst, "vllm:request_success_total")


def running(proxy: RunningProxy) -> list[Instance]:
    return [i for i in proxy.model("m").instances if i.state is State.RUNNING]


async def finish(resp: aiohttp.ClientResponse) -> bytes:
    body = await resp.read()
    assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
    return body


def test_replicas_and_autoscale_are_exclusive_and_bounded() -> None:
    both = {"model": "x", "replicas": 2, "autoscale": {"max_replicas": 2}}
    with pytest.raises(ConfigError, match="either replicas or autoscale"):
        parse_config({"models": {"m": both}})
    bad = {"model": "x", "autoscale": {"min_replicas": 3, "max_replicas": 2}}
    with pytest.raises(ConfigError, match="min_replicas must not exceed max_replicas"):
        parse_config({"models": {"m": bad}})
    spec = parse_config({"models": {"m": {"model": "x"}}}).specs()["m"]
    assert spec.replica_bounds() == (0, 1), "no key: today's single engine"


async def test_fixed_replicas_start_together_on_their_own_devices(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(config(tmp_path, {"replicas": 3}))
    assert await proxy.status("m") == 200
    await wait_for(lambda: len(running(proxy)) == 3, timeout=30, what="three replicas up")
    replicas = running(proxy)
    assert len({i.id for i in replicas}) == 3
    assert len({i.engine.port for i in replicas if i.engine}) == 3
    assert sorted(d for i in replicas for d in i.devices) == [0, 1, 2], "a GPU each"
    row = await (await proxy.http.get(proxy.url + "/admin/models/m")).json()
    assert row["replicas"]["mode"] == "fixed" and row["replicas"]["live"] == 3
    assert len(row["instances"]) == 3


async def test_least_outstanding_routing(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(tmp_path, {"replicas": 2, "env": LONG}, devices=2))
    assert await proxy.status("m") == 200
    await wait_for(lambda: len(running(proxy)) == 2, timeout=30, what="two replicas up")
    stream = await proxy.open_stream("m")
    (busy,) = [i for i in running(proxy) if i.leases == 1]
    (idle,) = [i for i in running(proxy) if i is not busy]
    before = await served(proxy, idle), await served(proxy, busy)
    for _ in range(5):
        assert await proxy.status("m") == 200
    # Every short request went to the replica without the long stream.
    assert await served(proxy, idle) == before[0] + 5
    assert await served(proxy, busy) == before[1]
    await finish(stream)


async def test_session_affinity_keeps_a_session_on_its_replica(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    model = {"replicas": 2, "env": LONG, "affinity_header": "X-Session-ID"}
    proxy = await start_proxy(config(tmp_path, model, devices=2))
    assert await proxy.status("m") == 200
    await wait_for(lambda: len(running(proxy)) == 2, timeout=30, what="two replicas up")
    stream = await proxy.open_stream("m", **{"X-Session-ID": "alice"})
    (alice,) = [i for i in running(proxy) if i.leases == 1]
    (other,) = [i for i in running(proxy) if i is not alice]
    before = await served(proxy, alice)
    # alice stays on her replica although it is the busier one; bob goes to the idle one.
    for _ in range(3):
        assert await proxy.status("m", **{"X-Session-ID": "alice"}) == 200
    assert await served(proxy, alice) == before + 3
    bob_before = await served(proxy, other)
    assert await proxy.status("m", **{"X-Session-ID": "bob"}) == 200
    assert await served(proxy, other) == bob_before + 1
    await finish(stream)
    # A session whose replica is gone moves to one that serves.
    assert alice.engine is not None
    os.killpg(alice.engine.pid or 0, signal.SIGKILL)
    await wait_for(lambda: alice.state is State.ERROR, what="alice's replica down")
    assert await proxy.status("m", **{"X-Session-ID": "alice"}) == 200


async def test_autoscale_up_under_streams_and_the_second_wave_spreads(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    scale = {"max_replicas": 3, "target_ongoing_requests": 1, "downscale_delay_s": 60}
    proxy = await start_proxy(config(tmp_path, {"autoscale": scale, "env": LONG}))
    first = await asyncio.gather(*(proxy.open_stream("m") for _ in range(3)))
    await wait_for(lambda: len(running(proxy)) == 3, timeout=30, what="scaled up to 3")
    assert sorted(d for i in running(proxy) for d in i.devices) == [0, 1, 2]
    for resp in first:
        await finish(resp)
    # The second wave spreads: three concurrent streams land on three different replicas.
    await wait_for(lambda: all(i.leases == 0 for i in running(proxy)), what="first wave done")
    replicas = running(proxy)
    second = await asyncio.gather(*(proxy.open_stream("m") for _ in range(3)))
    assert sorted(i.leases for i in replicas) == [1, 1, 1]
    for resp in second:
        await finish(resp)
    assert len(proxy.model("m").instances) == 3, "never more than max_replicas"


async def test_autoscale_down_one_at_a_time_to_min_replicas(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    scale = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 1,
             "downscale_delay_s": 0.5}  # fmt: skip
    proxy = await start_proxy(config(tmp_path, {"autoscale": scale, "env": LONG}))
    streams = await asyncio.gather(*(proxy.open_stream("m") for _ in range(3)))
    await wait_for(lambda: len(running(proxy)) == 3, timeout=30, what="scaled up to 3")
    for resp in streams:
        await finish(resp)
    # Idle past downscale_delay_s: removed one at a time down to min_replicas, and no further.
    await wait_for(lambda: len(running(proxy)) == 1, timeout=20, what="scaled down to 1")
    metrics = await proxy_samples(proxy)
    assert metrics.get("vllm_proxy_evictions_total", model_id="m", reason="downscale") == 2.0
    (last,) = running(proxy)
    await wait_for(lambda: proxy.model("m").instances == [last], what="the others stopped")
    assert await proxy.status("m") == 200
    assert running(proxy) == [last] and len(proxy.model("m").instances) == 1, "min is kept"


async def test_a_killed_replica_loses_only_its_own_requests(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(config(tmp_path, {"replicas": 2, "env": LONG}, devices=2))
    assert await proxy.status("m") == 200
    await wait_for(lambda: len(running(proxy)) == 2, timeout=30, what="two replicas up")
    streams = [await proxy.open_stream("m"), await proxy.open_stream("m")]
    a, b = running(proxy)
    assert a.leases == 1 and b.leases == 1
    assert a.engine is not None and a.engine.pid is not None
    os.killpg(a.engine.pid, signal.SIGKILL)
    bodies = await asyncio.gather(*(r.read() for r in streams))
    outcomes = sorted(b'"error"' in body for body in bodies)
    assert outcomes == [False, True], "one stream ended with an error event, the other whole"
    intact = next(body for body in bodies if b'"error"' not in body)
    events = [json.loads(e[6:]) for e in intact.split(b"\n\n") if e.startswith(b"data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == "".join(f"tok{i} " for i in range(40))
    assert b.state is State.RUNNING
    assert await proxy.status("m") == 200


# -- replicas and autoscaling under hostile timing ---------------------------------------------


#: Replicas that fall asleep soon after their last request, although they all fit awake.
SLEEPY = {"level": 1, "after_idle_s": 0.3, "on_idle": "always"}


async def replicas_asleep(proxy: RunningProxy, count: int) -> Model:
    """Model m, once it has `count` instances and all of them are asleep."""
    model = proxy.model("m")
    await wait_for(
        lambda: len(model.instances) == count and all(i.asleep for i in model.instances),
        timeout=30,
        what=f"{count} replicas asleep",
    )
    return model


def kept(proxy: RunningProxy) -> list[Instance]:
    """Instances of m that are not on their way out: not retired, not stopping, not done."""
    return [
        i
        for i in proxy.model("m").instances
        if not i.retired and i.state not in DOWN and i.state is not State.STOPPING
    ]


def engine_pid(inst: Instance) -> int:
    assert inst.engine is not None and inst.engine.pid is not None
    return inst.engine.pid


async def test_a_pending_upscale_never_restarts_an_unloaded_model(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Load asks for a second replica after `upscale_delay_s`; the model is unloaded before
    the delay is over. Nobody asks for it any more: it must stay unloaded."""
    scale = {"min_replicas": 0, "max_replicas": 2, "target_ongoing_requests": 1,
             "upscale_delay_s": 2.0}  # fmt: skip
    proxy = await start_proxy(config(tmp_path, {"autoscale": scale, "env": LONG}, devices=2))
    model = proxy.model("m")
    streams = await asyncio.gather(proxy.open_stream("m"), proxy.open_stream("m"))
    assert model.autoscaler.upscale_pending, "the second replica is due after the delay"
    resp = await proxy.http.post(proxy.url + "/admin/models/m/unload?timeout=0")
    assert resp.status == 200 and model.instances == []
    for stream in streams:
        stream.close()
    await wait_for(lambda: not model.autoscaler.upscale_pending, what="the upscale delay over")
    assert model.instances == [], "the unloaded model started again with nobody asking"


async def test_a_replica_that_fails_to_start_fails_no_request_another_replica_serves(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Two fixed replicas start together for the first request; the one that request waits
    for dies while starting, after the other is up. The request is served by the other."""
    env = FakeEngine(startup_delay=1.0).env()
    proxy = await start_proxy(config(tmp_path, {"replicas": 2, "env": env}, devices=2))
    model = proxy.model("m")
    request = asyncio.ensure_future(proxy.status("m"))
    await wait_for(
        lambda: len(model.instances) == 2 and all(i.engine for i in model.instances),
        what="both replicas spawned",
    )
    first, second = model.instances
    os.killpg(engine_pid(first), signal.SIGSTOP)  # the request's own start hangs ...
    try:
        await wait_for(lambda: second.state is State.RUNNING, what="the other replica up")
    finally:
        os.killpg(engine_pid(first), signal.SIGKILL)  # ... then dies
    assert await request == 200, "failed although a replica was serving"


async def test_replicas_the_load_asks_for_are_not_scaled_down_as_idle(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Three streams wait for a cold model and all land on its first replica (the other two
    are still starting). Load 3 with target 1 asks for three replicas: the two idle ones must
    not be scaled down while the streams run (else every new request scales up again)."""
    scale = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 1,
             "downscale_delay_s": 0.2}  # fmt: skip
    proxy = await start_proxy(config(tmp_path, {"autoscale": scale, "env": LONG}))
    streams = await asyncio.gather(*(proxy.open_stream("m") for _ in range(3)))
    await wait_for(lambda: len(running(proxy)) == 3, timeout=30, what="scaled up to 3")

    def kept_while_loaded() -> str | None:
        load = sum(i.leases for i in proxy.model("m").instances)
        awake = running(proxy)
        if load >= 3 and len(awake) < 3:
            return f"{len(awake)} replica(s) awake under a load of {load} (target 1)"
        return None

    async with watching(kept_while_loaded) as problems:
        for stream in streams:
            await stream.read()
    assert problems == []


async def test_a_reload_that_lowers_the_count_retires_sleeping_replicas_too(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Three fixed replicas, all asleep; a reload lowers the count to one. The surplus holds
    GPU memory (and host RAM at level 1) and must go, asleep or not."""
    proxy = await start_proxy(config(tmp_path, {"replicas": 3, "sleep": SLEEPY}))
    assert await proxy.status("m") == 200
    await replicas_asleep(proxy, 3)
    cfg = config(tmp_path, {"replicas": 1, "sleep": SLEEPY})
    report = proxy.manager.reload(cfg.specs(), 5.0)
    assert report["kept"] == ["m"]
    await wait_for(lambda: len(kept(proxy)) <= 1, timeout=5, what="the surplus retired")
    assert await proxy.status("m") == 200


async def test_a_reload_that_lowers_the_count_while_replicas_start_keeps_the_new_count(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Three fixed replicas are starting for the first request when a reload lowers the count
    to one: the surplus is retired, and no replacement starts for it."""
    env = FakeEngine(startup_delay=1.0).env()
    proxy = await start_proxy(config(tmp_path, {"replicas": 3, "env": env}))
    model = proxy.model("m")
    request = asyncio.ensure_future(proxy.status("m"))
    await wait_for(lambda: len(model.instances) == 3, what="three replicas starting")
    report = proxy.manager.reload(config(tmp_path, {"replicas": 1, "env": env}).specs(), 5.0)
    assert report["kept"] == ["m"]
    assert await request == 200
    await wait_for(
        lambda: not any(i.state is State.STARTING for i in model.instances), what="starts over"
    )
    assert [i.state for i in kept(proxy)] == [State.RUNNING], "one replica, as configured"


async def test_the_instances_gauge_stays_true_across_remove_add_remove(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """m is removed while a stream drains on m#1, added back (m#2 serves) and removed again.
    While m#1 still streams it is a live RUNNING instance of m and must be counted, and no
    state's count may go below zero while it stops."""
    endless = FakeEngine(tokens=2000, token_delay=0.05).env()  # outlasts the steps; closed below
    proxy = await start_proxy(config(tmp_path, {"env": endless}))
    memory = proxy.manager.memory
    assert memory is not None
    with_m = config(tmp_path, {"env": endless}).specs()
    without_m = make_config(tmp_path, {"other": {"model": "x", "memory_mb": 600}}).specs()

    def reload(specs: dict[str, Any]) -> None:
        memory.set_specs(specs)
        proxy.manager.reload(specs, 30.0)

    def counts() -> dict[str, float]:
        gauge = proxy.manager.ctx.metrics.instances
        return {
            s.labels["state"]: s.value
            for family in gauge.collect()
            for s in family.samples
            if s.labels["model_id"] == "m"
        }

    def never_negative() -> str | None:
        low = {k: v for k, v in counts().items() if v < 0}
        return f"vllm_proxy_instances of m below zero: {low}" if low else None

    stream = await proxy.open_stream("m")
    old = proxy.instance("m")
    reload(without_m)
    reload(with_m)
    assert await proxy.status("m") == 200
    new = proxy.instance("m")
    assert new is not old and old.state is State.DRAINING
    async with watching(never_negative) as problems:
        reload(without_m)
        await wait_for(lambda: new.state is State.STOPPED, what="the idle m#2 stopped")
        await wait_for(lambda: len(proxy.manager.removed) == 1, what="m#2's removal over")
        assert old.state is State.DRAINING and counts().get("running") == 1, counts()
        stream.close()  # the client goes: m#1's lease ends, and m#1 with it
        await wait_for(lambda: not proxy.manager.removed, what="both removals over")
    assert problems == []


async def test_autoscale_bursts_stay_within_bounds_and_budget(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Waves of concurrent requests against an autoscaled, sleep-enabled model that scales
    down fast (by sleep) between waves and up again (by wake) in each: never more than
    max_replicas kept (asleep ones included), never a lease on an instance that is not
    RUNNING, never more held on a device than it has, and every request is served."""
    scale = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
             "downscale_delay_s": 0.2}  # fmt: skip
    env = FakeEngine(tokens=10, token_delay=0.05).env()
    sleep = {"level": 1, "after_idle_s": 60}
    proxy = await start_proxy(config(tmp_path, {"autoscale": scale, "sleep": sleep, "env": env}))
    memory = proxy.manager.memory
    assert memory is not None
    peak = [0]

    def check() -> str | None:
        live = kept(proxy)
        peak[0] = max(peak[0], len(live))
        if len(live) > 2:
            return f"{len(live)} replicas kept: {[(i.id, i.state.name) for i in live]}"
        for inst in proxy.model("m").instances:
            if inst.leases and inst.state not in (State.RUNNING, State.DRAINING, State.STOPPING):
                return f"{inst.id} holds a lease while {inst.state.name}"
        for device in range(3):
            engines = [
                i for i in proxy.manager.all_instances()
                if i.engine is not None and i.engine.exit_code is None
                and i.state not in DOWN and i.id in memory.claims
                and device in memory.claims[i.id].devices
            ]  # fmt: skip
            held = sum(memory.held_mb(i.id) for i in engines if i.state.public is not State.WAKING)
            if held > 1000:
                return f"GPU{device}: {held} MiB held by engines alive"
        return None

    statuses: list[int] = []
    async with watching(check) as problems:
        for _ in range(4):
            statuses += await asyncio.gather(*(proxy.status("m", 10) for _ in range(4)))
            await wait_for(
                lambda: any(i.asleep for i in proxy.model("m").instances),
                what="scaled down (a replica put to sleep) between waves",
            )
    assert statuses == [200] * 16
    assert problems == []
    assert peak[0] == 2, "the load scaled the model up"
    assert proxy.engine_starts("m") == 2, "scaled up again by waking the sleeper"


async def test_a_reload_that_raises_the_count_while_a_replica_wakes(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    env = FakeEngine(wake_delay=0.8).env()
    proxy = await start_proxy(config(tmp_path, {"replicas": 2, "sleep": SLEEPY, "env": env}))
    assert await proxy.status("m") == 200
    model = await replicas_asleep(proxy, 2)
    request = asyncio.ensure_future(proxy.status("m"))
    await wait_for(lambda: any(i.state is State.WAKING for i in model.instances), what="waking")
    report = proxy.manager.reload(config(tmp_path, {"replicas": 3, "env": env,
                                                    "sleep": SLEEPY}).specs(), 5.0)  # fmt: skip
    assert report["kept"] == ["m"]

    def at_most_three() -> str | None:
        live = kept(proxy)
        return f"{len(live)} replicas kept" if len(live) > 3 else None

    async with watching(at_most_three) as problems:
        assert await request == 200
        await wait_for(lambda: len(kept(proxy)) == 3, timeout=20, what="a third replica")
        assert await proxy.status("m") == 200
    assert problems == []
    assert sorted(d for i in kept(proxy) for d in i.devices) == [0, 1, 2]


async def test_a_sleeping_replica_killed_beside_a_streaming_one_cuts_nothing(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    scale = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
             "downscale_delay_s": 0.2}  # fmt: skip
    sleep = {"level": 1, "after_idle_s": 60}
    proxy = await start_proxy(
        config(tmp_path, {"autoscale": scale, "sleep": sleep, "env": LONG}, devices=2)
    )
    first = await asyncio.gather(proxy.open_stream("m"), proxy.open_stream("m"))
    await wait_for(lambda: len(running(proxy)) == 2, timeout=30, what="two replicas")
    for resp in first:
        await resp.read()
    await wait_for(
        lambda: any(i.asleep for i in proxy.model("m").instances), what="one scaled down"
    )
    (sleeper,) = [i for i in proxy.model("m").instances if i.asleep]
    (awake,) = running(proxy)
    stream = await proxy.open_stream("m")
    assert awake.leases == 1
    os.killpg(engine_pid(sleeper), signal.SIGKILL)
    await wait_for(lambda: sleeper.state is State.ERROR, what="the sleeper's crash seen")
    body = await stream.read()
    assert body.rstrip().endswith(b"data: [DONE]") and b'"error"' not in body
    assert awake.state is State.RUNNING
    assert await proxy.status("m") == 200


async def test_a_burst_on_asleep_fixed_replicas_wakes_each_once_and_reaches_no_sleeper(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Both fixed replicas asleep, twenty concurrent requests, sessions sticky to replicas
    that went to sleep: each engine is woken once, none is started again, and no request
    reaches an engine while it sleeps or wakes."""
    model = {"replicas": 2, "sleep": SLEEPY, "affinity_header": "X-Session-ID",
             "env": FakeEngine(wake_delay=0.3).env()}  # fmt: skip
    proxy = await start_proxy(config(tmp_path, model, devices=2))
    for user in ("alice", "bob"):
        assert await proxy.status("m", **{"X-Session-ID": user}) == 200
    m = proxy.model("m")
    await wait_for(
        lambda: len(m.instances) == 2 and all(i.asleep for i in m.instances),
        timeout=30,
        what="both replicas asleep",
    )
    replicas = list(m.instances)
    users = ["alice", "bob", "carol", "dave"]
    statuses = await asyncio.gather(
        *(proxy.status("m", **{"X-Session-ID": users[n % 4]}) for n in range(20))
    )
    assert statuses == [200] * 20
    for inst in replicas:  # the second one is woken in the background (the fixed count)
        await wait_for(
            lambda i=inst: engine_metric(proxy, i, "fake_engine:wakes_total"), what="woken"
        )
    assert proxy.engine_starts("m") == 2
    for inst in replicas:
        assert await engine_metric(proxy, inst, "fake_engine:wakes_total") == 1
        assert await engine_metric(proxy, inst, "fake_engine:requests_while_asleep_total") == 0
