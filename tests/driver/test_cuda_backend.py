"""The real backend (:mod:`cudalab._driver.cuda`).

Part (a) runs everywhere, CI included (no GPU, usually no driver): import, the error helper,
the no-driver path, the context bookkeeping and query semantics over fake bindings, kernel
argument packing, and -- where no driver is installed -- an "argument shape" check that calls
every backend method far enough for the bindings to convert all arguments (they only then
try to load libcuda, so a wrong argument type shows up as TypeError instead of the loader
error). Part (b) (``@pytest.mark.gpu``) runs on a GPU host against the real driver.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from cudalab._driver import base
from cudalab._driver import cuda as C
from cudalab._driver import cuda_api as A
from cudalab._driver import cuda_kernel_args as KA
from cudalab._driver import cuda_memory as CM
from cudalab._driver.fast_calls import C_TWINS
from cudalab.errors import CudaError, DriverNotFoundError, OutOfMemoryError

drv = C.drv


def _driver_present() -> bool:
    """True when libcuda loads (whether or not a GPU answers)."""
    try:
        drv.cuInit(0)
    except Exception:
        return False
    return True


DRIVER_PRESENT = _driver_present()
no_driver_only = pytest.mark.skipif(DRIVER_PRESENT, reason="an NVIDIA driver is installed here")


# ============================================================================ (a) no GPU
def test_module_imports_and_class_shape():
    assert issubclass(C.CudaBackend, base.Backend)
    assert C.CudaBackend.name == "cuda"
    assert C.CudaBackend.simulated is False
    assert issubclass(C.CudaKernelArgs, base.KernelArgs)
    b = C.CudaBackend()  # construction touches no driver
    assert b.handle_int(drv.CUstream(0)) == 0
    assert b.handle_int(drv.CUevent(0x1234)) == 0x1234
    assert b.handle_int(None) == 0


def test_import_cudalab_does_not_import_the_backend():
    code = (
        "import sys, cudalab; "
        "print('cudalab._driver.cuda' in sys.modules, 'cuda.bindings.driver' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "False", out.stdout


def test_check_returns_out_params():
    ok = drv.CUresult.CUDA_SUCCESS
    assert C.check((ok,), "f") is None
    assert C.check((ok, 5), "f") == 5
    assert C.check((ok, 1, 2), "f") == (1, 2)
    assert C.check((0, "x"), "f") == "x"


@pytest.fixture
def fake_error_text(monkeypatch):
    calls = []

    def lookup(code):
        calls.append(code)
        return f"CUDA_ERROR_FAKE_{code}", f"fake description {code}"

    monkeypatch.setattr(A, "_lookup_error_text", lookup)
    monkeypatch.setattr(A, "_ERROR_TEXT", {})
    return calls


def test_check_raises_cuda_error_with_name_and_string(fake_error_text):
    err = drv.CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CudaError) as info:
        C.check((err, None), "cuMemFree")
    e = info.value
    assert not isinstance(e, OutOfMemoryError)
    assert (e.code, e.name, e.message, e.call) == (1, "CUDA_ERROR_FAKE_1", "fake description 1",
                                                   "cuMemFree")
    assert str(e) == "cuMemFree: CUDA_ERROR_FAKE_1 (1): fake description 1"
    # plain ints work too, and the text is looked up once per code
    with pytest.raises(CudaError):
        C.check((1,), "again")
    assert fake_error_text == [1]


def test_check_out_of_memory(fake_error_text):
    with pytest.raises(OutOfMemoryError) as info:
        C.check((drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None), "cuMemAlloc")
    e = info.value
    assert isinstance(e, CudaError)
    assert (e.code, e.name, e.call) == (2, "CUDA_ERROR_FAKE_2", "cuMemAlloc")
    assert "cuMemAlloc" in str(e)


def test_error_names_without_a_driver_fall_back_to_the_enum(monkeypatch):
    monkeypatch.setattr(A, "_ERROR_TEXT", {})
    e = C.cuda_error(2, "cuMemAlloc")
    assert isinstance(e, OutOfMemoryError)
    assert e.name == "CUDA_ERROR_OUT_OF_MEMORY"
    e = C.cuda_error(600, "cuEventQuery")
    assert e.name == "CUDA_ERROR_NOT_READY"
    e = C.cuda_error(987654, "x")  # not a CUresult at all
    assert e.code == 987654 and "987654" in str(e)


@no_driver_only
def test_init_without_driver_raises_driver_not_found():
    b = C.CudaBackend()
    with pytest.raises(DriverNotFoundError, match="no NVIDIA driver found"):
        b.init()
    with pytest.raises(DriverNotFoundError, match="libcuda.so.1"):
        b.init()  # remembered, same answer
    with pytest.raises(DriverNotFoundError):
        b.device_count()
    assert not isinstance(DriverNotFoundError("x"), CudaError)


@pytest.mark.parametrize(
    "exc",
    [RuntimeError("Failed to dlopen libcuda.so.1"),  # cuda-bindings 13.3 / pathfinder 1.8
     OSError("libcuda.so.1: cannot open shared object file")],
)
def test_init_maps_loader_errors(monkeypatch, exc):
    def boom(flags):
        raise exc

    monkeypatch.setattr(C, "cuInit", boom)
    with pytest.raises(DriverNotFoundError, match="no NVIDIA driver found"):
        C.CudaBackend().init()


def test_loader_error_message_is_one_short_sentence(monkeypatch):
    loader = OSError("libcuda.so.1: cannot open shared object file. Ensure the driver is installed.")

    def boom(flags):
        raise loader

    monkeypatch.setattr(C, "cuInit", boom)
    b = C.CudaBackend()
    with pytest.raises(DriverNotFoundError) as first:
        b.init()
    assert str(first.value) == "no NVIDIA driver found (libcuda.so.1 could not be loaded)"
    assert first.value.__cause__ is loader  # the loader's text, once, in the chain
    with pytest.raises(DriverNotFoundError) as again:
        b.init()
    assert str(again.value) == str(first.value)


def test_init_no_device_means_zero_devices(monkeypatch):
    # A thread that never had a context (other tests on a GPU host leave one current here).
    monkeypatch.setattr(C._THREAD, "device", -1)
    monkeypatch.setattr(C, "cuInit", lambda flags: (drv.CUresult.CUDA_ERROR_NO_DEVICE,))
    monkeypatch.setattr(C, "cuDriverGetVersion", lambda: (drv.CUresult.CUDA_SUCCESS, 13000))
    b = C.CudaBackend()
    b.init()
    b.init()
    assert b.device_count() == 0
    assert b.driver_version() == 13000
    with pytest.raises(CudaError) as info:
        b.device_info(0)
    assert info.value.code == 100
    with pytest.raises(CudaError):
        b.set_context(0)


class FakeDriver:
    """Just enough of the bindings for init and context bookkeeping."""

    def __init__(self, monkeypatch, count=2):
        ok = drv.CUresult.CUDA_SUCCESS
        self.current = {}  # thread id -> ctx int
        self.set_calls = []
        self.retains = []
        monkeypatch.setattr(C, "cuInit", lambda flags: (ok,))
        monkeypatch.setattr(C, "cuDriverGetVersion", lambda: (ok, 13000))
        monkeypatch.setattr(C, "cuDeviceGetCount", lambda: (ok, count))
        monkeypatch.setattr(C, "cuDeviceGet", lambda i: (ok, drv.CUdevice(i)))

        def retain(dev):
            self.retains.append(int(dev))
            return ok, drv.CUcontext(0x1000 + int(dev))

        def set_current(ctx):
            self.set_calls.append(int(ctx))
            self.current[threading.get_ident()] = int(ctx)
            return (ok,)

        def get_current():
            return ok, drv.CUcontext(self.current.get(threading.get_ident(), 0))

        monkeypatch.setattr(C, "cuDevicePrimaryCtxRetain", retain)
        monkeypatch.setattr(C, "cuCtxSetCurrent", set_current)
        monkeypatch.setattr(C, "cuCtxGetCurrent", get_current)
        # the C twins (bound when a real backend initialised earlier in this process) would
        # call the real driver with these fake contexts: the bindings' names only
        for name in C_TWINS:
            monkeypatch.setattr(C.FAST, name, None)
        monkeypatch.setattr(C.FAST, "event_record", A.cuEventRecord)
        monkeypatch.setattr(C, "_bind_fastcall", lambda driver_version: None)
        monkeypatch.setattr(CM, "cuMemAlloc", lambda n: (ok, drv.CUdeviceptr(0x7000_0000 + n)))
        monkeypatch.setattr(CM, "cuMemHostAlloc", lambda n, f: (ok, 0x5000))
        monkeypatch.setattr(C, "_THREAD", C._ThreadState())


def test_context_bookkeeping(monkeypatch):
    fake = FakeDriver(monkeypatch)
    b = C.CudaBackend()
    assert b.device_count() == 2  # implicit init
    b.set_context(0)
    b.set_context(0)
    assert fake.set_calls == [0x1000]
    assert b.mem_alloc(0, 16) == 0x7000_0010  # same device: no switch
    assert fake.set_calls == [0x1000]
    b.mem_alloc(1, 16)  # the call's device becomes current
    assert fake.set_calls == [0x1000, 0x1001]
    b.set_context(1)
    assert fake.set_calls == [0x1000, 0x1001]
    b.set_context(0)
    assert fake.retains == [0, 1]  # retained once each, never released

    seen = []

    def worker():  # a new thread has no context: the first call sets one
        b.mem_alloc(0, 32)
        seen.append(fake.current[threading.get_ident()])

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [0x1000]

    with pytest.raises(CudaError) as info:
        b.set_context(2)
    assert info.value.code == 101
    with pytest.raises(CudaError):
        b.mem_alloc(-1, 16)


def test_host_alloc_needs_any_context(monkeypatch):
    fake = FakeDriver(monkeypatch)
    b = C.CudaBackend()
    assert b.host_alloc(4096) == 0x5000  # no context on this thread: device 0's is made current
    assert fake.set_calls == [0x1000]
    assert b.mem_alloc(0, 0) == 0  # empty allocations are the null pointer, no driver call
    b.mem_free(0, 0)


def test_resync_context(monkeypatch):
    fake = FakeDriver(monkeypatch)
    b = C.CudaBackend()
    b.set_context(0)
    b.set_context(1)
    fake.current[threading.get_ident()] = 0x1000  # another library switched to device 0
    assert b.resync_context() == 0
    b.set_context(1)
    assert fake.set_calls[-1] == 0x1001


def test_query_semantics(monkeypatch, fake_error_text):
    R = drv.CUresult
    b = C.CudaBackend()
    for name, method in (("cuEventQuery", b.event_query), ("cuStreamQuery", b.stream_query)):
        monkeypatch.setattr(C, name, lambda h: (R.CUDA_SUCCESS,))
        assert method(object()) is True
        monkeypatch.setattr(C, name, lambda h: (R.CUDA_ERROR_NOT_READY,))
        assert method(object()) is False
        monkeypatch.setattr(C, name, lambda h: (R.CUDA_ERROR_INVALID_HANDLE,))
        with pytest.raises(CudaError) as info:
            method(object())
        assert info.value.code == 400


def test_priority_clamping(monkeypatch):
    FakeDriver(monkeypatch)
    ok = drv.CUresult.CUDA_SUCCESS
    monkeypatch.setattr(C, "cuCtxGetStreamPriorityRange", lambda: (ok, 0, -5))
    made = []
    monkeypatch.setattr(C, "cuStreamCreateWithPriority",
                        lambda flags, prio: (made.append((flags, prio)) or (ok, drv.CUstream(7))))
    b = C.CudaBackend()
    assert b.stream_priority_range(0) == (0, -5)
    for p in (-100, -5, -2, 0, 3):
        b.stream_create(0, base.STREAM_NON_BLOCKING, p)
    assert made == [(1, -5), (1, -5), (1, -2), (1, 0), (1, 0)]


def test_peer_access_already_enabled_is_benign(monkeypatch):
    FakeDriver(monkeypatch)
    R = drv.CUresult
    b = C.CudaBackend()
    monkeypatch.setattr(C, "cuCtxEnablePeerAccess",
                        lambda ctx, flags: (R.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,))
    b.enable_peer_access(0, 1)
    monkeypatch.setattr(C, "cuCtxEnablePeerAccess",
                        lambda ctx, flags: (R.CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,))
    with pytest.raises(CudaError):
        b.enable_peer_access(0, 1)


def test_pointer_device_paths(monkeypatch):
    FakeDriver(monkeypatch)
    R = drv.CUresult
    b = C.CudaBackend()
    memtype = {0x100: 2, 0x200: 1}  # device memory, pinned host memory; others unknown

    def get_attr(attr, ptr):
        if attr == A.POINTER_ATTRIBUTE_MEMORY_TYPE:
            if ptr in memtype:
                return R.CUDA_SUCCESS, memtype[ptr]
            return R.CUDA_ERROR_INVALID_VALUE, None
        return R.CUDA_SUCCESS, 1

    monkeypatch.setattr(CM, "cuPointerGetAttribute", get_attr)
    monkeypatch.setattr(CM, "_libcuda_fn", False)  # bindings fallback for the ordinal
    assert b.pointer_device(0x100) == 1
    assert b.pointer_device(0x200) is None
    assert b.pointer_device(0x300) is None
    assert b.pointer_device(0) is None
    monkeypatch.setattr(CM, "_pointer_device_ordinal", lambda ptr: (0, 3))
    assert b.pointer_device(0x100) == 3
    monkeypatch.setattr(CM, "cuPointerGetAttribute", lambda a, p: (R.CUDA_ERROR_INVALID_CONTEXT, None))
    with pytest.raises(CudaError):
        b.pointer_device(0x100)


def test_ipc_open_event_validates_length():
    b = C.CudaBackend()
    with pytest.raises(ValueError, match="64 bytes"):
        b.ipc_open_event(0, b"\0" * 63)
    with pytest.raises(TypeError):
        b.ipc_open_event(0, 12345)


def test_ipc_handle_struct_round_trip():
    # The backend reads/writes CUipcEventHandle through getPtr() (bindings 13.5 have no
    # `reserved` attribute); check that the struct really is 64 bytes at that address.
    h = drv.CUipcEventHandle()
    data = bytes(range(64))
    ctypes.memmove(h.getPtr(), data, 64)
    assert ctypes.string_at(h.getPtr(), 64) == data


def test_uuid_format():
    raw = bytes.fromhex("0123456789abcdef0011223344556677")
    assert C._fmt_uuid(raw) == "GPU-01234567-89ab-cdef-0011-223344556677"


# ---------------------------------------------------------------------- kernel arguments
def _read_through_pointers(args: C.CudaKernelArgs) -> list:
    """What cuLaunchKernel sees: follow kernelParams[i] and read each value by its type."""
    ctypes_types = {"p": ctypes.c_uint64, "i4": ctypes.c_int32, "u4": ctypes.c_uint32,
                    "i8": ctypes.c_int64, "u8": ctypes.c_uint64, "f4": ctypes.c_float,
                    "f8": ctypes.c_double}
    out = []
    for i, kind in enumerate(args.signature):
        ptr = ctypes.c_void_p.from_address(args.address_int + i * ctypes.sizeof(ctypes.c_void_p))
        assert ptr.value % 8 == 0  # every slot is 8-byte aligned
        out.append(ctypes_types[kind].from_address(ptr.value).value)
    return out


def test_kernel_args_round_trip():
    sig = ("p", "i4", "u4", "i8", "u8", "f4", "f8")
    a = C.CudaBackend().make_args(sig)
    assert isinstance(a, C.CudaKernelArgs) and a.signature == sig
    vals = (0x7F00_0000_1234, -(2**31), 2**32 - 1, -(2**63), 2**64 - 1, 1.5, -2.25)
    assert a.set(*vals) is a
    assert a.values == vals
    assert _read_through_pointers(a) == list(vals)
    for view, kind, v in zip(a.views, sig, vals):
        assert view.dtype == np.dtype(KA._ARG_DTYPES[kind]) and view.shape == (1,)
        assert view[0] == v
    # in place: addresses do not move, new values replace old ones
    addr = a.address_int
    a.set(0, 7, 8, 9, 10, 0.1, 1e300)
    assert a.address_int == addr
    got = a.values
    assert got[:5] == (0, 7, 8, 9, 10)
    assert got[5] == pytest.approx(0.1, rel=1e-7) and got[6] == 1e300
    # numpy scalars and bools are accepted
    a.set(np.uint64(5), np.int32(-3), True, np.int64(4), np.uint8(1), np.float32(2.0), 3)
    assert a.values == (5, -3, 1, 4, 1, 2.0, 3.0)
    assert isinstance(a.address_int, int)  # cuLaunchKernel takes an int as void**


def test_kernel_args_bad_counts_and_values():
    a = C.CudaKernelArgs(("p", "i4", "f4"))
    a.set(1, 2, 3.0)
    with pytest.raises(ValueError, match="3 argument"):
        a.set(1, 2)
    with pytest.raises(ValueError):
        a.set(1, 2, 3.0, 4)
    for bad in [(-1, 0, 0.0), (2**64, 0, 0.0), (0, 2**31, 0.0), (0, -(2**31) - 1, 0.0),
                (0, 0, 1e39)]:
        with pytest.raises(ValueError):
            a.set(*bad)
    for bad in [(1.5, 0, 0.0), (0, "1", 0.0), (0, 0, "x"), (None, 0, 0.0)]:
        with pytest.raises(TypeError):
            a.set(*bad)
    assert a.values == (1, 2, 3.0)  # failed sets leave the pack untouched
    a.set(0, 0, float("inf"))
    assert a.values[2] == float("inf")
    for kind, lo, hi in [("u4", 0, 2**32 - 1), ("i8", -(2**63), 2**63 - 1), ("u8", 0, 2**64 - 1)]:
        b = C.CudaKernelArgs((kind,))
        b.set(lo)
        b.set(hi)
        with pytest.raises(ValueError):
            b.set(lo - 1)
        with pytest.raises(ValueError):
            b.set(hi + 1)
    with pytest.raises(ValueError):
        C.CudaKernelArgs(("f2",))


def test_kernel_args_empty():
    a = C.CudaKernelArgs(())
    assert a.set() is a and a.values == () and a.address_int == 0
    with pytest.raises(ValueError):
        a.set(1)


# ---------------------------------------------------- argument shapes against the bindings
@no_driver_only
def test_every_call_passes_argument_conversion(monkeypatch):
    """Without a driver the bindings convert all arguments and *then* fail to load libcuda.

    So every backend method must end in the loader error (a RuntimeError that is not a
    CudaError); a TypeError/AttributeError/OverflowError means the backend passes an argument
    the installed bindings reject.
    """
    monkeypatch.setattr(C, "_THREAD", C._ThreadState())
    b = C.CudaBackend()
    b._initialized = True
    b._count = 2
    b._devices = [drv.CUdevice(0), drv.CUdevice(1)]
    b._contexts = {0: drv.CUcontext(0x1000), 1: drv.CUcontext(0x2000)}
    b._context_ints = {0: 0x1000, 1: 0x2000}
    b._priority_ranges = {0: (0, -5)}
    b._module_devices = {0x99: 0}
    C._THREAD.device = 0
    s, e1, e2 = drv.CUstream(0x1234), drv.CUevent(0x10), drv.CUevent(0x20)
    mod, fn = drv.CUmodule(0x99), drv.CUfunction(0x55)
    ptr = 0x7F00_0000_0000
    args = b.make_args(("p", "i4", "u4", "i8", "u8", "f4", "f8")).set(ptr, -1, 2, -3, 4, 0.5, 0.25)
    pool = drv.CUmemoryPool(0x88)
    access_desc = drv.CUmemAccessDesc()
    access_desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access_desc.location.id = 0
    access_desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    # (method, variant, this thread's recorded device before the call, call)
    calls = [
        ("mem_alloc", "", 0, lambda: b.mem_alloc(0, 1 << 20)),
        ("mem_free", "", 0, lambda: b.mem_free(0, ptr)),
        ("mem_alloc_async", "", 0, lambda: b.mem_alloc_async(0, 1 << 20, s)),
        ("mem_alloc_async", "null stream", 0, lambda: b.mem_alloc_async(0, 64, b.null_stream(0))),
        ("mem_free_async", "", 0, lambda: b.mem_free_async(0, ptr, s)),
        ("mem_get_info", "", 0, lambda: b.mem_get_info(0)),
        ("host_alloc", "", 0, lambda: b.host_alloc(4096)),
        ("host_alloc", "no context yet", -1, lambda: b.host_alloc(4096)),
        ("host_free", "", 0, lambda: b.host_free(ptr)),
        ("memcpy", "", 0, lambda: b.memcpy(0, ptr, ptr + 4096, 4096)),
        ("memcpy_async", "", 0, lambda: b.memcpy_async(0, ptr, ptr + 4096, 4096, s)),
        ("memcpy_peer_async", "", 0, lambda: b.memcpy_peer_async(ptr, 1, ptr + 64, 0, 64, s)),
        ("memset_d8", "", 0, lambda: b.memset_d8(0, ptr, 0xAB, 64)),
        ("memset_d8_async", "", 0, lambda: b.memset_d8_async(0, ptr, -1, 64, s)),
        ("memset_d16_async", "", 0, lambda: b.memset_d16_async(0, ptr, 0xBEEF, 16, s)),
        ("memset_d32_async", "", 0, lambda: b.memset_d32_async(0, ptr, 0xDEADBEEF, 16, s)),
        ("pointer_device", "", 0, lambda: b.pointer_device(ptr)),
        ("pointer_device", "bindings fallback", 0,
         lambda: A.cuPointerGetAttribute(A.POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)),
        ("stream_create", "", 0, lambda: b.stream_create(0, base.STREAM_NON_BLOCKING, -3)),
        ("stream_from_int", "wrapped handle", 0, lambda: b.stream_query(b.stream_from_int(0, 0x1234))),
        ("stream_from_int", "per-thread stream", 0, lambda: b.stream_query(b.stream_from_int(0, 2))),
        ("stream_priority_range", "", 1, lambda: b.stream_priority_range(1)),
        ("stream_destroy", "", 0, lambda: b.stream_destroy(s)),
        ("stream_query", "", 0, lambda: b.stream_query(s)),
        ("stream_synchronize", "", 0, lambda: b.stream_synchronize(s)),
        ("stream_wait_event", "", 0, lambda: b.stream_wait_event(s, e1)),
        ("stream_priority", "", 0, lambda: b.stream_priority(s)),
        ("stream_is_capturing", "", 0, lambda: b.stream_is_capturing(s)),
        ("event_create", "", 0, lambda: b.event_create(0, base.EVENT_DISABLE_TIMING)),
        ("event_destroy", "", 0, lambda: b.event_destroy(e1)),
        ("event_record", "", 0, lambda: b.event_record(e1, s)),
        ("event_record", "null stream", 0, lambda: b.event_record(e1, b.null_stream(0))),
        ("event_record_with_flags", "", 0,
         lambda: b.event_record_with_flags(e1, s, base.EVENT_RECORD_EXTERNAL)),
        ("event_query", "", 0, lambda: b.event_query(e1)),
        ("event_synchronize", "", 0, lambda: b.event_synchronize(e1)),
        ("event_elapsed_time", "", 0, lambda: b.event_elapsed_time(e1, e2)),
        ("ipc_event_handle", "", 0, lambda: b.ipc_event_handle(e1)),
        ("ipc_open_event", "", 0, lambda: b.ipc_open_event(0, bytes(range(64)))),
        ("ipc_mem_handle", "", 0, lambda: b.ipc_mem_handle(ptr)),
        ("module_load", "", 0, lambda: b.module_load(0, b"\x7fELF" + bytes(60))),
        ("module_load", "bytearray", 0, lambda: b.module_load(0, bytearray(b"\x7fELF" + bytes(60)))),
        ("module_unload", "", 0, lambda: b.module_unload(mod)),
        ("module_function", "", 0, lambda: b.module_function(mod, "kernel")),
        ("launch", "", 0, lambda: b.launch(fn, (2, 1, 1), (128, 1, 1), 0, s, args)),
        ("launch", "null stream", 0,
         lambda: b.launch(fn, (1, 1, 1), (1, 1, 1), 256, b.null_stream(0), args)),
        ("launch", "no parameters", 0, lambda: b.launch(fn, (1, 1, 1), (1, 1, 1), 0, s, b.make_args(()))),
        ("synchronize", "", 0, lambda: b.synchronize(0)),
        ("can_access_peer", "", 0, lambda: b.can_access_peer(0, 1)),
        ("enable_peer_access", "", 0, lambda: b.enable_peer_access(0, 1)),
        ("set_context", "", 0, lambda: b.set_context(1)),
        ("device_info", "", 0, lambda: b.device_info(0)),
        # the other calls device_info makes (it stops at the first loader error)
        ("device_info", "cuDeviceGetAttribute", 0,
         lambda: A.cuDeviceGetAttribute(A.DeviceAttribute.CU_DEVICE_ATTRIBUTE_WARP_SIZE, b._devices[0])),
        ("device_info", "cuDeviceTotalMem", 0, lambda: A.cuDeviceTotalMem(b._devices[0])),
        ("device_info", "cuDeviceGetUuid", 0, lambda: A.cuDeviceGetUuid(b._devices[0])),
        ("device_info", "cuDeviceGetPCIBusId", 0, lambda: A.cuDeviceGetPCIBusId(64, b._devices[0])),
        ("vmm_granularity", "", 0, lambda: b.vmm_granularity(0)),
        ("vmm_reserve", "", 0, lambda: b.vmm_reserve(0, 1 << 30)),
        ("vmm_free_address", "", 0, lambda: b.vmm_free_address(ptr, 1 << 30)),
        ("vmm_create", "", 0, lambda: b.vmm_create(0, 2 << 20)),
        ("vmm_release", "", 0, lambda: b.vmm_release(drv.CUmemGenericAllocationHandle(0x77))),
        ("vmm_map", "", 0, lambda: b.vmm_map(0, ptr, 2 << 20, drv.CUmemGenericAllocationHandle(0x77))),
        ("vmm_map", "cuMemSetAccess", 0, lambda: A.cuMemSetAccess(ptr, 2 << 20, [access_desc], 1)),
        ("vmm_unmap", "", 0, lambda: b.vmm_unmap(ptr, 2 << 20)),
        ("pool_create", "", 0, lambda: b.pool_create(0)),
        ("pool_create", "release threshold", 0, lambda: A.cuMemPoolSetAttribute(
            pool, A.MemPoolAttribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, drv.cuuint64_t(2**64 - 1))),
        ("pool_destroy", "", 0, lambda: b.pool_destroy(pool)),
        ("pool_alloc_async", "", 0, lambda: b.pool_alloc_async(pool, 1 << 20, s)),
        ("pool_usage", "", 0, lambda: b.pool_usage(pool)),
        ("pool_reset_high", "", 0, lambda: b.pool_reset_high(pool)),
        ("pool_trim", "", 0, lambda: b.pool_trim(pool, 0)),
        ("init", "cuDriverGetVersion", 0, lambda: A.cuDriverGetVersion()),
        ("init", "cuDeviceGetCount", 0, lambda: A.cuDeviceGetCount()),
        ("init", "cuDeviceGet", 0, lambda: A.cuDeviceGet(0)),
        ("init", "cuDevicePrimaryCtxRetain", 0, lambda: A.cuDevicePrimaryCtxRetain(b._devices[0])),
        ("init", "cuGetErrorName", 0, lambda: A.cuGetErrorName(drv.CUresult(2))),
        ("init", "cuGetErrorString", 0, lambda: A.cuGetErrorString(drv.CUresult(2))),
    ]
    interface = set(base.Backend.__abstractmethods__) | {
        m for m in vars(base.Backend) if m.startswith(("vmm_", "pool_"))}
    not_covered = interface - {c[0] for c in calls} - {
        "init", "driver_version", "device_count", "make_args", "null_stream", "nvml", "nccl",
        "blas", "fft"}  # (the library seams: objects of their own, tested with their libraries)
    assert not not_covered, f"add argument-shape checks for {sorted(not_covered)}"
    wrong = {}
    for name, variant, thread_device, call in calls:
        C._THREAD.device = thread_device
        key = f"{name} ({variant})" if variant else name
        try:
            call()
        except CudaError as exc:
            wrong[key] = f"CudaError before the driver call: {exc}"
        except RuntimeError as exc:  # the loader error: arguments were converted
            if "cuda" not in str(exc).lower():
                wrong[key] = f"unexpected RuntimeError: {exc}"
        except Exception as exc:
            wrong[key] = f"{type(exc).__name__}: {exc}"
        else:
            wrong[key] = "returned without calling the driver"
    assert not wrong, wrong


# ============================================================================ (b) GPU
NVRTC_SOURCE = r"""
extern "C" __global__ void pack_probe(unsigned long long* out, int a, unsigned int b,
                                      long long c, unsigned long long d, float e, double f) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        out[0] = (unsigned long long)(long long)a;
        out[1] = b;
        out[2] = (unsigned long long)c;
        out[3] = d;
        out[4] = __float_as_uint(e);
        out[5] = (unsigned long long)__double_as_longlong(f);
    }
}
extern "C" __global__ void fill_u32(unsigned int* p, unsigned int v, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = v;
}
"""


def compile_cubin(arch: str) -> bytes:
    """NVRTC -> CUBIN for ``arch`` (e.g. "sm_90"); needs no GPU."""
    from cuda.bindings import nvrtc

    def ok(res, what):
        if res[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{what}: {res[0]!r}")
        return res[1] if len(res) == 2 else None

    prog = ok(nvrtc.nvrtcCreateProgram(NVRTC_SOURCE.encode(), b"probe.cu", 0, [], []),
              "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode()]
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if res[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = ok(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(log.decode(errors="replace"))
        size = ok(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        ok(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def test_probe_kernel_compiles_without_gpu():
    try:
        cubin = compile_cubin("sm_90")
    except Exception as exc:  # NVRTC library not installed here
        pytest.skip(f"NVRTC unavailable: {exc}")
    assert cubin[:4] == b"\x7fELF"


@pytest.fixture
def cb():
    """A CudaBackend on the real driver, device 0 current."""
    b = C.CudaBackend()
    b.init()
    if b.device_count() < 1:
        pytest.skip("no CUDA device")
    b.set_context(0)
    return b


def _host_view(ptr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


@pytest.mark.gpu
def test_device_info(cb):
    assert cb.driver_version() >= 12000
    info = cb.device_info(0)
    assert cb.device_info(0) is info  # cached
    assert info.ordinal == 0 and info.simulated is False
    assert info.name and "\x00" not in info.name and info.name == info.name.strip()
    assert info.major >= 7 and info.minor >= 0
    assert info.total_memory > 1 << 30
    assert info.multi_processor_count > 0
    assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", info.uuid)
    assert re.fullmatch(r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-9a-fA-F]", info.pci_bus_id), \
        info.pci_bus_id
    assert info.warp_size == 32
    assert info.max_threads_per_block >= 1024
    assert info.max_threads_per_multi_processor >= 1024
    assert info.shared_memory_per_block_optin >= info.shared_memory_per_block > 0
    assert info.shared_memory_per_multiprocessor >= info.shared_memory_per_block
    assert info.regs_per_multiprocessor >= 65536
    assert info.l2_cache_size > 0 and info.memory_bus_width > 0
    assert info.unified_addressing is True
    assert info.extra["driver_version"] == cb.driver_version()
    free, total = cb.mem_get_info(0)
    assert 0 < free <= total and abs(total - info.total_memory) <= total // 10


@pytest.mark.gpu
def test_alloc_copy_free_round_trip(cb):
    n = 1 << 20
    src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    out = np.zeros(n, np.uint8)
    a = cb.mem_alloc(0, n)
    bptr = cb.mem_alloc(0, n)
    try:
        cb.memcpy(0, a, src.ctypes.data, n)  # H2D (pageable)
        cb.memcpy(0, bptr, a, n)  # D2D
        cb.memcpy(0, out.ctypes.data, bptr, n)  # D2H
        assert np.array_equal(out, src)
    finally:
        cb.mem_free(0, a)
        cb.mem_free(0, bptr)


@pytest.mark.gpu
def test_async_round_trip_with_pinned_memory(cb):
    n = 1 << 20
    s = cb.stream_create(0)
    pinned = cb.host_alloc(n)
    try:
        host = _host_view(pinned, n)
        host[:] = np.arange(n, dtype=np.uint64).astype(np.uint8)
        d = cb.mem_alloc_async(0, n, s)
        cb.memcpy_async(0, d, pinned, n, s)
        cb.memset_d8_async(0, d, 0x11, 16, s)
        out = np.zeros(n, np.uint8)
        cb.memcpy_async(0, out.ctypes.data, d, n, s)
        cb.mem_free_async(0, d, s)
        cb.stream_synchronize(s)
        assert cb.stream_query(s) is True
        assert (out[:16] == 0x11).all()
        assert np.array_equal(out[16:], host[16:])
    finally:
        cb.host_free(pinned)
        cb.stream_destroy(s)


@pytest.mark.gpu
def test_memset(cb):
    n = 4096
    d = cb.mem_alloc(0, n)
    try:
        cb.memset_d8(0, d, 0xAB, n)
        out = np.zeros(n, np.uint8)
        cb.memcpy(0, out.ctypes.data, d, n)
        assert (out == 0xAB).all()
        s = cb.null_stream(0)
        assert cb.handle_int(s) == 0
        cb.memset_d32_async(0, d, 0xDEADBEEF, n // 4, s)
        cb.memset_d8_async(0, d, -1, 4, s)  # -1 -> 0xFF
        cb.stream_synchronize(s)
        words = np.zeros(n // 4, np.uint32)
        cb.memcpy(0, words.ctypes.data, d, n)
        assert words[0] == 0xFFFFFFFF and (words[1:] == 0xDEADBEEF).all()
        cb.memset_d16_async(0, d + 2, 0x3C00, 3, s)  # 2-byte aligned, not 4
        cb.stream_synchronize(s)
        halves = np.zeros(8, np.uint16)
        cb.memcpy(0, halves.ctypes.data, d, 16)
        # (0xDEADBEEF little-endian: 0xBEEF, then 0xDEAD)
        assert list(halves[:6]) == [0xFFFF, 0x3C00, 0x3C00, 0x3C00, 0xBEEF, 0xDEAD]
    finally:
        cb.mem_free(0, d)


@pytest.mark.gpu
def test_stream_priorities_are_clamped(cb):
    least, greatest = cb.stream_priority_range(0)
    assert greatest <= least
    made = []
    try:
        for asked, expect in [(-100, greatest), (100, least), (least, least), (greatest, greatest)]:
            s = cb.stream_create(0, base.STREAM_NON_BLOCKING, asked)
            made.append(s)
            assert cb.stream_priority(s) == expect
            assert cb.stream_is_capturing(s) is False
            assert cb.stream_query(s) is True
        e = cb.event_create(0)
        cb.event_record(e, made[0])
        cb.stream_wait_event(made[1], e)
        cb.stream_synchronize(made[1])
        cb.event_destroy(e)
    finally:
        for s in made:
            cb.stream_destroy(s)


@pytest.mark.gpu
def test_event_timing_of_a_1gib_memset(cb):
    n = 1 << 30
    s = cb.stream_create(0)
    start = cb.event_create(0, base.EVENT_DEFAULT)
    end = cb.event_create(0, base.EVENT_DEFAULT)
    d = cb.mem_alloc(0, n)
    try:
        cb.event_record(start, s)
        cb.memset_d8_async(0, d, 1, n, s)
        cb.event_record(end, s)
        assert cb.event_query(end) in (True, False)
        cb.event_synchronize(end)
        assert cb.event_query(end) is True
        ms = cb.event_elapsed_time(start, end)
        assert isinstance(ms, float) and ms > 0
    finally:
        cb.mem_free(0, d)
        cb.event_destroy(start)
        cb.event_destroy(end)
        cb.stream_destroy(s)


@pytest.mark.gpu
def test_ipc_event_handle(cb):
    e = cb.event_create(0, base.EVENT_INTERPROCESS | base.EVENT_DISABLE_TIMING)
    try:
        h = cb.ipc_event_handle(e)
        assert isinstance(h, bytes) and len(h) == base.IPC_HANDLE_SIZE
        assert h != bytes(64)
        with pytest.raises(ValueError):
            cb.ipc_open_event(0, h[:-1])
    finally:
        cb.event_destroy(e)


@pytest.mark.gpu
def test_pointer_device(cb):
    d = cb.mem_alloc(0, 256)
    s = cb.stream_create(0)
    pinned = cb.host_alloc(256)
    try:
        assert cb.pointer_device(d) == 0
        assert cb.pointer_device(d + 128) == 0
        da = cb.mem_alloc_async(0, 256, s)
        cb.stream_synchronize(s)
        assert cb.pointer_device(da) == 0
        cb.mem_free_async(0, da, s)
        cb.stream_synchronize(s)
        host = np.zeros(256, np.uint8)
        assert cb.pointer_device(host.ctypes.data) is None
        assert cb.pointer_device(pinned) is None
        assert cb.pointer_device(0) is None
    finally:
        cb.mem_free(0, d)
        cb.host_free(pinned)
        cb.stream_destroy(s)


@pytest.mark.gpu
def test_out_of_memory(cb):
    with pytest.raises(OutOfMemoryError) as info:
        cb.mem_alloc(0, 1 << 50)  # 1 PiB
    e = info.value
    assert e.code == 2 and e.name == "CUDA_ERROR_OUT_OF_MEMORY" and e.call == "cuMemAlloc"
    assert e.message  # the driver's description
    d = cb.mem_alloc(0, 1024)  # still usable
    cb.mem_free(0, d)


@pytest.mark.gpu
def test_double_free_raises(cb):
    d = cb.mem_alloc(0, 1 << 20)
    cb.mem_free(0, d)
    with pytest.raises(CudaError) as info:
        cb.mem_free(0, d)
    assert not isinstance(info.value, OutOfMemoryError)
    assert info.value.call == "cuMemFree" and info.value.name.startswith("CUDA_ERROR_")
    d = cb.mem_alloc(0, 1024)
    cb.mem_free(0, d)


@pytest.mark.gpu
def test_module_load_and_launch(cb):
    info = cb.device_info(0)
    cubin = compile_cubin(f"sm_{info.major}{info.minor}")  # NVRTC ships with the GPU image
    mod = cb.module_load(0, cubin)
    s = cb.stream_create(0)
    out = cb.mem_alloc(0, 64)
    try:
        probe = cb.module_function(mod, "pack_probe")
        args = cb.make_args(("p", "i4", "u4", "i8", "u8", "f4", "f8"))
        vals = (out, -7, 0xFFFFFFFE, -(2**40), 2**64 - 3, 1.5, -0.1)
        cb.launch(probe, (1, 1, 1), (32, 1, 1), 0, s, args.set(*vals))
        args.set(0, 0, 0, 0, 0, 0.0, 0.0)  # values are copied at launch: safe to reuse
        cb.stream_synchronize(s)
        got = np.zeros(6, np.uint64)
        cb.memcpy(0, got.ctypes.data, out, 48)
        assert int(got[0]) == (-7) & (2**64 - 1)
        assert int(got[1]) == 0xFFFFFFFE
        assert int(got[2]) == (-(2**40)) & (2**64 - 1)
        assert int(got[3]) == 2**64 - 3
        assert int(got[4]) == int(np.array(1.5, np.float32).view(np.uint32))
        assert int(got[5]) == int(np.array(-0.1, np.float64).view(np.uint64))

        n = 1000
        buf = cb.mem_alloc(0, n * 4)
        fill = cb.module_function(mod, "fill_u32")
        cb.launch(fill, ((n + 255) // 256, 1, 1), (256, 1, 1), 0, cb.null_stream(0),
                  cb.make_args(("p", "u4", "i4")).set(buf, 0xC0FFEE, n))
        cb.synchronize(0)
        words = np.zeros(n, np.uint32)
        cb.memcpy(0, words.ctypes.data, buf, n * 4)
        cb.mem_free(0, buf)
        assert (words == 0xC0FFEE).all()

        with pytest.raises(CudaError) as err:
            cb.module_function(mod, "no_such_kernel")
        assert err.value.name == "CUDA_ERROR_NOT_FOUND"
    finally:
        cb.mem_free(0, out)
        cb.stream_destroy(s)
        cb.module_unload(mod)


@pytest.mark.gpu
def test_fresh_thread_gets_a_context(cb):
    result = {}

    def worker():
        try:
            p = cb.host_alloc(4096)  # no context on this thread yet: any-context path
            cb.host_free(p)
            d = cb.mem_alloc(0, 4096)
            cb.memset_d8(0, d, 3, 4096)
            out = np.zeros(4096, np.uint8)
            cb.memcpy(0, out.ctypes.data, d, 4096)
            cb.mem_free(0, d)
            result["ok"] = bool((out == 3).all())
        except Exception as exc:  # reported below
            result["error"] = exc

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert result == {"ok": True}


@pytest.mark.gpu
def test_stream_from_int(cb):
    assert cb.stream_from_int(0, 0) is cb.null_stream(0)
    assert cb.handle_int(cb.stream_from_int(0, 2)) == 2
    s = cb.stream_create(0)
    try:
        wrapped = cb.stream_from_int(0, cb.handle_int(s))
        assert cb.handle_int(wrapped) == cb.handle_int(s)
        assert cb.stream_query(wrapped) is True
        cb.stream_synchronize(cb.stream_from_int(0, 2))  # per-thread default stream
    finally:
        cb.stream_destroy(s)


@pytest.mark.gpu
def test_vmm_round_trip(cb):
    g = cb.vmm_granularity(0)
    assert g > 0 and g & (g - 1) == 0
    base_ptr = cb.vmm_reserve(0, 4 * g)
    handle = cb.vmm_create(0, 2 * g)
    try:
        cb.vmm_map(0, base_ptr, 2 * g, handle)
        try:
            cb.memset_d8(0, base_ptr, 0x5A, 2 * g)
            out = np.zeros(2 * g, np.uint8)
            cb.memcpy(0, out.ctypes.data, base_ptr, 2 * g)
            assert (out == 0x5A).all()
            assert cb.pointer_device(base_ptr + g) == 0
        finally:
            cb.synchronize(0)
            cb.vmm_unmap(base_ptr, 2 * g)
    finally:
        cb.vmm_release(handle)
        cb.vmm_free_address(base_ptr, 4 * g)
    too_big = (cb.device_info(0).total_memory // g + 1) * g
    with pytest.raises(OutOfMemoryError):
        h = cb.vmm_create(0, too_big)
        cb.vmm_release(h)


@pytest.mark.gpu
def test_pool_usage(cb):
    pool = cb.pool_create(0)
    s = cb.stream_create(0)
    try:
        p = cb.pool_alloc_async(pool, 1 << 20, s)
        cb.stream_synchronize(s)
        assert cb.pointer_device(p) == 0
        reserved, reserved_high, used, used_high = cb.pool_usage(pool)
        assert used >= 1 << 20 and reserved >= used and reserved_high >= reserved
        assert used_high >= used
        cb.mem_free_async(0, p, s)
        cb.stream_synchronize(s)
        reserved, _, used, used_high = cb.pool_usage(pool)
        assert used == 0 and used_high >= 1 << 20
        assert reserved >= 1 << 20  # cached: release threshold is unlimited
        cb.pool_reset_high(pool)
        assert cb.pool_usage(pool)[3] == 0
        cb.pool_trim(pool, 0)
        assert cb.pool_usage(pool)[0] == 0
        with pytest.raises(OutOfMemoryError):
            cb.pool_alloc_async(pool, 1 << 50, s)
    finally:
        cb.stream_synchronize(s)
        cb.stream_destroy(s)
        cb.pool_destroy(pool)


@pytest.mark.gpu
def test_peer_queries_single_device(cb):
    assert isinstance(cb.can_access_peer(0, 0), bool)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_peer_copy(cb):
    if cb.device_count() < 2:
        pytest.skip("needs two GPUs")
    n = 1 << 20
    src_host = np.arange(n, dtype=np.uint32).view(np.uint8)[:n]
    a = cb.mem_alloc(0, n)
    b1 = cb.mem_alloc(1, n)
    s = cb.stream_create(0)
    try:
        cb.memcpy(0, a, src_host.ctypes.data, n)
        cb.set_context(0)
        cb.memcpy_peer_async(b1, 1, a, 0, n, s)  # works with or without peer access
        cb.stream_synchronize(s)
        out = np.zeros(n, np.uint8)
        cb.memcpy(1, out.ctypes.data, b1, n)
        assert np.array_equal(out, src_host)
        assert cb.pointer_device(b1) == 1
        if cb.can_access_peer(0, 1):
            cb.enable_peer_access(0, 1)
            cb.enable_peer_access(0, 1)  # already enabled: fine
    finally:
        cb.mem_free(0, a)
        cb.mem_free(1, b1)
        cb.stream_destroy(s)


@pytest.mark.gpu
def test_nvml_is_cached(cb):
    assert cb.nvml() is cb.nvml()


@pytest.mark.gpu
def test_ipc_mem_handle_semantics_the_simulator_copies(cb):
    # Checked on an H100: any address inside a cuMemAlloc allocation gives its handle; pool,
    # virtual, host memory and 0 are refused with CUDA_ERROR_INVALID_VALUE.
    p = cb.mem_alloc(0, 4 << 20)
    other = cb.mem_alloc(0, 4096)
    s = cb.stream_create(0)
    pool = cb.pool_create(0)
    pooled = cb.pool_alloc_async(pool, 4096, s)
    host = cb.host_alloc(4096)
    try:
        h = cb.ipc_mem_handle(p)
        assert isinstance(h, bytes) and len(h) == base.IPC_HANDLE_SIZE
        assert cb.ipc_mem_handle(p) == cb.ipc_mem_handle(p + 512) == h
        assert cb.ipc_mem_handle(other) != h
        for ptr in (pooled, host, 0):
            with pytest.raises(CudaError) as info:
                cb.ipc_mem_handle(ptr)
            assert info.value.code == 1 and info.value.call == "cuIpcGetMemHandle"
    finally:
        cb.mem_free_async(0, pooled, s)
        cb.stream_synchronize(s)
        cb.pool_destroy(pool)
        cb.stream_destroy(s)
        cb.host_free(host)
        cb.mem_free(0, other)
        cb.mem_free(0, p)
