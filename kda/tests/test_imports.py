"""The modules of kda/python/flash_kda import each other without a circle (CPU; runs in CI).

Every module is parsed with ``ast`` (imports inside functions and under ``if TYPE_CHECKING`` count too), the
imports that name a module of the package become edges, and the graph must have no cycle.
``from flash_kda import x`` is an edge to the submodule ``flash_kda.x`` when there is one, else to the package
itself (``flash_kda/__init__.py``); the compiled extension ``_C`` is not a Python module and has no edges.
"""

from __future__ import annotations

import ast
import pathlib

import flash_kda

PACKAGE = "flash_kda"
ROOT = pathlib.Path(flash_kda.__file__).parent
EXTENSIONS = {"flash_kda._C"}  # compiled: no imports of the package


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join((PACKAGE, *parts[:-1])) if parts[-1] == "__init__" else ".".join((PACKAGE, *parts))


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imported(node: ast.AST, module: str, is_package: bool, modules: dict) -> list[str]:
    """The package's modules that one import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:  # relative: from the module's own package, then up
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    found = []
    for alias in node.names:
        if f"{source}.{alias.name}" in EXTENSIONS or source in EXTENSIONS:
            continue
        if f"{source}.{alias.name}" in modules:
            found.append(f"{source}.{alias.name}")  # a submodule
        elif source in modules:
            found.append(source)  # a name defined in the module
    return found


def import_graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports} for every module of the package."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[name] = {m for node in ast.walk(tree) for m in _imported(node, name, is_package, modules) if m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as [a, b, ..., a], or None (depth-first search, modules in sorted order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_package_has_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    edges = "\n".join(f"  {m} -> {', '.join(sorted(d)) or '-'}" for m, d in sorted(graph.items()))
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}\nimport graph:\n{edges}"


def test_graph_sees_imports_inside_functions():
    """The parse finds what the check depends on: a function-level import (api.fwd imports ops lazily) and
    the roles' imports (ops runs through launch and validation, not api)."""
    graph = import_graph()
    assert "flash_kda.ops" in graph["flash_kda.api"]
    assert {"flash_kda.launch", "flash_kda.validation"} <= graph["flash_kda.ops"]
    assert "flash_kda.api" not in graph["flash_kda.ops"] | graph["flash_kda.numerics"]


def test_find_cycle_reports_the_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
