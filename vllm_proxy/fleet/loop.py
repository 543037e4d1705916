"""The loop: every interval, read every proxy, place every model, update HAProxy and the file.

A server leaves the placement when its proxy does not answer ``/placement`` within the
interval, answers that it is closing (draining), or HAProxy has it anything but ``UP`` (DOWN,
DRAIN, MAINT). HAProxy out of reach: the map file is still written and the runtime API is tried
again next round. The loop keeps no state that the proxies and HAProxy do not hold: started
again, it reads the map HAProxy has (else the file) as the last decision and goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from .haproxy import IN_SERVICE, HaproxyError, RuntimeApi, read_map, write_map
from .placement import BadView, Decision, Server, entries, place, server_from_view

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Options:
    socket: str
    map_path: Path
    servers: Mapping[str, str]
    interval_s: float = 1.0
    api_key: str | None = None
    backend: str = "vllm"


class Fleet:
    """One placement loop (`run`), a round at a time (`tick`)."""

    def __init__(self, opts: Options, session: aiohttp.ClientSession) -> None:
        self.opts = opts
        self.session = session
        self.api = RuntimeApi(opts.socket, timeout_s=max(opts.interval_s, 1.0))
        #: The last round's decision: model -> server.
        self.previous: dict[str, str] = {}
        self.entries: dict[str, str] | None = None
        self._out: dict[str, str] = {}

    async def start(self) -> None:
        """Take the map HAProxy has (else the file's) as the last decision."""
        try:
            current = await self.api.show_map(str(self.opts.map_path))
            held = {key: values[0] for key, values in current.items()}
        except HaproxyError as err:
            log.warning("%s; starting from %s", err, self.opts.map_path)
            held = read_map(self.opts.map_path)
        self.previous = {k: v for k, v in held.items() if v in self.opts.servers}

    async def _view(self, name: str, url: str) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.opts.api_key}"} if self.opts.api_key else {}
        timeout = aiohttp.ClientTimeout(total=self.opts.interval_s * 0.8)
        async with self.session.get(
            url.rstrip("/") + "/placement", headers=headers, timeout=timeout
        ) as r:
            if r.status != 200:
                raise BadView(f"{name}: /placement answered {r.status}")
            view: dict[str, Any] = await r.json()
            return view

    async def servers(self) -> list[Server]:
        """The servers in service, each from its proxy's view."""
        names = list(self.opts.servers)
        views = await asyncio.gather(
            *(self._view(n, self.opts.servers[n]) for n in names), return_exceptions=True
        )
        try:
            status: dict[str, str] | None = await self.api.server_status(self.opts.backend)
        except HaproxyError as err:
            log.warning("%s", err)
            status = None
        live = []
        for name, view in zip(names, views, strict=True):
            why = None
            if isinstance(view, BaseException):
                why = f"not answering ({type(view).__name__}: {view})"
            elif view.get("closing"):
                why = "draining"
            elif status is not None and not status.get(name, "").startswith(IN_SERVICE):
                why = f"{status.get(name, 'not in backend ' + self.opts.backend)} in HAProxy"
            if why is None:
                assert isinstance(view, dict)
                try:
                    live.append(server_from_view(name, view))
                    why = None
                except BadView as err:
                    why = str(err)
            if why is not None and self._out.get(name) != why:
                log.warning("%s: out of the placement: %s", name, why)
            if why is None and name in self._out:
                log.info("%s: back in the placement", name)
            if why is None:
                self._out.pop(name, None)
            else:
                self._out[name] = why
        return live

    async def tick(self) -> dict[str, Decision]:
        servers = await self.servers()
        decisions = place(servers, self.previous)
        for model, d in sorted(decisions.items()):
            before = self.previous.get(model)
            if before != d.server:
                shown = f"{before} -> {d.server}" if before else f"-> {d.server}"
                log.info("%s: %s (%s)", model, shown, d.why)
        self.previous = {m: d.server for m, d in decisions.items()}
        wanted = entries(servers, decisions)
        try:
            changed = await self.api.apply(str(self.opts.map_path), wanted)
            if changed:
                log.debug("HAProxy map: %s", "; ".join(changed))
        except HaproxyError as err:
            log.warning("%s", err)
        if wanted != self.entries:
            write_map(self.opts.map_path, wanted)
            self.entries = wanted
        return decisions

    async def run(self, stop: asyncio.Event) -> None:
        """Rounds every `interval_s` (on a fixed schedule) until `stop` is set."""
        await self.start()
        log.info("placing the models of %d servers every %gs in %s", len(self.opts.servers),
                 self.opts.interval_s, self.opts.map_path)  # fmt: skip
        next_at = time.monotonic()
        first = True
        while not stop.is_set():
            try:
                decisions = await self.tick()
                if first:
                    servers = sorted({d.server for d in decisions.values()})
                    log.info("first round: %d models on %s", len(decisions), ", ".join(servers))
                    first = False
            except (OSError, aiohttp.ClientError) as err:  # the file, the network
                log.warning("round failed: %s", err)
            next_at = max(next_at + self.opts.interval_s, time.monotonic())
            try:
                await asyncio.wait_for(stop.wait(), next_at - time.monotonic())
            except TimeoutError:
                pass
