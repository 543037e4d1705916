"""`vllm-proxy-fleet`'s HAProxy side: the map file, the runtime API on a real HAProxy (Debian's
2.6, cluster tier) and the command line."""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kit.haproxy import HAPROXY, Haproxy

from vllm_proxy.fleet.cli import parse_args
from vllm_proxy.fleet.haproxy import HaproxyError, read_map, write_map


def test_the_map_file_is_written_whole_and_only_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "models.map"
    assert read_map(path) == {}
    assert write_map(path, {"b": "gpu2", "a": "gpu1"})
    assert path.read_text().splitlines()[1:] == ["a gpu1", "b gpu2"]
    assert read_map(path) == {"a": "gpu1", "b": "gpu2"}
    before = path.stat().st_ino
    assert not write_map(path, {"a": "gpu1", "b": "gpu2"}), "unchanged: not rewritten"
    assert path.stat().st_ino == before
    assert write_map(path, {"a": "gpu3"})
    assert path.stat().st_ino != before, "a new file renamed over the old one"
    assert read_map(path) == {"a": "gpu3"}
    assert [p.name for p in tmp_path.iterdir()] == ["models.map"], "no temporary file left"
    assert oct(path.stat().st_mode & 0o777) == "0o644", "HAProxy's user reads it"


def test_the_command_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VLLM_PROXY_FLEET_API_KEY", "from-env")
    opts = parse_args(
        ["--haproxy-socket", "/run/haproxy/admin.sock", "--map", "/var/lib/f/models.map",
         "--server", "gpu1=http://10.0.0.1:8080", "--server", "gpu2=http://10.0.0.2:8080"]
    )  # fmt: skip
    assert opts.servers == {"gpu1": "http://10.0.0.1:8080", "gpu2": "http://10.0.0.2:8080"}
    assert opts.interval_s == 1.0 and opts.api_key == "from-env" and opts.backend == "vllm"
    assert opts.max_view_mb == 16 and opts.missed_rounds == 3
    base = ["--haproxy-socket", "/s", "--map", "/m"]
    for bad in (
        ["--server", "gpu1"],
        ["--server", "gpu 1=http://x"],
        ["--server", "gpu1=http://a", "--server", "gpu1=http://b"],
        ["--server", "gpu1=http://a", "--interval-s", "0"],
        ["--server", "gpu1=10.0.0.1:8080"],
        ["--server", "gpu1=http://a", "--max-view-mb", "0"],
        ["--server", "gpu1=http://a", "--missed-rounds", "0"],
    ):
        with pytest.raises(SystemExit) as exit_:
            parse_args(base + bad)
        assert exit_.value.code == 2, bad
    with pytest.raises(SystemExit):
        parse_args(["--haproxy-socket", "/s", "--map", "relative.map", "--server", "a=http://a"])
    assert "absolute path" in capsys.readouterr().err


@pytest.fixture
async def haproxy(tmp_path: Path) -> AsyncIterator[Haproxy]:
    if not os.access(HAPROXY, os.X_OK):
        pytest.fail(f"{HAPROXY} missing: run scripts/system-deps.sh (make test does)")
    h = Haproxy(tmp_path)
    h.map.write_text("")
    await h.start()
    try:
        yield h
    finally:
        await h.stop()


@pytest.mark.cluster
@pytest.mark.timeout(120)
async def test_the_runtime_api_holds_exactly_the_wanted_map(haproxy: Haproxy) -> None:
    api, path = haproxy.api, str(haproxy.map)
    assert await api.server_status("vllm") == {"gpu1": "no check", "gpu2": "no check"}
    assert await api.apply(path, {"a": "gpu1", "b": "gpu2"}) == ["add a gpu1", "add b gpu2"]
    assert await api.show_map(path) == {"a": ["gpu1"], "b": ["gpu2"]}
    assert await api.apply(path, {"a": "gpu1", "b": "gpu2"}) == [], "nothing to change"
    assert await api.apply(path, {"a": "gpu2", "c": "gpu1"}) == ["del b", "set a gpu2",
                                                                 "add c gpu1"]  # fmt: skip
    assert await api.show_map(path) == {"a": ["gpu2"], "c": ["gpu1"]}
    # A duplicated key (someone's `add map`): one entry again.
    assert (await api.command(f"add map {path} a gpu1")).strip() == ""
    await api.apply(path, {"a": "gpu2", "c": "gpu1"})
    assert await api.show_map(path) == {"a": ["gpu2"], "c": ["gpu1"]}
    with pytest.raises(HaproxyError, match="refused"):
        await api._change("set map /no/such.map a gpu1")

    # Written to the file, the same map is HAProxy's after a restart.
    write_map(haproxy.map, {"a": "gpu2", "c": "gpu1"})
    await haproxy.stop()
    await haproxy.start()
    assert await api.show_map(path) == {"a": ["gpu2"], "c": ["gpu1"]}


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_haproxy_refuses_to_start_without_the_map_file(tmp_path: Path) -> None:
    """Why the recipe ships a tmpfiles.d entry that creates it empty (docs/cluster.md)."""
    h = Haproxy(tmp_path)
    done = subprocess.run([HAPROXY, "-c", "-f", str(h.cfg)], capture_output=True, text=True,
                          timeout=30)  # fmt: skip
    assert done.returncode != 0 and "models.map" in done.stdout + done.stderr
    h.map.write_text("")
    done = subprocess.run([HAPROXY, "-c", "-f", str(h.cfg)], capture_output=True, text=True,
                          timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
