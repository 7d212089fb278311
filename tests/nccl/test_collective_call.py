"""cudalab.collective_call: the CollectiveCall record, the one issue function every NCCL path
uses (cudalab.nccl, cudalab.comm's single-process collectives, Communicator), and the one
stream check."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cudalab
from cudalab import collective_call, nccl
from cudalab._driver.base import NCCL_CALL_BROADCAST, NCCL_CALL_REDUCE, NCCL_NUMPY_NAMES
from cudalab.collective_call import CollectiveCall, check_stream
from cudalab.comm import communicator as communicator_module
from cudalab.errors import StreamDeviceError
from tests.comm.test_communicator_fake import FakeNccl
from tests.helpers.interrupts import count_events, frames_of, interrupt_at


@pytest.fixture
def two():
    if cudalab.device_count() < 2:
        pytest.skip("needs two devices")
    if not nccl.is_available([]):
        pytest.skip("NCCL is not available (nccl4py missing)")
    yield (0, 1)
    nccl.destroy_communicators()


def test_the_record_is_frozen_and_its_fields_are_in_issues_order():
    # issue() unpacks the record in one step: the order is part of the record's contract
    assert CollectiveCall._fields == (
        "kind", "elements", "dtype", "op", "root", "sends", "recvs", "streams", "devices",
        "comms", "seam", "rank", "nranks", "route")
    call = CollectiveCall(0, 1, 7, 0, 0, (1,), (2,), (None,), (0,), (), None, 0, 1,
                          collective_call.ROUTE_CLIQUE)
    assert CollectiveCall.__slots__ == ()
    with pytest.raises(AttributeError):
        call.elements = 2  # type: ignore[misc]
    assert not dataclasses.is_dataclass(call) and not hasattr(call, "__dict__")


def test_type_bytes_are_the_element_sizes_of_nccls_types():
    for code, name in NCCL_NUMPY_NAMES.items():
        if name.startswith(("bfloat16", "float8")):
            ml_dtypes = pytest.importorskip("ml_dtypes")
            size = np.dtype(getattr(ml_dtypes, name)).itemsize
        else:
            size = np.dtype(name).itemsize
        assert collective_call.TYPE_BYTES[code] == size, name
    assert len(collective_call.TYPE_BYTES) == len(NCCL_NUMPY_NAMES)


def test_one_stream_check_with_one_error_type(two):
    side = cudalab.Stream(device=1)
    assert check_stream(side, 1, "x()", "input 0") is side
    with pytest.raises(StreamDeviceError, match=r"^nccl.broadcast\(\): the stream at index 0 is "
                                                r"on cuda:1, but input 0 is on cuda:0$") as info:
        check_stream(side, 0, "nccl.broadcast()", "input 0", 0)
    # torch.cuda.nccl's users catch RuntimeError, Communicator's ValueError: both still do
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)


def _spy(monkeypatch, module):
    """Record every CollectiveCall ``module`` hands to its ``issue`` (then issue it)."""
    seen = []
    real = module.issue

    def spy(call):
        assert type(call) is CollectiveCall
        seen.append(call)
        return real(call)

    monkeypatch.setattr(module, "issue", spy)
    return seen


def test_torch_nccl_and_comm_collectives_issue_one_record_each(two, monkeypatch):
    seen = _spy(monkeypatch, nccl)  # cudalab.comm calls nccl.issue too
    a = [cudalab.asarray(np.full(4, d + 1.0, np.float32), device=d) for d in two]
    nccl.all_reduce(a)
    (call,) = seen
    assert call.route == collective_call.ROUTE_NCCL and call.devices == (0, 1)
    assert call.sends == call.recvs == [x.ptr for x in a] and call.elements == 4
    assert [s.device_index for s in call.streams] == [0, 1] and len(call.comms) == 2
    assert call.seam is not None and (call.rank, call.nranks) == (0, 2)
    seen.clear()
    total = cudalab.comm.reduce_add(a, destination=1)
    (call,) = seen
    assert (call.kind, call.route, call.root) == (NCCL_CALL_REDUCE,
                                                  collective_call.ROUTE_CLIQUE, 1)
    assert call.comms == () and call.seam is None and call.recvs == [0, total.ptr]
    assert total.numpy().tolist() == [6.0] * 4  # (all_reduce made both 3.0)
    if cudalab.device_count() >= 3:
        seen.clear()
        cudalab.comm.broadcast(a[0], devices=[0, 1, 2])
        assert [c.kind for c in seen] == [NCCL_CALL_BROADCAST]


def test_a_communicator_issues_one_record_per_operation(backend, monkeypatch):
    fake = FakeNccl(backend, lonely=True)
    monkeypatch.setattr(backend, "nccl", lambda: fake)
    seen = _spy(monkeypatch, communicator_module)
    comm = communicator_module.Communicator(0, 1, bytes(128), device=0)
    try:
        x = cudalab.ones(8, dtype="float32")
        comm.all_reduce(x)
        comm.broadcast(x, root=0)
        assert [c.kind for c in seen] == [0, NCCL_CALL_BROADCAST]
        for call in seen:
            assert call.route == collective_call.ROUTE_RANK and call.seam is fake
            assert call.devices == (0,) and call.sends == call.recvs == (x.ptr,)
            assert (call.rank, call.nranks, call.elements) == (0, 1, 8)
    finally:
        comm.abort()


def test_the_sanitizer_sees_what_each_rank_reads_and_writes(two, monkeypatch):
    reported = []

    class Tracker:
        def access(self, stream, reads, writes, label):
            reported.append((stream.device_index, reads, writes, label))

        def __getattr__(self, name):  # (allocations and frees: not what is tested here)
            return lambda *args: None

    a = [cudalab.zeros(4, dtype="float32", device=d) for d in two]
    out = cudalab.zeros(4, dtype="float32", device=0)
    gathered = [cudalab.zeros(8, dtype="float32", device=d) for d in two]
    monkeypatch.setattr(collective_call._observe, "access_on", True)
    monkeypatch.setattr(collective_call._observe, "access_tracker", Tracker())
    nccl.broadcast(a, root=1)  # in place: the root reads, the others write
    nccl.reduce(a, out, root=0)  # every rank reads, the root writes its output
    nccl.all_gather(a, gathered)
    assert reported == [
        (0, [], [(a[0].ptr, 16)], "nccl.broadcast"),
        (1, [(a[1].ptr, 16)], [], "nccl.broadcast"),
        (0, [(a[0].ptr, 16)], [(out.ptr, 16)], "nccl.reduce"),
        (1, [(a[1].ptr, 16)], [], "nccl.reduce"),
        (0, [(a[0].ptr, 16)], [(gathered[0].ptr, 32)], "nccl.all_gather"),
        (1, [(a[1].ptr, 16)], [(gathered[1].ptr, 32)], "nccl.all_gather"),
    ]


def _in_issue(frame):
    return frame.f_code is collective_call.issue.__code__


@pytest.mark.parametrize("via", ["nccl", "comm"])
def test_ctrl_c_anywhere_in_issue_waits_until_the_collective_is_whole(two, deferring, via):
    """The group is issued on every rank, the caller's device is current again and no NVTX
    range is left open: then the KeyboardInterrupt comes."""
    cudalab.set_device(1)
    a = [cudalab.asarray(np.ones(4, np.float32), device=d) for d in two]

    def op():
        if via == "nccl":
            nccl.all_reduce(a)  # ROUTE_NCCL
        else:
            cudalab.comm.reduce_add(a, destination=0)  # ROUTE_CLIQUE

    op()  # (the clique and its runner exist: every run takes the same lines)
    n = count_events(op, _in_issue)
    assert n >= 5
    for k in range(1, n + 1):
        before = a[1].numpy().tolist()
        _, exc, tripped = interrupt_at(op, _in_issue, k)
        assert tripped and isinstance(exc, KeyboardInterrupt), k
        assert not any(f.f_code is collective_call.issue.__code__
                       for f in frames_of(exc.__traceback__)), k  # raised after issue ended
        if via == "nccl":
            assert a[1].numpy().tolist() == [2 * x for x in before], k
        assert cudalab.current_device() == 1 and cudalab.nvtx.current_ranges() == ()
    cudalab.set_device(0)
