"""What a hostile scenario must not leave behind: a lease, a queue ticket, an adapter use, body
bytes counted, an open spool file; and a raw POST to provoke one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from . import RunningProxy, wait_for


def open_spools(folder: Path) -> list[str]:
    """This process's open files in `folder` (a spool file is unlinked while open), and the
    files still in it."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder)):
            found.append(target)
    return found + [str(p) for p in folder.iterdir()]


async def left_nothing(proxy: RunningProxy, spool: Path | None = None) -> None:
    """No lease, queue ticket, adapter use, body byte or spool file is left."""
    manager = proxy.manager

    def leases() -> int:
        return sum(i.leases for i in manager.all_instances())

    def users() -> int:
        return sum(s.users for i in manager.all_instances() for s in i.adapters.slots.values())

    await wait_for(lambda: leases() == 0, 10, "no lease left")
    await wait_for(lambda: not manager.queue.tickets, 10, "no queue ticket left")
    await wait_for(lambda: users() == 0, 10, "no adapter use left")
    await wait_for(lambda: proxy.server.runtime.proxy.bodies.held == 0, 10, "no body held")
    if spool is not None:
        await wait_for(lambda: not open_spools(spool), 10, "no spool file left")


async def post_raw(proxy: RunningProxy, path: str, data: bytes, **headers: str) -> tuple[int, Any]:
    async with proxy.http.post(proxy.url + path, data=data, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)
