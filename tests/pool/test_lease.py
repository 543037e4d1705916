"""The request path's door to an engine (`pool.lease`) and the pages' views of fits
(`pool.views.Fit`), against stand-ins for a model, its instance and its engine process.

* the lease yields an `Upstream` handle and gives the lease back on every exit, once;
* a lease never taken (the start failed) gives nothing back;
* the handle reads the model's settings as reloaded, and answers a failure as the instance does;
* an adapter's slot is held for its block only, and an error on entry is told apart.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from vllm_proxy.errors import EngineFailed, NotFound, ProxyError, Unavailable
from vllm_proxy.planning.planner import NoFit, Plan
from vllm_proxy.pool.lease import Lease, Upstream
from vllm_proxy.pool.views import Fit, _fit


class Registrations:
    """What `Instance.adapters` answers: a slot per `use`, given back by `done`."""

    def __init__(self, refuse: ProxyError | None = None) -> None:
        self.refuse = refuse
        self.users = 0
        self.calls: list[Any] = []

    async def use(self, spec: Any, adapter: Any, engine: Any, session: Any) -> object:
        self.calls.append((spec, adapter, engine, session))
        if self.refuse is not None:
            raise self.refuse
        self.users += 1
        return object()

    def done(self, slot: object) -> None:
        self.users -= 1


class Instance:
    def __init__(self, refuse: ProxyError | None = None) -> None:
        self.id, self.name = "m#1", "m"
        self.spec = SimpleNamespace(api_key="engine-key", read_timeout_s=30.0)
        self.progress = object()
        self.ctx = SimpleNamespace(session="shared-session")
        self.adapters = Registrations(refuse)
        self.leases = 0
        self.failures: list[tuple[Any, Any]] = []

    def release(self) -> None:
        self.leases -= 1

    async def upstream_failure_after_exit(self, engine: Any, cause: Any) -> ProxyError:
        self.failures.append((engine, cause))
        return EngineFailed(f"model 'm': the engine exited ({cause})")


class Model:
    def __init__(self, inst: Instance, refuse: ProxyError | None = None) -> None:
        self.inst = inst
        self.engine = SimpleNamespace(
            address="/run/m.1.sock", socket_path="/run/m.1.sock", base_url="http://127.0.0.1:0"
        )
        self.refuse = refuse
        self.asked: tuple[Any, ...] | None = None

    async def acquire(self, session: Any, adapter: Any, priority: int) -> tuple[Any, Any]:
        self.asked = (session, adapter, priority)
        if self.refuse is not None:
            raise self.refuse
        self.inst.leases += 1
        return self.inst, self.engine


async def test_a_lease_yields_the_engine_handle_and_gives_it_back_once() -> None:
    inst = Instance()
    model = Model(inst)
    lease = Lease(model, "session-a", "ad", 3)
    async with lease as engine:
        assert isinstance(engine, Upstream)
        assert model.asked == ("session-a", "ad", 3)
        assert (engine.instance, engine.model) == ("m#1", "m")
        assert engine.address == engine.socket_path == "/run/m.1.sock"
        assert engine.base_url == "http://127.0.0.1:0"
        assert (engine.api_key, engine.read_timeout_s) == ("engine-key", 30.0)
        assert engine.progress is inst.progress
        assert inst.leases == 1
    assert inst.leases == 0
    lease.release()  # a second release gives nothing back
    assert inst.leases == 0


async def test_a_lease_is_given_back_when_the_block_fails() -> None:
    inst = Instance()
    with pytest.raises(RuntimeError):
        async with Lease(Model(inst)):
            raise RuntimeError("the client went away")
    assert inst.leases == 0


async def test_a_lease_never_taken_gives_nothing_back() -> None:
    inst = Instance()
    lease = Lease(Model(inst, refuse=Unavailable("no memory")))
    with pytest.raises(Unavailable):
        async with lease:
            pass  # pragma: no cover
    lease.release()
    assert inst.leases == 0


async def test_the_handle_reads_the_model_s_settings_as_reloaded() -> None:
    inst = Instance()
    async with Lease(Model(inst)) as engine:
        inst.spec = SimpleNamespace(api_key=None, read_timeout_s=5.0)
        assert (engine.api_key, engine.read_timeout_s) == (None, 5.0)


async def test_a_failure_is_what_the_instance_makes_of_it_after_the_exit() -> None:
    inst = Instance()
    model = Model(inst)
    async with Lease(model) as engine:
        cause = ConnectionResetError("reset")
        err = await engine.failure(cause)
    assert isinstance(err, EngineFailed)
    assert inst.failures == [(model.engine, cause)]


async def test_an_adapter_slot_is_held_for_its_block_only() -> None:
    inst = Instance()
    model = Model(inst)
    adapter = SimpleNamespace(name="sql")
    async with Lease(model) as engine:
        use = engine.adapter(adapter)
        async with use:
            assert use.entered and inst.adapters.users == 1
        assert inst.adapters.users == 0
    assert inst.adapters.calls == [(inst.spec, adapter, model.engine, "shared-session")]


async def test_an_adapter_refused_on_entry_holds_nothing_and_says_so() -> None:
    inst = Instance(refuse=NotFound("no adapter 'sql'"))
    async with Lease(Model(inst)) as engine:
        use = engine.adapter(SimpleNamespace(name="sql"))
        with pytest.raises(NotFound):
            async with use:
                pass  # pragma: no cover
        assert not use.entered and inst.adapters.users == 0


@pytest.mark.parametrize(
    ("decision", "fit"),
    [
        (Plan(devices=(0,), evict=()), Fit(True)),
        (Plan(devices=(0,), evict=("b#2",), sleep=("a#1",)), Fit(True, None, ("a#1",), ("b#2",))),
        (NoFit("needs 80000 MiB on one GPU", ("a",)), Fit(False, "needs 80000 MiB on one GPU")),
    ],
)
def test_a_fit_says_what_a_start_would_take(decision: Plan | NoFit, fit: Fit) -> None:
    got = _fit(decision)
    assert got == fit
    assert got.now == (fit.possible and not fit.sleep and not fit.evict)
