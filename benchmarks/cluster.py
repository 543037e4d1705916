"""Three vllm-proxy processes behind HAProxy on the shipped recipe: the setup that
`fleet.py` measures and the cluster test tier (`tests/kit/cluster.py`) runs. The recipe
(deploy/haproxy/haproxy.cfg) with only addresses, paths and the connection limit adapted, in
front of real `vllm-proxy` processes running the fake engine on static GPU budgets
(docs/cluster.md), and optionally `vllm-proxy-fleet` beside it. Needs Debian's `haproxy`.

Which server serves what is read from the proxies themselves (their admin API, logs and metrics)
and from HAProxy's runtime API (`show stat` on its stats socket), never guessed from timing.
"""

from __future__ import annotations

import asyncio
import csv
import io
import re
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from harness import FAKE_ENGINE, ROOT, pick_ports, until
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

RECIPE = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
HAPROXY = "/usr/sbin/haproxy"
SERVERS = ("gpu1", "gpu2", "gpu3")
#: Where the recipe keeps the fleet's map (a run's own folder replaces it).
RECIPE_MAP = "/var/lib/vllm-proxy-fleet/models.map"
#: The fake engine's settings: a reply has min(max_tokens, 400) tokens, 20 ms apart, so
#: max_tokens sets a stream's length.
ENGINE_ENV = {"FAKE_ENGINE_TOKENS": "400", "FAKE_ENGINE_TOKEN_DELAY": "0.02"}
ACCESS = re.compile(r"vllm_proxy\.access: (\S+) \S+ \S+ model=(\S+) instance=\S+ status=(\d+)")


def haproxy_config(
    recipe: str,
    *,
    frontend: int,
    stats: int,
    socket: Path,
    servers: dict[str, int],
    map_path: Path,
) -> str:
    """The shipped recipe as HAProxy runs it here: every routing, retry, health-check and
    timeout line is kept; what differs on a test machine is replaced, each exactly where the
    recipe has it (a recipe that changes shape fails here rather than being tested half)."""
    subs = [
        # no syslog here: HAProxy's log goes to its stderr (the test's log file)
        (r"^    log /dev/log local0$", "    log stderr format raw local0"),
        # chroot and the haproxy user need root
        (r"^    chroot .*$\n", ""),
        (r"^    user .*$\n", ""),
        (r"^    group .*$\n", ""),
        # the haproxy group needs root too
        (
            r"^(    stats socket )/run/haproxy/admin\.sock (.*) group haproxy$",
            rf"\g<1>{socket} \g<2>",
        ),
        # the recipe's limit needs twice as many descriptors as a test machine may allow
        (r"^    maxconn \d+$", "    maxconn 2000"),
        (r"^    bind :8000$", f"    bind 127.0.0.1:{frontend}"),
        (r"^    bind 127\.0\.0\.1:8404$", f"    bind 127.0.0.1:{stats}"),
    ]
    text = recipe
    for pattern, replacement in subs:
        text, n = re.subn(pattern, replacement, text, flags=re.MULTILINE)
        assert n == 1, f"the recipe no longer has a line matching {pattern!r}"

    def server(m: re.Match[str]) -> str:
        return f"    server {m[1]} 127.0.0.1:{servers[m[1]]} {m[2]}"

    n = text.count(RECIPE_MAP)
    assert n == 2, "the recipe names the fleet's map in its use-server line, twice"
    text = text.replace(RECIPE_MAP, str(map_path))
    text, n = re.subn(
        r"^    server (\S+) 10\.0\.0\.\d+:8080 (.*)$", server, text, flags=re.MULTILINE
    )
    assert n == len(servers), "the recipe lists one server line per GPU server"
    return text


@dataclass
class Member:
    """One vllm-proxy process of the cluster."""

    name: str
    index: int
    port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return (self.dir / "proxy.log").read_text(errors="replace")

    def served(self) -> list[tuple[str, str, int]]:
        """(request id, model, status) of every request its access log recorded."""
        return [(m[1], m[2], int(m[3])) for m in ACCESS.finditer(self.log())]

    def starts(self, model: str) -> int:
        """Engines of `model` this proxy started (that came up; a start that lost a port race
        and was retried counts once)."""
        return len(re.findall(rf"\b{re.escape(model)}#\d+: ready on (?:port|socket) ", self.log()))


@dataclass
class Reply:
    status: int
    body: bytes
    headers: CIMultiDict[str]


class Cluster:
    """Three proxies with the same `models` (name -> MiB) on `budget_mb` each (one static GPU),
    HAProxy in front on the recipe, and `vllm-proxy-fleet` when started (`start_fleet`).
    `traffic` are the models `place` serves (default: all); `engine_env` the fake engine's
    settings (default `ENGINE_ENV`)."""

    def __init__(
        self,
        tmp_path: Path,
        http: aiohttp.ClientSession,
        models: Mapping[str, int],
        budget_mb: int,
        traffic: Sequence[str] | None = None,
        engine_env: Mapping[str, str] = ENGINE_ENV,
    ) -> None:
        self.tmp = tmp_path
        self.http = http
        self.models = dict(models)
        self.budget_mb = budget_mb
        self.traffic = tuple(self.models if traffic is None else traffic)
        self.engine_env = dict(engine_env)
        self.map = tmp_path / "models.map"
        self.fleet: subprocess.Popen[bytes] | None = None
        self.fleet_interval_s = 1.0
        # the frontend, the stats page, then one per proxy: taken together, none twice
        self.port, self.stats_port, *ports = pick_ports(2 + len(SERVERS))
        self.socket = tmp_path / "haproxy.sock"
        self.members = {
            name: Member(name, i, ports[i], tmp_path / name) for i, name in enumerate(SERVERS)
        }
        self.haproxy: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- processes -----------------------------------------------------------------------

    def proxy_config(self, member: Member) -> dict[str, Any]:
        low = 15000 + 1000 * member.index  # below Linux's ephemeral ports (32768-60999)
        models: dict[str, Any] = {
            name: {"model": f"fake/{name}", "memory_mb": mb} for name, mb in self.models.items()
        }
        return {
            "server": {
                "host": "127.0.0.1",
                "port": member.port,
                "state_dir": str(member.dir / "state"),
                "admin_open": True,
                "drain_timeout_s": 30,
            },
            "engine": {
                "command": FAKE_ENGINE,
                "env": self.engine_env,
                "startup_timeout_s": 20,
                "stop_timeout_s": 2,
                "idle_timeout_s": 0,
                "port_range": [low, low + 999],
            },
            "gpu": {"monitor": "static", "devices": [{"id": 0, "memory_mb": self.budget_mb}]},
            # in a cluster a server without room answers at once: HAProxy tries the next one
            "admission": {"queue_timeout_s": 0},
            "models": models,
        }

    def start_proxy(self, member: Member) -> None:
        member.dir.mkdir(exist_ok=True)
        config = member.dir / "config.yaml"
        config.write_text(yaml.safe_dump(self.proxy_config(member)))
        with open(member.dir / "proxy.log", "ab") as log:  # a restart appends
            member.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_proxy", "--config", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    async def start(self) -> None:
        for member in self.members.values():
            self.start_proxy(member)
        for member in self.members.values():
            await self.listening(member)
        if not self.map.exists():
            self.map.write_text("")  # HAProxy refuses to start without it
        await self.start_haproxy()

    async def start_haproxy(self) -> None:
        """HAProxy on the recipe (written once: a restart reads the same file)."""
        cfg = self.tmp / "haproxy.cfg"
        if not cfg.exists():
            cfg.write_text(
                haproxy_config(
                    RECIPE.read_text(),
                    frontend=self.port,
                    stats=self.stats_port,
                    socket=self.socket,
                    servers={m.name: m.port for m in self.members.values()},
                    map_path=self.map,
                )
            )
        self.spawn_haproxy()

        async def all_up() -> bool:
            assert self.haproxy is not None and self.haproxy.poll() is None, self.haproxy_log()
            try:
                rows = await self.stat()
            except OSError:  # the runtime API is not open yet
                return False
            return all(row["status"] == "UP" for row in rows.values())

        await until(all_up, timeout=30, what="HAProxy up with every server UP")

    def spawn_haproxy(self) -> None:
        if self.socket.exists():
            self.socket.unlink()
        with open(self.tmp / "haproxy.log", "ab") as log:
            self.haproxy = subprocess.Popen(
                [HAPROXY, "-db", "-f", str(self.tmp / "haproxy.cfg")],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    async def stop_haproxy(self) -> None:
        if self.haproxy is not None and self.haproxy.poll() is None:
            self.haproxy.terminate()
            await asyncio.to_thread(self.haproxy.wait, 10)

    def start_fleet(self, interval_s: float = 1.0) -> None:
        """`vllm-proxy-fleet` beside HAProxy, as its systemd unit runs it."""
        self.fleet_interval_s = interval_s
        servers = [f"--server={m.name}={m.url}" for m in self.members.values()]
        with open(self.tmp / "fleet.log", "ab") as log:  # a restart appends
            self.fleet = subprocess.Popen(
                [sys.executable, "-m", "vllm_proxy.fleet", "--haproxy-socket", str(self.socket),
                 "--map", str(self.map), "--interval-s", str(interval_s), *servers],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip

    def stop_fleet(self, kill: bool = False) -> None:
        if self.fleet is not None and self.fleet.poll() is None:
            (self.fleet.kill if kill else self.fleet.terminate)()
            self.fleet.wait(10)

    def fleet_log(self) -> str:
        path = self.tmp / "fleet.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    async def haproxy_map(self) -> dict[str, str]:
        """HAProxy's map now (first entry of each key)."""
        out: dict[str, str] = {}
        for line in (await self.command(f"show map {self.map}")).splitlines():
            parts = line.split(" ", 2)
            if len(parts) == 3 and parts[0].startswith("0x"):
                out.setdefault(parts[1], parts[2])
        return out

    async def mapped(self, expected: Any, timeout: float = 30.0, what: str = "") -> dict[str, str]:
        """Wait until HAProxy's map satisfies `expected(map)`; the map."""
        seen: dict[str, str] = {}

        async def ok() -> bool:
            assert self.fleet is None or self.fleet.poll() is None, self.fleet_log()
            seen.clear()
            seen.update(await self.haproxy_map())
            return bool(expected(seen))

        await until(ok, timeout=timeout, what=what or "the fleet's map")
        return dict(seen)

    async def listening(self, member: Member) -> None:
        """Wait until the member's proxy answers /health with 200."""

        async def healthy() -> bool:
            assert member.proc is not None and member.proc.poll() is None, member.log()[-3000:]
            try:
                async with self.http.get(member.url + "/health") as r:
                    return r.status == 200
            except aiohttp.ClientError:
                return False

        await until(healthy, timeout=30, what=f"{member.name} listening")

    async def close(self) -> None:
        self.stop_fleet()
        for member in self.members.values():
            if member.proc is not None and member.proc.poll() is None:
                member.proc.send_signal(signal.SIGTERM)
        for member in self.members.values():
            if member.proc is None:
                continue
            try:
                await asyncio.to_thread(member.proc.wait, 30)
            except subprocess.TimeoutExpired:
                member.proc.kill()  # its engines' guards take them down with it
                member.proc.wait()
        if self.haproxy is not None and self.haproxy.poll() is None:
            self.haproxy.terminate()
            await asyncio.to_thread(self.haproxy.wait, 10)

    def haproxy_log(self) -> str:
        return (self.tmp / "haproxy.log").read_text(errors="replace")[-4000:]

    # -- what the cluster says -----------------------------------------------------------

    async def command(self, line: str) -> str:
        """One command on HAProxy's runtime API (its stats socket)."""
        reader, writer = await asyncio.open_unix_connection(str(self.socket))
        writer.write(line.encode() + b"\n")
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return raw.decode()

    async def stat(self) -> dict[str, dict[str, str]]:
        """HAProxy's `show stat` for each server of the backend (status, stot, chkdown, ...)."""
        rows = csv.DictReader(io.StringIO((await self.command("show stat")).lstrip("# ")))
        return {r["svname"]: r for r in rows if r["pxname"] == "vllm" and r["svname"] in SERVERS}

    async def status_is(self, server: str, status: str) -> None:
        async def reached() -> bool:
            return (await self.stat())[server]["status"] == status

        await until(reached, what=f"{server} {status} in HAProxy")

    async def where(self, model: str) -> list[str]:
        """The live servers with a RUNNING instance of `model`."""
        found = []
        for member in self.members.values():
            if member.proc is None or member.proc.poll() is not None:
                continue
            async with self.http.get(f"{member.url}/admin/models/{model}") as r:
                row = await r.json()
            if any(i["state"] == "running" for i in row["instances"]):
                found.append(member.name)
        return found

    async def homes(self) -> dict[str, str]:
        """Each model's one server (asserting that it runs on exactly one)."""
        homes = {}
        for model in self.traffic:
            where = await self.where(model)
            assert len(where) == 1, f"{model} runs on {where}"
            homes[model] = where[0]
        return homes

    def starts(self, model: str) -> int:
        return sum(m.starts(model) for m in self.members.values())

    async def evictions(self, reason: str = "memory") -> int:
        """Running engines the live proxies stopped for `reason`
        (``vllm_proxy_evictions_total``)."""
        total = 0.0
        for member in self.members.values():
            if member.proc is None or member.proc.poll() is not None:
                continue
            async with self.http.get(member.url + "/metrics") as r:
                text = await r.text()
            for family in text_string_to_metric_families(text):
                total += sum(
                    s.value
                    for s in family.samples
                    if s.name == "vllm_proxy_evictions_total" and s.labels.get("reason") == reason
                )
        return int(total)

    # -- requests ------------------------------------------------------------------------

    async def chat(
        self,
        model: str,
        *,
        rid: str | None = None,
        max_tokens: int = 1,
        url: str | None = None,
        session: aiohttp.ClientSession | None = None,
        **extra: Any,
    ) -> Reply:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
        body["max_tokens"] = max_tokens
        headers = {"X-Request-ID": rid} if rid else {}
        target = (url or self.url) + "/v1/chat/completions"
        async with (session or self.http).post(target, json=body, headers=headers) as r:
            return Reply(r.status, await r.read(), r.headers.copy())

    async def stream(
        self, model: str, rid: str, max_tokens: int, url: str | None = None
    ) -> aiohttp.ClientResponse:
        """A stream whose first chunk has arrived (it is being served)."""
        body = {"model": model, "stream": True, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
        resp = await self.http.post(
            (url or self.url) + "/v1/chat/completions", json=body, headers={"X-Request-ID": rid}
        )
        assert resp.status == 200, await resp.text()
        assert await resp.content.readany()
        return resp

    async def place(self) -> dict[str, str]:
        """Serve every model once through HAProxy; each model's home."""
        for model in self.traffic:
            reply = await self.chat(model)
            assert reply.status == 200, reply.body
        return await self.homes()
