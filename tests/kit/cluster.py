"""The multi-server tier's kit. The cluster itself (HAProxy from apt on the shipped recipe in
front of three real `vllm-proxy` processes running the fake engine on static GPU budgets, and
optionally `vllm-proxy-fleet`) is the benchmarks' `benchmarks/cluster.py`, which
`benchmarks/fleet.py` measures; this adds the tier's defaults, `need` and the clients (`Load`,
`complete`).

Which server serves what is read from the proxies themselves (their admin API and logs) and
from HAProxy's runtime API (`show stat` on its stats socket), never guessed from timing.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import aiohttp
import pytest

from kit.fake import FakeEngine
from kit.wait import wait_for

# benchmarks/ holds library modules that import each other by plain name (benchmarks/README.md)
sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))

import cluster as shared
from cluster import HAPROXY, RECIPE, RECIPE_MAP, ROOT, SERVERS, Member, Reply

__all__ = ["HAPROXY", "RECIPE", "RECIPE_MAP", "SERVERS", "Member", "Reply"]

TEMPLATE_UNIT = ROOT / "systemd" / "vllm-proxy@.service"
SYSTEMD_ANALYZE = "/usr/bin/systemd-analyze"
#: Every proxy runs the same models (any server can serve any model): by default six small
#: ones (five fit in a budget) and one that takes a whole server.
MODELS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot")
SMALL_MB, BUDGET_MB = 200, 1000
#: A reply has min(max_tokens, 400) tokens, 20 ms apart: max_tokens sets a stream's length.
ENGINE_ENV = FakeEngine(tokens=400, token_delay=0.02).env()


def need(binary: str) -> None:
    if not os.access(binary, os.X_OK):
        pytest.fail(f"{binary} missing: run scripts/system-deps.sh (make test does)")


class Cluster(shared.Cluster):
    """`benchmarks/cluster.py`'s cluster with the tier's defaults: `MODELS` and `big` (a whole
    server) on `BUDGET_MB` each; `traffic` are the models the helpers place and `Load` sends.
    Closing it also stops the clients of a test that failed half-way."""

    def __init__(
        self,
        tmp_path: Path,
        http: aiohttp.ClientSession,
        models: Mapping[str, int] | None = None,
        budget_mb: int = BUDGET_MB,
        traffic: Sequence[str] = MODELS,
    ) -> None:
        models = models or {**dict.fromkeys(MODELS, SMALL_MB), "big": BUDGET_MB}
        super().__init__(tmp_path, http, models, budget_mb, traffic, ENGINE_ENV)
        self.loads: list[Load] = []

    async def close(self) -> None:
        for load in self.loads:  # a test that failed half-way left its clients running
            load.stopped.set()
            for task in load.tasks:
                task.cancel()
            await asyncio.gather(*load.tasks, return_exceptions=True)
        await super().close()


async def complete(stream: aiohttp.ClientResponse) -> bool:
    """True when the rest of the stream arrives and ends with ``data: [DONE]``."""
    try:
        rest = await stream.read()
    except aiohttp.ClientError:
        return False
    finally:
        stream.release()
    return rest.endswith(b"data: [DONE]\n\n")


class Load:
    """Clients that send requests through HAProxy one after another, round robin over the
    models, until stopped; every reply is kept as (request id, model, status)."""

    def __init__(self, cluster: Cluster, clients: int, *, streams: bool = False) -> None:
        self.cluster = cluster
        self.stopped = asyncio.Event()
        self.replies: list[tuple[str, str, int]] = []
        self.started: list[str] = []
        self.streams = streams
        self.tasks = [asyncio.ensure_future(self.client(i)) for i in range(clients)]
        cluster.loads.append(self)

    async def client(self, i: int) -> None:
        n = 0
        while not self.stopped.is_set():
            models = self.cluster.traffic
            model = models[(i + n) % len(models)]
            rid = f"load-{i}-{n}"
            n += 1
            self.started.append(rid)
            try:
                if self.streams and n % 2:
                    reply = await self.cluster.chat(model, rid=rid, max_tokens=5, stream=True)
                    ok = reply.status == 200 and reply.body.endswith(b"data: [DONE]\n\n")
                    status = reply.status if ok else 0
                else:
                    status = (await self.cluster.chat(model, rid=rid)).status
            except aiohttp.ClientError:
                status = 0
            self.replies.append((rid, model, status))

    def since(self, mark: int) -> set[str]:
        """The requests started after `mark` (a length of `started`)."""
        return set(self.started[mark:])

    async def more(self, count: int) -> None:
        """Wait until `count` more replies have come back."""
        target = len(self.replies) + count
        await wait_for(lambda: len(self.replies) >= target, what=f"{count} more replies")

    async def stop(self) -> list[tuple[str, str, int]]:
        self.stopped.set()
        await asyncio.gather(*self.tasks)
        return self.replies
