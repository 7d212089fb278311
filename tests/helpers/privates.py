"""Find reads of one module's private names from other modules' source (an AST scan).

:func:`private_reads` reports, in a module's source, every

* ``from <target> import _name`` (also ``from <target> import _name as x``);
* attribute access ``X._name`` where ``X`` is bound to ``<target>`` by an import
  (``import a.b.target as X``, ``from a.b import target as X``), or a chain from a parent
  package (``import cudalab`` then ``cudalab.nvtx._tls``), imports inside functions included.

Dunder names (``__all__``) are not private. Used by the tests that keep each owner's
privates private (the registry, nvtx, the async allocator).
"""

from __future__ import annotations

import ast

__all__ = ["private_reads"]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


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
