#!/usr/bin/env python3
"""The stream relay's read callback alone: nanoseconds per event, this tree against a revision.

    .venv/bin/python benchmarks/relay_micro.py [--base REV] [--relays 200] [--rounds 6]

Each tree's `vllm_proxy.frontend.upstream` runs in a process of its own: `--relays` responses are
relayed at once (a real httptools parser each, chunked SSE head parsed), and one OpenAI chunk
event is fed to each engine connection's current protocol in turn, round after round, as
`data_received` would be called by the event loop; the client's transport is a stub whose
`write` does nothing. So the figure is the proxy's own Python and parsing per event, warm and
without any system call; `streams.py` measures the whole path. The trees take turns (the order
alternating per round) and the table gives medians; `--base` is unpacked into a temporary
folder (``git archive``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import ROOT, checkout, command_line, session

CHILD = r"""
import asyncio, json, sys, time
sys.path.insert(0, sys.argv[1])
import vllm_proxy.frontend.upstream as u

RELAYS, EVENTS = int(sys.argv[2]), int(sys.argv[3])


class Client:
    def __init__(self):
        self.write = lambda data: None

    def get_write_buffer_limits(self):
        return (16384, 65536)

    def get_write_buffer_size(self):
        return 0

    def is_closing(self):
        return False


class Engine:
    def __init__(self, conn):
        self.protocol = conn

    def set_protocol(self, protocol):
        self.protocol = protocol

    def get_protocol(self):
        return self.protocol

    def pause_reading(self): pass
    def resume_reading(self): pass
    def is_reading(self): return True
    def close(self): pass


class Pool:
    def __init__(self, loop):
        self.loop = loop


async def main():
    pool = Pool(asyncio.get_running_loop())
    relays = []
    for _ in range(RELAYS):
        conn = u._Conn(1)
        conn.transport = Engine(conn)
        resp = u.UpstreamResponse(conn, pool, asyncio.Semaphore(1))
        conn.start(resp)
        conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                           b"transfer-encoding: chunked\r\n\r\n")
        relays.append((conn, asyncio.ensure_future(resp.relay(Client(), True, None, 600))))
    await asyncio.sleep(0)  # every relay has started and waits
    event = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":'
             b'[{"index":0,"delta":{"content":"tok123 "}}]}\n\n')
    data = b"%x\r\n%b\r\n" % (len(event), event)
    feeds = [conn.transport.get_protocol().data_received for conn, _ in relays]
    for feed in feeds:  # warm up
        feed(data)
    t0 = time.perf_counter_ns()
    for _ in range(EVENTS):
        for feed in feeds:
            feed(data)
    ns = (time.perf_counter_ns() - t0) / (EVENTS * RELAYS)
    for _, task in relays:
        task.cancel()
    print(json.dumps({"ns": ns}))


asyncio.run(main())
"""


def measure(tree: Path, relays: int, events: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tree), str(relays), str(events)],
        capture_output=True, text=True, check=True, cwd=tree,
    )  # fmt: skip
    return float(json.loads(out.stdout.strip().splitlines()[-1])["ns"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--base", help="a git revision to compare with")
    p.add_argument("--relays", type=int, default=200, help="relays at once (default 200)")
    p.add_argument("--events", type=int, default=200, help="events per relay per round")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    with session("relay-micro-") as (tmp, _):
        trees = {"work tree": ROOT}
        if args.base:
            trees = {f"base {args.base}": checkout(args.base, tmp / "base"), **trees}
        got: dict[str, list[float]] = {name: [] for name in trees}
        for r in range(args.rounds):
            names = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in names:
                got[name].append(measure(trees[name], args.relays, args.events))
    first = statistics.median(next(iter(got.values())))
    print("| tree | ns per event (median) | min | max | ratio to the first |")
    print("|---|---:|---:|---:|---:|")
    for name, values in got.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.0f} | {min(values):.0f} | {max(values):.0f} | {med / first:.3f} |")
    print()
    print(f"{args.rounds} rounds, {args.relays} relays x {args.events} events each per round: "
          f"`{command_line('relay_micro.py')}`")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
