"""``replay`` reads the files cudalab writes for a history (issue 22, defect 6): the snapshot
pickle and the CSV give the same replay, a Perfetto JSON is refused naming the formats read,
and a history started mid-session says why replay/recorded exceeds 1."""

from __future__ import annotations

import gc
import gzip
import importlib
import json
import subprocess
import sys
import warnings

import pytest

import cudalab
import cudalab.memory as cm
from cudalab.memory_tools.trace_io import TraceError, load_trace

rp = importlib.import_module("cudalab.memory_tools.replay")
MiB = 1 << 20


def _quiet(trace):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rp.ReplayWarning)
        return rp.replay(trace)


def _comparable(r) -> dict:
    d = r.to_dict()
    for key in ("elapsed_s", "entries_per_s", "source"):
        d.pop(key)
    return d


@pytest.fixture
def history_files(tmp_path):
    """A mid-session history (blocks live and cache reserved before it began) saved as the
    ``%cuda_memory history save`` paths write it: .pickle, .csv, .json, .json.gz."""
    pytest.importorskip("pandas")
    cudalab.init()
    # Arrays of earlier tests that the collector frees mid-recording would add a free to one
    # export and not the other (the order of test files decides): collect them first, and
    # keep the collector off until the files are written.
    gc.collect()
    gc_was_on = gc.isenabled()
    gc.disable()
    cm.empty_cache()
    before = [cm.caching_allocator_alloc(5 * MiB) for _ in range(4)]  # 2 live, 2 cached
    for p in before[2:]:
        cm.caching_allocator_delete(p)
    cm._record_memory_history("all", max_entries=10_000)
    try:
        cm.caching_allocator_delete(before[0])  # a free of a block the trace never saw
        live = [cm.caching_allocator_alloc(5 * MiB) for _ in range(3)]  # reuses the cache
        live += [cm.caching_allocator_alloc(s * 4096) for s in range(1, 40)]
        for p in live[::3]:
            cm.caching_allocator_delete(p)
        live = [p for i, p in enumerate(live) if i % 3] + [cm.caching_allocator_alloc(30 * MiB)]
        paths = {ext: tmp_path / f"h.{ext}" for ext in ("pickle", "csv", "json", "json.gz")}
        # the CSV first: a snapshot's own entry lands in the history after it was read
        cm.history_frame().to_csv(paths["csv"], index=False)
        cm.export_memory_viz(paths["pickle"])
        cm.export_perfetto(paths["json"])
        cm.export_perfetto(paths["json.gz"])
    finally:
        cm._record_memory_history(None)
        if gc_was_on:
            gc.enable()
        for p in [before[1], *live]:
            cm.caching_allocator_delete(p)
        cm.empty_cache()
    return paths


def test_csv_export_replays_as_the_pickle(history_files):
    a = _quiet(str(history_files["pickle"]))
    b = _quiet(str(history_files["csv"]))
    assert a.entries > 40 and a.allocs > 40
    assert _comparable(a) == _comparable(b)
    # detected by content, not by the name
    renamed = history_files["csv"].with_suffix(".txt")
    renamed.write_bytes(history_files["csv"].read_bytes())
    assert _comparable(_quiet(str(renamed))) == _comparable(a)


@pytest.mark.parametrize("ext", ["json", "json.gz"])
def test_perfetto_json_is_refused_naming_the_formats(history_files, ext):
    with pytest.raises(TraceError, match="Perfetto/Chrome trace JSON") as info:
        load_trace(str(history_files[ext]))
    msg = str(info.value)
    assert "snapshot pickle" in msg and "history CSV" in msg and "\n" not in msg


def test_json_snapshot_and_garbage_files(tmp_path):
    snap = {"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 1 << 20, "size": 512, "stream": 0},
        {"action": "free_requested", "addr": 1 << 20, "size": 512, "stream": 0}]]}
    (tmp_path / "s.json").write_text(json.dumps(snap))
    assert len(load_trace(str(tmp_path / "s.json"))) == 2
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(TraceError, match="not a history CSV.*snapshot pickle"):
        load_trace(str(tmp_path / "bad.csv"))
    (tmp_path / "bad.pickle").write_bytes(b"\x80\x04garbage")
    with pytest.raises(TraceError, match="truncated or corrupt pickle.*history CSV"):
        load_trace(str(tmp_path / "bad.pickle"))


def test_mid_session_history_explains_the_ratio(history_files):
    r = _quiet(str(history_files["pickle"]))
    assert r.truncated and r.skipped.get("free_before_alloc") == 1
    assert r.reference.get("allocs_in_earlier_segments", 0) >= 1
    text = str(r)
    assert "history started mid-session" in text
    assert "reused memory reserved before the history began" in text
    assert "replay/recorded above 1 is expected" in text


def test_mid_session_note_only_when_earlier_memory_is_reused():
    seg = [("segment_alloc", 1 << 30, 20 * MiB, 0)]
    inside = [("alloc", (1 << 30) + i * 5 * MiB, 5 * MiB, 0) for i in range(4)]
    r = _quiet(seg + inside)
    assert "allocs_in_earlier_segments" not in r.reference and "note" not in str(r)
    outside = [("alloc", (2 << 30) + i * 5 * MiB, 5 * MiB, 0) for i in range(4)]
    r = _quiet(seg + inside + outside)
    assert r.reference["allocs_in_earlier_segments"] == 4
    assert r.peak_reserved / r.reference["recorded_peak_reserved"] > 1
    assert "4 allocations reused memory reserved before the history began" in str(r)


def test_cli_reads_csv_and_refuses_json(history_files):
    def cli(path):
        return subprocess.run([sys.executable, "-m", "cudalab", "replay", str(path)],
                              capture_output=True, text=True, timeout=300)

    res = cli(history_files["csv"])
    assert res.returncode == 0, res.stderr
    assert "peak reserved" in res.stdout and "mid-session" in res.stdout
    res = cli(history_files["json.gz"])
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "Perfetto/Chrome trace JSON" in res.stderr and "history CSV" in res.stderr
    assert gzip.decompress(history_files["json.gz"].read_bytes()).startswith(b"{")
