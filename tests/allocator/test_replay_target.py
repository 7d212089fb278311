"""The allocator's interface for trace replays (cudalab.allocator.replay_target) and the
private simulator it runs over (cudalab._internal.private_simulator)."""

from __future__ import annotations

import pytest

from cudalab import _internal
from cudalab.allocator.async_allocator import AsyncPoolAllocator
from cudalab.allocator.caching import DeviceCachingAllocator
from cudalab.allocator.config import AllocatorConfig, parse_alloc_conf
from cudalab.allocator.expandable import ExpandableCachingAllocator
from cudalab.allocator.registry import existing_allocator
from cudalab.allocator.replay_target import ReplayTarget

MiB = 1 << 20


def test_private_simulator_is_the_callers_own():
    sim = _internal.private_simulator(memory=64 * MiB)
    other = _internal.private_simulator(memory=64 * MiB)
    assert sim is not other and sim.name == "simulator"
    assert sim.device_count() == 1
    assert sim.mem_get_info(0)[1] == 64 * MiB
    ptr = sim.mem_alloc(0, MiB)
    assert sim.mem_get_info(0)[0] == 63 * MiB
    assert other.mem_get_info(0)[0] == 64 * MiB  # nothing shared
    sim.mem_free(0, ptr)
    with pytest.raises(ValueError):
        _internal.private_simulator(memory=1)  # below the simulator's 1 MiB


def test_native_target_keeps_counters_current_after_every_call():
    target = ReplayTarget(_internal.private_simulator(memory=256 * MiB), AllocatorConfig())
    alloc = target.allocator
    assert type(alloc) is DeviceCachingAllocator and not target.is_async
    assert target.pool_usage is None and target.stats is alloc.stats
    assert existing_allocator(0) is not alloc  # registered nowhere
    assert alloc._trace is None
    for i in range(1, 4):  # the same pair again and again: with the memo these are hits
        ptr = target.malloc(1000, 0)
        assert target.allocated() == 1024 and target.reserved() == 2 * MiB
        target.free(ptr)
        assert target.allocated() == 0
        stats = target.memory_stats()
        assert stats["allocation.all.allocated"] == stats["allocation.all.freed"] == i
        assert alloc.memo_block is None
    assert target.stream_key(7) == 7  # the native allocator takes stream keys as they are
    target.free(0)  # a failed allocation's slot: a no-op
    target.close()


def test_reconfigure_keeps_the_memo_off():
    target = ReplayTarget(_internal.private_simulator(memory=256 * MiB), AllocatorConfig())
    alloc = target.allocator
    assert isinstance(alloc, DeviceCachingAllocator)
    alloc.reconfigure(parse_alloc_conf("garbage_collection_threshold:0.5"))
    target.free(target.malloc(1000, 0))
    target.free(target.malloc(1000, 0))
    assert alloc.memo_block is None and target.memory_stats()["allocation.all.freed"] == 2


def test_expandable_target():
    cfg = parse_alloc_conf("expandable_segments:True")
    target = ReplayTarget(_internal.private_simulator(memory=256 * MiB), cfg)
    assert type(target.allocator) is ExpandableCachingAllocator
    ptr = target.malloc(3 * MiB, 0)
    assert target.allocated() == 3 * MiB and target.reserved() >= 3 * MiB
    target.free(ptr)


def test_async_target_streams_and_usage():
    cfg = parse_alloc_conf("backend:cudaMallocAsync")
    target = ReplayTarget(_internal.private_simulator(memory=256 * MiB), cfg)
    assert type(target.allocator) is AsyncPoolAllocator and target.is_async
    assert target.pool_usage is not None
    assert [target.stream_key(s) for s in (0, 1, 2)] == [0, 1, 2]
    seven = target.stream_key(7)
    assert seven not in (0, 1, 2, 7) and target.stream_key(7) == seven
    assert target.stream_key(8) != seven
    ptr = target.malloc(1000, seven)
    assert target.allocated() == 1000  # requested bytes (torch's pytorch_used_bytes)
    reserved, high, used, _ = target.pool_usage()
    assert target.reserved() == reserved == high > 0 and used >= 1000
    target.free(ptr)
    assert target.allocated() == 0
    target.close()
