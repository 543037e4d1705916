"""How an instance's start, wake or sleep ends badly, as errors its model acts on: a failed start
classified by its engine's log (`classify`), a failed wake or sleep by what it raised
(`wake_failure`, `sleep_failure`), what an operator's refused sleep and a request whose engine
broke are told."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..engine_args import start_failure
from ..errors import Conflict, EngineFailed, ProxyError, Unavailable
from .engine import CallFailed, EngineProcess, read_tail

log = logging.getLogger(__name__)


class Stopped(Unavailable):
    """The instance was stopped (unloaded, retired by a reload, shut down) while starting."""


def stopped_while(name: str, what: str) -> Stopped:
    """Model `name`'s instance was stopped while `what` (starting, asleep, waking)."""
    return Stopped(f"model '{name}' was stopped while {what}", code="stopped")


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


@dataclass(frozen=True)
class CallFailure:
    """How an instance's /sleep or wake (its /wake_up, wake check or warm-up) ended badly; the
    engine is stopped for it."""

    #: What went wrong, for the proxy's log.
    why: str
    #: The restart it counts as (``vllm_proxy_restarts_total``'s reason).
    reason: str
    #: Neither the engine's answer nor its time running out: a bug or an OS error (logged with
    #: its traceback).
    bug: bool = False
    #: The woken engine answered the check request wrongly: counted against its level
    #: (`breaker`).
    wrong_answer: bool = False


def wake_failure(err: Exception, timeout: float) -> CallFailure:
    """A wake that raised `err` (its time was `timeout`)."""
    if isinstance(err, WrongAnswer):
        return CallFailure(f"oracle mismatch: {err}", "wake_verify_failed", wrong_answer=True)
    if isinstance(err, CallFailed | TimeoutError):
        return CallFailure(str(err) or f"not awake within {timeout:g}s", "wake_failed")
    return CallFailure(type(err).__name__, "wake_failed", bug=True)


def sleep_failure(err: Exception, timeout: float) -> CallFailure:
    """A /sleep call that raised `err` (its time was `timeout`)."""
    bug = not isinstance(err, CallFailed | TimeoutError)
    return CallFailure(str(err) or f"no answer within {timeout:g}s", "sleep_failed", bug=bug)


def classify_start(
    err: ProxyError, devices: tuple[int, ...], engine: EngineProcess | None
) -> ProxyError:
    """A failed start: classified by its engine's log (`classify`) where it was placed on
    `devices` and its `engine` spawned, else `err` as it is."""
    if not devices or engine is None:
        return err
    return classify(err, read_tail(engine.log_path, lines=200))


def level_barred(name: str, level: int) -> Conflict:
    """An operator's sleep at a level whose wakes kept failing the wake check (`breaker`)."""
    return Conflict(
        f"model '{name}': its wakes from sleep level {level} kept failing the wake check, so it"
        f" no longer sleeps there (clear with POST /admin/models/{name}/wake_check/clear)",
        code="sleep_level_barred",
    )


def no_level_fits(name: str) -> Conflict:
    """An operator's sleep for which no level fits in host RAM (not stopped instead)."""
    return Conflict(
        f"model '{name}': no sleep level fits in the host RAM available (the proxy's log says"
        " how much each needs); not put to sleep",
        code="insufficient_host_memory",
    )


#: What a request is told of an engine killed for its health, by the reason it was killed for:
#: (what the engine did, the error code).
UNHEALTHY_WORDS = {
    "sleep_not_ordered": ("was put to sleep outside the proxy", "engine_unhealthy"),
    "stalled": ("stopped making progress", "engine_stalled"),
}
_NO_ANSWER = ("stopped answering health checks", "engine_unhealthy")


def unhealthy_error(name: str, reason: str) -> Unavailable:
    """503 + Retry-After for a request to model `name` whose engine was killed for `reason`."""
    what, code = UNHEALTHY_WORDS.get(reason, _NO_ANSWER)
    return Unavailable(
        f"model '{name}': the engine {what} and was restarted; retry", code=code, retry_after_s=1
    )


def upstream_error(
    name: str,
    who: str,
    unhealthy_reason: str | None,
    engine: EngineProcess,
    cause: BaseException | None = None,
) -> ProxyError:
    """What a request to model `name` whose engine connection broke is told:

    - the health watcher killed the engine (`unhealthy_reason`): 503 + Retry-After;
    - it died: 502 with the exit code or signal;
    - else 502, and `cause` (what the connection raised) goes to the log of instance `who`.

    Never engine log lines (they may hold other users' prompts); those go to the proxy's log."""
    if unhealthy_reason is not None:
        return unhealthy_error(name, unhealthy_reason)
    if engine.exit_code is not None:
        log.error("%s", engine.failure_message("exited while serving a request"))
        return EngineFailed(engine.short_failure("exited while serving the request"))
    if cause is not None:
        log.warning("%s: the request failed on a live engine: %s", who, cause)
    return EngineFailed(f"model '{name}': connection to the engine was lost")
