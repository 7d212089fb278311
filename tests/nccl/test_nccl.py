"""cudalab.nccl (torch.cuda.nccl's list API): values, in-place forms, torch's checks and
messages, the communicator cache, stream order, observers, NVTX and the sanitizer hook.

Most tests need two devices (the simulator has two); those that use simulator-only hooks or
the simulator's NCCL skip on a real GPU (tests/nccl/test_gpu.py covers the real NCCL).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import cudalab
from cudalab import _internal, _observe, collective_call, nccl
from cudalab import nvtx as cudalab_nvtx
from cudalab.errors import NcclError, StreamDeviceError
from tests.helpers.gpu import HAS_GPU

ROOT = Path(__file__).resolve().parents[2]
sim_only = pytest.mark.skipif(HAS_GPU, reason="the simulator's NCCL and test hooks")

DTYPES = ["float32", "float64", "float16", "int32", "int64", "int8", "uint8", "bfloat16"]


@pytest.fixture
def two():
    """Two devices with NCCL (skips otherwise); the communicator cache is emptied after."""
    if cudalab.device_count() < 2:
        pytest.skip("needs two devices")
    if not nccl.is_available([]):
        pytest.skip("NCCL is not available (nccl4py missing)")
    yield (0, 1)
    nccl.destroy_communicators()


def _dtype(name):
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _host(rank, n, dtype, low=1):
    """Small exactly representable values, different per rank."""
    return (np.arange(n) % 5 + low + rank).astype(dtype)


def _dev(values, device):
    return cudalab.asarray(values, device=device)


REFERENCE = {nccl.SUM: np.add, nccl.PROD: np.multiply, nccl.MAX: np.maximum,
             nccl.MIN: np.minimum}


# ------------------------------------------------------------------------------ values
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [nccl.SUM, nccl.PROD, nccl.MAX, nccl.MIN, nccl.AVG])
def test_all_reduce_values(two, dtype, op):
    dt = _dtype(dtype)
    if op == nccl.AVG and dt.kind in "iu":
        pytest.skip("avg of integers: NCCL's SumPostDiv, covered by the seam tests")
    host = [_host(r, 10, dt) for r in two]
    arrays = [_dev(h, d) for h, d in zip(host, two)]
    nccl.all_reduce(arrays, op=op)
    if op == nccl.AVG:
        expected = ((host[0].astype(np.float64) + host[1]) / 2).astype(dt)
    else:
        expected = REFERENCE[op](host[0], host[1]).astype(dt)
    for a in arrays:
        np.testing.assert_array_equal(a.numpy().astype(np.float64), expected.astype(np.float64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_into_outputs_leaves_inputs(two, dtype):
    dt = _dtype(dtype)
    host = [_host(r, 7, dt) for r in two]
    ins = [_dev(h, d) for h, d in zip(host, two)]
    outs = [cudalab.zeros(7, dtype=dt, device=d) for d in two]
    nccl.all_reduce(tuple(ins), outs)
    for a, h, o in zip(ins, host, outs):
        np.testing.assert_array_equal(a.numpy().astype(np.float64), h.astype(np.float64))
        np.testing.assert_array_equal(o.numpy().astype(np.float64),
                                      (host[0] + host[1]).astype(dt).astype(np.float64))


def test_all_reduce_of_bool_sums_bytes(two):
    arrays = [_dev(np.array([True, False, True]), d) for d in two]
    nccl.all_reduce(arrays)
    assert arrays[0].view(np.uint8).numpy().tolist() == [2, 0, 2]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("root", [0, 1])
def test_broadcast(two, dtype, root):
    dt = _dtype(dtype)
    host = [_host(r, 9, dt) for r in two]
    arrays = [_dev(h, d) for h, d in zip(host, two)]
    nccl.broadcast(arrays, root=root)
    for a in arrays:
        np.testing.assert_array_equal(a.numpy().astype(np.float64), host[root].astype(np.float64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("root", [0, 1])
def test_reduce_in_place_and_into_output(two, dtype, root):
    dt = _dtype(dtype)
    host = [_host(r, 6, dt) for r in two]
    expected = (host[0] + host[1]).astype(dt).astype(np.float64)
    arrays = [_dev(h, d) for h, d in zip(host, two)]
    nccl.reduce(arrays, root=root)
    np.testing.assert_array_equal(arrays[root].numpy().astype(np.float64), expected)
    other = 1 - root
    np.testing.assert_array_equal(arrays[other].numpy().astype(np.float64),
                                  host[other].astype(np.float64))
    arrays = [_dev(h, d) for h, d in zip(host, two)]
    out = cudalab.zeros(6, dtype=dt, device=two[root])
    nccl.reduce(arrays, out, root=root, op=nccl.MAX)
    np.testing.assert_array_equal(out.numpy().astype(np.float64),
                                  np.maximum(host[0], host[1]).astype(np.float64))


def test_reduce_deprecated_output_lists(two):
    arrays = [_dev(np.ones(3, np.float32), d) for d in two]
    outs = [cudalab.zeros(3, device=d) for d in two]
    with pytest.warns(FutureWarning, match="with an output tensor list is deprecated"):
        nccl.reduce(arrays, outputs=outs, root=1)
    assert outs[1].numpy().tolist() == [2, 2, 2] and outs[0].numpy().tolist() == [0, 0, 0]
    with pytest.warns(FutureWarning, match="Please specify a single output tensor."):
        nccl.reduce(arrays, outs, root=0)
    assert outs[0].numpy().tolist() == [2, 2, 2]
    with pytest.raises(ValueError, match="'output' and 'outputs' can not be both specified"):
        nccl.reduce(arrays, outs[0], outputs=outs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather(two, dtype):
    dt = _dtype(dtype)
    host = [_host(r, 5, dt) for r in two]
    ins = [_dev(h, d) for h, d in zip(host, two)]
    outs = [cudalab.zeros(10, dtype=dt, device=d) for d in two]
    nccl.all_gather(ins, outs)
    for o in outs:
        np.testing.assert_array_equal(o.numpy().astype(np.float64),
                                      np.concatenate(host).astype(np.float64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [nccl.SUM, nccl.MIN])
def test_reduce_scatter(two, dtype, op):
    dt = _dtype(dtype)
    host = [_host(r, 8, dt) for r in two]
    ins = [_dev(h, d) for h, d in zip(host, two)]
    outs = [cudalab.zeros(4, dtype=dt, device=d) for d in two]
    nccl.reduce_scatter(ins, outs, op=op)
    total = REFERENCE[op](host[0], host[1]).astype(dt).astype(np.float64)
    for r, o in enumerate(outs):
        np.testing.assert_array_equal(o.numpy().astype(np.float64), total[4 * r:4 * r + 4])


def test_a_set_of_inputs_works(two):
    arrays = [_dev(np.full(4, d + 1.0, np.float32), d) for d in two]
    nccl.all_reduce(set(arrays))
    assert arrays[0].numpy().tolist() == [3.0] * 4


def test_empty_arrays_are_fine(two):
    arrays = [cudalab.empty(0, device=d) for d in two]
    nccl.all_reduce(arrays)
    nccl.broadcast(arrays)


# ------------------------------------------------------------------------------ torch's checks
def test_collective_errors_need_a_collection(two):
    t = cudalab.zeros(10, device=0)
    for call in (lambda: nccl.all_reduce(t), lambda: nccl.reduce(t), lambda: nccl.broadcast(t),
                 lambda: nccl.all_gather(t, t), lambda: nccl.reduce_scatter(t, t)):
        with pytest.raises(TypeError, match="Inputs should be a collection of tensors"):
            call()


def _strided(a):
    """A non-contiguous view (every other element) of DeviceArray ``a``, through CAI."""
    class View:
        __cuda_array_interface__ = {"version": 3, "shape": (a.size // 2,),
                                    "typestr": a.dtype.str, "data": (a.ptr, False),
                                    "strides": (2 * a.itemsize,), "stream": None}
    return View()


def test_torch_error_messages(two):
    f32 = [cudalab.zeros(4, device=d) for d in two]
    cases = [
        (lambda: nccl.all_reduce([]), "input sequence can't be empty"),
        (lambda: nccl.all_reduce(f32, f32[:1]),
         "inputs and outputs sequences have to be of the same length, but got input of length "
         "2 and output of length 1"),
        (lambda: nccl.all_reduce([f32[0], np.zeros(4, np.float32)]),
         "input and output elements have to be cuda dense Tensors"),
        (lambda: nccl.all_reduce([f32[0], cudalab.zeros(4, dtype=np.float64, device=1)]),
         "all inputs and outputs must be of the same Tensor dtype \\(got float32 and "
         "float64\\)"),
        (lambda: nccl.all_reduce([f32[0], _strided(cudalab.zeros(8, device=1))]),
         "all inputs and outputs have to be contiguous"),
        (lambda: nccl.all_reduce([f32[0], cudalab.zeros(5, device=1)]),
         "all inputs must have the same number of elements"),
        (lambda: nccl.all_reduce(f32, [f32[0], cudalab.zeros(4, device=0)]),
         "input and output must be on the same device"),
        (lambda: nccl.all_gather(f32, f32), "output must be of size input_size \\* size_multiplier"),
        (lambda: nccl.reduce_scatter(f32, [cudalab.zeros(4, device=d) for d in two]),
         "output must be of size input_size \\* size_multiplier"),
        (lambda: nccl.all_reduce([f32[0], cudalab.zeros(4, device=0)]),
         "inputs must be on unique devices"),
        (lambda: nccl.broadcast(f32, root=2), "invalid root"),
        (lambda: nccl.broadcast([], root=0), "invalid root"),
        (lambda: nccl.reduce(f32, f32[0], root=-1), "invalid root"),
        (lambda: nccl.all_reduce(f32, streams=[None]),
         "number of streams is not equal to number of inputs"),
        (lambda: nccl.all_reduce(f32, comms=[object()]),
         "number of communicators is not equal to number of inputs"),
        (lambda: nccl.all_reduce([cudalab.zeros(4, dtype=np.int16, device=d) for d in two]),
         "Unconvertible NCCL type int16"),
        (lambda: nccl.reduce(f32, cudalab.zeros(3, device=0)),
         "output must be of size input_size \\* size_multiplier"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=f"^{message}$"):
            call()


def test_non_arrays_are_type_errors(two):
    with pytest.raises(TypeError, match=r"expected Tensor at 1 \(got int\)"):
        nccl.all_reduce([cudalab.zeros(2, device=0), 3])
    with pytest.raises(TypeError, match=r"expected Tensor \(got float\)"):
        nccl.reduce([cudalab.zeros(2, device=d) for d in (0, 1)], 3.0)


def test_stream_on_the_wrong_device_is_refused_before_launch(two):
    arrays = [_dev(np.ones(2, np.float32), d) for d in two]
    with pytest.raises(RuntimeError, match=r"^nccl.all_reduce\(\): the stream at index 1 is on "
                                           r"cuda:0, but input 1 is on cuda:1$") as info:
        nccl.all_reduce(arrays, streams=[None, cudalab.Stream(0)])
    # the one stream check of the collectives (Communicator's too): a ValueError as well
    assert type(info.value) is StreamDeviceError and isinstance(info.value, ValueError)
    assert arrays[0].numpy().tolist() == [1, 1]


# ------------------------------------------------------------------------------ availability
def test_is_available_cases(two):
    a0, a1 = cudalab.zeros(4, device=0), cudalab.zeros(4, device=1)
    assert nccl.is_available([a0, a1]) and nccl.is_available((a1, a0))
    assert not nccl.is_available([a0, cudalab.zeros(4, device=0)])  # repeated device
    assert not nccl.is_available([a0, np.zeros(4)])  # host memory
    assert not nccl.is_available([a0, _strided(cudalab.zeros(8, device=1))])  # strided
    assert not nccl.is_available([a0, 5])
    assert not nccl.is_available(5)


def test_is_available_is_false_without_nccl(two, monkeypatch):
    b = _internal.backend()

    def missing():
        raise NcclError("NCCL is not available: the 'nccl4py' package is not installed "
                        "(pip install 'cudalab[nccl]')", None)

    monkeypatch.setattr(b, "nccl", missing)
    monkeypatch.setattr(nccl, "_probe", None)
    assert nccl.is_available([cudalab.zeros(1, device=0)]) is False
    with pytest.raises(NcclError, match="nccl4py"):
        nccl.version()
    monkeypatch.setattr(nccl, "_probe", None)


def test_version_and_unique_id(two):
    v = nccl.version()
    assert isinstance(v, tuple) and len(v) == 3 and v[0] >= 2
    uid = nccl.unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128


@sim_only
def test_simulated_version(two):
    assert nccl.version() == (2, 28, 5)


# ------------------------------------------------------------------------------ cache
def test_communicator_cache(two):
    arrays = [_dev(np.ones(2, np.float32), d) for d in two]
    nccl.all_reduce(arrays)
    first = collective_call.cached_cliques()[(0, 1)]
    nccl.all_reduce(arrays)
    assert collective_call.cached_cliques()[(0, 1)] is first
    nccl.all_reduce(arrays[::-1])
    reverse = collective_call.cached_cliques()[(1, 0)]
    assert reverse is not first and len(collective_call.cached_cliques()) == 2
    n = _internal.backend().nccl()
    assert [n.comm_device(c) for c in reverse] == [1, 0]
    nccl.destroy_communicators()
    assert collective_call.cached_cliques() == {}
    with pytest.raises(NcclError, match="destroyed"):
        n.comm_rank(first[0])
    nccl.all_reduce(arrays)  # fresh communicators
    assert collective_call.cached_cliques()[(0, 1)] is not first
    assert arrays[0].numpy().tolist() == [16.0, 16.0]


def test_user_communicators(two):
    n = _internal.backend().nccl()
    comms = n.comm_init_all([0, 1])
    try:
        arrays = [_dev(np.full(2, 3.0, np.float32), d) for d in two]
        nccl.all_reduce(arrays, comms=comms)
        assert arrays[1].numpy().tolist() == [6.0, 6.0]
        assert (0, 1) not in collective_call.cached_cliques()
        with pytest.raises(RuntimeError, match="communicator at index 0 is bound to device 0, "
                                               "but input 0 is on device 1"):
            nccl.all_reduce(arrays[::-1], comms=comms)
    finally:
        collective_call.destroy_clique(n, comms)  # (finalize in one group, then destroy each)


# ------------------------------------------------------------------------------ streams
@sim_only
def test_a_paused_stream_delays_the_result(two):
    b = _internal.backend()
    s1 = cudalab.Stream(1)
    arrays = [_dev(np.full(3, d + 1.0, np.float32), d) for d in two]
    b.pause_stream(_internal.stream_handle(s1))
    try:
        with cudalab.stream(s1):
            arrays[1].fill_(10.0)  # queued on the paused stream, before the collective
        nccl.all_reduce(arrays, streams=[None, s1])
        assert not cudalab.current_stream(0).query()
        with pytest.raises(RuntimeError, match="would wait forever"):
            cudalab.current_stream(0).synchronize()
    finally:
        b.resume_stream(_internal.stream_handle(s1))
    s1.synchronize()
    assert arrays[0].numpy().tolist() == arrays[1].numpy().tolist() == [11.0] * 3


# ------------------------------------------------------------------------------ observers
def test_collective_records(two):
    records = []
    _internal.collective_observers.append(records.append)
    try:
        f32 = [cudalab.zeros(8, device=d) for d in two]
        nccl.all_reduce(f32)
        nccl.broadcast(f32)
        nccl.reduce(f32)
        nccl.all_gather(f32, [cudalab.zeros(16, device=d) for d in two])
        nccl.reduce_scatter(f32, [cudalab.zeros(4, device=d) for d in two])
    finally:
        _internal.collective_observers.remove(records.append)
    got = [(r.name, r.algorithm_bytes, r.nranks, r.bus_factor, r.devices) for r in records]
    assert got == [("nccl.all_reduce", 32, 2, 1.0, (0, 1)),
                   ("nccl.broadcast", 32, 2, 1.0, (0, 1)),
                   ("nccl.reduce", 32, 2, 1.0, (0, 1)),
                   ("nccl.all_gather", 64, 2, 0.5, (0, 1)),
                   ("nccl.reduce_scatter", 32, 2, 0.5, (0, 1))]


def test_nvtx_range_around_each_collective(two, monkeypatch):
    seen = []
    real = cudalab_nvtx.range_push

    def push(msg):
        seen.append(msg)
        return real(msg)

    monkeypatch.setattr(cudalab_nvtx, "range_push", push)
    f32 = [cudalab.zeros(2, device=d) for d in two]
    nccl.all_reduce(f32)
    nccl.broadcast(f32, root=1)
    assert seen == ["nccl.all_reduce", "nccl.broadcast"]
    assert cudalab_nvtx.current_ranges() == ()


def test_sanitizer_sees_the_accesses(two, monkeypatch):
    class Tracker:
        def __init__(self):
            self.calls = []

        def access(self, stream, reads, writes, name):
            self.calls.append((stream.device_index, list(reads), list(writes), name))

        def __getattr__(self, name):  # every other hook: ignored
            return lambda *args, **kwargs: None

    tracker = Tracker()
    ins = [cudalab.zeros(4, device=d) for d in two]
    outs = [cudalab.zeros(4, device=d) for d in two]
    _observe.subscribe_access(tracker)  # (the sanitizer's hook: the bus's memory-access family)
    try:
        nccl.all_reduce(ins, outs)
    finally:
        _observe.unsubscribe_access(tracker)
    assert tracker.calls == [
        (d, [(ins[d].ptr, 16)], [(outs[d].ptr, 16)], "nccl.all_reduce") for d in two]


# ------------------------------------------------------------------------------ four devices
@sim_only
def test_four_simulated_devices_in_a_subprocess():
    script = textwrap.dedent("""
        import numpy as np, cudalab
        from cudalab import collective_call, nccl
        devs = range(4)
        host = [np.arange(8, dtype=np.float32) * (d + 1) for d in devs]
        a = [cudalab.asarray(h, device=d) for h, d in zip(host, devs)]
        nccl.all_reduce(a)
        assert all(x.numpy().tolist() == sum(host).tolist() for x in a)
        parts = [cudalab.empty(2, device=d) for d in devs]
        nccl.reduce_scatter(a, parts, op=nccl.MAX)
        assert [p.numpy().tolist() for p in parts] == [
            sum(host)[2 * d:2 * d + 2].tolist() for d in devs]
        whole = [cudalab.empty(8, device=d) for d in devs]
        nccl.all_gather(parts, whole)
        assert all(w.numpy().tolist() == sum(host).tolist() for w in whole)
        b = [cudalab.asarray(h, device=d) for h, d in zip(host, devs)]
        nccl.broadcast(b, root=3)
        assert all(x.numpy().tolist() == host[3].tolist() for x in b)
        nccl.reduce(b[::-1], root=0, op=nccl.AVG)
        assert b[3].numpy().tolist() == host[3].tolist()
        print("ok", sorted(collective_call.cached_cliques()))
    """)
    env = dict(os.environ, CUDALAB_SIMULATOR="1", CUDALAB_SIMULATOR_DEVICES="4")
    res = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok [(0, 1, 2, 3), (3, 2, 1, 0)]"
