"""Pluggable allocators: device memory from user-supplied functions.

torch's ``torch.cuda.memory.CUDAPluggableAllocator(path, alloc_fn_name, free_fn_name)`` +
``change_current_allocator`` work as in torch (:class:`CUDAPluggableAllocator` loads the two
functions from a shared library with :mod:`ctypes`); :class:`PluggableAllocator` takes
Python callables instead, without a shared library::

    def my_malloc(size, device, stream):        # -> device pointer (int)
        ...
    def my_free(ptr, size, device, stream):
        ...
    cudalab.memory.change_current_allocator(
        cudalab.memory.PluggableAllocator(my_malloc, my_free))

The argument order is torch's (``alloc(size, device, stream)``, ``free(ptr, size, device,
stream)``); ``stream`` is the int handle of the allocation stream (``cuda_stream``: 0 for the
legacy default stream) and ``size`` in ``free_fn`` is the size that was requested.

``change_current_allocator`` must come before the first allocation (before any device's
allocator exists); afterwards it raises torch's RuntimeError "Can't swap an already
initialized allocator". From then on every device's allocator is a
:class:`PluggableDeviceAllocator` and ``get_allocator_backend()`` returns ``"pluggable"``.

Unlike torch (whose pluggable allocator has no statistics: ``memory_stats()`` raises),
cudalab keeps its own counters: every allocation counts as one allocation and one segment of
exactly the requested size (there is no cache, so reserved = allocated), split into the
small/large pools by torch's 1 MiB boundary; ``num_device_alloc``/``num_device_free`` count
the callable calls. ``set_per_process_memory_fraction`` is enforced on those counters.

``record_stream``: when a block used on other streams is freed, the allocation stream first
waits (``stream_wait_event``, no host sync) on events recorded on those streams, then
``free_fn`` is called with the allocation stream, so a stream-ordered ``free_fn`` (e.g.
``cuMemFreeAsync``) is safe; a synchronous one (``cuMemFree``) is safe anyway.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cudalab import streams as _streams
from cudalab._driver.base import EVENT_DISABLE_TIMING, ClosedHandle
from cudalab.allocator import registry as _registry
from cudalab.allocator.base import (
    Allocator,
    bad_pointer,
    fraction_total,
    oom_text,
    stream_key,
)
from cudalab.allocator.blocks import SegmentDict, StreamUses
from cudalab.allocator.config import SMALL_SIZE, UNLIMITED, AllocatorConfig
from cudalab.allocator.policy import check_size
from cudalab.allocator.stats import DeviceStats
from cudalab.errors import CudaError, OutOfMemoryError

if TYPE_CHECKING:
    from cudalab._driver.base import Backend
    from cudalab.allocator.hooks import AllocatorTrace

__all__ = [
    "CUDAPluggableAllocator",
    "PluggableAllocator",
    "PluggableDeviceAllocator",
    "change_current_allocator",
    "current_allocator",
]


class PluggableAllocator:
    """An allocator made of two Python callables (torch's ``CUDAPluggableAllocator``).

    Args:
        malloc_fn: ``malloc_fn(size: int, device: int, stream: int) -> int`` returns a device
            pointer of at least ``size`` bytes usable on ``stream`` of ``device``. It may
            raise (the exception reaches the caller) or return 0 when out of memory.
        free_fn: ``free_fn(ptr: int, size: int, device: int, stream: int) -> None`` gives it
            back (``size`` and ``stream`` as passed to ``malloc_fn``).

    Activate it with :func:`change_current_allocator` before the first allocation.
    """

    __slots__ = ("malloc_fn", "free_fn", "__weakref__")

    def __init__(self, malloc_fn: Callable[[int, int, int], int],
                 free_fn: Callable[[int, int, int, int], None]):
        for name, fn in (("malloc_fn", malloc_fn), ("free_fn", free_fn)):
            if not callable(fn):
                raise TypeError(
                    f"PluggableAllocator: {name} must be callable, got {type(fn).__name__} {fn!r}")
        self.malloc_fn = malloc_fn
        self.free_fn = free_fn

    def __repr__(self) -> str:
        return (f"PluggableAllocator(malloc_fn={_fn_name(self.malloc_fn)}, "
                f"free_fn={_fn_name(self.free_fn)})")

    def allocator(self) -> PluggableAllocator:
        """torch's ``CUDAPluggableAllocator.allocator()`` (here the object itself)."""
        return self

    def device_allocator(self, backend: Backend, device: int,
                         config: AllocatorConfig | None = None,
                         stream_resolver: Callable[[], int] | None = None
                         ) -> PluggableDeviceAllocator:
        """The per-device :class:`~cudalab.allocator.base.Allocator` over these callables."""
        return PluggableDeviceAllocator(self, backend, device, config, stream_resolver)


class CUDAPluggableAllocator(PluggableAllocator):
    """torch's ``CUDAPluggableAllocator(path_to_so_file, alloc_fn_name, free_fn_name)``: an
    allocator whose two functions come from a shared library, loaded with :mod:`ctypes`.

    The functions have torch's C signatures::

        void* alloc_fn(ssize_t size, int device, cudaStream_t stream);
        void free_fn(void* ptr, ssize_t size, int device, cudaStream_t stream);

    Activate it with :func:`change_current_allocator` before the first allocation, as in
    torch. Differences from torch: the functions are called through :mod:`ctypes` from
    Python (torch calls them from C++), so each allocation costs a few microseconds more;
    a NULL result raises :class:`cudalab.OutOfMemoryError` naming the function; cudalab
    keeps statistics for it (torch's ``memory_stats()`` raises for a pluggable
    allocator). :class:`PluggableAllocator` takes Python callables instead of a library.

    Parameters
    ----------
    path_to_so_file : str or os.PathLike
        The shared library (``ctypes.CDLL`` loads it; ``RTLD_GLOBAL`` is not used).
    alloc_fn_name : str
        The symbol of the allocation function.
    free_fn_name : str
        The symbol of the free function.

    Raises
    ------
    TypeError
        When a name is not a str.
    OSError
        When the library cannot be loaded.
    AttributeError
        When the library has no such symbol.
    """

    __slots__ = ("path_to_so_file", "alloc_fn_name", "free_fn_name", "_library")

    def __init__(self, path_to_so_file: Any, alloc_fn_name: str, free_fn_name: str):
        import ctypes  # (only here: keeps the allocator package's import lean)
        import os

        for name, value in (("alloc_fn_name", alloc_fn_name), ("free_fn_name", free_fn_name)):
            if not isinstance(value, str) or not value:
                raise TypeError(f"CUDAPluggableAllocator: {name} must be a non-empty str, "
                                f"got {value!r}")
        path = os.fspath(path_to_so_file)
        library = ctypes.CDLL(path)
        alloc = getattr(library, alloc_fn_name)  # AttributeError names the missing symbol
        free = getattr(library, free_fn_name)
        alloc.restype = ctypes.c_void_p
        alloc.argtypes = (ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
        free.restype = None
        free.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)

        def malloc_fn(size: int, device: int, stream: int) -> int:
            return alloc(size, device, stream) or 0  # NULL comes back as None

        def free_fn(ptr: int, size: int, device: int, stream: int) -> None:
            free(ptr, size, device, stream)

        malloc_fn.__qualname__ = f"{os.path.basename(path)}:{alloc_fn_name}"
        free_fn.__qualname__ = f"{os.path.basename(path)}:{free_fn_name}"
        super().__init__(malloc_fn, free_fn)
        self.path_to_so_file = path
        self.alloc_fn_name = alloc_fn_name
        self.free_fn_name = free_fn_name
        self._library = library  # keeps the library loaded while the allocator lives

    def __repr__(self) -> str:
        return (f"CUDAPluggableAllocator({self.path_to_so_file!r}, {self.alloc_fn_name!r}, "
                f"{self.free_fn_name!r})")


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def change_current_allocator(allocator: PluggableAllocator | None) -> None:
    """Use ``allocator`` for every device from now on (torch's function of the same name).

    Parameters
    ----------
    allocator : PluggableAllocator, CUDAPluggableAllocator or None
        The allocator; ``None`` (a cudalab extension) goes back to the allocator the
        settings choose.

    Raises
    ------
    RuntimeError
        Once any device's allocator exists ("Can't swap an already initialized
        allocator", as torch): call it before the first allocation.
    TypeError
        When ``allocator`` is not a :class:`PluggableAllocator`.
    """
    if allocator is not None and not isinstance(allocator, PluggableAllocator):
        raise TypeError(
            "change_current_allocator expects a cudalab.memory.PluggableAllocator, got "
            f"{type(allocator).__name__}")
    _registry.set_custom_allocator(allocator)


def current_allocator() -> PluggableAllocator | None:
    """The allocator set by :func:`change_current_allocator` (None: the settings decide)."""
    spec = _registry.custom_factory()
    return spec if isinstance(spec, PluggableAllocator) else None


class PluggableDeviceAllocator(Allocator):
    """One device's allocator calling a :class:`PluggableAllocator`'s callables.

    The callables are called without any lock held, so they may do anything, including
    allocating from cudalab on another device.
    """

    name = "pluggable"

    def __init__(self, spec: PluggableAllocator, backend: Backend, device: int = 0,
                 config: AllocatorConfig | None = None,
                 stream_resolver: Callable[[], int] | None = None):
        self.spec = spec
        self.backend = backend
        self.device = device
        self.config = config or AllocatorConfig()
        self._resolver = stream_resolver
        self.stats = DeviceStats(-1)
        self.live: dict[int, tuple[int, int, Any]] = {}  # ptr -> (size, stream int, pool)
        self._uses: dict[int, StreamUses] = {}
        self._lock = threading.Lock()
        self._limited = False
        self._fraction = 1.0
        self._limit = UNLIMITED
        self._total = 0
        self._trace: AllocatorTrace | None = None
        if self.config.per_process_memory_fraction is not None:
            self.set_memory_fraction(self.config.per_process_memory_fraction)

    def __repr__(self) -> str:
        return f"<PluggableDeviceAllocator device={self.device} {self.spec!r}>"

    # ------------------------------------------------------------------ malloc / free
    def malloc(self, size: Any, stream: Any = None) -> int:
        size = check_size(size)
        if size == 0:
            return 0
        if stream is None:
            skey = (_streams.current_stream(self.device).cuda_stream if self._resolver is None
                    else self._resolver())
        else:
            skey = stream_key(stream, self.device)
        st = self.stats
        pool = st.small if size <= SMALL_SIZE else st.large
        if self._limited:
            with self._lock:
                over = st.current("b_res") + size > self._limit
            if over:
                raise self._oom(size)
        ptr = self.spec.malloc_fn(size, self.device, skey)
        if type(ptr) is not int:
            if isinstance(ptr, int) and not isinstance(ptr, bool):
                ptr = int(ptr)
            else:
                raise self._bad_result(size, skey, f"returned {type(ptr).__name__} {ptr!r}, "
                                                   "not a device pointer (int)")
        if ptr <= 0:
            raise self._bad_result(size, skey, f"returned {ptr} (out of memory?)")
        if ptr in self.live:
            raise RuntimeError(
                f"pluggable allocator: malloc_fn returned {ptr:#x}, which is still live "
                f"(allocated and not freed) on device {self.device}")
        rec = (size, skey, pool)
        with self._lock:
            self.live[ptr] = rec
            st.num_device_alloc += 1
            st.increase(pool, "n_seg", 1)
            st.increase(pool, "n_alloc", 1)
            st.increase(pool, "b_res", size)
            st.increase(pool, "b_alloc", size)
            st.increase(pool, "b_req", size)
            v = st.small.b_alloc + st.large.b_alloc
            if v > self._mark:
                self._mark = v
            self._uses.pop(ptr, None)
        if self._trace is not None:
            self._trace("segment_alloc", ptr, size, skey)
            self._trace("alloc", ptr, size, skey)
        return ptr

    def free(self, ptr: int) -> None:
        rec = self.live.pop(ptr, None)
        if rec is None:
            if ptr == 0 and type(ptr) is int:
                return
            raise bad_pointer(ptr)
        size, skey, pool = rec
        uses = self._uses.pop(ptr, None) if self._uses else None
        try:
            if uses:
                self._wait_for_uses(skey, uses)
            self.spec.free_fn(ptr, size, self.device, skey)
        except BaseException:
            self.live[ptr] = rec  # lose nothing: still live, can be freed again
            if uses:
                self._uses[ptr] = uses
            raise
        st = self.stats
        with self._lock:
            st.num_device_free += 1
            for code in ("n_seg", "n_alloc"):
                st.decrease(pool, code, 1)
            for code in ("b_res", "b_alloc", "b_req"):
                st.decrease(pool, code, size)
        if self._trace is not None:
            for action in ("free_requested", "free_completed"):
                self._trace(action, ptr, size, skey)
            self._trace("segment_free", ptr, size, skey)

    # ------------------------------------------------------------------ Allocator API
    def owns(self, ptr: int) -> bool:
        return ptr in self.live

    def block_size(self, ptr: int) -> int:
        rec = self.live.get(ptr)
        if rec is None:
            raise bad_pointer(ptr)
        return rec[0]

    def record_stream(self, ptr: int, stream: Any) -> None:
        self._record_use(ptr, stream, 1)

    def empty_cache(self) -> None:
        """Nothing is cached: a no-op."""

    def set_memory_fraction(self, fraction: float) -> None:
        total = fraction_total(self.backend, self.device, fraction)
        with self._lock:
            self._total = total
            self._limit = int(fraction * total)
            self._fraction = float(fraction)  # returned as set (torch stores the fraction)
            self._limited = True

    def segments(self) -> list[SegmentDict]:
        """One segment per live allocation (torch's snapshot layout)."""
        with self._lock:
            items = sorted(self.live.items())
        small = self.stats.small
        return [{
            "device": self.device, "address": ptr, "total_size": size, "allocated_size": size,
            "active_size": size, "requested_size": size, "stream": skey,
            "segment_type": "small" if pool is small else "large",
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
            "blocks": [{"address": ptr, "size": size, "requested_size": size,
                        "state": "active_allocated", "frames": []}],
        } for ptr, (size, skey, pool) in items]

    # ------------------------------------------------------------------ internals
    def _bad_result(self, size: int, skey: int, what: str) -> OutOfMemoryError:
        with self._lock:
            self.stats.num_ooms += 1
        return OutOfMemoryError(text=(
            f"CUDA out of memory: the pluggable allocator's malloc_fn "
            f"{_fn_name(self.spec.malloc_fn)}(size={size}, device={self.device}, "
            f"stream={skey:#x}) {what}"))

    def _oom(self, size: int) -> OutOfMemoryError:
        free, total = self.backend.mem_get_info(self.device)
        st = self.stats
        with self._lock:
            st.num_ooms += 1
            allocated, reserved = st.current("b_alloc"), st.current("b_res")
        return OutOfMemoryError(text=oom_text(self.device, size, free, total, allocated,
                                               reserved, self._limit))

    def _wait_for_uses(self, skey: int, uses: StreamUses) -> None:
        """Make the allocation stream wait for the work queued so far on ``uses``."""
        b = self.backend
        try:
            alloc_stream = b.stream_from_int(self.device, skey)
        except CudaError:
            alloc_stream = None  # not a stream this driver seam knows: wait on the host
        for s in uses:
            dev = s.device_index
            h = s.handle
            if type(h) is ClosedHandle:  # closed stream
                b.synchronize(dev)
                continue
            if s.cuda_stream < 3:
                b.set_context(dev)
            ev = b.event_create(dev, EVENT_DISABLE_TIMING)
            try:
                try:
                    b.event_record(ev, h)
                except CudaError:
                    b.synchronize(dev)
                    continue
                if alloc_stream is None:
                    b.event_synchronize(ev)
                else:
                    if skey < 3:
                        b.set_context(self.device)
                    b.stream_wait_event(alloc_stream, ev)
            finally:
                b.event_destroy(ev)
