"""Hostile inputs against LoRA adapters, form uploads, the realtime WebSocket and scoped API keys,
through the proxy to the fake engine (real processes). Each test is named after its hazard,
and each ends by checking that the scenario left nothing behind: no lease, no admission-queue
ticket, no adapter use, no body bytes counted, no spool file."""

from __future__ import annotations

import asyncio
import json
import os
import random
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kit import FakeEngine, RunningProxy, StartProxy, make_config, wait_for
from test_lora import adapter, complete, engine_series, loads, text
from test_routes import (
    AUDIO,
    BOUNDARY,
    FORM,
    _peak_rss,
    _peak_rss_reset,
    field,
    form,
    receive,
    uploads,
)

from vllm_proxy.engines.states import State

#: What marks an engine's log line or command line (the fake prints vLLM's shapes).
LOG_MARKS = ("[fake_vllm.py]", "APIServer pid", "EngineCore", "RuntimeError", "Traceback",
             "--enable-lora", "--port", "--max-lora-rank", "non-default args")  # fmt: skip


@pytest.fixture(autouse=True)
def spool_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Temporary files (an upload's spool) go to a folder of the test's own."""
    folder = tmp_path / "spool"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder


def open_spools(folder: Path) -> list[str]:
    """This process's open files in `folder` (a spool file is unlinked while open), and the
    files still in it."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder)):
            found.append(target)
    return found + [str(p) for p in folder.iterdir()]


async def left_nothing(proxy: RunningProxy, spool: Path | None = None) -> None:
    """No lease, queue ticket, adapter use, body byte or spool file is left."""
    manager = proxy.manager

    def leases() -> int:
        return sum(i.leases for i in manager.all_instances())

    def users() -> int:
        return sum(s.users for i in manager.all_instances() for s in i.adapters.slots.values())

    await wait_for(lambda: leases() == 0, 10, "no lease left")
    await wait_for(lambda: not manager.queue.tickets, 10, "no queue ticket left")
    await wait_for(lambda: users() == 0, 10, "no adapter use left")
    await wait_for(lambda: proxy.server.runtime.proxy.bodies.held == 0, 10, "no body held")
    if spool is not None:
        await wait_for(lambda: not open_spools(spool), 10, "no spool file left")


def assert_clean_error(status: int, body: Any, expected: int, code: str | None = None) -> None:
    """An OpenAI-shaped error of the expected status, with no engine log or command line."""
    assert status == expected, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    if code is not None:
        assert err["code"] == code, err
    for mark in LOG_MARKS:
        assert mark not in err["message"], err


def lora_config(
    tmp_path: Path, models: dict[str, dict[str, Any]], queue_timeout_s: float = 5, **server: Any
) -> Any:
    cfg = make_config(
        tmp_path, models, server={"admin_open": True, **server}, engine={"health_interval_s": 0}
    )
    return cfg.model_copy(
        update={"admission": cfg.admission.model_copy(update={"queue_timeout_s": queue_timeout_s})}
    )


async def post_raw(proxy: RunningProxy, path: str, data: bytes, **headers: str) -> tuple[int, Any]:
    async with proxy.http.post(proxy.url + path, data=data, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


# -- LoRA adapters: names from clients --------------------------------------------------------


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


# -- LoRA adapters: loads, unloads and slots under pressure -----------------------------------


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


# -- API keys scoped to models ----------------------------------------------------------------


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


async def test_a_scoped_key_cannot_reach_other_models_by_realtime_upload_or_path_prefix(
    tmp_path: Path, start_proxy: StartProxy, spool_dir: Path
) -> None:
    env = FakeEngine(upload_log=tmp_path / "uploads.jsonl", tokens=4).env()
    models = {
        "whisper": {"model": "org/whisper", "aliases": ["w"], "env": env},
        "secret": {"model": "org/secret", "aliases": ["sec"], "env": env},
    }
    keys = [{"key": "w-key", "models": ["w"]}]
    proxy = await start_proxy(make_config(tmp_path, models, server={"api_keys": keys}))
    key = bearer("w-key")
    audio = form(field("model", b"secret"), field("file", AUDIO, "a.wav"))
    # No key at all: refused before anything.
    status, data = await post_raw(
        proxy, "/v1/audio/transcriptions", audio, **{"Content-Type": FORM}
    )
    assert_clean_error(status, data, 401)
    for path in ("/v1/realtime?model=w", "/serve/w/v1/realtime"):
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await proxy.http.ws_connect(proxy.url + path)
        assert refused.value.status == 401
    # Another model's names, in the query, the path or the form: as if they did not exist.
    for path in ("/v1/realtime?model=secret", "/v1/realtime?model=sec", "/serve/sec/v1/realtime"):
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await proxy.http.ws_connect(proxy.url + path, headers=key)
        assert refused.value.status == 404, path
    for path in ("/v1/audio/transcriptions", "/serve/secret/v1/audio/translations"):
        status, data = await post_raw(proxy, path, audio, **{"Content-Type": FORM}, **key)
        assert_clean_error(status, data, 404, "model_not_found")
        assert "secret" not in data["error"]["message"].partition("Available models")[2]
    # The path's model wins over the form's.
    status, data = await post_raw(
        proxy, "/serve/w/v1/audio/transcriptions", audio, **{"Content-Type": FORM}, **key
    )
    assert status == 200, data
    assert [u["fields"]["model"] for u in uploads(tmp_path)] == ["whisper"]
    # The first event names another model: an error event, then 1008.
    async with proxy.http.ws_connect(proxy.url + "/v1/realtime", headers=key) as ws:
        assert (await receive(ws))["type"] == "session.created"
        await ws.send_str(json.dumps({"type": "session.update", "model": "sec"}))
        refused_event = await receive(ws)
        assert refused_event["code"] == "model_not_found", refused_event
        assert "secret" not in refused_event["error"].partition("Available models")[2]
        closing = await asyncio.wait_for(ws.receive(), 10)
        assert closing.type == aiohttp.WSMsgType.CLOSE and ws.close_code == 1008
    # Mid-session: another model is "not found", never "another model" (which would tell it
    # exists); the session goes on.
    async with proxy.http.ws_connect(
        proxy.url + "/serve/w/v1/realtime?model=secret", headers=key
    ) as ws:
        assert (await receive(ws))["type"] == "session.created"
        for name in ("secret", "sec"):
            await ws.send_str(json.dumps({"type": "session.update", "model": name}))
            event = await receive(ws)
            assert event["type"] == "error" and event["code"] == "model_not_found", event
        await ws.send_str(json.dumps({"type": "session.update", "model": "w"}))
        await ws.send_str(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA"}))
        assert (await receive(ws))["type"] == "transcription.delta"
    assert proxy.engine_starts("secret") == 0
    await left_nothing(proxy, spool_dir)


# -- form uploads -----------------------------------------------------------------------------

B = BOUNDARY.encode()
MODEL_PART = field("model", b"w")
#: A file part's head, its content to follow.
FILE = b'--%b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n' % B
CLOSE = b"\r\n--%b--\r\n" % B


def speech_config(tmp_path: Path, **server: Any) -> Any:
    env = FakeEngine(upload_log=tmp_path / "uploads.jsonl", tokens=4).env()
    models = {"whisper": {"model": "org/whisper", "aliases": ["w"], "env": env}}
    return make_config(tmp_path, models, server=server)


HOSTILE_FORMS: list[tuple[str, bytes, str]] = [
    ("a-delimiter-in-the-audio-followed-by-junk",
     MODEL_PART + FILE + b"abc\r\n--" + B + b"junk\r\n" + CLOSE, "text after a boundary"),
    ("no-closing-boundary", MODEL_PART + FILE + AUDIO, "truncated"),
    ("closing-boundary-cut-in-half", MODEL_PART + FILE + AUDIO + CLOSE[:10], "truncated"),
    ("headers-that-never-end", MODEL_PART + b"--" + B + b"\r\nX-A: b\r\n" * 3, "truncated"),
    ("a-20-kib-part-header",
     MODEL_PART + b"--" + B + b"\r\nX-Pad: " + b"p" * 20_000 + b"\r\n\r\nx" + CLOSE, "16384"),
    ("a-header-without-colon", b"--" + B + b"\r\nno colon here\r\n\r\nw" + CLOSE, "colon"),
    ("1001-tiny-parts", MODEL_PART + field("x", b"") * 1000 + CLOSE[2:], "more than 1000"),
    ("model-only-inside-a-nested-multipart",
     b"--" + B + b"\r\nContent-Disposition: form-data; name=\"file\"\r\nContent-Type: "
     b"multipart/mixed; boundary=inner\r\n\r\n--inner\r\nContent-Disposition: form-data; "
     b"name=\"model\"\r\n\r\nw\r\n--inner--" + CLOSE, "'model' is required"),
    ("model-as-a-file-by-filename-star",
     b"--" + B + b"\r\nContent-Disposition: form-data; name=model; filename*=UTF-8''m.txt"
     b"\r\n\r\nw" + CLOSE, "not a file"),
    ("model-twice-second-after-the-file", MODEL_PART + FILE + AUDIO + b"\r\n" + MODEL_PART
     + CLOSE[2:], "more than once"),
    ("lf-line-endings", MODEL_PART.replace(b"\r\n", b"\n") + b"--" + B + b"--\n", "truncated"),
    ("an-empty-body", b"", "no part"),
    ("a-model-longer-than-1-kib", field("model", b"w" * 2000) + CLOSE[2:], "longer than 1024"),
]  # fmt: skip


async def test_hostile_forms_are_openai_shaped_400s_that_reach_no_engine(
    tmp_path: Path, start_proxy: StartProxy, spool_dir: Path
) -> None:
    proxy = await start_proxy(speech_config(tmp_path))
    for name, body, fragment in HOSTILE_FORMS:
        status, data = await post_raw(
            proxy, "/v1/audio/transcriptions", body, **{"Content-Type": FORM}
        )
        assert_clean_error(status, data, 400)
        assert fragment in data["error"]["message"], (name, data)
    # Two boundary parameters: the proxy and vLLM's parser would read different forms.
    body = form(field("model", b"w"), field("file", AUDIO, "a.wav"))
    for content_type in (
        f"{FORM}; boundary=other",
        f"multipart/form-data; boundary=x; {FORM[21:]}",
    ):
        status, data = await post_raw(
            proxy, "/v1/audio/transcriptions", body, **{"Content-Type": content_type}
        )
        assert_clean_error(status, data, 400)
        assert "boundary" in data["error"]["message"]
    assert uploads(tmp_path) == [], "the engine never got a whole body"
    # The boundary's text inside the audio, not after a line break, is audio; a form closed
    # without a final line break, 999 small fields, an epilogue, are forms.
    tricky = b"x" + (b"--" + B + b"--\n\r--" + B + b"\r\n-" + B) * 100
    accepted = [
        MODEL_PART + FILE + tricky + CLOSE,
        MODEL_PART + FILE + AUDIO + CLOSE[:-2],
        MODEL_PART + field("x", b"1") * 998 + FILE + AUDIO + CLOSE + b"epilogue --" + B,
        b"preamble " + b"\r\n--" + B + b"\r\n" + MODEL_PART[len(B) + 4 :] + FILE + b"x" + CLOSE,
    ]
    for body in accepted:
        status, data = await post_raw(
            proxy, "/v1/audio/transcriptions", body, **{"Content-Type": FORM}
        )
        assert status == 200, data
    seen = uploads(tmp_path)
    assert [u["files"]["file"]["length"] for u in seen] == [len(tricky), len(AUDIO), len(AUDIO), 1]
    assert all(u["fields"]["model"] == "whisper" for u in seen)
    await left_nothing(proxy, spool_dir)


async def test_a_gzip_bomb_upload_is_a_413_as_it_inflates(
    tmp_path: Path, start_proxy: StartProxy, spool_dir: Path
) -> None:
    import gzip

    proxy = await start_proxy(speech_config(tmp_path, max_body_mb=1))
    bomb = gzip.compress(FILE + b"\0" * (64 << 20) + CLOSE + MODEL_PART, 9)  # model last: spooled
    assert len(bomb) < 256 * 1024
    began = time.monotonic()
    status, data = await post_raw(
        proxy,
        "/v1/audio/transcriptions",
        bomb,
        **{"Content-Type": FORM, "Content-Encoding": "gzip"},
    )
    assert_clean_error(status, data, 413)
    assert time.monotonic() - began < 10
    assert uploads(tmp_path) == [] and proxy.model("whisper").instances == []
    await left_nothing(proxy, spool_dir)


async def raw_post(
    proxy: RunningProxy,
    head_length: int | None,
    first: bytes,
    path: str = "/v1/audio/transcriptions",
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A form upload sent by hand: its head (with `head_length`, else chunked) and `first`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    framing = f"Content-Length: {head_length}" if head_length else "Transfer-Encoding: chunked"
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {FORM}\r\n{framing}\r\n\r\n".encode()
        + first
    )
    await writer.drain()
    return reader, writer


async def answer_of(reader: asyncio.StreamReader, within: float) -> bytes:
    return await asyncio.wait_for(reader.read(65536), within)


async def test_slow_loris_uploads_are_408s_within_body_timeout_s(
    tmp_path: Path, start_proxy: StartProxy, spool_dir: Path
) -> None:
    proxy = await start_proxy(speech_config(tmp_path, body_timeout_s=1))
    began = time.monotonic()
    # Stalls before its model is known; stalls after 512 KiB of audio, spooled, model to come.
    stalled = await raw_post(proxy, 10_000_000, MODEL_PART[:20])
    spooled = await raw_post(proxy, 10_000_000, FILE + AUDIO * 8)
    await wait_for(lambda: bool(open_spools(spool_dir)), what="the audio spooled to a file")
    # Trickles a byte at a time: always sending, never done.
    trickle = await raw_post(proxy, 10_000_000, b"")
    for byte in MODEL_PART[:30]:
        trickle[1].write(bytes([byte]))
        await trickle[1].drain()
        if trickle[0].at_eof() or trickle[0]._buffer:  # (answered already)
            break
        await asyncio.sleep(0.1)  # the client's pace, not a wait for the proxy
    for reader, writer in (stalled, spooled, trickle):
        answer = await answer_of(reader, 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
        assert b'"code": "request_timeout"' in answer and b"body_timeout_s" in answer
    assert time.monotonic() - began < 6
    assert proxy.model("whisper").instances == []
    await left_nothing(proxy, spool_dir)


async def test_stalled_uploads_spool_at_most_max_spool_mb_in_all(
    tmp_path: Path, start_proxy: StartProxy, spool_dir: Path
) -> None:
    """Uploads with their model after the file, stalled mid-file, spooled without a bound in
    all (20 of them: 613 MiB with ``max_bodies_mb: 64``; RAM where the temporary directory is
    a tmpfs). The spool files of all uploads are bounded by ``max_spool_mb``: past it 503 +
    Retry-After, while an upload that names its model first still goes; a stalled client's
    bytes are given back when it goes."""
    proxy = await start_proxy(speech_config(tmp_path, max_body_mb=2, max_spool_mb=2))
    spools = proxy.server.runtime.proxy.spools
    stalled = []
    for _ in range(2):  # 1.1 MiB each, 0.9 MiB of it spooled
        stalled.append(await raw_post(proxy, 2_000_000, FILE + AUDIO * 18))
    await wait_for(lambda: spools.held >= 2 * 800 * 1024, what="two uploads spooled")
    reader, over = await raw_post(proxy, 2_000_000, FILE + AUDIO * 18)
    try:
        answer = await answer_of(reader, 10)
        assert answer.startswith(b"HTTP/1.1 503"), answer[:300]
        assert b"Retry-After" in answer and b'"code": "upload_spool_full"' in answer
        assert b"server.max_spool_mb" in answer
    finally:
        over.close()
    assert spools.held <= 2 * 1024 * 1024
    body = MODEL_PART + FILE + AUDIO + CLOSE  # the model first: never spooled
    status, data = await post_raw(proxy, "/v1/audio/transcriptions", body, **{"Content-Type": FORM})
    assert status == 200, data
    for _, writer in stalled:
        writer.close()
    await wait_for(lambda: spools.held == 0, what="the spooled bytes given back")
    await left_nothing(proxy, spool_dir)


async def test_a_client_gone_mid_upload_leaves_no_spool_file_no_lease_and_no_ticket(
    tmp_path: Path, start_proxy: StartProxy, spool_dir: Path
) -> None:
    cfg = speech_config(tmp_path)
    cfg.models["whisper"].env.update(FakeEngine(startup_delay=1.5).env())
    proxy = await start_proxy(cfg)
    model = proxy.model("whisper")
    # 1. While its audio is spooled before the model is known.
    _, writer = await raw_post(proxy, 10_000_000, FILE + AUDIO * 8)
    await wait_for(lambda: bool(open_spools(spool_dir)), what="the audio spooled")
    writer.transport.abort()
    await left_nothing(proxy, spool_dir)
    # 2. While the engine it needs starts (chunked, model first).
    chunk = MODEL_PART + FILE + AUDIO
    _, writer = await raw_post(proxy, None, b"%x\r\n%b\r\n" % (len(chunk), chunk))
    await wait_for(lambda: model.state() is State.STARTING, what="the engine starting")
    writer.transport.abort()
    await left_nothing(proxy, spool_dir)
    await wait_for(lambda: model.serving() is not None, what="the start went on")
    # 3. Spooled, then passed on under the lease, and gone half-way.
    first = FILE + AUDIO * 8 + b"\r\n" + MODEL_PART + FILE.replace(b'"file"', b'"more"')
    _, writer = await raw_post(proxy, 20_000_000, first + AUDIO * 16)
    inst = model.serving()
    assert inst is not None
    await wait_for(lambda: inst.leases == 1, what="the upload under its lease")
    writer.transport.abort()
    await left_nothing(proxy, spool_dir)
    assert uploads(tmp_path) == []
    good = form(field("model", b"w"), field("file", AUDIO, "a.wav"))
    status, data = await post_raw(proxy, "/v1/audio/transcriptions", good, **{"Content-Type": FORM})
    assert status == 200, data
    await left_nothing(proxy, spool_dir)


async def test_bodies_sent_one_byte_per_http_chunk_cost_neither_memory_nor_minutes(
    tmp_path: Path, start_proxy: StartProxy, spool_dir: Path
) -> None:
    """Each HTTP chunk was read as a piece of its own: a byte per chunk made a Python object
    of every byte (a 2 MB JSON body held ~26 MiB), and a scan step of every byte of a form
    (2 MB took ~18 s of the proxy's CPU)."""
    proxy = await start_proxy(speech_config(tmp_path))
    size = 2 * 1024 * 1024
    json_body = json.dumps({"prompt": "x" * size, "model": "nope"}).encode()
    form_body = FILE + b"x" * size + b"\r\n" + field("model", b"nope") + CLOSE[2:]
    for path, content_type, body in (
        ("/v1/completions", "application/json", json_body),
        ("/v1/audio/transcriptions", FORM, form_body),
    ):
        wire = b"".join(b"1\r\n%c\r\n" % c for c in body) + b"0\r\n\r\n"
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
        _peak_rss_reset()
        before, began = _peak_rss(), time.monotonic()
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        for i in range(0, len(wire), 1 << 16):
            writer.write(wire[i : i + (1 << 16)])
            await writer.drain()
        answer = await answer_of(reader, 60)
        took, grown = time.monotonic() - began, _peak_rss() - before
        writer.close()
        assert answer.startswith(b"HTTP/1.1 404"), answer[:300]
        assert grown < 8 * 2**20, f"{path}: the peak RSS grew by {grown / 2**20:.1f} MiB"
        assert took < 8, f"{path}: {took:.1f}s"
    await left_nothing(proxy, spool_dir)


# -- the realtime WebSocket -------------------------------------------------------------------


def realtime_config(tmp_path: Path, **server: Any) -> Any:
    models = {
        "whisper": {"model": "org/whisper", "aliases": ["w"], "loading_keepalive_interval_s": 0.2}
    }
    return make_config(tmp_path, models, server={"body_timeout_s": 1, **server})


async def closed_with(ws: aiohttp.ClientWebSocketResponse, within: float = 10) -> int | None:
    """Read to the close; its code."""
    while True:
        msg = await asyncio.wait_for(ws.receive(), within)
        if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
            return ws.close_code


async def test_realtime_clients_that_never_name_a_model_are_closed_within_body_timeout_s(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(realtime_config(tmp_path, max_body_mb=0.1))
    url = proxy.url + "/v1/realtime"
    began = time.monotonic()
    async with proxy.http.ws_connect(url) as ws:  # says nothing
        assert (await receive(ws))["type"] == "session.created"
        event = await receive(ws)
        assert event["type"] == "error" and event["code"] == "invalid_event", event
        assert "body_timeout_s" in event["error"]
        assert await closed_with(ws) == 1008
    assert time.monotonic() - began < 5
    for first in (b"\x00\x01binary", "not json", json.dumps({"type": "session.update"}),
                  json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA"}),
                  json.dumps({"type": "session.update", "model": ["w"]})):  # fmt: skip
        async with proxy.http.ws_connect(url) as ws:
            assert (await receive(ws))["type"] == "session.created"
            if isinstance(first, bytes):
                await ws.send_bytes(first)
            else:
                await ws.send_str(first)
            event = await receive(ws)
            assert event["type"] == "error" and event["code"] == "invalid_event", (first, event)
            assert await closed_with(ws) == 1008
    async with proxy.http.ws_connect(url, max_msg_size=0) as ws:  # a first frame too large
        assert (await receive(ws))["type"] == "session.created"
        await ws.send_str(json.dumps({"type": "session.update", "model": "w" * 200_000}))
        assert await closed_with(ws) in (1008, 1009)
    for leave in ("close", "abort"):  # gone before naming a model
        ws = await proxy.http.ws_connect(url)
        assert (await receive(ws))["type"] == "session.created"
        if leave == "close":
            await ws.close()
        else:
            ws._response.connection.transport.abort()  # type: ignore[union-attr]
    assert proxy.model("whisper").instances == []
    await left_nothing(proxy)


async def test_realtime_binary_and_oversized_frames_mid_session_end_only_that_session(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(realtime_config(tmp_path, max_body_mb=0.1))
    async with proxy.http.ws_connect(proxy.url + "/v1/realtime?model=w") as other:
        assert (await receive(other))["type"] == "session.created"
        async with proxy.http.ws_connect(proxy.url + "/v1/realtime?model=w") as ws:
            assert (await receive(ws))["type"] == "session.created"
            await ws.send_bytes(os.urandom(4096))  # passed on; the engine ignores it
            await ws.send_str(json.dumps({"type": "session.update", "model": "w"}))
            await ws.send_str(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA"}))
            assert (await receive(ws))["type"] == "transcription.delta"
            await ws.send_bytes(b"\0" * 200_000)  # over max_body_mb
            assert await closed_with(ws) == 1009
        inst = proxy.instance("whisper")
        await wait_for(lambda: inst.leases == 1, what="only the other session's lease left")
        await other.send_str(json.dumps({"type": "session.update", "model": "whisper"}))
        await other.send_str(json.dumps({"type": "input_audio_buffer.commit"}))
        await other.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA"}))
        assert (await receive(other))["type"] == "transcription.delta"
    await left_nothing(proxy)


async def test_an_engine_that_dies_mid_realtime_session_closes_the_client_with_1011(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(realtime_config(tmp_path))
    ws = await proxy.http.ws_connect(proxy.url + "/v1/realtime?model=w")
    assert (await receive(ws))["type"] == "session.created"
    inst = proxy.instance("whisper")
    assert inst.engine is not None
    inst.engine.kill()
    assert await closed_with(ws) == 1011
    await ws.close()
    await wait_for(lambda: inst.state is State.ERROR, what="the death noticed")
    await left_nothing(proxy)
    async with proxy.http.ws_connect(proxy.url + "/v1/realtime?model=w") as again:
        assert (await receive(again))["type"] == "session.created"


async def test_a_realtime_client_gone_while_its_engine_starts_or_mid_session_leaves_no_lease(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    cfg = realtime_config(tmp_path)
    cfg.models["whisper"].env.update(FakeEngine(startup_delay=1).env())
    proxy = await start_proxy(cfg)
    model = proxy.model("whisper")
    # Named in the URL: the engine starts before the upgrade; the client gives up meanwhile.
    connecting = asyncio.ensure_future(proxy.http.ws_connect(proxy.url + "/v1/realtime?model=w"))
    await wait_for(lambda: model.state() is State.STARTING, what="the engine starting")
    connecting.cancel()
    await left_nothing(proxy)
    # Named in the first event: the proxy has accepted; the client vanishes while it waits.
    await wait_for(lambda: model.serving() is not None, what="the start went on")
    ws = await proxy.http.ws_connect(proxy.url + "/v1/realtime")
    assert (await receive(ws))["type"] == "session.created"
    await ws.send_str(json.dumps({"type": "session.update", "model": "w"}))
    await wait_for(lambda: model.serving() is not None and model.serving().leases == 1)  # type: ignore[union-attr]
    ws._response.connection.transport.abort()  # type: ignore[union-attr]
    await left_nothing(proxy)
    sessions = proxy.server.runtime.realtime.sessions
    await wait_for(lambda: not sessions._closing, what="the engine's socket closed")


async def test_shutdown_closes_a_realtime_client_still_to_name_its_model_at_once(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(realtime_config(tmp_path, body_timeout_s=30, drain_timeout_s=30))
    ws = await proxy.http.ws_connect(proxy.url + "/v1/realtime")
    assert (await receive(ws))["type"] == "session.created"  # and then says nothing
    closing = asyncio.ensure_future(closed_with(ws, 30))
    began = time.monotonic()
    await asyncio.wait_for(proxy.server.shutdown(), 30)
    assert time.monotonic() - began < 2, "shutdown waited for a silent realtime client"
    assert await asyncio.wait_for(closing, 10) == 1001


async def test_a_realtime_client_that_goes_silent_without_closing_does_not_hold_its_lease(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """A client whose host vanished (no FIN, no close frame, no pong) would hold the engine's
    lease forever: the proxy pings it and drops it when no answer comes."""
    import base64

    proxy = await start_proxy(realtime_config(tmp_path, send_timeout_s=1))
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        "GET /v1/realtime?model=w HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 15)
    assert head.startswith(b"HTTP/1.1 101"), head
    inst = proxy.instance("whisper")
    assert inst.leases == 1
    began = time.monotonic()
    await wait_for(lambda: inst.leases == 0, 10, "the silent client dropped")
    assert time.monotonic() - began < 5
    writer.close()
    await left_nothing(proxy)


async def test_an_unknown_model_name_is_quoted_only_in_part(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """A client's huge ``model`` value is not echoed back whole in the 404."""
    proxy = await start_proxy(make_config(tmp_path))
    resp = await proxy.chat("x" * 100_000)
    assert resp.status == 404
    body = await resp.read()
    assert len(body) < 2_000 and b"x" * 200 + b"..." in body


async def raw_session(
    proxy: RunningProxy, path: str = "/v1/realtime?model=w"
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A realtime WebSocket opened by hand (its handshake answered 101)."""
    import base64

    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 15)
    assert head.startswith(b"HTTP/1.1 101"), head
    return reader, writer


def frame_head(length: int) -> bytes:
    """A client's binary frame head for `length` bytes, masked with a zero key (the payload
    goes as it is)."""
    return bytes([0x82, 0x80 | 127]) + length.to_bytes(8, "big") + b"\0\0\0\0"


async def read_until(reader: asyncio.StreamReader, mark: bytes, within: float = 10) -> bytes:
    """What the server sends until `mark` has come (or it closes)."""
    got = b""
    deadline = time.monotonic() + within
    while mark not in got:
        piece = await asyncio.wait_for(reader.read(65536), max(deadline - time.monotonic(), 0))
        if not piece:
            break
        got += piece
    return got


async def test_realtime_messages_count_in_max_bodies_mb_and_an_unfinished_one_times_out(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Realtime messages were outside the bodies' budget: 30 sockets each sending 30 MiB of a
    frame that never ended took the proxy from 60 to 960 MiB with ``max_bodies_mb: 64``, and
    a message never finished held its memory and the engine for good. Now the bytes count as
    they arrive: a session that would pass the budget gets an ``error`` event and is closed,
    and a message still arriving after ``body_timeout_s`` ends its session."""
    server = {"max_bodies_mb": 1, "max_body_mb": 1, "body_timeout_s": 2}
    proxy = await start_proxy(realtime_config(tmp_path, **server))
    bodies = proxy.server.runtime.proxy.bodies
    a_reader, a = await raw_session(proxy)
    a.write(frame_head(900_000) + b"\0" * 500_000)  # never finished
    await a.drain()
    await wait_for(lambda: bodies.held >= 500_000, what="the unfinished message counted")
    began = time.monotonic()
    b_reader, b = await raw_session(proxy)
    b.write(frame_head(900_000) + b"\0" * 600_000)
    await b.drain()
    assert b"request_bodies_full" in await read_until(b_reader, b"request_bodies_full")
    assert bodies.held <= 1024 * 1024
    got = await read_until(a_reader, b"request_timeout")
    assert b"request_timeout" in got and b"body_timeout_s" in got
    assert time.monotonic() - began < 2 + 3
    for writer in (a, b):
        writer.close()
    await wait_for(lambda: bodies.held == 0, what="every byte given back")
    await left_nothing(proxy)


async def test_realtime_sessions_are_bounded_in_time_in_number_and_in_connections(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """A silent session (pings answered) pinned its engine for ever, and 60 sessions opened 60
    engine connections with ``max_upstream_connections: 4``. A session with no message
    either way for ``realtime_idle_timeout_s`` is closed and its lease released; sessions per
    model are capped by ``max_realtime_sessions`` (503 + Retry-After); each holds a
    connection of its model's share (503 ``connections_busy`` past it)."""
    server = {
        "realtime_idle_timeout_s": 1.5,
        "max_realtime_sessions": 2,
        "max_upstream_connections": 2,
        "connection_queue_timeout_s": 0.5,
        "send_timeout_s": 0.5,  # pinged often: answering pings is not a message
    }
    proxy = await start_proxy(realtime_config(tmp_path, **server))
    url = proxy.url + "/v1/realtime?model=w"
    # Idle: closed with an error event naming the key, its lease released.
    began = time.monotonic()
    async with proxy.http.ws_connect(url) as ws:
        assert (await receive(ws))["type"] == "session.created"
        inst = proxy.instance("whisper")
        assert inst.leases == 1
        event = await receive(ws)
        assert event["type"] == "error" and event["code"] == "session_idle", event
        assert "realtime_idle_timeout_s" in event["error"]
        assert await closed_with(ws) == 1008
    assert 1.5 <= time.monotonic() - began < 5
    await wait_for(lambda: inst.leases == 0, what="the idle session's lease released")
    # Two sessions take the model's two connections: a request of the model waits for one,
    # then 503; a third session is one over max_realtime_sessions: refused at once.
    sessions = [await proxy.http.ws_connect(url) for _ in range(2)]
    try:
        for ws in sessions:
            assert (await receive(ws))["type"] == "session.created"
        async with proxy.http.post(
            proxy.url + "/v1/completions", json={"model": "w", "prompt": "hi", "max_tokens": 1}
        ) as r:
            assert r.status == 503, await r.text()
            assert (await r.json())["error"]["code"] == "connections_busy"
        sent = time.monotonic()
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await proxy.http.ws_connect(url)
        assert refused.value.status == 503
        assert refused.value.headers is not None and refused.value.headers["Retry-After"]
        assert time.monotonic() - sent < 0.4, "refused at once, not after a wait"
    finally:
        for ws in sessions:
            await ws.close()
    await left_nothing(proxy)


async def test_an_api_key_may_have_at_most_its_max_realtime_sessions(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """One key's sessions are bounded by its own ``max_realtime_sessions``: past it 429 +
    Retry-After before the upgrade, while another key still opens sessions of that model."""
    keys = [{"key": "kiosk", "max_realtime_sessions": 1}, "other"]
    proxy = await start_proxy(realtime_config(tmp_path, api_keys=keys))
    url = proxy.url + "/v1/realtime?model=w"

    def bearer(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    async with proxy.http.ws_connect(url, headers=bearer("kiosk")) as ws:
        assert (await receive(ws))["type"] == "session.created"
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await proxy.http.ws_connect(url, headers=bearer("kiosk"))
        assert refused.value.status == 429
        assert refused.value.headers is not None and refused.value.headers["Retry-After"]
        async with proxy.http.ws_connect(url, headers=bearer("other")) as other:
            assert (await receive(other))["type"] == "session.created"
    sessions = proxy.server.runtime.realtime.sessions
    await wait_for(lambda: not sessions.by_key, what="the key's session counted out")
    async with proxy.http.ws_connect(url, headers=bearer("kiosk")) as again:  # room again
        assert (await receive(again))["type"] == "session.created"
    await left_nothing(proxy)
