"""The allocator keeps its privates: other modules use its friend interface.

What the rest of cudalab may use of ``cudalab.allocator`` beyond the public methods is
spelled without an underscore (``Allocator``'s docstring lists the fields: ``stats``,
``live``, ``pending_frees``, ``memo_block``, ``outstanding_events``; trace replays drive
:class:`cudalab.allocator.replay_target.ReplayTarget`). An AST scan of every module outside
``cudalab/allocator/`` fails on

* a read of a private module-level name of an allocator module
  (``from cudalab.allocator.caching import _x``, ``registry._allocators``);
* an attribute ``X._name`` (``X`` not ``self``/``cls``) where ``_name`` is a private
  field or method of an allocator class and of no class outside the allocator (so the
  owner is certain: ``alloc._memo_ok``, ``a._pending_frees``);

and on an import of the driver seam's simulator from the tooling (a replay's private
simulator comes from ``cudalab._internal.private_simulator``).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from tests.helpers.privates import private_reads

ROOT = Path(__file__).resolve().parents[2]
ALLOCATOR = ROOT / "cudalab" / "allocator"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_fields(source: str) -> set[str]:
    """Private names a module's classes own: ``self._x`` / ``cls._x`` targets and reads,
    private methods, class-level names and ``__slots__`` entries."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls") and _private(node.attr)):
            names.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    if _private(item.target.id):
                        names.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    for target in item.targets:
                        if isinstance(target, ast.Name) and _private(target.id):
                            names.add(target.id)
                        if isinstance(target, ast.Name) and target.id == "__slots__":
                            names.update(c.value for c in ast.walk(item.value)
                                         if isinstance(c, ast.Constant)
                                         and isinstance(c.value, str) and _private(c.value))
    return names


def field_reads(source: str, fields: set[str] | frozenset[str], filename: str = "<string>") -> list[str]:
    """``file:line: X._name`` for each attribute read of one of ``fields`` not on self/cls."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr in fields
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def _outside() -> list[Path]:
    return sorted(p for p in (ROOT / "cudalab").rglob("*.py") if ALLOCATOR not in p.parents)


def _allocator_modules() -> list[str]:
    out = []
    for path in sorted(ALLOCATOR.glob("*.py")):
        out.append("cudalab.allocator" + ("" if path.stem == "__init__" else "." + path.stem))
    return out


@functools.cache
def allocator_only_fields() -> frozenset[str]:
    """Private names owned by allocator classes and by no class outside the allocator."""
    ours: set[str] = set()
    for path in ALLOCATOR.glob("*.py"):
        ours |= own_fields(path.read_text())
    theirs: set[str] = set()
    for path in _outside():
        theirs |= own_fields(path.read_text())
    return frozenset(ours - theirs)


def test_the_field_scan_sees_planted_reads() -> None:
    fields = own_fields("class A:\n    __slots__ = ('_a',)\n    def _m(self):\n"
                        "        self._b = 1\n        return cls._c")
    assert fields == {"_a", "_b", "_c", "_m"}
    source = "def f(alloc):\n    alloc._a = None\n    return self._b, alloc.stats._c, x.a"
    assert field_reads(source, fields) == ["<string>:2: alloc._a", "<string>:3: alloc.stats._c"]


def test_the_fields_checked_include_the_old_friend_reads() -> None:
    fields = allocator_only_fields()
    # What replay, memory.py and memory_tools read before they had public spellings:
    assert {"_memo_ok", "_memo_hits", "_pools", "_fold_mark"} <= fields
    assert "_lock" not in fields  # (owned outside the allocator too: not attributable)


def test_no_module_reads_allocator_fields() -> None:
    fields = allocator_only_fields()
    found = []
    for path in _outside():
        found += field_reads(path.read_text(), fields, path.relative_to(ROOT).as_posix())
    assert found == []


@pytest.mark.parametrize("target", _allocator_modules())
def test_no_module_reads_an_allocator_modules_privates(target: str) -> None:
    found = []
    for path in _outside():
        source = path.read_text()
        if target.rpartition(".")[2] in source:  # (a module that never names it reads none)
            found += private_reads(source, target, path.relative_to(ROOT).as_posix())
    assert found == []


def test_the_tooling_does_not_import_the_simulator() -> None:
    found = []
    for path in sorted((ROOT / "cudalab" / "memory_tools").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [f"{path.name}:{node.lineno}: {n}" for n in names
                      if n.startswith("cudalab._driver")]
    assert found == []
