"""Load for admission tests: requests held open on an engine (`busy`), what each was served by,
and a one-slot GPU budget."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from vllm_proxy.config import GpuDevice

from . import FakeEngine, RunningProxy, make_config

#: Replies of up to 100 tokens, 30 ms each: `max_tokens` sets a request's length.
SLOW = FakeEngine(tokens=100, token_delay=0.03).env()


def one_slot(
    tmp_path: Path,
    models: dict[str, dict[str, Any]],
    admission: dict[str, Any] | None = None,
    **engine: Any,
) -> Any:
    """Models of 600 MiB on a 1000 MiB budget: one at a time."""
    specs = {n: {"model": "x", "memory_mb": 600, "env": dict(SLOW), **m} for n, m in models.items()}
    cfg = make_config(tmp_path, specs, engine={"health_interval_s": 0, **engine})
    gpu = cfg.gpu.model_copy(
        update={"monitor": "static", "devices": [GpuDevice(id=0, memory_mb=1000)]}
    )
    adm = cfg.admission.model_copy(update=admission or {})
    return cfg.model_copy(update={"gpu": gpu, "admission": adm})


def busy(proxy: RunningProxy, name: str) -> bool:
    """The model serves and has a request in flight."""
    inst = proxy.model(name).serving()
    return inst is not None and inst.leases > 0


class Served:
    """Requests sent in the background, and the order their answers arrived in."""

    def __init__(self, proxy: RunningProxy) -> None:
        self.proxy = proxy
        self.order: list[str] = []
        self.tasks: list[asyncio.Task[int]] = []

    def send(self, label: str, model: str, tokens: int = 2, **extra: Any) -> asyncio.Task[int]:
        async def one() -> int:
            resp = await self.proxy.chat(model, max_tokens=tokens, **extra)
            await resp.read()
            self.order.append(label)
            return resp.status

        task = asyncio.ensure_future(one())
        self.tasks.append(task)
        return task

    async def statuses(self) -> list[int]:
        return list(await asyncio.gather(*self.tasks))
