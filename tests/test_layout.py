"""The package's module graph, read from the source: no import cycles (top-level and deferred
imports alike) and the algorithmic core free of the native runtime."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "verispec"
CORE = ("engine", "acceptance", "sampling", "control", "stats", "drafters.base", "drafters.ngram")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node but those under `if TYPE_CHECKING:` (imports for type checkers only)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                todo.extend(child.orelse)
            else:
                todo.append(child)


def imports_of(path: Path) -> set[str]:
    """Package-internal modules `path` imports anywhere in its text (deferred imports too)."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            if node.module:
                base = base + node.module.split(".")
            for alias in node.names:  # `from . import x` may name a module
                candidate = ".".join([*base, alias.name]).strip(".")
                found.add(candidate if candidate in MODULES else ".".join(base))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("verispec."):
                    found.add(alias.name.removeprefix("verispec."))
    return {m for m in found if m in MODULES and m != name}


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first search (each reported once, from its first node)."""
    found, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_imports_for_type_checkers_only_are_not_edges():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import verispec.model\nimport verispec.engine\n"
    names = {a.name for n in _runtime_nodes(ast.parse(source)) if isinstance(n, ast.Import) for a in n.names}
    assert names == {"verispec.engine"}


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_in_the_package():
    assert len(GRAPH) > 30 and GRAPH["engine"]  # the graph was read
    assert cycles(GRAPH) == []


def test_the_algorithmic_core_does_not_import_the_runtime():
    for name in CORE:
        reached, todo = set(), [name]
        while todo:
            for nxt in GRAPH[todo.pop()] - reached:
                reached.add(nxt)
                todo.append(nxt)
        assert not {m for m in reached if m.startswith("runtime")}, (name, sorted(reached))
