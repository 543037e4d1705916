"""Load generators: wrk (non-streamed requests) and small aiohttp clients (streams, RSS, storms).

Every loop here is bounded: wrk by ``-d`` plus a subprocess timeout, the clients by a request
count and a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import resource
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import psutil
from harness import BENCH_DIR

LUA = BENCH_DIR / "post.lua"
CHAT = "/v1/chat/completions"
PROMPT = [{"role": "user", "content": "Say hello"}]


def pct(values: list[float], p: float) -> float:
    """The p-th percentile (nearest rank on sorted data); NaN for no data."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(p / 100 * (len(s) - 1))))
    return s[k]


def med(values: list[float]) -> float:
    vals = [v for v in values if v == v]  # drop NaN
    return statistics.median(vals) if vals else float("nan")


# --------------------------------------------------------------------------- CPU noise


class CpuMeter:
    """CPU used by other programs on the machine during a measurement.

    other = busy time of the whole machine (user + nice + system in /proc/stat; irq and
    softirq left out) - this benchmark's own processes (itself, every live descendant: servers,
    engines; and reaped children: wrk) - kernel threads (ksoftirqd carries part of our own
    loopback traffic). A noisy neighbour (the machine may be shared) shows up here instead of
    silently in the results.
    """

    def __init__(self) -> None:
        self.tck = os.sysconf("SC_CLK_TCK")
        self.ncpu = os.cpu_count() or 1
        self._t0 = 0.0
        self._busy0 = 0.0
        self._mine0: dict[tuple[int, float], float] = {}
        self._rusage0 = 0.0

    def _busy(self) -> float:
        with open("/proc/stat") as fh:
            v = [int(x) for x in fh.readline().split()[1:]]
        return (v[0] + v[1] + v[2]) / self.tck

    @staticmethod
    def _mine() -> dict[tuple[int, float], float]:
        """CPU seconds of our live processes and of kernel threads, by (pid, start time)."""
        me = psutil.Process()
        ours = {me.pid, *(p.pid for p in me.children(recursive=True))}
        out = {}
        for p in psutil.process_iter(["pid", "ppid", "create_time", "cpu_times"]):
            i = p.info
            if i["cpu_times"] is None:
                continue
            if i["pid"] in ours or i["pid"] == 2 or i["ppid"] == 2:
                out[(i["pid"], i["create_time"] or 0.0)] = (
                    i["cpu_times"].user + i["cpu_times"].system
                )
        return out

    @staticmethod
    def _reaped() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._busy0, self._mine0, self._rusage0 = self._busy(), self._mine(), self._reaped()

    def foreign(self) -> float:
        """Share of all cores used by other programs since `start()` (0..1)."""
        wall = time.monotonic() - self._t0
        busy, mine, reaped = self._busy(), self._mine(), self._reaped()
        own = reaped - self._rusage0
        for key, v in mine.items():
            own += v - self._mine0.get(key, v if key[1] < self._t0_wall() else 0.0)
        other = (busy - self._busy0) - own
        return max(0.0, other / (wall * self.ncpu)) if wall > 0 else 0.0

    def _t0_wall(self) -> float:
        return time.time() - (time.monotonic() - self._t0) - 0.5


METER = CpuMeter()


# --------------------------------------------------------------------------- wrk


def run_wrk(url: str, model: str, key: str, conns: int, seconds: float) -> dict[str, Any]:
    """One wrk run (1 thread, keep-alive); latencies in microseconds, plus ``rps``."""
    argv = ["wrk", "-t1", f"-c{conns}", f"-d{seconds:g}s", "--timeout", "10s", "--latency"]
    argv += ["-s", str(LUA), url]
    env = {**os.environ, "BENCH_MODEL": model, "BENCH_KEY": key}
    METER.start()
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=seconds + 60)
    foreign = METER.foreign()
    m = re.search(r"^WRKJSON (\{.*\})$", out.stdout, re.M)
    if not m:
        raise RuntimeError(f"wrk printed no summary (rc {out.returncode}): {out.stderr[-500:]}")
    res: dict[str, Any] = json.loads(m[1])
    res["rps"] = res["requests"] / (res["duration_us"] / 1e6)
    res["foreign_cpu"] = foreign
    res["errors"] = sum(
        res[k] for k in ("err_connect", "err_read", "err_write", "err_status", "err_timeout")
    )
    return res


# --------------------------------------------------------------------------- streams

_ID = re.compile(rb'"id":"[^"]*"')
_CREATED = re.compile(rb'"created":\d+')


def normalize(raw: bytes) -> bytes:
    """An SSE body with per-request ids and timestamps blanked (for byte comparison)."""
    return _CREATED.sub(b'"created":0', _ID.sub(b'"id":""', raw))


@dataclass
class StreamResult:
    status: int
    ttfc: float  # seconds from sending the request to the first complete SSE event
    gaps: list[float]  # seconds between consecutive SSE events
    events: int
    reads: int  # socket reads that delivered data (TCP-level "chunks" seen by the client)
    raw: bytes = field(repr=False)


async def one_stream(
    session: aiohttp.ClientSession, url: str, model: str, key: str
) -> StreamResult:
    body = {"model": model, "messages": PROMPT, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    times: list[float] = []
    raw = bytearray()
    reads = 0
    t0 = time.perf_counter()
    async with session.post(url + CHAT, json=body, headers=headers) as resp:
        pending = b""
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            reads += 1
            raw += data
            pending += data
            while (i := pending.find(b"\n\n")) >= 0:
                pending = pending[i + 2 :]
                times.append(now)
        status = resp.status
    gaps = [b - a for a, b in itertools.pairwise(times)]
    ttfc = times[0] - t0 if times else float("nan")
    return StreamResult(status, ttfc, gaps, len(times), reads, bytes(raw))


async def stream_batch(
    url: str, model: str, key: str, sequential: int, concurrent: int
) -> dict[str, list[StreamResult]]:
    """`sequential` streams one after another (c=1), then one wave of `concurrent` at once."""
    timeout = aiohttp.ClientTimeout(total=120)
    out: dict[str, list[StreamResult]] = {"c1": [], "cN": []}
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        await one_stream(session, url, model, key)  # opens the keep-alive connection
        for _ in range(sequential):
            out["c1"].append(await one_stream(session, url, model, key))
        if concurrent:
            out["cN"] = list(
                await asyncio.gather(
                    *(one_stream(session, url, model, key) for _ in range(concurrent))
                )
            )
    return out


# --------------------------------------------------------------------------- open streams / RSS


async def hold_streams(
    url: str,
    model: str,
    key: str,
    n: int,
    rss: Callable[[], int],
    open_timeout: float,
) -> dict[str, Any]:
    """Open `n` streams, wait until each has its first SSE event, sample `rss()`, close all."""
    opened = 0
    failed: list[str] = []
    all_open = asyncio.Event()
    release = asyncio.Event()
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": model, "messages": PROMPT, "stream": True}

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal opened
        try:
            async with session.post(url + CHAT, json=body, headers=headers) as resp:
                if resp.status != 200:
                    failed.append(f"HTTP {resp.status}")
                    return
                buf = b""
                async for data in resp.content.iter_any():
                    buf += data
                    if b"\n\n" in buf:
                        break
                else:
                    failed.append("stream ended before its first event")
                    return
                opened += 1
                if opened == n:
                    all_open.set()
                await release.wait()
        except (aiohttp.ClientError, TimeoutError) as err:
            failed.append(type(err).__name__)

    baseline = rss()
    peak = baseline
    samples: list[int] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    t0 = time.perf_counter()
    open_s, open_at_sample = float("nan"), 0
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        tasks = [asyncio.create_task(client(session)) for _ in range(n)]
        try:
            deadline = t0 + open_timeout
            while not all_open.is_set() and time.perf_counter() < deadline:
                if opened + len(failed) >= n:
                    break
                peak = max(peak, rss())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(all_open.wait(), 0.1)
            open_s = time.perf_counter() - t0
            open_at_sample = opened
            for _ in range(5):  # hold them open a little and sample
                value = rss()
                samples.append(value)
                peak = max(peak, value)
                await asyncio.sleep(0.2)
        finally:
            release.set()
            _, pending = await asyncio.wait(tasks, timeout=30)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    return {
        "n": n,
        "opened": open_at_sample,  # streams open when RSS was sampled
        "opened_later": opened - open_at_sample,
        "failed": len(failed),
        "fail_kinds": sorted(set(failed))[:5],
        "open_s": open_s,
        "rss_baseline": baseline,
        "rss_open": statistics.median(samples) if samples else 0,
        "rss_peak": peak,
    }


# --------------------------------------------------------------------------- cold starts


async def _poll_health(port: int, deadline: float) -> tuple[float, float, float]:
    """Poll GET /health on the engine port every ~1 ms with a fresh connection.

    Returns (last failed poll's send time, first 200's send time, first 200's receive time).
    """
    last_fail = time.perf_counter()
    req = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    while time.perf_counter() < deadline:
        sent = time.perf_counter()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(req)
                line = await asyncio.wait_for(reader.readline(), 2)
            finally:
                writer.close()
            if line.split(b" ")[1:2] == [b"200"]:
                return last_fail, sent, time.perf_counter()
        except (OSError, TimeoutError):
            pass
        last_fail = sent
        await asyncio.sleep(0.001)
    raise TimeoutError(f"engine port {port} never answered /health with 200")


async def readiness(url: str, model: str, key: str, port: int, warm_n: int = 20) -> dict[str, Any]:
    """Cold request through the proxy while polling the engine's /health directly."""
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": model, "messages": PROMPT, "max_tokens": 16}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        t0 = time.perf_counter()
        poller = asyncio.create_task(_poll_health(port, t0 + 90))
        try:
            async with session.post(url + CHAT, json=body, headers=headers) as resp:
                await resp.read()
                status = resp.status
            t_resp = time.perf_counter()
            last_fail, _h_sent, h_recv = await asyncio.wait_for(poller, 10)
        finally:
            poller.cancel()
        warm = []
        for _ in range(warm_n):
            t = time.perf_counter()
            async with session.post(url + CHAT, json=body, headers=headers) as resp:
                await resp.read()
            warm.append(time.perf_counter() - t)
    warm_ms = statistics.median(warm) * 1e3
    raw_ms = (t_resp - h_recv) * 1e3
    return {
        "status": status,
        "cold_total_s": t_resp - t0,
        "readiness_ms": raw_ms,  # first 200 seen by our poller -> response at the client
        "window_ms": (h_recv - last_fail) * 1e3,  # when, at most, /health began answering
        "warm_ms": warm_ms,
        "net_ms": raw_ms - warm_ms,  # minus one warm request's own time
    }


def engine_pids(model: str) -> set[int]:
    """Fake-engine processes (not their guards) serving `model`."""
    pids = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd[1:3] == ["-m", "fake_vllm"] and model in cmd:
            i = cmd.index("--served-model-name") if "--served-model-name" in cmd else -1
            if i >= 0 and cmd[i + 1] == model:
                pids.add(p.info["pid"])
    return pids


async def storm(url: str, model: str, key: str, n: int) -> dict[str, Any]:
    """`n` concurrent requests for a cold model; time until all are answered."""
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": model, "messages": PROMPT, "max_tokens": 16}
    seen: set[int] = set()
    stop = asyncio.Event()

    async def sampler() -> None:
        while not stop.is_set():
            seen.update(engine_pids(model))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)

    async def one(session: aiohttp.ClientSession) -> tuple[int, float]:
        async with session.post(url + CHAT, json=body, headers=headers) as resp:
            await resp.read()
            return resp.status, time.perf_counter()

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        samp = asyncio.create_task(sampler())
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(session) for _ in range(n)), return_exceptions=True)
        stop.set()
        await samp
    seen.update(engine_pids(model))
    ok = [r for r in results if isinstance(r, tuple) and r[0] == 200]
    done_t = [r[1] - t0 for r in results if isinstance(r, tuple)]
    return {
        "n": n,
        "ok": len(ok),
        "errors": n - len(ok),
        "all_served_s": max(done_t) if done_t else float("nan"),
        "first_served_s": min(done_t) if done_t else float("nan"),
        "engine_pids_seen": len(seen),
    }
