"""The fake engine's knobs (``fake_vllm``'s package docstring) as typed settings.

Tests build a `FakeEngine` and put ``.env()`` in a model's or the engine's ``env``; this module
is the one place that spells the ``FAKE_ENGINE_*`` variable names. A field left at its default
leaves the variable unset, so the fake engine keeps its own default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Number = int | float


@dataclass(frozen=True)
class FakeEngine:
    """One fake engine's settings; ``FakeEngine(tokens=20, token_delay=0.05).env()``."""

    #: Seconds of "model loading" before the port is bound.
    startup_delay: Number | None = None
    #: Tokens per reply, and seconds per generated token.
    tokens: int | None = None
    token_delay: Number | None = None
    #: After this many chat/completion requests the next one kills the process (`crash_code`).
    crash_after: int | None = None
    crash_code: int | None = None
    #: After this many chat/completion requests every later one stalls for good, /health 200.
    stall_after: int | None = None
    #: Fail start-up with this exit status, never binding the port.
    exit_code: int | None = None
    ignore_sigterm: bool = False
    #: Fork an ``EngineCore`` child that only a process-group kill ends.
    spawn_child: bool = False
    #: A marker file: the first start with it fails like a taken port.
    port_in_use_once: Path | str | None = None
    #: Seconds ``/sleep`` and ``/wake_up`` take.
    sleep_delay: Number | None = None
    wake_delay: Number | None = None
    #: Requests while asleep: ``park`` (the default: wait for the wake) or ``reject`` (503).
    asleep: Literal["reject", "park"] | None = None
    sleep_fail: bool = False
    wake_fail: bool = False
    wake_hang: bool = False
    wake_lies: bool = False
    #: Sleep levels after whose wake every answer is wrong (HTTP 200): ``"1"``, ``"2"``,
    #: ``"1,2"`` or ``"all"``.
    wake_corrupts: Literal["0", "1", "2", "1,2", "all"] | None = None
    #: LoRA adapters whose load fails, and seconds each load takes.
    lora_fail: Sequence[str] = ()
    lora_load_delay: Number | None = None
    #: A file where every upload's bytes are recorded.
    upload_log: Path | str | None = None
    #: GPU mode: MiB of real device memory held, on this torch device.
    gpu_mb: int | None = None
    gpu_device: str | None = None
    #: Simulated-GPU mode: the ledger, then sizes in MiB and times in seconds.
    sim_gpu: Path | str | None = None
    sim_context_mb: int | None = None
    sim_weights_mb: int | None = None
    #: The weights' tensors, packed into torch's segments (each a CuMem allocation, pinned at a
    #: power of two by a level-1 sleep).
    sim_weight_segments_mb: Sequence[int] = ()
    #: The vocabulary of V2's sampler state (``--max-num-seqs`` x vocab int32, weights pool).
    sim_vocab: int | None = None
    #: The CuMem ``runtime`` pool (pinned by sleeps of both levels).
    sim_runtime_mb: int | None = None
    #: The CuMem ``workspace`` pool (discarded by every sleep, never pinned).
    sim_workspace_mb: int | None = None
    #: What a level-2 sleep copies to pageable host memory (model buffers).
    sim_buffers_mb: int | None = None
    #: The transient peak: in the budget, released after profiling and by every sleep and
    #: wake, regrown by the first batch of at least `sim_peak_tokens` tokens (0: any request).
    sim_peak_mb: int | None = None
    sim_peak_tokens: int | None = None
    sim_graphs_mb: int | None = None
    #: What the profile estimates for the graphs (unset: exactly `sim_graphs_mb`).
    sim_graphs_estimate_mb: int | None = None
    sim_min_kv_mb: int | None = None
    sim_reload_temp_mb: int | None = None
    sim_profile_s: Number | None = None
    sim_after_profile_s: Number | None = None
    sim_sleep_s: Number | None = None
    sim_reload_mb_s: Number | None = None

    def env(self, **more: str) -> dict[str, str]:
        """The environment variables these settings stand for (and `more` as given)."""
        out: dict[str, str] = {}
        for field in dataclasses.fields(self):
            value: Any = getattr(self, field.name)
            if value is None or (value is False and field.type == "bool") or value == ():
                continue
            if isinstance(value, bool):
                text = "1" if value else "0"
            elif isinstance(value, str | Path):
                text = str(value)
            elif isinstance(value, int | float):
                text = repr(value)
            else:
                text = ",".join(str(v) for v in value)
            out["FAKE_ENGINE_" + field.name.upper()] = text
        return {**out, **more}

    def but(self, **changes: Any) -> FakeEngine:
        """These settings with `changes`."""
        return dataclasses.replace(self, **changes)
