"""The package's layering: imports go one way, and the product never imports its test kit."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_proxy"
TEST_KIT = {"fake_vllm", "tiny_llama", "vllm_proxy_demo"}


def imports_of(path: Path) -> tuple[set[str], set[str]]:
    """(modules of the package this file imports, top-level packages it imports)."""
    tree = ast.parse(path.read_text())
    inside: set[str] = set()
    outside: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                if node.module:
                    inside.add(node.module.split(".")[0])
                else:  # from . import x
                    inside.update(a.name for a in node.names)
            elif node.module:
                top, _, rest = node.module.partition(".")
                if top == "vllm_proxy" and rest:
                    inside.add(rest.split(".")[0])
                outside.add(top)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                top, _, rest = alias.name.partition(".")
                if top == "vllm_proxy" and rest:
                    inside.add(rest.split(".")[0])
                outside.add(top)
    return inside, outside


def graph() -> dict[str, set[str]]:
    modules = {p.stem: p for p in PACKAGE.glob("*.py")}
    return {name: imports_of(path)[0] & set(modules) - {name} for name, path in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """An import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt, [*path, nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for name in sorted(edges):
        if name not in state:
            found = visit(name, [name])
            if found:
                return found
    return None


def test_imports_go_one_way() -> None:
    edges = graph()
    assert {"instance", "model", "manager", "proxy"} <= set(edges), "the modules were found"
    assert "instance" in edges["model"] and "model" in edges["manager"]
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges) or [])


def test_a_model_s_autoscaler_and_back_off_sit_below_it() -> None:
    """The model uses both; neither knows the model (the autoscaler sees it as `Replicas`),
    and the back-off is bookkeeping that knows no instance either."""
    edges = graph()
    assert {"autoscale", "backoff"} <= edges["model"]
    assert edges["backoff"] <= {"errors"}
    assert edges["autoscale"] <= {"config", "instance"}
    for part in ("autoscale", "backoff"):
        got = {name for name, deps in edges.items() if part in deps}
        assert got <= {"model"}, f"{sorted(got - {'model'})} import {part}"


def test_nothing_imports_the_composition_root() -> None:
    edges = graph()
    allowed = {"app": {"cli"}, "cli": {"__main__"}}
    for target, importers in allowed.items():
        got = {name for name, deps in edges.items() if target in deps}
        assert got <= importers, f"{sorted(got - importers)} import {target}"


def test_the_product_never_imports_its_test_kit() -> None:
    for path in PACKAGE.rglob("*.py"):
        _, outside = imports_of(path)
        assert not outside & TEST_KIT, f"{path.name} imports {sorted(outside & TEST_KIT)}"


def test_a_cycle_would_be_found(tmp_path: Path) -> None:
    """The checker itself: modules that import each other, directly or through a third."""
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("from . import c\n")
    (tmp_path / "c.py").write_text("import vllm_proxy.a\n")
    edges = {p.stem: imports_of(p)[0] for p in tmp_path.glob("*.py")}
    assert edges == {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert find_cycle(edges) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
