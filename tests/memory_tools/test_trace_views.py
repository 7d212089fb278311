"""The explorer's questions (trace_views, trace_diff, user_frames), checked against a
plain replay of the entries, and the synthetic writer of traces too large to hold."""

from __future__ import annotations

import numpy as np
import pytest

import cudalab.memory as cm
from cudalab.memory_tools.safe_pickle import SnapshotLoadError
from cudalab.memory_tools.synthetic import synthetic_snapshot, write_synthetic_pickle
from cudalab.memory_tools.trace_diff import diff
from cudalab.memory_tools.trace_index import COLUMNS, index_snapshot, open_trace
from cudalab.memory_tools.trace_io import load_snapshot
from cudalab.memory_tools.trace_views import SMALL_BLOCK, TraceViews
from cudalab.memory_tools.user_frames import (
    first_user_frame,
    fold_frames,
    frame_label,
    frames_html,
    is_tool_frame,
)


@pytest.fixture(scope="module")
def snap():
    return synthetic_snapshot(6000, devices=2, seed=3)


@pytest.fixture(scope="module")
def views(snap):
    return TraceViews(index_snapshot(snap))


def _replay(entries, row):
    """The blocks and segments live just after ``row``, by replaying the entry dicts."""
    live, segs = {}, {}
    for e in entries[:row + 1]:
        a = e["action"]
        if a == "alloc":
            live[e["addr"]] = e
        elif a == "free_completed":
            live.pop(e["addr"], None)
        elif a == "segment_alloc":
            segs[e["addr"]] = e["size"]
        elif a == "segment_free":
            segs.pop(e["addr"], None)
    return live, segs


@pytest.mark.parametrize("row", [0, 17, 2500, 5999])
def test_the_live_set_is_what_a_replay_of_the_entries_holds(snap, views, row):
    entries = snap["device_traces"][0]
    live, segs = _replay(entries, row)
    got = views.live_at(row)
    assert got.allocated == sum(e["size"] for e in live.values()) == views.allocated[row]
    assert got.reserved == sum(segs.values()) == views.reserved[row]
    assert got.n_blocks == len(live)
    assert sum(b for _, b, _ in got.by_pool) == got.allocated
    small = sum(e["size"] for e in live.values() if e["size"] <= SMALL_BLOCK)
    assert dict((k, b) for k, b, _ in got.by_pool).get("small", 0) == small
    by_cell = {}
    for e in live.values():
        by_cell[e.get("cell") or "(no cell)"] = by_cell.get(e.get("cell") or "(no cell)", 0) + e["size"]
    assert {k: b for k, b, _ in got.by_cell} == by_cell
    if live:
        biggest = max(live.values(), key=lambda e: e["size"])
        assert got.largest[0][1] == biggest["size"]
        top = biggest["frames"][0] if biggest["frames"] else None
        labels = [k for k, _, _ in got.by_line]
        assert (frame_label(top) if top else "(no frames recorded)") in labels


def test_the_second_device_has_its_own_moments(snap, views):
    entries = snap["device_traces"][1]
    d, a, b = views.device_range(1)
    assert d == 1 and b - a == len(entries)
    row = a + 4000
    live, segs = _replay(entries, 4000)
    got = views.live_at(row)
    assert got.device == 1 and got.allocated == sum(e["size"] for e in live.values())
    with pytest.raises(ValueError, match="no trace entries for device 5"):
        views.device_range(5)
    with pytest.raises(IndexError, match="not an entry"):
        views.live_at(10**9)


def test_the_segment_map_holds_the_live_blocks_inside_their_segments(views):
    row = 3000
    segs = views.segment_map_at(row, max_segments=10_000, max_blocks=10**6)
    live = views.live_at(row)
    assert sum(s["size"] for s in segs) == live.reserved
    blocks = [b for s in segs for b in s["blocks"]]
    assert len(blocks) == live.n_blocks
    for s in segs:
        for addr, size, _ in s["blocks"]:
            assert s["address"] <= addr and addr + size <= s["address"] + s["size"]
    few = views.segment_map_at(row, max_segments=3, max_blocks=5)
    assert len(few) == 3 and sum(len(s["blocks"]) for s in few) <= 5


def test_tiles_keep_every_peak_in_a_bounded_number_of_bins(views):
    d, a, b = views.device_range(0)
    tile = views.tile(a, b, bins=64)
    assert len(tile["rows"]) == 64
    assert max(tile["alloc_max"]) == int(views.allocated[a:b].max())
    assert min(tile["alloc_min"]) == int(views.allocated[a:b].min())
    assert max(tile["reserved_max"]) == int(views.reserved[a:b].max())
    small = views.tile(a, a + 10, bins=64)
    assert small["rows"] == list(range(a, a + 10))


def test_coarse_tiles_come_from_the_block_summary_and_keep_the_peaks(snap, monkeypatch):
    views = TraceViews(index_snapshot(snap))
    monkeypatch.setattr(views, "PYRAMID_BLOCK", 16)
    d, a, b = views.device_range(0)
    tile = views.tile(a, b, bins=50)  # 6000 rows: 375 blocks, 7 per bin
    assert len(tile["rows"]) == 50 and tile["rows"][0] == a
    assert max(tile["alloc_max"]) == int(views.allocated[a:b].max())
    assert max(tile["reserved_max"]) == int(views.reserved[a:b].max())
    fine = views.tile(a, a + 500, bins=50)  # few rows per bin: the rows themselves
    assert fine["rows"][:3] == [a, a + 10, a + 20]
    assert {r for r, _ in tile["cells"]} <= set(range(a, b))


def test_search_by_text_address_and_size(snap, views):
    entries = [e for t in snap["device_traces"] for e in t]
    found = views.search("OPTIM.py")
    want = [i for i, e in enumerate(entries) if any("optim.py" in f["filename"] for f in e["frames"])]
    assert found.count == len(want) and found.rows.tolist() == want[:200]
    e = next(e for e in entries if e["action"] == "alloc" and e["size"] > 4096)
    found = views.search(address=e["addr"] + 100)
    assert entries.index(e) in found.rows.tolist()
    assert all(entries[r]["addr"] <= e["addr"] + 100 < entries[r]["addr"] + entries[r]["size"]
               for r in found.rows.tolist())
    found = views.search(size_range=(1 << 20, 2 << 20), limit=5)
    want = [i for i, e in enumerate(entries)
            if e["action"] == "alloc" and (1 << 20) <= e["size"] <= (2 << 20)]
    assert found.count == len(want) and len(found.rows) == 5
    assert views.search().count == len(entries)


def test_diff_attributes_the_peak_change_to_lines(tmp_path):
    a = synthetic_snapshot(4000, seed=5)
    b = synthetic_snapshot(4000, seed=5)
    grow = b["device_traces"][0]
    # b allocates 100 MiB more at one new line, live to the end
    extra = {"action": "alloc", "addr": 0x10, "size": 100 << 20, "stream": 0,
             "time_us": grow[-1]["time_us"] + 1, "frames": [
                 {"filename": "/home/user/proj/new.py", "line": 7, "name": "cache"},
                 {"filename": "/usr/lib/python3/site-packages/IPython/core/interactiveshell.py",
                  "line": 3577, "name": "run_code"}],
             "compile_context": "", "user_metadata": ""}
    grow.append(extra)
    pa, pb = tmp_path / "a.pickle", tmp_path / "b.pickle"
    for p, s in ((pa, a), (pb, b)):
        p.write_bytes(__import__("cudalab.memory_tools.trace_io", fromlist=["x"]).dumps_snapshot(s))
    d = cm.diff(str(pa), str(pb))  # two files: read at once in two worker processes
    assert d.names == ("a.pickle", "b.pickle")
    assert diff(pa, pb, parallel=False) == d  # the same, read here one after the other
    va = TraceViews(index_snapshot(a))
    assert d.peak_allocated[0] == int(va.allocated.max())
    assert d.allocated_lines[0].line == "new.py:7 (cache)"
    assert d.allocated_lines[0].delta > 0
    assert [x.line for x in d.appeared][:1] == ["new.py:7 (cache)"]
    assert "new.py:7 (cache)" in repr(d) and "new.py:7 (cache)" in d._repr_html_()
    same = diff(a, a)
    assert same.allocated_delta == 0 and same.allocated_lines == [] and same.notes == []


def test_diff_says_when_the_runs_differ_in_origin():
    a = synthetic_snapshot(500, seed=1)
    b = synthetic_snapshot(500, seed=1, cudalab_keys=False)
    a["identity"] = {"host": "h", "pid": 1, "version": "1", "allocator": "cudalab",
                     "device_name": "NVIDIA H200"}
    b["identity"] = {"host": "h", "pid": 2, "version": "1", "allocator": "torch",
                     "device_name": "NVIDIA A100"}
    d = diff(a, b)
    text = " ".join(d.notes)
    assert "different devices" in text and "NVIDIA A100" in text
    assert "different sources" in text
    with pytest.raises(TypeError, match="paths, snapshot dicts"):
        diff(1, a)


def test_user_frames_fold_the_notebook_machinery():
    cell = {"filename": "/tmp/ipykernel_123/456.py", "line": 3, "name": "<module>"}
    ipy = [{"filename": f"/venv/lib/python3.12/site-packages/IPython/core/{f}.py", "line": 1,
            "name": n} for f, n in (("interactiveshell", "run_code"),
                                    ("interactiveshell", "run_ast_nodes"))]
    kernel = {"filename": "/venv/lib/python3.12/site-packages/ipykernel/kernelbase.py",
              "line": 9, "name": "dispatch_shell"}
    loop = {"filename": "/usr/lib/python3.12/asyncio/base_events.py", "line": 1,
            "name": "run_forever"}
    frames = [cell, *ipy, kernel, loop]
    assert not is_tool_frame(cell) and all(map(is_tool_frame, [*ipy, kernel, loop]))
    assert fold_frames(frames) == ([cell], 4)
    assert fold_frames(ipy) == (ipy, 0)  # nothing but machinery: shown whole
    assert first_user_frame([*ipy, cell]) is cell
    text = frames_html(frames)
    assert "456.py:3" in text and "<details" in text and "4 IPython/ipykernel frames" in text
    assert text.index("456.py:3") < text.index("<details")
    assert "run_code" in text.split("<details", 1)[1]  # one click away, not gone


def test_the_synthetic_writer_writes_what_synthetic_snapshot_builds(tmp_path):
    path = tmp_path / "w.pickle"
    size = write_synthetic_pickle(path, 3000, devices=2, seed=4)
    assert size == path.stat().st_size
    want = synthetic_snapshot(3000, devices=2, seed=4)
    got = load_snapshot(path)
    assert got["device_traces"] == want["device_traces"]
    assert got["segments"] == want["segments"]
    a, b = open_trace(path), index_snapshot(want)
    for name, _ in COLUMNS:
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_a_truncated_synthetic_file_is_refused(tmp_path):
    path = tmp_path / "w.pickle"
    write_synthetic_pickle(path, 2000)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SnapshotLoadError, match="truncated"):
        open_trace(path)


def test_totals_only_views_draw_the_same_timeline(snap, views):
    lite = TraceViews(views.index, pairs=False)
    assert np.array_equal(lite.allocated, views.allocated)
    assert np.array_equal(lite.reserved, views.reserved)
    d, a, b = views.device_range(0)
    assert lite.tile(a, b, 40) == views.tile(a, b, 40)
    assert len(lite.block_row) == 0 and lite.live_at(a + 10).n_blocks == 0


def test_live_blocks_of_a_private_pool_are_grouped_by_that_pool(tmp_path):
    """A real recording on the simulator: a MemPool's block is under "user (0, n)", the
    default pool's under small/large; the C reader and its twin agree on the pool column."""
    import cudalab
    from cudalab.memory_tools.trace_io import dumps_snapshot

    cudalab.init()
    pool = cm.MemPool()
    with cm.record_history(clear_history=True):
        with cm.use_mem_pool(pool):
            x = cm.caching_allocator_alloc(4096)
        y = cm.caching_allocator_alloc(4 << 20)
        snap = cm._snapshot()
    try:
        path = tmp_path / "pools.pickle"
        path.write_bytes(dumps_snapshot(snap))
        ix = open_trace(path)
        twin = index_snapshot(snap)
        assert np.array_equal(ix.pool, twin.pool) and ix.pools == twin.pools == [pool.id]
        views = TraceViews(ix)
        d, a, b = views.device_range(0)
        live = views.live_at(b - 1)
        labels = {label: nbytes for label, nbytes, _ in live.by_pool}
        assert labels[f"user ({pool.id[0]}, {pool.id[1]})"] == 4096
        assert labels["large"] >= 4 << 20
    finally:
        cm.caching_allocator_delete(x)
        cm.caching_allocator_delete(y)


def _mangled(seed):
    """A synthetic trace with the faults a ring buffer or a broken recorder leaves: frees
    of addresses never allocated, second allocations of a live address, second frees."""
    snap = synthetic_snapshot(3000, devices=2, seed=seed)
    rng = np.random.default_rng(seed)
    for entries in snap["device_traces"]:
        for i in sorted(rng.choice(len(entries), 40, replace=False).tolist(), reverse=True):
            e = dict(entries[i])
            if e["action"] in ("alloc", "free_completed", "segment_alloc", "segment_free"):
                entries.insert(i + int(rng.integers(1, 50)), e)  # the same event again, later
        entries.insert(0, {**entries[5], "action": "free_completed", "addr": 0x7777})
    # the second device's totals start at 0 on a row that moves none, then go negative
    snap["device_traces"][1].insert(0, {**snap["device_traces"][1][5],
                                        "action": "free_requested"})
    return snap


@pytest.mark.parametrize("seed", [3, 4, 11])
def test_peak_lines_from_the_columns_equal_the_views(seed, snap):
    from cudalab.memory_tools.trace_diff import peak_by_line, peak_lines

    for s in (snap if seed == 3 else synthetic_snapshot(5000, devices=2, seed=seed),
              _mangled(seed)):
        ix = index_snapshot(s)
        views = TraceViews(ix)
        for device in (None, 0, 1):
            assert peak_lines(ix, device) == peak_by_line(views, device), (seed, device)
    with pytest.raises(ValueError, match="no trace entries for device 5"):
        peak_lines(ix, 5)
    empty = index_snapshot({"segments": [], "device_traces": [[]]})
    assert peak_lines(empty) == peak_by_line(TraceViews(empty)) == (0, 0, {}, {})
