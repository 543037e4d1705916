#!/usr/bin/env python3
"""Throughput of one model with 1, 2 and 4 replicas: is the proxy the bottleneck?

    .venv/bin/python benchmarks/replicas.py [--seconds 10] [--clients 32] [--rounds 2] [--slots 4]

Each engine is the fake engine with a fixed per-token delay and few sequence slots
(``max_num_seqs``), so one engine serves at most ``slots / (tokens x delay)`` requests per second
and anything above that must come from more replicas. vllm-proxy (a real process, on a static
budget of four devices) runs the model with ``replicas: N``; closed-loop clients send
non-streaming chat requests for ``--seconds`` after every replica is up. The ideal is N times
the one-replica throughput; the table shows requests/s, the speed-up over one replica, the
efficiency (speed-up / N) and latency percentiles, interleaved over ``--rounds`` rounds (medians
shown). Prints the table and the command; writes benchmarks/results/replicas-<slots>slots.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    FAKE_ENGINE,
    RESULTS,
    Procs,
    command_line,
    pick_ports,
    proxy_config,
    session,
    start_proxy,
    static_gpu,
)

TOKENS, DELAY = 16, 0.02


def config(tmp: Path, port: int, replicas: int, slots: int) -> dict[str, Any]:
    env = {"FAKE_ENGINE_TOKENS": str(TOKENS), "FAKE_ENGINE_TOKEN_DELAY": str(DELAY)}
    model = {"model": "x", "memory_mb": 600, "replicas": replicas, "env": env,
             "args": {"max_num_seqs": slots}}  # fmt: skip
    return proxy_config(
        port,
        tmp / "state",
        {"m": model},
        server={"access_log": False, "admin_open": True},
        engine={"command": FAKE_ENGINE, "idle_timeout_s": 0, "port_range": [31000, 31999]},
        gpu=static_gpu(1000, 1000, 1000, 1000),
    )


async def wait_replicas(session: aiohttp.ClientSession, url: str, n: int) -> None:
    deadline = time.monotonic() + 60
    async with session.post(url + "/admin/models/m/load") as resp:
        assert resp.status == 200, await resp.text()
    while time.monotonic() < deadline:
        async with session.get(url + "/admin/models/m") as resp:
            row = await resp.json()
        if sum(1 for i in row["instances"] if i["state"] == "running") == n:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{n} replicas not up within 60 s")


async def load(url: str, clients: int, seconds: float) -> dict[str, float]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    latencies: list[float] = []
    errors = 0
    stop = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=60)
    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:

        async def client() -> None:
            nonlocal errors
            while time.monotonic() < stop:
                t0 = time.monotonic()
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    if resp.status != 200:
                        errors += 1
                        continue
                latencies.append(time.monotonic() - t0)

        started = time.monotonic()
        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed = time.monotonic() - started
    latencies.sort()
    return {
        "rps": len(latencies) / elapsed,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        "errors": errors,
        "requests": len(latencies),
    }


async def one(
    procs: Procs, replicas: int, slots: int, clients: int, seconds: float
) -> dict[str, float]:
    (port,) = pick_ports(1)
    cfg = config(procs.tmp, port, replicas, slots)
    proxy = await asyncio.to_thread(start_proxy, procs, f"proxy-{replicas}", cfg)
    try:
        async with aiohttp.ClientSession() as http:
            await wait_replicas(http, proxy.url, replicas)
        await load(proxy.url, clients, 1.0)  # warm the connection pools
        return await load(proxy.url, clients, seconds)
    finally:
        await asyncio.to_thread(procs.drop, proxy.proc, 30)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--slots", type=int, default=4, help="max_num_seqs of each engine")
    args = parser.parse_args()
    counts = (1, 2, 4)
    runs: dict[int, list[dict[str, float]]] = {n: [] for n in counts}
    with session("vllm-proxy-replicas-") as (_, procs):
        for _ in range(args.rounds):
            for n in counts:
                runs[n].append(await one(procs, n, args.slots, args.clients, args.seconds))
    ceiling = args.slots / (TOKENS * DELAY)
    med = {n: {k: statistics.median(r[k] for r in runs[n]) for k in runs[n][0]} for n in counts}
    base = med[1]["rps"]
    command = command_line("replicas.py")
    lines = [
        f"Fake engine: {TOKENS} tokens x {DELAY * 1000:g} ms, max_num_seqs {args.slots} "
        f"(one engine serves at most {ceiling:.1f} req/s); {args.clients} closed-loop clients, "
        f"{args.seconds:g} s per run, median of {args.rounds} interleaved rounds.",
        "",
        "| replicas | req/s | speed-up | efficiency | p50 ms | p99 ms | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in counts:
        m = med[n]
        lines.append(
            f"| {n} | {m['rps']:.1f} | {m['rps'] / base:.2f}x | {m['rps'] / base / n:.0%} "
            f"| {m['p50_ms']:.0f} | {m['p99_ms']:.0f} | {m['errors']:.0f} |"
        )
    lines += ["", f"Command: `{command.strip()}`"]
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"replicas-{args.slots}slots"
    (RESULTS / f"{stem}.md").write_text(table + "\n")
    (RESULTS / f"{stem}.json").write_text(json.dumps({"runs": runs, "median": med}, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
