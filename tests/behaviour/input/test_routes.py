"""Every vLLM route that names a model, through the proxy to the fake engine (a real process):
the JSON routes, the form uploads of speech to text (streamed, not held) and the realtime
WebSocket (relayed both ways under a lease)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from kit import FakeEngine, RunningProxy, StartProxy, make_config, wait_for
from kit.forms import (
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
from kit.metrics import proxy_samples

from vllm_proxy.frontend.routes.paths import MODEL_ROUTES

#: The head of a file part whose content follows.
FILE_HEAD = (
    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
).encode()


def config(tmp_path: Path, engine_env: dict[str, str] | None = None, **server: Any) -> Any:
    env = FakeEngine(upload_log=tmp_path / "uploads.jsonl", tokens=4).env()
    env.update(engine_env or {})
    models = {
        "whisper": {"model": "org/whisper", "aliases": ["w"], "env": env},
        "pool": {"model": "org/pool", "aliases": ["p"], "args": {"runner": "pooling"}},
    }
    return make_config(tmp_path, models, server=server)


def assert_openai_error(body: dict[str, Any], code: str | None = None) -> dict[str, Any]:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code, err
    return err  # type: ignore[no-any-return]


async def post_form(
    proxy: RunningProxy, body: bytes, path: str = "/v1/audio/transcriptions", **headers: str
) -> aiohttp.ClientResponse:
    return await proxy.http.post(
        proxy.url + path, data=body, headers={"Content-Type": FORM, **headers}
    )


# -- JSON routes ----------------------------------------------------------------------------

CHAT = [{"role": "user", "content": "say hello to me"}]
#: (path, body, model) for the JSON routes the fake engine serves; the body names an alias.
SERVED = [
    ("/v1/messages", {"model": "w", "max_tokens": 3, "messages": CHAT}, "whisper"),
    ("/v1/messages/count_tokens", {"model": "w", "messages": CHAT}, "whisper"),
    ("/pooling", {"model": "p", "input": ["a b", "c"]}, "pool"),
    ("/classify", {"model": "p", "input": "is this good"}, "pool"),
    ("/v2/embed", {"model": "p", "texts": ["a", "b c"], "input_type": "search_query"}, "pool"),
    ("/score", {"model": "p", "queries": "q", "documents": ["d1", "d2"]}, "pool"),
    ("/v1/score", {"model": "p", "text_1": "q", "text_2": ["d1", "d2"]}, "pool"),
    ("/rerank", {"model": "p", "query": "q", "documents": ["d1", "d2", "d3"]}, "pool"),
    ("/v1/rerank", {"model": "p", "query": "q", "documents": ["d1", "d2"], "top_n": 1}, "pool"),
    ("/v2/rerank", {"model": "p", "query": "q", "documents": ["d1", "d2"]}, "pool"),
]


async def test_json_routes_reach_the_engine_of_the_model_they_name(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(config(tmp_path))
    for path, body, model in SERVED:
        resp = await proxy.http.post(proxy.url + path, json=body)
        got = await resp.json()
        assert resp.status == 200, (path, got)
        assert resp.headers["X-Request-ID"]
        if "model" in got:
            assert got["model"] == model, "the engine got the canonical name for the alias"
    messages = await (await proxy.http.post(proxy.url + SERVED[0][0], json=SERVED[0][1])).json()
    assert messages["type"] == "message" and messages["content"][0]["type"] == "text"
    assert messages["stop_reason"] == "max_tokens"
    assert messages["usage"]["output_tokens"] == 3
    rerank = await (await proxy.http.post(proxy.url + SERVED[8][0], json=SERVED[8][1])).json()
    assert len(rerank["results"]) == 1 and "relevance_score" in rerank["results"][0]
    assert proxy.model("whisper").instances
    assert len(proxy.model("pool").instances) == 1, "one engine for every pooling route"
    # An unknown model is the proxy's own 404, naming the models there are.
    resp = await proxy.http.post(proxy.url + "/v2/embed", json={"model": "nope", "texts": ["a"]})
    assert resp.status == 404
    assert "whisper" in assert_openai_error(await resp.json(), "model_not_found")["message"]


async def test_routes_the_fake_does_not_serve_still_reach_an_engine(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """The scale-out, decisions, Cohere chat, SageMaker, responses and tokenizer routes are
    routed like the others: the engine's own FastAPI 404 comes back (the proxy's would be
    OpenAI-shaped)."""
    proxy = await start_proxy(config(tmp_path))
    served = {path for path, _, _ in SERVED} | {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
    }
    for path in MODEL_ROUTES:
        if path in served:
            continue
        resp = await proxy.http.post(proxy.url + path, json={"model": "w", "prompt": "x"})
        assert (resp.status, await resp.json()) == (404, {"detail": "Not Found"}), path
    assert len(proxy.model("whisper").instances) == 1


async def test_anthropic_messages_stream_passes_through_with_its_event_lines(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(config(tmp_path))
    body = {"model": "w", "max_tokens": 2, "messages": CHAT, "stream": True}
    resp = await proxy.http.post(proxy.url + "/v1/messages", json=body)
    assert resp.status == 200 and resp.headers["X-Accel-Buffering"] == "no"
    text = (await resp.read()).decode()
    events = re.findall(r"^event: (\S+)$", text, re.MULTILINE)
    assert events == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert '"text":"tok0 "' in text


# -- form uploads ---------------------------------------------------------------------------


async def test_audio_through_the_openai_sdk(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(tmp_path))
    async with openai.AsyncOpenAI(
        base_url=proxy.url + "/v1", api_key="unused", max_retries=0
    ) as client:
        text = await client.audio.transcriptions.create(model="w", file=("a.wav", AUDIO * 2))
        assert text.text == "tok0 tok1 tok2 tok3"
        with warnings.catch_warnings():  # (the SDK marks translations deprecated)
            warnings.simplefilter("ignore", DeprecationWarning)
            translated = await client.audio.translations.create(
                model="whisper", file=("a.wav", AUDIO)
            )
        assert translated.text.startswith("tok0")
        with pytest.raises(openai.NotFoundError):
            await client.audio.transcriptions.create(model="gpt-4o", file=("a.wav", AUDIO))
    seen = uploads(tmp_path)
    assert [u["fields"]["model"] for u in seen] == ["whisper", "whisper"], "canonical names"
    assert seen[0]["files"]["file"]["sha256"] == hashlib.sha256(AUDIO * 2).hexdigest()
    samples = await proxy_samples(proxy)
    assert samples.at('vllm_requests_total{model_id="whisper",status="200"}') == 2


async def test_a_streamed_transcription_passes_through(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(config(tmp_path))
    body = form(field("model", b"w"), field("stream", b"true"), field("file", AUDIO, "a.wav"))
    resp = await post_form(proxy, body)
    assert resp.status == 200 and resp.headers["X-Accel-Buffering"] == "no"
    events = (await resp.read()).decode().split("\n\n")
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    assert {c["object"] for c in chunks} == {"transcription.chunk"}
    assert events[-2] == "data: [DONE]"


@pytest.mark.parametrize("model_last", [False, True], ids=["model-first", "model-after-file"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_an_alias_in_a_form_is_replaced_and_every_other_byte_goes_on(
    tmp_path: Path, start_proxy: StartProxy, model_last: bool, chunked: bool
) -> None:
    """The engine knows only the canonical name: the form's model field is rewritten, the
    length follows (or the body goes on chunked), and the rest is the client's bytes; a model
    after the file waits in a temporary file, not in memory."""
    proxy = await start_proxy(config(tmp_path))
    audio = AUDIO * 8  # past the 256 KiB kept in memory: the form after it is spooled
    parts = [field("file", audio, "a.wav"), field("language", b"en")]
    parts.insert(len(parts) if model_last else 0, field("model", b"w"))
    body = b"preamble, ignored\r\n" + form(*parts)

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(body), 10000):
            yield body[i : i + 10000]

    resp = await post_form(proxy, pieces() if chunked else body)  # type: ignore[arg-type]
    assert resp.status == 200, await resp.text()
    (seen,) = uploads(tmp_path)
    expected = body.replace(b"\r\n\r\nw\r\n", b"\r\n\r\nwhisper\r\n")
    assert seen["sha256"] == hashlib.sha256(expected).hexdigest()
    assert seen["chunked"] is chunked
    assert seen["content_length"] == (None if chunked else str(len(expected)))
    assert seen["fields"] == {"model": "whisper", "language": "en"}


async def test_the_model_in_the_path_is_given_to_the_engine(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """``/serve/{model}/v1/audio/...``: a form without ``model`` gets one; one with another
    name gets the path's."""
    proxy = await start_proxy(config(tmp_path))
    for body in (
        form(field("file", AUDIO, "a.wav")),
        form(field("model", b"other"), field("file", AUDIO, "a.wav")),
    ):
        resp = await post_form(proxy, body, "/serve/w/v1/audio/translations")
        assert resp.status == 200, await resp.text()
    assert [u["fields"]["model"] for u in uploads(tmp_path)] == ["whisper", "whisper"]
    assert {u["path"] for u in uploads(tmp_path)} == {"/v1/audio/translations"}


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (form(field("file", AUDIO, "a.wav")), "'model' is required"),
        (form(field("model", b"w", "model.txt"), field("file", AUDIO, "a.wav")), "not a file"),
        (form(field("model", b""), field("file", AUDIO, "a.wav")), "'model' is required"),
        (form(field("model", b"\xff\xfe")), "not UTF-8"),
        (form(field("model", b"w"), field("model", b"w")), "more than once"),
        (form(field("model", b"w"), field("file", AUDIO, "a.wav"))[:-40], "truncated"),
        (form(field("file", AUDIO, "a.wav"), field("model", b"w"))[:-30], "truncated"),
        (b"no boundary anywhere", "no part"),
    ],
    ids=[
        "no-model",
        "model-is-a-file",
        "empty-model",
        "not-utf8",
        "twice",
        "truncated",
        "truncated-after-model",
        "no-parts",
    ],
)
async def test_bad_forms_are_openai_shaped_400s(
    tmp_path: Path, start_proxy: StartProxy, body: bytes, fragment: str
) -> None:
    proxy = await start_proxy(config(tmp_path))
    resp = await post_form(proxy, body)
    assert resp.status == 400
    assert fragment in assert_openai_error(await resp.json())["message"]
    assert uploads(tmp_path) == [], "the engine never got the whole body"


async def test_a_form_without_boundary_and_wrong_types_are_refused(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(config(tmp_path))
    url = proxy.url + "/v1/audio/transcriptions"
    resp = await proxy.http.post(url, data=b"x", headers={"Content-Type": "multipart/form-data"})
    assert resp.status == 400
    assert "boundary" in assert_openai_error(await resp.json())["message"]
    for content_type in ("application/json", "application/x-www-form-urlencoded", "audio/wav"):
        resp = await proxy.http.post(url, data=b"{}", headers={"Content-Type": content_type})
        assert resp.status == 415, content_type
        err = assert_openai_error(await resp.json(), "unsupported_media_type")
        assert "multipart/form-data" in err["message"]
    # ... and a form is still refused on the JSON routes.
    chat = await post_form(proxy, form(field("model", b"w")), "/v1/chat/completions")
    assert chat.status == 415
    assert proxy.model("whisper").instances == []


async def test_an_upload_over_the_body_limit_is_413(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(config(tmp_path, max_body_mb=0.5))
    body = form(field("model", b"w"), field("file", AUDIO * 10, "a.wav"))
    resp = await post_form(proxy, body)
    assert resp.status == 413
    assert_openai_error(await resp.json(), "request_too_large")

    async def pieces() -> AsyncIterator[bytes]:  # no length: counted as it comes
        for i in range(0, len(body), 65536):
            yield body[i : i + 65536]

    resp = await post_form(proxy, pieces())  # type: ignore[arg-type]
    assert resp.status == 413
    assert uploads(tmp_path) == []


async def test_uploads_and_websockets_from_another_sites_page_are_refused(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """A page may POST a form, or open a WebSocket, to any site without a CORS preflight."""
    proxy = await start_proxy(config(tmp_path))
    body = form(field("model", b"w"), field("file", AUDIO, "a.wav"))
    resp = await post_form(proxy, body, Origin="http://evil.example")
    assert resp.status == 403
    assert_openai_error(await resp.json(), "cross_origin")
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await proxy.http.ws_connect(
            proxy.url + "/v1/realtime?model=w", headers={"Origin": "http://evil.example"}
        )
    assert refused.value.status == 403
    assert proxy.model("whisper").instances == []
    own = await post_form(proxy, body, Origin=proxy.url)
    assert own.status == 200


async def test_a_50_mb_upload_is_routed_without_holding_it(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """The proxy (in this process, with the client) peaks far below the upload's size: the
    form streams through; the engine, another process, gets every byte."""
    size = 50 * 1024 * 1024
    cfg = config(tmp_path, {"VLLM_MAX_AUDIO_CLIP_FILESIZE_MB": "64"}, max_body_mb=64)
    proxy = await start_proxy(cfg)
    head = field("model", b"w") + field("response_format", b"json") + FILE_HEAD
    tail = f"\r\n--{BOUNDARY}--\r\n".encode()
    chunk = os.urandom(64 * 1024)
    total = len(head) + size + len(tail)
    digest = hashlib.sha256(head.replace(b"\r\n\r\nw\r\n", b"\r\n\r\nwhisper\r\n"))

    async def body() -> AsyncIterator[bytes]:
        yield head
        for _ in range(size // len(chunk)):
            digest.update(chunk)
            yield chunk
        digest.update(tail)
        yield tail

    # The engine started first, so that only the upload's own memory is measured.
    warm = await post_form(proxy, form(field("model", b"w"), field("file", chunk, "a.wav")))
    assert warm.status == 200
    _peak_rss_reset()
    before = _peak_rss()
    resp = await proxy.http.post(
        proxy.url + "/v1/audio/transcriptions",
        data=body(),
        headers={"Content-Type": FORM, "Content-Length": str(total)},
    )
    assert resp.status == 200, await resp.text()
    grown = _peak_rss() - before
    seen = uploads(tmp_path)[-1]
    assert seen["length"] == total + len("whisper") - 1
    assert seen["sha256"] == digest.hexdigest()
    assert grown < 15 * 1024 * 1024, f"the proxy's peak RSS grew by {grown / 2**20:.1f} MiB"


# -- realtime -------------------------------------------------------------------------------


async def transcribe(ws: aiohttp.ClientWebSocketResponse, appends: int) -> dict[str, Any]:
    """A commit, `appends` audio appends (a delta each), a final commit: the done event."""
    await ws.send_str(json.dumps({"type": "input_audio_buffer.commit"}))
    audio = "AAAA" * 100
    for _ in range(appends):
        await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
        assert (await receive(ws))["type"] == "transcription.delta"
    await ws.send_str(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
    done = await receive(ws)
    assert done["type"] == "transcription.done", done
    return done


async def test_a_realtime_session_is_relayed_both_ways_under_a_lease(
    tmp_path: Path, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vllm_proxy.access")
    proxy = await start_proxy(config(tmp_path))
    async with proxy.http.ws_connect(proxy.url + "/v1/realtime?model=w") as ws:
        created = await receive(ws)
        assert created["type"] == "session.created" and created["id"].startswith("sess-")
        inst = proxy.instance("whisper")
        assert inst.leases == 1, "held for the connection's lifetime"
        await ws.send_str(json.dumps({"type": "session.update", "model": "w"}))  # the alias
        done = await transcribe(ws, 3)
        assert done["text"] == "tok0 tok1 tok2 " and done["usage"]["completion_tokens"] == 3
        # Another model's name is refused by the proxy; the session goes on.
        await ws.send_str(json.dumps({"type": "session.update", "model": "pool"}))
        refused = await receive(ws)
        assert refused == {"type": "error", "error": refused["error"], "code": "model_mismatch"}
        assert (await transcribe(ws, 1))["text"] == "tok0 "
    await wait_for(lambda: inst.leases == 0, what="the lease released at the close")

    def logged() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "vllm_proxy.access"]

    await wait_for(lambda: len(logged()) == 1, what="the session's access-log line")
    assert re.search(
        r" GET /v1/realtime model=whisper instance=whisper#\d+ status=101 ", logged()[0]
    )
    metrics = await (await proxy.http.get(proxy.url + "/metrics")).text()
    assert 'vllm_requests_total{model_id="whisper",status="101"} 1.0' in metrics


async def test_a_realtime_session_may_name_its_model_in_the_first_event(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(config(tmp_path))
    async with proxy.http.ws_connect(proxy.url + "/v1/realtime") as ws:
        assert (await receive(ws))["type"] == "session.created"  # the proxy's own
        await ws.send_str(json.dumps({"type": "session.update", "model": "w"}))
        done = await transcribe(ws, 2)  # no second session.created came before
        assert done["text"] == "tok0 tok1 "
        assert proxy.instance("whisper").leases == 1
    async with proxy.http.ws_connect(proxy.url + "/v1/realtime") as ws:
        assert (await receive(ws))["type"] == "session.created"
        await ws.send_str(json.dumps({"type": "session.update", "model": "nope"}))
        refused = await receive(ws)
        assert refused["type"] == "error" and refused["code"] == "model_not_found"
        assert "whisper" in refused["error"]
        closing = await asyncio.wait_for(ws.receive(), 10)
        assert closing.type == aiohttp.WSMsgType.CLOSE and ws.close_code == 1008


async def test_a_realtime_session_may_name_its_model_in_the_path(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(config(tmp_path))
    async with proxy.http.ws_connect(proxy.url + "/serve/w/v1/realtime") as ws:
        assert (await receive(ws))["type"] == "session.created"
        await ws.send_str(json.dumps({"type": "session.update", "model": "whisper"}))
        assert (await transcribe(ws, 1))["text"] == "tok0 "


async def test_realtime_refusals_before_the_upgrade_are_json(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(config(tmp_path))
    with pytest.raises(aiohttp.WSServerHandshakeError) as unknown:
        await proxy.http.ws_connect(proxy.url + "/v1/realtime?model=nope")
    assert unknown.value.status == 404
    with pytest.raises(aiohttp.WSServerHandshakeError) as pooling:
        await proxy.http.ws_connect(proxy.url + "/serve/pool/v1/realtime")
    assert pooling.value.status == 404, "a pooling engine has no realtime route"
    plain = await proxy.http.get(proxy.url + "/v1/realtime?model=w")
    assert plain.status == 400
    assert_openai_error(await plain.json(), "websocket_required")
    assert proxy.model("whisper").instances == []


async def test_shutdown_closes_realtime_sessions_at_once_with_1001(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """A session never ends by itself: the drain does not wait for it."""
    proxy = await start_proxy(config(tmp_path, drain_timeout_s=30))
    ws = await proxy.http.ws_connect(proxy.url + "/v1/realtime?model=w")
    assert (await receive(ws))["type"] == "session.created"
    closing = asyncio.ensure_future(ws.receive())
    await asyncio.wait_for(proxy.server.shutdown(), 10)
    msg = await asyncio.wait_for(closing, 10)
    assert (msg.type, msg.data) == (aiohttp.WSMsgType.CLOSE, 1001)


# -- clients that stall or leave mid-upload ---------------------------------------------


async def raw_upload(
    proxy: RunningProxy, length: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """An upload that announces `length` and sends its model and the first 64 KiB."""
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    writer.write(
        f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nContent-Type: {FORM}\r\n"
        f"Content-Length: {length}\r\n\r\n".encode()
        + field("model", b"w")
        + FILE_HEAD
        + AUDIO
    )
    await writer.drain()
    return reader, writer


async def test_an_upload_that_stalls_after_its_model_is_a_408(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(config(tmp_path, body_timeout_s=1))
    reader, writer = await raw_upload(proxy, 10_000_000)
    answer = await asyncio.wait_for(reader.read(4096), 30)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"code": "request_timeout"' in answer
    assert uploads(tmp_path) == []
    await wait_for(lambda: proxy.instance("whisper").leases == 0, what="the lease released")


async def test_a_client_that_leaves_mid_upload_releases_its_lease(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(config(tmp_path))
    _, writer = await raw_upload(proxy, 10_000_000)

    def leased() -> bool:
        return bool(proxy.model("whisper").instances) and proxy.instance("whisper").leases == 1

    await wait_for(leased, what="the upload streaming to its engine")
    writer.close()
    await wait_for(lambda: proxy.instance("whisper").leases == 0, what="the lease released")
    assert uploads(tmp_path) == []
    assert (await post_form(proxy, form(field("model", b"w"), field("file", AUDIO, "a")))).ok
