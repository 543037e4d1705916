"""A second proxy started by mistake (same state dir, or same port) leaves the running one alone.

Both run as real processes: the second must exit 2 with one line before it touches the first's
engines, its registry or its port.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from kit import FAKE_ENGINE, FakeEngine, StartProxy, free_port, group_alive, wait_for

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


def write_config(path: Path, port: int, state: Path) -> Path:
    cfg = {
        "server": {"host": "127.0.0.1", "port": port, "state_dir": str(state)},
        "engine": {"command": FAKE_ENGINE, "stop_timeout_s": 1, "port_range": [30000, 39999]},
        "models": {"m1": {"model": "x", "env": FakeEngine(spawn_child=True).env()}},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def first_proxy(
    tmp_path: Path, start_proxy: StartProxy
) -> Iterator[tuple[subprocess.Popen[bytes], Path, int]]:
    port = free_port()
    path = write_config(tmp_path / "first.yaml", port, tmp_path / "st")
    first = start_proxy.process(path, port, tmp_path / "first.log")
    yield first.proc, path, port
    first.stop()


async def chat_ok(url: str) -> bool:
    async with aiohttp.ClientSession() as s:
        try:
            async with s.post(url + "/v1/chat/completions", json=CHAT) as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False


def engines(state: Path) -> dict[int, list[int]]:
    """Engine process groups in the registry, with their live members."""
    groups = json.loads((state / "engines.json").read_text())["engines"]
    return {int(g): sorted(group_alive(int(g))) for g in groups}


async def run_second(path: Path) -> tuple[int, list[str]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "vllm_proxy",
        "--config",
        str(path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, (out + err).decode().splitlines()


async def test_a_second_proxy_leaves_the_first_and_its_engines_untouched(
    tmp_path: Path, first_proxy: Any
) -> None:
    proc, path, port = first_proxy
    url = f"http://127.0.0.1:{port}"
    await wait_for(lambda: chat_ok(url), timeout=30, what="the first proxy serving")
    before = engines(tmp_path / "st")
    assert len(before) == 1 and all(len(pids) >= 3 for pids in before.values())

    # The same config: the same state dir and the same port.
    code, lines = await run_second(path)
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("vllm-proxy: state dir ") and f"pid {proc.pid}" in lines[0]
    assert "server.state_dir" in lines[0]

    # Its own state dir, the first one's port.
    other = write_config(tmp_path / "other.yaml", port, tmp_path / "other-st")
    code, lines = await run_second(other)
    assert code == 2, lines
    assert lines == [
        f"vllm-proxy: cannot listen on 127.0.0.1:{port}: port {port} is in use by another "
        "program; set server.port (or --port) to a free port"
    ]

    assert proc.poll() is None, "the first proxy is still running"
    assert engines(tmp_path / "st") == before, "same engine groups, same pids, all alive"
    assert await chat_ok(url)
    log = (tmp_path / "first.log").read_text()
    assert log.count("m1#1: STARTING -> RUNNING") == 1 and "m1#2" not in log, "no new engine"
