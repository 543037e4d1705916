"""Engines are verified, not trusted: a foreign listener on an engine port gets no request."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp import web
from conftest import StartProxy, free_port, make_config

import vllm_proxy.engine as engine_module


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
        cfg = make_config(tmp_path, engine={"port_range": [foreign_port, foreign_port + 50]})
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
