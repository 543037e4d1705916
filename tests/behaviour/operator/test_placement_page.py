"""/placement and /metrics/model-server: what a proxy says it holds, for the fleet loop and for
llm-d's endpoint picker (docs/cluster.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kit import RunningProxy, StartProxy, make_config
from prometheus_client.parser import text_string_to_metric_families

from vllm_proxy.frontend.routes import placement_page as placement_module

SLEEPS = {"level": 1, "after_idle_s": 600, "memory_mb": 100}
#: Three models of 400 MiB on one 1000 MiB device: two fit at once; `b` can sleep.
MODELS = {
    "a": {"model": "fake/a", "memory_mb": 400, "aliases": ["a-alias"]},
    "b": {"model": "fake/b", "memory_mb": 400, "sleep": SLEEPS},
    "c": {"model": "fake/c", "memory_mb": 400},
}
#: The model-server protocol's names (Gateway API Inference Extension, vLLM's mapping).
PROTOCOL = {
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:lora_requests_info",
}


async def placement(proxy: RunningProxy) -> dict[str, Any]:
    async with proxy.http.get(proxy.url + "/placement") as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def post(proxy: RunningProxy, path: str) -> None:
    async with proxy.http.post(proxy.url + path) as r:
        assert r.status == 200, await r.text()


def models(view: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in view["models"]}


async def page(proxy: RunningProxy) -> dict[str, list[Any]]:
    async with proxy.http.get(proxy.url + "/metrics/model-server") as r:
        assert r.status == 200
        text = await r.text()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


@pytest.fixture(autouse=True)
def uncached(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every read computes its view afresh (the proxies run in this process)."""
    monkeypatch.setattr(placement_module, "VIEW_TTL_S", 0.0)


async def test_placement_says_what_is_held_and_what_would_fit(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    config = make_config(tmp_path, MODELS, server={"admin_open": True}, budget_mb=1000)
    proxy = await start_proxy(config)
    view = await placement(proxy)
    assert view["version"] == 1 and view["memory"] == "static" and not view["closing"]
    assert view["gpus"] == [
        {"id": 0, "total_mb": 1000, "used_mb": 0, "claimed_mb": 0, "free_mb": 1000}
    ]
    assert view["queue"] == {"waiting": 0, "held": 0, "depth": 0}
    rows = models(view)
    assert {n: r["state"] for n, r in rows.items()} == dict.fromkeys("abc", "stopped")
    assert rows["a"]["names"] == ["a", "a-alias"]
    assert all(r["fits_now"] and r["evict_cost"] is None for r in rows.values())
    assert rows["a"]["footprint_mb"] == 400 and rows["a"]["gpus"] == 1

    await post(proxy, "/admin/models/a/load")
    await post(proxy, "/admin/models/b/load")
    view = await placement(proxy)
    rows = models(view)
    assert rows["a"]["state"] == rows["b"]["state"] == "awake"
    (inst,) = rows["a"]["instances"]
    assert inst["state"] == "running" and inst["devices"] == [0] and inst["held_mb"] == 400
    assert view["gpus"][0]["claimed_mb"] == 800 and view["gpus"][0]["free_mb"] == 200
    # c no longer fits as things are: its start would put b to sleep (cheaper than a stop).
    assert not rows["c"]["fits_now"]
    cost = rows["c"]["evict_cost"]
    assert cost["possible"] and cost["sleep"] == ["b#1"] and cost["evict"] == []
    assert cost["sleep_mb"] == 400

    await post(proxy, "/admin/models/b/sleep?level=1")
    rows = models(await placement(proxy))
    assert rows["b"]["state"] == "asleep" and rows["b"]["sleep_level"] == 1
    assert rows["b"]["instances"][0]["held_mb"] == 100
    assert rows["c"]["fits_now"], "400 MiB free once b sleeps in 100"
    assert rows["a"]["fits_now"], "a second replica would fit as well"


async def test_model_server_page_speaks_the_protocol(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    config = make_config(tmp_path, MODELS, server={"admin_open": True}, budget_mb=1000)
    proxy = await start_proxy(config)
    await post(proxy, "/admin/models/a/load")
    await post(proxy, "/admin/models/b/load")
    await post(proxy, "/admin/models/b/sleep?level=1")
    samples = await page(proxy)
    assert set(samples) == PROTOCOL, "only the protocol's names"
    assert all(len(s) == 1 for s in samples.values()), "one series per name"
    assert samples["vllm:num_requests_waiting"][0].value == 0
    assert samples["vllm:num_requests_running"][0].value == 0
    assert samples["vllm:kv_cache_usage_perc"][0].value == 0.5  # 400 + 100 of 1000 claimed
    (info,) = samples["vllm:lora_requests_info"]
    assert set(info.labels) == {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}
    assert info.labels["running_lora_adapters"] == "a,a-alias"
    assert info.labels["waiting_lora_adapters"] == "b", "asleep here: a wake beats a start"
    # running + waiting + c, which still fits in the 500 MiB left
    assert info.labels["max_lora"] == "4"
    assert info.value > 1.7e9, "the value is the time (the picker keeps the newest series)"

    # c started as well: nothing more fits, the picker's `len(running)+len(waiting) < max_lora`
    # no longer holds for a model not here.
    await post(proxy, "/admin/models/c/load")
    (info,) = (await page(proxy))["vllm:lora_requests_info"]
    running = info.labels["running_lora_adapters"].split(",")
    waiting = info.labels["waiting_lora_adapters"].split(",")
    assert sorted(running) == ["a", "a-alias", "c"]
    assert int(info.labels["max_lora"]) == len(running) + len(waiting)


async def test_the_pages_need_a_metrics_key_when_one_is_set(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    server = {"metrics_api_keys": ["mk"], "api_keys": ["user"]}
    proxy = await start_proxy(make_config(tmp_path, MODELS, server=server, budget_mb=1000))
    for path in ("/placement", "/metrics/model-server"):
        for auth in (None, "Bearer user"):
            headers = {"Authorization": auth} if auth else {}
            async with proxy.http.get(proxy.url + path, headers=headers) as r:
                assert r.status == 401, (path, auth)
        async with proxy.http.get(proxy.url + path, headers={"Authorization": "Bearer mk"}) as r:
            assert r.status == 200, path


async def test_without_managed_memory_every_model_fits(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(make_config(tmp_path, {"m": {"model": "x"}}))
    view = await placement(proxy)
    assert view["memory"] == "none" and view["gpus"] == []
    (row,) = view["models"]
    assert row["fits_now"] and row["footprint_mb"] is None
    (info,) = (await page(proxy))["vllm:lora_requests_info"]
    assert info.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "",
                           "max_lora": "1"}  # fmt: skip


async def test_placement_counts_the_start_the_queue_is_about_to_make(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Regression (F9): a start waiting in the admission queue holds no claim, so /placement
    offered the fleet its room: here 200 MiB free and a 150 MiB model fitting, while c (400
    MiB) waits to take a's place the moment a's stream ends."""
    import asyncio

    from kit import FakeEngine, wait_for

    slow = FakeEngine(tokens=400, token_delay=0.05).env()  # streams that last 20 s
    models = {
        "a": {"model": "fake/a", "memory_mb": 400, "env": slow},
        "b": {"model": "fake/b", "memory_mb": 400, "env": slow},
        "c": {"model": "fake/c", "memory_mb": 400},
        "d": {"model": "fake/d", "memory_mb": 150},
    }
    config = make_config(tmp_path, models, server={"admin_open": True}, budget_mb=1000)
    proxy = await start_proxy(config)
    streams = [await proxy.open_stream("a"), await proxy.open_stream("b")]
    try:
        view = await placement(proxy)
        assert view["gpus"][0]["free_mb"] == 200 and models_of(view)["d"]["fits_now"]
        assert [i["leases"] for m in ("a", "b") for i in models_of(view)[m]["instances"]] == [1, 1]
        waiting = asyncio.ensure_future(proxy.reply("c"))
        await wait_for(lambda: proxy.model("c").waiting == 1, what="c waiting for memory")
        view = await placement(proxy)
        assert view["queue"]["waiting"] == 1
        assert view["gpus"][0]["free_mb"] == 0, "c's 400 MiB are about to be taken"
        assert not models_of(view)["d"]["fits_now"]
    finally:
        for s in streams:
            s.close()
    assert (await waiting)[0] == 200


def models_of(view: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in view["models"]}
