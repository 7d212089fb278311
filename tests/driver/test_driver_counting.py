"""cudalab.testing.count_calls: counting driver calls, and what it pins (no call on a cache hit)."""

from __future__ import annotations

import cudalab
from cudalab import devices
from cudalab.testing import COUNTED, count_calls


def test_counts_and_restores():
    cudalab.init()
    backend = devices.backend()
    fast = devices.seam_fast_calls
    before = {n: n in vars(backend) for n in COUNTED}
    with count_calls() as counts:
        ev = cudalab.Event()
        ev.record()
        cudalab.synchronize()
    assert counts["event_create"] == 1 and counts["event_record"] == 1
    assert counts["synchronize"] == 1
    assert devices.seam_fast_calls is fast
    assert {n: n in vars(backend) for n in COUNTED} == before


def test_a_cache_hit_makes_no_driver_call():
    import cudalab.memory as cm

    cudalab.init()
    names = COUNTED + ("mem_alloc", "mem_free", "mem_get_info", "set_context")
    for _ in range(3):  # a cached block and the pair memo
        cm.caching_allocator_delete(cm.caching_allocator_alloc(4096))
    with count_calls(names) as counts:
        for size in (4096, 4096, 3000, 100_000):  # pure hits, a general hit, a best fit
            cm.caching_allocator_delete(cm.caching_allocator_alloc(size))
        a = cudalab.empty(1024, dtype="uint8")
        del a
    assert sum(counts.values()) == 0, dict(counts)
    with count_calls(names) as counts:  # (and a miss is seen)
        cm.caching_allocator_delete(cm.caching_allocator_alloc(1 << 30))
    assert counts["mem_alloc"] == 1
    cm.empty_cache()
