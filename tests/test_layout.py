"""The shape of the packages, which the linters do not check: no module grows past 800 lines
(past that a module holds more than one concept), and no import circle among the project's
modules. import-linter's layers only order packages; a circle inside one (a writer importing
the client that imports the writer) passes them, and so does one hidden in a function body or
under ``if TYPE_CHECKING:``, which still ties the two modules together for a reader and for
anyone who wants to move one of them. So every import counts here, wherever it is written."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tectonic_py", "chunkstore", "metadata")
MAX_LINES = 800


def _modules() -> dict[str, Path]:
    """Every module of the project's packages by dotted name (a package by its ``__init__``)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(module: str, source: str, is_package: bool, modules: set[str]) -> set[str]:
    """The project's modules that every import statement of the module reaches, wherever it
    stands: module level, a function body, an ``if TYPE_CHECKING:`` block. A name is taken
    as the longest of ``a.b.c``, ``a.b``, ``a`` that is a module of the project, so
    ``from pkg import mod`` names ``pkg.mod`` and ``from pkg import Class`` names ``pkg``."""

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {resolve(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            prefix = node.module or ""
            if node.level:
                base = module.split(".")
                drop = node.level - 1 if is_package else node.level
                base = base[: len(base) - drop]
                prefix = ".".join(base + ([prefix] if prefix else []))
            found |= {resolve(f"{prefix}.{alias.name}") for alias in node.names}
    return found - {"", module}


def _graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports."""
    modules = _modules()
    names = set(modules)
    return {
        module: _imports(module, path.read_text(), path.name == "__init__.py", names)
        for module, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one
    circle through all its modules where there is one, sorted so the message is stable."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(components)


def _circle(graph: dict[str, set[str]], component: list[str]) -> str:
    """One import path from the component's first module back to itself, for the message."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                return " -> ".join([*paths[v], start])
            if w not in paths:
                paths[w] = [*paths[v], w]
                queue.append(w)
    return " -> ".join(component)


def test_no_module_is_over_800_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in _modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_import_cycles() -> None:
    graph = _graph()
    cycles = _cycles(graph)
    message = "\n".join(
        f"{len(c)} modules: {', '.join(c)}\n  e.g. {_circle(graph, c)}" for c in cycles
    )
    assert not cycles, f"import cycles among the project's modules:\n{message}"


def test_the_scan_sees_every_kind_of_import() -> None:
    """The scan itself: relative, function-level and TYPE_CHECKING imports all count,
    ``from pkg import mod`` names the module and ``from pkg import name`` the package."""
    modules = {"p", "p.a", "p.b", "p.c", "p.d", "p.sub", "p.sub.e", "q"}
    source = """
from __future__ import annotations
from typing import TYPE_CHECKING
from . import b
from .sub import e
from p import Thing
if TYPE_CHECKING:
    from p.c import C
def f():
    import p.d
    from .c import D
"""
    assert _imports("p.a", source, False, modules) == {"p.b", "p.sub.e", "p", "p.c", "p.d"}
    assert _imports("p.sub", "from . import e\nfrom .. import a", True, modules) == {
        "p.sub.e",
        "p.a",
    }
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _circle(graph, ["a", "b", "c"]) == "a -> b -> c -> a"
