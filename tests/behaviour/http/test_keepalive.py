"""Component tests: a streaming request that waits for a start or a wake gets SSE keep-alive
comments (or, opt-in, visible progress), and afterwards the engine's stream byte for byte."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
from kit import FakeEngine, RunningProxy, StartProxy, make_config

SLOW_START = FakeEngine(startup_delay=2, tokens=12)
EXPECTED = "".join(f"tok{i} " for i in range(12))


def config(tmp_path: Path, **model: Any) -> Any:
    m = {"model": "x", "env": SLOW_START.env(), **model}
    return make_config(tmp_path, {"m": m}, engine={"loading_keepalive_interval_s": 0.3})


async def raw_stream(proxy: RunningProxy, path: str = "/v1/chat/completions") -> bytes:
    if path.endswith("chat/completions"):
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    else:
        body = {"prompt": "hi"}
    body |= {"model": "m", "stream": True}
    async with proxy.http.post(proxy.url + path, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        return await resp.read()


def split(body: bytes) -> tuple[list[bytes], list[dict[str, Any]], bool]:
    """(comment lines, data events as JSON, whether it ended with [DONE])."""
    comments, events, done = [], [], False
    for block in body.split(b"\n\n"):
        if not block:
            continue
        if block.startswith(b":"):
            comments.append(block)
        elif block == b"data: [DONE]":
            done = True
        else:
            assert block.startswith(b"data: "), block
            events.append(json.loads(block[6:]))
    return comments, events, done


def content(events: list[dict[str, Any]], key: str = "content") -> str:
    out = ""
    for e in events:
        for choice in e.get("choices") or []:
            out += (choice.get("delta") or {}).get(key) or choice.get("text") or ""
    return out


async def test_keepalive_comments_while_the_engine_starts(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(config(tmp_path))
    body = await raw_stream(proxy)
    comments, events, done = split(body)
    assert len(comments) >= 2 and set(comments) == {b": loading m"}
    assert body.startswith(b": loading m\n\n"), "the comments come before the engine's stream"
    assert content(events) == EXPECTED and done
    # Once it serves, a stream gets the engine's bytes only.
    comments, events, done = split(await raw_stream(proxy))
    assert comments == [] and content(events) == EXPECTED and done


async def test_the_openai_sdk_ignores_the_comments(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(tmp_path))
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0)
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    text = ""
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    assert text == EXPECTED
    await client.close()


async def test_completions_stream_keepalive(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(tmp_path, loading_progress=True))
    comments, events, done = split(await raw_stream(proxy, "/v1/completions"))
    # Visible progress would become part of the completion's text: comments there.
    assert comments and content(events) == EXPECTED and done


async def test_loading_progress_is_visible_reasoning(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(config(tmp_path, loading_progress=True))
    comments, events, done = split(await raw_stream(proxy))
    assert comments == []
    progress = [e for e in events if e["id"].startswith("loading-")]
    assert len(progress) >= 2
    assert all(e["object"] == "chat.completion.chunk" and e["model"] == "m" for e in progress)
    assert "Loading model m" in content(progress, "reasoning_content")
    assert content(events) == EXPECTED and done


async def test_a_start_failure_after_the_200_is_an_sse_error(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    env = SLOW_START.but(exit_code=7).env()
    proxy = await start_proxy(config(tmp_path, env=env))
    comments, events, done = split(await raw_stream(proxy))
    assert comments and done
    (error,) = events
    assert error["error"]["code"] == "engine_start_failed"
    assert "exit code 7" in error["error"]["message"]
    assert "Traceback" not in error["error"]["message"]


async def test_non_streaming_requests_just_wait(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config(tmp_path))
    resp = await proxy.chat("m")
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("application/json")
    assert (await resp.json())["choices"][0]["message"]["content"] == EXPECTED
