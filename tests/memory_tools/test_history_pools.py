"""The history and the snapshots show private pools: trace entries that happen in a graph or
user pool's segment carry its ``segment_pool_id``, snapshot segments carry theirs, and
``memory_snapshot(mempool_id)`` filters to one pool."""

from __future__ import annotations

import gc

import pytest

import cudalab
import cudalab.memory as cm
from cudalab.allocator import pools
from cudalab.allocator.config import AllocatorConfig
from cudalab.allocator.registry import native_allocator
from cudalab.memory_tools import history, history_pools
from cudalab.memory_tools.trace_io import dumps_snapshot, load_snapshot

KiB = 1024
MiB = 1024 * 1024
CAPTURE = 7


@pytest.fixture(autouse=True)
def _history_off():
    gc.collect()
    cm._record_memory_history(None)
    yield
    cm._record_memory_history(None)


@pytest.fixture
def alloc(backend):
    a = native_allocator(backend, 0, AllocatorConfig(), stream_resolver=lambda: 0)
    yield a
    history.detach_allocator(a)
    for pid, _ in list(a._captures):
        a.end_allocate_to_pool(pid)
    for p in list(a.live):
        a.free(p)
    for pid, pp in list(a._pools.items()):
        while pp.use_count:
            a.release_pool(pid)
    a.empty_cache()


def test_entries_in_a_pool_carry_its_id_and_default_ones_do_not(alloc):
    cm._record_memory_history("all")
    history.attach_allocator(alloc)
    pid = pools.new_graph_pool_id()
    d0 = alloc.malloc(KiB, CAPTURE)  # default pool, before the capture
    alloc.begin_allocate_to_pool(pid, lambda s: s == CAPTURE)
    p = alloc.malloc(KiB, CAPTURE)
    q = alloc.malloc(3 * MiB, CAPTURE)
    alloc.free(q)
    alloc.end_allocate_to_pool(pid)
    alloc.free(p)
    alloc.release_pool(pid)
    alloc.empty_cache()  # the pool's segments go back
    d1 = alloc.malloc(3 * MiB, CAPTURE)  # a default segment, possibly at a reused address
    entries = history.trace_entries(0)
    ours = {d0, p, q, d1}
    got = [(e["action"], e["addr"], e.get("segment_pool_id")) for e in entries
           if e["addr"] in ours or e["action"].startswith("segment")]
    in_pool = [g for g in got if g[2] == pid]
    assert ("alloc", p, pid) in got and ("alloc", q, pid) in got
    assert ("free_completed", p, pid) in got and ("free_completed", q, pid) in got
    assert sum(1 for g in in_pool if g[0] == "segment_alloc") == 2
    assert sum(1 for g in in_pool if g[0] == "segment_free") == 2
    assert ("alloc", d0, None) in got
    last_alloc = [g for g in got if g[0] == "alloc" and g[1] == d1][-1]
    assert last_alloc[2] is None  # after the pool's segment ended, its address is default
    alloc.free(d0)
    alloc.free(d1)


def test_segments_alive_when_recording_starts_are_known(alloc):
    pid = pools.graph_pool_handle()
    alloc.begin_allocate_to_pool(pid, lambda s: s == CAPTURE)
    p = alloc.malloc(KiB, CAPTURE)
    alloc.end_allocate_to_pool(pid)
    cm._record_memory_history("all")
    history.attach_allocator(alloc)
    alloc.free(p)
    alloc.begin_allocate_to_pool(pid, lambda s: s == CAPTURE)
    p2 = alloc.malloc(2 * KiB, CAPTURE)
    alloc.end_allocate_to_pool(pid)
    tags = {(e["action"], e["addr"]): e.get("segment_pool_id") for e in history.trace_entries(0)
            if e["addr"] in (p, p2)}
    assert tags[("free_completed", p)] == pid and tags[("alloc", p2)] == pid
    alloc.release_pool(pid)
    alloc.release_pool(pid)
    alloc.free(p2)


def test_the_table_of_ended_segments_is_bounded():
    for i in range(history_pools.MAX_ENDED + 10):
        history_pools.note(99, 1000 + i, 10, (0, 1), True, t_ns=i)
        history_pools.note(99, 1000 + i, 10, (0, 1), False, t_ns=i + 1)
    assert len(history_pools._segments[99]) == history_pools.MAX_ENDED
    assert history_pools.pool_of(99, 1000, 0) is None  # the oldest were dropped
    n = history_pools.MAX_ENDED + 9
    assert history_pools.pool_of(99, 1000 + n, n) == (0, 1)
    history_pools.clear()
    assert history_pools.pool_of(99, 1000 + n, n) is None


def test_snapshots_of_pools_round_trip_and_filter(tmp_path):
    cudalab.init()
    pool = cm.MemPool()
    with cm.record_history():
        with cm.use_mem_pool(pool):
            x = cm.caching_allocator_alloc(4 * KiB)
        y = cm.caching_allocator_alloc(4 * KiB)
        snap = cm._snapshot()
    ids = {tuple(s["segment_pool_id"]) for s in snap["segments"]}
    assert pool.id in ids and (0, 0) in ids
    tagged = [e for e in snap["device_traces"][0] if e.get("segment_pool_id") == pool.id]
    assert {e["action"] for e in tagged} >= {"segment_alloc", "alloc"}
    assert any(e["addr"] == x for e in tagged) and not any(e["addr"] == y for e in tagged)
    path = tmp_path / "pools.pickle"
    path.write_bytes(dumps_snapshot(snap))
    back = load_snapshot(path)  # the schema check accepts the extra key
    assert [tuple(s["segment_pool_id"]) for s in back["segments"]] == \
        [tuple(s["segment_pool_id"]) for s in snap["segments"]]
    only = cm.memory_snapshot(pool.id)
    assert only and all(s["segment_pool_id"] == pool.id for s in only)
    assert all(s["segment_pool_id"] == (0, 0) for s in cm.memory_snapshot((0, 0)))
    with pytest.raises(ValueError, match="mempool_id"):
        cm.memory_snapshot((1, 1))
    with pytest.raises(TypeError, match="mempool_id"):
        cm.memory_snapshot("pool")
    cm.caching_allocator_delete(x)
    cm.caching_allocator_delete(y)
    del pool
    gc.collect()
    cm.empty_cache()
