"""The console's API without a browser: the recent-requests ring and body capture (bounded, off
by default), the timeline and its reasons, the live stream's events, log download, and the
page's security headers."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
from kit import RunningProxy, StartProxy, config_data, wait_for
from kit.simgpu import sim_config

from fake_vllm.simgpu import Ledger
from vllm_proxy.config import parse_config
from vllm_proxy.frontend.recent import MAX_CAPTURE_COUNT, Recent
from vllm_proxy.frontend.routes.console import CSP, _read_from
from vllm_proxy.pool.journal import Journal

KEY = "api-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def entry(model: str, status: int) -> dict[str, Any]:
    return {"id": f"{model}-{status}", "model": model, "status": status}


def test_the_ring_keeps_the_last_requests_newest_first_and_filters() -> None:
    ring = Recent(size=3)
    for i, (model, status) in enumerate([("a", 200), ("b", 404), ("a", 500), ("a", 200)]):
        ring.add({**entry(model, status), "n": i})
    assert [e["n"] for e in ring.query()] == [3, 2, 1]  # the first fell out
    assert [e["n"] for e in ring.query(model="a")] == [3, 2]
    assert [e["n"] for e in ring.query(status="5xx")] == [2]
    assert [e["n"] for e in ring.query(status="404")] == [1]
    assert [e["n"] for e in ring.query(after=ring.seq - 1)] == [3]
    assert [e["n"] for e in ring.query(limit=1)] == [3]


def test_bodies_are_kept_only_while_captured_and_bounded() -> None:
    ring = Recent()
    ring.add(entry("a", 200), b"secret prompt")
    assert "body" not in ring.query()[0] and not ring.wants_body("a")
    cap = ring.start_capture("a", seconds=60, count=10**6, max_bytes=4)
    assert cap.count == MAX_CAPTURE_COUNT
    assert ring.wants_body("a") and not ring.wants_body("b")
    ring.add(entry("a", 200), b"abcdefgh")
    ring.add(entry("b", 200), b"not this one")
    newest_a = ring.query(model="a")[0]
    assert (newest_a["body"], newest_a["body_truncated"]) == ("abcd", True)
    assert "body" not in ring.query(model="b")[0]
    cap.until = time.time() - 1  # its time is up
    assert not ring.wants_body("a")
    ring.add(entry("a", 200), b"late")
    assert "body" not in ring.query(model="a")[0]
    ring.stop_capture()
    assert ring.capture is None


async def test_the_journal_is_bounded_and_wakes_readers() -> None:
    journal = Journal(max_events=2, window_s=60)
    changed = journal.changed()
    journal.note("m", "m#1", "stopped", "starting")
    assert changed.is_set() and not journal.changed().is_set()
    journal.note("m", "m#1", "starting", "running")
    journal.note("m", "m#1", "running", "sleeping", "idle")
    assert [e["new"] for e in journal.events] == ["running", "sleeping"]
    assert [e["new"] for e in journal.since(2)] == ["sleeping"]
    journal.sample([{"id": 0, "used_mb": 1, "total_mb": 2, "models": {}}])
    journal.samples[0]["t"] -= 120  # older than the window: dropped at the next sample
    journal.sample([])
    assert len(journal.history()["samples"]) == 1


async def start(start_proxy: StartProxy, tmp_path: Path) -> RunningProxy:
    models = {"alpha": {"model": "fake/alpha", "memory_mb": 300, "sleep": {"level": 1}}}
    data = config_data(tmp_path, models=models, server={"admin_api_keys": [KEY]}, budget_mb=1000)
    return await start_proxy(parse_config(data))


async def read_events(resp: aiohttp.ClientResponse, wanted: str) -> Any:
    """The data of the next ``wanted`` event on an open stream."""
    event = ""
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: ") and event == wanted:
            return json.loads(line[6:])
    raise AssertionError(f"the stream ended before a {wanted!r} event")


async def test_live_stream_timeline_capture_and_download(
    start_proxy: StartProxy, tmp_path: Path
) -> None:
    proxy = await start(start_proxy, tmp_path)
    timeout = aiohttp.ClientTimeout(total=60)
    async with proxy.http.get(proxy.url + "/admin/events", headers=AUTH, timeout=timeout) as ev:
        assert ev.headers["Content-Type"].startswith("text/event-stream")
        first = await read_events(ev, "state")
        assert first["models"][0]["state"] == "stopped"
        assert first["models"][0]["sleep_levels"] == [1, 2]

        # Capture on: the request's body is kept, shown in the list only with bodies=1.
        async with proxy.http.post(
            proxy.url + "/admin/capture?model=alpha&seconds=60&count=1", headers=AUTH
        ) as r:
            assert r.status == 200 and (await r.json())["capture"]["active"]
        assert (await proxy.chat("alpha")).status == 200
        assert (await proxy.chat("alpha")).status == 200  # past the count: not kept
        changes: list[str] = []
        while "running" not in changes:  # each event: the changes since the last one
            changes += [e["new"] for e in await read_events(ev, "timeline")]
        assert changes == ["starting", "running"]
        seen = await read_events(ev, "requests")
        assert seen and seen[0]["model"] == "alpha" and "body" not in seen[0]
        async with proxy.http.get(proxy.url + "/admin/requests?bodies=1", headers=AUTH) as r:
            listed = (await r.json())["requests"]
        assert len(listed) == 2
        assert "body" not in listed[0] and '"model": "alpha"' in listed[1]["body"]
        assert listed[0]["ttft_s"] is not None and listed[0]["tokens_out"]
        async with proxy.http.delete(proxy.url + "/admin/capture", headers=AUTH) as r:
            assert (await r.json())["capture"] is None

    # An operator's sleep is on the timeline with its reason; memory is sampled.
    async with proxy.http.post(proxy.url + "/admin/models/alpha/sleep", headers=AUTH) as r:
        assert r.status == 200, await r.text()
    async with proxy.http.get(proxy.url + "/admin/history", headers=AUTH) as r:
        history = await r.json()
    assert {"old": "running", "new": "sleeping", "reason": "admin"}.items() <= next(
        e for e in history["events"] if e["new"] == "sleeping"
    ).items()
    assert history["samples"] and history["samples"][-1]["gpus"][0]["total_mb"] == 1000

    # The log: tail, and the whole file as a download.
    iid = quote(proxy.model("alpha").instances[0].id, safe="")
    async with proxy.http.get(proxy.url + f"/admin/instances/{iid}/log?tail=2", headers=AUTH) as r:
        assert r.status == 200 and len((await r.text()).splitlines()) == 2
    async with proxy.http.get(
        proxy.url + f"/admin/instances/{iid}/log?download=1", headers=AUTH
    ) as r:
        assert r.status == 200
        assert r.headers["Content-Disposition"] == 'attachment; filename="alpha-1.log"'
        assert "vLLM server version" in await r.text()
    async with proxy.http.get(proxy.url + "/admin/instances/nope%231/log", headers=AUTH) as r:
        assert r.status == 404


async def test_the_page_and_its_files_carry_a_content_security_policy(
    start_proxy: StartProxy, tmp_path: Path
) -> None:
    proxy = await start(start_proxy, tmp_path)
    for path, kind in [("/", "text/html"), ("/console.js", "application/javascript"),
                       ("/console.css", "text/css")]:  # fmt: skip
        async with proxy.http.get(proxy.url + path) as r:
            assert r.status == 200 and r.content_type == kind
            assert r.headers["Content-Security-Policy"] == CSP
            assert r.headers["X-Frame-Options"] == "DENY"
            assert r.headers["X-Content-Type-Options"] == "nosniff"
    assert "'unsafe-inline'" not in CSP and "script-src 'self'" in CSP
    async with proxy.http.get(proxy.url + "/console.exe") as r:
        assert r.status == 404


async def test_memory_timeline_on_a_measured_gpu(
    start_proxy: StartProxy, tmp_path: Path, ledger: Ledger
) -> None:
    """On NVML (the simulated GPU): each sample has the device's use and the model's share,
    awake, then asleep after a sleep (smaller), and none once stopped."""
    models = {"a": {"model": "x", "memory_mb": 4000, "sleep": {"level": 1}}}
    proxy = await start_proxy(sim_config(tmp_path, ledger, models))
    journal = proxy.manager.journal
    assert (await proxy.chat("a")).status == 200

    def share(kind: str) -> int:
        gpu = proxy.manager.memory_sample()[0]
        return int(gpu["models"].get("a", {}).get(kind, 0))

    awake = share("awake")
    assert awake > 0 and share("asleep") == 0
    async with proxy.http.post(proxy.url + "/admin/models/a/sleep") as r:
        assert r.status == 200, await r.text()
    assert share("awake") == 0 and 0 < share("asleep") < awake

    async def sampled() -> bool:  # the sampler took one since the sleep
        return any(s["gpus"][0]["models"].get("a", {}).get("asleep") for s in journal.samples)

    await wait_for(sampled, what="a sample with the model asleep")
    async with proxy.http.post(proxy.url + "/admin/models/a/stop") as r:
        assert r.status == 200 and (await r.json())["state"] == "stopped"
    assert proxy.manager.memory_sample()[0]["models"] == {}
    assert [e["new"] for e in journal.events] == [
        "starting", "running", "sleeping", "stopping", "stopped",
    ]  # fmt: skip


def test_a_followed_log_starts_over_when_the_file_is_rotated(tmp_path: Path) -> None:
    log = tmp_path / "m.1.log"
    log.write_bytes(b"old line\n" * 10)
    pos, chunk = _read_from(log, 0)
    assert (pos, len(chunk)) == (0, 90)
    log.write_bytes(b"new\n")  # rotated: a new, shorter file
    assert _read_from(log, 90) == (0, b"new\n")
    assert _read_from(tmp_path / "gone.log", 7) == (7, b"")
