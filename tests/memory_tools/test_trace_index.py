"""The explorer's reader (cudalab.memory_tools.trace_index): snapshot pickles read into
columns, by the C reader and by its Python twin alike, progressively, and hostile or broken
files refused with a SnapshotLoadError that says why."""

from __future__ import annotations

import copy
import pickle
import random

import numpy as np
import pytest

from cudalab.memory_tools import trace_index
from cudalab.memory_tools.safe_pickle import SnapshotLoadError
from cudalab.memory_tools.synthetic import synthetic_snapshot
from cudalab.memory_tools.trace_index import (
    COLUMNS,
    index_snapshot,
    iter_trace,
    open_trace,
    scanner_available,
)
from cudalab.memory_tools.trace_io import dumps_snapshot

needs_scanner = pytest.mark.skipif(not scanner_available(),
                                   reason="the C reader (_tracescan) is not built")


def _torch_like(snap):
    """torch's pickles: a new frames list per entry, the frame dicts shared."""
    snap = copy.copy(snap)
    snap["device_traces"] = [[dict(e, frames=list(e["frames"])) for e in t]
                             for t in snap["device_traces"]]
    return snap


def _same(a, b):
    for name, _ in COLUMNS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert a.frames == b.frames and a.action_names == b.action_names and a.strings == b.strings
    assert np.array_equal(a.stack_offsets, b.stack_offsets)
    assert np.array_equal(a.stack_frames, b.stack_frames)


@needs_scanner
@pytest.mark.parametrize("cudalab_keys", [True, False])
@pytest.mark.parametrize("torch_like", [True, False])
def test_the_c_reader_and_the_python_twin_read_the_same_columns(tmp_path, cudalab_keys,
                                                                   torch_like):
    snap = synthetic_snapshot(3000, devices=2, cudalab_keys=cudalab_keys)
    if torch_like:
        snap = _torch_like(snap)
    path = tmp_path / "s.pickle"
    path.write_bytes(dumps_snapshot(snap))
    got = open_trace(path)
    want = index_snapshot(snap)
    _same(got, want)
    assert got.complete and got.n == sum(len(t) for t in snap["device_traces"])
    assert got.snapshot["segments"] == snap["segments"]
    assert got.snapshot["device_traces"] == [[], []]
    # the columns say what the entries say
    entries = [e for t in snap["device_traces"] for e in t]
    k = 1234
    e = entries[k]
    assert got.action_names[got.action[k]] == e["action"]
    assert int(got.size[k]) == e["size"] and int(got.time_us[k]) == e["time_us"]
    assert got.stack_dicts(int(got.stack[k])) == e["frames"]
    assert int(got.device[-1]) == 1


@needs_scanner
def test_progress_views_grow_and_the_last_is_the_whole_index(tmp_path):
    snap = synthetic_snapshot(20000)
    path = tmp_path / "s.pickle"
    path.write_bytes(dumps_snapshot(snap))
    views = list(iter_trace(path, step_bytes=50_000))
    assert len(views) > 5
    sizes = [v.n for v in views]
    assert sizes == sorted(sizes) and not views[0].complete and views[-1].complete
    assert [v.bytes_read for v in views] == sorted(v.bytes_read for v in views)
    whole = views[-1]
    part = views[len(views) // 2]
    assert 0 < part.n < whole.n
    assert np.array_equal(part.time_us, whole.time_us[:part.n])  # a prefix of the whole
    calls = []
    open_trace(path, on_progress=calls.append, step_bytes=50_000)
    assert len(calls) == len(views) and calls[-1].complete


def test_the_python_twin_reads_files_when_the_c_reader_is_absent(tmp_path, monkeypatch):
    snap = synthetic_snapshot(500)
    path = tmp_path / "s.pickle"
    path.write_bytes(dumps_snapshot(snap))
    monkeypatch.setattr(trace_index, "scanner_available", lambda: False)
    got = open_trace(path)
    _same(got, index_snapshot(snap))


def test_a_protocol_0_pickle_is_read_by_the_restricted_unpickler(tmp_path):
    snap = synthetic_snapshot(200, cudalab_keys=False)
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=0))
    _same(open_trace(path), index_snapshot(snap))


def test_frames_that_are_not_shared_objects_intern_by_content(tmp_path):
    snap = synthetic_snapshot(2000, cudalab_keys=False)
    snap["device_traces"] = [[dict(e, frames=[dict(f) for f in e["frames"]]) for e in t]
                             for t in snap["device_traces"]]
    path = tmp_path / "s.pickle"
    path.write_bytes(dumps_snapshot(snap))
    got = open_trace(path)
    _same(got, index_snapshot(snap))
    assert len(got.frames) <= 100 and got.n_stacks <= 41  # the synthetic trace's own


def test_64_bit_handles_stay_exact(tmp_path):
    snap = synthetic_snapshot(100, cudalab_keys=False)
    snap["device_traces"][0][3]["stream"] = (1 << 64) - 5
    path = tmp_path / "s.pickle"
    path.write_bytes(dumps_snapshot(snap))
    got = open_trace(path)
    assert got.stream.dtype == np.uint64 and int(got.stream[3]) == (1 << 64) - 5
    _same(got, index_snapshot(snap))


# --------------------------------------------------------------------------- bad input
def _write(tmp_path, data, name="bad.pickle"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_a_file_over_the_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path = _write(tmp_path, dumps_snapshot(synthetic_snapshot(300)))

    def no_open(*a, **k):  # nothing may be mapped or read
        raise AssertionError("read")

    monkeypatch.setattr(trace_index.mmap, "mmap", no_open)
    with pytest.raises(SnapshotLoadError, match="larger than the limit of 1,000 bytes"):
        open_trace(path, max_bytes=1000)


#: (the file, the reason given; True: a reason only the C reader gives, the restricted
#: unpickler of its Python twin refuses the file with its own words)
BAD_FILES = [
    (b"", "the file is empty", False),
    (b"\x00hello", "not a pickle", False),
    (b"\x80\x04cos\nsystem\n\x8c\x02id\x85R.", "refusing to load", False),
    (b"\x80\x04\x8c\x02os\x8c\x06system\x93.", "refusing to load", False),
    (b"\x80\x04N\x85" * 1 + b"\x85" * 500 + b".", "nested too deeply", True),
    (b"\x80\x04]" * 300 + b".", "truncated or corrupt|nested too deeply", True),
    (b"\x80\x04\x95\xff\xff\xff\xff\x00\x00\x00\x00}.", "a frame at byte 2 claims", True),
    (b"\x80\x04X\xff\xff\xff\x7fabc", "a string at byte 2 claims", True),
    (b"\x80\x04h\x07.", "memo key 7 not found", True),
    (b"\x80\x04]a.", "truncated or corrupt", False),
    (b"\x80\x04}(\x8c\x08segments]", "ends before its STOP", True),
    (b"\x80\x04K\x01.", "not a memory snapshot", False),
]


@pytest.mark.parametrize("data, reason, c_only", BAD_FILES)
def test_bad_files_are_a_snapshot_load_error_saying_why(tmp_path, data, reason, c_only):
    path = _write(tmp_path, data)
    with pytest.raises(SnapshotLoadError, match=reason if scanner_available() or not c_only
                       else "cannot read|not a memory snapshot|refusing"):
        open_trace(path)


@pytest.mark.parametrize("case, match", [
    ("lacks size", r"device_traces\[0\]\[7\] lacks the key 'size'"),
    ("time is text", r"device_traces\[0\]\[7\]\['time_us'\] is 'noon' \(str\)"),
    ("size 2**70", r"device_traces\[0\]\[7\]\['size'\] is 1180591620717411303424"),
    ("entry is a list", r"device_traces\[0\]\[7\] is a list"),
    ("frames is a dict", r"device_traces\[0\]\[7\]\['frames'\] is a dict"),
])
def test_a_malformed_entry_is_named_by_index_and_key(tmp_path, case, match):
    snap = synthetic_snapshot(300)
    e = snap["device_traces"][0][7]
    if case == "lacks size":
        e.pop("size")
    elif case == "time is text":
        e["time_us"] = "noon"
    elif case == "size 2**70":
        e["size"] = 2**70
    elif case == "entry is a list":
        snap["device_traces"][0][7] = ["alloc", 1, 2]
    else:
        e["frames"] = {"a": 1}
    path = _write(tmp_path, pickle.dumps(snap, protocol=4))
    with pytest.raises(SnapshotLoadError, match=match):
        open_trace(path)


@needs_scanner
def test_memory_is_bounded_while_reading(tmp_path, monkeypatch):
    """A small file that builds many objects (empty dicts, 1 byte each) is refused once the
    process's memory passes the bound, not read until memory runs out."""
    data = b"\x80\x04" + b"}" * (20 << 20) + b"."
    path = _write(tmp_path, data)
    monkeypatch.setattr(trace_index, "MEMORY_FACTOR", 0)
    monkeypatch.setattr(trace_index, "MEMORY_SLACK", 64 << 20)
    with pytest.raises(SnapshotLoadError, match="more memory than its limit"):
        open_trace(path)


def test_truncated_and_mutated_snapshots_load_or_raise_a_snapshot_load_error(tmp_path):
    data = dumps_snapshot(synthetic_snapshot(200, devices=2))
    rng = random.Random(40)
    outcomes = {"ok": 0, "error": 0}
    path = tmp_path / "m.pickle"
    for k in range(150):
        b = bytearray(data)
        if k % 3 == 0:
            b = b[:rng.randrange(1, len(b))]
        else:
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        path.write_bytes(bytes(b))
        try:
            open_trace(path)
            outcomes["ok"] += 1
        except SnapshotLoadError:
            outcomes["error"] += 1
    assert outcomes["error"] > 50, outcomes


@needs_scanner
def test_a_read_of_some_columns_gives_those_and_defaults_for_the_rest(tmp_path, monkeypatch):
    snap = _torch_like(synthetic_snapshot(30000, devices=2))
    path = tmp_path / "s.pickle"
    path.write_bytes(dumps_snapshot(snap))
    full = open_trace(path)
    # a small first guess of the rows: the columns grow (and the scratch with them)
    monkeypatch.setattr(trace_index, "_BYTES_PER_ENTRY", 2000)
    some = open_trace(path, columns=["addr", "stack"], step_bytes=1 << 16)
    assert some.n == full.n and some.frames == full.frames
    for name, dtype in COLUMNS:
        got = getattr(some, name)
        assert got.dtype == dtype and len(got) == full.n, name
        if name in ("addr", "stack", "action", "device", "size"):
            assert np.array_equal(got, getattr(full, name)), name
        else:
            assert (got == trace_index.DEFAULTS[name]).all() and not got.flags.writeable, name
    with pytest.raises(ValueError, match=r"unknown trace columns \['adress'\]"):
        open_trace(path, columns=["adress"])
    with pytest.raises(SnapshotLoadError):  # entries are checked in full all the same
        bad = copy.deepcopy(snap)
        bad["device_traces"][1][7]["time_us"] = "late"
        path.write_bytes(dumps_snapshot(bad))
        open_trace(path, columns=["addr"])


@needs_scanner
def test_integers_of_every_width_read_exactly(tmp_path):
    # LONG1 of 1 to 8 bytes is read as one int64 (sign included), wider ones as Python's
    times = [0, 1, -1, 127, 128, 255, -128, -129, 2**31, -2**31 - 1, 2**40 + 5, -2**40 - 7,
             2**55, -2**55, 2**63 - 1, -2**63]
    addrs = [2**63, 2**64 - 1, 139637976977920, 2**32]  # (9 bytes: the wide path; uint64)
    entries = [{"action": "alloc", "addr": addrs[i % len(addrs)], "size": 512, "stream": 0,
                "time_us": t, "frames": []} for i, t in enumerate(times)]
    snap = {"segments": [], "device_traces": [entries]}
    path = tmp_path / "ints.pickle"
    path.write_bytes(dumps_snapshot(snap))
    got = open_trace(path)
    assert got.time_us.tolist() == times
    assert got.addr.dtype == np.uint64 and [int(a) for a in got.addr] == \
        [addrs[i % len(addrs)] for i in range(len(times))]
