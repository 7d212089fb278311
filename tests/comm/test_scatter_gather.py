"""cudalab.comm.scatter and gather on the simulator: values along every dim, views, chunk
rules, streams, torch's errors, the host, records and NVTX ranges."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import cudalab
from cudalab import comm
from cudalab.comm import scatter_gather
from tests.comm.helpers import DTYPES, host_array, on


# --------------------------------------------------------------------------- chunk rule
@pytest.mark.parametrize("size,chunks,expected", [
    (10, 2, [5, 5]), (7, 2, [4, 3]), (5, 4, [2, 2, 1]), (1, 2, [1]), (0, 3, [0, 0, 0]),
    (6, 4, [2, 2, 2]), (9, 1, [9]),
])
def test_chunk_sizes_are_torchs(size, chunks, expected):
    assert scatter_gather.chunk_sizes_of(size, chunks) == expected


# --------------------------------------------------------------------------- scatter values
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim", [((8,), 0), ((6, 5), 0), ((6, 5), 1), ((6, 5), -1),
                                       ((3, 4, 5), 1), ((3, 4, 5), -1), ((3, 4, 5), -3)])
def test_scatter_values(two, dtype, shape, dim):
    host = host_array(shape, dtype)
    src = on(0, host)
    pieces = comm.scatter(src, [0, 1], dim=dim)
    assert type(pieces) is tuple
    expected = np.array_split(host, 2, axis=dim) if host.shape[dim] % 2 == 0 else None
    sizes = scatter_gather.chunk_sizes_of(host.shape[dim], 2)
    starts = np.cumsum([0] + sizes)
    for i, piece in enumerate(pieces):
        want = np.take(host, range(starts[i], starts[i + 1]), axis=dim)
        if expected is not None:
            np.testing.assert_array_equal(expected[i], want)
        assert piece.device_index == i and piece.dtype == src.dtype
        np.testing.assert_array_equal(piece.cpu(), want)


def test_scatter_returns_views_on_the_source_device(two):
    host = host_array((6, 4), "float32")
    src = on(1, host)
    pieces = comm.scatter(src, [0, 1])
    assert pieces[1].ptr == src.ptr + 3 * 4 * 4 and pieces[1].is_contiguous()
    assert pieces[1].base is src
    columns = comm.scatter(src, [1, 0], dim=1)
    assert columns[0].ptr == src.ptr and not columns[0].is_contiguous()
    assert columns[0].strides == (16, 4)
    assert columns[1].ptr != src.ptr and columns[1].is_contiguous()
    np.testing.assert_array_equal(columns[1].numpy(), host[:, 2:])
    np.testing.assert_array_equal(columns[0].cpu(), host[:, :2])


def test_scatter_with_chunk_sizes(two):
    host = host_array((7, 3), "int32")
    pieces = comm.scatter(on(0, host), [1, 0, 1], chunk_sizes=[2, 0, 5])
    assert [p.shape for p in pieces] == [(2, 3), (0, 3), (5, 3)]
    assert [p.device_index for p in pieces] == [1, 0, 1]
    np.testing.assert_array_equal(pieces[0].numpy(), host[:2])
    np.testing.assert_array_equal(pieces[2].numpy(), host[2:])


def test_scatter_chunk_may_give_fewer_pieces_than_devices(two):
    host = np.arange(5.0)
    pieces = comm.scatter(on(1, host), [0, 1, 0, 1])
    assert [p.shape for p in pieces] == [(2,), (2,), (1,)]
    assert [p.device_index for p in pieces] == [0, 1, 0]
    np.testing.assert_array_equal(np.concatenate([p.numpy() for p in pieces]), host)


def test_scatter_from_the_host(two):
    host = host_array((4, 6), "float64")
    pieces = comm.scatter(host, [0, 1], dim=1)
    assert [p.device_index for p in pieces] == [0, 1]
    assert all(p.is_contiguous() for p in pieces)
    np.testing.assert_array_equal(pieces[0].numpy(), host[:, :3])
    np.testing.assert_array_equal(pieces[1].numpy(), host[:, 3:])


def test_scatter_out(two):
    host = host_array((4, 6), "float32")
    outs = [cudalab.empty((4, 1), device=1), cudalab.empty((4, 5), device=0)]
    results = comm.scatter(on(0, host), dim=-1, out=outs)
    assert type(results) is tuple and results[0] is outs[0] and results[1] is outs[1]
    np.testing.assert_array_equal(outs[0].numpy(), host[:, :1])
    np.testing.assert_array_equal(outs[1].numpy(), host[:, 1:])


def test_scatter_on_given_streams(two, sim):
    host = host_array((8,), "float32")
    src = on(0, host)
    s1 = cudalab.Stream(device=1)
    sim.pause_stream(s1.handle)
    try:
        pieces = comm.scatter(src, [0, 1], streams=[None, s1])
        assert pieces[1].stream is s1  # allocated and copied under s1
        assert not s1.query() and cudalab.current_stream(1).query()
        assert cudalab.current_stream(1) is cudalab.default_stream(1)  # restored
    finally:
        sim.resume_stream(s1.handle)
    np.testing.assert_array_equal(pieces[1].numpy(), host[4:])


def test_scatter_on_the_current_stream(two, sim):
    src = on(0, np.arange(8.0))
    s1 = cudalab.Stream(device=1)
    cudalab.set_stream(s1)
    cudalab.set_device(0)
    sim.pause_stream(s1.handle)
    try:
        pieces = comm.scatter(src, [0, 1])
        assert pieces[1].stream is s1 and not s1.query()
        # torch's order: the copy runs on the source device's current stream after the work
        # queued so far on the destination's (the paused s1), which then waits for the copy
        assert not cudalab.current_stream(0).query()
    finally:
        sim.resume_stream(s1.handle)
    np.testing.assert_array_equal(pieces[1].numpy(), np.arange(4.0, 8.0))


# --------------------------------------------------------------------------- scatter errors
@pytest.mark.parametrize("kwargs,error,message", [
    (dict(devices=[]), RuntimeError, r"^Expected at least one device to scatter to$"),
    (dict(devices=[0, 1], chunk_sizes=[4]), RuntimeError,
     r"^Expected devices and chunk_sizes to be of same length, but got len\(devices\) = 2 and "
     r"len\(chunk_sizes\) = 1$"),
    (dict(devices=[0, 1], chunk_sizes=[5, 0]), RuntimeError,
     r"^split_with_sizes expects split_sizes to sum exactly to 4 \(input tensor's size at "
     r"dimension 0\), but got split_sizes=\[5, 0\]$"),
    (dict(devices=[0, 1], chunk_sizes=[5, -1]), RuntimeError,
     r"^split_with_sizes expects split_sizes have only non-negative entries, but got "
     r"split_sizes=\[5, -1\]$"),
    (dict(devices=[0, 1], dim=2), IndexError,
     r"^Dimension out of range \(expected to be in range of \[-2, 1\], but got 2\)$"),
    (dict(devices=[0, -1]), RuntimeError, r"^Expected non-negative device index, but got -1$"),
    (dict(devices=[0, 1], streams=[None, cudalab.Stream]), RuntimeError,
     r"^Expected the device associated with the stream at index 1 \(was 0\) to match the "
     r"device supplied at that index \(expected 1\)$"),
    (dict(devices=[0], out=[]), RuntimeError,
     r"^'devices' must not be specified when 'out' is specified, but got devices=\[0\]$"),
    (dict(chunk_sizes=[4], out=[]), RuntimeError,
     r"^'chunk_sizes' must not be specified when 'out' is specified, but got "
     r"chunk_sizes=\[4\]$"),
    (dict(out=[]), RuntimeError, r"^Expected at least one output tensor to scatter to$"),
    (dict(out=["host"]), RuntimeError,
     r"^Expected all output tensors to be CUDA tensors, but output tensor at index 0 has "
     r"device 'cpu'$"),
    (dict(out=[(4, 2), (3,)]), RuntimeError,
     r"^Output tensor at index 1 has incorrect shape: \[3\]. Expected same shape except for "
     r"scatter dim 0 as the source tensor: \[4, 2\]$"),
    (dict(out=[(3, 1), (4, 1)], dim=1), RuntimeError,
     r"^Output tensor at index 0 has incorrect shape: \[3, 1\]. Expected same shape except for "
     r"scatter dim 1 as the source tensor: \[4, 2\]$"),
    (dict(out=[(1, 2), (2, 2)]), RuntimeError,
     r"^Total size for output tensors along scatter dim 0 does not match the source tensor size "
     r"at dim 0. Expected 4, but got total size 3$"),
])
def test_scatter_errors(two, records, kwargs, error, message):
    src = on(0, np.zeros((4, 2), np.float32))
    if kwargs.get("streams"):
        kwargs["streams"] = [None, cudalab.Stream(device=0)]
    if "out" in kwargs:
        kwargs["out"] = [np.zeros((4, 2), np.float32) if o == "host" else
                         cudalab.empty(o, device=1) for o in kwargs["out"]]
    before = cudalab.memory_stats(1)["allocation.all.allocated"]
    with pytest.raises(error, match=message):
        comm.scatter(src, **kwargs)
    assert cudalab.memory_stats(1)["allocation.all.allocated"] == before  # nothing copied
    assert records == [] and cudalab.nvtx.current_ranges() == ()


def test_scatter_of_a_0d_array(two):
    with pytest.raises(RuntimeError, match=r"^chunk expects at least a 1-dimensional tensor$"):
        comm.scatter(on(0, np.float32(1)), [0, 1])
    with pytest.raises(RuntimeError, match=r"^split expects at least a 1-dimensional tensor$"):
        comm.scatter(on(0, np.float32(1)), [0], chunk_sizes=[1])


# --------------------------------------------------------------------------- gather values
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes,dim", [([(3,), (5,)], 0), ([(2, 4), (3, 4)], 0),
                                        ([(4, 2), (4, 3)], 1), ([(4, 2), (4, 3)], -1),
                                        ([(2, 3, 1), (2, 3, 4)], 2), ([(1, 3, 2), (2, 3, 2)], -3),
                                        ([(2, 0), (2, 3)], 1)])
@pytest.mark.parametrize("destination", [0, 1])
def test_gather_values(two, dtype, shapes, dim, destination):
    hosts = [host_array(s, dtype, i) for i, s in enumerate(shapes)]
    arrays = [on(i % 2, h) for i, h in enumerate(hosts)]
    result = comm.gather(arrays, dim=dim, destination=destination)
    assert result.device_index == destination and result.is_contiguous()
    np.testing.assert_array_equal(result.numpy(), np.concatenate(hosts, axis=dim))


def test_gather_of_three_to_the_current_device_with_a_strided_input(two):
    host = host_array((4, 6), "float32")
    base = on(1, host)
    column = scatter_gather._common.narrow(base, 1, 1, 2)  # a strided (4, 2) view
    arrays = [on(0, np.ones((4, 1), np.float32)), column, on(1, np.zeros((4, 3), np.float32))]
    cudalab.set_device(1)
    result = comm.gather(arrays, dim=1)
    assert result.device_index == 1 and result.shape == (4, 6)
    np.testing.assert_array_equal(result.numpy(), np.concatenate(
        [np.ones((4, 1)), host[:, 1:3], np.zeros((4, 3))], axis=1))


@pytest.mark.parametrize("destination", ["cpu", -1])
def test_gather_to_the_host(two, destination):
    hosts = [host_array((2, 3), "int64", 0), host_array((2, 2), "int64", 1)]
    arrays = [on(0, hosts[0]), on(1, hosts[1])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = comm.gather(arrays, dim=1, destination=destination)
    assert isinstance(result, np.ndarray)
    np.testing.assert_array_equal(result, np.concatenate(hosts, axis=1))
    deprecations = [w for w in caught if issubclass(w.category, FutureWarning)]
    if destination == -1:
        assert len(deprecations) == 1 and deprecations[0].filename == __file__
        assert str(deprecations[0].message) == (
            'Using -1 to represent CPU tensor is deprecated. Please use a device object or '
            'string instead, e.g., "cpu".')
    else:
        assert deprecations == []


def test_gather_out(two):
    hosts = [host_array((3, 2), "float32", 0), host_array((3, 1), "float32", 1)]
    arrays = [on(0, hosts[0]), on(1, hosts[1])]
    expected = np.concatenate(hosts, axis=1)
    out = cudalab.empty((3, 3), device=0)
    assert comm.gather(arrays, dim=1, out=out) is out
    np.testing.assert_array_equal(out.numpy(), expected)
    host_out = np.zeros((3, 3), np.float64)  # the host, and a dtype conversion
    assert comm.gather(arrays, dim=1, out=host_out) is host_out
    np.testing.assert_array_equal(host_out, expected)


def test_gather_result_is_on_the_current_stream(two, sim):
    arrays = [on(0, np.ones(4)), on(1, np.zeros(4))]
    s1 = cudalab.Stream(device=1)
    cudalab.set_stream(s1)
    sim.pause_stream(s1.handle)
    try:
        result = comm.gather(arrays, destination=1)
        assert result.stream is s1 and not s1.query()
    finally:
        sim.resume_stream(s1.handle)
    np.testing.assert_array_equal(result.numpy(), [1, 1, 1, 1, 0, 0, 0, 0])


def _recorded_copies(backend, monkeypatch, fail_local=False):
    """Record the copies and the waits a gather makes (each still made, unless failing)."""
    calls = []
    inside = []  # (the simulator's memcpy_ordered makes its calls through the two below)
    ordered, local, wait = (backend.memcpy_ordered, backend.memcpy_async,
                            backend.stream_wait_event)

    def memcpy_ordered(dst, src, nbytes, copy_device, *args, join=True):
        calls.append(("peer copy", copy_device, join))
        inside.append(True)
        try:
            ordered(dst, src, nbytes, copy_device, *args, join=join)
        finally:
            inside.pop()

    def memcpy_async(device, dst, src, nbytes, stream):
        if not inside:
            calls.append(("local copy", device) if stream == cudalab.current_stream(device).handle
                         else ("local copy on", stream))
            if fail_local:
                raise cudalab.CudaError(700, "CUDA_ERROR_ILLEGAL_ADDRESS",
                                        "the local copy failed")
        local(device, dst, src, nbytes, stream)

    def stream_wait_event(stream, event, *args):
        if not inside:
            calls.append(("wait", stream))
        wait(stream, event, *args)

    def event_record(event, stream):
        if not inside:
            calls.append(("record", stream))
        record(event, stream)

    record = backend.event_record
    monkeypatch.setattr(backend, "event_record", event_record)
    monkeypatch.setattr(backend, "memcpy_ordered", memcpy_ordered)
    monkeypatch.setattr(backend, "memcpy_async", memcpy_async)
    monkeypatch.setattr(backend, "stream_wait_event", stream_wait_event)
    return calls


@pytest.fixture
def overlapping(two, backend, monkeypatch):
    """Two devices whose gathers overlap their copies at any size (device 1 can write
    device 0's memory); returns cudalab._array_memory."""
    if not backend.can_access_peer(1, 0):
        pytest.skip("these devices have no peer access")
    from cudalab import _array_memory

    monkeypatch.setattr(_array_memory, "OVERLAP_MIN_BYTES", 16)
    return _array_memory


def test_gather_copies_run_beside_one_another(overlapping, backend, monkeypatch):
    arrays = [on(0, np.arange(4.0)), on(1, np.arange(4.0, 8.0)), on(0, np.arange(8.0, 10.0))]
    comm.gather(arrays)  # (peer access enabled, streams made)
    calls = _recorded_copies(backend, monkeypatch)
    with cudalab.stream(cudalab.Stream(device=0)):  # (not the legacy default stream)
        result = comm.gather(arrays, destination=0)
        destination = cudalab.current_stream(0).handle
    # torch's copy_ calls would make each copy wait for the one before; here the peer's copy
    # comes first without the destination's wait for it, then the local copies, then that
    # wait (after which the destination's stream has every copy behind it)
    assert calls == [("peer copy", 1, False), ("local copy", 0), ("local copy", 0),
                     ("wait", destination)]
    np.testing.assert_array_equal(result.numpy(), np.arange(10.0))


def test_gather_between_legacy_default_streams_copies_locally_on_a_side_stream(
        overlapping, backend, monkeypatch):
    arrays = [on(0, np.arange(4.0)), on(1, np.arange(4.0, 8.0))]
    comm.gather(arrays)
    side = overlapping._side_stream(0).handle
    destination = cudalab.current_stream(0)
    assert destination.is_legacy_null  # (the legacy default stream)
    calls = _recorded_copies(backend, monkeypatch)
    result = comm.gather(arrays, destination=0)
    # the side stream starts where the peer's copy starts, and the destination's stream
    # waits for both
    assert calls == [("peer copy", 1, False), ("wait", side), ("local copy on", side),
                     ("record", side), ("wait", destination.handle),
                     ("wait", destination.handle)]
    np.testing.assert_array_equal(result.numpy(), np.arange(8.0))
    # a current stream of its own on the destination: its copies stay on it
    with cudalab.stream(cudalab.Stream(device=0)):
        del calls[:]
        result = comm.gather(arrays, destination=0)
        assert calls[:2] == [("peer copy", 1, False), ("local copy", 0)]
    np.testing.assert_array_equal(result.numpy(), np.arange(8.0))


def test_a_failed_gather_copy_still_leaves_the_destination_waiting(overlapping, backend,
                                                                  monkeypatch):
    arrays = [on(0, np.arange(4.0)), on(1, np.arange(4.0, 8.0))]
    comm.gather(arrays)
    side = overlapping._side_stream(0).handle
    calls = _recorded_copies(backend, monkeypatch, fail_local=True)
    with pytest.raises(cudalab.CudaError, match="the local copy failed"):
        comm.gather(arrays, destination=0)
    # the peer's copy and the side stream may still be writing into the freed result: the
    # destination's stream waits for both
    destination = cudalab.current_stream(0).handle
    assert calls == [("peer copy", 1, False), ("wait", side), ("local copy on", side),
                     ("record", side), ("wait", destination), ("wait", destination)]


def test_small_gathers_copy_in_torchs_order(two, backend, monkeypatch):
    if not backend.can_access_peer(1, 0):
        pytest.skip("these devices have no peer access")
    arrays = [on(0, np.arange(4.0)), on(1, np.arange(4.0, 8.0))]
    comm.gather(arrays)
    calls = _recorded_copies(backend, monkeypatch)
    result = comm.gather(arrays, destination=0)  # (far below OVERLAP_MIN_BYTES)
    assert calls == [("local copy", 0), ("peer copy", 1, True)]
    np.testing.assert_array_equal(result.numpy(), np.arange(8.0))


# --------------------------------------------------------------------------- gather errors
def test_gather_errors(two, records):
    a, b = on(0, np.ones((2, 3))), on(1, np.ones((2, 4)))
    cases = [
        (dict(arrays=[]), RuntimeError, r"^Expected at least one tensor to gather from$"),
        (dict(arrays=[a, np.ones((2, 3))]), RuntimeError,
         r"^Expected all input tensors to be CUDA tensors, but tensor at index 1 has device cpu$"),
        (dict(arrays=[a, np.ones((2, 3))], out="ok"), RuntimeError,
         r"^Expected all input tensors to be CUDA tensors, but tensor at index 1 has device "
         r"'cpu'$"),
        (dict(arrays=[a, on(1, np.ones(3))]), RuntimeError,
         r"^Expected all input tensors to have the same number of dimensions, but tensor at "
         r"index 1has 1 dimensions, \(expected 2\)$"),
        (dict(arrays=[a, b]), RuntimeError,
         r"^Input tensor at index 1 has invalid shape \[2, 4\], but expected \[2, 3\]$"),
        (dict(arrays=[a, b], dim=2), IndexError,
         r"^Dimension out of range \(expected to be in range of \[-2, 1\], but got 2\)$"),
        (dict(arrays=[a, b], dim=1, destination=0, out="ok"), RuntimeError,
         r"^'destination' must not be specified when 'out' is specified, but got "
         r"destination=0$"),
        (dict(arrays=[a, b], dim=1, out=(2, 6)), RuntimeError,
         r"^Expected out tensor to have shape \[2, 7\], but got \[2, 6\]$"),
    ]
    for kwargs, error, message in cases:
        if "out" in kwargs:
            kwargs["out"] = cudalab.empty((2, 7) if kwargs["out"] == "ok" else kwargs["out"])
        arrays = kwargs.pop("arrays")
        with pytest.raises(error, match=message):
            comm.gather(arrays, **kwargs)
    assert records == [] and cudalab.nvtx.current_ranges() == ()


# --------------------------------------------------------------------------- accounting, records
def test_scatter_gather_allocations(two):
    src = on(0, np.zeros((4, 256), np.float32))  # 4 KiB
    before = cudalab.memory_allocated(1)
    pieces = comm.scatter(src, [0, 1])
    assert cudalab.memory_allocated(1) - before == 2048
    result = comm.gather(pieces, destination=1)
    assert cudalab.memory_allocated(1) - before == 2048 + 4096
    del pieces, result
    assert cudalab.memory_allocated(1) == before


def test_scatter_gather_records_and_ranges(two, records):
    src = on(0, np.zeros((4, 8), np.float32))
    pieces = comm.scatter(src, [0, 1])
    comm.scatter(src.numpy(), [1])
    comm.gather(pieces, destination=1)
    comm.gather(pieces, destination="cpu")
    got = [(r.name, r.algorithm_bytes, r.nranks, r.bus_factor, r.devices, ranges)
           for r, ranges in records]
    assert got == [
        ("comm.scatter", 128, 2, 0.5, (0, 1), ("comm.scatter",)),
        ("comm.scatter", 128, 1, 0.0, (1,), ("comm.scatter",)),
        ("comm.gather", 128, 2, 0.5, (0, 1), ("comm.gather",)),
        ("comm.gather", 128, 2, 0.5, (0, 1), ("comm.gather",)),
    ]
