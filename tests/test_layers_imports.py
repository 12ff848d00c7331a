"""The import graph of the project's packages, read with `ast`: no cycles, no import up the layers.

Layers, lowest first: proto, client, kvstore, conductor, workers, loadtest. A module
imports from its own package or from a lower one (docs: imports point one way); the
one door up is the `kvstore` command line, which may import the conductor's and the
workers' command lines. Imports inside functions count (a lazy import is still a
dependency); imports under ``if TYPE_CHECKING:`` do not (they never run). ``from pkg
import name`` is an import of the module ``pkg.name`` when there is one, else of ``pkg``.
"""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("proto", "client", "kvstore", "conductor", "workers", "loadtest")
DOORS_UP = {"kvstore.cli": {"conductor.cli", "workers.cli"}}


def module_files() -> dict[str, Path]:
    modules = {}
    for package in LAYERS:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(module: str, path: Path, tree: ast.AST, modules: dict[str, Path]):
    """Every dotted name an import statement of ``tree`` reaches, TYPE_CHECKING blocks aside."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    pending = list(ast.iter_child_nodes(tree))
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            pending += node.orelse
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
        else:
            pending += ast.iter_child_nodes(node)


@cache
def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (the nearest enclosing module of a name)."""
    modules = module_files()
    graph = {}
    for module, path in modules.items():
        targets = set()
        for name in _imported_names(module, path, ast.parse(path.read_text(), str(path)), modules):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components of more than one module (iterative: no recursion limit)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_no_import_cycles():
    graph = import_graph()
    cycles = strongly_connected(graph)
    described = ["\n".join(f"  {m} -> {sorted(graph[m] & c)}" for m in sorted(c)) for c in cycles]
    assert not cycles, "modules that import each other:\n" + "\n\n".join(described)


def test_imports_point_down_the_layers():
    rank = {package: i for i, package in enumerate(LAYERS)}
    upward = [f"{module} -> {target}" for module, targets in sorted(import_graph().items())
              for target in sorted(targets)
              if rank[target.split(".")[0]] > rank[module.split(".")[0]]
              and target not in DOORS_UP.get(module, set())]
    assert not upward, "imports that run up the layers (" + " <- ".join(LAYERS) + "):\n" + "\n".join(upward)


def test_the_walk_sees_lazy_imports_and_skips_type_checking(tmp_path):
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvstore.store.engine\n"
              "def run():\n    from kvstore.tiers import manager\n")
    path = tmp_path / "probe.py"
    path.write_text(source)
    names = set(_imported_names("kvstore.probe", path, ast.parse(source), module_files()))
    assert "kvstore.tiers.manager" in names and "kvstore.store.engine" not in names
