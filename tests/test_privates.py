"""Private means private: no cudalab module reads another module's ``_private`` names.

* Package-wide (:func:`tests.helpers.privates.package_private_reads`): imports (relative ones
  too), module attributes (``devices._tls``), private names on imported classes, and the hot
  instance fields (``stream._handle``, ``array._ptr``, ...) read on anything but ``self`` /
  ``cls`` outside the modules that define them. What it finds must be on :data:`ALLOWED` (at
  most 40 entries, each with its reason) or on the shrinking ``DEBT`` of
  ``tests/helpers/privates_debt.py``; an entry of either that no longer happens fails, so the
  lists only shrink.
* Per owner (:func:`tests.helpers.privates.private_reads`): the modules that document a public
  name for each of their readers (the allocator registry's lists, nvtx's per-thread ranges and
  flag, the async allocator's messages).

The planted cases show that both scans can fail.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.helpers.privates import HOT_FIELDS, cross_module_reads, package_private_reads, private_reads
from tests.helpers.privates_debt import DEBT

ROOT = Path(__file__).resolve().parents[1]

#: Cross-module private reads that stay, each with its reason (at most 40 entries). A key is
#: ``"<reading file>: <owner module>.<name>"``, or ``"<reading file>: .<field>"`` for a hot
#: instance field.
ALLOWED: dict[str, str] = {
    # "cudalab/x.py: cudalab.y._name": "why x must read it (and why y cannot offer a public name)",
}
MAX_ALLOWED = 40


@functools.cache
def _package_reads() -> dict[str, list[int]]:
    return package_private_reads(ROOT / "cudalab")


def test_no_module_reads_another_modules_privates():
    found = _package_reads()
    new = {k: lines for k, lines in found.items() if k not in ALLOWED and k not in DEBT}
    assert new == {}, ("cross-module private reads: use a public name or cudalab._internal "
                       "(file: owner.name -> lines)")


def test_the_allow_list_is_short_and_reasoned():
    assert len(ALLOWED) <= MAX_ALLOWED
    assert all(reason.strip() for reason in ALLOWED.values())
    assert not set(ALLOWED) & DEBT


def test_allowed_and_debt_entries_still_happen():
    """An entry whose read is gone must leave its list (the lists only shrink)."""
    found = _package_reads()
    assert sorted((set(ALLOWED) | DEBT) - set(found)) == []


_MODULES = {"cudalab", "cudalab.devices", "cudalab.streams", "cudalab.magics",
            "cudalab.magics.timing", "cudalab.magics.memory_args", "cudalab._driver",
            "cudalab._driver.cuda_api", "cudalab._driver.cuda", "cudalab.array"}


def _scan(source: str, module: str = "cudalab.magics.timing", package: bool = False) -> list[str]:
    return [what for _, what in cross_module_reads(source, module, _MODULES, package=package)]


@pytest.mark.parametrize("source, what", [
    ("from cudalab.devices import _tls", "cudalab.devices._tls"),
    ("from .memory_args import _parse as p", "cudalab.magics.memory_args._parse"),
    ("from ..devices import _backend", "cudalab.devices._backend"),
    ("from .. import devices\ndevices._tls.device", "cudalab.devices._tls"),
    ("from cudalab import devices as d\nd._ensure_context(0)", "cudalab.devices._ensure_context"),
    ("import cudalab.devices\ncudalab.devices._tls", "cudalab.devices._tls"),
    ("import cudalab\ndef f():\n    return cudalab.streams._custom", "cudalab.streams._custom"),
    ("def f():\n    import cudalab.streams as s\n    return s._exiting", "cudalab.streams._exiting"),
    ("from cudalab.array import DeviceArray\nDeviceArray._output(1)", "cudalab.array.DeviceArray._output"),
    ("def f(stream):\n    return stream._handle", "._handle"),
    ("def f(a, b):\n    return a._ptr + b.x._nbytes", "._ptr"),
])
def test_the_package_scan_catches_planted_reads(source, what):
    assert what in _scan(source)


def test_the_package_scan_resolves_a_packages_own_relative_imports():
    assert _scan("from ._driver.cuda_api import _cuInit", "cudalab", package=True) == [
        "cudalab._driver.cuda_api._cuInit"]
    assert _scan("from .cuda_api import _drv", "cudalab._driver.cuda") == ["cudalab._driver.cuda_api._drv"]


@pytest.mark.parametrize("source", [
    "from cudalab import _driver",  # a private module of the package: not a private name
    "from . import memory_args\nmemory_args.parse(1)",
    "from cudalab.devices import device_count, __all__",
    "import cudalab\ncudalab.devices.__name__",
    "_x = 1\ndef f():\n    return _x",
    "class C:\n    def f(self):\n        return self._handle, self.x",
    "class C:\n    @classmethod\n    def f(cls):\n        return cls._dtype",
    "class C:\n    __slots__ = ('_handle',)\ndef f(c):\n    return c._handle",  # its own class's field
    "def f(stream):\n    return stream._other, stream.handle",  # not a hot field
    "from cudalab.array import Stats\nStats._fields, Stats(1)._replace(a=2)",  # named tuple API
    "from cudalab.magics.timing import _own\n",  # its own privates
])
def test_the_package_scan_allows_public_names_own_privates_and_self(source):
    assert _scan(source) == []


def test_the_hot_fields_are_the_issues_list():
    assert HOT_FIELDS == {"_handle", "_ptr", "_dtype", "_shape", "_strides", "_device", "_nbytes",
                          "_contiguous"}


OWNED = {  # module -> the file that owns it (the only one that may read its privates)
    "cudalab.allocator.registry": "cudalab/allocator/registry.py",
    "cudalab.allocator.async_allocator": "cudalab/allocator/async_allocator.py",
    "cudalab.nvtx": "cudalab/nvtx.py",
}


def _sources() -> list[Path]:
    return sorted((ROOT / "cudalab").rglob("*.py"))


@pytest.mark.parametrize("target", sorted(OWNED))
def test_no_module_reads_an_owners_privates(target):
    found = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel == OWNED[target]:
            continue
        found += private_reads(path.read_text(), target, rel)
    assert found == []


@pytest.mark.parametrize("source", [
    "from cudalab.allocator import registry as r\nr._allocators[0]",
    "from cudalab.allocator import registry\nregistry._active",
    "import cudalab.allocator.registry as R\nR._custom",
    "import cudalab\ncudalab.allocator.registry._on_create.append(f)",
    "from cudalab.allocator.registry import _allocators",
    "def f():\n    from cudalab.allocator import registry as al\n    return al._allocators",
])
def test_the_scan_catches_planted_reads(source):
    assert len(private_reads(source, "cudalab.allocator.registry")) == 1


@pytest.mark.parametrize("source", [
    "from cudalab import nvtx as _nvtx\n_nvtx._used",
    "from cudalab.nvtx import _tls as t",
    "import cudalab.nvtx\ncudalab.nvtx._tls.__dict__",
    "import cudalab\ndef f():\n    return cudalab.nvtx._used",
])
def test_the_scan_catches_planted_nvtx_reads(source):
    assert len(private_reads(source, "cudalab.nvtx")) == 1


@pytest.mark.parametrize("source", [
    "from cudalab.allocator import registry as r\nr.allocators[0]",
    "from cudalab.allocator.registry import active, allocators",
    "import cudalab\ncudalab.allocator.registry.__all__",
    "from cudalab.allocator import caching\ncaching._custom",
    "from cudalab.allocator import registry\nregistry.active[0]._trace",
])
def test_the_scan_allows_public_names_and_other_modules(source):
    assert private_reads(source, "cudalab.allocator.registry") == []
