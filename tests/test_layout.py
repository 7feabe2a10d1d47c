"""The package's module graph, read from the source: no import cycles (top-level, deferred and
type-checking imports alike), the layers by folder (no import from a lower layer to a higher
one), the algorithmic core's pure parts free of the native runtime, one module name per concept,
and no module reading another's private names."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "verispec"
# The core's pure parts: the loop, the rules, sampling, control, statistics, n-gram drafting.
CORE = ("core.engine", "core.acceptance", "core.sampling", "core.control", "core.stats", "core.drafters.base",
        "core.drafters.ngram")
# The layers, lowest first, by the first part of a module's name (docs/architecture.md): a module
# may import its own layer and the layers below it, never one above. "" is the package itself.
LAYERS = (
    ("foundation", {"errors", "paths", "notices"}),
    ("gguf", {"gguf"}),
    ("runtime", {"runtime"}),
    ("target", {"target"}),
    ("core", {"core"}),
    ("request", {"request"}),
    ("shells", {"", "api", "cli", "hf_generate", "server", "bench", "train", "integrations", "data"}),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Package-internal modules `path` imports anywhere in its text (deferred imports too)."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):  # imports for type checkers too
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


def test_imports_for_type_checkers_are_edges_too(tmp_path):
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .model import Target\n"
    path = PACKAGE / "core" / "engine.py"
    assert "target.model" in GRAPH["core.engine"] or "TYPE_CHECKING" not in path.read_text()
    names = {node.module for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)}
    assert names == {"typing", "model"}


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_in_the_package():
    assert len(GRAPH) > 30 and GRAPH["core.engine"]  # the graph was read
    assert cycles(GRAPH) == []


def layer_of(module: str) -> int:
    top = module.split(".")[0]
    found = [rank for rank, (_, tops) in enumerate(LAYERS) if top in tops]
    assert found, f"{module} is in no layer: add its folder to LAYERS (and to docs/architecture.md)"
    return found[0]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for every import of a module of a higher layer."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


def test_every_module_is_in_a_layer_and_imports_only_its_own_or_lower_layers():
    assert upward_imports(GRAPH) == []


def test_the_layer_check_finds_an_upward_import():
    assert upward_imports({"runtime.rows": {"core.engine"}, "core.engine": {"runtime.rows"}}) == [
        "runtime.rows -> core.engine"]


def test_one_module_name_per_concept():
    """No two modules share a name (two `model.py`, two `metrics.py`), and no two classes in
    different modules do either (two `Target`s)."""
    names = [path.stem for path in PACKAGE.rglob("*.py") if path.stem != "__init__"]
    assert sorted({n for n in names if names.count(n) > 1}) == []
    classes: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):  # a private class is its module's
                classes.setdefault(node.name, []).append(name)
    assert {c: where for c, where in classes.items() if len(where) > 1} == {}


def test_the_algorithmic_core_does_not_import_the_runtime():
    for name in CORE:
        reached, todo = set(), [name]
        while todo:
            for nxt in GRAPH[todo.pop()] - reached:
                reached.add(nxt)
                todo.append(nxt)
        assert not {m for m in reached if m.startswith("runtime")}, (name, sorted(reached))


def private_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, `object._name`) for every read of a private attribute through anything but `self`
    or `cls` (a module's own classes may share privates through `self`; `__dunder__` names,
    and names an object sets on itself, are not private reads)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            found.append((node.lineno, f"{ast.unparse(owner)}.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            found += [(node.lineno, f"import {alias.name}") for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


# Reads of private names of other objects that the package allows: library internals it has no
# public way to reach (a transformers cache layer's fields, torch's op namespace, typer's click),
# named here so that a new one is a decision.
ALLOWED_PRIVATE = {"torch.ops.mkldnn._linear_pointwise", "torch.ops.mkldnn._reorder_linear_weight", "typer._click",
                   "t._version", "weight._version",  # a tensor's version counter: has it changed?
                   "events._queue"}  # asyncio.Queue has no public peek


def test_no_module_reads_another_objects_private_names():
    offenders = []
    for name, path in sorted(MODULES.items()):
        for line, read in private_reads(ast.parse(path.read_text())):
            if read not in ALLOWED_PRIVATE:
                offenders.append(f"{name}:{line} {read}")
    assert offenders == []


def test_the_private_read_finder_finds_them():
    source = "x = other._hidden\ny = self._own\nz = cls._too\nw = obj.__len__\nfrom .m import a, _b\n"
    assert sorted(private_reads(ast.parse(source))) == [(1, "other._hidden"), (5, "import _b")]


def long_functions(path: Path, limit: int) -> list[str]:
    """'module.function (N lines)' for each function in `path` longer than `limit` lines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append(f"{path.stem}.{node.name} ({length} lines)")
    return found


def test_the_command_line_reads_top_to_bottom():
    """No function of the CLI over 80 lines (signatures included): each command checks, runs and
    shows in parts that fit on a screen."""
    assert [f for path in sorted((PACKAGE / "cli").glob("*.py")) for f in long_functions(path, 80)] == []


def test_the_length_finder_finds_a_long_function(tmp_path):
    long = tmp_path / "long.py"
    long.write_text("def f():\n" + "    x = 1\n" * 90)
    assert long_functions(long, 80) == ["long.f (91 lines)"] and long_functions(long, 91) == []
