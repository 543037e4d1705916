"""The proxy on a simulated GPU: its real NVML code path over the simulated-GPU ledger, in front of
fake engines that hold memory the way vLLM 0.33 does (``fake_vllm/simgpu.py``).

Each test pins one of vLLM's memory rules that the planner used to get wrong, and fails on the
code before its fix:

* the CUDA context lies outside ``--gpu-memory-utilization``, and vLLM refuses to start unless
  ``util x total`` is free after creating it;
* the KV cache fills the whole budget, so a measurement fed back into the budget grows it at every
  restart (0.492 -> 0.624 over seven starts of one model);
* vLLM profiles device-wide and fails when a neighbour frees memory meanwhile;
* a sleeping engine keeps its context and CUDA graphs, which the proxy now measures;
* level-2 wakes map the weights, reload them, then map the KV cache;
* a budget without room for the KV cache is grown (estimates) or named (memory_mb);
* the world size counts every parallel dimension, and a model's own CUDA_VISIBLE_DEVICES is
  where it is planned.

Tests wait on states and on the ledger with deadlines, never on time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import pytest
from kit import FakeEngine, RunningProxy, StartProxy, simgpu, wait_for
from kit.metrics import proxy_samples
from kit.simgpu import (
    chat,
    outsider,
    profiling,
    tiny_checkpoint,
    utils_started,
)

from fake_vllm.simgpu import Ledger
from vllm_proxy.config import Config
from vllm_proxy.engines.engine import instance_logs
from vllm_proxy.engines.instance import Instance
from vllm_proxy.engines.states import State


def sim_config(
    tmp_path: Path, ledger: Ledger, models: dict[str, dict[str, Any]], devices: list[int] | None
) -> Config:
    return simgpu.sim_config(tmp_path, ledger, models, devices, queue_timeout_s=20)


async def asleep_after_one_request(
    start_proxy: StartProxy, cfg: Config, name: str
) -> tuple[RunningProxy, Instance, Any]:
    """A proxy whose model `name` served one request and was then put to sleep."""
    proxy = await start_proxy(cfg)
    assert (await chat(proxy, name))[0] == 200
    inst = proxy.instance(name)
    task = inst.sleep("test")
    assert task is not None
    await task
    assert inst.asleep and proxy.manager.memory is not None
    return proxy, inst, proxy.manager.memory


# -- the context outside the budget ------------------------------------------------------------


async def test_a_start_the_planner_admits_passes_vllms_free_memory_check(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """Regression: the context was planned inside the budget, so with exactly the footprint free
    vLLM's check (free after its own context >= util x total) refused the start."""
    outsider(ledger, 0, 24_000 - 11_800 - 256)  # leaves the footprint plus the reserve free
    proxy = await start_proxy(
        sim_config(tmp_path, ledger, {"a": {"model": "x", "memory_mb": 11_800}}, None)
    )
    status, _ = await chat(proxy, "a")
    assert status == 200, proxy.engine_log("a")
    assert simgpu.STARTUP_REFUSAL not in proxy.engine_log("a")
    inst = proxy.instance("a")
    util = utils_started(proxy, "a")[0]
    # vLLM holds its whole budget (KV fills it) plus the context: within the planned footprint.
    held = ledger.read()[0].used_mb - (24_000 - 11_800 - 256)
    assert held == math.ceil(util * 24_000) + simgpu.CONTEXT_MB <= 11_800
    assert proxy.manager.memory is not None
    assert proxy.manager.memory.claims[inst.id].footprint_mb == 11_800


# -- budgets never grow from measurements -------------------------------------------------------


async def test_budgets_stay_constant_across_10_lru_cycles(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """Regression: each measured engine raised the next one's --gpu-memory-utilization (the KV
    cache fills any budget), until the model "never fit"."""
    models = {"a": {"model": "x", "memory_mb": 12_400}, "b": {"model": "x", "memory_mb": 12_400}}
    proxy = await start_proxy(sim_config(tmp_path, ledger, models, None))
    utils: dict[str, list[float]] = {"a": [], "b": []}
    ids = set()
    for _ in range(10):
        for name in ("a", "b"):  # they do not fit together: each start evicts the other
            status, text = await chat(proxy, name)
            assert status == 200, text
            utils[name].append(utils_started(proxy, name)[-1])  # the newest engine's log
            ids.add(proxy.instance(name).id)
            assert simgpu.STARTUP_REFUSAL not in proxy.engine_log(name)
    for name in ("a", "b"):
        assert len(set(utils[name])) == 1, utils[name]
    assert len(ids) == 20, "every request started an engine, and none failed"


# -- nobody frees memory while a neighbour profiles ----------------------------------------------


@pytest.mark.parametrize("how", ["sleep", "stop"])
async def test_a_neighbours_idle_sleep_or_stop_never_fails_a_start(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy, how: str
) -> None:
    """Regression: only starts and wakes held the device lock; an idle sleep or stop released
    memory while another engine profiled, and vLLM failed it ("Error in memory profiling")."""
    models = {
        "a": {"model": "x", "memory_mb": 8_000, "sleep": {"level": 1, "after_idle_s": 3600}},
        "b": {"model": "x", "memory_mb": 8_000, "env": FakeEngine(sim_profile_s=1.5).env()},
    }
    proxy = await start_proxy(sim_config(tmp_path, ledger, models, None))
    assert (await chat(proxy, "a"))[0] == 200
    a = proxy.instance("a")
    a_pids = simgpu.engine_pids(ledger)
    b_request = asyncio.ensure_future(chat(proxy, "b"))
    await wait_for(lambda: profiling(ledger, a_pids), what="b profiling its start")
    if how == "sleep":
        a.timers.sleep_due()  # the idle timer firing now
    else:
        a.timers.idle_expired()
    status, text = await b_request
    assert status == 200, text
    assert "Error in memory profiling" not in proxy.engine_log("b")
    assert proxy.engine_starts("b") == 1
    # The neighbour's sleep or stop went ahead once the start had finished.
    if how == "sleep":
        await wait_for(lambda: a.asleep, what="a asleep")
    else:
        await wait_for(lambda: a.state is State.STOPPED, what="a stopped")


# -- what a sleeping engine keeps ----------------------------------------------------------------


async def test_the_sleep_residue_is_measured_and_planned_with(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """Regression: a sleeping engine was assumed to hold a fixed sleep_memory_mb; vLLM keeps its
    context and CUDA graphs (unless they are offloaded), which nothing measured."""
    models = {"a": {"model": "x", "memory_mb": 8_000, "sleep": {"level": 1, "after_idle_s": 3600},
                    "env": FakeEngine(sim_graphs_mb=700).env()}}  # fmt: skip
    cfg = sim_config(tmp_path, ledger, models, None)
    proxy, inst, memory = await asleep_after_one_request(start_proxy, cfg, "a")
    residue = ledger.read()[0].used_mb
    assert residue == simgpu.CONTEXT_MB + 700  # the context and the CUDA graphs stay
    assert memory.held_mb(inst.id) == residue
    assert memory.sleep_mb(inst.spec) == residue  # what the planner expects of the next sleep
    status, _ = await chat(proxy, "a")  # the wake needs only what the sleep freed
    assert status == 200 and proxy.engine_starts("a") == 1


# -- level-2 wake order --------------------------------------------------------------------------


async def sim_calls(proxy: RunningProxy, inst: Instance) -> list[Any]:
    assert inst.engine is not None
    async with inst.engine.client(proxy.http).get(inst.engine.base_url + "/sim/calls") as resp:
        return list(await resp.json())


async def test_a_level_2_wake_follows_vllms_order_on_a_tight_gpu(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """Regression: the proxy woke every tag and then reloaded the weights, so the reload's
    buffers sat on top of a mapped KV cache: on a packed GPU the wake ran out of memory and the
    engine was stopped and cold-started. Here the GPU holds exactly what the planner asks for
    the wake, and the reload needs 1100 MiB while the KV cache is still unmapped."""
    env = FakeEngine(sim_reload_temp_mb=1100).env()
    models = {"a": {"model": "x", "memory_mb": 20_000, "sleep": {"level": 2, "after_idle_s": 3600},
                    "env": env}}  # fmt: skip
    cfg = sim_config(tmp_path, ledger, models, None)
    proxy, inst, memory = await asleep_after_one_request(start_proxy, cfg, "a")
    need = memory.wake_need(inst.id) + memory.reserve_mb
    outsider(ledger, 0, ledger.read()[0].free_mb - need)  # nothing more than the wake needs
    status, text = await chat(proxy, "a")
    assert status == 200 and "<garbage>" not in text, text
    assert proxy.engine_starts("a") == 1, "the wake did not fall back to a cold start"
    calls = await sim_calls(proxy, inst)
    wake = [(c["call"], c.get("tags") or c.get("method")) for c in calls if c["call"] != "sleep"]
    assert wake == [
        ("wake_up", ["weights"]), ("collective_rpc", "reload_weights"), ("wake_up", ["kv_cache"]),
    ]  # fmt: skip
    assert all(c["status"] == 200 for c in calls)


async def test_a_level_2_wake_needs_no_reload_buffer_beyond_its_footprint(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """Regression: every level-2 model claimed its checkpoint's largest tensor on top of its
    budget, for a reload buffer vLLM does not keep: the final wake_up(tags=kv_cache) empties
    torch's cache before it maps the KV cache (vLLM 0.33 device_allocator/cumem.py:342-343).
    For a memory_mb model that buffer came out of vLLM's budget. Now the budget is memory_mb
    less the context alone, and with exactly footprint - residue free every wake fits: the
    reload's 400 MiB of temporaries sit where the KV cache goes, and are gone after it."""
    env = FakeEngine(sim_reload_temp_mb=400).env()
    models = {"a": {"model": "x", "memory_mb": 20_000, "sleep": {"level": 2, "after_idle_s": 3600},
                    "env": env}}  # fmt: skip
    proxy = await start_proxy(sim_config(tmp_path, ledger, models, None))
    assert (await chat(proxy, "a"))[0] == 200
    inst = proxy.instance("a")
    memory = proxy.manager.memory
    assert memory is not None
    assert memory.budget("a") == 20_000 - memory.overhead("a") == 20_000 - 768
    assert utils_started(proxy, "a") == [math.floor((20_000 - 768) / 24_000 * 1e6) / 1e6]
    for _ in range(2):
        task = inst.sleep("test")
        assert task is not None
        await task
        need = memory.wake_need(inst.id) + memory.reserve_mb
        assert memory.wake_need(inst.id) == 20_000 - memory.held_mb(inst.id)
        outsider(ledger, 0, ledger.read()[0].free_mb - need)
        status, text = await chat(proxy, "a")
        assert status == 200 and "<garbage>" not in text, text
        (pid,) = simgpu.engine_pids(ledger)
        assert "reload_temp" not in ledger.tags(pid, 0), "freed at the KV wake"
        assert ledger.held(pid)[0] <= memory.claims[inst.id].footprint_mb == 20_000
        ledger.free(os.getpid(), 0, "outsider")
    assert proxy.engine_starts("a") == 1


# -- an awake engine takes its transient peak back -------------------------------------------


async def test_a_neighbour_is_never_admitted_into_the_peak_an_engine_takes_back(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """Regression: a running engine was planned at what NVML showed. vLLM reserves its transient
    peak inside the budget but frees it after profiling (and at every sleep and wake), and
    takes it back on its first full batch (vLLM 0.33 utils/mem_utils.py:298-321,
    device_allocator/cumem.py:297-298,342-343). a (13500 MiB, 3000 of them its peak) read
    3000 below its claim after a small request; b (11500) was started beside it, and a's
    next large batch died of CUDA OOM (the client got an error). Now b evicts the idle a, and
    every request is answered with no engine out of memory."""
    peak = FakeEngine(sim_peak_mb=3_000, sim_peak_tokens=500).env()
    models = {"a": {"model": "x", "memory_mb": 13_500, "env": peak},
              "b": {"model": "x", "memory_mb": 11_500}}  # fmt: skip
    proxy = await start_proxy(sim_config(tmp_path, ledger, models, None))
    assert (await chat(proxy, "a"))[0] == 200  # a small batch: the peak stays released
    (a_pid,) = simgpu.engine_pids(ledger)
    full = math.ceil(utils_started(proxy, "a")[0] * 24_000) + simgpu.CONTEXT_MB
    assert ledger.held(a_pid)[0] == full - 3_000
    memory = proxy.manager.memory
    assert memory is not None
    await wait_for(lambda: memory.measured.get("a#1") == full - 3_000, what="a measured")
    assert memory.held_mb("a#1") == 13_500, "planned at what it may take back"
    assert (await chat(proxy, "b"))[0] == 200
    assert proxy.instance("a") is None or proxy.instance("a").state is State.STOPPED
    big = "word " * 600  # a full batch: a regrows its peak
    resp = await proxy.chat("a", content=big, max_tokens=2)
    assert resp.status == 200, await resp.text()
    for name in ("a", "b"):
        for log in instance_logs(proxy.model(name).spec).values():
            text = log.read_text()
            assert "out of memory" not in text and "EngineCore" not in text, text[-2000:]
    assert proxy.engine_starts("a") == 2 and proxy.engine_starts("b") == 1


# -- pinned host memory ------------------------------------------------------------------------


async def test_what_a_sleep_pins_in_host_ram_is_measured_kept_and_planned_with(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """Regression: level 1 was planned to pin the weights + 512 MiB, released at the wake.
    vLLM pins one backup per allocation from PyTorch's host allocator, which rounds each up to
    a power of two and keeps the blocks cached after the wake (vLLM 0.33 device_allocator/
    cumem.py:256-276,360): 300 + 300 + 150 MiB of weights and a 64 MiB runtime pool pin 1344
    MiB, and keep pinning them while awake. The proxy measures the engine's host memory across
    its sleep, counts it against that engine while it lives, and a second sleep needs nothing
    more."""
    env = FakeEngine(sim_weights_mb=750, sim_weight_segments_mb="300,300,150").env()
    models = {"a": {"model": "x", "memory_mb": 8_000, "sleep": {"level": 1, "after_idle_s": 3600},
                    "env": env}}  # fmt: skip
    cfg = sim_config(tmp_path, ledger, models, None)
    proxy, inst, _memory = await asleep_after_one_request(start_proxy, cfg, "a")
    host = proxy.manager.ctx.host
    assert inst.engine is not None
    pinned = simgpu.pinned_rss(ledger, inst.engine.pid)
    assert pinned == 512 + 512 + 256 + 64
    assert host.retained == {inst.id: pinned}
    key = inst.host_key
    assert host.learned[(key, 1)] == pinned
    samples = await proxy_samples(proxy)
    assert (
        samples.get("vllm_proxy_instance_host_pinned_mb", model_id="a", instance=inst.id) == pinned
    )
    assert (await chat(proxy, "a"))[0] == 200  # woken: the blocks stay pinned
    assert simgpu.pinned_rss(ledger, inst.engine.pid) == pinned
    assert host.need_mb(inst.id, key, 1, 10**6) == 0, "the next sleep reuses what it keeps"
    task = inst.sleep("test")
    assert task is not None and host.promised == {}
    await task
    assert (
        host.retained == {inst.id: pinned} and simgpu.pinned_rss(ledger, inst.engine.pid) == pinned
    )
    await proxy.http.post(proxy.url + "/admin/models/a/unload")
    await wait_for(lambda: inst.state is State.STOPPED, what="a stopped")
    assert host.retained == {}


# -- no room for the KV cache ------------------------------------------------------------------


async def test_an_estimate_without_room_for_the_kv_cache_is_grown_and_retried(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """Regression: "No available memory for the cache blocks" was no out-of-memory marker, and
    the same too-small budget was tried again at every request."""
    env = FakeEngine(sim_weights_mb=900, sim_peak_mb=300).env()
    models = {"a": {"model": tiny_checkpoint(tmp_path), "params_b": 0.05, "env": env}}
    proxy = await start_proxy(sim_config(tmp_path, ledger, models, None))
    memory = proxy.manager.memory
    assert memory is not None
    first = memory.budget("a")
    assert first < 900 + 300 + 256  # the estimate leaves vLLM no room for the KV cache
    status, text = await chat(proxy, "a")
    assert status == 200, text
    utils = utils_started(proxy, "a")
    assert len(utils) >= 2 and utils == sorted(utils) and utils[-1] > utils[0]
    assert "No available memory for the cache blocks" in proxy.engine_log("a")


async def test_no_budget_boost_is_learned_beside_a_neighbour_below_its_claim(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (F7): vLLM's profiling measures the whole device, so a neighbour that takes
    its transient peak back inside a start's profiling window leaves that start no room for
    the KV cache; the proxy then learned a +25 % budget for the life of the proxy. Where an
    awake neighbour was below its claim when the start began, the same budget is tried once
    more before any boost."""
    env = FakeEngine(sim_weights_mb=900, sim_peak_mb=300).env()
    models = {
        "a": {"model": tiny_checkpoint(tmp_path), "params_b": 0.05, "env": env},
        "n": {"model": "x", "memory_mb": 4_000, "env": FakeEngine(sim_peak_mb=800).env()},
    }
    proxy = await start_proxy(sim_config(tmp_path, ledger, models, [0]))
    neighbour, _ = await proxy.model("n").acquire()  # started, its peak freed: below its claim
    neighbour.release()
    with caplog.at_level(logging.WARNING, logger="vllm_proxy.engines.model"):
        status, text = await chat(proxy, "a")
    assert status == 200, text
    utils = utils_started(proxy, "a")
    assert len(utils) >= 3 and utils[1] == utils[0], utils
    assert utils[-1] > utils[0], "then grown, as before"
    assert any("retrying with the same budget" in r.getMessage() for r in caplog.records)


async def test_model_runner_v2_sampler_state_is_planned_and_the_first_start_has_its_kv_cache(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """Regression: the estimate modelled vLLM's deprecated V1 runner. Under Model Runner V2 a
    152k vocabulary at 256 sequences puts 154 MiB of sampler state into the weights pool (170
    MiB as torch's segments: ``v1/worker/gpu/sample/penalties.py:43-50``), which the plan
    left out: the engine found no room for its KV cache and was started again with a larger
    budget. Planned, the first start has its KV cache."""
    path = tmp_path / "qwen"
    path.mkdir()
    config = {"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2}
    config |= {"hidden_size": 896, "max_position_embeddings": 1024, "vocab_size": 151_936}
    (path / "config.json").write_text(json.dumps(config))
    # weights 96 + state 170 + runtime 64 + graphs 256 + a peak of 600 MiB, at least 48 MiB of
    # KV cache (4 sequences of 1024 tokens)
    env = FakeEngine(sim_weights_mb=96, sim_vocab=151_936, sim_peak_mb=600, sim_min_kv_mb=48)
    models = {"a": {"model": str(path), "params_b": 0.05, "env": env.env()}}
    proxy = await start_proxy(sim_config(tmp_path, ledger, models, None))
    status, text = await chat(proxy, "a")
    assert status == 200, text
    assert proxy.engine_starts("a") == 1
    assert "No available memory for the cache blocks" not in proxy.engine_log("a")
    memory = proxy.manager.memory
    assert memory is not None
    detail = memory.estimates["a"].detail
    assert (detail["max_num_seqs"], detail["kv_cache_mb"]) == (256, 48)
    assert detail["sampler_state_mb"] == 154  # 256 x (151936 + 4748) x 4 bytes
    (pid,) = simgpu.engine_pids(ledger)
    assert ledger.tags(pid, 0)["weights"] == 96 + 20 + 150
    assert ledger.tags(pid, 0)["kv_cache"] >= 48


async def test_a_start_needs_host_ram_for_v2s_pinned_token_buffer(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """Model Runner V2 pins ``max_num_seqs x max_model_len`` int32 of token ids per rank as it
    starts (``v1/worker/gpu/states.py:32-42``, ``v1/worker/gpu/buffer_utils.py:32-38``): 4 GiB
    per rank at 1024 sequences and a 1M context. A start without that much host RAM is refused
    with a message that says so, before any engine is spawned."""
    path = tmp_path / "long"
    path.mkdir()
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}
    config |= {"max_position_embeddings": 65_536, "vocab_size": 32_000}
    (path / "config.json").write_text(json.dumps(config))
    models = {
        "a": {"model": str(path), "params_b": 0.05, "env": FakeEngine(sim_weights_mb=96).env()}
    }
    proxy = await start_proxy(sim_config(tmp_path, ledger, models, None))
    memory = proxy.manager.memory
    assert memory is not None
    assert memory.estimates["a"].detail["token_buffer_mb"] == 64  # 256 x 65536 x 4 bytes
    proxy.manager.ctx.host._read = lambda: 60
    resp = await proxy.chat("a", max_tokens=2)
    assert resp.status == 503
    body = await resp.json()
    assert body["error"]["code"] == "insufficient_host_memory"
    assert "pins 64 MiB for its token buffer" in body["error"]["message"]
    assert proxy.engine_starts("a") == 0
    proxy.manager.ctx.host._read = lambda: 1_000_000

    async def served() -> bool:  # once the failed start's back-off is over
        return (await chat(proxy, "a"))[0] == 200

    await wait_for(served, what="a served")
    assert proxy.engine_starts("a") == 1
    assert proxy.manager.ctx.host.promised == {}


async def test_a_fixed_budget_without_room_for_the_kv_cache_names_the_key(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    env = FakeEngine(sim_weights_mb=2000).env()
    models = {"a": {"model": "x", "memory_mb": 2_500, "env": env}}
    proxy = await start_proxy(sim_config(tmp_path, ledger, models, None))
    status, text = await chat(proxy, "a")
    assert status == 503 and "memory_mb" in text and "KV cache" in text, text
    assert "No available memory" not in text  # the engine's log stays in the proxy's log
    assert proxy.engine_starts("a") == 1, "a budget the operator fixed is not grown"


# -- devices: world size and a model's own CUDA_VISIBLE_DEVICES --------------------------------


async def test_pipeline_parallel_engines_get_every_gpu_of_their_world(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """Regression: only tensor_parallel_size counted; a pipeline-parallel engine got one GPU and
    vLLM refused its world size."""
    models = {"pp": {"model": "x", "memory_mb": 6_000, "args": {"pipeline_parallel_size": 2}}}
    proxy = await start_proxy(sim_config(tmp_path, ledger, models, [0, 1]))
    status, text = await chat(proxy, "pp")
    assert status == 200, text
    inst = proxy.instance("pp")
    assert sorted(inst.devices) == [0, 1]
    assert all(r.used_mb > 0 for r in ledger.read())


async def test_a_model_pinned_by_its_env_is_planned_and_charged_on_that_gpu(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """Regression: the planner charged a GPU of its own choosing while the engine obeyed the
    model's CUDA_VISIBLE_DEVICES."""
    models = {"a": {"model": "x", "memory_mb": 6_000, "env": {"CUDA_VISIBLE_DEVICES": "1"}}}
    proxy = await start_proxy(sim_config(tmp_path, ledger, models, [0, 1]))
    assert (await chat(proxy, "a"))[0] == 200
    inst = proxy.instance("a")
    assert inst.devices == (1,)
    used = {r.id: r.used_mb for r in ledger.read()}
    assert used[0] == 0 and used[1] > 0
