"""Interop: CuPy/torch DLPack and CUDA-array-interface round trips, the CuPy allocator hook,
the Numba EMM plugin. The library round trips need a real GPU with CuPy/torch installed."""

from __future__ import annotations

import gc
import importlib.util

import numpy as np
import pytest

import cudalab
from cudalab import interop


def test_public_names():
    assert cudalab.memory.cupy_allocator is interop.cupy_allocator
    assert callable(interop.cupy_allocator)
    assert cudalab.interop is interop and "interop" in dir(cudalab)


def test_allocation_owner_frees_to_cudalab():
    gc.collect()  # (earlier tests' garbage freed first: the figures below are this test's)
    before = cudalab.memory_allocated()
    owner = interop._allocate(1 << 20, 0, 0)
    assert owner.ptr and cudalab.memory_allocated() == before + (1 << 20)
    assert "cuda:0" in repr(owner)
    del owner
    gc.collect()
    assert cudalab.memory_allocated() == before


def test_external_streams_are_mapped():
    assert interop._stream_for(0, 0) is cudalab.default_stream(0)
    s = cudalab.Stream()
    ext = interop._stream_for(0, s.cuda_stream)
    assert ext == s and ext.device_index == 0
    assert interop._stream_for(0, s.cuda_stream) is ext  # cached


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed")
def test_cupy_allocator_without_cupy():
    with pytest.raises(ImportError):
        interop.cupy_allocator(16)


@pytest.mark.skipif(importlib.util.find_spec("numba") is not None, reason="Numba is installed")
def test_numba_plugin_without_numba():
    with pytest.raises(ImportError):
        interop.CudalabNumbaMemoryManager  # noqa: B018
    with pytest.raises(AttributeError):
        interop.no_such_name  # noqa: B018


# --------------------------------------------------------------------------- GPU: CuPy
@pytest.mark.gpu
def test_cupy_reads_our_array_through_cai():
    cupy = pytest.importorskip("cupy")
    host = np.arange(24, dtype=np.float32).reshape(4, 6)
    a = cudalab.asarray(host)
    c = cupy.asarray(a)  # __cuda_array_interface__: no copy
    assert c.data.ptr == a.ptr and c.shape == (4, 6) and c.dtype == np.float32
    np.testing.assert_array_equal(cupy.asnumpy(c), host)
    c *= 2
    cupy.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(a.numpy(), host * 2)


@pytest.mark.gpu
def test_cupy_dlpack_both_ways():
    cupy = pytest.importorskip("cupy")
    a = cudalab.asarray(np.arange(10, dtype=np.int64))
    c = cupy.from_dlpack(a)
    assert c.data.ptr == a.ptr
    np.testing.assert_array_equal(cupy.asnumpy(c), np.arange(10))
    x = cupy.arange(12, dtype=cupy.float64).reshape(3, 4)
    b = cudalab.from_dlpack(x)
    assert b.ptr == x.data.ptr and b.shape == (3, 4) and b.dtype == np.float64
    np.testing.assert_array_equal(b.numpy(), cupy.asnumpy(x))
    if cupy.cuda.runtime.getDeviceCount() > 1:
        with cupy.cuda.Device(1):
            x1 = cupy.arange(4, dtype=cupy.int32)
        b1 = cudalab.from_dlpack(x1)
        assert b1.device_index == 1 and b1.ptr == x1.data.ptr
        np.testing.assert_array_equal(b1.numpy(), np.arange(4))
        c1 = cupy.from_dlpack(b1)
        assert c1.device.id == 1
    y = cudalab.asarray(x[:, 1])  # strided CuPy view: wrapped, not contiguous
    assert not y.is_contiguous() and y.strides == (32,)
    del x
    gc.collect()
    np.testing.assert_array_equal(b.numpy(), np.arange(12).reshape(3, 4))  # kept alive


@pytest.mark.gpu
def test_cupy_allocator_hook():
    cupy = pytest.importorskip("cupy")
    cupy.cuda.set_allocator(interop.cupy_allocator)
    try:
        before = cudalab.memory_allocated()
        x = cupy.ones((1024, 1024), dtype=cupy.float32)  # 4 MiB from cudalab's pool
        assert cudalab.memory_allocated() >= before + 4 * 1024 * 1024
        y = (x * 3).sum()
        assert float(y) == 3 * 1024 * 1024
        with cupy.cuda.Stream() as s:  # on a CuPy stream: allocated on that stream
            z = cupy.zeros(1000, dtype=cupy.int8)
            s.synchronize()
        e = cupy.empty(0)
        assert e.size == 0
        del x, y, z, e
        gc.collect()
        cupy.cuda.get_current_stream().synchronize()
        assert cudalab.memory_allocated() == before
    finally:
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)


# --------------------------------------------------------------------------- GPU: torch
@pytest.mark.gpu
def test_torch_dlpack_round_trip():
    torch = pytest.importorskip("torch")
    host = np.arange(20, dtype=np.float32).reshape(4, 5)
    a = cudalab.asarray(host)
    t = torch.from_dlpack(a)
    assert t.is_cuda and t.data_ptr() == a.ptr and tuple(t.shape) == (4, 5)
    np.testing.assert_array_equal(t.cpu().numpy(), host)
    back = cudalab.from_dlpack(t)
    assert back.ptr == a.ptr
    t.add_(1)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(a.numpy(), host + 1)


@pytest.mark.gpu
def test_from_dlpack_of_torch_tensor():
    torch = pytest.importorskip("torch")
    for dtype in (torch.float16, torch.float32, torch.int64, torch.bool, torch.complex64,
                  torch.uint8):
        t = (torch.arange(30, device="cuda") % 3).to(dtype)
        a = cudalab.from_dlpack(t)
        assert a.ptr == t.data_ptr() and a.shape == (30,)
        np.testing.assert_array_equal(a.numpy(), t.cpu().numpy())
    t = torch.arange(12, device="cuda", dtype=torch.float32).reshape(3, 4).t()
    a = cudalab.from_dlpack(t)
    assert a.shape == (4, 3) and not a.is_contiguous() and a.strides == (4, 16)
    if torch.cuda.device_count() > 1:
        t1 = torch.ones(5, device="cuda:1")
        a1 = cudalab.from_dlpack(t1)  # torch wants the tensor's device current meanwhile
        assert a1.device_index == 1 and a1.ptr == t1.data_ptr()
        assert torch.cuda.current_device() == 0 and cudalab.current_device() == 0
        np.testing.assert_array_equal(a1.numpy(), np.ones(5, np.float32))
        back = torch.from_dlpack(a1)
        assert back.device == torch.device("cuda:1") and back.data_ptr() == a1.ptr
    cpu = torch.ones(3)
    with pytest.raises(BufferError, match="kDLCPU"):
        cudalab.from_dlpack(cpu)
    np.testing.assert_array_equal(cudalab.asarray(cpu).numpy(), [1, 1, 1])


@pytest.mark.gpu
def test_torch_stream_handshake():
    torch = pytest.importorskip("torch")
    s = cudalab.Stream()
    with cudalab.stream(s):
        a = cudalab.full(1 << 20, 2, dtype=np.float32)
    ts = torch.cuda.Stream()
    with torch.cuda.stream(ts):
        t = torch.from_dlpack(a)  # torch passes ts; ts waits for our current stream
        total = float(t.sum())
    assert total == 2 * (1 << 20)


@pytest.mark.gpu
def test_torch_reads_cai():
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    a = cudalab.asarray(np.arange(8, dtype=np.int32))
    t = torch.as_tensor(a, device="cuda")  # torch understands __cuda_array_interface__
    assert t.data_ptr() == a.ptr
    assert cupy.asarray(t).data.ptr == a.ptr


# --------------------------------------------------------------------------- GPU: Numba
@pytest.mark.gpu
def test_numba_plugin():
    pytest.importorskip("numba.cuda")
    from numba import cuda

    cls = interop.CudalabNumbaMemoryManager
    cuda.set_memory_manager(cls)
    try:
        before = cudalab.memory_allocated()
        d = cuda.to_device(np.arange(1 << 18, dtype=np.float32))
        assert cudalab.memory_allocated() >= before + (1 << 20)
        np.testing.assert_array_equal(d.copy_to_host(), np.arange(1 << 18))
        del d
        gc.collect()
        assert cudalab.memory_allocated() == before
    finally:
        from numba.cuda.cudadrv.driver import NumbaCUDAMemoryManager

        cuda.set_memory_manager(NumbaCUDAMemoryManager)
