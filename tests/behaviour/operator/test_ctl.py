"""``vllm-proxy ctl`` against a live proxy, run as an operator runs it (a process of its own):
URL and key from the environment or flags, 401 without the key, the lifecycle commands, the
tables, and a log followed as the engine writes it."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from kit import StartProxy, config_data, wait_for

from vllm_proxy.config import parse_config
from vllm_proxy.ctl import ps_table, requests_table

KEY = "ctl-test-key"


async def ctl(url: str, *args: str, key: str | None = KEY) -> tuple[int, str, str]:
    env = {**os.environ, "VLLM_PROXY_URL": url}
    env.pop("VLLM_PROXY_ADMIN_KEY", None)
    if key is not None:
        env["VLLM_PROXY_ADMIN_KEY"] = key
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "vllm_proxy", "ctl", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_ctl_operates_a_running_proxy(start_proxy: StartProxy, tmp_path: Path) -> None:
    models = {"alpha": {"model": "fake/alpha", "memory_mb": 300, "sleep": {"level": 1}}}
    data = config_data(tmp_path, models=models, server={"admin_api_keys": [KEY]}, budget_mb=1000)
    proxy = await start_proxy(parse_config(data))
    url = proxy.url

    rc, _, err = await ctl(url, "ps", key=None)
    assert rc == 1 and "HTTP 401" in err and "VLLM_PROXY_ADMIN_KEY" in err
    rc, _, err = await ctl("http://127.0.0.1:1", "ps")
    assert rc == 2 and "cannot reach" in err

    rc, out, err = await ctl(url, "start", "alpha")
    assert (rc, out.strip()) == (0, "alpha: running"), err
    rc, out, _ = await ctl(url, "sleep", "--level", "1", "alpha")
    assert (rc, out.strip()) == (0, "alpha: sleeping (level 1)")
    rc, out, _ = await ctl(url, "ps")
    assert rc == 0
    assert "alpha#1" in out and "sleeping L1" in out and "GPU 0:" in out, out
    rc, out, _ = await ctl(url, "wake", "alpha")
    assert (rc, out.strip()) == (0, "alpha: running")
    rc, out, err = await ctl(url, "sleep", "--level", "3", "alpha")
    assert rc == 2 and "invalid choice" in err, (out, err)

    assert (await proxy.chat("alpha")).status == 200
    rc, out, _ = await ctl(url, "requests", "--model", "alpha", "--status", "2xx")
    assert rc == 0 and "/v1/chat/completions" in out and " 200 " in out, out

    rc, out, _ = await ctl(url, "logs", "--tail", "5", "alpha")
    assert rc == 0 and len(out.splitlines()) == 5

    # Followed: a line the engine writes after the command began shows up.
    inst = proxy.model("alpha").serving()
    assert inst is not None
    env = {**os.environ, "VLLM_PROXY_URL": url, "VLLM_PROXY_ADMIN_KEY": KEY}
    follow = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "vllm_proxy", "ctl", "logs", "-f", "--tail", "1", "alpha", env=env,
        stdout=asyncio.subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        assert follow.stdout is not None
        first = await asyncio.wait_for(follow.stdout.readline(), 30)
        assert first.strip(), "no tail before following"
        with open(inst.log_path, "a") as fh:
            fh.write("a line written while followed\n")
        line = await asyncio.wait_for(follow.stdout.readline(), 30)
        assert line.decode().strip() == "a line written while followed"
    finally:
        os.killpg(follow.pid, signal.SIGKILL)
        await follow.wait()

    rc, out, _ = await ctl(url, "top", "--count", "1")
    assert rc == 0 and "alpha#1" in out and "recent requests:" in out

    rc, out, _ = await ctl(url, "drain", "alpha")
    assert (rc, out.strip()) == (0, "alpha: stopped")
    await wait_for(lambda: not proxy.model("alpha").instances, what="alpha stopped")
    rc, out, _ = await ctl(url, "stop", "alpha")  # nothing runs: a no-op
    assert (rc, out.strip()) == (0, "alpha: stopped")


def test_tables_line_up_and_show_what_is_missing() -> None:
    data = {
        "proxy": {"now": 100.0, "version": "1", "uptime_s": 5, "active_requests": 0},
        "gpus": [],
        "models": [
            {"name": "m", "state": "stopped", "leases": 0, "queue": 2, "last_used": None,
             "restarts": 0, "last_error": None, "pinned": True, "instances": []},
        ],
    }  # fmt: skip
    lines = ps_table(data).splitlines()
    assert lines[0] == "vllm-proxy 1  up 5s  active 0"
    header, row = lines[2], lines[3]
    assert row.startswith("m [pinned]") and row.index("stopped") == header.index("STATE")
    assert requests_table([]).startswith("TIME")
    row = {"t": 0, "id": "r", "model": "m", "key": None, "route": "/v1/\x1b[2Jx", "status": 404,
           "wait_s": None, "ttft_s": None, "tokens_in": None, "tokens_out": None,
           "tokens_per_s": None, "duration_s": 0.5}  # fmt: skip
    shown = requests_table([row])
    assert "\x1b" not in shown and "/v1/?[2Jx" in shown
