"""The realtime WebSocket route against hostile clients, through the proxy to the fake engine
(real processes): clients that never name a model, bad frames, engines that die mid-session,
clients gone or silent, unknown names, message budgets, session bounds and per-key limits. Each
test is named after its hazard and ends by checking that nothing is left behind."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kit import FakeEngine, RunningProxy, StartProxy, make_config, wait_for
from kit.forms import (
    BOUNDARY,
    receive,
)
from kit.leftovers import left_nothing

from vllm_proxy.engines.states import State

pytestmark = pytest.mark.usefixtures("spool_dir")


# -- LoRA adapters: names from clients --------------------------------------------------------


# -- LoRA adapters: loads, unloads and slots under pressure -----------------------------------


# -- API keys scoped to models ----------------------------------------------------------------


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- form uploads -----------------------------------------------------------------------------

B = BOUNDARY.encode()
CLOSE = b"\r\n--%b--\r\n" % B


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
