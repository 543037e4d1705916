"""API keys that carry limits (``server.api_keys`` entries with ``name``,
``max_concurrent_requests``, ``max_requests_per_minute`` and ``priority``): the counting itself
without an event loop, the config and its errors, the 429 on every route that reaches an engine
(uploads and realtime sessions included), reloads, the admission queue and the per-key series."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kit import FakeEngine, RunningProxy, StartProxy, chat_body, make_config, wait_for
from kit.forms import AUDIO, FORM, field, form, receive
from kit.load import Served, busy, one_slot
from kit.metrics import proxy_samples

from vllm_proxy.config import parse_config
from vllm_proxy.errors import ConfigError, TooManyRequests
from vllm_proxy.frontend.keys import KeyLimits, KeyRing
from vllm_proxy.planning.queueing import Queue

#: Streams of 40 tokens, 50 ms apart: in flight for about 2 s.
SLOW = FakeEngine(tokens=40, token_delay=0.05).env()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def scope_of(entry: dict[str, Any]) -> Any:
    cfg = parse_config({"server": {"api_keys": [entry]}, "models": {"m": {"model": "x"}}})
    return KeyRing(cfg.server.api_keys).scopes()[0]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- the counting, without an event loop -------------------------------------------------------


def test_max_concurrent_requests_counts_requests_until_they_end() -> None:
    limits = KeyLimits()
    scope = scope_of({"key": "k", "max_concurrent_requests": 2})
    with limits.hold(scope), limits.hold(scope):
        with pytest.raises(TooManyRequests) as refused:
            limits.take(scope)
        err = refused.value
        assert err.status == 429 and err.code == "rate_limit_exceeded"
        assert err.reason == "concurrency" and err.headers == {"Retry-After": "1"}
        assert "max_concurrent_requests" in err.message
        assert limits.inflight == {scope.ident: 2}
    assert limits.inflight == {}  # released in finally, and nothing left behind


def test_max_requests_per_minute_is_a_sliding_window_with_the_wait_in_retry_after() -> None:
    clock = Clock()
    limits = KeyLimits(clock)
    scope = scope_of({"key": "k", "max_requests_per_minute": 2})
    for step in (0, 20):
        clock.now += step
        with limits.hold(scope):
            pass
    clock.now += 10  # starts at 0 and 20; now 30: the first leaves the window at 60
    with pytest.raises(TooManyRequests) as refused:
        limits.take(scope)
    assert refused.value.reason == "rate" and refused.value.headers == {"Retry-After": "30"}
    clock.now += 30  # the start at 0 has left the window
    with limits.hold(scope):
        pass
    with pytest.raises(TooManyRequests) as again:  # 20 and 60 in the window: 20 leaves at 80
        limits.take(scope)
    assert again.value.headers == {"Retry-After": "20"}
    assert limits.inflight == {}


def test_a_lowered_rate_counts_the_starts_already_made() -> None:
    clock = Clock()
    limits = KeyLimits(clock)
    wide = scope_of({"key": "k", "max_requests_per_minute": 5})
    for _ in range(4):
        clock.now += 1
        limits.hold(wide).__enter__()
    narrow = scope_of({"key": "k", "max_requests_per_minute": 2})
    assert narrow.ident == wide.ident  # the same key: the same counts
    limits.keep([narrow])
    with pytest.raises(TooManyRequests) as refused:
        limits.take(narrow)
    # Starts at 1001..1004, now 1004: three must leave; the third (1003) leaves at 1063.
    assert refused.value.headers == {"Retry-After": "59"}
    # A key that loses its rate forgets its window.
    limits.keep([scope_of({"key": "k"})])
    limits.take(narrow)


# -- config ------------------------------------------------------------------------------------


def test_limits_parse_and_label_each_key_without_its_secret() -> None:
    cfg = parse_config(
        {
            "server": {
                "api_keys": [
                    "plain-secret",
                    {
                        "key": "batch-secret",
                        "name": "batch",
                        "max_concurrent_requests": 4,
                        "max_requests_per_minute": 600,
                        "priority": 10,
                    },
                ]
            },
            "models": {"m": {"model": "x"}},
        }
    )
    plain, batch = KeyRing(cfg.server.api_keys).scopes()
    assert (plain.label, plain.max_concurrent_requests, plain.max_requests_per_minute) == (
        "key-0", None, None
    )  # fmt: skip
    assert plain.priority == 0
    assert (batch.label, batch.max_concurrent_requests, batch.max_requests_per_minute) == (
        "batch", 4, 600
    )  # fmt: skip
    assert batch.priority == 10


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        ([{"key": "a", "models": ["m"], "admin": True}], r"server\.api_keys\.0: admin: true with"),
        ([{"key": "a", "max_concurrent_requests": 0}], r"api_keys\.0\.max_concurrent_requests:"),
        ([{"key": "a", "max_requests_per_minute": 0}], r"api_keys\.0\.max_requests_per_minute:"),
        ([{"key": "a", "priority": "high"}], r"server\.api_keys\.0\.priority:"),
        ([{"key": "a", "name": "has space"}], r"server\.api_keys\.0\.name:"),
        (
            [{"key": "a", "name": "x"}, {"key": "b", "name": "x"}],
            r"server\.api_keys\.1\.name: 'x' already names server\.api_keys\.0",
        ),
        (["a", {"key": "b", "name": "key-0"}], r"api_keys\.1\.name: 'key-0' already names"),
    ],
)
def test_bad_limits_are_refused_with_their_path(entries: list[Any], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as err:
        parse_config({"server": {"api_keys": entries}, "models": {"m": {"model": "x"}}})
    assert "'a'" not in str(err.value) and "'b'" not in str(err.value)  # no secret shown


# -- on the model routes -----------------------------------------------------------------------


def limited(tmp_path: Path, *keys: Any, **server: Any) -> Any:
    models = {"m": {"model": "org/m", "aliases": ["w"], "env": SLOW}}
    return make_config(tmp_path, models, server={"api_keys": list(keys), **server})


async def chat(proxy: RunningProxy, key: str, **extra: Any) -> tuple[int, dict[str, str], Any]:
    url = proxy.url + "/v1/chat/completions"
    body = chat_body("m", max_tokens=1, **extra)
    async with proxy.http.post(url, json=body, headers=bearer(key)) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


def assert_rate_limited(status: int, headers: dict[str, str], body: Any, word: str) -> None:
    assert status == 429, body
    assert int(headers["Retry-After"]) >= 1
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
    assert word in err["message"]


async def test_a_key_at_max_concurrent_requests_gets_429_until_one_ends(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    keys = [{"key": "sk-batch-secret", "name": "batch", "max_concurrent_requests": 1}, "sk-other"]
    proxy = await start_proxy(limited(tmp_path, *keys))
    stream = await proxy.open_stream("m", **bearer("sk-batch-secret"))
    assert_rate_limited(*await chat(proxy, "sk-batch-secret"), "max_concurrent_requests")
    assert (await chat(proxy, "sk-other"))[0] == 200  # another key is not limited by it
    await stream.read()
    stream.release()
    limits = proxy.server.runtime.proxy.key_limits
    await wait_for(lambda: not limits.inflight, what="the stream counted out")
    assert (await chat(proxy, "sk-batch-secret"))[0] == 200
    samples = await proxy_samples(proxy)
    assert samples.get("vllm_proxy_key_rejected_total", key="batch", reason="concurrency") == 1
    assert samples.get("vllm_proxy_key_requests_total", key="batch") == 3
    assert samples.get("vllm_proxy_key_requests_total", key="key-1") == 1
    assert (samples.get("vllm_proxy_key_completion_tokens_total", key="batch") or 0) > 0


async def test_the_limit_holds_for_a_whole_upload_and_applies_to_upload_routes(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    keys = [{"key": "sk-up", "max_concurrent_requests": 1}]
    proxy = await start_proxy(limited(tmp_path, *keys))
    limits = proxy.server.runtime.proxy.key_limits
    go_on = asyncio.Event()
    upload = form(field("model", b"w"), field("file", AUDIO, "a.wav"))

    async def slowly() -> AsyncIterator[bytes]:
        yield upload[:40]
        await go_on.wait()
        yield upload[40:]

    url = proxy.url + "/v1/audio/transcriptions"
    headers = {"Content-Type": FORM, **bearer("sk-up")}
    sending = asyncio.ensure_future(proxy.http.post(url, data=slowly(), headers=headers))
    await wait_for(lambda: sum(limits.inflight.values()) == 1, what="the upload counted")
    # The upload still being sent holds the key's one request: a chat is refused ...
    assert_rate_limited(*await chat(proxy, "sk-up"), "max_concurrent_requests")
    # ... and so is a second upload, on either upload route.
    for path in ("/v1/audio/transcriptions", "/serve/w/v1/audio/translations"):
        async with proxy.http.post(proxy.url + path, data=upload, headers=headers) as r:
            body = await r.json()
            assert_rate_limited(r.status, dict(r.headers), body, "max_concurrent_requests")
    go_on.set()
    resp = await sending
    assert resp.status == 200, await resp.text()
    resp.release()
    await wait_for(lambda: not limits.inflight, what="the upload counted out")


async def test_a_realtime_session_counts_against_max_concurrent_requests(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    keys = [{"key": "sk-rt", "name": "kiosk", "max_concurrent_requests": 1}]
    proxy = await start_proxy(limited(tmp_path, *keys))
    url = proxy.url + "/v1/realtime?model=w"
    limits = proxy.server.runtime.proxy.key_limits
    async with proxy.http.ws_connect(url, headers=bearer("sk-rt")) as ws:
        assert (await receive(ws))["type"] == "session.created"
        assert_rate_limited(*await chat(proxy, "sk-rt"), "max_concurrent_requests")
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await proxy.http.ws_connect(url, headers=bearer("sk-rt"))
        assert refused.value.status == 429
        assert refused.value.headers is not None and refused.value.headers["Retry-After"]
    await wait_for(lambda: not limits.inflight, what="the session counted out")
    # A stream in flight refuses a session the same way.
    stream = await proxy.open_stream("m", **bearer("sk-rt"))
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await proxy.http.ws_connect(url, headers=bearer("sk-rt"))
    assert refused.value.status == 429
    await stream.read()
    stream.release()
    samples = await proxy_samples(proxy)
    assert samples.get("vllm_proxy_key_rejected_total", key="kiosk", reason="concurrency") == 3


async def test_max_requests_per_minute_refuses_with_the_seconds_to_wait(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    keys = [{"key": "sk-rpm", "name": "metered", "max_requests_per_minute": 2}]
    proxy = await start_proxy(limited(tmp_path, *keys))
    for _ in range(2):
        assert (await chat(proxy, "sk-rpm"))[0] == 200
    status, headers, body = await chat(proxy, "sk-rpm")
    assert_rate_limited(status, headers, body, "max_requests_per_minute")
    assert 50 <= int(headers["Retry-After"]) <= 60
    samples = await proxy_samples(proxy)
    assert samples.get("vllm_proxy_key_rejected_total", key="metered", reason="rate") == 1


async def test_a_reload_that_lowers_a_limit_drops_no_request_in_flight(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    cfg = limited(tmp_path, {"key": "sk-r", "name": "team", "max_concurrent_requests": 2},
                  admin_api_keys=["adm"])  # fmt: skip
    proxy = await start_proxy(cfg)
    limits = proxy.server.runtime.proxy.key_limits
    streams = [await proxy.open_stream("m", **bearer("sk-r")) for _ in range(2)]
    data = cfg.model_dump(mode="json", exclude_none=True)
    data["server"]["api_keys"] = [{"key": "sk-r", "name": "team", "max_concurrent_requests": 1}]
    await proxy.reload(tmp_path / "config.yaml", data)
    assert sum(limits.inflight.values()) == 2  # the count survived the reload
    assert_rate_limited(*await chat(proxy, "sk-r"), "max_concurrent_requests")
    for stream in streams:  # both run to their end
        text = (await stream.read()).decode()
        assert stream.status == 200 and text.rstrip().endswith("data: [DONE]"), text[-200:]
        stream.release()
    await wait_for(lambda: not limits.inflight, what="the streams counted out")
    assert (await chat(proxy, "sk-r"))[0] == 200
    # A key removed by a reload takes its series with it: they stay as many as the keys.
    data["server"]["api_keys"] = [{"key": "sk-new", "name": "fresh"}]
    await proxy.reload(tmp_path / "config.yaml", data)
    assert (await chat(proxy, "sk-new"))[0] == 200
    samples = await proxy_samples(proxy)
    keys = {s.labels["key"] for s in samples.find("vllm_proxy_key_requests_total")}
    assert keys == {"fresh"}


async def test_key_series_and_the_access_log_name_a_key_never_by_its_secret(
    tmp_path: Path, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    keys = [{"key": "sk-very-secret-1", "name": "web"}, "sk-very-secret-2"]
    proxy = await start_proxy(limited(tmp_path, *keys))
    caplog.set_level("INFO", logger="vllm_proxy.access")
    for key in ("sk-very-secret-1", "sk-very-secret-2"):
        assert (await chat(proxy, key))[0] == 200
    async with proxy.http.get(proxy.url + "/metrics") as r:
        text = await r.text()
    assert "sk-very-secret" not in text
    assert 'vllm_proxy_key_requests_total{key="web"} 1.0' in text
    assert 'vllm_proxy_key_requests_total{key="key-1"} 1.0' in text
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm_proxy.access"]
    assert [line.rsplit(" ", 1)[1] for line in lines] == ["key=web", "key=key-1"]
    assert not any("sk-very-secret" in line for line in lines)


# -- the admission queue -----------------------------------------------------------------------


async def test_a_models_rank_is_its_requests_best_not_its_starts() -> None:
    """b's start waits for memory with the model's own rank (0, 0); the request it was started
    for is a batch key's (0, 10): b ranks (0, 10), behind c's interactive request that came
    later. A start no request waits for (an admin load) keeps the model's own rank."""
    queue = Queue()
    queue.enter("b", (0, 10), since=1.0)
    queue.enter("b", (0, 0), since=2.0, instance="b#1")
    queue.enter("c", (0, 0), since=3.0)
    queue.enter("d", (0, 0), since=4.0, instance="d#1")
    queue.enter("e", (-1, 50), since=5.0)  # the model's priority ranks before the key's
    ranked = [(w.model, w.rank, w.since) for w in queue.waiters()]
    assert ranked == [
        ("e", (-1, 50), 5.0),
        ("c", (0, 0), 3.0),
        ("d", (0, 0), 4.0),
        ("b", (0, 10), 1.0),
    ]


async def test_a_batch_keys_request_waits_behind_an_interactive_keys_for_the_same_memory(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """a serves a long request; the batch key (priority 10) asks for b first, the interactive
    key (priority 0) for c after it: both need a's memory, and c goes first. The model's
    priority still ranks before the key's: low (priority 5) waits behind b."""
    models = {"a": {}, "b": {}, "c": {}, "low": {"priority": 5}}
    cfg = one_slot(tmp_path, models, {"max_reorder_s": 0}, min_resident_s=0)
    keys = [
        {"key": "sk-batch", "priority": 10},
        {"key": "sk-chat"},
    ]
    data = cfg.model_dump(mode="json", exclude_none=True)
    data["server"]["api_keys"] = keys
    proxy = await start_proxy(parse_config(data))
    served = Served(proxy)

    def send(label: str, model: str, key: str, tokens: int = 2) -> None:
        async def one() -> int:
            url = proxy.url + "/v1/chat/completions"
            body = chat_body(model, max_tokens=tokens)
            async with proxy.http.post(url, json=body, headers=bearer(key)) as resp:
                await resp.read()
                served.order.append(label)
                return resp.status

        served.tasks.append(asyncio.ensure_future(one()))

    send("a", "a", "sk-chat", tokens=40)
    await wait_for(lambda: busy(proxy, "a"), what="a in flight")
    send("low", "low", "sk-chat")
    await wait_for(lambda: proxy.manager.queue.waiting("low") > 0, what="low queued")
    send("b", "b", "sk-batch")
    await wait_for(lambda: proxy.manager.queue.waiting("b") > 0, what="b queued")
    send("c", "c", "sk-chat")
    await wait_for(lambda: proxy.manager.queue.waiting("c") > 0, what="c queued")
    assert await served.statuses() == [200] * 4
    assert served.order == ["a", "c", "b", "low"]
