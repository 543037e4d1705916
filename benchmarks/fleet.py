#!/usr/bin/env python3
"""Engine starts and evictions of a fleet behind HAProxy, with and without vllm-proxy-fleet.

    .venv/bin/python benchmarks/fleet.py [--seconds 45] [--clients 6] [--no-docs]

The scenario of docs/cluster.md: three vllm-proxy processes of 10000 MiB each (static budgets,
the fake engine), nine models of 3000 MiB (three fit per server, the fleet holds all nine),
HAProxy 2.6 on the shipped recipe. Each model is asked for once, then `--clients` clients send
requests for random models for `--seconds`. Run twice: HAProxy on the hash alone (the map left
empty), then with vllm-proxy-fleet filling the map. The cluster is the test tier's
(tests/kit/cluster.py: the recipe with only addresses and paths changed). Prints the table and
the command; writes benchmarks/results/fleet.{json,md} and the section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))

from docs_writer import DOCS, put_sections  # noqa: E402
from harness import RESULTS, command_line  # noqa: E402
from kit.cluster import Cluster  # noqa: E402
from kit.metrics import fetch  # noqa: E402

MODELS = {f"m{i}": 3000 for i in range(1, 10)}
BUDGET_MB = 10000
SECTION = "## Several servers: placement across a fleet"


async def traffic(cluster: Cluster, clients: int, seconds: float, seed: int) -> list[int]:
    statuses: list[int] = []
    end = time.monotonic() + seconds

    async def client(i: int) -> None:
        rng = random.Random(seed * 100 + i)
        while time.monotonic() < end:
            try:
                reply = await cluster.chat(rng.choice(list(MODELS)))
                statuses.append(reply.status)
            except aiohttp.ClientError:
                statuses.append(0)

    await asyncio.gather(*(client(i) for i in range(clients)))
    return statuses


async def one(with_fleet: bool, clients: int, seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            cluster = Cluster(Path(tmp), http, MODELS, BUDGET_MB, traffic=tuple(MODELS))
            try:
                await cluster.start()
                if with_fleet:
                    cluster.start_fleet(1.0)
                    await cluster.mapped(lambda m: len(m) == len(MODELS), timeout=60)
                statuses = [(await cluster.chat(m)).status for m in MODELS]
                statuses += await traffic(cluster, clients, seconds, seed=1)
                evicted = 0.0
                for member in cluster.members.values():
                    samples = await fetch(http, member.url + "/metrics")
                    evicted += samples.value("vllm_proxy_evictions_total", reason="memory")
                per_server = {
                    name: sum(member.starts(m) for m in MODELS)
                    for name, member in cluster.members.items()
                }
            finally:
                await cluster.close()
    return {
        "fleet": with_fleet,
        "requests": len(statuses),
        "answered": sum(1 for s in statuses if s == 200),
        "starts": sum(per_server.values()),
        "evicted_for_memory": int(evicted),
        "starts_per_server": per_server,
        "servers_used": sum(1 for n in per_server.values() if n),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| routing | answered | engine starts (9 models) | running engines stopped for memory"
        " | starts per server | servers used |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = "map by vllm-proxy-fleet (hash fallback)" if r["fleet"] else "hash (bounded load)"
        per = " / ".join(str(n) for n in r["starts_per_server"].values())
        lines.append(
            f"| {name} | {r['answered']} of {r['requests']} | {r['starts']} |"
            f" {r['evicted_for_memory']} | {per} | {r['servers_used']} of 3 |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=45.0)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--no-docs", action="store_true", help="leave docs/benchmarks.md as it is")
    args = p.parse_args()
    rows = [asyncio.run(one(f, args.clients, args.seconds)) for f in (False, True)]
    text = table(rows)
    cmd = command_line("fleet.py")
    print(text)
    print(f"\n`{cmd}`")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fleet.json").write_text(json.dumps(rows, indent=2) + "\n")
    (RESULTS / "fleet.md").write_text(text + "\n")
    if not args.no_docs:
        put_sections(DOCS, section(text, cmd, args))
    return 0


def section(text: str, cmd: str, args: argparse.Namespace) -> str:
    return f"""{SECTION}

Three vllm-proxy processes of 10000 MiB each (static budgets, the fake engine) behind HAProxy
2.6 on the shipped recipe; nine models of 3000 MiB: three fit on a server, the fleet holds all
nine. Each model is asked for once, then {args.clients} clients send requests for random models
for {args.seconds:g} s. Without vllm-proxy-fleet HAProxy routes by the consistent hash (its map
empty); with it, by the map the loop keeps (docs/cluster.md).

{text}

The hash knows nothing of memory: it gives some servers four or five models, which evict each
other on every switch (and the requests that wait for those starts are fewer and slower). The
map puts three on each server, each started once.

Reproduce: `{cmd}` (benchmarks/fleet.py)."""


if __name__ == "__main__":
    raise SystemExit(main())
