"""Multipart form uploads (audio transcription's shape): fields, a form, the uploads the fake
engine received, and the proxy's peak RSS while one passes."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import aiohttp

BOUNDARY = "vllm-proxy-test-boundary"


FORM = f"multipart/form-data; boundary={BOUNDARY}"


AUDIO = bytes(range(256)) * 256  # 64 KiB, no CRLF-dashes in it


def uploads(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "uploads.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def field(name: str, value: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    head = f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n"
    if filename:
        head += "Content-Type: audio/wav\r\n"
    return head.encode() + b"\r\n" + value + b"\r\n"


def form(*fields: bytes) -> bytes:
    return b"".join(fields) + f"--{BOUNDARY}--\r\n".encode()


def _peak_rss_reset() -> None:
    """Start the peak-RSS count (VmHWM) anew from the current RSS (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        found = re.search(r"VmHWM:\s+(\d+) kB", f.read())
    assert found is not None
    return int(found.group(1)) * 1024


async def receive(ws: aiohttp.ClientWebSocketResponse) -> dict[str, Any]:
    msg = await asyncio.wait_for(ws.receive(), 10)
    assert msg.type == aiohttp.WSMsgType.TEXT, msg
    return json.loads(msg.data)  # type: ignore[no-any-return]
