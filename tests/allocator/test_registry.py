"""The registry's public fields (``allocators``, ``active``, ``custom_factory``) and their
invariants (that no other module reads its privates is checked by tests/test_privates.py)."""

from __future__ import annotations


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
