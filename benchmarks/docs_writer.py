"""The one writer of the report, docs/benchmarks.md: each script replaces its own sections and
leaves every other one as it is.

The report is a preamble and ``## `` sections. `run.py` writes the preamble and its own
sections (`put_report`); every other script owns the sections named in `OTHER_SECTIONS`
(`put_sections`, or `put_part` for one ``### `` part of a section). A section new to the file
goes before the side-by-side section, which stays last, or else at the end.
"""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
SIDE_BY_SIDE = "## Side by side with an earlier revision"

#: The sections other scripts write, in the order the report keeps them after run.py's own.
OTHER_SECTIONS = {
    "## Sleep and wake: time to first token": "sleep.py",
    "## Replicas: throughput with 1, 2 and 4 engines of one model": "replicas.py",
    "## Stream capacity": "streams.py",
    "## Large request bodies": "streams.py",
    "## Density: many models on one GPU": "density.py",
    "## LoRA adapter switch": "lora_switch.py",
    "## Cold start": "coldstart.py",
    "## Several servers: placement across a fleet": "fleet.py",
    SIDE_BY_SIDE: "compare_revisions.py",
}


def split(text: str, level: str = "## ") -> tuple[str, dict[str, str]]:
    """The text before the first heading of `level`, and each such block by its heading line
    (the block keeps that line; blank lines at either end are dropped)."""
    head, *rest = ("\n" + text).split("\n" + level)
    blocks: dict[str, str] = {}
    for raw in rest:
        block = (level + raw).strip("\n")
        blocks[block.split("\n", 1)[0]] = block
    return head.strip("\n"), blocks


def join(head: str, blocks: dict[str, str]) -> str:
    """`split` undone: the parts one blank line apart, one newline at the end."""
    return "\n\n".join(p for p in (head, *blocks.values()) if p) + "\n"


def _place(blocks: dict[str, str], new: dict[str, str]) -> dict[str, str]:
    """`blocks` with each of `new` in the place of its namesake, or else before the
    side-by-side section (the side-by-side section itself: at the end)."""
    out = dict(blocks)
    for heading, block in new.items():
        if heading in out:
            out[heading] = block
        elif SIDE_BY_SIDE in out and heading != SIDE_BY_SIDE:
            items = list(out.items())
            at = list(out).index(SIDE_BY_SIDE)
            out = dict([*items[:at], (heading, block), *items[at:]])
        else:
            out[heading] = block
    return out


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def put_sections(path: Path, text: str) -> None:
    """Write the ``## `` sections of `text` into the report at `path`, each in the place of its
    namesake or, new, before the side-by-side section; nothing else of the file changes."""
    extra, new = split(text)
    if extra or not new:
        raise ValueError("the text must be one or more whole '## ' sections")
    head, blocks = split(_read(path))
    path.write_text(join(head, _place(blocks, new)))


def put_part(path: Path, section: str, intro: str, part: str) -> None:
    """Write `part` (a ``### `` block) into the section `section` of the report at `path`: in
    place of the part of that heading, or after the others; a new section gets `intro` first."""
    old = split(_read(path))[1].get(section, section + "\n\n" + intro)
    head, parts = split(old, "### ")
    _, new = split(part, "### ")
    put_sections(path, join(head, _place(parts, new)))


def put_report(path: Path, text: str) -> None:
    """Write run.py's report `text` (the preamble and its sections) to `path`, followed by the
    sections other scripts wrote there, in the order of `OTHER_SECTIONS`."""
    old = split(_read(path))[1]
    head, mine = split(text)
    kept = {h: old[h] for h in OTHER_SECTIONS if h in old and h not in mine}
    path.write_text(join(head, {**mine, **kept}))
