#!/usr/bin/env python3
"""Where does vllm-proxy's CPU go under load? py-spy's hottest frames and GC time.

    .venv/bin/python benchmarks/profile_proxy.py --conc 64 --seconds 10 [--gc-tuning]

Starts vllm-proxy (through `gc_probe.py`, which only adds a `gc.callbacks` hook that counts
collections and their time) in front of the static nginx upstream, runs wrk against it and,
while wrk runs, `py-spy record` on the proxy (when py-spy is found). ``--gc-tuning`` repeats the
load with ``gc.freeze()`` after start-up and ``gc.set_threshold(50000, 20, 100)`` applied by
the same wrapper, to show what that change would buy. Everything binds 127.0.0.1 and is
stopped at the end.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen
from harness import PYTHON, Procs, arun, pick_ports, raise_nofile, session, start_proxy
from servers import KEY, first_requests, static_proxy_config

PROBE = Path(__file__).resolve().parent / "gc_probe.py"


def find_pyspy() -> str | None:
    for cand in (os.environ.get("PY_SPY"), "/tmp/tools-venv/bin/py-spy", shutil.which("py-spy")):
        if cand and os.path.exists(cand):
            return cand
    return None


def top_frames(raw: Path, n: int) -> list[str]:
    """Self and inclusive shares of frames in a py-spy ``--format raw`` file."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        k = int(count)
        total += k
        frames = stack.split(";")
        own[frames[-1]] += k
        for fr in set(frames):
            incl[fr] += k
    if not total:
        return ["(no samples)"]
    groups = {
        "prometheus_client (metrics)": "prometheus_client/",
        "json encode/decode": "json/",
        "aiohttp client request (ClientSession._request)": "ClientSession._request",
        "socket writes (StreamWriter._writelines)": "StreamWriter._writelines",
        "contextlib (async context managers)": "contextlib.py",
    }
    shares = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        for name, needle in groups.items():
            if needle in stack:
                shares[name] += int(count)
    out = ["samples containing (share of all samples):"]
    out += [f"  {100 * shares[g] / total:5.1f}%  {g}" for g in groups]
    out.append(f"{total} samples; self time:")
    out += [f"  {100 * k / total:5.1f}%  {fr}" for fr, k in own.most_common(n)]
    out.append("inclusive time (vllm_proxy frames and the aiohttp client/server entry points):")
    keep = re.compile(
        r"vllm_proxy/|prometheus_client|ClientSession\._request|contextlib|"
        r"web_protocol.py|StreamWriter|json/"
    )
    rows = [(fr, k) for fr, k in incl.most_common() if keep.search(fr)]
    out += [f"  {100 * k / total:5.1f}%  {fr}" for fr, k in rows[:n]]
    return out


def one_run(args: argparse.Namespace, gc_mode: str, procs: Procs) -> None:
    try:
        port, upstream = pick_ports(2)
        config = static_proxy_config(procs.tmp, port, upstream)
        proxy = start_proxy(procs, "vllm-proxy", config, log_level="warning",
                            argv=[PYTHON, str(PROBE)], env={"GC_PROBE_MODE": gc_mode})  # fmt: skip
        url = proxy.url
        arun(first_requests([(url, "bench")]))
        loadgen.run_wrk(url + loadgen.CHAT, "bench", KEY, args.conc, 2)  # warm-up
        spy = find_pyspy()
        raw = procs.tmp / "pyspy.txt"
        rec = None
        if spy and not args.no_pyspy:
            rec = subprocess.Popen(
                [
                    spy,
                    "record",
                    "-p",
                    str(proxy.proc.pid),
                    "-d",
                    str(args.seconds),
                    "-r",
                    "200",
                    "-f",
                    "raw",
                    "-o",
                    str(raw),
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        w = loadgen.run_wrk(url + loadgen.CHAT, "bench", KEY, args.conc, args.seconds)
        print(
            f"\n=== vllm-proxy, gc mode '{gc_mode or 'default'}', wrk c={args.conc} "
            f"{args.seconds}s: {w['rps']:.0f} req/s, p50 {w['p50_us'] / 1e3:.2f} ms, "
            f"p99 {w['p99_us'] / 1e3:.2f} ms, errors {w['errors']}, other programs "
            f"{w['foreign_cpu']:.0%} CPU"
        )
        if rec is not None:
            _, err = rec.communicate(timeout=args.seconds + 30)
            if raw.exists():
                print("\n".join(top_frames(raw, args.top)))
            else:
                print(f"py-spy produced nothing: {err.decode(errors='replace')[-300:]}")
        elif not spy:
            print("(py-spy not found: see benchmarks/README.md)")
    finally:
        procs.stop_all()
    log_path = procs.tmp / "vllm-proxy.log"  # the probe's figures come as the proxy exits
    stats = [ln for ln in log_path.read_text().splitlines() if ln.startswith("GC_PROBE")]
    print(stats[-1] if stats else "(no GC statistics: the proxy did not exit cleanly)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--conc", type=int, default=64)
    p.add_argument("--seconds", type=int, default=10)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--gc-tuning", action="store_true", help="also run with GC tuned")
    p.add_argument("--no-pyspy", action="store_true")
    args = p.parse_args()
    raise_nofile()
    modes = ["", "freeze,threshold"] if args.gc_tuning else [""]
    for mode in modes:
        with session("vllm-proxy-profile-") as (_, procs):
            one_run(args, mode, procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
