"""The LoRA adapters registered on one engine instance, and the calls that register them.

vLLM serves an adapter only after ``POST /v1/load_lora_adapter`` named it (with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` and ``--enable-lora``); a request naming an adapter it
does not hold gets 404. So before a request for an adapter goes to an engine, the proxy makes
sure that engine holds it. `Registrations` is that engine's book, owned by its `Instance` (so
keyed by the instance id, and gone with it: a restarted engine starts with an empty book):

* one load per adapter and engine: the first request starts the call, every request that
  comes meanwhile waits on the same task (shielded, so a client that leaves does not cancel it
  for the others), and all of them see its error;
* at most ``max_adapters`` registered: to load another, the least recently used adapter with
  no request in flight is unloaded (its unload runs beside the new load; a request for it
  meanwhile waits for the unload, then loads it again). When every registered adapter has
  requests in flight the request waits for one to finish, up to the queue timeout, then gets
  503 with ``Retry-After``;
* after a level-2 wake the book is emptied (vLLM's copies of the adapters on the GPU were
  discarded with the weights), and the names the engine may still list are registered again
  in place (``load_inplace``) when next asked for.

Errors name the adapter and the model, never the engine's log: 404 when the engine finds no
adapter at its path, 502 with vLLM's own message (its first line, bounded) for other failures.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from ..adapters import AdapterSpec, rank_of
from ..config import ModelSpec
from ..errors import BadRequest, EngineFailed, NotFound, ProxyError, Unavailable
from ..metrics import Metrics
from .engine import EngineProcess

log = logging.getLogger(__name__)

#: Characters of vLLM's error message passed on to a client (its first line).
MESSAGE_CHARS = 300


@dataclass(eq=False)
class Slot:
    """One adapter registered (or being registered) on the engine."""

    adapter: AdapterSpec
    #: The load call; done without an exception once the engine holds the adapter.
    task: asyncio.Task[None]
    #: Requests in flight that named it (counted from the moment they wait for the load).
    users: int = 0
    #: Monotonic time of its last use.
    used_at: float = field(default_factory=time.monotonic)

    @property
    def ready(self) -> bool:
        return self.task.done() and not self.task.cancelled() and self.task.exception() is None


class Registrations:
    """The adapters one engine holds (see the module docstring); only its instance's requests
    change it."""

    def __init__(self, instance_id: str, metrics: Metrics, wait_s: Callable[[], float]) -> None:
        self.instance_id = instance_id
        self.metrics = metrics
        #: How long a request may wait for a free adapter slot (the admission queue's timeout).
        self._wait_s = wait_s
        #: By name, least recently used first.
        self.slots: OrderedDict[str, Slot] = OrderedDict()
        self._unloading: dict[str, asyncio.Task[None]] = {}
        #: Names the engine may still hold although the book does not (after a level-2 wake,
        #: a failed unload, a changed path): the next load replaces them in place.
        self._stale: set[str] = set()
        self._changed = asyncio.Event()

    def holds(self, name: str) -> bool:
        """Registered or being registered: a request for it here needs no new load."""
        return name in self.slots

    def status(self) -> dict[str, str]:
        """Each adapter's state on this engine: ``loaded`` or ``loading``."""
        return {n: "loaded" if s.ready else "loading" for n, s in self.slots.items()}

    async def use(
        self,
        spec: ModelSpec,
        adapter: AdapterSpec,
        engine: EngineProcess,
        session: aiohttp.ClientSession,
    ) -> Slot:
        """Return once the engine holds `adapter`, counting one request on it: pair with
        ``done(slot)`` in ``finally`` (not when this raises). Raises `NotFound` (404),
        `EngineFailed` (502), `BadRequest` (400, a rank the engine cannot take) or
        `Unavailable` (503, every slot busy)."""
        name = adapter.name
        deadline: float | None = None
        while True:
            slot = self.slots.get(name)
            if slot is not None and slot.adapter.path != adapter.path and slot.users == 0:
                if slot.ready:  # a reload moved it: registered anew, from the new path
                    del self.slots[name]
                    self._stale.add(name)
                    slot = None
            if slot is not None:
                slot.users += 1
                slot.used_at = time.monotonic()
                self.slots.move_to_end(name)
                if slot.ready:
                    return slot
                try:
                    await asyncio.shield(slot.task)
                except BaseException:
                    self.done(slot)
                    raise
                return slot
            unloading = self._unloading.get(name)
            if unloading is not None:  # chosen as a victim a moment ago: load it again after
                await asyncio.wait({unloading})
                continue
            if len(self.slots) >= spec.max_adapters:
                victim = next((s for s in self.slots.values() if s.users == 0 and s.ready), None)
                if victim is None:
                    loop = asyncio.get_running_loop()
                    deadline = deadline or loop.time() + self._wait_s()
                    await self._wait_for_slot(spec, adapter, deadline - loop.time())
                    continue
                self._unload(spec, victim, engine, session)
            task = asyncio.ensure_future(self._load(spec, adapter, engine, session))
            self.slots[name] = new = Slot(adapter, task)
            task.add_done_callback(functools.partial(self._loaded, name, new))

    def done(self, slot: Slot) -> None:
        """A request that `use()` counted on `slot` has ended."""
        slot.users -= 1
        slot.used_at = time.monotonic()
        if slot.users == 0:
            self._notify()

    def reset(self) -> None:
        """The engine's GPU copies of every adapter are gone (a level-2 wake): forget them; the
        engine may still list their names, so each is registered again in place."""
        self._stale.update(self.slots)
        self.slots.clear()
        self._notify()

    # -- internals -----------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_for_slot(self, spec: ModelSpec, adapter: AdapterSpec, remaining: float) -> None:
        if remaining > 0:
            try:
                async with asyncio.timeout(remaining):
                    await self._changed.wait()
                return
            except TimeoutError:
                pass
        raise Unavailable(
            f"adapter '{adapter.name}' of model '{spec.name}': all {spec.max_adapters} adapter"
            f" slot(s) of {self.instance_id} are busy with requests in flight (max_adapters)",
            code="adapters_busy",
        )

    def _loaded(self, name: str, slot: Slot, _task: asyncio.Task[None]) -> None:
        """The load ended: a failed one leaves the book, so that the next request tries again.
        Either way a request waiting for a slot looks again: a load whose clients all left
        has no user once it is done, and may make room."""
        if slot.task.cancelled() or slot.task.exception() is not None:
            if self.slots.get(name) is slot:
                del self.slots[name]
        self._notify()

    def _unload(
        self, spec: ModelSpec, victim: Slot, engine: EngineProcess, session: aiohttp.ClientSession
    ) -> None:
        """Take `victim` out of the book now (no request can pick it from here on) and unload
        it from the engine in the background."""
        name = victim.adapter.name
        del self.slots[name]
        log.info("%s: unloading adapter %s (least recently used; max_adapters %d)",
                 self.instance_id, name, spec.max_adapters)  # fmt: skip
        self.metrics.adapter_unloads.labels(spec.name, name).inc()
        task = asyncio.ensure_future(self._unload_call(spec, name, engine, session))
        self._unloading[name] = task

        def gone(_t: asyncio.Task[None]) -> None:
            if self._unloading.get(name) is task:
                del self._unloading[name]

        task.add_done_callback(gone)

    async def _unload_call(
        self, spec: ModelSpec, name: str, engine: EngineProcess, session: aiohttp.ClientSession
    ) -> None:
        try:
            status, data = await _post(
                spec, engine, session, "/v1/unload_lora_adapter", {"lora_name": name}
            )
        except (aiohttp.ClientError, TimeoutError) as err:
            status, data = 0, str(err).encode()
        if status not in (200, 404):  # 404: the engine no longer has it either
            self._stale.add(name)
            log.warning("%s: unloading adapter %s answered %s: %s", self.instance_id, name,
                        status or "nothing", _summary(data))  # fmt: skip

    async def _load(
        self,
        spec: ModelSpec,
        adapter: AdapterSpec,
        engine: EngineProcess,
        session: aiohttp.ClientSession,
    ) -> None:
        name = adapter.name
        started = time.monotonic()
        inplace = name in self._stale
        rank = rank_of(adapter.path) if adapter.discovered else None
        if rank is not None and rank > spec.max_lora_rank:  # found after the engine started
            self._count(spec, name, "refused")
            raise BadRequest(
                f"adapter '{name}' of model '{spec.name}' has rank {rank}, above the"
                f" engine's --max-lora-rank {spec.max_lora_rank}; set"
                f" models.{spec.name}.args.max_lora_rank (the engine restarts)",
                code="adapter_rank_too_large",
                param="model",
            )
        try:
            status, data = await self._load_call(spec, adapter, engine, session, inplace)
            if status == 400 and not inplace and b"already been loaded" in data:
                # The engine kept it although the book had forgotten it: replace it in place.
                status, data = await self._load_call(spec, adapter, engine, session, True)
        except (aiohttp.ClientError, TimeoutError) as err:
            self._count(spec, name, "failed")
            log.error("%s: loading adapter %s failed: %s", self.instance_id, name,
                      err or type(err).__name__)  # fmt: skip
            raise EngineFailed(
                f"adapter '{name}' of model '{spec.name}': the engine did not answer its load",
                code="adapter_load_failed",
            ) from None
        if status == 200:
            self._stale.discard(name)
            self._count(spec, name, "ok")
            log.info("%s: adapter %s loaded in %.3fs", self.instance_id, name,
                     time.monotonic() - started)  # fmt: skip
            return
        raise self._refused(spec, adapter, status, data)

    async def _load_call(
        self,
        spec: ModelSpec,
        adapter: AdapterSpec,
        engine: EngineProcess,
        session: aiohttp.ClientSession,
        inplace: bool,
    ) -> tuple[int, bytes]:
        body: dict[str, object] = {"lora_name": adapter.name, "lora_path": adapter.path}
        if inplace:
            body["load_inplace"] = True
        return await _post(spec, engine, session, "/v1/load_lora_adapter", body)

    def _refused(
        self, spec: ModelSpec, adapter: AdapterSpec, status: int, data: bytes
    ) -> ProxyError:
        """What a client is told when the engine refused a load; the whole answer goes to the
        proxy's log."""
        name = adapter.name
        message, detail = _error_of(data)
        log.error("%s: loading adapter %s from %s answered %d: %s", self.instance_id, name,
                  adapter.path, status, _summary(data))  # fmt: skip
        where = f"adapter '{name}' of model '{spec.name}'"
        if status == 404 and detail is not None:  # FastAPI's: the route is not there
            self._count(spec, name, "failed")
            return EngineFailed(
                f"{where}: the engine does not take adapters at run time (no"
                " /v1/load_lora_adapter: VLLM_ALLOW_RUNTIME_LORA_UPDATING unset?)",
                code="adapter_load_failed",
            )
        if status == 404:
            self._count(spec, name, "not_found")
            return NotFound(
                f"{where}: the engine found no adapter at its path", code="adapter_not_found",
                param="model",
            )  # fmt: skip
        self._count(spec, name, "refused" if 400 <= status < 500 else "failed")
        why = message or f"status {status}"
        return EngineFailed(f"{where} could not be loaded: {why}", code="adapter_load_failed")

    def _count(self, spec: ModelSpec, name: str, result: str) -> None:
        self.metrics.adapter_loads.labels(spec.name, name, result).inc()


async def _post(
    spec: ModelSpec,
    engine: EngineProcess,
    session: aiohttp.ClientSession,
    path: str,
    body: dict[str, object],
) -> tuple[int, bytes]:
    """One call to the engine's LoRA routes (with its API key: they are under /v1)."""
    key = spec.api_key
    headers = {"Authorization": f"Bearer {key}"} if key else None
    client = engine.client(session)
    limit = aiohttp.ClientTimeout(total=spec.read_timeout_s)
    async with client.post(
        engine.base_url + path, json=body, headers=headers, timeout=limit
    ) as resp:
        return resp.status, await resp.read()


def _error_of(data: bytes) -> tuple[str | None, object]:
    """(vLLM's error message, its first line and bounded; FastAPI's ``detail`` if that is
    what came back)."""
    try:
        answer = json.loads(data)
    except ValueError:
        return None, None
    if not isinstance(answer, dict):
        return None, None
    err = answer.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        first = err["message"].strip().splitlines()[0] if err["message"].strip() else ""
        return first[:MESSAGE_CHARS] or None, None
    return None, answer.get("detail")


def _summary(data: bytes) -> str:
    return data[:500].decode("utf-8", "replace")
