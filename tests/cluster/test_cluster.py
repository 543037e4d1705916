"""The multi-server tier: HAProxy from apt with the shipped recipe (deploy/haproxy/haproxy.cfg,
only addresses, paths and the connection limit adapted) in front of three real `vllm-proxy`
processes running the fake engine on 1000 MiB static GPU budgets (docs/cluster.md), routing by
the hash (the fleet's map is empty: tests/cluster/test_fleet_cluster.py runs the map).

Which server serves what is read from the proxies themselves (their admin API and logs) and
from HAProxy's runtime API (`show stat` on its stats socket), never guessed from timing.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from kit import wait_for
from kit.cluster import (
    HAPROXY,
    MODELS,
    RECIPE,
    RECIPE_MAP,
    SERVERS,
    SYSTEMD_ANALYZE,
    TEMPLATE_UNIT,
    Cluster,
    Load,
    complete,
    need,
)

from vllm_proxy.config import EngineConfig
from vllm_proxy.engine_args import auto_timeouts

# The cluster (HAProxy and three proxies) starts with the first test.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    need(HAPROXY)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        c = Cluster(tmp_path, http)
        try:
            await c.start()
            yield c
        finally:
            await c.close()


# --- the recipe itself ----------------------------------------------------------------------


def directives(section: str) -> list[str]:
    """The lines of one section of the recipe (``backend vllm``), comments dropped."""
    lines, inside = [], False
    for raw in RECIPE.read_text().splitlines():
        line = raw.rstrip()
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line.startswith(" "):
            inside = line.strip() == section
            continue
        if inside:
            lines.append(line.strip())
    return lines


def test_recipe_is_valid_and_routes_as_documented(tmp_path: Path) -> None:
    """`haproxy -c` accepts the shipped file as it is (with the fleet's map file where the
    recipe names it: HAProxy refuses to start without it), and it has what docs/cluster.md
    says."""
    need(HAPROXY)
    (tmp_path / "models.map").write_text("")
    checked = tmp_path / "haproxy.cfg"
    checked.write_text(RECIPE.read_text().replace(RECIPE_MAP, str(tmp_path / "models.map")))
    done = subprocess.run(
        [HAPROXY, "-c", "-f", str(checked)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stdout + done.stderr
    frontend, backend = directives("frontend openai"), directives("backend vllm")
    assert "option http-buffer-request" in frontend
    assert any("json_query('$.model')" in line for line in frontend)
    assert "balance hash var(txn.model)" in backend
    mapped = (
        f"%[var(txn.model),map({RECIPE_MAP})] if {{ var(txn.model),map({RECIPE_MAP}) -m found }}"
    )
    assert f"use-server {mapped}" in backend, "the fleet's map first, the hash as the fallback"
    assert any(
        x.startswith("stats socket ") and "level admin" in x and "group haproxy" in x
        for x in directives("global")
    ), "vllm-proxy-fleet reaches the runtime API through the haproxy group"
    assert any(line.startswith("hash-type consistent") for line in backend)
    factor = next(int(x.split()[1]) for x in backend if x.startswith("hash-balance-factor"))
    servers = [line for line in backend if line.startswith("server ")]
    assert 100 < factor < 100 * len(servers), "between 100 and 100 x servers it bounds the load"
    retry_on = next(x for x in backend if x.startswith("retry-on")).split()[1:]
    assert {"503", "conn-failure", "empty-response"} <= set(retry_on)
    assert "option redispatch 1" in backend, "every retry goes to another server"
    assert "option httpchk GET /health" in backend
    assert all(re.search(r" id \d+$", line) for line in servers), "stable ids: a stable ring"
    defaults = directives("defaults")
    assert not any(line.startswith("compression") for line in defaults + frontend + backend)
    assert "option http-no-delay" in defaults
    timeouts = {x.split()[1]: x.split()[2] for x in defaults if x.startswith("timeout ")}
    engine = EngineConfig()
    startup = auto_timeouts(16)["startup_timeout_s"]  # the default for a 16 GiB checkpoint
    assert timeouts["server"].endswith("m")
    assert int(timeouts["server"][:-1]) * 60 > startup + engine.read_timeout_s


def test_systemd_template_unit_verifies(tmp_path: Path) -> None:
    """`systemd-analyze verify` accepts an instance of `vllm-proxy@.service` (ExecStart pointed
    at this checkout's program), and each instance reads its own config."""
    need(SYSTEMD_ANALYZE)
    text = TEMPLATE_UNIT.read_text()
    assert "--config /etc/vllm-proxy/%i.yaml" in text
    assert "KillMode=mixed" in text and "Type=notify" in text
    program = str(Path(sys.executable).parent / "vllm-proxy")
    assert os.access(program, os.X_OK), program
    unit = tmp_path / TEMPLATE_UNIT.name
    unit.write_text(text.replace("/opt/vllm-proxy/.venv/bin/vllm-proxy", program, 1))
    instance = tmp_path / "vllm-proxy@gpu0.service"
    instance.symlink_to(unit)
    done = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", str(instance)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert [line for line in output.splitlines() if "vllm-proxy@" in line] == [], output


# --- routing ----------------------------------------------------------------------------------


async def test_one_model_from_many_clients_starts_one_engine_and_models_spread(
    cluster: Cluster,
) -> None:
    # Eight clients at once on a cold model (below the spill point of the shipped
    # hash-balance-factor: see test_a_hot_model_spills_onto_a_second_server), then 24 more.
    timeout = aiohttp.ClientTimeout(total=60)
    clients = [aiohttp.ClientSession(timeout=timeout) for _ in range(8)]
    try:
        for _ in range(4):
            replies = await asyncio.gather(*(cluster.chat("alpha", session=c) for c in clients))
            assert [r.status for r in replies] == [200] * len(clients)
    finally:
        for c in clients:
            await c.close()
    assert cluster.starts("alpha") == 1, "one engine start in the whole cluster"
    (home,) = await cluster.where("alpha")

    # The model named in a /serve/<model>/v1 path, or an X-Model header on a body too large for
    # HAProxy's buffer (its `model` out of reach at the end), routes to the same server.
    serve = await cluster.http.post(
        f"{cluster.url}/serve/alpha/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    )
    assert serve.status == 200, await serve.text()
    large = {"messages": [{"role": "user", "content": "x" * 600_000}], "max_tokens": 1}
    large["model"] = "alpha"
    for _ in range(3):
        async with cluster.http.post(
            cluster.url + "/v1/chat/completions", json=large, headers={"X-Model": "alpha"}
        ) as r:
            assert r.status == 200, await r.text()
    assert cluster.starts("alpha") == 1 and await cluster.where("alpha") == [home]

    homes = await cluster.place()
    assert all(cluster.starts(model) == 1 for model in MODELS)
    assert len(set(homes.values())) >= 2, f"the models spread over the servers: {homes}"
    for model in MODELS:  # and stay where they are
        assert (await cluster.chat(model)).status == 200
    assert await cluster.homes() == homes
    assert all(cluster.starts(model) == 1 for model in MODELS)


async def test_a_hot_model_spills_onto_a_second_server(cluster: Cluster) -> None:
    """hash-balance-factor: 40 streams of one model at once are more than its server may carry
    (at most 30 with 3 servers and 290); the rest go to the next server on the ring."""
    assert (await cluster.chat("bravo")).status == 200
    (home,) = await cluster.where("bravo")
    streams = await asyncio.gather(
        *(cluster.stream("bravo", f"hot-{i}", max_tokens=150) for i in range(40))
    )
    servers = await cluster.where("bravo")
    assert home in servers and len(servers) >= 2, servers
    assert all(await asyncio.gather(*(complete(s) for s in streams)))


async def test_a_full_server_answers_503_and_haproxy_serves_the_request_elsewhere(
    cluster: Cluster,
) -> None:
    assert (await cluster.chat("charlie")).status == 200
    (home,) = await cluster.where("charlie")
    full = cluster.members[home]
    async with cluster.http.post(f"{full.url}/admin/models/charlie/unload") as r:
        assert r.status == 200, await r.text()
    # `big` takes the whole budget there and streams (a lease: it cannot be evicted).
    hogs = [await cluster.stream("big", "hog-home", max_tokens=400, url=full.url)]

    reply = await cluster.chat("charlie", rid="full-1")
    assert reply.status == 200, reply.body
    (other,) = await cluster.where("charlie")
    assert other != home
    assert ("full-1", "charlie", 503) in full.served(), "the full server refused it"
    assert ("full-1", "charlie", 200) in cluster.members[other].served()
    assert int((await cluster.stat())[home]["wredis"]) >= 1, "HAProxy redispatched it"

    # Every server full: the client gets the proxy's 503, its Retry-After and the reason.
    for name, member in cluster.members.items():
        if name != home:
            hogs.append(await cluster.stream("big", f"hog-{name}", max_tokens=400, url=member.url))
    reply = await cluster.chat("delta", rid="full-2")
    assert reply.status == 503, reply.body
    assert int(reply.headers["Retry-After"]) >= 1
    assert json.loads(reply.body)["error"]["code"] == "insufficient_gpu_memory"
    for hog in hogs:
        hog.close()


# --- failures and maintenance ---------------------------------------------------------------


async def test_kill_9_of_a_server_moves_its_models_to_the_others(cluster: Cluster) -> None:
    homes = await cluster.place()
    victim = max(SERVERS, key=lambda s: sum(h == s for h in homes.values()))
    moved = {model for model, h in homes.items() if h == victim}
    streams = {
        model: await cluster.stream(model, f"long-{model}", max_tokens=150) for model in MODELS
    }
    load = Load(cluster, clients=4)
    await load.more(20)
    proc = cluster.members[victim].proc
    assert proc is not None
    proc.kill()
    proc.wait()

    await cluster.status_is(victim, "DOWN")
    assert (await cluster.stat())[victim]["chkdown"] == "1", "taken out once, and stays out"
    await load.more(40)
    replies = await load.stop()

    # Its models are served by the others. Requests that the victim had taken but not answered
    # are retried on the next server along the ring, later ones go to the model's new home
    # (the first refused connection took the server out): a model that had such requests may
    # have started on both (docs/cluster.md).
    for model in moved:
        assert (await cluster.chat(model)).status == 200
        where = await cluster.where(model)
        assert where and victim not in where, (model, where)
        assert cluster.starts(model) == 1 + len(where), model
    finished = {model: await complete(s) for model, s in streams.items()}
    assert all(finished[m] for m in MODELS if m not in moved), finished
    # At most the requests in flight on the victim fail: its streams (cut), and a load
    # client's request only if the victim had begun to answer it (one per client at most).
    failed = [(rid, model) for rid, model, status in replies if status != 200]
    assert all(model in moved for _, model in failed), failed
    assert len(failed) <= 4, failed


async def test_sigterm_drains_a_server_without_a_failed_request(cluster: Cluster) -> None:
    homes = await cluster.place()
    drained = max(SERVERS, key=lambda s: sum(h == s for h in homes.values()))
    member = cluster.members[drained]
    on_it = [model for model, h in homes.items() if h == drained]
    streams = {
        f"drain-{model}-{k}": await cluster.stream(model, f"drain-{model}-{k}", max_tokens=150)
        for model in MODELS
        for k in range(2)
    }
    load = Load(cluster, clients=4, streams=True)
    await load.more(20)
    assert member.proc is not None
    member.proc.send_signal(signal.SIGTERM)

    async def refusing() -> bool:  # the drain has begun: /health is 503
        try:
            async with cluster.http.get(member.url + "/health") as r:
                return r.status == 503
        except aiohttp.ClientError:  # gone already: it never said it was draining
            return False

    await wait_for(refusing, what=f"{drained} draining")
    mark = len(load.started)

    await cluster.status_is(drained, "DOWN")
    reached = (await cluster.stat())[drained]["stot"]
    await load.more(40)
    code = await asyncio.to_thread(member.proc.wait, 60)
    await load.more(20)
    replies = await load.stop()

    assert code == 0, member.log()[-3000:]
    assert all(await asyncio.gather(*(complete(s) for s in streams.values()))), "streams finish"
    assert [r for r in replies if r[2] != 200] == [], "zero failed requests"
    assert (await cluster.stat())[drained]["stot"] == reached, "nothing reached it once DOWN"
    # It served the streams it had; every request that reached it after the drain began (before
    # HAProxy took it out) was refused with 503 and served by another server.
    log = member.served()
    assert {rid for rid in streams if rid.split("-")[1] in on_it} <= {
        rid for rid, _, status in log if status == 200
    }
    late = [(rid, status) for rid, _, status in log if rid in load.since(mark)]
    assert all(status == 503 for _, status in late), late
    for model in on_it:  # now served by the others (docs/cluster.md: perhaps by two of them)
        assert (await cluster.chat(model)).status == 200
        where = await cluster.where(model)
        assert where and drained not in where, (model, where)


async def test_maintenance_takes_a_server_out_and_back_without_a_failed_request(
    cluster: Cluster,
) -> None:
    """The procedure of docs/cluster.md for maintenance and for a config change rolled out
    server by server: `set server vllm/<name> state drain` on HAProxy's runtime API, SIGTERM
    (in-flight streams finish), start the proxy again, `state ready`. No request fails, each of
    the server's models starts on exactly one other server meanwhile, and comes back after."""
    homes = await cluster.place()
    server = max(SERVERS, key=lambda s: sum(h == s for h in homes.values()))
    member = cluster.members[server]
    on_it = [model for model, h in homes.items() if h == server]
    streams = [await cluster.stream(model, f"maint-{model}", max_tokens=100) for model in on_it]
    load = Load(cluster, clients=4, streams=True)
    await load.more(10)

    assert (await cluster.command(f"set server vllm/{server} state drain")).strip() == ""
    await load.more(30)
    assert member.proc is not None
    member.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(member.proc.wait, 60) == 0
    assert all(await asyncio.gather(*(complete(s) for s in streams))), "its streams finish"
    for model in on_it:
        where = await cluster.where(model)
        assert len(where) == 1 and cluster.starts(model) == 2, (model, where)

    cluster.start_proxy(member)  # with the new config, in a rollout
    await cluster.listening(member)
    await cluster.status_is(server, "DRAIN")  # its checks pass; still out of rotation
    assert (await cluster.command(f"set server vllm/{server} state ready")).strip() == ""
    await cluster.status_is(server, "UP")
    await load.more(30)
    replies = await load.stop()
    assert [r for r in replies if r[2] != 200] == [], "zero failed requests"
    for model in on_it:  # back home
        assert (await cluster.chat(model)).status == 200
        assert server in await cluster.where(model)


# --- streams ----------------------------------------------------------------------------------


def events(data: bytes) -> list[bytes]:
    """SSE events with the per-request `id` and `created` blanked."""
    data = re.sub(rb'"id":"[^"]*"', b'"id":""', data)
    data = re.sub(rb'"created":\d+', b'"created":0', data)
    return [e for e in data.split(b"\n\n") if e]


async def test_streams_through_haproxy_are_chunk_exact(cluster: Cluster) -> None:
    assert (await cluster.chat("echo")).status == 200
    (home,) = await cluster.where("echo")
    member = cluster.members[home]
    async with cluster.http.get(f"{member.url}/admin/models/echo") as r:
        engine_socket = (await r.json())["instances"][0]["socket"]
    body = {"model": "echo", "stream": True, "max_tokens": 40,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    seen = {}
    connector = aiohttp.UnixConnector(path=engine_socket)
    async with aiohttp.ClientSession(connector=connector) as engine:  # the engine's own socket
        for name, http, url in (
            ("engine", engine, "http://localhost"),
            ("proxy", cluster.http, member.url),
            ("haproxy", cluster.http, cluster.url),
        ):
            async with http.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                seen[name] = events(await r.read())
    assert len(seen["engine"]) == 40 + 3, "a role chunk, 40 tokens, usage, [DONE]"
    assert seen["haproxy"] == seen["proxy"] == seen["engine"]

    # Nothing is held back on the way: the first event reaches the client while the engine is
    # still generating (a 400-token stream, 8 s).
    async with cluster.http.post(
        cluster.url + "/v1/chat/completions", json={**body, "max_tokens": 400}
    ) as r:
        first = await r.content.readany()
        assert 1 <= len(events(first)) < 400 and not r.content.at_eof()
