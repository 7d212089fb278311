"""Fixtures of the magics' tests: IPython's test shell, and fake torch and CuPy modules that
both ``sys.modules`` and the shell's user namespace hold (a cell's ``torch.…``/``cupy.…``).
A test module that needs a shell set up otherwise defines its own ``shell``."""

from __future__ import annotations

import sys

import pytest
from IPython.testing import globalipapp

from tests.helpers.fake_allocators import FakeCupy, FakeTorch


@pytest.fixture(scope="module")
def shell():
    return globalipapp.get_ipython()


def _in_shell(monkeypatch, shell, name, fake):
    monkeypatch.setitem(sys.modules, name, fake)
    shell.user_ns[name] = fake
    yield fake
    shell.user_ns.pop(name, None)


@pytest.fixture
def torch(monkeypatch, shell):
    """A :class:`FakeTorch` as ``torch`` in ``sys.modules`` and in the shell's namespace."""
    yield from _in_shell(monkeypatch, shell, "torch", FakeTorch())


@pytest.fixture
def cupy(monkeypatch, shell):
    """A :class:`FakeCupy` as ``cupy`` in ``sys.modules`` and in the shell's namespace."""
    yield from _in_shell(monkeypatch, shell, "cupy", FakeCupy())
