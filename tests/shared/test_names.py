"""Names HAProxy can carry (vllm_proxy/names.py): a model, alias or adapter name with `;`, white
space, `#`, ``\\``, a control character or more than `NAME_MAX` characters would split a command
on HAProxy's runtime API or a line of its map file; the proxy refuses them in its config and in
adapter folders."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from kit import StartProxy
from kit.lora import adapter, assert_clean_error, complete, lora_config

from vllm_proxy.names import NAME_MAX, carriable

BAD = ["a;x", "k 1", "#c", "tab\tx", "bell\x07", "back\\slash", "n" * (NAME_MAX + 1)]


def test_names_haproxy_cannot_carry_are_refused_at_load(tmp_path: Path) -> None:
    """`vllm-proxy --check` (a process): exit 2, one line per bad name with its key's path."""
    adapters = tmp_path / "ad"
    adapter(adapters, "ok")
    models = {
        "m;1": {"model": "x"},
        "good": {
            "model": "y",
            "aliases": ["fine", "has space"],
            "adapters": {"lo#ra": {"path": str(adapters / "ok"), "aliases": ["ctl\x01"]}},
        },
    }
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"server": {"state_dir": str(tmp_path / "state")},
                                   "models": models}))  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "vllm_proxy", "--config", str(cfg), "--check"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    err = done.stderr
    assert "Traceback" not in err
    for where, name in (
        ("models.m;1", "'m;1'"),
        ("models.good.aliases", "'has space'"),
        ("models.good.adapters.lo#ra", "'lo#ra'"),
        ("models.good.adapters.lo#ra.aliases", "'ctl\\x01'"),
    ):
        assert f"{where}: {name} cannot be routed by HAProxy" in err, (where, err)
    models = {"good": {"model": "y", "aliases": ["fine", "org/m:1.5-x_y"]}}
    cfg.write_text(yaml.safe_dump({"server": {"state_dir": str(tmp_path / "state")},
                                   "models": models}))  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "vllm_proxy", "--config", str(cfg), "--check"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_name_rule() -> None:
    for name in [*BAD, "", "x\u2028y", "nb\u00a0sp"]:
        assert not carriable(name), repr(name)
    for name in ["m", "org/model:tag", "Qwen2.5-7B_instruct", "ünï-çødé", "a" * NAME_MAX]:
        assert carriable(name), name


async def test_adapter_folders_with_names_haproxy_cannot_carry_are_not_adapters(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """One request loaded folder ``a;x``: the fleet then wrote ``add map ... a;x gpu1``, which
    HAProxy split in two. Such folders are neither listed nor loaded (404, no engine)."""
    folder = tmp_path / "adapters"
    adapter(folder, "good")
    for name in BAD[:-1]:  # (a folder name over 255 bytes cannot exist)
        adapter(folder, name)
    models = {"base": {"model": "x", "adapters_dir": str(folder)}}
    proxy = await start_proxy(lora_config(tmp_path, models))
    for name in BAD[:-1]:
        status, data = await complete(proxy, name)
        assert_clean_error(status, data, 404, "model_not_found")
    assert proxy.manager.all_instances() == [] or all(
        not i.adapters.slots for i in proxy.manager.all_instances()
    )
    async with proxy.http.get(proxy.url + "/v1/models") as resp:
        listed = {c["id"] for c in (await resp.json())["data"]}
    assert "good" in listed and not listed & set(BAD), listed
    status, data = await complete(proxy, "good")
    assert status == 200, data
