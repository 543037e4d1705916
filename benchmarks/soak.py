#!/usr/bin/env python3
"""A bounded soak under faults: is every request accounted for, and does nothing leak?

    .venv/bin/python benchmarks/soak.py [--seconds 60] [--clients 24] [--seed 1]

Runs vllm-proxy (a real process) with four models of the fake engine on a static budget that
holds two at a time, and for `--seconds`:

* clients send chat requests (a third streamed) to random models, back to back;
* some clients are slow: they read a stream a few bytes at a time, or stop reading at all
  (the proxy drops them after ``send_timeout_s``);
* every few seconds a random running engine is killed (SIGKILL to its group) or hung (SIGSTOP;
  the health watcher must kill it).

Every request must end in exactly one of: a complete answer (200, a whole stream ending in
``[DONE]``), an OpenAI-shaped error with a 4xx/5xx status, or a stream that ends with an SSE
``error`` event; for slow clients the proxy hanging up is the expected end. Afterwards the proxy
must hold no lease, the open descriptors must be back near their level before the load, every
engine process must belong to a live instance, and after SIGTERM no engine process may remain.
Prints a table and the command; exits 1 if any check fails. Everything binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("a", "b", "c", "d")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(tmp: Path, port: int) -> dict[str, Any]:
    env = {"FAKE_ENGINE_TOKENS": "40", "FAKE_ENGINE_TOKEN_DELAY": "0.02"}
    return {
        "server": {
            "host": "127.0.0.1",
            "port": port,
            "state_dir": str(tmp / "state"),
            "admin_open": True,
            "send_timeout_s": 2,
            "drain_timeout_s": 5,
            "access_log": False,
        },
        "engine": {
            "command": [sys.executable, "-m", "fake_vllm"],
            "idle_timeout_s": 20,
            "stop_timeout_s": 2,
            "startup_timeout_s": 30,
            "health_interval_s": 0.5,
            "health_timeout_s": 0.5,
            "health_misses": 2,
            "backoff_max_s": 2,
            "port_range": [40000, 44999],
            "env": env,
        },
        "gpu": {"monitor": "static", "devices": [{"id": 0, "memory_mb": 1000}]},
        "admission": {"queue_timeout_s": 20},
        "models": {m: {"model": f"fake/{m}", "memory_mb": 450} for m in MODELS},
    }


class Tally:
    def __init__(self) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.sent = 0
        self.unaccounted: list[str] = []

    def add(self, outcome: str) -> None:
        self.outcomes[outcome] += 1


async def one_request(http: aiohttp.ClientSession, url: str, rng: random.Random, tally: Tally,
                      slow: str | None) -> None:  # fmt: skip
    model = rng.choice(MODELS)
    stream = slow is not None or rng.random() < 1 / 3
    body = {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    tally.sent += 1
    try:
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                err = (await resp.json()).get("error", {})
                ok = isinstance(err.get("message"), str) and "code" in err
                tally.add(f"{resp.status} {err.get('code')}" if ok else f"{resp.status} bad body")
                return
            if not stream:
                data = await resp.json()
                tally.add("200" if data.get("object") == "chat.completion" else "200 bad body")
                return
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


async def client(url: str, seed: int, until: float, tally: Tally, slow: str | None) -> None:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while time.monotonic() < until:
            await one_request(http, url, rng, tally, slow)


async def chaos(url: str, seed: int, until: float, every_s: float) -> collections.Counter[str]:
    rng = random.Random(seed)
    done: collections.Counter[str] = collections.Counter()
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < until:
            await asyncio.sleep(every_s)
            async with http.get(url + "/admin/models") as resp:
                view = await resp.json()
            running = [i for m in view["models"] for i in m["instances"]
                       if i["state"] == "running" and i["pid"]]  # fmt: skip
            if not running:
                continue
            victim = rng.choice(running)
            how = rng.choice(("SIGKILL", "SIGSTOP"))
            try:
                os.killpg(victim["pid"], getattr(signal, how))
                done[how] += 1
            except ProcessLookupError:
                pass
    return done


def engine_pids() -> set[int]:
    out = set()
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if "fake_vllm" in cmd and "--port" in cmd:
            port = int(cmd[cmd.index("--port") + 1])
            if 40000 <= port <= 44999:
                out.add(p.pid)
    return out


async def leases(url: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm_model_requests_active{"))  # fmt: skip


async def main_async(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="vllm-proxy-soak-"))
    port = free_port()
    path = tmp / "config.yaml"
    path.write_text(json.dumps(config(tmp, port)))
    log = open(tmp / "proxy.log", "wb")  # noqa: ASYNC230
    proxy = subprocess.Popen(  # noqa: ASYNC220 - started once, before the load
        [sys.executable, "-m", "vllm_proxy", "--config", str(path), "--log-level", "warning"],
        stderr=log, cwd=ROOT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    checks: list[tuple[str, bool, str]] = []
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(300):
                try:
                    async with http.get(url + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.1)
        me = psutil.Process(proxy.pid)
        fds_before = me.num_fds()
        until = time.monotonic() + args.seconds
        tally = Tally()
        kinds = ["stuck", "slow"] + [None] * (args.clients - 2)
        started = time.monotonic()
        results = await asyncio.gather(
            chaos(url, args.seed, until, args.chaos_every_s),
            *(client(url, args.seed * 1000 + i, until, tally, k) for i, k in enumerate(kinds)),
        )
        took = time.monotonic() - started
        faults = results[0]
        accounted = sum(tally.outcomes.values())
        checks.append(("every request accounted for", accounted == tally.sent,
                       f"{accounted} of {tally.sent}"))  # fmt: skip
        odd = {k: v for k, v in tally.outcomes.items()
               if "bad body" in k or "client error" in k or k == "stream cut short"}  # fmt: skip
        checks.append(("no malformed answer or unexplained hang-up", not odd, str(odd or "none")))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and await leases(url) > 0:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        held = await leases(url)
        checks.append(("no lease held after the load", held == 0, f"{held:g}"))
        await asyncio.sleep(2)  # the stuck client's socket and hung engines settle
        fds_after = me.num_fds()
        checks.append(("descriptors back near their level", fds_after <= fds_before + 20,
                       f"{fds_before} before, {fds_after} after"))  # fmt: skip
        async with aiohttp.ClientSession() as http, http.get(url + "/admin/models") as resp:
            view = await resp.json()
        live = {i["pid"] for m in view["models"] for i in m["instances"] if i["pid"]}
        groups = {os.getpgid(p) for p in engine_pids() if _alive(p)}
        checks.append(("every engine process belongs to a live instance", groups <= live,
                       f"engine groups {sorted(groups)}, instances {sorted(live)}"))  # fmt: skip
    finally:
        proxy.send_signal(signal.SIGTERM)
        code = proxy.wait(timeout=60)
        log.close()
    await asyncio.sleep(1)
    left = [p for p in engine_pids() if _alive(p)]
    checks.append(("proxy exits 0 on SIGTERM", code == 0, str(code)))
    checks.append(("no engine process left after it", not left, str(left or "none")))
    report(args, tally, faults, took, checks, tmp)
    return 0 if all(ok for _, ok, _ in checks) else 1


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def report(args: argparse.Namespace, tally: Tally, faults: collections.Counter[str],
           took: float, checks: list[tuple[str, bool, str]], tmp: Path) -> None:  # fmt: skip
    print(f"\nsoak: {took:.0f} s, {args.clients} clients (1 stuck, 1 slow), "
          f"faults injected: {dict(faults)}\n")  # fmt: skip
    print("| outcome | requests |\n|---|---:|")
    for outcome, n in sorted(tally.outcomes.items(), key=lambda kv: -kv[1]):
        print(f"| {outcome} | {n} |")
    print(f"| **sent** | **{tally.sent}** |\n")
    print("| check | result | detail |\n|---|---|---|")
    for name, ok, detail in checks:
        print(f"| {name} | {'pass' if ok else '**FAIL**'} | {detail} |")
    cmd = " ".join(["benchmarks/soak.py", *sys.argv[1:]])
    print(f"\ncommand: `.venv/bin/python {cmd}`; proxy log: {tmp / 'proxy.log'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--clients", type=int, default=24)
    p.add_argument("--chaos-every-s", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=1)
    return asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
