"""`make demo-fake`: the demo's proxy, run as `python -m vllm_proxy_demo --fake` does it.

What the demo prints must be true: the models answer, and the console, the admin API and the
`ctl` command it points to work on its loopback listener without a key.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from kit import free_port, wait_for

from vllm_proxy.config import load_config
from vllm_proxy_demo import MODELS, build_config


def test_the_demo_config_loads_and_opens_admin_on_loopback_only(tmp_path: Path) -> None:
    import yaml

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(build_config(tmp_path, 18080, fake=True)))
    config = load_config(str(path))
    assert config.server.host == "127.0.0.1"
    assert config.server.admin_open
    assert sorted(config.models) == sorted(MODELS)


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm_proxy_demo",
            "--fake",
            "--dir",
            str(tmp_path / "demo"),
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield proc, port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def read_until(proc: subprocess.Popen[str], marker: str) -> str:
    """What the demo printed, up to the line with `marker` (it prints before it serves)."""
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if marker in line:
            return "".join(lines)
    raise AssertionError("the demo ended before printing " + marker + ":\n" + "".join(lines))


async def test_what_the_demo_prints_works(demo: tuple[subprocess.Popen[str], int]) -> None:
    proc, port = demo
    base = f"http://127.0.0.1:{port}"

    async def up() -> bool:
        assert proc.poll() is None, "the demo's proxy exited"
        try:
            async with aiohttp.ClientSession() as s, s.get(base + "/health") as r:
                return r.status == 200
        except aiohttp.ClientConnectionError:
            return False

    await wait_for(up, 30, "the demo's proxy to listen")
    printed = await asyncio.to_thread(read_until, proc, "Engine logs:")
    assert f"Console: {base}/ " in printed, printed
    ctl = next(line for line in printed.splitlines() if " ctl ps" in line).split(":  ", 1)[1]
    env_var, _, command = ctl.partition(" ")
    name, _, value = env_var.partition("=")
    out = subprocess.run(command.split(), env={**os.environ, name: value}, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and MODELS[0] in out.stdout, out
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/admin/models") as r:
            assert r.status == 200, await r.text()
            rows = (await r.json())["models"]
            assert sorted(row["name"] for row in rows) == sorted(MODELS)
        async with s.get(base + "/") as r:
            assert r.status == 200
            assert "text/html" in r.headers["Content-Type"]
        chat = {"model": MODELS[0], "messages": [{"role": "user", "content": "hi"}]}
        async with s.post(base + "/v1/chat/completions", json=chat) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["choices"][0]["message"]["content"]
