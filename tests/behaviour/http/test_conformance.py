"""The HTTP the proxy speaks to clients and engines, through a raw-socket engine (real processes).

Each test scripts what the engine answers (tests/kit/raw_engine.py) and checks what the
client receives and what the engine was sent.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import sys
from pathlib import Path
from typing import Any

import aiohttp
from kit import RunningProxy, StartProxy, make_config
from kit.raw import RAW_ENGINE_SCRIPT

RAW_ENGINE = [sys.executable, str(RAW_ENGINE_SCRIPT)]


async def raw_proxy(
    tmp_path: Path, start_proxy: StartProxy, answer: bytes, **server: Any
) -> RunningProxy:
    (tmp_path / "answer").write_bytes(answer)
    env = {"RAW_ENGINE_ANSWER": str(tmp_path / "answer"), "RAW_ENGINE_LOG": str(tmp_path / "seen")}
    models = {"m1": {"model": "raw", "command": RAW_ENGINE, "env": env, "aliases": ["a1"]}}
    return await start_proxy(make_config(tmp_path, models, server=server))


def seen(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "seen").read_text().splitlines()]


CHAT = {"model": "m1", "messages": [{"role": "user", "content": "x"}]}
EVENTS = b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"


def stream_answer(events: bytes, content_type: bytes = b"text/event-stream") -> bytes:
    """An engine's answer that streams `events` in one chunk."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head % content_type + b"%x\r\n%s\r\n0\r\n\r\n" % (len(events), events)


async def test_event_stream_is_matched_case_insensitively(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    answer = stream_answer(EVENTS, b"Text/Event-Stream; charset=utf-8")
    proxy = await raw_proxy(tmp_path, start_proxy, answer)
    resp = await proxy.http.post(proxy.url + "/v1/chat/completions", json=CHAT)
    assert resp.headers["X-Accel-Buffering"] == "no", "treated as a stream"
    assert await resp.read() == EVENTS


async def test_a_stream_to_an_http10_client_is_unframed_and_ends_with_the_connection(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await raw_proxy(tmp_path, start_proxy, stream_answer(EVENTS))
    body = json.dumps(CHAT).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    raw = await asyncio.wait_for(reader.read(), 10)  # to the end: the proxy closes
    writer.close()
    head, _, got = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") or head.startswith(b"HTTP/1.1 200"), head
    assert b"transfer-encoding" not in head.lower()
    assert got == EVENTS, "the engine's bytes, without chunk framing"


OK_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def image_request(model: str, pad: int = 400_000) -> bytes:
    """A chat request with a base64 "image" and odd spacing, ``model`` last (as the OpenAI SDK
    sends it), large enough to be scanned rather than parsed."""
    url = "data:image/jpeg;base64," + "QUJD+/" * (pad // 6)
    return (
        b'{ "messages" : [{"role":"user","content":[{"type":"text","text":"What is \\"this\\"?"},'
        b'{"type":"image_url","image_url":{"url":"%s"}}]}],\n  "model":"%s" , "max_tokens":16}'
        % (url.encode(), model.encode())
    )


#: What a JSON body is sent with (the proxy refuses other types, as vLLM does).
JSON_TYPE = {"Content-Type": "application/json"}


async def test_a_large_body_reaches_the_engine_byte_for_byte(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await raw_proxy(tmp_path, start_proxy, OK_ANSWER)
    body = image_request("m1")
    headers = {"Content-Type": "application/json"}
    resp = await proxy.http.post(proxy.url + "/v1/chat/completions", data=body, headers=headers)
    assert resp.status == 200, await resp.text()
    assert seen(tmp_path)[-1]["body"].encode("latin-1") == body

    async def pieces() -> Any:  # chunked: no length announced, read piece by piece
        for i in range(0, len(body), 65536):
            yield body[i : i + 65536]

    resp = await proxy.http.post(proxy.url + "/v1/chat/completions", data=pieces(), headers=headers)
    assert resp.status == 200, await resp.text()
    assert seen(tmp_path)[-1]["body"].encode("latin-1") == body


async def test_a_large_body_arriving_in_small_pieces_is_scanned_as_it_comes(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Pieces cut inside the model's key and value, and inside the image: the scan that walks
    each piece as it comes finds the model, and the engine gets the bytes as sent."""
    proxy = await raw_proxy(tmp_path, start_proxy, OK_ANSWER)
    body = image_request("a1")
    at = body.index(b'"model"')
    cuts = [1, 100, 70_000, 70_001, at + 3, at + 9, at + 11, len(body) - 2]
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True):
        writer.write(body[a:b])
        await writer.drain()
        await asyncio.sleep(0)  # let the proxy read this piece on its own
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    writer.close()
    assert head.startswith(b"HTTP/1.1 200"), head
    assert seen(tmp_path)[-1]["body"].encode("latin-1") == image_request("m1"), "alias replaced"


async def test_an_alias_in_a_large_body_is_replaced_in_place(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await raw_proxy(tmp_path, start_proxy, OK_ANSWER)
    resp = await proxy.http.post(
        proxy.url + "/v1/chat/completions", data=image_request("a1"), headers=JSON_TYPE
    )
    assert resp.status == 200, await resp.text()
    assert seen(tmp_path)[-1]["body"].encode("latin-1") == image_request("m1")


async def test_large_bad_bodies_are_refused_before_any_engine_starts(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await raw_proxy(tmp_path, start_proxy, OK_ANSWER, max_body_mb=0.45)
    good = image_request("m1")
    cases = [
        (good[:-1], 400, "not valid JSON"),  # cut short
        (good.replace(b'"max_tokens":16', b'"max_tokens":[1 2]'), 400, "not valid JSON"),
        (good.replace(b'"model":"m1"', b'"model":7'), 400, "'model' is required"),
        (good.replace(b'"model":"m1"', b'"model":"nope"'), 404, "does not exist"),
        (image_request("m1", pad=480_000), 413, "max_body_mb"),
    ]
    for data, status, fragment in cases:
        resp = await proxy.http.post(
            proxy.url + "/v1/chat/completions", data=data, headers=JSON_TYPE
        )
        assert resp.status == status, (status, await resp.text())
        assert fragment in (await resp.json())["error"]["message"]
    assert proxy.model("m1").instances == [], "no engine started for a bad body"


async def test_close_delimited_body_reaches_the_client_whole(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    body = json.dumps({"object": "chat.completion", "pad": "y" * 600_000}).encode()
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + body
    proxy = await raw_proxy(tmp_path, start_proxy, answer)
    for _ in range(2):  # and the next request gets a fresh connection
        resp = await proxy.http.post(proxy.url + "/v1/chat/completions", json=CHAT)
        assert resp.status == 200 and await resp.read() == body


async def test_a_large_body_is_passed_on_with_its_length(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    body = json.dumps({"object": "list", "data": "z" * 3_000_000}).encode()
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    answer += b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    proxy = await raw_proxy(tmp_path, start_proxy, answer)
    resp = await proxy.http.post(proxy.url + "/v1/embeddings", json={"model": "m1", "input": "x"})
    assert resp.status == 200 and resp.content_length == len(body)
    assert await resp.read() == body


async def test_hop_by_hop_and_connection_named_headers_are_dropped_both_ways(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: keep-alive, X-Engine-Hop"
        b"\r\nX-Engine-Hop: 1\r\nKeep-Alive: timeout=5\r\nX-Kept: 1\r\nContent-Length: 2\r\n\r\n{}"
    )
    proxy = await raw_proxy(tmp_path, start_proxy, answer)
    headers = {"Connection": "keep-alive, X-Client-Hop", "X-Client-Hop": "secret", "X-Other": "1"}
    headers["X-Request-ID"] = "client-7"
    resp = await proxy.http.post(proxy.url + "/v1/chat/completions", json=CHAT, headers=headers)
    assert resp.status == 200 and resp.headers["X-Request-ID"] == "client-7"
    assert "X-Engine-Hop" not in resp.headers and "Keep-Alive" not in resp.headers
    assert resp.headers["X-Kept"] == "1"
    sent = seen(tmp_path)[-1]["headers"]
    assert "x-client-hop" not in sent and sent["x-other"] == "1"
    assert "authorization" not in sent
    # vLLM needs unique request ids: the client's, with the proxy's own appended.
    assert sent["x-request-id"].startswith("client-7.") and len(sent["x-request-id"]) > 9


async def test_compressed_request_goes_on_decoded_without_the_header(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    proxy = await raw_proxy(tmp_path, start_proxy, answer)
    raw = json.dumps(CHAT).encode()
    resp = await proxy.http.post(
        proxy.url + "/v1/chat/completions",
        data=gzip.compress(raw),
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    )
    assert resp.status == 200, await resp.text()
    sent = seen(tmp_path)[-1]
    assert "content-encoding" not in sent["headers"]
    assert json.loads(sent["body"]) == CHAT


async def test_serve_tail_is_checked_and_the_query_re_encoded(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    proxy = await raw_proxy(tmp_path, start_proxy, answer)
    for tail in ("models/x", "admin", "chat/completions/../../admin", "chat%2Fcompletions%0d"):
        resp = await proxy.http.post(proxy.url + f"/serve/m1/v1/{tail}", json=CHAT)
        assert resp.status == 404, tail
    async with aiohttp.ClientSession() as raw_client:
        url = proxy.url + "/serve/m1/v1/chat/completions?a=b%20c&x=%0d%0aInjected:%201"
        resp = await raw_client.post(url, json=CHAT)
        assert resp.status == 200
    line = seen(tmp_path)[-1]["line"]
    assert line.startswith("POST /v1/chat/completions?a=b+c&x=%0D%0AInjected%3A+1 HTTP/1.1"), line
