"""HAProxy's side: its runtime API on the stats socket, and the map file for its next start.

The runtime API gets one command per connection (several in one write can break the pipe on
older versions) and every answer is checked: a map command answers nothing when it worked.
`set map` changes an existing key (HAProxy 2.6 applies it at once); `add map` on an existing
key would add a second entry, so it is used only for new keys; `del map` removes every entry of
a key. The map file is written whole to a temporary file beside it and renamed over it, so
HAProxy never reads half of one.
"""

from __future__ import annotations

import asyncio
import csv
import io
import os
from collections.abc import Mapping
from pathlib import Path

#: Server states in `show stat` that take requests (``UP 1/2``: up, one check failed).
IN_SERVICE = ("UP", "no check")


class HaproxyError(Exception):
    """HAProxy refused a command, or its socket could not be used."""


class RuntimeApi:
    """HAProxy's runtime API on the unix socket at `path`."""

    def __init__(self, path: str, timeout_s: float = 2.0) -> None:
        self.path = path
        self.timeout_s = timeout_s

    async def command(self, line: str) -> str:
        """One command on its own connection; HAProxy's answer (it closes after it)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                reader, writer = await asyncio.open_unix_connection(self.path)
                try:
                    writer.write(line.encode() + b"\n")
                    await writer.drain()
                    raw = await reader.read()
                finally:
                    writer.close()
        except (OSError, TimeoutError) as err:
            raise HaproxyError(f"HAProxy runtime API at {self.path}: {err!r}") from None
        return raw.decode(errors="replace")

    async def _change(self, line: str, *, ok: tuple[str, ...] = ()) -> str:
        answer = (await self.command(line)).strip()
        if answer and answer not in ok:
            raise HaproxyError(f"HAProxy refused {line!r}: {answer}")
        return answer

    async def show_map(self, map_path: str) -> dict[str, list[str]]:
        """Each key of the map and its values (more than one: duplicated entries)."""
        answer = await self.command(f"show map {map_path}")
        out: dict[str, list[str]] = {}
        for line in answer.splitlines():
            parts = line.split(" ", 2)
            if len(parts) != 3 or not parts[0].startswith("0x"):
                if line.strip():
                    raise HaproxyError(f"HAProxy: show map {map_path}: {line.strip()}")
                continue
            out.setdefault(parts[1], []).append(parts[2])
        return out

    async def server_status(self, backend: str) -> dict[str, str]:
        """Each server of `backend` and its status (``UP``, ``DOWN``, ``DRAIN``, ``MAINT``...)."""
        answer = await self.command("show stat")
        if not answer.startswith("# "):
            raise HaproxyError(f"HAProxy: show stat: {answer.strip()[:200]}")
        rows = csv.DictReader(io.StringIO(answer[2:]))
        return {
            r["svname"]: r["status"]
            for r in rows
            if r["pxname"] == backend and r["svname"] not in ("FRONTEND", "BACKEND")
        }

    async def apply(self, map_path: str, wanted: Mapping[str, str]) -> list[str]:
        """Make the map hold exactly `wanted`; the commands that changed it."""
        current = await self.show_map(map_path)
        done = []
        for key in sorted(set(current) - set(wanted)):
            await self._change(f"del map {map_path} {key}", ok=("Key not found.",))
            done.append(f"del {key}")
        for key, value in sorted(wanted.items()):
            have = current.get(key)
            if have == [value]:
                continue
            if have is not None and len(have) > 1:  # one entry per key, or the first one wins
                await self._change(f"del map {map_path} {key}", ok=("Key not found.",))
                have = None
            if have is not None:
                answer = await self._change(
                    f"set map {map_path} {key} {value}", ok=("entry not found.",)
                )
                if not answer:
                    done.append(f"set {key} {value}")
                    continue
            await self._change(f"add map {map_path} {key} {value}")
            done.append(f"add {key} {value}")
        return done


def render_map(entries: Mapping[str, str]) -> str:
    lines = ["# vllm-proxy-fleet: model -> HAProxy server (written at every change)"]
    lines += [f"{key} {value}" for key, value in sorted(entries.items())]
    return "\n".join(lines) + "\n"


def read_map(path: Path) -> dict[str, str]:
    """A map file's entries (the first of a duplicated key, as HAProxy takes it)."""
    out: dict[str, str] = {}
    try:
        text = path.read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition(" ")
        out.setdefault(key, value.strip())
    return out


def write_map(path: Path, entries: Mapping[str, str]) -> bool:
    """Write the map file atomically (temporary file, fsync, rename, fsync the folder); False
    when it already holds exactly this."""
    text = render_map(entries)
    try:
        if path.read_text() == text:
            return False
    except FileNotFoundError:
        pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    return True
