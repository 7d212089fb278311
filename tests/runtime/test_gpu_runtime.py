"""Runtime checks that need real hardware (issue 2): run on the GPU machine."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

import cudalab

pytestmark = pytest.mark.gpu


def test_event_timing_agrees_with_torch():
    """The same work timed by cudalab events and torch events on one stream: within 2 %."""
    torch = pytest.importorskip("torch")
    n = 256 * 1024 * 1024  # 1 GiB of float32 -> a copy of a few hundred µs
    x = torch.empty(n, dtype=torch.float32, device="cuda:0").uniform_()
    y = torch.empty_like(x)
    ts = torch.cuda.current_stream(0)
    stream = cudalab.ExternalStream(ts.cuda_stream, device=0)
    ours, theirs = [], []
    for _ in range(20):
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        c0 = cudalab.Event(enable_timing=True)
        c1 = cudalab.Event(enable_timing=True)
        t0.record(ts)
        c0.record(stream)
        for _ in range(4):
            y.copy_(x)
        c1.record(stream)
        t1.record(ts)
        t1.synchronize()
        c1.synchronize()
        ours.append(c0.elapsed_time(c1))
        theirs.append(t0.elapsed_time(t1))
    a, b = statistics.median(ours), statistics.median(theirs)
    assert a > 0.1
    assert abs(a - b) / b < 0.02, (a, b)


def test_spin_kernel_known_length():
    from cudalab._kernels.spin import gpu_sleep

    s = cudalab.Stream()
    start, end = cudalab.Event(enable_timing=True), cudalab.Event(enable_timing=True)
    gpu_sleep(1_000_000, stream=s)  # warm up: compile + load
    start.record(s)
    gpu_sleep(5_000_000, stream=s)  # 5 ms
    end.record(s)
    end.synchronize()
    ms = start.elapsed_time(end)
    assert 4.9 <= ms <= 6.0, ms


def test_priorities_real_range():
    least, greatest = cudalab.Stream.priority_range()
    assert least == 0 and greatest < 0
    hi = cudalab.Stream(priority=greatest)
    lo = cudalab.Stream(priority=least)
    assert hi.priority == greatest and lo.priority == least
    torch = pytest.importorskip("torch")
    # torch caps its range to its stream pools' levels (e.g. (0, -3)); the driver's is wider.
    t_least, t_greatest = torch.cuda.Stream.priority_range()
    assert t_least == least and greatest <= t_greatest


def test_no_sync_in_record_and_query():
    """Recording and querying behind a long kernel returns at once (no hidden host sync)."""
    import time

    from cudalab._kernels.spin import gpu_sleep

    s = cudalab.Stream()
    gpu_sleep(1_000_000, stream=s)
    s.synchronize()
    gpu_sleep(200_000_000, stream=s)  # 200 ms
    t0 = time.perf_counter()
    e = cudalab.Event()
    e.record(s)
    busy = (e.query(), s.query())
    elapsed = time.perf_counter() - t0
    s.synchronize()
    assert busy == (False, False)
    assert elapsed < 0.05


@pytest.mark.multigpu
def test_peer_copy_between_devices():
    if cudalab.device_count() < 2:
        pytest.skip("needs two GPUs")
    b = cudalab.devices.backend()
    n = 64 << 20
    src = np.random.default_rng(0).integers(0, 255, size=n, dtype=np.uint8)
    out = np.zeros_like(src)
    p0 = b.mem_alloc(0, n)
    p1 = b.mem_alloc(1, n)
    try:
        b.memcpy(0, p0, src.ctypes.data, n)
        s1 = cudalab.Stream(1)
        b.memcpy_peer_async(p1, 1, p0, 0, n, s1.handle)
        s1.synchronize()
        b.memcpy(1, out.ctypes.data, p1, n)
        assert np.array_equal(src, out)
        if cudalab.can_device_access_peer(0, 1):
            b.enable_peer_access(0, 1)
            b.enable_peer_access(0, 1)  # already enabled: fine
    finally:
        b.mem_free(0, p0)
        b.mem_free(1, p1)


def test_device_count_creates_no_context():
    """device_count() answers from NVML and CUDA_VISIBLE_DEVICES, like torch (fork-safe)."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import cudalab
        n = cudalab.device_count()
        assert not cudalab.is_initialized()
        from cuda.bindings import driver as d
        d.cuInit(0)
        err, ctx = d.cuCtxGetCurrent()
        print(n, 0 if ctx is None else int(ctx))
    """)
    env = {k: v for k, v in os.environ.items() if k != "CUDALAB_SIMULATOR"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    n, ctx = map(int, r.stdout.split())
    assert n == cudalab.device_count() and ctx == 0
