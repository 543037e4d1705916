"""Operator endpoints: the admin API, the status page and the engines' own metrics.

Everything under ``/admin`` needs a key from ``server.admin_api_keys`` (or ``admin_open: true``);
`Proxy.middleware` enforces it. The status page at ``/`` is static and reads ``/admin/models``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from . import __version__
from .engine import log_path, read_tail
from .errors import BadRequest
from .instance import Instance, State
from .manager import Manager

log = logging.getLogger(__name__)

LOG_TAIL_MAX = 5000
ENGINE_METRICS_TIMEOUT_S = 3.0
Reloader = Callable[[], Awaitable[dict[str, Any]]]


class Admin:
    """Handlers for /admin/*, / and /metrics/engines."""

    def __init__(self, manager: Manager, session: aiohttp.ClientSession, reload: Reloader) -> None:
        self.manager = manager
        self.session = session
        self.reload_config = reload
        self.started = time.monotonic()
        self._page: bytes | None = None

    # -- views ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        memory = self.manager.memory
        models = []
        for inst in self.manager.instances.values():
            row = inst.status()
            row["memory"] = _memory_of(inst, self.manager)
            models.append(row)
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
        return web.json_response(self.snapshot())

    async def model(self, request: web.Request) -> web.Response:
        inst = self._instance(request)
        return web.json_response({**inst.status(), "memory": _memory_of(inst, self.manager)})

    def _instance(self, request: web.Request) -> Instance:
        name = request.match_info["name"]
        return self.manager.instances[self.manager.resolve(name).name]

    # -- actions -------------------------------------------------------------------------

    async def load(self, request: web.Request) -> web.Response:
        inst = self._instance(request)
        await inst.ensure_running()
        return web.json_response(inst.status())

    async def unload(self, request: web.Request) -> web.Response:
        inst = self._instance(request)
        timeout = _float_query(request, "timeout", default=30.0)
        await inst.drain_and_stop(timeout)
        return web.json_response(inst.status())

    async def pin(self, request: web.Request) -> web.Response:
        inst = self._instance(request)
        inst.pinned = request.match_info["action"] == "pin"
        return web.json_response(inst.status())

    async def logs(self, request: web.Request) -> web.Response:
        inst = self._instance(request)
        tail = int(_float_query(request, "tail", default=100))
        if not 0 < tail <= LOG_TAIL_MAX:
            raise BadRequest(f"tail must be between 1 and {LOG_TAIL_MAX}", param="tail")
        text = read_tail(log_path(inst.spec), lines=tail, max_bytes=tail * 1024)
        return web.Response(text=text + "\n" if text else "", content_type="text/plain")

    async def reload(self, request: web.Request) -> web.Response:
        return web.json_response(await self.reload_config())

    # -- status page and engine metrics --------------------------------------------------

    async def page(self, request: web.Request) -> web.Response:
        if self._page is None:
            self._page = resources.files("vllm_proxy").joinpath("static/status.html").read_bytes()
        return web.Response(body=self._page, content_type="text/html", charset="utf-8")

    async def engine_metrics(self, request: web.Request) -> web.Response:
        """Every running engine's ``vllm:`` metrics, relabelled with ``model_id``."""
        running = [
            i for i in self.manager.instances.values()
            if i.state is State.RUNNING and i.engine is not None
        ]  # fmt: skip
        texts = await asyncio.gather(*(self._scrape(i) for i in running))
        registry = CollectorRegistry()
        registry.register(_Families(_merge(zip((i.name for i in running), texts, strict=True))))
        resp = web.Response(body=generate_latest(registry))
        resp.headers["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
        return resp

    async def _scrape(self, inst: Instance) -> str:
        assert inst.engine is not None
        try:
            timeout = aiohttp.ClientTimeout(total=ENGINE_METRICS_TIMEOUT_S)
            async with self.session.get(inst.engine.base_url + "/metrics", timeout=timeout) as r:
                return await r.text() if r.status == 200 else ""
        except (aiohttp.ClientError, TimeoutError) as err:
            log.warning("%s: cannot read engine metrics: %s", inst.name, err)
            return ""


class _Families:
    """A collector that yields a fixed list of metric families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def _merge(scrapes: Any) -> list[Metric]:
    merged: dict[str, Metric] = {}
    for model_id, text in scrapes:
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError as err:
            log.warning("%s: unparsable engine metrics: %s", model_id, err)
            continue
        for fam in families:
            if not fam.name.startswith("vllm:"):
                continue
            out = merged.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
            for s in fam.samples:
                out.add_sample(s.name, {**s.labels, "model_id": model_id}, s.value, s.timestamp)
    return list(merged.values())


def _memory_of(inst: Instance, manager: Manager) -> dict[str, Any]:
    memory = manager.memory
    if memory is None or inst.name not in memory.estimates:
        return {"estimate_mb": None, "measured_mb": None, "source": None}
    est = memory.estimates[inst.name]
    return {
        "estimate_mb": est.per_device_mb,
        "measured_mb": memory.measured.get(inst.name),
        "measured_from": (
            ("process" if inst.name in memory.by_process else "device delta")
            if inst.name in memory.measured
            else None
        ),
        "source": est.source,
        "detail": est.detail,
    }


def _float_query(request: web.Request, key: str, default: float) -> float:
    raw = request.query.get(key)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise BadRequest(f"{key} must be a number", param=key) from None


def add_admin_routes(app: web.Application, admin: Admin) -> None:
    app.router.add_get("/", admin.page)
    app.router.add_get("/metrics/engines", admin.engine_metrics)
    app.router.add_get("/admin/models", admin.models)
    app.router.add_get("/admin/models/{name}", admin.model)
    app.router.add_post("/admin/models/{name}/load", admin.load)
    app.router.add_post("/admin/models/{name}/unload", admin.unload)
    app.router.add_post("/admin/models/{name}/{action:pin|unpin}", admin.pin)
    app.router.add_get("/admin/models/{name}/logs", admin.logs)
    app.router.add_post("/admin/reload", admin.reload)
