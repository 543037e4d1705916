"""`RawEngine`: a loopback HTTP/1.1 server that answers with scripted bytes; and the script of an
engine command that does the same as a process of its own (`RAW_ENGINE_SCRIPT`)."""

from __future__ import annotations

import asyncio
from pathlib import Path


class RawEngine:
    """Answers each request with the next scripted bytes, and counts requests and connections.

    An answer of None reads the request, then closes the connection without answering. A
    connection ends after an answer that says ``Connection: close`` or has no length. `idle()`
    waits until every connection the engine accepted has been handled to its end.
    """

    def __init__(self, *answers: bytes | None) -> None:
        self.answers = list(answers)
        self.requests = 0
        self.connections = 0
        self.port = 0
        self.server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> RawEngine:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def idle(self, timeout: float = 5) -> None:
        """Every accepted connection handled to its end (its request read, its socket closed)."""
        if self._handlers:
            await asyncio.wait_for(asyncio.gather(*self._handlers), timeout)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self.connections += 1
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                self.requests += 1
                answer = self.answers.pop(0)
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
                lower = answer.lower()
                if b"connection: close" in lower or (
                    b"content-length" not in lower and b"chunked" not in lower
                ):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


#: The engine command's script that answers every request with a file's bytes as they are.
RAW_ENGINE_SCRIPT = Path(__file__).with_name("raw_engine.py")
