#!/usr/bin/env python3
"""The least a Python proxy on uvloop can do per stream event: a byte relay.

    floor_relay.py --port P --upstream U

Each client connection gets its own connection to 127.0.0.1:U; bytes go both ways as they are
read, one ``transport.write`` per read, with no HTTP parsing, no framing and no bookkeeping
(so a client must not reuse its connection for another request). `streams.py --targets
...,floor` runs it beside vllm-proxy and nginx: what vllm-proxy spends per event above it is
the cost of being an HTTP proxy in Python, not of Python and uvloop themselves.
"""

from __future__ import annotations

import argparse
import asyncio

import uvloop


class _Upstream(asyncio.Protocol):
    def __init__(self, client: asyncio.Transport) -> None:
        self.client = client

    def data_received(self, data: bytes) -> None:
        self.client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()


class _Client(asyncio.Protocol):
    def __init__(self, upstream: int) -> None:
        self.upstream_port = upstream
        self.upstream: asyncio.BaseTransport | None = None
        self.pending: list[bytes] = []
        self.connecting: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.connecting = asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            up, _ = await loop.create_connection(
                lambda: _Upstream(self.transport),  # type: ignore[arg-type]
                "127.0.0.1",
                self.upstream_port,
            )
        except OSError:
            self.transport.close()
            return
        self.upstream = up
        up.writelines(self.pending)  # type: ignore[attr-defined]
        self.pending.clear()

    def data_received(self, data: bytes) -> None:
        if self.upstream is None:
            self.pending.append(data)
        else:
            self.upstream.write(data)  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None:
            self.upstream.close()


async def serve(port: int, upstream: int) -> None:
    loop = asyncio.get_running_loop()
    await loop.create_server(lambda: _Client(upstream), "127.0.0.1", port, backlog=4096)
    await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", type=int, required=True)
    args = p.parse_args()
    uvloop.run(serve(args.port, args.upstream))


if __name__ == "__main__":
    main()
