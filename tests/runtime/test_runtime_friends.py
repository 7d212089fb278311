"""The core runtime keeps its privates: other modules use its friend interface.

What the runtime's modules read of each other on their hot paths is spelled without an
underscore (``devices.per_thread``, ``devices.ensure_context``, ``streams.close_listeners``,
``Stream.handle``, ``Event.create_handle``, ``random.state.state_lock``, ...;
``docs/architecture.md``, "The core runtime's friend interface"). An AST scan of every module
of ``cudalab`` fails on

* a read of a private module-level name of a core runtime module from another module
  (``from cudalab.random.state import _lock``, ``devices._tls``, ``cudalab.streams._custom``),
  imports inside functions included;
* an attribute ``X._name`` (``X`` not ``self``/``cls``) where ``_name`` is a private field
  or method of a class of one core runtime module and of no class of any other module (so
  the owner is certain: ``generator._state``, ``event._create(...)``), read elsewhere;
* a read of the hot fields that were private before (``x._handle``, ``x._b``, ``x._null``)
  on anything but ``self``/``cls``, anywhere in ``cudalab``: those are
  ``Stream.handle`` / ``Stream.backend`` / ``Stream.is_legacy_null`` and ``Event.handle``.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from tests.helpers.privates import private_reads

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "cudalab"

#: The core runtime: these modules and every module of these packages.
CORE = ("streams", "events", "devices", "sync_debug", "_internal", "kernels", "jiterator",
        "nvml", "nvtx", "blas", "random", "_kernels", "sanitizer")

#: Stream's and Event's fields read on hot paths, private before issue 35.
HOT_FIELDS = frozenset({"_handle", "_b", "_null"})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def _sources() -> dict[str, str]:
    """Every module of cudalab: dotted name -> source."""
    return {_module(p): p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))}


def core_modules() -> list[str]:
    return sorted(m for m in _sources()
                  if any(m == f"cudalab.{c}" or m.startswith(f"cudalab.{c}.") for c in CORE))


def own_fields(source: str | ast.AST) -> set[str]:
    """Private names a module's classes own: ``self._x`` / ``cls._x`` targets, private
    methods, class-level names and ``__slots__`` entries."""
    names: set[str] = set()
    tree = ast.parse(source) if isinstance(source, str) else source
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls") and isinstance(node.ctx, ast.Store)
                and _private(node.attr)):
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


def field_reads(source: str | ast.AST, fields: set[str] | frozenset[str] | dict[str, str],
                filename: str = "<string>") -> list[str]:
    """``file:line: X._name`` for each attribute access of one of ``fields`` not on self/cls
    (with ``(of owner)`` when ``fields`` maps each field to its owner)."""
    tree = ast.parse(source) if isinstance(source, str) else source
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in fields
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            owner = f" (of {fields[node.attr]})" if isinstance(fields, dict) else ""
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}{owner}")
    return found


@functools.cache
def _trees() -> dict[str, ast.AST]:
    return {m: ast.parse(s) for m, s in _sources().items()}


@functools.cache
def attributable_fields() -> dict[str, frozenset[str]]:
    """Core module -> the private class fields that it alone owns (no other module's
    classes have a field or method of that name)."""
    owned = {m: own_fields(tree) for m, tree in _trees().items()}
    out = {}
    for module in core_modules():
        others = set().union(*(f for m, f in owned.items() if m != module))
        out[module] = frozenset(owned[module] - others)
    return out


# ---------------------------------------------------------------------------- the rules
@pytest.mark.parametrize("target", core_modules())
def test_no_module_reads_a_core_modules_private_names(target):
    found = []
    parts = target.split(".")[1:]
    for module, source in _sources().items():
        # (a module that never names every part of the target's name reads none of it)
        if module != target and all(part in source for part in parts):
            found += private_reads(source, target, module)
    assert found == []


def test_no_module_reads_a_core_classes_private_fields():
    owner_of = {field: owner for owner, fields in attributable_fields().items() for field in fields}
    found = []
    for module, tree in _trees().items():
        found += [read for read in field_reads(tree, owner_of, module)
                  if not read.endswith(f"(of {module})")]
    assert found == []


def test_no_module_reads_the_old_private_hot_fields():
    found = []
    for module, tree in _trees().items():
        found += field_reads(tree, HOT_FIELDS, module)
    assert found == []


# -------------------------------------------------------------------- the scan can fail
def test_the_scans_cover_the_core_runtime():
    modules = core_modules()
    assert {"cudalab.devices", "cudalab.streams", "cudalab.events", "cudalab.random.state",
            "cudalab._kernels.kernel", "cudalab.sanitizer.tracking"} <= set(modules)
    fields = attributable_fields()
    # fields that other modules read before they had public spellings stay private, and
    # are attributable to their owner (so a new read of them fails)
    assert "_create" not in fields["cudalab.events"]  # (it is create_handle now)
    assert {"_rec", "_flags"} <= fields["cudalab.events"]
    assert "_ctx_stack" in fields["cudalab.streams"]


@pytest.mark.parametrize("source, target", [
    ("from cudalab import devices as _devices\n_devices._tls.device", "cudalab.devices"),
    ("import cudalab\ndef f():\n    return cudalab.streams._custom", "cudalab.streams"),
    ("from cudalab.random.state import _lock", "cudalab.random.state"),
    ("from cudalab._kernels import kernel as k\nk._launch_blocking", "cudalab._kernels.kernel"),
])
def test_a_planted_module_private_read_is_found(source, target):
    assert len(private_reads(source, target)) == 1


def test_a_planted_field_read_is_found():
    fields = own_fields("class Event:\n    __slots__ = ('handle', '_rec')\n"
                        "    def _bind(self):\n        self._q = 1\n")
    assert fields == {"_rec", "_bind", "_q"}
    source = "def f(event, stream):\n    event._rec(stream._handle)\n    return self._q, event.handle"
    assert field_reads(source, fields) == ["<string>:2: event._rec"]
    assert field_reads(source, {"_rec": "cudalab.events"}) == [
        "<string>:2: event._rec (of cudalab.events)"]
    assert field_reads(source, HOT_FIELDS) == ["<string>:2: stream._handle"]
