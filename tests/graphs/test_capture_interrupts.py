"""Ctrl-C never wedges capturing (issue 36, item 16): SIGINT simulated at every line of the
capture machinery (``with cudalab.graph(g):``'s entry and exit, ``capture_begin()``,
``capture_end()``), then: exactly one KeyboardInterrupt reached the caller, no stream is
left capturing, the allocator routes nothing to a private pool, ``synchronize()`` and
``empty_cache()`` work, and the next capture replays correctly."""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import pytest

import cudalab
from cudalab import _interrupts
from cudalab.graphs import capture as capture_module
from tests.graphs.conftest import add
from tests.helpers.interrupts import count_events, frames_of, interrupt_at

GRAPHS_DIR = os.path.dirname(os.path.abspath(capture_module.__file__))


def in_graphs(frame) -> bool:
    return os.path.dirname(frame.f_code.co_filename) == GRAPHS_DIR


def _capture_stream_capturing(stream) -> bool:
    with cudalab.stream(stream):
        return cudalab.is_current_stream_capturing()


def check_after(exc, streams) -> None:
    assert isinstance(exc, KeyboardInterrupt), "the interrupt was lost"
    frames = frames_of(exc.__traceback__)
    inside = [f.f_code.co_name for f in frames if in_graphs(f)]
    safe_point = any(f.f_code is _interrupts.deliver_owed.__code__ for f in frames)
    # (graph.__enter__'s safe point raises it before the capture begins)
    assert not inside or (safe_point and inside == ["__enter__"]), \
        f"KeyboardInterrupt raised inside the capture machinery ({inside})"
    for s in streams:
        assert not _capture_stream_capturing(s), "a stream was left capturing"
    routed = [p for p in cudalab.memory.private_pools() if p["routed"]]
    assert not routed, f"the allocator still routes to {routed}"
    cudalab.synchronize()
    cudalab.memory.empty_cache()
    a = cudalab.array.full((256,), 1.0, np.float32)
    g = cudalab.CUDAGraph()
    with cudalab.graph(g):
        add(a, a, 1)
    g.replay()
    assert a.numpy()[0] == 2.0


def _with_block():
    a = cudalab.array.full((256,), 1.0, np.float32)
    g = cudalab.CUDAGraph()

    def op():
        with cudalab.graph(g):
            add(a, a, 1)

    return op, lambda: None


def _manual():
    a = cudalab.array.full((256,), 1.0, np.float32)
    s = cudalab.Stream()
    g = cudalab.CUDAGraph()

    def op():
        with cudalab.stream(s):
            g.capture_begin()
            add(a, a, 1)
            g.capture_end()

    def finish():
        # An interrupt delivered in the user's code between capture_begin() and
        # capture_end() leaves the capture open, as torch's: the user ends it. It must be
        # whole: capturing, and capture_end() ends it.
        if "state=capturing" in repr(g):
            with cudalab.stream(s):
                g.capture_end()
        else:
            assert "state=empty" in repr(g) or "state=ready" in repr(g), repr(g)

    return op, finish


@pytest.mark.parametrize("setup", [_with_block, _manual], ids=["graph_block", "manual"])
def test_interrupt_at_every_line_of_a_capture(deferring, setup):
    add(cudalab.array.full((256,), 1.0, np.float32), cudalab.array.full((256,), 1.0, np.float32), 0)
    op, _ = setup()
    op()  # (warm: the capture stream exists, the kernel is loaded)
    op, _ = setup()
    n = count_events(op, in_graphs)
    assert n > 20
    streams = [cudalab.graph.default_capture_stream]
    trips = 0
    for k in range(1, n + 1):
        op, finish = setup()
        swallowed: list[BaseException] = []
        old_hook = sys.unraisablehook
        sys.unraisablehook = lambda u, out=swallowed: out.append(u.exc_value)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (an interrupted capture may be empty)
                returned, exc, tripped = interrupt_at(op, in_graphs, k)
        finally:
            sys.unraisablehook = old_hook
        if not tripped:  # (a run with fewer lines: a pool released at its start, ...)
            assert exc is None
            continue
        trips += 1
        if exc is None or not returned:
            finish()
        if exc is None and any(isinstance(e, KeyboardInterrupt) for e in swallowed):
            # Delivered (outside the capture machinery) into a weakref callback that the
            # collector ran in the caller's code, where Python prints and drops it, as it
            # would without cudalab: not this test's subject; the state must still be whole.
            exc = KeyboardInterrupt()
        check_after(exc, streams)
    assert trips >= n - 10

