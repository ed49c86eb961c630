"""The package's layout: no import cycle between its modules, at import time or deferred
inside a function (imports under ``if TYPE_CHECKING:`` are for annotations only and do
not count). A package's ``__init__`` that a submodule import runs counts as a module."""

from __future__ import annotations

import ast
from pathlib import Path

import prefixroute

ROOT = Path(prefixroute.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _imports(tree: ast.Module, mods: dict[str, Path]) -> set[str]:
    """The package's modules ``tree`` imports (``from pkg import sub`` names ``sub``)."""
    out: set[str] = set()
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.startswith("prefixroute"):
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
            out.update(subs if len(subs) == len(node.names) else [node.module])
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("prefixroute"))
        stack.extend(ast.iter_child_nodes(node))
    return {m for m in out if m in mods}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_the_package():
    mods = _modules()
    graph = {m: _imports(ast.parse(p.read_text()), mods) - {m} for m, p in mods.items()}
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the whole package was read
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import prefixroute.server.app\n"
                     "def f():\n    from prefixroute.server import proxy\n")
    mods = {"prefixroute.server.app": Path(), "prefixroute.server.proxy": Path(), "prefixroute.server": Path()}
    assert _imports(tree, mods) == {"prefixroute.server.proxy"}
