"""The CuPy recording (cudalab.memory_tools.cupy_history): CuPy's pool allocations recorded
with CuPy's memory hooks, as a trace, a snapshot and a what-if, on the fake CuPy of
tests/helpers/fake_allocators.py (whose pool calls the hooks with CuPy's keyword arguments).
The real CuPy's checks are tests/memory_tools/test_cupy_history_gpu.py."""

from __future__ import annotations

import io
import sys
import threading

import pytest

import cudalab
from cudalab.memory_sources import CupySource, SourceUnavailableError
from cudalab.memory_tools import cupy_history
from cudalab.memory_tools.cupy_history import HOOK_NAME, record_cupy_history
from cudalab.memory_tools.snapshot_check import check_snapshot
from cudalab.memory_tools.trace_io import dumps_snapshot, load_snapshot
from tests.helpers.fake_allocators import (  # noqa: F401 - fixtures: cupy
    FakeCupy,
    FakeMemoryHook,
    FakeOutOfMemoryError,
    fake_cupy,
    get_memory_hooks,
)


@pytest.fixture(autouse=True)
def _no_recording(monkeypatch):
    """Each test starts with no CuPy recording in the process and leaves none running."""
    monkeypatch.setattr(cupy_history, "_current", None)
    cudalab.init()
    yield
    rec = cupy_history.current_recording()
    if rec is not None and rec.active:
        rec.stop()
    assert HOOK_NAME not in get_memory_hooks()


class Spy(FakeMemoryHook):
    """A second hook beside the recording's: every postprocess call, as CuPy made it."""

    name = "spy"

    def __init__(self):
        self.calls = []

    def malloc_postprocess(self, **kw):
        self.calls.append(("malloc", kw))

    def free_postprocess(self, **kw):
        self.calls.append(("free", kw))

    def alloc_postprocess(self, **kw):
        self.calls.append(("alloc", kw))


def workload(cupy):
    """Allocations and frees as arrays make them: new segments, a reused split one."""
    a = cupy.alloc(3 << 20)
    b = cupy.alloc(1000)
    cupy.free(a)
    c = cupy.alloc(1 << 20)  # cut from a's segment
    d = cupy.alloc(5 << 20)
    cupy.free(b)
    return [c, d]


def entries(snap, device=0):
    return snap["device_traces"][device]


# ------------------------------------------------------------------ the trace
def test_each_hook_call_is_a_trace_entry(cupy):
    with Spy() as spy:
        rec = record_cupy_history(cupy)
        workload(cupy)
    trace = entries(rec.snapshot())
    expected = []
    for kind, kw in spy.calls:
        if kind == "alloc":
            expected.append(("segment_alloc", kw["mem_ptr"], kw["mem_size"]))
        elif kind == "malloc":
            expected.append(("alloc", kw["mem_ptr"], kw["mem_size"]))
        else:
            expected += [(a, kw["mem_ptr"], kw["mem_size"])
                         for a in ("free_requested", "free_completed")]
    assert [(e["action"], e["addr"], e["size"]) for e in trace] == expected
    assert len(expected) > 6
    times = [e["time_us"] for e in trace]
    assert times == sorted(times)
    assert all(e["device"] == 0 and e["stream"] == 0 for e in trace)


def test_snapshot_is_the_pool_when_everything_was_recorded(cupy):
    rec = record_cupy_history(cupy)
    keep = workload(cupy)
    pool = cupy.get_default_memory_pool()
    snap = rec.snapshot()
    check_snapshot(snap)
    live = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert sorted(b["address"] for b in live) == sorted(keep)
    assert sum(b["size"] for b in live) == pool.used_bytes() > 0
    assert sum(s["total_size"] for s in snap["segments"]) == pool.total_bytes()
    for s in snap["segments"]:  # the blocks tile each segment
        assert sum(b["size"] for b in s["blocks"]) == s["total_size"] and s["segment_seen"]
        assert s["allocated_size"] == sum(b["size"] for b in s["blocks"]
                                          if b["state"] == "active_allocated")
    (figures,) = snap["cudalab"]["cupy_pool"]
    assert (figures["used_bytes"], figures["total_bytes"]) == \
        (pool.used_bytes(), pool.total_bytes())
    assert figures["recorded_used_bytes"] == pool.used_bytes()
    assert snap["identity"]["allocator"] == "cupy"
    note = snap["cudalab"]["note"]
    assert "only what was allocated since the recording started is shown" in note
    assert "MemoryPool.used_bytes/total_bytes" in note and "per thread" in note
    back = load_snapshot(io.BytesIO(dumps_snapshot(snap)))  # the pickle cudalab's tools load
    assert back["device_traces"] == snap["device_traces"]
    assert back["identity"]["allocator"] == "cupy"


def test_older_memory_is_counted_not_drawn_as_seen(cupy):
    old = cupy.alloc(4 << 20)
    spare = cupy.alloc(2 << 20)
    cupy.free(spare)  # a free older segment the pool reuses
    rec = record_cupy_history(cupy)
    inside_old = cupy.alloc(1 << 20)
    cupy.free(old)
    snap = rec.snapshot()
    assert [e["action"] for e in entries(snap)] == ["alloc"]  # the older free is not written
    (seg,) = snap["segments"]
    assert seg["segment_seen"] is False and seg["address"] == inside_old
    assert seg["total_size"] == 1 << 20
    assert "1 free (4.0 MiB) of blocks allocated before the recording" in \
        snap["cudalab"]["note"]
    assert snap["cudalab"]["cupy_pool"][0]["older_frees"] == 1


def test_free_all_blocks_is_seen_through_the_pools_total(cupy):
    from cudalab.memory import history_frame

    rec = record_cupy_history(cupy)
    keep = workload(cupy)
    for ptr in keep[1:]:
        cupy.free(ptr)
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()  # CuPy calls no hook for it
    cupy.alloc(7 << 20)  # the next segment: the released ones are written first
    acts = [e["action"] for e in entries(rec.snapshot())]
    last = acts.index("segment_alloc", len(acts) - 3)
    assert "segment_free" in acts[:last] and acts[last + 1:] == ["alloc"]
    df = history_frame(source="cupy")
    assert int(df["reserved"].iloc[-1]) == pool.total_bytes()
    assert int(df["allocated"].iloc[-1]) == pool.used_bytes()
    cupy.free(keep[0])
    pool.free_all_blocks()  # and at the next snapshot
    snap = rec.snapshot()
    assert sum(s["total_size"] for s in snap["segments"]) == pool.total_bytes()
    assert history_frame(snap)["reserved"].iloc[-1] == pool.total_bytes()


def test_each_device_has_its_trace_and_pool_figures(cupy):
    rec = record_cupy_history(cupy)
    on0 = cupy.alloc(1 << 20)
    on1 = cupy.alloc(3 << 20, device=1)
    snap = rec.snapshot()
    assert [[e["addr"] for e in t if e["action"] == "alloc"] for t in snap["device_traces"]] \
        == [[on0], [on1]]
    assert all(e["device"] == 1 for e in snap["device_traces"][1])
    pool = cupy.get_default_memory_pool()
    with cupy.cuda.Device(1):
        used1 = pool.used_bytes()
    assert [(p["device"], p["used_bytes"]) for p in snap["cudalab"]["cupy_pool"]] == \
        [(0, 1 << 20), (1, used1)] and used1 == 3 << 20
    assert {s["device"] for s in snap["segments"]} == {0, 1}
    assert cupy.cuda.runtime.getDevice() == 0  # (read with device 1 current, then restored)


def test_a_stream_is_the_current_one(cupy):
    rec = record_cupy_history(cupy)
    cupy.pool.stream = 0x5000  # CuPy's current stream (its arena)
    ptr = cupy.alloc(1 << 20)
    cupy.pool.stream = 0
    cupy.free(ptr)
    trace = entries(rec.snapshot())
    assert {e["stream"] for e in trace} == {0x5000}  # the free keeps the block's stream
    assert rec.snapshot()["segments"][0]["stream"] == 0x5000


def test_max_entries_keeps_the_newest(cupy):
    rec = record_cupy_history(cupy, max_entries=5)
    ptrs = [cupy.alloc(512 * (i + 1)) for i in range(6)]
    trace = entries(rec.snapshot())
    assert len(trace) == 5 and [e["addr"] for e in trace][-1] == ptrs[-1]


@pytest.mark.parametrize("context, stacks, on_alloc, on_free, in_snapshot", [
    ("all", "all", True, "free", True),
    ("alloc", "python", True, "alloc", True),
    ("state", "all", False, None, True),
    (None, "all", False, None, False),
    ("all", None, False, None, False),
])
def test_stacks_as_cudalabs_history(cupy, context, stacks, on_alloc, on_free, in_snapshot):
    def allocate_here():
        return cupy.alloc(4096)

    def free_here(ptr):
        cupy.free(ptr)

    rec = record_cupy_history(cupy, context=context, stacks=stacks)
    ptr = allocate_here()
    keep = allocate_here()
    free_here(ptr)
    snap = rec.snapshot()

    def names(frames):
        return {f["name"] for f in frames}

    by = {e["action"]: e for e in entries(snap)}
    assert ("allocate_here" in names(by["alloc"]["frames"])) == on_alloc
    free_names = names(by["free_completed"]["frames"])
    assert ("free_here" in free_names) == (on_free == "free")
    assert ("allocate_here" in free_names) == (on_free == "alloc")
    (block,) = [b for s in snap["segments"] for b in s["blocks"] if b["address"] == keep]
    assert ("allocate_here" in names(block["frames"])) == in_snapshot


def test_only_the_starting_thread_is_recorded(cupy):
    rec = record_cupy_history(cupy)
    mine = cupy.alloc(1 << 20)
    other = []
    t = threading.Thread(target=lambda: other.append(cupy.alloc(2 << 20)))
    t.start()
    t.join()
    assert [e["addr"] for e in entries(rec.snapshot()) if e["action"] == "alloc"] == [mine]
    errors = []

    def stop_there():
        try:
            rec.stop()
        except RuntimeError as exc:
            errors.append(str(exc))

    # a block freed in another thread is found when the pool hands its address out again
    t = threading.Thread(target=lambda: cupy.free(mine))
    t.start()
    t.join()
    again = cupy.alloc(1 << 20)
    assert again == mine
    acts = [(e["action"], e["addr"]) for e in entries(rec.snapshot())]
    assert acts[-3:] == [("free_requested", mine), ("free_completed", mine), ("alloc", mine)]
    assert "1 block was freed outside the recorded thread" in rec.snapshot()["cudalab"]["note"]
    t = threading.Thread(target=stop_there)
    t.start()
    t.join()
    assert "stop it from that thread" in errors[0] and rec.active
    rec.stop()
    assert not rec.active


def test_a_snapshot_from_another_thread_only_reads(cupy):
    """The dashboard's thread, say: it reads the recording as it stands, writes nothing."""
    rec = record_cupy_history(cupy)
    keep = cupy.alloc(1 << 20)
    cupy.free(cupy.alloc(2 << 20))
    cupy.get_default_memory_pool().free_all_blocks()
    n = rec.entry_count()
    snaps = []
    t = threading.Thread(target=lambda: snaps.append(rec.snapshot()))
    t.start()
    t.join()
    assert rec.entry_count() == n == len(entries(snaps[0]))  # no segment_free written there
    assert "segment_free" in [e["action"] for e in entries(rec.snapshot())]  # here it is
    assert keep


def test_an_out_of_memory_error_is_an_oom_entry(cupy):
    rec = record_cupy_history(cupy)
    keep = cupy.alloc(1 << 20)
    cupy.get_default_memory_pool().set_limit(size=2 << 20)
    with pytest.raises(FakeOutOfMemoryError):
        cupy.alloc(4 << 20)
    last = entries(rec.snapshot())[-1]
    assert last["action"] == "oom" and last["size"] == 4 << 20
    assert last["device_free"] == cupy.cuda.runtime.memGetInfo()[0]
    assert keep


def test_stop_keeps_the_trace_and_records_nothing_more(cupy):
    with record_cupy_history(cupy) as rec:
        cupy.alloc(1 << 20)
    assert not rec.active and HOOK_NAME not in get_memory_hooks()
    n = rec.entry_count()
    cupy.alloc(1 << 20)
    assert rec.entry_count() == n == 2
    assert cupy_history.current_recording() is rec
    assert rec.snapshot()["cudalab"]["recording"]["active"] is False
    assert "stopped at" in rec.snapshot()["cudalab"]["note"]
    rec.stop()  # idempotent


# ------------------------------------------------------------------ bad input, gone sources
def test_no_recording_says_to_start_one(cupy):
    from cudalab.memory import history_frame, what_if

    for call in (lambda: history_frame(source="cupy"), lambda: what_if(source="cupy"),
                 lambda: CupySource(cupy).snapshot()):
        with pytest.raises(SourceUnavailableError, match="history start --source cupy"):
            call()


def test_bad_settings_and_a_second_start(cupy):
    with pytest.raises(ValueError, match="context must be one of"):
        record_cupy_history(cupy, context="sometimes")
    with pytest.raises(ValueError, match="max_entries must be an int >= 1"):
        record_cupy_history(cupy, max_entries=0)
    assert cupy_history.current_recording() is None
    record_cupy_history(cupy)
    with pytest.raises(RuntimeError, match="runs already"):
        record_cupy_history(cupy)


def test_cupy_backed_by_cudalab_points_to_cudalabs_history(cupy):
    from cudalab import interop
    from cudalab.memory import history_frame

    cupy.cuda.set_allocator(interop.cupy_allocator)
    with pytest.raises(SourceUnavailableError, match="cudalab's own history records"):
        record_cupy_history(cupy)
    with pytest.raises(SourceUnavailableError, match="use --source cudalab"):
        history_frame(source="cupy")  # (not "start a recording": it would see nothing)


def test_another_pool_is_recorded_without_comparing_totals(cupy):
    cupy.cuda.set_allocator(lambda n: None)  # a user's own MemoryPool(...).malloc, say
    rec = record_cupy_history(cupy)
    cupy.alloc(1 << 20)
    snap = rec.snapshot()
    assert rec.backing == "other" and len(entries(snap)) == 2
    assert "pool totals are not compared" in snap["cudalab"]["note"]


def test_without_cupy_or_its_cuda(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(SourceUnavailableError, match="this process has no CuPy"):
        record_cupy_history()
    with pytest.raises(SourceUnavailableError, match="is_available"):
        record_cupy_history(FakeCupy(available=False))


def test_a_failing_read_is_said_never_raised_into_cupy(cupy):
    rec = record_cupy_history(cupy)
    cupy.alloc(1 << 20)

    def gone():
        raise RuntimeError("the pool went away")

    cupy.get_default_memory_pool().total_bytes = gone
    cupy.alloc(8 << 20)  # a new segment: the pool's total cannot be read
    note = rec.snapshot()["cudalab"]["note"]
    assert rec.errors >= 1 and "hook calls failed (last: RuntimeError: the pool went away)" \
        in note


def test_the_recording_never_takes_the_pools_lock(cupy, monkeypatch):
    """It reads only the pool's atomic byte counters (inside CuPy's malloc, n_free_blocks
    would take the pool's mutex)."""
    def locked():
        raise AssertionError("n_free_blocks called")

    monkeypatch.setattr(cupy.get_default_memory_pool(), "n_free_blocks", locked)
    rec = record_cupy_history(cupy)
    cupy.free(cupy.alloc(1 << 20))
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.alloc(2 << 20)
    rec.snapshot()
    rec.stop()
    assert rec.errors == 0
    assert [e[0] for e in rec.raw_entries(0)] == [
        "segment_alloc", "alloc", "free_requested", "free_completed", "segment_free",
        "segment_alloc", "alloc"]


def test_a_hook_the_user_left_is_stopped_quietly(cupy):
    rec = record_cupy_history(cupy)
    get_memory_hooks().pop(HOOK_NAME)  # the user's own exit of CuPy's hook
    rec.stop()
    assert not rec.active


# ------------------------------------------------------------------ the views
def test_history_frame_has_a_row_per_entry(cupy):
    from cudalab.memory import history_frame

    rec = record_cupy_history(cupy)
    workload(cupy)
    df = history_frame(source="cupy")
    trace = entries(rec.snapshot())
    assert len(df) == len(trace) > 0
    assert list(df["action"].astype(str)) == [e["action"] for e in trace]
    assert df.attrs["identity"]["allocator"] == "cupy"
    assert int(df["allocated"].iloc[-1]) == cupy.get_default_memory_pool().used_bytes()


def test_what_if_replays_the_cupy_trace(cupy):
    from cudalab._units import format_bytes
    from cudalab.memory import history_frame, what_if
    from cudalab.memory_tools.what_if import format_what_if

    record_cupy_history(cupy)
    keep = workload(cupy)
    for _ in range(3):
        keep.append(cupy.alloc(3 << 20))
        cupy.free(keep.pop(0))
    df = what_if(source="cupy", configs=["expandable_segments:True"])
    assert df.attrs["allocator"] == "cupy"
    assert list(df["config"]) == sorted(df["config"], key=lambda c: c != df["config"].iloc[0])
    assert df.attrs["peak_live"] == int(history_frame(source="cupy")["allocated"].max())
    default = df.set_index("config").loc["default"]
    assert default["peak_reserved"] >= default["peak_allocated"] >= df.attrs["peak_live"]
    held = int(history_frame(source="cupy")["reserved"].max())  # CuPy's own, from the trace
    assert df.attrs["results"][0].reference["recorded_peak_reserved"] == held
    assert f"CuPy's own pool: the segments it took reached {format_bytes(held, decimals=2)}" \
        in format_what_if(df)


def test_snapshot_views_read_the_recording(cupy):
    pytest.importorskip("ipywidgets")
    from cudalab.widgets import SnapshotViewer

    rec = record_cupy_history(cupy)
    keep = workload(cupy)
    viewer = SnapshotViewer(source="cupy")
    assert viewer.snapshot["identity"]["allocator"] == "cupy"
    assert "only what was allocated since the recording started" in viewer._summary.value
    assert viewer.history is not None and viewer.history.n == rec.entry_count()
    viewer.close()
    assert CupySource(cupy).snapshot()["segments"] == rec.snapshot()["segments"]
    assert keep


def test_auto_is_cupy_while_it_records_and_cudalab_holds_nothing(cupy, monkeypatch):
    from cudalab.allocator import registry
    from cudalab.memory import history_frame
    from cudalab.memory_tools.libraries import auto_snapshot_source

    class Holding:
        def __init__(self, reserved):
            self.reserved = reserved

        def memory_stats(self):
            return {"reserved_bytes.all.current": self.reserved}

    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr(registry, "active", [Holding(0)])
    assert auto_snapshot_source() == "cudalab"  # no recording yet
    rec = record_cupy_history(cupy)
    cupy.alloc(1 << 20)
    assert auto_snapshot_source() == "cupy"
    assert history_frame(source="auto").attrs["identity"]["allocator"] == "cupy"
    monkeypatch.setattr(registry, "active", [Holding(2 << 20)])  # cudalab's holds memory
    assert auto_snapshot_source() == "cudalab"
    monkeypatch.setattr(registry, "active", [Holding(0)])
    rec.stop()
    assert auto_snapshot_source() == "cudalab"  # a stopped recording is not auto's
