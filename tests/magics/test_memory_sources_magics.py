"""``%cuda_memory ... --source``: the watch's torch and CuPy lines and the sources' errors, on
small fakes of torch and CuPy in sys.modules (tests/helpers/fake_allocators.py)."""

from __future__ import annotations

import sys

import pytest
from IPython.core.error import UsageError

import cudalab
from cudalab.magics.memory_watch_sources import cell_peak
from tests.helpers.fake_allocators import FakeTorch
from tests.helpers.shell import run_cell_printing as run


@pytest.fixture
def ip(shell):
    cudalab.init()
    shell.run_line_magic("load_ext", "cudalab")
    yield shell
    shell.run_line_magic("unload_ext", "cudalab")


def _last(sh, name):
    """The last cell's exact figures of ``name``'s watch line."""
    return sh.magics_manager.registry["CudaLabMagics"]._memory.library_watch.last[name]


def _lines(out: str, label: str) -> list[str]:
    return [x for x in out.splitlines() if x.startswith(f"[cudalab watch {label}")]


# ------------------------------------------------------------------ the cell's peak
@pytest.mark.parametrize("counters, expected", [
    # (start, end, start_peak, end_peak, allocated, freed) -> (peak, exact)
    ((10, 30, 50, 50, 20, 0), (30, True)),     # only allocations: the end
    ((10, 5, 50, 70, 80, 85), (70, True)),     # the global peak rose in the cell
    ((10, 10, 50, 50, 30, 30), (40, False)),   # start + allocated, below the global peak
    ((10, 10, 25, 25, 30, 30), (25, False)),   # the global peak is the tighter bound
    ((20, 20, 20, 20, 0, 0), (20, True)),      # nothing happened
    ((10, 10, 50, 50, 5, -3), (50, False)),    # the cumulative counters were reset
])
def test_cell_peak(counters, expected):
    assert cell_peak(*counters) == expected


# ------------------------------------------------------------------ torch's line
def test_torch_watch_deltas_are_memory_stats_deltas(ip, torch):
    big = torch.cuda.alloc(64 << 20)
    torch.cuda.free(big)  # a global peak above what the cells reach
    peak_before = torch.cuda.max_memory_allocated()
    r, out = run(ip, "%cuda_memory watch on --source torch")
    assert r.success and "torch's allocator" in out
    cells = ["a_ = torch.cuda.alloc(3 << 20)",
             "b_ = torch.cuda.alloc(5 << 20); torch.cuda.free(b_)",
             "torch.cuda.free(a_)",
             "x_ = 1"]
    for cell in cells:
        before = torch.cuda.memory_stats(0)
        r, out = run(ip, cell)
        after = torch.cuda.memory_stats(0)
        (line,) = _lines(out, "torch cuda:0")
        cell_figures = _last(ip, "torch")
        assert cell_figures.line() == line
        for name, key in (("allocated_delta", "allocated_bytes.all.current"),
                          ("reserved_delta", "reserved_bytes.all.current")):
            assert getattr(cell_figures, name) == after[key] - before[key], (cell, line)
        assert "GPU " in line and "wall" in line and not _lines(out, "cuda:0")
    run(ip, "%cuda_memory watch off")
    assert torch.cuda.max_memory_allocated() == peak_before
    assert "reset_peak_memory_stats" not in torch.cuda.calls


def test_torch_watch_peak_exact_or_bound(ip, torch):
    run(ip, "%cuda_memory watch on --source torch")
    r, out = run(ip, "p_ = torch.cuda.alloc(4 << 20)")  # only allocations: exact
    (line,) = _lines(out, "torch")
    assert "peak 4.0 MiB (+4.0 MiB in cell)" in line
    r, out = run(ip, "q_ = torch.cuda.alloc(8 << 20); torch.cuda.free(q_)")  # a new global peak
    (line,) = _lines(out, "torch")
    assert "peak 12.0 MiB (+8.0 MiB in cell)" in line
    r, out = run(ip, "q_ = torch.cuda.alloc(2 << 20); torch.cuda.free(q_)")  # below it: a bound
    (line,) = _lines(out, "torch")
    assert "peak ≤ 6.0 MiB (≤ +2.0 MiB in cell)" in line
    run(ip, "torch.cuda.free(p_)")
    run(ip, "%cuda_memory watch off")


def test_torch_watch_threshold(ip, torch):
    torch.cuda.free(torch.cuda.alloc(1 << 20))  # a cached segment: the cell's 1 MiB fits in it
    run(ip, "%cuda_memory watch on --source torch --threshold 2MiB")
    r, out = run(ip, "s_ = torch.cuda.alloc(1 << 20)")
    assert not _lines(out, "torch")
    r, out = run(ip, "t_ = torch.cuda.alloc(3 << 20)")
    assert len(_lines(out, "torch")) == 1
    run(ip, "%cuda_memory watch off")


def test_auto_watch_shows_torch_and_quiets_an_idle_cudalab(ip, torch):
    r, out = run(ip, "%cuda_memory watch on")
    assert "and torch's and CuPy's while imported" in out
    r, out = run(ip, "u_ = torch.cuda.alloc(1 << 20)")
    assert len(_lines(out, "torch")) == 1 and not _lines(out, "cuda:0")
    r, out = run(ip, "import cudalab; v_ = cudalab.empty((3 << 20,), dtype='uint8')")
    assert len(_lines(out, "cuda:0")) == 1 and "Δallocated +3.0 MiB" in _lines(out, "cuda:0")[0]
    assert not _lines(out, "torch")  # torch's allocator did not change: no torch line
    r, out = run(ip, "nothing_ = 1")  # nothing changed: cudalab's line, as without torch
    assert len(_lines(out, "cuda:0")) == 1 and not _lines(out, "torch")
    run(ip, "del v_")
    run(ip, "%cuda_memory watch off")


def test_watch_events_are_made_once_and_an_idle_auto_cell_reads_no_gpu_time(ip, torch,
                                                                            monkeypatch):
    """torch's two timing events are made once and recorded every cell; in auto a cell that
    left torch's allocator unchanged (no line) records no end and reads no GPU time, while a
    fixed --source torch reads it every cell (its line is printed every cell)."""
    made = []

    class CountingEvent(torch.cuda.Event):
        def __init__(self, enable_timing: bool = False):
            super().__init__(enable_timing)
            made.append(self)

    monkeypatch.setattr(torch.cuda, "Event", CountingEvent)
    run(ip, "%cuda_memory watch on")  # auto
    for cell, changes in (("a_ = torch.cuda.alloc(1 << 20)", True), ("n_ = 1", False),
                          ("torch.cuda.free(a_)", True), ("n_ = 2", False)):
        r, out = run(ip, cell)
        figures = _last(ip, "torch")
        assert figures.changed == changes, cell
        assert len(_lines(out, "torch")) == int(changes), out
        if changes:
            assert figures.gpu.startswith("GPU ") and figures.gpu != "GPU n/a", figures
        else:
            assert figures.gpu == "GPU n/a", figures
    assert len(made) == 2  # one (start, end) pair for device 0, for every cell
    run(ip, "%cuda_memory watch off")
    run(ip, "%cuda_memory watch on --source torch")
    r, out = run(ip, "n_ = 3")
    (line,) = _lines(out, "torch")
    assert "GPU n/a" not in line and "GPU " in line
    run(ip, "%cuda_memory watch off")


def test_auto_watch_leaves_out_a_cupy_pool_that_only_caches(ip, cupy):
    """A CuPy pool that holds cached bytes and no live ones changes nothing in a cell: its
    peak is only a bound (the pool's bytes), so auto prints no CuPy line and cudalab's line
    stays (seen on an H200, where an earlier test had left CuPy's pool holding a block)."""
    cupy.free(cupy.alloc(4_000_000))  # the pool caches the block: used 0, total > 0
    run(ip, "%cuda_memory watch on")
    r, out = run(ip, "nothing_ = 1")
    assert not _lines(out, "cupy"), out
    assert len(_lines(out, "cuda:0")) == 1, out
    run(ip, "%cuda_memory watch off")


def test_auto_watch_picks_up_torch_imported_later(ip, monkeypatch, shell):
    monkeypatch.setitem(sys.modules, "torch", None)  # not imported (restored afterwards)
    run(ip, "%cuda_memory watch on")
    r, out = run(ip, "y_ = 1")
    assert not _lines(out, "torch")
    fake = FakeTorch(initialized=False)
    monkeypatch.setitem(sys.modules, "torch", fake)
    shell.user_ns["torch"] = fake
    r, out = run(ip, "torch.cuda.initialized = True; w_ = torch.cuda.alloc(2 << 20)")
    (line,) = _lines(out, "torch")
    assert "Δallocated +2.0 MiB" in line and "GPU n/a" in line  # no start event before init
    run(ip, "%cuda_memory watch off")
    shell.user_ns.pop("torch", None)


def test_torch_going_away_is_said_not_raised(ip, torch):
    run(ip, "%cuda_memory watch on --source torch")

    def gone(device=None):
        raise RuntimeError("torch's allocator is gone")

    torch.cuda.memory_stats_as_nested_dict = gone
    r, out = run(ip, "z_ = 1")
    assert r.success and "[cudalab watch torch] not readable: RuntimeError" in out
    run(ip, "%cuda_memory watch off")


# ------------------------------------------------------------------ CuPy's line
def test_cupy_watch_deltas_are_the_pools(ip, cupy):
    run(ip, "%cuda_memory watch on --source cupy")
    pool = cupy.get_default_memory_pool()
    for cell in ("c1_ = cupy.alloc(4_000_000)", "cupy.free(c1_); c2_ = cupy.alloc(1000)",
                 "pool_ = cupy.get_default_memory_pool(); pool_.free_all_blocks()"):
        used, total = pool.used_bytes(), pool.total_bytes()
        r, out = run(ip, cell)
        (line,) = _lines(out, "cupy cuda:0")
        cell_figures = _last(ip, "cupy")
        assert cell_figures.line() == line
        assert cell_figures.allocated_delta == pool.used_bytes() - used
        assert cell_figures.reserved_delta == pool.total_bytes() - total
    run(ip, "%cuda_memory watch off")


# ------------------------------------------------------------------ errors
def test_source_errors_say_which(ip, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    r, out = run(ip, "%cuda_memory watch on --source torch")
    assert isinstance(r.error_in_exec, UsageError)
    assert "--source torch: this process has no torch" in str(r.error_in_exec)
    monkeypatch.setitem(sys.modules, "torch", FakeTorch(initialized=False))
    r, out = run(ip, "%cuda_memory watch on --source torch")
    assert "torch.cuda.is_initialized() is False" in str(r.error_in_exec)
    r, out = run(ip, "%cuda_memory watch on --source tensorflow")
    assert "unknown --source 'tensorflow'; use one of cudalab, torch, cupy, process, auto" in \
        str(r.error_in_exec)
    r, out = run(ip, "%cuda_memory watch on --source process")
    assert "--source process is not available here" in str(r.error_in_exec)
    r, out = run(ip, "%cuda_memory watch off")
    assert "already off" in out


# ------------------------------------------------------------------ the other views
def test_snapshot_views_of_torch(ip, torch, tmp_path):
    from cudalab.memory import load_snapshot

    torch.cuda.alloc(3 << 20)
    r, out = run(ip, "%cuda_memory snapshot dict --source torch")
    assert r.result["identity"]["allocator"] == "torch"
    assert repr(r.result).startswith("<torch memory snapshot: 1 segments")
    path = tmp_path / "t.pickle"
    ip.user_ns["tpath_"] = str(path)
    r, out = run(ip, "%cuda_memory snapshot {tpath_} --source torch")
    assert r.success and "torch memory snapshot" in out
    assert load_snapshot(str(path))["segments"] == torch.cuda.memory._snapshot()["segments"]
    r, out = run(ip, "%cuda_memory snapshot view --source torch")
    assert r.result.snapshot["identity"]["allocator"] == "torch"
    r.result.close()
    r, out = run(ip, "%cuda_memory snapshot view {tpath_} --source torch")
    assert "a file is one allocator's snapshot already" in str(r.error_in_exec)
    r, out = run(ip, "%cuda_memory snapshot dict --source cupy")  # (no CuPy recording)
    assert isinstance(r.error_in_exec, UsageError)
    assert "--source cupy: CuPy's pool keeps no per-block state nor trace of its own: start " \
        "a recording first ('%cuda_memory history start --source cupy'" in str(r.error_in_exec)


def test_dashboard_sources_from_the_magic(ip, torch, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # (no CuPy in this process)
    r, out = run(ip, "%cuda_memory dashboard --source torch -d 0")
    assert r.success and [s.name for s in r.result.sources] == ["torch"]
    r.result.close()
    r, out = run(ip, "%cuda_memory dashboard -d 0")  # auto
    assert [s.name for s in r.result.sources] == ["cudalab", "torch", "process"]
    r.result.close()
    torch.cuda.initialized = False
    r, out = run(ip, "%cuda_memory dashboard --source torch")
    assert "torch.cuda.is_initialized() is False" in str(r.error_in_exec)


def test_history_of_torch(ip, torch, tmp_path):
    import pandas as pd

    from cudalab.memory import load_snapshot

    r, out = run(ip, "%cuda_memory history start --source torch --context alloc --stacks python "
                     "--max-entries 1000")
    assert r.success and "torch is recording" in out
    assert {k: torch.cuda.history[k] for k in ("enabled", "context", "stacks", "max_entries")} \
        == {"enabled": "all", "context": "alloc", "stacks": "python", "max_entries": 1000}
    run(ip, "h1_ = torch.cuda.alloc(3 << 20); h2_ = torch.cuda.alloc(1 << 20); "
            "torch.cuda.free(h1_)")
    entries = list(torch.cuda.traces[0])
    r, out = run(ip, "%cuda_memory history frame --source torch")
    assert len(r.result) == len(entries) == 5
    r, out = run(ip, "%cuda_memory history frame --source torch -d cuda:0")
    assert len(r.result) == 5
    r, out = run(ip, "%cuda_memory history status --source torch")
    assert "torch recording; 5 trace entries held" in out
    ip.user_ns["hdir_"] = str(tmp_path)
    for name in ("h.pickle", "h.csv", "h.json"):
        r, out = run(ip, f"%cuda_memory history save {{hdir_}}/{name} --source torch")
        assert r.success and "wrote 5 torch trace entries" in out, out
    assert load_snapshot(str(tmp_path / "h.pickle"))["device_traces"][0] == entries
    assert len(pd.read_csv(tmp_path / "h.csv")) == 5
    r, out = run(ip, "%cuda_memory history stop --source torch")
    assert "5 trace entries kept" in out and torch.cuda.history is None
    r, out = run(ip, "%cuda_memory history frame --source torch")  # torch cleared its own
    assert len(r.result) == 5


def test_torch_history_stopped_by_the_user_is_reported(ip, torch, tmp_path):
    run(ip, "%cuda_memory history start --source torch")
    run(ip, "torch.cuda.alloc(1 << 20)")
    run(ip, "torch.cuda.memory._record_memory_history(enabled=None)")  # the user's own stop
    r, out = run(ip, "%cuda_memory history status --source torch")
    assert "torch not recording (stopped outside cudalab" in out
    ip.user_ns["hpath_"] = str(tmp_path / "x.pickle")
    r, out = run(ip, "%cuda_memory history save {hpath_} --source torch")
    assert r.success and "wrote 0 torch trace entries" in out and "clears torch's trace" in out


def test_history_source_errors(ip, monkeypatch):
    r, out = run(ip, "%cuda_memory history start --source process")
    assert isinstance(r.error_in_exec, UsageError)
    assert "NVML keeps no per-allocation records" in str(r.error_in_exec)
    assert "use the allocator's source for those (cudalab, torch, or cupy" in \
        str(r.error_in_exec)
    monkeypatch.setitem(sys.modules, "cupy", None)
    r, out = run(ip, "%cuda_memory history start --source cupy")
    assert "this process has no CuPy" in str(r.error_in_exec)
    monkeypatch.setitem(sys.modules, "torch", None)
    r, out = run(ip, "%cuda_memory history start --source torch")
    assert "this process has no torch" in str(r.error_in_exec)


# ------------------------------------------------------------------ %%cuda_timed
def test_library_streams_are_torchs_or_cupys_other_stream(ip, torch, cupy):
    from cudalab.magics.timed_context import library_streams

    cur = {0: cudalab.current_stream(0)}
    assert library_streams([0], cur) == {}  # both on cudalab's current stream
    s, t = cudalab.Stream(), cudalab.Stream()
    cupy.cuda.get_current_stream = lambda: type("S", (), {"ptr": t.cuda_stream})()
    ((library, stream),) = library_streams([0], cur).values()
    assert library == "cupy" and stream.cuda_stream == t.cuda_stream
    torch.cuda.stream.cuda_stream = s.cuda_stream  # torch's comes first
    ((library, stream),) = library_streams([0], cur).values()
    assert library == "torch" and stream.cuda_stream == s.cuda_stream
    torch.cuda.initialized = False  # torch's CUDA not initialised: not read
    assert library_streams([0], cur)[0][0] == "cupy"


def test_timed_times_torchs_current_stream(ip, torch):
    """torch's current stream is another stream: the run's events go there (an event on
    cudalab's idle stream would fire ahead of the queued work)."""
    from cudalab.magics.result import CudaTimedResult

    s = cudalab.Stream()
    torch.cuda.stream.cuda_stream = s.cuda_stream
    ip.user_ns["side_"] = s
    run(ip, "from cudalab._kernels.spin import gpu_sleep")
    for line in ("%%cuda_timed -o -q", "%%cuda_timed -o -q -n 1 -r 3 -w 0"):
        r, out = run(ip, line + "\nwith cudalab.stream(side_):\n    gpu_sleep(20_000_000)")
        assert r.success and isinstance(r.result, CudaTimedResult), out
        assert r.result.gpu_times.min() >= 0.019
        assert any(f"torch's on cuda:0 ({s.cuda_stream:#x})" in h for h in r.result.hints)
    torch.cuda.stream.cuda_stream = 0  # torch back on cudalab's stream: nothing said
    r, out = run(ip, "%%cuda_timed -o -q\ngpu_sleep(1000)")
    assert not any("torch's" in h for h in r.result.hints)


def test_source_on_a_view_that_reads_only_cudalab(ip, torch):
    r, out = run(ip, "%cuda_memory summary --source torch")
    assert "%cuda_memory summary: --source is for watch, history, snapshot and dashboard" in \
        str(r.error_in_exec)


def test_unload_stops_the_torch_recording_the_magic_started(shell, torch):
    cudalab.init()
    shell.run_line_magic("load_ext", "cudalab")
    run(shell, "%cuda_memory history start --source torch")
    assert torch.cuda.history is not None
    shell.run_line_magic("unload_ext", "cudalab")
    assert torch.cuda.history is None  # stopped (its trace read first)
