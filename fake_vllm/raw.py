"""A raw-socket engine: answers every request with exact bytes, for faulty-engine tests.

Run it the way the proxy runs vLLM::

    python -m fake_vllm.raw --port 8001 ...      (or --uds PATH)

``GET /health`` answers 200 with an empty body. Any other request gets the bytes of the file
``FAKE_RAW_ANSWER`` names, read again for every request (a test may change it between
requests) and written as they are; the connection is closed after them when they carry neither
a ``Content-Length`` nor chunking. Every request other than ``/health`` is appended to the file
``FAKE_RAW_LOG`` names as a JSON line: the connection's number (counted from 1), the request
line and the body. Every other flag is accepted and ignored.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
from collections.abc import Sequence

HEALTHY = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


class RawEngine:
    def __init__(self, answer_path: str, log_path: str | None) -> None:
        self.answer_path = answer_path
        self.log_path = log_path
        self._numbers = itertools.count(1)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = next(self._numbers)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                fields = [line.split(":", 1) for line in lines[1:] if ":" in line]
                length = {k.strip().lower(): v.strip() for k, v in fields}.get("content-length")
                body = await reader.readexactly(int(length or "0"))
                if lines[0].startswith("GET /health "):
                    writer.write(HEALTHY)
                    await writer.drain()
                    continue
                self._note(number, lines[0], body)
                with open(self.answer_path, "rb") as fh:  # noqa: ASYNC230 - a small file
                    answer = fh.read()
                writer.write(answer)
                await writer.drain()
                lower = answer.lower()
                if b"content-length" not in lower and b"chunked" not in lower:
                    break
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    def _note(self, connection: int, line: str, body: bytes) -> None:
        if self.log_path is None:
            return
        entry = {"connection": connection, "line": line, "body": body.decode("latin-1")}
        with open(self.log_path, "a") as fh:
            fh.write(json.dumps(entry) + "\n")


def _flag(argv: Sequence[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


async def main(argv: Sequence[str]) -> None:
    engine = RawEngine(os.environ["FAKE_RAW_ANSWER"], os.environ.get("FAKE_RAW_LOG"))
    uds = _flag(argv, "--uds")
    if uds is not None:
        server = await asyncio.start_unix_server(engine.serve, uds)
    else:
        server = await asyncio.start_server(
            engine.serve, "127.0.0.1", int(_flag(argv, "--port") or 8000)
        )
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
