"""The package's layering: imports go one way, between the layers' packages and between modules,
and the product never imports its test kit.

Layers, lowest first: the shared modules at the top of the package (config, engine_args, errors,
metrics, adapters, names), `planning`, `engines`, `pool`, `frontend`, then the composition root
(`app`, `cli`). A package may import its own modules, the shared ones and the layers below it,
never above. The request path (`frontend`) skips none: it sees the engines and the planner only
through the pool (`pool.lease`: the engine a request was given; `pool.views`: what the pages
show).

Tools (`fleet`: `vllm-proxy-fleet`, which runs beside HAProxy) stand apart: a tool imports its
own modules and the shared ones only, and nothing imports a tool.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_proxy"
TEST_KIT = {"fake_vllm", "tiny_llama", "vllm_proxy_demo"}
SHARED = {"config", "engine_args", "errors", "metrics", "adapters", "names"}
LAYERS = ["planning", "engines", "pool", "frontend"]
#: The composition root and the entry points (`ctl`: the operator's client, over HTTP only).
ROOT_MODULES = {"app", "cli", "ctl", "__main__", "__init__"}
TOOLS = {"fleet"}


def dotted(path: Path) -> str:
    """``engines.instance`` for engines/instance.py, ``config`` for config.py."""
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, package: Path = PACKAGE) -> tuple[set[str], set[str]]:
    """(modules of the package this file imports, dotted from the package root; top-level
    packages it imports)."""
    tree = ast.parse(path.read_text())
    here = list(path.relative_to(package).parent.parts)
    inside: set[str] = set()
    outside: set[str] = set()

    def add(base: list[str], module: str | None, names: list[str]) -> None:
        parts = base + (module.split(".") if module else [])
        if not module:
            inside.update(".".join([*parts, n]) for n in names)
        elif parts:
            inside.add(".".join(parts))

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                add(base, node.module, [a.name for a in node.names])
            elif node.module:
                top, _, rest = node.module.partition(".")
                if top == "vllm_proxy":
                    add([], rest or None, [a.name for a in node.names])
                outside.add(top)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                top, _, rest = alias.name.partition(".")
                if top == "vllm_proxy" and rest:
                    inside.add(rest)
                outside.add(top)
    return inside, outside


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a subpackage named alone is left out)."""
    modules = {dotted(p) if package == PACKAGE else p.stem: p for p in package.rglob("*.py")}
    modules = {name: p for name, p in modules.items() if p.stem != "__init__" or name == "__init__"}
    return {
        name: {d for d in imports_of(path, package)[0] if d in modules} - {name}
        for name, path in modules.items()
    }


def layer_of(module: str) -> str:
    head = module.split(".")[0]
    if head in LAYERS:
        return head
    if head in SHARED:
        return "shared"
    if head in TOOLS:
        return head
    return "root"


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
    assert {"engines.instance", "engines.model", "pool.manager", "frontend.routes.openai"} <= set(
        edges
    )
    assert "engines.instance" in edges["engines.model"]
    assert "engines.model" in edges["pool.manager"]
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges) or [])


def test_every_module_sits_in_a_layer() -> None:
    """A new module goes into one of the layers' packages, or is a shared one by decision."""
    for name in graph():
        head = name.split(".")[0]
        assert head in {*LAYERS, *SHARED, *ROOT_MODULES, *TOOLS}, f"{name} is in no layer"


def test_layers_import_only_downwards() -> None:
    """Shared modules import only shared ones; a layer imports itself, the shared modules and
    the layers below it; only the composition root sees every layer."""
    order = {"shared": -1, **{name: i for i, name in enumerate(LAYERS)}, "root": len(LAYERS)}
    for name, deps in graph().items():
        mine = layer_of(name)
        if mine in TOOLS:
            continue  # test_a_tool_imports_only_itself_and_the_shared_modules
        for dep in deps:
            theirs = layer_of(dep)
            assert theirs not in TOOLS, f"{name} imports the tool {dep}"
            if theirs == "root":
                continue  # checked by test_nothing_imports_the_composition_root
            assert order[theirs] <= order[mine], f"{name} ({mine}) imports {dep} ({theirs})"


#: What `frontend` may import besides itself.
FRONTEND_SEES = {"pool", "shared"}


def test_the_request_path_reaches_engines_only_through_the_pool() -> None:
    """`frontend` imports `pool` and the shared modules, never `engines` or `planning`: a
    handler holds an `Upstream` handle from its lease, a page reads `pool.views`."""
    edges = graph()
    for name, deps in edges.items():
        if layer_of(name) != "frontend":
            continue
        for dep in deps:
            theirs = layer_of(dep)
            assert theirs in {"frontend", *FRONTEND_SEES}, f"{name} imports {dep} ({theirs})"
    used = set().union(*(deps for name, deps in edges.items() if layer_of(name) == "frontend"))
    assert {"pool.lease", "pool.views"} <= used


def test_a_frontend_import_of_the_engines_would_be_refused(tmp_path: Path) -> None:
    """The check above, on a package where a handler imports an engine and a page a plan."""
    for sub in ("frontend", "engines", "planning", "pool"):
        (tmp_path / sub).mkdir()
    (tmp_path / "frontend" / "handler.py").write_text("from ..engines.instance import Instance\n")
    (tmp_path / "frontend" / "page.py").write_text("from ..planning import scheduler\n")
    (tmp_path / "frontend" / "fine.py").write_text("from ..pool.lease import Lease\n")
    got = {
        stem: {layer_of(d) for d in imports_of(tmp_path / "frontend" / f"{stem}.py", tmp_path)[0]}
        for stem in ("handler", "page", "fine")
    }
    assert got == {"handler": {"engines"}, "page": {"planning"}, "fine": {"pool"}}
    assert not got["handler"] <= FRONTEND_SEES and not got["page"] <= FRONTEND_SEES
    assert got["fine"] <= FRONTEND_SEES


def test_a_tool_imports_only_itself_and_the_shared_modules() -> None:
    """`vllm-proxy-fleet` talks to the proxies over HTTP: it knows no planner, engine, pool or
    handler, and no layer knows it."""
    edges = graph()
    assert "fleet.loop" in edges and "fleet.placement" in edges["fleet.loop"]
    for name, deps in edges.items():
        mine = layer_of(name)
        for dep in deps:
            theirs = layer_of(dep)
            if mine in TOOLS:
                assert theirs in {mine, "shared"}, f"{name} ({mine}) imports {dep} ({theirs})"
            else:
                assert theirs not in TOOLS, f"{name} ({mine}) imports the tool {dep}"


def test_the_layers_use_each_other() -> None:
    """The rule above is not vacuous: each layer does import the one below it."""
    edges = graph()
    for lower, upper in itertools.pairwise(LAYERS):
        assert any(
            layer_of(name) == upper and any(layer_of(d) == lower for d in deps)
            for name, deps in edges.items()
        ), f"nothing in {upper} imports {lower}"


def test_a_model_s_autoscaler_and_back_off_sit_below_it() -> None:
    """The model uses both; neither knows the model (the autoscaler sees it as `Replicas`),
    and the back-off is bookkeeping that knows no instance either."""
    edges = graph()
    assert {"engines.autoscale", "engines.backoff"} <= edges["engines.model"]
    assert edges["engines.backoff"] <= {"errors"}
    assert edges["engines.autoscale"] <= {"config", "engines.instance", "engines.states"}
    for part in ("engines.autoscale", "engines.backoff"):
        got = {name for name, deps in edges.items() if part in deps}
        assert got <= {"engines.model"}, f"{sorted(got - {'engines.model'})} import {part}"


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


def test_relative_imports_are_resolved_from_the_importing_package(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "sub" / "m.py").write_text(
        "from . import sib\nfrom ..shared import x\nfrom ..other.deep import y\n"
    )
    inside, _ = imports_of(pkg / "sub" / "m.py", pkg)
    assert inside == {"sub.sib", "shared", "other.deep"}


def test_a_cycle_would_be_found(tmp_path: Path) -> None:
    """The checker itself: modules that import each other, directly or through a third."""
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("from . import c\n")
    (tmp_path / "c.py").write_text("import vllm_proxy.a\n")
    edges = graph(tmp_path)
    assert edges == {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert find_cycle(edges) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
