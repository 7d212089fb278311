"""The real driver seam: :class:`CudaBackend` over ``cuda.bindings.driver``.

``import cudalab`` never imports this module; :func:`cudalab._driver.get_backend` imports it on
first use. Importing it loads the Cython bindings (~70 ms) but not ``libcuda``: the driver
library is opened by the first driver call, inside :meth:`CudaBackend.init`, which turns a
missing driver into :class:`cudalab.errors.DriverNotFoundError`.

The real backend is these modules, one concern each:

* :mod:`cudalab._driver.cuda_api`: the bindings' functions bound once as module globals, the
  CUresult codes, and error decoding (:func:`check` / :func:`cuda_error`);
* :mod:`cudalab._driver.cuda_memory`: :class:`CudaMemory`, the memory concern (allocations,
  copies, fills, IPC memory handles, VMM, stream-ordered pools);
* :mod:`cudalab._driver.cuda_graphs`: :class:`CudaGraphs`, stream capture and CUDA graphs
  (over :class:`CudaMemory`);
* :mod:`cudalab._driver.cuda_kernel_args`: :class:`CudaKernelArgs`, packed kernel parameters;
* this module: :class:`CudaBackend` (lifecycle, device identity, contexts, streams, events,
  kernels, NVML) over :class:`CudaGraphs`, and the binding of the C fast calls.

Conventions (see :mod:`cudalab._driver.base`):

* Every failing call raises :class:`cudalab.errors.CudaError` built by :func:`check` /
  :func:`cuda_error` with the driver's error name and string; ``CUDA_ERROR_OUT_OF_MEMORY`` raises
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
import os
import threading
from collections.abc import Sequence
from typing import SupportsInt

from cudalab._driver.base import (
    EVENT_DISABLE_TIMING,
    IPC_HANDLE_SIZE,
    STREAM_NON_BLOCKING,
    Blas,
    DeviceInfo,
    Fft,
    KernelArgs,
    Nccl,
    Nvml,
)
from cudalab._driver.cuda_api import (
    CUDA_ERROR_INVALID_DEVICE,
    CUDA_ERROR_NO_DEVICE,
    CUDA_ERROR_NOT_READY,
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
    CUDA_ERROR_STUB_LIBRARY,
    FAST,
    IMPORT_ERROR,
    CUipcEventHandle,
    CUstream,
    DeviceAttribute,
    check,
    cuCtxEnablePeerAccess,
    cuCtxGetCurrent,
    cuCtxGetStreamPriorityRange,
    cuCtxSetCurrent,
    cuCtxSynchronize,
    cuda_error,
    cuDeviceCanAccessPeer,
    cuDeviceGet,
    cuDeviceGetAttribute,
    cuDeviceGetCount,
    cuDeviceGetName,
    cuDeviceGetPCIBusId,
    cuDeviceGetUuid,
    cuDevicePrimaryCtxRetain,
    cuDeviceTotalMem,
    cuDriverGetVersion,
    cuEventCreate,
    cuEventDestroy,
    cuEventElapsedTime,
    cuEventQuery,
    cuEventRecord,
    cuEventSynchronize,
    cuInit,
    cuIpcGetEventHandle,
    cuIpcOpenEventHandle,
    cuLaunchKernel,
    cuModuleGetFunction,
    cuModuleLoadData,
    cuModuleUnload,
    cuStreamCreateWithPriority,
    cuStreamDestroy,
    cuStreamGetPriority,
    cuStreamIsCapturing,
    cuStreamQuery,
    cuStreamSynchronize,
    cuStreamWaitEvent,
    decode_text,
    drv,
    fastcall_turned_off,
)
from cudalab._driver.cuda_graphs import CudaGraphs
from cudalab._driver.cuda_kernel_args import CudaKernelArgs
from cudalab._driver.fast_calls import C_TWINS, FastCalls
from cudalab._driver.handles import (
    ContextHandle,
    DeviceHandle,
    EventHandle,
    FunctionHandle,
    ModuleHandle,
    StreamHandle,
)
from cudalab.errors import CudaError, DriverNotFoundError

try:  # optional C twin of the hot driver calls (setup.py builds it; see _bind_fastcall)
    from cudalab._driver import fastcall  # type: ignore[attr-defined]  # C, no stub
except ImportError:  # pragma: no cover - a pure-Python install
    fastcall = None

# ------------------------------------------------------------------------- C fast calls
# The C twins live in the fast-call registry cuda_api.FAST (None where the extension is not
# built or the driver did not give the entry points: then the cuda.bindings wrappers are
# used), bound by _bind_fastcall() in CudaBackend.init().
#: The driver symbols fastcall.setup() takes, in its order.
_FAST_SYMBOLS = (b"cuLaunchKernel", b"cuEventRecord", b"cuStreamWaitEvent", b"cuGraphLaunch",
                 b"cuCtxGetCurrent", b"cuCtxSetCurrent", b"cuMemcpyAsync")


def entry_point(symbol: bytes, driver_version: int) -> int:
    """The driver's entry point ``symbol`` (cuGetProcAddress, with the default-stream
    semantics cuda.bindings itself uses) as an int address; 0 when the driver does not give
    it (or the bindings are a test's fake)."""
    # cuda.bindings takes the per-thread default stream variants when this is set.
    ptds = os.environ.get("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "0") not in ("", "0")
    try:
        flags = drv.CUdriverProcAddress_flags
        flag = (flags.CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM if ptds
                else flags.CU_GET_PROC_ADDRESS_DEFAULT)
        err, address, _status = drv.cuGetProcAddress(symbol, driver_version, flag)
    except Exception:  # noqa: BLE001 - any binding trouble (or a test's fake): none
        return 0
    return 0 if err or not address else int(address)


#: Whether fastcall's launch_packed_programmatic has its cuLaunchKernelEx (_bind_fastcall).
_launch_ex_bound = False


def _bind_fastcall(driver_version: int) -> None:
    """Give fastcall the driver's entry points (cuGetProcAddress, with the default-stream
    semantics cuda.bindings itself uses), and publish its functions; on any failure keep what
    is in use (the bindings, or an earlier backend's binding to the same driver)."""
    if fastcall is None:
        return
    if fastcall_turned_off():  # the bindings from now
        for name in C_TWINS:
            setattr(FAST, name, None)
        FAST.event_record = cuEventRecord
        return
    addresses = [entry_point(symbol, driver_version) for symbol in _FAST_SYMBOLS]
    if not all(addresses):
        return
    fastcall.setup(*addresses, cuda_error)
    for name in C_TWINS:
        setattr(FAST, name, getattr(fastcall, name))
    global _launch_ex_bound
    launch_ex = entry_point(b"cuLaunchKernelEx", driver_version)
    if launch_ex:  # (apart, as below: CUDA 12+ drivers give it)
        fastcall.bind_launch_kernel_ex(launch_ex)
        _launch_ex_bound = True
    elapsed = entry_point(b"cuEventElapsedTime", driver_version)
    if elapsed:  # (apart: a driver without it keeps the others)
        fastcall.bind_event_elapsed_time(elapsed)
    else:
        FAST.event_elapsed_times = None
    # the C twin of cuEventRecord returns the bindings' (CUresult,): a status call as they are
    FAST.event_record = fastcall.event_record

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


class CudaBackend(CudaGraphs):
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
        self._devices: list[DeviceHandle] = []  # CUdevice handles by ordinal
        self._contexts: dict[int, ContextHandle] = {}  # ordinal -> retained primary CUcontext
        self._context_ints: dict[int, int] = {}
        self._infos: dict[int, DeviceInfo] = {}
        self._null_streams: dict[int, StreamHandle] = {}
        self._priority_ranges: dict[int, tuple[int, int]] = {}
        self._module_devices: dict[int, int] = {}
        self._granularity: dict[int, int] = {}
        self._nvml: Nvml | None = None  # created on first use
        self._nccl: Nccl | None = None  # created on first use (imports nccl4py)
        self._blas: Blas | None = None  # created on first use (cuBLAS loads on its first call)
        self._fft: Fft | None = None  # created on first use (cuFFT loads on its first call)

    # ------------------------------------------------------------ lifecycle and identity
    def init(self) -> None:
        if self._initialized:
            return
        with self._init_lock:
            if self._initialized:
                return
            if self._init_failure is not None:
                raise DriverNotFoundError(self._init_failure)
            if drv is None:
                self._init_failure = (
                    "cuda-bindings is not installed (import cuda.bindings.driver failed: "
                    f"{IMPORT_ERROR}); install cuda-bindings>=13.3,<14"
                )
                raise DriverNotFoundError(self._init_failure)
            try:
                err = cuInit(0)[0]
            except (RuntimeError, OSError) as exc:
                # cuda-pathfinder's DynamicLibNotFoundError (bindings >= 13.4) or
                # RuntimeError("Failed to dlopen libcuda.so.1") (bindings 13.3): no driver.
                # The loader's own (long) text stays in the chained exception, shown once.
                self._init_failure = "no NVIDIA driver found (libcuda.so.1 could not be loaded)"
                raise DriverNotFoundError(self._init_failure) from exc
            if err == CUDA_ERROR_STUB_LIBRARY:
                self._init_failure = (
                    "no NVIDIA driver found (libcuda.so.1 is the CUDA toolkit's stub library, "
                    "not a driver)"
                )
                raise DriverNotFoundError(self._init_failure)
            try:
                self._version = int(check(cuDriverGetVersion(), "cuDriverGetVersion"))
            except CudaError:
                self._version = 0
            if err == CUDA_ERROR_NO_DEVICE:
                # A driver but no usable GPU (or CUDA_VISIBLE_DEVICES hides them all).
                self._count = 0
                self._devices = []
                self._initialized = True
                return
            if err:
                raise cuda_error(err, "cuInit")
            count = int(check(cuDeviceGetCount(), "cuDeviceGetCount"))
            self._devices = [check(cuDeviceGet(i), "cuDeviceGet") for i in range(count)]
            self._count = count
            if self._version:
                _bind_fastcall(self._version)
            if FAST.launch_kernel is not None:
                # One C call, no Python frame, in place of Backend.launch_values (which is
                # launch(..., args.set(*values))): packs the values and launches (the
                # "host/call" rows of benchmarks/jiterator.py), and launches a graph (the
                # "replay() host cost" row of benchmarks/graphs.py). Both raise cuda_error's
                # exception, as the methods they stand in for.
                self.launch_values = fastcall.launch_packed  # type: ignore[method-assign]
                self.graph_launch = fastcall.graph_launch  # type: ignore[method-assign]
                if _launch_ex_bound:  # (else Backend's: launch_values, no attribute)
                    self.launch_values_programmatic = (  # type: ignore[method-assign]
                        fastcall.launch_packed_programmatic)
            self._initialized = True

    def driver_version(self) -> int:
        if not self._initialized:
            self.init()
        return self._version

    def device_count(self) -> int:
        if not self._initialized:
            self.init()
        return self._count

    def _device(self, device: int) -> DeviceHandle:
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
        A = DeviceAttribute

        def attr(name: str) -> int:
            return int(check(cuDeviceGetAttribute(getattr(A, "CU_DEVICE_ATTRIBUTE_" + name),
                                                    dev), "cuDeviceGetAttribute"))

        def opt_attr(name: str, default: int = 0) -> int:
            member = getattr(A, "CU_DEVICE_ATTRIBUTE_" + name, None)
            if member is None:
                return default
            try:
                return int(check(cuDeviceGetAttribute(member, dev), "cuDeviceGetAttribute"))
            except CudaError:
                return default

        name = decode_text(check(cuDeviceGetName(256, dev), "cuDeviceGetName"))
        uuid_obj = check(cuDeviceGetUuid(dev), "cuDeviceGetUuid")
        uuid_raw = ctypes.string_at(uuid_obj.getPtr(), 16)
        pci = decode_text(check(cuDeviceGetPCIBusId(64, dev), "cuDeviceGetPCIBusId"))
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
            total_memory=int(check(cuDeviceTotalMem(dev), "cuDeviceTotalMem")),
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
    def _primary(self, device: int) -> ContextHandle:
        """The retained primary context of ``device`` (retained once, never released)."""
        ctx = self._contexts.get(device)
        if ctx is not None:
            return ctx
        dev = self._device(device)
        with self._lock:
            ctx = self._contexts.get(device)
            if ctx is None:
                ctx = check(cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
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
            get = FAST.ctx_get_current
            if get is not None:  # from C: an int address (the 1 KiB rows of benchmarks/comm.py)
                if get() == want:
                    _THREAD.device = device
                    return
            else:
                cur = cuCtxGetCurrent()[1]
                if cur is not None and int(cur) == want:
                    _THREAD.device = device
                    return
        self._switch(device)

    def _switch(self, device: int) -> None:
        ctx = self._contexts.get(device)
        if ctx is None:
            ctx = self._primary(device)
        set_current = FAST.ctx_set_current
        err = set_current(self._context_ints[device]) if set_current is not None else \
            cuCtxSetCurrent(ctx)[0]
        if err:
            raise cuda_error(err, "cuCtxSetCurrent")
        _THREAD.device = device

    def _any_ctx(self) -> None:
        """Ensure *some* context is current (for calls such as cuMemHostAlloc that need one)."""
        if _THREAD.device >= 0:
            return
        cur = check(cuCtxGetCurrent(), "cuCtxGetCurrent")
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
        cur = check(cuCtxGetCurrent(), "cuCtxGetCurrent")
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
        err = cuCtxSynchronize()[0]
        if err:
            raise cuda_error(err, "cuCtxSynchronize")

    def can_access_peer(self, device: int, peer: int) -> bool:
        # A device-level query: no context needed (and none created).
        return bool(check(cuDeviceCanAccessPeer(self._device(device), self._device(peer)),
                           "cuDeviceCanAccessPeer"))

    def enable_peer_access(self, device: int, peer: int) -> None:
        peer_ctx = self._primary(peer)
        self._ctx(device)
        err = cuCtxEnablePeerAccess(peer_ctx, 0)[0]
        if err and err != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
            raise cuda_error(err, "cuCtxEnablePeerAccess")

    # -------------------------------------------------------------------------- streams
    def null_stream(self, device: int) -> StreamHandle:
        s = self._null_streams.get(device)
        if s is None:
            self._device(device)  # validate the ordinal
            with self._lock:
                s = self._null_streams.setdefault(device, CUstream(0))
        return s

    def stream_from_int(self, device: int, value: int) -> StreamHandle:
        if value == 0:
            return self.null_stream(device)
        self._device(device)  # validate the ordinal
        return CUstream(value)  # 1 = CU_STREAM_LEGACY, 2 = CU_STREAM_PER_THREAD, else a handle

    def stream_create(self, device: int, flags: int = STREAM_NON_BLOCKING, priority: int = 0) -> StreamHandle:
        least, greatest = self.stream_priority_range(device)  # greatest <= least numerically
        prio = least if priority > least else greatest if priority < greatest else priority
        self._ctx(device)
        return check(cuStreamCreateWithPriority(flags, prio), "cuStreamCreateWithPriority")

    def stream_destroy(self, stream: StreamHandle) -> None:
        err = cuStreamDestroy(stream)[0]
        if err:
            raise cuda_error(err, "cuStreamDestroy")

    def fast_calls(self) -> FastCalls:
        # The process-wide registry: the bindings themselves (and fastcall's event_record,
        # which returns the same (CUresult,) tuple) return (CUresult, ...) and never raise.
        return FAST

    def status_error(self, status: int, call: str) -> Exception:
        return cuda_error(status, call)

    def stream_query(self, stream: StreamHandle) -> bool:
        err = cuStreamQuery(stream)[0]
        if not err:
            return True
        if err == CUDA_ERROR_NOT_READY:
            return False
        raise cuda_error(err, "cuStreamQuery")

    def stream_synchronize(self, stream: StreamHandle) -> None:
        err = cuStreamSynchronize(stream)[0]
        if err:
            raise cuda_error(err, "cuStreamSynchronize")

    def stream_wait_event(self, stream: StreamHandle, event: EventHandle) -> None:
        fast = FAST.stream_wait_event
        err = fast(stream, event, 0) if fast is not None else cuStreamWaitEvent(stream, event, 0)[0]
        if err:
            raise cuda_error(err, "cuStreamWaitEvent")

    def stream_priority(self, stream: StreamHandle) -> int:
        return int(check(cuStreamGetPriority(stream), "cuStreamGetPriority"))

    def stream_priority_range(self, device: int) -> tuple[int, int]:
        rng = self._priority_ranges.get(device)
        if rng is None:
            self._ctx(device)
            least, greatest = check(cuCtxGetStreamPriorityRange(),
                                     "cuCtxGetStreamPriorityRange")
            rng = (int(least), int(greatest))
            with self._lock:
                self._priority_ranges[device] = rng
        return rng

    def stream_is_capturing(self, stream: StreamHandle) -> bool:
        status = check(cuStreamIsCapturing(stream), "cuStreamIsCapturing")
        return int(status) != 0  # CU_STREAM_CAPTURE_STATUS_NONE == 0

    # --------------------------------------------------------------------------- events
    def event_create(self, device: int, flags: int = EVENT_DISABLE_TIMING) -> EventHandle:
        self._ctx(device)
        return check(cuEventCreate(flags), "cuEventCreate")

    def event_destroy(self, event: EventHandle) -> None:
        err = cuEventDestroy(event)[0]
        if err:
            raise cuda_error(err, "cuEventDestroy")

    def event_record(self, event: EventHandle, stream: StreamHandle) -> None:
        err = FAST.event_record(event, stream)[0]  # the C twin once bound, else the bindings'
        if err:
            raise cuda_error(err, "cuEventRecord")

    def event_query(self, event: EventHandle) -> bool:
        err = cuEventQuery(event)[0]
        if not err:
            return True
        if err == CUDA_ERROR_NOT_READY:
            return False
        raise cuda_error(err, "cuEventQuery")

    def event_synchronize(self, event: EventHandle) -> None:
        err = cuEventSynchronize(event)[0]
        if err:
            raise cuda_error(err, "cuEventSynchronize")

    def event_elapsed_time(self, start: EventHandle, end: EventHandle) -> float:
        return float(check(cuEventElapsedTime(start, end), "cuEventElapsedTime"))

    def ipc_event_handle(self, event: EventHandle) -> bytes:
        handle = check(cuIpcGetEventHandle(event), "cuIpcGetEventHandle")
        # Read the C struct directly: `CUipcEventHandle.reserved` exists in bindings 13.3 but
        # not in 13.5, while getPtr() (address of the 64-byte struct) exists in both.
        return ctypes.string_at(handle.getPtr(), IPC_HANDLE_SIZE)

    def ipc_open_event(self, device: int, handle: bytes) -> EventHandle:
        if not isinstance(handle, (bytes, bytearray, memoryview)):
            raise TypeError(f"IPC event handle must be bytes, got {type(handle).__name__}")
        data = bytes(handle)
        if len(data) != IPC_HANDLE_SIZE:
            raise ValueError(
                f"IPC event handle must be {IPC_HANDLE_SIZE} bytes, got {len(data)}"
            )
        h = CUipcEventHandle()
        ctypes.memmove(h.getPtr(), data, IPC_HANDLE_SIZE)
        self._ctx(device)
        return check(cuIpcOpenEventHandle(h), "cuIpcOpenEventHandle")

    # ---------------------------------------------------------------- modules and kernels
    def module_load(self, device: int, image: bytes) -> ModuleHandle:
        if not isinstance(image, bytes):
            image = bytes(image)  # cuModuleLoadData reads it during the call only
        self._ctx(device)
        module = check(cuModuleLoadData(image), "cuModuleLoadData")
        with self._lock:
            self._module_devices[int(module)] = device
        return module

    def _module_ctx(self, module: ModuleHandle) -> None:
        device = self._module_devices.get(int(module))
        if device is not None:
            self._ctx(device)

    def module_unload(self, module: ModuleHandle) -> None:
        self._module_ctx(module)
        err = cuModuleUnload(module)[0]
        if err:
            raise cuda_error(err, "cuModuleUnload")
        with self._lock:
            self._module_devices.pop(int(module), None)

    def module_function(self, module: ModuleHandle, name: str) -> FunctionHandle:
        self._module_ctx(module)
        return check(cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")

    def make_args(self, signature: Sequence[str]) -> CudaKernelArgs:
        return CudaKernelArgs(signature)

    def launch(
        self,
        function: FunctionHandle,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: StreamHandle,
        args: KernelArgs,
    ) -> None:
        # The function's context must be current (set_context/_ctx of its device) unless
        # `stream` is a created stream of that device. `args` comes from this backend's
        # make_args (the seam's contract): a CudaKernelArgs, not checked on this hot path.
        fast = FAST.launch_kernel
        if fast is not None:
            err = fast(function, grid, block, shared_mem, stream,
                       args.address_int)  # type: ignore[attr-defined]
        else:
            err = cuLaunchKernel(function, grid[0], grid[1], grid[2], block[0], block[1],
                                  block[2], shared_mem, stream,
                                  args.address_int, 0)[0]  # type: ignore[attr-defined]
        if err:
            raise cuda_error(err, "cuLaunchKernel")

    # ----------------------------------------------------------------------------- NVML
    def nvml(self) -> Nvml:
        inst = self._nvml
        if inst is None:
            from cudalab._driver.nvml import RealNvml

            with self._lock:
                if self._nvml is None:
                    self._nvml = RealNvml()
                inst = self._nvml
        return inst

    # ----------------------------------------------------------------------------- NCCL
    def nccl(self) -> Nccl:
        inst = self._nccl
        if inst is None:
            from cudalab._driver.nccl import RealNccl

            with self._lock:
                if self._nccl is None:
                    self._nccl = RealNccl(self)
                inst = self._nccl
        return inst

    # ----------------------------------------------------------------- cuBLAS, cuFFT
    def blas(self) -> Blas:
        inst = self._blas
        if inst is None:
            from cudalab._driver.cublas import RealBlas

            with self._lock:
                if self._blas is None:
                    self._blas = RealBlas()
                inst = self._blas
        return inst

    def fft(self) -> Fft:
        inst = self._fft
        if inst is None:
            from cudalab._driver.cufft import RealFft

            with self._lock:
                if self._fft is None:
                    self._fft = RealFft()
                inst = self._fft
        return inst

    def handle_int(self, handle: SupportsInt | None) -> int:
        return 0 if handle is None else int(handle)

    # The two below serve the NCCL seam's C group call (cudalab/_driver/nccl.py); they are
    # not part of the Backend interface.
    def context_int(self, device: int) -> int:
        """The address of ``device``'s primary context (retained on first use)."""
        value = self._context_ints.get(device)
        if value is None:
            self._primary(device)
            value = self._context_ints[device]
        return value

    def entry_point(self, symbol: bytes) -> int:
        """The driver's entry point ``symbol`` as an int address, 0 when not given."""
        return entry_point(symbol, self.driver_version())


__all__ = ["CudaBackend", "CudaKernelArgs"]
