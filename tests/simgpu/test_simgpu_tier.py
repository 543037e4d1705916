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

The last section: hostile interleavings of starts, sleeps, wakes, stops, crashes, reloads and
shutdown around the device locks.

Each test pins an invariant of docs/design.md ("GPU memory", "Sleep tiers") with the proxy's real
NVML path over the simulated-GPU ledger (``fake_vllm/simgpu.py``):

* no memory is freed on a device while another engine profiles its start there, and nothing is
  allocated there while an engine sleeps (vLLM's "Error in memory profiling" and "Memory usage
  increased after sleeping"), checked on the ledger's event history, not only in the logs;
* a stop never waits for the lock its own instance holds (start, sleep, wake): no deadlock;
* no engine ever holds more than its claim (asleep: its measured residue), and vLLM's startup
  check never refuses a start the planner admitted;
* budgets (``--gpu-memory-utilization``) are the same at every start, retry and reload;
* claims and host-RAM promises come back on every path: a refused wake, a failed or stopped
  sleep, a wait for memory that did not come back.

Tests wait on states and on the ledger with deadlines, never on time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from kit import FakeEngine, RunningProxy, StartProxy, simgpu, wait_for
from kit.metrics import proxy_samples
from kit.simgpu import (
    CONTEXT_MB,
    STARTUP_REFUSAL,
    chat,
    engine_pids,
    outsider,
    profiling,
    sim_ledger,
    tiny_checkpoint,
    utils_started,
)
from kit.watch import watching

from fake_vllm.simgpu import Event, Ledger
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
        "a": {
            "model": "x",
            "memory_mb": 8_000,
            "sleep": {"level": 1, "after_idle_s": 3600, "on_idle": "always"},
        },
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


async def test_an_idle_engine_sleeps_once_another_program_takes_the_room_every_model_had(
    tmp_path: Path, start_proxy: StartProxy, ledger: Ledger
) -> None:
    """``sleep.on_idle: needed`` on the NVML path: two models that fit awake together on the
    simulated 24000 MiB GPU keep an idle engine awake past `after_idle_s`; once another program
    holds enough of the GPU that they no longer do, its next period puts it to sleep."""
    policy = {"level": 1, "after_idle_s": 0.3}
    models = {
        "a": {"model": "x", "memory_mb": 8_000, "sleep": policy},
        "b": {"model": "x", "memory_mb": 8_000, "sleep": policy},
    }
    proxy = await start_proxy(sim_config(tmp_path, ledger, models, None))
    assert (await chat(proxy, "a"))[0] == 200
    a = proxy.instance("a")
    memory = proxy.manager.memory
    assert memory is not None and memory.room_for_all()
    periods = [0]
    sleep_due = a.timers.sleep_due

    def counted() -> None:
        periods[0] += 1
        sleep_due()

    a.timers.sleep_due = counted  # type: ignore[method-assign]
    a.timers.arm()
    await wait_for(lambda: periods[0] >= 3, what="three idle periods")
    assert a.state is State.RUNNING, "kept awake: both models fit"
    outsider(ledger, 0, 12_000)  # b no longer fits beside a
    await wait_for(lambda: a.asleep, what="a asleep once the room is gone")
    assert not memory.room_for_all()


# -- hostile interleavings around the device locks ---------------------------------------------


#: vLLM's messages that must never appear in an engine's log during proxy-ordered changes.
PROFILING_ERROR = "Error in memory profiling"


SLEEP_ASSERT = "Memory usage increased after sleeping"


WAKE_OOM = "Failed to wake up allocator"


FORBIDDEN = (STARTUP_REFUSAL, PROFILING_ERROR, SLEEP_ASSERT, WAKE_OOM)


#: A sleep policy that never fires by itself.
L1 = {"level": 1, "after_idle_s": 3600}


L2 = {"level": 2, "after_idle_s": 3600}


def assert_clean_logs(proxy: RunningProxy, *names: str) -> None:
    for name in names:
        text = proxy.engine_log(name)
        for marker in FORBIDDEN:
            assert marker not in text, f"{name}: {marker!r} in its engine log"


async def sleep_now(inst: Instance) -> None:
    task = inst.sleep("test")
    assert task is not None
    await task


def windows(history: list[Event]) -> list[tuple[int, float, float]]:
    """(pid, start, end) of every engine start's measured window on a device: from its context
    (created before vLLM's free-memory snapshot) to the end of its profiling (its "profiled"
    mark). A start told its KV cache size ("kv_given") measures nothing: no window."""
    began: dict[int, float] = {}
    out = []
    for e in history:
        if e.tag == "context" and e.delta_mb > 0:
            began[e.pid] = e.time
        elif e.tag == "profiled" and e.pid in began:
            out.append((e.pid, began.pop(e.pid), e.time))
        elif e.tag == "kv_given":
            began.pop(e.pid, None)
    return out


def assert_no_free_while_profiling(ledger: Ledger, device: int = 0) -> None:
    """No other process freed memory on the device while an engine that started there was
    between its context and its KV cache (vLLM's measured window)."""
    history = ledger.history(device)
    bad = []
    for pid, start, end in windows(history):
        for e in history:
            if start < e.time < end and e.pid != pid and e.delta_mb < 0:
                bad.append((pid, e))
    assert not bad, f"memory freed while an engine profiled: {bad}"


def assert_no_alloc_while_sleeping(ledger: Ledger, device: int = 0) -> None:
    """No other process allocated on the device between an engine's sleep_begin marker and the
    end of that sleep's frees."""
    history = ledger.history(device)
    for i, mark in enumerate(history):
        if mark.tag != "sleep_begin":
            continue
        end = mark.time
        for e in history[i + 1 :]:
            if e.pid == mark.pid and e.delta_mb < 0:
                end = e.time
            elif e.pid == mark.pid:
                break
        intruders = [e for e in history if mark.time < e.time < end and e.pid != mark.pid
                     and e.delta_mb > 0]  # fmt: skip
        assert not intruders, f"allocated while {mark.pid} slept: {intruders}"


def held_by_instance(ledger: Ledger, inst: Instance) -> dict[int, int]:
    """MiB per device the instance's process group holds on the ledger."""
    assert inst.engine is not None and inst.engine.pid is not None
    out: dict[int, int] = {}
    for reading in ledger.read():
        for pid, mb in reading.processes.items():
            try:
                if os.getpgid(pid) == inst.engine.pid:
                    out[reading.id] = out.get(reading.id, 0) + mb
            except ProcessLookupError:
                continue
    return out


async def measured_settled(proxy: RunningProxy, ledger: Ledger) -> None:
    """Wait until NVML's per-process measurement of every running engine is what the ledger
    shows (the refresher's reading post-dates the engine's last change), so that the next plan
    is made on settled figures rather than on a reading taken while the engine still grew."""
    memory = proxy.manager.memory
    assert memory is not None

    def settled() -> bool:
        for inst in proxy.manager.all_instances():
            if inst.state.public is State.RUNNING and inst.engine is not None:
                held = held_by_instance(ledger, inst)
                assert held, f"{inst.id} runs and holds nothing on the ledger"
                if inst.id not in memory.by_process:
                    return False
                if memory.measured.get(inst.id) != max(held.values()):
                    return False
        return True

    await wait_for(settled, what="measurements settled")


def check_claims(proxy: RunningProxy, ledger: Ledger) -> None:
    """Every engine holds at most its claim (asleep: its residue) on each of its devices, and
    only on its devices. The proxy's view is read first: an engine only allocates after its
    claim went up, and the claim only goes down after the engine freed the memory."""
    memory = proxy.manager.memory
    assert memory is not None
    limits = {}
    for inst in proxy.manager.all_instances():
        claim = memory.claims.get(inst.id)
        if claim is None or inst.engine is None or inst.state is State.STOPPED:
            continue
        limit = memory.asleep.get(inst.id, claim.footprint_mb)
        limits[inst.id] = (inst, claim.devices, limit)
    for iid, (inst, devices, limit) in limits.items():
        for device, mb in held_by_instance(ledger, inst).items():
            assert device in devices, f"{iid} holds {mb} MiB on GPU {device}, placed on {devices}"
            assert mb <= limit, f"{iid} holds {mb} MiB on GPU {device}, more than its {limit}"


async def test_an_unload_during_its_own_start_does_not_wait_for_its_own_lock(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """The start holds the device lock for its whole profiling (10 s here); an unload then must
    stop the engine at once, leave nothing on the GPU and free the lock for the next start."""
    models = {
        "a": {"model": "x", "memory_mb": 8_000, "env": FakeEngine(sim_profile_s=10).env()},
        "b": {"model": "x", "memory_mb": 8_000},
    }
    proxy = await start_proxy(simgpu.sim_config(tmp_path, ledger, models))
    started = proxy.model("a").ensure_started()
    assert started is not None
    await wait_for(lambda: profiling(ledger, set()), what="a profiling")
    t0 = time.monotonic()
    await proxy.model("a").unload(5)
    assert time.monotonic() - t0 < 4, "the unload waited for the start's own lock"
    assert not proxy.model("a").instances
    await wait_for(lambda: not engine_pids(ledger), what="a's memory given back")
    assert proxy.manager.memory is not None and not proxy.manager.memory.claims
    t0 = time.monotonic()
    assert (await chat(proxy, "b"))[0] == 200  # the lock is free: b starts at once
    assert time.monotonic() - t0 < 4
    assert_no_free_while_profiling(ledger)


@pytest.mark.parametrize("change", ["sleep", "wake"])
async def test_an_unload_during_its_own_sleep_or_wake_call_is_not_deadlocked(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy, change: str
) -> None:
    """The instance's own /sleep or /wake_up holds its device lock (slow here); an unload then
    stops the engine without queueing behind that lock, and nothing is left half-way."""
    env = FakeEngine(sim_sleep_s=2).env() if change == "sleep" else FakeEngine(wake_delay=3).env()
    models = {"a": {"model": "x", "memory_mb": 8_000, "sleep": L1, "env": env}}
    proxy, a = await start_proxy.serving(
        simgpu.sim_config(tmp_path, ledger, models), "a", max_tokens=2
    )
    request = None
    if change == "sleep":
        nap = a.sleep("test")
        assert nap is not None
        await wait_for(lambda: a._owns_devices, what="the sleep holding the lock")
    else:
        await sleep_now(a)
        request = asyncio.ensure_future(chat(proxy, "a"))
        await wait_for(lambda: a.state is State.WAKING and a._owns_devices, what="a waking")
    t0 = time.monotonic()
    await proxy.model("a").unload(5)
    assert time.monotonic() - t0 < 4.5
    assert a.state is State.STOPPED
    assert proxy.manager.ctx.host.promised == {}
    assert proxy.manager.memory is not None and a.id not in proxy.manager.memory.claims
    await wait_for(lambda: not engine_pids(ledger), what="a's memory given back")
    if request is not None:  # the waiting request is served by a new engine after the unload
        status, text = await request
        assert status == 200, text
    assert_clean_logs(proxy, "a")


async def test_a_neighbours_unload_waits_until_the_start_has_profiled(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """An admin unload of `a` while `b` profiles on the same GPU: the unload returns only after
    b's start, and the ledger shows no free in b's measured window."""
    models = {
        "a": {"model": "x", "memory_mb": 8_000},
        "b": {"model": "x", "memory_mb": 8_000, "env": FakeEngine(sim_profile_s=1.5).env()},
    }
    proxy = await start_proxy(simgpu.sim_config(tmp_path, ledger, models))
    assert (await chat(proxy, "a"))[0] == 200
    a_pids = engine_pids(ledger)
    b_request = asyncio.ensure_future(chat(proxy, "b"))
    await wait_for(lambda: profiling(ledger, a_pids), what="b profiling")
    unload = asyncio.ensure_future(proxy.model("a").unload(5))
    await wait_for(lambda: proxy.instance("a").state is State.STOPPING, what="a stopping")
    assert proxy.instance("b").state is State.STARTING
    status, text = await b_request
    assert status == 200, text
    await unload
    assert proxy.engine_starts("b") == 1
    assert_no_free_while_profiling(ledger)
    assert_clean_logs(proxy, "a", "b")


async def test_a_reload_that_replaces_a_starting_engine_keeps_its_budget(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """A reload that changes a's engine while it profiles: the old start is stopped at once (its
    own lock), the new engine starts with the same budget, and the waiting request is served."""
    models = {"a": {"model": "x", "memory_mb": 8_000, "env": FakeEngine(sim_profile_s=2).env()}}
    cfg = simgpu.sim_config(tmp_path, ledger, models)
    proxy = await start_proxy(cfg)
    request = asyncio.ensure_future(chat(proxy, "a"))
    await wait_for(lambda: profiling(ledger, set()), what="a profiling")
    models["a"]["args"] = {"max_num_seqs": 8}  # a new engine, the same memory
    new = simgpu.sim_config(tmp_path, ledger, models)
    assert proxy.manager.memory is not None
    proxy.manager.memory.set_specs(new.specs())
    report = proxy.manager.reload(new.specs(), 5)
    assert report["restarted"] == ["a"]
    status, text = await request
    assert status == 200, text
    utils = utils_started(proxy, "a")
    assert len(utils) == 2 and utils[0] == utils[1], utils
    starts = [line for line in proxy.engine_log("a").splitlines() if "starting engine" in line]
    assert ["--max-num-seqs 8" in line for line in starts] == [False, True]
    await wait_for(lambda: len(engine_pids(ledger)) == 1, what="the old engine gone")
    assert_no_free_while_profiling(ledger)
    check_claims(proxy, ledger)


async def test_a_neighbour_killed_during_profiling_is_retried_with_the_same_budget(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """SIGKILL of `a` while `b` profiles: vLLM fails b's start ("Error in memory profiling"),
    the proxy retries it (not an out-of-memory eviction, not a client error) with the same
    --gpu-memory-utilization, and a's claim is gone."""
    models = {
        "a": {"model": "x", "memory_mb": 8_000},
        "b": {"model": "x", "memory_mb": 8_000, "env": FakeEngine(sim_profile_s=1).env()},
    }
    proxy, a = await start_proxy.serving(
        simgpu.sim_config(tmp_path, ledger, models), "a", max_tokens=2
    )
    a_pids = engine_pids(ledger)
    b_request = asyncio.ensure_future(chat(proxy, "b"))
    await wait_for(lambda: profiling(ledger, a_pids), what="b profiling")
    assert a.engine is not None and a.engine.pid is not None
    os.killpg(a.engine.pid, signal.SIGKILL)
    status, text = await b_request
    assert status == 200, text
    assert PROFILING_ERROR in proxy.engine_log("b")
    assert proxy.engine_starts("b") == 2
    utils = utils_started(proxy, "b")
    assert utils[0] == utils[1], utils
    assert a.state is State.ERROR
    memory = proxy.manager.memory
    assert memory is not None and set(memory.claims) == {proxy.instance("b").id}
    check_claims(proxy, ledger)


def residue_models(b_mb: int = 21_000) -> dict[str, dict[str, Any]]:
    """`a` sleeps leaving far more than the planner's first guess (3000 MiB of CUDA graphs stay
    on the GPU); `b` fits next to it only if that guess were right."""
    return {
        "a": {"model": "x", "memory_mb": 8_000, "sleep": L1,
              "env": FakeEngine(sim_graphs_mb=3000).env()},
        "b": {"model": "x", "memory_mb": b_mb},
    }  # fmt: skip


async def test_a_sleep_that_frees_less_than_planned_is_replanned_into_a_stop(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """wait_free comes back False (the residue was larger than guessed): the claim is dropped,
    the plan is made again on the measured residue, `a` is stopped and `b` starts once, never
    into vLLM's startup check."""
    cfg = simgpu.sim_config(tmp_path, ledger, residue_models(), free_timeout_s=1)
    proxy = await start_proxy(cfg)
    assert (await chat(proxy, "a"))[0] == 200
    a = proxy.instance("a")
    await measured_settled(proxy, ledger)
    status, text = await chat(proxy, "b")
    assert status == 200, text
    assert proxy.engine_starts("b") == 1
    assert a.state is State.STOPPED
    memory = proxy.manager.memory
    assert memory is not None
    assert memory.sleep_mb(a.spec) == CONTEXT_MB + 3000  # the residue measured, for next time
    assert set(memory.claims) == {proxy.instance("b").id}
    assert proxy.manager.ctx.host.promised == {}
    assert_clean_logs(proxy, "a", "b")
    check_claims(proxy, ledger)


async def test_a_wake_whose_freed_memory_is_taken_stays_asleep_with_its_residue(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`c` is asleep; its wake puts `a` to sleep, but another program takes the memory `a` gave
    back before the proxy sees it: the wake's claim is undone (the residue again), it is
    answered 503 and stays asleep, and wakes normally once the memory is back."""
    models = {
        "a": {"model": "x", "memory_mb": 12_500, "sleep": L1},
        "c": {"model": "x", "memory_mb": 12_500, "sleep": L1},
    }
    cfg = simgpu.sim_config(tmp_path, ledger, models, queue_timeout_s=2, free_timeout_s=0.5)
    proxy = await start_proxy(cfg)
    assert (await chat(proxy, "c"))[0] == 200
    c = proxy.instance("c")
    await sleep_now(c)
    assert (await chat(proxy, "a"))[0] == 200
    a = proxy.instance("a")
    await measured_settled(proxy, ledger)
    memory = proxy.manager.memory
    assert memory is not None
    residue = memory.held_mb(c.id)
    wait_free = memory.wait_free

    async def taken(devices: tuple[int, ...], need_mb: int) -> bool:
        if not ledger.held(os.getpid()):  # the moment a's memory came back, someone took it
            outsider(ledger, 0, ledger.read()[0].free_mb - 1_000)
        return await wait_free(devices, need_mb)

    monkeypatch.setattr(memory, "wait_free", taken)
    status, text = await chat(proxy, "c")
    assert status == 503, text
    assert a.asleep, "a was put to sleep for c's wake"
    assert c.asleep and c.state is State.SLEEPING
    assert memory.held_mb(c.id) == residue
    assert memory.claims[c.id].devices == (0,)
    assert proxy.manager.ctx.host.promised == {}
    check_claims(proxy, ledger)
    ledger.free(os.getpid(), 0, "outsider")
    status, text = await chat(proxy, "c")
    assert status == 200, text
    assert proxy.engine_starts("c") == 1, "the same engine woke"
    assert_clean_logs(proxy, "a", "c")
    assert_no_alloc_while_sleeping(ledger)
    check_claims(proxy, ledger)


async def test_a_start_refused_by_another_programs_memory_evicts_one_more_and_retries(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """Another program takes memory between b's admission and its spawn: vLLM refuses b's start
    ("less than desired GPU memory utilization"), the proxy evicts the idle `a` under the
    device lock and retries b once with the same budget; a's memory is never freed while b
    profiles."""
    models = {"a": {"model": "x", "memory_mb": 8_000}, "b": {"model": "x", "memory_mb": 8_000}}
    proxy, a = await start_proxy.serving(
        simgpu.sim_config(tmp_path, ledger, models), "a", max_tokens=2
    )
    memory = proxy.manager.memory
    assert memory is not None and proxy.manager.ctx.memory is memory
    starting_on = memory.starting_on

    def hostile(devices: tuple[int, ...], owner: str, sized: bool) -> Any:
        if not ledger.held(os.getpid()):  # once: right before b's first spawn
            outsider(ledger, 0, ledger.read()[0].free_mb - 4_000)
        return starting_on(devices, owner, sized)

    memory.starting_on = hostile  # type: ignore[method-assign]
    status, text = await chat(proxy, "b")
    assert status == 200, text
    assert STARTUP_REFUSAL in proxy.engine_log("b")
    assert proxy.engine_starts("b") == 2
    assert len(set(utils_started(proxy, "b"))) == 1
    assert a.state is State.STOPPED
    assert_no_free_while_profiling(ledger)
    check_claims(proxy, ledger)


@pytest.mark.parametrize("how", ["fails", "times_out", "stopped"])
async def test_host_ram_promised_to_a_sleep_is_released_on_every_path(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy, how: str
) -> None:
    """A level-1 sleep promises host RAM until its /sleep call returns; a failed, timed-out or
    stopped sleep releases it too (else the next victims would go to level 2 for nothing)."""
    env = {
        "fails": FakeEngine(sleep_fail=True).env(),
        "times_out": FakeEngine(sim_sleep_s=3).env(),
        "stopped": FakeEngine(sim_sleep_s=1).env(),
    }[how]
    models = {"a": {"model": "x", "memory_mb": 8_000, "sleep": {**L1, "timeout_s": 1.5},
                    "env": env}}  # fmt: skip
    proxy = await start_proxy(simgpu.sim_config(tmp_path, ledger, models))
    host = proxy.manager.ctx.host
    host._read = lambda: 1_000_000  # plenty: level 1 is chosen and promised
    assert (await chat(proxy, "a"))[0] == 200
    a = proxy.instance("a")
    nap = a.sleep("test")
    assert nap is not None
    assert set(host.promised) == {a.id}
    if how == "stopped":
        await wait_for(lambda: a._owns_devices, what="the /sleep call under way")
        await a.stop()
    await nap
    assert host.promised == {}
    await wait_for(lambda: a.state is State.STOPPED, what="a stopped")
    memory = proxy.manager.memory
    assert memory is not None and not memory.claims
    await wait_for(lambda: not engine_pids(ledger), what="a's memory given back")
    assert ledger.pinned_mb() == 0


async def test_victims_put_to_sleep_together_do_not_count_the_same_host_ram(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """Room in host RAM for one level-1 sleep: of two victims of one admission, one sleeps at
    level 1 and the other at level 2; both wake correctly later (the level-2 one reloads)."""
    models = {
        "a": {"model": "x", "memory_mb": 8_000, "sleep": L1},
        "b": {"model": "x", "memory_mb": 8_000, "sleep": L1},
        "c": {"model": "x", "memory_mb": 16_000},
    }
    proxy = await start_proxy(simgpu.sim_config(tmp_path, ledger, models))
    proxy.manager.ctx.host._read = lambda: 12_000  # one budget plus margin, not two
    assert (await chat(proxy, "a"))[0] == 200
    assert (await chat(proxy, "b"))[0] == 200
    a, b = proxy.instance("a"), proxy.instance("b")
    await measured_settled(proxy, ledger)
    status, text = await chat(proxy, "c")
    assert status == 200, text
    assert a.asleep and b.asleep
    assert sorted([a.sleep_level, b.sleep_level]) == [1, 2]
    assert proxy.manager.ctx.host.promised == {}
    await proxy.model("c").unload(5)
    for name in ("a", "b"):
        status, text = await chat(proxy, name)
        assert status == 200 and "<garbage>" not in text, text
    assert proxy.engine_starts("a") == proxy.engine_starts("b") == 1
    assert_clean_logs(proxy, "a", "b", "c")
    assert_no_free_while_profiling(ledger)
    assert_no_alloc_while_sleeping(ledger)


async def test_two_level_2_sleepers_swap_many_times_within_their_claims(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """Two level-2 models that do not fit awake together swap by sleep and wake 6 times: one
    engine each, every wake in vLLM's order and within its claim (reload buffer included), the
    budget never changes, and no sleep or wake sees a neighbour's allocation."""
    env = FakeEngine(sim_reload_temp_mb=300).env()
    models = {
        "a": {"model": "x", "memory_mb": 13_000, "sleep": L2, "env": dict(env)},
        "b": {"model": "x", "memory_mb": 13_000, "sleep": L2, "env": dict(env)},
    }
    proxy = await start_proxy(simgpu.sim_config(tmp_path, ledger, models))
    memory = proxy.manager.memory
    assert memory is not None
    budgets = {n: memory.budget(n) for n in models}
    for _ in range(6):
        for name in ("a", "b"):
            status, text = await chat(proxy, name)
            assert status == 200 and "<garbage>" not in text, text
            check_claims(proxy, ledger)
            assert {n: memory.budget(n) for n in models} == budgets
            await measured_settled(proxy, ledger)
    assert proxy.engine_starts("a") == proxy.engine_starts("b") == 1
    assert len(set(utils_started(proxy, "a") + utils_started(proxy, "b"))) == 1
    assert_clean_logs(proxy, "a", "b")
    assert_no_alloc_while_sleeping(ledger)
    assert ledger.read()[0].used_mb <= 24_000 - memory.reserve_mb


async def test_a_reload_that_keeps_the_engine_keeps_its_budget_and_instance(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """A reload that changes nothing the engine is made of keeps the running engine (same pid)
    and its claim stays within the GPU; the next start after it gets the same budget."""
    models = {"a": {"model": "x", "memory_mb": 9_000}, "b": {"model": "x", "memory_mb": 16_000}}
    proxy, a = await start_proxy.serving(
        simgpu.sim_config(tmp_path, ledger, models), "a", max_tokens=2
    )
    assert a.engine is not None
    pid = a.engine.pid
    models["a"]["idle_timeout_s"] = 900
    new = simgpu.sim_config(tmp_path, ledger, models)
    memory = proxy.manager.memory
    assert memory is not None
    memory.set_specs(new.specs())
    report = proxy.manager.reload(new.specs(), 5)
    assert report["kept"] == ["a", "b"]
    assert proxy.instance("a") is a and a.engine is not None and a.engine.pid == pid
    check_claims(proxy, ledger)
    for _ in range(3):  # b evicts a, a evicts b
        for name in ("b", "a"):
            status, text = await chat(proxy, name)
            assert status == 200, text
    for name in ("a", "b"):
        assert len(set(utils_started(proxy, name))) == 1, utils_started(proxy, name)
    assert_clean_logs(proxy, "a", "b")


async def test_a_reload_that_removes_an_asleep_and_a_falling_asleep_model_gives_all_back(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """A reload removes `a` (asleep) and `b` (its /sleep call under way, holding the lock): both
    engines stop, their residues and claims go, host RAM promised to b's sleep is released and
    nothing stays pinned or on the GPU."""
    models = {
        "a": {"model": "x", "memory_mb": 8_000, "sleep": L1},
        "b": {"model": "x", "memory_mb": 8_000, "sleep": L1,
              "env": FakeEngine(sim_sleep_s=1.5).env()},
        "c": {"model": "x", "memory_mb": 4_000},
    }  # fmt: skip
    proxy = await start_proxy(simgpu.sim_config(tmp_path, ledger, models))
    proxy.manager.ctx.host._read = lambda: 1_000_000
    for name in ("a", "b"):
        assert (await chat(proxy, name))[0] == 200
    a, b = proxy.instance("a"), proxy.instance("b")
    await sleep_now(a)
    assert b.sleep("test") is not None
    await wait_for(lambda: b._owns_devices, what="b's /sleep under way")
    new = simgpu.sim_config(tmp_path, ledger, {"c": models["c"]})
    memory = proxy.manager.memory
    assert memory is not None
    memory.set_specs(new.specs())
    report = proxy.manager.reload(new.specs(), 5)
    assert sorted(report["removed"]) == ["a", "b"]
    await wait_for(lambda: not proxy.manager.removed, what="removed models gone", timeout=10)
    assert a.state is b.state is State.STOPPED
    assert not memory.claims and not memory.asleep
    assert proxy.manager.ctx.host.promised == {}
    await wait_for(lambda: not engine_pids(ledger), what="the GPU empty")
    assert ledger.pinned_mb() == 0
    assert (await chat(proxy, "c"))[0] == 200


async def test_tensor_parallel_and_single_gpu_starts_on_two_gpus_do_not_deadlock(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """A tp=2 engine takes both devices' locks while single-GPU engines start on each: every
    start completes (sorted lock order), no start profiles next to another's change, and each
    engine holds its claim only on its own devices."""
    slow = FakeEngine(sim_profile_s=0.5).env()
    models = {
        "tp": {"model": "x", "memory_mb": 6_000, "args": {"tensor_parallel_size": 2}, "env": slow},
        "x0": {"model": "x", "memory_mb": 6_000, "devices": [0], "env": dict(slow)},
        "x1": {"model": "x", "memory_mb": 6_000, "devices": [1], "env": dict(slow)},
    }
    proxy = await start_proxy(simgpu.sim_config(tmp_path, ledger, models, devices=[0, 1]))
    t0 = time.monotonic()
    results = await asyncio.gather(*(chat(proxy, n) for n in ("x1", "tp", "x0", "tp", "x1")))
    assert all(status == 200 for status, _ in results), results
    assert time.monotonic() - t0 < 15
    assert sorted(proxy.instance("tp").devices) == [0, 1]
    for name in models:
        assert proxy.engine_starts(name) == 1
    for device in (0, 1):
        assert_no_free_while_profiling(ledger, device)
        starts = windows(ledger.history(device))
        for i, (_, s1, e1) in enumerate(starts):  # starts on one device never overlap
            for _, s2, e2 in starts[i + 1 :]:
                assert e1 <= s2 or e2 <= s1, starts
    check_claims(proxy, ledger)
    assert_clean_logs(proxy, *models)


def _starts(history: list[Event]) -> dict[int, tuple[float, float, str]]:
    """pid -> (its context, its KV cache, "profiled" or "kv_given") for every start on a device."""
    began: dict[int, float] = {}
    kind: dict[int, str] = {}
    out = {}
    for e in history:
        if e.tag == "context" and e.delta_mb > 0:
            began[e.pid] = e.time
        elif e.tag in ("profiled", "kv_given"):
            kind[e.pid] = e.tag
        elif e.tag == "kv_cache" and e.delta_mb > 0 and e.pid in began:
            out[e.pid] = (began.pop(e.pid), e.time, kind.get(e.pid, "?"))
    return out


async def test_starts_told_their_kv_cache_size_overlap_and_a_measuring_start_runs_alone(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """The first start of a model measures (alone on the device) and its KV cache size is kept;
    its later starts are told that size (``--kv-cache-memory-bytes``, vLLM skips profiling) and
    run beside each other, each with the KV cache its first start found. A start that measures
    waits for them and then has the device to itself until its profiling ends."""
    slow = FakeEngine(sim_profile_s=0.8, sim_after_profile_s=0.8).env()
    models = {n: {"model": "x", "memory_mb": 6_000, "env": dict(slow)} for n in ("a", "b", "c")}
    proxy = await start_proxy(simgpu.sim_config(tmp_path, ledger, models))
    memory = proxy.manager.memory
    assert memory is not None
    for name in ("a", "b"):
        assert (await chat(proxy, name))[0] == 200
    first = _starts(ledger.history(0))
    assert sorted(kind for _, _, kind in first.values()) == ["profiled", "profiled"]
    learned = {n: memory.kv_learned[n][2] for n in ("a", "b")}
    kv_first = [e.delta_mb for e in ledger.history(0) if e.tag == "kv_cache" and e.delta_mb > 0]
    for name in ("a", "b"):
        await proxy.model(name).unload(5)
    await wait_for(lambda: not engine_pids(ledger), what="a and b gone")
    mark = len(ledger.history(0))

    sized = [asyncio.ensure_future(chat(proxy, n)) for n in ("a", "b")]
    await wait_for(lambda: len(engine_pids(ledger)) == 2, what="a and b starting together")
    measuring = asyncio.ensure_future(chat(proxy, "c"))
    results = await asyncio.gather(*sized, measuring)
    assert all(status == 200 for status, _ in results), results

    history = ledger.history(0)[mark:]
    starts = _starts(history)
    told = [(s, e) for s, e, kind in starts.values() if kind == "kv_given"]
    alone = [(pid, s) for pid, (s, _, kind) in starts.items() if kind == "profiled"]
    assert len(told) == 2 and len(alone) == 1, starts
    (s1, e1), (s2, e2) = told
    assert s1 < e2 and s2 < e1, f"the two sized starts did not overlap: {told}"
    for name in ("a", "b"):
        assert f"--kv-cache-memory-bytes {learned[name]}" in proxy.engine_log(name)
        assert "skipped memory profiling" in proxy.engine_log(name)
    given = {pid for pid, (_, _, kind) in starts.items() if kind == "kv_given"}
    kv_told = sorted(
        e.delta_mb for e in history if e.tag == "kv_cache" and e.delta_mb > 0 and e.pid in given
    )
    # The size vLLM printed (GiB, 2 decimals), rounded down: at most ~11 MiB below the measured.
    for told_mb, measured_mb in zip(kv_told, sorted(kv_first), strict=True):
        assert measured_mb - 12 <= told_mb <= measured_mb
    # c measured with the device to itself: nobody else allocated or freed in its window.
    ((pid, began),) = alone
    ended = next(e.time for e in history if e.pid == pid and e.tag == "profiled")
    intruders = [e for e in history if began < e.time < ended and e.pid != pid and e.delta_mb]
    assert not intruders, intruders
    assert memory.kv_learned["c"][2] > 0
    check_claims(proxy, ledger)
    assert_clean_logs(proxy, *models)


async def test_random_load_over_three_models_keeps_every_engine_within_its_claim(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """Three models (level 1, level 2, no sleep) of which two fit awake, two clients asking for
    them in a random order: every request is served, a sampler never sees an engine above its
    claim, and no engine log shows a start, sleep or wake disturbed by a neighbour."""
    models = {
        "a": {"model": "x", "memory_mb": 9_000, "sleep": L1},
        "b": {"model": "x", "memory_mb": 9_000, "sleep": L2},
        "c": {"model": "x", "memory_mb": 9_000},
    }
    proxy = await start_proxy(simgpu.sim_config(tmp_path, ledger, models))
    proxy.manager.ctx.host._read = lambda: 1_000_000
    rng = random.Random(7)
    order = [[rng.choice("abc") for _ in range(10)] for _ in range(2)]
    failures: list[str] = []

    async def client(names: list[str]) -> None:
        for name in names:
            status, text = await chat(proxy, name)
            if status != 200 or "<garbage>" in text:
                failures.append(f"{name}: {status} {text}")

    samples = 0

    def claims_hold() -> str | None:
        nonlocal samples
        samples += 1
        try:
            check_claims(proxy, ledger)
        except AssertionError as broken:
            return str(broken)
        return None

    async with watching(claims_hold, every_s=0.03) as problems:
        await asyncio.wait_for(asyncio.gather(*(client(o) for o in order)), 18)
    assert samples > 10 and not problems, problems
    assert not failures, failures
    assert_clean_logs(proxy, *models)
    assert_no_free_while_profiling(ledger)
    assert_no_alloc_while_sleeping(ledger)
    for name in models:
        assert len(set(utils_started(proxy, name))) == 1


async def test_a_victim_whose_stop_waits_for_a_neighbours_start_is_planned_around(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """`c` must evict `a` while `b` profiles on the same GPU: a's stop waits for b's start (the
    lock), c's admission waits for that stop, and c starts once, after b, with nothing freed in
    either start's window."""
    models = {
        "a": {"model": "x", "memory_mb": 8_200},
        "b": {"model": "x", "memory_mb": 8_200, "env": FakeEngine(sim_profile_s=3).env()},
        "c": {"model": "x", "memory_mb": 8_200},
    }
    proxy = await start_proxy(simgpu.sim_config(tmp_path, ledger, models, free_timeout_s=0.5))
    assert (await chat(proxy, "a"))[0] == 200
    a_pids = engine_pids(ledger)
    b_request = asyncio.ensure_future(chat(proxy, "b"))
    await wait_for(lambda: profiling(ledger, a_pids), what="b profiling")
    status, text = await chat(proxy, "c")
    assert status == 200, text
    assert (await b_request)[0] == 200
    assert proxy.instance("a").state is State.STOPPED
    for name in ("b", "c"):
        assert proxy.engine_starts(name) == 1
    assert_no_free_while_profiling(ledger)
    assert_clean_logs(proxy, "a", "b", "c")
    check_claims(proxy, ledger)


async def test_preloaded_sleepers_that_do_not_fit_awake_together_all_come_up_asleep(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """Two preloaded models that do not fit awake together start at boot: the second waits for
    the first to fall asleep, both end asleep at their residues, and then serve by turns with
    one engine each."""
    models = {
        "a": {"model": "x", "memory_mb": 13_000, "sleep": L1, "preload": True},
        "b": {"model": "x", "memory_mb": 13_000, "sleep": L2, "preload": True},
    }
    proxy = await start_proxy(simgpu.sim_config(tmp_path, ledger, models))
    proxy.manager.ctx.host._read = lambda: 1_000_000
    await wait_for(lambda: not proxy.manager.preloading, what="preloads done")
    a, b = proxy.instance("a"), proxy.instance("b")
    assert a.asleep and b.asleep
    memory = proxy.manager.memory
    assert memory is not None
    assert sum(ledger.held(pid).get(0, 0) for pid in engine_pids(ledger)) == (
        memory.held_mb(a.id) + memory.held_mb(b.id)
    )
    for name in ("a", "b", "a", "b"):
        status, text = await chat(proxy, name)
        assert status == 200 and "<garbage>" not in text, text
        check_claims(proxy, ledger)
        await measured_settled(proxy, ledger)
    assert proxy.engine_starts("a") == proxy.engine_starts("b") == 1
    assert_clean_logs(proxy, "a", "b")
    assert_no_free_while_profiling(ledger)
    assert_no_alloc_while_sleeping(ledger)


async def test_a_budget_grown_for_the_kv_cache_stays_grown_and_constant_across_restarts(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """After vLLM found no room for the KV cache the budget grows until the start works; every
    later start of the same engine (evicted by another model, three times) gets exactly that
    budget: it neither grows again nor falls back."""
    env = FakeEngine(sim_weights_mb=900, sim_peak_mb=300).env()
    models = {
        "a": {"model": tiny_checkpoint(tmp_path), "params_b": 0.05, "env": env},
        "b": {"model": "x", "memory_mb": 22_000},
    }
    proxy = await start_proxy(simgpu.sim_config(tmp_path, ledger, models))
    memory = proxy.manager.memory
    assert memory is not None
    first = memory.budget("a")
    assert (await chat(proxy, "a"))[0] == 200
    budget = memory.budget("a")
    assert budget > first
    grown = utils_started(proxy, "a")[-1]  # the engine that started
    ids = {proxy.instance("a").id}
    for _ in range(3):
        for name in ("b", "a"):
            status, text = await chat(proxy, name)
            assert status == 200, text
        ids.add(proxy.instance("a").id)
        assert utils_started(proxy, "a")[-1] == grown
    assert len(ids) == 4, "a was started again each time"
    assert memory.budget("a") == budget
    assert_no_free_while_profiling(ledger)
    check_claims(proxy, ledger)


async def test_without_per_process_readings_level_2_swaps_stay_within_their_claims(
    tmp_path: Path, start_proxy: StartProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a container NVML lists no per-process memory: starts are measured by the device delta
    under the lock and residues by what the device's usage dropped by. Two level-2 models swap
    four times: no wake falls back to a cold start, no engine exceeds its claim, and a
    residue is never measured below what the engine really keeps."""
    ledger = sim_ledger(tmp_path, monkeypatch, devices=1, per_process=False)
    models = {
        "a": {"model": "x", "memory_mb": 13_000, "sleep": L2},
        "b": {"model": "x", "memory_mb": 13_000, "sleep": L2},
    }
    proxy = await start_proxy(simgpu.sim_config(tmp_path, ledger, models))
    memory = proxy.manager.memory
    assert memory is not None
    for _ in range(4):
        for name in ("a", "b"):
            status, text = await chat(proxy, name)
            assert status == 200 and "<garbage>" not in text, text
            check_claims(proxy, ledger)
            other = (
                proxy.model("b" if name == "a" else "a").serving()
                or proxy.model("b" if name == "a" else "a").sleeper()
            )
            if other is not None and other.asleep:
                assert memory.held_mb(other.id) >= held_by_instance(ledger, other)[0]
    assert proxy.engine_starts("a") == proxy.engine_starts("b") == 1
    assert_clean_logs(proxy, "a", "b")
    assert_no_alloc_while_sleeping(ledger)


async def test_a_stale_measurement_after_a_wake_never_counts_less_than_the_engine_holds(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    """A reading taken right after a wake shows the engine without its transient peak, which
    its first request takes back (vLLM 0.33 device_allocator/cumem.py:342-343); the next reading
    comes up to a second later. What the planner counts for the instance never drops below what
    it holds meanwhile."""
    env = FakeEngine(sim_reload_mb_s=1024).env()  # the reload takes 1 s
    models = {
        "a": {"model": "x", "memory_mb": 13_000, "sleep": L2, "env": dict(env)},
        "b": {"model": "x", "memory_mb": 13_000, "sleep": L2, "env": dict(env)},
    }
    proxy = await start_proxy(simgpu.sim_config(tmp_path, ledger, models, poll_interval_s=1.0))
    memory = proxy.manager.memory
    assert memory is not None
    low = []
    for _ in range(4):
        for name in ("a", "b"):
            status, text = await chat(proxy, name)
            assert status == 200 and "<garbage>" not in text, text
            inst = proxy.instance(name)
            for _ in range(20):  # until the next measurement tick at most
                counted = memory.held_mb(inst.id) if inst.id in memory.claims else None
                real = held_by_instance(ledger, inst).get(0, 0)
                if counted is not None and counted < real:
                    low.append((inst.id, counted, real))
                await asyncio.sleep(0.05)
    assert not low, low
    assert proxy.engine_starts("a") == proxy.engine_starts("b") == 1


def a_then_slow_b(a_engine: FakeEngine, **sleep: Any) -> dict[str, dict[str, Any]]:
    """`a` (level-1 sleep with `sleep`'s keys, `a_engine`) and `b`, whose start profiles for 4 s."""
    return {
        "a": {"model": "x", "memory_mb": 8_000, "sleep": {**L1, **sleep}, "env": a_engine.env()},
        "b": {"model": "x", "memory_mb": 8_000, "env": FakeEngine(sim_profile_s=4).env()},
    }


async def b_waiting_for_memory(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> tuple[RunningProxy, asyncio.Future[tuple[int, str]]]:
    """`a` put to sleep for `b`, whose request then waits for memory that another program took
    (it will not come back within the 15 s `free_timeout_s`)."""
    cfg = simgpu.sim_config(tmp_path, ledger, residue_models(), free_timeout_s=15)
    proxy = await start_proxy(cfg)
    assert (await chat(proxy, "a"))[0] == 200
    a = proxy.instance("a")
    b_request = asyncio.ensure_future(chat(proxy, "b"))
    await wait_for(lambda: a.asleep, what="a put to sleep for b")
    outsider(ledger, 0, 5_000)
    return proxy, b_request


async def test_sleep_timeout_releases_the_lock_while_the_engine_still_sleeps(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    models = a_then_slow_b(FakeEngine(sim_sleep_s=2.5), timeout_s=1)
    proxy, a = await start_proxy.serving(
        simgpu.sim_config(tmp_path, ledger, models), "a", max_tokens=2
    )
    assert a.sleep("test") is not None  # its /sleep takes 2.5 s, the proxy gives up after 1 s
    await wait_for(lambda: a._owns_devices, what="a's sleep holding the lock")
    status, text = await chat(proxy, "b")  # b's start queues behind a's sleep
    assert status == 200, text
    assert PROFILING_ERROR not in proxy.engine_log("b")
    assert proxy.engine_starts("b") == 1
    assert_no_free_while_profiling(ledger)


async def test_wake_timeout_releases_the_lock_while_the_engine_still_wakes(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    models = a_then_slow_b(FakeEngine(wake_delay=2.5), wake_timeout_s=1)
    proxy, a = await start_proxy.serving(
        simgpu.sim_config(tmp_path, ledger, models), "a", max_tokens=2
    )
    await sleep_now(a)
    a_request = asyncio.ensure_future(chat(proxy, "a"))  # its /wake_up takes 2.5 s; limit 1 s
    await wait_for(lambda: a.state is State.WAKING and a._owns_devices, what="a waking")
    status, text = await chat(proxy, "b")
    assert status == 200, text
    assert proxy.engine_starts("b") == 1
    await a_request


async def test_shutdown_waits_for_free_timeout(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    proxy, b_request = await b_waiting_for_memory(tmp_path, ledger, start_proxy)
    t0 = time.monotonic()
    await proxy.server.shutdown()
    took = time.monotonic() - t0
    status, text = await b_request
    assert took < 5, (took, status, text)


async def test_unload_waits_during_wait_free(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    proxy, b_request = await b_waiting_for_memory(tmp_path, ledger, start_proxy)
    t0 = time.monotonic()
    await proxy.model("b").unload(5)
    took = time.monotonic() - t0
    await b_request
    assert took < 5, took


async def test_stop_during_own_sleep_lock_released_before_exit(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    models = a_then_slow_b(FakeEngine(sim_sleep_s=2.5))
    proxy, a = await start_proxy.serving(
        simgpu.sim_config(tmp_path, ledger, models), "a", max_tokens=2
    )
    assert a.sleep("test") is not None
    await wait_for(lambda: a._owns_devices, what="a's sleep holding the lock")
    b_request = asyncio.ensure_future(chat(proxy, "b"))  # queued behind a's sleep
    await wait_for(lambda: proxy.model("b").instances, what="b admitted")
    unload = asyncio.ensure_future(proxy.model("a").unload(5))
    status, text = await b_request
    await unload
    assert status == 200, text
    assert PROFILING_ERROR not in proxy.engine_log("b")
    assert proxy.engine_starts("b") == 1
    assert_no_free_while_profiling(ledger)
    check_claims(proxy, ledger)


async def test_unload_of_a_start_queued_behind_another_start(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    models = {
        "a": {"model": "x", "memory_mb": 8_000, "env": FakeEngine(sim_profile_s=12).env()},
        "b": {"model": "x", "memory_mb": 8_000},
    }
    proxy = await start_proxy(simgpu.sim_config(tmp_path, ledger, models))
    assert proxy.model("a").ensure_started() is not None
    await wait_for(lambda: profiling(ledger, set()), what="a profiling")
    assert proxy.model("b").ensure_started() is not None
    await wait_for(lambda: proxy.model("b").instances, what="b admitted, queued on the lock")
    t0 = time.monotonic()
    await proxy.model("b").unload(5)
    took = time.monotonic() - t0
    assert took < 3, took


async def test_level1_model_demoted_to_level2_by_host_ram_wakes_on_a_tight_gpu(
    tmp_path: Path, ledger: Ledger, start_proxy: StartProxy
) -> None:
    env = FakeEngine(sim_reload_temp_mb=600).env()
    models = {"a": {"model": "x", "memory_mb": 20_000, "sleep": L1, "env": env}}
    proxy = await start_proxy(simgpu.sim_config(tmp_path, ledger, models))
    proxy.manager.ctx.host._read = lambda: 2_000  # no room to pin the weights: level 2
    assert (await chat(proxy, "a"))[0] == 200
    a = proxy.instance("a")
    await sleep_now(a)
    assert a.sleep_level == 2
    memory = proxy.manager.memory
    assert memory is not None
    need = memory.wake_need(a.id) + memory.reserve_mb
    outsider(ledger, 0, ledger.read()[0].free_mb - need)  # exactly what the planner asks for
    status, text = await chat(proxy, "a")
    assert status == 200 and "<garbage>" not in text, text
    assert proxy.engine_starts("a") == 1, "the wake fell back to a cold start"
