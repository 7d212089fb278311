"""Let other libraries allocate from cudalab's caching allocator (RMM's approach).

* CuPy: ``cupy.cuda.set_allocator(cudalab.memory.cupy_allocator)``. CuPy arrays then draw
  from (and show up in) cudalab's pool and statistics; memory is allocated on CuPy's current
  device and stream and returned when CuPy drops it.
* Numba: ``numba.cuda.set_memory_manager(cudalab.interop.CudalabNumbaMemoryManager)``
  or ``NUMBA_CUDA_MEMORY_MANAGER=cudalab.interop`` (External Memory Management
  plugin; device memory only, host allocations stay Numba's).

This adapter sits above the allocator and the memory API: it allocates through the public
:func:`cudalab.memory.caching_allocator_alloc` and gives memory back from finalizers with
:func:`cudalab._array_memory.release_device_memory` (the finalizer-safe release that
device arrays use too), so the allocator runtime knows nothing of CuPy or Numba.
Neither CuPy nor Numba is imported until used.
"""

from __future__ import annotations

import threading
from typing import Any

from cudalab import _interrupts, streams
from cudalab import memory as _memory
from cudalab._array_memory import release_device_memory

__all__ = ["cupy_allocator", "CudalabNumbaMemoryManager"]  # noqa: F822 (built lazily)

_streams_lock = threading.Lock()
#: (device, another library's stream handle) -> its cudalab stream; at most
#: ``_MAX_CACHED_STREAMS`` entries (cleared when full).
_external_streams: dict[tuple[int, int], streams.Stream] = {}
_MAX_CACHED_STREAMS = 256


def _stream_for(device: int, value: int) -> streams.Stream:
    """The cudalab stream for another library's stream handle on ``device``."""
    if value == 0:
        return streams.default_stream(device)
    key = (device, value)
    s = _external_streams.get(key)
    if s is None:
        s = streams.ExternalStream(value, device)
        with _streams_lock:
            if len(_external_streams) >= _MAX_CACHED_STREAMS:
                _external_streams.clear()
            _external_streams[key] = s
    return s


class _Allocation:
    """Owns one block of cudalab memory; returns it to the allocator when collected."""

    __slots__ = ("ptr", "size", "device", "_owns")

    def __init__(self, ptr: int, size: int, device: int):
        self.ptr = ptr
        self.size = size
        self.device = device
        self._owns = True  # False once given back (the finalizer gives it back once)

    def __del__(self) -> None:
        try:
            if self._owns:
                self._owns = False
                release_device_memory(self.ptr)
        except BaseException:
            pass

    def __repr__(self) -> str:
        return f"<cudalab allocation 0x{self.ptr:x} ({self.size} bytes) on cuda:{self.device}>"


_interrupts.guard(_Allocation.__del__)  # Ctrl-C waits until the finalizer returns


def _allocate(nbytes: int, device: int, stream_value: int) -> _Allocation:
    ptr = _memory.caching_allocator_alloc(nbytes, device, _stream_for(device, stream_value))
    return _Allocation(ptr, nbytes, device)


def cupy_allocator(nbytes: int) -> Any:
    """A CuPy allocator over cudalab's caching allocator.

    ``cupy.cuda.set_allocator(cudalab.memory.cupy_allocator)``; undo with
    ``cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)``.

    Parameters
    ----------
    nbytes : int
        Bytes, on CuPy's current device and stream.

    Returns
    -------
    cupy.cuda.MemoryPointer
        Over the allocation; the memory goes back to cudalab when CuPy drops it.

    Raises
    ------
    ImportError
        When CuPy is not installed.
    cudalab.OutOfMemoryError
        When the memory cannot be had.
    """
    import cupy

    device = cupy.cuda.runtime.getDevice()
    if nbytes == 0:
        mem = cupy.cuda.UnownedMemory(0, 0, None, device)
    else:
        owner = _allocate(nbytes, device, cupy.cuda.get_current_stream().ptr)
        mem = cupy.cuda.UnownedMemory(owner.ptr, nbytes, owner, device)
    return cupy.cuda.MemoryPointer(mem, 0)


# --------------------------------------------------------------------------- Numba (EMM)
_numba_class = None


def _make_numba_manager():
    import ctypes

    from numba import cuda
    from numba.cuda import HostOnlyCUDAMemoryManager, MemoryPointer

    try:  # numba-cuda with the NVIDIA bindings (the default) wants their CUdeviceptr
        from numba.cuda.cudadrv import driver as _nb_driver

        use_nv = bool(getattr(_nb_driver, "USE_NV_BINDING", True))
    except ImportError:  # pragma: no cover
        _nb_driver = None
        use_nv = True

    # Numba's own binding types, from the binding module Numba uses (only cudalab._driver
    # imports cuda.bindings itself).
    def _pointer(ptr: int):
        if use_nv:
            return _nb_driver.binding.CUdeviceptr(ptr)
        return ctypes.c_uint64(ptr)

    def _ipc_handle(data: bytes):
        if use_nv:
            handle = _nb_driver.binding.CUipcMemHandle()
            ctypes.memmove(handle.getPtr(), data, len(data))
            return handle
        from numba.cuda.cudadrv import drvapi

        return drvapi.cu_ipc_mem_handle.from_buffer_copy(data)

    class CudalabNumbaMemoryManager(HostOnlyCUDAMemoryManager):
        """Numba EMM plugin: device allocations come from cudalab's caching allocator."""

        def initialize(self) -> None:
            pass  # cudalab initialises itself lazily; nothing per context

        def memalloc(self, size: int):
            device = self.context.device.id
            if size == 0:
                return MemoryPointer(self.context, _pointer(0), 0, finalizer=None)
            stream = streams.current_stream(device)
            owner = _allocate(size, device, stream.cuda_stream)
            # The MemoryPointer's finalizer drops the owner, which frees to cudalab.
            holder = [owner]
            return MemoryPointer(self.context, _pointer(owner.ptr), size,
                                 finalizer=holder.clear)

        def get_ipc_handle(self, memory):
            from numba.cuda import IpcHandle

            from cudalab import _internal

            start, _ = cuda.cudadrv.driver.device_extents(memory)
            handle = _ipc_handle(_internal.backend().ipc_mem_handle(int(start)))
            offset = int(memory.handle) - int(start)
            source_info = cuda.current_context().device.get_device_identity()
            return IpcHandle(memory, handle, memory.size, source_info, offset=offset)

        def get_memory_info(self):
            free, total = _memory.mem_get_info(self.context.device.id)
            try:
                from numba.cuda.cudadrv.driver import MemoryInfo

                return MemoryInfo(free=free, total=total)
            except ImportError:  # pragma: no cover
                return (free, total)

        @property
        def interface_version(self) -> int:
            return 1

    return CudalabNumbaMemoryManager


def __getattr__(name: str) -> Any:
    # The plugin class derives from Numba's base class, so it is built on first access.
    global _numba_class
    if name in ("CudalabNumbaMemoryManager", "_numba_memory_manager"):
        if _numba_class is None:
            _numba_class = _make_numba_manager()
        return _numba_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
