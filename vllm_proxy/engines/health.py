"""The health watcher of one running engine.

Every ``health_interval_s`` (none while a sleep or wake call is in flight: those are bounded on
their own), the watcher marks the engine unhealthy (its instance kills it; the next request
starts a new one) when:

- its listener is no longer the engine's own socket (``unhealthy``);
- ``health_misses`` probes in a row got no 200 within ``health_timeout_s``: hung, deadlocked,
  SIGSTOPped (``unhealthy``);
- it answers its probes but has sent no byte on any request in flight for
  ``stall_timeout_s``: a decode stall, which /health does not see (``stalled``);
- with a sleep policy, it says it is asleep while the proxy has it running: someone else
  called its /sleep (``sleep_not_ordered``).

The watcher only reads; the instance changes its own state (`Watched.mark_unhealthy`).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import aiohttp

from ..config import ModelSpec
from .engine import EngineProcess
from .progress import Progress
from .states import ASLEEP_OR_FALLING, AWAKE, LIVE, State


class Watched(Protocol):
    """What the watcher sees of an instance."""

    spec: ModelSpec
    state: State
    engine: EngineProcess | None
    progress: Progress

    @property
    def wake_asked(self) -> bool: ...

    def mark_unhealthy(
        self, engine: EngineProcess, why: str, reason: str = "unhealthy"
    ) -> None: ...


def _awake(inst: Watched, engine: EngineProcess) -> bool:
    """Awake on `engine` as far as the proxy knows: none of its sleeps or wakes under way."""
    return inst.state in AWAKE and inst.engine is engine and not inst.wake_asked


async def watch_health(
    inst: Watched, engine: EngineProcess, session: aiohttp.ClientSession
) -> None:
    """Probe `inst`'s `engine` until it is no longer live or it was marked unhealthy (see the
    module docstring)."""
    spec = inst.spec
    misses = 0
    while True:
        await asyncio.sleep(spec.health_interval_s)
        if inst.state not in LIVE or inst.engine is not engine:
            return
        if inst.state in (State.FALLING_ASLEEP, State.WAKE_WAITING, State.WAKING):
            continue  # a wake or sleep call is bounded on its own
        if not engine.listener_unchanged():
            where = "socket path" if engine.socket_path else "port"
            inst.mark_unhealthy(engine, f"its {where} is no longer held by the engine's own socket")
            return
        client = engine.client(session)
        healthy = await engine.probe(client, spec.health_timeout_s)
        misses = 0 if healthy else misses + 1
        if misses >= spec.health_misses and inst.state in (*AWAKE, *ASLEEP_OR_FALLING):
            why = f"no answer to {misses} health probes in a row"
            inst.mark_unhealthy(engine, f"{why} ({spec.health_timeout_s:g}s each)")
            return
        if healthy and spec.stall_timeout_s > 0 and _awake(inst, engine):
            stalled = inst.progress.stalled_for()
            if stalled >= spec.stall_timeout_s:
                n = len(inst.progress.flows)
                inst.mark_unhealthy(engine, f"no byte on any of its {n} request(s) in flight for "
                                    f"{stalled:.0f}s while its /health answers 200 (a decode "
                                    "stall)", reason="stalled")  # fmt: skip
                return
        if healthy and spec.sleep is not None and _awake(inst, engine):
            asleep = await engine.probe_sleeping(client, spec.health_timeout_s)
            if asleep and _awake(inst, engine):  # (no sleep of its own began meanwhile)
                why = "/is_sleeping says asleep while the proxy has it running"
                inst.mark_unhealthy(engine, f"put to sleep by someone else ({why})",
                                    reason="sleep_not_ordered")  # fmt: skip
                return
