"""Memory snapshots: torch's ``_snapshot()`` schema with plain types only, pickles that
memory_viz reads (protocol 4, no globals), ``memory_snapshot()`` with stacks, and the
restricted loader that refuses pickles referencing any class or function.
"""

from __future__ import annotations

import gc
import io
import os
import pickle
import pickletools
import sys

import pytest

import cudalab
from cudalab.allocator.caching import DeviceCachingAllocator
from cudalab.allocator.config import AllocatorConfig, parse_alloc_conf
from cudalab.allocator.registry import native_allocator
from cudalab.memory_tools import history
from cudalab.memory_tools.trace_io import SnapshotLoadError, dumps_snapshot, to_plain

MiB = 1024 * 1024
HERE = os.path.abspath(__file__)

SEGMENT_KEYS = {"device", "address", "total_size", "allocated_size", "active_size",
                "requested_size", "stream", "segment_type", "segment_pool_id", "is_expandable",
                "frames", "blocks"}
BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames"}
TORCH_ENTRY_KEYS = {"action", "size", "stream", "time_us", "frames", "compile_context",
                    "user_metadata"}
CUDALAB_ENTRY_KEYS = {"device", "nvtx_range", "cell"}
SETTINGS_KEYS = {"PYTORCH_CUDA_ALLOC_CONF", "max_split_size", "garbage_collection_threshold",
                 "expandable_segments", "pinned_num_register_threads",
                 "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                 "graph_capture_record_stream_reuse", "roundup_power2_divisions"}
PLAIN = (dict, list, tuple, str, int, float, bool, type(None))
# the opcodes pytorch.org/memory_viz's JavaScript unpickler (MemoryViz.js) reads
VIEWER_OPS = {"PROTO", "FRAME", "APPEND", "APPENDS", "LIST", "TUPLE", "NEWFALSE", "NEWTRUE",
              "NONE", "BINGET", "LONG_BINGET", "BININT", "BININT1", "BININT2", "EMPTY_DICT",
              "EMPTY_LIST", "LONG1", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "SETITEMS",
              "SETITEM", "DICT", "SHORT_BINUNICODE", "BINUNICODE", "STOP", "EMPTY_TUPLE",
              "TUPLE1", "TUPLE2", "TUPLE3", "BINFLOAT"}
# opcodes that could run code
FORBIDDEN_OPS = {"GLOBAL", "STACK_GLOBAL", "REDUCE", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX",
                 "BUILD", "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID", "BINBYTES",
                 "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8"}


def line() -> int:
    return sys._getframe(1).f_lineno


def make(backend, conf: str | None = None) -> DeviceCachingAllocator:
    cfg = parse_alloc_conf(conf) if conf else AllocatorConfig()
    return native_allocator(backend, 0, cfg, stream_resolver=lambda: 0)


@pytest.fixture(autouse=True)
def _history_off():
    gc.collect()
    cudalab.memory._record_memory_history(None)
    yield
    cudalab.memory._record_memory_history(None)
    for a in list(history._extra):
        history.detach_allocator(a)


@pytest.fixture
def workload(backend):
    """A recorded private allocator with live, freed, split and large blocks, an OOM entry
    and an NVTX range; returns (allocator, snapshot, {name: ptr}, line of the first alloc)."""
    a = make(backend)
    history.attach_allocator(a)
    a.set_memory_fraction((200 * MiB + 0.5) / backend.mem_get_info(0)[1])
    cudalab.memory._record_memory_history()
    ptrs = {}
    ptrs["small"], ln = a.malloc(1000), line()
    ptrs["small2"] = a.malloc(3000)
    freed = a.malloc(7000)
    a.free(freed)
    with cudalab.nvtx.range("big"):
        ptrs["large"] = a.malloc(30 * MiB)
    with pytest.raises(cudalab.OutOfMemoryError):
        a.malloc(300 * MiB)
    snap = cudalab.memory._snapshot(allocators=[a])
    yield a, snap, ptrs, ln
    history.detach_allocator(a)
    for p in list(a.live):
        a.free(p)
    a.empty_cache()


def walk(obj, path="snapshot"):
    """Every value is a plain type (dict keys: str)."""
    assert type(obj) in PLAIN, f"{path}: {type(obj)}"
    if type(obj) is dict:
        for k, v in obj.items():
            assert type(k) is str, f"{path}: key {k!r}"
            walk(v, f"{path}[{k!r}]")
    elif type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            walk(v, f"{path}[{i}]")


# --------------------------------------------------------------------------- schema
def test_snapshot_schema(workload):
    a, snap, ptrs, ln = workload
    assert set(snap) == {"segments", "device_traces", "allocator_settings",
                         "external_annotations", "identity", "device_memory"}
    assert snap["device_memory"] == [cudalab.get_device_properties(d).total_memory
                                     for d in range(cudalab.device_count())]
    assert snap["external_annotations"] == []
    segs = snap["segments"]
    assert [s["address"] for s in segs] == sorted(s["address"] for s in segs)
    for s in segs:
        assert set(s) == SEGMENT_KEYS
        assert s["segment_type"] in ("small", "large") and s["segment_pool_id"] == (0, 0)
        assert s["is_expandable"] is False and s["device"] == 0
        assert s["total_size"] == sum(b["size"] for b in s["blocks"])
        addr = s["address"]
        for b in s["blocks"]:
            assert set(b) == BLOCK_KEYS
            assert b["address"] == addr  # consecutive, as memory_viz derives them
            addr += b["size"]
            assert b["state"] in ("active_allocated", "active_pending_free", "inactive")
        assert s["allocated_size"] == sum(b["size"] for b in s["blocks"]
                                          if b["state"] == "active_allocated")
    blocks = {b["address"]: b for s in segs for b in s["blocks"]}
    assert blocks[ptrs["small"]]["frames"][0] == {"filename": HERE, "line": ln,
                                                   "name": "workload"}
    assert blocks[ptrs["small"]]["requested_size"] == 1000
    # segment frames: the stack that created the segment
    (small_seg,) = [s for s in segs if s["address"] == ptrs["small"]]
    assert small_seg["frames"][0]["line"] == ln
    traces = snap["device_traces"]
    assert isinstance(traces, list) and all(isinstance(t, list) for t in traces)
    assert len(traces) >= cudalab.device_count()
    for e in traces[0]:
        keys = set(e)
        addr_key = "device_free" if e["action"] == "oom" else "addr"
        assert keys == TORCH_ENTRY_KEYS | CUDALAB_ENTRY_KEYS | {addr_key}
        assert e["action"] in history.ACTIONS
        for f in e["frames"]:
            assert set(f) == {"filename", "line", "name"}
    actions = [e["action"] for e in traces[0]]
    for act in ("segment_alloc", "alloc", "free_requested", "free_completed", "oom"):
        assert act in actions
    # torch reads the trace before it records the snapshot entry: a snapshot's own trace
    # ends with the last allocator event, not with itself
    assert "snapshot" not in actions and actions[-1] == "oom"
    (big,) = [e for e in traces[0] if e["action"] == "alloc" and e["addr"] == ptrs["large"]]
    assert big["nvtx_range"] == "big" and big["size"] == 30 * MiB
    settings = snap["allocator_settings"]
    assert set(settings) == SETTINGS_KEYS
    assert settings["max_split_size"] == -1 and settings["expandable_segments"] is False
    assert list(settings["roundup_power2_divisions"]) == [str(1 << i) for i in range(16)]


def test_snapshot_is_plain_python(workload):
    _, snap, _, _ = workload
    walk(snap)
    assert to_plain(snap) is snap  # nothing needed converting


def test_snapshot_entry_records_active_bytes(workload):
    a, snap, ptrs, _ = workload
    active = sum(s["active_size"] for s in snap["segments"])
    # the first snapshot's entry is in the trace from the next snapshot on
    later = cudalab.memory._snapshot(allocators=[a])
    last = later["device_traces"][0][-1]
    assert last["action"] == "snapshot" and last["size"] == active and last["addr"] == 0
    assert last["frames"] == []
    assert later["device_traces"][0][:-1] == snap["device_traces"][0]


def test_memory_snapshot_returns_segments_with_frames():
    cudalab.init()
    cudalab.memory._record_memory_history()
    p, ln = cudalab.memory.caching_allocator_alloc(5000), line()
    try:
        segs = cudalab.memory.memory_snapshot()
        assert isinstance(segs, list)
        (b,) = [b for s in segs for b in s["blocks"] if b["address"] == p]
        assert b["state"] == "active_allocated" and b["frames"][0]["line"] == ln
        assert history.trace_entries(0)[-1]["action"] == "snapshot"  # torch records it too
    finally:
        cudalab.memory.caching_allocator_delete(p)
    cudalab.memory._record_memory_history(None)
    segs = cudalab.memory.memory_snapshot()
    assert all(b["frames"] == [] for s in segs for b in s["blocks"])
    assert history.trace_entries(0) == []


def test_snapshot_without_recording_has_empty_traces():
    cudalab.init()
    p = cudalab.memory.caching_allocator_alloc(5000)
    try:
        snap = cudalab.memory._snapshot()
        assert all(t == [] for t in snap["device_traces"])
        assert len(snap["device_traces"]) == cudalab.device_count()
        assert any(b["address"] == p for s in snap["segments"] for b in s["blocks"])
        walk(snap)
    finally:
        cudalab.memory.caching_allocator_delete(p)


def test_expandable_segments_snapshot(backend):
    a = make(backend, "expandable_segments:True")
    history.attach_allocator(a)
    cudalab.memory._record_memory_history()
    p, ln = a.malloc(1 * MiB), line()
    snap = cudalab.memory._snapshot(allocators=[a])
    (seg,) = snap["segments"]
    assert seg["is_expandable"] is True and seg["address"] == p
    assert seg["frames"][0]["line"] == ln and seg["blocks"][0]["frames"][0]["line"] == ln
    assert snap["allocator_settings"]["expandable_segments"] is True
    acts = [e["action"] for e in snap["device_traces"][0]]
    assert "segment_map" in acts
    history.detach_allocator(a)
    a.free(p)
    a.empty_cache()


# --------------------------------------------------------------------------- pickles
def _ops(data: bytes) -> list:
    return [op for op, _, _ in pickletools.genops(data)]


def test_dump_snapshot_uses_protocol_4_and_no_globals(workload, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cudalab.memory._dump_snapshot()  # torch's default file name
    data = (tmp_path / "dump_snapshot.pickle").read_bytes()
    ops = _ops(data)
    assert ops[0].name == "PROTO"
    (_, proto, _) = next(pickletools.genops(data))
    assert proto <= 4
    names = {op.name for op in ops}
    assert not names & FORBIDDEN_OPS, names & FORBIDDEN_OPS
    assert names <= VIEWER_OPS, names - VIEWER_OPS
    loaded = pickle.loads(data)
    assert set(loaded) >= {"segments", "device_traces", "allocator_settings"}
    # the workload's private snapshot too
    _, snap, _, _ = workload
    data = dumps_snapshot(snap)
    assert next(pickletools.genops(data))[1] == 4
    assert {op.name for op in _ops(data)} <= VIEWER_OPS
    assert pickle.loads(data) == snap


def test_export_memory_viz_round_trip(tmp_path):
    cudalab.init()
    cudalab.memory._record_memory_history()
    p = cudalab.memory.caching_allocator_alloc(5000)
    try:
        path = tmp_path / "snap.pickle"
        assert cudalab.memory.export_memory_viz(path) == str(path)
        snap = cudalab.memory.load_snapshot(path)
        assert snap == pickle.loads(path.read_bytes())
        assert any(b["address"] == p for s in snap["segments"] for b in s["blocks"])
        with open(path, "rb") as f:  # a binary file object works too
            assert cudalab.memory.load_snapshot(f) == snap
        assert cudalab.memory.load_snapshot(str(path)) == snap
    finally:
        cudalab.memory.caching_allocator_delete(p)


def test_to_plain_converts_numpy_numbers_and_rejects_objects():
    np = pytest.importorskip("numpy")
    shared = [{"line": np.int64(3)}]
    snap = {"segments": [{"size": np.int64(5), "ok": np.float32(1.5), "flag": np.bool_(True),
                          "frames": shared, "again": shared}]}
    out = to_plain(snap)
    seg = out["segments"][0]
    assert type(seg["size"]) is int and seg["size"] == 5
    assert type(seg["ok"]) is float and type(seg["flag"]) is bool
    assert seg["frames"] is seg["again"]  # sharing survives
    walk(out)
    with pytest.raises(TypeError, match=r"\['segments'\]\[0\]\['bad'\].*only dict, list"):
        to_plain({"segments": [{"bad": object()}]})
    with pytest.raises(TypeError):
        to_plain({"segments": [], "b": b"bytes"})
    # a snapshot is pickled directly and converted only if needed
    data = dumps_snapshot({"segments": [{"address": np.uint64(7), "total_size": np.int64(0),
                                         "blocks": [], "frames": []}]})
    got = cudalab.memory.load_snapshot(io.BytesIO(data))
    assert type(got["segments"][0]["address"]) is int
    assert {op.name for op in _ops(data)} <= VIEWER_OPS
    with pytest.raises(TypeError, match="only dict, list"):
        dumps_snapshot({"segments": [object()]})


# --------------------------------------------------------------------------- identity
def test_every_snapshot_says_where_it_came_from(tmp_path):
    from cudalab.identity import Identity

    cudalab.init()
    snap = cudalab.memory._snapshot()
    ident = Identity.from_dict(snap["identity"])
    assert ident == Identity.current()  # this process, its current device, cudalab's allocator
    assert ident.pid == os.getpid() and ident.allocator == "cudalab"
    assert ident.device == cudalab.current_device()
    assert ident.device_uuid == cudalab.get_device_properties(ident.device).nvml_uuid
    # the file memory_viz reads carries it, as plain data, and load_snapshot checks it
    path = tmp_path / "snap.pickle"
    cudalab.memory._dump_snapshot(path)
    assert pickle.loads(path.read_bytes())["identity"] == snap["identity"]
    walk(pickle.loads(path.read_bytes())["identity"])
    assert cudalab.memory.load_snapshot(path)["identity"] == snap["identity"]


@pytest.mark.parametrize("identity,message", [
    ("node7", r"identity is a str \('node7'\), expected a dict"),
    ({"host": "h", "pid": "12", "version": "0", "allocator": "cudalab"},
     r"identity\['pid'\] is a str \('12'\), expected an int"),
    ({"host": "h", "pid": 1, "version": "0"}, r"identity lacks the key 'allocator'"),
])
def test_load_rejects_a_malformed_identity(identity, message):
    snap = {**torch_style_snapshot(), "identity": identity}
    with pytest.raises(SnapshotLoadError, match=r"snapshot.*: " + message):
        cudalab.memory.load_snapshot(io.BytesIO(pickle.dumps(snap)))


# --------------------------------------------------------------------------- loading
class Evil:
    """Unpickling this would run a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_load_refuses_a_malicious_pickle(tmp_path, protocol):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [Evil(marker)]},
                                  protocol=protocol))
    with pytest.raises(SnapshotLoadError, match=r"refusing to load .*evil\.pickle.*"
                                                 r"references (posix|nt|os)\.system; "
                                                 "snapshots contain only plain data"):
        cudalab.memory.load_snapshot(path)
    assert not marker.exists()
    assert issubclass(SnapshotLoadError, ValueError)


def test_load_refuses_builtins_and_numpy_scalars(tmp_path):
    np = pytest.importorskip("numpy")
    path = tmp_path / "np.pickle"
    path.write_bytes(pickle.dumps({"segments": [{"size": np.int64(3)}]}, protocol=4))
    with pytest.raises(SnapshotLoadError, match="numpy"):
        cudalab.memory.load_snapshot(path)
    # even harmless-looking globals are refused (eval, set, getattr ...)
    payload = pickle.dumps({"segments": [], "x": {1, 2}}, protocol=2)  # builtins.set
    with pytest.raises(SnapshotLoadError, match=r"(__builtin__|builtins)\.set"):
        cudalab.memory.load_snapshot(io.BytesIO(payload))
    hand = b"cbuiltins\neval\n(S'1+1'\ntR."  # GLOBAL + REDUCE written by hand
    with pytest.raises(SnapshotLoadError, match="builtins.eval"):
        cudalab.memory.load_snapshot(io.BytesIO(hand))
    with pytest.raises(SnapshotLoadError, match="persistent id"):
        cudalab.memory.load_snapshot(io.BytesIO(b"\x80\x02K\x01Q."))  # BINPERSID


def torch_style_snapshot() -> dict:
    """A snapshot as torch 2.11 writes it (no cudalab keys), built from plain dicts."""
    frames = [{"name": "forward", "filename": "/x/model.py", "line": 12},
              {"name": "<module>", "filename": "/x/train.py", "line": 3}]
    return {
        "segments": [{
            "device": 0, "address": 139_800_000_000_000, "total_size": 2 * MiB,
            "allocated_size": 512, "active_size": 512, "requested_size": 100,
            "stream": 0, "segment_type": "small", "segment_pool_id": (0, 0),
            "is_expandable": False, "frames": frames,
            "blocks": [
                {"address": 139_800_000_000_000, "size": 512, "requested_size": 100,
                 "state": "active_allocated", "frames": frames},
                {"address": 139_800_000_000_512, "size": 2 * MiB - 512, "requested_size": 0,
                 "state": "inactive", "frames": []},
            ],
        }],
        "device_traces": [[
            {"action": "segment_alloc", "addr": 139_800_000_000_000, "size": 2 * MiB,
             "stream": 0, "time_us": 1_700_000_000_000_000, "frames": frames,
             "compile_context": "", "user_metadata": ""},
            {"action": "alloc", "addr": 139_800_000_000_000, "size": 100, "stream": 0,
             "time_us": 1_700_000_000_000_001, "frames": frames, "compile_context": "",
             "user_metadata": ""},
            {"action": "oom", "device_free": 1024, "size": 80 * MiB, "stream": 0,
             "time_us": 1_700_000_000_000_002, "frames": [], "compile_context": "",
             "user_metadata": ""},
        ]],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1,
                               "garbage_collection_threshold": 0.0,
                               "expandable_segments": False,
                               "roundup_power2_divisions": {str(1 << i): 0 for i in range(16)}},
        "external_annotations": [],
    }


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_load_accepts_a_torch_style_snapshot(tmp_path, protocol):
    snap = torch_style_snapshot()
    path = tmp_path / "torch.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=protocol))
    assert cudalab.memory.load_snapshot(path) == snap


def test_load_accepts_a_segment_list_and_fills_device_traces(tmp_path):
    snap = torch_style_snapshot()
    got = cudalab.memory.load_snapshot(io.BytesIO(pickle.dumps(snap["segments"])))
    assert got == {"segments": snap["segments"], "device_traces": []}
    del snap["device_traces"]
    assert cudalab.memory.load_snapshot(io.BytesIO(pickle.dumps(snap)))["device_traces"] == []


def test_load_reports_truncated_corrupt_and_foreign_files(tmp_path):
    data = pickle.dumps(torch_style_snapshot(), protocol=4)
    path = tmp_path / "cut.pickle"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SnapshotLoadError, match=r"cut\.pickle.*truncated or corrupt"):
        cudalab.memory.load_snapshot(path)
    with pytest.raises(SnapshotLoadError, match="truncated or corrupt"):
        cudalab.memory.load_snapshot(io.BytesIO(b"this is not a pickle at all"))
    empty = tmp_path / "empty.pickle"
    empty.write_bytes(b"")
    with pytest.raises(SnapshotLoadError, match="empty"):
        cudalab.memory.load_snapshot(empty)
    for obj in ({"device_traces": []}, 42, "segments", [1, 2], {"segments": "no"}):
        with pytest.raises(SnapshotLoadError, match="not a memory snapshot"):
            cudalab.memory.load_snapshot(io.BytesIO(pickle.dumps(obj)))
    with pytest.raises(SnapshotLoadError, match="device_traces"):
        cudalab.memory.load_snapshot(io.BytesIO(pickle.dumps({"segments": [],
                                                              "device_traces": {}})))
    with pytest.raises(FileNotFoundError):
        cudalab.memory.load_snapshot(tmp_path / "missing.pickle")
    with pytest.raises(TypeError):
        cudalab.memory.load_snapshot(42)
    with pytest.raises(SnapshotLoadError, match="binary"):
        cudalab.memory.load_snapshot(io.StringIO("text"))


# --------------------------------------------------------------------------- GPU: torch reads it
def _cudalab_snapshot_with_history(tmp_path):
    cudalab.init()
    keep = []
    with cudalab.memory.record_history():
        for i in range(20):
            keep.append(cudalab.memory.caching_allocator_alloc((i + 1) * 100_000))
        for p in keep[::2]:
            cudalab.memory.caching_allocator_delete(p)
        path = tmp_path / "cudalab.pickle"
        cudalab.memory._dump_snapshot(path)
    for p in keep[1::2]:
        cudalab.memory.caching_allocator_delete(p)
    return path


@pytest.mark.gpu
def test_torch_memory_viz_reads_a_cudalab_snapshot(tmp_path):
    pytest.importorskip("torch")
    from torch.cuda import _memory_viz as mv

    path = _cudalab_snapshot_with_history(tmp_path)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert snap["device_traces"][0]
    assert snap["identity"]["pid"] == os.getpid()  # cudalab's key rides along
    for fn in ("segment_plot", "trace_plot"):
        html = getattr(mv, fn)(snap)
        assert isinstance(html, str) and "<html" in html.lower(), fn
    no_download = lambda lines, *a, **k: lines  # noqa: E731 - flamegraph.pl needs the network
    for fn in ("memory", "segments"):
        if hasattr(mv, fn):
            out = getattr(mv, fn)(snap, format_flamegraph=no_download)
            assert isinstance(out, str) and out
    for fn in ("segsum", "trace", "stats"):
        if hasattr(mv, fn):
            assert isinstance(getattr(mv, fn)(snap), str)
    if hasattr(mv, "compare"):
        mv.compare(snap["segments"], snap["segments"], format_flamegraph=no_download)


@pytest.mark.gpu
def test_torch_memory_viz_command_line_reads_a_cudalab_snapshot(tmp_path):
    pytest.importorskip("torch")
    import subprocess

    path = _cudalab_snapshot_with_history(tmp_path)
    for kind in ("trace_plot", "segment_plot"):
        out = tmp_path / f"{kind}.html"
        res = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", kind, str(path),
                              "-o", str(out)], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        assert "<html" in out.read_text().lower()
    for kind in ("stats", "trace", "segsum"):
        res = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", kind, str(path)],
                             capture_output=True, text=True, timeout=300)
        if "invalid choice" in res.stderr:
            continue
        assert res.returncode == 0, res.stderr


@pytest.mark.gpu
def test_load_snapshot_reads_torchs_own_dump(tmp_path):
    torch = pytest.importorskip("torch")
    torch.cuda.memory._record_memory_history(max_entries=10_000)
    try:
        xs = [torch.empty(n * 1000, dtype=torch.uint8, device="cuda") for n in range(1, 30)]
        del xs[::2]
        path = tmp_path / "torch.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(None)
    snap = cudalab.memory.load_snapshot(path)
    assert snap["segments"] and snap["device_traces"]
    acts = {e["action"] for t in snap["device_traces"] for e in t}
    assert {"alloc", "free_requested", "free_completed"} <= acts
    del xs
