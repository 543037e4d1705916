"""Component tests: admin API, hot reload with per-model isolation, prefixed routes, metrics."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import yaml
from kit import FAKE_ENGINE, FakeEngine, StartProxy, make_config, wait_for
from kit.metrics import proxy_samples
from prometheus_client.parser import text_string_to_metric_families

from vllm_proxy.engines.instance import Instance
from vllm_proxy.engines.states import State

ADMIN = {"Authorization": "Bearer adm"}


def write(path: Path, models: dict[str, Any], **server: Any) -> Path:
    data = {
        "server": {
            "host": "127.0.0.1",
            "port": 0,
            "state_dir": str(path.parent / "state"),
            "admin_api_keys": ["adm"],
            **server,
        },
        "engine": {"command": FAKE_ENGINE, "stop_timeout_s": 5, "port_range": [20000, 29999]},
        "models": models,
    }
    path.write_text(yaml.safe_dump(data))
    return path


async def test_admin_api_needs_a_key_or_explicit_opening(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    closed = await start_proxy(make_config(tmp_path / "a"))
    resp = await closed.http.get(closed.url + "/admin/models")
    assert resp.status == 403
    assert "admin_api_keys" in (await resp.json())["error"]["message"]
    keyed = await start_proxy(make_config(tmp_path / "b", server={"admin_api_keys": ["adm"]}))
    assert (await keyed.http.get(keyed.url + "/admin/models")).status == 401
    bad = await keyed.http.get(keyed.url + "/admin/models", headers={"Authorization": "Bearer x"})
    assert bad.status == 401
    ok = await keyed.http.get(keyed.url + "/admin/models", headers=ADMIN)
    assert ok.status == 200
    opened = await start_proxy(make_config(tmp_path / "c", server={"admin_open": True}))
    assert (await opened.http.get(opened.url + "/admin/models")).status == 200
    # The model API keys do not open the admin API, and the admin key does not open /v1.
    both = make_config(tmp_path / "d", server={"api_keys": ["user"], "admin_api_keys": ["adm"]})
    p = await start_proxy(both)
    user = {"Authorization": "Bearer user"}
    assert (await p.http.get(p.url + "/admin/models", headers=user)).status == 401
    assert (await p.http.get(p.url + "/v1/models", headers=ADMIN)).status == 401


async def test_admin_models_load_unload_pin_logs(tmp_path: Path, start_proxy: StartProxy) -> None:
    cfg = make_config(tmp_path, {"m1": {"model": "org/m1", "aliases": ["one"]}},
                      server={"admin_open": True})  # fmt: skip
    proxy = await start_proxy(cfg)
    url = proxy.url + "/admin/models"
    view = await (await proxy.http.get(url)).json()
    row = view["models"][0]
    assert row["name"] == "m1" and row["state"] == "stopped" and row["aliases"] == ["one"]
    assert row["instances"] == [] and row["last_instance"] is None
    assert row["base_urls"] == {"v1": proxy.url + "/v1", "serve": proxy.url + "/serve/m1/v1"}
    assert view["proxy"]["memory"] == "none" and view["gpus"] == []

    loaded = await (await proxy.http.post(url + "/one/load")).json()
    assert loaded["state"] == "running" and loaded["leases"] == 0
    [inst] = loaded["instances"]
    assert inst["id"] == "m1#1" and inst["state"] == "running" and inst["pid"] and inst["socket"]
    pinned = await (await proxy.http.post(url + "/m1/pin")).json()
    assert pinned["pinned"] is True
    assert (await (await proxy.http.post(url + "/m1/unpin")).json())["pinned"] is False

    logs = await proxy.http.get(url + "/m1/logs?tail=5")
    text = await logs.text()
    assert logs.status == 200 and "Application startup complete" in text
    assert text.startswith("==> m1#1 (running) <==\n")
    assert len(text.splitlines()) <= 6  # the header and 5 lines
    for bad in ("abc", "nan", "inf", "0"):
        resp = await proxy.http.get(url + f"/m1/logs?tail={bad}")
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "tail"
    assert (await proxy.http.get(url + "/m1/logs?instance=m1%239")).status == 404

    stopped = await (await proxy.http.post(url + "/m1/unload")).json()
    assert stopped["state"] == "stopped" and stopped["instances"] == []
    # The ended instance is still described, without a pid or port of a process that is gone.
    gone = stopped["last_instance"]
    assert gone["id"] == "m1#1" and gone["state"] == "stopped"
    assert gone["pid"] is None and gone["port"] is None
    logs = await proxy.http.get(url + "/m1/logs?instance=m1%231")
    assert "==> m1#1 (stopped) <==" in await logs.text()
    missing = await proxy.http.post(url + "/nope/load")
    assert missing.status == 404
    assert "Available models: m1, one" in (await missing.json())["error"]["message"]


async def test_unload_waits_for_in_flight_requests(tmp_path: Path, start_proxy: StartProxy) -> None:
    env = FakeEngine(tokens=10, token_delay=0.1).env()
    cfg = make_config(tmp_path, {"m1": {"model": "x", "env": env}}, server={"admin_open": True})
    proxy = await start_proxy(cfg)
    stream = await proxy.chat("m1", stream=True)
    await stream.content.readany()
    unload = await proxy.http.post(proxy.url + "/admin/models/m1/unload")
    assert (await stream.read()).endswith(b"data: [DONE]\n\n")  # finished, not cut
    assert (await unload.json())["state"] == "stopped"


async def test_reload_isolates_models(tmp_path: Path, start_proxy: StartProxy) -> None:
    """Unchanged models keep pid and port while others are added, changed and removed."""
    path = write(
        tmp_path / "config.yaml",
        {
            "keep": {"model": "org/keep"},
            "change": {"model": "org/change", "env": {"X": "1"}},
            "remove": {"model": "org/remove"},
        },
    )
    proxy = await start_proxy.file(path)
    http, url = proxy.http, proxy.url

    async def chat(model: str) -> int:
        body = {"model": model, "messages": [{"role": "user", "content": "x"}]}
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            await r.read()
            return r.status

    for name in ("keep", "change", "remove"):
        assert await chat(name) == 200
    mgr = proxy.manager

    def serving(name: str) -> Instance:
        inst = mgr.models[name].serving()
        assert inst is not None
        return inst

    keep = serving("keep")
    keep_pid, keep_port = keep.engine.pid, keep.engine.port  # type: ignore[union-attr]
    old_change = serving("change")
    old_change_pid = old_change.engine.pid  # type: ignore[union-attr]
    removed = serving("remove")
    removed_pid = removed.engine.pid  # type: ignore[union-attr]

    write(
        path,
        {
            "keep": {"model": "org/keep", "aliases": ["k"], "idle_timeout_s": 900},
            "change": {"model": "org/change", "env": {"X": "2"}},
            "added": {"model": "org/added"},
        },
    )
    async with http.post(url + "/admin/reload", headers=ADMIN) as r:
        report = await r.json()
    assert r.status == 200, report
    assert report["kept"] == ["keep"] and report["restarted"] == ["change"]
    assert report["added"] == ["added"] and report["removed"] == ["remove"]

    assert await chat("remove") == 404
    await wait_for(lambda: removed.state is State.STOPPED, what="removed model stopped")
    await wait_for(lambda: old_change.state is State.STOPPED, what="old instance stopped")
    await wait_for(lambda: mgr.models["change"].serving(), what="changed model restarted")
    changed = serving("change")
    assert changed.id == "change#2" and changed.spec.env == (("X", "2"),)
    assert changed.engine.pid != old_change_pid  # type: ignore[union-attr]
    assert await chat("added") == 200
    assert await chat("k") == 200  # the new alias of the kept model
    assert serving("keep") is keep
    assert (keep.engine.pid, keep.engine.port) == (keep_pid, keep_port)  # type: ignore[union-attr]
    assert keep.spec.idle_timeout_s == 900
    assert removed_pid != keep_pid

    # An invalid config is rejected as a whole; the running one stays.
    write(path, {"keep": {"model": "org/keep", "args": {"port": 1}}})
    async with http.post(url + "/admin/reload", headers=ADMIN) as r:
        err = await r.json()
    assert r.status == 400 and err["error"]["code"] == "invalid_config"
    assert "models.keep.args.port: reserved" in err["error"]["message"]
    assert set(mgr.models) == {"keep", "change", "added"}
    assert keep.engine.pid == keep_pid  # type: ignore[union-attr]


async def test_sighup_reloads(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    from kit import free_port

    port = free_port()
    path = write(tmp_path / "c.yaml", {"a": {"model": "x"}}, port=port)
    proc = subprocess.Popen([sys.executable, "-m", "vllm_proxy", "--config", str(path)])
    try:
        import aiohttp

        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{port}/v1/models"

            async def ids() -> set[str]:
                try:
                    async with http.get(url) as r:
                        return {c["id"] for c in (await r.json())["data"]}
                except aiohttp.ClientError:
                    return set()

            await wait_for(lambda: _eq(ids(), {"a"}), what="proxy up")
            write(path, {"a": {"model": "x"}, "b": {"model": "y"}}, port=port)
            proc.send_signal(signal.SIGHUP)
            await wait_for(lambda: _eq(ids(), {"a", "b"}), what="b added by SIGHUP")
    finally:
        proc.terminate()
        assert await asyncio.to_thread(proc.wait, 30) == 0


async def _eq(got: Any, want: set[str]) -> bool:
    return bool(await got == want)


async def test_prefixed_routes(tmp_path: Path, start_proxy: StartProxy) -> None:
    cfg = make_config(tmp_path, {"a": {"model": "x", "aliases": ["al"]}, "b": {"model": "y"}})
    proxy = await start_proxy(cfg)
    body = {"messages": [{"role": "user", "content": "hi"}]}  # no model: the path names it
    resp = await proxy.http.post(proxy.url + "/serve/al/v1/chat/completions", json=body)
    assert resp.status == 200 and (await resp.json())["model"] == "a"
    resp = await proxy.http.post(
        proxy.url + "/serve/b/v1/completions", json={"model": "a", "prompt": "x"}
    )
    assert (await resp.json())["model"] == "b"  # the path wins over the body
    listing = await (await proxy.http.get(proxy.url + "/serve/b/v1/models")).json()
    assert [c["id"] for c in listing["data"]] == ["b"]
    resp = await proxy.http.post(proxy.url + "/serve/zz/v1/completions", json={"prompt": "x"})
    assert resp.status == 404


async def test_token_and_ttfb_metrics(tmp_path: Path, start_proxy: StartProxy) -> None:
    env = FakeEngine(tokens=7).env()
    proxy = await start_proxy(make_config(tmp_path, {"m1": {"model": "x", "env": env}}))
    assert (await proxy.chat("m1")).status == 200  # 7 completion tokens
    stream = await proxy.chat("m1", stream=True, stream_options={"include_usage": True})
    await stream.read()  # 7 more, from the final usage chunk
    plain = await proxy.chat("m1", stream=True)  # no usage chunk: counts nothing
    await plain.read()
    samples = await proxy_samples(proxy)
    assert samples.at('vllm_proxy_completion_tokens_total{model_id="m1"}') == 14
    assert (samples.at('vllm_proxy_prompt_tokens_total{model_id="m1"}') or 0) > 0
    assert samples.at('vllm_proxy_time_to_first_byte_seconds_count{model_id="m1"}') == 3


async def test_engine_metrics_are_relabelled(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(make_config(tmp_path, {"a": {"model": "x"}, "b": {"model": "y"}}))
    for name in ("a", "b"):
        assert (await proxy.chat(name)).status == 200
    text = await (await proxy.http.get(proxy.url + "/metrics/engines")).text()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    running = fams["vllm:num_requests_running"]
    assert {s.labels["model_id"] for s in running.samples} == {"a", "b"}
    assert {s.labels["instance"] for s in running.samples} == {"a#1", "b#1"}
    assert all(s.name.startswith("vllm:") for f in fams.values() for s in f.samples)


def test_tap_finds_usage_across_chunks() -> None:
    from vllm_proxy.frontend.serving import Tap

    tap = Tap()
    event = json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}})
    data = f"data: {event}\n\ndata: [DONE]\n\n".encode()
    cut = data.index(b'"usage":') + 12  # the usage object straddles two chunks
    tap.feed(data[:cut])
    tap.feed(data[cut:])
    assert tap.tokens() == (3, 5)
    whole = Tap()
    whole.feed(data)
    assert whole.tokens() == (3, 5)
    assert Tap().tokens() is None
