"""Names a package loads on first use (PEP 562), so ``import cudalab`` stays cheap.

One implementation of the module-level ``__getattr__`` and ``__dir__`` that
:mod:`cudalab.comm`, :mod:`cudalab.cluster` and :mod:`cudalab.widgets` share: each keeps a
table of its public names and the submodule that owns each, and binds the two functions
this module makes::

    __getattr__, __dir__ = lazy_names(__name__, _OWNERS, globals())

A name is imported from its owner on its first read and then stored in the package's
namespace, so later reads never come back here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, owners: Mapping[str, str], namespace: dict[str, Any]
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``.

    Parameters
    ----------
    package : str
        The package's dotted name (its ``__name__``), for the AttributeError's message.
    owners : mapping of str to str
        Each lazily loaded public name and the dotted name of the module that defines it.
    namespace : dict
        The package's ``globals()``: a loaded name is stored there.

    Returns
    -------
    tuple of callables
        ``__getattr__(name)``, which raises ``AttributeError`` (as a module does) for a
        name not in ``owners``, and ``__dir__()``, the package's names and the lazy ones,
        sorted.
    """

    def __getattr__(name: str) -> Any:
        owner = owners.get(name)
        if owner is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(owner), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(owners))

    return __getattr__, __dir__
