"""Component tests: the HTTP surface (errors, auth, streaming, metrics) with the fake engine."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import aiohttp
import pytest
from kit import FakeEngine, StartProxy, make_config
from prometheus_client.parser import text_string_to_metric_families


def assert_openai_error(body: dict, code: str | None = None) -> dict:  # type: ignore[type-arg]
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if code is not None:
        assert err["code"] == code
    return err  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("data", "status", "fragment"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b"", 400, "empty"),
        (b'{"messages": []}', 400, "'model' is required"),
        (b'{"model": 5}', 400, "'model' is required"),
        (b'{"model": "nope"}', 404, "Available models: m1, vad"),
    ],
)
async def test_bad_requests_get_openai_errors(
    tmp_path: Path, start_proxy: StartProxy, data: bytes, status: int, fragment: str
) -> None:
    cfg = make_config(tmp_path, {"m1": {"model": "x", "aliases": ["vad"]}})
    proxy = await start_proxy(cfg)
    resp = await proxy.http.post(
        proxy.url + "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}
    )
    assert resp.status == status
    assert resp.content_type == "application/json"
    assert fragment in assert_openai_error(await resp.json())["message"]
    assert proxy.model("m1").instances == [], "bad input must not start an engine"


async def test_unknown_routes_and_methods_are_openai_errors(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(make_config(tmp_path))
    resp = await proxy.http.get(proxy.url + "/v1/nothing-here")
    assert resp.status == 404
    assert_openai_error(await resp.json(), "unknown_endpoint")
    resp = await proxy.http.get(proxy.url + "/v1/chat/completions")
    assert resp.status == 405
    assert_openai_error(await resp.json(), "method_not_allowed")


async def test_body_over_limit_is_413(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(make_config(tmp_path, server={"max_body_mb": 0.01}))
    big = json.dumps({"model": "m1", "prompt": "x" * 20000})
    resp = await proxy.http.post(proxy.url + "/v1/completions", data=big)
    assert resp.status == 413
    assert "max_body_mb" in assert_openai_error(await resp.json(), "request_too_large")["message"]
    small = await proxy.http.post(
        proxy.url + "/v1/completions", json={"model": "m1", "prompt": "x"}
    )
    assert small.status == 200


async def test_api_keys_guard_v1_but_not_health(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(make_config(tmp_path, server={"api_keys": ["k1", "k2"]}))
    url = proxy.url + "/v1/chat/completions"
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k1"}):
        resp = await proxy.http.post(url, json=body, headers=headers)
        assert resp.status == 401
        assert_openai_error(await resp.json(), "invalid_api_key")
    resp = await proxy.http.get(proxy.url + "/v1/models")
    assert resp.status == 401
    assert (await proxy.http.get(proxy.url + "/health")).status == 200
    for key in ("k1", "k2"):
        resp = await proxy.http.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
        assert resp.status == 200


async def test_models_lists_every_model_and_alias_with_state(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    cfg = make_config(
        tmp_path, {"a": {"model": "org/a", "aliases": ["a2"]}, "b": {"model": "org/b"}}
    )
    proxy = await start_proxy(cfg)
    listing = await (await proxy.http.get(proxy.url + "/v1/models")).json()
    assert listing["object"] == "list"
    cards = {c["id"]: c for c in listing["data"]}
    assert set(cards) == {"a", "a2", "b"}
    assert cards["a2"]["parent"] == "a" and cards["a2"]["root"] == "org/a"
    assert {c["state"] for c in cards.values()} == {"stopped"}
    one = await (await proxy.http.get(proxy.url + "/v1/models/a2")).json()
    assert one["id"] == "a2"
    missing = await proxy.http.get(proxy.url + "/v1/models/zzz")
    assert missing.status == 404


async def test_stream_passes_through_chunk_by_chunk(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    env = FakeEngine(tokens=5, token_delay=0.3).env()
    proxy = await start_proxy(make_config(tmp_path, {"m1": {"model": "x", "env": env}}))
    assert (await proxy.chat("m1", max_tokens=1)).status == 200  # warm up
    body = {
        "model": "m1",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}],
    }
    arrivals: list[tuple[float, bytes]] = []
    async with proxy.http.post(proxy.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["X-Accel-Buffering"] == "no"
        assert "Content-Encoding" not in resp.headers
        async for chunk in resp.content.iter_any():
            arrivals.append((time.monotonic(), chunk))
    text = b"".join(c for _, c in arrivals).decode()
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 5
    # Tokens arrive as the engine produces them: the first content arrives long before the end.
    first_content = next(t for t, c in arrivals if b'"content":"tok' in c)
    assert arrivals[-1][0] - first_content > 0.6
    assert len(arrivals) >= 5


async def test_completions_and_embeddings_routes(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(make_config(tmp_path))
    resp = await proxy.http.post(
        proxy.url + "/v1/completions", json={"model": "m1", "prompt": "hello", "max_tokens": 3}
    )
    body = await resp.json()
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 3
    resp = await proxy.http.post(
        proxy.url + "/v1/embeddings", json={"model": "m1", "input": ["a", "b"]}
    )
    body = await resp.json()
    assert [d["index"] for d in body["data"]] == [0, 1]


async def test_engine_errors_pass_through_unchanged(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(make_config(tmp_path))
    resp = await proxy.http.post(proxy.url + "/v1/chat/completions", json={"model": "m1"})
    assert resp.status == 400  # the engine's validation error (no messages)
    assert_openai_error(await resp.json())


async def test_metrics_exposition(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(make_config(tmp_path))
    assert (await proxy.chat("m1")).status == 200
    assert (await proxy.chat("nope")).status == 404
    text = await (await proxy.http.get(proxy.url + "/metrics")).text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    assert samples[("vllm_requests_total", (("model_id", "m1"), ("status", "200")))] == 1
    assert samples[("vllm_request_duration_seconds_count", (("model_id", "m1"),))] == 1
    assert samples[("vllm_model_loaded", (("model_id", "m1"),))] == 1
    assert samples[("vllm_model_requests_active", (("model_id", "m1"),))] == 0
    assert samples[("vllm_proxy_model_state", (("model_id", "m1"), ("state", "running")))] == 1
    running = (("instance", "m1#1"), ("model_id", "m1"), ("state", "running"))
    assert samples[("vllm_proxy_instance_state", running)] == 1
    assert samples[("vllm_proxy_instance_requests_active", running[:2])] == 0
    assert samples[("vllm_proxy_engine_start_duration_seconds_count", (("model_id", "m1"),))] == 1


async def test_health_and_shutdown_refusal(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(make_config(tmp_path))
    assert (await proxy.http.get(proxy.url + "/health")).status == 200
    proxy.manager.closing = True
    resp = await proxy.chat("m1")
    assert resp.status == 503
    assert resp.headers["Retry-After"]
    assert_openai_error(await resp.json(), "shutting_down")
    assert (await proxy.http.get(proxy.url + "/health")).status == 503


async def test_many_models_start_in_parallel(tmp_path: Path, start_proxy: StartProxy) -> None:
    env = FakeEngine(startup_delay=0.5).env()
    cfg = make_config(tmp_path, {f"m{i}": {"model": "x", "env": env} for i in range(3)})
    proxy = await start_proxy(cfg)
    results = await asyncio.gather(*(proxy.chat(f"m{i}") for i in range(3)))
    assert [r.status for r in results] == [200, 200, 200]
    ports = {proxy.instance(f"m{i}").engine.port for i in range(3)}
    assert len(ports) == 3


async def test_sse_error_event_on_upstream_read_timeout(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    env = FakeEngine(tokens=3, token_delay=5).env()
    cfg = make_config(tmp_path, {"m1": {"model": "x", "env": env}}, engine={"read_timeout_s": 2})
    proxy = await start_proxy(cfg)
    resp = await proxy.chat("m1", stream=True)
    text = (await resp.read()).decode()
    assert "engine_read_timeout" in text and text.endswith("data: [DONE]\n\n")
    assert proxy.manager.active_leases() == 0


async def test_client_timeout_does_not_leak_leases(tmp_path: Path, start_proxy: StartProxy) -> None:
    env = FakeEngine(tokens=50, token_delay=0.05).env()
    proxy = await start_proxy(make_config(tmp_path, {"m1": {"model": "x", "env": env}}))
    assert (await proxy.chat("m1", max_tokens=1)).status == 200
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as client:
        body = {"model": "m1", "messages": [{"role": "user", "content": "x"}]}
        with pytest.raises(asyncio.TimeoutError):
            await client.post(proxy.url + "/v1/chat/completions", json=body)
    from kit import wait_for

    await wait_for(lambda: proxy.manager.active_leases() == 0, what="lease released")


def _garbage(rng: random.Random) -> tuple[bytes, dict[str, str]]:
    """A random malformed (or just odd) request body and headers."""
    kind = rng.randrange(8)
    headers = {"Content-Type": rng.choice(["application/json", "text/plain", "", "a/b; x=1"])}
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 300)), headers
    if kind == 1:
        return json.dumps(rng.choice([None, 1, "s", [], [1], True])).encode(), headers
    if kind == 2:
        return json.dumps({"model": rng.choice([None, 1, [], {}, "", "x" * 300])}).encode(), headers
    if kind == 3:
        return b'{"model": "m1", "messages": ' + rng.randbytes(20), headers
    if kind == 4:
        return json.dumps({"model": "m1\u0000\ud7ff", "prompt": "x"}).encode(), headers
    if kind == 5:
        return b"\xff\xfe" + "{}".encode("utf-16-le"), headers
    if kind == 6:
        return json.dumps({"model": "nope", "messages": []}).encode(), headers
    return b"{" * 10000, headers


async def test_garbage_never_breaks_the_proxy_or_other_clients(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    env = FakeEngine(tokens=20, token_delay=0.05).env()
    proxy = await start_proxy(make_config(tmp_path, {"m1": {"model": "x", "env": env}}))
    stream = await proxy.chat("m1", stream=True)  # a good client, in flight the whole time
    rng = random.Random(1234)
    url = proxy.url + "/v1/chat/completions"
    for _ in range(200):
        body, headers = _garbage(rng)
        async with proxy.http.post(url, data=body, headers=headers) as resp:
            assert 400 <= resp.status < 500, (body[:80], resp.status)
            assert_openai_error(await resp.json())
    text = (await stream.read()).decode()
    assert text.endswith("data: [DONE]\n\n") and '"error"' not in text
    assert (await proxy.chat("m1")).status == 200
    assert proxy.manager.active_leases() == 0
