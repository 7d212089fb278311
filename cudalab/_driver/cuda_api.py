"""The ``cuda.bindings`` driver API as the real backend uses it: bound once, plus error decoding.

Imported only by the real backend's modules (:mod:`cudalab._driver.cuda`,
:mod:`cudalab._driver.cuda_memory`, :mod:`cudalab._driver.cuda_graphs`,
:mod:`cudalab._driver.nccl`), never by ``import cudalab``. Every driver function is bound to a
module-level name spelled as the driver spells it (``cuMemAlloc`` ...) that those modules
import, so a hot path does one global lookup and one call.

Its names are the ``_driver`` package's internal API (public spellings, read by the real
backend's modules only; nothing outside ``cudalab._driver`` imports this module): ``drv``
(the bindings' ``cuda.bindings.driver`` module, None without it) and ``IMPORT_ERROR``; the
``cu*`` functions; the bindings' types and enums ``CUstream``, ``CUipcEventHandle``,
``DeviceAttribute`` (``CUdevice_attribute``), ``MemPoolAttribute`` (``CUmemPool_attribute``),
``CaptureMode`` (``CUstreamCaptureMode``), ``POINTER_ATTRIBUTE_MEMORY_TYPE`` and
``POINTER_ATTRIBUTE_DEVICE_ORDINAL``; the ``CUDA_*`` codes and ``MEMORYTYPE_*`` values;
:data:`FAST`, the real backend's fast-call registry; :func:`fastcall_turned_off`;
:func:`decode_text`, :func:`check` and :func:`cuda_error`. A missing bindings wheel does not break the import: the
names are then stubs that raise :class:`cudalab.errors.DriverNotFoundError` when called.

Errors: :func:`check` / :func:`cuda_error` turn a failed ``CUresult`` into
:class:`cudalab.errors.CudaError` with the driver's error name and string
(``CUDA_ERROR_OUT_OF_MEMORY``: :class:`cudalab.errors.OutOfMemoryError`).
"""

from __future__ import annotations

import os
from typing import Any

from cudalab._driver.fast_calls import FastCalls
from cudalab.errors import CudaError, DriverNotFoundError, OutOfMemoryError, StreamCaptureError

try:  # the bindings are a hard dependency, but a missing wheel must not break `import`.
    from cuda.bindings import driver as drv
except ImportError as _exc:  # pragma: no cover - exercised only without cuda-bindings
    drv = None
    IMPORT_ERROR: ImportError | None = _exc
else:
    IMPORT_ERROR = None

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
MEMORYTYPE_DEVICE = 2
MEMORYTYPE_UNIFIED = 4


def _no_bindings(*_args: Any, **_kwargs: Any) -> Any:  # pragma: no cover - only without cuda-bindings
    raise DriverNotFoundError(
        "cuda-bindings is not installed (import cuda.bindings.driver failed: "
        f"{IMPORT_ERROR}); install cuda-bindings>=13.3,<14"
    )


#: Env switch that turns every C call off (CUDALAB_FASTCALL=0): cuda.bindings' and nccl4py's
#: wrappers are used, as without the extensions (tests/driver/test_fastcall.py and
#: test_ncclcall.py compare the two).
FASTCALL_ENV = "CUDALAB_FASTCALL"


def fastcall_turned_off() -> bool:
    """Whether :data:`FASTCALL_ENV` turns the C calls off (read when they are bound)."""
    return os.environ.get(FASTCALL_ENV, "1").strip() == "0"

# ------------------------------------------------------------------ binding aliases
# Module-level names so hot paths do one global lookup and one call.
if drv is not None:
    cuInit = drv.cuInit
    cuDriverGetVersion = drv.cuDriverGetVersion
    cuDeviceGetCount = drv.cuDeviceGetCount
    cuDeviceGet = drv.cuDeviceGet
    cuDeviceGetAttribute = drv.cuDeviceGetAttribute
    cuDeviceGetName = drv.cuDeviceGetName
    cuDeviceTotalMem = drv.cuDeviceTotalMem
    cuDeviceGetUuid = drv.cuDeviceGetUuid
    cuDeviceGetPCIBusId = drv.cuDeviceGetPCIBusId
    cuDeviceCanAccessPeer = drv.cuDeviceCanAccessPeer
    cuDevicePrimaryCtxRetain = drv.cuDevicePrimaryCtxRetain
    cuCtxGetCurrent = drv.cuCtxGetCurrent
    cuCtxSetCurrent = drv.cuCtxSetCurrent
    cuCtxSynchronize = drv.cuCtxSynchronize
    cuCtxEnablePeerAccess = drv.cuCtxEnablePeerAccess
    cuCtxGetStreamPriorityRange = drv.cuCtxGetStreamPriorityRange
    cuMemAlloc = drv.cuMemAlloc
    cuMemFree = drv.cuMemFree
    cuMemAllocAsync = drv.cuMemAllocAsync
    cuMemFreeAsync = drv.cuMemFreeAsync
    cuMemGetInfo = drv.cuMemGetInfo
    cuMemHostAlloc = drv.cuMemHostAlloc
    cuMemFreeHost = drv.cuMemFreeHost
    cuMemcpy = drv.cuMemcpy
    cuMemcpyAsync = drv.cuMemcpyAsync
    cuMemcpyPeerAsync = drv.cuMemcpyPeerAsync
    cuMemsetD8 = drv.cuMemsetD8
    cuMemsetD8Async = drv.cuMemsetD8Async
    cuMemsetD16Async = drv.cuMemsetD16Async
    cuMemsetD32Async = drv.cuMemsetD32Async
    cuPointerGetAttribute = drv.cuPointerGetAttribute
    cuStreamCreateWithPriority = drv.cuStreamCreateWithPriority
    cuStreamDestroy = drv.cuStreamDestroy
    cuStreamQuery = drv.cuStreamQuery
    cuStreamSynchronize = drv.cuStreamSynchronize
    cuStreamWaitEvent = drv.cuStreamWaitEvent
    cuStreamGetPriority = drv.cuStreamGetPriority
    cuStreamIsCapturing = drv.cuStreamIsCapturing
    cuEventCreate = drv.cuEventCreate
    cuEventDestroy = drv.cuEventDestroy
    cuEventRecord = drv.cuEventRecord
    cuEventQuery = drv.cuEventQuery
    cuEventSynchronize = drv.cuEventSynchronize
    # CUDA 12.8 added cuEventElapsedTime_v2; CUDA 13's header maps the plain name onto it and
    # bindings 13.x (13.3.1 and 13.5.0 checked) export only `cuEventElapsedTime`. Bindings
    # 12.8/12.9 export both; the plain name also works with pre-12.8 drivers, so prefer it.
    cuEventElapsedTime = getattr(drv, "cuEventElapsedTime", None) or drv.cuEventElapsedTime_v2
    cuIpcGetEventHandle = drv.cuIpcGetEventHandle
    cuIpcGetMemHandle = drv.cuIpcGetMemHandle
    cuIpcOpenEventHandle = drv.cuIpcOpenEventHandle
    cuModuleLoadData = drv.cuModuleLoadData
    cuModuleUnload = drv.cuModuleUnload
    cuModuleGetFunction = drv.cuModuleGetFunction
    cuLaunchKernel = drv.cuLaunchKernel
    cuMemGetAllocationGranularity = drv.cuMemGetAllocationGranularity
    cuMemAddressReserve = drv.cuMemAddressReserve
    cuMemAddressFree = drv.cuMemAddressFree
    cuMemCreate = drv.cuMemCreate
    cuMemRelease = drv.cuMemRelease
    cuMemMap = drv.cuMemMap
    cuMemSetAccess = drv.cuMemSetAccess
    cuMemUnmap = drv.cuMemUnmap
    cuMemPoolCreate = drv.cuMemPoolCreate
    cuMemPoolDestroy = drv.cuMemPoolDestroy
    cuMemAllocFromPoolAsync = drv.cuMemAllocFromPoolAsync
    cuMemPoolGetAttribute = drv.cuMemPoolGetAttribute
    cuMemPoolSetAttribute = drv.cuMemPoolSetAttribute
    cuMemPoolTrimTo = drv.cuMemPoolTrimTo
    cuThreadExchangeStreamCaptureMode = drv.cuThreadExchangeStreamCaptureMode
    cuGetErrorName = drv.cuGetErrorName
    cuGetErrorString = drv.cuGetErrorString
    CUstream = drv.CUstream
    CUipcEventHandle = drv.CUipcEventHandle
    # Enum members (cuPointerGetAttribute reads `attr.value`, so plain ints do not work there).
    POINTER_ATTRIBUTE_MEMORY_TYPE = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE
    POINTER_ATTRIBUTE_DEVICE_ORDINAL = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    DeviceAttribute = drv.CUdevice_attribute
    MemPoolAttribute = drv.CUmemPool_attribute
    CaptureMode = drv.CUstreamCaptureMode
else:  # pragma: no cover - only without cuda-bindings
    cuInit = cuDriverGetVersion = cuDeviceGetCount = cuDeviceGet = _no_bindings
    cuDeviceGetAttribute = cuDeviceGetName = cuDeviceTotalMem = _no_bindings
    cuDeviceGetUuid = cuDeviceGetPCIBusId = cuDeviceCanAccessPeer = _no_bindings
    cuDevicePrimaryCtxRetain = cuCtxGetCurrent = cuCtxSetCurrent = _no_bindings
    cuCtxSynchronize = cuCtxEnablePeerAccess = cuCtxGetStreamPriorityRange = _no_bindings
    cuMemAlloc = cuMemFree = cuMemAllocAsync = cuMemFreeAsync = _no_bindings
    cuMemGetInfo = cuMemHostAlloc = cuMemFreeHost = cuMemcpy = _no_bindings
    cuMemcpyAsync = cuMemcpyPeerAsync = cuMemsetD8 = cuMemsetD8Async = _no_bindings
    cuMemsetD16Async = cuMemsetD32Async = cuPointerGetAttribute = _no_bindings
    cuStreamCreateWithPriority = cuStreamDestroy = cuStreamQuery = _no_bindings
    cuStreamSynchronize = cuStreamWaitEvent = cuStreamGetPriority = _no_bindings
    cuStreamIsCapturing = cuEventCreate = cuEventDestroy = cuEventRecord = _no_bindings
    cuEventQuery = cuEventSynchronize = cuEventElapsedTime = _no_bindings
    cuIpcGetEventHandle = cuIpcOpenEventHandle = cuModuleLoadData = _no_bindings
    cuIpcGetMemHandle = _no_bindings
    cuModuleUnload = cuModuleGetFunction = cuLaunchKernel = _no_bindings
    cuMemGetAllocationGranularity = cuMemAddressReserve = cuMemAddressFree = _no_bindings
    cuMemCreate = cuMemRelease = cuMemMap = cuMemSetAccess = cuMemUnmap = _no_bindings
    cuMemPoolCreate = cuMemPoolDestroy = cuMemAllocFromPoolAsync = _no_bindings
    cuMemPoolGetAttribute = cuMemPoolSetAttribute = cuMemPoolTrimTo = _no_bindings
    cuGetErrorName = cuGetErrorString = CUstream = CUipcEventHandle = _no_bindings
    cuThreadExchangeStreamCaptureMode = CaptureMode = _no_bindings
    POINTER_ATTRIBUTE_MEMORY_TYPE = POINTER_ATTRIBUTE_DEVICE_ORDINAL = None
    DeviceAttribute = MemPoolAttribute = None


# ------------------------------------------------------------------ fast calls
#: The real backend's fast-call registry (:class:`cudalab._driver.fast_calls.FastCalls`),
#: process-wide as the C extension it binds: the bindings' own status-returning functions,
#: and the C twins of :mod:`cudalab._driver.fastcall` once
#: ``cudalab._driver.cuda._bind_fastcall`` has bound them (None until then, or where the
#: extension is not built or the driver did not give the entry points). cuda.py,
#: cuda_memory.py and the NCCL seam read it; :meth:`CudaBackend.fast_calls` returns it.
FAST = FastCalls(cuEventRecord, cuEventQuery, cuStreamQuery, cuEventElapsedTime)


# ------------------------------------------------------------------------------ errors
#: code -> (name, description), filled on first use of each code.
_ERROR_TEXT: dict[int, tuple[str, str]] = {}


def decode_text(raw: Any) -> str:
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
    if drv is not None:
        try:
            member = drv.CUresult(code)
        except (ValueError, TypeError):
            member = None
    if member is not None:
        try:
            err, raw = cuGetErrorName(member)
            if not err:
                name = decode_text(raw)
            err, raw = cuGetErrorString(member)
            if not err:
                text = decode_text(raw)
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


def cuda_error(code: Any, call: str) -> CudaError:
    """The exception for a failed driver call (OutOfMemoryError for CUDA_ERROR_OUT_OF_MEMORY)."""
    code = int(code)
    name, text = _error_text(code)
    if code == CUDA_ERROR_OUT_OF_MEMORY:
        return OutOfMemoryError(code, name or "CUDA_ERROR_OUT_OF_MEMORY", text or "out of memory",
                                call=call)
    if 900 <= code <= 908:  # CUDA_ERROR_STREAM_CAPTURE_* and CUDA_ERROR_CAPTURED_EVENT
        return StreamCaptureError(code, name, text, call=call)
    return CudaError(code, name, text, call=call)


def check(result: tuple[Any, ...], call: str) -> Any:
    """Raise for a failed binding call; return its out-parameters.

    ``result`` is the bindings' tuple ``(CUresult, *outs)``: returns None for no outs, the
    value for one, and a tuple for several.
    """
    err = result[0]
    if err:
        raise cuda_error(err, call)
    n = len(result)
    if n == 2:
        return result[1]
    if n == 1:
        return None
    return tuple(result[1:])
