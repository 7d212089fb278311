"""The ``cuda.bindings`` driver API as the real backend uses it: bound once, plus error decoding.

Imported only by the real backend's modules (:mod:`cudalab._driver.cuda`,
:mod:`cudalab._driver.cuda_memory`), never by ``import cudalab``. Every driver function is
bound to a module-level name (``_cuMemAlloc`` ...) that those modules import, so a hot path
does one global lookup and one call. A missing bindings wheel does not break the import: the
names are then stubs that raise :class:`cudalab.errors.DriverNotFoundError` when called.

Errors: :func:`_check` / :func:`_error` turn a failed ``CUresult`` into
:class:`cudalab.errors.CudaError` with the driver's error name and string
(``CUDA_ERROR_OUT_OF_MEMORY``: :class:`cudalab.errors.OutOfMemoryError`).
"""

from __future__ import annotations

import os
from typing import Any

from cudalab.errors import CudaError, DriverNotFoundError, OutOfMemoryError, StreamCaptureError

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


# ------------------------------------------------------------------ C twins
class FastCalls:
    """The C twins (_fastcall.c) of hot driver calls, each named as _fastcall names it, bound
    together by :func:`cudalab._driver.cuda._bind_fastcall`; None: use the bindings'
    wrappers. The one registry that cuda.py, cuda_memory.py and the NCCL seam read.

    ``launch_kernel(function, grid, block, shared_mem, stream, params)``,
    ``stream_wait_event(stream, event, flags)``, ``ctx_set_current(context)`` and
    ``memcpy_async(dst, src, nbytes, stream)`` return the CUresult; ``event_record(event,
    stream)`` returns ``(CUresult,)`` as the bindings' does; ``ctx_get_current()`` the
    current context's address (None on failure); ``ordered_copy(dst, src, nbytes,
    copy_context, copy_stream, copy_event, peer_context, peer_stream, peer_event[, join])``
    makes a copy between two devices with torch's two-way ordering (the peer stream's wait
    for the copy only when ``join``, the default) and returns None or the failed call's
    ``(name, CUresult)``. Rows they exist for: "capture, host time
    per launch" of benchmarks/graphs.py, "host/call" of benchmarks/jiterator.py, the launch
    and event rows of benchmarks/timing.py, and the 1 KiB rows of benchmarks/comm.py (every
    peer copy checks the context and copies).
    """

    __slots__ = ("launch_kernel", "event_record", "stream_wait_event", "ctx_get_current",
                 "ctx_set_current", "memcpy_async", "ordered_copy")

    def __init__(self) -> None:
        self.launch_kernel: Any = None
        self.event_record: Any = None
        self.stream_wait_event: Any = None
        self.ctx_get_current: Any = None
        self.ctx_set_current: Any = None
        self.memcpy_async: Any = None
        self.ordered_copy: Any = None


FAST = FastCalls()

#: Env switch that turns every C call off (CUDALAB_FASTCALL=0): cuda.bindings' and nccl4py's
#: wrappers are used, as without the extensions (tests/driver/test_fastcall.py and
#: test_ncclcall.py compare the two).
FASTCALL_ENV = "CUDALAB_FASTCALL"


def fastcall_turned_off() -> bool:
    """Whether :data:`FASTCALL_ENV` turns the C calls off (read when they are bound)."""
    return os.environ.get(FASTCALL_ENV, "1").strip() == "0"

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
    _cuIpcGetMemHandle = _drv.cuIpcGetMemHandle
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
    _cuThreadExchangeStreamCaptureMode = _drv.cuThreadExchangeStreamCaptureMode
    _cuGetErrorName = _drv.cuGetErrorName
    _cuGetErrorString = _drv.cuGetErrorString
    _CUstream = _drv.CUstream
    _CUipcEventHandle = _drv.CUipcEventHandle
    # Enum members (cuPointerGetAttribute reads `attr.value`, so plain ints do not work there).
    _PA_MEMORY_TYPE = _drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE
    _PA_DEVICE_ORDINAL = _drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    _DA = _drv.CUdevice_attribute
    _MPA = _drv.CUmemPool_attribute
    _CaptureMode = _drv.CUstreamCaptureMode
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
    _cuIpcGetMemHandle = _no_bindings
    _cuModuleUnload = _cuModuleGetFunction = _cuLaunchKernel = _no_bindings
    _cuMemGetAllocationGranularity = _cuMemAddressReserve = _cuMemAddressFree = _no_bindings
    _cuMemCreate = _cuMemRelease = _cuMemMap = _cuMemSetAccess = _cuMemUnmap = _no_bindings
    _cuMemPoolCreate = _cuMemPoolDestroy = _cuMemAllocFromPoolAsync = _no_bindings
    _cuMemPoolGetAttribute = _cuMemPoolSetAttribute = _cuMemPoolTrimTo = _no_bindings
    _cuGetErrorName = _cuGetErrorString = _CUstream = _CUipcEventHandle = _no_bindings
    _cuThreadExchangeStreamCaptureMode = _CaptureMode = _no_bindings
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
    if 900 <= code <= 908:  # CUDA_ERROR_STREAM_CAPTURE_* and CUDA_ERROR_CAPTURED_EVENT
        return StreamCaptureError(code, name, text, call=call)
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
