"""How an instance's start or wake ends badly, as errors its model acts on, and a failed start
classified by its engine's log (`classify`)."""

from __future__ import annotations

from ..engine_args import start_failure
from ..errors import EngineFailed, ProxyError, Unavailable


class Stopped(Unavailable):
    """The instance was stopped (unloaded, retired by a reload, shut down) while starting."""


class OutOfMemory(EngineFailed):
    """The engine failed to start because the GPU had too little free memory."""


class KvCacheShort(EngineFailed):
    """vLLM started but its budget left no room for the KV cache (non-KV memory took more than
    planned): a larger budget may work, evicting others does not."""


class ProfilingDisturbed(EngineFailed):
    """vLLM's start failed its memory-profiling check: another process freed GPU memory on the
    device meanwhile (an engine that crashed, a program outside the proxy). Worth a retry."""


class WakeFailed(Unavailable):
    """A wake that failed (or a sleep that failed under it): the engine was stopped; the caller
    starts a new instance."""


class WrongAnswer(Exception):
    """A woken engine answered the check request differently from its start (`oracle`)."""


def classify(err: ProxyError, tail: str) -> ProxyError:
    """A failed start placed on devices, by the end of its engine's log (`tail`):

    - no room for the KV cache in its budget: `KvCacheShort` (its model grows the budget);
    - profiling disturbed by another process: `ProfilingDisturbed` (retried);
    - out of GPU memory: `OutOfMemory` (its model evicts more and retries);
    - else `err` itself."""
    kind = start_failure(tail)
    if kind == "kv_short":
        return KvCacheShort(err.message, code="insufficient_gpu_memory")
    if kind == "profiling":
        return ProfilingDisturbed(err.message, code="engine_start_failed")
    if kind == "oom":
        return OutOfMemory(err.message, code="insufficient_gpu_memory")
    return err
