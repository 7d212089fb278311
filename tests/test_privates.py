"""Owners keep their privates: no cudalab module reads another module's private names where
the owner documents a public one for that reader (the allocator registry's lists, nvtx's
per-thread ranges and flag, the async allocator's messages).

An AST scan (:func:`tests.helpers.privates.private_reads`) of every module of ``cudalab``
but the owner; the planted cases show it can fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.privates import private_reads

ROOT = Path(__file__).resolve().parents[1]


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
