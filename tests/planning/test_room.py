"""Whether every configured model fits awake at once (`memory.all_fit`, `Memory.room_for_all`):
what `sleep.on_idle: needed` asks before an idle engine sleeps."""

from __future__ import annotations

import pytest

from vllm_proxy.config import parse_config
from vllm_proxy.metrics import Metrics
from vllm_proxy.planning.gpu import StaticBudget
from vllm_proxy.planning.memory import Memory, all_fit, engines_of

#: (engines as (MiB per device, devices spanned, devices allowed), room per device, all fit)
CASES = [
    ([], {0: 1000}, True),
    ([(600, 1, None), (400, 1, None)], {0: 1000}, True),
    ([(600, 1, None), (401, 1, None)], {0: 1000}, False),
    # Largest first: 700 then 600 each on a device of its own, then 300 beside the 600.
    ([(300, 1, None), (600, 1, None), (700, 1, None)], {0: 1000, 1: 1000}, True),
    # A tensor-parallel engine takes its size on each of two devices.
    ([(800, 2, None), (300, 1, None)], {0: 1000, 1: 1000}, False),
    ([(800, 2, None), (200, 1, None)], {0: 1000, 1: 1000}, True),
    # Allowed devices bind: both pinned to device 0.
    ([(600, 1, (0,)), (600, 1, (0,))], {0: 1000, 1: 1000}, False),
    ([(600, 1, (0,)), (600, 1, (1,))], {0: 1000, 1: 1000}, True),
    # A device the engine may use but the proxy does not manage is no room.
    ([(600, 1, (5,))], {0: 1000}, False),
]


@pytest.mark.parametrize(("engines", "room", "fits"), CASES)
def test_all_fit_places_the_largest_first_on_the_roomiest_devices(
    engines: list[tuple[int, int, tuple[int, ...] | None]], room: dict[int, int], fits: bool
) -> None:
    assert all_fit(engines, room) is fits
    assert room == dict(room), "the room given is not changed"


def test_a_model_counts_its_replicas_or_its_autoscalers_most() -> None:
    cfg = parse_config({"models": {
        "one": {"model": "x"},
        "three": {"model": "x", "replicas": 3},
        "scaled": {"model": "x", "autoscale": {"max_replicas": 4}},
    }})  # fmt: skip
    specs = cfg.specs()
    assert [engines_of(specs[n]) for n in ("one", "three", "scaled")] == [1, 3, 4]


def test_room_for_all_reads_the_budget_less_claims_and_the_reserve() -> None:
    def memory(budget: int, **models: int) -> Memory:
        cfg = parse_config({
            "gpu": {"monitor": "static", "devices": [{"id": 0, "memory_mb": budget}]},
            "models": {n: {"model": "x", "memory_mb": mb} for n, mb in models.items()},
        })  # fmt: skip
        return Memory(StaticBudget({0: budget}), "static", cfg, cfg.specs(), Metrics())

    assert memory(4000, a=1000, b=1000).room_for_all()
    assert not memory(1500, a=1000, b=1000).room_for_all()
    # Claims of the proxy's own engines are not taken from the room: they are those engines.
    m = memory(4000, a=1000, b=1000)
    m.claim("a#1", m.placement(m._specs["a"], (0,)))
    assert m.room_for_all()
