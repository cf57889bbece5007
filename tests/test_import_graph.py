"""The project's import graph: no cycle between its modules, and the layering that
docs/ARCHITECTURE.md draws.

The graph is read from the source with ``ast``: every ``import`` and ``from ... import`` of a
project module, at module level or inside a function (a function-level import is a cycle
postponed, not removed). Imports under ``if TYPE_CHECKING:`` never run, but two modules that
name each other's types are still one unit to read and change: the cycle check counts them,
the check of what a module pulls in at run time does not.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "server",
    "engine",
    "scheduler",
    "kvpool",
    "kernels",
    "loadtest",
    "planner",
    "benchmarks",
)
# What a plain model definition must not pull in, directly or through what it imports.
CPU_BACKEND = ("kernels.cpu", "kvpool.host_memory", "engine.backends", "engine.gguf_blocks")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(
    tree: ast.AST, module: str, is_package: bool, modules: set[str], *, type_only: bool
) -> set[str]:
    """Names of the modules ``tree`` imports when it runs (project or not). A package's
    ``__init__`` that runs only because a submodule is imported is not counted (Python
    initialises parents first, whatever imports what), so ``from package import submodule``
    is an import of the submodule alone."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_only:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(*, type_only: bool = True) -> dict[str, set[str]]:
    """Project module -> the project modules it imports; ``type_only``: with the imports
    under ``if TYPE_CHECKING:``."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        imported = _imported(tree, name, is_package, set(modules), type_only=type_only)
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_the_graph_is_read_from_the_source():
    graph = import_graph()
    assert "engine.config" in graph["engine.llama"]
    assert "engine.attention" in graph["engine.llama"]  # under TYPE_CHECKING
    assert "engine.attention" not in import_graph(type_only=False)["engine.llama"]
    assert "engine.backends.cpu" in graph["engine.builder"]
    # `from kernels import cpu` is an import of the submodule.
    assert "kernels.cpu" in graph["engine.attention"]


def test_no_import_cycle_between_project_modules():
    cycles = _cycles(import_graph())
    assert not cycles, f"import cycles: {cycles}"


def test_the_model_definition_imports_nothing_of_the_cpu_backend():
    """Not directly (type-only imports included), and not through what it runs."""
    direct = import_graph()["engine.llama"]
    reached = direct | _reachable(import_graph(type_only=False), "engine.llama")
    bad = sorted(m for m in reached if m.startswith(CPU_BACKEND))
    assert not bad, f"engine/llama.py reaches {bad}"


def test_lower_layers_import_nothing_above_them():
    """kernels/ imports nothing of the project; kvpool/ nothing of server/engine/scheduler;
    scheduler/ nothing of server/engine."""
    above = {
        "kernels": ("server", "engine", "scheduler", "kvpool", "planner", "loadtest"),
        "kvpool": ("server", "engine", "scheduler"),
        "scheduler": ("server", "engine"),
    }
    graph = import_graph()
    bad = [
        (module, target)
        for module, targets in graph.items()
        for package, forbidden in above.items()
        if module.split(".")[0] == package
        for target in targets
        if target.split(".")[0] in forbidden
    ]
    assert not bad, bad
