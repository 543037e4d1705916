"""HAProxy's side: its runtime API on the stats socket, and the map file for its next start.

A round's changes go to the runtime API on one connection in interactive mode (``prompt``: each
answer ends with a ``> `` prompt, so answers are told apart), written in batches and every
answer checked: a map command answers nothing when it worked (a connection per command made a
large map take many rounds: docs/reliability.md). `set map` changes an existing key (HAProxy
2.6 applies it at once); `add map` on an existing key would add a second entry, so it is used
only for new keys; `del map` removes every entry of a key. The map file is written whole to a
temporary file beside it and renamed over it, so HAProxy never reads half of one.
"""

from __future__ import annotations

import asyncio
import csv
import io
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

#: Server states in `show stat` that take requests (``UP 1/2``: up, one check failed).
IN_SERVICE = ("UP", "no check")


#: Commands written before their answers are read, on one connection.
BATCH = 200
#: How much one answer may hold (`show map` of a large map, `show stat`).
ANSWER_LIMIT = 256 * 1024 * 1024
PROMPT = b"\n> "


class HaproxyError(Exception):
    """HAProxy refused a command, or its socket could not be used."""


class Cli:
    """One connection to the runtime API in interactive mode (see `RuntimeApi.session`)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def _answer(self) -> str:
        raw = await self.reader.readuntil(PROMPT)
        return raw[: -len(PROMPT)].decode(errors="replace")

    async def batch(self, lines: Sequence[str]) -> list[str]:
        """Each command's answer, in order; commands are written `BATCH` at a time."""
        out: list[str] = []
        for start in range(0, len(lines), BATCH):
            chunk = lines[start : start + BATCH]
            self.writer.write("".join(f"{line}\n" for line in chunk).encode())
            await self.writer.drain()
            for _ in chunk:
                out.append(await self._answer())
        return out

    async def command(self, line: str) -> str:
        return (await self.batch([line]))[0]


class RuntimeApi:
    """HAProxy's runtime API on the unix socket at `path`."""

    def __init__(self, path: str, timeout_s: float = 2.0, session_timeout_s: float = 30.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.session_timeout_s = max(session_timeout_s, timeout_s)

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

    @asynccontextmanager
    async def session(self) -> AsyncIterator[Cli]:
        """One connection in interactive mode for many commands, all of them bounded by
        `session_timeout_s` (a first round that adds 20 000 names takes about a second)."""
        try:
            async with asyncio.timeout(self.session_timeout_s):
                reader, writer = await asyncio.open_unix_connection(self.path, limit=ANSWER_LIMIT)
                try:
                    cli = Cli(reader, writer)
                    writer.write(b"prompt\n")
                    await cli._answer()
                    yield cli
                    writer.write(b"quit\n")
                finally:
                    writer.close()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ValueError) as err:  # fmt: skip
            raise HaproxyError(f"HAProxy runtime API at {self.path}: {err!r}") from None

    async def _change(self, line: str, *, ok: tuple[str, ...] = ()) -> str:
        answer = (await self.command(line)).strip()
        if answer and answer not in ok:
            raise HaproxyError(f"HAProxy refused {line!r}: {answer}")
        return answer

    async def show_map(self, map_path: str) -> dict[str, list[str]]:
        """Each key of the map and its values (more than one: duplicated entries)."""
        return _parse_map(map_path, await self.command(f"show map {map_path}"))

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
        """Make the map hold exactly `wanted`, on one connection; the commands that changed
        it."""
        async with self.session() as cli:
            current = _parse_map(map_path, await cli.command(f"show map {map_path}"))
            dels, sets, adds = [], [], []
            for key in sorted(set(current) - set(wanted)):
                dels.append(key)
            for key, value in sorted(wanted.items()):
                have = current.get(key)
                if have == [value]:
                    continue
                if have is not None and len(have) > 1:  # one entry per key, or the first wins
                    dels.append(key)
                    adds.append(key)
                elif have is not None:
                    sets.append(key)
                else:
                    adds.append(key)
            done = [f"del {key}" for key in dels if key not in wanted]
            await self._batch(cli, [f"del map {map_path} {k}" for k in dels], ("Key not found.",))
            answers = await self._batch(
                cli, [f"set map {map_path} {k} {wanted[k]}" for k in sets], ("entry not found.",)
            )
            for key, answer in zip(sets, answers, strict=True):
                if answer:  # gone meanwhile: added below
                    adds.append(key)
                else:
                    done.append(f"set {key} {wanted[key]}")
            adds.sort()
            await self._batch(cli, [f"add map {map_path} {k} {wanted[k]}" for k in adds], ())
            done += [f"add {key} {wanted[key]}" for key in adds]
        return done

    @staticmethod
    async def _batch(cli: Cli, lines: list[str], ok: tuple[str, ...]) -> list[str]:
        answers = [a.strip() for a in await cli.batch(lines)]
        for line, answer in zip(lines, answers, strict=True):
            if answer and answer not in ok:
                raise HaproxyError(f"HAProxy refused {line[:200]!r}: {answer[:200]}")
        return answers


def _parse_map(map_path: str, answer: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in answer.splitlines():
        parts = line.split(" ", 2)
        if len(parts) != 3 or not parts[0].startswith("0x"):
            if line.strip():
                raise HaproxyError(f"HAProxy: show map {map_path}: {line.strip()}")
            continue
        out.setdefault(parts[1], []).append(parts[2])
    return out


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
