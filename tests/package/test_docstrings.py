"""Module docstrings say what a module does and why; measured figures live in docs/benchmarks.md.

A figure in a docstring goes stale the day the code or the machine changes, and nothing re-measures
it there. This check catches the usual shapes of one: a duration in ms or µs, a share ("14 % of
the time"), or "took" before a number.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("vllm_proxy", "fake_vllm", "tiny_llama", "vllm_proxy_demo")
FIGURE = re.compile(
    r"\d+(?:\.\d+)?(?:\s?-\s?\d+(?:\.\d+)?)?\s?(?:ms|us|µs)\b"  # 12 ms, 2.5-3.5 ms, 4.6 us
    r"|\d+(?:\.\d+)?(?:\s?-\s?\d+(?:\.\d+)?)?\s?% of\b"  # 14-25 % of the proxy's time
    r"|\btook\b[^.]*\d"  # "took 7 s", "took 12 ms of the proxy's time"
)


def module_docstrings() -> list[tuple[str, str]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text()))
            if doc:
                found.append((str(path.relative_to(ROOT)), doc))
    return found


DOCSTRINGS = module_docstrings()


@pytest.mark.parametrize(("path", "doc"), DOCSTRINGS, ids=[path for path, _ in DOCSTRINGS])
def test_no_module_docstring_carries_a_measured_figure(path: str, doc: str) -> None:
    hits = [m.group(0) for m in FIGURE.finditer(doc)]
    assert not hits, f"{path}: measured figures belong in docs/benchmarks.md: {hits}"


def test_the_check_catches_the_shapes_it_names() -> None:
    for text in ("took 12 ms", "about 4.6 us against 0.8 us", "14-25 % of the time", "took 7 s"):
        assert FIGURE.search(text), text
    for text in ("up to 256 KiB each", "4 s at least", "vLLM 0.33", '70 % "weights"'):
        assert not FIGURE.search(text), text
