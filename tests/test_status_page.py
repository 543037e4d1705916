"""The status page at `/`, rendered by headless Chromium against a live in-process proxy."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
from conftest import RunningProxy, StartProxy, make_config, wait_for

from vllm_proxy.config import Config, parse_config

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
CHROMIUM_TIMEOUT_S = 90.0
#: Where to keep a copy of the screenshot (for the docs); unset: only the tmp dir.
SCREENSHOT_COPY_ENV = "VLLM_PROXY_STATUS_SCREENSHOT"


def status_config(tmp_path: Path) -> Config:
    """Two fake-engine models on a static 1000 MiB GPU budget, admin API open."""
    base = make_config(
        tmp_path,
        models={
            "alpha": {"model": "fake/alpha", "aliases": ["a"], "memory_mb": 400},
            "beta": {"model": "fake/beta", "memory_mb": 300},
        },
        server={"admin_open": True},
    )
    data = base.model_dump(mode="json")
    data["gpu"] = {"monitor": "static", "devices": [{"id": 0, "memory_mb": 1000}]}
    return parse_config(data)


async def run_chromium(url: str, profile: Path, *args: str) -> tuple[int, str, str]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} missing: run scripts/system-deps.sh (make test does)")
    """Run headless Chromium in its own process group; kill the whole group when done."""
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM,
        *CHROMIUM_FLAGS,
        f"--user-data-dir={profile}",
        *args,
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), CHROMIUM_TIMEOUT_S)
    except TimeoutError:
        raise AssertionError(f"chromium did not finish within {CHROMIUM_TIMEOUT_S}s") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.returncode is None:
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


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


def row_html(dom: str, model: str) -> str:
    match = re.search(rf'<tr[^>]*data-model="{re.escape(model)}"[^>]*>.*?</tr>', dom, re.S)
    assert match, f"no row for {model!r} in the rendered page"
    return match.group(0)


async def make_alpha_running(proxy: RunningProxy) -> dict[str, Any]:
    async with await proxy.chat("a") as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()

    async def admin_models() -> dict[str, Any]:
        async with proxy.http.get(proxy.url + "/admin/models") as resp:
            assert resp.status == 200, await resp.text()
            body: dict[str, Any] = await resp.json()
            return body

    async def alpha_counted() -> bool:
        body = await admin_models()
        return bool(body["gpus"]) and body["gpus"][0]["used_mb"] >= 400

    await wait_for(alpha_counted, what="alpha's memory on the GPU budget")
    return await admin_models()


async def test_status_page_serves_html(start_proxy: StartProxy, tmp_path: Path) -> None:
    proxy = await start_proxy(status_config(tmp_path))
    async with proxy.http.get(proxy.url + "/") as resp:
        assert resp.status == 200
        assert resp.content_type == "text/html"
        page = await resp.text()
    assert "admin/models" in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page), "page must be self-contained"


async def test_status_page_renders_in_chromium(start_proxy: StartProxy, tmp_path: Path) -> None:
    proxy = await start_proxy(status_config(tmp_path))
    snapshot = await make_alpha_running(proxy)
    states = {m["name"]: m["state"] for m in snapshot["models"]}
    assert states == {"alpha": "running", "beta": "stopped"}
    gpu = snapshot["gpus"][0]
    assert (gpu["id"], gpu["total_mb"], gpu["used_mb"]) == (0, 1000, 400)
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
    alpha = row_html(dom, "alpha")
    beta = row_html(dom, "beta")
    assert 'data-state="running"' in alpha
    assert re.search(r'class="badge s-running">running<', alpha)
    assert "fake/alpha · a" in alpha
    assert 'data-state="stopped"' in beta and ">stopped<" in beta
    assert re.search(r'data-gpu="0"', dom), "no GPU section"
    assert re.search(r'class="bar\s*"[^>]*aria-valuenow="400"', dom), "no GPU memory bar"
    assert "400 MiB / 1000 MiB (40%)" in dom
    assert 'id="version">0.1.0<' in dom
    assert 'id="memory-mode">static<' in dom
    assert 'id="banner" class="banner hidden"' in dom, "the error banner is showing"
