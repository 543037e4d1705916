"""`vllm-proxy-fleet --haproxy-socket PATH --map FILE --server NAME=URL [...]`: runs beside
HAProxy until SIGTERM or SIGINT (exit 0); bad arguments exit 2 (docs/cluster.md)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys
from pathlib import Path

import aiohttp

from .loop import Fleet, Options

#: A server name as HAProxy's `server` line takes it.
SERVER_NAME = re.compile(r"[A-Za-z0-9_.:-]+")
KEY_ENV = "VLLM_PROXY_FLEET_API_KEY"


def parse_args(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(
        prog="vllm-proxy-fleet",
        description="Place every model of a fleet of vllm-proxy servers on one server, in "
        "HAProxy's map (runtime API and map file).",
    )
    p.add_argument("--haproxy-socket", required=True, help="HAProxy's stats socket (level admin)")
    p.add_argument("--map", required=True, type=Path,
                   help="the map file, as the HAProxy config names it")  # fmt: skip
    p.add_argument("--server", action="append", required=True, metavar="NAME=URL",
                   help="a server's name in HAProxy's backend and its proxy's URL")  # fmt: skip
    p.add_argument("--interval-s", type=float, default=1.0, help="seconds between rounds")
    p.add_argument("--api-key", default=os.environ.get(KEY_ENV),
                   help=f"a metrics key of the proxies (or ${KEY_ENV})")  # fmt: skip
    p.add_argument("--backend", default="vllm", help="the HAProxy backend of the servers")
    p.add_argument("--max-view-mb", type=float, default=16.0,
                   help="the largest /placement answer read (MiB); a larger one leaves its "
                   "server out for the round")  # fmt: skip
    p.add_argument("--missed-rounds", type=int, default=3,
                   help="a proxy that misses this many rounds in a row leaves the placement "
                   "(fewer: it keeps its models)")  # fmt: skip
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    servers: dict[str, str] = {}
    for item in args.server:
        name, sep, url = item.partition("=")
        if (
            not sep
            or not SERVER_NAME.fullmatch(name)
            or not url.startswith(("http://", "https://"))
        ):
            p.error(f"--server {item!r}: expected NAME=http://HOST:PORT")
        if name in servers:
            p.error(f"--server {name}: given twice")
        servers[name] = url
    if not args.interval_s > 0:
        p.error("--interval-s must be above 0")
    if not args.max_view_mb > 0:
        p.error("--max-view-mb must be above 0")
    if args.missed_rounds < 1:
        p.error("--missed-rounds must be at least 1")
    if not args.map.is_absolute():
        p.error("--map must be an absolute path (HAProxy names the map by it)")
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return Options(
        socket=args.haproxy_socket,
        map_path=args.map,
        servers=servers,
        interval_s=args.interval_s,
        api_key=args.api_key or None,
        backend=args.backend,
        max_view_mb=args.max_view_mb,
        missed_rounds=args.missed_rounds,
    )


async def run(opts: Options) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with aiohttp.ClientSession() as session:
        await Fleet(opts, session).run(stop)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    asyncio.run(run(opts))
    return 0
