"""The real backend's memory concern: allocations, copies, fills, VMM and stream-ordered pools.

:class:`CudaMemory` is a mixin of :class:`cudalab._driver.cuda.CudaBackend` (which supplies
the context machinery it declares: ``_ctx``, ``_any_ctx``, ``_primary``, ``_device``). Same
conventions as the rest of the real backend: one binding call and one integer test on hot
paths (stream-ordered alloc/free, copies, fills).
"""

from __future__ import annotations

import abc
import ctypes
import threading
from typing import Any

from cudalab._driver.base import CAPTURE_MODE_RELAXED, IPC_HANDLE_SIZE, Backend
from cudalab._driver.cuda_api import (
    CU_MEMHOSTALLOC_PORTABLE,
    CUDA_ERROR_INVALID_VALUE,
    FAST,
    MEMORYTYPE_DEVICE,
    MEMORYTYPE_UNIFIED,
    POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    POINTER_ATTRIBUTE_MEMORY_TYPE,
    CaptureMode,
    MemPoolAttribute,
    check,
    cuda_error,
    cuIpcGetMemHandle,
    cuMemAddressFree,
    cuMemAddressReserve,
    cuMemAlloc,
    cuMemAllocAsync,
    cuMemAllocFromPoolAsync,
    cuMemcpy,
    cuMemcpyAsync,
    cuMemcpyPeerAsync,
    cuMemCreate,
    cuMemFree,
    cuMemFreeAsync,
    cuMemFreeHost,
    cuMemGetAllocationGranularity,
    cuMemGetInfo,
    cuMemHostAlloc,
    cuMemMap,
    cuMemPoolCreate,
    cuMemPoolDestroy,
    cuMemPoolGetAttribute,
    cuMemPoolSetAttribute,
    cuMemPoolTrimTo,
    cuMemRelease,
    cuMemSetAccess,
    cuMemsetD8,
    cuMemsetD8Async,
    cuMemsetD16Async,
    cuMemsetD32Async,
    cuMemUnmap,
    cuPointerGetAttribute,
    cuThreadExchangeStreamCaptureMode,
    drv,
)
from cudalab._driver.handles import (
    EventHandle,
    MemoryPoolHandle,
    PhysicalMemoryHandle,
    StreamHandle,
)

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
        fn: Any
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
    err, ordinal = cuPointerGetAttribute(POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
    return int(err), int(ordinal) if not err else -1



class CudaMemory(Backend):
    """Device and pinned host memory, copies, fills, pointer queries, IPC memory handles,
    virtual memory and stream-ordered pools over the CUDA driver."""

    # Supplied by CudaBackend (cudalab._driver.cuda): its lock and caches ...
    _lock: threading.Lock
    _contexts: dict[int, Any]  # ordinal -> retained primary CUcontext
    _context_ints: dict[int, int]  # ordinal -> that context's address (the C calls take it)
    _granularity: dict[int, int]  # ordinal -> VMM granularity
    #: Captures begun through this backend and not yet ended (CudaGraphs keeps the count):
    #: while non-zero, cuMemAlloc and cuMemHostAlloc run under a RELAXED capture-mode guard.
    _captures_active: int = 0

    # ... and its context machinery.
    @abc.abstractmethod
    def _device(self, device: int) -> Any:
        """The CUdevice of ordinal ``device`` (validates it)."""

    @abc.abstractmethod
    def _primary(self, device: int) -> Any:
        """The retained primary context of ``device``."""

    @abc.abstractmethod
    def _ctx(self, device: int) -> None:
        """Make ``device``'s primary context current on this thread."""

    @abc.abstractmethod
    def _any_ctx(self) -> None:
        """Ensure some context is current."""

    # --------------------------------------------------------------------------- memory
    def mem_alloc(self, device: int, nbytes: int) -> int:
        if nbytes == 0:
            return 0  # like torch: empty allocations are the null pointer
        self._ctx(device)
        res = cuMemAlloc(nbytes) if not self._captures_active else self._alloc_relaxed(nbytes)
        if res[0]:
            raise cuda_error(res[0], "cuMemAlloc")
        return int(res[1])

    def _alloc_relaxed(self, nbytes: int) -> tuple[Any, ...]:
        """cuMemAlloc under a RELAXED capture-mode guard, while some capture runs (torch's
        ``cudaMallocMaybeCapturing``): the allocation is not captured, gets fresh memory,
        and is not repeated by replays. In GLOBAL mode the driver would refuse it."""
        old = check(cuThreadExchangeStreamCaptureMode(CaptureMode(CAPTURE_MODE_RELAXED)),
                     "cuThreadExchangeStreamCaptureMode")
        try:
            return cuMemAlloc(nbytes)
        finally:
            cuThreadExchangeStreamCaptureMode(old)

    def mem_free(self, device: int, ptr: int) -> None:
        if not ptr:
            return
        self._ctx(device)
        err = cuMemFree(ptr)[0]
        if err:
            raise cuda_error(err, "cuMemFree")

    def mem_alloc_async(self, device: int, nbytes: int, stream: StreamHandle) -> int:
        if nbytes == 0:
            return 0
        self._ctx(device)
        res = cuMemAllocAsync(nbytes, stream)
        if res[0]:
            raise cuda_error(res[0], "cuMemAllocAsync")
        return int(res[1])

    def mem_free_async(self, device: int, ptr: int, stream: StreamHandle) -> None:
        if not ptr:
            return
        self._ctx(device)
        err = cuMemFreeAsync(ptr, stream)[0]
        if err:
            raise cuda_error(err, "cuMemFreeAsync")

    def mem_get_info(self, device: int) -> tuple[int, int]:
        self._ctx(device)
        free, total = check(cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def host_alloc(self, nbytes: int) -> int:
        self._any_ctx()
        if self._captures_active:  # pinned memory for a copy captured into a graph
            old = check(cuThreadExchangeStreamCaptureMode(CaptureMode(CAPTURE_MODE_RELAXED)),
                         "cuThreadExchangeStreamCaptureMode")
            try:
                return int(check(cuMemHostAlloc(nbytes, CU_MEMHOSTALLOC_PORTABLE),
                                  "cuMemHostAlloc"))
            finally:
                cuThreadExchangeStreamCaptureMode(old)
        return int(check(cuMemHostAlloc(nbytes, CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc"))

    def host_free(self, ptr: int) -> None:
        if not ptr:
            return
        self._any_ctx()
        err = cuMemFreeHost(ptr)[0]
        if err:
            raise cuda_error(err, "cuMemFreeHost")

    def memcpy(self, device: int, dst: int, src: int, nbytes: int) -> None:
        if not nbytes:
            return
        self._ctx(device)
        err = cuMemcpy(dst, src, nbytes)[0]
        if err:
            raise cuda_error(err, "cuMemcpy")

    def memcpy_async(self, device: int, dst: int, src: int, nbytes: int, stream: StreamHandle) -> None:
        if not nbytes:
            return
        self._ctx(device)
        fast = FAST.memcpy_async
        err = fast(dst, src, nbytes, stream) if fast is not None else \
            cuMemcpyAsync(dst, src, nbytes, stream)[0]
        if err:
            raise cuda_error(err, "cuMemcpyAsync")

    def memcpy_ordered(self, dst: int, src: int, nbytes: int, copy_device: int,
                       copy_stream: StreamHandle, copy_event: EventHandle, peer_device: int,
                       peer_stream: StreamHandle, peer_event: EventHandle,
                       join: bool = True) -> None:
        # The eight driver calls (six without the join) in one C call where it is built (the
        # calling thread's context is then current again after); else Backend's one by one.
        fast = FAST.ordered_copy
        contexts = self._context_ints
        copy_context, peer_context = contexts.get(copy_device), contexts.get(peer_device)
        if fast is None or copy_context is None or peer_context is None:
            super().memcpy_ordered(dst, src, nbytes, copy_device, copy_stream, copy_event,
                                   peer_device, peer_stream, peer_event, join)
            return
        failure = fast(dst, src, nbytes, copy_context, copy_stream, copy_event, peer_context,
                       peer_stream, peer_event, join)
        if failure is not None:
            raise cuda_error(failure[1], failure[0])

    def memcpy_peer_async(
        self, dst: int, dst_device: int, src: int, src_device: int, nbytes: int, stream: StreamHandle
    ) -> None:
        if not nbytes:
            return
        dst_ctx = self._contexts.get(dst_device)
        if dst_ctx is None:
            dst_ctx = self._primary(dst_device)
        src_ctx = self._contexts.get(src_device)
        if src_ctx is None:
            src_ctx = self._primary(src_device)
        err = cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, nbytes, stream)[0]
        if err:
            raise cuda_error(err, "cuMemcpyPeerAsync")

    def memset_d8(self, device: int, ptr: int, value: int, nbytes: int) -> None:
        if not nbytes:
            return
        self._ctx(device)
        err = cuMemsetD8(ptr, value & 0xFF, nbytes)[0]
        if err:
            raise cuda_error(err, "cuMemsetD8")

    def memset_d8_async(self, device: int, ptr: int, value: int, nbytes: int, stream: StreamHandle) -> None:
        if not nbytes:
            return
        self._ctx(device)
        err = cuMemsetD8Async(ptr, value & 0xFF, nbytes, stream)[0]
        if err:
            raise cuda_error(err, "cuMemsetD8Async")

    def memset_d16_async(self, device: int, ptr: int, value: int, count: int, stream: StreamHandle) -> None:
        if not count:
            return
        self._ctx(device)
        err = cuMemsetD16Async(ptr, value & 0xFFFF, count, stream)[0]
        if err:
            raise cuda_error(err, "cuMemsetD16Async")

    def memset_d32_async(self, device: int, ptr: int, value: int, count: int, stream: StreamHandle) -> None:
        if not count:
            return
        self._ctx(device)
        err = cuMemsetD32Async(ptr, value & 0xFFFFFFFF, count, stream)[0]
        if err:
            raise cuda_error(err, "cuMemsetD32Async")

    def pointer_device(self, ptr: int) -> int | None:
        if not ptr:
            return None
        self._any_ctx()
        err, mtype = cuPointerGetAttribute(POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
        if err == CUDA_ERROR_INVALID_VALUE:
            return None  # not allocated, mapped or registered with CUDA: plain host memory
        if err:
            raise cuda_error(err, "cuPointerGetAttribute")
        if int(mtype) not in (MEMORYTYPE_DEVICE, MEMORYTYPE_UNIFIED):
            return None  # pinned / registered host memory
        err, ordinal = _pointer_device_ordinal(ptr)
        if err == CUDA_ERROR_INVALID_VALUE:
            return None
        if err:
            raise cuda_error(err, "cuPointerGetAttribute")
        return ordinal if ordinal >= 0 else None


    def ipc_mem_handle(self, ptr: int) -> bytes:
        self._any_ctx()
        handle = check(cuIpcGetMemHandle(ptr), "cuIpcGetMemHandle")
        # Read the C struct directly (as ipc_event_handle does): getPtr() exists in every
        # bindings version, the `reserved` field does not.
        return ctypes.string_at(handle.getPtr(), IPC_HANDLE_SIZE)

    # ---------------------------------------------------------------- virtual memory (VMM)
    @staticmethod
    def _alloc_prop(device: int) -> Any:
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = int(device)
        return prop

    def vmm_granularity(self, device: int) -> int:
        g = self._granularity.get(device)
        if g is None:
            self._device(device)
            g = int(check(cuMemGetAllocationGranularity(
                self._alloc_prop(device),
                drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                "cuMemGetAllocationGranularity"))
            with self._lock:
                self._granularity[device] = g
        return g

    def vmm_reserve(self, device: int, size: int) -> int:
        self._ctx(device)
        return int(check(cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve"))

    def vmm_free_address(self, ptr: int, size: int) -> None:
        err = cuMemAddressFree(ptr, size)[0]
        if err:
            raise cuda_error(err, "cuMemAddressFree")

    def vmm_create(self, device: int, size: int) -> PhysicalMemoryHandle:
        self._ctx(device)
        return check(cuMemCreate(size, self._alloc_prop(device), 0), "cuMemCreate")

    def vmm_release(self, handle: PhysicalMemoryHandle) -> None:
        err = cuMemRelease(handle)[0]
        if err:
            raise cuda_error(err, "cuMemRelease")

    def vmm_map(self, device: int, ptr: int, size: int, handle: PhysicalMemoryHandle) -> None:
        self._ctx(device)
        err = cuMemMap(ptr, size, 0, handle, 0)[0]
        if err:
            raise cuda_error(err, "cuMemMap")
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = int(device)
        desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        err = cuMemSetAccess(ptr, size, [desc], 1)[0]
        if err:
            cuMemUnmap(ptr, size)  # leave the range as it was
            raise cuda_error(err, "cuMemSetAccess")

    def vmm_unmap(self, ptr: int, size: int) -> None:
        err = cuMemUnmap(ptr, size)[0]
        if err:
            raise cuda_error(err, "cuMemUnmap")

    # ---------------------------------------------------------------- stream-ordered pools
    def pool_create(self, device: int) -> MemoryPoolHandle:
        self._ctx(device)
        props = drv.CUmemPoolProps()
        props.allocType = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.handleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        props.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = int(device)
        pool = check(cuMemPoolCreate(props), "cuMemPoolCreate")
        # Keep freed memory cached across synchronisations (torch's cudaMallocAsync setting).
        err = cuMemPoolSetAttribute(pool, MemPoolAttribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                     drv.cuuint64_t(2**64 - 1))[0]
        if err:
            cuMemPoolDestroy(pool)
            raise cuda_error(err, "cuMemPoolSetAttribute")
        return pool

    def pool_destroy(self, pool: MemoryPoolHandle) -> None:
        err = cuMemPoolDestroy(pool)[0]
        if err:
            raise cuda_error(err, "cuMemPoolDestroy")

    def pool_alloc_async(self, pool: MemoryPoolHandle, nbytes: int, stream: StreamHandle) -> int:
        if nbytes == 0:  # never ask the driver for 0 bytes (see tests/driver/test_simulator_vmm.py)
            return 0
        res = cuMemAllocFromPoolAsync(nbytes, pool, stream)
        if res[0]:
            raise cuda_error(res[0], "cuMemAllocFromPoolAsync")
        return int(res[1])

    def pool_usage(self, pool: MemoryPoolHandle) -> tuple[int, int, int, int]:
        out = []
        for attr in (MemPoolAttribute.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                     MemPoolAttribute.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
                     MemPoolAttribute.CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
                     MemPoolAttribute.CU_MEMPOOL_ATTR_USED_MEM_HIGH):
            out.append(int(check(cuMemPoolGetAttribute(pool, attr), "cuMemPoolGetAttribute")))
        return out[0], out[1], out[2], out[3]

    def pool_reset_high(self, pool: MemoryPoolHandle) -> None:
        # Setting a *_HIGH attribute to 0 resets it to the current value.
        for attr in (MemPoolAttribute.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
                     MemPoolAttribute.CU_MEMPOOL_ATTR_USED_MEM_HIGH):
            err = cuMemPoolSetAttribute(pool, attr, drv.cuuint64_t(0))[0]
            if err:
                raise cuda_error(err, "cuMemPoolSetAttribute")

    def pool_trim(self, pool: MemoryPoolHandle, keep: int = 0) -> None:
        err = cuMemPoolTrimTo(pool, keep)[0]
        if err:
            raise cuda_error(err, "cuMemPoolTrimTo")
