"""cudalab.memory.peak_scope: region peaks that never reset the global peak."""

from __future__ import annotations

import pytest

import cudalab
import cudalab.memory as cm


def _alloc(n):
    return cm.caching_allocator_alloc(n)


def test_scope_peak_and_global_peak_untouched():
    cudalab.init()
    big = _alloc(8 << 20)
    cm.caching_allocator_delete(big)
    global_peak = cm.max_memory_allocated()
    base = cm.memory_allocated()
    with cm.peak_scope() as s:
        p = _alloc(1 << 20)
        q = _alloc(1 << 20)
        cm.caching_allocator_delete(p)
        cm.caching_allocator_delete(q)
        assert s.peak_allocated == base + (2 << 20)  # live reading
    assert s.start_allocated == base and s.end_allocated == base
    assert s.peak_allocated == base + (2 << 20)
    assert cm.max_memory_allocated() == global_peak  # not reset, not lowered
    assert s.delta_allocated == 0 and s.elapsed >= 0


def test_nested_scopes_and_outer_sees_inner_peak():
    cudalab.init()
    base = cm.memory_allocated()
    with cm.peak_scope() as outer:
        with cm.peak_scope() as inner:
            p = _alloc(3 << 20)
            cm.caching_allocator_delete(p)
        q = _alloc(1 << 20)
        with cm.peak_scope() as inner2:
            pass
        cm.caching_allocator_delete(q)
    assert inner.peak_allocated == base + (3 << 20)
    assert inner2.peak_allocated == base + (1 << 20)  # start value: q was live
    assert outer.peak_allocated == base + (3 << 20)


def test_reset_peak_inside_a_scope_keeps_the_scope_peak():
    cudalab.init()
    base = cm.memory_allocated()
    with cm.peak_scope() as s:
        p = _alloc(4 << 20)
        cm.caching_allocator_delete(p)
        cm.reset_peak_memory_stats()
        assert cm.max_memory_allocated() == base
        q = _alloc(1 << 20)
        cm.caching_allocator_delete(q)
        assert cm.max_memory_allocated() == base + (1 << 20)  # the peak still works
    assert s.peak_allocated == base + (4 << 20)


def test_memo_hits_inside_a_scope_count():
    cudalab.init()
    for _ in range(3):  # leave a memo (deferred pair) behind
        cm.caching_allocator_delete(_alloc(4096))
    base = cm.memory_allocated()
    with cm.peak_scope() as s:
        for _ in range(3):
            cm.caching_allocator_delete(_alloc(4096))
    assert s.peak_allocated == base + 4096


def test_scope_misuse_is_a_clear_error():
    cudalab.init()
    s = cm.peak_scope()
    with pytest.raises(RuntimeError, match="not running"):
        s.stop()
    s.start()
    with pytest.raises(RuntimeError, match="already running"):
        s.start()
    s.stop()
    with pytest.raises(ValueError):
        cm.peak_scope(99)


def test_scopes_closing_out_of_order():
    cudalab.init()
    base = cm.memory_allocated()
    a = cm.peak_scope().start()
    p = _alloc(8 << 20)
    cm.caching_allocator_delete(p)
    b = cm.peak_scope().start()  # opened inside a, closed after it
    q = _alloc(1 << 20)
    a.stop()
    cm.caching_allocator_delete(q)
    b.stop()
    assert a.peak_allocated == base + (8 << 20)
    assert b.peak_allocated == base + (1 << 20)


@pytest.mark.parametrize("conf", ["backend:cudaMallocAsync", None])
def test_scope_over_allocators_with_either_lock(backend, monkeypatch, conf):
    # A scope takes the allocator's lock through the lock's own acquire/release, so it works
    # the same over a TokenLock (native) and a threading.Lock (cudaMallocAsync).
    import threading

    from cudalab.allocator import scope as scope_mod
    from cudalab.allocator.config import AllocatorConfig, parse_alloc_conf
    from cudalab.allocator.registry import create_allocator
    from cudalab.allocator.token_lock import TokenLock

    cfg = parse_alloc_conf(conf) if conf else AllocatorConfig()
    a = create_allocator(backend, 0, cfg, stream_resolver=lambda: 0)
    assert isinstance(a._lock, type(threading.Lock()) if conf else TokenLock)
    monkeypatch.setattr(scope_mod, "_allocator", lambda device: a)
    keep = a.malloc(1 << 20)
    with scope_mod.PeakScope(0) as s:
        p = a.malloc(3 << 20)
        a.free(p)
    assert not a._lock.locked() and a._scopes == []
    assert s.start_allocated == s.end_allocated == a.stats.small.b_alloc + a.stats.large.b_alloc
    assert s.peak_allocated == s.start_allocated + (3 << 20)
    a.free(keep)
    a.empty_cache()
    if hasattr(a, "close"):
        a.close()
