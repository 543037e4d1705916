"""Token ids and log-probabilities of the fake engine's completions, for requests that ask for
them (``logprobs``, ``return_token_ids``), in vLLM 0.33's shapes
(``entrypoints/openai/completion/protocol.py``: ``CompletionLogProbs``, ``token_ids``).

Greedy or not, the answer is the same for the same request: word ``tok<i>`` is token id
``1000 + i`` with log-probability ``-0.01 * (i + 1)``. A wrong answer (weights lost, a corrupting
wake) has other ids and far lower log-probabilities.
"""

from typing import Any

#: The id and log-probability of every token of a wrong answer.
GARBAGE_ID = 31337
GARBAGE_LOGPROB = -7.5


def token_ids(count: int, garbage: bool) -> list[int]:
    """The ids of the first `count` tokens of a reply."""
    return [GARBAGE_ID] * count if garbage else [1000 + i for i in range(count)]


def completion_logprobs(words: list[str], top: int, garbage: bool) -> dict[str, Any]:
    """A completion choice's ``logprobs`` for these `words` with `top` alternatives each."""
    values = [GARBAGE_LOGPROB if garbage else -0.01 * (i + 1) for i in range(len(words))]
    offsets, at = [], 0
    for word in words:
        offsets.append(at)
        at += len(word)
    return {
        "text_offset": offsets,
        "token_logprobs": values,
        "tokens": words,
        "top_logprobs": [{w: v} if top > 0 else None for w, v in zip(words, values, strict=True)],
    }
