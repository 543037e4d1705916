"""The set of models: names and aliases, admission by GPU memory, reload, drain and shutdown.

The `Manager` maps names and aliases to `Model`s (each the owner of its instances), decides
admission to `Admission` (the one queue, the pure `planner.plan()` over every live instance,
turns, reorder windows, minimum residency), which asks instances to evict themselves; neither
changes an instance's state directly. Admin and proxy read
`snapshot()`, never Memory's or an instance's internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from ..adapters import AdapterSpec, find_in, list_folder
from ..config import ModelSpec
from ..engines.instance import Instance
from ..engines.model import Model
from ..engines.ports import EngineContext
from ..engines.states import AWAKE, State
from ..errors import BadRequest, NotFound, Unavailable, consume_exception
from ..planning.memory import Memory, same_engine
from ..planning.queueing import Queue, Rules
from .admission import Admission
from .journal import Journal
from .lease import Lease
from .roster import Roster

log = logging.getLogger(__name__)

#: An unknown model name is quoted in the 404 up to this many characters (a client's 32 MB
#: "model" is not echoed back).
NAME_SHOWN = 200
#: On a forced exit: how long the guards get to stop their engine trees before the group kill.
FORCED_KILL_GRACE_S = 0.3


#: A listing of an adapters folder serves ``GET /v1/models`` for this long.
LISTING_TTL_S = 2.0


class Manager:
    """All configured models by name and alias, admission by GPU memory, proxy-wide operations."""

    def __init__(
        self,
        specs: dict[str, ModelSpec],
        ctx: EngineContext[Instance],
        roster: Roster,
        memory: Memory | None = None,
        admission: Admission | None = None,
        queue_timeout_s: float = 30.0,
        max_queue: int = 1024,
        rules: Rules | None = None,
    ) -> None:
        """`ctx` is built whole beforehand, with `roster` as its pool hooks and, where memory
        is managed, `memory` as its memory book and `admission` as its admission port."""
        assert ctx.pool is roster and (admission is None or ctx.admission is admission)
        self.ctx = ctx
        self.roster = roster
        self.memory = memory
        self.max_queue = max_queue
        #: The one admission queue (shared with every model and instance through `ctx`).
        self.queue: Queue = ctx.queue
        self.queue.rules = rules or Rules(queue_timeout_s=queue_timeout_s)
        #: GPU memory admission (None: memory is not managed).
        self.admission = admission
        roster.models = {n: self._new_model(s) for n, s in specs.items()}
        self.names: dict[str, str] = {}
        self._index_names()
        self.closing = False
        self._background: asyncio.Task[None] | None = None
        #: Listings of adapters folders (`_listing`): when each began, and its task.
        self._listings: dict[str, tuple[float, asyncio.Future[list[AdapterSpec]]]] = {}
        #: Preloads still running, by model name.
        self.preloading: dict[str, asyncio.Task[None]] = {}

    @property
    def models(self) -> dict[str, Model]:
        """Every configured model by name (held by the roster)."""
        return self.roster.models

    @models.setter
    def models(self, models: dict[str, Model]) -> None:
        self.roster.models = models

    @property
    def removed(self) -> set[Model]:
        """Models removed by a reload whose instances still drain or stop."""
        return self.roster.removed

    @property
    def journal(self) -> Journal:
        """State changes and memory over time, for the console."""
        return self.roster.journal

    @property
    def queue_timeout_s(self) -> float:
        """How long a start or wake waits for memory (``admission.queue_timeout_s``)."""
        return self.queue.rules.queue_timeout_s

    @queue_timeout_s.setter
    def queue_timeout_s(self, value: float) -> None:
        self.queue.rules = dataclasses.replace(self.queue.rules, queue_timeout_s=value)

    def _new_model(self, spec: ModelSpec) -> Model:
        evict_more = self.admission.evict_more if self.admission is not None else None
        return Model(spec, self.ctx, self.ctx.registry.new_id, self.max_queue, evict_more)

    def _index_names(self) -> None:
        names = {}
        adapters: dict[str, tuple[str, AdapterSpec]] = {}
        for name, model in self.models.items():
            names[name] = name
            for alias in model.spec.aliases:
                names[alias] = name
            for a in model.spec.adapters:
                for n in (a.name, *a.aliases):
                    adapters[n] = (name, a)
        self.names = names
        #: LoRA adapters by name and alias: (the base model's name, the adapter).
        self.adapter_names = adapters

    def all_instances(self) -> list[Instance]:
        """Every live instance, of configured and of removed models."""
        return self.roster.all_instances()

    def instance(self, iid: str) -> Instance | None:
        return next((i for i in self.all_instances() if i.id == iid), None)

    def start(self) -> None:
        """Start background work (the NVML refresher); call inside the running loop."""
        if self.memory is not None:
            self._background = asyncio.ensure_future(self.memory.run(self._engine_groups))

    def preload(self, names: list[str] | None = None) -> None:
        """Start the models marked ``preload`` (or those of `names` that are) in the background;
        those with a sleep policy go to sleep once up. `preloading` lists the ones under way."""
        for name, model in self.models.items():
            if not model.spec.preload or (names is not None and name not in names):
                continue
            if name in self.preloading:
                continue
            task = asyncio.ensure_future(model.preload())
            self.preloading[name] = task

            def done(t: asyncio.Task[None], name: str = name) -> None:
                if self.preloading.get(name) is t:
                    del self.preloading[name]
                consume_exception(t)

            task.add_done_callback(done)

    def _engine_groups(self) -> dict[str, tuple[int, float]]:
        """Every awake (RUNNING or DRAINING) engine's process group, with when it (last) woke
        or became ready."""
        return {
            i.id: (i.engine.pid, i.running_since)
            for i in self.all_instances()
            if i.state in AWAKE and i.engine is not None and i.engine.pid is not None
        }

    def resolve(self, requested: str, visible: Callable[[Model], bool] | None = None) -> Model:
        """The model serving `requested` (a model name or alias), or `NotFound`. With
        `visible` (an API key's scope), a model it refuses is not found either, in the same
        words, and the names listed are only those of the models it accepts."""
        name = self.names.get(requested)
        if name is not None and (visible is None or visible(self.models[name])):
            return self.models[name]
        if visible is None:
            valid = ", ".join(sorted(self.names)) or "(none configured)"
        else:
            shown = (n for n, target in self.names.items() if visible(self.models[target]))
            valid = ", ".join(sorted(shown)) or "(none)"
        shown_name = requested if len(requested) <= NAME_SHOWN else requested[:NAME_SHOWN] + "..."
        raise NotFound(
            f"The model '{shown_name}' does not exist. Available models: {valid}", param="model"
        )

    def resolve_target(
        self, requested: str, visible: Callable[[Model], bool] | None = None
    ) -> tuple[Model, AdapterSpec | None]:
        """The model serving `requested`, with the LoRA adapter it names (None for a model
        name or alias; see `find_adapter`). `NotFound` as `resolve()`."""
        return self.find_adapter(requested, visible) or (self.resolve(requested, visible), None)

    def find_adapter(
        self, requested: str, visible: Callable[[Model], bool] | None = None
    ) -> tuple[Model, AdapterSpec] | None:
        """The LoRA adapter `requested` names and its base model: a configured adapter or
        alias, else a sub-folder of a model's ``adapters_dir`` with an
        ``adapter_config.json`` (looked up now, so an adapter copied there is served without
        a reload). Model names win over adapters; an adapter of a model that `visible` (an
        API key's scope) refuses is not found. A name found in the folders of two models the
        key may use is refused (`BadRequest`), never given to either: a key scoped to one of
        them finds its own."""
        if requested in self.names:
            return None
        found = self.adapter_names.get(requested)
        if found is None:
            return self._discover(requested, visible)
        model = self.models[found[0]]
        return (model, found[1]) if visible is None or visible(model) else None

    def _discover(
        self, requested: str, visible: Callable[[Model], bool] | None
    ) -> tuple[Model, AdapterSpec] | None:
        """The adapter named `requested` in the ``adapters_dir`` of a model `visible` allows;
        `BadRequest` when two such models have one of that name."""
        found = []
        for model in self.models.values():
            folder = model.spec.adapters_dir
            if folder is None or (visible is not None and not visible(model)):
                continue
            spec = find_in(folder, requested)
            if spec is not None:
                found.append((model, spec))
        if len(found) > 1:
            bases = " and ".join(repr(m.name) for m, _ in found)
            raise BadRequest(
                f"{requested!r} is an adapter in the adapters_dir of models {bases}, so it"
                " names neither: the operator renames one, or a key scoped to one model uses"
                " its own",
                code="ambiguous_adapter",
                param="model",
            )
        return found[0] if found else None

    async def adapter_entries(
        self, visible: Callable[[Model], bool] | None = None
    ) -> list[tuple[str, Model, AdapterSpec]]:
        """Every adapter name and alias clients may use now (of the models `visible` allows),
        with its base model and adapter: configured ones first, then those in the models'
        folders (as many as `adapters.list_folder` reads, listed by `_listing`; a name a model
        or another adapter has is not one, nor one in two of these folders: `find_adapter`
        refuses it). Only the folders of models `visible` allows are listed."""
        out = [
            (n, self.models[base], a)
            for n, (base, a) in self.adapter_names.items()
            if visible is None or visible(self.models[base])
        ]
        taken = set(self.names) | set(self.adapter_names)
        found: dict[str, list[tuple[Model, AdapterSpec]]] = {}
        for model in self.models.values():
            folder = model.spec.adapters_dir
            if folder is not None and (visible is None or visible(model)):
                for a in await self._listing(folder):
                    if a.name not in taken:
                        found.setdefault(a.name, []).append((model, a))
        out += [(name, *seen[0]) for name, seen in found.items() if len(seen) == 1]
        return out

    async def _listing(self, folder: str) -> list[AdapterSpec]:
        """The adapters in `folder`, listed in a thread (a folder of thousands of entries
        takes the disk's time, not the event loop's). One listing serves every call while it
        runs and for `LISTING_TTL_S` after it began."""
        now = time.monotonic()
        cached = self._listings.get(folder)
        if cached is None or now - cached[0] >= LISTING_TTL_S:
            self._listings = {f: c for f, c in self._listings.items() if now - c[0] < LISTING_TTL_S}
            task = asyncio.ensure_future(asyncio.to_thread(list_folder, folder))
            cached = self._listings[folder] = (now, task)
        return await asyncio.shield(cached[1])

    def lease(
        self,
        model: str | Model,
        session: str | None = None,
        adapter: str | None = None,
        priority: int = 0,
    ) -> Lease:
        """``async with manager.lease(name) as up:`` holds a lease for the body; `up` is the
        engine's `Upstream` handle (see `lease`).

        `session` is the value of the model's affinity header, if any; `adapter` the LoRA
        adapter the request names (a replica holding it is preferred); `priority` the API
        key's (see `model.rank_of`). Raises `NotFound` for an unknown name and `Unavailable`
        while shutting down.
        """
        if self.closing:
            raise Unavailable("the proxy is shutting down", code="shutting_down")
        target = self.resolve(model) if isinstance(model, str) else model
        return Lease(target, session, adapter, priority)

    def update_metrics(self) -> None:
        """Refresh the request gauges from the leases (at scrape time: the request path itself
        touches no metric for a lease)."""
        metrics = self.ctx.metrics
        for model in self.models.values():
            total = 0
            for inst in model.instances:
                total += inst.leases
                metrics.instance_active.labels(model.name, inst.id).set(inst.leases)
            metrics.active.labels(model.name).set(total)

    def active_leases(self) -> int:
        return sum(i.leases for i in self.all_instances())

    # -- reload --------------------------------------------------------------------------

    def reload(self, specs: dict[str, ModelSpec], drain_timeout_s: float) -> dict[str, list[str]]:
        """Reconcile model by model; unchanged models keep their instances (same pid and port).

        Added models become routable; removed ones stop being routable and their instances
        drain and stop; a model whose engine (command, model, args, env) changed, or whose
        memory or devices now need another placement, gets a new instance while the old ones
        drain. The caller has validated `specs` as a whole (and the memory plan).
        """
        report: dict[str, list[str]] = {"added": [], "removed": [], "restarted": [], "kept": []}
        models: dict[str, Model] = {}
        asleep = {n for n, m in self.models.items() if m.sleeper() is not None}
        for name, spec in specs.items():
            cur = self.models.get(name)
            if cur is None:
                models[name] = self._new_model(spec)
                report["added"].append(name)
                continue
            restart = self._needs_new_instance(cur, spec)
            cur.update(spec, drain_timeout_s, restart)
            self.queue.rerank(name, spec.priority)  # requests waiting now take the new one
            cur.max_queue = self.max_queue
            models[name] = cur
            report["restarted" if restart else "kept"].append(name)
        for name, cur in self.models.items():
            if name not in specs:
                self._remove(cur, drain_timeout_s)
                report["removed"].append(name)
        self.models = models
        self._index_names()
        self.roster.on_capacity()
        # A restarted model whose pool was asleep has nothing coming up: preload it again.
        pools = [n for n in report["restarted"] if n in asleep and models[n].starting() is None]
        self.preload(report["added"] + pools)
        log.info("reloaded: %s", ", ".join(f"{k} {v}" for k, v in report.items() if v) or "none")
        return report

    def _needs_new_instance(self, model: Model, spec: ModelSpec) -> bool:
        """Whether the running instances cannot take `spec` in place: a different engine, or a
        memory/devices change that moves the engine or changes what it is started with."""
        if model.spec.engine_key() != spec.engine_key():
            return True
        if self.memory is None:
            return False
        updates = {}
        for inst in model.instances:
            claim = self.memory.claims.get(inst.id)
            if claim is None:
                continue
            allowed = spec.devices is None or set(claim.devices) <= set(spec.devices)
            new = self.memory.placement(spec, claim.devices) if allowed else None
            if new is None or not same_engine(new, claim):
                return True
            updates[inst.id] = dataclasses.replace(new, overrides=claim.overrides)
        for iid, new in updates.items():  # the same engines, a new budget
            self.memory.claim(iid, new)
        return False

    def _remove(self, model: Model, drain_timeout_s: float) -> None:
        stops = model.remove(drain_timeout_s)
        starting = model.starting()
        if not model.instances and starting is None:
            if all(m.name != model.name for m in self.removed):  # none of an older one drains
                self.ctx.metrics.forget_model(model.name)
            return
        self.removed.add(model)  # still counted (and stopped at shutdown) until it is down

        async def gone() -> None:
            await asyncio.gather(*stops, return_exceptions=True)
            if starting is not None:
                await asyncio.gather(starting, return_exceptions=True)
            await asyncio.gather(*(i.stop() for i in list(model.instances)), return_exceptions=True)
            self.removed.discard(model)
            self._forget_model(model.name)

        asyncio.ensure_future(gone()).add_done_callback(consume_exception)

    def _forget_model(self, name: str) -> None:
        """Drop a model's gauges once nothing of that name is configured or still draining (a
        name removed, added back and removed again has two generations of instances)."""
        if name not in self.models and all(m.name != name for m in self.removed):
            self.ctx.metrics.forget_model(name)

    # -- views ---------------------------------------------------------------------------

    def memory_sample(self) -> list[dict[str, Any]]:
        """Per device: MiB in use and each model's share, awake and asleep (by what each
        instance was measured or is held to hold there)."""
        if self.memory is None:
            return []
        devices: dict[int, dict[str, Any]] = {
            s.id: {"id": s.id, "used_mb": s.used_mb, "total_mb": s.total_mb, "models": {}}
            for s in self.memory.snapshots
        }
        for inst in self.all_instances():
            if not inst.devices or inst.state.public in (State.STOPPED, State.ERROR):
                continue
            seen = self.memory.describe_instance(inst.id)  # held: per device, asleep or not
            mb = seen["held_mb"] if seen["held_mb"] is not None else seen["measured_mb"]
            if not isinstance(mb, (int, float)):
                continue
            for dev in inst.devices:
                if dev in devices:
                    row = devices[dev]["models"].setdefault(inst.name, {"awake": 0, "asleep": 0})
                    row["asleep" if inst.asleep else "awake"] += round(mb)
        return list(devices.values())

    def snapshot(self) -> list[dict[str, Any]]:
        """Every configured model with its instances (and the memory each holds), for the admin
        API and the status page; removed models still draining are listed with ``removed``."""
        rows = []
        for model in (*self.models.values(), *self.removed):
            row = model.status()
            row["removed"] = model.removed
            if self.memory is not None:
                row["memory"] = self.memory.describe(model.spec)
                for inst in row["instances"]:  # type: ignore[attr-defined]
                    inst["memory"] = self.memory.describe_instance(inst["id"])
            rows.append(row)
        return rows

    # -- shutdown ------------------------------------------------------------------------

    async def drain(self, timeout: float) -> bool:
        """Stop admitting requests (those still waiting get 503 now) and wait for in-flight
        ones; True if all finished in time."""
        self.closing = True
        for model in (*self.models.values(), *self.removed):
            model.close()
        deadline = time.monotonic() + timeout
        while self.active_leases() > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.roster.capacity_changed(), remaining)
        return True

    async def shutdown(self) -> None:
        """Refuse new work, fail waiters, stop every engine in parallel."""
        self.closing = True
        if self._background is not None:
            self._background.cancel()
        everything = [*self.models.values(), *self.removed]
        await asyncio.gather(*(m.shutdown() for m in everything), return_exceptions=True)
        if self.memory is not None:
            self.memory.close()

    def kill_all(self) -> None:
        """Kill every engine now (forced exit, the proxy exits right after): each guard is
        asked first (it also stops helpers that left the group), then every group gets SIGKILL."""
        everything = self.all_instances()
        for inst in everything:
            inst.kill()
        time.sleep(FORCED_KILL_GRACE_S)
        for inst in everything:
            inst.kill_group()
