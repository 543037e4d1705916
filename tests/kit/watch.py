"""`Watch`, the invariant watcher: samples a proxy between event-loop steps while a scenario
runs, and records every broken invariant."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from kit.harness import RunningProxy
from vllm_proxy.engines.states import State


def held(proxy: RunningProxy, name: str) -> int:
    """Requests of model `name` held in the admission queue."""
    return sum(1 for t in proxy.manager.queue.tickets.values() if t.held and t.model == name)


class Watch:
    """The invariants: the memory of engines that hold it (running, starting, waking, asleep)
    within each device's budget; no engine stopping or falling asleep under a lease (unless
    `leases` is False: a scenario that unloads or shuts down cuts streams on purpose). It also
    keeps the most requests of each model held at once (`peak_held`). `close()` fails the test
    with what was broken."""

    def __init__(self, proxy: RunningProxy, leases: bool = True, every_s: float = 0.005) -> None:
        self.proxy = proxy
        self.leases = leases
        self.every_s = every_s
        self.broken: list[str] = []
        self.samples = 0
        self.peak_held: dict[str, int] = {}
        self._task = asyncio.ensure_future(self._run())

    def check(self) -> None:
        memory = self.proxy.manager.memory
        assert memory is not None
        per_device: dict[int, int] = {}
        holders = []
        for inst in self.proxy.manager.all_instances():
            cut = inst.leases > 0 and inst.state.public in (State.STOPPING, State.SLEEPING)
            if cut and self.leases:
                self.broken.append(f"{inst.id} is {inst.state.name} with {inst.leases} lease(s)")
            claim = memory.claims.get(inst.id)
            if claim is None:
                continue
            live = inst.state.public in (State.RUNNING, State.STARTING, State.WAKING) or inst.asleep
            if not live:
                continue
            holders.append(f"{inst.id}:{inst.state.name}:{memory.held_mb(inst.id)}")
            for d in claim.devices:
                per_device[d] = per_device.get(d, 0) + memory.held_mb(inst.id)
        for d, mb in per_device.items():
            if mb > memory.totals[d]:
                self.broken.append(f"GPU {d}: {mb} MiB handed out of {memory.totals[d]}: {holders}")
        for name in self.proxy.manager.models:
            self.peak_held[name] = max(self.peak_held.get(name, 0), held(self.proxy, name))
        self.samples += 1

    async def _run(self) -> None:
        while True:
            self.check()
            await asyncio.sleep(self.every_s)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        assert self.samples > 0
        assert not self.broken, self.broken[:5]


@asynccontextmanager
async def watching(
    check: Callable[[], str | None], every_s: float = 0.005, at_end: bool = False
) -> AsyncIterator[list[str]]:
    """Evaluate `check` at every turn of the event loop (every `every_s` at least) while the
    body runs, and once more after it if `at_end`; the yielded list collects every violation
    it reported, each once."""
    seen: list[str] = []

    def look() -> None:
        problem = check()
        if problem is not None and problem not in seen:
            seen.append(problem)

    async def loop() -> None:
        while True:
            look()
            await asyncio.sleep(every_s)

    task = asyncio.ensure_future(loop())
    try:
        yield seen
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if at_end:
            look()
