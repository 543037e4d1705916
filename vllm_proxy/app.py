"""Composition root: builds every runtime object from a `Config`, serves, shuts down in order.

A proxy first claims what it must hold alone (`Server.claim`): the state directory's lock, then
its listening sockets. Only then does it sweep engines left by a dead predecessor, so a second
proxy started by mistake leaves a running one untouched and exits with one line.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import resource
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from .config import AdmissionConfig, Config, ModelSpec, load_for_reload, state_dir
from .engines.engine import EngineProcess, PortAllocator, prune_caches
from .engines.instance import Instance
from .engines.ports import EngineContext, NoAdmission, UnmanagedMemory
from .engines.readahead import ReadAhead
from .engines.registry import EngineRegistry, StateDirBusy, StateLock
from .errors import BadRequest, ConfigError, ProxyError
from .frontend.bytes.connection import Listener, Runner, Site, listen
from .frontend.gate import Gate, parse_hosts
from .frontend.routes.admin import Admin, add_admin_routes
from .frontend.routes.console import Console, add_console_routes
from .frontend.routes.openai import OpenAIRoutes, add_routes
from .frontend.routes.placement_page import Holdings, add_placement_routes
from .frontend.routes.realtime import RealtimeRoute, add_realtime_routes
from .frontend.upstream import UpstreamPool
from .metrics import Metrics
from .planning.hostmem import HostRam
from .planning.memory import Memory, make_source, source_kind
from .planning.queueing import Queue, Rules
from .pool.admission import Admission
from .pool.manager import Manager
from .pool.roster import Roster

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    config: Config
    session: aiohttp.ClientSession
    manager: Manager
    metrics: Metrics
    proxy: OpenAIRoutes
    realtime: RealtimeRoute
    gate: Gate
    admin: Admin
    config_path: str | None = None
    #: ``--host``/``--port`` from the command line: they win over the file at every reload.
    overrides: dict[str, Any] = field(default_factory=dict)
    console: Console | None = None

    async def reload(self) -> dict[str, Any]:
        """Re-read the config file and reconcile model by model; all or nothing.

        Raises `BadRequest` (code ``invalid_config``) when the new file is invalid (unreadable,
        empty, truncated, not YAML, a bad key, a model that cannot fit); the running config then
        stays as it was and the error is logged once.
        """
        if self.config_path is None:
            raise BadRequest("the proxy was started without a config file", code="invalid_config")
        try:
            new = load_for_reload(self.config_path, self.overrides)
            hosts = parse_hosts(new.server.allowed_hosts)
            memory = self.manager.memory
            specs = resolve_specs(new, memory.kind if memory is not None else "none")
            if memory is not None:
                memory.set_specs(specs)
        except ConfigError as err:
            log.error("reload rejected, keeping the running config: %s", err)
            raise BadRequest(f"reload rejected: {err}", code="invalid_config") from None
        self.manager.max_queue = new.admission.max_queue
        self.manager.queue.rules = admission_rules(new.admission)
        report: dict[str, Any] = self.manager.reload(specs, new.server.drain_timeout_s)
        self.proxy.configure(new.server)
        self.realtime.configure(new.server)
        self.gate.configure(new.server, hosts)
        self.admin.configure(new.server)
        if self.console is not None:
            self.console.configure(new.server)
        self.proxy.upstream.set_shares(specs)
        report["needs_restart"] = _restart_only(self.config, new)
        if report["needs_restart"]:
            log.warning(
                "reload: %s change only after a restart", ", ".join(report["needs_restart"])
            )
        self.config = new
        return report


def admission_rules(adm: AdmissionConfig) -> Rules:
    """The admission queue's rules from the ``admission`` section."""
    return Rules(adm.max_reorder_s, adm.idle_grace_s, adm.queue_timeout_s, adm.max_wait_s)


def _restart_only(old: Config, new: Config) -> list[str]:
    """Settings a reload cannot apply to a running proxy."""
    keys = ["host", "port", "state_dir", "max_body_mb", "max_upstream_connections"]
    changed = [f"server.{k}" for k in keys if getattr(old.server, k) != getattr(new.server, k)]
    if old.gpu != new.gpu:
        changed.append("gpu")
    return changed


#: At shutdown, how long read-aheads still in flight may take (a posix_fadvise call each).
READ_AHEAD_WAIT_S = 2.0
RUNTIME = web.AppKey("runtime", Runtime)


def resolve_specs(config: Config, kind: str | None = None) -> dict[str, ModelSpec]:
    """`Config.specs` on this host: an engine on NVIDIA GPUs (memory read through NVML; `kind`
    of the running memory, else `source_kind`) sleeps by default (`config.sleep_by_default`)."""
    return config.specs(platform_sleeps=(kind or source_kind(config)) == "nvml")


def build_memory(config: Config, specs: dict[str, ModelSpec], metrics: Metrics) -> Memory | None:
    """GPU memory management, or None when the config (or the machine) has no GPU to manage.

    Raises `ConfigError` for a model that can never fit on the configured devices.
    """
    source, kind = make_source(config)
    if source is None:
        log.info("GPU memory management off (gpu.monitor: none, or no GPU found)")
        return None
    memory = Memory(source, kind, config, specs, metrics)
    sizes = ", ".join(f"{d}: {mb} MiB" for d, mb in memory.totals.items())
    log.info("GPU memory managed (%s): %s", kind, sizes)
    return memory


def check_memory(config: Config) -> str:
    """What ``--check`` says of GPU memory: `ConfigError` naming a model that cannot fit on any
    device it may use, else how memory is managed."""
    memory = build_memory(config, resolve_specs(config), Metrics())
    if memory is None:
        return "not managed"
    memory.close()
    return f"{memory.kind}, every model fits"


def engine_context(
    session: aiohttp.ClientSession,
    registry: EngineRegistry,
    metrics: Metrics,
    memory: Memory | None,
    *,
    queue: Queue | None = None,
    host: HostRam | None = None,
    admission_class: type[Admission] = Admission,
    engine_factory: type[EngineProcess] = EngineProcess,
    read_ahead: ReadAhead | None = None,
) -> tuple[EngineContext[Instance], Roster, Admission | None]:
    """The context every instance shares, built whole, in the order its ports need:

    - the queue, host RAM and the roster (empty until the manager fills it);
    - admission over the roster's instances, where memory is managed;
    - the context, with memory (or `UnmanagedMemory`), admission (or `NoAdmission`) and the
      roster as the pool's hooks.

    The density benchmark passes its virtual clock's queue, its world's host RAM, a watched
    admission and its virtual engines.
    """
    queue = queue or Queue()
    host = host or HostRam()
    roster = Roster(queue, host)
    admission = (
        admission_class(queue, metrics, memory, roster.all_instances, lambda: roster.models)
        if memory is not None
        else None
    )
    ctx = EngineContext(
        session=session,
        ports=PortAllocator(),
        registry=registry,
        metrics=metrics,
        admission=admission or NoAdmission(),
        memory=memory or UnmanagedMemory(),
        pool=roster,
        host=host,
        queue=queue,
        engine_factory=engine_factory,
        read_ahead=read_ahead,
    )
    return ctx, roster, admission


async def create_app(
    config: Config, config_path: str | None = None, overrides: dict[str, Any] | None = None
) -> web.Application:
    """Build the application (inside the running loop). Sweeps engines left by a dead proxy:
    call it only while holding the state dir's lock (`Server.claim`)."""
    metrics = Metrics()
    gate = Gate(config.server)  # a bad allowed_hosts entry stops us here
    specs = resolve_specs(config)
    memory = build_memory(config, specs, metrics)  # a model that can never fit stops us here
    registry = EngineRegistry(state_dir(config.server))
    pruned = prune_caches(Path(state_dir(config.server)) / "vllm-cache",
                          {Path(s.cache_dir).name for s in specs.values()})  # fmt: skip
    if pruned:
        log.info("deleted the compile caches of models no longer configured: %s",
                 ", ".join(pruned))  # fmt: skip
    swept = registry.sweep()
    if swept:
        log.warning("stopped %d engine group(s) left by a previous proxy", len(swept))
    # For health polling, engine metrics and admin calls; requests go through `UpstreamPool`.
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
    ctx, roster, admission = engine_context(session, registry, metrics, memory,
                                            read_ahead=ReadAhead())  # fmt: skip
    adm = config.admission
    manager = Manager(specs, ctx, roster, memory, admission, adm.queue_timeout_s, adm.max_queue,
                      admission_rules(adm))  # fmt: skip
    manager.start()
    upstream = UpstreamPool(
        config.server.max_upstream_connections, slot_wait_s=config.server.connection_queue_timeout_s
    )
    upstream.set_shares(specs)
    proxy = OpenAIRoutes(manager, metrics, upstream, config.server)
    # Outermost first: the proxy's middleware (request ids, errors) wraps the gate.
    app = web.Application(
        client_max_size=proxy.max_body_bytes, middlewares=[proxy.middleware, gate.middleware]
    )
    admin = Admin(manager, session, config.server)
    realtime = RealtimeRoute(proxy, config.server)
    runtime = Runtime(
        config, session, manager, metrics, proxy, realtime, gate, admin, config_path,
        overrides or {},
    )  # fmt: skip
    admin.reload_config = runtime.reload
    app[RUNTIME] = runtime
    add_routes(app, proxy)
    add_realtime_routes(app, realtime)
    add_admin_routes(app, admin)
    runtime.console = Console(manager, proxy.recent, admin.snapshot, config.server)
    add_console_routes(app, runtime.console)
    add_placement_routes(app, Holdings(manager, admin))
    app.on_cleanup.append(_cleanup)
    return app


async def _cleanup(app: web.Application) -> None:
    rt = app[RUNTIME]
    rt.admin.close()
    await rt.manager.shutdown()
    if rt.manager.ctx.read_ahead is not None:  # its thread: a read ends at its next window
        rt.manager.ctx.read_ahead.close()
        await rt.manager.ctx.read_ahead.wait(READ_AHEAD_WAIT_S)
    rt.proxy.upstream.close()
    await rt.session.close()


class Server:
    """A listening proxy: start, then `shutdown()` (drain, stop engines, close)."""

    def __init__(
        self,
        config: Config,
        config_path: str | None = None,
        overrides: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.overrides = overrides or {}
        self.runner: Runner | None = None
        self.app: web.Application | None = None
        self._lock: StateLock | None = None
        self._sockets: list[socket.socket] | None = None

    def claim(self) -> None:
        """Take the state dir's lock, then bind the listening sockets, before anything else.

        A proxy that cannot have both changes nothing: `ConfigError` with one line naming the
        key to change (another proxy with the same ``server.state_dir``, a port in use).
        """
        if self._lock is not None:
            return
        s = self.config.server
        path = state_dir(s)
        try:
            lock = StateLock(path)
        except StateDirBusy as err:
            raise ConfigError(
                f"{err}: stop it first, or give this proxy its own server.state_dir"
            ) from None
        except OSError as err:
            raise ConfigError(f"server.state_dir: cannot use {path}: {_reason(err)}") from None
        try:
            self._sockets = listen(s.host, s.port)
        except OSError as err:
            lock.release()
            raise ConfigError(_bind_error(s.host, s.port, err)) from None
        self._lock = lock

    def _unclaim(self) -> None:
        for sock in self._sockets or ():
            sock.close()  # no-op for sockets a listener has closed already
        self._sockets = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    async def start(self) -> None:
        """Claim (unless done), sweep leftovers and build the application, then listen."""
        self.claim()
        try:
            await self._start()
        except BaseException:
            self._unclaim()
            raise

    async def _start(self) -> None:
        assert self._sockets is not None
        self.app = await create_app(self.config, self.config_path, self.overrides)
        self.runner = Runner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=5.0,
            keepalive_timeout=self.config.server.keepalive_timeout_s,
            head_timeout_s=self.config.server.header_timeout_s,
        )
        await self.runner.setup()
        s = self.config.server
        await ClaimedSite(self.runner, s.host, s.port, self._sockets).start()
        log.info("vllm-proxy listening on %s", ", ".join(self.urls))
        self.runtime.manager.preload()

    @property
    def port(self) -> int:
        assert self.runner is not None
        return int(self.runner.addresses[0][1])

    @property
    def urls(self) -> list[str]:
        assert self.runner is not None
        return [f"http://{a[0]}:{a[1]}" for a in self.runner.addresses]

    @property
    def runtime(self) -> Runtime:
        assert self.app is not None
        return self.app[RUNTIME]

    async def shutdown(self) -> None:
        """Stop admitting, let in-flight requests finish (bounded), stop engines, close."""
        if self.runner is None:
            self._unclaim()
            return
        manager = self.runtime.manager
        self.runtime.realtime.sessions.end_all()  # realtime sessions never end by themselves
        drained = await manager.drain(self.config.server.drain_timeout_s)
        if not drained:
            log.warning("drain timeout: %d request(s) still in flight", manager.active_leases())
        await manager.shutdown()
        await self.runner.cleanup()
        self.runner = None
        self._unclaim()  # engines are stopped: another proxy may take the state dir now


class ClaimedSite(Site):
    """A `Site` on sockets bound before the application was built (`Server.claim`)."""

    __slots__ = ("_sockets",)

    def __init__(
        self, runner: web.BaseRunner, host: str | None, port: int, sockets: list[socket.socket]
    ) -> None:
        super().__init__(runner, host, port)
        self._sockets = sockets

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site; `Site.start` would bind again
        server = self._runner.server
        assert server is not None
        self._server = Listener(asyncio.get_running_loop(), self._sockets, server)


def _reason(err: OSError) -> str:
    if err.errno and err.errno > 0:
        return os.strerror(err.errno)
    return err.strerror or str(err)  # getaddrinfo's errors


def _bind_error(host: str, port: int, err: OSError) -> str:
    """One line for a listening socket that cannot be had, naming the key to change."""
    where = f"{host or '0.0.0.0'}:{port}"
    if err.errno == errno.EADDRINUSE:
        return (
            f"cannot listen on {where}: port {port} is in use by another program; "
            "set server.port (or --port) to a free port"
        )
    if err.errno == errno.EACCES:
        return (
            f"cannot listen on {where}: permission denied (ports below 1024 need privileges); "
            "set server.port (or --port)"
        )
    if isinstance(err, socket.gaierror) or err.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {where}: {_reason(err)}; check server.host (or --host)"
    return f"cannot listen on {where}: {_reason(err)}; check server.host and server.port"


_tasks: set[asyncio.Task[None]] = set()


def _spawn(coro: Any) -> None:
    task = asyncio.ensure_future(coro)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


async def _reload_on_signal(server: Server) -> None:
    log.info("SIGHUP: reloading %s", server.config_path)
    sd_notify("RELOADING=1")
    try:
        await server.runtime.reload()
    except ProxyError:
        pass  # logged by reload(); the running config stays
    finally:
        sd_notify("READY=1")


def sd_notify(message: str) -> None:
    """Tell systemd about our state when run as a ``Type=notify`` service (no-op otherwise)."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(message.encode(), addr)
    except OSError as err:
        log.warning("cannot notify systemd: %s", err)


def raise_fd_limit() -> None:
    """Lift the soft limit on open descriptors to the hard one: every stream holds two."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as err:
            log.warning("cannot raise the open-file limit from %d: %s", soft, err)
    log.info("open-file limit: %s", soft)


def tune_gc() -> None:
    """Freeze start-up objects and collect young objects less often.

    Under load, full collections that find nothing to free took a large share of the proxy's
    time and caused p99 spikes (benchmarks/profile_proxy.py); the request path makes few
    reference cycles.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


async def serve(
    config: Config, config_path: str | None = None, overrides: dict[str, Any] | None = None
) -> int:
    """Run until SIGTERM/SIGINT (a second one forces exit); SIGHUP reloads the config."""
    server = Server(config, config_path, overrides)
    server.claim()  # first: a proxy that cannot claim its state dir and port says one line
    raise_fd_limit()
    await server.start()
    tune_gc()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("second %s: killing engines and exiting now", sig.name)
            server.runtime.manager.kill_all()
            os._exit(1)
        log.info("%s: draining (up to %gs)", sig.name, config.server.drain_timeout_s)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    loop.add_signal_handler(signal.SIGHUP, lambda: _spawn(_reload_on_signal(server)))
    sd_notify("READY=1")  # only now: a SIGHUP right after READY must find its handler
    await stop.wait()
    sd_notify("STOPPING=1")
    await server.shutdown()
    log.info("vllm-proxy stopped")
    return 0
