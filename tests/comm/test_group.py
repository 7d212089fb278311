"""cudalab.comm.group(): group_start/group_end around the block, also when it raises; nesting;
the thread's depth. The backend's NCCL is replaced by a recorder on the simulator."""

from __future__ import annotations

import sys
import threading

import pytest

import cudalab
from cudalab.errors import NcclError


class Recorder:
    """Records group_start / group_end; group_end may be made to fail."""

    simulated = True

    def __init__(self):
        self.calls = []
        self.fail_end = False
        self.fail_start = False

    def group_start(self):
        if self.fail_start:
            raise NcclError("ncclGroupStart: ncclInvalidUsage (5): too deep", 5, "ncclInvalidUsage")
        self.calls.append("start")

    def group_end(self):
        self.calls.append("end")
        if self.fail_end:
            raise NcclError("ncclGroupEnd: ncclRemoteError (6): peer gone", 6, "ncclRemoteError")


@pytest.fixture
def nccl(backend, monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(backend, "nccl", lambda: recorder)
    return recorder


def _depth():
    return sys.modules["cudalab.comm.group_calls"].group_depth()


def test_the_lazy_name_is_the_context_manager():
    group = cudalab.comm.group
    assert isinstance(group, type) and hasattr(group, "__enter__")


def test_start_and_end_around_the_block(nccl):
    with cudalab.comm.group() as g:
        assert nccl.calls == ["start"] and _depth() == 1
    assert isinstance(g, cudalab.comm.group)
    assert nccl.calls == ["start", "end"] and _depth() == 0


def test_nested_groups_end_in_order(nccl):
    with cudalab.comm.group():
        with cudalab.comm.group():
            assert _depth() == 2
        assert nccl.calls == ["start", "start", "end"] and _depth() == 1
    assert nccl.calls == ["start", "start", "end", "end"]


def test_an_exception_in_the_block_still_ends_the_group_and_propagates(nccl):
    with pytest.raises(ZeroDivisionError):
        with cudalab.comm.group():
            raise ZeroDivisionError("in the block")
    assert nccl.calls == ["start", "end"] and _depth() == 0


def test_keyboard_interrupt_in_the_block_still_ends_the_group(nccl):
    with pytest.raises(KeyboardInterrupt):
        with cudalab.comm.group():
            raise KeyboardInterrupt
    assert nccl.calls == ["start", "end"]


def test_a_failing_group_end_after_an_exception_keeps_the_first_error(nccl):
    nccl.fail_end = True
    with pytest.raises(ValueError, match="the block's error") as info:
        with cudalab.comm.group():
            raise ValueError("the block's error")
    assert any("ncclGroupEnd also failed" in note and "ncclRemoteError" in note
               for note in info.value.__notes__)
    assert _depth() == 0


def test_a_failing_group_end_raises_without_an_exception(nccl):
    nccl.fail_end = True
    with pytest.raises(NcclError, match="peer gone"):
        with cudalab.comm.group():
            pass
    assert nccl.calls == ["start", "end"] and _depth() == 0


def test_a_failing_group_start_runs_no_block_and_no_end(nccl):
    nccl.fail_start = True
    ran = []
    with pytest.raises(NcclError, match="too deep"):
        with cudalab.comm.group():
            ran.append(1)
    assert ran == [] and nccl.calls == [] and _depth() == 0


def test_one_group_object_cannot_be_entered_twice(nccl):
    g = cudalab.comm.group()
    with g:
        with pytest.raises(RuntimeError, match="already open"):
            g.__enter__()
    assert nccl.calls == ["start", "end"]


def test_the_depth_is_per_thread(nccl):
    seen = []
    with cudalab.comm.group():
        worker = threading.Thread(target=lambda: seen.append(_depth()))
        worker.start()
        worker.join()
    assert seen == [0]


def test_with_the_simulators_own_nccl(backend):
    if not backend.simulated:
        pytest.skip("the simulator's own NCCL (this backend is real)")
    try:
        sim = backend.nccl()
    except (ImportError, AttributeError, NcclError):
        pytest.skip("the simulator's NCCL is not in this checkout yet")
    assert sim.simulated
    with cudalab.comm.group():
        with cudalab.comm.group():
            pass
    assert _depth() == 0
