"""The CuPy recording over the real CuPy, on a GPU: the trace CuPy's memory hooks gave,
checked against CuPy's own pool counters (``used_bytes()``, ``total_bytes()``), and the
views that read it (skipped on the simulator and where CuPy is not installed; the fake's
tests are tests/memory_tools/test_cupy_history.py)."""

from __future__ import annotations

import gc

import pytest
from IPython.testing import globalipapp
from IPython.utils.capture import capture_output

pytestmark = pytest.mark.gpu

# 40 arrays of mixed sizes (bytes): small ones, 512-byte multiples and not, large ones
SIZES = [(i * 7919) % (3 << 20) + 1 for i in range(1, 31)] + [n << 20 for n in range(1, 11)]


@pytest.fixture
def cupy():
    import cudalab.memory_tools.cupy_history as ch

    cupy = pytest.importorskip("cupy")
    if not cupy.cuda.is_available():
        pytest.skip("CuPy has no CUDA here")
    pool = cupy.get_default_memory_pool()
    cupy.cuda.set_allocator(pool.malloc)  # (an earlier test may have set cudalab's)
    # an older array freed by the cycle collector in the middle of a test would change the
    # pool's counters under it: collect them now, and not during the test
    gc.collect()
    gc.disable()
    pool.free_all_blocks()
    try:
        yield cupy
    finally:
        gc.enable()
        rec = ch.current_recording()
        if rec is not None and rec.active:
            rec.stop()


def _figures(snap):
    (pool,) = [p for p in snap["cudalab"]["cupy_pool"] if p["device"] == 0]
    return pool


def test_recorded_blocks_are_the_pools_used_bytes(cupy):
    from cudalab.memory import history_frame, record_cupy_history

    pool = cupy.get_default_memory_pool()
    used0, total0 = pool.used_bytes(), pool.total_bytes()
    rec = record_cupy_history(cupy)
    arrays = []
    for i, n in enumerate(SIZES):
        arrays.append(cupy.empty(n, dtype=cupy.uint8))
        if i % 3 == 2:
            del arrays[len(arrays) // 2]
        snap = rec.snapshot()
        live = [b for s in snap["segments"] for b in s["blocks"]
                if b["state"] == "active_allocated"]
        assert sum(b["size"] for b in live) == pool.used_bytes() - used0, i
        assert _figures(snap)["used_bytes"] == pool.used_bytes()
        seen = sum(s["total_size"] for s in snap["segments"] if s["segment_seen"])
        assert seen == pool.total_bytes() - total0, i
    df = history_frame(source="cupy")
    assert len(df) == rec.entry_count() > len(SIZES)
    assert int(df["allocated"].iloc[-1]) == pool.used_bytes() - used0
    assert int(df["reserved"].iloc[-1]) == pool.total_bytes() - total0
    assert (df["action"] == "alloc").sum() == len(SIZES)
    assert (df["action"] == "free_completed").sum() == len(SIZES) - len(arrays)
    ptrs = {a.data.ptr for a in arrays}
    assert ptrs == {b["address"] for s in rec.snapshot()["segments"] for b in s["blocks"]
                    if b["state"] == "active_allocated"}
    # the allocating line of this test is on each block's stack (CuPy's Cython frames are not)
    assert all(any(f["name"] == "test_recorded_blocks_are_the_pools_used_bytes"
                   for f in b["frames"])
               for s in rec.snapshot()["segments"] for b in s["blocks"]
               if b["state"] == "active_allocated")
    rec.stop()


def test_free_all_blocks_without_a_hook_is_seen(cupy):
    from cudalab.memory import history_frame, record_cupy_history

    pool = cupy.get_default_memory_pool()
    used0, total0 = pool.used_bytes(), pool.total_bytes()
    rec = record_cupy_history(cupy)
    keep = cupy.empty(5 << 20, dtype=cupy.uint8)
    gone = [cupy.empty(n << 20, dtype=cupy.uint8) for n in (1, 2, 3)]
    del gone
    pool.free_all_blocks()  # CuPy calls no hook when segments go back to the driver
    snap = rec.snapshot()
    assert sum(s["total_size"] for s in snap["segments"]) == pool.total_bytes() - total0
    df = history_frame(snap)
    # every segment seen is released but keep's (a block the pool cut from an older segment
    # has none of its own)
    made = set(df.loc[df["action"] == "segment_alloc", "addr"])
    assert len(made) >= 3
    assert (df["action"] == "segment_free").sum() == len(made - {keep.data.ptr})
    assert int(df["reserved"].iloc[-1]) == pool.total_bytes() - total0
    assert int(df["allocated"].iloc[-1]) == pool.used_bytes() - used0 == keep.nbytes
    rec.stop()


def test_what_if_replays_cupys_trace(cupy):
    from cudalab.memory import history_frame, record_cupy_history, what_if

    rec = record_cupy_history(cupy)
    keep = []
    for i, n in enumerate(SIZES * 3):  # a growing working set, freed out of order
        keep.append(cupy.empty(n, dtype=cupy.uint8))
        if i % 4 == 3:
            del keep[i % len(keep)]
    del keep
    rec.stop()
    df = what_if(source="cupy", configs=["expandable_segments:True"])
    assert df.attrs["allocator"] == "cupy"
    assert df.attrs["peak_live"] == int(history_frame(source="cupy")["allocated"].max()) > 0
    assert (df["peak_reserved"] >= df["peak_allocated"]).all()


def test_the_magic_over_cupy(cupy, tmp_path):
    from cudalab.memory import load_snapshot

    shell = globalipapp.get_ipython()
    shell.user_ns["cupy"] = cupy
    shell.user_ns["path_"] = str(tmp_path / "cupy.pickle")
    shell.run_line_magic("load_ext", "cudalab")
    try:
        pool = cupy.get_default_memory_pool()
        used0 = pool.used_bytes()
        for src in ("%cuda_memory history start --source cupy",
                    "a_ = cupy.empty(1 << 20); b_ = cupy.zeros((256, 1024)); del a_",
                    "%cuda_memory history save {path_} --source cupy",
                    "snap_ = %cuda_memory snapshot dict --source cupy",
                    "%cuda_memory history stop --source cupy"):
            with capture_output() as cap:
                r = shell.run_cell(src, store_history=True)
            assert r.success, (src, r.error_in_exec, cap.stdout)
        snap = shell.user_ns["snap_"]
        assert _figures(snap)["recorded_used_bytes"] == pool.used_bytes() - used0
        saved = load_snapshot(str(tmp_path / "cupy.pickle"))
        assert saved["identity"]["allocator"] == "cupy" and saved["device_traces"][0]
    finally:
        shell.run_line_magic("unload_ext", "cudalab")
        for name in ("cupy", "b_", "snap_", "path_"):
            shell.user_ns.pop(name, None)
