"""The real driver seam: :class:`CudaBackend` over ``cuda.bindings.driver``.

``import cudalab`` never imports this module; :func:`cudalab._driver.get_backend` imports it on
first use. Importing it loads the Cython bindings (~70 ms) but not ``libcuda``: the driver
library is opened by the first driver call, inside :meth:`CudaBackend.init`, which turns a
missing driver into :class:`cudalab.errors.DriverNotFoundError`.

Conventions (see :mod:`cudalab._driver.base`):

* Every failing call raises :class:`cudalab.errors.CudaError` built by :func:`_check` /
  :func:`_error` with the driver's error name and string; ``CUDA_ERROR_OUT_OF_MEMORY`` raises
  :class:`cudalab.errors.OutOfMemoryError`.
* Handles are the bindings' own objects (``CUstream``, ``CUevent``, ``CUmodule``,
  ``CUfunction``), passed back to the driver unchanged; device and host pointers are ints.
* Contexts are the devices' primary contexts (shared with the runtime API, CuPy, torch and
  cuda.core), retained once and never released. Calls that take ``device`` (and
  :meth:`CudaBackend.set_context`) make its primary context current through
  :meth:`CudaBackend._ctx`, which asks the driver which context is current first (so a device
  switch made by torch or CuPy is noticed). :meth:`CudaBackend.set_context`, used only before
  null-stream work, trusts the per-thread record (a stale record there makes the driver report
  an invalid handle, never a silent wrong-device operation); :meth:`resync_context` re-reads it.
* Hot paths (record/query/launch/stream-ordered alloc and copies) are one binding call and one
  integer test; no dicts, no logging, no context queries.
* No API newer than CUDA 13.0 is used (the GPU hosts run driver 580 = API 13000). Anything
  newer must be gated on ``driver_version() >= 13010``.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from cudalab._driver.base import (
    EVENT_DISABLE_TIMING,
    IPC_HANDLE_SIZE,
    STREAM_NON_BLOCKING,
    Backend,
    DeviceInfo,
    FastPaths,
    KernelArgs,
)
from cudalab.errors import CudaError, DriverNotFoundError, OutOfMemoryError

try:  # the bindings are a hard dependency, but a missing wheel must not break `import`.
    from cuda.bindings import driver as _drv
except ImportError as _exc:  # pragma: no cover - exercised only without cuda-bindings
    _drv = None
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None

# ------------------------------------------------------------------------------------ codes
# CUresult values used on hot paths, as plain ints (CUresult is an int subclass: `err == 600`
# uses int.__eq__, and CUDA_SUCCESS is falsy).
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_STUB_LIBRARY = 34
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704

#: CU_MEMHOSTALLOC_PORTABLE: pinned memory that counts as pinned in every context.
CU_MEMHOSTALLOC_PORTABLE = 1
# CUmemorytype values (CU_POINTER_ATTRIBUTE_MEMORY_TYPE).
_MEMORYTYPE_DEVICE = 2
_MEMORYTYPE_UNIFIED = 4


def _no_bindings(*_args, **_kwargs):  # pragma: no cover - only without cuda-bindings
    raise DriverNotFoundError(
        "cuda-bindings is not installed (import cuda.bindings.driver failed: "
        f"{_IMPORT_ERROR}); install cuda-bindings>=13.3,<14"
    )


# ------------------------------------------------------------------ binding aliases
# Module-level names so hot paths do one global lookup and one call.
if _drv is not None:
    _cuInit = _drv.cuInit
    _cuDriverGetVersion = _drv.cuDriverGetVersion
    _cuDeviceGetCount = _drv.cuDeviceGetCount
    _cuDeviceGet = _drv.cuDeviceGet
    _cuDeviceGetAttribute = _drv.cuDeviceGetAttribute
    _cuDeviceGetName = _drv.cuDeviceGetName
    _cuDeviceTotalMem = _drv.cuDeviceTotalMem
    _cuDeviceGetUuid = _drv.cuDeviceGetUuid
    _cuDeviceGetPCIBusId = _drv.cuDeviceGetPCIBusId
    _cuDeviceCanAccessPeer = _drv.cuDeviceCanAccessPeer
    _cuDevicePrimaryCtxRetain = _drv.cuDevicePrimaryCtxRetain
    _cuCtxGetCurrent = _drv.cuCtxGetCurrent
    _cuCtxSetCurrent = _drv.cuCtxSetCurrent
    _cuCtxSynchronize = _drv.cuCtxSynchronize
    _cuCtxEnablePeerAccess = _drv.cuCtxEnablePeerAccess
    _cuCtxGetStreamPriorityRange = _drv.cuCtxGetStreamPriorityRange
    _cuMemAlloc = _drv.cuMemAlloc
    _cuMemFree = _drv.cuMemFree
    _cuMemAllocAsync = _drv.cuMemAllocAsync
    _cuMemFreeAsync = _drv.cuMemFreeAsync
    _cuMemGetInfo = _drv.cuMemGetInfo
    _cuMemHostAlloc = _drv.cuMemHostAlloc
    _cuMemFreeHost = _drv.cuMemFreeHost
    _cuMemcpy = _drv.cuMemcpy
    _cuMemcpyAsync = _drv.cuMemcpyAsync
    _cuMemcpyPeerAsync = _drv.cuMemcpyPeerAsync
    _cuMemsetD8 = _drv.cuMemsetD8
    _cuMemsetD8Async = _drv.cuMemsetD8Async
    _cuMemsetD32Async = _drv.cuMemsetD32Async
    _cuPointerGetAttribute = _drv.cuPointerGetAttribute
    _cuStreamCreateWithPriority = _drv.cuStreamCreateWithPriority
    _cuStreamDestroy = _drv.cuStreamDestroy
    _cuStreamQuery = _drv.cuStreamQuery
    _cuStreamSynchronize = _drv.cuStreamSynchronize
    _cuStreamWaitEvent = _drv.cuStreamWaitEvent
    _cuStreamGetPriority = _drv.cuStreamGetPriority
    _cuStreamIsCapturing = _drv.cuStreamIsCapturing
    _cuEventCreate = _drv.cuEventCreate
    _cuEventDestroy = _drv.cuEventDestroy
    _cuEventRecord = _drv.cuEventRecord
    _cuEventQuery = _drv.cuEventQuery
    _cuEventSynchronize = _drv.cuEventSynchronize
    # CUDA 12.8 added cuEventElapsedTime_v2; CUDA 13's header maps the plain name onto it and
    # bindings 13.x (13.3.1 and 13.5.0 checked) export only `cuEventElapsedTime`. Bindings
    # 12.8/12.9 export both; the plain name also works with pre-12.8 drivers, so prefer it.
    _cuEventElapsedTime = getattr(_drv, "cuEventElapsedTime", None) or _drv.cuEventElapsedTime_v2
    _cuIpcGetEventHandle = _drv.cuIpcGetEventHandle
    _cuIpcOpenEventHandle = _drv.cuIpcOpenEventHandle
    _cuModuleLoadData = _drv.cuModuleLoadData
    _cuModuleUnload = _drv.cuModuleUnload
    _cuModuleGetFunction = _drv.cuModuleGetFunction
    _cuLaunchKernel = _drv.cuLaunchKernel
    _cuMemGetAllocationGranularity = _drv.cuMemGetAllocationGranularity
    _cuMemAddressReserve = _drv.cuMemAddressReserve
    _cuMemAddressFree = _drv.cuMemAddressFree
    _cuMemCreate = _drv.cuMemCreate
    _cuMemRelease = _drv.cuMemRelease
    _cuMemMap = _drv.cuMemMap
    _cuMemSetAccess = _drv.cuMemSetAccess
    _cuMemUnmap = _drv.cuMemUnmap
    _cuMemPoolCreate = _drv.cuMemPoolCreate
    _cuMemPoolDestroy = _drv.cuMemPoolDestroy
    _cuMemAllocFromPoolAsync = _drv.cuMemAllocFromPoolAsync
    _cuMemPoolGetAttribute = _drv.cuMemPoolGetAttribute
    _cuMemPoolSetAttribute = _drv.cuMemPoolSetAttribute
    _cuMemPoolTrimTo = _drv.cuMemPoolTrimTo
    _cuGetErrorName = _drv.cuGetErrorName
    _cuGetErrorString = _drv.cuGetErrorString
    _CUstream = _drv.CUstream
    _CUipcEventHandle = _drv.CUipcEventHandle
    # Enum members (cuPointerGetAttribute reads `attr.value`, so plain ints do not work there).
    _PA_MEMORY_TYPE = _drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE
    _PA_DEVICE_ORDINAL = _drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    _DA = _drv.CUdevice_attribute
    _MPA = _drv.CUmemPool_attribute
else:  # pragma: no cover - only without cuda-bindings
    _cuInit = _cuDriverGetVersion = _cuDeviceGetCount = _cuDeviceGet = _no_bindings
    _cuDeviceGetAttribute = _cuDeviceGetName = _cuDeviceTotalMem = _no_bindings
    _cuDeviceGetUuid = _cuDeviceGetPCIBusId = _cuDeviceCanAccessPeer = _no_bindings
    _cuDevicePrimaryCtxRetain = _cuCtxGetCurrent = _cuCtxSetCurrent = _no_bindings
    _cuCtxSynchronize = _cuCtxEnablePeerAccess = _cuCtxGetStreamPriorityRange = _no_bindings
    _cuMemAlloc = _cuMemFree = _cuMemAllocAsync = _cuMemFreeAsync = _no_bindings
    _cuMemGetInfo = _cuMemHostAlloc = _cuMemFreeHost = _cuMemcpy = _no_bindings
    _cuMemcpyAsync = _cuMemcpyPeerAsync = _cuMemsetD8 = _cuMemsetD8Async = _no_bindings
    _cuMemsetD32Async = _cuPointerGetAttribute = _no_bindings
    _cuStreamCreateWithPriority = _cuStreamDestroy = _cuStreamQuery = _no_bindings
    _cuStreamSynchronize = _cuStreamWaitEvent = _cuStreamGetPriority = _no_bindings
    _cuStreamIsCapturing = _cuEventCreate = _cuEventDestroy = _cuEventRecord = _no_bindings
    _cuEventQuery = _cuEventSynchronize = _cuEventElapsedTime = _no_bindings
    _cuIpcGetEventHandle = _cuIpcOpenEventHandle = _cuModuleLoadData = _no_bindings
    _cuModuleUnload = _cuModuleGetFunction = _cuLaunchKernel = _no_bindings
    _cuMemGetAllocationGranularity = _cuMemAddressReserve = _cuMemAddressFree = _no_bindings
    _cuMemCreate = _cuMemRelease = _cuMemMap = _cuMemSetAccess = _cuMemUnmap = _no_bindings
    _cuMemPoolCreate = _cuMemPoolDestroy = _cuMemAllocFromPoolAsync = _no_bindings
    _cuMemPoolGetAttribute = _cuMemPoolSetAttribute = _cuMemPoolTrimTo = _no_bindings
    _cuGetErrorName = _cuGetErrorString = _CUstream = _CUipcEventHandle = _no_bindings
    _PA_MEMORY_TYPE = _PA_DEVICE_ORDINAL = _DA = _MPA = None


# ------------------------------------------------------------------------------ errors
#: code -> (name, description), filled on first use of each code.
_ERROR_TEXT: dict[int, tuple[str, str]] = {}


def _decode(raw: Any) -> str:
    if raw is None:
        return ""
    if isinstance(raw, (bytes, bytearray)):
        return bytes(raw).split(b"\x00", 1)[0].decode("utf-8", "replace").strip()
    return str(raw)


def _lookup_error_text(code: int) -> tuple[str, str]:
    """(name, description) of a CUresult from the driver (cuGetErrorName/cuGetErrorString).

    Falls back to the bindings' enum name and an empty description when the driver cannot
    answer (not loadable, unknown code). Tests replace this function.
    """
    name = ""
    text = ""
    member = None
    if _drv is not None:
        try:
            member = _drv.CUresult(code)
        except (ValueError, TypeError):
            member = None
    if member is not None:
        try:
            err, raw = _cuGetErrorName(member)
            if not err:
                name = _decode(raw)
            err, raw = _cuGetErrorString(member)
            if not err:
                text = _decode(raw)
        except Exception:  # driver missing or half-loaded: keep the enum's own name
            pass
        if not name:
            name = getattr(member, "name", "") or ""
    return name, text


def _error_text(code: int) -> tuple[str, str]:
    cached = _ERROR_TEXT.get(code)
    if cached is not None:
        return cached
    name, text = _lookup_error_text(code)
    if name:  # only cache real answers, so a later driver load can still fill them in
        _ERROR_TEXT[code] = (name, text)
    return name, text


def _error(code: Any, call: str) -> CudaError:
    """The exception for a failed driver call (OutOfMemoryError for CUDA_ERROR_OUT_OF_MEMORY)."""
    code = int(code)
    name, text = _error_text(code)
    if code == CUDA_ERROR_OUT_OF_MEMORY:
        return OutOfMemoryError(code, name or "CUDA_ERROR_OUT_OF_MEMORY", text or "out of memory",
                                call=call)
    return CudaError(code, name, text, call=call)


def _check(result: tuple, call: str) -> Any:
    """Raise for a failed binding call; return its out-parameters.

    ``result`` is the bindings' tuple ``(CUresult, *outs)``: returns None for no outs, the
    value for one, and a tuple for several.
    """
    err = result[0]
    if err:
        raise _error(err, call)
    n = len(result)
    if n == 2:
        return result[1]
    if n == 1:
        return None
    return tuple(result[1:])


# ------------------------------------------------------------------------- kernel args
#: signature code -> (struct format of the 8-byte slot, min, max) (min/max None for floats).
_ARG_KINDS: dict[str, tuple[str, int | None, int | None]] = {
    "p": ("Q", 0, 2**64 - 1),
    "i4": ("i4x", -(2**31), 2**31 - 1),
    "u4": ("I4x", 0, 2**32 - 1),
    "i8": ("q", -(2**63), 2**63 - 1),
    "u8": ("Q", 0, 2**64 - 1),
    "f4": ("f4x", None, None),
    "f8": ("d", None, None),
}
_ARG_DTYPES = {
    "p": np.uint64, "i4": np.int32, "u4": np.uint32, "i8": np.int64,
    "u8": np.uint64, "f4": np.float32, "f8": np.float64,
}
_F4_MAX = float(np.finfo(np.float32).max)


class CudaKernelArgs(KernelArgs):
    """Pre-packed ``void*[]`` kernel parameters for ``cuLaunchKernel``.

    Storage is one 8-byte-aligned slot per parameter in a single numpy buffer (``views[i]`` is
    the parameter's one-element array of its own dtype), plus an ``intp`` array holding the
    slots' addresses; :attr:`address_int` is that array's address, which ``cuLaunchKernel``
    accepts directly as ``kernelParams``. :meth:`set` writes all values with one precompiled
    ``struct.pack``. The driver copies parameter values at launch, so a pack can be
    re-set right after a launch.
    """

    __slots__ = ("signature", "views", "address_int", "_buf", "_mv", "_ptrs", "_struct")

    def __init__(self, signature: Sequence[str]):
        sig = tuple(signature)
        for kind in sig:
            if kind not in _ARG_KINDS:
                raise ValueError(
                    f"unknown kernel parameter type {kind!r}; expected one of "
                    f"{', '.join(_ARG_KINDS)}"
                )
        n = len(sig)
        self.signature = sig
        self._struct = struct.Struct("=" + "".join(_ARG_KINDS[k][0] for k in sig))
        self._buf = np.zeros(max(n, 1), dtype=np.uint64)
        self._mv = memoryview(self._buf).cast("B")[: self._struct.size]
        base = self._buf.ctypes.data
        self.views = tuple(self._buf[i:i + 1].view(_ARG_DTYPES[k])[:1] for i, k in enumerate(sig))
        self._ptrs = np.array([base + 8 * i for i in range(n)], dtype=np.intp)
        # NULL kernelParams for a kernel without parameters.
        self.address_int = int(self._ptrs.ctypes.data) if n else 0

    def set(self, *values: Any) -> CudaKernelArgs:
        try:
            # pack() then one copy: atomic (a failed set leaves the pack untouched) and faster
            # than pack_into() on a numpy buffer.
            self._mv[:] = self._struct.pack(*values)
        except (struct.error, OverflowError, TypeError) as exc:
            self._raise_for(values, exc)
        return self

    def _raise_for(self, values: tuple, exc: Exception) -> None:
        """Turn a failed pack into a precise error: ValueError for a wrong argument count or
        a value out of range, TypeError for a value of the wrong kind."""
        sig = self.signature
        if len(values) != len(sig):
            raise ValueError(
                f"kernel takes {len(sig)} argument(s) {sig}, got {len(values)}"
            ) from None
        for i, (kind, value) in enumerate(zip(sig, values)):
            _fmt, lo, hi = _ARG_KINDS[kind]
            if lo is None:
                if isinstance(value, (str, bytes, bytearray)):
                    raise TypeError(
                        f"kernel argument {i} ({kind}) must be a real number, got "
                        f"{type(value).__name__}"
                    ) from None
                try:
                    v = float(value)
                except OverflowError:
                    raise ValueError(
                        f"kernel argument {i} ({kind}) = {value!r} is out of range"
                    ) from None
                except (TypeError, ValueError):
                    raise TypeError(
                        f"kernel argument {i} ({kind}) must be a real number, got "
                        f"{type(value).__name__}"
                    ) from None
                if kind == "f4" and abs(v) > _F4_MAX and abs(v) != float("inf"):
                    raise ValueError(
                        f"kernel argument {i} ({kind}) = {value!r} is out of float32 range"
                    ) from None
            else:
                try:
                    v = value.__index__()
                except (AttributeError, TypeError):
                    raise TypeError(
                        f"kernel argument {i} ({kind}) must be an integer, got "
                        f"{type(value).__name__}"
                    ) from None
                if not lo <= v <= hi:
                    raise ValueError(
                        f"kernel argument {i} ({kind}) = {v} is out of range [{lo}, {hi}]"
                    ) from None
        raise ValueError(f"cannot pack kernel arguments {values!r}: {exc}") from exc

    @property
    def values(self) -> tuple:
        return self._struct.unpack_from(self._buf, 0)

    def __repr__(self) -> str:
        return f"CudaKernelArgs({self.signature!r}, values={self.values!r})"


# ------------------------------------------------------------- pointer -> device ordinal
# cuda-bindings 13.3.1 (the GPU image's version) returns 0 for every
# cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL) call: its attribute helper lets
# the driver write a C int but hands back a different, zero-initialised field (fixed by 13.5,
# seen on 2 x H200: device-1 memory reported as device 0). So this one query goes straight to
# libcuda through ctypes (the library is already loaded by the bindings at that point), with
# the bindings as a fallback where ctypes cannot open it.
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
_libcuda_fn: Any = None


def _libcuda_pointer_get_attribute() -> Any:
    global _libcuda_fn
    if _libcuda_fn is None:
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuPointerGetAttribute
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = False
        _libcuda_fn = fn
    return _libcuda_fn


def _pointer_device_ordinal(ptr: int) -> tuple[int, int]:
    """(CUresult, device ordinal) of CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL for ``ptr``."""
    fn = _libcuda_pointer_get_attribute()
    if fn:
        out = ctypes.c_int(-1)
        err = fn(ctypes.byref(out), _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
        return err, out.value
    err, ordinal = _cuPointerGetAttribute(_PA_DEVICE_ORDINAL, ptr)
    return int(err), int(ordinal) if not err else -1


# --------------------------------------------------------------------------- the backend
class _ThreadState(threading.local):
    #: Device ordinal whose primary context cudalab last made current on this thread
    #: (-1: none yet). Class attribute = per-thread default.
    device = -1


#: Process-wide, per-thread record shared by every CudaBackend instance: the current context
#: belongs to the thread, not to a backend object, and primary contexts are per process.
_THREAD = _ThreadState()


def _fmt_uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class CudaBackend(Backend):
    """The CUDA driver through ``cuda.bindings.driver`` (one instance per process)."""

    name = "cuda"
    simulated = False

    def __init__(self) -> None:
        self._init_lock = threading.Lock()
        self._lock = threading.Lock()  # caches below
        self._initialized = False
        self._init_failure: str | None = None
        self._version = 0
        self._count = 0
        self._devices: list[Any] = []  # CUdevice handles by ordinal
        self._contexts: dict[int, Any] = {}  # ordinal -> retained primary CUcontext
        self._context_ints: dict[int, int] = {}
        self._infos: dict[int, DeviceInfo] = {}
        self._null_streams: dict[int, Any] = {}
        self._priority_ranges: dict[int, tuple[int, int]] = {}
        self._module_devices: dict[int, int] = {}
        self._granularity: dict[int, int] = {}
        self._nvml = None

    # ------------------------------------------------------------ lifecycle and identity
    def init(self) -> None:
        if self._initialized:
            return
        with self._init_lock:
            if self._initialized:
                return
            if self._init_failure is not None:
                raise DriverNotFoundError(self._init_failure)
            if _drv is None:
                self._init_failure = (
                    "cuda-bindings is not installed (import cuda.bindings.driver failed: "
                    f"{_IMPORT_ERROR}); install cuda-bindings>=13.3,<14"
                )
                raise DriverNotFoundError(self._init_failure)
            try:
                err = _cuInit(0)[0]
            except (RuntimeError, OSError) as exc:
                # cuda-pathfinder's DynamicLibNotFoundError (bindings >= 13.4) or
                # RuntimeError("Failed to dlopen libcuda.so.1") (bindings 13.3): no driver.
                self._init_failure = (
                    "no NVIDIA driver found (libcuda.so.1 could not be loaded): "
                    f"{type(exc).__name__}: {exc}"
                )
                raise DriverNotFoundError(self._init_failure) from exc
            if err == CUDA_ERROR_STUB_LIBRARY:
                self._init_failure = (
                    "no NVIDIA driver found (libcuda.so.1 is the CUDA toolkit's stub library, "
                    "not a driver)"
                )
                raise DriverNotFoundError(self._init_failure)
            try:
                self._version = int(_check(_cuDriverGetVersion(), "cuDriverGetVersion"))
            except CudaError:
                self._version = 0
            if err == CUDA_ERROR_NO_DEVICE:
                # A driver but no usable GPU (or CUDA_VISIBLE_DEVICES hides them all).
                self._count = 0
                self._devices = []
                self._initialized = True
                return
            if err:
                raise _error(err, "cuInit")
            count = int(_check(_cuDeviceGetCount(), "cuDeviceGetCount"))
            self._devices = [_check(_cuDeviceGet(i), "cuDeviceGet") for i in range(count)]
            self._count = count
            self._initialized = True

    def driver_version(self) -> int:
        if not self._initialized:
            self.init()
        return self._version

    def device_count(self) -> int:
        if not self._initialized:
            self.init()
        return self._count

    def _device(self, device: int) -> Any:
        """CUdevice handle of ordinal ``device`` (raises CudaError for a bad ordinal)."""
        if not self._initialized:
            self.init()
        if not 0 <= device < self._count:
            if self._count == 0:
                raise CudaError(CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE",
                                "no CUDA-capable device is detected", call="cuDeviceGet")
            raise CudaError(CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE",
                            f"invalid device ordinal {device} (device count {self._count})",
                            call="cuDeviceGet")
        return self._devices[device]

    def device_info(self, device: int) -> DeviceInfo:
        info = self._infos.get(device)
        if info is not None:
            return info
        # Attributes need no context: listing devices must not create contexts on all GPUs.
        dev = self._device(device)
        A = _DA

        def attr(name: str) -> int:
            return int(_check(_cuDeviceGetAttribute(getattr(A, "CU_DEVICE_ATTRIBUTE_" + name),
                                                    dev), "cuDeviceGetAttribute"))

        def opt_attr(name: str, default: int = 0) -> int:
            member = getattr(A, "CU_DEVICE_ATTRIBUTE_" + name, None)
            if member is None:
                return default
            try:
                return int(_check(_cuDeviceGetAttribute(member, dev), "cuDeviceGetAttribute"))
            except CudaError:
                return default

        name = _decode(_check(_cuDeviceGetName(256, dev), "cuDeviceGetName"))
        uuid_obj = _check(_cuDeviceGetUuid(dev), "cuDeviceGetUuid")
        uuid_raw = ctypes.string_at(uuid_obj.getPtr(), 16)
        pci = _decode(_check(_cuDeviceGetPCIBusId(64, dev), "cuDeviceGetPCIBusId"))
        extra = {
            "driver_version": self._version,
            "pci_bus_number": opt_attr("PCI_BUS_ID"),
            "max_blocks_per_multi_processor": opt_attr("MAX_BLOCKS_PER_MULTIPROCESSOR"),
            "max_grid_size": (opt_attr("MAX_GRID_DIM_X"), opt_attr("MAX_GRID_DIM_Y"),
                              opt_attr("MAX_GRID_DIM_Z")),
            "max_block_size": (opt_attr("MAX_BLOCK_DIM_X"), opt_attr("MAX_BLOCK_DIM_Y"),
                               opt_attr("MAX_BLOCK_DIM_Z")),
            "total_constant_memory": opt_attr("TOTAL_CONSTANT_MEMORY"),
            "async_engine_count": opt_attr("ASYNC_ENGINE_COUNT"),
            "concurrent_kernels": bool(opt_attr("CONCURRENT_KERNELS")),
            "memory_pools_supported": bool(opt_attr("MEMORY_POOLS_SUPPORTED")),
            "managed_memory": bool(opt_attr("MANAGED_MEMORY")),
            "concurrent_managed_access": bool(opt_attr("CONCURRENT_MANAGED_ACCESS")),
            "compute_preemption_supported": bool(opt_attr("COMPUTE_PREEMPTION_SUPPORTED")),
            "cooperative_launch": bool(opt_attr("COOPERATIVE_LAUNCH")),
            "ecc_enabled": bool(opt_attr("ECC_ENABLED")),
            "ipc_event_supported": bool(opt_attr("IPC_EVENT_SUPPORTED")),
            "stream_priorities_supported": bool(opt_attr("STREAM_PRIORITIES_SUPPORTED")),
            "multi_gpu_board_group_id": opt_attr("MULTI_GPU_BOARD_GROUP_ID"),
            "compute_mode": opt_attr("COMPUTE_MODE"),
            "max_persisting_l2_cache_size": opt_attr("MAX_PERSISTING_L2_CACHE_SIZE"),
        }
        info = DeviceInfo(
            ordinal=int(device),
            name=name,
            major=attr("COMPUTE_CAPABILITY_MAJOR"),
            minor=attr("COMPUTE_CAPABILITY_MINOR"),
            total_memory=int(_check(_cuDeviceTotalMem(dev), "cuDeviceTotalMem")),
            multi_processor_count=attr("MULTIPROCESSOR_COUNT"),
            uuid=_fmt_uuid(uuid_raw),
            pci_bus_id=pci,
            pci_domain_id=opt_attr("PCI_DOMAIN_ID"),
            pci_device_id=opt_attr("PCI_DEVICE_ID"),
            l2_cache_size=opt_attr("L2_CACHE_SIZE"),
            max_threads_per_multi_processor=attr("MAX_THREADS_PER_MULTIPROCESSOR"),
            max_threads_per_block=attr("MAX_THREADS_PER_BLOCK"),
            warp_size=attr("WARP_SIZE"),
            regs_per_multiprocessor=opt_attr("MAX_REGISTERS_PER_MULTIPROCESSOR"),
            shared_memory_per_block=opt_attr("MAX_SHARED_MEMORY_PER_BLOCK"),
            shared_memory_per_block_optin=opt_attr("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
            shared_memory_per_multiprocessor=opt_attr("MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"),
            # CLOCK_RATE / MEMORY_CLOCK_RATE are deprecated in CUDA 13 (kept as attributes);
            # 0 when the driver stops answering.
            clock_rate=opt_attr("CLOCK_RATE"),
            memory_clock_rate=opt_attr("MEMORY_CLOCK_RATE"),
            memory_bus_width=opt_attr("GLOBAL_MEMORY_BUS_WIDTH"),
            is_integrated=bool(opt_attr("INTEGRATED")),
            is_multi_gpu_board=bool(opt_attr("MULTI_GPU_BOARD")),
            unified_addressing=bool(opt_attr("UNIFIED_ADDRESSING")),
            simulated=False,
            extra=extra,
        )
        with self._lock:
            return self._infos.setdefault(device, info)

    # ------------------------------------------------------------------------- contexts
    def _primary(self, device: int) -> Any:
        """The retained primary context of ``device`` (retained once, never released)."""
        ctx = self._contexts.get(device)
        if ctx is not None:
            return ctx
        dev = self._device(device)
        with self._lock:
            ctx = self._contexts.get(device)
            if ctx is None:
                ctx = _check(_cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
                self._context_ints[device] = int(ctx)
                self._contexts[device] = ctx
        return ctx

    def _ctx(self, device: int) -> None:
        """Make ``device``'s primary context current on this thread.

        Asks the driver which context is current (about 0.25 µs) rather than trusting the
        per-thread record: torch or CuPy may have switched devices since cudalab last looked,
        and a cuMemAlloc in the wrong context would silently land on the wrong GPU. Only
        calls that name a device come here; the record/query hot paths do not.
        """
        want = self._context_ints.get(device)
        if want is not None:
            cur = _cuCtxGetCurrent()[1]
            if cur is not None and int(cur) == want:
                _THREAD.device = device
                return
        self._switch(device)

    def _switch(self, device: int) -> None:
        ctx = self._contexts.get(device)
        if ctx is None:
            ctx = self._primary(device)
        err = _cuCtxSetCurrent(ctx)[0]
        if err:
            raise _error(err, "cuCtxSetCurrent")
        _THREAD.device = device

    def _any_ctx(self) -> None:
        """Ensure *some* context is current (for calls such as cuMemHostAlloc that need one)."""
        if _THREAD.device >= 0:
            return
        cur = _check(_cuCtxGetCurrent(), "cuCtxGetCurrent")
        if cur is not None and int(cur):
            return  # a context another library (or the user) made current: use it
        self._switch(0)

    def set_context(self, device: int) -> None:
        # Same per-thread record as every other call (a new thread has none, so it sets).
        if _THREAD.device != device:
            self._switch(device)

    def resync_context(self) -> int:
        """Re-read this thread's current context from the driver (after another library such
        as CuPy or torch may have switched it) and return its device ordinal, -1 if it is not
        one of cudalab's primary contexts. Not part of the Backend interface."""
        cur = _check(_cuCtxGetCurrent(), "cuCtxGetCurrent")
        value = int(cur) if cur is not None else 0
        ordinal = -1
        for dev, ctx_int in list(self._context_ints.items()):
            if ctx_int == value and value:
                ordinal = dev
                break
        _THREAD.device = ordinal
        return ordinal

    def synchronize(self, device: int) -> None:
        self._ctx(device)
        err = _cuCtxSynchronize()[0]
        if err:
            raise _error(err, "cuCtxSynchronize")

    def can_access_peer(self, device: int, peer: int) -> bool:
        # A device-level query: no context needed (and none created).
        return bool(_check(_cuDeviceCanAccessPeer(self._device(device), self._device(peer)),
                           "cuDeviceCanAccessPeer"))

    def enable_peer_access(self, device: int, peer: int) -> None:
        peer_ctx = self._primary(peer)
        self._ctx(device)
        err = _cuCtxEnablePeerAccess(peer_ctx, 0)[0]
        if err and err != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
            raise _error(err, "cuCtxEnablePeerAccess")

    # --------------------------------------------------------------------------- memory
    def mem_alloc(self, device: int, nbytes: int) -> int:
        if nbytes == 0:
            return 0  # like torch: empty allocations are the null pointer
        self._ctx(device)
        res = _cuMemAlloc(nbytes)
        if res[0]:
            raise _error(res[0], "cuMemAlloc")
        return int(res[1])

    def mem_free(self, device: int, ptr: int) -> None:
        if not ptr:
            return
        self._ctx(device)
        err = _cuMemFree(ptr)[0]
        if err:
            raise _error(err, "cuMemFree")

    def mem_alloc_async(self, device: int, nbytes: int, stream: Any) -> int:
        if nbytes == 0:
            return 0
        self._ctx(device)
        res = _cuMemAllocAsync(nbytes, stream)
        if res[0]:
            raise _error(res[0], "cuMemAllocAsync")
        return int(res[1])

    def mem_free_async(self, device: int, ptr: int, stream: Any) -> None:
        if not ptr:
            return
        self._ctx(device)
        err = _cuMemFreeAsync(ptr, stream)[0]
        if err:
            raise _error(err, "cuMemFreeAsync")

    def mem_get_info(self, device: int) -> tuple[int, int]:
        self._ctx(device)
        free, total = _check(_cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def host_alloc(self, nbytes: int) -> int:
        self._any_ctx()
        return int(_check(_cuMemHostAlloc(nbytes, CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc"))

    def host_free(self, ptr: int) -> None:
        if not ptr:
            return
        self._any_ctx()
        err = _cuMemFreeHost(ptr)[0]
        if err:
            raise _error(err, "cuMemFreeHost")

    def memcpy(self, device: int, dst: int, src: int, nbytes: int) -> None:
        if not nbytes:
            return
        self._ctx(device)
        err = _cuMemcpy(dst, src, nbytes)[0]
        if err:
            raise _error(err, "cuMemcpy")

    def memcpy_async(self, device: int, dst: int, src: int, nbytes: int, stream: Any) -> None:
        if not nbytes:
            return
        self._ctx(device)
        err = _cuMemcpyAsync(dst, src, nbytes, stream)[0]
        if err:
            raise _error(err, "cuMemcpyAsync")

    def memcpy_peer_async(
        self, dst: int, dst_device: int, src: int, src_device: int, nbytes: int, stream: Any
    ) -> None:
        if not nbytes:
            return
        dst_ctx = self._contexts.get(dst_device)
        if dst_ctx is None:
            dst_ctx = self._primary(dst_device)
        src_ctx = self._contexts.get(src_device)
        if src_ctx is None:
            src_ctx = self._primary(src_device)
        err = _cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, nbytes, stream)[0]
        if err:
            raise _error(err, "cuMemcpyPeerAsync")

    def memset_d8(self, device: int, ptr: int, value: int, nbytes: int) -> None:
        if not nbytes:
            return
        self._ctx(device)
        err = _cuMemsetD8(ptr, value & 0xFF, nbytes)[0]
        if err:
            raise _error(err, "cuMemsetD8")

    def memset_d8_async(self, device: int, ptr: int, value: int, nbytes: int, stream: Any) -> None:
        if not nbytes:
            return
        self._ctx(device)
        err = _cuMemsetD8Async(ptr, value & 0xFF, nbytes, stream)[0]
        if err:
            raise _error(err, "cuMemsetD8Async")

    def memset_d32_async(self, device: int, ptr: int, value: int, count: int, stream: Any) -> None:
        if not count:
            return
        self._ctx(device)
        err = _cuMemsetD32Async(ptr, value & 0xFFFFFFFF, count, stream)[0]
        if err:
            raise _error(err, "cuMemsetD32Async")

    def pointer_device(self, ptr: int) -> int | None:
        if not ptr:
            return None
        self._any_ctx()
        err, mtype = _cuPointerGetAttribute(_PA_MEMORY_TYPE, ptr)
        if err == CUDA_ERROR_INVALID_VALUE:
            return None  # not allocated, mapped or registered with CUDA: plain host memory
        if err:
            raise _error(err, "cuPointerGetAttribute")
        if int(mtype) not in (_MEMORYTYPE_DEVICE, _MEMORYTYPE_UNIFIED):
            return None  # pinned / registered host memory
        err, ordinal = _pointer_device_ordinal(ptr)
        if err == CUDA_ERROR_INVALID_VALUE:
            return None
        if err:
            raise _error(err, "cuPointerGetAttribute")
        return ordinal if ordinal >= 0 else None

    # -------------------------------------------------------------------------- streams
    def null_stream(self, device: int) -> Any:
        s = self._null_streams.get(device)
        if s is None:
            self._device(device)  # validate the ordinal
            with self._lock:
                s = self._null_streams.setdefault(device, _CUstream(0))
        return s

    def stream_from_int(self, device: int, value: int) -> Any:
        if value == 0:
            return self.null_stream(device)
        self._device(device)  # validate the ordinal
        return _CUstream(value)  # 1 = CU_STREAM_LEGACY, 2 = CU_STREAM_PER_THREAD, else a handle

    def stream_create(self, device: int, flags: int = STREAM_NON_BLOCKING, priority: int = 0) -> Any:
        least, greatest = self.stream_priority_range(device)  # greatest <= least numerically
        prio = least if priority > least else greatest if priority < greatest else priority
        self._ctx(device)
        return _check(_cuStreamCreateWithPriority(flags, prio), "cuStreamCreateWithPriority")

    def stream_destroy(self, stream: Any) -> None:
        err = _cuStreamDestroy(stream)[0]
        if err:
            raise _error(err, "cuStreamDestroy")

    def fast_paths(self) -> FastPaths:
        # The bindings themselves: each returns (CUresult, ...) and never raises.
        return FastPaths(_cuEventRecord, _cuEventQuery, _cuStreamQuery, _cuEventElapsedTime)

    def status_error(self, status: int, call: str) -> Exception:
        return _error(status, call)

    def stream_query(self, stream: Any) -> bool:
        err = _cuStreamQuery(stream)[0]
        if not err:
            return True
        if err == CUDA_ERROR_NOT_READY:
            return False
        raise _error(err, "cuStreamQuery")

    def stream_synchronize(self, stream: Any) -> None:
        err = _cuStreamSynchronize(stream)[0]
        if err:
            raise _error(err, "cuStreamSynchronize")

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        err = _cuStreamWaitEvent(stream, event, 0)[0]
        if err:
            raise _error(err, "cuStreamWaitEvent")

    def stream_priority(self, stream: Any) -> int:
        return int(_check(_cuStreamGetPriority(stream), "cuStreamGetPriority"))

    def stream_priority_range(self, device: int) -> tuple[int, int]:
        rng = self._priority_ranges.get(device)
        if rng is None:
            self._ctx(device)
            least, greatest = _check(_cuCtxGetStreamPriorityRange(),
                                     "cuCtxGetStreamPriorityRange")
            rng = (int(least), int(greatest))
            with self._lock:
                self._priority_ranges[device] = rng
        return rng

    def stream_is_capturing(self, stream: Any) -> bool:
        status = _check(_cuStreamIsCapturing(stream), "cuStreamIsCapturing")
        return int(status) != 0  # CU_STREAM_CAPTURE_STATUS_NONE == 0

    # --------------------------------------------------------------------------- events
    def event_create(self, device: int, flags: int = EVENT_DISABLE_TIMING) -> Any:
        self._ctx(device)
        return _check(_cuEventCreate(flags), "cuEventCreate")

    def event_destroy(self, event: Any) -> None:
        err = _cuEventDestroy(event)[0]
        if err:
            raise _error(err, "cuEventDestroy")

    def event_record(self, event: Any, stream: Any) -> None:
        err = _cuEventRecord(event, stream)[0]
        if err:
            raise _error(err, "cuEventRecord")

    def event_query(self, event: Any) -> bool:
        err = _cuEventQuery(event)[0]
        if not err:
            return True
        if err == CUDA_ERROR_NOT_READY:
            return False
        raise _error(err, "cuEventQuery")

    def event_synchronize(self, event: Any) -> None:
        err = _cuEventSynchronize(event)[0]
        if err:
            raise _error(err, "cuEventSynchronize")

    def event_elapsed_time(self, start: Any, end: Any) -> float:
        return float(_check(_cuEventElapsedTime(start, end), "cuEventElapsedTime"))

    def ipc_event_handle(self, event: Any) -> bytes:
        handle = _check(_cuIpcGetEventHandle(event), "cuIpcGetEventHandle")
        # Read the C struct directly: `CUipcEventHandle.reserved` exists in bindings 13.3 but
        # not in 13.5, while getPtr() (address of the 64-byte struct) exists in both.
        return ctypes.string_at(handle.getPtr(), IPC_HANDLE_SIZE)

    def ipc_open_event(self, device: int, handle: bytes) -> Any:
        if not isinstance(handle, (bytes, bytearray, memoryview)):
            raise TypeError(f"IPC event handle must be bytes, got {type(handle).__name__}")
        data = bytes(handle)
        if len(data) != IPC_HANDLE_SIZE:
            raise ValueError(
                f"IPC event handle must be {IPC_HANDLE_SIZE} bytes, got {len(data)}"
            )
        h = _CUipcEventHandle()
        ctypes.memmove(h.getPtr(), data, IPC_HANDLE_SIZE)
        self._ctx(device)
        return _check(_cuIpcOpenEventHandle(h), "cuIpcOpenEventHandle")

    # ---------------------------------------------------------------- modules and kernels
    def module_load(self, device: int, image: bytes) -> Any:
        if not isinstance(image, bytes):
            image = bytes(image)  # cuModuleLoadData reads it during the call only
        self._ctx(device)
        module = _check(_cuModuleLoadData(image), "cuModuleLoadData")
        with self._lock:
            self._module_devices[int(module)] = device
        return module

    def _module_ctx(self, module: Any) -> None:
        device = self._module_devices.get(int(module))
        if device is not None:
            self._ctx(device)

    def module_unload(self, module: Any) -> None:
        self._module_ctx(module)
        err = _cuModuleUnload(module)[0]
        if err:
            raise _error(err, "cuModuleUnload")
        with self._lock:
            self._module_devices.pop(int(module), None)

    def module_function(self, module: Any, name: str) -> Any:
        self._module_ctx(module)
        return _check(_cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")

    def make_args(self, signature: Sequence[str]) -> CudaKernelArgs:
        return CudaKernelArgs(signature)

    def launch(
        self,
        function: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: Any,
        args: CudaKernelArgs,
    ) -> None:
        # The function's context must be current (set_context/_ctx of its device) unless
        # `stream` is a created stream of that device.
        err = _cuLaunchKernel(function, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                              shared_mem, stream, args.address_int, 0)[0]
        if err:
            raise _error(err, "cuLaunchKernel")

    # ---------------------------------------------------------------- virtual memory (VMM)
    @staticmethod
    def _alloc_prop(device: int) -> Any:
        prop = _drv.CUmemAllocationProp()
        prop.type = _drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = _drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = int(device)
        return prop

    def vmm_granularity(self, device: int) -> int:
        g = self._granularity.get(device)
        if g is None:
            self._device(device)
            g = int(_check(_cuMemGetAllocationGranularity(
                self._alloc_prop(device),
                _drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                "cuMemGetAllocationGranularity"))
            with self._lock:
                self._granularity[device] = g
        return g

    def vmm_reserve(self, device: int, size: int) -> int:
        self._ctx(device)
        return int(_check(_cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve"))

    def vmm_free_address(self, ptr: int, size: int) -> None:
        err = _cuMemAddressFree(ptr, size)[0]
        if err:
            raise _error(err, "cuMemAddressFree")

    def vmm_create(self, device: int, size: int) -> Any:
        self._ctx(device)
        return _check(_cuMemCreate(size, self._alloc_prop(device), 0), "cuMemCreate")

    def vmm_release(self, handle: Any) -> None:
        err = _cuMemRelease(handle)[0]
        if err:
            raise _error(err, "cuMemRelease")

    def vmm_map(self, device: int, ptr: int, size: int, handle: Any) -> None:
        self._ctx(device)
        err = _cuMemMap(ptr, size, 0, handle, 0)[0]
        if err:
            raise _error(err, "cuMemMap")
        desc = _drv.CUmemAccessDesc()
        desc.location.type = _drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = int(device)
        desc.flags = _drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        err = _cuMemSetAccess(ptr, size, [desc], 1)[0]
        if err:
            _cuMemUnmap(ptr, size)  # leave the range as it was
            raise _error(err, "cuMemSetAccess")

    def vmm_unmap(self, ptr: int, size: int) -> None:
        err = _cuMemUnmap(ptr, size)[0]
        if err:
            raise _error(err, "cuMemUnmap")

    # ---------------------------------------------------------------- stream-ordered pools
    def pool_create(self, device: int) -> Any:
        self._ctx(device)
        props = _drv.CUmemPoolProps()
        props.allocType = _drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.handleTypes = _drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        props.location.type = _drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = int(device)
        pool = _check(_cuMemPoolCreate(props), "cuMemPoolCreate")
        # Keep freed memory cached across synchronisations (torch's cudaMallocAsync setting).
        err = _cuMemPoolSetAttribute(pool, _MPA.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                     _drv.cuuint64_t(2**64 - 1))[0]
        if err:
            _cuMemPoolDestroy(pool)
            raise _error(err, "cuMemPoolSetAttribute")
        return pool

    def pool_destroy(self, pool: Any) -> None:
        err = _cuMemPoolDestroy(pool)[0]
        if err:
            raise _error(err, "cuMemPoolDestroy")

    def pool_alloc_async(self, pool: Any, nbytes: int, stream: Any) -> int:
        if nbytes == 0:  # never ask the driver for 0 bytes (see tests/test_simulator_vmm.py)
            return 0
        res = _cuMemAllocFromPoolAsync(nbytes, pool, stream)
        if res[0]:
            raise _error(res[0], "cuMemAllocFromPoolAsync")
        return int(res[1])

    def pool_usage(self, pool: Any) -> tuple[int, int, int, int]:
        out = []
        for attr in (_MPA.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, _MPA.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
                     _MPA.CU_MEMPOOL_ATTR_USED_MEM_CURRENT, _MPA.CU_MEMPOOL_ATTR_USED_MEM_HIGH):
            out.append(int(_check(_cuMemPoolGetAttribute(pool, attr), "cuMemPoolGetAttribute")))
        return out[0], out[1], out[2], out[3]

    def pool_reset_high(self, pool: Any) -> None:
        # Setting a *_HIGH attribute to 0 resets it to the current value.
        for attr in (_MPA.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, _MPA.CU_MEMPOOL_ATTR_USED_MEM_HIGH):
            err = _cuMemPoolSetAttribute(pool, attr, _drv.cuuint64_t(0))[0]
            if err:
                raise _error(err, "cuMemPoolSetAttribute")

    def pool_trim(self, pool: Any, keep: int = 0) -> None:
        err = _cuMemPoolTrimTo(pool, keep)[0]
        if err:
            raise _error(err, "cuMemPoolTrimTo")

    # ----------------------------------------------------------------------------- NVML
    def nvml(self):
        inst = self._nvml
        if inst is None:
            from cudalab._driver.nvml import RealNvml

            with self._lock:
                if self._nvml is None:
                    self._nvml = RealNvml()
                inst = self._nvml
        return inst

    def handle_int(self, handle: Any) -> int:
        return 0 if handle is None else int(handle)


__all__ = ["CudaBackend", "CudaKernelArgs"]
