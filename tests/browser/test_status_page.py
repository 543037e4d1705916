"""The status page at `/`, rendered by headless Chromium against a live in-process proxy."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import pytest
from kit import FakeEngine, RunningProxy, StartProxy, make_config, wait_for
from kit.browser import run_chromium

from vllm_proxy import __version__
from vllm_proxy.config import Config, parse_config

#: Where to keep a copy of the screenshot (for the docs); unset: only the tmp dir.
SCREENSHOT_COPY_ENV = "VLLM_PROXY_STATUS_SCREENSHOT"


#: A stream on this engine holds its lease for minutes (until the client goes away).
SLOW = FakeEngine(tokens=10000, token_delay=0.05).env()
GPU_MB = 1200


def status_models(alpha_env: dict[str, str], gamma: bool = True) -> dict[str, dict[str, Any]]:
    models: dict[str, dict[str, Any]] = {
        "alpha": {"model": "fake/alpha", "aliases": ["a"], "memory_mb": 300, "env": alpha_env},
        "beta": {"model": "fake/beta", "memory_mb": 250},
    }
    if gamma:
        models["gamma"] = {"model": "fake/gamma", "memory_mb": 200, "env": SLOW}
    return models


def status_config(tmp_path: Path, models: dict[str, dict[str, Any]]) -> Config:
    """Fake-engine models on a static GPU budget, admin API open, long drains."""
    base = make_config(tmp_path, models=models, server={"admin_open": True, "drain_timeout_s": 120})
    data = base.model_dump(mode="json")
    data["gpu"] = {"monitor": "static", "devices": [{"id": 0, "memory_mb": GPU_MB}]}
    return parse_config(data)


def write_config(tmp_path: Path, models: dict[str, dict[str, Any]]) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(status_config(tmp_path, models).model_dump(mode="json")))
    return path


class StatusProxy(NamedTuple):
    proxy: RunningProxy
    path: Path
    #: Streams the test holds open; closed at teardown, so the draining instances stop.
    held: list[aiohttp.ClientResponse]


@pytest.fixture
async def status_proxy(tmp_path: Path, start_proxy: StartProxy) -> AsyncIterator[StatusProxy]:
    """A proxy started from a config file (so it can reload), with a client session of its own
    (no time limit: the streams it holds run for minutes)."""
    path = write_config(tmp_path, status_models(SLOW))
    server = (await start_proxy.file(path)).server
    held: list[aiohttp.ClientResponse] = []
    async with aiohttp.ClientSession() as session:
        try:
            yield StatusProxy(RunningProxy(server, session), path, held)
        finally:
            for resp in held:
                resp.close()


def png_summary(path: Path) -> tuple[int, int, int]:
    """(width, height, distinct scanlines) of an 8-bit non-interlaced PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and colour in (2, 6), f"unexpected PNG format {depth=} {colour=}"
    stride = 1 + width * (4 if colour == 6 else 3)
    raw = zlib.decompress(idat)
    rows = {raw[i : i + stride] for i in range(0, len(raw), stride)}
    return width, height, len(rows)


def row_html(dom: str, attr: str, value: str) -> str:
    """The rendered table row with ``data-<attr>="<value>"``."""
    pattern = rf'<tr[^>]*data-{attr}="{re.escape(value)}"[^>]*>.*?</tr>'
    match = re.search(pattern, dom, re.S)
    assert match, f"no row with data-{attr}={value!r} in the rendered page"
    return match.group(0)


async def admin_models(proxy: RunningProxy) -> dict[str, Any]:
    async with proxy.http.get(proxy.url + "/admin/models") as resp:
        assert resp.status == 200, await resp.text()
        body: dict[str, Any] = await resp.json()
        return body


async def hold_stream(scene: StatusProxy, model: str) -> None:
    """A streamed request that keeps its lease until the client closes it."""
    resp = await scene.proxy.chat(model, stream=True)
    scene.held.append(resp)
    assert resp.status == 200, await resp.text()
    assert await resp.content.readany()


class Scene(NamedTuple):
    snapshot: dict[str, Any]
    #: alpha's instance that the reload replaced, draining its request
    old: str
    #: alpha's instance the reload started, serving new requests
    new: str
    #: the removed model's instance, draining its request
    gamma: str


async def reload_scene(scene: StatusProxy) -> Scene:
    """alpha's engine changes while a request holds its instance, and gamma is removed while one
    holds gamma's: both drain (retired) beside alpha's new instance; beta never started.

    Instance ids are read, not assumed: a start that lost its port takes an id too."""
    proxy, path = scene.proxy, scene.path
    await hold_stream(scene, "a")
    await hold_stream(scene, "gamma")
    before = {m["name"]: m for m in (await admin_models(proxy))["models"]}
    (old,) = [i["id"] for i in before["alpha"]["instances"]]
    (gamma,) = [i["id"] for i in before["gamma"]["instances"]]
    write_config(path.parent, status_models({**SLOW, "X": "2"}, gamma=False))
    async with proxy.http.post(proxy.url + "/admin/reload") as resp:
        report = await resp.json()
    assert resp.status == 200, report
    assert (report["restarted"], report["removed"]) == (["alpha"], ["gamma"]), report

    async def settled() -> bool:
        body = await admin_models(proxy)
        alpha = next(m for m in body["models"] if m["name"] == "alpha")
        states = [(i["id"] == old, i["state"], i["retired"]) for i in alpha["instances"]]
        used = body["gpus"][0]["used_mb"] if body["gpus"] else 0
        return states == [(True, "running", True), (False, "running", False)] and (
            used == 300 + 300 + 200
        )

    await wait_for(settled, timeout=30, what=f"a new alpha instance beside the draining {old}")
    snapshot = await admin_models(proxy)
    alpha = next(m for m in snapshot["models"] if m["name"] == "alpha")
    return Scene(snapshot, old, alpha["instances"][1]["id"], gamma)


async def test_status_page_serves_html(start_proxy: StartProxy, tmp_path: Path) -> None:
    proxy = await start_proxy(status_config(tmp_path, status_models({})))
    async with proxy.http.get(proxy.url + "/") as resp:
        assert resp.status == 200
        assert resp.content_type == "text/html"
        page = await resp.text()
    assert 'src="console.js"' in page and 'data-events="admin/events"' in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page), "page must be self-contained"


async def test_status_page_renders_in_chromium(status_proxy: StatusProxy, tmp_path: Path) -> None:
    proxy = status_proxy.proxy
    scene = await reload_scene(status_proxy)
    snapshot = scene.snapshot
    models = {m["name"]: m for m in snapshot["models"]}
    assert {n: (m["state"], m["removed"]) for n, m in models.items()} == {
        "alpha": ("running", False),
        "beta": ("stopped", False),
        "gamma": ("running", True),
    }
    live = {i["id"]: i for m in models.values() for i in m["instances"]}
    assert set(live) == {scene.old, scene.new, scene.gamma}
    assert [scene.old, scene.new] == [i["id"] for i in models["alpha"]["instances"]]
    assert all(re.fullmatch(rf"{m}#\d+", i["id"]) for m in models for i in models[m]["instances"])
    assert all(i["pid"] and i["socket"] for i in live.values())
    gpu = snapshot["gpus"][0]
    assert (gpu["id"], gpu["total_mb"], gpu["used_mb"]) == (0, GPU_MB, 800)
    assert snapshot["proxy"]["memory"] == "static"
    url = proxy.url + "/"

    shot = tmp_path / "status.png"
    rc, _, err = await run_chromium(
        url,
        tmp_path / "profile-shot",
        f"--screenshot={shot}",
        "--window-size=1280,800",
        "--hide-scrollbars",
        "--virtual-time-budget=5000",
    )
    assert rc == 0, err[-2000:]
    assert shot.is_file(), err[-2000:]
    width, height, distinct_rows = png_summary(shot)
    assert (width, height) == (1280, 800)
    assert shot.stat().st_size > 10_000
    assert distinct_rows > 100, f"screenshot looks blank ({distinct_rows} distinct rows)"
    if copy_to := os.environ.get(SCREENSHOT_COPY_ENV):
        shutil.copyfile(shot, copy_to)

    rc, dom, err = await run_chromium(
        url, tmp_path / "profile-dom", "--dump-dom", "--virtual-time-budget=5000"
    )
    assert rc == 0, err[-2000:]
    assert 'id="banner" class="banner hidden"' in dom, "the error banner is showing"
    assert f'id="version">{__version__}<' in dom
    assert 'id="memory-mode">static<' in dom
    assert 'id="engines">3<' in dom and 'id="active">2<' in dom

    # Models: summary state, names, tags.
    alpha = row_html(dom, "model", "alpha")
    assert 'data-state="running"' in alpha
    assert re.search(r'class="badge s-running">running<', alpha)
    assert "fake/alpha · a" in alpha
    assert "removed" not in alpha and "draining" not in alpha
    beta = row_html(dom, "model", "beta")
    assert 'data-state="stopped"' in beta and ">stopped<" in beta
    gamma = row_html(dom, "model", "gamma")
    assert 'data-removed="true"' in gamma and ">removed<" in gamma

    # Both OpenAI base URLs, as text, for every configured model (not the removed one).
    for name in ("alpha", "beta"):
        urls = row_html(dom, "urls", name)
        assert f"<code>{proxy.url}/v1</code>" in urls, urls
        assert f"<code>{proxy.url}/serve/{name}/v1</code>" in urls, urls
        assert models[name]["base_urls"] == {
            "v1": f"{proxy.url}/v1",
            "serve": f"{proxy.url}/serve/{name}/v1",
        }
    assert 'data-urls="gamma"' not in dom

    # One row per live instance: id, state, pid : port, devices, leases; retired ones draining.
    for iid, inst in live.items():
        assert dom.count(f'data-instance="{iid}"') == 1, f"{iid} shown more than once"
        row = row_html(dom, "instance", iid)
        assert f'data-state="{inst["state"]}"' in row and ">running<" in row
        where = inst["port"] or inst["socket"].rsplit("/", 1)[-1]
        assert f"{inst['pid']} : {where}" in row, row
        assert re.search(r"<td>0</td>", row), f"no device in {row}"
        assert re.search(rf'class="num">{inst["leases"]}<', row), row
        retired = ">draining<" in row
        assert retired == inst["retired"] == (iid != scene.new), row
        assert ('data-retired="true"' in row) == retired
    assert re.search(r'class="num">1<', row_html(dom, "instance", scene.old))
    assert "no engine yet" in dom  # beta
    order = [
        'data-model="alpha"',
        'data-urls="alpha"',
        f'data-instance="{scene.old}"',
        f'data-instance="{scene.new}"',
        'data-model="beta"',
        'data-model="gamma"',
        f'data-instance="{scene.gamma}"',
    ]
    assert sorted(order, key=dom.index) == order, "rows out of order"

    assert re.search(r'data-gpu="0"', dom), "no GPU section"
    assert re.search(r'class="bar\s*"[^>]*aria-valuenow="800"', dom), "no GPU memory bar"
    assert "800 MiB / 1200 MiB (67%)" in dom
