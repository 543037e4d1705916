"""What an instance needs from the rest of the proxy, as named ports, and `EngineContext`.

An instance reaches three things above it, each through a Protocol declared here (the engines
package imports nothing from the pool):

- `AdmissionPort`: when a start or a wake may take GPU memory, and which requests wait
  (`pool.admission.Admission`; `NoAdmission` where memory is not managed);
- `MemoryBook`: the claims, device locks and readings of GPU memory, and what a model pins in
  host RAM (`planning.memory.Memory`; `UnmanagedMemory` where memory is not managed);
- `PoolHooks`: what the pool is told of and asked (`pool.roster.Roster`; `NoPool` for an
  instance or model built alone).

`EngineContext` carries them with the shared runtime objects. It is frozen: ``app.py`` (or a
test) builds it whole, every port in place, before any instance exists.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import aiohttp

from ..config import ModelSpec
from ..metrics import Metrics
from ..planning.footprint import host_runtime_mb, host_start_mb, host_weights_mb
from ..planning.hostmem import HostRam
from ..planning.memory import NOT_SIZED, Held, Placement, Usage, Use
from ..planning.queueing import Queue, Rank
from .breaker import WakeBreaker
from .engine import EngineProcess, PortAllocator
from .readahead import ReadAhead
from .registry import EngineRegistry
from .states import State

#: The instance a port is told of (`instance.Instance`; a type parameter, so that this module
#: need not import the one that imports it).
Inst = TypeVar("Inst")
Inst_contra = TypeVar("Inst_contra", contravariant=True)


class AdmissionPort(Protocol[Inst_contra]):
    """GPU memory admission, as an instance and its model see it."""

    async def admit(self, inst: Inst_contra) -> Placement | None:
        """Wait until `inst` may start; where (None: memory is not managed)."""
        ...

    async def readmit(self, inst: Inst_contra) -> None:
        """Wait until a sleeping `inst`'s full footprint fits again on its devices (a wake)."""
        ...

    def holds(self, inst: Inst_contra, rank: Rank, arrived: float) -> bool:
        """Whether a request of `rank`, arrived then (monotonic), for the serving `inst` must
        queue behind a waiter before it whose reorder window has run out and whose plan takes
        that instance."""
        ...

    def timed(self, spec: ModelSpec, kind: str, seconds: float) -> None:
        """A start, wake or sleep (`kind`: "start", "wake", "first sleep", "sleep") of `spec`
        took `seconds`: the planner's price of putting it to sleep or stopping it."""
        ...

    def regrowing(self, inst: Inst_contra) -> list[str]:
        """The awake instances beside `inst` (on its devices) below their claim now: each may
        regrow its transient peak while `inst`'s start profiles."""
        ...


class MemoryBook(Protocol):
    """GPU memory as an instance changes it, and the host RAM its model pins."""

    def starting_on(
        self, devices: tuple[int, ...], owner: str, sized: bool = False
    ) -> AbstractAsyncContextManager[Held | None]:
        """A start's hold on its devices: alone while its vLLM profiles, beside other
        allocations when `sized` (told its KV cache size). None: nothing is held."""
        ...

    def device_lock(
        self, devices: tuple[int, ...], use: Use, owner: str | None = None
    ) -> AbstractAsyncContextManager[Held | None]:
        """A wake's, sleep's or stop's hold on its devices, in `use`."""
        ...

    def release_claim(self, instance_id: str) -> None:
        """A stopped engine's memory goes back to the budget."""
        ...

    def sleep_claim(self, instance_id: str, mb: int | None, level: int | None = None) -> None:
        """An instance whose /sleep call returned holds `mb` MiB per device (None: what its
        model is expected to hold asleep), asleep at `level`."""
        ...

    async def usage(self, pgid: int | None, devices: tuple[int, ...]) -> Usage | None:
        """A fresh reading of an engine's devices (None: no per-process readings)."""
        ...

    def residue(self, instance_id: str, before: Usage | None, after: Usage | None) -> int | None:
        """What an instance holds after its /sleep, from readings before and after."""
        ...

    async def wait_released(self, before: Usage | None) -> bool:
        """Wait (bounded) until a stopped engine's processes have left the GPU."""
        ...

    def grow_budget(self, spec: ModelSpec) -> str | None:
        """After vLLM found no room for the KV cache: raise the model's budget for its next
        start (None), or say why that cannot help."""
        ...

    def weights_mb(self, spec: ModelSpec) -> int | None:
        """Host RAM (MiB) a level-1 sleep pins for the model's weights, all devices together
        (None: not known)."""
        ...

    def runtime_mb(self, spec: ModelSpec) -> int:
        """Host RAM (MiB) a sleep of either level pins for the ``runtime`` pool."""
        ...

    def start_host_mb(self, spec: ModelSpec) -> int:
        """Host RAM (MiB) an engine of the model pins as it starts, all ranks together (Model
        Runner V2's token buffer); 0: not known."""
        ...

    def room_for_all(self) -> bool:
        """Whether an engine of every configured model (each replica) fits awake at once beside
        what other programs hold now: then no start or wake waits for an idle engine's
        memory (`sleep.on_idle: needed` keeps idle engines awake). False where unknown."""
        ...


class PoolHooks(Protocol[Inst]):
    """What the pool of every model is told of and asked by an instance."""

    def on_capacity(self) -> None:
        """A lease was released or an engine went down: memory may have become free."""
        ...

    def observe(self, inst: Inst, old: State) -> None:
        """Told of every state change of every instance, after its model was (the console)."""
        ...

    def host_victims(self, inst: Inst, short_mb: int) -> list[Inst]:
        """Engines asleep to stop, least recently used first, so that a sleep of `inst` finds
        `short_mb` more MiB of host RAM (empty: no such set frees that much)."""
        ...


class NoAdmission:
    """Memory is not managed: every start and wake goes ahead at once, nothing waits."""

    async def admit(self, inst: object) -> Placement | None:
        return None

    async def readmit(self, inst: object) -> None:
        return None

    def holds(self, inst: object, rank: Rank, arrived: float) -> bool:
        return False

    def timed(self, spec: ModelSpec, kind: str, seconds: float) -> None:
        return None

    def regrowing(self, inst: object) -> list[str]:
        return []


@asynccontextmanager
async def no_hold() -> AsyncIterator[None]:
    """No hold on any device (memory not managed, or no device placed)."""
    yield


class UnmanagedMemory:
    """Memory is not managed: no claims, no locks, no readings; host RAM from the model's
    config alone (no estimate of its footprint)."""

    def starting_on(
        self, devices: tuple[int, ...], owner: str, sized: bool = False
    ) -> AbstractAsyncContextManager[Held | None]:
        return no_hold()

    def device_lock(
        self, devices: tuple[int, ...], use: Use, owner: str | None = None
    ) -> AbstractAsyncContextManager[Held | None]:
        return no_hold()

    def release_claim(self, instance_id: str) -> None:
        return None

    def sleep_claim(self, instance_id: str, mb: int | None, level: int | None = None) -> None:
        return None

    async def usage(self, pgid: int | None, devices: tuple[int, ...]) -> Usage | None:
        return None

    def residue(self, instance_id: str, before: Usage | None, after: Usage | None) -> int | None:
        return None

    async def wait_released(self, before: Usage | None) -> bool:
        return True

    def grow_budget(self, spec: ModelSpec) -> str | None:
        return NOT_SIZED

    def weights_mb(self, spec: ModelSpec) -> int | None:
        return host_weights_mb(spec, None)

    def runtime_mb(self, spec: ModelSpec) -> int:
        return host_runtime_mb(None)

    def start_host_mb(self, spec: ModelSpec) -> int:
        return host_start_mb(None)

    def room_for_all(self) -> bool:
        return False  # memory not managed: nothing says the GPU is not wanted


class NoPool:
    """An instance or a model built alone (tests): nobody to tell, no other engine to stop."""

    def on_capacity(self) -> None:
        return None

    def observe(self, inst: object, old: State) -> None:
        return None

    def host_victims(self, inst: object, short_mb: int) -> list[Any]:
        return []


@dataclass(frozen=True)
class EngineContext(Generic[Inst]):
    """What every instance shares: the session, ports, registry and metrics, the admission
    queue, and the three ports above. Built whole; no field changes afterwards."""

    session: aiohttp.ClientSession
    ports: PortAllocator
    registry: EngineRegistry
    metrics: Metrics
    #: When a start or a wake may take GPU memory.
    admission: AdmissionPort[Inst] = field(default_factory=NoAdmission)
    #: GPU memory's claims, locks and readings; host RAM a model pins.
    memory: MemoryBook = field(default_factory=UnmanagedMemory)
    #: The pool of every model: told of capacity and state changes, asked for host RAM.
    pool: PoolHooks[Inst] = field(default_factory=NoPool)
    #: Host RAM promised to level-1 sleeps in flight.
    host: HostRam = field(default_factory=HostRam)
    #: The admission queue: every request that waits holds a ticket in it.
    queue: Queue = field(default_factory=Queue)
    #: The engine process class (the density benchmark's runs in virtual time).
    engine_factory: type[EngineProcess] = EngineProcess
    #: Weights read ahead into the page cache (None: never).
    read_ahead: ReadAhead | None = None
    #: Sleep levels whose wakes keep failing the wake check, per model and engine.
    breaker: WakeBreaker = field(default_factory=WakeBreaker)
