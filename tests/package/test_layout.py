"""The test tree mirrors the package: a folder of module tests for each layer, end-to-end tests
by behaviour, the tiers that need more than Python (real vLLM, HAProxy, a GPU, a browser) in
folders of their own, and the helpers every test shares in `kit`.

- `shared/`, `planning/`, `engines/`, `pool/`, `frontend/`, `fleet/`: a layer's module tests; each
  file imports the layer it tests.
- `behaviour/<topic>/`: the proxy as a client, an operator or an engine sees it (fake engines as
  real processes), one folder per topic.
- `realvllm/`, `cluster/`, `gpu/`, `simgpu/`, `browser/`: the tiers.
- `bench/` (the benchmarks' own tests), `ops/` (deployment artefacts, the demo), `fake_engine/`
  (the fake engine alone), `package/` (checks on the whole package: imports, docstrings, this).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
PACKAGE = TESTS.parent / "vllm_proxy"
#: Test folder -> the modules of the package its files test (dotted prefixes).
LAYERS = {
    "shared": ("vllm_proxy.config", "vllm_proxy.names", "vllm_proxy.metrics",
               "vllm_proxy.engine_args", "vllm_proxy.errors", "vllm_proxy.adapters"),
    "planning": ("vllm_proxy.planning",),
    "engines": ("vllm_proxy.engines",),
    "pool": ("vllm_proxy.pool",),
    "frontend": ("vllm_proxy.frontend",),
    "fleet": ("vllm_proxy.fleet",),
}  # fmt: skip
TIERS = {"realvllm", "cluster", "gpu", "simgpu", "browser"}
OTHERS = {"behaviour", "bench", "ops", "fake_engine", "package", "kit"}


def all_test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def imported(path: Path) -> set[str]:
    """Every module `path` imports (absolute names)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_every_folder_is_a_layer_a_tier_or_a_kind_of_test() -> None:
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders <= set(LAYERS) | TIERS | OTHERS, folders - set(LAYERS) - TIERS - OTHERS
    assert [p.name for p in TESTS.glob("test_*.py")] == [], "every test file lives in a folder"
    behaviour = TESTS / "behaviour"
    assert not list(behaviour.glob("test_*.py")), "behaviour tests live in a folder per topic"


def test_every_layer_of_the_package_has_its_folder_of_module_tests() -> None:
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages - {"static"} <= set(LAYERS), packages - set(LAYERS)
    for folder in LAYERS:
        assert list((TESTS / folder).glob("test_*.py")), f"tests/{folder} has no module test"


def test_a_layers_module_tests_import_the_layer_they_test() -> None:
    wrong = []
    for folder, prefixes in LAYERS.items():
        for path in (TESTS / folder).glob("test_*.py"):
            if not any(m.startswith(prefixes) for m in imported(path)):
                wrong.append(f"{path.relative_to(TESTS)} imports nothing of {prefixes}")
    assert wrong == []


def test_test_files_share_helpers_through_the_kit_and_their_names_are_unique() -> None:
    files = all_test_files()
    names = [p.name for p in files]
    assert len(names) == len(set(names)), "two test files share a name (pytest's prepend mode)"
    stems = {p.stem for p in files}
    borrowing = [
        f"{p.relative_to(TESTS)} imports {m}"
        for p in files
        for m in imported(p)
        if m.split(".")[0] in stems
    ]
    assert borrowing == [], "a helper two test files share belongs in tests/kit"
