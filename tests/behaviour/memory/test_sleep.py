"""Component tests: the sleep tier (vLLM sleep mode) with the fake engine as a real subprocess.

The fake engine implements vLLM's dev routes (/sleep, /wake_up, /is_sleeping, /collective_rpc,
/reset_prefix_cache) only with VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode, parks a
completion sent while asleep until the wake, as vLLM queues it, and counts it
(``fake_engine:requests_while_asleep_total``), and after a
level-2 sleep answers ``<garbage>`` until the weights are reloaded: the tests read those counters
to prove what the proxy did and did not send.

The last section, hostile interleavings: sleep and wake calls with requests, stops, eviction,
reloads, crashes and shutdown, with the fake engine as a real subprocess.

Every test pins an invariant of docs/design.md ("Sleep tiers"): no request reaches a sleeping or
waking engine (the fake counts them), nothing is put to sleep with a request in flight or
queued, memory counts as awake until the /sleep call returned, a failed wake is never served
from, and no stop leaves an instance stuck in SLEEPING, WAKING or STOPPING or an engine alive.
Slow sleep and wake calls (`FakeEngine.sleep_delay`/`wake_delay`) open the
windows; each test waits on states with deadlines, never on time.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kit import SLEEPY, FakeEngine, RunningProxy, StartProxy, alive, make_config, sleepy, wait_for
from kit import sleep_config as config
from kit.metrics import engine_metric, proxy_metric, proxy_samples
from kit.watch import watching

from vllm_proxy.config import parse_config
from vllm_proxy.engines.engine import EngineProcess
from vllm_proxy.engines.instance import Instance
from vllm_proxy.engines.states import DOWN, State


async def chat(proxy: RunningProxy, model: str, **extra: Any) -> tuple[int, str]:
    return await proxy.reply(model, max_tokens=4, **extra)


async def stopped_then_cold_started(proxy: RunningProxy, inst: Instance, why: str) -> None:
    """`inst` stops (`why`), and the next request for m starts the engine a second time."""
    await wait_for(lambda: inst.state is State.STOPPED, what=why)
    assert (await chat(proxy, "m"))[0] == 200
    assert proxy.engine_starts("m") == 2


async def transitions(proxy: RunningProxy, kind: str) -> float | None:
    """How many transitions of `kind` (``wake_l1``...) of model m the proxy timed."""
    series = "vllm_proxy_engine_transition_seconds_count"
    return await proxy_metric(proxy, series, kind=kind, model_id="m")


async def asleep(inst: Instance) -> None:
    await wait_for(lambda: inst.asleep, what=f"{inst.id} asleep")


# -- config -----------------------------------------------------------------------------------


def test_a_sleep_policy_starts_the_engine_in_sleep_mode(tmp_path: Path) -> None:
    cfg = parse_config(
        {
            "server": {"state_dir": str(tmp_path)},
            "engine": {"sleep": {"level": 2}},
            "models": {"a": {"model": "x"}, "b": {"model": "y", "sleep": None}},
        }
    )
    a, b = cfg.specs()["a"], cfg.specs()["b"]
    assert a.sleep is not None and a.sleep.level == 2 and a.sleep.after_idle_s == 60
    assert "--enable-sleep-mode" in a.engine_argv(9000)
    assert a.engine_env()["VLLM_SERVER_DEV_MODE"] == "1"
    # `sleep: null` on a model turns the engine-wide policy off: today's behaviour.
    assert b.sleep is None and "--enable-sleep-mode" not in b.engine_argv(9000)
    # No sleep memory given: the planner guesses (context + 512 MiB) until a sleep is measured.
    assert a.sleep_memory_mb is None and a.preload is False and a.warmup is False
    # Turning sleep mode on or off changes the engine: a reload restarts it.
    assert a.engine_key() != b.engine_key()


def test_sleep_level_is_validated(tmp_path: Path) -> None:
    from vllm_proxy.errors import ConfigError

    with pytest.raises(ConfigError, match=r"models\.a\.sleep\.level"):
        parse_config({"models": {"a": {"model": "x", "sleep": {"level": 3}}}})


# -- idle sleep, one wake for many ------------------------------------------------------------


async def test_idle_sleep_then_concurrent_requests_cause_one_wake(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy, inst = await start_proxy.serving(config(tmp_path, {"m": sleepy()}), "m")
    pid = inst.engine.pid if inst.engine else None
    await asleep(inst)
    assert inst.state is State.SLEEPING and inst.sleep_level == 1
    assert proxy.model("m").state() is State.SLEEPING

    results = await asyncio.gather(*(chat(proxy, "m") for _ in range(20)))
    assert [status for status, _ in results] == [200] * 20
    assert all(text.startswith("tok0") for _, text in results)
    assert proxy.instance("m") is inst and inst.engine is not None and inst.engine.pid == pid
    assert proxy.engine_starts("m") == 1, "woken, not restarted"
    assert await engine_metric(proxy, inst, "fake_engine:wakes_total") == 1
    assert await engine_metric(proxy, inst, "fake_engine:requests_while_asleep_total") == 0
    assert await transitions(proxy, "wake_l1") == 1


async def test_an_idle_engine_whose_sleep_was_put_off_sleeps_at_a_later_period(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Its sleep timer fired while a request of its model waited in admission (a replica ready
    before the one the request waits for): no sleep then, but the engine stays idle, so it
    sleeps a period later rather than stay awake until its next request."""
    proxy, inst = await start_proxy.serving(config(tmp_path, {"m": sleepy()}), "m")
    waiting, asked = [1], [0]

    def queued() -> int:  # a request of m waits in admission meanwhile
        asked[0] += 1
        return waiting[0]

    inst._queued = queued
    await wait_for(lambda: asked[0] >= 2, what="the sleep asked for again a period later")
    assert inst.state is State.RUNNING, "not put to sleep while its model has a request waiting"
    waiting[0] = 0
    await asleep(inst)
    assert proxy.engine_starts("m") == 1


async def test_an_idle_engine_sleeps_only_where_its_memory_may_be_wanted(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """``sleep.on_idle: needed`` (the default): on a budget that holds both models awake an idle
    engine is kept awake past `after_idle_s` (a wake would only cost its next request time);
    on one that does not, it sleeps. ``always`` sleeps either way."""
    needed = {"level": 1, "after_idle_s": 0.3}
    models = {"m": sleepy(needed, memory_mb=1000), "n": sleepy(needed, memory_mb=1000)}
    proxy, inst = await start_proxy.serving(config(tmp_path, models, budget_mb=4000), "m")
    asked = [0]
    sleep_due = inst.timers.sleep_due

    def counted() -> None:
        asked[0] += 1
        sleep_due()

    inst.timers.sleep_due = counted  # type: ignore[method-assign]
    inst.timers.arm()  # idle from now, with the counted timer
    await wait_for(lambda: asked[0] >= 3, what="the sleep timer fired three periods")
    assert inst.state is State.RUNNING and proxy.manager.memory is not None
    assert proxy.manager.memory.room_for_all()

    for folder in ("tight", "always"):
        (tmp_path / folder).mkdir()
    tight = config(tmp_path / "tight", models, budget_mb=1500)  # m and n do not fit together
    proxy, inst = await start_proxy.serving(tight, "m")
    await asleep(inst)
    always = {"m": sleepy({**needed, "on_idle": "always"}, memory_mb=1000)}
    proxy, inst = await start_proxy.serving(config(tmp_path / "always", always), "m")
    await asleep(inst)


async def test_a_stream_longer_than_after_idle_is_never_cut_by_a_sleep(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    env = FakeEngine(tokens=20, token_delay=0.05).env()  # ~1 s of tokens
    proxy = await start_proxy(config(tmp_path, {"m": sleepy(env=env)}))
    resp = await proxy.chat("m", stream=True)
    inst = proxy.instance("m")
    body = await resp.read()
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    text = "".join(
        json.loads(e[6:])["choices"][0]["delta"].get("content") or ""
        for e in events[:-1]
        if json.loads(e[6:])["choices"]
    )
    assert text == "".join(f"tok{i} " for i in range(20))
    assert await engine_metric(proxy, inst, "fake_engine:sleeps_total") == 0
    await asleep(inst)  # and once it is over, the engine does go to sleep
    assert await engine_metric(proxy, inst, "fake_engine:requests_while_asleep_total") == 0


async def test_idle_timeout_still_stops_a_sleeping_engine(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy, inst = await start_proxy.serving(
        config(tmp_path, {"m": sleepy(idle_timeout_s=1.0)}), "m"
    )
    await asleep(inst)
    await stopped_then_cold_started(proxy, inst, "stopped after total idleness")


# -- swap by sleep and wake -------------------------------------------------------------------


async def test_two_preloaded_models_swap_by_sleep_and_wake(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """A budget that holds one awake: the pool is created asleep, then alternate requests
    swap the two by sleep and wake with exactly two engine processes ever started."""
    policy = {"level": 1, "after_idle_s": 60}
    models = {n: {"model": "x", "memory_mb": 600, "preload": True, "sleep": policy} for n in "ab"}
    proxy = await start_proxy(config(tmp_path, models, budget_mb=1000, sleep_memory_mb=100))
    health = await (await proxy.http.get(proxy.url + "/health")).json()
    assert health["status"] == "ok"
    await wait_for(lambda: not proxy.manager.preloading, timeout=30, what="preloads done")
    health = await (await proxy.http.get(proxy.url + "/health")).json()
    assert "preloading" not in health
    a, b = proxy.instance("a"), proxy.instance("b")
    assert a.asleep and b.asleep, "the pool is created asleep"

    for name in "abab":
        assert (await chat(proxy, name))[0] == 200
        awake, other = (a, b) if name == "a" else (b, a)
        assert awake.state is State.RUNNING and other.asleep
    assert proxy.engine_starts("a") == 1 and proxy.engine_starts("b") == 1
    for inst in (a, b):
        assert await engine_metric(proxy, inst, "fake_engine:requests_while_asleep_total") == 0
    metrics = await proxy_samples(proxy)
    assert not metrics.find("vllm_proxy_evictions_total", model_id="a"), "nothing was stopped"


async def test_level_2_wake_reloads_weights_before_serving(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy, inst = await start_proxy.serving(
        config(tmp_path, {"m": sleepy(sleep={"level": 2})}), "m"
    )
    task = inst.sleep("test")
    assert task is not None
    await task
    assert inst.asleep and inst.sleep_level == 2
    status, text = await chat(proxy, "m")
    assert status == 200 and "<garbage>" not in text and text.startswith("tok0")
    assert await engine_metric(proxy, inst, "fake_engine:reload_weights_total") == 1
    # vLLM's own order (weights, reload, KV cache); a level-1+ sleep already cleared the caches.
    assert await engine_metric(proxy, inst, "fake_engine:reset_prefix_cache_total") == 0
    assert await engine_metric(proxy, inst, "fake_engine:garbage_completions_total") == 0
    assert await transitions(proxy, "wake_l2") == 1


# -- eviction order ---------------------------------------------------------------------------


async def test_reclaim_sleeps_first_then_stops_sleepers_never_busy(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    policy = {"level": 1, "after_idle_s": 60}
    long = FakeEngine(tokens=60, token_delay=0.05).env()
    models = {
        "a": {"model": "x", "memory_mb": 300, "sleep": policy},
        "b": {"model": "x", "memory_mb": 300, "sleep": policy},
        # No sleep policy: waiting for its stream would only stop it in a sleeper's place, so
        # e does not wait for it (a busy engine that could sleep instead is waited for:
        # test_admission.py::test_a_wake_waits_for_a_busy_engine_rather_than_stop_asleep_ones).
        "busy": {"model": "x", "memory_mb": 300, "env": long},
        "d": {"model": "x", "memory_mb": 400},
        "e": {"model": "x", "memory_mb": 150},
    }
    # No minimum residency: a and b are idle for d at once (the order is what is tested).
    cfg = config(tmp_path, models, budget_mb=1000, sleep_memory_mb=100, min_resident_s=0)
    proxy = await start_proxy(cfg)
    for name in ("a", "b"):
        assert (await chat(proxy, name))[0] == 200
    stream = await proxy.chat("busy", stream=True)
    await stream.content.readany()
    busy = proxy.instance("busy")
    # d needs 400 with 100 free: a and b (idle) go to sleep, nothing is stopped.
    assert (await chat(proxy, "d"))[0] == 200
    a, b = proxy.instance("a"), proxy.instance("b")
    assert a.asleep and b.asleep and busy.state is State.RUNNING
    assert a.engine is not None and a.engine.exit_code is None
    # e needs 150 with 100 free: the least recently used sleeper is stopped, nothing else.
    assert (await chat(proxy, "e"))[0] == 200
    assert a.state is State.STOPPED and b.asleep
    assert busy.state is State.RUNNING and proxy.instance("d").state is State.RUNNING
    body = await stream.read()
    assert body.rstrip().endswith(b"data: [DONE]"), "the busy stream was never touched"
    assert await engine_metric(proxy, busy, "fake_engine:sleeps_total") == 0


# -- failures fall back to a stop and a cold start --------------------------------------------


@pytest.mark.parametrize(
    ("knob", "extra"),
    [
        ("wake_fail", {}),
        ("wake_lies", {}),
        ("wake_hang", {"wake_timeout_s": 0.5}),  # sleep.wake_timeout_s
    ],
)
async def test_a_failed_wake_stops_the_engine_and_cold_starts(
    tmp_path: Path, start_proxy: StartProxy, knob: str, extra: dict[str, Any]
) -> None:
    proxy = await start_proxy(
        config(tmp_path, {"m": sleepy({**SLEEPY, **extra}, env=FakeEngine(**{knob: True}).env())})
    )
    assert (await chat(proxy, "m"))[0] == 200
    first = proxy.instance("m")
    await asleep(first)
    status, text = await chat(proxy, "m")
    assert status == 200 and text.startswith("tok0"), "served by a new engine"
    assert first.state is State.STOPPED and first.engine is not None
    assert first.engine.exit_code is not None, "the half-woken engine is gone"
    assert proxy.instance("m") is not first and proxy.engine_starts("m") == 2
    assert (
        await proxy_metric(
            proxy, "vllm_proxy_engine_restarts_total", model_id="m", reason="wake_failed"
        )
        == 1
    )


async def test_a_failed_sleep_stops_the_engine(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(
        config(tmp_path, {"m": sleepy(env=FakeEngine(sleep_fail=True).env())})
    )
    assert (await chat(proxy, "m"))[0] == 200
    inst = proxy.instance("m")
    await stopped_then_cold_started(proxy, inst, "stopped after a failed sleep")


async def test_warmup_runs_before_the_instance_serves(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    # (Without the wake check, which runs a request of its own: test_wake_verify.py.)
    unchecked = {**SLEEPY, "verify_wake": False}
    proxy = await start_proxy(config(tmp_path, {"m": sleepy(unchecked, warmup=True)}))
    admin = await proxy.http.post(proxy.url + "/admin/models/m/load")
    assert admin.status == 200
    inst = proxy.instance("m")
    # Loaded by the admin API, no client request yet: the engine already served the warm-up.
    assert await engine_metric(proxy, inst, "vllm:request_success_total") == 1
    await asleep(inst)
    assert (await chat(proxy, "m"))[0] == 200
    # The wake warmed it up too: warm-up, client, warm-up after the wake, client.
    assert await engine_metric(proxy, inst, "vllm:request_success_total") == 3


async def test_a_failing_warmup_fails_the_start(tmp_path: Path, start_proxy: StartProxy) -> None:
    # The engine crashes on its first completion: the warm-up's.
    env = FakeEngine(crash_after=0).env()
    proxy = await start_proxy(config(tmp_path, {"m": {"model": "x", "warmup": True, "env": env}}))
    status, text = await chat(proxy, "m")
    assert status == 502 and "warm-up" in text
    assert proxy.instance("m").state is State.ERROR


# -- admin ------------------------------------------------------------------------------------


async def test_admin_sleep_and_wake(tmp_path: Path, start_proxy: StartProxy) -> None:
    models = {"m": sleepy(sleep={"level": 1, "after_idle_s": 60}), "plain": {"model": "x"}}
    proxy = await start_proxy(config(tmp_path, models))
    base = proxy.url + "/admin/models"
    assert (await chat(proxy, "m"))[0] == 200
    resp = await proxy.http.post(base + "/m/sleep?level=2")
    assert resp.status == 200
    row = await resp.json()
    (inst,) = row["instances"]
    assert row["state"] == "sleeping" and inst["state"] == "sleeping" and inst["sleep_level"] == 2
    assert row["sleep"] == {"level": 1, "after_idle_s": 60.0}
    assert (
        await proxy_metric(proxy, "vllm_proxy_instance_sleep_level", instance="m#1", model_id="m")
        == 2
    )
    assert await proxy_metric(proxy, "vllm_proxy_instances", model_id="m", state="sleeping") == 1

    resp = await proxy.http.post(base + "/m/wake")
    assert resp.status == 200
    row = await resp.json()
    assert row["state"] == "running" and row["instances"][0]["sleep_level"] == 0
    assert await proxy_metric(proxy, "vllm_proxy_instances", model_id="m", state="running") == 1

    resp = await proxy.http.post(base + "/m/wake")
    assert resp.status == 200, "waking an awake model is a no-op"
    resp = await proxy.http.post(base + "/m/sleep?level=3")
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "level"
    resp = await proxy.http.post(base + "/plain/sleep")
    assert resp.status == 409 and (await resp.json())["error"]["code"] == "sleep_not_enabled"
    resp = await proxy.http.post(base + "/plain/wake")
    assert resp.status == 409 and (await resp.json())["error"]["code"] == "not_sleeping"


async def test_admin_level_2_is_refused_for_a_model_that_cannot_reload(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """A level-2 wake reloads the weights with the model's loader, which tensorizer and the
    other one-shot formats cannot do (vLLM 0.33 model_loader/reload/inplace.py:73-79): an
    operator's ?level=2 on such a model gets 409 and the model keeps serving."""
    models = {"m": sleepy(sleep={"level": 1}, args={"load_format": "tensorizer"})}
    proxy = await start_proxy(config(tmp_path, models))
    assert (await chat(proxy, "m"))[0] == 200
    resp = await proxy.http.post(proxy.url + "/admin/models/m/sleep?level=2")
    body = await resp.json()
    assert resp.status == 409 and body["error"]["code"] == "sleep_level_unsupported", body
    assert "load_format" in body["error"]["message"]
    assert proxy.instance("m").state is State.RUNNING
    assert (await chat(proxy, "m"))[0] == 200


async def test_admin_sleep_waits_for_requests_in_flight(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    env = FakeEngine(tokens=20, token_delay=0.05).env()
    policy = {"level": 1, "after_idle_s": 60}
    proxy = await start_proxy(config(tmp_path, {"m": sleepy(sleep=policy, env=env)}))
    stream = await proxy.chat("m", stream=True)
    await stream.content.readany()
    # Too short a drain: 409, and the stream goes on untouched.
    resp = await proxy.http.post(proxy.url + "/admin/models/m/sleep?timeout=0.05")
    assert resp.status == 409 and (await resp.json())["error"]["code"] == "model_busy"
    sleeping = asyncio.ensure_future(proxy.http.post(proxy.url + "/admin/models/m/sleep"))
    body = await stream.read()
    assert body.rstrip().endswith(b"data: [DONE]")
    resp = await sleeping
    assert resp.status == 200 and (await resp.json())["state"] == "sleeping"


# -- honest GPU admission ---------------------------------------------------------------------


class _Mem:
    def __init__(self, total: int, used: int) -> None:
        self.total, self.used, self.free = total, used, total - used


class StaleNvml:
    """One 80 GiB device whose reading lags: it reports only what `used` says, however much
    the proxy's engines have been promised."""

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        self.used = 0

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> _Mem:
        return _Mem(80 * 1024 * 2**20, self.used * 2**20)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        raise self.NVMLError("not supported")

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        raise self.NVMLError("not supported")


async def test_admission_counts_claims_when_the_device_reading_lags(tmp_path: Path) -> None:
    """Three 31 GiB models on 80 GiB: the third must evict even though the device reading
    (stale, or taken before the second engine allocated) shows room for it."""
    from vllm_proxy.app import engine_context
    from vllm_proxy.engines.registry import EngineRegistry
    from vllm_proxy.metrics import Metrics
    from vllm_proxy.planning.gpu import NvmlMonitor
    from vllm_proxy.planning.memory import Memory
    from vllm_proxy.planning.planner import Plan
    from vllm_proxy.pool.manager import Manager

    models = {n: {"model": "x", "memory_mb": 31 * 1024} for n in "abc"}
    cfg = make_config(tmp_path, models)
    specs = cfg.specs()
    nvml = StaleNvml()
    metrics = Metrics()
    memory = Memory(NvmlMonitor(nvml=nvml), "nvml", cfg, specs, metrics)
    async with aiohttp.ClientSession() as session:
        registry = EngineRegistry(tmp_path / "engines.json")
        ctx, roster, admission = engine_context(session, registry, metrics, memory)
        manager = Manager(specs, ctx, roster, memory, admission)
        assert manager.admission is not None
        placed = []
        for name in "ab":
            inst = manager.models[name]._new_instance()
            inst.state = State.STARTING
            decision = manager.admission.plan_for(inst)
            assert isinstance(decision, Plan) and decision.evict == ()
            memory.claim(inst.id, memory.placement(inst.spec, decision.devices))
            inst.state = State.RUNNING  # ready; the device reading has not caught up
            inst.last_used = len(placed)
            placed.append(inst)
        nvml.used = 31 * 1024  # only a's allocation is visible
        await memory.read_fresh()
        c = manager.models["c"]._new_instance()
        c.state = State.STARTING
        decision = manager.admission.plan_for(c)
        assert isinstance(decision, Plan)
        assert decision.evict == (placed[0].id,), "the LRU engine makes room: no overcommit"
        # A starting instance is not counted twice: what it has allocated since its start
        # began is in the reading, its claim covers only the rest.
        placed[1].state = State.STARTING
        memory.baseline[placed[1].id] = {0: 31 * 1024}  # the reading when its start began
        nvml.used = 62 * 1024
        await memory.read_fresh()
        _, pending = manager.admission._views()
        assert pending == {0: 0}, "its allocation so far is already in the reading"
        (dev,) = memory.device_views(pending)
        assert dev.used_mb + dev.pending_mb == 62 * 1024


# -- level 1 needs host RAM -------------------------------------------------------------------


def _sleepy_instance(
    tmp_path: Path,
    model: dict[str, Any],
    weights: int | None,
    room: int,
    iid: str = "m#1",
    host: Any = None,
    pool: Any = None,
) -> tuple[Any, Any]:
    """An instance of model `m` whose level-1 sleep pins `weights` MiB (+ the 512 MiB runtime
    pool), with `room` MiB of host RAM (or `host`'s figures) and `pool`'s hooks; its context's
    host figures."""
    from unittest.mock import MagicMock

    from vllm_proxy.engines.ports import EngineContext, NoPool, UnmanagedMemory
    from vllm_proxy.metrics import Metrics
    from vllm_proxy.planning.hostmem import HostRam

    class Weights(UnmanagedMemory):
        def weights_mb(self, spec: Any) -> int | None:
            return weights

    cfg = parse_config({"server": {"state_dir": str(tmp_path)}, "models": {"m": model}})
    host = host or HostRam(lambda: room)
    ctx = EngineContext(
        session=MagicMock(), ports=MagicMock(), registry=MagicMock(), metrics=Metrics(),
        memory=Weights(), host=host, pool=pool or NoPool(),
    )  # fmt: skip
    return Instance(cfg.specs()["m"], iid, ctx, lambda _i, _o: None), host


def test_level_1_falls_back_to_level_2_without_host_ram_for_the_weights(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    inst, host = _sleepy_instance(tmp_path, {"model": "x", "sleep": {}}, 40_000, 10_000)
    with caplog.at_level("WARNING", logger="vllm_proxy.engines.instance"):
        assert inst._choose_level(1) == 2
    # The weights and the runtime pool are pinned at level 1, the runtime pool at level 2.
    assert "using level 2" in caplog.text and "40512 MiB" in caplog.text
    assert host.promised == {"m#1": 512}
    host.settle("m#1")
    inst2, _ = _sleepy_instance(tmp_path, {"model": "x", "sleep": {}}, 1, 10_000)
    assert inst2._choose_level(1) == 1, "weights that fit in host RAM keep level 1"
    assert inst2._choose_level(2) == 2


def test_level_2_needs_host_ram_for_its_runtime_pool_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Level 2 still pins the runtime pool (vLLM 0.33 device_allocator/sleep_mode_backend.py:
    127-137): with no room even for that, no level fits and the engine is stopped instead
    (a sleep that pins past the cgroup limit gets the engine OOM-killed)."""
    inst, host = _sleepy_instance(tmp_path, {"model": "x", "sleep": {"level": 2}}, 1_000, 1_200)
    with caplog.at_level("WARNING", logger="vllm_proxy.engines.instance"):
        assert inst._choose_level(2) is None
    assert "no sleep level fits in host RAM" in caplog.text and host.promised == {}


def test_with_no_level_in_host_ram_an_idle_engine_is_stopped_and_an_operator_told(
    tmp_path: Path,
) -> None:
    """A sleep the planner or the idle timer asks for stops the engine instead (its GPU memory
    is what was wanted); an operator who asked for a sleep gets 409 and the engine keeps
    serving."""
    from unittest.mock import MagicMock

    from vllm_proxy.errors import Conflict

    inst, _ = _sleepy_instance(tmp_path, {"model": "x", "sleep": {"level": 2}}, 1_000, 1_200)
    inst.state = State.RUNNING
    inst.engine = MagicMock()
    with pytest.raises(Conflict, match="no sleep level fits"):
        inst.sleep("admin")
    assert inst.state is State.RUNNING
    stopping = MagicMock()
    inst._begin_stop = lambda: stopping  # type: ignore[method-assign]
    assert inst.sleep("memory") is stopping


def test_short_of_host_ram_a_sleep_stops_engines_asleep_used_less_recently_first(
    tmp_path: Path,
) -> None:
    """Engines asleep are not stopped by a timer (with a sleep policy, idle_timeout_s is unset:
    never); a sleep that would not fit in host RAM stops the least recently used of them
    instead of falling back to level 2, and waits for their stops before it pins."""
    from types import SimpleNamespace
    from unittest.mock import MagicMock

    from vllm_proxy.pool.roster import Roster

    # The pool's hooks, over the roster below.
    pool = SimpleNamespace(host_victims=lambda me, short: Roster.host_victims(roster, me, short))  # type: ignore[arg-type]
    inst, host = _sleepy_instance(tmp_path, {"model": "x", "sleep": {}}, 40_000, 10_000, pool=pool)
    assert inst.spec.idle_timeout_s == 0
    host.retained = {"old#1": 20_000, "older#1": 25_000, "newer#1": 50_000, "busy#1": 90_000}
    inst.last_used = 100.0

    def asleep(iid: str, used: float, **more: Any) -> Any:
        fields = {"id": iid, "name": iid.split("#")[0], "state": State.SLEEPING, "leases": 0,
                  "wake_asked": False, "retired": False, "last_used": used,
                  "evict": MagicMock(return_value=None)}  # fmt: skip
        return SimpleNamespace(**{**fields, **more})

    old, older = asleep("old#1", 50.0), asleep("older#1", 10.0)
    newer, busy = asleep("newer#1", 150.0), asleep("busy#1", 5.0, leases=1)
    roster = SimpleNamespace(all_instances=lambda: [old, newer, busy, older, inst], models={},
                             host=host)  # fmt: skip
    # 40512 + the margin - 10000: the two least recently used asleep (not newer, not busy).
    chosen = Roster.host_victims(roster, inst, 31_000)  # type: ignore[arg-type]
    assert [v.id for v in chosen] == ["older#1", "old#1"]
    assert Roster.host_victims(roster, inst, 50_000) == []  # they cannot free that much

    stops: list[str] = []

    async def stopped() -> None:
        stops.append("done")

    loop = asyncio.new_event_loop()
    try:
        for victim in (older, old):
            victim.evict = MagicMock(return_value=loop.create_task(stopped()))
        assert inst._choose_level(1) == 1, "level 1 kept: the host RAM is made"
        older.evict.assert_called_once_with("host memory")
        old.evict.assert_called_once_with("host memory")
        assert len(inst._host_freeing) == 2
        loop.run_until_complete(asyncio.wait(inst._host_freeing))
    finally:
        loop.close()
    assert stops == ["done", "done"]


def test_a_model_that_cannot_reload_is_not_demoted_to_level_2(tmp_path: Path) -> None:
    """A level-2 wake of a tensorizer (or other one-shot) checkpoint fails reload_weights
    (vLLM 0.33 model_loader/reload/inplace.py:73-79): short of host RAM for level 1, such a
    model is stopped, never put to a level-2 sleep it cannot wake from."""
    model = {"model": "x", "sleep": {"level": 1}, "args": {"load_format": "tensorizer"}}
    inst, _ = _sleepy_instance(tmp_path, model, 40_000, 10_000)
    assert inst._choose_level(1) is None


def test_a_second_sleep_pins_only_what_the_engine_does_not_keep_yet(tmp_path: Path) -> None:
    """PyTorch's caching host allocator keeps the pinned blocks after the wake (vLLM never
    empties it): the engine's next sleep reuses them, and what its first sleep pinned, as
    measured, is what the model's other engines are planned with."""
    inst, host = _sleepy_instance(tmp_path, {"model": "x", "sleep": {}}, 4_000, 9_000)
    assert inst._choose_level(1) == 1 and host.promised == {"m#1": 4_512}
    host.settle("m#1")
    key = inst.host_key
    host.slept("m#1", key, 1, 5_900)  # measured: more than the guess (power-of-two blocks)
    assert host.retained == {"m#1": 5_900} and host.need_mb("m#1", key, 1, 4_512) == 0
    assert inst._choose_level(1) == 1 and host.promised == {}, "nothing more to pin"
    other, _ = _sleepy_instance(tmp_path, {"model": "x", "sleep": {}}, 4_000, 9_000, "m#2", host)
    assert host.need_mb("m#2", key, 1, 4_512) == 5_900, "planned with the measured figure"
    host._read = lambda: 6_000  # type: ignore[method-assign]
    assert other._choose_level(1) == 2, "5900 + margin no longer fits; the runtime pool does"
    host.forget("m#1")
    assert host.retained == {}


def test_level_1_sleeps_in_flight_share_one_host_ram_figure(tmp_path: Path) -> None:
    """Two victims put to sleep together must not both count the same free host RAM."""
    first, host = _sleepy_instance(tmp_path, {"model": "x", "sleep": {}}, 4_000, 10_000)
    second, _ = _sleepy_instance(tmp_path, {"model": "x", "sleep": {}}, 4_000, 10_000, "m#2", host)
    assert first._choose_level(1) == 1  # 4000 + 512 runtime pool + 1024 margin fit in 10000
    assert host.promised == {"m#1": 4_512}
    assert second._choose_level(1) == 2, "the first sleep's 4512 MiB are promised"
    host.settle("m#1")
    host.settle("m#2")
    assert second._choose_level(1) == 1


def test_host_ram_room_comes_from_the_cgroup_limit(tmp_path: Path) -> None:
    from vllm_proxy.planning.hostmem import cgroup_room_mb

    root_only = tmp_path / "self-root"
    root_only.write_text("0::/\n")
    (tmp_path / "memory.max").write_text(f"{8 * 2**30}\n")
    (tmp_path / "memory.current").write_text(f"{3 * 2**30}\n")
    assert cgroup_room_mb(tmp_path, root_only) == 5 * 1024
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_room_mb(tmp_path, root_only) is None  # unlimited: the host's figure applies
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{2 * 2**30}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{2**30}\n")
    v1_self = tmp_path / "v1-self"
    v1_self.write_text("3:cpu,cpuacct:/\n2:memory:/\n")
    assert cgroup_room_mb(v1, v1_self) == 1024


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_the_cgroup_room_counts_reclaimable_page_cache_as_room(
    tmp_path: Path, version: str
) -> None:
    """Regression (F4): room was ``memory.max - memory.current``, which counts the page cache
    (the engines' checkpoint reads, the read-ahead) as used: under MemoryMax=8G, after a 6 GiB
    file was read, a level-1 sleep that fits was refused. Now the file cache counts as room, as
    the host's MemAvailable counts it; shared memory (pinned backups) does not."""
    from vllm_proxy.planning.hostmem import cgroup_room_mb

    gib = 2**30
    if version == "v2":
        own = tmp_path / "self"
        own.write_text("0::/\n")
        (tmp_path / "memory.max").write_text(f"{8 * gib}\n")
        (tmp_path / "memory.current").write_text(f"{7 * gib}\n")
        stat = f"anon {gib // 2}\nfile {6 * gib}\nactive_file {2 * gib}\ninactive_file {4 * gib}\n"
        stat += f"shmem {gib // 2}\n"
        (tmp_path / "memory.stat").write_text(stat)
        root = tmp_path
    else:
        own = tmp_path / "self"
        own.write_text("2:memory:/\n")
        root = tmp_path / "v1"
        (root / "memory").mkdir(parents=True)
        (root / "memory" / "memory.limit_in_bytes").write_text(f"{8 * gib}\n")
        (root / "memory" / "memory.usage_in_bytes").write_text(f"{7 * gib}\n")
        (root / "memory" / "memory.stat").write_text(
            f"cache {6 * gib}\ntotal_active_file {2 * gib}\ntotal_inactive_file {4 * gib}\n"
            f"total_shmem {gib // 2}\n"
        )
    # 8 GiB limit, 7 used of which 6 are file cache: 7 GiB of room, not 1.
    assert cgroup_room_mb(root, own) == 7 * 1024


def test_a_pinned_measurement_far_below_the_estimate_needs_corroboration() -> None:
    """Regression (F5): a sleep measured at 0 (RSS that misses pinned pages, as the fake engine
    without GPU shows) was learned, and every later level-1 sleep of the model was admitted
    with no host-RAM check at all."""
    from vllm_proxy.planning.hostmem import HostRam, trusted

    key = ("m", "engine")
    host = HostRam(reader=lambda: 100_000)
    host.slept("m#1", key, 1, 0, guess_mb=40_000)
    assert host.learned[(key, 1)] == 40_000, "kept at the estimate"
    assert host.need_mb("m#2", key, 1, 40_000) == 40_000, "the next sleep is still checked"
    assert host.need_mb("m#1", key, 1, 40_000) == 40_000, "its own next sleep too"
    # Corroborated: shared memory grew by what RSS missed, or confirms a small pin.
    assert trusted(0, 40_000, 41_000) == 41_000
    assert trusted(1_000, 40_000, 1_200) == 1_200
    assert trusted(30_000, 40_000, None) == 30_000, "near the estimate: trusted as it is"
    assert trusted(500, None, None) == 500, "no estimate: as measured"
    assert trusted(0, 40_000, 0) == 40_000, "shared memory that did not move shows nothing"


def test_vllms_backed_up_lines_since_the_sleep_began_corroborate_a_pin(tmp_path: Path) -> None:
    """Each rank logs what its sleep backed up in host memory (vLLM 0.33
    device_allocator/cumem.py:282-289): the lines written since the sleep began are summed."""
    from vllm_proxy.planning.hostmem import backed_up_mb, log_size

    line = (
        "(Worker_TP{r} pid=1) INFO [cumem.py:282] CuMemAllocator: sleep freed 40.00 GiB memory"
        " in total, of which {gib} GiB is backed up in CPU and the rest 2.00 GiB is discarded"
        " directly.\n"
    )
    log = tmp_path / "m.1.log"
    log.write_text(line.format(r=0, gib="9.00"))  # an earlier sleep's
    at = log_size(log)
    assert backed_up_mb(log, at) is None, "nothing said since"
    with log.open("a") as f:
        f.write("other line\n" + line.format(r=0, gib="38.00") + line.format(r=1, gib="38.00"))
    assert backed_up_mb(log, at) == 76 * 1024
    log.rename(tmp_path / "m.1.log.1")  # rotated meanwhile: the new file from its start
    log.write_text(line.format(r=0, gib="1.50"))
    assert backed_up_mb(log, at) == 1536
    assert backed_up_mb(tmp_path / "absent.log", (0, 0)) is None


def test_host_ram_room_comes_from_the_proxys_own_cgroup_and_those_above(tmp_path: Path) -> None:
    """Under systemd's MemoryMax= the limit sits on the service's own cgroup
    (/proc/self/cgroup), not at the root of the hierarchy: every level from there up counts,
    the tightest wins."""
    from vllm_proxy.planning.hostmem import cgroup_room_mb

    unit = tmp_path / "system.slice" / "vllm-proxy.service"
    unit.mkdir(parents=True)
    (unit / "memory.max").write_text(f"{8 * 2**30}\n")
    (unit / "memory.current").write_text(f"{3 * 2**30}\n")
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text(f"{50 * 2**30}\n")
    own = tmp_path / "cgroup"
    own.write_text("0::/system.slice/vllm-proxy.service\n")
    assert cgroup_room_mb(tmp_path, own) == 5 * 1024
    (tmp_path / "system.slice" / "memory.max").write_text(f"{4 * 2**30}\n")
    (tmp_path / "system.slice" / "memory.current").write_text(f"{3 * 2**30}\n")
    assert cgroup_room_mb(tmp_path, own) == 1024, "the slice above is tighter"


def test_weights_size_for_level_1_comes_from_the_footprint(tmp_path: Path) -> None:
    from vllm_proxy.planning.footprint import host_weights_mb

    cfg = parse_config(
        {
            "server": {"state_dir": str(tmp_path)},
            "models": {"p": {"model": "x", "params_b": 7}, "m": {"model": "x", "memory_mb": 900}},
        }
    )
    specs = cfg.specs()
    weights = host_weights_mb(specs["p"], None)
    assert weights is not None and 13_000 < weights < 14_000, "7e9 x 2 bytes"
    # Only memory_mb known: its budget (less the context) stands in for the weights.
    assert host_weights_mb(specs["m"], None) == 900 - 768


async def test_a_pooling_model_warms_up_through_embeddings(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Regression: the warm-up was a completion, a route pooling models do not have in vLLM:
    every start and every wake of an embedding model with `warmup: true` failed."""
    models = {"e": {"model": "x", "warmup": True, "args": {"runner": "pooling"}}}
    proxy = await start_proxy(config(tmp_path, models))
    body = {"model": "e", "input": "hello"}
    async with proxy.http.post(proxy.url + "/v1/embeddings", json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["data"]
    assert proxy.engine_starts("e") == 1
    async with proxy.http.post(proxy.url + "/v1/completions", json={"model": "e"}) as resp:
        assert resp.status == 404  # the engine has no completion route: nor did the warm-up


# -- hostile interleavings of sleeps, wakes and requests ---------------------------------------


#: States an instance may be left in once everything has settled.
SETTLED = frozenset({State.RUNNING, State.STOPPED, State.ERROR})


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
