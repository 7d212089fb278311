"""The caching allocator's policy: sizes, pools, best fit, split/merge, oversize blocks,
streams, record_stream, the slow path up to OutOfMemoryError, and errors that lose nothing.

Each test builds a private :class:`DeviceCachingAllocator` over the session backend (the
simulator in CI, the real driver on a GPU machine), so the global allocator is untouched;
tests that need a tiny device build their own simulator.
"""

from __future__ import annotations

import re

import pytest

from cudalab.allocator.caching import DeviceCachingAllocator
from cudalab.allocator.config import AllocatorConfig, parse_alloc_conf
from cudalab.allocator.hooks import attach_trace
from cudalab.allocator.policy import allocation_size, round_size, roundup_power2_next_division
from cudalab.allocator.registry import create_allocator, native_allocator
from cudalab.allocator.uncached import UncachedAllocator
from cudalab.errors import OutOfMemoryError
from tests.helpers.counting_backend import CountingBackend

KiB = 1024
MiB = 1024 * 1024


def make(backend, conf: str | None = None, **kw) -> DeviceCachingAllocator:
    cfg = parse_alloc_conf(conf) if conf else AllocatorConfig()
    return native_allocator(backend, 0, cfg, stream_resolver=lambda: 0, **kw)


@pytest.fixture
def allocs(backend):
    """Factory of private allocators, checked and emptied after the test."""
    made: list[DeviceCachingAllocator] = []

    def factory(conf: str | None = None) -> DeviceCachingAllocator:
        a = make(backend, conf)
        made.append(a)
        return a

    yield factory
    for a in made:
        a.check_invariants()
        for ptr in list(a.live):
            a.free(ptr)
        a.empty_cache()
        assert a.segments() == []


@pytest.fixture
def alloc(allocs):
    return allocs()


def stat(a, key: str) -> int:
    return a.memory_stats()[key]


def seg_of(a, ptr: int) -> dict:
    for seg in a.segments():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg
    raise AssertionError(f"{ptr:#x} is in no segment")


def block_of(a, ptr: int) -> dict:
    for b in seg_of(a, ptr)["blocks"]:
        if b["address"] == ptr:
            return b
    raise AssertionError(f"{ptr:#x} starts no block")


# --------------------------------------------------------------------------- rounding
def test_round_size_follows_torch():
    assert round_size(1) == 512
    assert round_size(512) == 512
    assert round_size(513) == 1024
    assert round_size(1_500_000) == 1_500_160
    cfg = parse_alloc_conf("roundup_power2_divisions:4")
    # torch only rounds to divisions when size > 512 * divisions ...
    assert round_size(1200, cfg) == 1536
    # ... while its helper alone gives the documented example
    assert roundup_power2_next_division(1200, 4) == 1280
    assert round_size(3000, cfg) == 3072
    assert round_size(1_300_000, cfg) == 1_310_720
    assert round_size(4096, cfg) == 4096  # powers of two stay
    cfg8 = parse_alloc_conf("roundup_power2_divisions:[1:2,>:8]")
    assert cfg8.divisions_for(1 * MiB) == 2  # sizes below 2 MiB use entry 0
    assert cfg8.divisions_for(3 * MiB) == 8  # [2, 4) MiB: filled by ">"
    assert round_size(3 * MiB + 1, cfg8) == 3 * MiB + 256 * KiB
    assert roundup_power2_next_division(1 << 20, 4) == 1 << 20


def test_allocation_size_follows_torch():
    assert allocation_size(512) == 2 * MiB
    assert allocation_size(1 * MiB) == 2 * MiB
    assert allocation_size(1 * MiB + 512) == 20 * MiB
    assert allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB
    assert allocation_size(11 * MiB) == 12 * MiB
    assert allocation_size(11 * MiB + 512) == 12 * MiB


# --------------------------------------------------------------------------- pools and segments
def test_one_byte_gets_512_bytes_in_a_2mib_small_segment(alloc):
    p = alloc.malloc(1)
    s = alloc.memory_stats()
    assert s["allocated_bytes.all.current"] == 512
    assert s["requested_bytes.all.current"] == 1
    assert s["reserved_bytes.small_pool.current"] == 2 * MiB
    assert s["segment.small_pool.current"] == 1
    seg = seg_of(alloc, p)
    assert seg["segment_type"] == "small" and seg["total_size"] == 2 * MiB
    assert [b["size"] for b in seg["blocks"]] == [512, 2 * MiB - 512]
    assert seg["address"] == p


def test_small_pool_boundary_is_1mib(allocs):
    a = allocs()
    p = a.malloc(1 * MiB)
    assert seg_of(a, p)["segment_type"] == "small"
    assert a.memory_stats()["reserved_bytes.small_pool.current"] == 2 * MiB
    b = allocs()
    q = b.malloc(1 * MiB + 1)
    assert seg_of(b, q)["segment_type"] == "large"
    assert b.memory_stats()["reserved_bytes.large_pool.current"] == 20 * MiB
    assert block_of(b, q)["size"] == 1 * MiB + 512


def test_one_and_a_half_mib_gets_a_20mib_segment(alloc):
    p = alloc.malloc(1536 * KiB)
    seg = seg_of(alloc, p)
    assert seg["total_size"] == 20 * MiB and seg["segment_type"] == "large"
    assert [b["size"] for b in seg["blocks"]] == [1536 * KiB, 20 * MiB - 1536 * KiB]


def test_eleven_mib_gets_a_12mib_segment(alloc):
    p = alloc.malloc(11 * MiB)
    seg = seg_of(alloc, p)
    assert seg["total_size"] == 12 * MiB
    # remainder 1 MiB is not > 1 MiB: the whole segment is handed out
    assert [b["size"] for b in seg["blocks"]] == [12 * MiB]
    assert alloc.memory_stats()["allocated_bytes.all.current"] == 12 * MiB


def test_ten_mib_exactly_gets_its_own_size(alloc):
    p = alloc.malloc(10 * MiB)
    assert seg_of(alloc, p)["total_size"] == 10 * MiB
    q = alloc.malloc(10 * MiB - 512)
    assert seg_of(alloc, q)["total_size"] == 20 * MiB


def test_large_blocks_split_only_above_1mib_remainder(alloc):
    p = alloc.malloc(19 * MiB + 512 * KiB)  # segment 20 MiB, remainder 0.5 MiB: no split
    assert block_of(alloc, p)["size"] == 20 * MiB
    assert stat(alloc, "allocated_bytes.large_pool.current") == 20 * MiB
    assert stat(alloc, "requested_bytes.large_pool.current") == 19 * MiB + 512 * KiB
    alloc.free(p)
    q = alloc.malloc(18 * MiB)  # reuse: remainder 2 MiB > 1 MiB: split
    assert q == p
    assert [b["size"] for b in seg_of(alloc, q)["blocks"]] == [18 * MiB, 2 * MiB]
    r = alloc.malloc(1 * MiB + 512 * KiB)  # fits the 2 MiB remainder, 0.5 MiB left: no split
    assert r == p + 18 * MiB
    assert block_of(alloc, r)["size"] == 2 * MiB
    assert stat(alloc, "reserved_bytes.all.current") == 20 * MiB


def test_small_blocks_split_down_to_512_bytes(alloc):
    p = alloc.malloc(2 * MiB - 1024)  # rounds to 2 MiB - 1024 > 1 MiB: large pool
    assert seg_of(alloc, p)["segment_type"] == "large"
    q = alloc.malloc(1 * MiB)
    r = alloc.malloc(1 * MiB - 512)
    assert r == q + 1 * MiB
    assert [b["size"] for b in seg_of(alloc, q)["blocks"]] == [1 * MiB, 1 * MiB - 512, 512]


# --------------------------------------------------------------------------- split / merge / best fit
def test_split_and_merge_with_both_neighbours(alloc):
    a = alloc.malloc(1000)
    b = alloc.malloc(3000)
    c = alloc.malloc(5000)
    assert (b - a, c - b) == (1024, 3072)
    s = alloc.memory_stats()
    assert s["inactive_split.small_pool.current"] == 1  # the tail
    alloc.free(b)
    s = alloc.memory_stats()
    assert s["inactive_split.small_pool.current"] == 2
    assert s["inactive_split_bytes.small_pool.current"] == 2 * MiB - 1024 - 3072 - 5120 + 3072
    alloc.free(a)  # merges with b's free block
    assert [x["size"] for x in seg_of(alloc, c)["blocks"]] == [4096, 5120, 2 * MiB - 9216]
    alloc.free(c)  # merges with both neighbours: the segment is one free block again
    assert [x["size"] for x in alloc.segments()[0]["blocks"]] == [2 * MiB]
    s = alloc.memory_stats()
    assert s["inactive_split.all.current"] == 0 and s["inactive_split_bytes.all.current"] == 0
    alloc.check_invariants()


def test_best_fit_takes_smallest_block_then_lowest_address(alloc):
    ptrs = [alloc.malloc(n) for n in (4096, 512, 8192, 512, 4096, 512)]
    alloc.free(ptrs[0])  # 4096 @ 0
    alloc.free(ptrs[2])  # 8192 @ 4608
    alloc.free(ptrs[4])  # 4096 @ 13312
    assert alloc.malloc(4000) == ptrs[0]  # smallest fit, lowest address
    assert alloc.malloc(4000) == ptrs[4]
    assert alloc.malloc(4000) == ptrs[2]  # only the 8 KiB block is left: split it
    assert alloc.malloc(4000) == ptrs[2] + 4096


def test_blocks_are_never_reused_on_another_stream(alloc):
    p = alloc.malloc(4096, stream=0)
    alloc.free(p)
    q = alloc.malloc(4096, stream=12345)  # a different stream key: a new segment
    assert seg_of(alloc, q)["address"] != seg_of(alloc, p)["address"]
    assert seg_of(alloc, q)["stream"] == 12345
    assert stat(alloc, "segment.all.current") == 2
    alloc.free(q)
    assert alloc.malloc(4096, stream=0) == p


# --------------------------------------------------------------------------- oversize
def test_oversize_rules_with_max_split_size(allocs):
    a = allocs("max_split_size_mb:40")
    assert stat(a, "max_split_size") == 40 * MiB
    big = a.malloc(64 * MiB)
    s = a.memory_stats()
    assert s["oversize_allocations.current"] == 1 and s["oversize_segments.current"] == 1
    a.free(big)
    assert stat(a, "oversize_allocations.current") == 0
    small = a.malloc(30 * MiB)  # below max_split: never served by the oversize block
    assert small != big and seg_of(a, small)["total_size"] == 30 * MiB
    mid = a.malloc(50 * MiB)  # oversize request: 64 < 50 + 20, reused unsplit
    assert mid == big and block_of(a, mid)["size"] == 64 * MiB
    assert stat(a, "allocated_bytes.all.current") == 94 * MiB
    a.free(mid)
    other = a.malloc(40 * MiB)  # 64 >= 40 + 20: rejected, new 40 MiB segment
    assert other != big and seg_of(a, other)["total_size"] == 40 * MiB
    s = a.memory_stats()
    assert s["oversize_segments.current"] == 2 and s["oversize_allocations.peak"] == 1
    assert s["oversize_allocations.allocated"] == 3


def test_max_non_split_rounding_is_configurable(allocs):
    a = allocs("max_split_size_mb:40,max_non_split_rounding_mb:30")
    big = a.malloc(64 * MiB)
    a.free(big)
    assert a.malloc(40 * MiB) == big  # 64 < 40 + 30


def test_unlimited_max_split_size_reports_minus_one(alloc):
    assert stat(alloc, "max_split_size") == -1


# --------------------------------------------------------------------------- hot path
def test_cache_hits_make_no_driver_calls(backend):
    counting = CountingBackend(backend)
    a = make(counting)
    sizes = (512, 1 * MiB, 3 * MiB, 64 * MiB)
    for n in sizes:
        a.free(a.malloc(n))
    segments = a.memory_stats()["num_device_alloc"]
    assert counting.calls == ["mem_alloc"] * segments  # one per segment, nothing else
    for _ in range(50):
        for n in sizes:
            a.free(a.malloc(n))
    assert counting.calls == ["mem_alloc"] * segments
    a.empty_cache()
    assert counting.calls.count("mem_free") == segments


def test_trace_hook_sees_torchs_points(alloc):
    seen = []
    attach_trace(alloc, lambda action, addr, size, stream: seen.append((action, size)))
    p = alloc.malloc(100)
    alloc.free(p)
    alloc.empty_cache()
    assert seen == [("segment_alloc", 2 * MiB), ("alloc", 100), ("free_requested", 100),
                    ("free_completed", 100), ("segment_free", 2 * MiB)]


# --------------------------------------------------------------------------- record_stream


def test_record_stream_defers_reuse_until_events_complete(backend, allocs, hold):
    import cudalab

    s1, s2 = cudalab.Stream(), cudalab.Stream()
    a = allocs()
    p = a.malloc(4096, s1)
    a.record_stream(p, s2)
    a.record_stream(p, s1)  # the allocation stream: ignored
    hold(s2)
    a.free(p)
    s = a.memory_stats()
    assert s["allocated_bytes.all.current"] == 0
    assert s["active_bytes.all.current"] == 4096  # pending free: still active
    assert s["active.all.current"] == 1 and s["allocation.all.current"] == 0
    assert s["requested_bytes.all.current"] == 4096
    assert block_of(a, p)["state"] == "active_pending_free"
    q = a.malloc(4096, s1)  # not reused while s2 may still use it
    assert q != p
    a.check_invariants()
    hold.release()
    r = a.malloc(4096, s1)  # malloc processed the completed event: p is back
    assert r == p
    s = a.memory_stats()
    assert s["active.all.current"] == 2 and s["active.all.peak"] == 2
    assert s["active_bytes.all.freed"] == 4096
    a.free(q)
    a.free(r)
    a.check_invariants()
    assert a._event_pools[0].created == 1 and a._event_pools[0].idle() == 1


def test_pending_free_block_is_released_by_empty_cache(backend, allocs):
    import cudalab

    s1, s2 = cudalab.Stream(), cudalab.Stream()
    a = allocs()
    p = a.malloc(5 * MiB, s1)
    a.record_stream(p, s2)
    a.free(p)  # events recorded; nothing held, they complete soon
    a.empty_cache()  # synchronises all events first
    s = a.memory_stats()
    assert s["num_sync_all_streams"] == 1
    assert s["reserved_bytes.all.current"] == 0 and s["active.all.current"] == 0


def test_events_are_pooled_and_reused(backend, allocs):
    import cudalab

    s1, s2 = cudalab.Stream(), cudalab.Stream()
    a = allocs()
    for _ in range(5):
        p = a.malloc(1000, s1)
        a.record_stream(p, s2)
        a.free(p)
        s2.synchronize()
        a.process_events()
    assert a._event_pools[0].created == 1


# --------------------------------------------------------------------------- slow path and OOM
def _fraction_for(backend, nbytes: int) -> float:
    _, total = backend.mem_get_info(0)
    return (nbytes + 0.5) / total


def test_oom_message_follows_torch_and_memory_recovers(backend, allocs):
    a = allocs()
    a.set_memory_fraction(_fraction_for(backend, 64 * MiB))
    p = a.malloc(40 * MiB)
    with pytest.raises(OutOfMemoryError) as info:
        a.malloc(30 * MiB)
    msg = str(info.value)
    assert isinstance(info.value, RuntimeError)
    pattern = (
        r"CUDA out of memory\. Tried to allocate 30\.00 MiB\. GPU 0 has a total capacity of "
        r"\d+\.\d\d [KMG]iB of which \d+\.\d\d [KMG]iB is free\. Including non-cudalab memory, "
        r"this process has \d+\.\d\d [KMG]iB memory in use\. 64\.00 MiB allowed; Of the "
        r"allocated memory 40\.00 MiB is allocated by cudalab, and 0 bytes is reserved by "
        r"cudalab but unallocated\. If reserved but unallocated memory is large try setting "
        r"CUDALAB_ALLOC_CONF=expandable_segments:True \(PYTORCH_CUDA_ALLOC_CONF is also read\) "
        r"to avoid fragmentation\.  See documentation for Memory Management  "
        r"\(https://docs\.pytorch\.org/docs/stable/notes/cuda\.html"
        r"#optimizing-memory-usage-with-pytorch-cuda-alloc-conf\)$"
    )
    assert re.match(pattern, msg), msg
    s = a.memory_stats()
    assert s["num_ooms"] == 1 and s["num_alloc_retries"] == 1 and s["num_sync_all_streams"] == 1
    assert s["allocated_bytes.all.current"] == 40 * MiB
    a.free(p)
    q = a.malloc(30 * MiB)  # recovery: the cached 40 MiB block is split
    assert q == p
    a.check_invariants()


def test_oom_releases_unsplit_cached_blocks_of_other_streams(backend, allocs):
    a = allocs()
    a.set_memory_fraction(_fraction_for(backend, 150 * MiB))
    p = a.malloc(100 * MiB, stream=7)
    a.free(p)
    q = a.malloc(60 * MiB, stream=0)  # other stream: no reuse; over the cap: flush + retry
    s = a.memory_stats()
    assert s["num_alloc_retries"] == 1 and s["num_sync_all_streams"] == 1
    assert s["num_device_free"] == 1 and s["num_ooms"] == 0
    assert s["reserved_bytes.all.current"] == 60 * MiB
    a.free(q)


def test_release_available_cached_oversize_blocks_first(backend, allocs):
    a = allocs("max_split_size_mb:40")
    a.set_memory_fraction(_fraction_for(backend, 150 * MiB))
    big = a.malloc(100 * MiB)
    a.free(big)
    q = a.malloc(60 * MiB)  # 100 >= 60 + 20: not reusable; cap reached: free it, no retry
    s = a.memory_stats()
    assert s["num_device_free"] == 1 and s["num_alloc_retries"] == 0
    assert s["num_sync_all_streams"] == 0 and s["reserved_bytes.all.current"] == 60 * MiB
    a.free(q)


def test_oom_on_a_tiny_simulated_device_then_recovery(monkeypatch):
    from cudalab._driver.sim import SimulatorBackend

    monkeypatch.setenv("CUDALAB_SIMULATOR_MEMORY", "64MiB")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sim = SimulatorBackend()
    sim.init()
    a = make(sim)
    p = a.malloc(40 * MiB)
    q = a.malloc(1000)
    with pytest.raises(OutOfMemoryError) as info:
        a.malloc(30 * MiB)
    msg = str(info.value)
    assert "GPU 0 has a total capacity of 64.00 MiB of which 22.00 MiB is free" in msg
    assert "this process has 42.00 MiB memory in use" in msg
    assert "Of the allocated memory 40.00 MiB is allocated by cudalab, and 2.00 MiB is" in msg
    assert "allowed;" not in msg
    assert a.memory_stats()["num_ooms"] == 1
    a.free(p)
    r = a.malloc(30 * MiB)
    assert r == p
    a.free(q)
    a.free(r)
    a.empty_cache()
    assert sim.mem_get_info(0) == (64 * MiB, 64 * MiB)


def test_garbage_collection_frees_old_large_blocks_before_cudamalloc(backend, allocs):
    a = allocs("garbage_collection_threshold:0.5")
    a.set_memory_fraction(_fraction_for(backend, 100 * MiB))
    old = a.malloc(30 * MiB, stream=1)
    a.free(old)
    for _ in range(5):  # age the cached block: get_free_block calls on the large pool
        a.free(a.malloc(12 * MiB, stream=2))
    p = a.malloc(12 * MiB, stream=3)  # reserved 42 MiB <= 50 MiB: no GC, reserved 54 MiB
    assert a.memory_stats()["num_device_free"] == 0
    q = a.malloc(12 * MiB, stream=4)  # reserved 54 > 50: GC frees blocks of above-mean age
    s = a.memory_stats()
    assert s["num_device_free"] == 1 and s["num_sync_all_streams"] == 0
    assert s["reserved_bytes.all.current"] == 36 * MiB
    a.free(p)
    a.free(q)


def test_free_memory_callbacks_run_before_device_allocation(alloc):
    calls = []
    keep = [alloc.malloc(1 * MiB)]
    alloc.malloc(1 * MiB)  # the small segment is now full

    def callback():
        calls.append(1)
        if keep:
            alloc.free(keep.pop())
            return True
        return False

    alloc.add_free_memory_callback(callback)
    p = alloc.malloc(1000, stream=0)  # the callback frees a block: reused, no new segment
    assert calls == [1] and alloc.memory_stats()["segment.all.current"] == 1
    alloc.free(p)


# --------------------------------------------------------------------------- errors
def _snapshot(a):
    return a.memory_stats(), a.segments()


@pytest.mark.parametrize("bad", ["double", "foreign", "interior"])
def test_bad_pointers_raise_and_change_nothing(alloc, bad):
    p = alloc.malloc(1000)
    q = alloc.malloc(3000)
    alloc.free(q)
    ptr = {"double": q, "foreign": 0xDEAD0000, "interior": p + 512}[bad]
    before = _snapshot(alloc)
    with pytest.raises(ValueError, match=rf"pointer {ptr:#x} was not allocated by cudalab's "
                                         r"caching allocator \(double free or foreign pointer\)"):
        alloc.free(ptr)
    assert _snapshot(alloc) == before
    import cudalab

    with pytest.raises(ValueError):
        alloc.record_stream(ptr, cudalab.current_stream())
    assert _snapshot(alloc) == before
    alloc.check_invariants()


def test_bad_sizes_raise_and_change_nothing(alloc):
    alloc.malloc(1000)
    before = _snapshot(alloc)
    assert alloc.malloc(0) == 0  # torch returns a null pointer for 0 bytes
    alloc.free(0)  # and freeing it is a no-op
    with pytest.raises(ValueError, match="must be >= 0"):
        alloc.malloc(-1)
    with pytest.raises(TypeError):
        alloc.malloc(1.5)
    with pytest.raises(TypeError):
        alloc.malloc(True)
    with pytest.raises(TypeError):
        alloc.malloc("100")
    with pytest.raises(TypeError):
        alloc.free("0x100")
    with pytest.raises(OutOfMemoryError, match="more than 1EB"):
        alloc.malloc(1 << 61)
    with pytest.raises(TypeError):
        alloc.malloc(100, stream=1.5)
    assert _snapshot(alloc) == before
    import numpy as np

    p = alloc.malloc(np.int64(100))  # integer-like sizes are fine
    alloc.free(p)


def test_stream_of_another_device_is_rejected(backend, alloc, two_devices):
    import cudalab

    s = cudalab.Stream(device=1)
    with pytest.raises(ValueError, match="device 1"):
        alloc.malloc(100, stream=s)


def test_memory_fraction_validation(alloc):
    with pytest.raises(ValueError):
        alloc.set_memory_fraction(1.5)
    assert alloc.get_memory_fraction() == 1.0
    alloc.set_memory_fraction(0.5)
    assert alloc.get_memory_fraction() == pytest.approx(0.5)


# --------------------------------------------------------------------------- other allocators
def test_native_allocator_class_follows_the_expandable_setting(backend):
    from cudalab.allocator.expandable import ExpandableCachingAllocator

    assert isinstance(make(backend, "expandable_segments:True"), ExpandableCachingAllocator)
    assert type(make(backend, "expandable_segments:False")) is DeviceCachingAllocator
    # The stream-ordered pool backend is a different Allocator (create_allocator picks it);
    # the native class refuses to pretend to be it.
    with pytest.raises(ValueError, match="cudaMallocAsync"):
        make(backend, "backend:cudaMallocAsync")


def test_no_caching_passes_every_call_through(backend):
    counting = CountingBackend(backend)
    a = create_allocator(counting, 0, AllocatorConfig(), no_caching=True)
    assert isinstance(a, UncachedAllocator)
    p = a.malloc(1000)
    q = a.malloc(3 * MiB)
    assert counting.calls == ["mem_alloc", "mem_alloc"]
    s = a.memory_stats()
    assert s["allocated_bytes.all.current"] == 1000 + 3 * MiB
    assert s["segment.small_pool.current"] == 1 and s["segment.large_pool.current"] == 1
    assert s["num_device_alloc"] == 2
    a.free(p)
    a.free(q)
    assert counting.calls == ["mem_alloc", "mem_alloc", "mem_free", "mem_free"]
    s = a.memory_stats()
    assert s["reserved_bytes.all.current"] == 0 and s["num_device_free"] == 2
    with pytest.raises(ValueError, match="double free"):
        a.free(p)
    assert a.malloc(0) == 0


def test_no_caching_environment_selects_the_pass_through(monkeypatch, backend):
    from cudalab.allocator.config import no_caching_from_env

    monkeypatch.setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    assert no_caching_from_env()
    assert isinstance(create_allocator(backend, 0, AllocatorConfig()), UncachedAllocator)
    monkeypatch.setenv("CUDALAB_NO_MEMORY_CACHING", "0")  # ours wins, and says off
    assert not no_caching_from_env()


# --------------------------------------------------------------------------- snapshot schema
def test_segments_use_torchs_snapshot_schema(alloc):
    p = alloc.malloc(100)
    q = alloc.malloc(3 * MiB)
    segs = alloc.segments()
    assert [s["address"] for s in segs] == sorted(s["address"] for s in segs)
    for seg in segs:
        assert set(seg) == {"device", "address", "total_size", "allocated_size", "active_size",
                            "requested_size", "stream", "segment_type", "segment_pool_id",
                            "is_expandable", "frames", "blocks"}
        assert seg["segment_pool_id"] == (0, 0) and seg["is_expandable"] is False
        for b in seg["blocks"]:
            assert set(b) == {"address", "size", "requested_size", "state", "frames"}
    small = seg_of(alloc, p)
    assert small["allocated_size"] == 512 and small["requested_size"] == 100
    assert small["blocks"][1]["state"] == "inactive"
    assert block_of(alloc, q)["state"] == "active_allocated"
    import pickle

    assert pickle.loads(pickle.dumps(segs, protocol=4)) == segs


# --------------------------------------------------------------------------- pinned copies
def test_max_allocation_size_is_the_one_limit(backend):
    """Every allocator refuses MAX_ALLOCATION_SIZE bytes with torch's message, before any
    driver call (the malloc hot paths compare against the same name)."""
    import inspect

    from cudalab.allocator import async_allocator, caching, expandable, pluggable, policy, uncached

    assert policy.MAX_ALLOCATION_SIZE == 1 << 60
    for mod in (caching, expandable, async_allocator, uncached, pluggable, policy):
        assert "1152921504606846976" not in inspect.getsource(mod)
    with pytest.raises(OutOfMemoryError, match="more than 1EB"):
        policy.check_size(policy.MAX_ALLOCATION_SIZE)
    assert policy.check_size(policy.MAX_ALLOCATION_SIZE - 1) == policy.MAX_ALLOCATION_SIZE - 1
    for conf in ("", "expandable_segments:True", "backend:cudaMallocAsync"):
        a = create_allocator(backend, 0, parse_alloc_conf(conf) if conf else AllocatorConfig(),
                             no_caching=False, stream_resolver=lambda: 0)
        try:
            with pytest.raises(OutOfMemoryError, match="more than 1EB"):
                a.malloc(policy.MAX_ALLOCATION_SIZE)
            assert a.memory_stats()["num_device_alloc"] == 0
        finally:
            close = getattr(a, "close", None)
            if close is not None:
                close()
    u = UncachedAllocator(backend, 0, AllocatorConfig())
    with pytest.raises(OutOfMemoryError, match="more than 1EB"):
        u.malloc(policy.MAX_ALLOCATION_SIZE)


def _tracked(st) -> dict:
    """The counters the hot paths update inline (pools' current/peak/accumulated, the
    aggregate's peaks) of DeviceStats ``st``."""
    out = {}
    for code in ("n_alloc", "b_alloc", "b_req", "n_split", "b_split"):
        for name, c in (("small", st.small), ("large", st.large)):
            out[f"{name}.{code}"] = getattr(c, code)
            out[f"{name}.{code}_peak"] = getattr(c, code + "_peak")
            out[f"{name}.{code}_acc"] = getattr(c, code + "_acc")
        out[f"agg.{code}_peak"] = getattr(st.agg, code + "_peak")
    return out


def test_inline_peaks_match_increase(backend):
    """The cache-hit path writes out DeviceStats.increase for speed (malloc's split,
    _account_alloc, _free_block; see caching.py): replaying each operation's changes of the
    current values through increase/decrease on a reference DeviceStats must give the same
    counters, peaks and accumulated values, so the copies cannot drift from the method.
    (The pair memo is off: it defers these updates; test_allocator_memo pins it to this path.)"""
    import random

    from cudalab.allocator.stats import Counters, DeviceStats

    a = make(backend)
    a._memo_ok = False
    ref = DeviceStats(-1, Counters(), Counters())
    rng = random.Random(17)
    sizes = [1, 512, 3000, 65536, 1 << 20, (1 << 20) + 1, 3 << 20, 12 << 20, 25 << 20]
    live: list[int] = []
    try:
        for step in range(600):
            before = _tracked(a.stats)
            if live and (rng.random() < 0.45 or len(live) > 24):
                a.free(live.pop(rng.randrange(len(live))))
            else:
                live.append(a.malloc(rng.choice(sizes) + rng.randrange(0, 2048)))
            after = _tracked(a.stats)
            for code in ("n_alloc", "b_alloc", "b_req", "n_split", "b_split"):
                for name, refpool in (("small", ref.small), ("large", ref.large)):
                    delta = after[f"{name}.{code}"] - before[f"{name}.{code}"]
                    if delta > 0:
                        ref.increase(refpool, code, delta)
                    elif delta < 0:
                        ref.decrease(refpool, code, -delta)
            assert _tracked(ref) == after, f"step {step}"
        assert after["small.n_split_peak"] > 0 and after["large.b_split_peak"] > 0
    finally:
        for p in live:
            a.free(p)
        a.empty_cache()
