"""A real HAProxy (Debian's package) run by a test, with its runtime API on a socket."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

from vllm_proxy.fleet.haproxy import HaproxyError, RuntimeApi

from . import free_port, wait_for

HAPROXY = "/usr/sbin/haproxy"


CONFIG = """
global
    stats socket {socket} mode 600 level admin
defaults
    mode http
    timeout connect 1s
    timeout client 5s
    timeout server 5s
frontend f
    bind 127.0.0.1:{port}
    http-request set-var(txn.model) req.hdr(x-model)
    default_backend vllm
backend vllm
    balance hash var(txn.model)
    use-server %[var(txn.model),map({map})] if {{ var(txn.model),map({map}) -m found }}
    server gpu1 127.0.0.1:1 id 1
    server gpu2 127.0.0.1:2 id 2
"""


class Haproxy:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.socket = tmp / "haproxy.sock"
        self.map = tmp / "models.map"
        self.cfg = tmp / "haproxy.cfg"
        self.cfg.write_text(CONFIG.format(socket=self.socket, port=free_port(), map=self.map))
        self.api = RuntimeApi(str(self.socket))
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        if self.socket.exists():
            self.socket.unlink()
        with open(self.tmp / "haproxy.log", "ab") as log:
            self.proc = subprocess.Popen(
                [HAPROXY, "-db", "-f", str(self.cfg)], stdout=log, stderr=subprocess.STDOUT
            )

        async def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log()
            try:
                await self.api.command("show info")
            except HaproxyError:
                return False
            return True

        await wait_for(up, timeout=30, what="HAProxy's runtime API")

    def log(self) -> str:
        return (self.tmp / "haproxy.log").read_text(errors="replace")[-3000:]

    async def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            await asyncio.to_thread(self.proc.wait, 10)
