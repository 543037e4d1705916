#!/usr/bin/env python3
"""Has a change made the request path slower? Two revisions of vllm-proxy side by side.

    .venv/bin/python benchmarks/compare_revisions.py --base 65dc40e [--rounds 5] [--seconds 4]
    .venv/bin/python benchmarks/compare_revisions.py --base c3f5d3c 7080263 382e35b  # bisect

With several ``--base`` revisions, each runs beside the others in every round and every ratio
is against the first: a regression is placed between two commits in one run.

Unpacks the base revision (``git archive``) into a temporary folder and runs, in each round
and for each revision in turn (the order alternating), vllm-proxy in front of the static nginx
upstream (`nginx_engine.py`) and wrk against it at c=1 and c=64. Both revisions run from the
same venv (each through ``PYTHONPATH``), on the same cores, minutes apart at most; the table
shows medians over rounds and the ratio new/base, which is what a noisy machine can compare.
It also shows the proxy's CPU time per request (user + system, from /proc): at c=1 throughput
mostly measures how the scheduler interleaves wrk, proxy and upstream on two busy cores, CPU
per request what the proxy itself spends.
Everything binds 127.0.0.1 and is stopped at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import docs_writer
import loadgen
from harness import (
    Procs,
    arun,
    checkout,
    command_line,
    cpu_times,
    git_head,
    log,
    pick_ports,
    session,
    start_proxy,
)
from servers import KEY, first_requests, static_proxy_config

CONCURRENCY = (1, 64)


def measure(tree: Path | None, procs: Procs, seconds: float) -> dict[int, dict[str, float]]:
    """One proxy of the revision checked out at `tree` (None: this one): wrk at each
    concurrency."""
    try:
        port, upstream = pick_ports(2)
        config = static_proxy_config(procs.tmp, port, upstream, tree)
        proxy = start_proxy(procs, "vllm-proxy", config, tree=tree, log_level="warning")
        arun(first_requests([(proxy.url, "bench")]))
        loadgen.run_wrk(proxy.url + loadgen.CHAT, "bench", KEY, 64, 1)  # warm-up
        out = {}
        for c in CONCURRENCY:
            u0, s0 = cpu_times([proxy.proc.pid])
            r = loadgen.run_wrk(proxy.url + loadgen.CHAT, "bench", KEY, c, seconds)
            u1, s1 = cpu_times([proxy.proc.pid])
            cpu_us = (u1 - u0 + s1 - s0) * 1e6 / max(1, r["requests"])
            out[c] = {
                "rps": r["rps"],
                "p50": r["p50_us"] / 1000,
                "p99": r["p99_us"] / 1000,
                "cpu": cpu_us,
            }
        return out
    finally:
        procs.stop_all()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--base", required=True, nargs="+", help="the revision(s) to compare with (e.g. commits)"
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--append", type=Path, help="also write the table as a section of this file")
    args = p.parse_args()
    with session("vllm-proxy-compare-") as (tmp, _):
        trees: dict[str, Path | None] = {
            f"base {rev}": checkout(rev, tmp / f"base{i}") for i, rev in enumerate(args.base)
        }
        trees[f"new {git_head()} (+ work tree)"] = None
        results: Results = {k: [] for k in trees}
        for rnd in range(args.rounds):
            order = list(trees) if rnd % 2 == 0 else list(reversed(trees))
            for name in order:
                work = tmp / f"r{rnd}-{list(trees).index(name)}"
                work.mkdir()
                results[name].append(measure(trees[name], Procs(work), args.seconds))
                r = results[name][-1]
                log(
                    f"round {rnd + 1} {name}: "
                    + ", ".join(f"c={c} {r[c]['rps']:,.0f} req/s" for c in CONCURRENCY)
                )
    print_table(results, args)
    return 0


Results = dict[str, list[dict[int, dict[str, float]]]]


SECTION = docs_writer.SIDE_BY_SIDE


def print_table(results: Results, args: argparse.Namespace) -> None:
    lines = table(results, args)
    print("\n".join(lines))
    if args.append is not None:
        docs_writer.put_sections(args.append, SECTION + "\n\n" + "\n".join(lines))


def table(results: Results, args: argparse.Namespace) -> list[str]:
    out = [
        "Absolute figures on this machine move a lot from hour to hour (a shared 2-core VM);",
        "a change is judged against an earlier revision measured in the same run, interleaved.",
        "",
    ]
    names = list(results)
    out.append("| c | revision | req/s (median) | p50 ms | p99 ms | proxy CPU µs per request |")
    out.append("|---:|---|---:|---:|---:|---:|")
    med: dict[tuple[str, int], dict[str, float]] = {}
    for c in CONCURRENCY:
        for name in names:
            m = {
                k: statistics.median(r[c][k] for r in results[name])
                for k in ("rps", "p50", "p99", "cpu")
            }
            med[(name, c)] = m
            out.append(
                f"| {c} | {name} | {m['rps']:,.0f} | {m['p50']:.3f} | {m['p99']:.3f} "
                f"| {m['cpu']:.0f} |"
            )
    out.append("")
    for c in CONCURRENCY:
        base = med[(names[0], c)]
        for name in names[1:]:
            new = med[(name, c)]
            ratio, p50 = new["rps"] / base["rps"], new["p50"] / base["p50"]
            cpu = new["cpu"] / base["cpu"]
            label = "new/base" if len(names) == 2 else f"{name.split()[1]}/{names[0].split()[1]}"
            out.append(
                f"* c={c}: {label} throughput **{ratio:.2f}x**, p50 {p50:.2f}x, "
                f"CPU per request {cpu:.2f}x"
            )
    cmd = command_line("compare_revisions.py")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out.append("")
    out.append(
        f"{args.rounds} interleaved rounds, wrk {args.seconds:g} s per run, static upstream; "
        f"`{cmd}` ({when}, {os.cpu_count()} cores)"
    )
    return out


if __name__ == "__main__":
    sys.exit(main())
