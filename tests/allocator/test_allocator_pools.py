"""Private memory pools (torch's graph pools and MemPools) in the caching allocator.

A capture is faked with a routing filter that accepts one chosen stream key (the graphs
module passes a filter on the capture id; ``use_mem_pool`` one on the calling thread).
Each test builds a private allocator over the session backend, except the MemPool tests,
which use the device's allocator through the public API.
"""

from __future__ import annotations

import gc
import threading

import pytest

import cudalab
from cudalab._driver.sim import SimulatorBackend, SimulatorConfig
from cudalab.allocator import pools
from cudalab.allocator.caching import DeviceCachingAllocator
from cudalab.allocator.config import AllocatorConfig, parse_alloc_conf
from cudalab.allocator.mem_pool import on_use_mem_pool
from cudalab.allocator.pluggable import PluggableAllocator
from cudalab.allocator.registry import get_allocator, native_allocator
from cudalab.allocator.uncached import UncachedAllocator
from cudalab.errors import OutOfMemoryError

KiB = 1024
MiB = 1024 * 1024
CAPTURE = 7  # the stream key of the fake capture
OTHER = 9  # another stream key


def make(backend, conf: str | None = None) -> DeviceCachingAllocator:
    cfg = parse_alloc_conf(conf) if conf else AllocatorConfig()
    return native_allocator(backend, 0, cfg, stream_resolver=lambda: 0)


def on(key):
    return lambda s: s == key


@pytest.fixture
def alloc(backend):
    a = make(backend)
    yield a
    a.check_invariants()
    for pid, _ in list(a._captures):
        a.end_allocate_to_pool(pid)
    for ptr in list(a.live):
        a.free(ptr)
    for pid, pp in list(a._pools.items()):
        while pp.use_count > 0:
            a.release_pool(pid)
    a.empty_cache()
    assert a.segments() == []
    assert a._pools == {} and a._freeable == {}


def pool_of(a, ptr: int) -> tuple[int, int]:
    for seg in a.segments():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg["segment_pool_id"]
    raise AssertionError(f"{ptr:#x} is in no segment")


# ----------------------------------------------------------------------------- ids
def test_pool_ids_follow_torch():
    g1, g2 = pools.new_graph_pool_id(), pools.new_graph_pool_id()
    u1, u2 = pools.graph_pool_handle(), pools.graph_pool_handle()
    assert g1[1] == g2[1] == 0 and 0 < g1[0] < g2[0]
    assert u1[0] == u2[0] == 0 and 0 < u1[1] < u2[1]
    assert pools.pool_kind(g1) == pools.KIND_GRAPH and pools.pool_kind(u1) == pools.KIND_USER
    assert cudalab.graph_pool_handle()[1] > u2[1]


@pytest.mark.parametrize("bad, exc", [
    ((0, 0), ValueError), ((1, 1), ValueError), ((-1, 0), ValueError), ((0, 1, 2), TypeError),
    ("(0, 1)", TypeError), ((0, 1.0), TypeError), ((True, 0), TypeError), (None, TypeError)])
def test_bad_pool_ids_are_refused_naming_the_parameter(alloc, bad, exc):
    with pytest.raises(exc, match="pool_id"):
        alloc.begin_allocate_to_pool(bad, on(CAPTURE))
    with pytest.raises(exc, match="pool_id"):
        alloc.release_pool(bad)
    assert alloc._captures == [] and alloc._pools == {}


# ----------------------------------------------------------------------------- routing
def test_matching_allocations_come_from_the_pool_others_from_the_default(alloc):
    pid = pools.graph_pool_handle()
    alloc.begin_allocate_to_pool(pid, on(CAPTURE))
    p = alloc.malloc(4 * KiB, CAPTURE)
    q = alloc.malloc(4 * KiB, OTHER)
    big = alloc.malloc(3 * MiB, CAPTURE)
    alloc.end_allocate_to_pool(pid)
    assert pool_of(alloc, p) == pid and pool_of(alloc, big) == pid
    assert pool_of(alloc, q) == (0, 0)
    segs = {(s["segment_pool_id"], s["segment_type"]) for s in alloc.segments()}
    assert segs == {(pid, "small"), (pid, "large"), ((0, 0), "small")}
    # after the capture, the same stream allocates from the default pool again
    r = alloc.malloc(4 * KiB, CAPTURE)
    assert pool_of(alloc, r) == (0, 0)


def test_memory_freed_in_the_pool_is_reused_only_inside_it(alloc):
    pid = pools.new_graph_pool_id()
    alloc.begin_allocate_to_pool(pid, on(CAPTURE))
    p = alloc.malloc(4 * KiB, CAPTURE)
    alloc.free(p)
    q = alloc.malloc(4 * KiB, CAPTURE)  # freed inside the capture: reused by it
    assert q == p
    alloc.free(q)
    alloc.end_allocate_to_pool(pid)
    r = alloc.malloc(4 * KiB, CAPTURE)  # an ordinary allocation never gets a private block
    assert r != p and pool_of(alloc, r) == (0, 0)
    alloc.begin_allocate_to_pool(pid, on(CAPTURE))  # a later capture sharing the pool does
    s = alloc.malloc(4 * KiB, CAPTURE)
    assert s == p
    alloc.end_allocate_to_pool(pid)
    alloc.release_pool(pid)  # (the second begin added a use)


def test_a_routed_allocation_never_takes_a_cached_default_block(alloc):
    d = alloc.malloc(4 * KiB, CAPTURE)
    alloc.free(d)  # a cached default block on the capture's stream
    pid = pools.graph_pool_handle()
    alloc.begin_allocate_to_pool(pid, on(CAPTURE))
    p = alloc.malloc(4 * KiB, CAPTURE)
    alloc.end_allocate_to_pool(pid)
    assert p != d and pool_of(alloc, p) == pid
    assert alloc.memory_stats()["segment.small_pool.current"] == 2


def test_routing_tries_the_newest_capture_first(alloc):
    outer, inner = pools.graph_pool_handle(), pools.graph_pool_handle()
    alloc.begin_allocate_to_pool(outer, lambda s: True)
    alloc.begin_allocate_to_pool(inner, on(CAPTURE))
    a = alloc.malloc(KiB, CAPTURE)
    b = alloc.malloc(KiB, OTHER)
    alloc.end_allocate_to_pool(inner)
    c = alloc.malloc(KiB, CAPTURE)
    alloc.end_allocate_to_pool(outer)
    assert (pool_of(alloc, a), pool_of(alloc, b), pool_of(alloc, c)) == (inner, outer, outer)


def test_no_split_pool_hands_out_whole_blocks(backend):
    a = make(backend)
    pid = pools.graph_pool_handle()
    a.create_or_incref_pool(pid)
    a.set_pool_options(pid, no_split=True)
    a.begin_allocate_to_pool(pid, on(CAPTURE))
    p = a.malloc(KiB, CAPTURE)
    a.end_allocate_to_pool(pid)
    assert a.block_size(p) == 2 * MiB
    a.free(p)
    a.release_pool(pid)
    a.release_pool(pid)
    a.empty_cache()
    assert a.segments() == []


# ----------------------------------------------------------------------------- lifetime
def test_use_count_keeps_the_pool_and_empty_cache_releases_it_at_zero(alloc):
    pid = pools.new_graph_pool_id()
    assert alloc.get_pool_use_count(pid) == 0
    alloc.begin_allocate_to_pool(pid, on(CAPTURE))
    p = alloc.malloc(4 * KiB, CAPTURE)
    alloc.end_allocate_to_pool(pid)
    alloc.create_or_incref_pool(pid)  # a second graph shares it
    assert alloc.get_pool_use_count(pid) == 2
    alloc.free(p)
    alloc.empty_cache()
    assert [s["segment_pool_id"] for s in alloc.segments()] == [pid]  # kept while used
    alloc.release_pool(pid)
    alloc.empty_cache()
    assert [s["segment_pool_id"] for s in alloc.segments()] == [pid]  # one user left
    alloc.release_pool(pid)
    assert alloc.get_pool_use_count(pid) == 0
    assert alloc.pools()[0]["freeable"]
    alloc.empty_cache()
    assert alloc.segments() == [] and alloc.pools() == []


def test_a_live_block_keeps_its_segment_until_it_is_freed(alloc):
    pid = pools.new_graph_pool_id()
    alloc.begin_allocate_to_pool(pid, on(CAPTURE))
    out = alloc.malloc(4 * KiB, CAPTURE)  # a graph's output, used after the graph is gone
    tmp = alloc.malloc(3 * MiB, CAPTURE)
    alloc.free(tmp)
    alloc.end_allocate_to_pool(pid)
    alloc.release_pool(pid)
    reserved = alloc.memory_stats()["reserved_bytes.all.current"]
    alloc.empty_cache()  # the free large segment goes, the output's small one stays
    assert alloc.memory_stats()["reserved_bytes.all.current"] == reserved - 20 * MiB
    assert [s["segment_pool_id"] for s in alloc.segments()] == [pid]
    assert alloc.pools()[0]["allocated_bytes"] == 4 * KiB
    alloc.free(out)  # back to the (freeable) private pool, not to the default one
    q = alloc.malloc(4 * KiB, CAPTURE)
    assert pool_of(alloc, q) == (0, 0)
    alloc.free(q)
    alloc.empty_cache()
    assert alloc.segments() == [] and alloc.get_pool_use_count(pid) == 0


def test_empty_cache_during_a_capture_keeps_the_default_cache(alloc):
    d = alloc.malloc(4 * KiB)
    alloc.free(d)
    pid = pools.graph_pool_handle()
    alloc.begin_allocate_to_pool(pid, on(CAPTURE))
    alloc.empty_cache()  # torch: only freeable private pools are released meanwhile
    assert len(alloc.segments()) == 1
    alloc.end_allocate_to_pool(pid)
    alloc.empty_cache()
    assert alloc.segments() == []


def test_memory_stats_count_private_segments_in_the_totals(alloc):
    pid = pools.graph_pool_handle()
    d = alloc.malloc(100 * KiB)
    alloc.begin_allocate_to_pool(pid, on(CAPTURE))
    p = alloc.malloc(5 * MiB, CAPTURE)
    q = alloc.malloc(200, CAPTURE)
    alloc.end_allocate_to_pool(pid)
    st = alloc.memory_stats()
    segs = alloc.segments()
    assert st["reserved_bytes.all.current"] == sum(s["total_size"] for s in segs) == 24 * MiB
    assert st["allocated_bytes.all.current"] == sum(s["allocated_size"] for s in segs)
    assert st["segment.large_pool.current"] == 1 and st["segment.small_pool.current"] == 2
    assert st["requested_bytes.all.current"] == 100 * KiB + 5 * MiB + 200
    for ptr in (d, p, q):
        alloc.free(ptr)
    alloc.release_pool(pid)
    alloc.empty_cache()
    assert alloc.memory_stats()["reserved_bytes.all.current"] == 0


def test_the_pair_memo_is_off_while_routing_and_back_after(alloc):
    pid = pools.graph_pool_handle()
    alloc.free(alloc.malloc(64))
    alloc.free(alloc.malloc(4 * KiB))  # the memo is set up on the default stream
    assert alloc.memo_block is not None
    alloc.begin_allocate_to_pool(pid, lambda s: True)
    assert alloc.memo_block is None
    p = alloc.malloc(4 * KiB)  # the same request: routed, not the memo's default block
    alloc.free(p)
    alloc.free(alloc.malloc(4 * KiB))
    assert alloc.memo_block is None and pool_of(alloc, alloc.malloc(4 * KiB)) == pid
    alloc.end_allocate_to_pool(pid)
    hits = alloc._memo_hits
    x = alloc.malloc(4 * KiB)
    alloc.free(x)
    for _ in range(3):
        alloc.free(alloc.malloc(4 * KiB))
    assert alloc.memo_block is not None and alloc._memo_hits >= hits + 3
    assert pool_of(alloc, x) == (0, 0)


def test_a_capture_oom_does_not_release_cached_blocks():

    sim = SimulatorBackend(SimulatorConfig(1, 64 * MiB, None))
    sim.init()
    a = make(sim)
    a.free(a.malloc(50 * MiB))  # cached in the default pool
    pid = pools.graph_pool_handle()
    a.begin_allocate_to_pool(pid, on(CAPTURE))
    with pytest.raises(OutOfMemoryError, match="out of memory"):
        a.malloc(30 * MiB, CAPTURE)
    assert a.memory_stats()["reserved_bytes.all.current"] == 50 * MiB  # not released
    a.end_allocate_to_pool(pid)
    p = a.malloc(30 * MiB)  # outside the capture the ladder releases and retries
    a.free(p)
    a.release_pool(pid)
    a.empty_cache()
    a.check_invariants()


def test_use_on_oom_pool_serves_an_ordinary_allocation_that_failed():

    sim = SimulatorBackend(SimulatorConfig(1, 64 * MiB, None))
    sim.init()
    a = make(sim)
    pid = pools.graph_pool_handle()
    a.begin_allocate_to_pool(pid, on(0))
    a.free(a.malloc(50 * MiB, 0))  # a free 50 MiB segment of the pool
    a.end_allocate_to_pool(pid)
    with pytest.raises(OutOfMemoryError):
        a.malloc(40 * MiB, 0)  # the device is full and the pool is private
    a.set_pool_options(pid, use_on_oom=True)
    q = a.malloc(40 * MiB, 0)  # now the use_on_oom pool's free block serves it
    assert pool_of(a, q) == pid
    a.free(q)
    a.release_pool(pid)
    a.empty_cache()
    assert a.segments() == []
    a.check_invariants()


# ----------------------------------------------------------------------------- errors
def test_errors_use_torchs_texts_and_change_nothing(alloc):
    pid = pools.graph_pool_handle()
    with pytest.raises(RuntimeError, match="^endAllocatePool: not currently recording to mempool_id$"):
        alloc.end_allocate_to_pool(pid)
    alloc.begin_allocate_to_pool(pid, on(CAPTURE))
    with pytest.raises(RuntimeError, match="^beginAllocateToPool: already recording to mempool_id$"):
        alloc.begin_allocate_to_pool(pid, on(OTHER))
    assert alloc.get_pool_use_count(pid) == 1 and len(alloc._captures) == 1
    with pytest.raises(TypeError, match="filter"):
        alloc.begin_allocate_to_pool(pools.graph_pool_handle(), 42)
    alloc.end_allocate_to_pool(pid)
    with pytest.raises(ValueError, match="no private pool"):
        alloc.release_pool(pools.graph_pool_handle())
    p = alloc.malloc(KiB, CAPTURE)
    alloc.begin_allocate_to_pool(pid, on(CAPTURE))
    q = alloc.malloc(KiB, CAPTURE)
    alloc.end_allocate_to_pool(pid)
    alloc.release_pool(pid)
    alloc.release_pool(pid)
    with pytest.raises(RuntimeError, match="released already"):
        alloc.release_pool(pid)
    with pytest.raises(RuntimeError, match="was released"):  # torch asserts here
        alloc.begin_allocate_to_pool(pid, on(CAPTURE))
    assert alloc._captures == []
    with pytest.raises(ValueError, match="allocator"):
        alloc.create_or_incref_pool(pid, PluggableAllocator(lambda *a: 0, lambda *a: None))
    alloc.free(p)
    alloc.free(q)


def test_allocators_without_private_pools_say_so(backend):
    u = UncachedAllocator(backend, 0)
    with pytest.raises(NotImplementedError, match="native caching allocator.*Uncached"):
        u.begin_allocate_to_pool(pools.graph_pool_handle(), None)
    assert u.get_pool_use_count((0, 1)) == 0 and u.pools() == []
    x = native_allocator(backend, 0, parse_alloc_conf("expandable_segments:True"),
                         stream_resolver=lambda: 0)
    with pytest.raises(NotImplementedError, match="expandable_segments"):
        x.begin_allocate_to_pool(pools.graph_pool_handle(), None)
    assert x._captures == []


# ----------------------------------------------------------------------------- MemPool
@pytest.fixture
def fresh_device():
    cudalab.init()
    yield
    gc.collect()
    cudalab.empty_cache()


def test_mem_pool_routes_the_current_thread_only(fresh_device):
    pool = cudalab.MemPool()
    assert pool.id[0] == 0 and pool.id != cudalab.MemPool().id  # (torch's test_mempool_id)
    assert pool.use_count() == 1
    other: list[int] = []
    with cudalab.use_mem_pool(pool):
        assert pool.use_count() == 2
        mine = cudalab.caching_allocator_alloc(4 * KiB)
        t = threading.Thread(target=lambda: other.append(cudalab.caching_allocator_alloc(4 * KiB)))
        t.start()
        t.join()
    assert pool.use_count() == 1
    assert [s["segment_pool_id"] for s in pool.snapshot()] == [pool.id]
    assert any(b["address"] == mine for s in pool.snapshot() for b in s["blocks"])
    owners = {s["segment_pool_id"] for s in cudalab.memory_snapshot()
              if s["address"] <= other[0] < s["address"] + s["total_size"]}
    assert owners == {(0, 0)}
    assert cudalab.memory_snapshot(pool.id) == pool.snapshot()
    cudalab.caching_allocator_delete(mine)
    cudalab.caching_allocator_delete(other[0])


def test_dropping_a_mem_pool_releases_its_memory(fresh_device):
    pool = cudalab.MemPool()
    pid = pool.id
    with cudalab.use_mem_pool(pool):
        kept = cudalab.caching_allocator_alloc(3 * MiB)
        cudalab.caching_allocator_delete(cudalab.caching_allocator_alloc(KiB))
    from cudalab.allocator.registry import get_allocator

    a = get_allocator(0)
    del pool
    gc.collect()  # ~MemPool: release, then empty that pool's cache
    assert a.get_pool_use_count(pid) == 0
    assert [s["segment_pool_id"] for s in cudalab.memory_snapshot(pid)] == [pid]  # the live one
    cudalab.caching_allocator_delete(kept)
    cudalab.empty_cache()
    assert cudalab.memory_snapshot(pid) == [] and all(p["id"] != pid for p in a.pools())


def test_mem_pool_with_a_pluggable_allocator_takes_its_segments_from_it(fresh_device, backend):
    calls: list[tuple] = []

    def malloc_fn(size, device, stream):
        ptr = backend.mem_alloc(device, size)
        calls.append(("malloc", ptr, size))
        return ptr

    def free_fn(ptr, size, device, stream):
        calls.append(("free", ptr, size))
        backend.mem_free(device, ptr)

    pool = cudalab.MemPool(cudalab.memory.PluggableAllocator(malloc_fn, free_fn))
    with cudalab.use_mem_pool(pool):
        p = cudalab.caching_allocator_alloc(KiB)
    assert calls == [("malloc", pool.snapshot()[0]["address"], 2 * MiB)]
    cudalab.caching_allocator_delete(p)
    del pool
    gc.collect()
    assert [c[0] for c in calls] == ["malloc", "free"] and calls[1][1:] == calls[0][1:]


def test_mem_pool_arguments_and_devices_are_checked(fresh_device, two_devices):
    with pytest.raises(TypeError, match="allocator"):
        cudalab.MemPool(allocator=object())
    with pytest.raises(TypeError, match="use_on_oom"):
        cudalab.MemPool(use_on_oom=1)
    pool = cudalab.MemPool()
    with pytest.raises(ValueError, match="device 0, not on device 1"):
        with cudalab.use_mem_pool(pool, device=1):
            pass
    with pytest.raises(TypeError, match="MemPool"):
        with cudalab.use_mem_pool(pool.id):
            pass
    with cudalab.use_mem_pool(pool):
        with pytest.raises(RuntimeError, match="already recording"):
            with cudalab.use_mem_pool(pool):
                pass
        assert pool.use_count() == 2
    assert pool.use_count() == 1


def test_use_mem_pool_calls_the_capture_hooks_and_cleans_up_if_one_fails(fresh_device):
    seen = []

    def hook(pool_id, device):
        seen.append((pool_id, device))
        raise RuntimeError("hook failed")

    pool = cudalab.MemPool()
    on_use_mem_pool.append(hook)
    try:
        with pytest.raises(RuntimeError, match="hook failed"):
            with cudalab.use_mem_pool(pool):
                pass
    finally:
        on_use_mem_pool.remove(hook)
    assert seen == [(pool.id, 0)] and pool.use_count() == 1
    from cudalab.allocator.registry import get_allocator

    assert get_allocator(0)._captures == []


def test_a_record_stream_free_during_a_capture_waits_for_its_end(alloc):
    """torch defers such frees (no event may be recorded or queried in a capture): the block
    stays pending, then the end of the last capture records its events."""
    side = cudalab.Stream()
    p = alloc.malloc(4 * KiB, CAPTURE)  # allocated before the capture
    alloc.record_stream(p, side)
    pid = pools.graph_pool_handle()
    alloc.begin_allocate_to_pool(pid, on(CAPTURE))
    alloc.free(p)
    states = {b["address"]: b["state"] for s in alloc.segments() for b in s["blocks"]}
    assert states[p] == "active_pending_free" and alloc.outstanding_events == 0
    alloc.check_invariants()
    q = alloc.malloc(4 * KiB, OTHER)  # allocations go on; the pending block is not reused
    assert q != p
    alloc.end_allocate_to_pool(pid)
    assert alloc.outstanding_events == 1 and alloc._deferred_uses == []
    side.synchronize()
    alloc.process_events()
    states = {b["address"]: b["state"] for s in alloc.segments() for b in s["blocks"]}
    assert states[p] == "inactive"
    alloc.free(q)
    side.close()


def test_the_oom_message_counts_free_memory_of_private_pools_as_torch():
    sim = SimulatorBackend(SimulatorConfig(1, 64 * MiB, None))
    sim.init()
    a = make(sim)
    pid = pools.graph_pool_handle()
    a.begin_allocate_to_pool(pid, on(CAPTURE))
    a.free(a.malloc(KiB, CAPTURE))  # a free 2 MiB segment in the pool
    a.end_allocate_to_pool(pid)
    keep = a.malloc(40 * MiB)
    with pytest.raises(OutOfMemoryError) as info:
        a.malloc(40 * MiB)
    text = str(info.value)
    assert ("Of the allocated memory 42.00 MiB is allocated by cudalab, with 2.00 MiB allocated "
            "in private pools (e.g., CUDA Graphs), and 0 bytes is reserved by cudalab but "
            "unallocated.") in text
    a.free(keep)
    a.release_pool(pid)
    a.empty_cache()
    assert a.segments() == []


def test_mem_pools_made_in_many_threads_get_distinct_ids(fresh_device):
    """torch's test_mempool_multithread: ids from the process-global counter never repeat."""
    ids: list[tuple[int, int]] = []
    made: list = []
    lock = threading.Lock()

    def work():
        for _ in range(20):
            p = cudalab.MemPool()
            with lock:
                ids.append(p.id)
                made.append(p)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == len(ids) == 80 and all(i[0] == 0 for i in ids)
    made.clear()
    gc.collect()


def test_each_thread_allocates_from_its_own_mem_pool(fresh_device):
    """torch's test_mempool_ctx_multithread: use_mem_pool routes only the thread that
    entered it, so concurrent blocks of different threads fill different pools."""
    n = 4
    barrier = threading.Barrier(n)
    got: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            pool = cudalab.MemPool()
            with cudalab.use_mem_pool(pool):
                barrier.wait()  # every thread routes at the same time
                ptrs = [cudalab.caching_allocator_alloc((i + 1) * KiB) for _ in range(10)]
                barrier.wait()
            owners = {s["segment_pool_id"] for s in cudalab.memory_snapshot()
                      for b in s["blocks"] if b["address"] in ptrs}
            got[i] = (pool.id, owners)
            for p in ptrs:
                cudalab.caching_allocator_delete(p)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(owners == {pid} for pid, owners in got.values())
    assert len({pid for pid, _ in got.values()}) == n
    gc.collect()
    get_allocator(0).check_invariants()


def test_a_pool_still_routed_to_is_not_forgotten_at_use_count_zero(alloc):
    pid = pools.graph_pool_handle()
    alloc.begin_allocate_to_pool(pid, on(CAPTURE))
    alloc.free(alloc.malloc(KiB, CAPTURE))
    alloc.release_pool(pid)  # e.g. its MemPool dropped while a capture still routes to it
    alloc.empty_cache()
    assert alloc.pools()[0]["routed"] and alloc.pools()[0]["freeable"]
    p = alloc.malloc(KiB, CAPTURE)  # routing still finds it
    assert pool_of(alloc, p) == pid
    alloc.free(p)
    alloc.end_allocate_to_pool(pid)
    alloc.empty_cache()
    assert alloc.pools() == [] and alloc.segments() == []


def _finishes(fn, timeout: float = 5.0) -> bool:
    """Whether fn() returns within ``timeout`` in a thread (a wedged lock would not)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


def test_a_release_from_a_finalizer_inside_an_allocator_call_never_waits(alloc):
    """A graph's or a MemPool's finalizer may run (garbage collection) while its own thread
    holds the allocator's lock: release_pool / drop_pool then queue, as free does."""
    pid = pools.graph_pool_handle()
    alloc.begin_allocate_to_pool(pid, on(CAPTURE))
    alloc.free(alloc.malloc(KiB, CAPTURE))
    alloc.end_allocate_to_pool(pid)
    alloc.create_or_incref_pool(pid)  # two uses

    def inside_an_allocator_call():
        with alloc._lock:  # this thread is inside the allocator
            alloc.release_pool(pid)
            alloc.drop_pool(pid)
            assert alloc.get_pool_use_count(pid) == 0  # counted at once

    assert _finishes(inside_an_allocator_call), "release_pool waited for its own thread's lock"
    assert len(alloc._pending_releases) == 2
    assert alloc.pools()[0]["freeable"] and not alloc._pending_releases  # made by the next holder
    alloc.empty_cache()
    assert alloc.pools() == [] and alloc.segments() == []
    with pytest.raises(ValueError, match="no private pool"):
        alloc.release_pool(pid)


def test_a_mem_pool_collected_inside_an_allocator_call_does_not_deadlock(fresh_device):
    a = get_allocator(0)
    pool = cudalab.MemPool()
    pid = pool.id

    def collect_inside():
        nonlocal pool
        with a._lock:
            del pool
            gc.collect()  # ~MemPool runs here, with this thread holding the lock

    assert _finishes(collect_inside), "~MemPool waited for its own thread's lock"
    assert a.get_pool_use_count(pid) == 0
    cudalab.empty_cache()
    assert all(p["id"] != pid for p in a.pools())
