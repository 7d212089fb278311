"""cudalab.comm.broadcast and reduce_add on the simulator (two devices): values, identities,
torch's errors, allocator accounting, streams, peer access, records and NVTX ranges."""

from __future__ import annotations

import numpy as np
import pytest

import cudalab
from cudalab import comm
from cudalab.comm import _common
from tests.comm.helpers import DTYPES, host_array, on

SHAPES = [(7,), (3, 5), (2, 3, 4), ()]


# --------------------------------------------------------------------------- broadcast values
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_broadcast_values(two, path, dtype, shape):
    host = host_array(shape, dtype)
    src = on(0, host)
    results = comm.broadcast(src, (0, 1))
    assert type(results) is list and len(results) == 2
    assert results[0] is src  # the source's own device: the source itself
    assert results[1].device == cudalab.Device("cuda:1")
    assert results[1].shape == shape and results[1].dtype == src.dtype
    np.testing.assert_array_equal(results[1].numpy(), host)


def test_broadcast_from_the_second_device_and_device_spellings(two, path):
    host = host_array((4, 4), "float32")
    src = on(1, host)
    results = comm.broadcast(src, ["cuda:0", cudalab.Device("cuda:1")])
    assert results[1] is src and results[0].device_index == 0
    np.testing.assert_array_equal(results[0].numpy(), host)


def test_broadcast_from_the_host(two, path):
    host = host_array((5, 3), "int64")
    results = comm.broadcast(host, [0, 1])
    assert [r.device_index for r in results] == [0, 1]
    for r in results:
        np.testing.assert_array_equal(r.numpy(), host)


def test_broadcast_from_a_strided_host_array(two, path):
    host = host_array((6, 4), "float32")[:, ::2]
    results = comm.broadcast(host, [1])
    np.testing.assert_array_equal(results[0].numpy(), host)


def test_broadcast_to_duplicate_devices_makes_separate_copies(two, path):
    src = on(0, host_array((8,), "float32"))
    results = comm.broadcast(src, [1, 1, 0])
    assert results[2] is src
    assert results[0].ptr != results[1].ptr
    for r in results[:2]:
        np.testing.assert_array_equal(r.numpy(), src.numpy())


def test_broadcast_out(two, path):
    host = host_array((3, 4), "float32")
    src = on(0, host)
    outs = [cudalab.empty((3, 4), device=1), cudalab.zeros((3, 4), device=0)]
    results = comm.broadcast(src, out=outs)
    assert type(results) is list
    assert results[0] is outs[0] and results[1] is outs[1]
    for r in results:
        np.testing.assert_array_equal(r.numpy(), host)


def test_broadcast_out_converts_the_dtype(two, copies):
    src = on(0, np.arange(6, dtype=np.int32))
    out = cudalab.empty(6, dtype=np.float64, device=1)
    comm.broadcast(src, out=[out])
    np.testing.assert_array_equal(out.numpy(), np.arange(6.0))


def test_broadcast_out_into_itself_is_a_no_op(two, path):
    src = on(0, np.arange(4.0))
    assert comm.broadcast(src, out=[src])[0] is src
    np.testing.assert_array_equal(src.numpy(), np.arange(4.0))


@pytest.fixture
def no_peer_access(backend, monkeypatch):
    """Devices that cannot read each other's memory (then a broadcast to one goes to NCCL)."""
    monkeypatch.setattr(backend, "can_access_peer", lambda device, peer: False)
    monkeypatch.setattr(cudalab.devices, "_peer_access", {})


def test_broadcast_to_one_peer_is_one_peer_copy(two, fake_nccl, backend, monkeypatch):
    monkeypatch.setattr(cudalab.devices, "_peer_access", {})
    if not backend.can_access_peer(0, 1):
        pytest.skip("these devices have no peer access")
    src = on(1, np.arange(4.0))
    results = comm.broadcast(src, [0, 1])
    assert fake_nccl.calls == []  # faster than NCCL's broadcast for a single destination
    assert results[1] is src
    np.testing.assert_array_equal(results[0].numpy(), np.arange(4.0))


def test_broadcast_nccl_branch_gets_torchs_list(two, fake_nccl, no_peer_access):
    src = on(1, np.arange(4.0))
    comm.broadcast(src, [0, 1])
    comm.broadcast(src, [0, 0])  # duplicate devices: copies, as torch
    comm.broadcast(src.numpy(), [0, 1])  # a host source: copies
    assert fake_nccl.calls == [("broadcast", (1, 0), 0)]


def test_broadcast_of_a_strided_source_copies(two, fake_nccl):
    host = host_array((4, 6), "float32")
    base = on(0, host)
    strided = _common.narrow(base, 1, 2, 3)
    assert not strided.is_contiguous()
    results = comm.broadcast(strided, [1, 0])
    assert fake_nccl.calls == []  # not contiguous: torch's is_available says no
    assert results[1] is strided
    np.testing.assert_array_equal(results[0].numpy(), host[:, 2:5])


# --------------------------------------------------------------------------- broadcast errors
def test_broadcast_needs_exactly_one_of_devices_and_out(two):
    src = on(0, np.zeros(2))
    with pytest.raises(RuntimeError, match=r"^Exactly one of 'devices' and 'out' must be "
                       r"specified, but got devices=None and out=None$"):
        comm.broadcast(src)
    out = [cudalab.empty(2, dtype=np.float64, device=1)]
    with pytest.raises(RuntimeError, match=r"but got devices=\[0\] and out=\[DeviceArray"):
        comm.broadcast(src, [0], out=out)


def test_broadcast_negative_device(two):
    with pytest.raises(RuntimeError, match=r"^Expected non-negative device index, but got -1$"):
        comm.broadcast(on(0, np.zeros(2)), [0, -1])


def test_broadcast_device_out_of_range(two):
    with pytest.raises(ValueError, match="Invalid device index 7"):
        comm.broadcast(on(0, np.zeros(2)), [0, 7])


def test_broadcast_out_on_the_host(two):
    src = on(0, np.zeros((2, 3), np.float32))
    with pytest.raises(RuntimeError, match=r"^Expected all output tensors to be CUDA tensors, "
                       r"but output tensor at index 1 has device 'cpu'$"):
        comm.broadcast(src, out=[cudalab.empty((2, 3), device=1), np.zeros((2, 3), np.float32)])


def test_broadcast_out_shape(two):
    src = on(0, np.zeros((2, 3), np.float32))
    with pytest.raises(RuntimeError, match=r"^Expected all output tensors to have same shape as "
                       r"the source tensor \[2, 3\], but output tensor at index 0 has shape "
                       r"\[3, 2\]$"):
        comm.broadcast(src, out=[cudalab.empty((3, 2), device=1)])


def test_broadcast_bad_source_type(two):
    with pytest.raises(TypeError, match="DeviceArray or a numpy array, not list"):
        comm.broadcast([1, 2], [0, 1])


def test_broadcast_errors_queue_nothing(two, records):
    before = cudalab.memory_stats(1)["allocation.all.allocated"]
    with pytest.raises(RuntimeError):
        comm.broadcast(on(0, np.zeros(2)), [1, -1])
    assert cudalab.memory_stats(1)["allocation.all.allocated"] == before
    assert records == []


# --------------------------------------------------------------------------- reduce_add values
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != "bool"])
@pytest.mark.parametrize("shape", SHAPES)
def test_reduce_add_values(two, path, dtype, shape):
    a_host, b_host = host_array(shape, dtype, 1), host_array(shape, dtype, 2)
    a, b = on(0, a_host), on(1, b_host)
    result = comm.reduce_add([a, b], destination=1)
    assert result.device_index == 1 and result.shape == shape
    assert result.ptr not in (a.ptr, b.ptr)
    expected = (a_host.astype(np.float64) + b_host.astype(np.float64)).astype(result.dtype)
    np.testing.assert_array_equal(result.numpy(), expected)


def test_reduce_add_bool_is_or_on_the_copy_path(two, copies):
    a, b = on(0, np.array([True, False, False])), on(1, np.array([True, True, False]))
    result = comm.reduce_add([a, b], destination=0)
    np.testing.assert_array_equal(result.numpy(), [True, True, False])


def test_reduce_add_default_destination_is_the_current_device(two, path):
    a, b = on(0, np.ones(4, np.float32)), on(1, np.full(4, 2, np.float32))
    cudalab.set_device(1)
    result = comm.reduce_add([a, b])
    assert result.device_index == 1
    np.testing.assert_array_equal(result.numpy(), np.full(4, 3, np.float32))


def test_reduce_add_one_input_is_returned_itself(two, path):
    a = on(1, np.ones(3))
    assert comm.reduce_add([a], destination="cuda:1") is a


def test_reduce_add_copy_path_order_is_torchs(two, copies):
    """float32 sums in torch's order: the destination's input, then the others in order."""
    values = [np.array([1e8], np.float32), np.array([1.0], np.float32),
              np.array([-1e8], np.float32)]
    arrays = [on(0, values[0]), on(0, values[1]), on(1, values[2])]
    result = comm.reduce_add(arrays, destination=1)
    torch_order = (values[2] + values[0]) + values[1]  # root first: -1e8 + 1e8 + 1 = 1
    other_order = (values[0] + values[1]) + values[2]  # 1e8 + 1 rounds away the 1: 0
    assert torch_order[0] != other_order[0]
    np.testing.assert_array_equal(result.numpy(), torch_order)


def test_reduce_add_root_is_the_last_input_on_the_destination(two, fake_nccl):
    a, b = on(0, np.ones(2)), on(1, np.ones(2))
    comm.reduce_add([a, b], destination=0)
    assert fake_nccl.calls == [("reduce", (0, 1), 0)]
    fake_nccl.calls.clear()
    c = on(0, np.ones(2))
    result = comm.reduce_add([a, b, c], destination=0)  # duplicate devices: copies
    assert fake_nccl.calls == []
    np.testing.assert_array_equal(result.numpy(), [3.0, 3.0])


def test_reduce_add_mixed_dtypes_promote_on_the_copy_path(two, copies):
    a, b = on(0, np.arange(3, dtype=np.int32)), on(1, np.full(3, 0.5))
    result = comm.reduce_add([a, b], destination=0)
    assert result.dtype == np.float64
    np.testing.assert_array_equal(result.numpy(), np.arange(3) + 0.5)


# --------------------------------------------------------------------------- reduce_add errors
def test_reduce_add_host_input(two):
    with pytest.raises(AssertionError, match=r"^reduce_add expects all inputs to be on GPUs$"):
        comm.reduce_add([on(0, np.ones(2)), np.ones(2)], destination=0)


def test_reduce_add_size_mismatch(two):
    with pytest.raises(ValueError, match=r"^input 1 has invalid size: got 3x2, but expected 2x3$"):
        comm.reduce_add([on(0, np.ones((2, 3))), on(1, np.ones((3, 2)))], destination=0)


def test_reduce_add_no_input_on_the_destination(two):
    with pytest.raises(RuntimeError, match=r"^reduce_add expects destination to be on the same "
                       r"GPU with one of the tensors$"):
        comm.reduce_add([on(0, np.ones(2)), on(0, np.ones(2))], destination=1)


def test_reduce_add_no_input(two):
    with pytest.raises(IndexError):
        comm.reduce_add([], destination=0)


# --------------------------------------------------------------------------- allocator, streams
def test_results_come_from_the_caching_allocator(two, path):
    src = on(0, np.zeros(1024, np.float32))  # 4096 bytes: no rounding
    other = on(1, np.zeros(1024, np.float32))
    before = cudalab.memory_allocated(1), cudalab.memory_stats(1)["allocation.all.current"]
    results = comm.broadcast(src, [0, 1])
    after = cudalab.memory_allocated(1), cudalab.memory_stats(1)["allocation.all.current"]
    assert after[0] - before[0] == 4096 and after[1] - before[1] == 1
    total = comm.reduce_add([src, other], destination=1)
    assert cudalab.memory_allocated(1) - after[0] == 4096  # the result (temporaries freed)
    del results, total
    assert cudalab.memory_allocated(1) == before[0]


def test_broadcast_result_is_queued_on_the_current_stream(two, path, sim):
    if path == "nccl":
        pytest.skip("the NCCL stand-in copies through the host (it waits for its streams)")
    host = host_array((64,), "float32")
    src = on(0, host)
    s1 = cudalab.Stream(device=1)
    cudalab.set_stream(s1)
    cudalab.set_device(0)
    sim.pause_stream(s1.handle)
    try:
        result = comm.broadcast(src, [1])[0]
        assert result.stream is s1  # allocated on the current stream
        assert not s1.query()  # the copy waits on the paused stream
    finally:
        sim.resume_stream(s1.handle)
    np.testing.assert_array_equal(result.numpy(), host)


def test_copies_wait_for_the_source_devices_current_stream(two, copies, sim):
    src = on(0, np.zeros(32, np.float32))
    ones = on(1, np.ones(32, np.float32))
    s0 = cudalab.Stream(device=0)
    sim.pause_stream(s0.handle)
    try:
        with cudalab.stream(s0):
            src.fill_(7)  # held back on device 0's current stream
            result = comm.broadcast(src, [1])[0]
            total = comm.reduce_add([src, ones], destination=1)
        assert not cudalab.current_stream(1).query()  # device 1 waits for the paused fill
    finally:
        sim.resume_stream(s0.handle)
    np.testing.assert_array_equal(result.numpy(), np.full(32, 7, np.float32))
    np.testing.assert_array_equal(total.numpy(), np.full(32, 8, np.float32))


def test_peer_access_is_enabled_once_per_pair(two, copies, sim, monkeypatch):
    monkeypatch.setattr(cudalab.devices, "_peer_access", {})
    calls = []
    original = type(sim).enable_peer_access
    monkeypatch.setattr(type(sim), "enable_peer_access",
                        lambda self, d, p: (calls.append((d, p)), original(self, d, p))[1])
    src = on(0, np.ones(16))
    comm.broadcast(src, [1])
    comm.broadcast(src, [1, 0])
    comm.reduce_add([src, on(1, np.ones(16))], destination=0)
    assert calls == [(1, 0), (0, 1)]
    assert {(1, 0), (0, 1)} <= sim._peers


# --------------------------------------------------------------------------- records, NVTX
def test_records_and_nvtx_ranges(two, path, records):
    src = on(0, np.zeros((4, 8), np.float32))
    comm.broadcast(src, [0, 1])
    comm.broadcast(src.numpy(), out=[cudalab.empty((4, 8), device=1)])
    comm.reduce_add([src, on(1, np.zeros((4, 8), np.float32))], destination=1)
    got = [(r.name, r.algorithm_bytes, r.nranks, r.bus_factor, r.devices, ranges)
           for r, ranges in records]
    assert got == [
        ("comm.broadcast", 128, 2, 1.0, (0, 1), ("comm.broadcast",)),
        ("comm.broadcast", 128, 1, 1.0, (1,), ("comm.broadcast",)),
        ("comm.reduce_add", 128, 2, 1.0, (0, 1), ("comm.reduce_add",)),
    ]
    assert cudalab.nvtx.current_ranges() == ()


def test_nvtx_range_is_closed_after_an_error(two):
    with pytest.raises(AssertionError):
        comm.reduce_add([np.ones(2)], destination=0)
    assert cudalab.nvtx.current_ranges() == ()
