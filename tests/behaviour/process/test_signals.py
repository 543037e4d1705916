"""The proxy as a real process: SIGTERM drains and exits 0, kill -9 leaves no engine behind."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from kit import (
    FAKE_ENGINE,
    FakeEngine,
    StartProxy,
    free_port,
    group_alive,
    wait_for,
    wait_for_sync,
    wait_healthy,
)


def write_config(tmp_path: Path, env: dict[str, str], **server: Any) -> tuple[Path, int]:
    port = free_port()
    cfg = {
        "server": {"host": "127.0.0.1", "port": port, "state_dir": str(tmp_path / "st"), **server},
        "engine": {"command": FAKE_ENGINE, "stop_timeout_s": 1, "port_range": [30000, 39999]},
        "models": {"m1": {"model": "x", "env": env}, "m2": {"model": "y", "env": env}},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, port


@pytest.fixture
def proxy_proc(tmp_path: Path, start_proxy: StartProxy) -> Any:
    def start(env: dict[str, str], **server: Any) -> tuple[subprocess.Popen[bytes], str]:
        path, port = write_config(tmp_path, env, **server)
        proxy = start_proxy.process(path, port, tmp_path / "proxy.log")
        return proxy.proc, proxy.url

    return start


def engine_groups(tmp_path: Path) -> list[int]:
    log = (tmp_path / "proxy.log").read_text()
    ports = re.findall(r"ready on (?:port|socket) (\S+)", log)
    registry = tmp_path / "st" / "engines.json"
    groups = []
    if registry.exists():
        groups = [int(k) for k in json.loads(registry.read_text())["engines"]]
    assert len(groups) == len(ports), (groups, ports)
    return groups


CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


async def test_kill_9_of_the_proxy_takes_every_engine_tree_down(
    tmp_path: Path, proxy_proc: Any
) -> None:
    # The spawned child ignores SIGTERM and survives its parent, like vLLM's EngineCore.
    proc, url = proxy_proc(FakeEngine(spawn_child=True).env())
    async with aiohttp.ClientSession() as s:
        await wait_healthy(s, url)
        for model in ("m1", "m2"):
            async with s.post(url + "/v1/chat/completions", json={**CHAT, "model": model}) as r:
                assert r.status == 200
    groups = engine_groups(tmp_path)
    assert len(groups) == 2 and all(len(group_alive(g)) >= 3 for g in groups)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    wait_for_sync(lambda: not any(group_alive(g) for g in groups), what="engine trees gone")


async def test_sigterm_drains_in_flight_refuses_new_and_exits_0(
    tmp_path: Path, proxy_proc: Any
) -> None:
    env = FakeEngine(tokens=10, token_delay=0.15).env()
    proc, url = proxy_proc(env, drain_timeout_s=20)
    async with aiohttp.ClientSession() as s:
        await wait_healthy(s, url)
        async with s.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 1}) as r:
            assert r.status == 200
        groups = engine_groups(tmp_path)
        stream = await s.post(url + "/v1/chat/completions", json={**CHAT, "stream": True})
        assert stream.status == 200
        await stream.content.readany()  # the stream is in flight
        proc.send_signal(signal.SIGTERM)

        async def refusing() -> bool:
            async with s.post(url + "/v1/chat/completions", json=CHAT) as r:
                return r.status == 503 and "Retry-After" in r.headers

        await wait_for(refusing, what="new requests refused with 503")
        rest = await stream.read()
        assert rest.endswith(b"data: [DONE]\n\n"), "the in-flight stream must complete"
        stream.release()
    code = await asyncio.to_thread(proc.wait, 30)
    assert code == 0
    assert not any(group_alive(g) for g in groups)
    assert "vllm-proxy stopped" in (tmp_path / "proxy.log").read_text()


async def test_second_signal_forces_exit(tmp_path: Path, proxy_proc: Any) -> None:
    env = FakeEngine(tokens=1000, token_delay=0.05).env()
    proc, url = proxy_proc(env, drain_timeout_s=120)
    async with aiohttp.ClientSession() as s:
        await wait_healthy(s, url)
        stream = await s.post(url + "/v1/chat/completions", json={**CHAT, "stream": True})
        await stream.content.readany()
        groups = engine_groups(tmp_path)
        proc.send_signal(signal.SIGTERM)
        await wait_for(
            lambda: "draining" in (tmp_path / "proxy.log").read_text(), what="drain started"
        )
        proc.send_signal(signal.SIGINT)
        code = await asyncio.to_thread(proc.wait, 30)
        stream.close()
    assert code != 0
    wait_for_sync(
        lambda: not any(group_alive(g) for g in groups), timeout=30, what="engines killed"
    )


async def test_json_log_format_never_logs_bodies(tmp_path: Path) -> None:
    path, port = write_config(tmp_path, {})
    secret = "do-not-log-this-prompt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_proxy", "--config", str(path), "--log-format", "json"],
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as s:
            await wait_healthy(s, url)
            body = {"model": "m1", "messages": [{"role": "user", "content": secret}]}
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
            headers = {"Content-Type": "application/json"}
            async with s.post(
                url + "/v1/chat/completions", data=b"{" + secret.encode(), headers=headers
            ) as r:
                assert r.status == 400
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.to_thread(proc.communicate, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [json.loads(line) for line in err.decode().splitlines() if line.strip()]
    assert lines and all({"ts", "level", "logger", "msg"} <= set(e) for e in lines)
    assert any("m1#1: STARTING -> RUNNING" in e["msg"] for e in lines)
    assert secret not in err.decode()


async def test_sighup_right_after_ready_reloads_and_never_kills(tmp_path: Path) -> None:
    """systemd may deliver SIGHUP the moment it reads READY=1: the handler must be there."""
    path, port = write_config(tmp_path, {})
    notify = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    sock.settimeout(60)
    log = open(tmp_path / "proxy.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_proxy", "--config", str(path)],
        stderr=log,
        env={**os.environ, "NOTIFY_SOCKET": str(notify)},
    )
    try:
        message = await asyncio.to_thread(sock.recv, 4096)
        assert message == b"READY=1"
        proc.send_signal(signal.SIGHUP)  # at once, as systemctl reload right after start would
        messages = [await asyncio.to_thread(sock.recv, 4096) for _ in range(2)]
        assert messages == [b"RELOADING=1", b"READY=1"]
        assert proc.poll() is None, "the proxy survived the SIGHUP"
        async with aiohttp.ClientSession() as s:
            await wait_healthy(s, f"http://127.0.0.1:{port}")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close()
        log.close()
    assert "SIGHUP: reloading" in (tmp_path / "proxy.log").read_text()
