"""One engine process: spawn (under its guard), readiness, health probes, vLLM's sleep, wake
and warm-up calls, stop, logs, and where it serves (a Unix socket in a private directory, or an
allocated loopback port).

Nothing here knows about instance states or requests; `instance.Instance` drives an
`EngineProcess` through its life and decides what its exit means.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import stat
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import psutil

from ..config import ModelSpec, file_stem
from ..engine_args import PORT_IN_USE, ArgValue, profiled_lines
from ..errors import EngineFailed, EngineTimeout
from .guard import DEATH_SIGNAL
from .statedir import open_nofollow, private_dirs

log = logging.getLogger(__name__)

#: Grace before SIGKILL when stopping an engine that is still loading: vLLM ignores SIGTERM then.
STARTING_STOP_GRACE_S = 2.0
#: Every wait for a killed process group is bounded by this.
KILL_WAIT_S = 10.0
#: After asking the guard to kill its engine tree: when the group gets SIGKILL regardless.
GUARD_KILL_S = 1.0
#: After a broken engine connection: how long to look for the exit of an engine that seems alive.
EXIT_LOOK_S = 0.25
#: Readiness polling: from 5 ms, backing off to 20 ms (a refused connect costs microseconds).
POLL_FIRST_S, POLL_MAX_S = 0.005, 0.02
LOG_TAIL_LINES = 20
#: How often a start's log is read for the end of its profiling (first, then at most).
PROFILE_POLL_FIRST_S, PROFILE_POLL_MAX_S = 0.1, 1.0
#: The most of a start's log read in one poll.
PROFILE_READ_MAX = 1 << 20
#: The longest path a Unix socket address holds (``sun_path``: 108 bytes with its final NUL).
SUN_PATH_MAX = 107


class PortInUse(EngineFailed):
    """The engine could not bind its port (lost a race with another program)."""


class CallFailed(Exception):
    """A sleep, wake or warm-up call the engine did not answer as it should (the message says
    how: status, timeout, wrong state); for the proxy's log, never for clients."""


#: The route that answers a pooling task and the field of each item that holds its numbers
#: (vLLM 0.33 registers /v1/embeddings for embed and token_embed, /classify for classify, and
#: /pooling for every task: ``entrypoints/pooling/factories.py:110-143``; the models in
#: ``embed/protocol.py:174-177``, ``token_embed/protocol.py:58-61``,
#: ``classify/protocol.py:58-62``, ``pooling/protocol.py:102-105``). Any other task goes to
#: /pooling, which without a ``task`` answers the engine's own (``pooling/serving.py:66-67``).
POOLING_ROUTES = {
    "embed": ("/v1/embeddings", "embedding"),
    "token_embed": ("/v1/embeddings", "embedding"),
    "embed&token_classify": ("/v1/embeddings", "embedding"),
    "classify": ("/classify", "probs"),
}


def _flat(value: object) -> list[float] | None:
    """A number, or nested lists of numbers, as one flat list (None for anything else)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return [float(value)]
    if not isinstance(value, list):
        return None
    out: list[float] = []
    for part in value:
        numbers = _flat(part)
        if numbers is None:
            return None
        out += numbers
    return out


class PortAllocator:
    """Hands out loopback ports that are free now and not held by another engine of ours."""

    def __init__(self) -> None:
        self._held: set[int] = set()
        self._cursor: dict[tuple[int, int], int] = {}

    def allocate(self, port_range: tuple[int, int]) -> int:
        lo, hi = port_range
        span = hi - lo + 1
        # A random first port: proxies that share a range (several on one host) rarely race.
        start = self._cursor.setdefault(port_range, random.randrange(span))
        for i in range(span):
            port = lo + (start + i) % span
            if port not in self._held and port_is_free(port):
                self._held.add(port)
                self._cursor[port_range] = (start + i + 1) % span
                return port
        raise EngineFailed(f"no free port in {lo}-{hi}", code="no_free_port")

    def release(self, port: int) -> None:
        self._held.discard(port)


def port_is_free(port: int) -> bool:
    """True when nothing listens on (or is bound to) the port on loopback or all interfaces."""
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def address_for(spec: ModelSpec, instance_id: str, ports: PortAllocator) -> int | str:
    """Where a new engine of instance `instance_id` will serve: its socket's path (uds), or a
    free port of the model's range (tcp); `EngineFailed` when there is no place for the socket."""
    if spec.transport == "tcp":
        return ports.allocate(spec.port_range)
    try:
        return socket_path(spec, instance_id)
    except OSError as err:
        log.error("%s: no place for the engine's socket: %s", instance_id, err)
        raise EngineFailed(
            f"model '{spec.name}': no place for the engine's socket (see the proxy's log)",
            code="engine_start_failed",
        ) from None


def socket_path(spec: ModelSpec, instance_id: str) -> str:
    """Where instance ``<model>#<n>`` serves under transport uds: ``<socket_dir>/<model>.<n>.sock``
    in a directory only the proxy's user can open (made, or made private, here).

    A path longer than a socket address holds gets a short name (a hash of the instance id);
    when even that is too long, the directory is ``vllm-proxy-<uid>-<hash>`` under the temp
    directory (or /tmp), made private the same way. Raises `OSError` when no directory fits or
    one is not the proxy's own."""
    n = instance_id.rpartition("#")[2]
    short = hashlib.sha256(instance_id.encode()).hexdigest()[:16] + ".sock"
    tag = hashlib.sha256(spec.socket_dir.encode()).hexdigest()[:12]
    private = f"vllm-proxy-{os.geteuid()}-{tag}"
    choices = [
        (Path(spec.socket_dir), f"{file_stem(spec.name)}.{n}.sock"),
        (Path(spec.socket_dir), short),
        (Path(tempfile.gettempdir()) / private, short),
        (Path("/tmp") / private, short),
    ]
    for directory, name in choices:
        path = str(directory / name)
        if len(os.fsencode(path)) <= SUN_PATH_MAX:
            private_dir(directory)
            return path
    raise OSError(f"no directory for engine sockets has a path short enough: {spec.socket_dir}")


def private_dir(path: Path) -> None:
    """Make `path` a directory of mode 0700 owned by this user (its parents as needed), or
    raise `OSError` when it is something else (a link, another user's directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise OSError(f"{path}: not a directory owned by the proxy's user")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def log_path(spec: ModelSpec, instance_id: str) -> Path:
    """``<log_dir>/<model>.<n>.log`` for instance ``<model>#<n>`` (rotated to .1, .2, ...)."""
    n = instance_id.rpartition("#")[2]
    return Path(spec.log_dir) / f"{file_stem(spec.name)}.{n}.log"


def instance_logs(spec: ModelSpec) -> dict[int, Path]:
    """The model's instance log files on disk: instance number -> current file."""
    pattern = re.compile(re.escape(file_stem(spec.name)) + r"\.(\d+)\.log")
    found: dict[int, Path] = {}
    with contextlib.suppress(OSError):
        for path in Path(spec.log_dir).iterdir():
            m = pattern.fullmatch(path.name)
            if m:
                found[int(m.group(1))] = path
    return found


def prune_logs(spec: ModelSpec, keep: set[int], newest: int) -> None:
    """Delete log files (and their rotations) of the model's instances, except those in `keep`
    and the `newest` most recent ones: ids are never reused, so files would pile up."""
    numbers = sorted(instance_logs(spec))
    recent = set(numbers[-newest:]) if newest > 0 else set()
    for n in numbers:
        if n in keep or n in recent:
            continue
        base = log_path(spec, f"#{n}")
        for path in [base, *base.parent.glob(base.name + ".*")]:
            with contextlib.suppress(OSError):
                path.unlink()


#: A compile cache of a model no longer configured is deleted once unused this long.
CACHE_MAX_AGE_S = 7 * 24 * 3600


def prune_caches(
    root: Path, keep: set[str], max_age_s: float = CACHE_MAX_AGE_S, now: float | None = None
) -> list[str]:
    """Delete the folders under `root` (``<state_dir>/vllm-cache``) that belong to no model in
    `keep` (their `config.cache_stem`s) and that nothing wrote to for `max_age_s` (the newest
    mtime of the folder and its entries); returns their names. A renamed or removed model's
    torch.compile, FlashInfer and DeepGEMM caches would otherwise stay for ever."""
    now = time.time() if now is None else now
    gone = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    for entry in entries:
        if entry.name in keep or not entry.is_dir() or entry.is_symlink():
            continue
        try:
            newest = max([entry.stat().st_mtime, *(c.lstat().st_mtime for c in entry.iterdir())])
        except OSError:
            continue
        if now - newest >= max_age_s:
            shutil.rmtree(entry, ignore_errors=True)
            gone.append(entry.name)
    return gone


def read_tail(path: Path, lines: int = LOG_TAIL_LINES, max_bytes: int = 16384) -> str:
    """The last `lines` lines of a log file (empty when unreadable)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except OSError:
        return ""
    text = data.decode("utf-8", "replace").splitlines()
    return "\n".join(text[-lines:])


def _read_from(path: Path, offset: int) -> tuple[bytes, int]:
    """Up to `PROFILE_READ_MAX` bytes of `path` from `offset`, and where the next read starts
    (from 0 again once the file was rotated, being shorter than `offset`)."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            if size < offset:
                offset = 0
            fh.seek(offset)
            data = fh.read(PROFILE_READ_MAX)
    except OSError:
        return b"", offset
    return data, offset + len(data)


class EngineProcess:
    """A guarded engine process group serving on a Unix socket (`socket_path`) or on
    127.0.0.1:`port`."""

    def __init__(
        self,
        spec: ModelSpec,
        address: int | str,
        log_file: Path,
        tag: str = "",
        overrides: dict[str, ArgValue] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.spec = spec
        #: Where it serves: a loopback port (int) or the path of its Unix socket (str). The
        #: request path's `UpstreamPool` takes it as it is.
        self.address = address
        self.socket_path = address if isinstance(address, str) else None
        self.tag = tag
        self.overrides = overrides or {}
        self.env = env or {}
        #: The URL `client()` reaches the engine at. Over a socket the host names nothing; port
        #: 0 makes a TCP session given it by mistake fail (nothing can listen there).
        self.base_url = "http://127.0.0.1:0" if self.socket_path else f"http://127.0.0.1:{address}"
        #: Under uds: a session over the socket, made at spawn, closed once the process exited.
        self._client: aiohttp.ClientSession | None = None
        self.log_path = log_file
        self.proc: asyncio.subprocess.Process | None = None
        self.started_at = 0.0
        #: The smallest KV cache (bytes) a worker of this engine measured at its start (None:
        #: not seen, or it was told the size); read by `watch_profiling`.
        self.kv_measured: int | None = None
        self._log_offset = 0
        self._log_carry = b""
        self._profiled = 0
        self.exit_code: int | None = None
        self.exited_at: float | None = None
        #: Inodes of the verified listening socket(s) on `port`.
        self.listener: frozenset[int] = frozenset()
        self._exited = asyncio.Event()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def port(self) -> int | str:
        """`address`: what the request path hands `UpstreamPool.request`."""
        return self.address

    @property
    def tcp_port(self) -> int | None:
        """The loopback port under transport tcp (None on a socket)."""
        return None if isinstance(self.address, str) else self.address

    @property
    def endpoint(self) -> str:
        """Where it serves, for logs: ``socket <path>`` or ``port <port>``."""
        return f"socket {self.socket_path}" if self.socket_path else f"port {self.address}"

    def _private_folders(self) -> None:
        """The log folder and the compile cache: inside the state dir, made 0700 and checked
        to be the proxy user's own (another user's cache would be loaded by the engine);
        elsewhere (an operator's `log_dir`), made as needed."""
        state = Path(self.spec.socket_dir).parent
        for folder in (Path(self.spec.log_dir), Path(self.spec.cache_dir or state)):
            if folder.is_relative_to(state):
                private_dirs(folder, state)
            else:
                folder.mkdir(parents=True, exist_ok=True)

    async def spawn(self) -> None:
        """Start the guard and, under it, the engine; returns once the process exists."""
        self._private_folders()
        argv = [sys.executable, "-m", "vllm_proxy.engines.guard", "--parent", str(os.getpid())]
        argv += ["--log", str(self.log_path), "--log-max-bytes", str(self.spec.log_max_bytes)]
        argv += ["--log-backups", str(self.spec.log_backups), "--tag", self.tag, "--"]
        argv += self.spec.engine_argv(self.address, self.overrides)
        if self.socket_path is not None:
            # A socket file left by an engine that died with the proxy: vLLM's bind would fail.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        errfd = open_nofollow(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        with open(errfd, "ab") as errlog:  # noqa: ASYNC230 - the guard's own errors
            self._log_offset = errlog.seek(0, os.SEEK_END)
            self.proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=errlog,
                env=self.spec.engine_env(self.env),
                start_new_session=True,
            )
        self.started_at = time.monotonic()
        if self.socket_path is not None:
            connector = aiohttp.UnixConnector(path=self.socket_path, limit=16)
            self._client = aiohttp.ClientSession(connector=connector)
        asyncio.get_running_loop().create_task(self._watch(self.proc))

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        # The guard sweeps its group; this covers a guard that was itself killed.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        self.exit_code = code if code >= 0 else 128 - code
        self.exited_at = time.monotonic()
        if self._client is not None:  # closed before anyone waiting on the exit goes on
            with contextlib.suppress(Exception):
                async with asyncio.timeout(KILL_WAIT_S):
                    await self._client.close()
        if self.socket_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.socket_path)
        self._exited.set()

    async def wait_exit(self, timeout: float | None = None) -> int | None:
        """The exit code, or None if the process is still running after `timeout`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._exited.wait(), timeout)
        return self.exit_code

    async def look_for_exit(self) -> int | None:
        """The exit code of an engine whose connection broke: waited for (bounded) when its
        process is gone, looked for briefly when it still seems alive (a dying engine may look
        alive for a moment: a short look, not a fixed wait)."""
        if self.exit_code is None:
            await self.wait_exit(EXIT_LOOK_S if self.engine_alive() else KILL_WAIT_S)
        return self.exit_code

    def short_failure(self, what: str) -> str:
        """What a client may see: the model, what happened and the exit code or signal."""
        code = self.exit_code
        if code is None:
            return f"model '{self.spec.name}': engine {what}"
        if code > 128 and code - 128 in signal.valid_signals():
            how = f"killed by {signal.Signals(code - 128).name}"
        else:
            how = f"exit code {code}"
        return f"model '{self.spec.name}': engine {what} ({how})"

    def failure_message(self, what: str) -> str:
        """For the proxy's log only: the short cause and the engine's last log lines."""
        tail = read_tail(self.log_path)
        msg = self.short_failure(what)
        return f"{msg}; last log lines of {self.log_path}:\n{tail}" if tail else msg

    async def wait_ready(self, session: aiohttp.ClientSession) -> float:
        """Poll ``/health`` until 200 while watching the process; returns seconds taken.

        Raises `EngineFailed` (or `PortInUse`) at once when the process exits, and
        `EngineTimeout` after ``startup_timeout_s``.
        """
        exited = asyncio.ensure_future(self._exited.wait())
        polling = asyncio.ensure_future(self._poll_health(session))
        try:
            done, _ = await asyncio.wait(
                {exited, polling},
                timeout=self.spec.startup_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            exited.cancel()
            polling.cancel()
        if polling in done and not polling.cancelled() and polling.exception() is None:
            if polling.result():
                return time.monotonic() - self.started_at
            if self.socket_path is not None:  # only the proxy's user can bind there
                log.error(
                    "%s: %s answers /health, but its listener is not the engine's own process",
                    self.spec.name, self.socket_path,
                )  # fmt: skip
                raise EngineFailed(
                    f"model '{self.spec.name}': the engine's socket is held by another program",
                    code="engine_start_failed",
                )
            log.error(
                "%s: port %d answers /health, but its listener is not the engine's own process;"
                " trying another port",
                self.spec.name,
                self.address,
            )
            raise PortInUse(
                f"model '{self.spec.name}': the engine's port was taken by another program",
                code="engine_start_failed",
            )
        if self._exited.is_set():
            tail = read_tail(self.log_path, lines=200).encode()
            taken = self.socket_path is None and PORT_IN_USE.search(tail)
            cls = PortInUse if taken else EngineFailed
            log.error("%s", self.failure_message("exited while starting"))
            raise cls(self.short_failure("exited while starting"), code="engine_start_failed")
        what = f"not ready after {self.spec.startup_timeout_s:g}s, stopped"
        log.error("%s", self.failure_message(what))
        raise EngineTimeout(self.short_failure(what))

    async def until_ready(
        self,
        session: aiohttp.ClientSession,
        workers: int,
        who: str,
        profiled: Callable[[], None] | None = None,
    ) -> float:
        """`wait_ready`; for a start whose hold on its devices waits for the end of its memory
        profiling (`profiled`: the hold relaxed), `wait_ready_profiled` over its `workers`."""
        if profiled is None:
            return await self.wait_ready(session)

        def measured() -> None:
            log.info("%s: memory profiled; its devices are shared from here", who)
            profiled()

        return await self.wait_ready_profiled(session, workers, measured)

    async def wait_ready_profiled(
        self, session: aiohttp.ClientSession, workers: int, profiled: Callable[[], None]
    ) -> float:
        """`wait_ready`, calling `profiled()` once `workers` workers have ended their memory
        profiling (`watch_profiling`) if the engine is not ready by then; what the log gained
        after the last read is scanned too (`kv_measured`)."""
        ready = asyncio.ensure_future(self.wait_ready(session))
        watch = asyncio.ensure_future(self.watch_profiling(workers))
        try:
            await asyncio.wait({ready, watch}, return_when=asyncio.FIRST_COMPLETED)
            measured = watch.done() and watch.exception() is None and watch.result()
            if measured and not ready.done():
                profiled()
            seconds = await ready
        finally:
            ready.cancel()
            watch.cancel()
        with contextlib.suppress(OSError):
            while await self.scan_profiling():
                pass
        return seconds

    async def watch_profiling(self, workers: int) -> bool:
        """Read the engine's log as it starts until `workers` workers have ended their memory
        profiling (`engine_args.profiled_lines`); True then, False once the process exited.
        What they measured is left in `kv_measured`. Unbounded by itself: the caller races it
        with `wait_ready` (and calls `scan_profiling` once more after that)."""
        delay = PROFILE_POLL_FIRST_S
        while not self._exited.is_set():
            if await self.scan_profiling():
                if self._profiled >= workers:
                    return True
                continue  # more may be there already
            await asyncio.sleep(delay)
            delay = min(delay * 2, PROFILE_POLL_MAX_S)
        return False

    async def scan_profiling(self) -> bool:
        """Read what the engine's log gained since the last scan (see `watch_profiling`);
        whether it gained anything."""
        chunk, self._log_offset = await asyncio.to_thread(_read_from, self.log_path,
                                                          self._log_offset)  # fmt: skip
        if not chunk:
            return False
        text, _, self._log_carry = (self._log_carry + chunk).rpartition(b"\n")
        count, kv = profiled_lines(text.decode("utf-8", "replace"))
        self._profiled += count
        if kv is not None:
            self.kv_measured = kv if self.kv_measured is None else min(self.kv_measured, kv)
        return True

    async def _poll_health(self, session: aiohttp.ClientSession) -> bool:
        """Poll until ``/health`` answers 200; then True if the listener is the engine's own
        socket, False if another program holds the port (never trust a foreign listener)."""
        url = self.base_url + "/health"
        session = self.client(session)
        delay = POLL_FIRST_S
        timeout = aiohttp.ClientTimeout(total=5)
        while True:
            try:
                if not session.closed:  # (closed: the process exited, which `wait_ready` sees)
                    async with session.get(url, timeout=timeout) as resp:
                        if resp.status == 200:
                            return self._verify_listener()
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, POLL_MAX_S)

    def _listeners(self) -> frozenset[int]:
        """Inodes of the sockets listening where the engine serves."""
        if self.socket_path is not None:
            return unix_listening_inodes(self.socket_path)
        assert isinstance(self.address, int)
        return listening_inodes(self.address)

    def _verify_listener(self) -> bool:
        """Whether every socket listening where the engine serves (its port, or its socket's
        path) belongs to the engine's process tree; records the socket so it can be checked
        again later (`listener_unchanged`)."""
        assert self.proc is not None
        listeners = self._listeners()
        ours = tree_socket_inodes(self.proc.pid)
        if not listeners or not listeners <= ours:
            log.error(
                "%s: listeners on %s: %s held by pid(s) %s; the engine's tree holds %s",
                self.spec.name, self.endpoint, sorted(listeners),
                [(p, _cmd(p)) for p in _holders(listeners - ours)], sorted(ours),
            )  # fmt: skip
            return False
        self.listener = listeners
        return True

    def client(self, shared: aiohttp.ClientSession) -> aiohttp.ClientSession:
        """The HTTP session that reaches this engine at `base_url`: the proxy's shared one for an
        engine on a loopback port; for one on a Unix socket, a session of its own over that
        socket (made at spawn, closed once the process has exited: a call then fails)."""
        return self._client or shared

    async def probe(self, session: aiohttp.ClientSession, timeout: float) -> bool:
        """One health probe: ``GET /health`` answered 200 within `timeout`."""
        session = self.client(session)
        if session.closed:
            return False
        try:
            limit = aiohttp.ClientTimeout(total=timeout)
            async with session.get(self.base_url + "/health", timeout=limit) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    # -- sleep mode (vLLM's dev routes; see docs/design.md, "Sleep tiers") --------------------

    async def _call(
        self,
        session: aiohttp.ClientSession,
        method: str,
        path: str,
        body: object = None,
        headers: dict[str, str] | None = None,
    ) -> object:
        """One call to the engine; its JSON answer (None when empty). `CallFailed` for anything
        but 200. The caller bounds the time."""
        session = self.client(session)
        if session.closed:
            raise CallFailed(f"{method} {path}: the engine has exited")
        try:
            async with session.request(
                method, self.base_url + path, json=body, headers=headers
            ) as resp:
                data = await resp.read()
                if resp.status != 200:
                    snippet = data[:200].decode("utf-8", "replace")
                    raise CallFailed(f"{method} {path} answered {resp.status}: {snippet}")
        except aiohttp.ClientError as err:
            raise CallFailed(f"{method} {path} failed: {type(err).__name__}: {err}") from None
        if not data.strip():
            return None
        try:
            return json.loads(data)
        except ValueError:
            raise CallFailed(f"{method} {path} answered 200 with a body that is not JSON") from None

    async def is_sleeping(self, session: aiohttp.ClientSession) -> bool:
        answer = await self._call(session, "GET", "/is_sleeping")
        if not isinstance(answer, dict) or not isinstance(answer.get("is_sleeping"), bool):
            raise CallFailed(f"GET /is_sleeping answered {answer!r}")
        return bool(answer["is_sleeping"])

    async def probe_sleeping(self, session: aiohttp.ClientSession, timeout: float) -> bool:
        """``GET /is_sleeping`` answered ``true`` within `timeout` (False for anything else:
        awake, no answer, an error; the /health probe judges those)."""
        try:
            async with asyncio.timeout(timeout):
                return await self.is_sleeping(session)
        except (CallFailed, TimeoutError):
            return False

    async def sleep(self, session: aiohttp.ClientSession, level: int) -> None:
        """``POST /sleep?level=N``, then check ``/is_sleeping`` says so."""
        await self._call(session, "POST", f"/sleep?level={level}")
        if not await self.is_sleeping(session):
            raise CallFailed("/sleep answered 200 but /is_sleeping says awake")

    async def wake(self, session: aiohttp.ClientSession, level: int) -> None:
        """``POST /wake_up``, then check ``/is_sleeping`` says awake.

        After level 2 the weights were discarded: vLLM's order is ``wake_up?tags=weights``,
        ``collective_rpc reload_weights``, then ``wake_up?tags=kv_cache``, so that the reload's
        per-layer buffers never sit on top of a mapped KV cache (and the scheduler resumes only
        once the weights are valid)."""
        if level >= 2:
            await self._call(session, "POST", "/wake_up?tags=weights")
            await self._call(session, "POST", "/collective_rpc", {"method": "reload_weights"})
            await self._call(session, "POST", "/wake_up?tags=kv_cache")
        else:
            await self._call(session, "POST", "/wake_up")
        if await self.is_sleeping(session):
            raise CallFailed("/wake_up answered 200 but /is_sleeping still says asleep")

    def _headers(self) -> dict[str, str] | None:
        key = self.spec.api_key
        return {"Authorization": f"Bearer {key}"} if key else None

    async def warmup(self, session: aiohttp.ClientSession) -> None:
        """One 1-token completion, or for a pooling model one call of the route its task has
        (`pool`); the answer must have the shape that route promises. A ``plugin`` task takes
        inputs only its plug-in knows: nothing is sent."""
        if self.spec.pooling:
            if self.spec.pooling_task != "plugin":
                await self.pool(session, "Hello")
            return
        await self.complete(session, {"prompt": "Hello", "max_tokens": 1, "temperature": 0})

    async def warm_up(self, session: aiohttp.ClientSession, timeout: float, who: str) -> None:
        """A start's warm-up (`warmup`) within `timeout`; when it fails the engine is stopped
        and `EngineFailed` raised (logged for instance `who`)."""
        try:
            async with asyncio.timeout(timeout):
                await self.warmup(self.client(session))
        except (CallFailed, TimeoutError) as err:
            why = str(err) or f"no answer within {timeout:g}s"
            log.error("%s: warm-up failed: %s", who, why)
            await self.stop(STARTING_STOP_GRACE_S)
            raise EngineFailed(
                f"model '{self.spec.name}': the engine's warm-up request failed",
                code="engine_start_failed",
            ) from None

    async def complete(
        self, session: aiohttp.ClientSession, body: dict[str, object]
    ) -> dict[str, object]:
        """``POST /v1/completions`` with `body` (the model's name added); its first choice."""
        body = {"model": self.spec.name, **body}
        answer = await self._call(session, "POST", "/v1/completions", body, self._headers())
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise CallFailed("POST /v1/completions answered without a choice")
        return choices[0]

    async def pool(self, session: aiohttp.ClientSession, text: str) -> list[float]:
        """One input through the route of the model's pooling task (`POOLING_ROUTES`): the
        numbers of the answer's first item, flattened (an embedding, class probabilities, one
        row per token). `CallFailed` when they are missing or not numbers."""
        task = self.spec.pooling_task or "pooling"
        if task == "plugin":
            raise CallFailed("a plugin pooling task takes inputs only its plug-in knows")
        path, field = POOLING_ROUTES.get(task, ("/pooling", "data"))
        body = {"model": self.spec.name, "input": text}
        answer = await self._call(session, "POST", path, body, self._headers())
        data = answer.get("data") if isinstance(answer, dict) else None
        item = data[0] if isinstance(data, list) and data else None
        numbers = _flat(item.get(field)) if isinstance(item, dict) else None
        if not numbers:
            raise CallFailed(f"POST {path} answered without {field} for task {task}")
        return numbers

    def engine_alive(self) -> bool:
        """Whether the engine under the guard still has a live (non-zombie) process."""
        if self.proc is None or self._exited.is_set():
            return False
        for pid in _tree(self.proc.pid)[1:]:  # the guard's descendants, no full /proc scan
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    return True
        return False

    def listener_unchanged(self) -> bool:
        """The socket that listens where the engine serves is still the one verified at
        readiness."""
        return bool(self.listener) and self._listeners() == self.listener

    async def stop(self, grace_s: float) -> int | None:
        """SIGTERM to the group, `grace_s`, then SIGKILL; every wait bounded. Idempotent."""
        if self.proc is None or self._exited.is_set():
            return self.exit_code
        self._signal_group(signal.SIGTERM)
        code = await self.wait_exit(grace_s)
        if code is None:
            log.warning("%s: engine did not stop in %.1fs, killing", self.spec.name, grace_s)
            self.kill()
            code = await self.wait_exit(KILL_WAIT_S)
        return code

    def kill(self) -> None:
        """Kill the engine now (synchronous). The guard is asked first (its parent-death
        signal): it SIGKILLs the helpers that left the group, then the group. A guard that
        cannot act (stopped, hung) gets the group SIGKILL a moment later anyway."""
        if self.proc is None or self._exited.is_set():
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.proc.pid, DEATH_SIGNAL)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._signal_group(signal.SIGKILL)
            return
        loop.call_later(GUARD_KILL_S, self._signal_group, signal.SIGKILL)

    def kill_group(self) -> None:
        """SIGKILL the whole group now."""
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, sig: int) -> None:
        if self.proc is None or (sig == signal.SIGKILL and self._exited.is_set()):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


def listening_inodes(port: int) -> frozenset[int]:
    """Socket inodes listening on TCP `port` (any address, IPv4 and IPv6).

    Asks the kernel for listening sockets only (sock_diag netlink), so the cost does not grow
    with the server's connections; falls back to reading /proc/net/tcp{,6}.
    """
    try:
        return frozenset(
            inode
            for family in (socket.AF_INET, socket.AF_INET6)
            for sport, inode in _listeners(family)
            if sport == port
        )
    except (OSError, struct.error):
        return _listening_inodes_proc(port)


_SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, _NLM_F_DUMP = 20, 0x1, 0x300
_NLMSG_DONE, _TCP_LISTEN = 3, 10


def _sock_diag(req: bytes, min_length: int) -> Iterator[tuple[bytes, int, int]]:
    """Every answer of a NETLINK_SOCK_DIAG dump for `req`: (buffer, offset of the message,
    its length); OSError when the kernel refuses or answers oddly."""
    head = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY,
                       _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)  # fmt: skip
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 4) as nl:  # NETLINK_SOCK_DIAG
        nl.settimeout(2.0)
        nl.sendall(head + req)
        while True:
            data = nl.recv(65536)
            if not data:
                return
            offset = 0
            while offset + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, offset)
                if kind == _NLMSG_DONE:
                    return
                if kind != _SOCK_DIAG_BY_FAMILY or length < 16 + min_length:
                    raise OSError("sock_diag refused the request or answered oddly")
                yield data, offset, length
                offset += (length + 3) & ~3


def _listeners(family: int) -> list[tuple[int, int]]:
    """(local port, inode) of every listening TCP socket of `family`, from NETLINK_SOCK_DIAG."""
    # struct inet_diag_req_v2: family, protocol, ext, pad, states, then a zeroed sockid (48 B).
    req = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 0, 1 << _TCP_LISTEN) + bytes(48)
    found: list[tuple[int, int]] = []
    for data, offset, _length in _sock_diag(req, 72):
        msg = offset + 16  # struct inet_diag_msg: sport at +4 (big endian), inode at +68
        sport = struct.unpack_from("!H", data, msg + 4)[0]
        found.append((sport, struct.unpack_from("=I", data, msg + 68)[0]))
    return found


def unix_listening_inodes(path: str) -> frozenset[int]:
    """Inodes of the Unix sockets listening on `path` (the name they were bound to).

    Asks the kernel for listening Unix sockets only (sock_diag netlink, with their names);
    falls back to reading /proc/net/unix."""
    name = os.fsencode(path)
    try:
        return frozenset(inode for inode, bound in _unix_listeners() if bound == name)
    except (OSError, struct.error):
        return _unix_listening_inodes_proc(path)


_UDIAG_SHOW_NAME, _UNIX_DIAG_NAME = 0x1, 0


def _unix_listeners() -> list[tuple[int, bytes]]:
    """(inode, bound name) of every listening Unix socket, from NETLINK_SOCK_DIAG."""
    # struct unix_diag_req: family, protocol, pad, states, ino, show, cookie[2].
    req = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 1 << _TCP_LISTEN, 0, _UDIAG_SHOW_NAME,
                      0, 0)  # fmt: skip
    found: list[tuple[int, bytes]] = []
    for data, offset, length in _sock_diag(req, 16):
        # struct unix_diag_msg (16 B): inode at +4; then attributes (rtattr).
        inode = struct.unpack_from("=I", data, offset + 20)[0]
        attr, end = offset + 32, offset + length
        while attr + 4 <= end:
            size, attr_type = struct.unpack_from("=HH", data, attr)
            if size < 4:
                break
            if attr_type == _UNIX_DIAG_NAME:
                found.append((inode, data[attr + 4 : attr + size].rstrip(b"\0")))
            attr += (size + 3) & ~3
    return found


def _unix_listening_inodes_proc(path: str) -> frozenset[int]:
    # "Num RefCount Protocol Flags Type St Inode Path": flag 00010000 is a listening socket.
    found: set[int] = set()
    try:
        with open("/proc/net/unix") as fh:
            for line in fh:
                fields = line.split(None, 7)
                if len(fields) == 8 and fields[7].rstrip("\n") == path:
                    if int(fields[3], 16) & 0x10000:
                        found.add(int(fields[6]))
    except (OSError, ValueError):
        pass
    return frozenset(found)


def _listening_inodes_proc(port: int) -> frozenset[int]:
    # "sl local_address rem_address st ... inode": the local port, any remote, state 0A (LISTEN).
    pattern = re.compile(
        rf"^\s*\d+: [0-9A-F]+:{port:04X} [0-9A-F]+:0000 0A (?:\S+\s+){{5}}(\d+)", re.M
    )
    found: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                found.update(int(inode) for inode in pattern.findall(fh.read()))
        except OSError:
            continue
    return frozenset(found)


def tree_socket_inodes(pid: int) -> frozenset[int]:
    """Socket inodes held open by `pid` and its descendants."""
    found = set()
    for proc in _tree(pid):
        try:
            fds = os.listdir(f"/proc/{proc}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{proc}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                found.add(int(target[8:-1]))
    return frozenset(found)


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants, from /proc/<pid>/task/*/children (no scan of every process);
    psutil's full scan where the kernel lacks those files."""
    if not _PROC_CHILDREN:
        try:
            return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
        except psutil.Error:
            return []
    out, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        out.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue  # it ended while the tree was walked
        for task in tasks:
            try:
                with open(f"/proc/{current}/task/{task}/children") as fh:
                    frontier.extend(int(c) for c in fh.read().split())
            except OSError:
                continue  # that thread ended
    return out


_PROC_CHILDREN = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def _holders(inodes: frozenset[int]) -> list[int]:
    """Pids holding any of these socket inodes (a full /proc scan: for error reports only)."""
    wanted = {f"socket:[{i}]" for i in inodes}
    pids = []
    for pid in psutil.pids():
        with contextlib.suppress(OSError):
            fd_dir = f"/proc/{pid}/fd"
            if any(os.readlink(f"{fd_dir}/{fd}") in wanted for fd in os.listdir(fd_dir)):
                pids.append(pid)
    return pids


def _cmd(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:200]
    except psutil.Error:
        return "?"
