#!/usr/bin/env python3
"""Cold start through vllm-proxy on the CPU build of vLLM: time to first token.

    .venv/bin/python benchmarks/coldstart.py [--rounds 2] [--budget-s 900] [--docs]
                                             [--out FILE] [--keep-tmp]

One vllm-proxy (a real process, ``vllm-proxy --config``) per round, with a fresh state dir,
serves the tiny random-weight Llama (``tiny_llama``, the real-vLLM tier's model) as two models
on the same folder: ``tiny`` (``read_ahead: true``, the default) and ``tiny-noread``
(``read_ahead: false``, its ``VLLM_CACHE_ROOT`` set to ``tiny``'s compile cache). vLLM runs
with torch.compile (no ``enforce_eager``), so the compile cache matters. Each case is one
streamed completion to a model with no engine, timed from the request to the first SSE event
with text; the engine is unloaded (``POST /admin/models/<m>/unload``) after each:

* ``first start``: the round's first start, the compile cache folder empty;
* ``cache kept``: the next start, its compile cache kept (the default);
* ``cache removed``: ``<state_dir>/vllm-cache/tiny`` removed before the start;
* ``page cache dropped, read-ahead on|off``: the compile cache kept, the weight files dropped
  from the page cache (``posix_fadvise(DONTNEED)``) just before the request, then ``tiny`` (the
  proxy reads the weights ahead while the start waits) or ``tiny-noread``; the two alternate
  which goes first.

Rounds stop early when the next one would end past ``--budget-s``. Prints a table of medians
(and min-max) and the command; raw numbers go to ``benchmarks/results/coldstart.json``;
``--docs`` writes the section ``## Cold start`` of docs/benchmarks.md. Everything binds
127.0.0.1 and is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp
import docs_writer
import harness

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "coldstart.json"
SECTION = "## Cold start"
INTRO = """{section}

Time to first token of a streamed completion to a model with no engine, through vllm-proxy
(a process, `vllm-proxy --config`), on the CPU build of vLLM ({vllm}) with torch.compile
(no `enforce_eager`) and the tiny random-weight Llama of the real-vLLM tier
(`benchmarks/coldstart.py`; method in its docstring). Each case is a new engine: spawn,
vLLM's imports, weights, compile (or the compile cache), then the first token.
"""
NOT_SHOWN = """What it does not show: a GPU start's CUDA-graph capture and its CUDA context (the
CPU build has neither; vLLM keeps no disk cache of CUDA graphs, so they are captured at every start
whatever the compile cache holds); the read-ahead on a real checkpoint (the tiny model's
weights are about 1 MiB, read from disk in milliseconds, so the two read-ahead rows differ by
noise, not by the read-ahead; on a GPU host with a checkpoint of tens of GiB on a disk that
reads 0.5-2 GiB/s, the read-ahead saves up to the time it takes to read the files, when the
start waits or the model stopped long enough before); a start after a level-2 sleep. The two
rows with the page cache dropped run last in each round, after three starts: compare them with
each other, not with *cache kept*. The host is shared with other work: the load average is
given, and single rounds vary by several seconds."""
CASES = (
    "first start",
    "cache kept",
    "cache removed",
    "page cache dropped, read-ahead on",
    "page cache dropped, read-ahead off",
)


def config(tmp: Path, state: Path, port: int, model: Path) -> dict[str, Any]:
    from vllm_proxy_demo import CPU_ARGS, CPU_ENV

    args = {**CPU_ARGS, "enforce_eager": False}  # torch.compile: what the cache holds
    engine = {
        "args": args,
        "env": CPU_ENV,
        "idle_timeout_s": 0,
        "startup_timeout_s": 600,
        "stop_timeout_s": 20,
        "health_interval_s": 0,
    }
    shared_cache = {"VLLM_CACHE_ROOT": str(state / "vllm-cache" / "tiny")}
    models = {
        "tiny": {"model": str(model)},
        "tiny-noread": {"model": str(model), "read_ahead": False, "env": shared_cache},
    }
    server = {"admin_open": True, "access_log": False, "drain_timeout_s": 2}
    return harness.proxy_config(port, state, models, server=server, engine=engine)


def drop_pages(model: Path) -> int:
    """Drop the weight files from the page cache; returns their bytes."""
    total = 0
    for f in sorted(model.iterdir()):
        if f.suffix in (".safetensors", ".bin"):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


async def first_token(http: aiohttp.ClientSession, url: str, model: str) -> float:
    """Seconds from sending a streamed completion to its first event with text."""
    body = {"model": model, "prompt": "the cat sat on", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    async with http.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{model}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            text = line.decode().strip()
            if text.startswith("data:") and '"text"' in text and text != "data: [DONE]":
                took = time.perf_counter() - t0
                async for _ in resp.content:  # read the rest: the engine sees a whole request
                    pass
                return took
    raise RuntimeError(f"{model}: stream ended without text")


async def unload(http: aiohttp.ClientSession, url: str, model: str) -> None:
    async with http.post(f"{url}/admin/models/{model}/unload") as resp:
        await resp.read()
        if resp.status >= 300:
            raise RuntimeError(f"unload {model}: HTTP {resp.status}")


async def one_round(n: int, tmp: Path, procs: harness.Procs, model: Path) -> dict[str, float]:
    state = tmp / f"state{n}"
    (port,) = harness.pick_ports(1)
    handle = harness.start_proxy(procs, f"proxy{n}", config(tmp, state, port, model))
    out: dict[str, float] = {}
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def case(name: str, target: str) -> None:
            out[name] = await first_token(http, handle.url, target)
            harness.log(f"round {n}: {name}: {out[name]:.1f} s")
            await unload(http, handle.url, target)
            await asyncio.sleep(2)  # the read-ahead begun by the stop, if any, has ended

        await case("first start", "tiny")
        await case("cache kept", "tiny")
        shutil.rmtree(state / "vllm-cache" / "tiny")
        await case("cache removed", "tiny")
        order = [("on", "tiny"), ("off", "tiny-noread")]
        for which, target in order if n % 2 == 0 else order[::-1]:
            drop_pages(model)
            await case(f"page cache dropped, read-ahead {which}", target)
        metrics = await (await http.get(handle.url + "/metrics")).text()
    out["read_ahead_bytes"] = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm_proxy_read_ahead_bytes_total{")
    )
    procs.drop(handle.proc)
    return out


def table(rounds: list[dict[str, float]], meta: dict[str, Any]) -> str:
    rows = ["| case | median s | min-max s | rounds |", "|---|---:|---:|---:|"]
    for name in CASES:
        xs = [r[name] for r in rounds if name in r]
        if xs:
            rows.append(f"| {name} | {statistics.median(xs):.1f} | {min(xs):.1f}-{max(xs):.1f} "
                        f"| {len(xs)} |")  # fmt: skip
    rows.append("")
    rows.append(f"Median of the per-round differences: compile cache kept - removed "
                f"{paired(rounds, 'cache kept', 'cache removed')}; read-ahead on - off "
                f"{paired(rounds, CASES[3], CASES[4])}.")  # fmt: skip
    rows.append("")
    rows.append(f"Weights: {meta['weights_bytes'] / 2**20:.1f} MiB; {meta['machine']}; load "
                f"average {meta['load_before']} before, {meta['load_after']} after; "
                f"git {meta['rev']}, {meta['date']}.")  # fmt: skip
    rows.append("")
    rows.append(f"    {meta['command']}")
    return "\n".join(rows)


def paired(rounds: list[dict[str, float]], a: str, b: str) -> str:
    diffs = [r[a] - r[b] for r in rounds if a in r and b in r]
    return f"{statistics.median(diffs):+.1f} s" if diffs else "n/a"


def vllm_version() -> str:
    code = "import vllm; print(vllm.__version__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    return done.stdout.strip()


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=900)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--docs", action="store_true")
    ap.add_argument("--keep-tmp", action="store_true")
    ap.add_argument("--render", type=Path, help="print (and with --docs write) a saved run")
    args = ap.parse_args()
    if args.render:
        saved = json.loads(args.render.read_text())
        return report(saved["rounds"], saved["meta"], args.docs)
    meta: dict[str, Any] = {
        "rev": harness.git_head(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": harness.machine(),
        "load_before": loadavg(),
        "vllm": vllm_version(),
        "command": harness.command_line("coldstart.py"),
    }
    rounds: list[dict[str, float]] = []
    t0 = time.monotonic()
    with harness.session("coldstart", keep=args.keep_tmp) as (tmp, procs):
        from tiny_llama import ensure_tiny_model

        model = ensure_tiny_model(tmp / "tiny")
        meta["weights_bytes"] = sum(
            f.stat().st_size for f in model.iterdir() if f.suffix in (".safetensors", ".bin")
        )
        for n in range(args.rounds):
            spent = time.monotonic() - t0
            if rounds and spent + spent / len(rounds) > args.budget_s:
                harness.log(f"stopping after {len(rounds)} rounds: the budget is spent")
                break
            rounds.append(harness.arun(one_round(n, tmp, procs, model)))
            args.out.write_text(json.dumps({"meta": meta, "rounds": rounds}, indent=1) + "\n")
    meta["load_after"] = loadavg()
    args.out.write_text(json.dumps({"meta": meta, "rounds": rounds}, indent=1) + "\n")
    return report(rounds, meta, args.docs)


def report(rounds: list[dict[str, float]], meta: dict[str, Any], docs: bool) -> int:
    text = table(rounds, meta)
    print(text)
    if docs:
        intro = INTRO.format(section=SECTION, vllm=meta["vllm"])
        docs_writer.put_sections(docs_writer.DOCS, intro + "\n" + text + "\n\n" + NOT_SHOWN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
