"""The operator console's API, beside the admin API it extends (all under ``/admin``, so every
route here needs an admin key; `Serving.middleware` checks it):

* ``GET /admin/events``: one Server-Sent Events stream of the live state (``state``: the same
  object as ``GET /admin/models``, sent when it changed, checked at every state change and at
  least every `TICK_S`), the timeline (``timeline``: state changes with reasons) and the
  requests that ended (``requests``). One stream per page; at most `MAX_STREAMS` at once.
* ``GET /admin/history``: memory per device and model over the last hour, and the events.
* ``GET /admin/requests``: the ring of recent requests, filtered; ``/admin/capture``: request
  bodies of one model, kept for a while (bounded), or not.
* ``GET /admin/instances/{id}/log``: an instance's log: its tail, followed (``follow=1``), or
  the whole file to download (``download=1``).
* ``POST /admin/models/{name}/stop`` and ``/drain``: every instance stops, in-flight requests
  cut at once or given ``server.drain_timeout_s``.

The console page itself (``/``, ``/console.js``, ``/console.css``) is static and holds no data.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web

from ...config import ServerConfig
from ...errors import BadRequest, NotFound, TooManyRequests
from ...pool.journal import SAMPLE_S
from ...pool.manager import Manager
from ...pool.views import InstanceView, find_instance, read_tail
from ..recent import MAX_CAPTURE_BYTES, MAX_CAPTURE_COUNT, MAX_CAPTURE_S, Recent

log = logging.getLogger(__name__)

#: The longest a live stream waits without checking the state (queue depth and memory change
#: without a state change).
TICK_S = 1.0
#: A comment line this often keeps idle connections (and proxies in between) open.
HEARTBEAT_S = 15.0
#: Live streams (and log follows) open at once; past it 429.
MAX_STREAMS = 16
#: A followed log is read this often; at most `FOLLOW_CHUNK` bytes a read.
FOLLOW_POLL_S = 0.25
FOLLOW_CHUNK = 64 * 1024
#: A memory sample at most this often (state changes ask for one at once).
MIN_SAMPLE_GAP_S = 1.0
#: The Content-Security-Policy of the console: its own scripts and styles only, no frames.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}
STATIC = {"console.js": "application/javascript", "console.css": "text/css"}

Snapshot = Callable[[str], dict[str, Any]]


class Console:
    """Handlers for the console's routes, and the memory sampler."""

    def __init__(
        self, manager: Manager, recent: Recent, snapshot: Snapshot, server: ServerConfig
    ) -> None:
        self.manager = manager
        self.recent = recent
        self.snapshot = snapshot
        self.configure(server)
        self.streams = 0
        self._sampler: asyncio.Task[None] | None = None
        self._files: dict[str, bytes] = {}

    def configure(self, server: ServerConfig) -> None:
        """Apply the keys of a (re)loaded config."""
        self.drain_timeout_s = server.drain_timeout_s

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Begin sampling memory (inside the running loop)."""
        if self._sampler is None:
            self._sampler = asyncio.ensure_future(self._sample())

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()

    async def _sample(self) -> None:
        journal = self.manager.journal
        while True:
            changed = journal.changed()
            try:
                if self.manager.memory is not None:
                    self.manager.memory.refresh()
                journal.sample(self.manager.memory_sample())
            except Exception:  # a bad reading must not end the timeline
                log.exception("console: memory sample failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), SAMPLE_S)
            await asyncio.sleep(MIN_SAMPLE_GAP_S)  # a rate limit, not a wait for state

    # -- static files --------------------------------------------------------------------

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["file"]
        if name not in STATIC:
            raise NotFound(f"no file {name!r}")
        body = self._files.get(name)
        if body is None:
            body = resources.files("vllm_proxy").joinpath(f"static/{name}").read_bytes()
            self._files[name] = body
        resp = web.Response(body=body, content_type=STATIC[name], charset="utf-8")
        resp.headers.update(PAGE_HEADERS)
        return resp

    # -- live state ----------------------------------------------------------------------

    async def events(self, request: web.Request) -> web.StreamResponse:
        """The live stream: ``state`` when it changed, ``timeline`` and ``requests`` as they
        come. Holds one copy of the last state sent, nothing else."""
        if self.streams >= MAX_STREAMS:
            raise TooManyRequests(
                f"{MAX_STREAMS} console streams are open already", retry_after_s=5, reason="streams"
            )
        self.streams += 1
        try:
            return await self._events(request)
        finally:
            self.streams -= 1

    async def _events(self, request: web.Request) -> web.StreamResponse:
        resp = _stream(request, "text/event-stream")
        await resp.prepare(request)
        with contextlib.suppress(ConnectionResetError):  # the page went away
            await self._send_events(request, resp)
        return resp

    async def _send_events(self, request: web.Request, resp: web.StreamResponse) -> None:
        journal = self.manager.journal
        origin = f"{request.scheme}://{request.host}"
        seq = _int_query(request, "after", 0)
        rseq = self.recent.seq
        last = ""
        beat = time.monotonic()
        while True:
            changed = journal.changed()
            state = json.dumps(self.snapshot(origin), separators=(",", ":"))
            out = []
            if state != last:
                out.append(_sse("state", state))
                last = state
            if journal.seq > seq:
                out.append(_sse("timeline", json.dumps(journal.since(seq))))
                seq = journal.seq
            if self.recent.seq > rseq:
                fresh = self.recent.query(after=rseq, limit=100)
                out.append(_sse("requests", json.dumps([_public(e) for e in reversed(fresh)])))
                rseq = self.recent.seq
            if not out and time.monotonic() - beat >= HEARTBEAT_S:
                out.append(b": ping\n\n")
            if out:
                await resp.write(b"".join(out))
                beat = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), TICK_S)

    async def history(self, request: web.Request) -> web.Response:
        return web.json_response(self.manager.journal.history())

    # -- recent requests -----------------------------------------------------------------

    async def requests(self, request: web.Request) -> web.Response:
        q = request.query
        rows = self.recent.query(
            model=q.get("model") or None,
            status=q.get("status") or None,
            limit=min(max(_int_query(request, "limit", 100), 1), len(self.recent.ring) or 1),
            after=_int_query(request, "after", 0),
        )
        bodies = q.get("bodies") == "1"
        return web.json_response(
            {
                "requests": [e if bodies else _public(e) for e in rows],
                "capture": self._capture_status(),
                "size": self.recent.ring.maxlen,
            }
        )

    def _capture_status(self) -> dict[str, Any] | None:
        cap = self.recent.capture
        return cap.status() if cap is not None else None

    async def capture(self, request: web.Request) -> web.Response:
        """``POST /admin/capture?model=M&seconds=S&count=N&max_bytes=B``: keep the request
        bodies of model M (bounded); ``DELETE``: stop."""
        if request.method == "DELETE":
            self.recent.stop_capture()
            return web.json_response({"capture": None})
        if request.method == "POST":
            name = request.query.get("model", "")
            model = self.manager.resolve(name)
            self.recent.start_capture(
                model.name,
                float(_int_query(request, "seconds", 300)),
                _int_query(request, "count", 20),
                _int_query(request, "max_bytes", MAX_CAPTURE_BYTES),
            )
        return web.json_response(
            {"capture": self._capture_status(), "max_s": MAX_CAPTURE_S,
             "max_count": MAX_CAPTURE_COUNT, "max_bytes": MAX_CAPTURE_BYTES}
        )  # fmt: skip

    # -- stop and drain ------------------------------------------------------------------

    async def stop(self, request: web.Request) -> web.Response:
        """Every instance stops now; requests in flight are cut."""
        return await self._unload(request, 0.0)

    async def drain(self, request: web.Request) -> web.Response:
        """New requests wait; those in flight get ``server.drain_timeout_s``; then it stops."""
        return await self._unload(request, self.drain_timeout_s)

    async def _unload(self, request: web.Request, timeout: float) -> web.Response:
        model = self.manager.resolve(request.match_info["name"])
        await asyncio.shield(model.unload(timeout))  # a client gone does not stop it half-way
        row = next(r for r in self.manager.snapshot() if r["name"] == model.name)
        return web.json_response(row)

    # -- logs ----------------------------------------------------------------------------

    def _instance(self, iid: str) -> InstanceView:
        inst = find_instance(self.manager, iid)
        if inst is None:
            raise NotFound(f"no live or last-ended instance '{iid}'", code="instance_not_found")
        return inst

    async def log(self, request: web.Request) -> web.StreamResponse:
        """An instance's log: the last ``tail`` lines (default 200), then with ``follow=1``
        what it writes next, until the client goes; ``download=1``: the whole file."""
        inst = self._instance(request.match_info["iid"])
        path = inst.log_path
        if request.query.get("download") == "1":
            if not path.is_file():
                raise NotFound(f"{inst.id} has no log file", code="log_not_found")
            name = inst.id.replace("#", "-") + ".log"
            resp = web.FileResponse(path)
            resp.headers["Content-Type"] = "text/plain; charset=utf-8"
            resp.headers["Content-Disposition"] = f'attachment; filename="{_safe(name)}"'
            return resp
        tail = _int_query(request, "tail", 200)
        if not 1 <= tail <= 5000:
            raise BadRequest("tail must be between 1 and 5000", param="tail")
        if request.query.get("follow") != "1":
            text = read_tail(path, lines=tail, max_bytes=tail * 1024)
            return web.Response(text=text + ("\n" if text else ""), content_type="text/plain")
        if self.streams >= MAX_STREAMS:
            raise TooManyRequests(
                f"{MAX_STREAMS} console streams are open already", retry_after_s=5, reason="streams"
            )
        self.streams += 1
        try:
            return await self._follow(request, path, tail)
        finally:
            self.streams -= 1

    async def _follow(self, request: web.Request, path: Path, tail: int) -> web.StreamResponse:
        resp = _stream(request, "text/plain")
        await resp.prepare(request)
        with contextlib.suppress(ConnectionResetError):  # the page went away
            await self._send_log(resp, path, tail)
        return resp

    async def _send_log(self, resp: web.StreamResponse, path: Path, tail: int) -> None:
        size, text = await asyncio.to_thread(_size_and_tail, path, tail)
        await resp.write((text + "\n").encode() if text else b"")
        pos = size
        # Until the client goes: handler cancellation (app.py) ends this loop then.
        while True:
            pos, chunk = await asyncio.to_thread(_read_from, path, pos)
            if chunk:
                # Whole lines only: a partial last line waits for its end.
                cut = chunk.rfind(b"\n") + 1 if len(chunk) < FOLLOW_CHUNK else len(chunk)
                if cut:
                    await resp.write(chunk[:cut])
                    pos += cut
            if not chunk or len(chunk) < FOLLOW_CHUNK:
                await asyncio.sleep(FOLLOW_POLL_S)  # a file has no change signal to wait on


def _size_and_tail(path: Path, tail: int) -> tuple[int, str]:
    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0
    return size, read_tail(path, lines=tail, max_bytes=tail * 1024)


def _read_from(path: Path, pos: int) -> tuple[int, bytes]:
    """What the file holds from `pos` on (at most `FOLLOW_CHUNK`), and where that began: from
    the start when the file is now shorter (rotated at ``log_max_bytes``, a new file)."""
    try:
        with open(path, "rb") as fh:
            if os.fstat(fh.fileno()).st_size < pos:
                pos = 0
            fh.seek(pos)
            return pos, fh.read(FOLLOW_CHUNK)
    except OSError:
        return pos, b""


def _stream(request: web.Request, content_type: str) -> web.StreamResponse:
    resp = web.StreamResponse()
    resp.headers["Content-Type"] = f"{content_type}; charset=utf-8"
    resp.headers["Cache-Control"] = "no-cache"
    resp.headers["X-Accel-Buffering"] = "no"
    return resp


def _sse(event: str, data: str) -> bytes:
    return f"event: {event}\ndata: {data}\n\n".encode()


def _public(entry: dict[str, Any]) -> dict[str, Any]:
    """A recent request without its captured body (the live stream never carries bodies)."""
    if "body" not in entry:
        return entry
    return {k: v for k, v in entry.items() if k not in ("body", "body_truncated")} | {
        "captured": True
    }


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in name)


def _int_query(request: web.Request, key: str, default: int) -> int:
    raw = request.query.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise BadRequest(f"{key} must be an integer", param=key) from None


def add_console_routes(app: web.Application, console: Console) -> None:
    app.router.add_get("/{file:console\\.(?:js|css)}", console.static)
    app.router.add_get("/admin/events", console.events)
    app.router.add_get("/admin/history", console.history)
    app.router.add_get("/admin/requests", console.requests)
    app.router.add_route("*", "/admin/capture", console.capture)
    app.router.add_post("/admin/models/{name}/stop", console.stop)
    app.router.add_post("/admin/models/{name}/drain", console.drain)
    app.router.add_get("/admin/instances/{iid}/log", console.log)

    async def started(_app: web.Application) -> None:
        console.start()

    async def cleanup(_app: web.Application) -> None:
        console.close()

    app.on_startup.append(started)
    app.on_cleanup.append(cleanup)
