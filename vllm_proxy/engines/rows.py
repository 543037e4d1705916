"""What an operator sees of one instance (the admin API's row, ``/admin/models``): read from the
instance, never written to it. Its pid, port and socket show only while its process lives."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from .engine import EngineProcess
from .lora import Registrations
from .ports import EngineContext
from .states import ASLEEP_OR_FALLING, AWAKE, DOWN, State


class Shown(Protocol):
    """What the row reads of an instance (`Instance`)."""

    id: str
    state: State
    engine: EngineProcess | None
    sleep_level: int
    devices: tuple[int, ...]
    leases: int
    ready_at: float
    last_used: float
    retired: bool
    last_error: str | None
    adapters: Registrations
    ctx: EngineContext[Any]

    @property
    def log_path(self) -> Path: ...


def wall_time(monotonic: float, clock: Callable[[], float]) -> float | None:
    """A reading of `clock` (monotonic) as a Unix timestamp, for display; None for 0 (never:
    an instance's `last_used` before its first use)."""
    if not monotonic:
        return None
    return time.time() - (clock() - monotonic)


def instance_row(inst: Shown) -> dict[str, object]:
    """The instance's row: its public state and phase, the level it sleeps at (0 awake), its
    process while it lives, devices while not ended, leases, uptime while awake, its adapters
    and the host RAM its sleep pins."""
    engine = inst.engine
    live = engine is not None and engine.exit_code is None and inst.state not in DOWN
    up = inst.state in AWAKE and live
    return {
        "id": inst.id,
        "state": inst.state.public.value,
        "phase": inst.state.value,
        "sleep_level": inst.sleep_level if inst.state in ASLEEP_OR_FALLING else 0,
        "pid": engine.pid if live and engine else None,
        "port": engine.tcp_port if live and engine else None,
        "socket": engine.socket_path if live and engine else None,
        "devices": list(inst.devices) if inst.state not in DOWN else [],
        "leases": inst.leases,
        "last_used": wall_time(inst.last_used, inst.ctx.queue.clock),
        "uptime_s": round(inst.ctx.queue.clock() - inst.ready_at, 3) if up else None,
        "retired": inst.retired,
        "last_error": inst.last_error,
        "log": str(inst.log_path),
        "adapters": inst.adapters.status(),
        "host_pinned_mb": inst.ctx.host.retained.get(inst.id),
    }
