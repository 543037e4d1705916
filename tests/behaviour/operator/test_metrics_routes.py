"""/metrics and /metrics/engines: keys when configured, bounded engine pages read off the loop."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kit import RunningProxy, StartProxy, make_config, wait_for
from prometheus_client.parser import text_string_to_metric_families

OPEN = {"admin_open": True}

#: An engine that serves the page in ``STUB_PAGE`` at ``/metrics`` (with its length, or closing
#: the connection after it when ``STUB_NO_LENGTH`` is set) and an empty 200 on any other path;
#: each /metrics request is a line in ``STUB_LOG``. Listens on ``--port`` or ``--uds``.
STUB_ENGINE = r"""
import asyncio, os, sys

PAGE = open(os.environ["STUB_PAGE"], "rb").read()
LENGTH = not os.environ.get("STUB_NO_LENGTH")


async def serve(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"GET /metrics "):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                continue
            with open(os.environ["STUB_LOG"], "a") as log:
                log.write("GET /metrics\n")
            length = b"Content-Length: %d\r\n" % len(PAGE) if LENGTH else b"Connection: close\r\n"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n" + length + b"\r\n")
            writer.write(PAGE)
            await writer.drain()
            if not LENGTH:
                break
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main():
    argv = sys.argv
    if "--uds" in argv:
        server = await asyncio.start_unix_server(serve, argv[argv.index("--uds") + 1])
    else:
        server = await asyncio.start_server(serve, "127.0.0.1", int(argv[argv.index("--port") + 1]))
    async with server:
        await server.serve_forever()


asyncio.run(main())
"""


def stub_model(tmp_path: Path, page: bytes, length: bool = True) -> dict[str, Any]:
    """A model whose engine serves `page` as its metrics page (`STUB_ENGINE`)."""
    (tmp_path / "stub_engine.py").write_text(STUB_ENGINE)
    (tmp_path / "page").write_bytes(page)
    env = {"STUB_PAGE": str(tmp_path / "page"), "STUB_LOG": str(tmp_path / "seen")}
    if not length:
        env["STUB_NO_LENGTH"] = "1"
    return {
        "model": "stub",
        "command": [sys.executable, str(tmp_path / "stub_engine.py")],
        "env": env,
    }


def metrics_reads(tmp_path: Path) -> int:
    seen = tmp_path / "seen"
    return seen.read_text().count("GET /metrics") if seen.exists() else 0


async def load(proxy: RunningProxy, *names: str) -> None:
    for name in names:
        async with proxy.http.post(f"{proxy.url}/admin/models/{name}/load") as r:
            assert r.status == 200, await r.text()


class Ticker:
    """A task on the proxy's loop that notes the longest gap between its 10 ms ticks, in CPU
    seconds of the loop's thread: what the loop spent without yielding, which a busy machine
    (another process on the core, a worker thread holding the GIL) does not stretch as it does
    wall time."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        last = time.thread_time()
        while True:
            await asyncio.sleep(0.01)
            now = time.thread_time()
            self.longest = max(self.longest, now - last)
            last = now

    async def stop(self) -> float:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        return self.longest


@pytest.mark.parametrize("length", [True, False], ids=["with-length", "no-length"])
async def test_a_huge_engine_metrics_page_is_left_out_without_stalling_the_proxy(
    tmp_path: Path, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture, length: bool
) -> None:
    """An engine that serves a 20 MiB metrics page (it froze the proxy for 7.3 s while it was
    parsed on the loop) is not read past the bound, whether it says its length or not; the
    other engines' series are served."""
    line = b'vllm:num_requests_running{engine="0",model_name="big",n="%d"} 1\n'
    huge = b"# TYPE vllm:num_requests_running gauge\n" + b"".join(
        line % i for i in range(20 * 2**20 // len(line % 0) + 1)
    )
    models = {"big": stub_model(tmp_path, huge, length), "ok": {"model": "x"}}
    proxy = await start_proxy(make_config(tmp_path, models, server=OPEN))
    await load(proxy, "big", "ok")
    ticker = Ticker()
    with caplog.at_level(logging.WARNING, logger="vllm_proxy.frontend.routes.admin"):
        resp = await proxy.http.get(proxy.url + "/metrics/engines")
        text = await resp.text()
    longest = await ticker.stop()
    assert resp.status == 200
    assert longest < 0.5, f"the proxy's loop ran {longest:.2f} CPU seconds without yielding"
    running = {f.name: f for f in text_string_to_metric_families(text)}["vllm:num_requests_running"]
    assert {s.labels["instance"] for s in running.samples} == {"ok#1"}
    warned = [r.getMessage() for r in caplog.records if "big#1" in r.getMessage()]
    assert len(warned) == 1 and "server.max_engine_metrics_mb" in warned[0], warned


async def test_an_engine_metrics_page_under_the_bound_is_parsed_off_the_loop(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    line = b'vllm:num_requests_running{engine="0",model_name="mid",n="%d"} 1\n'
    page = b"# TYPE vllm:num_requests_running gauge\n" + b"".join(
        line % i for i in range(3 * 2**20 // len(line % 0))
    )
    proxy = await start_proxy(
        make_config(tmp_path, {"mid": stub_model(tmp_path, page)}, server=OPEN)
    )
    await load(proxy, "mid")
    ticker = Ticker()
    resp = await proxy.http.get(proxy.url + "/metrics/engines")
    text = await resp.text()
    longest = await ticker.stop()
    assert resp.status == 200
    assert text.count('instance="mid#1"') == page.count(b"\n") - 1, "every sample re-exported"
    assert longest < 0.5, f"the proxy's loop ran {longest:.2f} CPU seconds without yielding"


async def test_a_burst_of_engine_metrics_scrapes_reads_each_engine_once(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    page = b'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 2\n'
    proxy = await start_proxy(make_config(tmp_path, {"m": stub_model(tmp_path, page)}, server=OPEN))
    await load(proxy, "m")

    async def scrape() -> str:
        async with proxy.http.get(proxy.url + "/metrics/engines") as r:
            assert r.status == 200
            return await r.text()

    pages = await asyncio.gather(*(scrape() for _ in range(20)))
    assert len(set(pages)) == 1 and 'instance="m#1"' in pages[0]
    assert metrics_reads(tmp_path) == 1, "one round of engine reads for the burst"

    async def read_again() -> bool:
        await scrape()
        return metrics_reads(tmp_path) == 2

    await wait_for(read_again, timeout=10, what="a later scrape reading the engine again")


async def test_metrics_routes_need_a_metrics_key_when_one_is_set(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    server = {"metrics_api_keys": ["mk"], "api_keys": ["user"], "admin_api_keys": ["adm"]}
    proxy = await start_proxy(make_config(tmp_path / "keyed", server=server))
    for path in ("/metrics", "/metrics/engines"):
        for auth in (None, "Bearer wrong", "Bearer user", "Bearer adm", "Basic mk"):
            headers = {"Authorization": auth} if auth else {}
            async with proxy.http.get(proxy.url + path, headers=headers) as r:
                assert r.status == 401, (path, auth)
                body = await r.json()
                assert body["error"]["code"] == "invalid_api_key"
                assert "server.metrics_api_keys" in body["error"]["message"]
                assert "X-Request-ID" in r.headers
        async with proxy.http.get(proxy.url + path, headers={"Authorization": "Bearer mk"}) as r:
            assert r.status == 200, path
    opened = await start_proxy(make_config(tmp_path / "open"))
    for path in ("/metrics", "/metrics/engines"):
        async with opened.http.get(opened.url + path) as r:
            assert r.status == 200, "open by default (Prometheus on a trusted network)"
