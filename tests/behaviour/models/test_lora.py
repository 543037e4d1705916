"""LoRA adapters as models: config, resolution, one load per adapter and engine, max_adapters,
replicas, re-registration after a restart or a level-2 wake, failures, /v1/models.

The fake engine serves adapters as vLLM does at run time (``fake_vllm.lora``): it answers a
request for an adapter it holds with words of that adapter (``<name>:tok0 ...``), 404 for one
it does not, and counts loads, unloads and requests per adapter on its own /metrics, which
the tests read to prove what the proxy sent.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kit import FakeEngine, StartProxy, make_config, wait_for
from kit.forms import (
    AUDIO,
    FORM,
    field,
    form,
)
from kit.leftovers import left_nothing, post_raw
from kit.lora import (
    LOG_MARKS,
    adapter,
    assert_clean_error,
    complete,
    engine_series,
    loads,
    lora_config,
    text,
)
from kit.metrics import proxy_samples

from vllm_proxy.config import ConfigError, parse_config
from vllm_proxy.engines.states import State


def config(tmp_path: Path, models: dict[str, dict[str, Any]], **engine: Any) -> Any:
    return make_config(
        tmp_path,
        models,
        server={"admin_open": True},
        engine={"health_interval_s": 0, **engine},
    )


def base(
    adapters: dict[str, Any] | None = None, env: dict[str, str] | None = None, **keys: Any
) -> dict[str, dict[str, Any]]:
    """One model, ``base``, serving `adapters` (paths or entries); `keys` that name a fake-engine
    setting go to its env, the others to the model."""
    knobs = {k: keys.pop(k) for k in list(keys) if k in FakeEngine.__dataclass_fields__}
    spec: dict[str, Any] = {"model": "x", **keys}
    if adapters is not None:
        spec["adapters"] = {n: str(a) if isinstance(a, Path) else a for n, a in adapters.items()}
    if env or knobs:
        spec["env"] = {**(env or {}), **FakeEngine(**knobs).env()}
    return {"base": spec}


# -- config -----------------------------------------------------------------------------------


def test_adapter_forms_rank_and_engine_flags(tmp_path: Path) -> None:
    a = adapter(tmp_path / "ad", "a", rank=8)
    b = adapter(tmp_path / "ad", "b", rank=12)
    folder = tmp_path / "more"
    adapter(folder, "c", rank=4)
    cfg = parse_config(
        {
            "models": {
                "base": {
                    "model": "x",
                    "adapters": {"a": str(a), "b": {"path": str(b), "aliases": ["bee"]}},
                    "adapters_dir": str(folder),
                },
                "plain": {"model": "y"},
            }
        }
    )
    spec = cfg.specs()["base"]
    assert [(s.name, s.path, s.aliases) for s in spec.adapters] == [
        ("a", str(a), ()),
        ("b", str(b), ("bee",)),
    ]
    assert spec.adapters_dir == str(folder) and spec.max_adapters == 4
    assert spec.max_lora_rank == 16  # the largest rank (12) rounded up to vLLM's values
    argv = spec.engine_argv(9000)
    assert argv[argv.index("--max-loras") + 1] == "4"
    assert argv[argv.index("--max-lora-rank") + 1] == "16"
    assert "--enable-lora" in argv
    assert spec.engine_env()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    plain = cfg.specs()["plain"]
    assert not plain.lora and "--enable-lora" not in plain.engine_argv(9000)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain.engine_env({}) or (
        plain.engine_env()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] != "True"
    )


def test_args_win_over_the_derived_flags(tmp_path: Path) -> None:
    a = adapter(tmp_path, "a", rank=8)
    m = {"model": "x", "adapters": {"a": str(a)}, "args": {"max_loras": 2, "max-lora-rank": 64}}
    spec = parse_config({"models": {"m": m}}).specs()["m"]
    assert spec.max_adapters == 2 and spec.max_lora_rank == 64
    argv = spec.engine_argv(9000)
    assert argv.count("--max-loras") == 1 and argv.count("--max-lora-rank") == 1
    assert argv[argv.index("--max-lora-rank") + 1] == "64"
    m = {"model": "x", "adapters": {"a": str(a)}, "max_adapters": 3}
    spec = parse_config({"models": {"m": m}}).specs()["m"]
    assert spec.max_adapters == 3 and spec.max_lora_rank == 8


@pytest.mark.parametrize(
    ("models", "error"),
    [
        (
            {"m": {"model": "x", "adapters": {"n": "@A"}}, "n": {"model": "y"}},
            r"models\.m\.adapters\.n: name or alias 'n' already used by model n",
        ),
        (
            {
                "m": {
                    "model": "x",
                    "aliases": ["al"],
                    "adapters": {"z": {"path": "@A", "aliases": ["al"]}},
                }
            },
            r"models\.m\.adapters\.z: name or alias 'al' already used by model m",
        ),
        (
            {
                "m": {"model": "x", "adapters": {"z": "@A"}},
                "k": {"model": "y", "adapters": {"z": "@A"}},
            },
            r"models\.k\.adapters\.z: .*already used by adapter z of m",
        ),
        ({"m": {"model": "x", "adapters": {"z": "/nowhere/z"}}}, r"models\.m\.adapters\.z\.path"),
        ({"m": {"model": "x", "adapters": {"z": ""}}}, r"models\.m\.adapters\.z\.path"),
        ({"m": {"model": "x", "adapters_dir": "/nowhere"}}, r"models\.m\.adapters_dir"),
        ({"m": {"model": "x", "max_adapters": 2}}, r"models\.m\.max_adapters: set without"),
        ({"m": {"model": "x", "adapters": {"z": "@A"}, "max_adapters": 0}}, r"max_adapters"),
        (
            {"m": {"model": "x", "adapters": {"z": "@A"}, "args": {"enable_lora": False}}},
            r"models\.m\.args\.enable_lora",
        ),
        (
            {"m": {"model": "x", "adapters": {"z": "@B"}, "args": {"max_lora_rank": 8}}},
            r"models\.m\.adapters\.z: rank 32 is above args\.max_lora_rank 8",
        ),
        (
            {"m": {"model": "x", "adapters": {"z": "@C"}}},
            r"models\.m\.adapters\.z: rank 1024 is above vLLM's largest",
        ),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, models: dict[str, Any], error: str) -> None:
    paths = {
        f"@{n}": str(adapter(tmp_path, n, rank=r)) for n, r in (("A", 8), ("B", 32), ("C", 1024))
    }
    data = json.loads(json.dumps(models))
    for m in data.values():
        for name, a in m.get("adapters", {}).items():
            if isinstance(a, dict):
                a["path"] = paths.get(a["path"], a["path"])
            else:
                m["adapters"][name] = paths.get(a, a)
    with pytest.raises(ConfigError, match=error):
        parse_config({"models": data})


def test_the_example_config_still_loads() -> None:
    from vllm_proxy.config import load_config

    root = Path(__file__).resolve().parents[3]
    spec = load_config(root / "config.example.yaml").specs()
    assert all(not s.lora for s in spec.values())


# -- serving ----------------------------------------------------------------------------------


async def test_two_adapters_answer_with_their_own_output_and_aliases_reach_them(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    a, b = adapter(tmp_path, "sql"), adapter(tmp_path, "poet")
    adapters = {"sql": str(a), "poet": {"path": str(b), "aliases": ["bard"]}}
    proxy = await start_proxy(config(tmp_path, {"base": {"model": "x", "adapters": adapters}}))
    status, base = await complete(proxy, "base")
    assert status == 200 and text(base) == "tok0 tok1 " and base["model"] == "base"
    status, sql = await complete(proxy, "sql")
    assert status == 200 and text(sql) == "sql:tok0 sql:tok1 " and sql["model"] == "sql"
    status, poet = await complete(proxy, "bard")  # an alias: the engine gets the adapter's name
    assert status == 200 and text(poet) == "poet:tok0 poet:tok1 " and poet["model"] == "poet"
    status, events = await complete(proxy, "poet", stream=True)
    assert status == 200 and '"poet:tok0 "' in events and events.endswith("data: [DONE]\n\n")
    inst = proxy.instance("base")
    assert inst.id == "base#1" and await loads(proxy, inst) == {"sql": 1, "poet": 1}
    async with proxy.http.post(
        proxy.url + "/v1/chat/completions",
        json={"model": "bard", "messages": [{"role": "user", "content": "x"}], "stream": True},
    ) as resp:
        body = await resp.text()
    assert resp.status == 200 and '"poet:tok0 "' in body and body.endswith("data: [DONE]\n\n")
    requests = await engine_series(proxy, inst, "fake_engine:lora_requests_total")
    assert requests == {"sql": 1, "poet": 3}
    metrics = await proxy_samples(proxy)
    assert (
        metrics.get("vllm_proxy_adapter_loads_total", adapter="poet", model_id="base", result="ok")
        == 1.0
    )
    assert metrics.get("vllm_proxy_adapter_requests_total", adapter="poet", model_id="base") == 3.0


async def test_fifty_concurrent_requests_for_an_adapter_make_one_load(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    a = adapter(tmp_path, "sql")
    proxy = await start_proxy(config(tmp_path, base({"sql": a}, lora_load_delay=0.3)))
    results = await asyncio.gather(*(complete(proxy, "sql") for _ in range(50)))
    assert all(s == 200 and text(d) == "sql:tok0 sql:tok1 " for s, d in results)
    inst = proxy.instance("base")
    assert await loads(proxy, inst) == {"sql": 1}
    metrics = await proxy_samples(proxy)
    assert (
        metrics.get("vllm_proxy_adapter_loads_total", adapter="sql", model_id="base", result="ok")
        == 1.0
    )


async def test_an_adapter_copied_into_adapters_dir_is_served_without_a_reload(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    folder = tmp_path / "adapters"
    adapter(folder, "first")
    proxy = await start_proxy(config(tmp_path, base(adapters_dir=str(folder))))
    status, data = await complete(proxy, "first")
    assert status == 200 and text(data).startswith("first:tok0")
    status, data = await complete(proxy, "later")
    assert status == 404 and "later" in data["error"]["message"]
    adapter(folder, "later")  # copied in while the proxy runs
    status, data = await complete(proxy, "later")
    assert status == 200 and text(data).startswith("later:tok0")
    (folder / "notes").mkdir()  # a folder without adapter_config.json is no adapter
    for bad in ("notes", "../adapters/later", ".hidden"):
        status, data = await complete(proxy, bad)
        assert status == 404, bad
    cards = {
        c["id"]: c for c in (await (await proxy.http.get(proxy.url + "/v1/models")).json())["data"]
    }
    assert cards["later"]["parent"] == "base" and cards["later"]["state"] == "loaded"
    assert "notes" not in cards


async def test_a_discovered_adapter_above_the_engines_rank_is_refused(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    folder = tmp_path / "adapters"
    adapter(folder, "small", rank=8)
    proxy = await start_proxy(config(tmp_path, base(adapters_dir=str(folder))))
    assert proxy.model("base").spec.max_lora_rank == 8
    adapter(folder, "big", rank=64)
    status, data = await complete(proxy, "big")
    assert status == 400 and data["error"]["code"] == "adapter_rank_too_large"
    assert "'big'" in data["error"]["message"] and "max_lora_rank" in data["error"]["message"]
    assert (await complete(proxy, "small"))[0] == 200


async def test_max_adapters_unloads_the_least_recently_used_and_loads_it_again(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    a, b = adapter(tmp_path, "a"), adapter(tmp_path, "b")
    proxy = await start_proxy(config(tmp_path, base({"a": a, "b": b}, max_adapters=1)))
    assert "--max-loras" in (argv := proxy.model("base").spec.engine_argv(1))
    assert argv[argv.index("--max-loras") + 1] == "1"
    for name in ("a", "b", "a"):
        status, data = await complete(proxy, name)
        assert status == 200 and text(data).startswith(f"{name}:tok0")
    inst = proxy.instance("base")
    assert await loads(proxy, inst) == {"a": 2, "b": 1}
    assert inst.adapters.status() == {"a": "loaded"}

    async def settled() -> bool:  # the last unload runs beside the load that needed its slot
        unloads = await engine_series(proxy, inst, "fake_engine:lora_unloads_total")
        return unloads == {"a": 1, "b": 1}

    await wait_for(settled, what="both unloads")
    assert await engine_series(proxy, inst, "fake_engine:lora_loaded") == {"a": 1.0}


async def test_busy_adapters_are_never_unloaded_and_a_new_one_waits_then_gets_503(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    a, b = adapter(tmp_path, "a"), adapter(tmp_path, "b")
    cfg = config(tmp_path, base({"a": a, "b": b}, token_delay=0.4, max_adapters=1))
    cfg = cfg.model_copy(
        update={"admission": cfg.admission.model_copy(update={"queue_timeout_s": 0.3})}
    )
    proxy = await start_proxy(cfg)
    slow = asyncio.ensure_future(complete(proxy, "a", max_tokens=3))  # holds "a" for ~1.2 s
    await wait_for(lambda: proxy.model("base").serving() is not None)
    inst = proxy.instance("base")
    await wait_for(lambda: inst.adapters.status() == {"a": "loaded"})
    async with proxy.http.post(
        proxy.url + "/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 1}
    ) as resp:
        data = await resp.json()
        assert resp.status == 503 and resp.headers["Retry-After"]
    assert data["error"]["code"] == "adapters_busy" and "'b'" in data["error"]["message"]
    status, first = await slow
    assert status == 200 and text(first).startswith("a:tok0")
    status, data = await complete(proxy, "b", max_tokens=1)  # "a" is idle now: it makes room
    assert status == 200 and text(data) == "b:tok0 "
    assert await loads(proxy, inst) == {"a": 1, "b": 1}


async def test_a_failing_adapter_is_isolated(tmp_path: Path, start_proxy: StartProxy) -> None:
    good, bad, gone = adapter(tmp_path, "good"), adapter(tmp_path, "bad"), adapter(tmp_path, "gone")
    adapters = {"good": str(good), "bad": str(bad), "gone": str(gone)}
    proxy = await start_proxy(config(tmp_path, base(adapters, lora_fail=("bad",))))
    results = await asyncio.gather(*(complete(proxy, "bad") for _ in range(5)))
    for status, data in results:
        assert status == 502 and data["error"]["code"] == "adapter_load_failed"
        message = data["error"]["message"]
        assert "adapter 'bad' of model 'base'" in message and "FAKE_ENGINE_LORA_FAIL" in message
    shutil.rmtree(gone)  # its folder went away after the config was loaded
    status, data = await complete(proxy, "gone")
    assert status == 404 and data["error"]["code"] == "adapter_not_found"
    assert "'gone'" in data["error"]["message"]
    status, data = await complete(proxy, "good")
    assert status == 200 and text(data).startswith("good:tok0")
    status, data = await complete(proxy, "base")
    assert status == 200 and text(data) == "tok0 tok1 "
    inst = proxy.instance("base")
    assert inst.state is State.RUNNING and inst.id == "base#1"
    assert inst.adapters.status() == {"good": "loaded"}
    metrics = await proxy_samples(proxy)
    assert metrics.find(
        "vllm_proxy_adapter_loads_total", adapter="bad", model_id="base", result="failed"
    )
    assert (
        metrics.get(
            "vllm_proxy_adapter_loads_total", adapter="gone", model_id="base", result="not_found"
        )
        == 1.0
    )


async def test_a_replica_that_holds_the_adapter_is_preferred(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    a, b = adapter(tmp_path, "a"), adapter(tmp_path, "b")
    proxy = await start_proxy(config(tmp_path, base({"a": a, "b": b}, replicas=2)))
    assert (await complete(proxy, "base"))[0] == 200
    model = proxy.model("base")
    await wait_for(lambda: len([i for i in model.instances if i.state is State.RUNNING]) == 2)
    assert (await complete(proxy, "a"))[0] == 200
    holder = next(i for i in model.instances if i.adapters.holds("a"))
    for _ in range(6):  # the other replica is as idle, and more recently used: still "a"'s
        status, _ = await complete(proxy, "a")
        assert status == 200
        assert [i.id for i in model.instances if i.adapters.holds("a")] == [holder.id]
    status, _ = await complete(proxy, "b")  # loaded where it is least loaded
    totals: dict[str, float] = {}
    for inst in model.instances:
        for name, n in (await loads(proxy, inst)).items():
            totals[name] = totals.get(name, 0) + n
    assert totals == {"a": 1, "b": 1}
    cards = {
        c["id"]: c for c in (await (await proxy.http.get(proxy.url + "/v1/models")).json())["data"]
    }
    assert cards["a"]["instances"] == [holder.id]


async def test_adapters_are_registered_again_on_a_restarted_engine(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    a = adapter(tmp_path, "a")
    proxy = await start_proxy(config(tmp_path, base({"a": a})))
    assert (await complete(proxy, "a"))[0] == 200
    first = proxy.instance("base")
    assert first.engine is not None
    first.engine.kill()
    await wait_for(lambda: first.state is State.ERROR, what="the engine's death noticed")
    status, data = await complete(proxy, "a")
    assert status == 200 and text(data).startswith("a:tok0")
    second = proxy.instance("base")
    assert second.id == "base#2" and await loads(proxy, second) == {"a": 1}


async def test_adapters_survive_sleeps_and_a_level_2_wake_registers_them_again_in_place(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """vLLM keeps its adapter registry across sleeps of both levels (``entrypoints/openai/
    models/serving.py:167-230``) and reloads an adapter lazily after ``reload_weights``: the
    engine still serves `a` after a level-2 wake. The proxy's in-place registration after that
    wake is redundant but harmless: one more load, same answers."""
    a = adapter(tmp_path, "a")
    policy = {"level": 1, "after_idle_s": 60}
    proxy = await start_proxy(config(tmp_path, base({"a": a}, sleep=policy)))
    assert (await complete(proxy, "a"))[0] == 200
    inst = proxy.instance("base")
    for level, expected in ((1, 1), (2, 2)):
        resp = await proxy.http.post(proxy.url + f"/admin/models/base/sleep?level={level}")
        assert resp.status == 200, await resp.text()
        await wait_for(lambda: inst.asleep)
        assert await engine_series(proxy, inst, "fake_engine:lora_loaded") == {"a": 1}, level
        status, data = await complete(proxy, "a")
        assert status == 200 and text(data).startswith("a:tok0"), data
        assert proxy.instance("base") is inst and await loads(proxy, inst) == {"a": expected}


async def test_v1_models_lists_adapters_with_their_parent(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    a = adapter(tmp_path, "a")
    folder = tmp_path / "more"
    adapter(folder, "c")
    proxy = await start_proxy(
        config(
            tmp_path,
            {
                "base": {
                    "model": "x",
                    "adapters": {"a": {"path": str(a), "aliases": ["alpha"]}},
                    "adapters_dir": str(folder),
                },
                "other": {"model": "y"},
            },
        )
    )
    listed = (await (await proxy.http.get(proxy.url + "/v1/models")).json())["data"]
    cards = {c["id"]: c for c in listed}
    assert set(cards) == {"base", "other", "a", "alpha", "c"}
    assert cards["a"] | {"created": 0} == {
        "id": "a",
        "object": "model",
        "created": 0,
        "owned_by": "vllm-proxy",
        "root": str(a),
        "parent": "base",
        "state": "not_loaded",
        "instances": [],
    }
    assert cards["alpha"]["adapter"] == "a" and cards["alpha"]["parent"] == "base"
    assert cards["c"]["parent"] == "base" and cards["c"]["root"] == str(folder / "c")
    assert (await complete(proxy, "alpha"))[0] == 200
    card = await (await proxy.http.get(proxy.url + "/v1/models/a")).json()
    assert card["state"] == "loaded" and card["instances"] == ["base#1"]
    snapshot = await (await proxy.http.get(proxy.url + "/admin/models")).json()
    rows = snapshot if isinstance(snapshot, list) else snapshot.get("models", snapshot)
    row = next(r for r in rows if r["name"] == "base")
    assert row["adapters"][0] == {
        "name": "a",
        "aliases": ["alpha"],
        "path": str(a),
        "source": "config",
        "instances": {"base#1": "loaded"},
    }
    assert row["max_adapters"] == 4 and row["adapters_dir"] == str(folder)
    assert row["instances"][0]["adapters"] == {"a": "loaded"}


async def test_a_model_name_wins_over_an_adapter_folder_of_the_same_name(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    folder = tmp_path / "adapters"
    adapter(folder, "other")
    proxy = await start_proxy(
        config(tmp_path, {**base(adapters_dir=str(folder)), "other": {"model": "y"}})
    )
    status, data = await complete(proxy, "other")
    assert status == 200 and data["model"] == "other" and text(data) == "tok0 tok1 "
    assert all(not i.adapters.slots for i in proxy.model("base").instances)


async def test_an_engine_without_runtime_lora_routes_is_a_clear_502(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    a = adapter(tmp_path, "a")
    models = base({"a": a}, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})
    proxy = await start_proxy(config(tmp_path, models))
    status, data = await complete(proxy, "a")
    assert status == 502 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in data["error"]["message"]
    assert (await complete(proxy, "base"))[0] == 200


async def test_the_status_page_shows_each_models_adapters(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    from kit.browser import run_chromium

    a, b = adapter(tmp_path, "sql"), adapter(tmp_path, "poet")
    adapters = {"sql": {"path": str(a), "aliases": ["q"]}, "poet": str(b)}
    proxy = await start_proxy(config(tmp_path, {"base": {"model": "x", "adapters": adapters}}))
    assert (await complete(proxy, "q"))[0] == 200
    rc, dom, err = await run_chromium(
        proxy.url + "/", tmp_path / "profile", "--dump-dom", "--virtual-time-budget=5000"
    )
    assert rc == 0, err[-2000:]
    row = dom[dom.index('data-adapters="base"') :].split("</tr>")[0]
    assert "max 4 per engine" in row
    assert re.search(r'data-adapter="sql"[^>]*><code>sql</code> on base#1 \(q\)', row), row
    assert re.search(r'data-adapter="poet"[^>]*><code>poet</code> not loaded', row), row


async def test_a_reload_that_adds_an_adapter_keeps_the_engine(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    a, b = adapter(tmp_path, "a"), adapter(tmp_path, "b")
    proxy = await start_proxy(config(tmp_path, base({"a": a})))
    assert (await complete(proxy, "a"))[0] == 200
    inst = proxy.instance("base")
    status, _ = await complete(proxy, "b")
    assert status == 404
    both = {"a": str(a), "b": {"path": str(b), "aliases": ["bee"]}}
    report = proxy.manager.reload(
        config(tmp_path, {"base": {"model": "x", "adapters": both}}).specs(), 5
    )
    assert report["kept"] == ["base"]
    status, data = await complete(proxy, "bee")
    assert status == 200 and text(data).startswith("b:tok0")
    assert proxy.instance("base") is inst and await loads(proxy, inst) == {"a": 1, "b": 1}
    bigger = adapter(tmp_path / "big", "c", rank=64)
    report = proxy.manager.reload(
        config(tmp_path, base({**both, "c": bigger})).specs(),
        5,
    )
    assert report["restarted"] == ["base"]  # --max-lora-rank 8 -> 64: a new engine


async def test_a_client_gone_during_the_load_leaves_no_use_behind(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    a, b = adapter(tmp_path, "a"), adapter(tmp_path, "b")
    models = base({"a": a, "b": b}, lora_load_delay=0.5, max_adapters=1)
    proxy = await start_proxy(config(tmp_path, models))
    assert (await complete(proxy, "base"))[0] == 200
    inst = proxy.instance("base")
    gone = asyncio.ensure_future(complete(proxy, "a"))
    await wait_for(lambda: inst.adapters.status() == {"a": "loading"})
    gone.cancel()  # the client hangs up while the load is under way
    await wait_for(lambda: inst.adapters.status() == {"a": "loaded"}, what="the load goes on")
    await wait_for(lambda: inst.leases == 0, what="the lease released")
    assert inst.adapters.slots["a"].users == 0
    status, data = await complete(proxy, "b")  # "a" is idle: it makes room
    assert status == 200 and text(data).startswith("b:tok0")


# -- hostile clients of LoRA adapters: names, loads, unloads and slots under pressure ----------


async def test_one_adapter_name_in_two_models_adapters_dir_goes_to_neither_by_mistake(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """``shared`` is in a's folder and in b's: it went to a, the first in config order, for
    every key (b's users got a's adapter; a key scoped to b got 404 for its own). A key scoped
    to one model finds its own; a key that may use both gets a 400 naming both, never the
    wrong adapter, and the listing shows each key what it can use."""
    adapter(tmp_path / "a-adapters", "shared")
    adapter(tmp_path / "b-adapters", "shared")
    keys = [{"key": "for-a", "models": ["a"]}, {"key": "for-b", "models": ["b"]}, "for-all"]
    models = {
        "a": {"model": "x", "adapters_dir": str(tmp_path / "a-adapters")},
        "b": {"model": "y", "adapters_dir": str(tmp_path / "b-adapters")},
    }
    proxy = await start_proxy(lora_config(tmp_path, models, api_keys=keys))

    async def ask(key: str) -> tuple[int, Any]:
        body = {"model": "shared", "prompt": "hi", "max_tokens": 2}
        headers = {"Authorization": f"Bearer {key}"}
        async with proxy.http.post(proxy.url + "/v1/completions", json=body, headers=headers) as r:
            return r.status, await r.json()

    async def listed(key: str) -> list[tuple[str, Any]]:
        headers = {"Authorization": f"Bearer {key}"}
        async with proxy.http.get(proxy.url + "/v1/models", headers=headers) as r:
            assert r.status == 200
            cards = (await r.json())["data"]
        return [(c["id"], c["parent"]) for c in cards if c["id"] == "shared"]

    for key, owner in (("for-b", "b"), ("for-a", "a")):
        status, data = await ask(key)
        assert status == 200 and text(data).startswith("shared:tok0"), (key, data)
        assert proxy.instance(owner).adapters.holds("shared")
        assert await listed(key) == [("shared", owner)]
    status, data = await ask("for-all")
    assert_clean_error(status, data, 400, "ambiguous_adapter")
    assert "'a' and 'b'" in data["error"]["message"]
    assert await listed("for-all") == []


async def test_models_lists_adapters_folders_off_the_event_loop_once_per_ttl(
    tmp_path: Path, start_proxy: StartProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``GET /v1/models`` listed every ``adapters_dir`` on the event loop, at every call: with
    1000 adapters and four clients ``/health`` went from 3 to 143 ms (881 ms with 50 000
    other entries in the folder). Now a folder is listed in a thread, once for the calls of a
    couple of seconds, only for a key that may use its model, and files in it cost no system
    call: forty calls from four clients list it once (or once per two seconds), off the
    loop."""
    folder = tmp_path / "adapters"
    for i in range(1000):
        adapter(folder, f"lora-{i:04d}")
    for i in range(20_000):  # sorted before the adapters
        (folder / f"0-junk-{i:05d}").touch()
    from vllm_proxy.pool import manager as manager_module

    listings: list[int] = []
    original = manager_module.list_folder

    def counted(path: str, *args: Any) -> Any:
        listings.append(threading.get_ident())
        return original(path, *args)

    monkeypatch.setattr(manager_module, "list_folder", counted)
    keys = [{"key": "other", "models": ["plain"]}, "all"]
    models = {"base": {"model": "x", "adapters_dir": str(folder)}, "plain": {"model": "y"}}
    proxy = await start_proxy(lora_config(tmp_path, models, api_keys=keys))

    async def ids(key: str) -> set[str]:
        headers = {"Authorization": f"Bearer {key}"}
        async with proxy.http.get(proxy.url + "/v1/models", headers=headers) as r:
            assert r.status == 200
            return {c["id"] for c in (await r.json())["data"]}

    assert await ids("other") == {"plain"}
    assert listings == [], "a key that may not use base lists nothing"

    async def client() -> None:
        for _ in range(10):
            assert len(await ids("all")) == 1002

    await asyncio.gather(*(client() for _ in range(4)))
    assert 1 <= len(listings) <= 4, f"listed {len(listings)} times"
    assert threading.get_ident() not in listings, "listed on the event loop"


async def test_adapter_names_that_look_like_paths_never_load_a_folder_outside_adapters_dir(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    folder = tmp_path / "adapters"
    adapter(folder, "good")
    adapter(folder, "ünï-çødé")
    outside = adapter(tmp_path / "outside", "secret")
    theirs = tmp_path / "theirs"
    adapter(theirs, "their-own")
    (folder / "escape").symlink_to(outside, target_is_directory=True)  # a link out of it
    (folder / "linked").symlink_to(folder / "good", target_is_directory=True)  # one inside
    proxy = await start_proxy(
        lora_config(
            tmp_path,
            {
                "base": {"model": "x", "adapters_dir": str(folder)},
                "other": {"model": "y", "adapters_dir": str(theirs)},
            },
        )
    )
    hostile = [
        "../outside/secret",
        str(outside),
        str(folder / "good"),
        "%2e%2e%2foutside%2fsecret",
        "..",
        ".",
        "good/",
        "good/.",
        "./good",
        "..\\outside\\secret",
        "good\x00",
        "good\n",
        "x" * 300,
        "a" * 255,
        "escape",
        "../theirs/their-own",
        "\udcff",
        "\ud800",
    ]
    for name in hostile:
        status, data = await complete(proxy, name)
        assert_clean_error(status, data, 404, "model_not_found")
    for name, owner in (("good", "base"), ("ünï-çødé", "base"), ("their-own", "other")):
        status, data = await complete(proxy, name)
        assert status == 200 and text(data).startswith(f"{name}:tok0"), (name, data)
        assert proxy.instance(owner).adapters.holds(name)
    status, data = await complete(proxy, "linked")  # a link to a folder inside is an adapter
    assert status == 200 and text(data).startswith("linked:tok0")
    paths = {
        s.adapter.path for i in proxy.manager.all_instances() for s in i.adapters.slots.values()
    }
    assert all(
        os.path.realpath(p).startswith((str(folder) + os.sep, str(theirs) + os.sep)) for p in paths
    ), paths
    assert set(await loads(proxy, proxy.instance("base"))) == {"good", "ünï-çødé", "linked"}
    # The model list and the card route take the same names without walking the disk.
    listed = {
        c["id"] for c in (await (await proxy.http.get(proxy.url + "/v1/models")).json())["data"]
    }
    assert "escape" not in listed and {"good", "linked", "their-own"} <= listed
    for path in ("/v1/models/..%2F..%2Foutside%2Fsecret", "/v1/models/%2e%2e", "/v1/models/escape"):
        async with proxy.http.get(proxy.url + path) as resp:
            assert_clean_error(resp.status, await resp.json(), 404)
    await left_nothing(proxy)


async def test_a_load_that_ends_after_its_client_left_frees_the_slot_for_a_waiting_adapter(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """max_adapters 1: "a" loads for a client that hangs up, "b" waits for the slot. Once the
    load is done "a" has no user and must make room at once, not after the queue timeout."""
    a, b = adapter(tmp_path, "a"), adapter(tmp_path, "b")
    env = FakeEngine(lora_load_delay=0.6).env()
    models = {"base": {"model": "x", "adapters": {"a": str(a), "b": str(b)}, "max_adapters": 1,
                       "env": env}}  # fmt: skip
    proxy = await start_proxy(lora_config(tmp_path, models, queue_timeout_s=20))
    assert (await complete(proxy, "base"))[0] == 200
    inst = proxy.instance("base")
    gone = asyncio.ensure_future(complete(proxy, "a"))
    await wait_for(lambda: inst.adapters.status() == {"a": "loading"})
    gone.cancel()
    await wait_for(lambda: inst.adapters.slots["a"].users == 0, what="the client's use dropped")
    began = time.monotonic()
    status, data = await complete(proxy, "b")
    assert status == 200 and text(data).startswith("b:tok0"), data
    assert time.monotonic() - began < 5, "b waited for the queue timeout, not for a's load"
    assert await loads(proxy, inst) == {"a": 1, "b": 1}
    await left_nothing(proxy)


async def test_an_adapter_storm_across_replicas_with_one_slot_each_ends_without_deadlock(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Two replicas, one adapter slot each, four adapters, many requests at once in a random
    order, some of whose clients leave mid-way: every request ends within the bound (200, or
    503 adapters_busy with Retry-After), the slots churn, and once it is over each engine holds
    exactly what the proxy's book says it holds."""
    paths = {n: str(adapter(tmp_path, n)) for n in ("a", "b", "c", "d")}
    env = FakeEngine(lora_load_delay=0.05, token_delay=0.01).env()
    models = {"base": {"model": "x", "replicas": 2, "adapters": paths, "max_adapters": 1,
                       "env": env}}  # fmt: skip
    proxy = await start_proxy(lora_config(tmp_path, models, queue_timeout_s=2))
    model = proxy.model("base")
    assert (await complete(proxy, "base"))[0] == 200
    await wait_for(lambda: len([i for i in model.instances if i.state is State.RUNNING]) == 2)
    rng = random.Random(7)

    async def one(name: str, leave_after: float | None) -> tuple[int, str, float]:
        began = time.monotonic()
        body = {"model": name, "prompt": "x", "max_tokens": 3, "stream": name in "bd"}

        async def ask() -> tuple[int, str]:
            async with proxy.http.post(proxy.url + "/v1/completions", json=body) as resp:
                if resp.status == 503:
                    assert resp.headers["Retry-After"]
                return resp.status, await resp.text()

        try:
            status, text_ = await asyncio.wait_for(ask(), leave_after)
        except TimeoutError:  # the client left
            status, text_ = 0, ""
        return status, text_, time.monotonic() - began

    names = [rng.choice("abcd") for _ in range(80)]
    leaving = [rng.choice((None, None, None, 0.02, 0.08)) for _ in names]
    results = await asyncio.wait_for(
        asyncio.gather(*(one(n, t) for n, t in zip(names, leaving, strict=True))), 60
    )
    for (status, body, took), name in zip(results, names, strict=True):
        assert status in (0, 200, 503), (status, body)
        if status == 200:
            assert f"{name}:tok0" in body, (name, body)
        elif status == 503:
            assert '"adapters_busy"' in body, body
        assert took < 2 + 5, f"a request waited {took:.1f}s"
    assert sum(s == 200 for s, _, _ in results) >= len(names) // 4
    await left_nothing(proxy)
    churn = 0
    for inst in model.instances:
        churn += int(sum((await loads(proxy, inst)).values()))
    assert churn > len(paths), "the slots never changed hands"

    async def books_match() -> bool:
        for inst in model.instances:
            held = await engine_series(proxy, inst, "fake_engine:lora_loaded")
            if set(held) != set(inst.adapters.slots):
                return False
        return True

    await wait_for(books_match, what="each engine holding what its book says")
    for name in paths:  # and every adapter still serves
        status, data = await complete(proxy, name)
        assert status == 200 and text(data).startswith(f"{name}:tok0")
    await left_nothing(proxy)


async def test_a_request_for_an_adapter_being_unloaded_waits_and_loads_it_again(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    a, b = adapter(tmp_path, "a"), adapter(tmp_path, "b")
    models = {"base": {"model": "x", "adapters": {"a": str(a), "b": str(b)}, "max_adapters": 1,
                       "env": FakeEngine(lora_load_delay=0.3).env()}}  # fmt: skip
    proxy = await start_proxy(lora_config(tmp_path, models, queue_timeout_s=10))
    assert (await complete(proxy, "a"))[0] == 200
    inst = proxy.instance("base")
    # "b" evicts "a" (its unload runs beside b's load); "a" asked meanwhile waits for the
    # unload, then for b's request to end, then loads again, evicting "b".
    evict = asyncio.ensure_future(complete(proxy, "b"))
    await wait_for(lambda: "a" not in inst.adapters.slots, what="a chosen as the victim")
    again = asyncio.ensure_future(complete(proxy, "a"))
    (sb, db), (sa, da) = await asyncio.wait_for(asyncio.gather(evict, again), 30)
    assert sb == 200 and text(db).startswith("b:tok0"), db
    assert sa == 200 and text(da).startswith("a:tok0"), da
    assert await loads(proxy, inst) == {"a": 2, "b": 1}
    await left_nothing(proxy)

    async def settled() -> bool:
        held = await engine_series(proxy, inst, "fake_engine:lora_loaded")
        return set(held) == set(inst.adapters.slots) == {"a"}

    await wait_for(settled, what="the engine holding only a")


async def test_an_engine_that_dies_during_a_load_fails_every_waiter_cleanly(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    a = adapter(tmp_path, "a")
    models = {"base": {"model": "x", "adapters": {"a": str(a)},
                       "env": FakeEngine(lora_load_delay=30).env()}}  # fmt: skip
    proxy = await start_proxy(lora_config(tmp_path, models))
    assert (await complete(proxy, "base"))[0] == 200
    first = proxy.instance("base")
    waiting = [asyncio.ensure_future(complete(proxy, "a")) for _ in range(5)]
    await wait_for(lambda: first.adapters.status() == {"a": "loading"})
    await wait_for(lambda: first.adapters.slots["a"].users == 5, what="all five waiting")
    assert first.engine is not None
    first.engine.kill()
    results = await asyncio.wait_for(asyncio.gather(*waiting), 15)
    for status, data in results:
        assert_clean_error(status, data, 502)
        assert "'a'" in data["error"]["message"]
    await wait_for(lambda: first.state is State.ERROR, what="the death noticed")
    await left_nothing(proxy)
    assert first.adapters.slots == {}


async def test_a_load_that_hangs_is_a_502_after_read_timeout_s_and_the_base_still_serves(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    a = adapter(tmp_path, "a")
    models = {"base": {"model": "x", "adapters": {"a": str(a)}, "read_timeout_s": 1,
                       "env": FakeEngine(lora_load_delay=60).env()}}  # fmt: skip
    proxy = await start_proxy(lora_config(tmp_path, models))
    assert (await complete(proxy, "base"))[0] == 200
    began = time.monotonic()
    results = await asyncio.gather(*(complete(proxy, "a") for _ in range(3)))
    assert time.monotonic() - began < 5
    for status, data in results:
        assert_clean_error(status, data, 502, "adapter_load_failed")
    assert (await complete(proxy, "base"))[0] == 200
    inst = proxy.instance("base")
    assert inst.state is State.RUNNING and inst.adapters.slots == {}
    await left_nothing(proxy)


async def test_a_stream_for_a_failing_adapter_that_waited_for_its_engine_ends_with_an_sse_error(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    a = adapter(tmp_path, "a")
    env = FakeEngine(startup_delay=1, lora_fail=("a",)).env()
    models = {
        "base": {
            "model": "x",
            "adapters": {"a": str(a)},
            "loading_keepalive_interval_s": 0.2,
            "env": env,
        }
    }
    proxy = await start_proxy(lora_config(tmp_path, models))
    async with proxy.http.post(
        proxy.url + "/v1/completions",
        json={"model": "a", "prompt": "x", "max_tokens": 2, "stream": True},
    ) as resp:
        assert resp.status == 200  # answered while the engine started
        events = await resp.text()
    assert events.startswith(": loading base") and events.endswith("data: [DONE]\n\n"), events
    error = json.loads(events.split("data: ")[-2])["error"]
    assert error["code"] == "adapter_load_failed" and "'a'" in error["message"]
    assert not any(mark in error["message"] for mark in LOG_MARKS), error
    await left_nothing(proxy)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_a_scoped_key_reaches_its_models_adapters_and_nothing_of_the_others(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """docs/design.md: an API key's scope applies to the base model. A key for "base" uses
    its adapters under every name; another model's adapters read as names that do not
    exist, on every route that takes a name."""
    folder = tmp_path / "found"
    adapter(folder, "found")
    sql, theirs = adapter(tmp_path, "sql"), adapter(tmp_path, "theirs")
    models = {
        "base": {"model": "x", "adapters": {"sql": {"path": str(sql), "aliases": ["q"]}},
                 "adapters_dir": str(folder)},
        "other": {"model": "y", "adapters": {"theirs": {"path": str(theirs), "aliases": ["th"]}}},
    }  # fmt: skip
    keys = [{"key": "base-key", "models": ["base"]}, {"key": "other-key", "models": ["oth*"]}]
    proxy = await start_proxy(lora_config(tmp_path, models, api_keys=keys))
    key = bearer("base-key")

    async def post(path: str, model: str | None, headers: dict[str, str]) -> tuple[int, Any]:
        body: dict[str, Any] = {"prompt": "x", "max_tokens": 1}
        if model is not None:
            body["model"] = model
        async with proxy.http.post(proxy.url + path, json=body, headers=headers) as resp:
            return resp.status, await resp.json()

    for name in ("sql", "q", "found"):
        for path, model in (("/v1/completions", name), (f"/serve/{name}/v1/completions", None)):
            status, data = await post(path, model, key)
            expected = "sql" if name == "q" else name
            assert status == 200 and text(data).startswith(f"{expected}:tok0"), (path, data)
    status, unknown = await post("/v1/completions", "no-such", key)
    assert_clean_error(status, unknown, 404, "model_not_found")
    for name in ("theirs", "th", "other"):
        for path, model in (("/v1/completions", name), (f"/serve/{name}/v1/completions", None)):
            status, data = await post(path, model, key)
            assert_clean_error(status, data, 404, "model_not_found")
            assert data["error"]["message"] == unknown["error"]["message"].replace("no-such", name)
        async with proxy.http.get(proxy.url + f"/v1/models/{name}", headers=key) as resp:
            assert_clean_error(resp.status, await resp.json(), 404, "model_not_found")
    for hidden in ("other", "theirs", "th"):
        assert f" {hidden}" not in unknown["error"]["message"]
    async with proxy.http.get(proxy.url + "/v1/models", headers=key) as resp:
        assert {c["id"] for c in (await resp.json())["data"]} == {"base", "sql", "q", "found"}
    async with proxy.http.get(proxy.url + "/v1/models/q", headers=key) as resp:
        card = await resp.json()
        assert card["parent"] == "base" and card["adapter"] == "sql"
    # The other key, the other way round.
    status, data = await post("/v1/completions", "sql", bearer("other-key"))
    assert_clean_error(status, data, 404, "model_not_found")
    status, data = await post("/v1/completions", "found", bearer("other-key"))
    assert_clean_error(status, data, 404, "model_not_found")
    assert proxy.engine_starts("other") == 0
    status, data = await post("/v1/completions", "th", bearer("other-key"))
    assert status == 200 and text(data).startswith("theirs:tok0")
    # Adapters are taken on the JSON routes only: not by an upload, not by a WebSocket.
    upload = form(field("model", b"sql"), field("file", AUDIO, "a.wav"))
    status, data = await post_raw(
        proxy, "/v1/audio/transcriptions", upload, **{"Content-Type": FORM}, **key
    )
    assert_clean_error(status, data, 404, "model_not_found")
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await proxy.http.ws_connect(proxy.url + "/v1/realtime?model=sql", headers=key)
    assert refused.value.status == 404
    for name in ("sql", "found"):  # no key, a wrong key
        for headers in ({}, bearer("nope")):
            assert_clean_error(*(await post("/v1/completions", name, headers)), 401)
    await left_nothing(proxy)
