"""The modules of ``cudalab.allocator`` import one another without a cycle.

Every ``import`` / ``from ... import`` statement counts, wherever it is: at module level,
inside functions and under ``if TYPE_CHECKING:`` (import-linter's acyclic contract skips
the last kind). The caching allocator is one class over several modules (``cache_state``
for the fields, the ``memo`` / ``pools`` / ``slow_path`` / ``inspection`` concerns, the
hot paths in ``caching``): its concerns import the state below them, never the class made
from them, and the pool record lives in ``private_pool`` below both.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "cudalab.allocator"


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (the package itself included)."""
    out = {}
    for path in (ROOT / "cudalab" / "allocator").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_edges(name: str, source: str, known: set[str], is_package: bool) -> set[str]:
    """The modules of ``known`` that module ``name`` imports anywhere in ``source``."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.append(full if full in known else base)
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        found.update(t for t in targets if t in known and t != name)
    return found


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (its modules in order, the first repeated), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_scan_finds_a_cycle() -> None:
    known = {"p.a", "p.b", "p.c"}
    edges = {
        "p.a": import_edges("p.a", "from p.b import X", known, False),
        "p.b": import_edges("p.b", "def f():\n    from . import c", known, False),
        "p.c": import_edges("p.c", "from typing import TYPE_CHECKING\n"
                                   "if TYPE_CHECKING:\n    from p.a import Y", known, False),
    }
    assert edges == {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}}
    assert cycle(edges) == ["p.a", "p.b", "p.c", "p.a"]
    edges["p.c"] = set()
    assert cycle(edges) is None


def test_the_allocator_package_has_no_import_cycle() -> None:
    mods = modules()
    assert f"{PACKAGE}.caching" in mods and f"{PACKAGE}.private_pool" in mods
    known = set(mods)
    edges = {name: import_edges(name, path.read_text(), known, path.name == "__init__.py")
             for name, path in mods.items()}
    # The concerns of the caching allocator sit on its state, below the class made of them.
    for concern in ("memo", "pools", "slow_path", "inspection", "cache_state"):
        assert f"{PACKAGE}.caching" not in edges[f"{PACKAGE}.{concern}"], concern
    found = cycle(edges)
    assert found is None, "import cycle: " + " -> ".join(found or [])
