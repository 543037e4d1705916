"""The stall watchdog (`engine.stall_timeout_s`): an engine whose /health answers 200 but which
sends no byte on any request in flight (a decode stall) is killed and replaced. The fake engine
runs as a real process and stalls mid-stream with its health green (`FAKE_ENGINE_STALL_AFTER`)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from kit import FakeEngine, StartProxy, group_alive, make_config, wait_for
from kit.metrics import proxy_samples

from vllm_proxy.engines.progress import Progress
from vllm_proxy.engines.states import State

STALL_S = 1.5
WATCH = {"health_interval_s": 0.2, "health_timeout_s": 2, "health_misses": 3,
         "stall_timeout_s": STALL_S}  # fmt: skip


async def test_an_engine_that_stalls_mid_stream_with_health_green_is_killed_and_replaced(
    tmp_path: Path, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream stalls after its first chunks and a non-stream request never gets a byte, while
    the engine's /health answers 200: within `stall_timeout_s` (plus a probe) both are answered
    (an SSE error event, a 503 + Retry-After), the engine is killed, the next request gets a new
    one; a metric and an ERROR line say why. Before: both hung until `read_timeout_s` (600 s)
    and every later request went to the stalled engine."""
    env = FakeEngine(tokens=40, token_delay=0.02, stall_after=1).env()
    cfg = make_config(tmp_path, {"m1": {"model": "x", "env": env}}, engine=WATCH)
    proxy = await start_proxy(cfg)
    assert (await proxy.chat("m1", max_tokens=1)).status == 200  # request 1: served
    stalled = proxy.instance("m1")
    assert stalled.engine is not None and stalled.engine.pid is not None
    pgid = stalled.engine.pid

    stream = await proxy.chat("m1", stream=True)  # request 2: stalls after its first chunks
    assert stream.status == 200
    first = await stream.content.readany()
    assert first.startswith(b"data: ")
    began = time.monotonic()
    waiting = asyncio.ensure_future(proxy.chat("m1"))  # request 3: never gets a byte
    await wait_for(lambda: stalled.leases == 2, what="both requests in flight")
    async with proxy.http.get(f"{proxy.url}/health") as health:
        assert health.status == 200

    resp = await asyncio.wait_for(waiting, 60)
    took = time.monotonic() - began
    assert resp.status == 503, await resp.text()
    assert int(resp.headers["Retry-After"]) >= 1
    err = (await resp.json())["error"]
    assert err["code"] == "engine_stalled" and "stopped making progress" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    body = (await asyncio.wait_for(stream.read(), 60)).decode()
    assert '"engine_stalled"' in body and body.endswith("data: [DONE]\n\n"), body[-500:]
    assert took < STALL_S + 20, f"{took:.1f}s to give up on a stalled engine"
    assert stalled.state is State.UNHEALTHY
    await wait_for(lambda: not group_alive(pgid), what="the stalled engine's group killed")
    stalls = [r for r in caplog.records if r.levelno == logging.ERROR and "decode stall" in
              r.getMessage()]  # fmt: skip
    assert stalls, "an ERROR line names the stall"
    assert "request(s) in flight" in stalls[0].getMessage()

    # The next request starts a new engine (its first request is served: STALL_AFTER=1).
    resp = await proxy.chat("m1", max_tokens=1)
    assert resp.status == 200, await resp.text()
    fresh = proxy.instance("m1")
    assert fresh is not stalled and fresh.state is State.RUNNING
    metrics = await proxy_samples(proxy)
    assert metrics.get("vllm_proxy_engine_restarts_total", model_id="m1", reason="stalled") == 1


async def test_a_slow_stream_and_an_idle_engine_are_no_stall(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Tokens every 0.3 s for longer than `stall_timeout_s` in all, then the engine idle for
    longer than it: nothing is killed."""
    env = FakeEngine(tokens=10, token_delay=0.3).env()
    cfg = make_config(tmp_path, {"m1": {"model": "x", "env": env}}, engine=WATCH)
    proxy = await start_proxy(cfg)
    resp = await proxy.chat("m1", stream=True, max_tokens=10)
    body = (await asyncio.wait_for(resp.read(), 60)).decode()
    assert body.endswith("data: [DONE]\n\n") and "error" not in body
    inst = proxy.instance("m1")
    idle_until = time.monotonic() + STALL_S * 2
    await wait_for(lambda: time.monotonic() > idle_until, timeout=30, what="an idle spell")
    assert inst.state is State.RUNNING and proxy.instance("m1") is inst
    assert (await proxy.chat("m1", max_tokens=1)).status == 200
    metrics = await proxy_samples(proxy)
    assert metrics.get("vllm_proxy_engine_restarts_total", model_id="m1", reason="stalled") in (
        None,
        0,
    )


class _Flow:
    def __init__(self, held: bool = False) -> None:
        self.held = held

    def waiting_on_client(self) -> bool:
        return self.held


def test_progress_counts_silence_only_while_requests_are_in_flight_and_not_held_back() -> None:
    """`Progress` as a table of steps: (what happens, the clock, the stall it reports)."""
    now = [0.0]
    p = Progress(clock=lambda: now[0])
    a, b = _Flow(), _Flow()
    steps: list[tuple[str, float, float]] = [
        ("idle", 10, 0),  # nothing in flight: never a stall
        ("begin a", 10, 0),  # the clock starts with the first request of a busy spell
        ("", 13, 3),
        ("byte", 14, 0),  # a byte on any request resets it
        ("begin b", 15, 1),  # a second request does not reset it
        ("", 20, 6),
        ("hold b", 21, 0),  # a client that takes nothing: the engine is not the one stalling
        ("free b", 22, 1),  # (counted from the last look that saw it held)
        ("", 25, 4),
        ("end a", 26, 5),
        ("end b", 27, 0),
    ]
    for what, at, want in steps:
        now[0] = at
        if what == "begin a":
            p.begin(a)
        elif what == "begin b":
            p.begin(b)
        elif what == "byte":
            p.seen += 10
        elif what == "hold b":
            b.held = True
        elif what == "free b":
            b.held = False
        elif what == "end a":
            p.end(a)
        elif what == "end b":
            p.end(b)
        assert p.stalled_for() == want, (what, at)
