"""Page-locked (pinned) host memory from a caching allocator, as numpy arrays.

Pinned memory is what makes host <-> device copies truly asynchronous (and faster), but
``cuMemHostAlloc``/``cuMemFreeHost`` are slow and synchronising, so blocks are cached:

* sizes are rounded up to 512 bytes, then to the next power of two, and cached in
  exact-size free lists (CuPy's ``PinnedMemoryPool``): no splitting or merging;
* a block whose memory an asynchronous copy may still be reading or writing is not handed
  out again until that copy is done: :func:`record_use` records an event on the copy's
  stream (``DeviceArray.copy_(..., non_blocking=True)`` and ``DeviceArray.numpy(out=...,
  non_blocking=True)`` do it for you), and a freed block is reused only once all its
  events have completed (torch's CachingHostAllocator rule);
* the array's memory returns to the cache when the last numpy array (or view) over it goes
  away; returns from finalizers are lock-free and filed at the next allocation.

``cudalab.empty_pinned(shape, dtype)``, ``cudalab.pin_memory(a)``, ``cudalab.is_pinned(a)``,
:func:`pinned_memory_stats` and :func:`empty_pinned_cache` are the public API.
"""

from __future__ import annotations

import bisect
import collections
import math
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from cudalab import devices as _devices
from cudalab._dtypes import normalize_dtype, normalize_shape
from cudalab._units import format_bytes
from cudalab.allocator.events import EventPool
from cudalab.allocator.host_stats import HostStats, flatten
from cudalab.errors import OutOfMemoryError

if TYPE_CHECKING:
    from cudalab._driver.base import Backend

__all__ = [
    "empty_pinned",
    "pin_memory",
    "is_pinned",
    "record_use",
    "pinned_memory_stats",
    "host_memory_stats",
    "host_memory_stats_as_nested_dict",
    "reset_peak_host_memory_stats",
    "reset_accumulated_host_memory_stats",
    "empty_pinned_cache",
    "CachingHostAllocator",
    "round_size",
]

_MIN_BLOCK = 512


def round_size(nbytes: int) -> int:
    """512-byte multiple, then the next power of two (CuPy's pinned pool rounding)."""
    n = max(nbytes, 1)
    n = -(-n // _MIN_BLOCK) * _MIN_BLOCK
    return 1 << (n - 1).bit_length()


class _Block:
    __slots__ = ("ptr", "size", "requested", "events")

    def __init__(self, ptr: int, size: int):
        self.ptr = ptr
        self.size = size
        self.requested = 0
        #: (device, stream value) -> (event handle, EventPool) of the last recorded use.
        self.events: dict[tuple[int, int], tuple[Any, EventPool]] = {}


class CachingHostAllocator:
    """The process's pinned host memory cache (one per process: pinned memory is portable
    across devices)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._backend: Backend | None = None  # bound on first use (initialises CUDA)
        #: Free blocks by (rounded) size. Invariant: a block is in exactly one of ``_free``,
        #: ``_used`` or ``_returned`` (returned: released by a finalizer, filed at the next
        #: call under the lock).
        self._free: dict[int, list[_Block]] = {}
        #: Blocks handed out, by pointer; ``_used_starts`` is their sorted pointers (address
        #: lookups), always the same set as ``_used``'s keys.
        self._used: dict[int, _Block] = {}
        self._used_starts: list[int] = []
        self._returned: collections.deque[_Block] = collections.deque()
        self._event_pools: dict[int, EventPool] = {}
        # Counters. Invariants (lock held, after _drain): _allocated_bytes is the sum of the
        # used blocks' sizes and _requested_bytes of their requests (<= _allocated_bytes);
        # _cached_bytes / _cached_blocks are the free blocks' total size and number;
        # _peak_allocated >= _allocated_bytes; _host_allocs - _host_frees blocks exist.
        self._allocated_bytes = 0
        self._requested_bytes = 0
        self._cached_bytes = 0
        self._cached_blocks = 0
        self._peak_allocated = 0
        self._host_allocs = 0
        self._host_frees = 0
        self._cache_hits = 0
        #: torch's HostStats (cudalab.allocator.host_stats), updated with the counters
        #: above: allocation/allocated_bytes with _used, segment/reserved_bytes with the
        #: blocks that exist (used + free + returned).
        self._host_stats = HostStats()

    # ------------------------------------------------------------------ plumbing
    def _b(self) -> Backend:
        b = self._backend
        if b is None:
            b = self._backend = _devices.backend()
        return b

    def _event_pool(self, device: int) -> EventPool:
        pool = self._event_pools.get(device)
        if pool is None:
            pool = self._event_pools.setdefault(device, EventPool(self._b(), device))
        return pool

    def _drain(self) -> None:
        """File blocks released by finalizers (lock held)."""
        returned = self._returned
        while returned:
            block = returned.popleft()
            if self._used.pop(block.ptr, None) is None:
                continue
            del self._used_starts[bisect.bisect_left(self._used_starts, block.ptr)]
            self._allocated_bytes -= block.size
            self._requested_bytes -= block.requested
            self._host_stats.allocation.decrease(1)
            self._host_stats.allocated_bytes.decrease(block.size)
            self._free.setdefault(block.size, []).append(block)
            self._cached_bytes += block.size
            self._cached_blocks += 1

    def _ready(self, block: _Block) -> bool:
        """True when no recorded use of ``block`` is pending; returns finished events."""
        events = block.events
        if not events:
            return True
        query = self._b().event_query
        for key, (ev, pool) in list(events.items()):
            if not query(ev):
                return False
            del events[key]
            pool.put(ev)
        return True

    def _find_used(self, ptr: int, nbytes: int = 1) -> _Block | None:
        starts = self._used_starts
        i = bisect.bisect_right(starts, ptr) - 1
        if i < 0:
            return None
        block = self._used[starts[i]]
        if ptr + max(nbytes, 1) <= block.ptr + block.size:
            return block
        return None

    # ------------------------------------------------------------------ allocation
    def malloc(self, nbytes: int) -> _Block:
        """A block of at least ``nbytes`` (cached if one is free and no copy uses it)."""
        size = round_size(nbytes)
        with self._lock:
            if self._returned:
                self._drain()
            block = self._take_cached(size)
            if block is not None:
                self._register(block, nbytes)
                return block
        block = self._allocate(size)
        with self._lock:
            self._register(block, nbytes)
        return block

    def _register(self, block: _Block, nbytes: int) -> None:
        """Count ``block`` as handed out (lock held)."""
        block.requested = nbytes
        self._used[block.ptr] = block
        bisect.insort(self._used_starts, block.ptr)
        self._allocated_bytes += block.size
        self._requested_bytes += nbytes
        if self._allocated_bytes > self._peak_allocated:
            self._peak_allocated = self._allocated_bytes
        self._host_stats.allocation.increase(1)
        self._host_stats.allocated_bytes.increase(block.size)

    def _take_cached(self, size: int) -> _Block | None:
        blocks = self._free.get(size)
        if not blocks:
            return None
        for i in range(len(blocks) - 1, -1, -1):
            block = blocks[i]
            if self._ready(block):
                del blocks[i]
                self._cached_bytes -= size
                self._cached_blocks -= 1
                self._cache_hits += 1
                return block
        return None

    def _allocate(self, size: int) -> _Block:
        b = self._b()
        t0 = time.perf_counter_ns()
        try:
            ptr = b.host_alloc(size)
        except OutOfMemoryError:
            self.empty_cache()
            t0 = time.perf_counter_ns()
            try:
                ptr = b.host_alloc(size)
            except OutOfMemoryError as exc:
                raise OutOfMemoryError(
                    text=f"out of pinned host memory allocating {format_bytes(size)} ({size} "
                         f"bytes; {format_bytes(self.stats()['allocated_bytes'])} of pinned "
                         f"memory in use): {exc}") from exc
        elapsed_us = (time.perf_counter_ns() - t0) // 1000
        with self._lock:
            self._host_allocs += 1
            hs = self._host_stats
            hs.segment.increase(1)
            hs.reserved_bytes.increase(size)
            hs.host_alloc_time.add(elapsed_us)
        return _Block(ptr, size)

    def release(self, block: _Block) -> None:
        """Give ``block`` back (called from finalizers: lock-free, never raises)."""
        self._returned.append(block)

    # ------------------------------------------------------------------ uses by copies
    def record_use(self, ptr: int, stream: Any) -> bool:
        """Record that work queued on ``stream`` uses the pinned memory at ``ptr``.

        The block is then not reused before that work completes. Returns False (and does
        nothing) when ``ptr`` is not memory from this allocator.
        """
        device = stream.device_index
        key = (device, stream.cuda_stream)
        b = self._b()
        if stream.is_legacy_null:
            _devices.ensure_context(device)
        # Held across two quick, non-blocking driver calls (event create/record): that keeps
        # concurrent record_use calls on one block simple. Finalizers never take this lock.
        with self._lock:
            self._drain()
            block = self._find_used(ptr)
            if block is None:
                return False
            entry = block.events.get(key)
            if entry is None:
                pool = self._event_pool(device)
                entry = block.events[key] = (pool.get(), pool)
            b.event_record(entry[0], stream.handle)
        return True

    def lookup(self, ptr: int, nbytes: int = 1) -> bool:
        """True when [ptr, ptr + nbytes) lies inside pinned memory in use."""
        with self._lock:
            self._drain()
            return self._find_used(ptr, nbytes) is not None

    # ------------------------------------------------------------------ cache control
    def empty_cache(self) -> None:
        """Free every cached block that no pending copy uses (others stay cached)."""
        to_free: list[_Block] = []
        with self._lock:
            self._drain()
            for size, blocks in list(self._free.items()):
                keep: list[_Block] = []
                for block in blocks:
                    (to_free if self._ready(block) else keep).append(block)
                if keep:
                    self._free[size] = keep
                else:
                    del self._free[size]
            for block in to_free:
                self._cached_bytes -= block.size
                self._cached_blocks -= 1
        if not to_free:
            return
        b = self._b()
        for block in to_free:
            t0 = time.perf_counter_ns()
            b.host_free(block.ptr)
            elapsed_us = (time.perf_counter_ns() - t0) // 1000
            with self._lock:
                self._host_frees += 1
                hs = self._host_stats
                hs.segment.decrease(1)
                hs.reserved_bytes.decrease(block.size)
                hs.host_free_time.add(elapsed_us)

    def stats(self) -> dict[str, int]:
        """Counters: bytes/blocks in use and cached, peak, host allocations and frees."""
        with self._lock:
            self._drain()
            pending = sum(1 for blocks in self._free.values() for b in blocks if b.events)
            return {
                "allocated_bytes": self._allocated_bytes,
                "allocated_blocks": len(self._used),
                "requested_bytes": self._requested_bytes,
                "cached_bytes": self._cached_bytes,
                "cached_blocks": self._cached_blocks,
                "cached_blocks_pending": pending,
                "reserved_bytes": self._allocated_bytes + self._cached_bytes,
                "peak_allocated_bytes": self._peak_allocated,
                "num_host_alloc": self._host_allocs,
                "num_host_free": self._host_frees,
                "num_cache_hits": self._cache_hits,
            }

    def host_stats(self) -> dict[str, object]:
        """torch's nested host stats dict (:meth:`HostStats.nested`), after filing returns."""
        with self._lock:
            self._drain()
            return self._host_stats.nested()

    def reset_host_stats(self, peak: bool) -> None:
        """Reset the peaks (``peak=True``) or the accumulated counters of the host stats."""
        with self._lock:
            self._drain()
            if peak:
                self._host_stats.reset_peak()
            else:
                self._host_stats.reset_accumulated()


_allocator = CachingHostAllocator()
_typestrs: dict[np.dtype, str] = {}  # dtype -> its array-interface typestr ("" if none)


class _PinnedBuffer:
    """Owner of one block: numpy arrays over the block keep it alive (as their ``base``)."""

    __slots__ = ("__array_interface__", "_block")

    def __init__(self, block: _Block, shape: tuple[int, ...], typestr: str):
        self._block = block
        self.__array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (block.ptr, False),
            "version": 3,
        }

    def __del__(self) -> None:
        try:
            _allocator.release(self._block)  # lock-free: safe from any finalizer context
        except BaseException:
            pass


# --------------------------------------------------------------------------- public API
def empty_pinned(shape: Any, dtype: Any = np.float32) -> np.ndarray:
    """An uninitialised numpy array in page-locked memory from the pinned cache.

    Parameters
    ----------
    shape : int or tuple of int
        The array's shape.
    dtype : dtype, optional
        Any dtype a :class:`cudalab.DeviceArray` can hold (default float32).

    Returns
    -------
    numpy.ndarray
        C-contiguous; its memory returns to the cache when the last array over it goes.

    Raises
    ------
    TypeError, ValueError
        For an unsupported dtype or a bad shape (as :func:`cudalab.empty`).
    cudalab.OutOfMemoryError
        When pinned memory cannot be had even after emptying the cache.
    """
    shape = normalize_shape(shape)
    dt = normalize_dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    block = _allocator.malloc(nbytes)
    typestr = _typestrs.get(dt)
    if typestr is None:
        typestr = _typestrs[dt] = dt.str if np.dtype(dt.str) == dt else ""
    if typestr:  # the array interface can name the dtype: no view needed
        return np.asarray(_PinnedBuffer(block, shape, typestr))
    raw = np.asarray(_PinnedBuffer(block, (nbytes,), "|u1"))  # e.g. ml_dtypes' bfloat16
    return raw.view(dt).reshape(shape)


def pin_memory(array: Any) -> np.ndarray:
    """A pinned copy of ``array``.

    Parameters
    ----------
    array : array_like
        Anything ``numpy.asarray`` takes.

    Returns
    -------
    numpy.ndarray
        ``array`` itself when it already lies in pinned memory from the cache, else a
        pinned copy.
    """
    a = np.asarray(array)
    if is_pinned(a):
        return a
    out = empty_pinned(a.shape, a.dtype)
    np.copyto(out, a)
    return out


def is_pinned(array: Any) -> bool:
    """Whether ``array`` lies in pinned memory from cudalab's cache.

    Parameters
    ----------
    array : numpy.ndarray or object
        A numpy array or anything with ``__array_interface__``.

    Returns
    -------
    bool
        False for anything else.
    """
    if not isinstance(array, np.ndarray):
        if not hasattr(array, "__array_interface__"):
            return False
        array = np.asarray(array)
    return _allocator.lookup(array.__array_interface__["data"][0])


def record_use(ptr: int, stream: Any) -> bool:
    """Record that work queued on ``stream`` uses pinned memory at ``ptr`` (see module doc).

    Parameters
    ----------
    ptr : int
        An address inside a pinned block in use.
    stream : cudalab.Stream
        The stream whose queued work reads or writes it.

    Returns
    -------
    bool
        False (and nothing recorded) when ``ptr`` is not pinned memory from the cache.
    """
    return _allocator.record_use(ptr, stream)


def _lookup(ptr: int, nbytes: int) -> bool:
    return _allocator.lookup(ptr, nbytes)


def pinned_memory_stats() -> dict[str, int]:
    """The pinned cache's counters: an alias of :func:`host_memory_stats` (torch's name)
    that also carries cudalab's flat summary keys.

    Unlike :func:`host_memory_stats` it answers (zeros) before CUDA is initialised.

    Returns
    -------
    dict of str to int
        Every key of :func:`host_memory_stats`, plus ``allocated_bytes``/``allocated_blocks``
        (in use, rounded sizes), ``requested_bytes``, ``cached_bytes``/``cached_blocks``
        (free, kept), ``cached_blocks_pending`` (free but possibly still used by a copy),
        ``reserved_bytes`` (= allocated + cached), ``peak_allocated_bytes`` and
        ``num_cache_hits``; ``num_host_alloc``/``num_host_free`` (driver calls) are
        :func:`host_memory_stats`'s, which :func:`reset_accumulated_host_memory_stats` resets.
    """
    out = _allocator.stats()
    out.update(flatten(_allocator.host_stats()))  # num_host_alloc/free: torch's (resettable)
    return out


def host_memory_stats_as_nested_dict() -> dict[str, object]:
    """torch's ``host_memory_stats_as_nested_dict()``: the pinned allocator's statistics.

    Returns
    -------
    dict
        ``{"num_host_alloc": int, "num_host_free": int, "allocation": {...},
        "segment": {...}, "allocated_bytes": {...}, "reserved_bytes": {...},
        "host_alloc_time": {...}, "host_free_time": {...}}`` (see
        :func:`host_memory_stats`); ``{}`` when CUDA is not initialised, as torch.
    """
    if not _devices.is_initialized():
        return {}
    return _allocator.host_stats()


def host_memory_stats() -> dict[str, int]:
    """torch's ``host_memory_stats()``: the pinned (host) allocator's statistics, flat.

    Keys (torch 2.11's): ``allocation.{current,peak,allocated,freed}`` (blocks handed out;
    a block counts until the last array over it goes), ``allocated_bytes.{...}`` (their
    rounded bytes), ``segment.{...}`` (blocks obtained from the driver, in use or cached),
    ``reserved_bytes.{...}`` (their bytes), ``num_host_alloc`` / ``num_host_free`` (driver
    allocations / frees), ``host_alloc_time.{total,max,min,count,avg}`` and
    ``host_free_time.{...}`` (microseconds in those driver calls). Peaks are exact (torch
    sums per-size-bucket peaks, an upper bound).

    Returns
    -------
    dict of str to int
        The statistics, keys sorted; ``{}`` when CUDA is not initialised, as torch.
    """
    return flatten(host_memory_stats_as_nested_dict())


def reset_peak_host_memory_stats() -> None:
    """torch's ``reset_peak_host_memory_stats()``: every ``peak`` of
    :func:`host_memory_stats` becomes the current value; ``host_alloc_time`` and
    ``host_free_time`` forget their ``min`` and ``max``."""
    _allocator.reset_host_stats(peak=True)


def reset_accumulated_host_memory_stats() -> None:
    """torch's ``reset_accumulated_host_memory_stats()``: the ``allocated`` and ``freed``
    counters of :func:`host_memory_stats` (hence ``num_host_alloc``/``num_host_free``) and
    the durations' ``total``/``count`` back to 0."""
    _allocator.reset_host_stats(peak=False)


def empty_pinned_cache() -> None:
    """Return cached pinned blocks to the driver (blocks a pending copy uses stay cached)."""
    _allocator.empty_cache()
