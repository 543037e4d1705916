"""Read-only views of the pool: what the admin API, the console, the catalogue and the
placement page show, taken from the models' instances without handing the instances out.

* `Model`: the type a route names a model by (found with `Manager.resolve`); what it does
  (load, unload, sleep, wake, pin) is its own.
* `InstanceView`: one instance as a page shows it (a snapshot: it does not follow the instance);
  `instances(model)` for the live ones, `shown_instances(model)` with the last one that ended
  first, `find_instance(manager, iid)` for one by id.
* `EngineView`: an engine that answers on its ``/metrics`` (awake or asleep), with its URL and
  the HTTP session that reaches it; `engines(manager)` lists them.
* `Fit`: whether one more instance of a model would start now, else what it would take;
  `fit(admission, spec)` and `fits(admission, specs)` (one snapshot for all).
* `read_tail`: the last lines of a log file, bounded.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import aiohttp

from ..config import ModelSpec
from ..engines.engine import EngineProcess, read_tail
from ..engines.instance import Instance
from ..engines.model import Model
from ..engines.states import AWAKE
from ..planning.planner import NoFit, Plan
from .admission import Admission
from .manager import Manager

__all__ = [
    "EngineView",
    "Fit",
    "InstanceView",
    "Model",
    "engines",
    "find_instance",
    "fit",
    "fits",
    "instances",
    "read_tail",
    "shown_instances",
]


@dataclasses.dataclass(frozen=True, slots=True)
class InstanceView:
    """One instance as the pages show it."""

    #: ``<model>#<n>``, never reused; the model's name.
    id: str
    model: str
    #: The state operators see (`State.public`'s value: ``running``, ``sleeping``, ...).
    state: str
    asleep: bool
    #: The level it sleeps at (meaningful while `asleep`).
    sleep_level: int
    devices: tuple[int, ...]
    #: Requests it serves now.
    leases: int
    #: LoRA adapters the engine holds or loads: name -> ``loaded`` or ``loading``.
    adapters: dict[str, str]
    log_path: Path


def _view(inst: Instance) -> InstanceView:
    return InstanceView(
        id=inst.id,
        model=inst.name,
        state=inst.state.public.value,
        asleep=inst.asleep,
        sleep_level=inst.sleep_level,
        devices=tuple(inst.devices),
        leases=inst.leases,
        adapters=inst.adapters.status(),
        log_path=inst.log_path,
    )


def instances(model: Model) -> list[InstanceView]:
    """The model's live instances."""
    return [_view(i) for i in model.instances]


def shown_instances(model: Model) -> list[InstanceView]:
    """The last instance of the model that ended (if any), then the live ones."""
    ended = [] if model.last_ended is None else [_view(model.last_ended)]
    return ended + instances(model)


def find_instance(manager: Manager, iid: str) -> InstanceView | None:
    """The live instance `iid`, or the last one that ended of a model (configured or removed),
    or None."""
    inst = manager.instance(iid)
    if inst is None:
        models = (*manager.models.values(), *manager.removed)
        inst = next((m.last_ended for m in models
                     if m.last_ended is not None and m.last_ended.id == iid), None)  # fmt: skip
    return None if inst is None else _view(inst)


class EngineView:
    """An engine that answers on its own routes (awake or asleep), for a read of its pages."""

    __slots__ = ("_engine", "base_url", "id", "name")

    def __init__(self, inst: Instance, engine: EngineProcess) -> None:
        #: The model's name and the instance's id.
        self.name = inst.name
        self.id = inst.id
        self._engine = engine
        self.base_url = engine.base_url

    def client(self, shared: aiohttp.ClientSession) -> aiohttp.ClientSession:
        """The session that reaches the engine at `base_url` (`shared` on a loopback port)."""
        return self._engine.client(shared)


def engines(manager: Manager) -> list[EngineView]:
    """Every engine awake (running or draining) or asleep, of configured and removed models."""
    return [
        EngineView(i, i.engine)
        for i in manager.all_instances()
        if (i.state in AWAKE or i.asleep) and i.engine is not None
    ]


@dataclasses.dataclass(frozen=True, slots=True)
class Fit:
    """What starting one more instance of a model would take now:

    * it fits as things are: `possible`, `sleep` and `evict` empty;
    * it fits once the instances of `sleep` sleep and those of `evict` stop: `possible`;
    * it does not fit: not `possible`, and the planner's `reason`.
    """

    possible: bool
    reason: str | None = None
    sleep: tuple[str, ...] = ()
    evict: tuple[str, ...] = ()

    @property
    def now(self) -> bool:
        """Whether it fits as things are."""
        return self.possible and not self.sleep and not self.evict


def _fit(decision: Plan | NoFit) -> Fit:
    if isinstance(decision, NoFit):
        return Fit(False, decision.reason)
    return Fit(True, None, tuple(decision.sleep), tuple(decision.evict))


def fit(admission: Admission, spec: ModelSpec) -> Fit:
    """`Admission.fit` (pure: nothing is claimed, nobody is asked to sleep or stop)."""
    return _fit(admission.fit(spec))


def fits(admission: Admission, specs: list[ModelSpec]) -> dict[str, Fit]:
    """`Admission.fits`: `fit` of each of `specs`, from one snapshot, by model name."""
    return {name: _fit(d) for name, d in admission.fits(specs).items()}
