"""No import cycles among hivespec's own modules.

A cycle means two modules each need the other to make sense: neither can be read, tested or
moved alone. The graph counts every import of a hivespec module wherever it sits: at module
level, inside a function (a lazy import is still a dependency, only a later one), and under
``if TYPE_CHECKING:`` (a type a module names is part of what a reader must know). Package
``__init__`` modules count as modules too; ``from hivespec.node import runtime`` is an edge to
``hivespec.node.runtime``.

The source folders map to packages as pyproject's ``package-dir`` says: ``node/`` is
``hivespec.node`` and so on. Found by walking the files with `ast`, so nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"protocol": "hivespec.protocol", "kernels": "hivespec.kernels", "node": "hivespec.node", "dashboard": "hivespec.dashboard"}


def hivespec_modules() -> dict[str, Path]:
    """Every module of the four packages, by dotted name."""
    modules = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The hivespec modules `name` imports anywhere in its file (see the module docstring)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            # `from package import module` names a module; `from module import name` names the module.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import hivespec.node.x.y` where only x is a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = hivespec_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative: no recursion limit on a deep graph)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for target in edges:
                if target not in index:
                    index[target] = low[target] = counter
                    counter += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                    advanced = True
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    # Module level, function level (cli imports runtime lazily) and a package's own modules.
    assert "hivespec.node.config" in graph["hivespec.node.cli"]
    assert any(target.startswith("hivespec.node.") and target != "hivespec.node.config" for target in graph["hivespec.node.cli"])
    assert len(graph) > 60


def test_no_import_cycles_among_hivespec_modules():
    cycles = [c for c in strongly_connected(import_graph()) if len(c) > 1]
    assert cycles == [], "import cycles (break each by moving the shared part into its own module): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [sorted(c) for c in strongly_connected(graph) if len(c) > 1] == [["a", "b", "c"]]
