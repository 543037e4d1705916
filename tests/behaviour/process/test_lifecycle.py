"""Component tests: engine lifecycle through the proxy, with the fake engine as a subprocess."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
from kit import FakeEngine, RunningProxy, StartProxy, group_alive, make_config, wait_for

from vllm_proxy.engines.states import State


def starts_logged(proxy: RunningProxy, name: str) -> int:
    return proxy.engine_starts(name)


async def test_cold_start_on_first_request(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(make_config(tmp_path))
    assert proxy.model("m1").state() is State.STOPPED
    assert proxy.model("m1").instances == []
    resp = await proxy.chat("m1")
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "m1"
    inst = proxy.instance("m1")
    assert inst.state is State.RUNNING
    assert inst.id == "m1#1"
    assert inst.engine.socket_path and inst.engine.socket_path.endswith("m1.1.sock")
    models = await (await proxy.http.get(proxy.url + "/v1/models")).json()
    assert {"id": "m1", "state": "running"}.items() <= models["data"][0].items()


async def test_concurrent_cold_requests_start_exactly_one_engine(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    cfg = make_config(tmp_path, {"m1": {"model": "x", "env": FakeEngine(startup_delay=1.0).env()}})
    proxy = await start_proxy(cfg)
    responses = await asyncio.gather(*(proxy.chat("m1") for _ in range(200)))
    assert [r.status for r in responses] == [200] * 200
    assert starts_logged(proxy, "m1") == 1
    assert proxy.manager.active_leases() == 0


async def test_alias_reaches_the_same_engine(tmp_path: Path, start_proxy: StartProxy) -> None:
    cfg = make_config(tmp_path, {"m1": {"model": "x", "aliases": ["vad", "v"]}})
    proxy = await start_proxy(cfg)
    for name in ("vad", "m1", "v"):
        resp = await proxy.chat(name)
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["model"] == "m1"
    assert starts_logged(proxy, "m1") == 1


async def test_engine_dying_while_starting_fails_waiters_at_once(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    cfg = make_config(
        tmp_path,
        {"m1": {"model": "x", "env": FakeEngine(exit_code=7).env()}},
        engine={"startup_timeout_s": 120},
    )
    proxy = await start_proxy(cfg)
    started = time.monotonic()
    results = await asyncio.gather(proxy.chat("m1"), proxy.chat("m1"))
    elapsed = time.monotonic() - started
    for resp in results:
        assert resp.status == 502
        err = (await resp.json())["error"]
        assert "exit code 7" in err["message"]
        # The engine's log lines stay with the operator: they may hold other users' prompts.
        assert "Engine core initialization failed" not in err["message"]
        assert err["code"] == "engine_start_failed"
    assert elapsed < 60, "waiters must not wait for the startup timeout"
    assert proxy.instance("m1").state is State.ERROR
    assert proxy.model("m1").state() is State.ERROR
    assert "Engine core initialization failed" in proxy.instance("m1").log_path.read_text()


async def test_startup_timeout_kills_engine_and_answers_504(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    cfg = make_config(
        tmp_path,
        {"m1": {"model": "x", "env": FakeEngine(startup_delay=60).env()}},
        engine={"startup_timeout_s": 1},
    )
    proxy = await start_proxy(cfg)
    resp = await proxy.chat("m1")
    assert resp.status == 504
    assert "not ready after 1s" in (await resp.json())["error"]["message"]
    inst = proxy.instance("m1")
    assert inst.state is State.ERROR
    assert inst.last_error and "not ready" in inst.last_error


async def test_port_race_is_retried_on_another_port(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    marker = tmp_path / "port-race-once"
    env = FakeEngine(port_in_use_once=marker).env()
    cfg = make_config(tmp_path, {"m1": {"model": "x", "env": env, "transport": "tcp"}})
    proxy = await start_proxy(cfg)
    resp = await proxy.chat("m1")
    assert resp.status == 200, await resp.text()
    assert marker.exists()
    assert starts_logged(proxy, "m1") == 2


async def test_idle_engine_is_unloaded(tmp_path: Path, start_proxy: StartProxy) -> None:
    cfg = make_config(tmp_path, engine={"idle_timeout_s": 0.5})
    proxy = await start_proxy(cfg)
    assert (await proxy.chat("m1")).status == 200
    inst = proxy.instance("m1")
    pgid = inst.engine.pid
    await wait_for(lambda: inst.state is State.STOPPED, what="idle unload")
    await wait_for(lambda: not group_alive(pgid), what="engine group gone")
    assert proxy.model("m1").instances == []
    # and it comes back on the next request, as a new instance
    assert (await proxy.chat("m1")).status == 200
    assert proxy.instance("m1").state is State.RUNNING
    assert proxy.instance("m1").id == "m1#2"


async def test_idle_timer_waits_for_the_last_lease(tmp_path: Path, start_proxy: StartProxy) -> None:
    cfg = make_config(
        tmp_path,
        {
            "m1": {
                "model": "x",
                "env": FakeEngine(tokens=12, token_delay=0.1).env(),
            }
        },
        engine={"idle_timeout_s": 0.3},
    )
    proxy = await start_proxy(cfg)
    assert (await proxy.chat("m1", max_tokens=1)).status == 200  # warm, starts the idle clock
    inst = proxy.instance("m1")
    resp = await proxy.chat("m1", stream=True)  # ~1.2 s stream, longer than the idle timeout
    body = await resp.read()
    assert body.endswith(b"data: [DONE]\n\n")
    assert inst.state is State.RUNNING, "unloaded while a stream was in flight"
    await wait_for(lambda: inst.state is State.STOPPED, what="idle unload after the stream")


async def test_crash_while_running_errors_in_flight_and_restarts(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    env = FakeEngine(crash_after=1, token_delay=0.05).env()
    proxy = await start_proxy(make_config(tmp_path, {"m1": {"model": "x", "env": env}}))
    assert (await proxy.chat("m1")).status == 200
    inst = proxy.instance("m1")
    resp = await proxy.chat("m1", stream=True)  # the engine exits mid-stream
    assert resp.status == 200
    text = (await resp.read()).decode()
    assert '"error"' in text.split("data: ")[-2], text  # a final SSE error event ...
    assert "exit code 3" in text  # ... naming the exit code
    assert text.endswith("data: [DONE]\n\n")
    await wait_for(lambda: inst.state is State.ERROR, what="ERROR after the crash")
    assert proxy.manager.active_leases() == 0
    assert proxy.model("m1").state() is State.ERROR
    # the next request starts a new instance
    resp = await proxy.chat("m1")
    assert resp.status == 200
    assert proxy.instance("m1").id == "m1#2" and inst.id == "m1#1"
    text = (await proxy.http.get(proxy.url + "/metrics")).text
    assert 'vllm_proxy_engine_restarts_total{model_id="m1",reason="crash"} 1.0' in await text()


async def test_non_stream_request_in_flight_gets_502_on_crash(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    env = FakeEngine(crash_after=0, token_delay=0.05).env()
    proxy = await start_proxy(make_config(tmp_path, {"m1": {"model": "x", "env": env}}))
    resp = await proxy.chat("m1")
    assert resp.status == 502
    err = (await resp.json())["error"]
    assert "exit code 3" in err["message"]
    assert proxy.manager.active_leases() == 0


async def test_client_disconnect_releases_lease_and_aborts_upstream(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    env = FakeEngine(tokens=1000, token_delay=0.05).env()
    proxy = await start_proxy(make_config(tmp_path, {"m1": {"model": "x", "env": env}}))
    async with aiohttp.ClientSession() as client:
        body = {"model": "m1", "stream": True, "messages": [{"role": "user", "content": "x"}]}
        async with client.post(proxy.url + "/v1/chat/completions", json=body) as resp:
            await resp.content.readany()
            inst = proxy.instance("m1")
            assert inst.leases == 1
    await wait_for(lambda: inst.leases == 0, what="lease released after disconnect")
    engine_metrics = inst.engine.base_url + "/metrics"
    engine_http = inst.engine.client(proxy.http)

    async def upstream_idle() -> bool:
        async with engine_http.get(engine_metrics) as r:
            text = await r.text()
        return 'vllm:num_requests_running{engine="0",model_name="m1"} 0' in text

    await wait_for(upstream_idle, what="engine aborted the request")
    assert inst.state is State.RUNNING, "a client hang-up must not mark the engine unhealthy"


async def test_stop_escalates_to_sigkill_for_the_whole_group(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    env = FakeEngine(ignore_sigterm=True, spawn_child=True).env()
    cfg = make_config(tmp_path, {"m1": {"model": "x", "env": env}}, engine={"stop_timeout_s": 0.5})
    proxy = await start_proxy(cfg)
    assert (await proxy.chat("m1")).status == 200
    inst = proxy.instance("m1")
    pgid = inst.engine.pid
    assert len(group_alive(pgid)) >= 3  # guard, engine, its child
    await inst.stop()
    assert inst.state is State.STOPPED
    await wait_for(lambda: not group_alive(pgid), what="whole group gone")


async def test_stop_is_idempotent_and_start_stop_cycles(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(make_config(tmp_path))
    for n in range(2):
        assert (await proxy.chat("m1")).status == 200
        inst = proxy.instance("m1")
        assert inst.id == f"m1#{n + 1}"
        await asyncio.gather(inst.stop(), inst.stop())
        assert inst.state is State.STOPPED
        await inst.stop()  # stopped: no-op
        assert inst.state is State.STOPPED


async def test_engine_output_goes_to_the_instance_log(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    cfg = make_config(tmp_path, engine={"log_dir": str(tmp_path / "logs")})
    proxy = await start_proxy(cfg)
    assert (await proxy.chat("m1")).status == 200
    text = (tmp_path / "logs" / "m1.1.log").read_text()
    assert "Application startup complete" in text
    assert proxy.instance("m1").log_path == tmp_path / "logs" / "m1.1.log"
