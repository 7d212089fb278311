"""``%cuda_memory pools`` and the pools section of the summary: graph and user pools with
their id, kind, use count, reserved and allocated bytes."""

from __future__ import annotations

import gc

import pytest

import cudalab
import cudalab.memory as cm
from cudalab.allocator import pools
from cudalab.allocator.registry import get_allocator
from cudalab.magics.memory_pools import pools_data, pools_text
from tests.magics.test_magics import ip, run, shell  # noqa: F401 - fixtures

KiB = 1024
MiB = 1024 * 1024


@pytest.fixture
def two_pools():
    """A MemPool with 4 KiB allocated and a released graph pool holding a free 3 MiB block
    (in a 20 MiB segment) while a 1 KiB output stays allocated in it."""
    cudalab.init()
    a = get_allocator(0)
    user = cm.MemPool()
    with cm.use_mem_pool(user):
        kept = cm.caching_allocator_alloc(4 * KiB)
    gid = pools.new_graph_pool_id()
    key = cudalab.current_stream().cuda_stream
    a.begin_allocate_to_pool(gid, lambda s: s == key)
    out = cm.caching_allocator_alloc(KiB)
    cm.caching_allocator_delete(cm.caching_allocator_alloc(3 * MiB))
    a.end_allocate_to_pool(gid)
    a.release_pool(gid)  # the "graph" was reset: freeable
    yield user.id, gid  # (the object stays here: dropping it releases the pool)
    cm.caching_allocator_delete(kept)
    cm.caching_allocator_delete(out)
    del user
    gc.collect()
    cm.empty_cache()
    assert cm.private_pools() == []


def test_private_pools_lists_graph_and_user_pools(two_pools):
    uid, gid = two_pools
    rows = {p["id"]: p for p in cm.private_pools()}
    assert rows[uid] == {"id": uid, "kind": "user", "use_count": 1, "segments": 1,
                             "reserved_bytes": 2 * MiB, "allocated_bytes": 4 * KiB,
                             "freeable": False, "routed": False}
    g = rows[gid]
    assert (g["kind"], g["use_count"], g["freeable"]) == ("graph", 0, True)
    assert (g["segments"], g["reserved_bytes"], g["allocated_bytes"]) == (2, 22 * MiB, KiB)
    text = pools_text(pools_data(0))
    assert f"({gid[0]}, 0)" in text and f"(0, {uid[1]})" in text
    assert "released" in text and "kept" in text


def test_the_magic_and_the_summary_show_the_pools(ip, two_pools):  # noqa: F811
    uid, gid = two_pools
    r, _out, texts, htmls = run(ip, "%cuda_memory pools")
    assert r.success, r.error_in_exec
    for word in ("private memory pools", "graph", "user", "use count", "22.0 MiB",
                 f"(0, {uid[1]})"):
        assert word in texts[0], word
    assert "<table" in htmls[0] and "graph" in htmls[0]
    r, _out, texts, htmls = run(ip, "%cuda_memory")
    assert "private memory pools" in texts[0] and f"({gid[0]}, 0)" in texts[0]
    assert "cudalab-memory-pools" in htmls[0]


def test_the_summary_has_no_pools_section_without_pools(ip):  # noqa: F811
    cm.empty_cache()
    if cm.private_pools():
        pytest.skip("another test left a pool alive")
    r, _out, texts, _h = run(ip, "%cuda_memory")
    assert "private memory pools" not in texts[0]
    r, _out, texts, _h = run(ip, "%cuda_memory pools")
    assert "no private pools" in texts[0]
