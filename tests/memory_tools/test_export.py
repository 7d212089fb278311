"""cudalab.memory_tools.export (DataFrames of snapshots/history), .perfetto (the Chrome/Perfetto
trace), .trace_columns and .trace_io.read_history_csv."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pd = pytest.importorskip("pandas")

from cudalab.memory_tools.export import (  # noqa: E402
    ACTIONS,
    history_frame,
    segments_frame,
    snapshot_frame,
    stats_frame,
)
from cudalab.memory_tools.perfetto import _assign_lanes, export_perfetto  # noqa: E402
from cudalab.memory_tools.synthetic import synthetic_snapshot  # noqa: E402
from cudalab.memory_tools.trace_columns import stream_label  # noqa: E402
from cudalab.memory_tools.trace_io import read_history_csv  # noqa: E402

HISTORY_DTYPES = {
    "time": "datetime64[us]", "time_us": "int64", "device": "int64", "stream": "int64",
    "action": "category", "addr": "int64", "size": "int64", "device_free": "int64",
    "filename": "object", "line": "Int64", "name": "object", "cell": "object",
    "nvtx_range": "object", "allocated": "int64", "reserved": "int64",
}
BLOCK_DTYPES = {
    "device": "int64", "segment_address": "int64", "segment_total_size": "int64",
    "segment_type": "category", "segment_stream": "int64", "is_expandable": "bool",
    "address": "int64", "size": "int64", "requested_size": "int64", "state": "category",
    "filename": "object", "line": "Int64", "name": "object",
}
SEGMENT_DTYPES = {
    "device": "int64", "address": "int64", "total_size": "int64", "allocated_size": "int64",
    "active_size": "int64", "requested_size": "int64", "stream": "int64",
    "segment_type": "category", "is_expandable": "bool", "n_blocks": "int64",
    "free_size": "int64", "largest_free_block": "int64", "fragmentation": "float64",
}
EMPTY = {"segments": [], "device_traces": [], "allocator_settings": {},
         "external_annotations": []}
FR = [{"filename": "train.py", "line": 12, "name": "step"},
      {"filename": "main.py", "line": 3, "name": "<module>"}]


def _dtypes(df) -> dict:
    return {c: str(t) for c, t in df.dtypes.items()}


def _e(action, addr, size, t, stream=0, frames=(), **kw):
    """A torch-2.11-style trace entry (plus any cudalab keys given in kw)."""
    e = {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": t,
         "frames": list(frames), "compile_context": "", "user_metadata": ""}
    if action == "oom":
        e["device_free"] = e.pop("addr")
    e.update(kw)
    return e


MB = 1 << 20
# a hand-written device-0 history: segment 2 MiB, two allocs, one freed, a map/unmap pair
HAND = [
    _e("segment_alloc", 0x1000_0000, 2 * MB, 100, frames=FR),   # reserved 2M
    _e("alloc", 0x1000_0000, 512, 101, frames=FR),              # allocated 512
    _e("alloc", 0x1000_0200, 1024, 105, cell="c1", nvtx_range="fwd"),  # 1536
    _e("free_requested", 0x1000_0000, 512, 110),                # unchanged
    _e("free_completed", 0x1000_0000, 512, 112),                # 1024
    _e("segment_map", 0x2000_0000, 4 * MB, 120),                # reserved 6M
    _e("oom", 777, 8 * MB, 125, frames=FR),                     # device_free 777
    _e("segment_unmap", 0x2000_0000, 4 * MB, 130),              # reserved 2M
    _e("snapshot", 0, 0, 140),
    _e("free_requested", 0x1000_0200, 1024, 150),
    _e("free_completed", 0x1000_0200, 1024, 151),               # 0
    _e("segment_free", 0x1000_0000, 2 * MB, 160),               # reserved 0
]


def _hand_snapshot(**extra):
    snap = {"segments": [], "device_traces": [list(HAND)], "allocator_settings": {},
            "external_annotations": []}
    snap.update(extra)
    return snap


# --------------------------------------------------------------------------- history_frame
def test_history_columns_and_dtypes_generated():
    snap = synthetic_snapshot(3000, devices=2)
    df = history_frame(snap)
    assert _dtypes(df) == HISTORY_DTYPES
    assert len(df) == sum(len(t) for t in snap["device_traces"])
    assert list(df["action"].cat.categories[:9]) == list(ACTIONS)
    assert df["time_us"].is_monotonic_increasing  # devices interleaved by time
    assert set(df["device"]) == {0, 1}
    assert (df["time"] == pd.to_datetime(df["time_us"], unit="us")).all()
    assert df["cell"].isin([None, "cell-1", "cell-2"]).all()
    # top frame: first frame of the entry, None/<NA> where there are no frames
    entries = [e for tr in snap["device_traces"] for e in tr]
    no_frames = sum(1 for e in entries if not e["frames"])
    assert df["filename"].isna().sum() == no_frames == df["line"].isna().sum()


def test_history_empty_snapshot():
    for snap in (EMPTY, {"segments": []}, {"segments": [], "device_traces": [[], []]}):
        df = history_frame(snap)
        assert len(df) == 0
        assert _dtypes(df) == HISTORY_DTYPES


def test_running_totals_hand_written():
    df = history_frame(_hand_snapshot())
    assert df["allocated"].tolist() == [0, 512, 1536, 1536, 1024, 1024, 1024, 1024, 1024, 1024,
                                        0, 0]
    assert df["reserved"].tolist() == [2 * MB] * 5 + [6 * MB] * 2 + [2 * MB] * 4 + [0]
    assert df["action"].tolist() == [e["action"] for e in HAND]
    oom = df[df["action"] == "oom"].iloc[0]
    assert oom["device_free"] == 777 and oom["addr"] == 0 and oom["size"] == 8 * MB
    assert (df.loc[df["action"] != "oom", "device_free"] == -1).all()
    row = df.iloc[0]
    assert (row["filename"], row["line"], row["name"]) == ("train.py", 12, "step")
    row = df.iloc[2]
    assert row["filename"] is None and pd.isna(row["line"]) and row["name"] is None
    assert (row["cell"], row["nvtx_range"]) == ("c1", "fwd")
    assert df.iloc[0]["cell"] is None and df.iloc[0]["nvtx_range"] is None


def test_running_totals_are_per_device():
    dev1 = [_e("segment_alloc", 0x9000, MB, 102), _e("alloc", 0x9000, 100, 103)]
    snap = {"segments": [], "device_traces": [list(HAND), dev1]}
    df = history_frame(snap)
    d1 = df[df["device"] == 1]
    assert d1["allocated"].tolist() == [0, 100]
    assert d1["reserved"].tolist() == [MB, MB]
    d0 = df[df["device"] == 0]
    assert d0["allocated"].tolist() == history_frame(_hand_snapshot())["allocated"].tolist()
    only1 = history_frame(snap, device=1)
    assert only1["device"].tolist() == [1, 1]
    assert history_frame(snap, device="cuda:1")["allocated"].tolist() == [0, 100]
    assert len(history_frame(snap, device=5)) == 0


def test_torch_style_snapshot_without_cudalab_keys():
    snap = synthetic_snapshot(2000, cudalab_keys=False)
    assert "cudalab" not in snap
    assert not any(k in e for e in snap["device_traces"][0] for k in ("device", "cell",
                                                                      "nvtx_range"))
    df = history_frame(snap)
    assert _dtypes(df) == HISTORY_DTYPES
    assert df["cell"].map(lambda v: v is None).all()
    assert df["nvtx_range"].map(lambda v: v is None).all()
    assert set(df["device"]) == {0}
    # totals match the final segments (the generator starts from an empty device)
    assert df["reserved"].iloc[-1] == sum(s["total_size"] for s in snap["segments"])
    assert len(snapshot_frame(snap)) == sum(len(s["blocks"]) for s in snap["segments"])


def test_final_totals_match_generated_segments():
    snap = synthetic_snapshot(5000, devices=2, streams=(0, 11, 22))
    df = history_frame(snap)
    seg = segments_frame(snap)
    for d in (0, 1):
        last = df[df["device"] == d].iloc[-1]
        sd = seg[seg["device"] == d]
        assert last["reserved"] == sd["total_size"].sum()
        live = snapshot_frame(snap).query("device == @d and state == 'active_allocated'")
        assert last["allocated"] == live["requested_size"].sum()


def test_unknown_action_and_big_stream_handle():
    big = (1 << 63) + 5
    snap = {"device_traces": [[_e("alloc", 16, 8, 1, stream=big),
                               _e("custom_thing", 0, 0, 2, stream=big)]]}
    df = history_frame(snap)
    assert list(df["action"]) == ["alloc", "custom_thing"]
    assert df["stream"].dtype == np.uint64 and int(df["stream"].iloc[0]) == big


def test_snapshot_fallback_when_no_recorder(monkeypatch):
    from cudalab.memory_tools import trace_columns

    snap = _hand_snapshot()
    monkeypatch.setattr(trace_columns, "live_history", lambda: None)
    monkeypatch.setattr(trace_columns, "take_snapshot", lambda: snap)
    assert len(history_frame()) == len(HAND)
    assert history_frame()["allocated"].tolist() == history_frame(snap)["allocated"].tolist()


def _recording():
    import cudalab.memory as cm

    rec = getattr(cm, "_record_memory_history", None)
    if rec is None or not hasattr(cm, "_snapshot"):
        pytest.skip("history recording (H-history) is not in this tree yet")
    return rec


def test_history_from_recorded_run(tmp_path):
    import cudalab
    import cudalab.memory as cm

    rec = _recording()
    cudalab.init()
    s1 = cudalab.Stream()
    rec("all", max_entries=10_000)
    try:
        p = cm.caching_allocator_alloc(4096)
        q = cm.caching_allocator_alloc(3 << 20, stream=s1)
        cm.caching_allocator_delete(p)
        live = history_frame()  # the recorder read directly
        live_x = _load(export_perfetto(tmp_path / "live.json"))
        snap = cm._snapshot()  # appends a "snapshot" entry after reading the trace (as torch)
        after = history_frame()
        cm.caching_allocator_delete(q)
    finally:
        rec(None)
    df = history_frame(snap)
    assert _dtypes(live) == _dtypes(df) == HISTORY_DTYPES
    n = len(live)
    # the snapshot's trace holds what was recorded before it: its own entries (one per device
    # that has an allocator, as torch) come after, in the live history
    n_alloc_devices = sum(a is not None for a in cudalab.allocator.registry.allocators)
    assert len(df) == n
    assert after["action"].astype(str).tolist()[n:] == ["snapshot"] * n_alloc_devices
    cols = [c for c in HISTORY_DTYPES if c not in ("action",)]
    pd.testing.assert_frame_equal(live[cols], df[cols].iloc[:n])
    assert live["action"].astype(str).tolist() == df["action"].astype(str).tolist()[:n]
    assert {"alloc", "free_completed"} <= set(live["action"].astype(str))
    assert live["filename"].notna().all() and (live["filename"] == __file__).any()
    assert set(live["stream"]) == {0, s1.cuda_stream}
    assert live["allocated"].iloc[-1] == 3 << 20
    _check_trace(live_x)
    names = [e["args"]["name"] for e in live_x["traceEvents"] if e["name"] == "process_name"]
    sim = cudalab.devices.backend().simulated
    assert names == ["cuda:0 (simulated)" if sim else "cuda:0"]
    xs = [e for e in live_x["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["args"]["size"] for e in xs) == [4096, 3 << 20]
    data = _load(export_perfetto(tmp_path / "snap.json", snap))
    _check_trace(data)


def test_segments_frames_default_to_live_memory_snapshot():
    import cudalab
    import cudalab.memory as cm

    cudalab.init()
    p = cm.caching_allocator_alloc(12345)
    try:
        blocks = snapshot_frame()
        assert p in set(blocks["address"])
        row = blocks[blocks["address"] == p].iloc[0]
        assert row["state"] == "active_allocated" and row["requested_size"] == 12345
        segs = segments_frame()
        assert int(row["segment_address"]) in set(segs["address"])
    finally:
        cm.caching_allocator_delete(p)


def test_history_csv_round_trip(tmp_path):
    snap = synthetic_snapshot(2000, devices=2)
    snap["device_traces"][0].extend(HAND)  # frames, None cells, an oom
    df = history_frame(snap)
    p = tmp_path / "h.csv"
    df.to_csv(p, index=False)
    back = read_history_csv(p)
    assert _dtypes(back) == HISTORY_DTYPES
    pd.testing.assert_frame_equal(back, df, check_categorical=False)
    assert list(back["action"].cat.categories[:9]) == list(ACTIONS)
    # plain pandas reads the same values too (dtypes then inferred)
    plain = pd.read_csv(p)
    assert plain["allocated"].tolist() == df["allocated"].tolist()


def test_frames_parquet_round_trip(tmp_path):
    pytest.importorskip("pyarrow")
    snap = synthetic_snapshot(2000, devices=2)
    for name, df in (("h", history_frame(snap)), ("b", snapshot_frame(snap)),
                     ("s", segments_frame(snap))):
        p = tmp_path / f"{name}.parquet"
        df.to_parquet(p)
        back = pd.read_parquet(p)
        for col in df.columns:  # string columns may come back as pandas' str dtype
            if df[col].dtype == object:  # None may come back as NaN in a str column
                assert [None if pd.isna(v) else v for v in back[col]] == df[col].tolist(), col
            else:
                assert back[col].dtype == df[col].dtype, col
                pd.testing.assert_series_equal(back[col], df[col], check_categorical=False)


def _tiled(n_total: int, base_entries: int = 100_000) -> dict:
    """A generated history repeated (shifted in time) up to ``n_total`` entries: cheaper to
    build than one 1M-entry generation, same per-entry shape."""
    base = synthetic_snapshot(base_entries)
    tr = base["device_traces"][0]
    span = tr[-1]["time_us"] - tr[0]["time_us"] + 1
    out: list = []
    k = 0
    while len(out) < n_total:
        off = k * span
        out += [{**e, "time_us": e["time_us"] + off} for e in tr[: n_total - len(out)]]
        k += 1
    base["device_traces"] = [out]
    return base


def test_history_1m_entries_to_dataframe():
    snap = _tiled(1_000_000)
    t0 = time.perf_counter()
    df = history_frame(snap)
    dt = time.perf_counter() - t0
    print(f"\nhistory_frame of 1M entries: {dt:.2f} s (bound in benchmarks/export.py)")
    assert len(df) == 1_000_000
    assert _dtypes(df) == HISTORY_DTYPES
    assert df["time_us"].is_monotonic_increasing


def test_pandas_is_imported_lazily():
    code = ("import sys; import cudalab.memory_tools.export as e; "
            "assert 'pandas' not in sys.modules, 'pandas imported at module import'; "
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "CUDALAB_SIMULATOR": "1"})
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout


# --------------------------------------------------------------------------- snapshot frames
SEG = {
    "device": 1, "address": 0x5000, "total_size": 10_000, "allocated_size": 3000,
    "active_size": 4000, "requested_size": 3900, "stream": 7, "segment_type": "large",
    "segment_pool_id": (0, 0), "is_expandable": True, "frames": [],
    "blocks": [
        {"address": 0x5000, "size": 3000, "requested_size": 2900, "state": "active_allocated",
         "frames": FR},
        {"address": 0x5000 + 3000, "size": 1000, "requested_size": 0, "state": "inactive",
         "frames": []},
        {"address": 0x5000 + 4000, "size": 1000, "requested_size": 1000,
         "state": "active_pending_free", "frames": []},
        {"address": 0x5000 + 5000, "size": 5000, "requested_size": 0, "state": "inactive",
         "frames": []},
    ],
}
FULL_SEG = {**SEG, "address": 0x90000, "total_size": 2048, "segment_type": "small",
            "is_expandable": False, "device": 0, "stream": 0,
            "blocks": [{"address": 0x90000, "size": 2048, "requested_size": 2000,
                        "state": "active_allocated", "frames": []}]}


def test_snapshot_frame_hand_written():
    df = snapshot_frame({"segments": [SEG, FULL_SEG]})
    assert _dtypes(df) == BLOCK_DTYPES
    assert len(df) == 5
    assert (df["segment_address"].iloc[:4] == 0x5000).all()
    assert df["state"].tolist()[:4] == ["active_allocated", "inactive", "active_pending_free",
                                        "inactive"]
    assert df["segment_type"].tolist() == ["large"] * 4 + ["small"]
    assert df["is_expandable"].tolist() == [True] * 4 + [False]
    assert (df["filename"].iloc[0], df["line"].iloc[0]) == ("train.py", 12)
    assert df["filename"].iloc[1] is None
    assert df["segment_stream"].tolist() == [7] * 4 + [0]


def test_segments_frame_fragmentation():
    df = segments_frame([SEG, FULL_SEG])  # a memory_snapshot()-style list works too
    assert _dtypes(df) == SEGMENT_DTYPES
    a, b = df.iloc[0], df.iloc[1]
    assert (a["n_blocks"], a["free_size"], a["largest_free_block"]) == (4, 6000, 5000)
    assert a["fragmentation"] == pytest.approx(1 - 5000 / 6000)
    assert (b["free_size"], b["largest_free_block"], b["fragmentation"]) == (0, 0, 0.0)
    assert a["device"] == 1 and a["stream"] == 7 and bool(a["is_expandable"])


def test_snapshot_frames_generated_and_empty():
    snap = synthetic_snapshot(3000, devices=2)
    bf, sf = snapshot_frame(snap), segments_frame(snap)
    assert _dtypes(bf) == BLOCK_DTYPES and _dtypes(sf) == SEGMENT_DTYPES
    assert len(sf) == len(snap["segments"])
    assert sf["n_blocks"].sum() == len(bf)
    # blocks tile their segment
    sums = bf.groupby("segment_address")["size"].sum()
    assert (sums.sort_index().to_numpy()
            == sf.set_index("address")["total_size"].sort_index().to_numpy()).all()
    assert ((sf["fragmentation"] >= 0) & (sf["fragmentation"] < 1)).all()
    for snap in (EMPTY, {"device_traces": []}):
        assert _dtypes(snapshot_frame(snap)) == BLOCK_DTYPES and len(snapshot_frame(snap)) == 0
        assert _dtypes(segments_frame(snap)) == SEGMENT_DTYPES and len(segments_frame(snap)) == 0


def test_segments_frame_from_live_memory_snapshot():
    import cudalab
    import cudalab.memory as cm

    cudalab.init()
    ptrs = [cm.caching_allocator_alloc(n) for n in (1000, 3 << 20, 5000)]
    try:
        df = segments_frame(cm.memory_snapshot())
        blocks = snapshot_frame(cm.memory_snapshot())
        assert len(df) >= 2
        assert set(ptrs) <= set(blocks["address"])
        assert (df["total_size"] >= df["allocated_size"]).all()
    finally:
        for p in ptrs:
            cm.caching_allocator_delete(p)


def test_stats_frame_columns_are_torch_keys():
    import cudalab
    import cudalab.memory as cm
    from cudalab.allocator.stats import STAT_KEYS

    cudalab.init()
    p = cm.caching_allocator_alloc(1 << 20)
    try:
        df = stats_frame()
        assert list(df.columns) == list(STAT_KEYS) and len(STAT_KEYS) == 122
        assert df.index.name == "device"
        assert df.index.tolist() == list(range(cudalab.device_count()))
        assert (df.dtypes == np.int64).all()
        assert df.loc[0, "allocated_bytes.all.current"] == cm.memory_allocated(0) > 0
        one = stats_frame(0)
        assert one.index.tolist() == [0]
        last = cudalab.device_count() - 1
        assert stats_frame([f"cuda:{last}"]).index.tolist() == [last]
    finally:
        cm.caching_allocator_delete(p)


# --------------------------------------------------------------------------- Perfetto
def _load(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _check_trace(data) -> dict:
    """Shape checks every exported trace must pass; returns X events grouped by tid."""
    assert set(data) >= {"traceEvents", "displayTimeUnit"}
    assert data["displayTimeUnit"] == "ms"
    by_tid = defaultdict(list)
    pids = set()
    thread_tids = set()
    named_threads = set()
    for ev in data["traceEvents"]:
        assert ev["ph"] in {"X", "C", "i", "M"}
        for key in ("ph", "ts", "pid", "tid", "name"):
            assert key in ev, (key, ev)
        assert isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0
        assert isinstance(ev["pid"], int) and ev["pid"] > 0  # Perfetto reserves pid 0
        pids.add(ev["pid"])
        if ev["ph"] == "X":
            assert isinstance(ev["dur"], (int, float)) and ev["dur"] >= 0
            assert {"addr", "size", "frame", "stream"} <= set(ev["args"])
            by_tid[ev["tid"]].append(ev)
            thread_tids.add((ev["pid"], ev["tid"]))
        elif ev["ph"] == "C":
            assert set(ev["args"]) == {"allocated", "reserved"}
            assert ev["tid"] == ev["pid"]
        elif ev["ph"] == "i":
            assert ev["s"] == "p"
        elif ev["ph"] == "M" and ev["name"] == "thread_name":
            named_threads.add((ev["pid"], ev["tid"]))
    assert thread_tids <= named_threads
    tids = [t for _, t in named_threads]
    assert len(tids) == len(set(tids))  # unique across processes (Perfetto keys threads by tid)
    assert not set(tids) & pids
    # slices on one track nest or are disjoint (never partially overlap)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[float] = []
        for e in evs:
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            end = e["ts"] + e["dur"]
            assert not stack or end <= stack[-1], f"partial overlap on tid {e['tid']}"
            stack.append(end)
    return by_tid


def test_perfetto_hand_written(tmp_path):
    p = export_perfetto(tmp_path / "t.json", _hand_snapshot(cudalab={"simulated": True}))
    data = _load(p)
    by_tid = _check_trace(data)
    evs = data["traceEvents"]
    procs = [e["args"]["name"] for e in evs if e["name"] == "process_name"]
    assert procs == ["cuda:0 (simulated)"]
    xs = sorted((e for e in evs if e["ph"] == "X"), key=lambda e: e["ts"])
    assert [(e["ts"], e["dur"]) for e in xs] == [(1, 11), (5, 46)]  # relative to t=100
    assert xs[0]["name"] == "512 B" and xs[1]["name"] == "1.0 KiB"
    assert xs[0]["args"]["addr"] == "0x10000000" and xs[0]["args"]["size"] == 512
    assert xs[0]["args"]["frame"] == "train.py:12 step" and xs[1]["args"]["frame"] == ""
    assert xs[0]["tid"] != xs[1]["tid"]  # alive at once on one stream: two lanes
    assert len(by_tid) == 2
    inst = [(e["name"], e["ts"]) for e in evs if e["ph"] == "i"]
    assert inst == [("OOM", 25), ("snapshot", 40)]
    oom = next(e for e in evs if e["name"] == "OOM")
    assert oom["args"]["device_free"] == 777 and oom["args"]["size"] == 8 * MB
    counters = [(e["ts"], e["args"]["allocated"], e["args"]["reserved"])
                for e in evs if e["ph"] == "C"]
    assert counters == [(0, 0, 2 * MB), (1, 512, 2 * MB), (5, 1536, 2 * MB), (12, 1024, 2 * MB),
                        (20, 1024, 6 * MB), (30, 1024, 2 * MB), (51, 0, 2 * MB), (60, 0, 0)]


def test_perfetto_torch_snapshot_not_simulated_and_gz(tmp_path):
    snap = synthetic_snapshot(4000, cudalab_keys=False, streams=(0, 0x7F00AA, 0x7F00BB))
    data = _load(export_perfetto(tmp_path / "t.json.gz", snap))
    with open(tmp_path / "t.json.gz", "rb") as f:
        assert f.read(2) == b"\x1f\x8b"
    by_tid = _check_trace(data)
    evs = data["traceEvents"]
    assert [e["args"]["name"] for e in evs if e["name"] == "process_name"] == ["cuda:0"]
    names = {e["args"]["name"] for e in evs if e["name"] == "thread_name"}
    assert {"stream 0 (legacy default)", "stream 0x7f00aa", "stream 0x7f00bb"} <= names
    n_alloc = sum(1 for e in snap["device_traces"][0] if e["action"] == "alloc")
    assert sum(len(v) for v in by_tid.values()) == n_alloc
    # every X sits on a track of its own stream
    tname = {e["tid"]: e["args"]["name"] for e in evs if e["name"] == "thread_name"}
    for tid, xs in by_tid.items():
        for x in xs:
            assert tname[tid].startswith(stream_label(x["args"]["stream"]))


def test_perfetto_generated_multi_device(tmp_path):
    snap = synthetic_snapshot(6000, devices=2, oom_every=500, snapshot_every=300)
    data = _load(export_perfetto(tmp_path / "t.json", snap))
    _check_trace(data)
    evs = data["traceEvents"]
    assert sorted(e["args"]["name"] for e in evs if e["name"] == "process_name") == [
        "cuda:0 (simulated)", "cuda:1 (simulated)"]
    t0 = min(e["time_us"] for tr in snap["device_traces"] for e in tr)
    t1 = max(e["time_us"] for tr in snap["device_traces"] for e in tr)
    xs = [e for e in evs if e["ph"] == "X"]
    assert min(e["ts"] for e in xs) >= 0
    assert max(e["ts"] + e["dur"] for e in xs) == t1 - t0  # live blocks run to the end
    n_inst = sum(1 for tr in snap["device_traces"] for e in tr if e["action"] in ("oom", "snapshot"))
    assert n_inst > 0
    assert sum(1 for e in evs if e["ph"] == "i") == n_inst
    # the last counter of each device equals history_frame's final totals
    df = history_frame(snap)
    for d in (0, 1):
        last = [e for e in evs if e["ph"] == "C" and e["pid"] == d + 1][-1]["args"]
        row = df[df["device"] == d].iloc[-1]
        assert (last["allocated"], last["reserved"]) == (row["allocated"], row["reserved"])


def test_perfetto_preexisting_and_empty(tmp_path):
    snap = {"device_traces": [[_e("free_completed", 0x40, 64, 10), _e("alloc", 0x80, 32, 20),
                               _e("alloc", 0x80, 32, 25)]]}  # double alloc: truncated trace
    data = _load(export_perfetto(tmp_path / "t.json", snap))
    _check_trace(data)
    xs = sorted((e for e in data["traceEvents"] if e["ph"] == "X"), key=lambda e: e["ts"])
    assert (xs[0]["ts"], xs[0]["dur"], xs[0]["args"].get("preexisting")) == (0, 0, True)
    assert [(e["ts"], e["dur"]) for e in xs[1:]] == [(10, 5), (15, 0)]
    data = _load(export_perfetto(tmp_path / "e.json", EMPTY))
    assert data["traceEvents"] == []


def test_perfetto_default_snapshot(tmp_path, monkeypatch):
    import cudalab
    from cudalab.memory_tools import perfetto, trace_columns

    cudalab.init()
    monkeypatch.setattr(perfetto, "live_history", lambda: None)  # no recorder: _snapshot()
    monkeypatch.setattr(trace_columns, "take_snapshot", _hand_snapshot)
    assert export_perfetto(str(tmp_path / "d.json")) == str(tmp_path / "d.json")
    data = _load(tmp_path / "d.json")
    _check_trace(data)
    # no "cudalab" key in the snapshot: the live backend says whether it is simulated
    sim = cudalab.devices.backend().simulated
    procs = [e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"]
    assert procs == ["cuda:0 (simulated)" if sim else "cuda:0"]
    # an explicit snapshot without the key is taken as real hardware (torch's own snapshots)
    data = _load(export_perfetto(tmp_path / "e.json", _hand_snapshot()))
    assert [e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"] == [
        "cuda:0"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20)), max_size=60))
def test_lanes_never_overlap(pairs):
    iv = sorted((s, s + d) for s, d in pairs)
    lanes = _assign_lanes([s for s, _ in iv], [e for _, e in iv])
    by_lane = defaultdict(list)
    for (s, e), lane in zip(iv, lanes):
        by_lane[lane].append((s, e))
    for lst in by_lane.values():
        for (_, e0), (s1, _) in zip(lst, lst[1:]):
            assert e0 <= s1
    if iv:  # never more lanes than intervals meeting at one instant
        depth = max(sum(1 for s, e in iv if s <= t <= e) for t in range(0, 71))
        assert max(lanes) + 1 <= depth


def test_slice_names_are_sizes_by_the_one_byte_formatter(tmp_path):
    """Perfetto slice names are ``cudalab._units.format_bytes`` of the block's size."""
    from cudalab._units import format_bytes

    expect = {1023: "1023 B", 1024: "1.0 KiB", 1536: "1.5 KiB", 3 << 20: "3.0 MiB",
              200 << 20: "200.0 MiB", (1 << 20) - 1: "1.0 MiB", 5 << 40: "5.0 TiB"}
    assert format_bytes(0) == "0 B"
    snap = {"device_traces": [[_e("alloc", 0x1000 * (i + 1), size, i)
                               for i, size in enumerate(expect)]]}
    data = _load(export_perfetto(tmp_path / "s.json", snap))
    got = {e["args"]["size"]: e["name"] for e in data["traceEvents"] if e["ph"] == "X"}
    assert got == expect
    assert all(format_bytes(size) == name for size, name in got.items())


def test_perfetto_escapes_frame_strings(tmp_path):
    odd = [{"filename": 'we"ird\\path\n/ü.py', "line": 7, "name": "f<\u2028>"}]
    snap = {"device_traces": [[_e("alloc", 0x10, 8, 1, frames=odd),
                               _e("oom", 5, 99, 2, frames=odd)]]}
    data = _load(export_perfetto(tmp_path / "o.json", snap))
    _check_trace(data)
    x = next(e for e in data["traceEvents"] if e["ph"] == "X")
    assert x["args"]["frame"] == 'we"ird\\path\n/ü.py:7 f<\u2028>'
    assert (x["ts"], x["dur"]) == (0, 1)  # never freed: runs to the last timestamp
    oom = next(e for e in data["traceEvents"] if e["ph"] == "i")
    assert oom["args"]["frame"] == x["args"]["frame"]


# --------------------------------------------------------------------------- identity
IDENT = {"host": "node7", "pid": 4242, "rank": 3, "local_rank": 1, "world_size": 8,
         "device": 1, "device_uuid": "GPU-f4acf50d-0d79-5f08-8bcc-895c63508791",
         "device_name": "NVIDIA H200", "version": "0.1.0", "allocator": "cudalab"}


def test_frames_carry_the_snapshots_identity(tmp_path):
    snap = synthetic_snapshot(500, devices=2)
    snap["identity"] = dict(IDENT)
    for make in (history_frame, snapshot_frame, segments_frame):
        df = make(snap)
        assert df.attrs["identity"] == IDENT, make.__name__
        assert df.attrs["identity"] is not snap["identity"]  # a copy: the frame owns it
        assert df[df.index >= 0].attrs["identity"] == IDENT  # kept through selections
    # torch's snapshots have none
    snap.pop("identity")
    assert history_frame(snap).attrs["identity"] is None
    assert segments_frame(snap).attrs["identity"] is None


def test_live_frames_carry_this_process_identity():
    import os

    import cudalab
    from cudalab.identity import Identity

    cudalab.init()
    p = cudalab.memory.caching_allocator_alloc(4096)
    try:
        with cudalab.memory.record_history():
            q = cudalab.memory.caching_allocator_alloc(8192)
            cudalab.memory.caching_allocator_delete(q)
            frames = [history_frame(), snapshot_frame(), segments_frame(), stats_frame()]
    finally:
        cudalab.memory.caching_allocator_delete(p)
    for df in frames:
        ident = Identity.from_dict(df.attrs["identity"])
        assert ident.pid == os.getpid() and ident.allocator == "cudalab"
        assert ident.device == cudalab.current_device()


def test_parquet_files_carry_the_identity(tmp_path):
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from cudalab.memory_tools.export import save_frame

    snap = synthetic_snapshot(300)
    snap["identity"] = dict(IDENT)
    path = save_frame(history_frame(snap), tmp_path / "h.parquet")
    assert pd.read_parquet(path).attrs["identity"] == IDENT
    meta = pq.read_schema(path).metadata  # what other readers see: JSON in the metadata
    assert json.loads(meta[b"PANDAS_ATTRS"])["identity"] == IDENT


def test_perfetto_metadata_carries_the_identity(tmp_path):
    import os

    import cudalab

    data = _load(export_perfetto(tmp_path / "a.json", _hand_snapshot(identity=dict(IDENT))))
    _check_trace(data)
    assert data["otherData"] == {"source": "cudalab memory history", "identity": IDENT}
    # torch's snapshots have none: no identity is made up for them
    data = _load(export_perfetto(tmp_path / "b.json", _hand_snapshot()))
    assert data["otherData"] == {"source": "cudalab memory history"}
    # the live history: this process's
    cudalab.init()
    with cudalab.memory.record_history():
        cudalab.memory.caching_allocator_delete(cudalab.memory.caching_allocator_alloc(512))
        data = _load(export_perfetto(tmp_path / "c.json.gz"))
    assert data["otherData"]["identity"]["pid"] == os.getpid()
