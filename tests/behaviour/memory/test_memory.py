"""Component tests: admission by GPU memory with a static budget and the fake engine."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kit import FAKE_ENGINE, FakeEngine, RunningProxy, StartProxy, wait_for
from kit import budget_config as budget
from kit.metrics import proxy_samples

from vllm_proxy.app import create_app
from vllm_proxy.engines.states import State
from vllm_proxy.errors import ConfigError

SLOW = FakeEngine(tokens=30, token_delay=0.05).env()
LONG = FakeEngine(tokens=200, token_delay=0.05).env()


def m(mb: int, **extra: Any) -> dict[str, Any]:
    return {"model": "x", "memory_mb": mb, "env": dict(SLOW), **extra}


async def chat(proxy: RunningProxy, model: str, **extra: Any) -> int:
    resp = await proxy.chat(model, max_tokens=1, **extra)
    await resp.read()
    return resp.status


def states(proxy: RunningProxy) -> dict[str, str]:
    return {n: m.state().value for n, m in proxy.manager.models.items()}


async def test_lru_idle_model_is_evicted(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(budget(tmp_path, {"a": m(400), "b": m(400), "c": m(400)}))
    assert await chat(proxy, "a") == 200
    assert await chat(proxy, "b") == 200
    assert await chat(proxy, "a") == 200  # a is now the most recently used
    assert await chat(proxy, "c") == 200
    assert states(proxy) == {"a": "running", "b": "stopped", "c": "running"}
    metrics = await proxy_samples(proxy)
    assert metrics.get("vllm_proxy_evictions_total", model_id="b", reason="memory") == 1.0
    assert metrics.get("vllm_gpu_memory_total_mb", gpu_id="0") == 1000.0
    assert metrics.get("vllm_gpu_memory_used_mb", gpu_id="0") == 800.0


async def test_cumulative_eviction_frees_enough(tmp_path: Path, start_proxy: StartProxy) -> None:
    models = {"a": m(300), "b": m(300), "c": m(300), "big": m(700)}
    proxy = await start_proxy(budget(tmp_path, models))
    for name in ("a", "b", "c"):
        assert await chat(proxy, name) == 200
    assert await chat(proxy, "big") == 200
    assert states(proxy) == {"a": "stopped", "b": "stopped", "c": "running", "big": "running"}


async def test_busy_model_is_kept_while_its_stream_completes(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(budget(tmp_path, {"a": m(500), "b": m(500), "c": m(500)}))
    assert await chat(proxy, "a") == 200
    assert await chat(proxy, "b") == 200
    stream = await proxy.chat("a", stream=True)  # a is LRU... but busy for ~1.5 s
    await stream.content.readany()
    assert await chat(proxy, "c") == 200  # must evict b, the idle one
    body = await stream.read()
    assert body.endswith(b"data: [DONE]\n\n")
    assert b'"error"' not in body
    assert states(proxy) == {"a": "running", "b": "stopped", "c": "running"}


async def test_pinned_model_is_never_evicted(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(
        budget(tmp_path, {"a": m(500, pinned=True), "b": m(500), "c": m(500)})
    )
    for name in ("a", "b", "c"):
        assert await chat(proxy, name) == 200
    assert states(proxy) == {"a": "running", "b": "stopped", "c": "running"}


async def test_queued_request_is_served_when_a_lease_is_released(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(
        budget(tmp_path, {"a": m(500), "b": m(500, env=LONG), "c": m(500)}, queue_timeout_s=30)
    )
    assert await chat(proxy, "a") == 200
    assert await chat(proxy, "b") == 200
    sa = await proxy.chat("a", stream=True)
    sb = await proxy.chat("b", stream=True)
    await sa.content.readany()
    await sb.content.readany()
    waiting = asyncio.ensure_future(chat(proxy, "c"))
    await wait_for(lambda: proxy.model("c").waiting == 1, what="c queued")
    inst_c = proxy.instance("c")
    assert inst_c.state is State.STARTING and inst_c.engine is None
    await sa.read()  # a's stream ends: its lease is released, c is re-planned
    assert await waiting == 200
    assert states(proxy) == {"a": "stopped", "b": "running", "c": "running"}
    sb.close()


@pytest.mark.parametrize("timeout", [0, 0.5])
async def test_503_with_retry_after_when_nothing_can_be_evicted(
    tmp_path: Path, start_proxy: StartProxy, timeout: float
) -> None:
    proxy = await start_proxy(budget(tmp_path, {"a": m(600), "c": m(600)}, queue_timeout_s=timeout))
    assert await chat(proxy, "a") == 200
    stream = await proxy.chat("a", stream=True)
    await stream.content.readany()
    resp = await proxy.chat("c")
    assert resp.status == 503
    assert int(resp.headers["Retry-After"]) >= 1
    err = (await resp.json())["error"]
    assert err["code"] == "insufficient_gpu_memory"
    assert "'a#1'" in err["message"] and "in flight" in err["message"]
    assert proxy.model("c").state() is State.STOPPED and not proxy.model("c").instances
    await stream.read()
    assert await chat(proxy, "c") == 200  # and it is admitted once a is idle


async def test_queue_is_bounded(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(
        budget(tmp_path, {"a": m(600), "c": m(600)}, queue_timeout_s=30, max_queue=2)
    )
    assert await chat(proxy, "a") == 200
    stream = await proxy.chat("a", stream=True)
    await stream.content.readany()
    queued = [asyncio.ensure_future(chat(proxy, "c")) for _ in range(2)]
    await wait_for(lambda: proxy.model("c").waiting == 2, what="two queued")
    resp = await proxy.chat("c")
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "queue_full"
    await stream.read()
    assert await asyncio.gather(*queued) == [200, 200]


async def test_starts_on_one_device_are_serialised(tmp_path: Path, start_proxy: StartProxy) -> None:
    env = FakeEngine(startup_delay=0.5).env()
    models = {"a": {**m(100), "env": env}, "b": {**m(100), "env": env}}
    proxy = await start_proxy(budget(tmp_path, models))
    assert await asyncio.gather(chat(proxy, "a"), chat(proxy, "b")) == [200, 200]
    a, b = proxy.instance("a"), proxy.instance("b")
    first, second = sorted((a, b), key=lambda i: i.ready_at)
    assert second.engine is not None and first.engine is not None
    assert second.engine.started_at >= first.ready_at


async def test_starts_on_different_devices_run_in_parallel(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    env = FakeEngine(startup_delay=1.0).env()
    models = {"a": {**m(600), "env": env}, "b": {**m(600), "env": env}}
    proxy = await start_proxy(budget(tmp_path, models, budget_mb={0: 1000, 1: 1000}))
    assert await asyncio.gather(chat(proxy, "a"), chat(proxy, "b")) == [200, 200]
    a, b = proxy.instance("a"), proxy.instance("b")
    assert {a.placement.devices, b.placement.devices} == {(0,), (1,)}  # type: ignore[union-attr]
    assert b.engine.started_at < a.ready_at and a.engine.started_at < b.ready_at  # type: ignore[union-attr]


async def test_tensor_parallel_takes_a_device_set(tmp_path: Path, start_proxy: StartProxy) -> None:
    models = {
        "small": m(500),
        "tp2": m(600, args={"tensor_parallel_size": 2}),
    }
    proxy = await start_proxy(budget(tmp_path, models, budget_mb={0: 1000, 1: 1000}))
    assert await chat(proxy, "small") == 200
    assert await chat(proxy, "tp2") == 200
    assert proxy.instance("tp2").placement.devices == (0, 1)  # type: ignore[union-attr]
    assert states(proxy)["small"] == "stopped"  # 500 + 600 do not fit on one 1000 MiB device


async def test_out_of_memory_at_start_evicts_one_more_and_retries(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    marker = tmp_path / "oom-once"
    script = (
        f"if [ ! -e {marker} ]; then touch {marker}; "
        'echo "torch.OutOfMemoryError: CUDA out of memory"; exit 1; fi; '
        f'exec {" ".join(FAKE_ENGINE)} "$@"'
    )
    models = {"a": m(300), "b": m(300), "c": m(300, command=["sh", "-c", script, "sh"])}
    proxy = await start_proxy(budget(tmp_path, models))
    assert await chat(proxy, "a") == 200
    assert await chat(proxy, "b") == 200
    assert await chat(proxy, "c") == 200  # fits by the budget, fails with OOM, retried
    assert states(proxy) == {"a": "stopped", "b": "running", "c": "running"}
    metrics = await proxy_samples(proxy)
    assert metrics.get("vllm_proxy_evictions_total", model_id="a", reason="out_of_memory") == 1.0


async def test_model_larger_than_any_device_fails_at_start(tmp_path: Path) -> None:
    cfg = budget(tmp_path, {"a": m(300), "huge": m(5000)})
    with pytest.raises(ConfigError, match=r"models.huge: .*5000 MiB"):
        await create_app(cfg)


async def test_admission_waits_for_a_stopping_engine(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    # a's engine ignores SIGTERM: evicting it takes its stop timeout; c must wait, not overcommit.
    models = {
        "a": m(500, env=FakeEngine(ignore_sigterm=True).env(), stop_timeout_s=0.5),
        "c": m(600),
    }
    proxy = await start_proxy(budget(tmp_path, models))
    assert await chat(proxy, "a") == 200
    a_engine = proxy.instance("a").engine
    assert a_engine is not None
    assert await chat(proxy, "c") == 200
    assert states(proxy) == {"a": "stopped", "c": "running"}
    c_engine = proxy.instance("c").engine
    assert c_engine is not None and a_engine.exited_at is not None
    # SIGTERM was ignored: a went only after its stop timeout, and c was spawned after that.
    assert a_engine.exited_at - a_engine.started_at > 0.5
    assert c_engine.started_at >= a_engine.exited_at


async def test_proxy_answers_while_a_model_waits(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(budget(tmp_path, {"a": m(600), "c": m(600)}, queue_timeout_s=30))
    assert await chat(proxy, "a") == 200
    stream = await proxy.chat("a", stream=True)
    await stream.content.readany()
    queued = asyncio.ensure_future(chat(proxy, "c"))
    await wait_for(lambda: proxy.model("c").waiting == 1, what="c queued")
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/v1/models") as r:
        cards = {c["id"]: c["state"] for c in (await r.json())["data"]}
    assert cards == {"a": "running", "c": "starting"}
    await stream.read()
    assert await queued == 200


def test_static_monitor_needs_sizes(tmp_path: Path) -> None:
    from vllm_proxy.config import parse_config
    from vllm_proxy.planning.memory import make_source

    cfg = parse_config({"gpu": {"monitor": "static", "devices": [0, 1]}})
    with pytest.raises(ConfigError, match=r"gpu\.devices"):
        make_source(cfg)
    assert make_source(parse_config({"gpu": {"monitor": "none"}})) == (None, "none")
    assert sys.platform.startswith("linux")
