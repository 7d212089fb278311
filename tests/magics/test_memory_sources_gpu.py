"""``%cuda_memory watch`` over the real torch and CuPy, on a GPU: the lines' Δallocated and
Δreserved equal torch's ``memory_stats()`` deltas (CuPy's pool counters) exactly over 20
scripted cells, the cell's peak is exact or a true bound (checked against torch's own trace),
and torch's ``max_memory_allocated()`` is never reset."""

from __future__ import annotations

import pytest
from IPython.testing import globalipapp
from IPython.utils.capture import capture_output

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def shell():
    return globalipapp.get_ipython()


@pytest.fixture
def ip(shell):
    shell.run_line_magic("load_ext", "cudalab")
    yield shell
    shell.run_line_magic("unload_ext", "cudalab")


def run(sh, src):
    with capture_output() as cap:
        r = sh.run_cell(src, store_history=True)
    assert r.success, (src, r.error_in_exec, cap.stdout)
    return cap.stdout


def _last(sh, name):
    return sh.magics_manager.registry["CudaLabMagics"]._memory.library_watch.last[name]


#: 20 scripted cells: allocations, frees, both, nothing, a temporary peak, a cache release.
CELLS = [
    "a = torch.empty(3 << 20, dtype=torch.uint8, device='cuda')",
    "b = torch.empty(50 << 20, dtype=torch.uint8, device='cuda')",
    "del a",
    "t = torch.empty(200 << 20, dtype=torch.uint8, device='cuda'); del t",
    "c = torch.randn(1024, 1024, device='cuda') @ torch.randn(1024, 1024, device='cuda')",
    "t = torch.empty(1 << 20, device='cuda'); del t",  # below the peak so far: a bound
    "del b",
    "torch.cuda.empty_cache()",
    "d = [torch.empty(n << 10, device='cuda') for n in range(1, 40)]",
    "del d[::2]",
    "t = torch.empty(10 << 20, device='cuda'); del t; e = torch.empty(1 << 20, device='cuda')",
    "x = 1; del d",
    "f = torch.zeros(7, 1000, 1000, device='cuda').sum(0)",
    "del c, e",
    "g = torch.empty(120 << 20, dtype=torch.uint8, device='cuda')",
    "g2 = g.clone(); del g",
    "torch.cuda.synchronize()",
    "h = torch.ones(3000, 3000, device='cuda').cumsum(0); del f",
    "del g2, h",
    "torch.cuda.empty_cache()",
]


def _requested_peak(trace, start_requested, t0, t1):
    """The cell's peak of *requested* bytes from torch's own trace (entries in [t0, t1]; a
    trace's sizes are the requests, so this is a lower bound of the allocated peak)."""
    level = peak = start_requested
    for e in trace:
        if not t0 <= e["time_us"] <= t1:
            continue
        if e["action"] == "alloc":
            level += e["size"]
        elif e["action"] == "free_completed":
            level -= e["size"]
        peak = max(peak, level)
    return peak


def test_torch_watch_over_20_cells_is_memory_stats_exactly(ip):
    """Δallocated and Δreserved equal memory_stats()'s deltas on every cell. The cell's peak:
    before every other cell the test resets torch's peak itself, so max_memory_allocated()
    after the cell is the true cell peak, which the watch must give exactly; on the other
    cells it must be at least the peak of requested bytes torch's trace shows, and at least
    the start and the end."""
    import time

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this torch has no CUDA")
    torch.zeros(1, device="cuda")
    ip.user_ns["torch"] = torch
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, context=None)
    try:
        run(ip, "%cuda_memory watch on --source torch")
        exact = bound = 0
        for i, cell in enumerate(CELLS):
            if i % 2 == 0:
                torch.cuda.reset_peak_memory_stats()  # the test's own reset, before the cell
            before = torch.cuda.memory_stats()
            t0 = int(time.time() * 1e6)
            out = run(ip, cell)
            t1 = int(time.time() * 1e6)
            after = torch.cuda.memory_stats()
            figures = _last(ip, "torch")
            assert figures is not None, (cell, out)
            assert figures.allocated_delta == (after["allocated_bytes.all.current"]
                                               - before["allocated_bytes.all.current"]), cell
            assert figures.reserved_delta == (after["reserved_bytes.all.current"]
                                              - before["reserved_bytes.all.current"]), cell
            assert figures.line() in out
            start, end = (before["allocated_bytes.all.current"],
                          after["allocated_bytes.all.current"])
            assert figures.peak >= max(start, end), (cell, figures)
            if i % 2 == 0:  # torch's own peak since the reset is the cell's peak
                assert figures.exact and figures.peak == after["allocated_bytes.all.peak"], \
                    (cell, figures, after["allocated_bytes.all.peak"])
            else:
                trace = torch.cuda.memory._snapshot()["device_traces"][0]
                floor = _requested_peak(trace, before["requested_bytes.all.current"], t0, t1)
                assert figures.peak >= floor, (cell, figures, floor)
                exact += figures.exact
                bound += not figures.exact
        assert exact and bound, (exact, bound)  # both kinds met on the unreset cells
        run(ip, "%cuda_memory watch off")
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
        for name in ("a", "b", "c", "d", "e", "f", "g", "g2", "h", "t", "x"):
            ip.user_ns.pop(name, None)


def test_watch_never_resets_torchs_peak(ip):
    torch = pytest.importorskip("torch")
    ip.user_ns["torch"] = torch
    big = torch.empty(300 << 20, dtype=torch.uint8, device="cuda")
    del big
    peak = torch.cuda.max_memory_allocated()
    run(ip, "%cuda_memory watch on")  # auto
    for cell in CELLS[:5]:
        run(ip, cell)
    run(ip, "%cuda_memory watch off")
    # a reset would bring it down to the cells' own peak (below 300 MiB)
    assert torch.cuda.max_memory_allocated() >= peak >= 300 << 20
    for name in ("a", "b", "c", "t"):
        ip.user_ns.pop(name, None)


def test_cupy_watch_is_the_pools_counters(ip):
    cupy = pytest.importorskip("cupy")
    ip.user_ns["cupy"] = cupy
    pool = cupy.get_default_memory_pool()
    run(ip, "%cuda_memory watch on --source cupy")
    cells = ["ca = cupy.empty(4_000_000, dtype=cupy.uint8)",
             "cb = cupy.ones((1000, 1000)); del ca",
             "cc = cupy.arange(10**6).sum()",
             "del cb",
             "cupy.get_default_memory_pool().free_all_blocks()"]
    for cell in cells:
        used, total = pool.used_bytes(), pool.total_bytes()
        run(ip, cell)
        figures = _last(ip, "cupy")
        assert figures is not None, cell
        assert figures.allocated_delta == pool.used_bytes() - used, cell
        assert figures.reserved_delta == pool.total_bytes() - total, cell
    run(ip, "%cuda_memory watch off")


def test_timed_torch_matmul_agrees_with_torch_events(ip):
    import statistics

    torch = pytest.importorskip("torch")
    a = torch.randn(4096, 4096, device="cuda")
    b = torch.randn(4096, 4096, device="cuda")
    ip.user_ns.update(a_=a, b_=b, torch=torch)
    for _ in range(5):
        torch.mm(a, b)
    # torch's own events, back to back: the regime %%cuda_timed measures in
    events = [torch.cuda.Event(enable_timing=True) for _ in range(51)]
    events[0].record()
    for i in range(50):
        torch.mm(a, b)
        events[i + 1].record()
    torch.cuda.synchronize()
    theirs = statistics.median(events[i].elapsed_time(events[i + 1]) for i in range(50)) / 1e3
    with capture_output():
        r = ip.run_cell("%%cuda_timed -o -q -n 1 -r 50 -w 5\ntorch.mm(a_, b_)")
    assert r.success, r.error_in_exec
    ours = r.result.median
    assert abs(ours - theirs) / theirs < 0.02, (ours, theirs)
    with capture_output():
        r = ip.run_cell("%%cuda_timed -o -q --kernels\ntorch.mm(a_, b_)")
    res = r.result
    if not res.kernels:
        pytest.skip(f"no kernel records here: {res.kernels_note}")
    names = " ".join(str(k.get("name", "")) for k in res.kernels).lower()
    assert "gemm" in names or "cutlass" in names or "sm90" in names, names
    for name in ("a_", "b_"):
        ip.user_ns.pop(name, None)


def test_timed_times_torchs_side_stream(ip):
    torch = pytest.importorskip("torch")
    a = torch.randn(4096, 4096, device="cuda")
    s = torch.cuda.Stream()
    ip.user_ns.update(a_=a, s_=s, torch=torch)
    with capture_output():
        base = ip.run_cell("%%cuda_timed -o -q -n 1 -r 10 -w 2\ntorch.mm(a_, a_)").result
        torch.cuda.set_stream(s)  # torch's current stream is another stream now
        try:
            r = ip.run_cell("%%cuda_timed -o -q -n 1 -r 10 -w 2\ntorch.mm(a_, a_)")
        finally:
            torch.cuda.set_stream(torch.cuda.default_stream())
    # the work runs on s_, torch's current stream: timed there (not 0 on cudalab's)
    assert r.success, r.error_in_exec
    assert abs(r.result.median - base.median) / base.median < 0.1, (r.result.median,
                                                                     base.median)
    for name in ("a_", "s_"):
        ip.user_ns.pop(name, None)
