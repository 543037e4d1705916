"""The proxy's own accept loop (`connection.Listener`): the listen queue is drained at once."""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop
from kit import wait_for

from vllm_proxy.frontend.bytes import connection
from vllm_proxy.frontend.bytes.connection import Listener, listen


class Counting(asyncio.Protocol):
    made: list[Counting] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        Counting.made.append(self)

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _reset() -> None:
    Counting.made = []


#: The proxy runs on uvloop; each test runs on it and on asyncio's own loop.
LOOPS = pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
Run = Callable[[Coroutine[Any, Any, None]], None]


def connect(port: int, n: int) -> list[socket.socket]:
    """`n` connections whose handshake the kernel completes; they wait in the listen queue."""
    out = []
    for _ in range(n):
        s = socket.socket()
        try:
            s.connect(("127.0.0.1", port))
        except OSError:
            s.close()
            raise
        out.append(s)
    return out


async def echo(client: socket.socket, data: bytes) -> bytes:
    client.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(client, data)
    return await asyncio.wait_for(loop.sock_recv(client, 64), 5)


@LOOPS
def test_every_queued_connection_is_accepted_in_one_wake_up(run: Run) -> None:
    run(every_queued_connection_is_accepted_in_one_wake_up())


async def every_queued_connection_is_accepted_in_one_wake_up() -> None:
    (sock,) = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    listener = Listener(asyncio.get_running_loop(), [sock], Counting)
    clients = connect(port, 50)
    listener._accept(sock, sock.family)  # one readiness callback, as the loop would make it
    with pytest.raises(BlockingIOError):
        sock.accept()  # nothing left in the queue
    await wait_for(lambda: len(Counting.made) == 50, what="50 connections set up")
    assert await echo(clients[-1], b"ping") == b"ping"
    listener.close()
    for c in clients:
        c.close()


class Exhausted(socket.socket):
    """A listening socket whose accept fails with EMFILE while `full` is set."""

    full = True
    attempts = 0

    def _accept(self) -> tuple[int, Any]:
        Exhausted.attempts += 1
        if Exhausted.full:
            raise OSError(errno.EMFILE, "Too many open files")
        return super()._accept()  # type: ignore[misc]


@LOOPS
def test_out_of_descriptors_pauses_accepting_instead_of_spinning(
    run: Run, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(connection, "ACCEPT_RETRY_S", 0.05)
    Exhausted.full, Exhausted.attempts = True, 0
    run(out_of_descriptors_pauses_accepting_instead_of_spinning())
    assert "cannot accept connections: Too many open files" in caplog.text


async def out_of_descriptors_pauses_accepting_instead_of_spinning() -> None:
    sock = Exhausted(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    listener = Listener(asyncio.get_running_loop(), [sock], Counting)
    client = connect(sock.getsockname()[1], 1)[0]
    # The socket stays readable while the queue is full: each try must be followed by a pause,
    # not by another accept (a level-triggered reader would otherwise spin).
    await wait_for(lambda: Exhausted.attempts >= 3, what="accept retried after the pause")
    assert Exhausted.attempts <= 4
    Exhausted.full = False
    await wait_for(lambda: len(Counting.made) == 1, what="accepted once descriptors are back")
    listener.close()
    client.close()


@LOOPS
def test_a_closed_listener_accepts_nothing_and_keeps_open_connections(run: Run) -> None:
    run(a_closed_listener_accepts_nothing_and_keeps_open_connections())


async def a_closed_listener_accepts_nothing_and_keeps_open_connections() -> None:
    (sock,) = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    listener = Listener(asyncio.get_running_loop(), [sock], Counting)
    (client,) = connect(port, 1)
    await wait_for(lambda: len(Counting.made) == 1, what="connection set up")
    listener.close()
    await listener.wait_closed()
    assert not listener.is_serving() and sock.fileno() == -1
    with pytest.raises(ConnectionRefusedError):
        connect(port, 1)
    assert await echo(client, b"still here") == b"still here"
    client.close()
