"""Process lifecycle: binding, the port-race marker, the EngineCore child, signals, serve, main."""

import asyncio
import errno
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, NoReturn

from aiohttp import web

from .gpu import MIB, DeviceMemory, GpuError, GpuMemory
from .log import log
from .server import FakeServer
from .settings import KEEPALIVE_TIMEOUT, SHUTDOWN_GRACE, VERSION, Settings, load_settings
from .simengine import SimGpu, SimStartError


def _uvicorn(message: str) -> None:
    print(f"INFO:     {message}", flush=True)


def _display_host(settings: Settings) -> str:
    return settings.host or "0.0.0.0"


def _listen_address(settings: Settings) -> str:
    """What vLLM logs it serves on: ``unix:PATH`` or ``http://HOST:PORT``."""
    if settings.uds:
        return f"unix:{settings.uds}"
    return f"http://{_display_host(settings)}:{settings.port}"


def _set_title(title: str) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(title)
        return
    except ImportError:
        pass
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(title[:15])
    except OSError:
        pass


def _engine_core_main() -> NoReturn:
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _set_title("VLLM::EngineCore")
        while True:
            time.sleep(3600)
    finally:
        os._exit(0)


def _spawn_engine_core() -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _engine_core_main()
    log(f"EngineCore pid={pid}")
    return pid


def _bind(settings: Settings) -> socket.socket:
    if settings.uds:  # as vLLM: an existing file at the path fails the bind (Errno 98)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(settings.uds)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        return sock
    host = _display_host(settings)
    infos = socket.getaddrinfo(
        host, settings.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def _claim_port_race_marker(path: str) -> bool:
    """True the first time ``path`` is seen (the file is created atomically)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True


def _listening_socket(settings: Settings) -> socket.socket | None:
    try:
        marker = settings.port_in_use_once
        if marker and _claim_port_race_marker(marker):
            raise OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE))
        return _bind(settings)
    except OSError as exc:
        url = _listen_address(settings)
        log(f"Failed to bind the API server socket on {url}", "ERROR", sys.stderr)
        print(f"OSError: {exc}", file=sys.stderr, flush=True)
        return None


def _log_banner(settings: Settings) -> None:
    log(f"vLLM server version {VERSION}, serving model {settings.model}")
    names = list(settings.served_names)
    sleep = ", 'enable_sleep_mode': True" if settings.enable_sleep_mode else ""
    args = f"'model': {settings.model!r}, 'served_model_name': {names!r}{sleep}"
    log(f"non-default args: {{{args}}}")
    if settings.dev_mode:
        warning = "Development endpoints are enabled! This should NOT be used in production!"
        log(f"SECURITY WARNING: {warning}", "WARNING")
    log(f"Using max model len {settings.max_model_len}")


def _load_gpu(settings: Settings) -> GpuMemory | None:
    """Hold ``FAKE_ENGINE_GPU_MB`` of device memory (None when off or when it cannot be had)."""
    try:
        gpu = GpuMemory(settings.gpu_mb, settings.gpu_device)
    except GpuError as exc:
        print(f"fake_vllm: error: FAKE_ENGINE_GPU_MB={settings.gpu_mb}: {exc}", file=sys.stderr)
        sys.stderr.flush()
        return None
    gib = gpu.held_bytes() / (1024 * MIB)
    log(f"Model loading took {gib:.4f} GiB memory on {gpu.device} (fake weights and KV cache)")
    return gpu


def _report_start_failure(exc: SimStartError) -> None:
    """vLLM's root cause, then the line its API server prints when the engine core died."""
    log("EngineCore failed to start.", "ERROR", sys.stderr)
    print(str(exc), file=sys.stderr)
    message = "RuntimeError: Engine core initialization failed. See root cause above."
    print(f"{message} Failed core proc(s): {{}}", file=sys.stderr, flush=True)


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM before serving: unwind (so simulated memory is given back) like Ctrl-C."""
    raise KeyboardInterrupt


async def serve(settings: Settings, sock: socket.socket, gpu: DeviceMemory | None = None) -> int:
    """Serve on the bound socket until SIGTERM/SIGINT, then abort requests and return 0."""
    server = FakeServer(settings, gpu)
    runner = web.AppRunner(
        server.build_app(),
        access_log=None,
        keepalive_timeout=KEEPALIVE_TIMEOUT,
        shutdown_timeout=SHUTDOWN_GRACE,
    )
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    if not settings.ignore_sigterm:
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    await web.SockSite(runner, sock, backlog=2048).start()
    log("Supported tasks: ['generate', 'embed']")
    log(f"Starting vLLM server on {_listen_address(settings)}")
    _uvicorn(f"Started server process [{os.getpid()}]")
    _uvicorn("Waiting for application startup.")
    _uvicorn("Application startup complete.")
    await stop.wait()
    log("[shutdown] API server: shutdown triggered (mode=abort)")
    _uvicorn("Shutting down")
    server.engine.shutdown()
    await server.engine.wait_drained(SHUTDOWN_GRACE)
    await runner.cleanup()
    _uvicorn("Waiting for application shutdown.")
    _uvicorn("Application shutdown complete.")
    _uvicorn(f"Finished server process [{os.getpid()}]")
    return 0


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def _run(coro: Coroutine[Any, Any, int]) -> int:
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    """Start the fake engine; returns the process exit status."""
    try:
        settings = load_settings(sys.argv[1:] if argv is None else argv, os.environ)
    except ValueError as exc:
        print(f"fake_vllm: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if settings.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif settings.sim is not None:
        signal.signal(signal.SIGTERM, _interrupt)
    _log_banner(settings)
    core = _spawn_engine_core() if settings.spawn_child else None
    sim = None
    try:
        if settings.startup_delay > 0:
            time.sleep(settings.startup_delay)
        if settings.exit_code is not None:
            log("EngineCore failed to start.", "ERROR", sys.stderr)
            message = (
                "RuntimeError: Engine core initialization failed (fake). See root cause above."
            )
            print(f"{message} Failed core proc(s): {{}}", file=sys.stderr, flush=True)
            return settings.exit_code
        gpu: DeviceMemory | None = None
        if settings.sim is not None:
            try:
                gpu = sim = SimGpu(settings, core or os.getpid())
                sim.start()
            except SimStartError as exc:
                _report_start_failure(exc)
                return 1
        elif settings.gpu_mb:
            gpu = _load_gpu(settings)
            if gpu is None:
                return 1
        sock = _listening_socket(settings)
        if sock is None:
            return 1
        return _run(serve(settings, sock, gpu))
    except KeyboardInterrupt:
        return 130
    finally:
        if sim is not None:
            sim.release()
