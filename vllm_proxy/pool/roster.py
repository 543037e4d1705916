"""The roster: every model by name, the removed ones still draining, and the pool's side of an
instance's `PoolHooks` (capacity, state changes, host RAM for a sleep).

It exists before any model, so that ``app.py`` can build the `EngineContext` whole: admission
reads the instances through it, instances tell it of capacity and state changes, and the
`Manager` fills it (names, reload, shutdown).
"""

from __future__ import annotations

import asyncio

from ..engines.instance import Instance
from ..engines.model import Model
from ..engines.states import State
from ..planning.hostmem import HostRam
from ..planning.queueing import Queue
from .journal import Journal


class Roster:
    """The models the pool serves and the instances they hold; implements `PoolHooks`."""

    def __init__(self, queue: Queue, host: HostRam) -> None:
        self.queue = queue
        self.host = host
        #: Every configured model by name (the manager's; replaced as a whole by a reload).
        self.models: dict[str, Model] = {}
        #: Models removed by a reload whose instances still drain or stop.
        self.removed: set[Model] = set()
        #: State changes and memory over time, for the console.
        self.journal = Journal()
        self._capacity = asyncio.Event()

    def all_instances(self) -> list[Instance]:
        """Every live instance, of configured and of removed models."""
        return [i for m in (*self.models.values(), *self.removed) for i in m.instances]

    def on_capacity(self) -> None:
        """A lease was released, an engine went down or the models changed: wake whoever waits
        for capacity (a drain, the admission queue)."""
        self._capacity.set()
        self._capacity = asyncio.Event()
        self.queue.changed()

    async def capacity_changed(self) -> None:
        """Until the next `on_capacity`."""
        await self._capacity.wait()

    def observe(self, inst: Instance, old: State) -> None:
        """An instance changed state: a public change goes to the journal (with its reason,
        forgotten once the change it explained is over); any other wakes its readers."""
        if inst.state.public is not old.public:
            reason = inst.change_reason
            self.journal.note(inst.name, inst.id, old.public.value, inst.state.public.value, reason)
            if inst.state.public in (State.RUNNING, State.SLEEPING, State.STOPPED, State.ERROR):
                inst.change_reason = ""  # the change it explained is over
        else:
            self.journal.poke()

    def host_victims(self, inst: Instance, short_mb: int) -> list[Instance]:
        """Engines asleep and idle, of models not pinned, used less recently than `inst`,
        least recently used first, whose pinned host RAM together is at least `short_mb`
        (empty: they do not hold that much)."""
        retained = self.host.retained
        asleep = sorted(
            (
                i for i in self.all_instances()
                if i is not inst and i.state is State.SLEEPING and i.leases == 0
                and not i.wake_asked and not i.retired and retained.get(i.id, 0) > 0
                and i.last_used <= inst.last_used
                and not (i.name in self.models and self.models[i.name].pinned)
            ),
            key=lambda i: i.last_used,
        )  # fmt: skip
        chosen, total = [], 0
        for i in asleep:
            chosen.append(i)
            total += retained[i.id]
            if total >= short_mb:
                return chosen
        return []
