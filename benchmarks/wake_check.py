#!/usr/bin/env python3
"""What the wake check (``sleep.verify_wake``) adds to a wake: the same wakes with and without
it, side by side in one run.

    .venv/bin/python benchmarks/wake_check.py [--rounds 15] [--wake-delay 0] [--tokens 8]

One vllm-proxy (a real process, ``vllm-proxy --config``) serves four models of the fake engine
on a static GPU budget that holds all of them: level-1 and level-2 sleepers, each with the check
(``checked``) and without it (``unchecked``). Each round (the order rotates) puts every model to
sleep through the admin API and sends it one chat request, which wakes it. Per wake it reads the
proxy's own ``vllm_proxy_engine_transition_seconds`` (``wake_l1``/``wake_l2``: wake calls to
serving, the check included) and ``vllm_proxy_wake_verify_seconds`` (the check alone), and the
client's time for the whole request. Prints the medians and the command.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp
import harness
import loadgen

MODELS = {"l1-checked": (1, True), "l1-unchecked": (1, False),
          "l2-checked": (2, True), "l2-unchecked": (2, False)}  # fmt: skip


def config(args: argparse.Namespace, tmp: Path, port: int) -> dict[str, Any]:
    env = {"FAKE_ENGINE_WAKE_DELAY": f"{args.wake_delay:g}", "FAKE_ENGINE_TOKENS": str(args.tokens)}
    models = {
        name: {
            "model": f"fake/{name}",
            "memory_mb": 1000,
            "env": env,
            "sleep": {
                "level": level,
                "after_idle_s": 3600,
                "memory_mb": 100,
                "verify_wake": checked,
            },
        }
        for name, (level, checked) in MODELS.items()
    }
    return harness.proxy_config(
        port,
        tmp / "proxy-state",
        models,
        server={"admin_open": True, "access_log": False, "drain_timeout_s": 2},
        engine={"command": harness.FAKE_ENGINE, "idle_timeout_s": 0, "stop_timeout_s": 3},
        gpu=harness.static_gpu(8000),
    )


async def sums(http: aiohttp.ClientSession, url: str, model: str) -> tuple[float, float]:
    """The proxy's wake seconds (both levels) and check seconds for `model` so far."""
    text = await (await http.get(url + "/metrics")).text()

    def total(series: str, extra: str = "") -> float:
        pattern = series + r"\{" + extra + r'model_id="' + re.escape(model) + r'"\} (\S+)'
        return sum(float(v) for v in re.findall(pattern, text))

    wake = total("vllm_proxy_engine_transition_seconds_sum", r'kind="wake_l\d",')
    return wake, total("vllm_proxy_wake_verify_seconds_sum")


async def one_wake(http: aiohttp.ClientSession, url: str, model: str) -> dict[str, float]:
    async with http.post(f"{url}/admin/models/{model}/sleep") as resp:
        if resp.status != 200:
            raise RuntimeError(f"{model}: sleep: HTTP {resp.status}: {await resp.text()}")
    wake0, check0 = await sums(http, url, model)
    body = {"model": model, "messages": loadgen.PROMPT, "max_tokens": 4}
    t0 = time.perf_counter()
    async with http.post(url + loadgen.CHAT, json=body) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{model}: HTTP {resp.status}")
    request = time.perf_counter() - t0
    wake1, check1 = await sums(http, url, model)
    return {"wake": wake1 - wake0, "check": check1 - check0, "request": request}


async def run(args: argparse.Namespace, url: str) -> dict[str, list[dict[str, float]]]:
    out: dict[str, list[dict[str, float]]] = {name: [] for name in MODELS}
    names = list(MODELS)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        for name in names:  # first starts (the check's answer is recorded there): not timed
            async with http.post(
                url + loadgen.CHAT, json={"model": name, "messages": loadgen.PROMPT}
            ) as resp:
                await resp.read()
        for rnd in range(args.rounds):
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            for name in order:
                out[name].append(await one_wake(http, url, name))
    return out


def table(
    args: argparse.Namespace, rows: dict[str, list[dict[str, float]]], starts: dict[str, int]
) -> list[str]:
    def med(name: str, key: str) -> float:
        return loadgen.med([r[key] * 1000 for r in rows[name]])

    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out = [
        "| level | wakes | wake unchecked p50 ms | wake checked p50 ms | **added p50 ms** |"
        " check alone p50 ms | request unchecked / checked p50 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for level in (1, 2):
        on, off = f"l{level}-checked", f"l{level}-unchecked"
        out.append(
            f"| {level} | {len(rows[on])} | {med(off, 'wake'):.1f} | {med(on, 'wake'):.1f}"
            f" | **{med(on, 'wake') - med(off, 'wake'):.1f}** | {med(on, 'check'):.1f}"
            f" | {med(off, 'request'):.1f} / {med(on, 'request'):.1f} |"
        )
    out += [
        "",
        f"Engine starts over the run: {starts} (1 each: every wake was a wake and passed).",
        f"`{harness.command_line('wake_check.py')}` ({when}, git {harness.git_head()},"
        f" {harness.machine()}; fake engine: wake delay"
        f" {args.wake_delay:g} s, {args.tokens} tokens per reply)",
    ]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--wake-delay", type=float, default=0.0, help="FAKE_ENGINE_WAKE_DELAY")
    p.add_argument("--tokens", type=int, default=8, help="FAKE_ENGINE_TOKENS")
    p.add_argument("--keep-tmp", action="store_true", help="keep the configs and every log")
    args = p.parse_args()
    with harness.session("vllm-proxy-wake-check-", args.keep_tmp) as (tmp, procs):
        (port,) = harness.pick_ports(1)
        proxy = harness.start_proxy(procs, "vllm-proxy", config(args, tmp, port))
        try:
            rows = harness.arun(run(args, proxy.url))
        except Exception:
            print(harness.tail(proxy.log_path, 30), file=sys.stderr)
            raise
        starts = {name: proxy.starts(name) for name in MODELS}
    print("\n".join(table(args, rows, starts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
