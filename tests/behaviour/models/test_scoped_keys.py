"""API keys scoped to models (``server.api_keys`` entries with ``models``, ``admin``,
``key_file``): config parsing and its errors, every model route, the model list, hot reload, the
admin API and the OpenAI SDK."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml
from kit import FakeEngine, StartProxy, make_config, write_config
from kit.forms import (
    AUDIO,
    BOUNDARY,
    FORM,
    field,
    form,
    receive,
    uploads,
)
from kit.leftovers import left_nothing, post_raw
from kit.lora import (
    assert_clean_error,
)
from kit.metrics import proxy_samples

from vllm_proxy.config import load_config, parse_config
from vllm_proxy.errors import ConfigError
from vllm_proxy.frontend import keys
from vllm_proxy.frontend.keys import KeyRing
from vllm_proxy.frontend.routes.paths import MODEL_ROUTES, PREFIXED_TAILS

#: Three models whose names and aliases share no substring with the error message's words.
MODELS: dict[str, dict[str, Any]] = {
    "alpha": {"model": "org/alpha", "aliases": ["alf"]},
    "bravo": {"model": "org/bravo", "aliases": ["brv"]},
    "zulu-7b": {"model": "org/zulu", "aliases": ["zz7"]},
}
OTHERS = ("bravo", "brv", "zulu-7b", "zz7")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def parse(api_keys: list[Any], models: dict[str, Any] | None = None) -> Any:
    return parse_config({"server": {"api_keys": api_keys}, "models": models or MODELS})


# -- config ----------------------------------------------------------------------------------


def test_every_form_of_an_api_key_parses(tmp_path: Path) -> None:
    secret = tmp_path / "key"
    secret.write_text("\n  from-a-file  \n")
    secret.chmod(0o600)
    cfg = parse(
        [
            "plain",
            {"key": "scoped", "models": ["alpha", "zulu-*"]},
            {"key": "boss", "admin": True},
            {"key_file": str(secret), "models": ["brv"]},
        ]
    )
    got = [(k.secret, k.models, k.admin) for k in cfg.server.api_keys]
    assert got == [
        ("plain", None, False),
        ("scoped", ["alpha", "zulu-*"], False),
        ("boss", None, True),
        ("from-a-file", ["brv"], False),
    ]
    # A key read from a file is never written back out with the config.
    assert "from-a-file" not in str(cfg.model_dump())


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        (["a", ""], r"server\.api_keys\.1: empty key"),
        (["  "], r"server\.api_keys\.0: empty key"),
        ([" padded"], r"server\.api_keys\.0: the key has surrounding whitespace"),
        ([{"key": ""}], r"server\.api_keys\.0\.key: empty key"),
        ([12345], r"server\.api_keys\.0: a key is a string \(quote one made of digits\)"),
        (["a", "b", {"key": "a"}], r"server\.api_keys\.2: the same key as server\.api_keys\.0"),
        ([{"models": ["alpha"]}], r"server\.api_keys\.0: key or key_file is required"),
        ([{"key": "a", "key_file": "/k"}], r"server\.api_keys\.0: set either key or key_file"),
        ([{"key": "a", "modles": ["alpha"]}], r"server\.api_keys\.0\.modles: unknown key"),
        ([{"key": "a", "admin": "maybe"}], r"server\.api_keys\.0\.admin: "),
        ([{"key": "a", "models": []}], r"server\.api_keys\.0\.models: empty"),
        ([{"key": "a", "models": ["alpha", " "]}], r"server\.api_keys\.0\.models\.1: empty"),
        (
            ["x", {"key": "a", "models": ["alpha", "alpah"]}],
            r"server\.api_keys\.1\.models\.1: no model or alias is named 'alpah'",
        ),
    ],
)
def test_bad_api_keys_are_refused_with_their_path(entries: list[Any], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        parse(entries)


def test_a_duplicate_key_is_refused_without_showing_it() -> None:
    with pytest.raises(ConfigError) as err:
        parse(["sk-do-not-print", {"key": "sk-do-not-print", "models": ["alpha"]}])
    assert "server.api_keys.1: the same key as server.api_keys.0" in str(err.value)
    assert "sk-do-not-print" not in str(err.value)


def test_a_glob_that_matches_nothing_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm_proxy.config"):
        cfg = parse([{"key": "k", "models": ["alpha", "qwen-*"]}])
    assert cfg.server.api_keys[0].models == ["alpha", "qwen-*"]
    assert "server.api_keys.0.models.1: 'qwen-*' matches no configured model" in caplog.text


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("missing", "cannot read {path}: No such file or directory"),
        ("empty", "{path} is empty"),
        ("blank", "{path} is empty"),
        ("two-lines", "{path} has more than one line"),
        ("directory", "{path} is not a regular file"),
        ("fifo", "{path} is not a regular file"),
        ("huge", "{path} is larger than 65536 bytes"),
        ("binary", "{path} is not UTF-8 text"),
    ],
)
def test_an_unusable_key_file_is_refused_with_its_path(
    tmp_path: Path, setup: str, expected: str
) -> None:
    path = tmp_path / "key"
    if setup == "empty":
        path.write_text("")
    elif setup == "blank":
        path.write_text(" \n\t\n")
    elif setup == "two-lines":
        path.write_text("sk-one\nsk-two\n")
    elif setup == "directory":
        path.mkdir()
    elif setup == "fifo":
        os.mkfifo(path)  # reading it would block the load
    elif setup == "huge":
        path.write_bytes(b"k" * 70_000)
    elif setup == "binary":
        path.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError) as err:
        parse(["plain", {"key_file": str(path)}])
    assert f"server.api_keys.1.key_file: {expected.format(path=path)}" in str(err.value)
    assert "sk-one" not in str(err.value)


def test_an_unreadable_key_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text("sk-hidden")
    path.chmod(0)
    if os.access(path, os.R_OK):  # root reads anything
        pytest.skip("running as root")
    with pytest.raises(ConfigError, match=r"server\.api_keys\.0\.key_file: cannot read .*denied"):
        parse([{"key_file": str(path)}])


def test_a_key_file_every_user_can_read_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "key"
    path.write_text("sk-shared")
    path.chmod(0o644)  # how Kubernetes and Docker mount secrets by default
    with caplog.at_level(logging.WARNING, logger="vllm_proxy.config"):
        cfg = parse([{"key_file": str(path)}])
    assert cfg.server.api_keys[0].secret == "sk-shared"
    assert f"key_file {path} can be read by every user" in caplog.text
    assert "sk-shared" not in caplog.text


def test_a_relative_key_file_is_read_from_the_config_files_directory(tmp_path: Path) -> None:
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "team").write_text("sk-team\n")
    path = tmp_path / "config.yaml"
    data = {
        "server": {"api_keys": [{"key_file": "secrets/team", "models": ["alpha"]}]},
        "models": MODELS,
    }
    path.write_text(yaml.safe_dump(data))
    assert load_config(path).server.api_keys[0].secret == "sk-team"


def test_a_key_is_compared_with_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def compare(a: bytes, b: bytes) -> bool:
        calls.append(b)
        return a == b

    monkeypatch.setattr(keys.hmac, "compare_digest", compare)
    cfg = parse(["first", {"key": "second", "models": ["alpha"]}, "third"])
    ring = KeyRing(cfg.server.api_keys)
    scope = ring.find(b"first")
    assert scope is not None and scope.everything and len(calls) == 3
    scope = ring.find(b"second")
    assert scope is not None and scope.patterns == ("alpha",) and len(calls) == 6
    assert ring.find(b"nope") is None


# -- the request path ------------------------------------------------------------------------


async def scoped_proxy(start_proxy: StartProxy, tmp_path: Path) -> Any:
    return await start_proxy(
        make_config(
            tmp_path,
            MODELS,
            server={
                "api_keys": [
                    "plain",
                    {"key": "alpha-only", "models": ["alf"]},  # an alias brings its model
                    {"key": "globbed", "models": ["*-7b", "brav?"]},
                ]
            },
        )
    )


def body_for(model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "hi"}],
        "prompt": "hi",
        "input": "hi",
        "max_tokens": 2,
    }
    if model is not None:
        body["model"] = model
    return body


async def post(proxy: Any, path: str, key: str, model: str | None) -> tuple[int, dict[str, Any]]:
    async with proxy.http.post(proxy.url + path, json=body_for(model), headers=bearer(key)) as r:
        data = await r.json(content_type=None) if r.content_type.endswith("json") else {}
        return r.status, data


def assert_not_found(status: int, body: dict[str, Any], requested: str) -> None:
    assert status == 404, body
    err = body["error"]
    assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error"
    assert err["message"] == (
        f"The model '{requested}' does not exist. Available models: alf, alpha"
    )


async def test_a_scoped_key_reaches_only_its_models_on_every_model_route(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await scoped_proxy(start_proxy, tmp_path)
    routes = [(path, None) for path in MODEL_ROUTES] + [
        (f"/serve/{{model}}/v1/{tail}", "path") for tail in sorted(PREFIXED_TAILS)
    ]
    for template, where in routes:
        for other in (*OTHERS, "no-such-model"):
            path = template.format(model=other)
            status, body = await post(proxy, path, "alpha-only", None if where else other)
            assert_not_found(status, body, other)
        for name in ("alpha", "alf"):
            path = template.format(model=name)
            model = None if where else name
            # The scoped key gets what a key for every model gets (the fake engine serves some
            # of these routes only).
            scoped = await post(proxy, path, "alpha-only", model)
            plain = await post(proxy, path, "plain", model)
            assert scoped[0] == plain[0], (path, scoped, plain)
            assert scoped[1].get("error", {}).get("code") != "model_not_found", (path, scoped)
    assert proxy.engine_starts("bravo") == 0 and proxy.engine_starts("zulu-7b") == 0


async def test_the_model_list_shows_only_the_keys_models(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await scoped_proxy(start_proxy, tmp_path)

    async def get(path: str, key: str) -> tuple[int, dict[str, Any]]:
        async with proxy.http.get(proxy.url + path, headers=bearer(key)) as r:
            return r.status, await r.json()

    listing = {key: (await get("/v1/models", key))[1] for key in ("plain", "alpha-only", "globbed")}
    ids = {key: sorted(c["id"] for c in v["data"]) for key, v in listing.items()}
    assert ids == {
        "plain": ["alf", "alpha", "bravo", "brv", "zulu-7b", "zz7"],
        "alpha-only": ["alf", "alpha"],
        "globbed": ["bravo", "brv", "zulu-7b", "zz7"],
    }
    assert (await get("/v1/models/alf", "alpha-only"))[1]["parent"] == "alpha"
    assert (await get("/serve/alf/v1/models", "alpha-only"))[1]["data"][0]["id"] == "alpha"
    for other in (*OTHERS, "no-such-model"):
        for path in (f"/v1/models/{other}", f"/serve/{other}/v1/models"):
            status, body = await get(path, "alpha-only")
            assert_not_found(status, body, other)
    # Unknown and forbidden read the same, word for word.
    _, unknown = await post(proxy, "/v1/chat/completions", "alpha-only", "no-such-model")
    _, hidden = await post(proxy, "/v1/chat/completions", "alpha-only", "bravo")
    assert hidden["error"]["message"] == unknown["error"]["message"].replace(
        "no-such-model", "bravo"
    )
    for name in OTHERS:
        assert name not in unknown["error"]["message"]
    # A key for every model still sees every name in the message.
    _, full = await post(proxy, "/v1/chat/completions", "plain", "no-such-model")
    assert all(name in full["error"]["message"] for name in OTHERS)
    # Without a key, or with a wrong one: 401 as ever.
    async with proxy.http.get(proxy.url + "/v1/models") as r:
        assert r.status == 401
    assert (await get("/v1/models", "alpha-onl"))[0] == 401


async def test_a_scope_refusal_is_counted_as_a_404_of_the_model(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await scoped_proxy(start_proxy, tmp_path)
    for _ in range(2):
        assert (await post(proxy, "/v1/completions", "alpha-only", "brv"))[0] == 404
    await post(proxy, "/v1/completions", "alpha-only", "no-such-model")
    samples = (await proxy_samples(proxy)).find("vllm_requests_total")
    counts = {(s.labels["model_id"], s.labels["status"]): s.value for s in samples}
    assert counts == {("bravo", "404"): 2}


async def test_plain_string_keys_reach_every_model(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(make_config(tmp_path, MODELS, server={"api_keys": ["k1", "k2"]}))
    for key in ("k1", "k2"):
        async with proxy.http.get(proxy.url + "/v1/models", headers=bearer(key)) as r:
            assert len((await r.json())["data"]) == 6
    assert (await post(proxy, "/v1/completions", "k2", "zz7"))[0] == 200
    assert (await post(proxy, "/v1/completions", "k3", "zz7"))[0] == 401


async def test_an_admin_key_opens_the_admin_api(tmp_path: Path, start_proxy: StartProxy) -> None:
    server = {
        "api_keys": ["plain", {"key": "ops", "admin": True}],
        "admin_api_keys": ["adm"],
    }
    proxy = await start_proxy(make_config(tmp_path / "a", MODELS, server=server))

    async def admin(p: Any, key: str) -> int:
        async with p.http.get(p.url + "/admin/models", headers=bearer(key)) as r:
            return int(r.status)

    assert await admin(proxy, "ops") == 200
    assert await admin(proxy, "adm") == 200
    assert await admin(proxy, "plain") == 401
    # It reaches the model routes too; the admin key still has no model route.
    assert (await post(proxy, "/v1/completions", "ops", "bravo"))[0] == 200
    assert (await post(proxy, "/v1/completions", "adm", "alpha"))[0] == 401
    # With no admin_api_keys at all, an admin: true key opens the API (and only it does).
    server = {"api_keys": ["plain", {"key": "ops", "admin": True}]}
    alone = await start_proxy(make_config(tmp_path / "b", MODELS, server=server))
    assert await admin(alone, "ops") == 200
    assert await admin(alone, "plain") == 401


async def test_a_reload_rereads_key_files_and_applies_scopes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, start_proxy: StartProxy
) -> None:
    key_file = tmp_path / "team.key"
    key_file.write_text("sk-old\n")
    key_file.chmod(0o600)
    path = tmp_path / "config.yaml"
    data = make_config(tmp_path, MODELS, server={"admin_api_keys": ["adm"]}).model_dump(
        mode="json", exclude_none=True
    )
    data["server"]["api_keys"] = [{"key_file": "team.key", "models": ["alpha"]}]
    write_config(path, data)
    proxy = await start_proxy.file(path)
    http, url = proxy.http, proxy.url

    async def models(key: str) -> int | list[str]:
        async with http.get(url + "/v1/models", headers=bearer(key)) as r:
            if r.status != 200:
                return int(r.status)
            return sorted(c["id"] for c in (await r.json())["data"])

    async def reload() -> tuple[int, dict[str, Any]]:
        async with http.post(url + "/admin/reload", headers=bearer("adm")) as r:
            return r.status, await r.json()

    assert await models("sk-old") == ["alf", "alpha"]
    key_file.write_text("sk-new\n")
    data["server"]["api_keys"][0]["models"] = ["alpha", "bravo"]
    path.write_text(yaml.safe_dump(data))
    assert (await reload())[0] == 200
    assert await models("sk-old") == 401
    assert await models("sk-new") == ["alf", "alpha", "bravo", "brv"]
    # An empty key file rejects the reload; the running keys stay.
    key_file.write_text("")
    with caplog.at_level(logging.ERROR):
        status, body = await reload()
    assert status == 400 and body["error"]["code"] == "invalid_config"
    assert "server.api_keys.0.key_file:" in body["error"]["message"]
    assert await models("sk-new") == ["alf", "alpha", "bravo", "brv"]
    # So does an exact model name that no model has any more (a typo or a removal).
    key_file.write_text("sk-new")
    del data["models"]["bravo"]
    path.write_text(yaml.safe_dump(data))
    status, body = await reload()
    assert status == 400
    assert (
        "server.api_keys.0.models.1: no model or alias is named 'bravo'"
        in (body["error"]["message"])
    )
    assert "sk-new" not in body["error"]["message"] and "sk-new" not in caplog.text


async def test_the_openai_sdk_with_a_scoped_key(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy = await scoped_proxy(start_proxy, tmp_path)
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="globbed", max_retries=0)
    async with client:
        assert sorted([m.id async for m in client.models.list()]) == [
            "bravo", "brv", "zulu-7b", "zz7"
        ]  # fmt: skip
        chat = await client.chat.completions.create(
            model="zz7", messages=[{"role": "user", "content": "hello"}]
        )
        assert chat.choices[0].message.content
        with pytest.raises(openai.NotFoundError) as nf:
            await client.chat.completions.create(
                model="alpha", messages=[{"role": "user", "content": "x"}]
            )
        assert nf.value.code == "model_not_found"
        assert "alpha" in nf.value.message and "alf" not in nf.value.message
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("alf")


# -- a scoped key against every way into another model -----------------------------------------


async def test_a_scoped_key_cannot_reach_other_models_by_realtime_upload_or_path_prefix(
    tmp_path: Path, start_proxy: StartProxy, spool_dir: Path
) -> None:
    env = FakeEngine(upload_log=tmp_path / "uploads.jsonl", tokens=4).env()
    models = {
        "whisper": {"model": "org/whisper", "aliases": ["w"], "env": env},
        "secret": {"model": "org/secret", "aliases": ["sec"], "env": env},
    }
    keys = [{"key": "w-key", "models": ["w"]}]
    proxy = await start_proxy(make_config(tmp_path, models, server={"api_keys": keys}))
    key = bearer("w-key")
    audio = form(field("model", b"secret"), field("file", AUDIO, "a.wav"))
    # No key at all: refused before anything.
    status, data = await post_raw(
        proxy, "/v1/audio/transcriptions", audio, **{"Content-Type": FORM}
    )
    assert_clean_error(status, data, 401)
    for path in ("/v1/realtime?model=w", "/serve/w/v1/realtime"):
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await proxy.http.ws_connect(proxy.url + path)
        assert refused.value.status == 401
    # Another model's names, in the query, the path or the form: as if they did not exist.
    for path in ("/v1/realtime?model=secret", "/v1/realtime?model=sec", "/serve/sec/v1/realtime"):
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await proxy.http.ws_connect(proxy.url + path, headers=key)
        assert refused.value.status == 404, path
    for path in ("/v1/audio/transcriptions", "/serve/secret/v1/audio/translations"):
        status, data = await post_raw(proxy, path, audio, **{"Content-Type": FORM}, **key)
        assert_clean_error(status, data, 404, "model_not_found")
        assert "secret" not in data["error"]["message"].partition("Available models")[2]
    # The path's model wins over the form's.
    status, data = await post_raw(
        proxy, "/serve/w/v1/audio/transcriptions", audio, **{"Content-Type": FORM}, **key
    )
    assert status == 200, data
    assert [u["fields"]["model"] for u in uploads(tmp_path)] == ["whisper"]
    # The first event names another model: an error event, then 1008.
    async with proxy.http.ws_connect(proxy.url + "/v1/realtime", headers=key) as ws:
        assert (await receive(ws))["type"] == "session.created"
        await ws.send_str(json.dumps({"type": "session.update", "model": "sec"}))
        refused_event = await receive(ws)
        assert refused_event["code"] == "model_not_found", refused_event
        assert "secret" not in refused_event["error"].partition("Available models")[2]
        closing = await asyncio.wait_for(ws.receive(), 10)
        assert closing.type == aiohttp.WSMsgType.CLOSE and ws.close_code == 1008
    # Mid-session: another model is "not found", never "another model" (which would tell it
    # exists); the session goes on.
    async with proxy.http.ws_connect(
        proxy.url + "/serve/w/v1/realtime?model=secret", headers=key
    ) as ws:
        assert (await receive(ws))["type"] == "session.created"
        for name in ("secret", "sec"):
            await ws.send_str(json.dumps({"type": "session.update", "model": name}))
            event = await receive(ws)
            assert event["type"] == "error" and event["code"] == "model_not_found", event
        await ws.send_str(json.dumps({"type": "session.update", "model": "w"}))
        await ws.send_str(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA"}))
        assert (await receive(ws))["type"] == "transcription.delta"
    assert proxy.engine_starts("secret") == 0
    await left_nothing(proxy, spool_dir)


B = BOUNDARY.encode()


CLOSE = b"\r\n--%b--\r\n" % B
