"""The answer an engine gives to a fixed request: recorded once the engine has started, checked
after each of its wakes (``sleep.verify_wake``) before a request is routed to it.

A wake can answer 200, say awake on ``/is_sleeping`` and still compute garbage (weights restored
wrongly, a reload that skipped a tensor); the HTTP status never shows it, the output does. A
generating model is asked for a greedy completion of `PROMPT` (`TOKENS` tokens, each with its
log-probability and, where vLLM gives them, its token id); a pooling model for the numbers its
task's route answers for `PROMPT` (`engine.POOLING_ROUTES`).

Tokens must match exactly. Numbers are compared within a tolerance: vLLM does not promise
bit-identical results (batch invariance is off by default, and some kernels reduce in an order
that varies from run to run), even though the recording and every check run alone on the engine
(before it serves, and while it wakes) with an empty prefix cache (a sleep resets it). Broken
weights move log-probabilities by whole units and embeddings by far more than `VECTOR_TOLERANCE`;
a greedy token that flips between two near-equal candidates costs a needless cold start, never a
wrong answer. A check that differs is asked once more before the engine is condemned, and where
data-parallel ranks run experts (``--data-parallel-size`` > 1 with ``--enable-expert-parallel``)
the idle ranks' dummy batches change the expert kernels' shapes, so the first token alone is
compared. Wakes that keep failing bar their level (`breaker`).

What the check cannot see: it runs the base model's greedy path on a short text prompt, so a
speculative-decoding drafter restored wrongly (greedy output is the target model's whatever the
drafter proposes: only the speed drops), LoRA slots (the check names no adapter; they are
registered again after a level-2 wake) and a vision or audio encoder (no image or audio in the
prompt) are not exercised; nor are weights that only long prompts, sampling or other tasks reach.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from .engine import CallFailed, EngineProcess
from .failures import WrongAnswer

log = logging.getLogger(__name__)

#: The fixed input, and how many tokens a generating model is asked for.
PROMPT = "The capital of France is"
TOKENS = 8
#: Largest difference of one token's log-probability (nats) between recording and check ...
LOGPROB_TOLERANCE = 0.1
#: ... and of one number of a pooling model's answer.
VECTOR_TOLERANCE = 0.01


@dataclass(frozen=True)
class Oracle:
    """What the engine answered: tokens (ids, else text pieces) and their log-probabilities
    (empty when not given), or a pooling model's numbers."""

    tokens: tuple[int | str, ...] = ()
    logprobs: tuple[float, ...] = ()
    numbers: tuple[float, ...] = ()


async def take(engine: EngineProcess, session: aiohttp.ClientSession) -> Oracle:
    """Ask the engine the fixed question; `CallFailed` when it does not answer as it should."""
    if engine.spec.pooling:
        return Oracle(numbers=tuple(await engine.pool(session, PROMPT)))
    body: dict[str, object] = {
        "prompt": PROMPT,
        "max_tokens": TOKENS,
        "temperature": 0,
        "logprobs": 1,
        "return_token_ids": True,
    }
    choice = await engine.complete(session, body)
    ids = choice.get("token_ids")
    lp = choice.get("logprobs")
    pieces = lp.get("tokens") if isinstance(lp, dict) else None
    values = lp.get("token_logprobs") if isinstance(lp, dict) else None
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        tokens: tuple[int | str, ...] = tuple(ids)
    elif isinstance(pieces, list) and all(isinstance(p, str) for p in pieces):
        tokens = tuple(pieces)
    elif isinstance(choice.get("text"), str):
        tokens = (str(choice["text"]),)
    else:
        raise CallFailed("POST /v1/completions answered without tokens or text")
    logprobs: tuple[float, ...] = ()
    if isinstance(values, list) and all(isinstance(v, int | float) for v in values):
        logprobs = tuple(float(v) for v in values)
    return Oracle(tokens=tokens, logprobs=logprobs)


def mismatch(expected: Oracle, got: Oracle, first_only: bool = False) -> str | None:
    """How `got` differs from `expected` (for the proxy's log: positions and sizes, never the
    engine's text), or None when it matches. `first_only`: the first token and its
    log-probability alone (data-parallel experts: later tokens may drift with batch shapes)."""
    if first_only and expected.tokens:
        expected = Oracle(expected.tokens[:1], expected.logprobs[:1], expected.numbers)
        got = Oracle(got.tokens[:1], got.logprobs[:1], got.numbers)
    if expected.tokens != got.tokens:
        if len(expected.tokens) != len(got.tokens) and all(
            a == b for a, b in zip(expected.tokens, got.tokens, strict=False)
        ):
            return f"{len(got.tokens)} tokens instead of {len(expected.tokens)}"
        first = next(
            i for i, (a, b) in enumerate(zip(expected.tokens, got.tokens, strict=False)) if a != b
        )
        return f"first differing token at position {first}"
    if expected.logprobs and got.logprobs:
        if len(expected.logprobs) != len(got.logprobs):
            return f"{len(got.logprobs)} log-probabilities instead of {len(expected.logprobs)}"
        worst = _worst(expected.logprobs, got.logprobs)
        if worst is not None and not worst[1] <= LOGPROB_TOLERANCE:
            return f"log-probability of token {worst[0]} off by {worst[1]:.3g}"
    if len(expected.numbers) != len(got.numbers):
        return f"{len(got.numbers)} numbers instead of {len(expected.numbers)}"
    worst = _worst(expected.numbers, got.numbers)
    if worst is not None and not worst[1] <= VECTOR_TOLERANCE:
        return f"number {worst[0]} off by {worst[1]:.3g}"
    return None


def _worst(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[int, float] | None:
    """The position and size of the largest absolute difference (None when empty); a NaN
    anywhere is the largest."""
    worst: tuple[int, float] | None = None
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        d = 0.0 if x == y else abs(x - y)  # (equal infinities differ by 0, not NaN)
        if worst is None or d != d or d > worst[1]:
            worst = (i, d)
            if d != d:
                break
    return worst


async def record(
    engine: EngineProcess, session: aiohttp.ClientSession, timeout: float, who: str
) -> Oracle | None:
    """The answer the wakes of instance `who` are checked against; None where the check request
    failed (said in the log: its wakes go unchecked, the engine still serves)."""
    try:
        async with asyncio.timeout(timeout):
            return await take(engine, engine.client(session))
    except (CallFailed, TimeoutError) as err:
        why = str(err) or f"no answer within {timeout:g}s"
        log.warning("%s: its wakes will not be checked: the check request failed: %s", who, why)
        return None


async def verify(
    engine: EngineProcess,
    client: aiohttp.ClientSession,
    oracle: Oracle,
    first_only: bool,
    who: str,
    clock: Callable[[], float],
    observe: Callable[[float], None],
) -> None:
    """The wake check (`check`) of instance `who`, its seconds by `clock` told to `observe`
    whatever its outcome; `WrongAnswer` when it failed."""
    began = clock()
    why = await check(engine, client, oracle, first_only, who)
    observe(clock() - began)
    if why is not None:
        raise WrongAnswer(why)


async def check(
    engine: EngineProcess,
    client: aiohttp.ClientSession,
    oracle: Oracle,
    first_only: bool,
    who: str,
) -> str | None:
    """Ask the woken engine of instance `who` the check request, and once more when the answer
    differs (a near-tie that flipped once must not cost a cold start); how the second answer
    differs from the recording, None when either matched."""
    why = mismatch(oracle, await take(engine, client), first_only=first_only)
    if why is not None:
        again = mismatch(oracle, await take(engine, client), first_only=first_only)
        if again is None:
            log.warning("%s: the wake check differed once (%s), then matched", who, why)
        why = again
    return why
