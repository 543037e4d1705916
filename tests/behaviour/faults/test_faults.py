"""Faults injected through real processes: hung engines, crash loops."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import aiohttp
import pytest
from kit import FAKE_ENGINE, FakeEngine, StartProxy, group_alive, make_config, wait_for
from kit.metrics import proxy_samples

from vllm_proxy.engines.states import State

WATCH = {"health_interval_s": 0.2, "health_timeout_s": 0.3, "health_misses": 3}


async def test_hung_engine_is_killed_and_replaced(tmp_path: Path, start_proxy: StartProxy) -> None:
    """SIGSTOP (a hung engine): the health watcher marks it unhealthy within a few probes; the
    request waiting for an answer gets 503 + Retry-After, the stream an SSE error event, and the
    next request is served by a new instance."""
    env = FakeEngine(tokens=100, token_delay=0.05).env()
    cfg = make_config(
        tmp_path, {"m1": {"model": "x", "env": env}}, server={"admin_open": True}, engine=WATCH
    )
    proxy = await start_proxy(cfg)
    assert (await proxy.chat("m1", max_tokens=1)).status == 200
    hung = proxy.instance("m1")
    assert hung.engine is not None and hung.engine.pid is not None
    pgid = hung.engine.pid
    stream = await proxy.chat("m1", stream=True)
    await stream.content.readany()
    waiting = asyncio.ensure_future(proxy.chat("m1"))  # ~5 s of tokens: still waiting
    await wait_for(lambda: hung.leases == 2, what="both requests in flight")
    os.killpg(pgid, signal.SIGSTOP)

    resp = await asyncio.wait_for(waiting, 30)
    assert resp.status == 503, await resp.text()
    assert int(resp.headers["Retry-After"]) >= 1
    err = (await resp.json())["error"]
    assert err["code"] == "engine_unhealthy" and "health checks" in err["message"]
    body = (await asyncio.wait_for(stream.read(), 30)).decode()
    assert '"engine_unhealthy"' in body and body.endswith("data: [DONE]\n\n")
    assert hung.state is State.UNHEALTHY and hung.unhealthy
    await wait_for(lambda: not group_alive(pgid), what="the hung group killed")
    # Operators see the public state (as in the metrics) and the exact one as `phase`.
    row = hung.status()
    assert (row["state"], row["phase"]) == ("error", "unhealthy")
    async with proxy.http.get(proxy.url + "/admin/models/m1/logs?instance=m1%231") as logs:
        assert (await logs.text()).startswith("==> m1#1 (error) <==")

    resp = await proxy.chat("m1", max_tokens=1)
    assert resp.status == 200
    fresh = proxy.instance("m1")
    assert fresh is not hung and fresh.state is State.RUNNING
    metrics = await proxy_samples(proxy)
    assert metrics.get("vllm_proxy_engine_restarts_total", model_id="m1", reason="unhealthy") == 1.0


async def test_crash_loop_backs_off_and_a_success_resets(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    marker = tmp_path / "healthy-now"
    script = f'[ -e {marker} ] || {{ echo "boom" >&2; exit 7; }}; exec {" ".join(FAKE_ENGINE)} "$@"'
    models = {"m1": {"model": "x", "command": ["sh", "-c", script, "sh"]}}
    proxy = await start_proxy(make_config(tmp_path, models, engine={"max_backoff_s": 2}))
    model = proxy.model("m1")

    resp = await proxy.chat("m1")  # a real start: the engine exits with 7
    assert resp.status == 502 and "exit code 7" in (await resp.json())["error"]["message"]
    for retry_after in (1, 2):
        fast = await proxy.chat("m1")  # within the back-off: refused at once, no new engine
        assert fast.status == 503, await fast.text()
        assert fast.headers["Retry-After"] == str(retry_after)
        err = (await fast.json())["error"]
        assert err["code"] == "engine_backoff" and "exit code 7" in err["message"]
        assert "boom" not in err["message"], "engine output stays out of client errors"
        starts = proxy.engine_starts("m1")
        await wait_for(lambda: model.backoff_s() == 0, timeout=5, what="back-off over")
        if retry_after == 1:
            resp = await proxy.chat("m1")  # the second real start fails again: 2 s next
            assert resp.status == 502
            assert proxy.engine_starts("m1") == starts + 1
    assert model.failures == 2
    marker.touch()
    resp = await proxy.chat("m1")
    assert resp.status == 200, await resp.text()
    inst = proxy.instance("m1")
    await inst.stop()  # it ran and was stopped: the loop is over
    assert model.failures == 0 and model.backoff_s() == 0


async def test_a_port_taken_over_while_running_marks_the_engine_unhealthy(
    tmp_path: Path, start_proxy: StartProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watcher re-checks that the listener is still the socket verified at readiness."""
    proxy = await start_proxy(make_config(tmp_path, engine=WATCH))
    assert (await proxy.chat("m1", max_tokens=1)).status == 200
    first = proxy.instance("m1")
    assert first.engine is not None and first.engine.listener_unchanged()
    monkeypatch.setattr(first.engine, "listener_unchanged", lambda: False)
    await wait_for(lambda: first.state is State.UNHEALTHY, what="marked unhealthy")
    assert first.unhealthy and "no longer held" in (first.last_error or "")
    assert (await proxy.chat("m1", max_tokens=1)).status == 200
    assert proxy.instance("m1") is not first


async def test_a_client_gone_during_a_cold_start_leaks_nothing(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    models = {"m1": {"model": "x", "env": FakeEngine(startup_delay=1.5).env()}}
    proxy = await start_proxy(make_config(tmp_path, models))
    model = proxy.model("m1")
    async with aiohttp.ClientSession() as client:
        body = {"model": "m1", "messages": [{"role": "user", "content": "x"}]}
        request = asyncio.ensure_future(client.post(proxy.url + "/v1/chat/completions", json=body))
        await wait_for(lambda: model.waiting == 1, what="waiting for the cold start")
        request.cancel()  # the client goes away while the engine loads
        with contextlib.suppress(asyncio.CancelledError):
            await request
    await wait_for(lambda: model.waiting == 0, what="the waiter left the queue")
    await wait_for(lambda: model.serving() is not None, what="the start finished anyway")
    assert proxy.manager.active_leases() == 0
    assert (await proxy.chat("m1", max_tokens=1)).status == 200
    assert proxy.engine_starts("m1") == 1, "the next request used the engine that was started"


async def test_a_cancelled_stop_still_finishes(tmp_path: Path, start_proxy: StartProxy) -> None:
    """The caller of a stop goes away (an admin client hangs up during an unload): the stop
    runs on by itself, the instance ends STOPPED and its claim and process are gone."""
    env = FakeEngine(ignore_sigterm=True).env()
    cfg = make_config(tmp_path, {"m1": {"model": "x", "env": env}}, engine={"stop_timeout_s": 0.5})
    proxy = await start_proxy(cfg)
    assert (await proxy.chat("m1", max_tokens=1)).status == 200
    inst = proxy.instance("m1")
    assert inst.engine is not None and inst.engine.pid is not None
    pgid = inst.engine.pid
    caller = asyncio.ensure_future(inst.stop())
    await wait_for(lambda: inst.state is State.STOPPING, what="stopping")
    caller.cancel()
    await wait_for(lambda: inst.state is State.STOPPED, what="stopped all the same")
    await wait_for(lambda: not group_alive(pgid), what="the group killed after the grace")
    await inst.stop()  # and a later stop returns at once
    assert (await proxy.chat("m1", max_tokens=1)).status == 200


async def test_a_crash_loop_never_shows_engine_log_lines(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Engines that die soon after readiness twice in a row: the back-off answer names the
    cause, never the engine's output (which may hold other users' prompts)."""
    env = FakeEngine(crash_after=0, token_delay=0.05).env()
    proxy = await start_proxy(make_config(tmp_path, {"m1": {"model": "x", "env": env}}))
    for _ in range(2):
        assert (await proxy.chat("m1")).status == 502
    resp = await proxy.chat("m1")
    assert resp.status == 503, await resp.text()
    message = (await resp.json())["error"]["message"]
    assert "exit code 3" in message and "last log lines" not in message and "\n" not in message
