"""A capture's allocations come from the graph's private pool (torch's semantics): the pool
lives while a graph uses it, empty_cache() leaves it alone, reset() / deleting the graph makes
it releasable, graphs can share one; the memory numbers of torch's test."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import cudalab
from cudalab import random as crandom
from cudalab.allocator.registry import get_allocator
from tests.graphs.conftest import add_new, clone, sum2

MiB = 1 << 20
#: The default generator's seed/offset words, allocated in the default small pool at the
#: first capture: one 512-byte block here (torch allocates two, 1024 bytes).
HOLDER_BLOCKS, HOLDER_BYTES = 1, 512


def _pool_segments(pool_id):
    return [s for s in cudalab.memory_snapshot() if tuple(s["segment_pool_id"]) == pool_id]


def _use_count(pool_id):
    return get_allocator(cudalab.current_device()).get_pool_use_count(pool_id)


def test_capture_allocates_from_the_graphs_private_pool():
    a = cudalab.array.full((1000,), 1.0, np.float32)
    add_new(a, 0)
    g = cudalab.CUDAGraph()
    with cudalab.graph(g):
        b = add_new(a, 1)
    pid = g.pool()
    assert pid[0] > 0 and pid[1] == 0  # a graph's own pool: (n, 0)
    segs = _pool_segments(pid)
    assert segs and any(blk["address"] == b.data_ptr() for s in segs for blk in s["blocks"])
    assert _use_count(pid) == 1
    c = add_new(a, 2)  # outside the capture: the default pool
    assert not any(blk["address"] == c.data_ptr() for s in segs for blk in s["blocks"])


def test_memory_freed_in_capture_is_reused_only_inside_the_pool():
    a = cudalab.array.full((1000,), 1.0, np.float32)
    add_new(a, 0)
    g = cudalab.CUDAGraph()
    with cudalab.graph(g):
        t = add_new(a, 1)
        freed = t.data_ptr()
        del t
        u = add_new(a, 2)  # reuses the freed block, inside the pool
    assert u.data_ptr() == freed
    del u  # back to g's pool, free
    w = add_new(a, 4)  # eager: never from a private pool
    g2 = cudalab.CUDAGraph()
    with cudalab.graph(g2):  # another pool: g's free block is not handed out
        v = add_new(a, 3)
    assert freed not in (v.data_ptr(), w.data_ptr())
    g3 = cudalab.CUDAGraph()
    with cudalab.graph(g3, pool=g.pool()):  # sharing g's pool: the free block is reused
        x = add_new(a, 5)
    assert x.data_ptr() == freed


def test_pool_lives_while_the_graph_does_and_is_released_after_reset():
    a = cudalab.array.full((1000,), 1.0, np.float32)
    add_new(a, 0)
    g = cudalab.CUDAGraph()
    with cudalab.graph(g):
        b = add_new(a, 1)
        del b  # the pool keeps the segment: replays write there
    pid = g.pool()
    cudalab.empty_cache()
    assert _pool_segments(pid), "empty_cache() released a live graph's pool"
    g.replay()
    g.reset()
    assert _use_count(pid) == 0
    cudalab.empty_cache()
    assert not _pool_segments(pid)


def test_deleting_the_graph_releases_its_pool():
    a = cudalab.array.full((1000,), 1.0, np.float32)
    add_new(a, 0)
    g = cudalab.CUDAGraph()
    with cudalab.graph(g):
        add_new(a, 1)
    pid = g.pool()
    del g
    gc.collect()
    cudalab.empty_cache()
    assert not _pool_segments(pid)


def test_graph_two_successive():
    """torch's test: two graphs captured back to back, sharing a pool or not, replayed between
    unrelated eager work; sharing reserves exactly one 2 MiB small segment less."""
    size = 1000

    def func_with_temps(t, val):
        x = add_new(clone(t), val)
        y = add_new(clone(t), val)
        return sum2(x, y)

    s = cudalab.Stream()
    func_with_temps(cudalab.array.full((size,), 1.0, np.float32), 1)  # warm up the kernels
    cudalab.synchronize()
    cudalab.empty_cache()
    reserved_no_sharing = None
    for share_mem in ("Don't share", "via pool()", "via graph_pool_handle()"):
        g0, g1 = cudalab.CUDAGraph(), cudalab.CUDAGraph()
        a = cudalab.array.full((size,), 1.0, np.float32)
        s.wait_stream(cudalab.current_stream())
        with cudalab.stream(s):
            g0_args = ((cudalab.graph_pool_handle(),) if share_mem == "via graph_pool_handle()"
                       else ())
            g0.capture_begin(*g0_args)
            b = clone(a)
            for _ in range(5):
                b = func_with_temps(b, 1)
            g0.capture_end()
            g1_args = (g0.pool(),) if share_mem == "via pool()" else g0_args
            g1.capture_begin(*g1_args)
            for _ in range(5):
                b = func_with_temps(b, 1)
            g1.capture_end()
        cudalab.current_stream().wait_stream(s)
        c = clone(a)
        for _ in range(2):
            c = func_with_temps(c, 3)
        g0.replay()
        for _ in range(2):
            c = func_with_temps(c, 3)
        g1.replay()
        for _ in range(2):
            c = func_with_temps(c, 3)
        assert b.numpy().sum() == size * 3070
        assert c.numpy().sum() == size * 442
        reserved = cudalab.memory_stats()["reserved_bytes.all.current"]
        if share_mem == "Don't share":
            reserved_no_sharing = reserved
        else:
            assert reserved_no_sharing - reserved == 2 * MiB
        del a, b, c, g0, g1
        gc.collect()
        cudalab.synchronize()
        cudalab.empty_cache()


CASES = [  # numel, pool, (segments, reserved, blocks, bytes) after capture, after del g
    (512 // 4, "small_pool", (1, 2 * MiB, 1, 0), (1, 2 * MiB, 1, 0)),
    (MiB // 4, "small_pool", (2, 4 * MiB, 1, 0), (1, 2 * MiB, 1, 0)),
    ((MiB + 512) // 4, "large_pool", (1, 20 * MiB, 1, 0), (1, 20 * MiB, 1, 0)),
    ((10 * MiB - 512) // 4, "large_pool", (2, 40 * MiB, 1, 0), (1, 20 * MiB, 1, 0)),
    ((10 * MiB + 512) // 4, "large_pool", (3, 36 * MiB, 1, 0), (1, 12 * MiB, 1, 0)),
]


@pytest.mark.parametrize(("numel", "pool", "captured", "after_del"), CASES,
                         ids=[str(c[0] * 4) for c in CASES])
def test_graph_memory_stats_and_use_result_after_destroy_graph(numel, pool, captured, after_del):
    """torch's table (test_cuda.py), each delta of <stat>.<pool>.current from right after
    ``a`` is created to right after capture_end, then after ``del g; empty_cache()``; the
    small-pool cases also count the RNG holders (one 512 B block here, two in torch)."""
    keys = [f"segment.{pool}.current", f"reserved_bytes.{pool}.current",
            f"active.{pool}.current", f"active_bytes.{pool}.current"]
    gc.collect()  # graphs of earlier tests: the holders are allocated by the first graph
    first_graph = crandom.default_generators[0].graph_state.graph_buffer is None
    holders = (HOLDER_BLOCKS, HOLDER_BYTES) if pool == "small_pool" and first_graph else (0, 0)
    s = cudalab.Stream()
    with cudalab.stream(s):
        add_new(cudalab.array.full((4,), 1.0, np.float32), 0)  # warm up the kernel
    cudalab.synchronize()
    cudalab.empty_cache()
    with cudalab.stream(s):
        a = cudalab.array.full((numel,), 1.0, np.float32)
        base = [cudalab.memory_stats()[k] for k in keys]
        g = cudalab.CUDAGraph()
        g.capture_begin()
        b = clone(a)
        for _ in range(5):
            b = add_new(clone(b), 1)
        g.capture_end()
    cudalab.current_stream().wait_stream(s)

    def delta():
        now = cudalab.memory_stats()
        return [now[k] - v for k, v in zip(keys, base, strict=True)]

    seg, res, blocks, _ = captured
    want = [seg, res, blocks + holders[0], numel * 4 + holders[1]]
    assert delta() == want
    g.replay()
    g.replay()
    cudalab.empty_cache()  # between replays: nothing changes
    g.replay()
    assert delta() == want
    assert b.numpy()[0] == 6.0
    del g
    gc.collect()
    cudalab.empty_cache()
    seg, res, blocks, _ = after_del
    holders = holders if crandom.default_generators[0].graph_state.graph_buffer is not None \
        else (0, 0)
    assert delta() == [seg, res, blocks + holders[0], numel * 4 + holders[1]]
    assert b.numpy()[0] == 6.0  # b outlives the graph
    del a, b
    cudalab.synchronize()
    cudalab.empty_cache()


def test_graph_capture_oom():
    g = cudalab.CUDAGraph()
    huge = cudalab.get_device_properties(0).total_memory * 2
    ooms = cudalab.memory_stats()["num_ooms"]
    try:
        with pytest.raises(RuntimeError, match="out of memory"), cudalab.graph(g):
            cudalab.array.empty((huge,), np.uint8)
        assert cudalab.memory_stats()["num_ooms"] == ooms + 1
        assert not cudalab.is_current_stream_capturing()
        a = cudalab.array.full((10,), 1.0, np.float32)  # the allocator works again
        assert a.numpy()[0] == 1.0
    finally:
        cudalab.reset_accumulated_memory_stats()  # later tests read num_ooms


def test_a_graph_collected_inside_the_allocator_defers_its_pool_release():
    """The garbage collector may run a graph's finalizer while this thread holds the
    allocator's (non-re-entrant) lock: the finalizer must not wait for it."""
    a = cudalab.array.full((1000,), 1.0, np.float32)
    add_new(a, 0)
    g = cudalab.CUDAGraph()
    with cudalab.graph(g):
        add_new(a, 1)
    pid = g.pool()
    g.cycle = g  # only the garbage collector frees it
    del g
    alloc = get_allocator(cudalab.current_device())
    assert alloc._lock.acquire(blocking=False)
    try:
        gc.collect()  # would deadlock if the finalizer waited for the lock
    finally:
        alloc._lock.release()
    assert _use_count(pid) == 1  # deferred
    g2 = cudalab.CUDAGraph()
    with cudalab.graph(g2):  # the next capture releases it
        add_new(a, 2)
    assert _use_count(pid) == 0
    cudalab.empty_cache()
    assert not _pool_segments(pid)


def test_a_graph_collected_during_another_capture_leaves_it_valid():
    """The collector may finalize a graph while another one captures (in a notebook, any
    allocation can run it): destroying its executable then (cuGraphExecDestroy, refused in a
    global capture) would invalidate the capture, whose next launch fails with 901. The
    finalizer defers the destroys and the pool release to the capture's end (seen on an
    H200 by tests/graphs/test_capture_interrupts.py)."""
    a = cudalab.array.full((1000,), 1.0, np.float32)
    add_new(a, 0)
    old = cudalab.CUDAGraph()
    with cudalab.graph(old):
        add_new(a, 1)
    old_pid = old.pool()
    old.cycle = old  # only the garbage collector frees it
    del old
    g = cudalab.CUDAGraph()
    with cudalab.graph(g):
        gc.collect()  # the old graph's finalizer runs inside this capture
        assert _use_count(old_pid) == 1  # its pool is released after the capture
        out = add_new(a, 2)  # the capture is still valid
    assert _use_count(old_pid) == 0
    g.replay()
    cudalab.synchronize()
    assert out.numpy()[0] == 3.0


def test_a_graph_collected_as_a_capture_begins_leaves_it_valid(monkeypatch):
    """The same between the driver's begin of a capture and its registration (its id is
    known only after the begin): on an H200 the collector ran there, in the interrupt
    machinery's allocations, and the finalizer's cuGraphExecDestroy invalidated it."""
    from cudalab import _internal

    a = cudalab.array.full((1000,), 1.0, np.float32)
    add_new(a, 0)
    old = cudalab.CUDAGraph()
    with cudalab.graph(old):
        add_new(a, 1)
    old.cycle = old
    del old
    backend = _internal.backend()
    info = backend.stream_capture_info
    collected = []

    def capture_info_after_a_collection(handle):
        if not collected:
            collected.append(gc.collect())  # the old graph's finalizer runs here
        return info(handle)

    monkeypatch.setattr(backend, "stream_capture_info", capture_info_after_a_collection)
    g = cudalab.CUDAGraph()
    with cudalab.graph(g):
        out = add_new(a, 2)
    assert collected and collected[0] > 0
    g.replay()
    cudalab.synchronize()
    assert out.numpy()[0] == 3.0


@pytest.mark.parametrize("pool", [(0, 0), [0, 0]])
def test_pool_zero_zero_means_no_pool(pool):
    """torch's capture_begin treats the id (0, 0) as "no pool": the graph gets a new private
    pool of its own (issue 36, item 24)."""
    a = cudalab.array.full((256,), 1.0, np.float32)
    g = cudalab.CUDAGraph()
    with cudalab.graph(g, pool=pool):
        b = add_new(a, 1)
    assert g.pool() != (0, 0) and g.pool()[0] > 0
    g.replay()
    assert b.numpy()[0] == 2.0
    g2 = cudalab.CUDAGraph()
    s = cudalab.Stream()
    with cudalab.stream(s):
        g2.capture_begin(pool=pool)
        add_new(a, 1)
        g2.capture_end()
    assert g2.pool() not in ((0, 0), g.pool())


def test_memory_snapshot_during_a_capture_returns_the_segments():
    """torch returns the segments and the capture stays valid (issue 36, item 20)."""
    a = cudalab.array.full((256,), 1.0, np.float32)
    g = cudalab.CUDAGraph()
    with cudalab.graph(g):
        b = add_new(a, 1)
        during = cudalab.memory_snapshot()
        assert cudalab.is_current_stream_capturing()
    pooled = [s for s in during if tuple(s["segment_pool_id"]) == g.pool()]
    assert pooled, during
    g.replay()
    assert b.numpy()[0] == 2.0
