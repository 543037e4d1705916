#!/usr/bin/env python3
"""A bounded soak under faults: is every request accounted for, and does nothing leak?

    .venv/bin/python benchmarks/soak.py [--seconds 60] [--clients 24] [--seed 1]

Runs vllm-proxy (a real process, engines on Unix sockets) with four models of the fake engine
on a static budget that holds two at a time (two of them with a level-1 sleep policy, so the
proxy puts them to sleep to make room before it stops anything), and for `--seconds`:

* `--clients` clients send chat requests (a third streamed) to random models, back to back;
  one of them reads a stream a few bytes at a time, one stops reading at all (the proxy drops
  it after ``send_timeout_s``);
* besides them, now and then: a 31 KiB gzip body of dense JSON (``{"model": ..., "x":
  [{},{},...]}``, 30 MiB inflated, under ``max_body_mb``), sometimes two at once past
  ``max_bodies_mb``; ``text/plain``, form, multipart or untyped POSTs to a model route; forged
  ``X-Request-ID`` values, a ``%0A`` in the path and a newline in the model name; and a scrape
  of ``/metrics/engines`` every second (one in five without the metrics key);
* every few seconds a random running engine is killed (SIGKILL to its group), hung (SIGSTOP;
  the health watcher must kill it) or put to sleep behind the proxy's back (``POST /sleep``
  straight to its socket under ``<state_dir>/sockets``; the watcher must notice at its next
  probe, unless the proxy's own sleep or stop of that instance comes first).

Every request must end in exactly one of: a complete answer (200, a whole stream ending in
``[DONE]``), an OpenAI-shaped error with a 4xx/5xx status (never a 500), or a stream that ends
with an SSE ``error`` event; for slow clients the proxy hanging up is the expected end; the odd
clients each get the answer their request calls for (400/404, 415, 503 ``request_bodies_full``).
Afterwards the proxy must hold no lease, its open descriptors and resident memory must be back
near their level before the load, every engine process must belong to a live instance, every
line of its log must be a log record (or a line of the engine log a record quotes) with exactly
one well-formed access line per request, a ``/health`` probe from another process must never
have waited longer than `--max-stall-s`, and after SIGTERM no engine process may remain.
Prints tables and the command; exits 1 if any check fails. Everything binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gzip
import json
import os
import random
import re
import select
import signal
import sys
import time
from http.client import HTTPConnection, HTTPException
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from yarl import URL

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    FAKE_ENGINE,
    Procs,
    pick_ports,
    proxy_config,
    session,
    start_proxy,
    static_gpu,
)

MODELS = ("a", "b", "c", "d")
#: Models with a sleep policy: the proxy checks /is_sleeping only for them (and only their
#: engines serve /sleep at all: vLLM's dev routes come with sleep mode).
SLEEPERS = ("c", "d")
HEALTH_INTERVAL_S = 0.5
HEALTH_TIMEOUT_S = 0.5
METRICS_KEY = "soak-metrics-key"
METRICS_AUTH = {"Authorization": f"Bearer {METRICS_KEY}"}
#: Dense bodies inflate to this (under ``max_body_mb``, 32 by default) ...
DENSE_MIB = 30
#: ... and two at once pass this (the soak's ``server.max_bodies_mb``, 512 by default).
MAX_BODIES_MB = 48
MIB = 1024 * 1024
GZIP_JSON = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
CHAT_TAIL = ', "messages": [{"role": "user", "content": "hi"}]}'
#: A record of the proxy's log (text format): time, level, logger.
RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                    r"[\w.]+: ")  # fmt: skip
#: An access line, whole: request id (a token), method, path and fields escaped, numbers.
ACCESS = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO vllm_proxy\.access: "
                    r"(?P<rid>[A-Za-z0-9\-._:~+/=]{1,128}) [A-Z]+ /[\x21-\x7e]* "
                    r"model=[\x21-\x7e]+ instance=[\x21-\x7e]+ status=[1-5]\d\d bytes=\d+ "
                    r"duration_ms=\d+\.\d( key=[\x21-\x7e]+)?")  # fmt: skip
#: An ERROR record that quotes an engine's log: its next lines are that log's.
QUOTES = re.compile(r" ERROR .*; last log lines of (?P<path>/.+):$")
#: The most lines of an engine's log a record quotes (engine.LOG_TAIL_LINES).
TAIL_LINES = 20
TOKEN = re.compile(r"[A-Za-z0-9\-._:~+/=]{1,128}")


def config(tmp: Path, port: int) -> dict[str, Any]:
    env = {"FAKE_ENGINE_TOKENS": "40", "FAKE_ENGINE_TOKEN_DELAY": "0.02"}
    models: dict[str, Any] = {m: {"model": f"fake/{m}", "memory_mb": 450} for m in MODELS}
    for m in SLEEPERS:  # asleep it holds 50 MiB: two sleepers and two engines fit
        models[m].update(sleep={"level": 1, "after_idle_s": 600, "memory_mb": 50})
    # Requests that reach an engine asleep: c's get a 503 from it, d's wait for a wake (the
    # fake engine's default, as vLLM 0.33 queues them).
    models["c"]["env"] = {"FAKE_ENGINE_ASLEEP": "reject"}
    server = {"admin_open": True, "send_timeout_s": 2, "drain_timeout_s": 5,
              "max_bodies_mb": MAX_BODIES_MB, "metrics_api_keys": [METRICS_KEY]}  # fmt: skip
    return proxy_config(
        port,
        tmp / "state",
        models,
        server=server,
        engine={
            "command": FAKE_ENGINE,
            "idle_timeout_s": 20,
            "stop_timeout_s": 2,
            "startup_timeout_s": 30,
            "health_interval_s": HEALTH_INTERVAL_S,
            "health_timeout_s": HEALTH_TIMEOUT_S,
            "health_misses": 2,
            "max_backoff_s": 2,
            "env": env,
        },
        gpu=static_gpu(1000),
        admission={"queue_timeout_s": 20},
    )


class Tally:
    def __init__(self) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.sent = 0
        #: The X-Request-ID of every answer ("" when it had none).
        self.rids: list[str] = []
        #: Requests of the odd clients that got another answer than theirs.
        self.unexpected: collections.Counter[str] = collections.Counter()
        #: What became of forged and token request ids.
        self.ids: collections.Counter[str] = collections.Counter()

    def add(self, outcome: str) -> None:
        self.outcomes[outcome] += 1

    def expect(self, outcome: str, allowed: tuple[str, ...]) -> None:
        self.add(outcome)
        if outcome.split(": ", 1)[1] not in allowed:
            self.unexpected[outcome] += 1


async def error_of(resp: aiohttp.ClientResponse) -> str:
    """``STATUS code`` for an OpenAI-shaped error, else ``STATUS bad body``."""
    try:
        err = (await resp.json(content_type=None)).get("error", {})
    except (ValueError, AttributeError):
        return f"{resp.status} bad body"
    ok = isinstance(err, dict) and isinstance(err.get("message"), str) and "code" in err
    return f"{resp.status} {err.get('code')}" if ok else f"{resp.status} bad body"


async def one_request(http: aiohttp.ClientSession, url: str, rng: random.Random, tally: Tally,
                      slow: str | None, headers: dict[str, str] | None = None
                      ) -> str | None:  # fmt: skip
    """One chat request; returns the X-Request-ID it was answered with (None: no answer)."""
    model = rng.choice(MODELS)
    stream = slow is not None or rng.random() < 1 / 3
    body = {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    tally.sent += 1
    rid = None
    try:
        async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
            rid = resp.headers.get("X-Request-ID", "")
            tally.rids.append(rid)
            if resp.status != 200:
                tally.add(await error_of(resp))
                return rid
            if not stream:
                data = await resp.json()
                tally.add("200" if data.get("object") == "chat.completion" else "200 bad body")
                return rid
            if slow == "stuck":
                await resp.content.readany()
                await asyncio.sleep(10)  # reads nothing more: the proxy should drop it
            text = b""
            while chunk := await resp.content.read(64 if slow == "slow" else 65536):
                text += chunk
                if slow == "slow":
                    await asyncio.sleep(0.01)
            if text.endswith(b"data: [DONE]\n\n") and b'"error"' not in text:
                tally.add("200 stream")
            elif b'"error"' in text:
                tally.add("stream error event")
            else:
                tally.add("stream cut short")
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
            aiohttp.ClientOSError) as err:  # fmt: skip
        tally.add(
            "hung up on a stuck client" if slow == "stuck" else f"client error {type(err).__name__}"
        )
    return rid


async def client(url: str, seed: int, until: float, tally: Tally, slow: str | None) -> None:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while time.monotonic() < until:
            await one_request(http, url, rng, tally, slow)


async def pause(rng: random.Random, low: float, high: float, until: float) -> None:
    await asyncio.sleep(min(rng.uniform(low, high), max(0.0, until - time.monotonic())))


async def odd_request(http: aiohttp.ClientSession, tally: Tally, what: str,
                      allowed: tuple[str, ...], url: str | URL, **kw: Any) -> None:  # fmt: skip
    """A request whose answer is known: `allowed` (``STATUS code``), tallied as ``what: ...``."""
    tally.sent += 1
    try:
        async with http.post(url, **kw) as resp:
            tally.rids.append(resp.headers.get("X-Request-ID", ""))
            tally.expect(f"{what}: {await error_of(resp)}", allowed)
    except aiohttp.ClientError as err:
        tally.expect(f"{what}: client error {type(err).__name__}", allowed)


def dense_bodies() -> dict[str, bytes]:
    """31 KiB gzip bodies that inflate to `DENSE_MIB` of ``[{},{},...]`` inside the object: one
    naming a model that does not exist, one naming a model whose object never closes."""
    fill = b"{}," * (DENSE_MIB * MIB // 3 - 8) + b"{}]"
    return {
        "404 model_not_found": gzip.compress(b'{"model":"nope","x":[' + fill + b"}", 6),
        "400 invalid_request": gzip.compress(b'{"model":"a","x":[' + fill, 6),
    }


async def dense_client(url: str, seed: int, until: float, tally: Tally,
                       bodies: dict[str, bytes]) -> None:  # fmt: skip
    """A dense body every few seconds; every third time two at once (together they pass
    ``max_bodies_mb``: the later one may get 503 ``request_bodies_full``)."""
    rng = random.Random(seed)
    allowed = (*bodies, "503 request_bodies_full")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        n = 0
        while time.monotonic() < until:
            n += 1
            picks = [rng.choice(list(bodies)) for _ in range(2 if n % 3 == 0 else 1)]
            await asyncio.gather(*(
                odd_request(http, tally, "dense gzip body", allowed,
                            url + "/v1/chat/completions", data=bodies[p], headers=GZIP_JSON)
                for p in picks))  # fmt: skip
            await pause(rng, 2, 5, until)


MULTIPART = b'--x\r\nContent-Disposition: form-data; name="model"\r\n\r\na\r\n--x--\r\n'
#: Content types a browser page (or ``curl -d``, or a raw body) sends, and what they carry.
NOT_JSON = (
    ("text/plain", b'{"model": "a"' + CHAT_TAIL.encode()),
    ("application/x-www-form-urlencoded", b"model=a&messages=hi"),
    ("multipart/form-data; boundary=x", MULTIPART),
    ("application/octet-stream", b'{"model": "a"' + CHAT_TAIL.encode()),
    (None, b'{"model": "a"' + CHAT_TAIL.encode()),
)


async def not_json_client(url: str, seed: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        while time.monotonic() < until:
            kind, data = rng.choice(NOT_JSON)
            headers = {"Content-Type": kind} if kind else {}
            skip = () if kind else ("Content-Type",)
            await odd_request(http, tally, "not JSON", ("415 unsupported_media_type",),
                              url + "/v1/chat/completions", data=data, headers=headers,
                              skip_auto_headers=skip)  # fmt: skip
            await pause(rng, 0.1, 0.5, until)


#: Request ids that are not tokens: the proxy must answer (and log) one of its own instead.
FORGED_IDS = (
    "id with spaces status=200",
    'quote" model=evil instance=x',
    "tab\there",
    "caf\u00e9-non-ascii",
    "x" * 129,
)


async def forged_client(url: str, seed: int, until: float, tally: Tally) -> None:
    """Chat requests with forged or token request ids, and requests whose path or model would
    forge an access line if written raw."""
    rng = random.Random(seed)
    paths = ("/v1/chat/completions%0AGET%20/v1/models%20status=200",
             "/serve/a%0Ainstance=a%231/v1/chat/completions")  # fmt: skip
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        n = 0
        while time.monotonic() < until:
            n += 1
            what = rng.choice(("forged id", "forged id", "token id", "path", "model"))
            if what == "path":
                where = URL(url + rng.choice(paths), encoded=True)
                await odd_request(http, tally, "%0A in the path",
                                  ("404 unknown_endpoint", "404 model_not_found"), where,
                                  json={"model": "a"})  # fmt: skip
            elif what == "model":
                model = "a\n127.0.0.1 GET /v1/models model=a status=200"
                await odd_request(http, tally, "newline in the model name",
                                  ("404 model_not_found", "400 invalid_request"),
                                  url + "/v1/chat/completions",
                                  json={"model": model, "messages": []})  # fmt: skip
            else:
                given = rng.choice(FORGED_IDS) if what == "forged id" else f"soak-{seed}-{n}"
                rid = await one_request(http, url, rng, tally, None, {"X-Request-ID": given})
                if rid is not None:
                    kept = rid == given
                    if what == "token id":
                        tally.ids["token id kept" if kept else "token id NOT kept"] += 1
                    elif kept or not TOKEN.fullmatch(rid):
                        tally.ids["forged id passed on"] += 1
                    else:
                        tally.ids["forged id replaced"] += 1
            await pause(rng, 0.1, 0.3, until)


class Scrapes:
    def __init__(self) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.slowest = 0.0
        self.largest = 0
        self.series = 0
        self.bad: list[str] = []


async def scraper(url: str, until: float, scrapes: Scrapes) -> None:
    """``/metrics/engines`` every second with the metrics key (200, a page of samples labelled
    by instance), one in five without it (401)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        n = 0
        while time.monotonic() < until:
            n += 1
            keyed = n % 5 != 0
            began = time.monotonic()
            try:
                async with http.get(url + "/metrics/engines",
                                    headers=METRICS_AUTH if keyed else None) as resp:  # fmt: skip
                    page = await resp.read()
                    status = resp.status
            except aiohttp.ClientError as err:
                scrapes.bad.append(f"client error {type(err).__name__}")
                continue
            took = time.monotonic() - began
            scrapes.outcomes[f"{status}{'' if keyed else ' without the key'}"] += 1
            if not keyed:
                if status != 401:
                    scrapes.bad.append(f"{status} without the key")
            elif status != 200:
                scrapes.bad.append(f"{status} with the key")
            else:
                scrapes.slowest = max(scrapes.slowest, took)
                scrapes.largest = max(scrapes.largest, len(page))
                lines = page.decode("utf-8", "replace").splitlines()
                samples = [ln for ln in lines if ln and not ln.startswith("#")]
                scrapes.series = max(scrapes.series, len({s.split("{", 1)[0] for s in samples}))
                odd = [s for s in samples if "instance=" not in s or " " not in s]
                if odd:
                    scrapes.bad.append(f"sample without an instance: {odd[0][:80]!r}")
            await asyncio.sleep(1)


async def metrics_text(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/metrics", headers=METRICS_AUTH) as resp:
        return await resp.text()


def not_ordered(text: str, model: str) -> float:
    """``vllm_proxy_engine_restarts_total{reason="sleep_not_ordered"}`` of `model`."""
    labels = (f'model_id="{model}"', 'reason="sleep_not_ordered"')
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm_proxy_engine_restarts_total{")
               and all(label in line for label in labels))  # fmt: skip


class Faults:
    def __init__(self) -> None:
        self.done: collections.Counter[str] = collections.Counter()
        #: Sleeps sent behind the proxy's back: how each ended ...
        self.sleeps: collections.Counter[str] = collections.Counter()
        #: ... and seconds from the /sleep answer to the proxy's restart count for it.
        self.found_in: list[float] = []
        self.raced: list[str] = []
        self.sockets_outside: list[str] = []


async def foreign_sleep(http: aiohttp.ClientSession, url: str, tmp: Path, victim: dict[str, Any],
                        model: str, faults: Faults) -> None:  # fmt: skip
    """``POST /sleep`` straight to the engine's socket, then wait for the proxy to count a
    ``sleep_not_ordered`` restart of its model."""
    sock = victim["socket"]
    if not str(sock).startswith(str(tmp / "state" / "sockets") + "/"):
        faults.sockets_outside.append(str(sock))
    before = not_ordered(await metrics_text(http, url), model)
    engine = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock),
                                   timeout=aiohttp.ClientTimeout(total=2))  # fmt: skip
    try:
        async with engine, engine.post("http://localhost/sleep?level=1") as resp:
            answered = resp.status
    except (aiohttp.ClientError, TimeoutError):
        faults.sleeps["the engine did not answer /sleep (killed or hung meanwhile)"] += 1
        return
    if answered != 200:
        faults.sleeps[f"/sleep answered {answered}"] += 1
        return
    faults.done["sleep"] += 1
    slept = time.monotonic()
    while time.monotonic() - slept < 5:
        async with http.get(url + "/admin/models") as resp:
            view = await resp.json()
        now = [i["state"] for m in view["models"] for i in m["instances"]
               if i["id"] == victim["id"]]  # fmt: skip
        if not_ordered(await metrics_text(http, url), model) > before:
            faults.found_in.append(time.monotonic() - slept)
            faults.sleeps["noticed: engine killed, restart counted"] += 1
            return
        if now != ["running"]:  # the proxy's own sleep or stop came first
            faults.sleeps["raced: the proxy slept or stopped it itself first"] += 1
            faults.raced.append(f"{victim['id']} {now[0] if now else 'gone'} after "
                                f"{time.monotonic() - slept:.2f} s")  # fmt: skip
            return
        await asyncio.sleep(0.02)
    faults.sleeps["MISSED: still running asleep after 5 s"] += 1
    faults.raced.append(f"MISSED {victim['id']}")


async def chaos(url: str, tmp: Path, seed: int, until: float, every_s: float,
                faults: Faults) -> None:  # fmt: skip
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < until:
            await asyncio.sleep(every_s)
            async with http.get(url + "/admin/models") as resp:
                view = await resp.json()
            running = [(m["name"], i) for m in view["models"] for i in m["instances"]
                       if i["state"] == "running" and i["pid"]]  # fmt: skip
            how = rng.choice(("SIGKILL", "SIGSTOP", "sleep"))
            if how == "sleep":
                # A busy engine if there is one: the proxy never puts those to sleep itself
                # (an idle one it may sleep to make room first, and the fault is gone).
                sleepers = [(m, i) for m, i in running if m in SLEEPERS and i["socket"]]
                busy = [(m, i) for m, i in sleepers if i["leases"]]
                if busy or sleepers:
                    model, victim = rng.choice(busy or sleepers)
                    await foreign_sleep(http, url, tmp, victim, model, faults)
                    continue
                how = rng.choice(("SIGKILL", "SIGSTOP"))
            if not running:
                continue
            model, victim = rng.choice(running)
            try:
                os.killpg(victim["pid"], getattr(signal, how))
                faults.done[how] += 1
            except ProcessLookupError:
                pass


def engine_pids(tmp: Path) -> set[int]:
    """Guards and engines serving a socket under this soak's state dir."""
    out = set()
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if "fake_vllm" in cmd and "--uds" in cmd:
            where = cmd[cmd.index("--uds") + 1] if cmd.index("--uds") + 1 < len(cmd) else ""
            if where.startswith(str(tmp)):
                out.add(p.pid)
    return out


async def leases(url: str) -> float:
    async with aiohttp.ClientSession() as http:
        text = await metrics_text(http, url)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm_model_requests_active{"))  # fmt: skip


def probe_health(url: str) -> None:
    """(Run as its own process.) ``GET /health`` on one kept-alive connection every 20 ms until
    stdin closes; prints the round trips' count, 99th percentile and longest (seconds)."""
    host, port = url.removeprefix("http://").split(":")
    conn = HTTPConnection(host, int(port), timeout=30)
    took: list[float] = []
    while not select.select([sys.stdin], [], [], 0.02)[0]:
        began = time.perf_counter()
        try:
            conn.request("GET", "/health")
            conn.getresponse().read()
        except (OSError, HTTPException):
            conn.close()
            conn = HTTPConnection(host, int(port), timeout=30)
            continue
        took.append(time.perf_counter() - began)
    took.sort()
    p99 = took[int(len(took) * 0.99)] if took else 0.0
    print(json.dumps({"n": len(took), "p99_s": p99, "max_s": took[-1] if took else 0.0}))


def rss_mib(pid: int) -> tuple[float, float]:
    """Resident memory now and at its highest (VmRSS, VmHWM), MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def check_log(path: Path, tally: Tally) -> list[tuple[str, bool, str]]:
    """Every line is a record, or one of the (at most `TAIL_LINES`) lines of the engine log the
    record before it quotes, found in that log where it is still kept (the proxy keeps the
    last few instances' logs); one well-formed access line per request, under the request id
    its client was answered with."""
    stray: list[str] = []
    access: list[str] = []
    malformed: list[str] = []
    quoted, left, checked, unchecked = "", 0, 0, 0
    lines = path.read_bytes().decode("utf-8", "replace").splitlines()
    for line in lines:
        if RECORD.match(line):
            match = QUOTES.search(line)
            quoted, left = (engine_log(Path(match["path"])), TAIL_LINES) if match else ("", 0)
            if " INFO vllm_proxy.access: " in line:
                m = ACCESS.fullmatch(line)
                if m:
                    access.append(m["rid"])
                else:
                    malformed.append(line)
        elif left > 0 and (line in quoted or not quoted):
            left -= 1
            checked, unchecked = (checked + 1, unchecked) if quoted else (checked, unchecked + 1)
        else:
            stray.append(line)
    given = collections.Counter(tally.rids)
    logged = collections.Counter(access)
    wrong = [r for r in given if not r or given[r] != 1 or logged[r] != 1]
    return [
        ("every log line is a record (or a line of the engine log it quotes)", not stray,
         f"{len(lines)} lines, {checked + unchecked} quoted from engine logs ({unchecked} from "
         "logs since pruned)" + (f"; {len(stray)} stray, first {stray[0][:120]!r}"
                                 if stray else "")),
        ("one well-formed access line per request, under its answer's request id",
         not malformed and not wrong and len(access) == tally.sent,
         f"{len(access)} access lines for {tally.sent} requests; {len(malformed)} malformed"
         + (f" (first {malformed[0][:120]!r})" if malformed else "")
         + f"; {len(wrong)} answer ids not logged exactly once"
         + (f" (first {wrong[0]!r})" if wrong else "")),
    ]  # fmt: skip


def engine_log(path: Path) -> str:
    """An engine log and its rotated backups, as text."""
    out = ""
    for p in [path, *sorted(path.parent.glob(path.name + ".*"))]:
        try:
            out += p.read_bytes().decode("utf-8", "replace")
        except OSError:
            pass
    return out


async def main_async(args: argparse.Namespace) -> int:
    with session("vllm-proxy-soak-", keep=True) as (tmp, procs):  # the log stays to be read
        return await soak(args, tmp, procs)


async def soak(args: argparse.Namespace, tmp: Path, procs: Procs) -> int:
    (port,) = pick_ports(1)
    bodies = dense_bodies()
    proxy = start_proxy(procs, "proxy", config(tmp, port))  # once, before the load
    url = f"http://127.0.0.1:{port}"
    checks: list[tuple[str, bool, str]] = []
    tally = Tally()
    faults = Faults()
    scrapes = Scrapes()
    stall: dict[str, float] = {}
    memory: dict[str, float] = {}
    took = 0.0
    try:
        me = psutil.Process(proxy.proc.pid)
        fds_before = me.num_fds()
        memory["before"] = rss_mib(proxy.proc.pid)[0]
        probe = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--probe-health", url,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        until = time.monotonic() + args.seconds
        kinds = ["stuck", "slow"] + [None] * (args.clients - 2)
        started = time.monotonic()
        seed = args.seed * 1000
        await asyncio.gather(
            chaos(url, tmp, args.seed, until, args.chaos_every_s, faults),
            *(client(url, seed + i, until, tally, k) for i, k in enumerate(kinds)),
            dense_client(url, seed + 900, until, tally, bodies),
            not_json_client(url, seed + 901, until, tally),
            forged_client(url, seed + 902, until, tally),
            scraper(url, until, scrapes),
        )
        took = time.monotonic() - started
        assert probe.stdin is not None and probe.stdout is not None
        probe.stdin.close()
        stall = json.loads(await probe.stdout.read())
        await probe.wait()
        accounted = sum(tally.outcomes.values())
        checks.append(("every request accounted for", accounted == tally.sent,
                       f"{accounted} of {tally.sent}"))  # fmt: skip
        odd = {k: v for k, v in tally.outcomes.items()
               if "bad body" in k or "client error" in k or k == "stream cut short"}  # fmt: skip
        checks.append(("no malformed answer or unexplained hang-up", not odd, str(odd or "none")))
        fives = {k: v for k, v in tally.outcomes.items() if " 500 " in f" {k} "}
        checks.append(("no 500", not fives, str(fives or "none")))
        checks.append(("every odd request got the answer it calls for", not tally.unexpected,
                       str(dict(tally.unexpected) or "all")))  # fmt: skip
        ids_ok = not tally.ids["forged id passed on"] and not tally.ids["token id NOT kept"]
        checks.append(("forged request ids replaced, token ids kept", ids_ok,
                       str(dict(tally.ids))))  # fmt: skip
        found = max(faults.found_in, default=0.0)
        bound = HEALTH_INTERVAL_S + HEALTH_TIMEOUT_S
        missed = sum(v for k, v in faults.sleeps.items() if k.startswith("MISSED"))
        checks.append((f"every sleep not ordered noticed within {bound:g} s (interval + probe)",
                       not missed and found <= bound and not faults.sockets_outside,
                       f"{len(faults.found_in)} noticed, slowest {found:.2f} s; {missed} missed"
                       + (f"; sockets outside sockets/: {faults.sockets_outside}"
                          if faults.sockets_outside else "")))  # fmt: skip
        # The proxy reads every engine's page at once, each bounded by 3 s
        # (admin.ENGINE_METRICS_TIMEOUT_S: a hung engine), then renders in a thread.
        scrapes.bad += [f"slowest {scrapes.slowest:.2f} s"] if scrapes.slowest > 4 else []
        checks.append(("/metrics/engines: 200 within 4 s with the key, 401 without",
                       not scrapes.bad, f"{sum(scrapes.outcomes.values())} scrapes, slowest "
                       f"{scrapes.slowest:.2f} s" + (f"; {scrapes.bad[:3]}" if scrapes.bad
                                                     else "")))  # fmt: skip
        checks.append((f"the proxy's loop never stalled {args.max_stall_s:g} s (/health from "
                       "another process)", stall["max_s"] <= args.max_stall_s,
                       f"{stall['n']:.0f} probes, p99 {stall['p99_s'] * 1000:.0f} ms, longest "
                       f"{stall['max_s'] * 1000:.0f} ms"))  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and await leases(url) > 0:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        held = await leases(url)
        checks.append(("no lease held after the load", held == 0, f"{held:g}"))
        await asyncio.sleep(2)  # the stuck client's socket and hung engines settle
        fds_after = me.num_fds()
        checks.append(("descriptors back near their level", fds_after <= fds_before + 20,
                       f"{fds_before} before, {fds_after} after"))  # fmt: skip
        memory["after"], memory["peak"] = rss_mib(proxy.proc.pid)
        # Bodies held at once are capped at max_bodies_mb; what they leave free on the heap
        # is kept up to heap.TRIM_THRESHOLD (128 MiB) below their high mark before it is given
        # back, so the heap they can leave behind is at most max_bodies_mb. Beyond it: 32 MiB
        # for the rest (sessions, metric series, caches).
        limit = memory["before"] + MAX_BODIES_MB + 32
        checks.append((f"resident memory after the load within before + max_bodies_mb + 32 MiB "
                       f"({limit:.0f} MiB)", memory["after"] <= limit,
                       f"{memory['before']:.0f} MiB before, peak {memory['peak']:.0f}, "
                       f"{memory['after']:.0f} after"))  # fmt: skip
        async with aiohttp.ClientSession() as http, http.get(url + "/admin/models") as resp:
            view = await resp.json()
        live = {i["pid"] for m in view["models"] for i in m["instances"] if i["pid"]}
        groups = {os.getpgid(p) for p in engine_pids(tmp) if _alive(p)}
        checks.append(("every engine process belongs to a live instance", groups <= live,
                       f"engine groups {sorted(groups)}, instances {sorted(live)}"))  # fmt: skip
    finally:
        procs.drop(proxy.proc, grace=60)  # SIGTERM first: the proxy stops its engines itself
        code = proxy.proc.returncode
    await asyncio.sleep(1)
    left = [p for p in engine_pids(tmp) if _alive(p)]
    checks.append(("proxy exits 0 on SIGTERM", code == 0, str(code)))
    checks.append(("no engine process left after it", not left, str(left or "none")))
    checks += check_log(tmp / "proxy.log", tally)
    report(args, tally, faults, scrapes, took, checks, tmp)
    return 0 if all(ok for _, ok, _ in checks) else 1


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def report(args: argparse.Namespace, tally: Tally, faults: Faults, scrapes: Scrapes,
           took: float, checks: list[tuple[str, bool, str]], tmp: Path) -> None:  # fmt: skip
    print(f"\nsoak: {took:.0f} s, {args.clients} chat clients (1 stuck, 1 slow), a dense-body, "
          f"a non-JSON and a forged-fields client, a scraper; faults injected: "
          f"{dict(faults.done)}\n")  # fmt: skip
    print("| outcome | requests |\n|---|---:|")
    for outcome, n in sorted(tally.outcomes.items(), key=lambda kv: -kv[1]):
        print(f"| {outcome} | {n} |")
    print(f"| **sent** | **{tally.sent}** |\n")
    found = ", ".join(f"{s:.2f}" for s in sorted(faults.found_in)) or "-"
    print(f"sleeps sent to engines behind the proxy's back: {dict(faults.sleeps)}; noticed in "
          f"{found} s; raced: {faults.raced or '-'}")  # fmt: skip
    print(f"request ids: {dict(tally.ids)}")
    print(
        f"/metrics/engines: {dict(scrapes.outcomes)}, slowest {scrapes.slowest:.2f} s, "
        f"largest {scrapes.largest / 1024:.0f} KiB, {scrapes.series} series names\n"
    )
    print("| check | result | detail |\n|---|---|---|")
    for name, ok, detail in checks:
        print(f"| {name} | {'pass' if ok else '**FAIL**'} | {detail} |")
    cmd = " ".join(["benchmarks/soak.py", *sys.argv[1:]])
    print(f"\ncommand: `.venv/bin/python {cmd}`; proxy log: {tmp / 'proxy.log'}")


def main() -> int:
    if sys.argv[1:2] == ["--probe-health"]:
        probe_health(sys.argv[2])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--clients", type=int, default=24)
    p.add_argument("--chaos-every-s", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=1)
    # The bound the proxy's own test holds a dense body's scan to (test_trust_bodies.py).
    p.add_argument("--max-stall-s", type=float, default=0.25,
                   help="longest /health round trip allowed during the load")  # fmt: skip
    return asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
