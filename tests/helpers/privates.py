"""Find reads of one module's private names from other modules' source (an AST scan).

:func:`private_reads` reports, in a module's source, every

* ``from <target> import _name`` (also ``from <target> import _name as x``);
* attribute access ``X._name`` where ``X`` is bound to ``<target>`` by an import
  (``import a.b.target as X``, ``from a.b import target as X``), or a chain from a parent
  package (``import cudalab`` then ``cudalab.nvtx._tls``), imports inside functions included.

Dunder names (``__all__``) and a named tuple's API (``_fields``, ``_replace``) are not private.
Used by the tests that keep each owner's privates private (the registry, nvtx, the async
allocator).

:func:`package_private_reads` scans the whole package (:func:`cross_module_reads` per module:
relative imports, module attributes, names on imported classes, and the hot instance fields
:data:`HOT_FIELDS`), for ``tests/test_privates.py``'s package-wide test.
``python -m tests.helpers.privates`` prints what it finds as the ``DEBT`` set of
``tests/helpers/privates_debt.py`` (less the allow-list).
"""

from __future__ import annotations

import ast
from pathlib import Path

__all__ = ["HOT_FIELDS", "cross_module_reads", "package_modules", "package_private_reads", "private_reads"]


#: A named tuple's public API, spelled with an underscore so it cannot clash with a field.
_NAMEDTUPLE_API = frozenset({"_fields", "_field_defaults", "_replace", "_asdict", "_make"})


def _private(name: str) -> bool:
    return (name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
            and name not in _NAMEDTUPLE_API)


def private_reads(source: str, target: str, filename: str = "<string>") -> list[str]:
    """Every read of a private name of module ``target`` in ``source``.

    Parameters
    ----------
    source
        Python source of the module scanned.
    target
        The dotted name of the module whose privates are looked for (``cudalab.nvtx``).
    filename
        Used in the messages.

    Returns
    -------
    list[str]
        ``"file:line: what"`` for each read, in walk order; empty when there is none.
    """
    tree = ast.parse(source, filename)
    out: list[str] = []
    bound: dict[str, str] = {}  # local name -> the dotted module it names (target or a parent)

    def on_path(module: str) -> bool:
        return module == target or target.startswith(module + ".")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and on_path(alias.name):
                    bound[alias.asname] = alias.name
                elif not alias.asname:
                    top = alias.name.split(".")[0]
                    if on_path(top):
                        bound[top] = top
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if node.module == target and _private(alias.name):
                    out.append(f"{filename}:{node.lineno}: imports {target}.{alias.name}")
                elif on_path(f"{node.module}.{alias.name}"):
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = [node.attr]
        root: ast.AST = node.value
        while isinstance(root, ast.Attribute):
            chain.append(root.attr)
            root = root.value
        if not (isinstance(root, ast.Name) and root.id in bound):
            continue
        dotted = ".".join([bound[root.id], *reversed(chain)])
        owner, _, name = dotted.rpartition(".")  # the innermost step past target is reported
        if owner == target and _private(name):
            out.append(f"{filename}:{node.lineno}: reads {dotted}")
    return out


# ------------------------------------------------------------------ the package-wide scan
#: Instance fields that other modules used to read (``stream._handle``, ``array._ptr``): an
#: access on anything but ``self``/``cls`` is reported outside the modules that define them.
HOT_FIELDS = frozenset({"_handle", "_ptr", "_dtype", "_shape", "_strides", "_device", "_nbytes",
                        "_contiguous"})


def package_modules(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root`` (``cudalab/``): dotted name -> its file.

    C extensions count by their source (``_fastcall.c``), so a clean checkout without the
    built ``.so`` sees the same modules.
    """
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")) + sorted(root.rglob("*.c")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.setdefault(".".join(parts), path)
    return out


def _defined_fields(tree: ast.AST) -> set[str]:
    """The hot fields some class of this module defines (``self._handle = ...`` in a method,
    a class-level assignment or annotation, or a ``__slots__`` entry)."""
    out: set[str] = set()
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in ast.walk(cls):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out.add(node.target.id)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        out.add(target.id)
                        if target.id == "__slots__" and isinstance(node.value, (ast.Tuple, ast.List)):
                            out.update(e.value for e in node.value.elts
                                       if isinstance(e, ast.Constant) and isinstance(e.value, str))
    return out & HOT_FIELDS


def cross_module_reads(source: str, module: str, modules: set[str] | dict[str, Path],
                       package: bool = False, filename: str = "<string>") -> list[tuple[int, str]]:
    """Every read, in one module's source, of another package module's private name.

    Reported, each as ``(line, what)``:

    * ``from X import _name`` and ``from .X import _name`` (relative imports resolved), where
      ``_name`` is not itself a module (``from cudalab import _driver`` is fine):
      ``what`` is ``"X._name"``;
    * ``M._name`` where ``M`` is bound to another package module by any import (in functions
      too), or reached through a chain (``cudalab.devices._tls``): ``"M._name"``;
    * ``C._name`` where ``C`` was imported from another package module (a class):
      ``"M.C._name"``;
    * a :data:`HOT_FIELDS` access ``x._handle`` on anything but ``self``/``cls``, in a module
      that defines no class with that field: ``"._handle"``.

    Dunder names are not private; the module's own privates are its own.

    Parameters
    ----------
    source
        The module's source.
    module
        Its dotted name (``cudalab.magics.timing``).
    modules
        The dotted names of the package's modules (:func:`package_modules`).
    package
        Whether the source is a package's ``__init__.py`` (relative imports start there).
    filename
        Used by the parser's messages.
    """
    tree = ast.parse(source, filename)
    base_package = module if package else module.rpartition(".")[0]
    bound: dict[str, str] = {}  # local name -> dotted module, or "module:Name" for imported objects
    out: list[tuple[int, str]] = []

    def absolute(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = base_package.split(".")
        parts = parts[:len(parts) - (node.level - 1)]
        return ".".join(parts + ([node.module] if node.module else []))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    if alias.name in modules:
                        bound[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    if top in modules:
                        bound[top] = top
        elif isinstance(node, ast.ImportFrom):
            source_module = absolute(node)
            if source_module not in modules:
                continue
            for alias in node.names:
                full = f"{source_module}.{alias.name}"
                if full in modules:
                    bound[alias.asname or alias.name] = full
                elif _private(alias.name) and source_module != module:
                    out.append((node.lineno, full))
                elif source_module != module and alias.name != "*":
                    bound[alias.asname or alias.name] = f"{source_module}:{alias.name}"
    reported: set[int] = set()  # ids of attribute nodes already reported as module reads
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = [node.attr]
        root: ast.AST = node.value
        while isinstance(root, ast.Attribute):
            chain.append(root.attr)
            root = root.value
        if not (isinstance(root, ast.Name) and root.id in bound):
            continue
        chain.reverse()
        target = bound[root.id]
        if ":" in target:  # an object (a class) imported from another module
            owner, _, name = target.partition(":")
            if len(chain) == 1 and _private(chain[0]):
                out.append((node.lineno, f"{owner}.{name}.{chain[0]}"))
                reported.add(id(node))
            continue
        dotted = target
        for i, part in enumerate(chain):  # walk down through modules; report the step past them
            if f"{dotted}.{part}" in modules:
                dotted = f"{dotted}.{part}"
                continue
            if i == len(chain) - 1 and _private(part) and dotted != module:
                out.append((node.lineno, f"{dotted}.{part}"))
                reported.add(id(node))
            break
    fields = _defined_fields(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in HOT_FIELDS and node.attr not in fields
                and id(node) not in reported
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            out.append((node.lineno, f".{node.attr}"))
    return sorted(out)


def package_private_reads(root: Path) -> dict[str, list[int]]:
    """The whole package's cross-module private reads (:func:`cross_module_reads`).

    Returns
    -------
    dict[str, list[int]]
        ``"cudalab/x.py: what"`` -> the lines where it happens.
    """
    modules = package_modules(root)
    out: dict[str, list[int]] = {}
    for module, path in modules.items():
        if path.suffix != ".py":
            continue
        rel = path.relative_to(root.parent).as_posix()
        for line, what in cross_module_reads(path.read_text(), module, modules,
                                             package=path.name == "__init__.py", filename=rel):
            out.setdefault(f"{rel}: {what}", []).append(line)
    return out


if __name__ == "__main__":  # python -m tests.helpers.privates > tests/helpers/privates_debt.py
    from tests.test_privates import ALLOWED, ROOT

    found = package_private_reads(ROOT / "cudalab")
    print('''"""Cross-module private reads that issue 35 is removing: ``tests/test_privates.py`` accepts
these and fails when one of them is gone (then delete its line). Generated by
``python -m tests.helpers.privates > tests/helpers/privates_debt.py``; being removed in issue 35;
must be empty. Never add a line by hand: use a public name, ``cudalab._internal``, or (with a
reason) ``tests/test_privates.py``'s ``ALLOWED``.
"""

DEBT: frozenset[str] = frozenset({''')
    for key in sorted(set(found) - set(ALLOWED)):
        print(f"    {key!r},")
    print("})")
