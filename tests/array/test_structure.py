"""DeviceArray's parts stay typed and acyclic (issue 35, item 4), and stay small (item 6).

* No part of DeviceArray (``cudalab/_array_*.py``) imports :mod:`cudalab.array`, in any
  form: at module level, inside a function or under ``TYPE_CHECKING``.
* Every method of a mixin class there types ``self`` (``ArrayState`` or ``ArrayT``), so
  the type checker checks each use of ``self``; no mixin derives from ``Any``.
* ``array.py``, its parts and the ``graphs`` package's modules stay under 800 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "cudalab"
PARTS = sorted(ROOT.glob("_array_*.py"))
SELF_TYPES = {"ArrayState", "ArrayT"}


def _imports_of(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in ``tree``, names imported from a package included
    as ``package.name``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def test_the_parts_are_found():
    names = {p.name for p in PARTS}
    assert {"_array_operators.py", "_array_views.py", "_array_state.py"} <= names


@pytest.mark.parametrize("path", PARTS, ids=lambda p: p.name)
def test_no_part_imports_the_array_module(path):
    tree = ast.parse(path.read_text(), str(path))
    bad = [(line, m) for line, m in _imports_of(tree)
           if m == "cudalab.array" or m.startswith("cudalab.array.")]
    assert not bad, f"{path.name} imports cudalab.array (an import cycle): {bad}"


def test_the_scan_sees_imports_inside_functions_and_type_checking():
    tree = ast.parse("if TYPE_CHECKING:\n    from cudalab.array import DeviceArray\n"
                     "def f():\n    from cudalab import array\n")
    assert {m for _, m in _imports_of(tree)} >= {"cudalab.array.DeviceArray",
                                                  "cudalab.array"}


def _untyped_methods(source: str, name: str = "<string>") -> list[str]:
    """``Class.method`` for each method of a class in ``source`` whose ``self`` is not
    typed with ArrayState or ArrayT, and ``Class(base)`` for a class deriving from Any."""
    out = []
    for node in ast.parse(source, name).body:
        if not isinstance(node, ast.ClassDef):
            continue
        out += [f"{node.name}({ast.unparse(b)})" for b in node.bases
                if ast.unparse(b) in ("Any", "_ArrayBase")]
        for item in node.body:
            if not isinstance(item, ast.FunctionDef) or not item.args.args:
                continue
            first = item.args.args[0]
            if first.arg != "self" or any(isinstance(d, ast.Name) and d.id == "staticmethod"
                                          for d in item.decorator_list):
                continue
            if first.annotation is None or ast.unparse(first.annotation) not in SELF_TYPES:
                out.append(f"{node.name}.{item.name}")
    return out


@pytest.mark.parametrize("path", [p for p in PARTS if p.name != "_array_state.py"],
                         ids=lambda p: p.name)
def test_every_mixin_method_types_self(path):
    assert _untyped_methods(path.read_text(), str(path)) == []


def test_the_self_check_can_fail():
    source = ("class M(_ArrayBase):\n    def f(self): ...\n"
              "    def g(self: ArrayT) -> ArrayT: ...\n")
    assert _untyped_methods(source) == ["M(_ArrayBase)", "M.f"]


@pytest.mark.parametrize("path", [ROOT / "array.py", *PARTS, *sorted((ROOT / "graphs").glob("*.py"))],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_modules_stay_under_800_lines(path):
    n = len(path.read_text().splitlines())
    assert n < 800, f"{path.name} has {n} lines"
