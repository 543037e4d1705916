"""The loop: every interval, read every proxy, place every model, update HAProxy and the file.

No neighbour is trusted. Each ``/placement`` answer is read up to `Options.max_view_mb` and
checked field by field (placement.py); one too large or of another shape leaves its server
out for that round, with a WARNING when the reason changes, and names HAProxy cannot carry are
left out of the map (names.py). A server leaves the placement at once when it answers that it
is closing (draining) or HAProxy has it anything but ``UP`` (DOWN, DRAIN, MAINT); a proxy that
only misses rounds (a pause, a slow answer) keeps its models, as its last answer had them,
until it has missed `Options.missed_rounds` in a row, so a 2.5 s pause moves nothing. No
error of a round ends the loop: it is logged and the next round runs (a unit restarted by
systemd in a loop would leave HAProxy's map frozen). HAProxy out of reach: the map file is
still written and the runtime API is tried again next round. The loop keeps no state that the
proxies and HAProxy do not hold: started again, it reads the map HAProxy has (else the file)
as the last decision and goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from .haproxy import IN_SERVICE, HaproxyError, RuntimeApi, read_map, write_map
from .placement import BadView, Decision, Server, place, routes, server_from_view

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Options:
    socket: str
    map_path: Path
    servers: Mapping[str, str]
    interval_s: float = 1.0
    api_key: str | None = None
    backend: str = "vllm"
    #: The largest ``/placement`` answer read (MiB); a larger one leaves its server out.
    max_view_mb: float = 16.0
    #: A proxy that misses this many rounds in a row (no answer in time) leaves the placement;
    #: fewer, it keeps its models.
    missed_rounds: int = 3


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
        #: Each server's last good answer and the rounds it has missed since.
        self._last: dict[str, tuple[Server, int]] = {}
        #: What was last logged about names left out or in conflict (logged on change).
        self._said: dict[str, tuple[str, ...]] = {}

    async def start(self) -> None:
        """Take the map HAProxy has (else the file's) as the last decision."""
        try:
            current = await self.api.show_map(str(self.opts.map_path))
            held = {key: values[0] for key, values in current.items()}
        except HaproxyError as err:
            log.warning("%s; starting from %s", err, self.opts.map_path)
            held = read_map(self.opts.map_path)
        self.previous = {k: v for k, v in held.items() if v in self.opts.servers}

    async def _view(self, name: str, url: str) -> Any:
        """The JSON of `name`'s ``/placement``, read no further than `max_view_mb`."""
        headers = {"Authorization": f"Bearer {self.opts.api_key}"} if self.opts.api_key else {}
        timeout = aiohttp.ClientTimeout(total=self.opts.interval_s * 0.8)
        limit = int(self.opts.max_view_mb * 1024 * 1024)
        async with self.session.get(
            url.rstrip("/") + "/placement", headers=headers, timeout=timeout
        ) as r:
            if r.status != 200:
                raise BadView(f"{name}: /placement answered {r.status}")
            if (r.content_length or 0) > limit:
                raise BadView(f"{name}: /placement of {r.content_length} bytes, over "
                              f"--max-view-mb {self.opts.max_view_mb:g}")  # fmt: skip
            body = bytearray()
            async for chunk in r.content.iter_any():
                body += chunk
                if len(body) > limit:
                    raise BadView(f"{name}: /placement over --max-view-mb "
                                  f"{self.opts.max_view_mb:g}")  # fmt: skip
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as err:
            raise BadView(f"{name}: /placement is not JSON: {str(err)[:100]}") from None

    async def servers(self) -> list[Server]:
        """The servers in service, each from its proxy's view (or its last one, while it
        misses fewer than `missed_rounds` rounds in a row)."""
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
            server, why = self._judge(name, view, status)
            if server is not None:
                live.append(server)
            if why is not None and self._out.get(name) != why:
                log.warning("%s: out of the placement: %s", name, why)
            if why is None and name in self._out:
                log.info("%s: back in the placement", name)
            if why is None:
                self._out.pop(name, None)
            else:
                self._out[name] = why
        return live

    def _judge(
        self, name: str, view: Any, status: dict[str, str] | None
    ) -> tuple[Server | None, str | None]:
        """(the server to place on, or None; why it is out, or None)."""
        if status is not None and not status.get(name, "").startswith(IN_SERVICE):
            self._last.pop(name, None)
            return None, f"{status.get(name, 'not in backend ' + self.opts.backend)} in HAProxy"
        if isinstance(view, BadView):
            self._last.pop(name, None)
            return None, str(view)
        if isinstance(view, BaseException):
            last = self._last.get(name)
            if last is None or last[1] + 1 >= self.opts.missed_rounds:
                self._last.pop(name, None)
                return None, f"not answering ({type(view).__name__}: {str(view)[:200]})"
            self._last[name] = (last[0], last[1] + 1)
            log.info("%s: no answer (%s); its models kept from its last answer (%d of %d "
                     "rounds missed)", name, type(view).__name__, last[1] + 1,
                     self.opts.missed_rounds)  # fmt: skip
            return last[0], None
        try:
            server = server_from_view(name, view)
        except BadView as err:
            self._last.pop(name, None)
            return None, str(err)
        if isinstance(view, dict) and view.get("closing") is True:
            self._last.pop(name, None)
            return None, "draining"
        self._last[name] = (server, 0)
        self._say(f"dropped {name}", server.dropped,
                  f"{name}: names HAProxy cannot carry, left out of the map")  # fmt: skip
        return server, None

    def _say(self, key: str, items: tuple[str, ...] | list[str], what: str) -> None:
        """A WARNING listing `items` when they differ from the last ones said under `key`."""
        items = tuple(items)
        if self._said.get(key, ()) != items:
            self._said[key] = items
            if items:
                shown = "; ".join(items[:10]) + (f" (and {len(items) - 10} more)"
                                                  if len(items) > 10 else "")  # fmt: skip
                log.warning("%s: %s", what, shown)

    async def tick(self) -> dict[str, Decision]:
        servers = await self.servers()
        decisions = place(servers, self.previous)
        for model, d in sorted(decisions.items()):
            before = self.previous.get(model)
            if before != d.server:
                shown = f"{before} -> {d.server}" if before else f"-> {d.server}"
                log.info("%s: %s (%s)", model, shown, d.why)
        self.previous = {m: d.server for m, d in decisions.items()}
        wanted, conflicts = routes(servers, decisions)
        self._say("conflicts", conflicts, "names in conflict (a model's own name wins)")
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
            except Exception:  # a bug must not end the loop: HAProxy's map would freeze
                log.exception("round failed")
            next_at = max(next_at + self.opts.interval_s, time.monotonic())
            try:
                await asyncio.wait_for(stop.wait(), next_at - time.monotonic())
            except TimeoutError:
                pass
