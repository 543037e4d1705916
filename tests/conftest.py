"""Fixtures on the test kit (`kit`): `start_proxy`, the one proxy harness; `ledger`, a simulated
GPU; `spool_dir`, temporary files of the test's own; and the fake engine run alone."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from kit import Proxies
from kit.simgpu import sim_ledger

from fake_vllm.simgpu import Ledger

#: Fixtures of the kit's own modules, for every test: `start_fake` and `session` (the fake
#: engine run alone).
pytest_plugins = ["kit.fakeproc"]


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


@pytest.fixture
def spool_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Temporary files (an upload's spool) go to a folder of the test's own."""
    folder = tmp_path / "spool"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder
