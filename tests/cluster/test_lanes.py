"""Every rank's snapshot as a lane on one time axis: cudalab.memory_tools.trace_lanes and
cudalab.widgets.LanesExplorer, on snapshots of 2-4 simulated ranks (hand-made traces whose
times and sizes are known) and on the cluster dashboard's records."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("ipywidgets")

from cudalab.cluster.records import RankRecords  # noqa: E402
from cudalab.identity import Identity  # noqa: E402
from cudalab.memory_tools.samples import DeviceSample  # noqa: E402
from cudalab.memory_tools.trace_lanes import Lane, TraceLanes, lane, lost_lane, trace_lanes  # noqa: E402
from cudalab.widgets import LanesExplorer, SnapshotExplorer  # noqa: E402
from cudalab.widgets.cluster_dashboard import rank_label, rank_lanes  # noqa: E402
from tests.cluster.helpers import T0, MiB, rank_snapshot  # noqa: E402


def _last(snap: dict) -> int:
    return max(e["time_us"] for t in snap["device_traces"] for e in t)


def _labels(svg: str) -> list[str]:
    return re.findall(r'class="cudalab-lanes-lane[^"]*" data-lane="\d+" data-label="([^"]*)"', svg)


def test_lanes_keep_their_order_and_share_one_time_axis():
    snaps = {f"rank {r}": rank_snapshot(r, T0 + 1000 * r, blocks=5 + r) for r in (2, 0, 1)}
    lanes = trace_lanes(snaps, keys={f"rank {r}": r for r in range(3)})
    assert [x.label for x in lanes.lanes] == ["rank 2", "rank 0", "rank 1"]  # as given
    assert [x.key for x in lanes.lanes] == [2, 0, 1]
    assert [x.entries for x in lanes.lanes] == [1 + 7 + 2 * 6, 1 + 5 + 2 * 4, 1 + 6 + 2 * 5]
    # the axis: the first entry of any lane to the last of any
    assert lanes.bounds == (T0, max(_last(s) for s in snaps.values()))
    assert lanes.lane_bounds(1) == (T0, _last(snaps["rank 0"]))
    assert lanes.lane_bounds(0) == (T0 + 2000, _last(snaps["rank 2"]))
    # a tile over the whole axis: each lane's bins sit at its own times, its peak is its own
    a, b = lanes.bounds
    for i, r in enumerate((2, 0, 1)):
        tile = lanes.tile(i, a, b, bins=1000)
        assert tile["x_us"][0] == T0 + 1000 * r and tile["end_us"][-1] == _last(snaps[f"rank {r}"])
        assert all(x0 <= x1 for x0, x1 in zip(tile["x_us"], tile["end_us"]))
        assert max(tile["alloc_max"]) == (5 + r) * (r + 1) * MiB  # every block live at once
        assert tile["alloc_min"][0] == 0 and max(tile["reserved_max"]) == 64 * MiB
    # a window inside rank 0's allocations: the level before the window holds at its start
    tile = lanes.tile(1, T0 + 25, T0 + 35, bins=10)
    assert tile["x_us"][0] == T0 + 25 and tile["alloc_max"][0] == 2 * MiB  # (2 blocks by T0+20)
    assert tile["end_us"][-1] == T0 + 30 and tile["alloc_max"][-1] == 3 * MiB
    # the row in effect at a time: the last entry at or before it; None before the first
    assert lanes.row_at(1, T0 + 25) == lanes.lanes[1].start + 2
    assert lanes.row_at(1, T0 - 1) is None and lanes.row_at(0, T0 + 1999) is None
    assert lanes.tile(1, T0 - 100, T0 - 10)["rows"] == []  # before the lane began


def test_a_lost_lane_keeps_its_place_and_says_why():
    lanes = trace_lanes({"rank 0": rank_snapshot(0, T0, 3), "rank 1": None,
                         "rank 2": {"segments": "not a list"}},
                        errors={"rank 1": "timed out after 10 s", "rank 3": "not a live rank"})
    assert [x.label for x in lanes.lanes] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert [x.lost for x in lanes.lanes] == [False, True, True, True]
    assert lanes.lanes[1].error == "timed out after 10 s"
    assert lanes.lanes[2].error.startswith("cannot read the trace: SnapshotLoadError")
    assert lanes.lanes[3].error == "not a live rank"
    assert lanes.bounds == (T0, _last(rank_snapshot(0, T0, 3)))  # lost lanes add no time
    assert lanes.tile(1, *lanes.bounds)["rows"] == [] and lanes.row_at(1, T0 + 5) is None
    assert "4 lanes, 3 lost" in repr(lanes)
    empty = TraceLanes([lost_lane("rank 9", "gone")])
    assert empty.bounds == (0, 1)


def test_lane_records_check_their_invariants():
    with pytest.raises(ValueError, match="label"):
        lost_lane("", "why")
    with pytest.raises(ValueError, match="exactly one"):
        Lane("rank 0", None, -1, 0, 0)
    with pytest.raises(ValueError, match="not a range"):
        Lane("rank 0", lane("x", rank_snapshot(0, T0, 2)).views, 0, 5, 2)
    with pytest.raises(TypeError, match="not int"):
        lane("rank 0", 42)
    with pytest.raises(TypeError, match="Lane records"):
        TraceLanes(["rank 0"])  # type: ignore[list-item]
    # a device with entries is shown; one without falls back to the first that has some
    snap = rank_snapshot(1, T0, 3, device=1)
    assert lane("r", snap, device=1).device == 1 and lane("r", snap, device=0).device == 1


def test_the_explorer_draws_a_lane_per_rank_and_pans_zooms_and_picks_across_them():
    snaps = {f"rank {r}": rank_snapshot(r, T0 + 1000 * r, blocks=4) for r in range(3)}
    ex = LanesExplorer(snaps, errors={"rank 3": "did not answer"}, width=400)
    svg = ex._timeline.value  # noqa: SLF001
    assert _labels(svg) == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert 'data-lanes="4"' in svg and svg.count('data-lost="1"') == 1
    assert "lost: did not answer" in svg
    assert "data-lost='1'" in ex._summary.value  # noqa: SLF001
    lo, hi = ex.lanes.bounds
    assert ex.window == (lo, hi)
    # zoom in around the middle, pan, zoom out past everything, reset
    ex.command("zoom 0.5 0.5")
    a, b = ex.window
    assert lo < a < b < hi and b - a == pytest.approx((hi - lo) / 2)
    ex.command("pan 0.25")
    assert ex.window[0] == pytest.approx(a + (b - a) / 4)
    ex.command("pan 100")
    assert ex.window[1] == pytest.approx(hi)  # (never past the axis)
    ex.command("zoom 0.5 50")
    assert ex.window == (lo, hi)
    sent = ex.tiles_sent
    ex._cmd.value = "zoom 0.2 0.5 12345"  # (what the page sends: a command and a stamp)  # noqa: SLF001
    assert ex.tiles_sent == sent + 1 and ex.window[1] - ex.window[0] == pytest.approx((hi - lo) / 2)
    ex._cmd.value = "nonsense 1 2"  # (ignored)  # noqa: SLF001
    ex.command("reset")
    # a click in rank 1's lane at rank 1's third allocation: its live set below, the moment
    # drawn across every lane
    span = hi - lo
    row = ex.pick(1, T0 + 1000 + 30)
    assert row == ex.lanes.lanes[1].start + 3
    live = ex._live.value  # noqa: SLF001
    assert "rank 1" in live and "data-allocated='6291456'" in live  # 3 blocks of 2 MiB
    assert 'class="cudalab-explorer-moment"' in ex._timeline.value  # noqa: SLF001
    ex.command(f"click {(T0 + 10 - lo) / span:.6f} 0")
    assert ex.moment_row == ex.lanes.lanes[0].start + 1 and "data-allocated='1048576'" in ex._live.value  # noqa: SLF001
    assert ex.pick(3, lo) is None and "lost: did not answer" in ex._live.value  # noqa: SLF001
    assert ex.pick(2, lo) is None and "before this lane" in ex._live.value  # noqa: SLF001
    with pytest.raises(IndexError, match="4 lanes"):
        ex.pick(4, lo)
    # the highest peak of any lane: rank 2's, when its 4 blocks of 3 MiB are all live
    lane_2 = ex.lanes.lanes[2]
    assert ex.peak() == (2, T0 + 2000 + 40)
    ex.command("peak")
    assert ex.moment == (2, T0 + 2000 + 40) and ex.moment_row == lane_2.start + 4
    assert "data-allocated='12582912'" in ex._live.value  # noqa: SLF001
    assert LanesExplorer({"x": None}, errors={"x": "gone"}).peak() is None
    with pytest.raises(ValueError, match="unknown command"):
        ex.command("explode")
    bundle = ex._repr_mimebundle_()
    assert "cudalab-lanes-timeline" in bundle["text/html"] and "4 lanes" in bundle["text/plain"]


def test_the_single_trace_explorer_is_unchanged_by_the_lanes():
    snap = rank_snapshot(0, T0, 4)
    single = SnapshotExplorer(snap, width=300)
    assert single.window == (0, len(snap["device_traces"][0]))
    ex = LanesExplorer({"rank 0": snap}, width=300, bins=300)
    tile = ex.tiles()[0]
    # one lane's bins are the single explorer's bins of the same rows
    views = single.views
    assert views is not None
    same = views.tile(0, len(snap["device_traces"][0]), 300)
    assert tile["alloc_max"] == same["alloc_max"] and tile["rows"] == same["rows"]


def test_bad_explorer_arguments():
    with pytest.raises(ValueError, match="at least"):
        LanesExplorer({"a": rank_snapshot(0, T0, 2)}, width=10)


def _sample(rank: int, device: int = 0) -> DeviceSample:
    identity = Identity(host="node7", pid=100 + rank, version="0", allocator="cudalab", rank=rank,
                        world_size=4, device=device, device_name="NVIDIA H200")
    return DeviceSample(time=1.0, source="cudalab", identity=identity, capacity=80 * MiB,
                        allocated=0, reserved=0, peak_allocated=0, peak_reserved=0, requested=0,
                        allocations=0, allocations_total=0, segments=0, num_ooms=0,
                        num_alloc_retries=0)


def ident(host: str, rank: int) -> Identity:
    return Identity(host=host, pid=100 + rank, version="0", allocator="cudalab", rank=rank,
                    world_size=4)


def test_rank_lanes_label_every_rank_and_keep_a_silent_one_as_lost():
    records = {r: RankRecords(identity=ident("node7", r),
                              sent_snapshot=rank_snapshot(r, T0 + 100 * r, 3))
               for r in (0, 2, 3)}
    samples = {r: [_sample(r)] for r in range(4)}
    lanes = rank_lanes(records, {1: "timed out"}, samples)
    assert [x.key for x in lanes.lanes] == [0, 1, 2, 3]
    assert [x.label for x in lanes.lanes] == [
        f"rank {r} · node7 · cuda:0 (NVIDIA H200)" for r in range(4)]
    assert [x.lost for x in lanes.lanes] == [False, True, False, False]
    assert lanes.lanes[1].error == "timed out"
    assert lanes.bounds == (T0, _last(records[3].sent_snapshot))  # type: ignore[arg-type]
    # a rank whose answer came without a snapshot, one whose snapshot is unreadable, one
    # known only from its samples: each a lost lane, in rank order
    odd = {0: RankRecords(identity=ident("node7", 0)),
           2: RankRecords(identity=ident("node7", 2),
                          sent_snapshot={"segments": 5})}
    lanes = rank_lanes(odd, {}, {1: [_sample(1)], 2: [_sample(2)]})
    assert [x.key for x in lanes.lanes] == [0, 1, 2]
    assert all(x.lost for x in lanes.lanes)
    assert lanes.lanes[0].label == "rank 0 · node7"
    assert "cannot read its snapshot" in lanes.lanes[2].error
    # a trace on another device than the samples' names that device
    moved = {0: RankRecords(identity=ident("h", 0),
                            sent_snapshot=rank_snapshot(0, T0, 2, device=1))}
    lanes = rank_lanes(moved, {}, {0: [_sample(0, device=0)]})
    assert lanes.lanes[0].device == 1 and lanes.lanes[0].label == "rank 0 · h · cuda:1"
    assert rank_label(5, "", None) == "rank 5"


def test_a_rank_trace_is_indexed_from_its_columns_as_from_its_dicts():
    """What travelled as columns (a recorded history, through encode and decode) indexes to
    the same columns and tables as the snapshot's dicts do."""
    import numpy as np

    import cudalab
    from cudalab import memory
    from cudalab.cluster import records
    from cudalab.memory_tools.column_index import index_columns
    from cudalab.memory_tools.safe_pickle import SnapshotLoadError
    from cudalab.memory_tools.trace_index import COLUMNS, index_snapshot

    memory.record_history(max_entries=5000)
    try:
        kept = [cudalab.zeros(1000 + 64 * k) for k in range(40)]
        for k in range(300):
            a = cudalab.empty(512 + (k % 9) * 4096)
            del a
        got = records.decode(records.encode(records.collect(("snapshot",))), "rank 0")
    finally:
        memory.record_history(enabled=None)
    assert got.trace_columns and not any(got.sent_snapshot["device_traces"])
    fast = index_columns(got.sent_snapshot, got.trace_columns, source="rank 0")
    slow = index_snapshot(got.snapshot, source="rank 0")
    assert fast.n == slow.n > 600
    for name, _ in COLUMNS:
        assert np.array_equal(getattr(fast, name), getattr(slow, name)), name
    for name in ("action_names", "strings", "pools", "frames"):
        assert getattr(fast, name) == getattr(slow, name), name
    assert np.array_equal(fast.stack_offsets, slow.stack_offsets)
    assert np.array_equal(fast.stack_frames, slow.stack_frames)
    assert fast.snapshot["segments"] == slow.snapshot["segments"]
    # entries left in the snapshot, or a column without sizes, are refused
    with pytest.raises(SnapshotLoadError, match="all in the columns"):
        index_columns(got.snapshot, got.trace_columns)
    (d, cols), = got.trace_columns.items()
    broken = type("C", (), {"n": cols.n, "columns": {**cols.columns, "size": [None] * cols.n}})
    with pytest.raises(SnapshotLoadError, match="lacks 'size'"):
        index_columns(got.sent_snapshot, {d: broken})
    del kept
