"""Host copies keep stream order and leave nothing behind (issue 36, items 1 and 18).

* A converting copy from pinned memory (``c.copy_(b, non_blocking=True)`` with another dtype)
  reads ``b`` in stream order, after an earlier queued device-to-host copy into ``b`` has
  written it: it converts on the device, not on the host at once.
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
