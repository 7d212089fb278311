"""``backend:cudaMallocAsync``: a stream-ordered pool allocator behind cudalab's memory API.

torch's ``CUDAMallocAsyncAllocator`` over cudalab's driver seam. Each device gets one private
memory pool (``pool_create``: unlimited release threshold, so freed memory stays cached in the
pool until :meth:`AsyncPoolAllocator.empty_cache`); the driver does all the caching, splitting
and stream-ordered reuse:

* ``malloc(size, stream)`` is ``pool_alloc_async(pool, size, stream)`` on the given (default:
  current) stream, no rounding; ``free`` is ``mem_free_async`` on the allocation stream. The
  hot path makes no other driver call and takes the lock once.
* ``record_stream``: a block used on other streams is freed on a private "unifying" stream
  that first waits (``stream_wait_event``) on events recorded on the allocation stream and
  on every usage stream, so the pool can only hand the memory out again once all that work
  has finished. Nothing waits on the host.
* statistics, like torch: of the 122 ``memory_stats()`` keys only ``allocated_bytes.all``,
  ``active_bytes.all`` and ``reserved_bytes.all`` move; ``max_split_size`` is 0.
  ``allocated_bytes.all`` is this allocator's own count of the bytes handed out and not yet
  freed (requested sizes: torch's ``pytorch_used_bytes``), with its peak and cumulative
  allocated/freed; ``active_bytes.all`` is the pool's used memory and ``reserved_bytes.all``
  the pool's reserved memory (current and high-water mark, read from the pool).
  ``memory_allocated()`` is a counter read (no driver call); ``memory_reserved()`` asks the
  pool.
* ``set_per_process_memory_fraction`` is enforced on the allocated-bytes counter (torch's
  rule), the out-of-memory text is torch's for this backend ("Allocation on device N would
  exceed allowed memory. (out of memory)" ...).
* ``empty_cache`` = synchronise the device, then ``pool_trim(pool, 0)``.
* snapshots (``segments()`` / ``memory_snapshot()``) and the history recorder are not
  supported and raise RuntimeError, as torch's backend does.

Deviations from torch: a private pool instead of the device's default pool (other libraries
using the default pool do not show up in these numbers); ``allocated_bytes.all`` is this
allocator's own counter (torch reports the pool's used memory there, i.e. the same value as
``active_bytes.all``) and its ``allocated``/``freed`` are filled in (torch reports 0);
``reset_accumulated_memory_stats`` resets them (torch: no effect).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from cudalab import streams as _streams
from cudalab._driver.base import EVENT_DISABLE_TIMING, STREAM_NON_BLOCKING, ClosedHandle
from cudalab.allocator.base import Allocator, bad_pointer, fraction_total, stream_key
from cudalab.allocator.blocks import SegmentDict, StreamUses
from cudalab.allocator.config import UNLIMITED, AllocatorConfig, config_from_env
from cudalab.allocator.policy import MAX_ALLOCATION_SIZE, check_size
from cudalab.allocator.stats import STAT_KEYS, Counters, format_size
from cudalab.errors import CudaError, OutOfMemoryError

__all__ = ["AsyncPoolAllocator", "AsyncPoolStats", "HISTORY_UNSUPPORTED", "SNAPSHOT_UNSUPPORTED"]

#: The RuntimeError text for snapshots under this backend.
SNAPSHOT_UNSUPPORTED = (
    "memory snapshots are not supported with the cudaMallocAsync backend: it does not track "
    "individual blocks (torch: \"Calling snapshot with backend:cudaMallocAsync is not "
    "meaningful\"); use backend:native for memory_snapshot() and history recording"
)
#: The error message of history recording under this backend; also raised by
#: :mod:`cudalab.memory_tools.history` when recording starts before any allocator exists,
#: so the two cannot drift.
HISTORY_UNSUPPORTED = (
    "recording the allocation history is not supported with the cudaMallocAsync backend "
    "(torch: \"cudaMallocAsync does not yet support recordHistory\"); use backend:native"
)

# The template of torch's stats dict under this backend: every key 0, max_split_size 0
# (torch's DeviceStats default), in sorted order.
_TEMPLATE = dict.fromkeys(STAT_KEYS, 0)
_STREAM_CACHE_MAX = 256


class _Bytes:
    """The allocator's counters, standing in for both ``DeviceStats.large`` and
    ``DeviceStats.agg`` so that the public getters (which read ``stats.large.b_alloc``,
    ``stats.agg.b_alloc_peak``, ``stats.large.b_res``, ``stats.agg.b_res_peak``) work
    unchanged: allocated bytes are plain fields, reserved bytes are read from the pool."""

    __slots__ = ("b_alloc", "b_alloc_peak", "b_alloc_acc", "b_alloc_base", "_usage")

    def __init__(self, usage: Callable[[], tuple[int, int, int, int]]):
        self.b_alloc = 0
        self.b_alloc_peak = 0
        self.b_alloc_acc = 0
        self.b_alloc_base = 0
        self._usage = usage

    @property
    def b_res(self) -> int:
        return self._usage()[0]

    @property
    def b_res_peak(self) -> int:
        return self._usage()[1]


class AsyncPoolStats:
    """Statistics of an :class:`AsyncPoolAllocator` (duck-types
    :class:`~cudalab.allocator.stats.DeviceStats` for the public getters)."""

    __slots__ = ("small", "large", "agg", "_owner")

    def __init__(self, owner: AsyncPoolAllocator):
        self.small = Counters()  # always zero: this backend has no small/large pools
        self.large = self.agg = _Bytes(owner._usage)
        self._owner = owner

    def current(self, code: str) -> int:
        if code == "b_alloc":
            return self.large.b_alloc
        if code == "b_res":
            return self.large.b_res
        return 0

    def as_dict(self) -> dict[str, int]:
        return self._owner.memory_stats()

    def reset_peak(self) -> None:
        self._owner.reset_peak_stats()

    def reset_accumulated(self) -> None:
        self._owner.reset_accumulated_stats()


def _oom_text(device: int, used: int, size: int, total: int, free: int, limit: int) -> str:
    """torch's out-of-memory message of the cudaMallocAsync backend (cudalab's name)."""
    return (
        f"Allocation on device {device} would exceed allowed memory. (out of memory)"
        f"\nCurrently allocated     : {format_size(used)}"
        f"\nRequested               : {format_size(size)}"
        f"\nDevice limit            : {format_size(total)}"
        f"\nFree (according to CUDA): {format_size(free)}"
        "\ncudalab limit (set by user-supplied memory fraction)"
        f"\n                        : {format_size(limit)}"
    )


class AsyncPoolAllocator(Allocator):
    """One device's ``backend:cudaMallocAsync`` allocator over a private stream-ordered pool.

    Args:
        backend: the driver seam (needs ``pool_*``, ``mem_free_async`` and events).
        device: the device ordinal.
        config: the settings (default: from the environment). Only
            ``per_process_memory_fraction`` applies; native-only options are ignored (the
            settings parser warns about them once).
        stream_resolver: maps ``stream=None`` to an int stream handle (default: the current
            stream of ``device``; tests over a private backend pass ``lambda: 0``).
    """

    name = "cudaMallocAsync"

    def __init__(self, backend: Any, device: int = 0, config: AllocatorConfig | None = None,
                 stream_resolver: Callable[[], int] | None = None):
        if config is None:
            config = config_from_env()
        self.backend = backend
        self.device = device
        self.config = config
        self._resolver = stream_resolver
        self._lock = threading.Lock()
        self.live: dict[int, tuple[int, Any, int]] = {}  # ptr -> (size, stream handle, key)
        self._uses: dict[int, StreamUses] = {}  # ptr -> streams from record_stream
        self.pending_frees: deque[int] = deque()  # sizes of frees done while the lock was busy
        self._handles: dict[int, Any] = {}  # int stream handle -> driver stream handle
        self._unifier: Any = None
        self._limit = UNLIMITED
        self._limited = False
        self._fraction = 1.0
        self._pool = backend.pool_create(device)
        self._pool_alloc = backend.pool_alloc_async
        self._free_async = backend.mem_free_async
        # duck-types DeviceStats for the public getters (see AsyncPoolStats)
        self.stats = AsyncPoolStats(self)  # type: ignore[assignment]
        self._c = self.stats.large
        if config.per_process_memory_fraction is not None:
            self.set_memory_fraction(config.per_process_memory_fraction)

    def __repr__(self) -> str:
        return (f"<AsyncPoolAllocator device={self.device} live={len(self.live)} "
                f"allocated={self._c.b_alloc}>")

    # ------------------------------------------------------------------ hot path
    def malloc(self, size: Any, stream: Any = None) -> int:
        """``size`` bytes from the pool, ordered on ``stream`` (default: the current stream)."""
        if type(size) is not int or size <= 0 or size >= MAX_ALLOCATION_SIZE:
            size = check_size(size)
            if size == 0:
                return 0
        if stream is None:
            if self._resolver is None:
                s = _streams.current_stream(self.device)
                h = s.handle
                key = s.cuda_stream
            else:
                key = self._resolver()
                h = self._handles.get(key)
                if h is None:
                    h = self._handle_for(key)
        elif type(stream) is int:
            key = stream
            h = self._handles.get(key)
            if h is None:
                h = self._handle_for(key)
        else:
            h, key = self._resolve(stream)
        if key < 3:  # null / legacy / per-thread stream: the driver uses the current context
            self.backend.set_context(self.device)
        c = self._c
        if self._limited:
            return self._malloc_limited(size, h, key)
        try:
            ptr = self._pool_alloc(self._pool, size, h)
        except OutOfMemoryError:
            raise self._oom(size) from None
        with self._lock:
            # allocated_bytes current/peak/allocated and the peak_scope watermark, written
            # out (a DeviceStats.increase on these _Bytes counters) for the cache-hit pair
            # rows of benchmarks/allocator.py under backend:cudaMallocAsync
            v = c.b_alloc = c.b_alloc + size
            if v > self._mark:
                self._mark = v
            if v > c.b_alloc_peak:
                c.b_alloc_peak = v
            c.b_alloc_acc += size
        if self._uses:
            self._uses.pop(ptr, None)
        self.live[ptr] = (size, h, key)
        return ptr

    def free(self, ptr: int) -> None:
        """Stream-ordered free on the allocation stream (or the unifying stream after
        ``record_stream``). ValueError for a pointer that is not live here; nothing changes."""
        rec = self.live.pop(ptr, None)
        if rec is None:
            if ptr == 0 and type(ptr) is int:
                return
            raise bad_pointer(ptr)
        size, h, key = rec
        uses = self._uses.pop(ptr, None) if self._uses else None
        try:
            if uses:
                self._free_unified(ptr, h, key, uses)
            else:
                if key < 3:
                    self.backend.set_context(self.device)
                self._free_async(self.device, ptr, h)
        except BaseException:
            self.live[ptr] = rec  # lose nothing: the pointer is still live and owned
            if uses:
                self._uses[ptr] = uses
            raise
        lock = self._lock
        if not lock.acquire(False):
            # Busy: another thread, or a finalizer inside this thread's own allocator call.
            self.pending_frees.append(size)
            if lock.acquire(False):
                try:
                    self._drain()
                finally:
                    lock.release()
            return
        try:
            self._c.b_alloc -= size
            if self.pending_frees:
                self._drain()
        finally:
            lock.release()

    # ------------------------------------------------------------------ Allocator API
    def owns(self, ptr: int) -> bool:
        return ptr in self.live

    def block_size(self, ptr: int) -> int:
        """The size of the live allocation at ``ptr`` (as requested: no rounding)."""
        rec = self.live.get(ptr)
        if rec is None:
            raise bad_pointer(ptr)
        return rec[0]

    def record_stream(self, ptr: int, stream: Any) -> None:
        """``ptr`` is used on ``stream`` (a cudalab Stream): its free then waits for the work
        queued on ``stream`` up to the free (use on the allocation stream is ignored)."""
        self._record_use(ptr, stream, 2)

    def empty_cache(self) -> None:
        """torch: synchronise the device, then trim the pool to 0 bytes of cached memory."""
        self.sync_pending()
        self.backend.synchronize(self.device)
        self.backend.pool_trim(self._pool, 0)

    def set_memory_fraction(self, fraction: float) -> None:
        total = fraction_total(self.backend, self.device, fraction)
        with self._lock:
            self._fraction = float(fraction)
            self._limit = int(fraction * total)
            self._limited = True

    def segments(self) -> list[SegmentDict]:
        raise RuntimeError(SNAPSHOT_UNSUPPORTED)

    def sync_pending(self) -> None:
        if self.pending_frees:
            with self._lock:
                self._drain()

    def memory_stats(self) -> dict[str, int]:
        """torch's 122 keys; only ``allocated_bytes.all``, ``active_bytes.all`` (pool used)
        and ``reserved_bytes.all`` (pool reserved) are non-zero."""
        reserved, reserved_high, used, used_high = self._usage()
        c = self._c
        with self._lock:
            if self.pending_frees:
                self._drain()
            cur, peak, acc, base = c.b_alloc, c.b_alloc_peak, c.b_alloc_acc, c.b_alloc_base
        d = _TEMPLATE.copy()
        d["allocated_bytes.all.current"] = cur
        d["allocated_bytes.all.peak"] = peak
        d["allocated_bytes.all.allocated"] = acc
        d["allocated_bytes.all.freed"] = acc - cur + base
        d["active_bytes.all.current"] = used
        d["active_bytes.all.peak"] = used_high
        d["reserved_bytes.all.current"] = reserved
        d["reserved_bytes.all.peak"] = reserved_high
        return d

    def reset_peak_stats(self) -> None:
        """Peaks become current values: the pool's high-water marks and the allocated peak."""
        self.sync_pending()
        self.backend.pool_reset_high(self._pool)
        with self._lock:
            self._fold_mark()
            self._c.b_alloc_peak = self._c.b_alloc

    def reset_accumulated_stats(self) -> None:
        """``allocated_bytes.all.allocated``/``freed`` back to 0 (torch: no effect)."""
        with self._lock:
            if self.pending_frees:
                self._drain()
            c = self._c
            c.b_alloc_acc = 0
            c.b_alloc_base = c.b_alloc

    @property
    def _trace(self) -> None:
        """The history recorder's hook: always None here (recording is unsupported)."""
        return None

    @_trace.setter
    def _trace(self, value: Any) -> None:
        if value is not None:
            raise RuntimeError(HISTORY_UNSUPPORTED)

    def pool_usage(self) -> tuple[int, int, int, int]:
        """(reserved, reserved high, used, used high) bytes of this allocator's pool."""
        return self._usage()

    def close(self) -> None:
        """Trim and destroy the pool and the unifying stream (for tests and shutdown).

        Allocations still live stay valid until freed (``pool_destroy`` semantics) but this
        allocator can no longer serve new ones."""
        b = self.backend
        b.synchronize(self.device)
        b.pool_trim(self._pool, 0)
        b.pool_destroy(self._pool)
        if self._unifier is not None:
            b.stream_destroy(self._unifier)
            self._unifier = None

    # ------------------------------------------------------------------ internals
    def _usage(self) -> tuple[int, int, int, int]:
        return self.backend.pool_usage(self._pool)

    def _drain(self) -> None:
        dq = self.pending_frees
        c = self._c
        while dq:
            c.b_alloc -= dq.popleft()

    def _handle_for(self, key: int) -> Any:
        """The driver handle of int stream handle ``key`` (cached; 2, the per-thread default
        stream, differs per thread and is never cached)."""
        h = self._handles.get(key)
        if h is None:
            h = self.backend.stream_from_int(self.device, key)
            if key != 2:
                if len(self._handles) >= _STREAM_CACHE_MAX:
                    self._handles.clear()
                self._handles[key] = h
        return h

    def _resolve(self, stream: Any) -> tuple[Any, int]:
        if isinstance(stream, _streams.Stream):
            if stream.device_index != self.device:
                raise ValueError(
                    f"stream {stream!r} belongs to device {stream.device_index}, "
                    f"not to device {self.device}")
            # A closed stream's handle is a ClosedHandle, which the seam's allocation call
            # refuses with the error naming the stream (no check here).
            return stream.handle, stream.cuda_stream
        key = stream_key(stream, self.device)
        return self._handle_for(key), key

    def _malloc_limited(self, size: int, h: Any, key: int) -> int:
        """malloc with a memory fraction set: the bytes are reserved in the counter before
        the driver call (so concurrent callers cannot overshoot the limit together)."""
        c = self._c
        with self._lock:
            if self.pending_frees:
                self._drain()
            over = c.b_alloc + size > self._limit
            if not over:
                c.b_alloc += size
        if over:
            raise self._oom(size)
        try:
            ptr = self._pool_alloc(self._pool, size, h)
        except BaseException as exc:
            with self._lock:
                c.b_alloc -= size
            if isinstance(exc, OutOfMemoryError):
                raise self._oom(size) from None
            raise
        with self._lock:
            if c.b_alloc > self._mark:
                self._mark = c.b_alloc
            if c.b_alloc > c.b_alloc_peak:
                c.b_alloc_peak = c.b_alloc
            c.b_alloc_acc += size
        if self._uses:
            self._uses.pop(ptr, None)
        self.live[ptr] = (size, h, key)
        return ptr

    def _oom(self, size: int) -> OutOfMemoryError:
        free, total = self.backend.mem_get_info(self.device)
        self.sync_pending()
        return OutOfMemoryError(text=_oom_text(self.device, self._c.b_alloc, size, total, free,
                                               self._limit))

    def _unifying_stream(self) -> Any:
        u = self._unifier
        if u is None:
            with self._lock:
                u = self._unifier
            if u is None:
                u = self.backend.stream_create(self.device, STREAM_NON_BLOCKING)
                with self._lock:
                    if self._unifier is None:
                        self._unifier = u
                        u = None
                if u is not None:  # another thread made one first
                    self.backend.stream_destroy(u)
                u = self._unifier
        return u

    def _free_unified(self, ptr: int, h: Any, key: int, uses: StreamUses) -> None:
        """torch's unifying-stream free: the side stream waits on events recorded on the
        allocation stream and on every usage stream, then frees ``ptr`` in its order."""
        b = self.backend
        dev = self.device
        u = self._unifying_stream()
        self._join(u, dev, h, key)
        for s in uses:
            self._join(u, s.device_index, s.handle, s.cuda_stream)
        b.set_context(dev)
        self._free_async(dev, ptr, u)

    def _join(self, unifier: Any, dev: int, h: Any, key: int) -> None:
        """Make ``unifier`` wait for the work queued so far on stream ``h`` of ``dev``."""
        b = self.backend
        if type(h) is ClosedHandle:  # a closed stream: wait for its device instead
            b.synchronize(dev)
            return
        if key < 3:
            b.set_context(dev)
        ev = b.event_create(dev, EVENT_DISABLE_TIMING)
        try:
            try:
                b.event_record(ev, h)
            except CudaError:  # the stream is unusable (destroyed): wait for the device
                b.synchronize(dev)
                return
            b.stream_wait_event(unifier, ev)
        finally:
            b.event_destroy(ev)
