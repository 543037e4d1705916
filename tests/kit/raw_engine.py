"""A raw-socket engine for conformance tests: scripted bytes back, every request head logged.

Run by the proxy as an engine command: ``python raw_engine.py --port P ...`` (vLLM's other
flags are accepted and ignored). ``GET /health`` answers 200. Any other request gets the bytes
of the file named by ``RAW_ENGINE_ANSWER`` (``{port}`` and ``{length}`` markers are not used:
the answer is sent as is), then the connection closes if the answer says so or has no length.
Each request's head and body are appended to ``RAW_ENGINE_LOG`` as JSON lines.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    answer = open(os.environ["RAW_ENGINE_ANSWER"], "rb").read()
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            fields = [line.split(":", 1) for line in lines[1:] if ":" in line]
            headers = {k.strip().lower(): v.strip() for k, v in fields}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            if lines[0].startswith("GET /health"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
                continue
            with open(os.environ["RAW_ENGINE_LOG"], "a") as log:
                entry = {"line": lines[0], "headers": headers, "body": body.decode("latin-1")}
                log.write(json.dumps(entry) + "\n")
            writer.write(answer)
            await writer.drain()
            lower = answer.lower()
            if b"content-length" not in lower and b"chunked" not in lower:
                break
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main() -> None:
    if "--uds" in sys.argv:
        server = await asyncio.start_unix_server(serve, sys.argv[sys.argv.index("--uds") + 1])
    else:
        port = int(sys.argv[sys.argv.index("--port") + 1])
        server = await asyncio.start_server(serve, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
