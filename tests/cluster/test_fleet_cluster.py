"""The shipped recipe with `vllm-proxy-fleet` beside it (docs/cluster.md): three proxies of
10000 MiB, models of 3000 MiB (three fit per server), HAProxy routing by the fleet's map.

What is checked is read from the proxies (their logs and metrics) and from HAProxy's runtime API
(`show map`, `show stat`); every wait is on a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
from kit import wait_for
from kit.cluster import HAPROXY, SERVERS, SYSTEMD_ANALYZE, Cluster, Load, need
from kit.metrics import fetch

from vllm_proxy.fleet.haproxy import read_map

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
FLEET_UNIT = ROOT / "systemd" / "vllm-proxy-fleet.service"
MODEL_MB, BUDGET_MB = 3000, 10000
INTERVAL_S = 1.0


def models(n: int) -> dict[str, int]:
    return {f"m{i}": MODEL_MB for i in range(1, n + 1)}


async def fleet(tmp_path: Path, n: int) -> AsyncIterator[Cluster]:
    need(HAPROXY)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        c = Cluster(tmp_path, http, models(n), BUDGET_MB, traffic=tuple(models(n)))
        try:
            await c.start()
            c.start_fleet(INTERVAL_S)
            yield c
        finally:
            await c.close()


@pytest.fixture
async def nine(tmp_path: Path) -> AsyncIterator[Cluster]:
    async for c in fleet(tmp_path, 9):
        yield c


@pytest.fixture
async def six(tmp_path: Path) -> AsyncIterator[Cluster]:
    async for c in fleet(tmp_path, 6):
        yield c


def complete(n: int) -> Callable[[dict[str, str]], bool]:
    return lambda m: len(m) == n


async def memory_evictions(cluster: Cluster) -> float:
    total = 0.0
    for member in cluster.members.values():
        samples = await fetch(cluster.http, member.url + "/metrics")
        total += samples.value("vllm_proxy_evictions_total", reason="memory")
    return total


async def test_nine_models_on_three_servers_start_once_each(nine: Cluster) -> None:
    """The issue's scenario: with the hash, 62 starts and 56 engines stopped for memory; with
    the map, each model starts once on a server with room and nothing is evicted."""
    placed = await nine.mapped(complete(9), what="nine models in HAProxy's map")
    assert sorted(Counter(placed.values()).values()) == [3, 3, 3], placed
    for model in nine.traffic:  # each asked for once
        reply = await nine.chat(model)
        assert reply.status == 200, reply.body
    load = Load(nine, clients=6)
    await load.more(180)
    replies = await load.stop()
    assert [r for r in replies if r[2] != 200] == [], "every request answered"
    starts = sum(nine.starts(m) for m in nine.traffic)
    assert starts <= 10, f"{starts} engine starts for 9 models"
    assert await memory_evictions(nine) == 0, "no running engine stopped for memory"
    homes = {m: (await nine.where(m)) for m in nine.traffic}
    assert all(len(w) == 1 for w in homes.values()), homes
    assert {m: w[0] for m, w in homes.items()} == await nine.haproxy_map()


async def test_the_map_survives_the_loop_and_haproxy_restarting(six: Cluster) -> None:
    placed = await six.mapped(complete(6))
    for model in six.traffic:
        assert (await six.chat(model)).status == 200
    starts = {m: six.starts(m) for m in six.traffic}

    # The loop dies: HAProxy routes on the last map.
    six.stop_fleet(kill=True)
    assert await six.haproxy_map() == placed
    for model in six.traffic:
        assert (await six.chat(model)).status == 200
    assert {m: six.starts(m) for m in six.traffic} == starts, "no model moved"

    # Started again, it rebuilds the same map from the proxies.
    six.start_fleet(INTERVAL_S)
    await wait_for(lambda: six.fleet_log().count("first round:") == 2, timeout=30,
                   what="the restarted loop's first round")  # fmt: skip
    assert await six.haproxy_map() == placed
    assert read_map(six.map) == placed

    # HAProxy restarted (the loop stopped meanwhile): it reads the map from the file.
    six.stop_fleet()
    await six.stop_haproxy()
    await six.start_haproxy()
    assert await six.haproxy_map() == placed
    for model in six.traffic:
        assert (await six.chat(model)).status == 200
    assert {m: six.starts(m) for m in six.traffic} == starts

    # A server taken out for maintenance (`state drain`) leaves the map within two rounds.
    six.start_fleet(INTERVAL_S)
    drained = Counter(placed.values()).most_common(1)[0][0]
    assert (await six.command(f"set server vllm/{drained} state drain")).strip() == ""
    began = time.monotonic()
    await six.mapped(lambda m: len(m) == 6 and drained not in m.values(), timeout=30)
    took = time.monotonic() - began
    assert took < 2 * INTERVAL_S + 3, f"{took:.1f}s to leave the map"


async def test_a_server_killed_under_traffic_leaves_the_map(six: Cluster) -> None:
    placed = await six.mapped(complete(6))
    for model in six.traffic:
        assert (await six.chat(model)).status == 200
    victim = Counter(placed.values()).most_common(1)[0][0]
    moved = {m for m, s in placed.items() if s == victim}
    load = Load(six, clients=4)
    await load.more(20)
    proc = six.members[victim].proc
    assert proc is not None
    proc.kill()
    began = time.monotonic()
    await asyncio.to_thread(proc.wait)
    await six.mapped(lambda m: len(m) == 6 and victim not in m.values(), timeout=30)
    took = time.monotonic() - began
    await load.more(40)
    replies = await load.stop()
    assert took < 2 * INTERVAL_S + 3, f"{took:.1f}s for its models to leave the map"
    # (Until the loop's next round, HAProxy sends the victim's models by the hash: on a full
    # server that start may evict an idle model, which the loop then places anew.)
    # Only requests in flight on the victim at the kill fail (at most one per client).
    failed = [(rid, model) for rid, model, status in replies if status != 200]
    assert all(model in moved for _, model in failed), failed
    assert len(failed) <= 4, failed
    for model in moved:  # served, and where the map puts them once the loop has placed them
        assert (await six.chat(model)).status == 200

        async def agrees(model: str = model) -> bool:
            return (await six.haproxy_map()).get(model) in await six.where(model)

        await wait_for(agrees, timeout=4 * INTERVAL_S + 5, what=f"{model} where the map says")


def test_fleet_unit_verifies(tmp_path: Path) -> None:
    """`systemd-analyze verify` accepts systemd/vllm-proxy-fleet.service (ExecStart pointed at
    this checkout's interpreter)."""
    need(SYSTEMD_ANALYZE)
    text = FLEET_UNIT.read_text()
    assert "SupplementaryGroups=haproxy" in text and "Restart=always" in text
    for name in SERVERS:
        assert f"--server {name}=http://" in text
    unit = tmp_path / FLEET_UNIT.name
    here = f"{sys.executable} -m vllm_proxy.fleet"
    unit.write_text(text.replace("/opt/vllm-proxy/.venv/bin/vllm-proxy-fleet", here, 1))
    done = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert [line for line in output.splitlines() if "vllm-proxy-fleet" in line] == [], output
