"""Host copies keep stream order and leave nothing behind (issue 36, items 1 and 18).

* A converting copy from pinned memory (``c.copy_(b, non_blocking=True)`` with another dtype)
  reads ``b`` in stream order, after an earlier queued device-to-host copy into ``b`` has
  written it: it converts on the device, not on the host at once.
  A copy that must convert on the host (a strided source, a float8 target) waits for the
  stream before it reads a pinned source.
* A ``numpy()`` (or ``cpu()``, or a host-to-device ``copy_``) whose wait fails leaves no
  queued copy that later touches a freed host buffer.

The simulator queues copies in stream order; a paused stream (its test hook) holds them back.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import cudalab


@pytest.fixture
def paused(backend):
    """A new stream whose work is held back (simulator only), resumed at teardown."""
    if not backend.simulated:
        pytest.skip("needs the simulator's pause_stream/resume_stream test hooks")
    s = cudalab.Stream()
    backend.pause_stream(s.handle)
    state = {"paused": True}
    yield s, backend, state
    if state["paused"]:
        backend.resume_stream(s.handle)


def test_converting_copy_from_pinned_memory_keeps_stream_order(paused):
    s, backend, state = paused
    with cudalab.stream(s):
        a = cudalab.ones(4)  # float32, queued on the paused stream
        b = cudalab.empty_pinned((4,), np.float32)
        b[...] = 0
        a.numpy(out=b, non_blocking=True)  # device -> pinned host, queued
        c = cudalab.zeros(4, dtype=np.int64)
        c.copy_(b, non_blocking=True)  # pinned float32 -> device int64, after the first copy
        d = cudalab.zeros((2, 4), dtype=np.float64)
        d.copy_(b, non_blocking=True)  # a broadcasting, converting copy, likewise
    backend.resume_stream(s.handle)
    state["paused"] = False
    s.synchronize()
    assert c.numpy().tolist() == [1, 1, 1, 1]
    assert d.numpy().tolist() == [[1.0] * 4] * 2


@pytest.mark.parametrize("target", ["strided_source", "float8", "setitem"])
def test_host_converted_copy_from_pinned_memory_waits_for_the_stream(paused, target):
    """A converting copy that cannot run on the device (a non-contiguous source; float8,
    which has no conversion kernel) converts on the host: from a pinned source it first
    waits for the stream, here one that cannot run (the simulator raises instead of
    hanging), and the destination is left as it was."""
    s, backend, state = paused
    with cudalab.stream(s):
        a = cudalab.ones(8)
        b = cudalab.empty_pinned((8,), np.float32)
        b[...] = 0
        a.numpy(out=b, non_blocking=True)  # queued on the paused stream
        dtype = np.int64 if target == "strided_source" else "float8_e4m3fn"
        c = cudalab.full((4 if target == "strided_source" else 8,), 5, dtype=dtype)
        source = b[::2] if target == "strided_source" else b
        if target == "setitem":  # a[...] = pinned (converted by numpy, on the host)
            def assign():
                c[...] = source
            c = cudalab.full((8,), 5, dtype=np.int64)
        else:
            def assign():
                c.copy_(source, non_blocking=True)
        with pytest.raises(RuntimeError):
            assign()  # must wait for the stream: it cannot run
        backend.resume_stream(s.handle)
        state["paused"] = False
        # untouched: no stale conversion (zeros) was queued behind the first copy
        assert c.numpy().astype(np.float64).tolist() == [5.0] * c.size
        assign()
    assert c.numpy().astype(np.float64).tolist() == [1.0] * c.size


def test_host_converted_copy_from_pinned_memory_reads_the_queued_copy():
    """The same on a real GPU: a large device-to-pinned copy is still running when the
    strided, converting copy reads its destination."""
    n = 1 << 24
    a = cudalab.ones(n)
    b = cudalab.empty_pinned((n,), np.float32)
    b[...] = 0
    a.numpy(out=b, non_blocking=True)
    c = cudalab.zeros(n // 2, dtype=np.int64)
    c.copy_(b[::2], non_blocking=True)
    assert int(c.sum().item()) == n // 2


@pytest.mark.parametrize("how", ["numpy", "cpu"])
def test_failed_copy_to_host_leaves_no_work_on_freed_memory(paused, how):
    s, backend, state = paused
    n = 1 << 14
    with cudalab.stream(s):
        a = cudalab.full((n,), 7, dtype=np.int64)
    with pytest.raises(RuntimeError):
        getattr(a, how)()  # waits on a stream that cannot run: raises
    gc.collect()
    others = [np.full(n, -1, dtype=np.int64) for _ in range(16)]  # may reuse freed memory
    backend.resume_stream(s.handle)
    state["paused"] = False
    s.synchronize()
    assert all((o == -1).all() for o in others)
    assert a.numpy().tolist() == [7] * n  # the array itself is intact
