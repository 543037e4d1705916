"""The request path's door to an engine: a lease that yields an `Upstream` handle.

``async with manager.lease(model, session, adapter, priority) as up:`` waits until an instance
of the model serves (starting or waking one when none does), counts the request on it, and
gives it back in ``__aexit__`` (on every exit: an answer, an error, a client gone). The handler
holds no instance and no engine process, only `up`:

* where the engine listens: `Upstream.address` (a port, or a socket's path), `base_url`,
  `socket_path`;
* what it expects: `api_key`, the key the engine was started with (None: none);
* how long a read may stay silent: `read_timeout_s` (the model's, as reloaded);
* what a failure after the engine exited means: `failure(cause)`, the error to answer with
  (it waits, bounded, for the exit code first);
* a LoRA adapter's slot: ``async with up.adapter(spec):`` registers the adapter on the engine
  (one load however many requests wait) and counts the request on it until the block ends;
* whose it is: `instance` (the id) and `model` (the name), for logs and metrics; `progress`, the
  engine's byte count that the stall watchdog reads.
"""

from __future__ import annotations

from ..adapters import AdapterSpec
from ..engines.engine import EngineProcess
from ..engines.instance import Instance
from ..engines.lora import Slot
from ..engines.model import Model
from ..engines.progress import Progress
from ..errors import ProxyError

__all__ = ["AdapterUse", "Lease", "Progress", "Upstream"]


class Upstream:
    """One leased engine, as the request path sees it (valid inside its lease only)."""

    __slots__ = ("_engine", "_inst", "address", "base_url", "instance", "model", "progress",
                 "socket_path")  # fmt: skip

    def __init__(self, inst: Instance, engine: EngineProcess) -> None:
        self._inst = inst
        self._engine = engine
        #: The instance's id (``<model>#<n>``) and its model's name.
        self.instance = inst.id
        self.model = inst.name
        #: Where the engine listens: a loopback port, or a Unix socket's path.
        self.address: int | str = engine.address
        self.socket_path = engine.socket_path
        #: The URL of the engine for a client of `socket_path`'s (the host names nothing there).
        self.base_url = engine.base_url
        #: The engine's bytes on its requests in flight (the stall watchdog).
        self.progress = inst.progress

    @property
    def api_key(self) -> str | None:
        """The key the engine was started with (sent as ``Authorization``); None: none."""
        return self._inst.spec.api_key

    @property
    def read_timeout_s(self) -> float:
        """How long a read of the engine's answer may wait for a byte."""
        return self._inst.spec.read_timeout_s

    async def failure(self, cause: BaseException | None = None) -> ProxyError:
        """The error a failed exchange with the engine means: the engine's exit (with its
        code and a classification) when it died, else a failure of the engine (`cause`)."""
        return await self._inst.upstream_failure_after_exit(self._engine, cause)

    def adapter(self, adapter: AdapterSpec) -> AdapterUse:
        """``async with up.adapter(spec):``: the engine holds `adapter` for the block."""
        return AdapterUse(self._inst, self._engine, adapter)


class AdapterUse:
    """A LoRA adapter's slot on one engine, held as an async context.

    * entering waits until the engine holds the adapter and counts the request on it; it
      raises as `LoRAs.use` does (404, 502, 400, 503) and then holds nothing;
    * leaving gives the count back: the adapter may be unloaded for another once unused.

    `entered` tells an error raised on entry from one raised in the block.
    """

    __slots__ = ("_adapter", "_engine", "_inst", "_slot", "entered")

    def __init__(self, inst: Instance, engine: EngineProcess, adapter: AdapterSpec) -> None:
        self._inst = inst
        self._engine = engine
        self._adapter = adapter
        self._slot: Slot | None = None
        self.entered = False

    async def __aenter__(self) -> None:
        inst = self._inst
        self._slot = await inst.adapters.use(
            inst.spec, self._adapter, self._engine, inst.ctx.session
        )
        self.entered = True

    async def __aexit__(self, *exc: object) -> None:
        if self._slot is not None:
            self._inst.adapters.done(self._slot)
            self._slot = None


class Lease:
    """The request path's hold on an instance: acquired on entry, released in ``__aexit__``.

    A plain class rather than a generator-based context manager: it is on every request. A
    caller that awaits `__aenter__` as a task of its own (to send keep-alives meanwhile) gives
    the lease back with `release()`.
    """

    __slots__ = ("_inst", "adapter", "model", "priority", "session")

    def __init__(
        self,
        model: Model,
        session: str | None = None,
        adapter: str | None = None,
        priority: int = 0,
    ) -> None:
        self.model = model
        self.session = session
        self.adapter = adapter
        self.priority = priority
        self._inst: Instance | None = None

    async def __aenter__(self) -> Upstream:
        inst, engine = await self.model.acquire(self.session, self.adapter, self.priority)
        self._inst = inst
        return Upstream(inst, engine)

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Give the lease back (once; nothing when none was taken)."""
        inst, self._inst = self._inst, None
        if inst is not None:
            inst.release()
