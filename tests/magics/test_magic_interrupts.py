"""Ctrl-C in ``%%cuda_timed`` cells that allocate: SIGINT simulated at every line of the
magic's own code (the cell wrapper, the timer's hooks, the launch tracker, the context) and
of the cell's body. Each time the cell ends as interrupted, and the magic's bookkeeping and
the allocator are intact for the next cell."""

from __future__ import annotations

import gc
import inspect
import os
import signal
import sys

import pytest
from IPython.testing import globalipapp
from IPython.utils.capture import capture_output

import cudalab
import cudalab.memory as cm
from cudalab import _interrupts
from cudalab._internal import launch_observers
from cudalab.magics import timed
from tests.helpers.interrupts import interrupt_at

MAGICS_DIR = os.path.dirname(os.path.abspath(timed.__file__))
MAGIC_FILES = {os.path.join(MAGICS_DIR, f) for f in (
    "timed.py", "event_timer.py", "kernel_listing.py", "timed_compile.py", "timed_context.py")}

CELLS = {
    "single": "%%cuda_timed\nx_ = cudalab.empty(1000)\ny_ = cudalab.empty(3000)\ndel x_, y_",
    "repeat": "%%cuda_timed -n 2 -r 2 -w 1\nx_ = cudalab.empty(1000)\ndel x_",
}


@pytest.fixture
def ip():
    sh = globalipapp.get_ipython()
    cudalab.init()
    sh.run_line_magic("load_ext", "cudalab")
    sh.run_cell("import cudalab", store_history=False)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    assert _interrupts.install()
    yield sh
    signal.signal(signal.SIGINT, old)
    sh.run_line_magic("unload_ext", "cudalab")


def in_magic_or_cell(frame) -> bool:
    f = frame.f_code.co_filename
    return f in MAGIC_FILES or f.startswith("<ipython-input-")


def _check_consistent(ip) -> None:
    assert not launch_observers
    assert gc.isenabled()
    magics = ip.magics_manager.registry["CudaLabMagics"]
    pool = magics._event_pool
    if pool is not None:
        assert not any(pool._used.values()), pool._used  # every event given back
    a = cm.get_allocator(0)
    assert not a._lock.locked()
    a.check_invariants()
    # the next cells, timed and plain, run (no KeyError from leftover state)
    with capture_output():
        r = ip.run_cell("%%cuda_timed -n 1 -r 2 -w 0 -q -v res_next_\nz_ = cudalab.empty(500)")
        assert r.error_in_exec is None, r.error_in_exec
        assert ip.user_ns["res_next_"].count == 2
        r = ip.run_cell("w_ = cudalab.empty(700)\ndel w_")
        assert r.error_in_exec is None, r.error_in_exec


@pytest.mark.parametrize("mode", sorted(CELLS))
def test_interrupt_at_every_line_of_the_magic_and_the_cell(ip, mode):
    cell = CELLS[mode]
    results = []

    def op():
        with capture_output():
            results.append(ip.run_cell(cell, store_history=True))

    op()
    assert results[-1].error_in_exec is None
    lines = _event_lines(op)
    n = len(lines)
    assert n > 20
    # the magic's last safe point: an interrupt after it comes after the cell, as in Python
    assert _SAFE_POINT_LINE is not None
    last = max(i for i, (code, line) in enumerate(lines, 1)
               if code is timed.run_cuda_timed.__code__ and line == _SAFE_POINT_LINE)
    ks = sorted({*range(1, n + 1, max(1, n // 20)), *range(max(1, last - 3), n + 1)})
    for k in ks:
        results.clear()
        returned, exc, tripped = interrupt_at(op, in_magic_or_cell, k, timeout=0.02)
        assert tripped
        if k > last:
            assert isinstance(exc, KeyboardInterrupt) or isinstance(
                results[-1].error_in_exec, KeyboardInterrupt), f"event {k}: lost"
        else:  # it ended the cell (IPython reports it as the cell's error)
            assert returned and exc is None, f"event {k}: delivered outside the cell"
            # (an interrupt delivered before the cell's code ran, e.g. in the magic's
            # pre_run_cell callback, is IPython's error_before_exec: the cell did not run)
            r = results[-1]
            assert isinstance(r.error_in_exec, KeyboardInterrupt) or isinstance(
                r.error_before_exec, KeyboardInterrupt), \
                f"event {k}: the cell ran to completion despite Ctrl-C ({r!r})"
        _check_consistent(ip)


_SAFE_POINT_LINE = next((
    timed.run_cuda_timed.__code__.co_firstlineno + i
    for i, text in enumerate(inspect.getsource(timed.run_cuda_timed).splitlines())
    if text.strip() == "_internal.deliver_owed_interrupt()"), None)


def _event_lines(op) -> list:
    """(code, line) of each line event that count_events counts."""
    out = []

    def local(frame, event, arg):
        if event == "line":
            out.append((frame.f_code, frame.f_lineno))
        return local

    def glob(frame, event, arg):
        return local if in_magic_or_cell(frame) else None

    sys.settrace(glob)
    try:
        op()
    finally:
        sys.settrace(None)
    return out
