"""Component tests: hot reload by instances, under traffic, with the fake engine as a subprocess.

A changed model gets a new instance while the old one drains; the memory budget counts both;
a bad file changes nothing; a removed model is never restarted by a request that waited for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from kit import FAKE_ENGINE, FakeEngine, group_alive, wait_for

from vllm_proxy.app import Server
from vllm_proxy.config import load_config
from vllm_proxy.engines.model import Model
from vllm_proxy.engines.states import State

ADMIN = {"Authorization": "Bearer adm"}
USER = {"Authorization": "Bearer user"}


def write(path: Path, models: dict[str, Any] | None, **extra: Any) -> Path:
    """A config file with the fake engine; `models=None` leaves the section out."""
    data: dict[str, Any] = {
        "server": {
            "host": "127.0.0.1",
            "port": 0,
            "state_dir": str(path.parent / "state"),
            "admin_api_keys": ["adm"],
            "api_keys": ["user"],
            "drain_timeout_s": 30,
        },
        "engine": {
            "command": FAKE_ENGINE,
            "stop_timeout_s": 5,
            "idle_timeout_s": 0,
            "port_range": [20000, 29999],
        },
        **extra,
    }
    if models is not None:
        data["models"] = models
    path.write_text(yaml.safe_dump(data))
    return path


@contextlib.asynccontextmanager
async def running(path: Path, overrides: dict[str, Any] | None = None) -> AsyncIterator[Server]:
    config = load_config(path)
    if overrides:
        config = config.model_copy(update={"server": config.server.model_copy(update=overrides)})
    server = Server(config, str(path), overrides)
    await server.start()
    try:
        yield server
    finally:
        await server.shutdown()


class Client:
    def __init__(self, server: Server, http: aiohttp.ClientSession) -> None:
        self.url = f"http://127.0.0.1:{server.port}"
        self.http = http

    async def chat(self, model: str, **extra: Any) -> aiohttp.ClientResponse:
        body = {"model": model, "messages": [{"role": "user", "content": "x"}], **extra}
        return await self.http.post(self.url + "/v1/chat/completions", json=body, headers=USER)

    async def status(self, model: str, **extra: Any) -> int:
        async with await self.chat(model, **extra) as resp:
            await resp.read()
            return resp.status

    async def reload(self) -> tuple[int, dict[str, Any]]:
        async with self.http.post(self.url + "/admin/reload", headers=ADMIN) as resp:
            return resp.status, await resp.json()

    async def loaded(self, model: str) -> float | None:
        async with self.http.get(self.url + "/metrics") as resp:
            text = await resp.text()
        for line in text.splitlines():
            if line.startswith(f'vllm_model_loaded{{model_id="{model}"}}'):
                return float(line.rsplit(" ", 1)[1])
        return None


def model_of(server: Server, name: str) -> Model:
    return server.runtime.manager.models[name]


async def test_reload_under_traffic_hands_over_without_a_failed_request(tmp_path: Path) -> None:
    """A changed arg while a stream and a steady flow of short requests run: the stream ends
    intact, every request gets 200, one engine remains, and the model reads as loaded
    throughout."""
    stream_env = FakeEngine(tokens=60, token_delay=0.1).env()
    path = write(tmp_path / "c.yaml", {"m": {"model": "org/m", "env": stream_env}})
    async with running(path) as server, aiohttp.ClientSession() as http:
        client = Client(server, http)
        assert await client.status("m") == 200
        old = model_of(server, "m").serving()
        assert old is not None and old.engine is not None
        old_pgid = old.engine.pid
        assert old_pgid is not None

        stream = await client.chat("m", stream=True, max_tokens=60)  # ~6 s of tokens
        await stream.content.readany()
        statuses: list[int] = []
        samples: list[float | None] = []
        stop = asyncio.Event()

        async def short_requests() -> None:
            while not stop.is_set():
                statuses.append(await client.status("m", max_tokens=1))

        async def sample_loaded() -> None:
            while not stop.is_set():
                samples.append(await client.loaded("m"))
                await asyncio.sleep(0.05)

        workers = [asyncio.ensure_future(short_requests()) for _ in range(2)]
        sampler = asyncio.ensure_future(sample_loaded())
        await wait_for(lambda: len(statuses) >= 5, what="traffic flowing")

        write(path, {"m": {"model": "org/m", "env": {**stream_env, "X": "changed"}}})
        code, report = await client.reload()
        assert code == 200 and report["restarted"] == ["m"]
        assert old.retired
        model = model_of(server, "m")
        # Both instances exist during the handover; the admin view shows both.
        async with http.get(client.url + "/admin/models/m", headers=ADMIN) as resp:
            view = await resp.json()
        assert [i["id"] for i in view["instances"]][:1] == [old.id]
        await wait_for(lambda: model.serving() not in (None, old), what="new instance serving")
        new = model.serving()
        assert new is not None and new.id != old.id
        async with http.get(client.url + "/admin/models/m", headers=ADMIN) as resp:
            view = await resp.json()
        assert {i["id"]: i["retired"] for i in view["instances"]} == {old.id: True, new.id: False}
        counted = len(statuses)
        await wait_for(lambda: len(statuses) >= counted + 5, what="new instance serves traffic")

        body = await stream.read()  # the old instance finishes its stream...
        assert body.endswith(b"data: [DONE]\n\n") and b'"error"' not in body
        await wait_for(lambda: old.state is State.STOPPED, what="old instance stopped")
        stop.set()
        await asyncio.gather(*workers, sampler)

        assert statuses and set(statuses) == {200}, statuses
        assert samples and all(s == 1 for s in samples), samples
        assert [i.id for i in model.instances] == [new.id]  # exactly one engine remains
        await wait_for(lambda: not group_alive(old_pgid), what="old engine group gone")
        # Each instance had its own log file.
        logs = {p.name for p in (tmp_path / "state" / "logs").glob("m.*.log")}
        assert {old.log_path.name, new.log_path.name} <= logs and old.log_path != new.log_path


async def test_handover_on_a_budget_that_holds_one_waits_for_the_old_instance(
    tmp_path: Path,
) -> None:
    """Static budget of 1000 MiB, a 600 MiB model: the new instance is admitted only after the
    old one has drained and stopped (no over-admission), and every request is served."""
    gpu = {"monitor": "static", "devices": [{"id": 0, "memory_mb": 1000}]}
    env = FakeEngine(tokens=15, token_delay=0.1).env()
    path = write(tmp_path / "c.yaml", {"m": {"model": "org/m", "memory_mb": 600, "env": env}},
                 gpu=gpu, admission={"queue_timeout_s": 30})  # fmt: skip
    async with running(path) as server, aiohttp.ClientSession() as http:
        client = Client(server, http)
        assert await client.status("m") == 200
        model = model_of(server, "m")
        old = model.serving()
        assert old is not None and old.engine is not None
        old_engine = old.engine
        stream = await client.chat("m", stream=True, max_tokens=15)  # ~1.5 s
        await stream.content.readany()

        write(path, {"m": {"model": "org/m", "memory_mb": 600, "env": {**env, "X": "2"}}},
              gpu=gpu, admission={"queue_timeout_s": 30})  # fmt: skip
        code, report = await client.reload()
        assert code == 200 and report["restarted"] == ["m"]

        async def short() -> tuple[int, str]:
            async with await client.chat("m", max_tokens=1) as resp:
                return resp.status, await resp.text()

        waiting = asyncio.ensure_future(short())
        await wait_for(lambda: len(model.instances) == 2, what="new instance created")
        new = model.instances[-1]
        assert new.state is State.STARTING and new.engine is None, "admitted beside the old one"
        memory = server.runtime.manager.memory
        assert memory is not None
        assert [s.used_mb for s in memory.source.read()] == [600]  # the old one's claim only
        body = await stream.read()
        assert body.endswith(b"data: [DONE]\n\n")
        assert (await waiting)[0] == 200, (await waiting)[1]
        assert new.engine is not None and old_engine.exited_at is not None
        assert new.engine.started_at >= old_engine.exited_at
        assert [i.id for i in model.instances] == [new.id]


@pytest.mark.parametrize("bad", ["empty", "truncated", "directory", "no-models", "unparsable"])
async def test_bad_file_on_reload_changes_nothing(
    tmp_path: Path, bad: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path / "c.yaml", {"m": {"model": "org/m"}})
    text = path.read_text()
    async with running(path) as server, aiohttp.ClientSession() as http:
        client = Client(server, http)
        assert await client.status("m") == 200
        inst = model_of(server, "m").serving()
        if bad == "empty":
            path.write_text("")
        elif bad == "truncated":
            path.write_text(text[: text.index("models:") + len("models:\n  m:\n    mod")])
        elif bad == "no-models":
            write(path, None)
        elif bad == "unparsable":
            path.write_text(text.replace("api_keys:", "api_keys: [sk-secret-123\n  x:", 1))
        else:
            path.unlink()
            path.mkdir()
        caplog.clear()
        with caplog.at_level("ERROR"):
            code, err = await client.reload()
        assert code == 400 and err["error"]["code"] == "invalid_config", err
        assert "sk-secret-123" not in err["error"]["message"]
        rejected = [r for r in caplog.records if "reload rejected" in r.getMessage()]
        assert len(rejected) == 1, "logged once"
        assert "sk-secret-123" not in caplog.text
        # Nothing changed: same instance serving, API keys still enforced.
        assert model_of(server, "m").serving() is inst
        assert await client.status("m") == 200
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        async with http.post(client.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 401


async def test_explicit_empty_models_removes_every_model(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", {"a": {"model": "org/a"}, "b": {"model": "org/b"}})
    async with running(path) as server, aiohttp.ClientSession() as http:
        client = Client(server, http)
        assert await client.status("a") == 200
        pgid = model_of(server, "a").serving().engine.pid  # type: ignore[union-attr]
        write(path, {})
        code, report = await client.reload()
        assert code == 200 and sorted(report["removed"]) == ["a", "b"]
        assert await client.status("a") == 404
        await wait_for(lambda: not group_alive(pgid), what="a's engine gone")
        await wait_for(lambda: not server.runtime.manager.removed, what="removed models drained")
        async with http.get(client.url + "/metrics") as resp:
            assert 'model_id="a"' not in "\n".join(
                line for line in (await resp.text()).splitlines()
                if line.startswith(("vllm_model_loaded", "vllm_proxy_model_state"))
            )  # fmt: skip


async def test_request_waiting_for_a_removed_model_gets_an_error_and_no_engine(
    tmp_path: Path,
) -> None:
    slow = FakeEngine(startup_delay=1.5).env()
    path = write(tmp_path / "c.yaml", {"a": {"model": "org/a", "env": slow}, "b": {"model": "x"}})
    async with running(path) as server, aiohttp.ClientSession() as http:
        client = Client(server, http)
        waiting = asyncio.ensure_future(client.chat("a"))
        model = model_of(server, "a")
        await wait_for(lambda: model.waiting == 1 and model.instances, what="a starting")
        starting = model.instances[0]
        write(path, {"b": {"model": "x"}})
        code, report = await client.reload()
        assert code == 200 and report["removed"] == ["a"]
        resp = await waiting
        err = (await resp.json())["error"]
        assert resp.status == 404 and err["code"] == "model_removed", err
        assert "removed from the configuration" in err["message"]
        await wait_for(lambda: starting.state is State.STOPPED, what="the start was stopped")
        assert model.instances == [] and model.removed
        assert not any(i.name == "a" for i in server.runtime.manager.all_instances())


async def test_command_line_host_and_port_survive_a_reload(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", {"m": {"model": "org/m"}})
    async with running(path, overrides={"port": 0, "host": "127.0.0.1"}) as server:
        config = yaml.safe_load(path.read_text())
        config["server"]["port"] = 1  # the file says otherwise; the command line wins
        config["server"]["host"] = "0.0.0.0"
        path.write_text(yaml.safe_dump(config))
        report = await server.runtime.reload()
        assert report["needs_restart"] == []
        assert server.runtime.config.server.port == 0
        assert server.runtime.config.server.host == "127.0.0.1"


async def test_memory_and_devices_changes_take_effect(tmp_path: Path) -> None:
    gpu = {
        "monitor": "static",
        "devices": [{"id": 0, "memory_mb": 1000}, {"id": 1, "memory_mb": 1000}],
    }
    path = write(tmp_path / "c.yaml", {"m": {"model": "org/m", "memory_mb": 400, "devices": [0]}},
                 gpu=gpu)  # fmt: skip
    async with running(path) as server, aiohttp.ClientSession() as http:
        client = Client(server, http)
        assert await client.status("m") == 200
        model = model_of(server, "m")
        first = model.serving()
        assert first is not None and first.devices == (0,)
        memory = server.runtime.manager.memory
        assert memory is not None

        def used() -> list[int]:
            return [s.used_mb for s in memory.source.read()]

        assert used() == [400, 0]
        # A new budget on the same device: the same engine keeps running, its claim grows.
        write(path, {"m": {"model": "org/m", "memory_mb": 500, "devices": [0]}}, gpu=gpu)
        code, report = await client.reload()
        assert code == 200 and report["kept"] == ["m"]
        assert model.serving() is first and used() == [500, 0]
        # Another device: the engine must move, so a new instance starts there.
        write(path, {"m": {"model": "org/m", "memory_mb": 500, "devices": [1]}}, gpu=gpu)
        code, report = await client.reload()
        assert code == 200 and report["restarted"] == ["m"]
        await wait_for(lambda: model.serving() not in (None, first), what="moved instance")
        moved = model.serving()
        assert moved is not None and moved.devices == (1,)
        await wait_for(lambda: used() == [0, 500], what="old claim released")
        assert await client.status("m") == 200


async def test_a_request_queued_for_memory_of_a_removed_model_gets_model_removed(
    tmp_path: Path,
) -> None:
    gpu = {"monitor": "static", "devices": [{"id": 0, "memory_mb": 1000}]}
    env = FakeEngine(tokens=30, token_delay=0.1).env()
    models = {"a": {"model": "org/a", "memory_mb": 600, "env": env},
              "c": {"model": "org/c", "memory_mb": 600}}  # fmt: skip
    path = write(tmp_path / "c.yaml", models, gpu=gpu, admission={"queue_timeout_s": 30})
    async with running(path) as server, aiohttp.ClientSession() as http:
        client = Client(server, http)
        stream = await client.chat("a", stream=True)  # a holds the memory for ~3 s
        await stream.content.readany()
        waiting = asyncio.ensure_future(client.chat("c"))
        await wait_for(lambda: model_of(server, "c").waiting == 1, what="c queued for memory")
        write(path, {"a": models["a"]}, gpu=gpu, admission={"queue_timeout_s": 30})
        code, report = await client.reload()
        assert code == 200 and report["removed"] == ["c"]
        resp = await waiting
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_removed"
        await stream.read()


async def test_a_reload_with_a_removed_key_name_is_refused_and_changes_nothing(
    tmp_path: Path,
) -> None:
    path = write(tmp_path / "c.yaml", {"m": {"model": "org/m", "loading_keepalive_interval_s": 3}})
    async with running(path) as server, aiohttp.ClientSession() as http:
        client = Client(server, http)
        assert await client.status("m") == 200
        model = model_of(server, "m")
        inst = model.serving()
        write(path, {"m": {"model": "org/m", "keepalive_s": 4}})
        code, err = await client.reload()
        assert code == 400 and err["error"]["code"] == "invalid_config", err
        assert "models.m.keepalive_s: unknown key" in err["error"]["message"]
        assert model.spec.loading_keepalive_interval_s == 3 and model.serving() is inst
        assert model_of(server, "m") is model
