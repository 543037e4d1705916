"""The ports an instance reaches the proxy through: the context is built whole and never
changes; where memory is not managed, the null ports say so."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest.mock import MagicMock

import pytest

from vllm_proxy.app import engine_context
from vllm_proxy.config import parse_config
from vllm_proxy.engines.ports import EngineContext, NoAdmission, NoPool, UnmanagedMemory
from vllm_proxy.metrics import Metrics
from vllm_proxy.planning.footprint import RUNTIME_POOL_MB
from vllm_proxy.planning.memory import NOT_SIZED, Use
from vllm_proxy.pool.roster import Roster


def test_no_field_of_the_context_changes_after_it_is_built() -> None:
    ctx = EngineContext(session=MagicMock(), ports=MagicMock(), registry=MagicMock(),
                        metrics=Metrics())  # fmt: skip
    for name in ("admission", "memory", "pool", "host", "queue"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(ctx, name, None)


def test_the_app_builds_the_context_with_every_port_in_place() -> None:
    """Without managed memory: the null ports; the roster is the pool's hooks, sharing the
    context's queue and host RAM."""
    ctx, roster, admission = engine_context(MagicMock(), MagicMock(), Metrics(), None)
    assert admission is None
    assert isinstance(ctx.admission, NoAdmission) and isinstance(ctx.memory, UnmanagedMemory)
    assert ctx.pool is roster and isinstance(roster, Roster)
    assert roster.queue is ctx.queue and roster.host is ctx.host


async def test_unmanaged_memory_holds_nothing_and_admits_at_once(tmp_path: Path) -> None:
    spec = parse_config({"server": {"state_dir": str(tmp_path)},
                         "models": {"m": {"model": "x", "params_b": 1}}}).specs()["m"]  # fmt: skip
    memory, admission, pool = UnmanagedMemory(), NoAdmission(), NoPool()
    async with memory.starting_on((0,), "m#1", sized=False) as held:
        assert held is None
    async with memory.device_lock((0,), Use.SLEEP, "m#1") as held:
        assert held is None
    assert await memory.usage(1, (0,)) is None and await memory.wait_released(None)
    assert memory.residue("m#1", None, None) is None
    assert memory.grow_budget(spec) == NOT_SIZED, "no budget the proxy sizes"
    assert memory.runtime_mb(spec) == RUNTIME_POOL_MB and memory.start_host_mb(spec) == 0
    weights = memory.weights_mb(spec)
    assert weights is not None and 1_900 < weights < 1_950, "1e9 x 2 bytes, from the config"
    assert await admission.admit(object()) is None and await admission.readmit(object()) is None
    assert not admission.holds(object(), (0, 0), 0.0) and admission.regrowing(object()) == []
    assert pool.host_victims(object(), 1) == []
