"""Communicator's operations end to end on the simulator: two ranks as two threads, one per
simulated device, over the thread fake of the seam's NCCL (test_communicator_fake.py).
Checks the values against numpy, the pointers, counts and NCCL types passed, the in-place
forms, the NVTX ranges, the collective records and record_stream."""

from __future__ import annotations

import numpy as np
import pytest

import cudalab
from cudalab import _internal
from cudalab._driver.base import NCCL_FLOAT32, NCCL_FLOAT64, NCCL_UINT8
from cudalab.array import DeviceArray
from cudalab.comm.communicator import Communicator, live_communicators
from tests.comm.test_communicator_fake import FakeNccl, run_ranks

WORLD = 2
N = 7  # elements per rank (odd: no accidental alignment)


@pytest.fixture
def fake(backend, monkeypatch, two_devices):
    nccl = FakeNccl(backend)
    monkeypatch.setattr(backend, "nccl", lambda: nccl)
    return nccl


@pytest.fixture(autouse=True)
def _abort_leftovers():
    yield
    for comm in live_communicators():
        comm.abort()


def _on_ranks(body):
    """``body(comm, rank)`` on each rank of a fresh 2-rank communicator (device = rank)."""
    uid = bytes(np.random.default_rng().integers(0, 256, 128, dtype=np.uint8))

    def rank_main(rank):
        with Communicator(rank, WORLD, uid, device=rank) as comm:
            return body(comm, rank)

    return run_ranks(WORLD, rank_main)


def _dev(values, rank, dtype=None):
    return cudalab.asarray(np.asarray(values, dtype=dtype), device=rank)


def _inputs(rank, dtype):
    return (np.arange(N) * (rank + 1) + rank).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "int32", "float64", "uint8", "int64"])
def test_all_reduce_sum_in_place(fake, dtype):
    def body(comm, rank):
        x = _dev(_inputs(rank, dtype), rank)
        assert comm.all_reduce(x) is x
        return x.numpy()

    expected = sum(_inputs(r, dtype) for r in range(WORLD)).astype(dtype)
    for got in _on_ranks(body):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("op, reduce", [("max", np.maximum.reduce), ("min", np.minimum.reduce),
                                        ("prod", np.multiply.reduce), (4, None)])
def test_all_reduce_out_of_place_other_ops(fake, op, reduce):
    def body(comm, rank):
        x = _dev(_inputs(rank, np.float32), rank)
        y = cudalab.zeros(N, device=rank)
        assert comm.all_reduce(x, y, op=op) is y
        return x.numpy(), y.numpy()

    inputs = [_inputs(r, np.float32) for r in range(WORLD)]
    expected = (sum(inputs) / WORLD if op == 4 else reduce(inputs)).astype(np.float32)
    for rank, (x, y) in enumerate(_on_ranks(body)):
        np.testing.assert_array_equal(x, inputs[rank])  # send untouched
        np.testing.assert_allclose(y, expected)


def test_complex_sums_as_pairs_and_bool_max_as_bytes(fake):
    def body(comm, rank):
        z = _dev(np.arange(N) * (1 + 2j) * (rank + 1), rank, np.complex64)
        flags = _dev(np.arange(N) % WORLD == rank, rank, np.bool_)
        comm.all_reduce(z, op="avg")
        comm.all_reduce(flags, op="MAX")
        return z.numpy(), flags.numpy()

    for z, flags in _on_ranks(body):
        np.testing.assert_allclose(z, np.arange(N) * (1 + 2j) * 1.5)
        assert flags.dtype == np.bool_ and flags.all()
    calls = [c for c in fake.collective_calls() if c[0] == "all_reduce"]
    assert {(c[1][2], c[1][3]) for c in calls} == {(2 * N, NCCL_FLOAT32), (N, NCCL_UINT8)}


def test_all_gather_out_of_place_and_in_place(fake):
    def body(comm, rank):
        send = _dev(_inputs(rank, np.float64), rank)
        recv = cudalab.zeros(WORLD * N, dtype="float64", device=rank)
        comm.all_gather(send, recv)
        whole = cudalab.zeros(WORLD * N, dtype="float64", device=rank)
        mine = whole[rank * N:(rank + 1) * N]
        mine.copy_(_inputs(rank, np.float64))
        assert comm.all_gather(mine, whole) is whole
        return recv.numpy(), whole.numpy()

    expected = np.concatenate([_inputs(r, np.float64) for r in range(WORLD)])
    for recv, whole in _on_ranks(body):
        np.testing.assert_array_equal(recv, expected)
        np.testing.assert_array_equal(whole, expected)
    gathers = [c for c in fake.collective_calls() if c[0] == "all_gather"]
    assert {(c[1][2], c[1][3]) for c in gathers} == {(N, NCCL_FLOAT64)}


def test_reduce_scatter_out_of_place_and_in_place(fake):
    def body(comm, rank):
        send = _dev(np.arange(WORLD * N) * (rank + 1), rank, np.int64)
        recv = cudalab.zeros(N, dtype="int64", device=rank)
        comm.reduce_scatter(send, recv)
        in_place = _dev(np.arange(WORLD * N) * (rank + 1), rank, np.int64)
        comm.reduce_scatter(in_place, in_place[rank * N:(rank + 1) * N], op="max")
        return recv.numpy(), in_place.numpy()[rank * N:(rank + 1) * N]

    total = sum(np.arange(WORLD * N) * (r + 1) for r in range(WORLD))
    biggest = np.arange(WORLD * N) * WORLD
    for rank, (recv, mine) in enumerate(_on_ranks(body)):
        np.testing.assert_array_equal(recv, total[rank * N:(rank + 1) * N])
        np.testing.assert_array_equal(mine, biggest[rank * N:(rank + 1) * N])


def test_broadcast_in_place_and_two_buffers_with_a_nonzero_root(fake):
    def body(comm, rank):
        x = _dev(np.full(N, rank + 10), rank, np.int32)
        comm.broadcast(x, root=1)
        send = _dev(np.full(N, rank + 20), rank, np.int16)  # int16 travels as bytes
        recv = cudalab.zeros(N, dtype="int16", device=rank)
        assert comm.broadcast(send, recv, 0) is recv
        return x.numpy(), recv.numpy()

    for x, recv in _on_ranks(body):
        assert x.tolist() == [11] * N and recv.tolist() == [20] * N
    bytes_call = [c for c in fake.collective_calls() if c[0] == "broadcast" and c[1][3] == NCCL_UINT8]
    assert {c[1][2] for c in bytes_call} == {2 * N}


def test_reduce_writes_the_root_only(fake):
    def body(comm, rank):
        send = _dev(_inputs(rank, np.float32), rank)
        recv = _dev(np.full(N, -1.0), rank, np.float32)
        comm.reduce(send, recv, root=1)
        in_place = _dev(_inputs(rank, np.float32), rank)
        comm.reduce(in_place, root=0, op="min")
        return recv.numpy(), in_place.numpy()

    (recv0, place0), (recv1, place1) = _on_ranks(body)
    inputs = [_inputs(r, np.float32) for r in range(WORLD)]
    assert recv0.tolist() == [-1.0] * N  # not the root: untouched
    np.testing.assert_array_equal(recv1, sum(inputs))
    np.testing.assert_array_equal(place0, np.minimum(*inputs))
    np.testing.assert_array_equal(place1, inputs[1])


def test_send_recv_one_way_and_an_exchange_in_a_group(fake):
    def body(comm, rank):
        peer = 1 - rank
        got = cudalab.zeros(N, dtype="float32", device=rank)
        if rank == 0:
            comm.send(_dev(np.arange(N), rank, np.float32), peer)
        else:
            assert comm.recv(got, peer) is got
        outgoing = _dev(np.full(N, rank + 100), rank, np.float32)
        incoming = cudalab.zeros(N, dtype="float32", device=rank)
        with cudalab.comm.group():
            comm.send(outgoing, peer)
            comm.recv(incoming, peer)
        return got.numpy(), incoming.numpy()

    (got0, in0), (got1, in1) = _on_ranks(body)
    assert got0.tolist() == [0.0] * N and got1.tolist() == list(range(N))
    assert in0.tolist() == [101.0] * N and in1.tolist() == [100.0] * N


def test_each_operation_is_an_nvtx_range_and_a_collective_record(fake):
    records = []
    _internal.collective_observers.append(records.append)
    try:
        def body(comm, rank):
            x = cudalab.ones(N, device=rank)
            big = cudalab.zeros(WORLD * N, device=rank)
            comm.all_reduce(x)
            comm.all_gather(x, big)
            comm.reduce_scatter(big, x)
            comm.broadcast(x)
            comm.reduce(x)
            return None

        _on_ranks(body)
    finally:
        _internal.collective_observers.remove(records.append)
    for name, _, ranges in fake.collective_calls():
        assert ranges[-1:] == (f"cudalab.comm.{name}",)
    size = 4 * N
    mine = sorted((r.name, r.algorithm_bytes, r.nranks, r.bus_factor)
                  for r in records if r.devices == (0,))
    assert mine == sorted([("all_reduce", size, 2, 1.0), ("all_gather", 2 * size, 2, 0.5),
                           ("reduce_scatter", 2 * size, 2, 0.5), ("broadcast", size, 2, 1.0),
                           ("reduce", size, 2, 1.0)])
    assert len(records) == 2 * len(mine)
    assert cudalab.nvtx.current_ranges() == ()


def test_work_on_another_stream_records_the_arrays_on_it(fake, monkeypatch):
    recorded = []
    monkeypatch.setattr(DeviceArray, "record_stream",
                        lambda self, stream: recorded.append((self.ptr, stream)))

    def body(comm, rank):
        x = cudalab.ones(N, device=rank)
        y = cudalab.zeros(N, device=rank)
        comm.all_reduce(x, y)  # the current stream: nothing to record
        side = cudalab.Stream(device=rank)
        comm.all_reduce(x, y, stream=side)
        side.synchronize()
        assert fake.collective_calls()[-1][1][-1] is not None
        return x.ptr, y.ptr, side

    results = _on_ranks(body)
    expected = {(x, side) for x, _, side in results} | {(y, side) for _, y, side in results}
    assert len(recorded) == 4 and set(recorded) == expected


@pytest.mark.parametrize("world", [2, 3])
def test_the_gpu_workers_checks_pass_on_the_fake(fake, world, capsys):
    """tests/comm/multiprocess_worker.py's expectations, run here on threads, so the GPU test
    can only fail for what the real NCCL does differently."""
    from tests.comm import multiprocess_worker as worker

    uid = bytes([world]) * 128

    def rank_main(rank):
        with Communicator(rank, world, uid, device=rank % 2) as comm:
            worker.run(comm)

    run_ranks(world, rank_main)
    out = capsys.readouterr().out
    assert out.count("grouped ring exchange ok") == world
    assert out.count("all_reduce on a side stream ok") == world
