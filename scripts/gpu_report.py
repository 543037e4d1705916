"""Turn one GPU check's results into the dated section of docs/gpu.md (run by gpu-check.sh).

Reads, from the results folder: ``smi.csv`` (``nvidia-smi --query-gpu=name,memory.total,
driver_version --format=csv,noheader``), ``torch.txt`` (torch's version, its CUDA and the
device it sees), ``junit.xml`` (pytest's outcome per test), ``measure.json`` (what the
measurement test read, `tests/kit/gpumeasure.py`) and ``cumem.json`` (the real allocator
check, `scripts/gpu_cumem_check.py`). Writes the section between `BEGIN` and
`END` in the document (replacing an earlier run's), and prints the outcome line.

    python scripts/gpu_report.py RESULTS_DIR DOC --rc N --seconds S --command TEXT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BEGIN = "<!-- gpu-check results: begin (written by scripts/gpu-check.sh) -->"
END = "<!-- gpu-check results: end -->"


@dataclass(frozen=True)
class Outcome:
    """One test as pytest's JUnit report tells it."""

    name: str
    outcome: str  # passed, failed, error, skipped
    seconds: float
    message: str


def read_junit(text: str) -> list[Outcome]:
    out = []
    for case in ET.fromstring(text).iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = "failed" if kind == "failure" else kind
                message = node.get("message") or (node.text or "")
                break
        first = message.strip().splitlines()[0] if message.strip() else ""
        seconds = float(case.get("time") or 0)
        out.append(Outcome(case.get("name", "?"), outcome, seconds, first[:200]))
    return out


def verdict(outcomes: list[Outcome], rc: int) -> str:
    """passed / failed / skipped (nothing ran) / timed out, for the whole run."""
    if rc in (124, 137):
        return "timed out"
    if any(o.outcome in ("failed", "error") for o in outcomes) or rc not in (0, 5):
        return "failed"
    if not any(o.outcome == "passed" for o in outcomes):
        return "skipped"
    return "passed"


def _cell(value: Any, digits: int = 0) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def readings_table(measure: dict[str, Any]) -> list[str]:
    """One row per step; device and host figures relative to the first where that helps."""
    rows = measure.get("readings") or []
    if not rows:
        return ["No measurement was written (the measurement test did not run or failed early)."]
    before = measure.get("engine", {}).get("device_used_before_mb")
    rss0 = rows[0].get("rss_mb")
    avail0 = rows[0].get("mem_available_mb")
    lines = [
        "| step | took (s) | device used, + since before start (MiB) | NVML, engine's processes "
        "(MiB) | engine holds (MiB) | host RSS, engine tree (MiB) | + RSS since ready (MiB) "
        "| pinned by torch: held / in use (MiB) | VmPin / VmLck (kB) | RssShmem, engine tree "
        "(kB) | Shmem, host (kB) | cgroup shmem (MiB) | - MemAvailable since ready (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        used = r.get("device_used_mb")
        grown = None if used is None or before is None else used - before
        rss = r.get("rss_mb")
        avail = r.get("mem_available_mb")
        pinned = f"{_cell(r.get('pinned_mb'))} / {_cell(r.get('pinned_in_use_mb'))}"
        locked = f"{_cell(r.get('vm_pin_kb'))} / {_cell(r.get('vm_lck_kb'))}"
        cells = [
            r.get("step", "?"),
            _cell(r.get("seconds"), 2),
            f"{_cell(used)} (+{_cell(grown)})",
            _cell(r.get("nvml_process_mb")),
            _cell(r.get("engine_gpu_mb")),
            _cell(rss),
            _cell(None if rss is None or rss0 is None else rss - rss0),
            pinned,
            locked,
            _cell(r.get("rss_shmem_kb")),
            _cell(r.get("shmem_kb")),
            _cell(r.get("cgroup_shmem_mb"), 1),
            _cell(None if avail is None or avail0 is None else avail0 - avail),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def cumem_lines(cumem: dict[str, Any]) -> list[str]:
    """The real allocator check's figures (`scripts/gpu_cumem_check.py`), one row a step."""
    steps = cumem.get("steps") or []
    if not steps:
        return ["The allocator check wrote no figures (see gpu-check-results/cumem.log)."]
    sizes = cumem.get("allocation_sizes") or []
    lines = [
        f"The allocator check (vLLM 0.33's CuMem allocator, torch {cumem.get('torch')},"
        f" `{cumem.get('alloc_conf')}`): {len(sizes)} allocations in the `weights` pool for"
        f" {_mib(cumem.get('tensor_bytes'))} MiB of tensors (vocabulary {cumem.get('vocab')},"
        f" `[1024, vocab]` int32 included), {_mib(sum(sizes))} MiB allocated; as power-of-two"
        f" blocks {_mib(cumem.get('pow2_blocks_bytes'))} MiB; contents survived two sleeps:"
        f" {cumem.get('contents_survived')}.",
        "",
        "| step | took (s) | on the device (MiB) | pinned held by torch (MiB) | RssShmem (kB) "
        "| RssAnon (kB) | VmPin (kB) | Shmem, host (kB) | cgroup shmem (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in steps:
        shmem = r.get("cgroup_shmem")
        cells = [r.get("step", "?"), _cell(r.get("seconds"), 2), _mib(r.get("allocated_bytes")),
                 _mib(r.get("pinned_held_bytes")), _cell(r.get("rss_shmem_kb")),
                 _cell(r.get("rss_anon_kb")), _cell(r.get("vm_pin_kb")),
                 _cell(r.get("shmem_kb")), _mib(shmem)]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def _mib(value: Any) -> str:
    return "n/a" if value is None else f"{int(value) / 1048576:.0f}"


def engine_line(measure: dict[str, Any]) -> str:
    e = measure.get("engine") or {}
    if not e:
        return ""
    return (
        f"The measured engine: `FAKE_ENGINE_GPU_MB={e.get('mb')}`: weights {e.get('weights_mb')} "
        f"MiB in {e.get('weights_tensors')} tensors (as pinned power-of-two blocks: "
        f"{_cell(e.get('weights_pinned_blocks_mb'))} MiB), KV cache {e.get('kv_cache_mb')} MiB, "
        f"runtime pool {e.get('runtime_mb')} MiB (pinned block "
        f"{_cell(e.get('runtime_pinned_blocks_mb'))} MiB), activation peak {e.get('peak_mb')} "
        f"MiB; device 0 used {e.get('device_used_before_mb')} MiB before it started."
    )


def render(
    smi: str, torch_info: str, outcomes: list[Outcome], measure: dict[str, Any], rc: int,
    seconds: float, command: str, cumem: dict[str, Any] | None = None,
) -> str:  # fmt: skip
    """The dated section, markers included."""
    date = measure.get("date") or time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    device = measure.get("device") or {}
    result = verdict(outcomes, rc)
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.outcome] = counts.get(o.outcome, 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no test reported"
    lines = [
        BEGIN,
        "",
        f"### Last run: {result} ({date})",
        "",
        "| | |",
        "|---|---|",
        f"| device (nvidia-smi: name, memory, driver) | {smi.strip() or 'n/a'} |",
        f"| torch | {torch_info.strip() or 'n/a'} |",
        f"| command | `{command}` |",
        f"| result | {result}: {summary}; pytest exit status {rc}; {seconds:.0f} s in all |",
        "",
        "| test | outcome | time (s) | message |",
        "|---|---|---|---|",
    ]
    for o in outcomes:
        message = o.message.replace("|", "\\|")
        lines.append(f"| `{o.name}` | {o.outcome} | {o.seconds:.1f} | {message} |")
    if device:
        nvml = f"{device.get('name')}, {device.get('memory_mb')} MiB, driver {device.get('driver')}"
        lines.insert(lines.index("| | |") + 3, f"| device (NVML, as measured) | {nvml} |")
    if result == "skipped":
        lines += ["", "Nothing was measured: every test was skipped."]
    else:
        lines += ["", engine_line(measure), "", *readings_table(measure)]
    if cumem is not None:
        lines += ["", *cumem_lines(cumem)]
    return "\n".join([*lines, "", END]) + "\n"


def replace_section(doc: str, section: str) -> str:
    """The document with `section` between the markers (in place of an earlier one), or
    appended where the markers are missing."""
    start, end = doc.find(BEGIN), doc.find(END)
    if start == -1 or end == -1 or end < start:
        return doc.rstrip("\n") + "\n\n" + section
    return doc[:start] + section.rstrip("\n") + doc[end + len(END) :]


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("doc", type=Path)
    parser.add_argument("--rc", type=int, required=True, help="pytest's exit status")
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--command", default="sh scripts/gpu-check.sh")
    args = parser.parse_args(argv)
    junit = _read(args.results / "junit.xml")
    try:
        outcomes = read_junit(junit) if junit else []
    except ET.ParseError:
        outcomes = []
    try:
        measure = json.loads(_read(args.results / "measure.json") or "{}")
    except ValueError:
        measure = {}
    try:
        cumem = json.loads(_read(args.results / "cumem.json") or "{}")
    except ValueError:
        cumem = {}
    section = render(
        _read(args.results / "smi.csv"), _read(args.results / "torch.txt"), outcomes, measure,
        args.rc, args.seconds, args.command, cumem,
    )  # fmt: skip
    (args.results / "section.md").write_text(section)
    args.doc.write_text(replace_section(_read(args.doc), section))
    result = verdict(outcomes, args.rc)
    (args.results / "verdict").write_text(result + "\n")
    print(f"gpu-check: {result}; results written into {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
