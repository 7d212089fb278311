"""The plain-case paths of cudalab.comm (contiguous arrays cut or joined along dimension 0,
reduce_add and broadcast through ``cudalab.nccl.clique_call``, the cached clique's runner): they must be taken where
they apply, give what the general paths give (numpy is the reference), keep torch's stream
ordering, and report to the stream sanitizer what they read and write."""

from __future__ import annotations

import numpy as np
import pytest

import cudalab
from cudalab import collective_call, comm, nccl
from cudalab.comm import scatter_gather
from cudalab.sanitizer import StreamRaceError

from .helpers import on


@pytest.fixture
def spies(monkeypatch):
    """Count the calls of the plain-case paths."""
    calls = {"scatter": 0, "gather": 0, "nccl": []}
    scatter_rows, gather_rows = scatter_gather._scatter_rows, scatter_gather._gather_rows
    clique_call = nccl.clique_call

    def spy_scatter(*args):
        calls["scatter"] += 1
        return scatter_rows(*args)

    def spy_gather(*args):
        result = gather_rows(*args)
        calls["gather"] += result is not None
        return result

    def spy_issue(kind, *args, **kwargs):
        calls["nccl"].append(collective_call.CALL_NAMES[kind])
        return clique_call(kind, *args, **kwargs)

    monkeypatch.setattr(scatter_gather, "_scatter_rows", spy_scatter)
    monkeypatch.setattr(scatter_gather, "_gather_rows", spy_gather)
    monkeypatch.setattr(nccl, "clique_call", spy_issue)
    return calls


# --------------------------------------------------------------------------- scatter
@pytest.mark.parametrize("shape", [(8,), (5, 3), (2, 3, 4), (1, 2), (0, 3), (4, 0)])
@pytest.mark.parametrize("source", [0, 1])
def test_scatter_rows_values(two, spies, shape, source):
    host = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    src = on(source, host)
    pieces = comm.scatter(src, devices=[0, 1])
    assert spies["scatter"] == 1
    expected = np.array_split(host, 2)[:len(pieces)] if shape[0] else [host[:0], host[:0]]
    sizes = scatter_gather.chunk_sizes_of(shape[0], 2)
    assert [p.shape[0] for p in pieces] == sizes
    start = 0
    for piece, device, size in zip(pieces, (0, 1), sizes):
        assert piece.device_index == device and piece.dtype == np.int64
        np.testing.assert_array_equal(piece.numpy(), host[start:start + size])
        if device == source:
            assert piece.ptr == src.ptr + start * host[:1].nbytes  # a view of the source
        start += size
    assert len(expected) == len(pieces)


def test_scatter_rows_with_fewer_pieces_than_devices_and_repeats(two, spies):
    host = np.arange(6.0)
    pieces = comm.scatter(on(1, host), devices=[0, 0, 1, 0, 1, 0, 1])  # chunk: 6 pieces of 1
    assert spies["scatter"] == 1 and len(pieces) == 6
    assert [p.device_index for p in pieces] == [0, 0, 1, 0, 1, 0]
    np.testing.assert_array_equal(np.concatenate([p.numpy() for p in pieces]), host)


def test_scatter_general_cases_do_not_take_the_rows_path(two, spies):
    host = np.arange(12.0).reshape(3, 4)
    comm.scatter(on(0, host), devices=[0, 1], dim=1)
    comm.scatter(on(0, host), devices=[0, 1], chunk_sizes=[1, 2])
    comm.scatter(host, devices=[0, 1])  # a host source
    strided = on(0, np.arange(24.0).reshape(3, 8)).narrow(1, 2, 4)
    assert not strided.is_contiguous()
    pieces = comm.scatter(strided, devices=[1, 0])
    assert spies["scatter"] == 0
    np.testing.assert_array_equal(pieces[0].numpy(), np.arange(24.0).reshape(3, 8)[:2, 2:6])


# --------------------------------------------------------------------------- gather
@pytest.mark.parametrize("shapes", [[(4,), (2,)], [(2, 3), (0, 3), (5, 3)], [(1, 2, 2)] * 3])
@pytest.mark.parametrize("destination", [0, 1, None])
def test_gather_rows_values(two, spies, shapes, destination):
    hosts = [np.full(shape, float(i + 1)) for i, shape in enumerate(shapes)]
    arrays = [on(i % 2, h) for i, h in enumerate(hosts)]
    cudalab.set_device(1)
    result = comm.gather(arrays, destination=destination)
    assert spies["gather"] == 1
    assert result.device_index == (1 if destination is None else destination)
    np.testing.assert_array_equal(result.numpy(), np.concatenate(hosts))


def test_gather_rows_of_a_1d_list_along_minus_one(two, spies):
    result = comm.gather([on(0, np.arange(3.0)), on(1, np.arange(3.0, 5.0))], dim=-1,
                         destination=0)
    assert spies["gather"] == 1
    np.testing.assert_array_equal(result.numpy(), np.arange(5.0))


def test_gather_general_cases_do_not_take_the_rows_path(two, spies):
    a, b = on(0, np.ones((2, 3))), on(1, np.zeros((2, 3)))
    comm.gather([a, b], dim=1, destination=0)
    comm.gather([a, b], destination="cpu")
    comm.gather([a, on(1, np.zeros((2, 3), np.float32))], destination=0)  # two dtypes
    comm.gather([a, b], out=cudalab.empty((4, 3), dtype=np.float64, device=1))
    assert spies["gather"] == 0


def test_gather_rows_errors_are_torchs(two):
    with pytest.raises(RuntimeError, match="Input tensor at index 1 has invalid shape"):
        comm.gather([on(0, np.ones((2, 3))), on(1, np.ones((2, 4)))], destination=0)
    with pytest.raises(ValueError):
        comm.gather([on(0, np.ones(2)), on(1, np.ones(2))], destination=7)


# --------------------------------------------------------------------------- NCCL branches
def test_reduce_add_and_broadcast_go_through_clique_call(two, spies):
    if not nccl.is_available([on(0, np.ones(1)), on(1, np.ones(1))]):
        pytest.skip("NCCL is not loadable here")
    x0, x1 = on(0, np.arange(4.0)), on(1, np.full(4, 10.0))
    total = comm.reduce_add([x1, x0], destination=0)
    np.testing.assert_array_equal(total.numpy(), np.arange(4.0) + 10.0)
    assert total.device_index == 0
    x2 = on(0, np.arange(4.0))
    outs = [cudalab.empty(4, dtype=np.float64, device=1),
            cudalab.empty(4, dtype=np.float64, device=1)]
    comm.broadcast(x2, out=outs[:1])  # one destination: a peer copy, not NCCL
    assert spies["nccl"] == ["reduce"]
    np.testing.assert_array_equal(outs[0].numpy(), np.arange(4.0))
    mixed = [on(0, np.ones(4)), on(1, np.ones(4, np.float32))]
    with pytest.raises(RuntimeError, match="same Tensor dtype"):  # torch's error, from nccl.reduce
        comm.reduce_add(mixed, destination=0)
    assert spies["nccl"] == ["reduce"]


def test_the_sanitizer_sees_the_copies_and_their_ordering(two):
    src = on(0, np.arange(8.0))
    with cudalab.sanitizer.sanitize(on_race="raise"):
        pieces = comm.scatter(src, [0, 1])
        gathered = comm.gather([src, pieces[1]], destination=1)
        total = comm.reduce_add([src, on(1, np.ones(8))], destination=0)
        copies = comm.broadcast(src, devices=[1])
        (gathered + 1).numpy()  # on the current streams: ordered, no finding
        (total * 2).numpy()
        copies[0].numpy()
        side = cudalab.Stream(device=1)
        with cudalab.stream(side):  # the result is allocated and ordered on side: no finding
            ordered = comm.broadcast(src, devices=[1])[0]
            ordered.fill_(0.0)
        fresh = comm.broadcast(src, devices=[1])[0]  # ordered with cuda:1's default stream
        with cudalab.stream(side), pytest.raises(StreamRaceError):
            fresh.fill_(0.0)  # ... but written on side, which never waited for the copy
