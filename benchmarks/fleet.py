#!/usr/bin/env python3
"""Engine starts and evictions of a fleet behind HAProxy, with and without vllm-proxy-fleet.

    .venv/bin/python benchmarks/fleet.py [--seconds 45] [--clients 6] [--no-docs]

The scenario of docs/cluster.md: three vllm-proxy processes of 10000 MiB each (static budgets,
the fake engine), nine models of 3000 MiB (three fit per server, the fleet holds all nine),
HAProxy 2.6 on the shipped recipe. Each model is asked for once, then `--clients` clients send
requests for random models for `--seconds`. Run twice: HAProxy on the hash alone (the map left
empty), then with vllm-proxy-fleet filling the map. The cluster is benchmarks/cluster.py (the
recipe with only addresses and paths changed), which the cluster test tier runs too. Every reply
that is not a 200 is counted by its status and the error's code (the proxies' and HAProxy's
errors both carry one). Prints the table and the command; writes benchmarks/results/fleet.{json,md}
and the section of docs/benchmarks.md; `--keep-tmp` keeps HAProxy's, the proxies' and the loop's
configs and logs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import SERVERS, Cluster
from docs_writer import DOCS, put_sections
from harness import RESULTS, command_line, log

MODELS = {f"m{i}": 3000 for i in range(1, 10)}
BUDGET_MB = 10000
SECTION = "## Several servers: placement across a fleet"


def outcome(status: int, body: bytes) -> str:
    """A reply as the table counts it: ``200``, or the status and the error's code
    (``503 insufficient_gpu_memory``; a proxy's and HAProxy's errors both carry one)."""
    if status == 200:
        return "200"
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = "?"
    return f"{status} {code}"


async def ask(cluster: Cluster, model: str) -> str:
    try:
        reply = await cluster.chat(model)
    except aiohttp.ClientError as e:  # no HTTP answer at all: the connection failed
        return f"no answer ({type(e).__name__})"
    return outcome(reply.status, reply.body)


async def traffic(cluster: Cluster, clients: int, seconds: float, seed: int) -> list[str]:
    outcomes: list[str] = []
    end = time.monotonic() + seconds

    async def client(i: int) -> None:
        rng = random.Random(seed * 100 + i)
        while time.monotonic() < end:
            outcomes.append(await ask(cluster, rng.choice(list(MODELS))))

    await asyncio.gather(*(client(i) for i in range(clients)))
    return outcomes


async def one(with_fleet: bool, clients: int, seconds: float, keep: bool) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="fleet-bench-")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            cluster = Cluster(Path(tmp), http, MODELS, BUDGET_MB, traffic=tuple(MODELS))
            try:
                await cluster.start()
                if with_fleet:
                    cluster.start_fleet(1.0)
                    await cluster.mapped(lambda m: len(m) == len(MODELS), timeout=60)
                outcomes = [await ask(cluster, m) for m in MODELS]
                outcomes += await traffic(cluster, clients, seconds, seed=1)
                evicted = await cluster.evictions("memory")
                per_server = {
                    name: sum(member.starts(m) for m in MODELS)
                    for name, member in cluster.members.items()
                }
            finally:
                await cluster.close()
    finally:
        if keep:
            log(f"kept {tmp} (configs and logs of HAProxy, the proxies and the loop)")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return {
        "fleet": with_fleet,
        "requests": len(outcomes),
        "answered": outcomes.count("200"),
        "not_answered": dict(Counter(o for o in outcomes if o != "200").most_common()),
        "starts": sum(per_server.values()),
        "evicted_for_memory": evicted,
        "starts_per_server": per_server,
        "servers_used": sum(1 for n in per_server.values() if n),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| routing | answered | engine starts (9 models) | running engines stopped for memory"
        " | starts per server | servers used | not answered (status, error code) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = "map by vllm-proxy-fleet (hash fallback)" if r["fleet"] else "hash (bounded load)"
        per = " / ".join(str(n) for n in r["starts_per_server"].values())
        failed = ", ".join(f"{o}: {n}" for o, n in r["not_answered"].items()) or "none"
        lines.append(
            f"| {name} | {r['answered']} of {r['requests']} | {r['starts']} |"
            f" {r['evicted_for_memory']} | {per} | {r['servers_used']} of {len(SERVERS)} |"
            f" {failed} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=45.0)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--no-docs", action="store_true", help="leave docs/benchmarks.md as it is")
    p.add_argument("--keep-tmp", action="store_true", help="keep every config and log")
    args = p.parse_args()
    rows = [asyncio.run(one(f, args.clients, args.seconds, args.keep_tmp)) for f in (False, True)]
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

The hash knows nothing of memory: it gives some servers more models than fit (the starts per
server above), which evict each other on every switch while another server may sit with room
to spare (and the requests that wait for those starts are fewer and slower). The map puts three
on each server, each started once.

The requests not answered on the hash are the proxies' own answer to that thrash, not lost
ones: the recipe's proxies run with `admission.queue_timeout_s: 0` (docs/cluster.md), so a proxy
whose memory is held by engines that are serving or starting answers 503
`insufficient_gpu_memory` (with `Retry-After`) at once instead of waiting. HAProxy retries it
(`retries 3`, `option redispatch 1`), but it remembers only the last server it tried, so the
retries alternate between the model's home and the next server on the ring, both thrashing;
after the third the client gets the 503. HAProxy's log shows each of them as a 503 with `+3`
retries and no connection errors. `admission.queue_timeout_s` bounds it: a proxy that waits for
memory (the default 30 s) answers them all, later.

Reproduce: `{cmd}` (benchmarks/fleet.py)."""


if __name__ == "__main__":
    raise SystemExit(main())
