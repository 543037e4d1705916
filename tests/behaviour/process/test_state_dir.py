"""A state dir no one else can prepare (vllm_proxy/engines/statedir.py): the proxy, started as a
process of its own, refuses a state dir that another user could write or owns (or a folder
above it), makes what is missing 0700, and never follows a link planted where it writes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from kit import (
    ProxyProcess,
    StartProxy,
    config_data,
    free_port,
    make_config,
    wait_for,
    write_config,
)

NOBODY = 65534


def run_proxy(tmp_path: Path, state: Path, name: str) -> subprocess.CompletedProcess[str]:
    """`vllm-proxy --config` on `state`; it must exit by itself (a proxy that starts is killed
    after 60 s and the test fails)."""
    data = config_data(tmp_path, {"m1": {"model": "x"}})
    data["server"].update(state_dir=str(state), port=free_port())
    cfg = write_config(tmp_path / f"{name}.yaml", data)
    try:
        return subprocess.run([sys.executable, "-m", "vllm_proxy", "--config", str(cfg)],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name}: the proxy started on {state}")


def refused(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vllm-proxy: server.state_dir: cannot use")
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_a_state_dir_another_user_can_write_or_owns_is_refused(tmp_path: Path) -> None:
    """Issue 4: a state dir in a folder another local user made first (0777) let that user plant
    links (the lock, a temp file and an engine log overwritten) and swap `sockets/` aside."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # (not sticky)
    refused(run_proxy(tmp_path, shared / "state", "shared"), str(shared), "written by others")
    assert not (shared / "state").exists(), "nothing made in it"

    group = tmp_path / "group"
    group.mkdir(mode=0o700)
    os.chmod(group, 0o770)
    refused(run_proxy(tmp_path, group / "state", "group"), "written by its group")

    own = tmp_path / "own-0777"
    own.mkdir()
    os.chmod(own, 0o777)
    refused(run_proxy(tmp_path, own, "own"), "(mode 0777)")
    assert not (own / "proxy.lock").exists()

    if os.geteuid() == 0:  # another user's folders (chown needs root)
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o755)
        os.chown(theirs, NOBODY, NOBODY)
        refused(run_proxy(tmp_path, theirs / "state", "theirs"), f"({NOBODY})", "not to the")
        prepared = tmp_path / "prepared"
        prepared.mkdir(mode=0o700)
        os.chown(prepared, NOBODY, NOBODY)
        refused(run_proxy(tmp_path, prepared, "prepared"), "not to the proxy's user")

    # A link to someone's folder in place of the state dir: its real path is checked.
    (tmp_path / "elsewhere").symlink_to(shared, target_is_directory=True)
    refused(run_proxy(tmp_path, tmp_path / "elsewhere" / "state", "link"), str(shared))


async def test_a_missing_state_dir_is_made_0700_and_its_lock_is_never_a_link(
    tmp_path: Path,
) -> None:
    state = tmp_path / "planted" / "state"
    state.mkdir(parents=True, mode=0o700)
    os.chmod(state.parent, 0o700)
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    # The lock's place taken by a link: an error, and the file it points to untouched.
    (state / "proxy.lock").symlink_to(victim)
    done = run_proxy(tmp_path, state, "lock-link")
    assert done.returncode == 2 and "Too many levels of symbolic links" in done.stderr
    assert victim.read_text() == "keep me\n"

    fresh = tmp_path / "new" / "deeper" / "state"
    data = config_data(tmp_path, {"m1": {"model": "x"}})
    port = free_port()
    data["server"].update(state_dir=str(fresh), port=port)
    proc = ProxyProcess(write_config(tmp_path / "fresh.yaml", data), port, tmp_path / "fresh.log")
    try:
        async with aiohttp.ClientSession() as http:
            await proc.listening(http, timeout=60)
    finally:
        proc.stop()
    for folder in (fresh.parent.parent, fresh.parent, fresh):
        assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700, folder
    assert stat.S_IMODE(os.lstat(fresh / "proxy.lock").st_mode) == 0o600


async def test_links_planted_where_engines_write_are_never_followed(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """An engine log and `engines.json`'s temporary file: links in their place make the start
    fail (502, nothing written through them); the next instance logs to a file of its own."""
    state = tmp_path / "state"
    logs = state / "logs"
    logs.mkdir(parents=True, mode=0o700)
    os.chmod(state, 0o700)
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    (logs / "m1.1.log").symlink_to(victim)
    (state / "engines.tmp").symlink_to(victim)
    proxy = await start_proxy(make_config(tmp_path, {"m1": {"model": "x"}}))
    resp = await proxy.chat("m1", max_tokens=1)
    assert resp.status == 502, await resp.text()
    err = (await resp.json())["error"]
    assert err["code"] == "engine_start_failed", err
    assert victim.read_text() == "keep me\n"
    assert (state / "engines.json").is_file() and not (state / "engines.json").is_symlink()

    async def served() -> bool:  # (503 engine_backoff after the failed start, then served)
        return (await proxy.chat("m1", max_tokens=1)).status == 200

    await wait_for(served, timeout=60, what="m1 served by its next instance")
    assert victim.read_text() == "keep me\n"


async def test_a_compile_cache_another_user_made_is_never_used(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """The engines' compile cache in the state dir (``vllm-cache/<model>``) is made 0700 and
    must be the proxy user's own: one another user prepared stops the start (502) instead of
    being loaded by the engine."""
    if os.geteuid() != 0:
        pytest.skip("making a folder of another user needs root")
    cache = tmp_path / "state" / "vllm-cache" / "m1"
    cache.mkdir(parents=True, mode=0o700)
    os.chmod(tmp_path / "state", 0o700)
    os.chown(cache, 65534, 65534)
    proxy = await start_proxy(make_config(tmp_path, {"m1": {"model": "x"}}))
    resp = await proxy.chat("m1", max_tokens=1)
    assert resp.status == 502, await resp.text()
    err = (await resp.json())["error"]
    assert err["code"] == "engine_start_failed" and "owned by the proxy's user" in err["message"]
    os.chown(cache, os.geteuid(), os.getegid())
    os.chmod(cache, 0o755)

    async def served() -> bool:  # (503 engine_backoff after the failed start, then served)
        return (await proxy.chat("m1", max_tokens=1)).status == 200

    await wait_for(served, timeout=60, what="m1 served once the cache is the proxy's")
    assert stat.S_IMODE(os.lstat(cache).st_mode) == 0o700, "made private again"
