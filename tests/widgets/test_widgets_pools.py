"""The dashboard and the snapshot viewer show graph and user pools as such."""

from __future__ import annotations

import gc
import re

import pytest

import cudalab
import cudalab.memory as cm
from cudalab.allocator import pools
from cudalab.allocator.registry import get_allocator

W = pytest.importorskip("ipywidgets")

from cudalab.widgets import close_all  # noqa: E402
from cudalab.widgets.dashboard import MemoryDashboard  # noqa: E402
from cudalab.widgets.snapshot_viewer import SnapshotViewer  # noqa: E402

KiB = 1024
MiB = 1024 * 1024


@pytest.fixture
def graph_and_user_pool():
    """A MemPool holding 4 KiB and a graph pool (kept) holding 1 KiB, both on device 0,
    recorded from the start; yields (user id, graph id)."""
    cudalab.init()
    gc.collect()
    cm.empty_cache()  # pools earlier tests left freeable (use count 0, a cached segment): gone
    cm._record_memory_history(None)
    a = get_allocator(0)
    rec = cm.record_history()
    user = cm.MemPool()
    with cm.use_mem_pool(user):
        u = cm.caching_allocator_alloc(4 * KiB)
    gid = pools.new_graph_pool_id()
    key = cudalab.current_stream().cuda_stream
    a.begin_allocate_to_pool(gid, lambda s: s == key)
    g = cm.caching_allocator_alloc(KiB)
    cm.caching_allocator_delete(cm.caching_allocator_alloc(3 * MiB))  # a 20 MiB segment
    a.end_allocate_to_pool(gid)
    yield user.id, gid
    close_all()
    rec.restore()
    cm.caching_allocator_delete(u)
    cm.caching_allocator_delete(g)
    if a.get_pool_use_count(gid):
        a.release_pool(gid)
    del user
    gc.collect()
    cm.empty_cache()


def test_the_dashboard_lists_the_pools_of_each_device(graph_and_user_pool):
    uid, gid = graph_and_user_pool
    d = MemoryDashboard(start=False)
    d.refresh()
    pools = d._panels[0]["pools"].value
    m = re.search(r'class="cudalab-dash-pools" data-pools="(\d+)"', pools)
    assert m and int(m.group(1)) == 2
    assert f"graph pool ({gid[0]}, 0) <b>22.0 MiB</b>" in pools
    assert f"user pool (0, {uid[1]}) <b>2.0 MiB</b>" in pools
    assert "cudalab-dash-pools" not in d._panels[0]["counts"].value  # (its own widget)
    assert pools in d.to_html()
    assert d.latest[0]["pools"] == cm.private_pools(0)
    d.close()


def test_a_tick_sends_the_pools_line_only_when_a_pool_changed(graph_and_user_pool,
                                                              monkeypatch):
    """The pools have a widget of their own: allocations outside them change the counts
    line every tick, and the pools line is not sent again (it was part of the counts line,
    so a device with many pools sent kilobytes a tick: the message budget test in CI)."""
    d = MemoryDashboard(start=False)
    d.refresh()
    pools_widget, counts_widget = d._panels[0]["pools"], d._panels[0]["counts"]
    assert "cudalab-dash-pools" in pools_widget.value
    sent: list[object] = []
    send = W.Widget._send

    def record(self, msg, buffers=None):
        sent.append(self)
        return send(self, msg, buffers)

    monkeypatch.setattr(W.Widget, "_send", record)
    ptrs = []
    try:
        for k in range(4):
            ptrs.append(cm.caching_allocator_alloc((k + 1) * MiB, 0))  # the default pool
            d.refresh()
            assert any(w is counts_widget for w in sent)  # the counts changed: sent
            assert not any(w is pools_widget for w in sent)  # the pools did not: not sent
            sent.clear()
    finally:
        for ptr in ptrs:
            cm.caching_allocator_delete(ptr)
        d.close()


def test_the_viewer_filters_graph_and_user_pools_and_their_history(graph_and_user_pool):
    uid, gid = graph_and_user_pool
    snap = cm._snapshot()
    v = SnapshotViewer(snap)
    labels = [label for label, _v in v._pool.options]
    g_label, u_label = f"graph ({gid[0]}, 0)", f"user (0, {uid[1]})"
    assert g_label in labels and u_label in labels
    v._pool.value = g_label
    shown = v.segments()
    assert shown and all(tuple(s["segment_pool_id"]) == gid for s in shown)
    assert f"{g_label} pool" in v._map.value
    alloc, res = v.history.totals(None, None, g_label)
    assert int(res[-1]) == 22 * MiB and int(alloc[-1]) == KiB  # the graph pool alone
    v._pool.value = u_label
    assert [tuple(s["segment_pool_id"]) for s in v.segments()] == [uid]
    _alloc, res = v.history.totals(None, None, "small")  # the default pool only
    assert int(res[-1]) == sum(s["total_size"] for s in snap["segments"]
                               if s["segment_type"] == "small" and s["segment_pool_id"] == (0, 0))
    v.close()


def test_the_viewer_rebuilds_a_freed_pool_segment_with_its_pool(graph_and_user_pool):
    uid, gid = graph_and_user_pool
    a = get_allocator(0)
    a.release_pool(gid)  # the graph is reset: its free 20 MiB segment goes back
    cm.empty_cache()
    snap = cm._snapshot()
    assert not any(s["total_size"] == 20 * MiB and tuple(s["segment_pool_id"]) == gid
                   for s in snap["segments"])
    v = SnapshotViewer(snap)
    h = v.history
    i = max(k for k, e in enumerate(h.entries)
            if e["action"] == "segment_free" and e.get("segment_pool_id") == gid)
    before = h.state_at(i)  # the state just before that segment_free
    assert any(s["total_size"] == 20 * MiB and tuple(s["segment_pool_id"]) == gid
               for s in before)
    v.close()
