"""cudalab.comm.broadcast_coalesced and reduce_add_coalesced on the simulator: torch's chunking
(C++ take_tensors, Python _take_tensors), flat buffers, order, errors, records."""

from __future__ import annotations

import numpy as np
import pytest

import cudalab
from cudalab import comm
from cudalab.comm import coalesced
from tests.comm.helpers import host_array, on


def _mixed(device, seed=0):
    """Arrays of several dtypes and sizes (torch's test_broadcast_coalesced, dense part)."""
    specs = [((5,), "int64"), ((5,), "float32"), ((2, 3), "float64"), ((5,), "int64"),
             ((7,), "float32"), ((), "float32"), ((0,), "uint8"), ((4, 2), "float16"),
             ((9,), "int32"), ((3,), "bool"), ((5,), "int64")]
    hosts = [host_array(shape, dtype, seed + i) for i, (shape, dtype) in enumerate(specs)]
    return hosts, [on(device, h) for h in hosts]


def _sizes_of(chunks):
    return [[a.nbytes for a in chunk] for chunk in chunks]


# --------------------------------------------------------------------------- chunking rules
class _Spec:
    """An array's dtype and bytes, for the chunking functions."""

    def __init__(self, name, dtype, nbytes):
        self.name, self.dtype, self.nbytes = name, np.dtype(dtype), nbytes


def test_take_tensors_is_torchs_cpp_rule():
    a0, a1, a2, a3, a4 = (_Spec("a0", "float32", 16), _Spec("a1", "int64", 16),
                          _Spec("a2", "float32", 16), _Spec("a3", "float32", 16),
                          _Spec("a4", "int64", 8))
    chunks = coalesced.take_tensors([a0, a1, a2, a3, a4], 32)
    # float32 reaches 32 bytes at a2 (>=): emitted; the rest at the end in ScalarType
    # order (Long = 4 before Float = 6)
    assert [[a.name for a in c] for c in chunks] == [["a0", "a2"], ["a1", "a4"], ["a3"]]


def test_take_tensors_python_is_torchs_python_rule():
    a0, a1, a2, a3, a4 = (_Spec("a0", "float32", 16), _Spec("a1", "int64", 16),
                          _Spec("a2", "float32", 16), _Spec("a3", "float32", 16),
                          _Spec("a4", "int64", 8))
    chunks = list(coalesced.take_tensors_python([a0, a1, a2, a3, a4], 32))
    # emitted before a3 would pass 32 (>); leftovers in order of first appearance
    assert [[a.name for a in c] for c in chunks] == [["a0", "a2"], ["a3"], ["a1", "a4"]]


def test_take_tensors_python_never_emits_an_empty_buffer():
    big = _Spec("big", "float32", 100)
    assert [[a.name for a in c] for c in coalesced.take_tensors_python([big, big], 10)] == [
        ["big"], ["big"]]


def test_take_tensors_orders_leftover_groups_by_scalar_type():
    names = ["bool", "float32", "uint8", "int64", "float16", "int8", "float64", "int32"]
    chunks = coalesced.take_tensors([_Spec(n, n, 1) for n in names], 1000)
    assert [c[0].name for c in chunks] == ["uint8", "int8", "int32", "int64", "float16",
                                           "float32", "float64", "bool"]


# --------------------------------------------------------------------------- broadcast_coalesced
@pytest.mark.parametrize("buffer_size", [0, 1, 20, 40, 100, coalesced.DEFAULT_BUFFER_SIZE])
def test_broadcast_coalesced_values_and_order(two, path, buffer_size):
    hosts, arrays = _mixed(0)
    outputs = comm.broadcast_coalesced(arrays, [0, 1], buffer_size=buffer_size)
    assert type(outputs) is list and len(outputs) == 2
    assert all(o is a for o, a in zip(outputs[0], arrays))  # devices[0]: the inputs as-is
    assert len(outputs[1]) == len(arrays)
    for out, host in zip(outputs[1], hosts):
        assert out.device_index == 1 and out.dtype == host.dtype and out.shape == host.shape
        np.testing.assert_array_equal(out.numpy(), host)


def test_broadcast_coalesced_chunks_share_a_flat_buffer(two, path):
    arrays = [on(0, np.arange(4, dtype=np.float32)), on(0, np.arange(2, dtype=np.int64)),
              on(0, np.arange(4, 8, dtype=np.float32)), on(0, np.arange(8, 12, dtype=np.float32)),
              on(0, np.arange(1, dtype=np.int64))]
    outputs = comm.broadcast_coalesced(arrays, [0, 1], buffer_size=32)[1]
    bases = [id(o.base) for o in outputs]
    # chunks [a0, a2], [a1, a4], [a3]: one flat buffer each
    assert bases[0] == bases[2] and bases[1] == bases[4]
    assert len({bases[0], bases[1], bases[3]}) == 3
    assert outputs[0].base.shape == (8,) and outputs[1].base.shape == (3,)
    for out, a in zip(outputs, arrays):
        np.testing.assert_array_equal(out.numpy(), a.numpy())


def test_broadcast_coalesced_to_three_device_entries(two, path):
    hosts, arrays = _mixed(1, seed=3)
    outputs = comm.broadcast_coalesced(arrays, ["cuda:1", 0, 1], buffer_size=24)
    assert all(o is a for o, a in zip(outputs[0], arrays))
    assert [o.device_index for o in outputs[1]] == [0] * len(arrays)
    for out, host in zip(outputs[2], hosts):  # devices[0] again: views of the source chunk
        assert out.device_index == 1
        np.testing.assert_array_equal(out.numpy(), host)
    for out, host in zip(outputs[1], hosts):
        np.testing.assert_array_equal(out.numpy(), host)


def test_broadcast_coalesced_of_nothing(two, path, records):
    assert comm.broadcast_coalesced([], [0, 1]) == [[], []]
    assert records[0][0].algorithm_bytes == 0


def test_broadcast_coalesced_nccl_branch_once_per_chunk(two, fake_nccl, backend, monkeypatch):
    monkeypatch.setattr(backend, "can_access_peer", lambda device, peer: False)
    monkeypatch.setattr(cudalab.devices, "_peer_access", {})  # no peer access: NCCL, as torch
    arrays = [on(0, np.arange(4, dtype=np.float32)), on(0, np.arange(2, dtype=np.int64)),
              on(0, np.arange(4, dtype=np.float32))]
    comm.broadcast_coalesced(arrays, [0, 1], buffer_size=16)
    assert fake_nccl.calls == [("broadcast", (0, 1), 0)] * 3


def test_broadcast_coalesced_errors(two, records):
    a, b = on(0, np.ones(2)), on(1, np.ones(2))
    with pytest.raises(RuntimeError, match=r"^All tensors must be on devices\[0\]: 0$"):
        comm.broadcast_coalesced([a, b], [0, 1])
    with pytest.raises(RuntimeError, match=r"^All tensors must be on devices\[0\]: 1$"):
        comm.broadcast_coalesced([np.ones(2)], [1, 0])
    with pytest.raises(RuntimeError, match="non-negative device index, but got -2"):
        comm.broadcast_coalesced([a], [0, -2])
    assert records == [] and cudalab.nvtx.current_ranges() == ()


def test_broadcast_coalesced_record_once(two, path, records):
    arrays = [on(0, np.ones(8, np.float32)), on(0, np.ones(3, np.int64))]
    comm.broadcast_coalesced(arrays, [0, 1], buffer_size=1)
    assert [(r.name, r.algorithm_bytes, r.nranks, r.bus_factor, r.devices, ranges)
            for r, ranges in records] == [
        ("comm.broadcast_coalesced", 56, 2, 1.0, (0, 1), ("comm.broadcast_coalesced",))]


def test_broadcast_coalesced_allocates_one_buffer_per_chunk(two, path):
    arrays = [on(0, np.ones(256, np.float32)) for _ in range(4)]  # 1 KiB each
    before = cudalab.memory_stats(1)["allocation.all.current"]
    outputs = comm.broadcast_coalesced(arrays, [0, 1], buffer_size=2048)
    assert cudalab.memory_stats(1)["allocation.all.current"] - before == 2
    assert cudalab.memory_allocated(1) >= 4096
    del outputs


# --------------------------------------------------------------------------- reduce_add_coalesced
@pytest.mark.parametrize("buffer_size", [0, 24, 64, coalesced.DEFAULT_BUFFER_SIZE])
def test_reduce_add_coalesced_values_and_order(two, path, buffer_size):
    hosts0, arrays0 = _mixed(0, seed=0)
    hosts1, arrays1 = _mixed(1, seed=20)
    # bool sums are "or" on the copy path and bytes on NCCL's: leave them out of this one
    keep = [i for i, h in enumerate(hosts0) if h.dtype != np.bool_]
    arrays0, arrays1 = [arrays0[i] for i in keep], [arrays1[i] for i in keep]
    result = comm.reduce_add_coalesced([arrays0, arrays1], destination=1,
                                       buffer_size=buffer_size)
    assert type(result) is tuple and len(result) == len(keep)
    for r, i in zip(result, keep):
        h0, h1 = hosts0[i], hosts1[i]
        assert r.device_index == 1 and r.dtype == h0.dtype and r.shape == h0.shape
        expected = (h0.astype(np.float64) + h1.astype(np.float64)).astype(h0.dtype)
        np.testing.assert_array_equal(r.numpy(), expected)


def test_reduce_add_coalesced_chunks_share_a_flat_buffer(two, path):
    def lists(device):
        return [on(device, np.arange(4, dtype=np.float32)), on(device, np.arange(2)),
                on(device, np.arange(4, dtype=np.float32)), on(device, np.arange(4, dtype=np.float32)),
                on(device, np.arange(1))]
    result = comm.reduce_add_coalesced([lists(0), lists(1)], destination=0, buffer_size=32)
    bases = [id(r.base) for r in result]
    # Python rule: chunks [a0, a2], [a3], [a1, a4]
    assert bases[0] == bases[2] and bases[1] == bases[4] and len(set(bases)) == 3
    assert result[3].base is not None  # a lone array's flat result is viewed too
    for r, a in zip(result, lists(0)):
        np.testing.assert_array_equal(r.numpy(), 2 * a.numpy())


def test_reduce_add_coalesced_default_destination(two, path):
    cudalab.set_device(1)
    result = comm.reduce_add_coalesced([[on(0, np.ones(3))], [on(1, np.ones(3))]])
    assert result[0].device_index == 1
    np.testing.assert_array_equal(result[0].numpy(), [2.0, 2.0, 2.0])


def test_reduce_add_coalesced_nccl_branch_once_per_chunk(two, fake_nccl):
    lists = [[on(d, np.ones(4, np.float32)), on(d, np.ones(2))] for d in (0, 1)]
    comm.reduce_add_coalesced(lists, destination=1, buffer_size=1)
    assert fake_nccl.calls == [("reduce", (0, 1), 1)] * 2


def test_reduce_add_coalesced_errors_before_anything_is_queued(two, records):
    good = [on(0, np.ones(4)), on(0, np.ones(4))]
    short = [on(1, np.ones(4)), on(1, np.ones(3))]
    mixed = [on(1, np.ones(4)), on(0, np.ones(4))]
    before = [cudalab.memory_stats(d)["allocation.all.allocated"] for d in (0, 1)]
    # the second chunk's sizes differ: found before the first chunk is summed
    with pytest.raises(ValueError, match=r"^input 1 has invalid size: got 3, but expected 4$"):
        comm.reduce_add_coalesced([good, short], destination=0, buffer_size=1)
    with pytest.raises(RuntimeError, match="expects destination to be on the same GPU"):
        comm.reduce_add_coalesced([good, good], destination=1)
    with pytest.raises(AssertionError, match="expects all inputs to be on GPUs"):
        comm.reduce_add_coalesced([good, [np.ones(4), np.ones(4)]], destination=0)
    with pytest.raises(RuntimeError, match=r"^Expected all tensors to be on the same device, "
                       r"but found at least two devices, cuda:0 and cuda:1!$"):
        comm.reduce_add_coalesced([good, mixed], destination=0)
    assert [cudalab.memory_stats(d)["allocation.all.allocated"] for d in (0, 1)] == before
    assert records == [] and cudalab.nvtx.current_ranges() == ()


def test_reduce_add_coalesced_record_once(two, path, records):
    lists = [[on(d, np.ones(8, np.float32)), on(d, np.ones(3))] for d in (0, 1)]
    comm.reduce_add_coalesced(lists, destination=0, buffer_size=1)
    assert [(r.name, r.algorithm_bytes, r.nranks, r.bus_factor, r.devices, ranges)
            for r, ranges in records] == [
        ("comm.reduce_add_coalesced", 56, 2, 1.0, (0, 1), ("comm.reduce_add_coalesced",))]
