"""Headless Chromium driven over its DevTools protocol (a WebSocket, aiohttp's client): open a
page, click with the mouse, type, run script, wait for the page to show something, take a
screenshot. The page's exceptions and console errors (a Content-Security-Policy violation is
one) are collected in `problems`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

CHROMIUM = "/usr/bin/chromium"
#: Headless, no sandbox (root), and none of the background connections a closed network refuses.
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
FLAGS = [*CHROMIUM_FLAGS, "--remote-debugging-port=0", "--remote-allow-origins=*"]
START_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 30.0
_LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


class BrowserError(AssertionError):
    pass


class Page:
    """One tab, over its own DevTools WebSocket."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.problems: list[str] = []
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type is not aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            if "id" in data:
                fut = self._calls.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
            elif data.get("method") == "Runtime.exceptionThrown":
                details = data["params"]["exceptionDetails"]
                text = details.get("exception", {}).get("description") or details.get("text")
                self.problems.append(f"exception: {text}")
            elif data.get("method") == "Log.entryAdded":
                entry = data["params"]["entry"]
                # An HTTP error status is the page's to show (the tests check it does), not a
                # fault of the page.
                text = entry.get("text", "")
                if entry.get("level") == "error" and "Failed to load resource" not in text:
                    self.problems.append(f"log: {entry.get('text')}")
            elif data.get("method") == "Runtime.consoleAPICalled":
                if data["params"].get("type") == "error":
                    args = data["params"].get("args", [])
                    self.problems.append("console: " + " ".join(str(a.get("value")) for a in args))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(BrowserError("the browser closed the connection"))

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        cid = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._calls[cid] = fut
        await self.ws.send_str(json.dumps({"id": cid, "method": method, "params": params}))
        reply = await asyncio.wait_for(fut, CALL_TIMEOUT_S)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    async def js(self, expression: str) -> Any:
        """The value of `expression` in the page (promises awaited)."""
        reply = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in reply:
            raise BrowserError(f"{expression!r}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)
        await self.until("document.readyState === 'complete'", what=f"{url} to load")

    async def until(self, expression: str, timeout: float = 20.0, what: str = "") -> Any:
        """Poll `expression` until truthy (with a deadline); its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.js(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"timed out after {timeout}s waiting for {what or expression}")
            await asyncio.sleep(0.1)

    async def click(self, selector: str) -> None:
        """A mouse click (press and release) in the middle of the element `selector` finds."""
        box = await self.until(
            f"""(() => {{
              const e = document.querySelector({json.dumps(selector)});
              if (!e || e.disabled || e.offsetParent === null) return null;
              e.scrollIntoView({{block: "center"}});
              const r = e.getBoundingClientRect();
              return [r.left + r.width / 2, r.top + r.height / 2];
            }})()""",
            what=f"an enabled, visible {selector}",
        )
        x, y = box
        for kind in ("mousePressed", "mouseReleased"):
            await self.call(
                "Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1
            )

    async def type(self, selector: str, text: str) -> None:
        await self.js(f"document.querySelector({json.dumps(selector)}).focus()")
        await self.call("Input.insertText", text=text)

    async def screenshot(self, path: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))


@contextlib.asynccontextmanager
async def chromium(profile: Path, width: int = 1400, height: int = 1000) -> AsyncIterator[Page]:
    """A headless Chromium with one blank tab, killed (its whole process group) at the end."""
    if not os.access(CHROMIUM, os.X_OK):
        raise BrowserError(f"{CHROMIUM} missing: run scripts/system-deps.sh (make test does)")
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
        "about:blank",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    drain: asyncio.Task[None] | None = None
    try:
        assert proc.stderr is not None
        url = await asyncio.wait_for(_listening(proc.stderr), START_TIMEOUT_S)
        drain = asyncio.ensure_future(_drain(proc.stderr))  # never leave the pipe full
        port = int(url.split(":")[2].split("/")[0])
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as r:
                targets = await r.json()
            page_ws = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
            async with session.ws_connect(page_ws, max_msg_size=0) as ws:
                page = Page(ws)
                for domain in ("Page", "Runtime", "Log"):
                    await page.call(f"{domain}.enable")
                await page.call(
                    "Emulation.setDeviceMetricsOverride", width=width, height=height,
                    deviceScaleFactor=1, mobile=False,
                )  # fmt: skip
                try:
                    yield page
                finally:
                    page._reader.cancel()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        if drain is not None:
            drain.cancel()


async def _listening(stream: asyncio.StreamReader) -> str:
    while True:
        line = await stream.readline()
        if not line:
            raise BrowserError("chromium exited before it listened for DevTools")
        found = _LISTENING.search(line.decode(errors="replace"))
        if found:
            return found.group(1)


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.read(65536):
        pass


CHROMIUM_TIMEOUT_S = 90.0


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
