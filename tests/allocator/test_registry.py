"""The registry's public fields (``allocators``, ``active``, ``custom_factory``) and their
invariants, and that no module outside the registry reads its privates."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.privates import private_reads

ROOT = Path(__file__).resolve().parents[2]


def test_allocators_and_active_are_filled_in_one_step(backend):
    import cudalab
    from cudalab.allocator import registry

    cudalab.memory.caching_allocator_delete(cudalab.memory.caching_allocator_alloc(512))
    a = registry.allocators[0]
    assert a is not None
    assert a in registry.active
    assert registry.existing_allocator(0) is a
    assert registry.get_allocator(0) is a  # never replaced once set
    assert [x for x in registry.allocators if x is not None] == sorted(
        registry.active, key=lambda x: x.device)


def test_the_facade_binds_the_registry_lists_once():
    """cudalab.memory's hot getters index the lists bound at import: the registry must
    never rebind them (reset clears them in place)."""
    from cudalab import memory
    from cudalab.allocator import registry

    assert memory._allocators is registry.allocators
    assert memory._active is registry.active
    ids = id(registry.allocators), id(registry.active)
    with registry._registry_lock:  # what _reset_for_tests does, without losing the state
        saved = list(registry.allocators), list(registry.active)
        registry.allocators.clear()
        registry.active.clear()
        registry.allocators[:] = saved[0]
        registry.active[:] = saved[1]
    assert (id(registry.allocators), id(registry.active)) == ids


def test_custom_factory_reads_the_installed_allocator():
    from cudalab.allocator import registry

    assert registry.custom_factory() is registry._custom


OWNED = {  # module -> the file that owns it (the only one that may read its privates)
    "cudalab.allocator.registry": "cudalab/allocator/registry.py",
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
    "from cudalab.allocator import registry as r\nr.allocators[0]",
    "from cudalab.allocator.registry import active, allocators",
    "import cudalab\ncudalab.allocator.registry.__all__",
    "from cudalab.allocator import caching\ncaching._custom",
    "from cudalab.allocator import registry\nregistry.active[0]._trace",
])
def test_the_scan_allows_public_names_and_other_modules(source):
    assert private_reads(source, "cudalab.allocator.registry") == []
