"""The official `openai` SDK, unchanged, pointed at the proxy (fake engine behind it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from kit import FakeEngine, StartProxy, make_config


async def sdk(start_proxy: StartProxy, tmp_path: Path, **server: Any) -> openai.AsyncOpenAI:
    env = FakeEngine(tokens=4).env()
    cfg = make_config(
        tmp_path,
        {"chat": {"model": "org/chat", "aliases": ["c"], "env": env}, "emb": {"model": "org/e"}},
        server=server,
    )
    proxy = await start_proxy(cfg)
    key = (server.get("api_keys") or ["unused"])[0]
    return openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0)


async def test_sdk_chat_stream_completions_embeddings_models(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    async with await sdk(start_proxy, tmp_path) as client:
        chat = await client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hello"}]
        )
        assert chat.choices[0].message.content
        assert chat.model == "chat" and chat.usage is not None

        stream = await client.chat.completions.create(
            model="c",
            messages=[{"role": "user", "content": "hello"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage = [], None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage:
                usage = chunk.usage
        assert len(pieces) == 4
        assert usage is not None and usage.completion_tokens == 4

        comp = await client.completions.create(model="chat", prompt="once upon", max_tokens=2)
        assert comp.choices[0].text and comp.usage and comp.usage.completion_tokens == 2

        emb = await client.embeddings.create(model="emb", input=["a", "b", "c"])
        assert len(emb.data) == 3 and len(emb.data[0].embedding) > 0

        ids = [m.id async for m in client.models.list()]
        assert sorted(ids) == ["c", "chat", "emb"]
        assert (await client.models.retrieve("c")).id == "c"


async def test_sdk_sees_typed_errors(tmp_path: Path, start_proxy: StartProxy) -> None:
    async with await sdk(start_proxy, tmp_path) as client:
        with pytest.raises(openai.NotFoundError) as nf:
            await client.chat.completions.create(
                model="gpt-4", messages=[{"role": "user", "content": "x"}]
            )
        assert "gpt-4" in nf.value.message and "chat" in nf.value.message
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="chat", messages="not a list")  # type: ignore[arg-type]


async def test_sdk_authentication(tmp_path: Path, start_proxy: StartProxy) -> None:
    async with await sdk(start_proxy, tmp_path, api_keys=["secret"]) as client:
        ok = await client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "x"}]
        )
        assert ok.choices
        bad = client.with_options(api_key="wrong")
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "x"}]
            )
