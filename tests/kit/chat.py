"""Chat and stream helpers over the OpenAI API the proxy serves."""

from __future__ import annotations

import json
from typing import Any

import aiohttp


def chat_body(model: str, content: str = "hi", **extra: Any) -> dict[str, Any]:
    """A chat completion request for `model` with one user message and `extra` keys."""
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


async def chat_text(resp: aiohttp.ClientResponse) -> tuple[int, str]:
    """A non-streamed reply read whole: (200, the reply's text), else (status, the body)."""
    body = await resp.read()
    if resp.status != 200:
        return resp.status, body.decode()
    return resp.status, json.loads(body)["choices"][0]["message"]["content"]


def sse_events(body: bytes) -> list[str]:
    """The ``data:`` payloads of an event stream, in order (``[DONE]`` included)."""
    return [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]


async def healthy(session: aiohttp.ClientSession, url: str, path: str = "/health") -> bool:
    """``GET {url}{path}`` answers 200 (False while nothing listens)."""
    try:
        async with session.get(url + path) as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False
