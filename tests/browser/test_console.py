"""The operator console in a real browser (headless Chromium over DevTools), against one live
in-process proxy with the fake engine: without the key nothing can be done and the admin routes
answer 401; with it, an operator streams an answer in the playground, finds the request in the
recent list, puts a model to sleep and wakes it, follows an engine's log, stops the engine
(after confirming), and sees the memory timeline. Model names and log lines carry markup,
which must stay text."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import quote

from kit import FakeEngine, RunningProxy, StartProxy, config_data
from kit.browser import Page, chromium

from vllm_proxy.config import parse_config

KEY = "console-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: A model whose name and served model carry markup: it must show as text, run nothing.
EVIL = '<img/src="x"/onerror="window.__xss=1">'
EVIL_MODEL = "<script>window.__xss=2</script>"
#: A line an engine "writes" into its log: shown as text, never as an element.
EVIL_LINE = '<b id="pwned">engine line</b><script>window.__xss=3</script>'
#: Where to keep the screenshots (for docs/operations.md); unset: the tmp dir only.
SCREENSHOT_DIR_ENV = "VLLM_PROXY_CONSOLE_SCREENSHOTS"
#: Answers take a moment, so the playground shows tokens arriving.
STREAMING = FakeEngine(tokens=24, token_delay=0.01).env()


def console_config(tmp_path: Path) -> dict[str, Any]:
    models = {
        "alpha": {"model": "fake/alpha", "memory_mb": 300, "sleep": {"level": 1},
                  "env": STREAMING},
        EVIL: {"model": EVIL_MODEL, "memory_mb": 200},
    }  # fmt: skip
    server = {"api_keys": [{"key": KEY, "name": "ops", "admin": True}]}
    return config_data(tmp_path, models=models, server=server, budget_mb=1200)


CSP_PROBE = """
window.__csp = [];
document.addEventListener("securitypolicyviolation",
  (e) => window.__csp.push(`${e.violatedDirective} ${e.blockedURI}`));
"""


def q(value: str) -> str:
    """`value` quoted for a CSS attribute selector."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def find(selector: str) -> str:
    """The script that finds the element `selector` selects."""
    return f"document.querySelector({json.dumps(selector)})"


def js_str(value: str) -> str:
    return json.dumps(value)


async def choose(page: Page, select: str, value: str) -> None:
    """Pick `value` in the ``<select id=select>`` as a user would (its change event fires)."""
    await page.js(
        f"(() => {{ const s = document.getElementById({js_str(select)}); s.value = {js_str(value)};"
        " s.dispatchEvent(new Event('change')); })()"
    )


async def row_state(page: Page, model: str) -> str:
    state: str = await page.js(f"{find(f'tr.model[data-model={q(model)}]')}?.dataset.state ?? ''")
    return state


async def wait_state(page: Page, model: str, state: str, timeout: float = 30.0) -> None:
    await page.until(
        f"{find(f'tr.model[data-model={q(model)}]')}?.dataset.state === {js_str(state)}",
        timeout=timeout,
        what=f"{model} shown {state}",
    )


async def admin_routes_refuse_without_key(proxy: RunningProxy) -> None:
    iid = quote("alpha#1", safe="")
    name = quote("alpha", safe="")
    for method, path in [
        ("GET", "/admin/models"),
        ("GET", "/admin/events"),
        ("GET", "/admin/history"),
        ("GET", "/admin/requests"),
        ("POST", "/admin/capture?model=alpha"),
        ("GET", f"/admin/instances/{iid}/log?follow=1"),
        ("GET", f"/admin/models/{name}/logs"),
        *[
            ("POST", f"/admin/models/{name}/{action}")
            for action in ("load", "sleep", "wake", "stop", "drain", "unload", "pin")
        ],
        ("POST", "/admin/reload"),
    ]:
        async with proxy.http.request(method, proxy.url + path) as r:
            assert r.status == 401, (method, path, r.status)
        async with proxy.http.request(
            method, proxy.url + path, headers={"Authorization": "Bearer wrong"}
        ) as r:
            assert r.status == 401, (method, path, r.status)


async def test_console_in_a_browser(start_proxy: StartProxy, tmp_path: Path) -> None:
    proxy = await start_proxy(parse_config(console_config(tmp_path)))
    await admin_routes_refuse_without_key(proxy)
    async with proxy.http.get(proxy.url + "/") as r:
        csp = r.headers["Content-Security-Policy"]
        page_html = await r.text()
    assert "script-src 'self'" in csp and "'unsafe-inline'" not in csp
    assert "<script>" not in page_html, "no inline script"
    assert not re.search(r"\son[a-z]+\s*=", page_html), "no inline event handlers"
    shots = Path(os.environ.get(SCREENSHOT_DIR_ENV) or tmp_path)

    async with chromium(tmp_path / "profile") as page:
        await page.call("Page.addScriptToEvaluateOnNewDocument", source=CSP_PROBE)

        # -- no key: the page asks for one and offers nothing ---------------------------------
        await page.goto(proxy.url + "/")
        await page.until("document.body.dataset.authorized === 'false'", what="the key prompt")
        assert await page.js("!document.getElementById('auth').classList.contains('hidden')")
        assert await page.js("document.querySelectorAll('button[data-action]').length") == 0
        assert await page.js("document.getElementById('admin-panels').classList.contains('hidden')")
        assert await page.js("fetch('admin/models').then((r) => r.status)") == 401
        assert await page.js("fetch('admin/models/alpha/sleep', {method: 'POST'})"
                             ".then((r) => r.status)") == 401  # fmt: skip

        # -- the key: kept for the tab only, sent as Authorization ----------------------------
        await page.type("#key-input", KEY)
        await page.click("#key-form button[type=submit]")
        await page.until("document.body.dataset.authorized === 'true'", what="the key accepted")
        assert await page.js("sessionStorage.getItem('vllm-proxy-admin-key')") == KEY
        assert await page.js("localStorage.length") == 0
        assert await page.js("document.cookie") == ""
        await wait_state(page, "alpha", "stopped")
        # The model named with markup is a row of text: no image, no script ran.
        assert await page.js(f"{find(f'tr.model[data-model={q(EVIL)}] b')}.textContent") == EVIL
        assert await page.js("document.querySelectorAll('#models img, #models script').length") == 0
        # A model without a sleep policy: sleep offered disabled, with the reason.
        evil_sleep = f"button[data-action=sleep][data-model={q(EVIL)}]"
        assert await page.js(f"{find(evil_sleep)}.disabled")
        assert "no sleep policy" in await page.js(f"{find(evil_sleep)}.title")
        assert await page.js(
            "document.querySelector('button[data-action=wake][data-model=alpha]').disabled"
        )

        # -- playground: a cold start, then tokens streamed, TTFT and tokens/s ----------------
        await page.until("[...document.querySelectorAll('#pg-model option')]"
                         ".some((o) => o.value === 'alpha')")  # fmt: skip
        await choose(page, "pg-model", "alpha")
        await page.click("#pg-send")
        await page.until(
            "document.getElementById('pg-out').dataset.done === 'true'",
            timeout=40,
            what="the playground's answer",
        )
        answer = await page.js("document.getElementById('pg-out').textContent")
        assert answer.strip(), "no answer streamed"
        assert await page.js("document.getElementById('pg-tokens').textContent") == "24"
        assert await page.js("document.getElementById('pg-ttft').textContent") != "\u2013"
        assert float(await page.js("document.getElementById('pg-tps').textContent")) > 0
        await wait_state(page, "alpha", "running")

        # -- the request in the recent list, filtered ------------------------------------------
        row = "#requests tr[data-model=alpha][data-status='200']"
        await page.until(f"{find(row)} !== null", what="the request in the list")
        rid = await page.js(f"{find(row)}.dataset.rid")
        async with proxy.http.get(proxy.url + "/admin/requests?model=alpha", headers=AUTH) as r:
            listed = (await r.json())["requests"]
        assert [e["id"] for e in listed] == [rid]
        assert listed[0]["tokens_out"] == 24 and listed[0]["key"] == "ops"
        assert "body" not in listed[0], "bodies are not kept unless captured"
        await choose(page, "req-status", "5xx")
        assert await page.js(f"{find(row)}") is None
        await choose(page, "req-status", "2xx")
        assert await page.js(f"{find(row)} !== null")
        # Capture for one model, shown as on; then off again.
        await choose(page, "req-model", "alpha")
        await page.click("#capture-toggle")
        await page.until(f"{find('#capture-state [data-capture=alpha]')} !== null",
                         what="capture shown on")  # fmt: skip
        assert proxy.server.runtime.proxy.recent.wants_body("alpha")
        await page.click("#capture-toggle")
        await page.until(f"{find('#capture-state [data-capture]')} === null", what="capture off")
        assert not proxy.server.runtime.proxy.recent.wants_body("alpha")
        await choose(page, "req-model", "")

        # -- sleep, then wake ----------------------------------------------------------------
        await page.click("button[data-action=sleep][data-model=alpha][data-level='1']")
        await wait_state(page, "alpha", "sleeping")
        assert proxy.model("alpha").sleeper() is not None
        badge = "tr.instance[data-state=sleeping] .badge"
        await page.until(f"{find(badge)}?.textContent === 'sleeping L1'", what="the level shown")
        reason = "button[data-action=sleep][data-model=alpha]"
        await page.until(f"{find(reason)}.title === 'already asleep'")
        await page.click("button[data-action=wake][data-model=alpha]")
        await wait_state(page, "alpha", "running")
        assert proxy.model("alpha").serving() is not None
        # The wake's place in the queue is given back, and the live view shows it.
        queue = f"{find('tr.model[data-model=alpha] td:nth-child(7)')}.textContent"
        await page.until(f"{queue} === '0'", what="alpha's queue back to 0")

        # -- follow the engine's log ---------------------------------------------------------
        inst = proxy.model("alpha").serving()
        assert inst is not None
        await page.click("#log-follow")
        await page.click(f"button[data-action=logs][data-log={q(inst.id)}]")
        await page.until("document.getElementById('log').dataset.following === 'true'")
        await page.until(
            "document.getElementById('log').textContent.includes('vLLM server version')",
            what="the log's tail",
        )
        with open(inst.log_path, "a") as fh:  # as the engine would write a line
            fh.write(EVIL_LINE + "\n")
        await page.until(
            f"document.getElementById('log').textContent.includes({js_str(EVIL_LINE)})",
            what="the new line, followed",
        )
        assert await page.js("document.getElementById('pwned')") is None
        assert await page.js("document.querySelectorAll('#log *').length") == 0

        await page.js(
            "document.querySelectorAll('.table-wrap').forEach((e) => { e.scrollLeft = 0; });"
            "window.scrollTo(0, 0)"
        )
        await page.screenshot(shots / "console.png")

        # -- stop: asked first, because it serves -----------------------------------------------
        await page.click("button[data-action=stop][data-model=alpha]")
        await page.until("!document.getElementById('confirm').classList.contains('hidden')",
                         what="the confirmation")  # fmt: skip
        assert await row_state(page, "alpha") == "running", "stopped before confirming"
        await page.click("#confirm-yes")
        await wait_state(page, "alpha", "stopped")
        assert proxy.model("alpha").instances == []
        await page.until("document.getElementById('notice').textContent.includes('stop done')")

        # -- reload: this proxy has no config file, and the page says so -----------------------
        await page.click("#reload-config")
        await page.until(
            "document.getElementById('notice').textContent.includes('without a config file')",
            what="the reload's refusal shown",
        )
        assert await page.js("document.getElementById('notice').dataset.kind") == "err"

        # -- the memory timeline: starts, sleeps, wakes and stops marked, with reasons ---------
        marks = "#chart svg[data-chart-gpu='0'] g.event title"
        for change in ("running → sleeping (admin)", "→ stopped (admin unload)"):
            await page.until(
                f"[...document.querySelectorAll({js_str(marks)})].some((t) => t.textContent"
                f".includes({js_str(change)}))",
                what=f"{change!r} marked on the chart",
            )
        titles = await page.js(
            f"[...document.querySelectorAll({js_str(marks)})].map((t) => t.textContent)"
        )
        assert any("starting → running" in t for t in titles), titles

        # -- the model with markup: started, its log (naming its model) shown as text -----------
        await page.click(f"button[data-action=start][data-model={q(EVIL)}]")
        await wait_state(page, EVIL, "running")
        evil = proxy.model(EVIL).serving()
        assert evil is not None
        await page.click(f"button[data-action=logs][data-log={q(evil.id)}]")
        await page.until(
            f"document.getElementById('log').textContent.includes({js_str(EVIL_MODEL)})",
            what="the engine's line naming its model",
        )
        assert await page.js("document.querySelectorAll('#log *, #models img').length") == 0
        assert await page.js("window.__xss") is None

        assert await page.js("window.__csp") == [], "Content-Security-Policy violations"
        assert page.problems == [], page.problems
