"""Operator endpoints: the admin API, the status page and the engines' own metrics.

Everything under ``/admin`` needs a key from ``server.admin_api_keys`` (or ``admin_open: true``);
`Serving.middleware` enforces it. The console at ``/`` is static (its routes: `console`), sent
with the console's Content-Security-Policy.

``/metrics/engines`` reads every engine's own page, at most ``server.max_engine_metrics_mb`` of
each (a larger one is left out, with a warning), parses and renders them in a worker thread (a
large page takes seconds to parse), and keeps the result for `ENGINE_METRICS_TTL_S`: scrapes in a
burst share one round of engine reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from ... import __version__
from ...config import ServerConfig
from ...errors import BadRequest, NotFound
from ...pool.lease import Lease
from ...pool.manager import Manager
from ...pool.views import EngineView, Model, engines, read_tail, shown_instances
from .console import PAGE_HEADERS

log = logging.getLogger(__name__)

LOG_TAIL_MAX = 5000
ENGINE_METRICS_TIMEOUT_S = 3.0
#: How long a merged page of the engines' metrics is served again without reading the engines.
ENGINE_METRICS_TTL_S = 1.0
Reloader = Callable[[], Awaitable[dict[str, Any]]]


class Admin:
    """Handlers for /admin/*, / and /metrics/engines."""

    def __init__(
        self,
        manager: Manager,
        session: aiohttp.ClientSession,
        server: ServerConfig,
        reload: Reloader | None = None,
    ) -> None:
        self.manager = manager
        self.session = session
        self.reload_config = reload
        self.started = time.monotonic()
        self._page: bytes | None = None
        self.configure(server)
        #: The last merged engine page and when it was made; the round of reads under way.
        self._engine_page: tuple[float, bytes] | None = None
        self._engine_round: asyncio.Task[tuple[bytes, dict[str, float]]] | None = None
        #: Totals over the engines of the last round (`SUMMED`), for the model-server page.
        self.engine_sums: dict[str, float] = {}
        #: Instances whose oversized page was reported (once each, while they live).
        self._too_large: set[str] = set()

    def configure(self, server: ServerConfig) -> None:
        """Apply the keys of a (re)loaded config."""
        self.engine_metrics_max = int(server.max_engine_metrics_mb * 1024 * 1024)

    def close(self) -> None:
        """Cancel a round of engine reads under way (the proxy is closing)."""
        if self._engine_round is not None:
            self._engine_round.cancel()

    # -- views ---------------------------------------------------------------------------

    def snapshot(self, base_url: str = "") -> dict[str, Any]:
        memory = self.manager.memory
        models = self.manager.snapshot()
        for row in models:
            row["base_urls"] = _base_urls(base_url, row["name"])
        gpus = []
        if memory is not None:
            for s in memory.refresh():
                gpus.append(
                    {"id": s.id, "total_mb": s.total_mb, "used_mb": s.used_mb,
                     "free_mb": s.free_mb, "util_percent": s.util_percent}
                )  # fmt: skip
        return {
            "proxy": {
                "version": __version__,
                "now": time.time(),
                "uptime_s": round(time.monotonic() - self.started, 3),
                "closing": self.manager.closing,
                "memory": memory.kind if memory else "none",
                "active_requests": self.manager.active_leases(),
            },
            "gpus": gpus,
            "models": models,
        }

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(self.snapshot(_origin(request)))

    async def model(self, request: web.Request) -> web.Response:
        return web.json_response(self._row(request))

    def _model(self, request: web.Request) -> Model:
        return self.manager.resolve(request.match_info["name"])

    def _row(self, request: web.Request) -> dict[str, Any]:
        name = self._model(request).name
        row = next(r for r in self.manager.snapshot() if r["name"] == name and not r["removed"])
        row["base_urls"] = _base_urls(_origin(request), name)
        return row

    # -- actions -------------------------------------------------------------------------

    async def load(self, request: web.Request) -> web.Response:
        async with Lease(self._model(request)):  # starts one unless one serves; errors as
            pass  # for requests
        return web.json_response(self._row(request))

    async def unload(self, request: web.Request) -> web.Response:
        timeout = _float_query(request, "timeout", default=30.0)
        await self._model(request).unload(timeout)
        return web.json_response(self._row(request))

    async def sleep(self, request: web.Request) -> web.Response:
        """Put the model to sleep (``?level=1|2``, default its policy's); in-flight requests
        get ``?timeout=`` seconds (default 30) to finish first, else 409."""
        model = self._model(request)
        level = None
        if "level" in request.query:
            raw = request.query["level"]
            if raw not in ("1", "2"):
                raise BadRequest("level must be 1 or 2", param="level")
            level = int(raw)
        await model.sleep(level, _float_query(request, "timeout", default=30.0))
        return web.json_response(self._row(request))

    async def wake(self, request: web.Request) -> web.Response:
        """Wake the model's sleeping instance (as the next request would); 409 when none."""
        await self._model(request).wake()
        return web.json_response(self._row(request))

    async def clear_wake_check(self, request: web.Request) -> web.Response:
        """Use again the sleep levels a model stopped using after failed wake checks."""
        model = self._model(request)
        cleared = model.clear_wake_check()
        return web.json_response({"model": model.name, "cleared_levels": cleared})

    async def pin(self, request: web.Request) -> web.Response:
        self._model(request).pinned = request.match_info["action"] == "pin"
        return web.json_response(self._row(request))

    async def logs(self, request: web.Request) -> web.Response:
        """The last lines of each live instance's log (and of the last one that ended), each
        under a ``==> <instance id> (<state>) <==`` header; ``?instance=ID`` for just one."""
        model = self._model(request)
        tail = _float_query(request, "tail", default=100)
        if not (tail == tail and 0 < tail <= LOG_TAIL_MAX):  # tail == tail: not NaN
            raise BadRequest(f"tail must be between 1 and {LOG_TAIL_MAX}", param="tail")
        lines = int(tail)
        wanted = request.query.get("instance")
        shown = shown_instances(model)
        if wanted is not None:
            shown = [i for i in shown if i.id == wanted]
            if not shown:
                raise NotFound(f"model '{model.name}' has no instance '{wanted}' to show",
                               code="instance_not_found", param="instance")  # fmt: skip
        parts = []
        for inst in shown:
            text = read_tail(inst.log_path, lines=lines, max_bytes=lines * 1024)
            state = inst.state  # the state operators see everywhere else
            parts.append(f"==> {inst.id} ({state}) <==\n{text}\n" if text else "")
        return web.Response(text="".join(parts), content_type="text/plain")

    async def reload(self, request: web.Request) -> web.Response:
        if self.reload_config is None:
            raise BadRequest("the proxy cannot reload its config", code="invalid_config")
        return web.json_response(await self.reload_config())

    # -- status page and engine metrics --------------------------------------------------

    async def page(self, request: web.Request) -> web.Response:
        if self._page is None:
            self._page = resources.files("vllm_proxy").joinpath("static/status.html").read_bytes()
        resp = web.Response(body=self._page, content_type="text/html", charset="utf-8")
        resp.headers.update(PAGE_HEADERS)
        return resp

    async def engine_metrics(self, request: web.Request) -> web.Response:
        """Every running or sleeping engine's ``vllm:`` metrics, relabelled with ``model_id``
        and ``instance``."""
        resp = web.Response(body=await self._engine_metrics_page())
        resp.headers["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
        return resp

    async def _engine_metrics_page(self) -> bytes:
        cached = self._engine_page
        if cached is not None and time.monotonic() - cached[0] < ENGINE_METRICS_TTL_S:
            return cached[1]
        # Shielded: a scraper that hangs up does not cancel the round the others wait for.
        return (await asyncio.shield(self._start_round()))[0]

    def _start_round(self) -> asyncio.Task[tuple[bytes, dict[str, float]]]:
        if self._engine_round is None:
            self._engine_round = asyncio.ensure_future(self._read_engines())
            self._engine_round.add_done_callback(self._round_done)
        return self._engine_round

    def refresh_engine_sums(self) -> None:
        """Start a round of engine reads when the last one is older than
        `ENGINE_METRICS_TTL_S` (`engine_sums` then changes when it ends); never waits."""
        cached = self._engine_page
        if cached is None or time.monotonic() - cached[0] >= ENGINE_METRICS_TTL_S:
            self._start_round()

    def _round_done(self, task: asyncio.Task[tuple[bytes, dict[str, float]]]) -> None:
        self._engine_round = None
        if not task.cancelled() and task.exception() is None:
            page, sums = task.result()
            self._engine_page = (time.monotonic(), page)
            self.engine_sums = sums

    async def _read_engines(self) -> tuple[bytes, dict[str, float]]:
        running = engines(self.manager)
        self._too_large &= {i.id for i in running}
        pages = await asyncio.gather(*(self._scrape(i) for i in running))
        read = [(i.name, i.id, p) for i, p in zip(running, pages, strict=True) if p is not None]
        return await asyncio.to_thread(_render, read)

    async def _scrape(self, inst: EngineView) -> bytes | None:
        """The engine's page, or None: not answered, or larger than the bound."""
        limit = self.engine_metrics_max
        try:
            timeout = aiohttp.ClientTimeout(total=ENGINE_METRICS_TIMEOUT_S)
            client = inst.client(self.session)
            async with client.get(inst.base_url + "/metrics", timeout=timeout) as r:
                if r.status != 200:
                    return None
                if r.content_length is not None and r.content_length > limit:
                    self._report_too_large(inst, r.content_length)
                    return None
                page = bytearray()
                async for chunk in r.content.iter_any():
                    page += chunk
                    if len(page) > limit:  # no length given, or a compressed page
                        self._report_too_large(inst, None)
                        return None
                return bytes(page)
        except (aiohttp.ClientError, TimeoutError, RuntimeError) as err:  # closed: it exited
            log.warning("%s: cannot read engine metrics: %s", inst.id, err)
            return None

    def _report_too_large(self, inst: EngineView, size: int | None) -> None:
        if inst.id in self._too_large:
            return
        self._too_large.add(inst.id)
        shown = f" ({size / 2**20:.1f} MiB)" if size is not None else ""
        log.warning(
            "%s: engine metrics page%s is over server.max_engine_metrics_mb (%g): left out of "
            "/metrics/engines", inst.id, shown, self.engine_metrics_max / 2**20,
        )  # fmt: skip


#: Engine gauges summed over every engine in a round (`Admin.engine_sums`).
SUMMED = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def _render(pages: list[tuple[str, str, bytes]]) -> tuple[bytes, dict[str, float]]:
    """The engines' pages (model name, instance id, page) merged and rendered, and the totals
    of `SUMMED`; CPU-bound, run in a worker thread."""
    families = _merge(pages)
    sums = {name: 0.0 for name in SUMMED}
    for fam in families:
        if fam.name in sums:
            sums[fam.name] += sum(s.value for s in fam.samples if s.name == fam.name)
    registry = CollectorRegistry()
    registry.register(Families(families))
    return generate_latest(registry), sums


class Families:
    """A collector that yields a fixed list of metric families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def _merge(pages: list[tuple[str, str, bytes]]) -> list[Metric]:
    merged: dict[str, Metric] = {}
    for name, iid, page in pages:
        labels = {"model_id": name, "instance": iid}
        try:
            text = page.decode("utf-8")
            families = list(text_string_to_metric_families(text))
        except ValueError as err:  # UnicodeDecodeError is one too
            log.warning("%s: unparsable engine metrics: %s", iid, err)
            continue
        for fam in families:
            if not fam.name.startswith("vllm:"):
                continue
            out = merged.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
            for s in fam.samples:
                out.add_sample(s.name, {**s.labels, **labels}, s.value, s.timestamp)
    return list(merged.values())


def _origin(request: web.Request) -> str:
    return f"{request.scheme}://{request.host}"


def _base_urls(origin: str, name: str) -> dict[str, str]:
    """The OpenAI base URLs that reach the model: ``/v1`` with its name in the body, or the
    prefixed one where the path picks the model."""
    return {"v1": f"{origin}/v1", "serve": f"{origin}/serve/{quote(name, safe='')}/v1"}


def _float_query(request: web.Request, key: str, default: float) -> float:
    raw = request.query.get(key)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest(f"{key} must be a number", param=key) from None
    if value != value or value in (float("inf"), float("-inf")):
        raise BadRequest(f"{key} must be a finite number", param=key)
    return value


def add_admin_routes(app: web.Application, admin: Admin) -> None:
    app.router.add_get("/", admin.page)
    app.router.add_get("/metrics/engines", admin.engine_metrics)
    app.router.add_get("/admin/models", admin.models)
    app.router.add_get("/admin/models/{name}", admin.model)
    app.router.add_post("/admin/models/{name}/load", admin.load)
    app.router.add_post("/admin/models/{name}/unload", admin.unload)
    app.router.add_post("/admin/models/{name}/{action:pin|unpin}", admin.pin)
    app.router.add_post("/admin/models/{name}/sleep", admin.sleep)
    app.router.add_post("/admin/models/{name}/wake", admin.wake)
    app.router.add_post("/admin/models/{name}/wake_check/clear", admin.clear_wake_check)
    app.router.add_get("/admin/models/{name}/logs", admin.logs)
    app.router.add_post("/admin/reload", admin.reload)
