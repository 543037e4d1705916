#!/usr/bin/env python3
"""LoRA adapter switch latency: via vllm-proxy and straight at the same engine, side by side.

    .venv/bin/python benchmarks/lora_switch.py [--engine fake|vllm] [--rounds 40]
                                               [--load-delay 0.02] [--append docs/benchmarks.md]
                                               [--out FILE] [--keep-tmp]

One vllm-proxy (a real process, ``vllm-proxy --config``) serves one model with two adapters,
``a`` and ``b``, and ``max_adapters: 1``: every request for the other adapter makes the proxy
unload the one the engine holds and load the one asked for, then send the request. The engine
is the fake engine (``--engine fake``, its load taking ``FAKE_ENGINE_LORA_LOAD_DELAY``) or the
CPU build of vLLM with the tiny Llama and two random rank-8 adapters (``--engine vllm``). It
serves on a loopback port (``transport: tcp``) so that the benchmark reaches the very same
engine directly, where it registers the same two folders under names of its own
(``direct-a``, ``direct-b``) and does what the proxy does: unload the other one beside the
load of the one it wants, then the request. Rounds alternate the adapter, and which of proxy
and direct goes first; each request is one greedy completion of 4 tokens; both sides keep
their connections alive (one client session), as a client of either would.

Rows: a switch (unload + load + completion) via the proxy and direct, the proxy's added time
(the per-round differences), and for reference a completion for the adapter already loaded,
both ways; each cell is median / p90. Goal: a switch via the proxy adds <= 5 ms to vLLM's own
load.

Prints the table and the command; raw numbers go to ``benchmarks/results/lora_switch.json``;
``--append FILE`` also writes the table as the section ``## LoRA adapter switch`` of FILE
(replaced when there). Everything binds 127.0.0.1 and is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp
import docs_writer
import harness
import loadgen

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "lora_switch.json"
SECTION = "## LoRA adapter switch"
HEADINGS = {"fake": "Fake engine", "vllm": "vLLM CPU build, tiny Llama"}
INTRO = """What a request for the other adapter costs with `max_adapters: 1` (the proxy unloads the
adapter the engine holds beside loading the one asked for, then sends the request), through
the proxy and straight at the same engine doing the same calls (`benchmarks/lora_switch.py`;
method in its docstring). Cells are median / p90 in ms over the rounds; *added* is the
per-round difference.
"""
GOAL_MS = 5.0
ADAPTERS = ("a", "b")


def make_adapters(args: argparse.Namespace, tmp: Path) -> tuple[str, dict[str, Path]]:
    """(the base model's path, the two adapter folders)."""
    if args.engine == "fake":
        folders = {}
        for name in ADAPTERS:
            folder = tmp / "lora" / name
            folder.mkdir(parents=True)
            (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))
            folders[name] = folder
        return "fake/base", folders
    from tiny_llama import ensure_tiny_model
    from tiny_llama.lora import make_adapter

    model = ensure_tiny_model(tmp / "tiny")
    folders = {n: make_adapter(model, tmp / "lora" / n, seed=i + 1) for i, n in enumerate(ADAPTERS)}
    return str(model), folders


def lora_config(
    args: argparse.Namespace, tmp: Path, port: int, model: str, folders: dict[str, Path]
) -> dict[str, Any]:
    engine: dict[str, Any] = {
        "transport": "tcp",
        "idle_timeout_s": 0,
        "stop_timeout_s": 5,
        "health_interval_s": 0,
        "port_range": [32000, 32999],
    }
    if args.engine == "fake":
        engine["command"] = harness.FAKE_ENGINE
        engine["env"] = {
            "FAKE_ENGINE_LORA_LOAD_DELAY": f"{args.load_delay:g}",
            "FAKE_ENGINE_TOKENS": "4",
        }
        engine["startup_timeout_s"] = 60
    else:
        from vllm_proxy_demo import CPU_ARGS, CPU_ENV

        engine.update(args=CPU_ARGS, env=CPU_ENV, startup_timeout_s=300)
    adapters = {n: str(p) for n, p in folders.items()}
    return harness.proxy_config(
        port,
        tmp / "state",
        {"base": {"model": model, "max_adapters": 1, "adapters": adapters}},
        server={"admin_open": True, "access_log": False, "drain_timeout_s": 2},
        engine=engine,
    )


def body(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": "the cat sat on", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}  # fmt: skip


async def post(http: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> tuple[int, bytes]:
    async with http.post(url, json=payload) as resp:
        return resp.status, await resp.read()


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path, procs: harness.Procs) -> None:
        self.args, self.tmp, self.procs = args, tmp, procs
        self.proxy_url = ""
        self.engine_url = ""
        self.folders: dict[str, Path] = {}
        self.rows: list[dict[str, Any]] = []
        self.direct_loaded: str | None = None

    def start(self) -> None:
        model, self.folders = make_adapters(self.args, self.tmp)
        (port,) = harness.pick_ports(1)
        config = lora_config(self.args, self.tmp, port, model, self.folders)
        self.log = self.tmp / "proxy.log"
        self.proxy_url = harness.start_proxy(self.procs, "proxy", config).url

    async def warm(self, http: aiohttp.ClientSession) -> None:
        """Start the engine through the proxy and find its port."""
        status, data = await post(http, self.proxy_url + "/v1/completions", body("base"))
        assert status == 200, data
        async with http.get(self.proxy_url + "/admin/models") as resp:
            snapshot = await resp.json()
        rows = snapshot["models"] if isinstance(snapshot, dict) else snapshot
        port = rows[0]["instances"][0]["port"]
        self.engine_url = f"http://127.0.0.1:{port}"
        for name in ADAPTERS:  # the first registration of each is not a switch
            await self.via_proxy(http, name)
            await self.direct(http, name)

    async def via_proxy(self, http: aiohttp.ClientSession, name: str) -> float:
        started = time.perf_counter()
        status, data = await post(http, self.proxy_url + "/v1/completions", body(name))
        seconds = time.perf_counter() - started
        assert status == 200, data
        return seconds

    async def direct(self, http: aiohttp.ClientSession, name: str) -> float:
        """What the proxy does, done by the client: the other adapter's unload beside this
        one's load (when it is not loaded), then the completion."""
        own = f"direct-{name}"
        started = time.perf_counter()
        if self.direct_loaded != own:
            calls = [post(http, self.engine_url + "/v1/load_lora_adapter",
                          {"lora_name": own, "lora_path": str(self.folders[name])})]  # fmt: skip
            if self.direct_loaded is not None:
                calls.append(post(http, self.engine_url + "/v1/unload_lora_adapter",
                                  {"lora_name": self.direct_loaded}))  # fmt: skip
            results = await asyncio.gather(*calls)
            assert all(s == 200 for s, _ in results), results
            self.direct_loaded = own
        status, data = await post(http, self.engine_url + "/v1/completions", body(own))
        seconds = time.perf_counter() - started
        assert status == 200, data
        return seconds

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await self.warm(http)
            for rnd in range(self.args.rounds):
                name = ADAPTERS[rnd % 2]
                order = ("proxy", "direct") if rnd % 4 < 2 else ("direct", "proxy")
                row: dict[str, Any] = {"round": rnd, "adapter": name}
                for side in order:  # a switch: the other adapter was used last, both ways
                    call = self.via_proxy if side == "proxy" else self.direct
                    row[f"{side}_switch_ms"] = await call(http, name) * 1000
                for side in order:  # the same adapter again: no load
                    call = self.via_proxy if side == "proxy" else self.direct
                    row[f"{side}_loaded_ms"] = await call(http, name) * 1000
                self.rows.append(row)

    def loads(self) -> int:
        """Loads the proxy made (its log): the warm-up's two, then one per round."""
        lines = self.log.read_text(errors="replace").splitlines()
        return sum(1 for line in lines if ": adapter " in line and " loaded in " in line)


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    def stats(values: list[float]) -> dict[str, float]:
        return {"median": loadgen.med(values), "p90": loadgen.pct(values, 90)}

    keys = ("proxy_switch_ms", "direct_switch_ms", "proxy_loaded_ms", "direct_loaded_ms")
    out = {key: stats([r[key] for r in rows]) for key in keys}
    out["added_switch_ms"] = stats([r["proxy_switch_ms"] - r["direct_switch_ms"] for r in rows])
    out["added_loaded_ms"] = stats([r["proxy_loaded_ms"] - r["direct_loaded_ms"] for r in rows])
    return out


def table(res: dict[str, Any]) -> list[str]:
    s = res["summary"]
    engine = "fake engine" if res["args"]["engine"] == "fake" else "vLLM CPU build, tiny Llama"
    lines = [
        f"Measured {res['when']} at {res['git']} on {res['machine']}; {engine}, "
        f"{res['args']['rounds']} rounds, {res['loads']} adapter loads by the proxy; host load"
        f" average {res['load_average'][0]:.1f} -> {res['load_average'][1]:.1f} (other work on"
        " the host shows in the p90s).",
        "",
        "| request | via proxy (ms) | direct (ms) | added by the proxy (ms) |",
        "|---|---|---|---|",
    ]
    for key, label in (("switch", "switch: unload the other, load this one, complete"),
                       ("loaded", "adapter already loaded: complete")):  # fmt: skip
        p, d, a = s[f"proxy_{key}_ms"], s[f"direct_{key}_ms"], s[f"added_{key}_ms"]
        lines.append(
            f"| {label} | {p['median']:.2f} / {p['p90']:.2f} | {d['median']:.2f} / {d['p90']:.2f}"
            f" | {a['median']:.2f} / {a['p90']:.2f} |"
        )
    added = s["added_switch_ms"]["median"]
    verdict = "met" if added <= GOAL_MS else "missed"
    lines += [
        "",
        f"Goal: a switch via the proxy adds <= {GOAL_MS:g} ms to the engine's own unload and load"
        f" ({verdict}: {added:.2f} ms).",
        "",
        "Reproduce:",
        "",
        "```",
        res["command"],
        "```",
    ]
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=("fake", "vllm"), default="fake")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--load-delay", type=float, default=0.02,
                   help="FAKE_ENGINE_LORA_LOAD_DELAY (fake engine only)")  # fmt: skip
    p.add_argument("--out", type=Path, default=RESULTS, help="raw numbers (JSON)")
    p.add_argument("--append", type=Path, help="also write the table as a section of this file")
    p.add_argument("--keep-tmp", action="store_true", help="keep the config and the logs")
    args = p.parse_args()
    with harness.session("vllm-proxy-lora-", args.keep_tmp) as (tmp, procs):
        bench = Bench(args, tmp, procs)
        load_before = os.getloadavg()[0]
        try:
            bench.start()
            asyncio.run(bench.run())
            loads = bench.loads()
        except Exception:
            print(harness.tail(tmp / "proxy.log", 30), file=sys.stderr)
            raise
    command = " ".join(
        shlex.quote(a) for a in [".venv/bin/python", "benchmarks/lora_switch.py", *sys.argv[1:]]
    )
    res = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "git": harness.git_head(),
        "machine": harness.machine(),
        "command": command,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": bench.rows,
        "loads": loads,
        "load_average": [load_before, os.getloadavg()[0]],
        "summary": summarize(bench.rows),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    lines = table(res)
    print("\n" + "\n".join(lines))
    if args.append is not None:
        part = f"### {HEADINGS[args.engine]}\n\n" + "\n".join(lines)
        docs_writer.put_part(args.append, SECTION, INTRO, part)
    return 0


if __name__ == "__main__":
    sys.exit(main())
