#!/usr/bin/env python3
"""Time to first token after a cold start, a level-1 wake and a level-2 wake: via vllm-proxy
and straight at the engine, side by side.

    .venv/bin/python benchmarks/sleep.py [--rounds 5] [--startup-delay 2] [--wake-l1 0.3]
                                         [--wake-l2 1.0] [--append docs/benchmarks.md]
                                         [--out FILE] [--keep-tmp]

One vllm-proxy (a real process, ``vllm-proxy --config``) serves three models of the fake engine
on a static GPU budget that holds all of them: ``cold`` (no sleep policy), ``l1`` (sleep level
1) and ``l2`` (sleep level 2). The fake engine's wake delay is one knob for both levels, so the
two sleepy models differ in ``FAKE_ENGINE_WAKE_DELAY`` (a level-2 wake reloads the weights from
disk and is the slower one). Beside the proxy run the engine-side references, same knobs:

* cold: ``python -m fake_vllm`` spawned by the benchmark itself and polled (TCP connect every
  2 ms) until it listens;
* l1, l2: a standalone fake engine each, put to sleep with ``POST /sleep?level=N`` and woken
  with the very calls the proxy makes: ``POST /wake_up``; for level 2 also
  ``POST /collective_rpc {"method": "reload_weights"}`` and ``POST /reset_prefix_cache``; then
  ``GET /is_sleeping``.

In each round (the order of the three cases rotates, and which of proxy and direct goes first
alternates) the benchmark makes each case cold or asleep (admin ``unload`` / ``sleep`` on the
proxy; the calls above directly) and then times one streamed chat request: request sent ->
first SSE event that carries content (TTFT). Every request opens a new connection. *Added* =
TTFT via the proxy - TTFT direct in the same round (direct includes the wake calls). Goal: a
wake adds <= 50 ms. Where the proxy's time goes: its own ``vllm_proxy_engine_transition_seconds``
(its wake calls, or spawn to ready) and the times of its ``SLEEPING -> WAKE_WAITING`` and
``WAKING -> RUNNING`` log lines (``NEW -> STARTING -> RUNNING`` for a cold start) against
the client's clock: request -> WAKE_WAITING is routing and the start of the wake, RUNNING -> first
token is the lease and the relay, and TTFT minus the engine calls is everything the proxy did
outside them (admission included).

Prints the tables and the command; raw numbers go to ``benchmarks/results/sleep.json``;
``--append FILE`` also writes the tables as a section of FILE (docs/benchmarks.md).
Everything binds 127.0.0.1 and is stopped at the end (``--keep-tmp`` keeps the logs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import re
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
RESULTS = ROOT / "benchmarks" / "results" / "sleep.json"
CASES = ("cold", "l1", "l2")
LABEL = {"cold": "cold start", "l1": "wake from level 1", "l2": "wake from level 2"}
GOAL_MS = 50.0
SECTION = "## Sleep and wake: time to first token"
BODY = {"messages": loadgen.PROMPT, "stream": True, "max_tokens": 4}


def engine_env(args: argparse.Namespace, case: str) -> dict[str, str]:
    env = {"FAKE_ENGINE_STARTUP_DELAY": f"{args.startup_delay:g}", "FAKE_ENGINE_TOKENS": "4"}
    if case != "cold":
        env["FAKE_ENGINE_WAKE_DELAY"] = f"{args.wake_l1 if case == 'l1' else args.wake_l2:g}"
    return env


def sleepy_config(args: argparse.Namespace, tmp: Path, port: int) -> dict[str, Any]:
    models: dict[str, Any] = {}
    for case in CASES:
        models[case] = {"model": f"fake/{case}", "memory_mb": 1000, "env": engine_env(args, case)}
        if case != "cold":  # asleep only when the benchmark says so
            models[case]["sleep"] = {"level": int(case[1]), "after_idle_s": 3600, "memory_mb": 100}
    return harness.proxy_config(
        port,
        tmp / "proxy-state",
        models,
        server={"admin_open": True, "access_log": False, "drain_timeout_s": 2},
        engine={
            "command": harness.FAKE_ENGINE,
            "idle_timeout_s": 0,
            "stop_timeout_s": 3,
            "startup_timeout_s": 60,
            "port_range": [30000, 31999],
        },
        gpu=harness.static_gpu(8000),
    )


# --------------------------------------------------------------------------- one request


async def ttft(http: aiohttp.ClientSession, url: str, model: str) -> float:
    """Seconds from sending a streamed chat request to the first SSE event with content; the
    rest of the stream is read to its end."""
    return (await timed_stream(http, url, model))[0]


async def timed_stream(
    http: aiohttp.ClientSession, url: str, model: str
) -> tuple[float, float, float]:
    """`ttft()`, and the wall-clock times the request was sent and its first token came."""
    sent = time.time()
    t0 = time.perf_counter()
    first: float | None = None
    async with http.post(url + loadgen.CHAT, json={"model": model, **BODY}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{model}: HTTP {resp.status}: {(await resp.read())[:300]!r}")
        pending = b""
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            pending += data
            while first is None and (i := pending.find(b"\n\n")) >= 0:
                event, pending = pending[:i], pending[i + 2 :]
                if event.startswith(b"data: {") and _has_content(event[6:]):
                    first = now - t0
    if first is None:
        raise RuntimeError(f"{model}: stream ended without content")
    return first, sent, sent + first


def transition_at(log_path: Path, model: str, old: str, new: str) -> float:
    """Wall-clock time (ms resolution) of the proxy's last ``<model>#<n>: OLD -> NEW`` line."""
    found = re.findall(
        rf"^(\S+ \S+) INFO \S+: {re.escape(model)}#\d+: {old} -> {new}$",
        log_path.read_text(errors="replace"),
        flags=re.M,
    )
    if not found:
        return float("nan")
    return datetime.datetime.strptime(found[-1], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _has_content(data: bytes) -> bool:
    choices = json.loads(data).get("choices") or []
    return any((c.get("delta") or {}).get("content") for c in choices)


async def call(http: aiohttp.ClientSession, method: str, url: str, body: Any = None) -> Any:
    async with http.request(method, url, json=body) as resp:
        data = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{method} {url}: HTTP {resp.status}: {data[:300]!r}")
        return json.loads(data) if data.strip() else None


async def transition_sum(http: aiohttp.ClientSession, url: str, model: str, kind: str) -> float:
    """The proxy's own seconds in ``vllm_proxy_engine_transition_seconds`` (sum) so far."""
    text = await (await http.get(url + "/metrics")).text()
    pattern = (
        r'vllm_proxy_engine_transition_seconds_sum\{kind="' + kind + r'",model_id="' + model
        + r'"\} ([0-9.e+-]+)'
    )  # fmt: skip
    match = re.search(pattern, text)
    return float(match.group(1)) if match else 0.0


# --------------------------------------------------------------------------- the cases


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path, procs: harness.Procs) -> None:
        self.args = args
        self.tmp = tmp
        self.procs = procs
        self.proxy: harness.ProxyHandle | None = None
        self.direct: dict[str, int] = {}  # case -> port of its standalone engine
        self.cold_port = 0
        self.rows: list[dict[str, Any]] = []

    def engine_argv(self, case: str, port: int) -> list[str]:
        argv = [harness.PYTHON, "-m", "fake_vllm", "--model", f"fake/{case}"]
        argv += ["--served-model-name", case, "--port", str(port)]
        return argv + (["--enable-sleep-mode"] if case != "cold" else [])

    def start(self) -> None:
        proxy_port, cold_port, l1, l2 = harness.pick_ports(4)
        self.cold_port = cold_port
        self.direct = {"l1": l1, "l2": l2}
        for case, port in self.direct.items():
            env = {**engine_env(self.args, case), "VLLM_SERVER_DEV_MODE": "1"}
            log_path = self.tmp / f"direct-{case}.log"
            proc = self.procs.start(f"direct-{case}", self.engine_argv(case, port), log_path, env)
            harness.wait_http(f"http://127.0.0.1:{port}/health", 60, proc)
        config = sleepy_config(self.args, self.tmp, proxy_port)
        self.proxy = harness.start_proxy(self.procs, "vllm-proxy", config)

    async def via_proxy(self, http: aiohttp.ClientSession, case: str) -> dict[str, float]:
        assert self.proxy is not None
        url = self.proxy.url
        if case == "cold":
            await call(http, "POST", f"{url}/admin/models/cold/unload")
            kind = "cold_start"
        else:
            await call(http, "POST", f"{url}/admin/models/{case}/sleep")
            kind = f"wake_{case}"
        before = await transition_sum(http, url, case, kind)
        total, sent, first = await timed_stream(http, url, case)
        engine = await transition_sum(http, url, case, kind) - before
        warm = await ttft(http, url, case)
        # Where the time outside the engine calls went, from the proxy's log (1 ms resolution).
        # A cold start: NEW -> STARTING -> RUNNING; a wake: SLEEPING -> WAKE_WAITING (asked) ->
        # WAKING (admitted) -> RUNNING.
        old, asked, last = ("NEW", "STARTING", "STARTING") if case == "cold" else (
            "SLEEPING", "WAKE_WAITING", "WAKING")  # fmt: skip
        began = transition_at(self.proxy.log_path, case, old, asked)
        ended = transition_at(self.proxy.log_path, case, last, "RUNNING")
        return {
            "ttft": total,
            "engine": engine,
            "outside": total - engine,
            "warm": warm,
            "to_transition": began - sent,
            "transition": ended - began,
            "after_running": first - ended,
        }

    async def direct_cold(self, http: aiohttp.ClientSession) -> dict[str, float]:
        port = self.cold_port
        env = engine_env(self.args, "cold")
        log_path = self.tmp / "direct-cold.log"
        t0 = time.perf_counter()
        proc = self.procs.start("direct-cold", self.engine_argv("cold", port), log_path, env)
        try:
            while not await _listens(port):
                if proc.poll() is not None:
                    raise RuntimeError(f"direct cold engine exited {proc.returncode}")
                await asyncio.sleep(0.002)
            ready = time.perf_counter() - t0
            first = await ttft(http, f"http://127.0.0.1:{port}", "cold")
            total = ready + first  # spawn -> first token
            warm = await ttft(http, f"http://127.0.0.1:{port}", "cold")
        finally:
            self.procs.drop(proc, grace=5)
        return {"ttft": total, "engine": ready, "warm": warm}

    async def direct_wake(self, http: aiohttp.ClientSession, case: str) -> dict[str, float]:
        base = f"http://127.0.0.1:{self.direct[case]}"
        level = int(case[1])
        await call(http, "POST", f"{base}/sleep?level={level}")
        t0 = time.perf_counter()
        await call(http, "POST", f"{base}/wake_up")
        wake_up = time.perf_counter() - t0
        if level >= 2:
            await call(http, "POST", f"{base}/collective_rpc", {"method": "reload_weights"})
            await call(http, "POST", f"{base}/reset_prefix_cache")
        if (await call(http, "GET", f"{base}/is_sleeping"))["is_sleeping"]:
            raise RuntimeError(f"direct {case}: still asleep after the wake calls")
        engine = time.perf_counter() - t0
        first = await ttft(http, base, case)
        warm = await ttft(http, base, case)
        return {"ttft": engine + first, "engine": engine, "wake_up": wake_up, "warm": warm}

    async def round(self, rnd: int) -> None:
        connector = aiohttp.TCPConnector(force_close=True)  # a new connection per request
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            if rnd == 0:  # first starts of the sleepy models: not measured
                assert self.proxy is not None
                for case in ("l1", "l2"):
                    await ttft(http, self.proxy.url, case)
            order = CASES[rnd % 3 :] + CASES[: rnd % 3]
            for case in order:
                sides = ("proxy", "direct") if rnd % 2 == 0 else ("direct", "proxy")
                row: dict[str, Any] = {"round": rnd + 1, "case": case}
                for side in sides:
                    if side == "proxy":
                        row["proxy"] = await self.via_proxy(http, case)
                    elif case == "cold":
                        row["direct"] = await self.direct_cold(http)
                    else:
                        row["direct"] = await self.direct_wake(http, case)
                row["added"] = row["proxy"]["ttft"] - row["direct"]["ttft"]
                self.rows.append(row)
                harness.log(
                    f"round {rnd + 1} {case}: via proxy {row['proxy']['ttft'] * 1000:.1f} ms,"
                    f" direct {row['direct']['ttft'] * 1000:.1f} ms,"
                    f" added {row['added'] * 1000:.1f} ms"
                )

    def starts(self) -> dict[str, int]:
        assert self.proxy is not None
        return {case: self.proxy.starts(case) for case in CASES}

    def log_errors(self) -> list[str]:
        """The proxy's ERROR lines and tracebacks, each cut to its first 160 characters."""
        assert self.proxy is not None
        text = self.proxy.log_path.read_text(errors="replace")
        lines = [ln for ln in text.splitlines() if " ERROR " in ln or " CRITICAL " in ln]
        lines += ["Traceback"] * text.count("Traceback (most recent call last)")
        return [ln.split(": ", 1)[-1][:160] for ln in lines]


async def _listens(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


# --------------------------------------------------------------------------- report


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per case: p50, p90 and max (ms) of every measured quantity over the rounds."""
    out = {}
    for case in CASES:
        mine = [r for r in rows if r["case"] == case]
        stats: dict[str, float] = {"n": len(mine)}
        for side in ("proxy", "direct"):
            for key in mine[0][side] if mine else ():
                vals = [r[side][key] * 1000 for r in mine]
                stats[f"{side}_{key}_p50"] = loadgen.med(vals)
                stats[f"{side}_{key}_p90"] = loadgen.pct(vals, 90)
                stats[f"{side}_{key}_max"] = max(vals)
        vals = [r["added"] * 1000 for r in mine]
        stats["added_p50"], stats["added_p90"] = loadgen.med(vals), loadgen.pct(vals, 90)
        stats["added_max"] = max(vals) if vals else float("nan")
        out[case] = stats
    return out


def table(res: dict[str, Any]) -> list[str]:
    s = res["summary"]
    a = res["args"]
    knob = {
        "cold": f"startup {a['startup_delay']:g} s",
        "l1": f"wake {a['wake_l1']:g} s",
        "l2": f"wake {a['wake_l2']:g} s",
    }

    def pair(x: dict[str, float], key: str) -> str:
        return f"{x[key + '_p50']:.1f} / {x[key + '_p90']:.1f}"

    out = [
        "One vllm-proxy process in front of three models of the fake engine (`cold`: no sleep"
        " policy; `l1`, `l2`: sleep levels 1 and 2), and beside it the same engines driven"
        " directly; each round makes every case cold or asleep, then times one streamed chat"
        " request (method: the docstring of `benchmarks/sleep.py`).",
        "",
        "| case | engine knob | rounds | TTFT via proxy p50 / p90 ms | TTFT direct p50 / p90 ms"
        " | **added p50 / p90 ms** |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for case in CASES:
        x = s[case]
        out.append(
            f"| {LABEL[case]} | {knob[case]} | {x['n']:.0f} | {pair(x, 'proxy_ttft')}"
            f" | {pair(x, 'direct_ttft')} | **{pair(x, 'added')}** |"
        )
    worst = max(s[c]["added_p50"] for c in ("l1", "l2"))
    met = "**yes**" if worst <= GOAL_MS else "**no**"
    out += [
        "",
        f"Goal: a wake adds <= {GOAL_MS:g} ms to the time to first token (median): {met}"
        f" (the larger median of the two levels: {worst:.1f} ms).",
        "",
        "Where the proxy's time goes (p50 / p90 ms; from the proxy's log, 1 ms resolution, and"
        " its `vllm_proxy_engine_transition_seconds`):",
        "",
        "| case | request -> WAKE_WAITING (cold: STARTING) | engine calls (proxy's histogram) |"
        " RUNNING -> first token at the client | TTFT - engine calls |",
        "|---|---:|---:|---:|---:|",
    ]
    for case in CASES:
        x = s[case]
        out.append(
            f"| {LABEL[case]} | {pair(x, 'proxy_to_transition')} | {pair(x, 'proxy_engine')}"
            f" | {pair(x, 'proxy_after_running')} | {pair(x, 'proxy_outside')} |"
        )
    starts = res["engine_starts"]
    rounds = a["rounds"]
    errors = res["log_errors"]
    out += [
        "",
        f"Engine starts via the proxy over the run: cold {starts['cold']} for {rounds} rounds"
        " (one more is a retried start, e.g. a lost port race: see the log lines below),"
        f" l1 {starts['l1']}, l2 {starts['l2']} (1 each: every wake was a wake, never a"
        f" restart). Proxy log: {len(errors)} ERROR/Traceback line(s)"
        + ("" if not errors else ": " + "; ".join(f"`{e}`" for e in errors[:3]))
        + ".",
        "",
        "*TTFT*: request sent -> first SSE event with content, a new connection per request."
        " *Direct*: the engine alone — cold: spawn -> listening (TCP connect polled every 2 ms)"
        " -> first token; a wake: the proxy's own wake calls (`/wake_up`; level 2 also"
        " `reload_weights` and `/reset_prefix_cache`; `/is_sleeping`) -> first token."
        " *Added* = via proxy - direct, paired by round."
        f" Awake, the same request takes {s['l1']['proxy_warm_p50']:.1f} ms via the proxy and"
        f" {s['l1']['direct_warm_p50']:.1f} ms direct (p50, l1 engine).",
        "",
        "A cold start's added time lies inside spawn -> ready, not around it: the proxy starts"
        " the engine under its guard (a Python process of its own)"
        " and polls `/health` 5-20 ms apart, and the row carries the start-up noise of Python"
        " processes on a shared 2-core machine (a round can come out negative). The goal is"
        " about the wake rows.",
    ]
    cmd = " ".join(["benchmarks/sleep.py", *sys.argv[1:]])
    out += [
        "",
        f"`.venv/bin/python {cmd}` ({res['when']}, git {res['git']}, {res['machine']}; the proxy"
        " as a process, `vllm-proxy --config`, on a static GPU budget)",
    ]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--startup-delay", type=float, default=2.0, help="FAKE_ENGINE_STARTUP_DELAY")
    p.add_argument("--wake-l1", type=float, default=0.3, help="FAKE_ENGINE_WAKE_DELAY of l1")
    p.add_argument("--wake-l2", type=float, default=1.0, help="FAKE_ENGINE_WAKE_DELAY of l2")
    p.add_argument("--out", type=Path, default=RESULTS, help="raw numbers (JSON)")
    p.add_argument("--append", type=Path, help="also write the table as a section of this file")
    p.add_argument("--keep-tmp", action="store_true", help="keep the configs and every log")
    args = p.parse_args()
    with harness.session("vllm-proxy-sleep-", args.keep_tmp) as (tmp, procs):
        bench = Bench(args, tmp, procs)
        try:
            bench.start()
            for rnd in range(args.rounds):
                asyncio.run(bench.round(rnd))
            starts, errors = bench.starts(), bench.log_errors()
        except Exception:
            if bench.proxy is not None:
                print(harness.tail(bench.proxy.log_path, 30), file=sys.stderr)
            raise
    res = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "git": harness.git_head(),
        "machine": harness.machine(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": bench.rows,
        "summary": summarize(bench.rows),
        "engine_starts": starts,
        "log_errors": errors,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    lines = table(res)
    print("\n" + "\n".join(lines))
    if args.append is not None:
        docs_writer.put_sections(args.append, SECTION + "\n\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
