"""Fixtures on the test kit (`kit`): `start_proxy`, the one proxy harness."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kit import (
    FAKE_ENGINE,
    Proxies,
    RunningProxy,
    StartProxy,
    free_port,
    group_alive,
    make_config,
    wait_for,
    wait_for_sync,
)
from kit.simgpu import sim_ledger

from fake_vllm.simgpu import Ledger

# Names some test modules still import from here; the kit is where they live.
__all__ = [
    "FAKE_ENGINE",
    "RunningProxy",
    "StartProxy",
    "free_port",
    "group_alive",
    "make_config",
    "wait_for",
    "wait_for_sync",
]


@pytest.fixture
async def start_proxy() -> AsyncIterator[Proxies]:
    """Start in-process proxies (`Proxies`); they are shut down (engines stopped) after the
    test, and proxies run as processes are killed."""
    proxies = Proxies()
    try:
        yield proxies
    finally:
        await proxies.close()


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ledger:
    """Two simulated 24000 MiB GPUs (`kit.simgpu`); the proxy's NVML import reads them."""
    return sim_ledger(tmp_path, monkeypatch)
