"""DeviceArray: creation, dtypes, copies, fills, views, lifetime, CAI and DLPack (both backends).

Interop with CuPy/torch (GPU only) lives in test_interop.py.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import cudalab
from cudalab import _dlpack
from cudalab.array import SUPPORTED_DTYPES, DeviceArray


def _sim(backend):
    if not backend.simulated:
        pytest.skip("needs the simulator's pause_stream/resume_stream test hooks")
    return backend


@pytest.fixture
def paused(backend):
    """A new stream whose work is held back (simulator only); resumed at teardown."""
    b = _sim(backend)
    s = cudalab.Stream()
    b.pause_stream(s.handle)
    yield s
    b.resume_stream(s.handle)


# --------------------------------------------------------------------------- creation
def test_empty_attributes():
    a = cudalab.empty((3, 4), dtype=np.float32)
    assert isinstance(a, DeviceArray)
    assert a.shape == (3, 4) and a.dtype == np.float32 and a.ndim == 2
    assert a.strides == (16, 4) and a.size == 12 and a.itemsize == 4 and a.nbytes == 48
    assert a.device == cudalab.Device("cuda:0") and str(a.device) == "cuda:0" and a.device_index == 0
    assert a.device.index == 0 and a.device.type == "cuda" and a.device != 0
    assert a.ptr == a.data_ptr() != 0
    assert a.is_contiguous()
    assert a.stream is cudalab.current_stream()
    assert len(a) == 3
    assert cudalab.empty(5).shape == (5,)
    assert cudalab.empty(()).shape == () and cudalab.empty(()).nbytes == 4
    assert DeviceArray((2,), "int8").nbytes == 2


def test_repr(backend):
    a = cudalab.empty(3)
    sim = " (simulated)" if backend.simulated else ""
    assert repr(a) == f"DeviceArray(shape=(3,), dtype=float32, device='cuda:0{sim}')"


def test_zeros_ones_full():
    np.testing.assert_array_equal(cudalab.zeros((2, 3)).numpy(), np.zeros((2, 3), np.float32))
    np.testing.assert_array_equal(cudalab.ones(4, dtype="int16").numpy(), np.ones(4, np.int16))
    f = cudalab.full((2, 2), 7.5)
    assert f.dtype == np.float32  # torch's default dtype for a Python float (issue 36, 11)
    np.testing.assert_array_equal(f.numpy(), np.full((2, 2), 7.5))
    assert cudalab.full(3, 2).dtype == np.int64
    assert cudalab.full(3, True).dtype == np.bool_
    np.testing.assert_array_equal(cudalab.full(3, 9, dtype=np.uint8).numpy(), [9, 9, 9])


def test_like_functions():
    a = cudalab.asarray(np.arange(6, dtype=np.int32).reshape(2, 3))
    e = cudalab.empty_like(a)
    assert e.shape == a.shape and e.dtype == a.dtype and e.device == a.device and e.ptr != a.ptr
    z = cudalab.zeros_like(a)
    np.testing.assert_array_equal(z.numpy(), np.zeros((2, 3), np.int32))
    z2 = cudalab.zeros_like(np.ones((4,), np.float64))
    assert z2.dtype == np.float64 and z2.shape == (4,)
    assert cudalab.empty_like(a, dtype="float16").dtype == np.float16


def test_asarray_from_host():
    host = np.arange(10, dtype=np.float32)
    a = cudalab.asarray(host)
    np.testing.assert_array_equal(a.numpy(), host)
    np.testing.assert_array_equal(cudalab.asarray([1, 2, 3]).numpy(), [1, 2, 3])
    b = cudalab.asarray([1, 2, 3], dtype="float32")
    assert b.dtype == np.float32
    # non-contiguous host input is made contiguous on the host first
    nc = np.arange(20, dtype=np.int64)[::2]
    np.testing.assert_array_equal(cudalab.asarray(nc).numpy(), nc)
    assert cudalab.asarray(a) is a


def test_asarray_device_and_dtype(two_devices):
    a = cudalab.asarray(np.arange(4, dtype=np.float32))
    b = cudalab.asarray(a, device=1)
    assert b.device_index == 1 and b is not a
    np.testing.assert_array_equal(b.numpy(), np.arange(4))
    assert cudalab.asarray(a, device=0) is a
    assert cudalab.asarray(a, dtype=np.float32) is a
    converted = cudalab.asarray(a, dtype=np.float64)  # a converting copy on the device
    assert converted.dtype == np.float64
    np.testing.assert_array_equal(converted.numpy(), np.arange(4))
    c = cudalab.asarray(np.ones(3), device="cuda:1")
    assert c.device_index == 1


def test_every_dtype_round_trips():
    rng = np.random.default_rng(0)
    for dt in SUPPORTED_DTYPES:
        if dt.kind == "b":
            host = rng.integers(0, 2, 33).astype(bool)
        elif dt.kind == "c":
            host = (rng.standard_normal(33) + 1j * rng.standard_normal(33)).astype(dt)
        elif dt.kind == "f":
            host = rng.standard_normal(33).astype(dt)
        else:
            host = rng.integers(0, 100, 33).astype(dt)
        a = cudalab.asarray(host)
        assert a.dtype == dt
        np.testing.assert_array_equal(a.numpy(), host)
        assert cudalab.empty(2, dtype=dt.name).dtype == dt


def test_bfloat16_without_ml_dtypes(monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes -> ImportError
    with pytest.raises(TypeError, match="ml_dtypes"):
        cudalab.empty(3, dtype="bfloat16")


def test_bfloat16_with_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = cudalab.full(4, 1.5, dtype="bfloat16")
    assert a.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(a.numpy().astype(np.float32), [1.5] * 4)
    b = cudalab.from_dlpack(a)
    assert b.dtype == a.dtype and b.ptr == a.ptr
    assert not hasattr(a, "__cuda_array_interface__")  # CAI has no bfloat16 typestr


@pytest.mark.parametrize("bad", [object, "U3", "datetime64[s]", ">f4", "float128", "nope"])
def test_unsupported_dtypes(bad):
    try:
        np.dtype(bad)
    except TypeError:
        pass
    with pytest.raises(TypeError, match="unsupported dtype"):
        cudalab.empty(2, dtype=bad)


def test_bad_shapes():
    with pytest.raises(ValueError, match="negative dimension"):
        cudalab.empty((2, -1))
    with pytest.raises(ValueError, match="negative dimension"):
        cudalab.zeros(-3)
    with pytest.raises(TypeError, match="shape"):
        cudalab.empty(2.5)
    with pytest.raises(TypeError, match="shape"):
        cudalab.empty((2, "3"))
    with pytest.raises(TypeError, match="shape"):
        cudalab.empty(True)
    with pytest.raises(ValueError):
        cudalab.empty(2, device=99)
    with pytest.raises(TypeError, match="implicit conversion"):
        np.asarray(cudalab.empty(2))


def test_zero_size_arrays():
    before = cudalab.memory_allocated()
    a = cudalab.empty((0, 4))
    assert a.ptr == 0 and a.nbytes == 0 and a.size == 0
    assert cudalab.memory_allocated() == before
    assert a.numpy().shape == (0, 4)
    a.fill_(3)
    a.copy_(np.empty((0, 4), np.float32))
    b = cudalab.from_dlpack(a)
    assert b.shape == (0, 4)
    assert cudalab.zeros(0).numpy().shape == (0,)


# --------------------------------------------------------------------------- copies
def test_copy_host_and_device():
    host = np.arange(12, dtype=np.int32).reshape(3, 4)
    a = cudalab.empty((3, 4), dtype=np.int32)
    assert a.copy_(host) is a
    np.testing.assert_array_equal(a.numpy(), host)
    b = cudalab.zeros((3, 4), dtype=np.int32)
    b.copy_(a)
    np.testing.assert_array_equal(b.numpy(), host)
    b.copy_(host * 2, non_blocking=True)  # pageable memory: still correct
    np.testing.assert_array_equal(b.numpy(), host * 2)
    out = np.empty((3, 4), np.int32)
    assert b.numpy(out=out) is out
    np.testing.assert_array_equal(out, host * 2)


def test_copy_peer(two_devices):
    host = np.arange(1000, dtype=np.float64)
    a = cudalab.asarray(host, device=0)
    b = cudalab.empty(1000, dtype=np.float64, device=1)
    b.copy_(a)
    np.testing.assert_array_equal(b.numpy(), host)
    c = cudalab.zeros(1000, dtype=np.float64, device=0)
    c.copy_(b)
    np.testing.assert_array_equal(c.numpy(), host)
    with cudalab.device(1):
        d = a.to(0)
        assert d is a
        e = a.to("cuda:1")
    assert e.device_index == 1
    np.testing.assert_array_equal(e.numpy(), host)


def test_copy_mismatch_errors():
    a = cudalab.empty((2, 3), dtype=np.float32)
    with pytest.raises(ValueError, match="shape"):
        a.copy_(np.zeros((3, 2), np.float32))
    with pytest.raises(RuntimeError, match="must match"):  # torch's copy_ broadcasts, or says so
        a.copy_(cudalab.empty((6,), dtype=np.float32))
    with pytest.raises(ValueError, match="shape"):
        a.numpy(out=np.empty((2, 2), np.float32))


def test_non_contiguous_rejected():
    a = cudalab.empty((4, 4), dtype=np.float32)
    nc = np.zeros((4, 8), np.float32)[:, ::2]
    assert nc.shape == (4, 4)
    with pytest.raises(ValueError, match="C-contiguous"):
        a.copy_(nc)
    with pytest.raises(ValueError, match="C-contiguous"):
        a.numpy(out=np.zeros((8, 4), np.float32)[::2])
    # a strided device array (imported through the CUDA array interface)
    strided = _cai_view(a, shape=(2,), strides=(8,))
    assert not strided.is_contiguous()
    assert strided.strides == (8,)
    with pytest.raises(ValueError, match="C-contiguous"):
        strided.numpy()
    with pytest.raises(ValueError, match="C-contiguous"):
        strided.fill_(1)
    a.copy_(np.arange(16, dtype=np.float32).reshape(4, 4))  # a strided source is read
    np.testing.assert_array_equal(cudalab.empty(2).copy_(strided).numpy(), [0, 2])  # (torch)
    with pytest.raises(ValueError, match="C-contiguous"):
        strided.reshape(2, 1)
    assert strided.__cuda_array_interface__["strides"] == (8,)


class _CAI:
    """A foreign array exposing only __cuda_array_interface__."""

    def __init__(self, **cai):
        self.__cuda_array_interface__ = cai


def _cai_view(arr, shape, strides=None, read_only=False, stream=None):
    cai = {"shape": shape, "typestr": arr.dtype.str, "data": (arr.ptr, read_only),
           "version": 3, "strides": strides, "stream": stream}
    return cudalab.asarray(_CAI(**cai))


def test_cuda_array_interface_import():
    a = cudalab.asarray(np.arange(6, dtype=np.float32))
    v = _cai_view(a, shape=(6,))
    assert v.ptr == a.ptr and v.is_contiguous() and v.device_index == 0
    np.testing.assert_array_equal(v.numpy(), np.arange(6))
    ro = _cai_view(a, shape=(6,), read_only=True)
    with pytest.raises(ValueError, match="read-only"):
        ro.fill_(0)
    with pytest.raises(TypeError, match="mask"):
        cudalab.asarray(_CAI(shape=(1,), typestr="<f4", data=(a.ptr, False), version=3,
                             mask=object()))


def test_cuda_array_interface_stream_is_waited_for(paused):
    a = cudalab.zeros(8, dtype=np.int32)
    with cudalab.stream(paused):
        a.fill_(5)  # held back on the paused stream
    v = _cai_view(a, shape=(8,), stream=paused.cuda_stream)  # consumer: the default stream
    assert v.stream is cudalab.current_stream()
    assert not cudalab.current_stream().query()  # waits for the producer's stream
    cudalab.devices.backend().resume_stream(paused.handle)
    np.testing.assert_array_equal(v.numpy(), [5] * 8)


# --------------------------------------------------------------------------- fill
FILLS = [
    ("bool", True), ("int8", -3), ("uint8", 200), ("int16", 0x1234), ("uint16", 65000),
    ("float16", 1.5), ("int32", -2), ("uint32", 0xDEADBEEF), ("float32", 3.25),
    ("int64", 2**40 + 3), ("uint64", 2**63 + 5), ("float64", -2.25), ("complex64", 1 - 2j),
    ("complex128", 3 + 4j), ("complex128", 2 + 2j), ("float32", 0.0), ("int16", -1),
]


@pytest.mark.parametrize("dtype,value", FILLS)
def test_fill_every_item_size(dtype, value):
    for n in (1, 7, 1000):
        a = cudalab.empty(n, dtype=dtype)
        assert a.fill_(value) is a
        np.testing.assert_array_equal(a.numpy(), np.full(n, value, dtype=dtype))


_FILL_VALUES = [0, 1, -1, 7, 255, 256, -129, 2**31 - 1, -(2**31), 2**32 - 1, 2**53, 2**53 + 1,
                -(2**53) - 1, 2**63 - 1, 2**64 - 1, 2**64, -(2**63), 16777217, 0.0, -0.0, 1.5, -2.25,
                0.1, 1e-45, 1e-320, 3.4028235677973366e38, 3.5e38, 1e300, float("inf"),
                float("-inf"), float("nan"), -float("nan"), True, False, np.float32(0.1),
                np.int64(-5)]


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "int32", "uint32",
                                   "int64", "uint64", "float32", "float64", "float16", "bool"])
def test_fill_values_convert_as_numpy_does(dtype):
    """The fast conversion of fill_ values (no numpy for Python ints and floats into the
    integer dtypes, float32 and float64) gives numpy's bytes, or numpy's error."""
    from cudalab._array_memory import scalar_bytes

    dt = np.dtype(dtype)
    for value in _FILL_VALUES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # numpy's cast warnings (overflow, nan to int)
            try:
                expect = np.array(value, dtype=dt).tobytes()
            except (OverflowError, ValueError, TypeError):
                expect = None
            if expect is None:
                with pytest.raises(ValueError, match="cannot be stored"):
                    scalar_bytes(value, dt)
            else:
                assert scalar_bytes(value, dt) == expect, (dtype, value)


def test_fill_slice_only_touches_slice():
    a = cudalab.zeros(10, dtype=np.int16)
    a[2:5].fill_(7)
    a[7] = 9
    expect = np.zeros(10, np.int16)
    expect[2:5] = 7
    expect[7] = 9
    np.testing.assert_array_equal(a.numpy(), expect)
    a[:] = np.arange(10)
    np.testing.assert_array_equal(a.numpy(), np.arange(10))
    a[...] = 1
    np.testing.assert_array_equal(a.numpy(), np.ones(10))


def test_fill_bad_values():
    with pytest.raises(ValueError, match="uint8"):
        cudalab.empty(3, dtype=np.uint8).fill_(300)
    with pytest.raises(ValueError, match="uint8"):
        cudalab.empty(3, dtype=np.uint8).fill_(-1)
    with pytest.raises(ValueError):
        cudalab.empty(3).fill_("x")
    with pytest.raises(ValueError, match="scalar"):
        cudalab.empty(3).fill_([1, 2, 3])


# --------------------------------------------------------------------------- views and lifetime
def test_views_share_memory():
    a = cudalab.asarray(np.arange(12, dtype=np.float32))
    r = a.reshape(3, 4)
    assert r.ptr == a.ptr and r.shape == (3, 4) and r.base is a
    assert a.reshape((2, -1)).shape == (2, 6)
    np.testing.assert_array_equal(r[1].numpy(), [4, 5, 6, 7])
    np.testing.assert_array_equal(r[-1].numpy(), [8, 9, 10, 11])
    np.testing.assert_array_equal(r[1:3].numpy(), np.arange(4, 12).reshape(2, 4))
    assert r[1].ptr == a.ptr + 16
    s = a[3:7]
    assert s.shape == (4,) and s.ptr == a.ptr + 12 and s.base is a
    assert s[1:].base is a  # views of views point at the owner
    assert a[5:2].shape == (0,)
    u = a.view(np.uint32)
    np.testing.assert_array_equal(u.numpy(), np.arange(12, dtype=np.float32).view(np.uint32))
    h = a.view(np.float16)
    assert h.shape == (24,)
    assert a.view("complex64").shape == (6,)
    s.fill_(-1)
    np.testing.assert_array_equal(a.numpy()[3:7], [-1] * 4)
    x = a[0]
    assert x.shape == () and x.numpy() == 0


def test_view_errors():
    a = cudalab.empty(5, dtype=np.float32)
    with pytest.raises(ValueError, match="step 1"):
        a[::2]
    with pytest.raises(IndexError, match="out of bounds"):
        a[5]
    with pytest.raises(IndexError, match="first axis"):
        cudalab.empty((2, 2))[0, 1]
    with pytest.raises(TypeError, match="integers or slices"):
        a[1.5]
    with pytest.raises(ValueError, match="reshape"):
        a.reshape(2, 3)
    with pytest.raises(ValueError, match="-1"):
        cudalab.empty(6).reshape(-1, -1)
    with pytest.raises(ValueError, match="multiple"):
        a.view(np.float64)
    with pytest.raises(TypeError, match="0-d"):
        len(cudalab.empty(()))
    with pytest.raises(IndexError, match="0-d"):
        cudalab.empty(())[0]


def test_view_keeps_owner_alive():
    gc.collect()  # (arrays an earlier test left in reference cycles are freed first)
    before = cudalab.memory_allocated()
    a = cudalab.asarray(np.arange(1000, dtype=np.int64))
    during = cudalab.memory_allocated()
    assert during > before
    v = a[10:20].reshape(2, 5)
    del a
    gc.collect()
    assert cudalab.memory_allocated() == during  # the view still holds the memory
    np.testing.assert_array_equal(v.numpy(), np.arange(10, 20).reshape(2, 5))
    del v
    gc.collect()
    assert cudalab.memory_allocated() == before


def test_memory_returned_when_last_reference_goes():
    before = cudalab.memory_allocated()
    arrays = [cudalab.empty(10_000, dtype=np.float64) for _ in range(5)]
    assert cudalab.memory_allocated() >= before + 5 * 80_000
    del arrays
    assert cudalab.memory_allocated() == before
    b = cudalab.asarray(np.ones(100))
    ptr = b.ptr
    del b
    c = cudalab.empty(100, dtype=np.float64)  # same size, same stream: the block is reused
    assert c.ptr == ptr


def test_record_stream():
    a = cudalab.empty(100)
    s = cudalab.Stream()
    a.record_stream(s)
    a[10:20].record_stream(s)  # views record on the owner's block
    with pytest.raises(TypeError, match="Stream"):
        a.record_stream(0)
    imported = cudalab.from_dlpack(a)
    imported.record_stream(s)  # not cudalab's block: nothing to do


def test_record_stream_defers_reuse(paused):
    a = cudalab.empty(256, dtype=np.float32)
    ptr = a.ptr
    with cudalab.stream(paused):
        a.fill_(1)  # pending on the paused stream
    a.record_stream(paused)
    del a
    b = cudalab.empty(256, dtype=np.float32)
    assert b.ptr != ptr  # the block is not handed out while the paused work is pending


def test_numpy_is_a_sync_point():
    a = cudalab.zeros(4)
    cudalab.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="DeviceArray.numpy"):
            a.numpy()
    finally:
        cudalab.set_sync_debug_mode("default")
    assert a.numpy().tolist() == [0, 0, 0, 0]


def test_numpy_uses_the_array_stream(backend):
    s = cudalab.Stream()
    with cudalab.stream(s):
        a = cudalab.full(16, 3, dtype=np.int32)
    assert a.stream is s
    np.testing.assert_array_equal(a.numpy(), [3] * 16)


# --------------------------------------------------------------------------- CAI
def test_cuda_array_interface_contents():
    a = cudalab.empty((2, 3), dtype=np.float64)
    cai = a.__cuda_array_interface__
    assert cai == {"shape": (2, 3), "typestr": "<f8", "data": (a.ptr, False), "version": 3,
                   "strides": None, "stream": 1}  # 1: the legacy default stream
    s = cudalab.Stream()
    with cudalab.stream(s):
        assert a.__cuda_array_interface__["stream"] == s.cuda_stream
    assert cudalab.empty(2, dtype=bool).__cuda_array_interface__["typestr"] == "|b1"
    assert cudalab.empty(0).__cuda_array_interface__["data"] == (0, False)


# --------------------------------------------------------------------------- DLPack
def test_dlpack_device():
    assert cudalab.empty(1).__dlpack_device__() == (2, 0)


def test_dlpack_round_trip_shares_memory():
    a = cudalab.asarray(np.arange(12, dtype=np.int16).reshape(3, 4))
    b = cudalab.from_dlpack(a)
    assert b.ptr == a.ptr and b.shape == (3, 4) and b.dtype == np.int16 and b.device_index == 0
    assert b.is_contiguous() and b.strides == a.strides
    np.testing.assert_array_equal(b.numpy(), a.numpy())
    b.fill_(7)
    np.testing.assert_array_equal(a.numpy(), np.full((3, 4), 7))


def test_dlpack_deleter_called_exactly_once():
    a = cudalab.empty(8)
    calls, live = _dlpack.deleter_calls, _dlpack.live_exports()
    b = cudalab.from_dlpack(a)
    assert _dlpack.live_exports() == live + 1 and _dlpack.deleter_calls == calls
    del b
    gc.collect()
    assert _dlpack.live_exports() == live and _dlpack.deleter_calls == calls + 1
    # an unconsumed capsule calls the deleter from its destructor, once
    cap = a.__dlpack__()
    assert _dlpack.live_exports() == live + 1
    del cap
    gc.collect()
    assert _dlpack.live_exports() == live and _dlpack.deleter_calls == calls + 2
    # a consumed capsule: the consumer calls it, the capsule destructor does not
    cap = a.__dlpack__(max_version=(1, 0))
    c = cudalab.from_dlpack(cap)
    del cap
    gc.collect()
    assert _dlpack.deleter_calls == calls + 2
    del c
    gc.collect()
    assert _dlpack.deleter_calls == calls + 3 and _dlpack.live_exports() == live


def test_dlpack_keeps_producer_alive():
    before = cudalab.memory_allocated()
    a = cudalab.asarray(np.arange(100, dtype=np.float32))
    b = cudalab.from_dlpack(a)
    held = cudalab.memory_allocated()
    del a
    gc.collect()
    assert cudalab.memory_allocated() == held
    np.testing.assert_array_equal(b.numpy(), np.arange(100))
    del b
    gc.collect()
    assert cudalab.memory_allocated() == before


def test_dlpack_capsule_versions():
    a = cudalab.empty((2, 2), dtype=np.complex64)
    assert _dlpack._PyCapsule_GetName(a.__dlpack__()) == b"dltensor"
    assert _dlpack._PyCapsule_GetName(a.__dlpack__(max_version=(0, 8))) == b"dltensor"
    cap = a.__dlpack__(max_version=(1, 2))
    assert _dlpack._PyCapsule_GetName(cap) == b"dltensor_versioned"
    b = cudalab.from_dlpack(cap)
    assert _dlpack._PyCapsule_GetName(cap) == b"used_dltensor_versioned"
    assert b.dtype == np.complex64 and b.shape == (2, 2) and b.ptr == a.ptr
    with pytest.raises(BufferError, match="already consumed"):
        cudalab.from_dlpack(cap)


def test_dlpack_bad_arguments():
    a = cudalab.empty(3)
    with pytest.raises(ValueError, match="stream=0"):
        a.__dlpack__(stream=0)
    with pytest.raises(TypeError, match="stream"):
        a.__dlpack__(stream="1")
    with pytest.raises(BufferError, match="device"):
        a.__dlpack__(dl_device=(1, 0))
    a.__dlpack__(stream=-1)
    a.__dlpack__(stream=1, dl_device=(2, 0), copy=False)
    c = cudalab.from_dlpack(a.__dlpack__(copy=True, max_version=(1, 0)))
    assert c.ptr != a.ptr


def test_from_dlpack_rejects_host_memory():
    host = np.arange(3, dtype=np.float32)
    with pytest.raises(BufferError, match="kDLCPU"):
        cudalab.from_dlpack(host)
    cap = host.__dlpack__()
    with pytest.raises(BufferError, match="kDLCPU"):
        cudalab.from_dlpack(cap)
    assert _dlpack._PyCapsule_GetName(cap) == b"dltensor"  # rejected: left unconsumed
    with pytest.raises(TypeError, match="DLPack"):
        cudalab.from_dlpack([1, 2, 3])


def test_dlpack_consumer_stream_waits(paused, backend):
    a = cudalab.zeros(4, dtype=np.int32)
    with cudalab.stream(paused):
        a.fill_(3)
        consumer = cudalab.Stream()
        cap = a.__dlpack__(stream=consumer.cuda_stream)  # producer stream: paused
    assert not consumer.query()  # the consumer's stream now waits for the paused work
    backend.resume_stream(paused.handle)
    assert consumer.query()
    b = cudalab.from_dlpack(cap)
    np.testing.assert_array_equal(b.numpy(), [3, 3, 3, 3])


def test_objects_alive_at_interpreter_exit_are_quiet():
    """Arrays, views, imports, unconsumed capsules and pinned buffers alive at exit: no noise."""
    code = textwrap.dedent("""
        import numpy as np, cudalab
        a = cudalab.asarray(np.arange(100.0))
        v = a[10:20]
        b = cudalab.from_dlpack(a)
        cap = a.__dlpack__(max_version=(1, 0))
        p = cudalab.pin_memory(np.ones(10))
        s = cudalab.Stream()
        with cudalab.stream(s):
            c = cudalab.zeros(1000)
        c.copy_(cudalab.empty_pinned(1000), non_blocking=True)
        keep = [a, v, b, cap, p, c]
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert out.stderr.strip() == "", out.stderr
