"""Engines are verified, not trusted: a foreign listener on an engine port gets no request."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from aiohttp import web
from kit import StartProxy, free_port, make_config

import vllm_proxy.engines.engine as engine_module


async def test_foreign_listener_on_the_engine_port_is_never_trusted(
    tmp_path: Path, start_proxy: StartProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another program takes the port between allocation and the engine's bind (a race the
    free-port check cannot close). It answers /health with 200 — the proxy must notice that the
    listener is not the engine's own socket and start the engine on another port."""
    foreign_port = free_port()
    hits: list[str] = []

    async def anything(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.json_response({"foreign": True})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", foreign_port).start()
    try:
        # The race: the free-port check passed just before the stranger bound the port.
        monkeypatch.setattr(engine_module.random, "randrange", lambda n: 0)  # first port first
        real_check = engine_module.port_is_free
        monkeypatch.setattr(
            engine_module, "port_is_free", lambda port: port == foreign_port or real_check(port)
        )
        engine = {"transport": "tcp", "port_range": [foreign_port, foreign_port + 50]}
        cfg = make_config(tmp_path, engine=engine)
        proxy = await start_proxy(cfg)
        resp = await proxy.chat("m1")
        body = await resp.json()
        assert resp.status == 200, body
        assert body.get("object") == "chat.completion" and "foreign" not in body
        inst = proxy.instance("m1")
        assert inst.engine is not None and inst.engine.port != foreign_port
        assert inst.id == "m1#2", "the first instance gave up the taken port"
        assert set(hits) <= {"/health"}, "no client request reached the foreign listener"
        assert inst.engine.listener_unchanged()
    finally:
        await runner.cleanup()


async def test_an_engine_started_with_a_key_gets_it_with_every_request(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Regression: with `args.api_key` the proxy dropped the client's Authorization (the proxy's
    own key) and sent none, so the engine answered every request 401."""
    models = {"m": {"model": "x", "args": {"api_key": "engine-secret"}}}
    proxy = await start_proxy(make_config(tmp_path, models, server={"api_keys": ["client-key"]}))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"Authorization": "Bearer client-key"}
    async with proxy.http.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
    async with proxy.http.post(proxy.url + "/v1/completions", json={**body, "prompt": "x"},
                               headers=headers) as r:  # fmt: skip
        assert r.status == 200, await r.text()


async def test_access_log_fields_cannot_forge_lines(
    tmp_path: Path, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: a decoded %0A in the path and spaces in X-Request-ID wrote forged lines."""
    proxy = await start_proxy(make_config(tmp_path))
    forged = "x 200 forged\nGET /v1/models model=evil"
    with caplog.at_level(logging.INFO, logger="vllm_proxy.access"):
        async with proxy.http.post(
            proxy.url + "/v1/chat/completions%0AGET%20/v1/models%20status=200",
            json={"model": "m1"},
        ) as r:
            assert r.status == 404
        async with proxy.http.post(
            proxy.url + "/v1/chat/completions",
            json={"model": "m1\nGET /v1/models status=200", "messages": []},
            headers={"X-Request-ID": "id with spaces status=200"},
        ) as r:
            assert r.status in (400, 404)
            assert r.headers["X-Request-ID"] != "id with spaces status=200"  # a new one
        async with proxy.http.post(
            proxy.url + "/v1/chat/completions", json={"model": "m1"},
            headers={"X-Request-ID": "client-id.1:2"},
        ) as r:  # fmt: skip
            assert r.headers["X-Request-ID"] == "client-id.1:2"  # a token is kept
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "vllm_proxy.access"]
    assert len(lines) == 3
    for line in lines:
        assert "\n" not in line and forged not in line
        assert line.count(" status=") == 1 and line.count(" model=") == 1
    assert "\\x0a" in lines[0]  # the path, escaped
