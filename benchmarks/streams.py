#!/usr/bin/env python3
"""Stream capacity and large request bodies: vllm-proxy and nginx proxy_pass in one run.

    .venv/bin/python benchmarks/streams.py                      # full: ~5 min
    .venv/bin/python benchmarks/streams.py --levels 100 --seconds 5 --body-requests 5  # smoke

**Streams.** LLM serving is many long streams, not many short requests. A Node SSE server with
one shared ticker (`sse_upstream.js`) is the engine: every open stream gets one OpenAI chunk
event per tick, 20 per second. vllm-proxy starts it as the engine of model ``sse``, and nginx
``proxy_pass`` (one worker, ``proxy_buffering off``) is pointed at the same process. For each
level N (100, 1000, 2000) and each target, `sse_client.js` opens N streams evenly over 2 s, each
on its own connection, each receiving 400 events (20 s); it checks every event arrived, in
order, once, and stamps them. Meanwhile this script samples the target's listening socket's
accept queue (sock_diag, every 10 ms) and its RSS, and reads its CPU time before and after (in
ns, from each thread's /proc schedstat: the tick counts in /proc/<pid>/stat are 10 ms apart,
up to 4 % of a 100-stream run). The targets take turns, the order rotating from level to
level, and each starts once the machine is quiet again (`settle`).

**Large bodies.** A chat request with one base64 image (the shape a video-analysis client sends
frames in), 1 and 10 MB, ``model`` after ``messages`` as the OpenAI SDK orders the keys, and
before them; sent one at a time over keep-alive, alternating direct / vllm-proxy / nginx; the
upstream reads the body to its end and answers a small ``chat.completion``. Added = via minus
direct, per round, median over rounds.

Prints the tables and the command that produced them; writes benchmarks/results/streams.json
and .md, and with ``--docs`` replaces its sections in docs/benchmarks.md and draws
docs/benchmarks/stream-capacity.png (when matplotlib is installed). Everything binds 127.0.0.1
and is stopped at the end.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import docs_writer
import loadgen
from harness import (
    BENCH_DIR,
    PYTHON,
    ROOT,
    Procs,
    ProxyHandle,
    arun,
    attempt,
    checkout,
    command_line,
    cpu_times,
    exit_code,
    log,
    pick_ports,
    raise_nofile,
    session,
    wait_port,
)
from servers import KEY, first_requests, start_fake_proxy, start_nginx_proxy, versions

NODE = os.environ.get("NODE", "node")
RESULTS = BENCH_DIR / "results"
#: Targets in table order; "base" is vllm-proxy of an earlier revision (``--base``).
LABEL = {
    "base": "vllm-proxy (base)",
    "vllm-proxy": "vllm-proxy",
    "nginx": "nginx proxy_pass",
    "floor": "byte relay on uvloop (floor)",
    "direct": "direct (no proxy)",
}
SECTIONS = ("## Stream capacity", "## Large request bodies")


# --------------------------------------------------------------------------- sampling


def listen_queue(port: int) -> int | None:
    """Connections waiting in the accept queue of the socket listening on 127.0.0.1:`port`.

    sock_diag netlink, listening sockets only: for them ``idiag_rqueue`` is the accept queue's
    current length (``ss -lnt`` shows it as Recv-Q).
    """
    req = struct.pack("=BBBxI", socket.AF_INET, socket.IPPROTO_TCP, 0, 1 << 10) + bytes(48)
    head = struct.pack("=IHHII", 16 + len(req), 20, 0x301, 1, 0)
    found = None
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 4) as nl:
        nl.settimeout(1.0)
        nl.sendall(head + req)
        while True:
            data = nl.recv(65536)
            if not data:
                return found
            offset = 0
            while offset + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, offset)
                if kind == 3:  # NLMSG_DONE
                    return found
                msg = offset + 16
                if struct.unpack_from("!H", data, msg + 4)[0] == port:
                    found = max(found or 0, struct.unpack_from("=I", data, msg + 56)[0])
                offset += (length + 3) & ~3


def cpu_ns(pids: list[int]) -> int:
    """CPU nanoseconds of `pids`, every thread's, from /proc/<pid>/task/<tid>/schedstat.

    /proc/<pid>/stat counts in clock ticks (10 ms): a 100-stream run costs a proxy 0.4-0.7 s,
    so a tick at each end moved a target's figure by up to 4 %, as much as the margin being
    measured. schedstat counts the time each thread ran in ns; a thread that exits during a
    run takes its time with it, which `run_streams` checks against the tick count."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    return total


def rss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_info().rss
    return total


class Sampler(threading.Thread):
    """Listen-queue peak (every 10 ms) and RSS peak (every 250 ms) while a run goes on."""

    def __init__(self, port: int, pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.port, self.pids = port, pids
        self.stop = threading.Event()
        self.queue_peak = 0
        self.rss_peak = 0
        self.samples = 0

    def run(self) -> None:
        last_rss = 0.0
        while not self.stop.is_set():
            q = listen_queue(self.port)
            self.queue_peak = max(self.queue_peak, q or 0)
            self.samples += 1
            now = time.monotonic()
            if now - last_rss >= 0.25:
                self.rss_peak = max(self.rss_peak, rss(self.pids))
                last_rss = now
            self.stop.wait(0.01)


# --------------------------------------------------------------------------- streams


def target_pids(key: str, pid: int) -> list[int]:
    """The processes whose CPU counts for a target: vllm-proxy's own process (its engine is a
    child in another group), nginx's master and workers, or the upstream itself."""
    if key == "vllm-proxy":
        return [pid]
    try:
        p = psutil.Process(pid)
        return [pid, *(c.pid for c in p.children(recursive=True))]
    except psutil.Error:
        return [pid]


def run_streams(
    key: str, port: int, pids: list[int], n: int, args: argparse.Namespace
) -> dict[str, Any]:
    events = round(args.seconds * args.rate)
    argv = [NODE, str(BENCH_DIR / "sse_client.js"), "--url", f"http://127.0.0.1:{port}"]
    argv += ["--model", "sse", "--key", KEY, "--streams", str(n), "--ramp", str(args.ramp)]
    argv += ["--events", str(events), "--rate", str(args.rate)]
    sampler = Sampler(port, pids)
    loadgen.METER.start()
    u0, s0 = cpu_times(pids)
    n0 = cpu_ns(pids)
    sampler.start()
    t0 = time.monotonic()
    out = subprocess.run(
        argv, capture_output=True, text=True, timeout=args.ramp + args.seconds + 120
    )
    wall = time.monotonic() - t0
    sampler.stop.set()
    sampler.join()
    n1 = cpu_ns(pids)
    u1, s1 = cpu_times(pids)
    foreign = loadgen.METER.foreign()
    line = next((x for x in out.stdout.splitlines() if x.startswith("SSEJSON ")), None)
    if line is None:
        raise RuntimeError(f"sse_client printed no summary (rc {out.returncode}): {out.stderr}")
    r: dict[str, Any] = json.loads(line[8:])
    ticks = (u1 - u0) + (s1 - s0)  # whole ticks: only for the kernel share and a check
    cpu = (n1 - n0) / 1e9
    tick = 1 / os.sysconf("SC_CLK_TCK")
    if abs(cpu - ticks) > 2 * tick * len(pids) + 0.02 * ticks:
        log(f"{key}: CPU {cpu:.3f} s by schedstat but {ticks:.2f} s by ticks (a thread exited?)")
    r.update(
        target=key,
        cpu_s=cpu,
        cpu_tick_s=ticks,
        cpu_user_s=u1 - u0,
        cpu_sys_s=s1 - s0,
        cpu_ms_per_1000=cpu * 1e3 / (r["events"] / 1000) if r["events"] else float("nan"),
        kernel_share=(s1 - s0) / ticks if ticks else float("nan"),
        rss_peak=sampler.rss_peak,
        listen_queue_peak=sampler.queue_peak,
        queue_samples=sampler.samples,
        foreign_cpu=foreign,
        run_wall_s=wall,
    )
    return r


def settle(quiet: float = 10.0, longest: float = 20.0) -> float:
    """Wait (at least 1 s, at most `longest`) until the machine's CPU is below `quiet` percent
    for half a second: a target that fell behind (an old revision at 2,000 streams) still
    closes connections and drains its listen queue after its client has gone, and the next
    target must not be measured on top of that. Returns the seconds waited."""
    t0 = time.monotonic()
    time.sleep(0.5)
    calm = 0
    while time.monotonic() - t0 < longest:
        calm = calm + 1 if psutil.cpu_percent(interval=0.25) < quiet else 0
        if calm >= 2 and time.monotonic() - t0 >= 1.0:
            break
    waited = time.monotonic() - t0
    if waited >= longest:
        log(f"the machine did not quiet down within {longest:g} s; going on")
    return waited


def phase_streams(
    targets: dict[str, tuple[int, list[int]]], args: argparse.Namespace, res: dict[str, Any]
) -> None:
    keys = list(targets)
    for rnd in range(args.rounds):
        for i, n in enumerate(args.levels):
            k = (rnd + i) % len(keys)
            for key in keys[k:] + keys[:k]:
                port, pids = targets[key]
                r = run_streams(key, port, pids, n, args)
                r["round"] = rnd
                res["streams"].append(r)
                log(
                    f"{n:5d} streams via {key:10}: intact {r['intact']}/{n}, lost {r['lost']}, "
                    f"first event p99 {f(r['ttfe_p99_ms'], 0)} ms, gap p99 "
                    f"{f(r['gap_p99_ms'], 0)} ms, {f(r['cpu_ms_per_1000'])} CPU ms/1000 events "
                    f"({r['kernel_share']:.0%} kernel), listen queue peak "
                    f"{r['listen_queue_peak']}, other programs {r['foreign_cpu']:.0%} CPU"
                )
                settle()  # the next target starts on a quiet machine


# --------------------------------------------------------------------------- large bodies


def image_body(mb: float, model_first: bool) -> bytes:
    """A chat request with one base64 image of about `mb` MB in all."""
    raw = os.urandom(int(mb * 1e6 * 3 / 4))
    url = "data:image/jpeg;base64," + base64.b64encode(raw).decode()
    content = [
        {"type": "text", "text": "What happens in this frame?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    messages = [{"role": "user", "content": content}]
    body = {"model": "sse", "messages": messages} if model_first else {"messages": messages}
    body.update({"model": "sse", "max_tokens": 16})
    return json.dumps(body).encode()


async def _bodies(urls: dict[str, str], body: bytes, rounds: int) -> dict[str, list[float]]:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    times: dict[str, list[float]] = {k: [] for k in urls}
    sessions = {k: aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) for k in urls}
    try:
        keys = list(urls)
        for rnd in range(-2, rounds):  # two warm-up rounds
            k = rnd % len(keys)
            for key in keys[k:] + keys[:k]:
                t = time.perf_counter()
                async with sessions[key].post(urls[key] + loadgen.CHAT, data=body,
                                              headers=headers) as resp:  # fmt: skip
                    data = await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"{key}: HTTP {resp.status} {data[:200]!r}")
                if rnd >= 0:
                    times[key].append(time.perf_counter() - t)
    finally:
        for s in sessions.values():
            await s.close()
    return times


def phase_bodies(urls: dict[str, str], args: argparse.Namespace, res: dict[str, Any]) -> None:
    for mb in args.body_mb:
        for model_first in (False, True):
            body = image_body(mb, model_first)
            loadgen.METER.start()
            times = arun(_bodies(urls, body, args.body_requests))
            foreign = loadgen.METER.foreign()
            row: dict[str, Any] = {
                "mb": mb,
                "bytes": len(body),
                "model_first": model_first,
                "foreign_cpu": foreign,
                "requests": args.body_requests,
            }
            for key, ts in times.items():
                row[f"{key}_p50_ms"] = statistics.median(ts) * 1e3
                row[f"{key}_p90_ms"] = loadgen.pct(ts, 90) * 1e3
                if key != "direct":
                    diffs = [(a - b) * 1e3 for a, b in zip(ts, times["direct"], strict=True)]
                    row[f"{key}_added_ms"] = statistics.median(diffs)
            res["bodies"].append(row)
            log(
                f"{len(body) / 1e6:.1f} MB body (model {'first' if model_first else 'last'}): "
                + ", ".join(f"{k} {row[f'{k}_p50_ms']:.1f} ms" for k in times)
                + f"; vllm-proxy adds {row.get('vllm-proxy_added_ms', float('nan')):.1f} ms"
            )


# --------------------------------------------------------------------------- report


def f(x: float | None, d: int = 1) -> str:
    if x is None or x != x:
        return "n/a"
    return f"{x:,.{d}f}"


def streams_table(res: dict[str, Any]) -> list[str]:
    rows = res["streams"]
    if not rows:
        return []
    out = [
        "| streams | via | intact | lost / out of order | events/s delivered / offered "
        "| gap p50 / p99 ms | first event p50 / p99 ms | CPU ms per 1000 events (kernel) "
        "| RSS peak MiB | listen queue peak | other programs' CPU |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r["streams"], list(LABEL).index(r["target"]))):
        errs = "".join(f" ({k}: {v})" for k, v in r["errors"].items())
        out.append(
            f"| {r['streams']:,} | {LABEL[r['target']]} | {r['intact']:,}/{r['streams']:,}{errs} "
            f"| {r['lost']} / {r['disorder']} "
            f"| {f(r['delivered_eps'], 0)} / {r['offered_eps']:,} "
            f"| {f(r['gap_p50_ms'])} / {f(r['gap_p99_ms'])} "
            f"| {f(r['ttfe_p50_ms'])} / {f(r['ttfe_p99_ms'])} "
            f"| {f(r['cpu_ms_per_1000'])} ({r['kernel_share']:.0%}) "
            f"| {f(r['rss_peak'] / 2**20)} | {r['listen_queue_peak']} | {r['foreign_cpu']:.0%} |"
        )
    return out


def _paired(res: dict[str, Any], lvl: int, target: str, key: str) -> tuple[float, float, float]:
    """(median of `key` via `target`, median via nginx, median of the per-round ratios) at
    `lvl` streams; NaN where a side is missing. With several rounds each ratio pairs the
    two runs of one round (minutes apart at most), so a noisy hour cancels out."""
    mine = {
        r.get("round", 0): r[key]
        for r in res["streams"]
        if (r["streams"], r["target"]) == (lvl, target)
    }
    ng = {
        r.get("round", 0): r[key]
        for r in res["streams"]
        if (r["streams"], r["target"]) == (lvl, "nginx")
    }
    nan = float("nan")
    ratios = [mine[k] / ng[k] for k in mine if ng.get(k)]
    return (
        statistics.median(mine.values()) if mine else nan,
        statistics.median(ng.values()) if ng else nan,
        statistics.median(ratios) if ratios else nan,
    )


def goals(res: dict[str, Any]) -> list[str]:
    levels = sorted({r["streams"] for r in res["streams"]})
    if not levels:
        return []
    targets = {r["target"] for r in res["streams"]}
    rounds = len({r.get("round", 0) for r in res["streams"]})
    over = f", median of {rounds} rounds" if rounds > 1 else ""
    top = levels[-1]
    base = LABEL["base"].removeprefix("vllm-proxy ").removesuffix(" (before)")
    out = []
    if {"vllm-proxy", "nginx"} <= targets:
        mine, ng, times = _paired(res, top, "vllm-proxy", "ttfe_p99_ms")
        was = (
            f"; {base}: {f(_paired(res, top, 'base', 'ttfe_p99_ms')[0])} ms"
            if "base" in targets
            else ""
        )
        out.append(
            f"* time to first event p99 at {top:,} streams: {f(mine)} ms vs nginx "
            f"{f(ng)} ms = **{times:.2f}x** (goal ≤ 2x{was}{over})"
        )
        mine, ng, _ = _paired(res, top, "vllm-proxy", "listen_queue_peak")
        was = (
            f"; {base}: {_paired(res, top, 'base', 'listen_queue_peak')[0]:.0f}"
            if "base" in targets
            else ""
        )
        out.append(
            f"* listen queue peak at {top:,} streams: {mine:.0f} connections vs nginx {ng:.0f}{was}"
        )

    def ratio(target: str, lvl: int) -> str:
        r = _paired(res, lvl, target, "cpu_ms_per_1000")[2]
        return f"{r:.2f}x" if r == r else "n/a"

    if {"vllm-proxy", "nginx"} <= targets:
        was = (
            f"; {base}: " + ", ".join(ratio("base", lvl) for lvl in levels)
            if "base" in targets
            else ""
        )
        out.append(
            "* CPU per event, vllm-proxy / nginx: "
            + ", ".join(f"{lvl:,} streams **{ratio('vllm-proxy', lvl)}**" for lvl in levels)
            + (
                "; byte relay on uvloop (floor): "
                + ", ".join(ratio("floor", lvl) for lvl in levels)
                if "floor" in targets
                else ""
            )
            + f" (goal ≤ 1.5x{was}{over})"
        )
    mine_rows = [r for r in res["streams"] if r["target"] == "vllm-proxy"]
    if mine_rows:
        lost = sum(r["lost"] + r["disorder"] + r["extra"] for r in mine_rows)
        intact = sum(r["intact"] for r in mine_rows)
        total = sum(r["streams"] for r in mine_rows)
        merged = sum(r["merged_reads"] for r in mine_rows)
        out.append(
            f"* via vllm-proxy: {intact:,}/{total:,} streams intact, {lost} events lost, "
            f"duplicated or out of order (goal 0); {merged:,} client reads carried more than one "
            "event"
        )
    return out


def body_goals(res: dict[str, Any]) -> list[str]:
    rows = [r for r in res["bodies"] if "vllm-proxy_added_ms" in r]
    if not rows:
        return []
    top = max(r["mb"] for r in rows)
    parts = []
    for r in rows:
        if r["mb"] == top:
            order = "first" if r["model_first"] else "last"
            ng = f", nginx {f(r['nginx_added_ms'])}" if "nginx_added_ms" in r else ""
            was = f", {LABEL['base']} {f(r['base_added_ms'])}" if "base_added_ms" in r else ""
            if "floor_added_ms" in r:
                was += f", byte relay (floor) {f(r['floor_added_ms'])}"
            parts.append(f"model {order} **{f(r['vllm-proxy_added_ms'])} ms**{ng}{was}")
    return [f"* added at {top:g} MB: " + "; ".join(parts) + " (goal ≤ 5 ms)"]


def bodies_table(res: dict[str, Any]) -> list[str]:
    rows = res["bodies"]
    if not rows:
        return []
    targets = [k for k in LABEL if f"{k}_p50_ms" in rows[0]]
    targets.sort(key=lambda k: ["direct", "base", "vllm-proxy", "nginx", "floor"].index(k))
    head = "| body | `model` | " + " | ".join(f"{LABEL[k]} p50 / p90 ms" for k in targets)
    head += " | " + " | ".join(f"**added by {LABEL[k]}** ms" for k in targets if k != "direct")
    out = [head + " |", "|" + "---:|" * 2 + "---:|" * (2 * len(targets) - 1)]
    for r in rows:
        cells = [f"{r['bytes'] / 1e6:.1f} MB", "first" if r["model_first"] else "last"]
        cells += [f"{f(r[f'{k}_p50_ms'])} / {f(r[f'{k}_p90_ms'])}" for k in targets]
        cells += [f"**{f(r[f'{k}_added_ms'])}**" for k in targets if k != "direct"]
        out.append("| " + " | ".join(cells) + " |")
    return out


def markdown(res: dict[str, Any]) -> str:
    meta = res["meta"]
    v = meta["versions"]
    a = meta["args"]
    machine = (
        f"{v['cpu']}, {v['memory']} RAM, Linux {v['kernel']}; client, upstream and proxy share "
        f"the cores (other programs' share of both cores is in the last column)"
    )
    L = [SECTIONS[0], ""]
    targets = {r["target"] for r in res["streams"]}
    rounds = len({r.get("round", 0) for r in res["streams"]})
    if res["streams"]:
        L += [
            f"`{meta['command']}` ({meta['started']}, {meta['runtime_s']:.0f} s). Each stream "
            f"gets {round(a['seconds'] * a['rate'])} OpenAI chunk events, {a['rate']:g} per "
            "second, from "
            "`benchmarks/sse_upstream.js` (Node, one shared ticker); `benchmarks/sse_client.js` "
            f"opens the N streams evenly over {a['ramp']:g} s, one connection each, and checks "
            "every event (in order, none lost or twice, then `[DONE]`). vllm-proxy and nginx "
            "`proxy_pass` (one worker, `proxy_buffering off`) forward to the same Node process and "
            "take turns, each starting once the machine is quiet again (below 10 % CPU for "
            "half a second: a target that fell behind still drains after its client has gone). "
            "*Delivered* counts events while every stream should be open; CPU is the "
            "proxy's time on the CPU over the whole run, every thread's, in ns from "
            "/proc/<pid>/task/*/schedstat, per 1000 events delivered (kernel = the system share "
            "of its /proc/<pid>/stat ticks); the listen queue is the accept queue of the proxy's "
            "listening socket, sampled every 10 ms. The machine is shared and small: a repeat run "
            "moves the ratios by up to a third (compare targets within one run, not across runs)."
            + (
                f" {LABEL['base']} is the same benchmark against that revision (run from a "
                "checkout of that revision, with an upstream process of its own)."
                if "base" in targets
                else ""
            )
            + (
                f" The {LABEL['floor']} is `benchmarks/floor_relay.py`: what the engine sends is "
                "written to the client as read, one write per read, with no HTTP at all. It "
                "shows what Python and uvloop themselves cost per event; what vllm-proxy spends "
                "above it is its HTTP work, per event (the engine's chunks parsed, the client's "
                "framed) and per stream (the connection accepted, the request parsed, checked "
                "and routed, the engine connection, the end)."
                if "floor" in targets
                else ""
            )
            + (
                f" Every level and target ran {rounds} times (the table has every run); the goal "
                "lines give medians, and each ratio to nginx is the median of the ratios paired "
                "within a round."
                if rounds > 1
                else ""
            ),
            "",
            f"**Machine:** {machine}. **Versions:** vllm-proxy {v['vllm-proxy']}, "
            f"python {v['python']}, aiohttp {v['aiohttp']}, uvloop {v['uvloop']}, "
            f"nginx {v['nginx']}, node {v.get('node', '?')}.",
            "",
            *goals(res),
            "",
            *streams_table(res),
            "",
        ]
        if res.get("plot"):
            L += [f"![Stream capacity]({res['plot']})", ""]
    if res["bodies"]:
        L += [
            SECTIONS[1],
            "",
            f"`{meta['command']}`: a `/v1/chat/completions` request with one base64 image, sent "
            f"{a['body_requests']} times one at a time over keep-alive to each target in turn; "
            "the upstream (`sse_upstream.js`) reads the body to its end and answers a small "
            "`chat.completion`. `model` last is the order the OpenAI SDK sends; *added* = via "
            "minus direct, paired per round, median. nginx buffers a large request body before it "
            "forwards it (`proxy_request_buffering` on, its default; in memory here).",
            "",
            *body_goals(res),
            "",
            *bodies_table(res),
            "",
        ]
    return "\n".join(L)


def plot(res: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = res["streams"]
    levels = sorted({r["streams"] for r in rows})
    colors = {
        "base": "#ff7f0e",
        "vllm-proxy": "#1f77b4",
        "nginx": "#2ca02c",
        "floor": "#9467bd",
        "direct": "#777777",
    }
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = (
        ("ttfe_p99_ms", "time to first event p99 (ms, log)", True),
        ("cpu_ms_per_1000", "CPU ms per 1000 events", False),
        ("listen_queue_peak", "listen queue peak (connections)", False),
    )
    for ax, (field, title, log_scale) in zip(axes, panels, strict=True):
        targets = [t for t in LABEL if any(r["target"] == t for r in rows)]
        width = 0.8 / max(1, len(targets))
        for j, t in enumerate(targets):
            vals = []
            for lvl in levels:
                mine = [r[field] for r in rows if r["target"] == t and r["streams"] == lvl]
                vals.append(statistics.median(mine) if mine else 0)
            xs = [i + (j - (len(targets) - 1) / 2) * width for i in range(len(levels))]
            ax.bar(xs, vals, width, label=LABEL[t], color=colors[t])
        ax.set_xticks(range(len(levels)), [f"{lvl:,} streams" for lvl in levels])
        ax.set_title(title, fontsize=10)
        if log_scale:
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        "Stream capacity: N streams x 20 events/s, vllm-proxy vs nginx proxy_pass"
        + (" (medians over rounds)" if len({r.get("round", 0) for r in rows}) > 1 else "")
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- main


def node_version() -> str:
    try:
        return subprocess.run(
            [NODE, "--version"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unavailable"


def sse_model(port: int, rate: float) -> dict[str, dict[str, object]]:
    """Model ``sse``: the Node SSE server as its engine, on `port`."""
    return {
        "sse": {
            "model": "node/sse",
            "command": [NODE, str(BENCH_DIR / "sse_upstream.js")],
            "port_range": [port, port],
            "env": {"SSE_RATE": str(rate)},
        }
    }


def start_sse_proxy(
    procs: Procs, tmp: Path, name: str, port: int, up: int, rate: float, tree: Path | None = None
) -> ProxyHandle:
    """A vllm-proxy whose model ``sse`` has been started (a first request) on port `up`."""
    proxy = start_fake_proxy(procs, name, port, sse_model(up, rate), tree)
    ((status, body),) = arun(first_requests([(proxy.url, "sse")]))
    if status != 200:
        raise RuntimeError(f"first request via {name}: HTTP {status} {body[:300]!r}")
    if proxy.engine_port("sse") != up:
        raise RuntimeError(f"{name}: the engine is not on its configured port")
    return proxy


def run(args: argparse.Namespace, tmp: Path, procs: Procs, res: dict[str, Any]) -> None:
    proxy_port, up, ng, base_port, base_up, floor_port = pick_ports(6)
    log(f"temp dir {tmp}; starting vllm-proxy on 127.0.0.1:{proxy_port}")
    proxy = start_sse_proxy(procs, tmp, "vllm-proxy", proxy_port, up, args.rate)
    nginx = start_nginx_proxy(procs, tmp, {"sse": (ng, up, False)})
    upstream_pid = next(
        (
            p.pid
            for p in psutil.Process(proxy.proc.pid).children(recursive=True)
            if "sse_upstream.js" in " ".join(p.cmdline())
        ),
        None,
    )
    every: dict[str, tuple[int, list[int]]] = {
        "vllm-proxy": (proxy_port, target_pids("vllm-proxy", proxy.proc.pid)),
        "nginx": (ng, target_pids("nginx", nginx.pid)),
        "direct": (up, [upstream_pid] if upstream_pid is not None else []),
    }
    urls: dict[str, str] = {}
    if "floor" in args.targets:
        floor = procs.start(
            "floor-relay",
            [
                PYTHON,
                str(BENCH_DIR / "floor_relay.py"),
                "--port",
                str(floor_port),
                "--upstream",
                str(up),
            ],
            tmp / "floor-relay.log",
        )
        wait_port(floor_port, 30, floor)
        every["floor"] = (floor_port, [floor.pid])
        urls["floor"] = f"http://127.0.0.1:{floor_port}"
    urls |= {
        "direct": f"http://127.0.0.1:{up}",
        "vllm-proxy": proxy.url,
        "nginx": f"http://127.0.0.1:{ng}",
    }
    if args.base:
        tree = checkout(args.base, tmp / "base-tree")
        log(f"starting vllm-proxy {args.base} on 127.0.0.1:{base_port}")
        base = start_sse_proxy(procs, tmp, "vllm-proxy-base", base_port, base_up, args.rate, tree)
        every["base"] = (base_port, target_pids("vllm-proxy", base.proc.pid))
        urls["base"] = base.url
    targets = {k: every[k] for k in args.targets + (["base"] if args.base else [])}
    if args.levels:
        phase_streams(targets, args, res)
    if args.body_mb and args.body_requests:
        phase_bodies({k: v for k, v in urls.items() if k == "direct" or k in targets}, args, res)
    res["proxy_log_errors"] = proxy.log_errors()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)

    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x]

    def floats(s: str) -> list[float]:
        return [float(x) for x in s.split(",") if x]

    p.add_argument("--levels", type=ints, default=[100, 1000, 2000], help="streams per run")
    p.add_argument("--seconds", type=float, default=20, help="stream length (default 20)")
    p.add_argument("--rate", type=float, default=20, help="events per second per stream")
    p.add_argument("--ramp", type=float, default=2, help="seconds over which streams open")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--base", help="also run vllm-proxy of this earlier revision (e.g. a commit)")
    p.add_argument(
        "--targets",
        type=lambda s: [x for x in s.split(",") if x],
        default=["vllm-proxy", "nginx"],
        help="of vllm-proxy, nginx, floor (a byte relay on uvloop: no HTTP; streams only), "
        "direct (default vllm-proxy,nginx)",
    )
    p.add_argument("--body-mb", type=floats, default=[1, 10], help="large-body sizes (MB)")
    p.add_argument("--body-requests", type=int, default=100, help="requests per size and target")
    p.add_argument("--docs", action="store_true", help="update docs/benchmarks.md and its plot")
    p.add_argument("--keep-tmp", action="store_true")
    p.add_argument(
        "--render", metavar="JSON", help="only write the tables (and --docs) from a saved run"
    )
    return p.parse_args(argv)


def write_out(res: dict[str, Any], docs: bool, failed: bool) -> None:
    """Raw results, the tables, and with `docs` the report's sections and the plot."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    if docs and res["streams"]:
        png = ROOT / "docs" / "benchmarks" / "stream-capacity.png"
        if plot(res, png):
            res["plot"] = "benchmarks/stream-capacity.png"
        else:
            log(f"matplotlib is not installed: {png} is not redrawn (see benchmarks/README.md)")
    text = markdown(res)
    (RESULTS / "streams.json").write_text(json.dumps(res, indent=1, default=str))
    (RESULTS / "streams.md").write_text(text + "\n")
    if docs and not failed:
        docs_writer.put_sections(docs_writer.DOCS, text)
    print(text)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for tool in (NODE, "nginx"):
        if shutil.which(tool) is None:
            sys.exit(f"missing {tool} (see benchmarks/README.md)")
    raise_nofile()
    if args.render:
        res = json.loads(Path(args.render).read_text())
        base = res["meta"]["args"].get("base")
        if base:
            LABEL["base"] = f"vllm-proxy {base} (before)"
        write_out(res, args.docs, failed=False)
        return 0
    res: dict[str, Any] = {"streams": [], "bodies": [], "notes": []}
    if args.base:
        LABEL["base"] = f"vllm-proxy {args.base} (before)"
    res["meta"] = {
        "command": command_line("streams.py", argv),
        "args": {k: v for k, v in vars(args).items()},
        "versions": {**versions(Path("/nonexistent")), "node": node_version()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    t0 = time.monotonic()
    with session("vllm-proxy-streams-", args.keep_tmp) as (tmp, procs):
        failed = attempt(res["notes"], lambda: run(args, tmp, procs, res))
        log("stopping every server ...")
    res["meta"]["runtime_s"] = time.monotonic() - t0
    write_out(res, args.docs, failed is not None)
    return exit_code(failed)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
