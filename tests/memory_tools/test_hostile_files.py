"""Hostile or broken files never crash the process.

Deeply nested pickles (a crash of the interpreter is tested in a subprocess, so it fails the
test instead of killing pytest), endless and oversized inputs, gzip bombs, snapshots that
load but are malformed, sizes that are not integers in a replay, and a seeded fuzz of
mutated pickles and JSON files: each either loads or raises SnapshotLoadError / ValueError.
"""

from __future__ import annotations

import copy
import gzip
import io
import json
import os
import pickle
import random
import subprocess
import sys
import time
import warnings

import pytest

import cudalab
from cudalab.memory_tools import export, perfetto, safe_pickle
from cudalab.memory_tools.replay import ReplayWarning, replay
from cudalab.memory_tools.safe_pickle import (
    MAX_NESTING,
    MAX_SNAPSHOT_BYTES_ENV,
    SnapshotLoadError,
    check_nesting,
    max_snapshot_bytes,
)
from cudalab.memory_tools.synthetic import synthetic_snapshot
from cudalab.memory_tools.trace_io import TraceError, dumps_snapshot, load_snapshot, load_trace
from cudalab.memory_tools.what_if import what_if

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --------------------------------------------------------------------------- deep nesting
def _deep_tuple_key(depth: int) -> bytes:
    """A dict whose key is a tuple nested ``depth`` deep: about ``depth`` bytes. CPython
    hashes it recursively in C while unpickling: 150,000 levels overflow the C stack."""
    return b"\x80\x04}N" + b"\x85" * depth + b"Ns."


def _deep_tuple_in_set(depth: int) -> bytes:
    return b"\x80\x04(N" + b"\x85" * depth + b"\x91."


def _deep_list(depth: int) -> bytes:
    return b"\x80\x04" + b"]" * depth + b"a" * (depth - 1) + b"."


def _deep_dict_segments(depth: int) -> bytes:
    """{"segments": [[[[...]]]], "device_traces": []}."""
    return (b"\x80\x04}(\x8c\x08segments" + b"]" * depth + b"a" * (depth - 1)
            + b"\x8c\x0ddevice_traces]u.")


def _run_python(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "CUDALAB_SIMULATOR": "1", "PYTHONPATH": ROOT, **(env or {})}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=120, env=full, cwd=ROOT)


_LOAD_ALL = """
import sys
from cudalab.memory_tools.trace_io import load_snapshot, load_trace
from cudalab.memory_tools.safe_pickle import SnapshotLoadError
for path in sys.argv[1:]:
    for fn in (load_snapshot, load_trace):
        try:
            fn(path)
        except ValueError as exc:  # SnapshotLoadError, TraceError
            print(type(exc).__name__, str(exc).splitlines()[0][:200])
        else:
            print("loaded", path)
"""


def test_deeply_nested_pickles_are_refused_not_a_crash(tmp_path):
    files = {"tuple-key.pickle": _deep_tuple_key(150_000),
             "tuple-set.pickle": _deep_tuple_in_set(150_000),
             "list.pickle": _deep_list(150_000),
             "segments.pickle": _deep_dict_segments(150_000)}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        assert len(data) >= 150_000
    r = _run_python(_LOAD_ALL, *(str(tmp_path / n) for n in files))
    assert r.returncode == 0, r.stderr[-2000:]  # -11 (SIGSEGV) without the bound
    lines = r.stdout.splitlines()
    assert len(lines) == 2 * len(files) and not any(x.startswith("loaded") for x in lines)
    assert "nested too deeply" in lines[0] and "nested too deeply" in lines[2]


@pytest.mark.parametrize("command", ["replay", "what-if"])
def test_the_cli_refuses_a_deeply_nested_pickle(tmp_path, command):
    path = tmp_path / "deep.pickle"
    path.write_bytes(_deep_tuple_key(150_000))
    r = _run_python("import sys; from cudalab.cli import main; sys.exit(main(sys.argv[1:]))",
                    command, str(path))
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "nested too deeply" in r.stderr and "Traceback" not in r.stderr


def test_deeply_nested_json_is_refused_not_a_crash(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 150_000 + "]" * 150_000)
    r = _run_python(_LOAD_ALL, str(path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "invalid JSON" in r.stdout or "not a" in r.stdout


@pytest.mark.parametrize("build", [_deep_tuple_key, _deep_tuple_in_set, _deep_list,
                                   _deep_dict_segments])
def test_a_moderately_nested_pickle_is_a_snapshot_load_error(build):
    for depth in (MAX_NESTING + 50, 5_000):
        with pytest.raises(SnapshotLoadError):
            load_snapshot(io.BytesIO(build(depth)))


def test_the_nesting_scan_follows_every_protocol():
    """check_nesting (used where no big-stack thread starts) reads every valid pickle."""
    snap = synthetic_snapshot(300)
    values = [snap, {"trace": [("alloc", 1, 2, 3)] * 20}, -3, 2**70, -2**100, "é" * 300,
              b"x" * 300, bytearray(b"ab"), {1, 2}, frozenset({3}), (), (1,), (1, 2),
              (1, 2, 3), (1, 2, 3, 4), None, True, 1.5, "x" * 70_000, {"a": [[[]]]}]
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        for v in values:
            check_nesting(pickle.dumps(v, protocol=proto), "x")
    t: tuple | None = None
    for _ in range(MAX_NESTING + 1):
        t = (t,)
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        with pytest.raises(SnapshotLoadError, match="nested too deeply"):
            check_nesting(pickle.dumps(t, protocol=proto), "x")
    with pytest.raises(SnapshotLoadError, match="truncated"):
        check_nesting(pickle.dumps(snap)[:-40], "x")


def test_many_tuples_still_load_and_deep_ones_do_not(monkeypatch):
    """Past the safe count of tuple opcodes, the load runs on a big stack and checks the
    nesting afterwards; without such a thread, the opcode scan runs first."""
    trace = {"trace": [("alloc", i * 512, 512, 0) for i in range(30_000)]}
    data = pickle.dumps(trace, protocol=4)
    assert safe_pickle.unpickle(data, "x") == trace
    deep = _deep_tuple_key(60_000)
    with pytest.raises(SnapshotLoadError, match="nested too deeply"):
        safe_pickle.unpickle(deep, "x")
    monkeypatch.setattr(safe_pickle, "_load_on_big_stack", lambda *a: None)
    assert safe_pickle.unpickle(data, "x") == trace
    with pytest.raises(SnapshotLoadError, match="nested too deeply"):
        safe_pickle.unpickle(deep, "x")


# --------------------------------------------------------------------------- size limits
class Endless(io.RawIOBase):
    """/dev/zero as a file object (or an endless run of ``fill``), counting what was read."""

    def __init__(self, fill=b"\0"):
        self.read_bytes = 0
        self.fill = fill

    def readable(self):
        return True

    def readinto(self, b):
        n = len(b)
        b[:n] = self.fill * n
        self.read_bytes += n
        return n


def test_an_endless_stream_stops_at_the_limit():
    f = Endless(b"(")  # pickle's MARK opcode: it starts like a pickle
    with pytest.raises(SnapshotLoadError, match="larger than the limit of 1,048,576 bytes"):
        load_snapshot(f, max_bytes="1MiB")
    assert f.read_bytes <= (1 << 20) + 1


_UNDER_AN_ADDRESS_LIMIT = """
import io, resource, sys
from cudalab.memory_tools.trace_io import load_snapshot
from cudalab.memory_tools.safe_pickle import SnapshotLoadError

class EndlessMarks(io.RawIOBase):  # an endless stream that starts like a pickle
    def readable(self):
        return True
    def readinto(self, b):
        b[:] = b"(" * len(b)
        return len(b)

with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
limit = vm + (384 << 20)  # far below the default 4 GiB budget
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
for source in ("/dev/zero", EndlessMarks()):
    try:
        load_snapshot(source)
    except SnapshotLoadError as exc:
        print("refused:", str(exc).splitlines()[0][:300])
    except MemoryError:
        print("bare MemoryError")
bytearray(64 << 20)  # the process recovered its memory
print("alive")
"""


@pytest.mark.skipif(not os.path.exists("/dev/zero") or sys.platform != "linux",
                    reason="needs Linux's /dev/zero and /proc")
def test_an_endless_stream_under_an_address_space_limit_is_refused_not_a_memory_error():
    """load_snapshot("/dev/zero") with less memory than the size budget: SnapshotLoadError
    (at once for a stream that does not start like a pickle; when memory runs out for one
    that does), never a bare MemoryError."""
    r = _run_python(_UNDER_AN_ADDRESS_LIMIT)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 3 and lines[2] == "alive", r.stdout
    assert lines[0].startswith("refused:") and "not a pickle" in lines[0], lines[0]
    assert lines[1].startswith("refused:") and "out of memory" in lines[1], lines[1]


def test_a_stream_that_is_not_a_pickle_is_refused_after_its_first_chunk():
    f = Endless()
    with pytest.raises(SnapshotLoadError, match="not a pickle"):
        load_snapshot(f)  # the default limit is 4 GiB: it stops long before
    assert f.read_bytes <= safe_pickle.READ_CHUNK


def test_the_limit_comes_from_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "s.pickle"
    path.write_bytes(dumps_snapshot(synthetic_snapshot(200)))
    monkeypatch.setenv(MAX_SNAPSHOT_BYTES_ENV, "1000")
    with pytest.raises(SnapshotLoadError, match=MAX_SNAPSHOT_BYTES_ENV):
        load_snapshot(path)
    with pytest.raises(SnapshotLoadError, match="larger than the limit of 1,000 bytes"):
        replay(str(path))
    assert load_snapshot(path, max_bytes=10 << 20)["segments"]  # the argument wins
    monkeypatch.setenv(MAX_SNAPSHOT_BYTES_ENV, "lots")
    with pytest.raises(ValueError, match=MAX_SNAPSHOT_BYTES_ENV):
        load_snapshot(path)
    monkeypatch.delenv(MAX_SNAPSHOT_BYTES_ENV)
    assert max_snapshot_bytes() == 4 << 30 == safe_pickle.DEFAULT_MAX_SNAPSHOT_BYTES
    assert max_snapshot_bytes("2g") == 2 << 30


def test_a_gzip_bomb_stops_at_the_limit(tmp_path):
    path = tmp_path / "bomb.json.gz"
    path.write_bytes(gzip.compress(b"[" + b" " * (64 << 20) + b"]"))
    assert path.stat().st_size < 1 << 20
    with pytest.raises(SnapshotLoadError, match="larger than the limit"):
        load_trace(str(path), max_bytes="4MiB")


def test_the_cli_names_the_limit(tmp_path):
    path = tmp_path / "s.pickle"
    path.write_bytes(dumps_snapshot(synthetic_snapshot(200)))
    r = _run_python("import sys; from cudalab.cli import main; sys.exit(main(sys.argv[1:]))",
                    "replay", str(path), env={MAX_SNAPSHOT_BYTES_ENV: "2KiB"})
    assert r.returncode == 2 and MAX_SNAPSHOT_BYTES_ENV in r.stderr, r.stderr


# --------------------------------------------------------------------------- malformed
def _seg(s):
    return s["segments"][0]


def _entry(s):
    return s["device_traces"][0][5]


MALFORMED = {
    "segment lacks address": (lambda s: _seg(s).pop("address"), r"segments\[0\] lacks the key 'address'"),
    "segment lacks total_size": (lambda s: _seg(s).pop("total_size"), r"segments\[0\] lacks the key 'total_size'"),
    "segment lacks blocks": (lambda s: _seg(s).pop("blocks"), r"segments\[0\] lacks the key 'blocks'"),
    "block lacks size": (lambda s: _seg(s)["blocks"][1].pop("size"), r"segments\[0\]\['blocks'\]\[1\] lacks the key 'size'"),
    "block size 2**70": (lambda s: _seg(s)["blocks"][0].__setitem__("size", 2**70), r"\['blocks'\]\[0\]\['size'\] is 1180591620717411303424, out of range"),
    "segment is a list": (lambda s: s["segments"].__setitem__(0, [1, 2]), r"segments\[0\] is a list, expected a segment"),
    "segments is a dict": (lambda s: s.__setitem__("segments", {"a": 1}), r"'?segments'? is a dict"),
    "entry lacks size": (lambda s: _entry(s).pop("size"), r"device_traces\[0\]\[5\] lacks the key 'size'"),
    "entry lacks action": (lambda s: _entry(s).pop("action"), r"device_traces\[0\]\[5\] lacks the key 'action'"),
    "time is a string": (lambda s: _entry(s).__setitem__("time_us", "noon"), r"device_traces\[0\]\[5\]\['time_us'\] is 'noon' \(str\)"),
    "time is NaN": (lambda s: _entry(s).__setitem__("time_us", float("nan")), r"device_traces\[0\]\[5\]\['time_us'\] is nan"),
    "size 2**70": (lambda s: _entry(s).__setitem__("size", 2**70), r"device_traces\[0\]\[5\]\['size'\] is 1180591620717411303424"),
    "entry is a list": (lambda s: s["device_traces"][0].__setitem__(5, ["alloc", 1, 2]), r"device_traces\[0\]\[5\] is a list"),
    "frames is a dict": (lambda s: _entry(s).__setitem__("frames", {"a": 1}), r"device_traces\[0\]\[5\]\['frames'\] is a dict"),
    "frame lacks line": (lambda s: _entry(s).__setitem__("frames", [{"filename": "a", "name": "f"}]), r"device_traces\[0\]\[5\]\['frames'\]\[0\] lacks the key 'line'"),
    "stream is text": (lambda s: _entry(s).__setitem__("stream", "s0"), r"device_traces\[0\]\[5\]\['stream'\] is 's0'"),
    "cudalab key is a list": (lambda s: s.__setitem__("cudalab", [1]), r"'?cudalab'? is a list"),
    "trace is a dict": (lambda s: s["device_traces"].__setitem__(0, {"a": 1}), r"device_traces\[0\] is a dict"),
}
#: What each reader reads: a malformed part it does not read is not its error.
READS_ENTRIES = {"history_frame", "export_perfetto", "plot_timeline", "SnapshotViewer",
                 "load_snapshot", "replay", "what_if"}
READS_SEGMENTS = {"snapshot_frame", "segments_frame", "history_frame", "export_perfetto",
                  "plot_timeline", "SnapshotViewer", "load_snapshot"}
REPLAY_KEYS = ("action", "size", "stream", "addr", "trace is", "entry is")


def _readers(tmp_path):
    out = {
        "snapshot_frame": export.snapshot_frame,
        "segments_frame": export.segments_frame,
        "history_frame": export.history_frame,
        "export_perfetto": lambda s: perfetto.export_perfetto(tmp_path / "t.json", s),
        "load_snapshot": lambda s: load_snapshot(io.BytesIO(pickle.dumps(s, protocol=4))),
        "replay": replay,
        "what_if": lambda s: what_if(s, ["expandable_segments:True"]),
    }
    try:
        import matplotlib  # noqa: F401

        from cudalab.memory_tools.plot import plot_timeline
        out["plot_timeline"] = plot_timeline
    except ImportError:
        pass
    try:
        from cudalab.widgets import SnapshotViewer
        out["SnapshotViewer"] = SnapshotViewer
    except ImportError:
        pass
    return out


@pytest.fixture(scope="module")
def base_snapshot():
    return synthetic_snapshot(300)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_snapshot_is_named_by_every_reader(tmp_path, base_snapshot, case):
    mutate, message = MALFORMED[case]
    for name, read in _readers(tmp_path).items():
        snap = copy.deepcopy(base_snapshot)
        mutate(snap)
        in_segments = case.startswith(("segment", "block"))
        reads = READS_SEGMENTS if in_segments else READS_ENTRIES
        if case in ("entry is a list", "trace is a dict", "cudalab key is a list"):  # the shape
            reads = READS_SEGMENTS | READS_ENTRIES
        if name in ("replay", "what_if") and not any(k in case for k in REPLAY_KEYS):
            reads = set()  # (the replay reads only action, addr, size and stream)
        if name in ("replay", "what_if") and "size 2**70" in case:
            reads = set()  # (skipped as an invalid size: see the test below)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReplayWarning)
            if name not in reads:
                read(snap)  # a part it does not read: no error
                continue
            with pytest.raises(ValueError) as info:
                read(snap)
        assert isinstance(info.value, (SnapshotLoadError, TraceError)), (name, info.value)
        if not isinstance(info.value, TraceError):
            assert info.match(message), (name, str(info.value))


@pytest.mark.parametrize("bad", ["512", 512.5, True, float("nan"), 2**70, None])
def test_replay_skips_sizes_that_are_not_integers(bad):
    trace = [{"action": "alloc", "addr": 4096, "size": bad, "stream": 0},
             {"action": "alloc", "addr": 8192, "size": 1 << 20, "stream": 0},
             {"action": "free_requested", "addr": 4096, "size": bad, "stream": 0},
             {"action": "free_requested", "addr": 8192, "size": 1 << 20, "stream": 0}]
    for form in (trace, {"segments": [], "device_traces": [trace]}):
        with pytest.warns(ReplayWarning, match="2 allocations .and their frees. with a size"):
            r = replay(form)
        assert r.skipped == {"invalid_size": 2}
        assert r.peak_allocated == 1 << 20  # never replayed as 512 bytes


# --------------------------------------------------------------------------- fuzz
def _mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        how = rng.random()
        i = rng.randrange(len(b))
        if how < 0.4:
            b[i] = rng.randrange(256)
        elif how < 0.6:
            del b[i:i + rng.randint(1, 8)]
        elif how < 0.8:
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        else:
            b = b[:i]
        if not b:
            b = bytearray(b"\x80")
    return bytes(b)


def _read_everything(snap):
    export.history_frame(snap)
    export.snapshot_frame(snap)
    export.segments_frame(snap)


def test_fuzzed_pickles_and_json_load_or_raise_a_value_error(tmp_path):
    rng = random.Random(23)
    snap = synthetic_snapshot(40)
    data = dumps_snapshot(snap)
    text = json.dumps(snap).encode()
    start = time.perf_counter()
    outcomes: dict[str, int] = {}
    for k in range(400):
        is_json = k % 4 == 3
        blob = _mutate(text if is_json else data, rng)
        path = tmp_path / f"f{k % 8}.{'json' if is_json else 'pickle'}"
        path.write_bytes(blob)
        for reader in (load_snapshot, load_trace, replay):
            if reader is load_snapshot and is_json:
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    got = reader(str(path))
                    if reader is load_snapshot:
                        _read_everything(got)
                outcomes["ok"] = outcomes.get("ok", 0) + 1
            except ValueError as exc:  # SnapshotLoadError, TraceError
                outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
    assert time.perf_counter() - start < 30
    assert outcomes.get("ok", 0) and outcomes.get("SnapshotLoadError", 0), outcomes


def test_fuzzed_snapshot_dicts_are_read_or_named(tmp_path):
    """Structural mutations: a key dropped, a value of another type, in a real snapshot."""
    rng = random.Random(5)
    base = synthetic_snapshot(60)
    wrong = ["512", 512.5, float("nan"), -1, 2**70, None, [], {}, [1, 2], True, "x"]

    def dicts(obj, out):
        if isinstance(obj, dict):
            out.append(obj)
            for v in obj.values():
                dicts(v, out)
        elif isinstance(obj, list):
            for v in obj:
                dicts(v, out)
        return out

    for _ in range(150):
        snap = copy.deepcopy(base)
        for _ in range(rng.randint(1, 3)):
            d = rng.choice(dicts(snap, []))
            if not d:
                continue
            key = rng.choice(sorted(d))
            if rng.random() < 0.3:
                del d[key]
            else:
                d[key] = rng.choice(wrong)
        for read in (export.history_frame, export.snapshot_frame, export.segments_frame,
                     lambda s: perfetto.export_perfetto(tmp_path / "f.json", s)):
            try:
                read(snap)
            except SnapshotLoadError:
                pass


def test_a_real_snapshot_round_trips(tmp_path):
    x = cudalab.empty(1000)
    cudalab.memory._record_memory_history(max_entries=1000)
    try:
        y = cudalab.empty(3000)
        del y
        path = tmp_path / "real.pickle"
        cudalab.memory._dump_snapshot(path)
    finally:
        cudalab.memory._record_memory_history(None)
    del x
    snap = load_snapshot(path)
    assert snap["segments"] and snap["device_traces"]
    _read_everything(snap)


def test_dict_and_list_subclasses_are_snapshots_too():
    class Snap(dict):
        pass

    class Entries(list):
        pass

    snap = synthetic_snapshot(100)
    sub = Snap(snap, device_traces=[Entries(t) for t in snap["device_traces"]])
    assert export.history_frame(sub)["size"].tolist() == export.history_frame(snap)["size"].tolist()
    assert len(export.snapshot_frame(sub)) == len(export.snapshot_frame(snap))


def test_a_deep_value_in_an_unchecked_key_loads_but_does_not_export_a_recursion_error():
    """Deep lists under a key the schema does not read load (lists cannot crash CPython:
    its recursion over them is checked); pickling them again is a ValueError."""
    data = (b"\x80\x04}(\x8c\x08segments]\x8c\x0ddevice_traces]\x8c\x04meta"
            + b"]" * 5_000 + b"a" * 4_999 + b"u.")
    got = load_snapshot(io.BytesIO(data))
    with pytest.raises(ValueError, match="nests containers too deeply"):
        dumps_snapshot(got)


@pytest.mark.parametrize("value", ["1180591620717411303424", "abc", "1e400", "512.5", ""])
@pytest.mark.parametrize("column", ["size", "addr", "time_us"])
def test_a_malformed_history_csv_names_the_column_and_row(tmp_path, column, value):
    df = export.history_frame(synthetic_snapshot(50))
    df.to_csv(tmp_path / "h.csv", index=False)
    lines = (tmp_path / "h.csv").read_text().splitlines()
    i = lines[0].split(",").index(column)
    row = lines[4].split(",")
    row[i] = value
    lines[4] = ",".join(row)
    (tmp_path / "h.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"column '{column}', row 3 is"):
        cudalab.memory.read_history_csv(tmp_path / "h.csv")
    with pytest.raises(TraceError, match=rf"column '{column}', row 3"):
        replay(str(tmp_path / "h.csv"))
