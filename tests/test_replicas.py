"""Component tests: replicas, least-load routing, session affinity and autoscaling, with the fake
engine as a real subprocess on a static multi-device budget (each replica on a GPU of its own)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import aiohttp
import pytest
from kit import FakeEngine, RunningProxy, StartProxy, wait_for
from kit import replicas_config as config
from kit.metrics import engine_metric, proxy_samples

from vllm_proxy.config import parse_config
from vllm_proxy.engines.instance import Instance
from vllm_proxy.engines.states import State
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
