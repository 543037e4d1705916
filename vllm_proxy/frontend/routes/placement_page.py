"""What this proxy holds, for whoever places models across servers.

* ``GET /placement`` (JSON, `PLACEMENT_VERSION`): per model its state here, its instances, its
  footprint per GPU and whether one more instance would start now without evicting anyone
  (else what its start would put to sleep or stop); per GPU total, used, claimed and free
  memory; the admission queue's depth. `vllm-proxy-fleet` reads it from every proxy.
* ``GET /metrics/model-server``: the same in the model-server protocol of the Gateway API
  Inference Extension (llm-d's endpoint picker), one series per name: requests waiting and
  running, memory pressure as ``vllm:kv_cache_usage_perc``, and ``vllm:lora_requests_info``
  whose lists name the models awake here (running) and those starting, waking or asleep here
  (waiting), so the picker's LoRA-affinity scorer sends each model where it lives.

Both are read-only, guarded like ``/metrics`` (``server.metrics_api_keys``), and computed from
the planner's own view (`Admission.fits` runs the real `planner.plan` for every model from one
snapshot, claiming nothing). Pickers and fleets poll many times a second: both pages are made
together, from one view, at most once per `VIEW_TTL_S` by a task of their own while someone
polls (none when nobody does), and the handlers only send the bytes last made (a view made per
request held the event loop for every poll: docs/reliability.md). Engine totals come from the
last round of engine reads (`Admin.refresh_engine_sums`), never waited for.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from ...pool.manager import Manager
from ...pool.views import Fit, InstanceView, Model, fit, fits, instances
from .admin import Admin, Families

#: The shape of ``/placement``; a consumer refuses another.
PLACEMENT_VERSION = 1
#: How often the pages are made again while someone polls them (0: at every request).
VIEW_TTL_S = 1.0
log = logging.getLogger(__name__)
#: Each model's state as ``/placement`` names it, from `Model.state`.
STATES = {
    "running": "awake",
    "sleeping": "asleep",
    "starting": "starting",
    "waking": "waking",
}


class Holdings:
    """Handlers for ``/placement`` and ``/metrics/model-server``."""

    def __init__(self, manager: Manager, admin: Admin) -> None:
        self.manager = manager
        self.admin = admin
        #: The pages last made: (``/placement`` JSON, ``/metrics/model-server`` text).
        self._pages: tuple[bytes, bytes] | None = None
        self._polled = False
        self._refresher: asyncio.Task[None] | None = None
        #: Each model's `Admission.fits` answer while a view is made.
        self._fits: dict[str, Fit] = {}

    def pages(self) -> tuple[bytes, bytes]:
        """The pages last made (made now when there are none yet, or `VIEW_TTL_S` is 0); a
        poll keeps the refresher running."""
        if self._pages is None or VIEW_TTL_S <= 0:
            self._pages = self._make()
        self._polled = True
        if self._refresher is None and VIEW_TTL_S > 0:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh())
        return self._pages

    def _make(self) -> tuple[bytes, bytes]:
        view = self.view()
        return json.dumps(view).encode(), self.model_server_page(view)

    async def _refresh(self) -> None:
        """Make the pages again every `VIEW_TTL_S` while they are polled; end after an
        interval without a poll (the next poll starts it again)."""
        try:
            while True:
                await asyncio.sleep(VIEW_TTL_S)
                if not self._polled:
                    return
                self._polled = False
                try:
                    self._pages = self._make()
                except Exception:  # the last pages stay; the next round tries again
                    log.exception("making /placement failed")
        finally:
            self._refresher = None

    def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()

    async def placement(self, request: web.Request) -> web.Response:
        return web.Response(body=self.pages()[0], content_type="application/json")

    async def model_server(self, request: web.Request) -> web.Response:
        self.admin.refresh_engine_sums()
        resp = web.Response(body=self.pages()[1])
        resp.headers["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
        return resp

    # -- the JSON view -------------------------------------------------------------------

    def view(self) -> dict[str, Any]:
        manager = self.manager
        models = list(manager.models.values())
        adm = manager.admission
        memory = manager.memory
        self._fits = {}
        if adm is not None and memory is not None:
            memory.refresh()  # (the readings first: every row and GPU from the same ones)
            self._fits = fits(adm, [m.spec for m in models if m.name in memory.estimates])
        return {
            "version": PLACEMENT_VERSION,
            "closing": manager.closing,
            "memory": manager.memory.kind if manager.memory is not None else "none",
            "active_requests": manager.active_leases(),
            "queue": self._queue(models),
            "gpus": self._gpus(),
            "models": [self._model(m) for m in models],
        }

    def _queue(self, models: list[Model]) -> dict[str, int]:
        """Requests waiting for a start or a wake, and requests held behind another model's
        turn for memory; `depth` is both."""
        waiting = sum(m.waiting for m in models)
        held = sum(1 for t in self.manager.queue.tickets.values() if t.held)
        return {"waiting": waiting, "held": held, "depth": waiting + held}

    def _gpus(self) -> list[dict[str, int]]:
        adm = self.manager.admission
        memory = self.manager.memory
        if adm is None or memory is None:
            return []
        claimed = memory.claimed_by_device()
        return [
            {
                "id": d.id,
                "total_mb": d.total_mb,
                "used_mb": d.used_mb,
                "claimed_mb": claimed.get(d.id, 0),
                "free_mb": max(d.total_mb - d.used_mb - d.pending_mb - memory.reserve_mb, 0),
            }
            for d in adm.devices()
        ]

    def _model(self, model: Model) -> dict[str, Any]:
        memory = self.manager.memory
        state = model.state().value
        shown = instances(model)
        asleep = [i.sleep_level for i in shown if i.asleep]
        row: dict[str, Any] = {
            "name": model.name,
            "names": self.names(model, shown),
            "state": STATES.get(state, "stopped"),
            "sleep_level": min(asleep) if state == "sleeping" and asleep else None,
            "load": sum(i.leases for i in shown) + model.waiting,
            "instances": [
                {
                    "id": i.id,
                    "state": i.state,
                    "sleep_level": i.sleep_level if i.asleep else None,
                    "devices": list(i.devices),
                    "leases": i.leases,
                    "held_mb": memory.held_mb(i.id)
                    if memory is not None and i.id in memory.claims
                    else None,
                }
                for i in shown
            ],
            "footprint_mb": None,
            "gpus": None,
            "fits_now": True,
            "evict_cost": None,
        }
        adm = self.manager.admission
        if adm is None or memory is None or model.name not in memory.estimates:
            return row  # memory is not managed: nothing is ever evicted for room
        row["footprint_mb"] = memory.footprint(model.name)
        row["gpus"] = memory.estimates[model.name].gpus
        known = self._fits
        decision = known[model.name] if model.name in known else fit(adm, model.spec)
        if not decision.possible:
            row["fits_now"] = False
            row["evict_cost"] = {
                "possible": False,
                "reason": decision.reason,
                "sleep": [],
                "evict": [],
                "sleep_mb": 0,
                "evict_mb": 0,
            }
        elif not decision.now:
            row["fits_now"] = False
            row["evict_cost"] = self._cost(decision)
        return row

    def _cost(self, decision: Fit) -> dict[str, Any]:
        """What a start would take from the others, in MiB over all their devices."""
        memory = self.manager.memory
        assert memory is not None

        def mb(ids: tuple[str, ...]) -> int:
            return sum(
                memory.held_mb(i) * len(memory.claims[i].devices) for i in ids if i in memory.claims
            )

        return {
            "possible": True,
            "reason": None,
            "sleep": list(decision.sleep),
            "evict": list(decision.evict),
            "sleep_mb": mb(decision.sleep),
            "evict_mb": mb(decision.evict),
        }

    def names(self, model: Model, shown: list[InstanceView] | None = None) -> list[str]:
        """Every name a request may give for `model`: its own, its aliases, its configured
        adapters' names and aliases, and adapters from its folder an engine holds (`shown`:
        its instances, when they were viewed already)."""
        out = [model.name, *model.spec.aliases]
        for a in model.spec.adapters:
            out += [a.name, *a.aliases]
        for inst in instances(model) if shown is None else shown:
            out += [n for n in inst.adapters if n not in out]
        return list(dict.fromkeys(out))

    # -- the model-server page -----------------------------------------------------------

    def model_server_page(self, view: dict[str, Any] | None = None) -> bytes:
        view = view if view is not None else self.view()
        running: list[str] = []
        waiting: list[str] = []
        for row in view["models"]:
            names = [n for n in row["names"] if "," not in n]
            if row["state"] == "awake":
                running += names
            elif row["state"] in ("asleep", "starting", "waking"):
                waiting += names
        sums = self.admin.engine_sums
        engines_running = sums.get("vllm:num_requests_running")
        families: list[Metric] = [
            _gauge(
                "vllm:num_requests_waiting",
                "Requests waiting: the proxy's admission queue and the engines' own queues.",
                view["queue"]["depth"] + sums.get("vllm:num_requests_waiting", 0.0),
            ),
            _gauge(
                "vllm:num_requests_running",
                "Requests the engines are serving.",
                engines_running if engines_running is not None else view["active_requests"],
            ),
            _gauge(
                "vllm:kv_cache_usage_perc",
                "Memory pressure: GPU memory claimed by the proxy's engines over the total.",
                _pressure(view["gpus"]),
            ),
        ]
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Models and adapters awake here (running), starting, waking or asleep here"
            " (waiting), and how many names the server holds with what still fits (max_lora).",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        room = len(running) + len(waiting) + _more_fit(view)
        info.add_metric([",".join(running), ",".join(waiting), str(room)], time.time())
        families.append(info)
        registry = CollectorRegistry()
        registry.register(Families(families))
        return generate_latest(registry)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _pressure(gpus: list[dict[str, int]]) -> float:
    total = sum(g["total_mb"] for g in gpus)
    return min(sum(g["claimed_mb"] for g in gpus) / total, 1.0) if total else 0.0


def _more_fit(view: dict[str, Any]) -> int:
    """How many of the stopped models would still start here without evicting anyone, packed
    smallest first into the free memory (unmanaged memory: every stopped model)."""
    stopped = [m for m in view["models"] if m["state"] == "stopped" and m["fits_now"]]
    if not view["gpus"]:
        return len(stopped)
    free = sorted(g["free_mb"] for g in view["gpus"])
    count = 0
    for m in sorted(stopped, key=lambda m: m["footprint_mb"] or 0):
        need, gpus = m["footprint_mb"] or 0, m["gpus"] or 1
        fitting = [i for i, f in enumerate(free) if f >= need]
        if len(fitting) < gpus:
            continue
        for i in fitting[:gpus]:
            free[i] -= need
        free.sort()
        count += 1
    return count


def add_placement_routes(app: web.Application, holdings: Holdings) -> None:
    app.router.add_get("/placement", holdings.placement)
    app.router.add_get("/metrics/model-server", holdings.model_server)

    async def close(_app: web.Application) -> None:
        holdings.close()

    app.on_cleanup.append(close)
