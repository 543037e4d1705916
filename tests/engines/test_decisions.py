"""The instance's pure decisions, where their facts live: a failed start by its log, the sleep
level that fits in host RAM, what a sleep and a start pin there, the planner's phase of a state
and what a request whose engine broke is told. Tables, no event loop, no process."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_proxy.engine_args import BACKED_UP, start_failure
from vllm_proxy.engines.failures import (
    KvCacheShort,
    OutOfMemory,
    ProfilingDisturbed,
    classify,
    level_barred,
    no_level_fits,
    unhealthy_error,
    upstream_error,
)
from vllm_proxy.engines.states import DOWN, PHASES, State
from vllm_proxy.errors import EngineFailed, Unavailable
from vllm_proxy.planning.footprint import (
    RUNTIME_POOL_MB,
    host_runtime_mb,
    host_start_mb,
)
from vllm_proxy.planning.hostmem import (
    HOST_RAM_MARGIN_MB,
    HostRam,
    sleep_guess,
    sleep_levels,
)
from vllm_proxy.planning.planner import Phase


@pytest.mark.parametrize(
    ("tail", "kind"),
    [
        ("ValueError: No available memory for the cache blocks.", "kv_short"),
        ("4 GiB KV cache, which is larger than the available KV cache memory", "kv_short"),
        ("AssertionError: Error in memory profiling. Initial free memory 70 GiB", "profiling"),
        ("torch.OutOfMemoryError: CUDA out of memory.", "oom"),
        ("ValueError: Free memory on device (3.1/79.2 GiB) on startup is less than desired", "oom"),
        ("RuntimeError: something else", None),
        ("", None),
    ],
)  # fmt: skip
def test_a_failed_start_is_classified_by_its_log(tail: str, kind: str | None) -> None:
    assert start_failure(tail) == kind


def test_the_classification_picks_the_error_its_model_acts_on() -> None:
    err = EngineFailed("model 'm': the engine exited while starting", code="engine_start_failed")
    cases: list[tuple[str, type[Exception], str]] = [
        ("No available memory for the cache blocks", KvCacheShort, "insufficient_gpu_memory"),
        ("Error in memory profiling", ProfilingDisturbed, "engine_start_failed"),
        ("CUDA out of memory", OutOfMemory, "insufficient_gpu_memory"),
    ]
    for tail, kind, code in cases:
        got = classify(err, tail)
        assert isinstance(got, kind) and got.code == code and got.message == err.message
    # Both a KV shortage and an OOM line: the budget is what to change, not the neighbours.
    assert isinstance(classify(err, "out of memory\nNo available memory for the cache blocks"),
                      KvCacheShort)  # fmt: skip
    assert classify(err, "Traceback: ImportError") is err


def test_vllms_backed_up_line_is_read_per_rank() -> None:
    line = ("CuMemAllocator: sleep freed 70.25 GiB memory in total, of which 14.5 GiB is backed"
            " up in CPU")  # fmt: skip
    assert BACKED_UP.findall(f"{line}\n{line}\n") == ["14.5", "14.5"]


@pytest.mark.parametrize(
    ("asked", "reloadable", "levels"),
    [(1, True, [1, 2]), (1, False, [1]), (2, True, [2]), (2, False, [2])],
)
def test_level_1_falls_back_to_level_2_only_where_the_weights_reload(
    asked: int, reloadable: bool, levels: list[int]
) -> None:
    assert sleep_levels(asked, reloadable) == levels


def test_what_a_sleep_pins_before_it_was_measured() -> None:
    assert sleep_guess(1, 4_000, 512) == 4_512, "the weights and the runtime pool"
    assert sleep_guess(1, None, 512) is None, "the weights' size unknown"
    assert sleep_guess(2, 4_000, 512) == 512, "the runtime pool alone"


def _host(room: int) -> HostRam:
    return HostRam(lambda: room, rss=lambda _pid: None, shmem=lambda: None)


def test_the_first_level_that_fits_is_chosen_and_promised(caplog: Any) -> None:
    key = ("m", "engine")
    refused: list[int] = []

    def free(short: int) -> bool:
        refused.append(short)
        return False

    host = _host(4_000 + HOST_RAM_MARGIN_MB)
    assert host.choose_level("m#1", key, 1, {1: 4_000, 2: 512}, free) == 1
    assert host.promised == {"m#1": 4_000} and refused == []
    host.settle("m#1")
    host = _host(3_000)
    with caplog.at_level(logging.WARNING):
        assert host.choose_level("m#1", key, 1, {1: 4_000, 2: 512}, free) == 2
    assert refused == [4_000 + HOST_RAM_MARGIN_MB - 3_000], "asked to free what level 1 lacks"
    assert host.promised == {"m#1": 512}
    assert "using level 2" in caplog.text
    host.settle("m#1")
    assert _host(100).choose_level("m#1", key, 1, {1: 4_000, 2: 512}, free) is None
    assert _host(100).choose_level("m#1", key, 1, {1: None, 2: 512}, free) == 1, "unknown: as asked"


def test_a_level_is_kept_where_stopping_sleepers_frees_the_host_ram() -> None:
    host = _host(1_000)
    freed: list[int] = []
    chosen = host.choose_level("m#1", ("m", "e"), 1, {1: 4_000}, lambda s: freed.append(s) or True)
    assert chosen == 1 and freed == [4_000 + HOST_RAM_MARGIN_MB - 1_000]
    assert host.promised == {"m#1": 4_000}


def test_a_sleep_pins_only_what_the_engine_does_not_keep_yet() -> None:
    host = _host(2_000)
    host.retained["m#1"] = 4_000
    assert host.choose_level("m#1", ("m", "e"), 1, {1: 4_000}, lambda _s: False) == 1
    assert host.promised == {}, "nothing more to pin"


def test_a_start_promises_its_token_buffer_or_is_refused() -> None:
    host = _host(1_000)
    host.promise_start("m", "m#1", 600)
    assert host.promised == {"m#1": 600}
    with pytest.raises(Unavailable) as refused:
        host.promise_start("n", "n#1", 600)
    assert refused.value.code == "insufficient_host_memory" and "400 MiB" in refused.value.message


def test_host_ram_of_the_runtime_pool_and_the_token_buffer() -> None:
    fp: Any = SimpleNamespace(gpus=2, detail={"lora_mb": 100, "token_buffer_mb": 64})
    assert host_runtime_mb(None) == RUNTIME_POOL_MB
    assert host_runtime_mb(fp) == (RUNTIME_POOL_MB + 100) * 2
    assert host_start_mb(None) == 0 and host_start_mb(fp) == 64


def test_every_placed_state_has_one_phase() -> None:
    """Admission (in the proxy and the density benchmark) views an instance with a claim by
    this table: every state between a start and the end of a stop has a phase, no other."""
    assert set(PHASES) == set(State) - DOWN - {State.NEW}
    assert PHASES[State.DRAINING] is Phase.RUNNING and PHASES[State.WAKE_WAITING] is Phase.WAKING
    assert PHASES[State.SLEEPING] is Phase.ASLEEP


def test_what_a_request_whose_engine_broke_is_told() -> None:
    alive: Any = SimpleNamespace(exit_code=None)
    stalled = upstream_error("m", "m#1", "stalled", alive)
    assert isinstance(stalled, Unavailable) and stalled.code == "engine_stalled"
    assert stalled.headers == {"Retry-After": "1"}
    hung = unhealthy_error("m", "unhealthy")
    assert "stopped answering health checks" in hung.message and hung.code == "engine_unhealthy"
    lost = upstream_error("m", "m#1", None, alive, ConnectionResetError())
    assert isinstance(lost, EngineFailed) and "connection to the engine was lost" in lost.message
    dead: Any = SimpleNamespace(
        exit_code=-9,
        failure_message=lambda what: f"log: {what}",
        short_failure=lambda what: f"model 'm': engine {what} (SIGKILL)",
    )
    died = upstream_error("m", "m#1", None, dead)
    assert isinstance(died, EngineFailed) and "SIGKILL" in died.message


def test_an_operators_refused_sleep_says_why() -> None:
    barred = level_barred("m", 1)
    assert barred.code == "sleep_level_barred"
    assert "/admin/models/m/wake_check/clear" in barred.message
    assert no_level_fits("m").code == "insufficient_host_memory"
