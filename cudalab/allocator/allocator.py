"""The device caching allocator: torch's ``CUDACachingAllocator`` (backend "native") in Python.

One :class:`DeviceCachingAllocator` per device sits on the driver seam (``mem_alloc`` /
``mem_free`` / events of a :class:`~cudalab._driver.base.Backend`) and reproduces torch's
policy exactly, so sizes, segments, statistics, snapshots and OOM messages match torch's for
the same sequence of calls:

* requests are rounded to 512 B (or to ``roundup_power2_divisions`` steps); rounded sizes up
  to 1 MiB use the small pool, whose segments are 2 MiB; larger ones the large pool, whose
  segments are 20 MiB below 10 MiB and the request rounded to 2 MiB above;
* best fit by (stream, size, address) within a pool; blocks are only reused on the stream
  they were allocated for; oversize rules with ``max_split_size`` /
  ``max_non_split_rounding``; torch's split rule; freed blocks merge with free neighbours;
* ``record_stream``: a block used on other streams is kept (active, "pending free") until
  one pooled event per such stream, recorded when it is freed, has completed;
* the slow path runs torch's ladder: free-memory callbacks, garbage collection (with a
  memory fraction), device allocation, release of cached oversize blocks, synchronisation
  of all pending events and release of every unsplit cached block, retry, and finally
  :class:`cudalab.OutOfMemoryError` with torch's message.

Data structures. Free blocks of one pool and one stream live in a :class:`_FreeList`: a
sorted list of packed keys ``size << 64 | address`` (one ``bisect`` gives the best fit) and
a dict from key to block. Removal only marks the dict entry stale (``None``), so a block
that is split and merged again over and over (the common alloc/free pair) re-uses its list
entries and the list is only touched when a new (size, address) appears; stale keys are
skipped by the search and swept out when the list has grown to twice its live size.

Locking. One lock per device (a :class:`~cudalab.allocator.token_lock.TokenLock`: a
``threading.Lock`` whose uncontended acquire and release are one ``list.pop`` and one
``list.append``, inlined on the hot paths), held briefly and never across a blocking driver
call: it is dropped around ``mem_alloc``, ``mem_free`` and event synchronisation (blocks in
flight are detached from every pool first, so nothing another thread can see changes).
``free`` never waits: if the lock is busy (another thread, or a finalizer running inside
this thread's own allocator call) the block goes to a pending list that the next
allocator call on that device merges in (CuPy's scheme), so frees from finalizers cannot
deadlock. The free of a pair-memo hit takes no lock at all (see ``free``).

Hot path. A cache hit makes no driver call, builds no dict and logs nothing; the one hook
for the history recorder (``self._trace``) is tested once per operation and costs nothing
when it is None. The commonest hit, a temporary buffer allocated and freed again with the
same request on the same stream, is the memo's *pure hit*: malloc checks the request, the
Stream object and the ready box, and free hands the block back to the box.
"""

from __future__ import annotations

import abc
import threading
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable
from operator import index as _index
from typing import Any

from cudalab import streams as _streams
from cudalab.errors import CudaError, OutOfMemoryError
from cudalab.allocator.config import (
    MIN_BLOCK_SIZE,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    UNLIMITED,
    AllocatorConfig,
    config_from_env,
    no_caching_from_env,
)
from cudalab.allocator.events import EventPool
from cudalab.allocator.stats import Counters, DeviceStats, format_size
from cudalab.allocator.token_lock import TokenLock

_Stream = _streams.Stream
_NO_STREAM = object()  # never a malloc's stream argument
_tls = _streams._tls  # per thread: .device and .streams (the current stream of each device)
_custom = _streams._custom  # empty: stream=None is the default stream in every thread

__all__ = [
    "Allocator",
    "DeviceCachingAllocator",
    "UncachedAllocator",
    "create_allocator",
    "round_size",
    "roundup_power2_next_division",
    "get_allocator",
    "existing_allocator",
    "find_owner",
    "allocator_config",
]

_SHIFT = 64  # packed free-list key: size << 64 | address
_LIST_MIN = 64  # a free list is swept when it holds this many keys and twice its live blocks

# Block states.
_FREE = 0  # cached, in its pool's free list
_ALLOCATED = 1  # handed out
_PENDING = 2  # freed, waiting for record_stream events
_DETACHED = 3  # out of every structure (segment being released, or a fresh segment)
_UNMAPPED = 4  # expandable segments: reserved address space with no memory mapped behind it
_DEFERRED = 5  # freed into the pair memo: logically free and merged, physically still split

_OOM_HINT = (
    " If reserved but unallocated memory is large try setting"
    " CUDALAB_ALLOC_CONF=expandable_segments:True (PYTORCH_CUDA_ALLOC_CONF is also read) to avoid"
    " fragmentation.  See documentation for Memory Management "
    " (https://docs.pytorch.org/docs/stable/notes/cuda.html"
    "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
)


# --------------------------------------------------------------------------- size policy
def roundup_power2_next_division(size: int, divisions: int) -> int:
    """torch's ``roundup_power2_next_division``: 1200 with 4 divisions -> 1280."""
    if size & (size - 1) == 0:
        return size
    if divisions < 2:
        raise ValueError("Only 2 or more divisions are supported")
    power2_floor = 1 << (size.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)
    if step == 0:
        return power2_floor << 1
    floor = size & ~(step - 1)
    return size if floor == size else floor + step


def round_size(size: int, config: AllocatorConfig | None = None) -> int:
    """torch's ``round_size``: the block size a request of ``size`` bytes gets."""
    if size < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    if config is not None:
        divisions = config.divisions_for(size)
        if divisions > 1 and size > MIN_BLOCK_SIZE * divisions:
            return roundup_power2_next_division(size, divisions)
    return (size + MIN_BLOCK_SIZE - 1) & -MIN_BLOCK_SIZE


def allocation_size(rounded: int, large_segment_size: int = 20 * 1024 * 1024) -> int:
    """torch's ``get_allocation_size``: the segment size a rounded request creates."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return large_segment_size
    return (rounded + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE


def _check_size(size: Any) -> int:
    if type(size) is not int:
        if isinstance(size, bool):
            raise TypeError(f"allocation size must be an int, got {size!r}")
        try:
            size = _index(size)
        except TypeError:
            raise TypeError(
                f"allocation size must be an int, got {type(size).__name__} {size!r}"
            ) from None
    if size < 0:
        raise ValueError(f"allocation size must be >= 0, got {size}")
    if size >= 1 << 60:
        raise OutOfMemoryError(text="CUDA out of memory. Tried to allocate more than 1EB memory.")
    return size


def _bad_pointer(ptr: Any) -> Exception:
    if isinstance(ptr, int) and not isinstance(ptr, bool):
        return ValueError(
            f"pointer {ptr:#x} was not allocated by cudalab's caching allocator "
            "(double free or foreign pointer)"
        )
    return TypeError(f"expected a device pointer (int), got {type(ptr).__name__} {ptr!r}")


# --------------------------------------------------------------------------- blocks
class Block:
    """A contiguous range of one segment: cached (free), handed out, or awaiting events."""

    __slots__ = ("ptr", "size", "requested", "fl", "state", "prev", "next", "event_count",
                 "uses", "gc_base", "tfree")

    def __init__(self, ptr: int, size: int, fl: _FreeList):
        self.ptr = ptr
        self.size = size
        self.requested = 0
        self.fl = fl
        self.state = _DETACHED
        self.prev: Block | None = None
        self.next: Block | None = None
        self.event_count = 0
        self.uses: set | None = None  # streams (other than the allocation stream) it was used on
        self.gc_base = 0
        self.tfree = 0  # stamp of its deferred memo free, for the history (0: none)

    def __repr__(self) -> str:
        state = ("free", "allocated", "pending_free", "detached", "unmapped",
                 "deferred_free")[self.state]
        return f"<Block {self.ptr:#x} size={self.size} {state}>"


class _FreeList:
    """The free blocks of one pool on one stream, ordered by (size, address)."""

    __slots__ = ("keys", "entries", "limit", "stream", "pool")

    def __init__(self, pool: BlockPool, stream: int):
        self.keys: list[int] = []  # sorted packed keys, some possibly stale
        self.entries: dict[int, Block | None] = {}  # key -> block (None: stale key)
        self.limit = _LIST_MIN
        self.stream = stream
        self.pool = pool

    def add(self, key: int, b: Block) -> None:
        """Insert a key the list does not hold yet (callers first try ``entries[key] = b``
        when the key is already there, stale)."""
        insort(self.keys, key)
        self.entries[key] = b
        if len(self.keys) >= self.limit:
            self.sweep()

    def sweep(self) -> None:
        """Drop stale keys (done when the list reaches twice its live size)."""
        live = {k: b for k, b in self.entries.items() if b is not None}
        self.keys = sorted(live)
        self.entries = live
        self.limit = max(_LIST_MIN, 2 * len(live))

    def blocks(self) -> list[Block]:
        """Live blocks in (size, address) order."""
        entries = self.entries
        return [b for b in (entries[k] for k in self.keys) if b is not None]


class BlockPool(Counters):
    """torch's BlockPool: the small or the large pool of one device, one free list per stream.

    The pool is also its own statistics counters (:class:`~cudalab.allocator.stats.Counters`),
    which saves the hot path an attribute lookup per update.
    """

    __slots__ = ("is_small", "lists", "gc_calls", "name")

    def __init__(self, is_small: bool):
        super().__init__()
        self.is_small = is_small
        self.lists: dict[int, _FreeList] = {}
        #: get_free_block calls (counted only while garbage collection is on), for ages.
        self.gc_calls = 0
        self.name = "small" if is_small else "large"

    def free_list(self, stream: int) -> _FreeList:
        fl = self.lists.get(stream)
        if fl is None:
            fl = self.lists[stream] = _FreeList(self, stream)
        return fl

    def free_blocks(self) -> list[Block]:
        """All cached blocks in torch's set order (stream, size, address)."""
        out: list[Block] = []
        for stream in sorted(self.lists):
            out.extend(self.lists[stream].blocks())
        return out


# --------------------------------------------------------------------------- interface
class Allocator(abc.ABC):
    """One device's allocator behind cudalab's memory API (RMM-style composition).

    Implementations: :class:`DeviceCachingAllocator` (backend "native"),
    :class:`UncachedAllocator` (``CUDALAB_NO_MEMORY_CACHING``); expandable segments,
    cudaMallocAsync and pluggable allocators slot in as further implementations. Every one
    keeps :attr:`stats` (a :class:`~cudalab.allocator.stats.DeviceStats`) current, because the
    public getters read its counters directly.
    """

    #: torch's backend name, as ``get_allocator_backend()`` reports it.
    name = "native"
    device: int
    stats: DeviceStats
    #: Live allocations keyed by pointer (the registry finds a pointer's owner here).
    _live: dict
    #: Frees deferred while the lock was busy (the getters check it before reading).
    _pending_frees: Any = ()
    #: The native allocator's pair memo (see DeviceCachingAllocator); the getters call
    #: sync_pending() first while it is set, so they never see deferred counters.
    _memo: Any = None
    #: Watermark of allocated bytes for :func:`cudalab.memory.peak_scope` (never above the
    #: peak; a scope opening hands it to the open scopes, then lowers it to the current value).
    _mark: int = 0
    _scopes: tuple = ()  # open PeakScopes (a list once one is opened)

    @abc.abstractmethod
    def malloc(self, size: int, stream: Any = None) -> int:
        """Device memory of at least ``size`` bytes for use on ``stream`` (0 for size 0)."""

    @abc.abstractmethod
    def free(self, ptr: int) -> None:
        """Give back memory from :meth:`malloc`; ValueError for anything else."""

    @abc.abstractmethod
    def owns(self, ptr: int) -> bool:
        """Whether ``ptr`` is a live allocation of this allocator."""

    @abc.abstractmethod
    def record_stream(self, ptr: int, stream: Any) -> None:
        """Note that ``ptr`` is used on ``stream`` (its reuse then waits for that work)."""

    @abc.abstractmethod
    def empty_cache(self) -> None:
        """Return every cached block that can be returned to the driver."""

    @abc.abstractmethod
    def set_memory_fraction(self, fraction: float) -> None:
        """Cap reserved memory at ``fraction`` of the device's total memory."""

    @abc.abstractmethod
    def get_memory_fraction(self) -> float:
        """The cap set by :meth:`set_memory_fraction` (1.0 when none)."""

    @abc.abstractmethod
    def segments(self) -> list[dict]:
        """torch's ``memory_snapshot()`` segment dicts for this device, sorted by address."""

    def sync_pending(self) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Apply frees deferred because the lock was busy (before reading statistics)."""

    def memory_stats(self) -> dict:
        """torch's 122-key ``memory_stats()`` dict."""
        self.sync_pending()
        return self.stats.as_dict()

    def reset_peak_stats(self) -> None:
        self.sync_pending()
        self._fold_mark()
        self.stats.reset_peak()

    def _fold_mark(self) -> None:
        """Open peak scopes keep what the watermark saw, and the watermark drops to the
        current value: before peaks are reset (it must never exceed the peak) and when a
        scope opens (its peak starts from now)."""
        for scope in self._scopes:
            if self._mark > scope._seen:
                scope._seen = self._mark
        st = self.stats
        self._mark = st.small.b_alloc + st.large.b_alloc

    def reset_accumulated_stats(self) -> None:
        self.sync_pending()
        self.stats.reset_accumulated()

    def _record_use(self, ptr: int, stream: Any, stream_field: int) -> None:
        """``record_stream`` for allocators that keep ``_live[ptr]`` as a tuple (the
        allocation stream key at ``stream_field``) and the streams a pointer was used on in
        ``_uses[ptr]``; use on the allocation stream is ignored."""
        dev, key = _stream_use(stream, need_handle=True)
        rec = self._live.get(ptr)
        if rec is None:
            raise _bad_pointer(ptr)
        if dev == self.device and key == rec[stream_field]:
            return
        with self._lock:
            uses = self._uses.get(ptr)
            if uses is None:
                uses = self._uses[ptr] = set()
            uses.add(stream)


def _stream_use(stream: Any, need_handle: bool = False) -> tuple[int, int]:
    """(device index, stream key) of a stream passed to ``record_stream`` (TypeError if it is
    not a cudalab Stream; ``need_handle`` also requires the driver handle events need)."""
    dev = getattr(stream, "device_index", None)
    key = getattr(stream, "cuda_stream", None)
    if (not isinstance(key, int) or not isinstance(dev, int)
            or (need_handle and not hasattr(stream, "_handle"))):
        raise TypeError(f"record_stream needs a cudalab.Stream, got {type(stream).__name__}")
    return dev, key


def _fraction_total(backend: Any, device: int, fraction: float) -> int:
    """Check a per-process memory fraction (torch's rule and message); the device's total."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    return backend.mem_get_info(device)[1]


def _stream_key(stream: Any, device: int) -> int:
    """The allocation-stream key: the stream's handle value (0 = the legacy default stream)."""
    if type(stream) is int:
        return stream
    key = getattr(stream, "cuda_stream", None)
    if not isinstance(key, int):
        if isinstance(stream, int) and not isinstance(stream, bool):
            return int(stream)
        raise TypeError(
            "stream must be a cudalab.Stream or an int stream handle, got "
            f"{type(stream).__name__} {stream!r}"
        )
    dev = getattr(stream, "device_index", device)
    if dev != device:
        raise ValueError(f"stream {stream!r} belongs to device {dev}, not to device {device}")
    return key


def _current_stream_key(device: int) -> int:
    return _streams.current_stream(device).cuda_stream


# --------------------------------------------------------------------------- native allocator
class DeviceCachingAllocator(Allocator):
    """torch's DeviceCachingAllocator for one device, over a driver :class:`Backend`.

    Args:
        backend: the driver seam (``cudalab.devices._backend()``, or any Backend in tests).
        device: the device ordinal.
        config: the settings (default: parsed from the environment, see
            :mod:`cudalab.allocator.config`).
        stream_resolver: maps ``stream=None`` to a stream key (default: the current stream of
            ``device``; tests over a private backend pass ``lambda: 0``).
    """

    name = "native"
    #: Flavours that override malloc turn the pair memo off.
    _memo_class_ok = True
    # What the cache hit and the memo's free read live in slots (an instance with this many
    # attributes keeps them in a dict, each access then a few ns slower); the rest (and
    # subclasses') in the instance dict.
    __slots__ = ("_take", "_give", "_hit_size", "_hit_stream", "_hit_none",
                 "_ready", "_pending_frees", "_live", "_memo_hits", "_trace", "_memo",
                 "_tls_streams", "device", "_hit_log", "_hit_ap", "_hit_now", "_hit_fnow",
                 "_memo_req0")

    def __new__(cls, backend: Any = None, device: int = 0, config: AllocatorConfig | None = None,
                stream_resolver: Callable[[], int] | None = None):
        # expandable_segments:True selects the subclass that grows segments page by page
        # (cudalab.allocator.expandable); the settings are fixed for an allocator's lifetime.
        if cls is DeviceCachingAllocator and (
                config if config is not None else config_from_env()).expandable_segments:
            from cudalab.allocator.expandable import ExpandableCachingAllocator

            cls = ExpandableCachingAllocator
        return super().__new__(cls)

    def __init__(self, backend: Any, device: int = 0, config: AllocatorConfig | None = None,
                 stream_resolver: Callable[[], int] | None = None):
        if config is None:
            config = config_from_env()
        if config.backend != "native":
            raise ValueError(
                f"DeviceCachingAllocator is the native backend, but the settings "
                f"({config.source or 'given'}) ask for backend:{config.backend}; "
                "use cudalab.allocator.allocator.create_allocator(), which picks the right class"
            )
        self.backend = backend
        self.device = device
        self.config = config
        self._default_stream = stream_resolver or (lambda: _current_stream_key(device))
        self._tls_streams = stream_resolver is None  # malloc reads the thread's stream list
        ms = config.max_split_size
        self.small = BlockPool(True)
        self.large = BlockPool(False)
        self.stats = DeviceStats(-1 if ms >= UNLIMITED else ms, self.small, self.large)
        self._agg = self.stats.agg
        # settings read on the hot path
        self._max_split = ms
        self._split_limited = ms < UNLIMITED
        self._max_non_split = config.max_non_split_rounding_size
        self._large_segment = config.large_segment_size
        self._rounding = any(d > 1 for d in config.roundup_power2_divisions)
        self._gc_threshold = config.garbage_collection_threshold
        self._gc_on = False  # set_fraction and threshold > 0
        self._set_fraction = False
        self._fraction = 1.0
        self._allowed = 0
        self._total = 0
        # state
        self._lock = lock = TokenLock()
        self._take = lock.take  # the hot paths inline acquire/release (see token_lock)
        self._give = lock.give
        self._live: dict[int, Block] = {}
        self._pending_frees: deque[Block] = deque()
        self._events: dict[Any, deque] = {}  # stream -> FIFO of (event, block, pool)
        self._n_events = 0
        self._n_pending = 0  # blocks freed but awaiting events (active, not allocated)
        self._in_sync: list[list] = []  # event lists being synchronised with the lock dropped
        self._event_pools: dict[int, EventPool] = {}
        self._spare: list[Block] = []
        self._callbacks: list[Callable[[], bool]] = []
        #: Hook for the history recorder: called as trace(action, addr, size, stream) at
        #: torch's points (alloc, free_requested, free_completed, segment_alloc,
        #: segment_free, oom; segment_map and segment_unmap with expandable segments).
        #: None (the default) costs nothing.
        self._trace: Callable[[str, int, int, int], None] | None = None
        # ---- the pair memo (see _establish_memo)
        #: Whether this allocator may defer frees at all (off for flavours with their own
        #: malloc, for max_split_size, and for tests that compare against the plain path).
        self._memo_ok = type(self)._memo_class_ok and not self._split_limited
        self._last: Block | None = None  # the block the last malloc took by a plain best fit
        self._last_stream: Any = None  # the stream argument (or current Stream) of that malloc
        self._memo: Block | None = None
        #: Holds the memo block while its free is deferred (a list: append and pop are
        #: atomic, so free can publish it without the lock; see free and _flush_memo).
        self._ready: list[Block] = []
        self._memo_stream = 0
        self._hit_size = -1  # the request of a pure memo hit (-1: none)
        #: memo pairs logged compactly for the history: (free stamp, alloc stamp) pairs, 0
        #: for none (see _establish_memo); _hit_ap is its append, _hit_now and _hit_fnow
        #: make the alloc and free stamps
        self._hit_log: deque | None = None
        self._hit_ap: Callable[[Any], None] | None = None
        self._hit_now: Callable[[], Any] | None = None
        self._hit_fnow: Callable[[], Any] | None = None
        self._hit_stream: Any = _NO_STREAM  # the Stream object of a pure hit
        self._hit_none = False  # whether stream=None may take a pure hit without the TLS
        self._memo_rem: Block | None = None  # the remainder the memo block was split from
        self._memo_lo = 0  # requests in (lo, hi] round to the memo's size
        self._memo_hi = 0
        self._memo_req0 = 0  # requested bytes the counters still hold for the memo block
        self._memo_hits = 0
        self._memo_req = 0  # sum over hits of (requested - req0), and the largest request
        self._memo_req_max = 0
        self._memo_split = (0, 0)  # inactive_split (count, bytes) accumulated per hit pair
        if config.per_process_memory_fraction is not None:
            self.set_memory_fraction(config.per_process_memory_fraction)

    # ------------------------------------------------------------------ public API
    def malloc(self, size: Any, stream: Any = None) -> int:
        """A block of at least ``size`` bytes for ``stream`` (default: the current stream)."""
        try:
            self._take()  # the allocator lock (a TokenLock), inlined
        except IndexError:
            self._lock.wait()
        try:
            # The pure memo hit (see _establish_memo): the same request on the same Stream
            # object as the pair that set up the memo, so only the hit count changes.
            if (size == self._hit_size and type(size) is int and self._ready
                    and (stream is self._hit_stream
                         or stream is None and self._hit_none and not _custom
                         or stream is None and self._tls_streams and (cur := _tls.streams) is not None
                         and cur[self.device] is self._hit_stream)
                    and not self._pending_frees):
                m = self._ready.pop()  # (its state is left as is: _flush_memo sets it)
                self._live[m.ptr] = m
                self._memo_hits += 1
                if self._trace is not None:
                    ap = self._hit_ap
                    if ap is not None:  # see _establish_memo
                        ap(m.tfree)  # its free's stamp (0: none, skipped when written)
                        ap(self._hit_now())
                    else:
                        self._trace("alloc", m.ptr, size, self._memo_stream)
                return m.ptr
            if type(size) is not int or size <= 0 or size >= 1152921504606846976:
                size = _check_size(size)
                if size == 0:
                    return 0  # torch returns a null pointer for 0 bytes
            sobj = stream
            if type(stream) is int:
                skey = stream
            elif stream is None:
                cur = _tls.streams if self._tls_streams else None
                if cur is not None and (sobj := cur[self.device]) is not None:
                    skey = sobj.cuda_stream
                else:
                    skey = self._default_stream()
            elif type(stream) is _Stream and stream.device_index == self.device:
                skey = stream.cuda_stream
            else:
                skey = _stream_key(stream, self.device)
            m = self._memo
            if m is not None:
                # The pair memo: the block the last free deferred is exactly what torch's
                # best fit would return for this request (see _establish_memo). It is in
                # the ready box while deferred; only lock holders take it out.
                ready = self._ready
                if (ready and skey == self._memo_stream and self._memo_lo < size <= self._memo_hi
                        and not self._pending_frees):
                    ready.pop()
                    m.state = 1
                    if m.tfree:  # its free, deferred without the lock, left a stamp
                        if self._hit_ap is not None:
                            self._hit_ap(m.tfree)
                            self._hit_ap(0)
                        m.tfree = 0
                    r = self._memo_rem
                    if r is not None:  # torch's split leaves the old request on the remainder
                        r.requested = m.requested
                    m.requested = size
                    self._live[m.ptr] = m
                    self._memo_hits += 1
                    if size != self._memo_req0:
                        self._memo_req += size - self._memo_req0
                        if size > self._memo_req_max:
                            self._memo_req_max = size
                        self._hit_size = -1
                    else:
                        self._hit_size = size if r is None or r.requested == size else -1
                        self._hit_stream = sobj if type(sobj) is _Stream else _NO_STREAM
                    if self._trace is not None:
                        if self._hit_log:
                            self._spill_log()
                        self._trace("alloc", m.ptr, size, skey)
                    return m.ptr
                self._flush_memo()
            self._last = None
            if self._n_events or self._pending_frees:
                self._process_pending()
            # ---- round, pick the pool, best fit (torch's round_size / get_free_block)
            if size <= 512:
                rs = 512
            elif self._rounding:
                rs = round_size(size, self.config)
            else:
                rs = (size + 511) & -512
            small = rs <= 1048576
            pool = self.small if small else self.large
            if self._gc_on:
                pool.gc_calls += 1
            b = None
            fl = pool.lists.get(skey)
            if fl is not None:
                keys = fl.keys
                i = bisect_left(keys, rs << 64)
                n = len(keys)
                if i < n:
                    entries = fl.entries
                    k = keys[i]
                    b = entries[k]
                    while b is None:  # skip stale keys
                        i += 1
                        if i == n:
                            break
                        k = keys[i]
                        b = entries[k]
                    if b is not None:
                        if self._split_limited and self._oversize_reject(rs, b.size):
                            b = None
                        else:
                            entries[k] = None
            if b is None:
                b = self._malloc_slow(rs, pool, skey)
                fast = False
            else:
                fast = True
            # ---- torch's alloc_found_block
            bsize = b.size
            remaining = bsize - rs
            prev = b.prev
            was_split = prev is not None or b.next is not None
            if (remaining >= 512) if small else (remaining > 1048576 and rs < self._max_split):
                nb = self._carve(b, rs, pool)
                ptr = nb.ptr
                if was_split:  # an inactive split block shrinks by rs
                    pool.b_split -= rs
                else:  # a new inactive split block of `remaining` bytes
                    v = pool.n_split = pool.n_split + 1
                    if v > pool.n_split_peak:
                        pool.n_split_peak = v
                    pool.n_split_acc += 1
                    v = pool.b_split = pool.b_split + remaining
                    if v > pool.b_split_peak:
                        pool.b_split_peak = v
                    pool.b_split_acc += remaining
                    agg = self._agg
                    v = self.small.n_split + self.large.n_split
                    if v > agg.n_split_peak:
                        agg.n_split_peak = v
                    v = self.small.b_split + self.large.b_split
                    if v > agg.b_split_peak:
                        agg.b_split_peak = v
                b = nb
                bsize = rs
            else:
                ptr = b.ptr
                if was_split:  # an inactive split block becomes active
                    pool.n_split -= 1
                    pool.b_split -= bsize
            if fast:
                self._last = b
                self._last_stream = sobj
            return self._account_alloc(pool, b, ptr, bsize, size, skey)
        finally:
            self._give(True)

    def _carve(self, b: Block, rs: int, pool: BlockPool) -> Block:
        """torch's split in alloc_found_block: a new block of ``rs`` bytes at ``b``'s start
        (returned), ``b`` shrinks to the remainder and goes back to its free list. Split
        statistics are the caller's (the expandable flavour keeps none)."""
        fl = b.fl
        spare = self._spare
        nb = spare.pop() if spare else Block(0, 0, fl)
        ptr = b.ptr
        prev = b.prev
        nb.ptr = ptr
        nb.size = rs
        nb.fl = fl
        nb.prev = prev
        nb.next = b
        if prev is not None:
            prev.next = nb
        b.prev = nb
        rptr = b.ptr = ptr + rs
        remaining = b.size = b.size - rs
        b.state = _FREE
        b.gc_base = pool.gc_calls
        key = (remaining << 64) | rptr
        entries = fl.entries
        if key in entries:
            entries[key] = b
        else:
            fl.add(key, b)
        return nb

    def _account_alloc(self, pool: BlockPool, b: Block, ptr: int, bsize: int, size: int,
                       skey: int) -> int:
        """Hand out block ``b`` (``bsize`` bytes at ``ptr``) for a ``size``-byte request:
        state, the live map, torch's statistics, the trace hook. Shared by every native
        allocator flavour; runs under the allocator lock."""
        b.state = 1  # _ALLOCATED
        b.requested = size
        self._live[ptr] = b
        # allocation, allocated_bytes, requested_bytes (active is derived): the pool's
        # current/peak/allocated, then the total's peak.
        v = pool.n_alloc = pool.n_alloc + 1
        if v > pool.n_alloc_peak:
            pool.n_alloc_peak = v
        pool.n_alloc_acc += 1
        v = pool.b_alloc = pool.b_alloc + bsize
        if v > pool.b_alloc_peak:
            pool.b_alloc_peak = v
        pool.b_alloc_acc += bsize
        v = pool.b_req = pool.b_req + size
        if v > pool.b_req_peak:
            pool.b_req_peak = v
        pool.b_req_acc += size
        s = self.small
        lg = self.large
        agg = self._agg
        v = s.n_alloc + lg.n_alloc
        if v > agg.n_alloc_peak:
            agg.n_alloc_peak = v
        v = s.b_alloc + lg.b_alloc
        if v > self._mark:  # the peak_scope watermark (<= the peak: one compare when lower)
            self._mark = v
            if v > agg.b_alloc_peak:
                agg.b_alloc_peak = v
        v = s.b_req + lg.b_req
        if v > agg.b_req_peak:
            agg.b_req_peak = v
        if self._n_pending:
            self.stats.note_active_peaks()
        if bsize >= self._max_split:
            self._oversize_alloc(1)
        if self._trace is not None:
            self._trace("alloc", ptr, size, skey)
        return ptr

    def free(self, ptr: int) -> None:
        """Give a pointer from :meth:`malloc` back to the cache (ValueError if it is not one)."""
        b = self._live.pop(ptr, None)
        if b is None:
            if ptr == 0 and type(ptr) is int:
                return  # torch: freeing the null pointer is a no-op
            raise _bad_pointer(ptr)
        box = self._ready  # read before the memo (a flush swaps the box, then clears it)
        if b is self._memo and b.uses is None and (
                (trace := self._trace) is None
                or self._hit_log is not None and b.requested == self._memo_req0):
            # A memo hit comes back: defer its free again, without the lock. Popping b from
            # the live map made this thread its only holder; appending it to the ready box
            # publishes it to the next hit. A flush under the lock that ran meanwhile
            # swapped the box: then whoever pops b from the old box frees it. (While the
            # memo lives, whether its block is in the box is its state: _flush_memo sets
            # Block.state from that.) With history logged as stamps, the free's stamp
            # travels with the block: whoever pops it from the box logs it.
            if trace is not None:
                b.tfree = self._hit_fnow()
            box.append(b)
            if self._ready is box:
                return
            try:
                box.pop()
            except IndexError:
                return  # the flush took it and freed it for real
            b.state = 1  # the flush saw it allocated: free it the plain way below
            b.tfree = 0
        try:
            self._take()  # the allocator lock, never waited for here
        except IndexError:
            # Busy: another thread, or a finalizer inside this thread's own allocator call.
            self._pending_frees.append(b)
            lock = self._lock
            if lock.acquire(False):
                try:
                    self._drain_pending_frees()
                finally:
                    lock.release()
            return
        try:
            m = self._memo
            if m is not None:
                if b is m and b.uses is None:  # a memo hit comes back (history on): defer
                    b.state = 5
                    self._ready.append(b)
                    if self._trace is not None:
                        log = self._hit_log
                        if log is not None and b.requested == self._memo_req0:
                            b.tfree = self._hit_fnow()  # logged by the hit that pops it
                        else:
                            if log:
                                self._spill_log()
                            self._trace_free(b)
                    return
                self._flush_memo()
            if self._pending_frees:
                self._drain_pending_frees()
            if (b is self._last and self._memo_ok and b.uses is None
                    and not self._gc_on and not self._n_events and not self._n_pending):
                if self._establish_memo(b) and self._trace is not None:
                    self._trace_free(b)
                return
            # torch's free(): the request (same lines as _free_requested, inlined)
            pool = b.fl.pool
            bsize = b.size
            pool.n_alloc -= 1
            pool.b_alloc -= bsize
            if self._trace is not None:
                self._trace("free_requested", ptr, b.requested, b.fl.stream)
            if bsize >= self._max_split:
                self._oversize_alloc(-1)
            if b.uses:
                self._insert_events(b)
            else:
                self._free_block(b)
        finally:
            self._give(True)

    # ------------------------------------------------------------------ the pair memo
    # A loop that allocates and frees the same size on the same stream (a temporary buffer)
    # makes torch split a cached block and merge it back on every iteration. When a block is
    # freed right after the malloc that took it by a plain best fit, with nothing in
    # between, torch's free would restore exactly the structure that malloc found, so the next
    # request of the same rounded size on that stream would get the same block, split the
    # same way. The free is therefore deferred: the block stays physically split
    # (state _DEFERRED) while the allocator is logically back in that structure, and a
    # matching malloc hands it out again with no split, merge or counter update ("hits").
    # Any other operation first calls _flush_memo, which performs the deferred free for real
    # and adds what the hit pairs would have added to torch's counters: every current and
    # peak is as after the first pair, except requested bytes (tracked per hit), so only
    # accumulated values and the requested-bytes peaks need the hit count.
    def _establish_memo(self, b: Block) -> bool:
        """Defer the free of ``b`` (allocated by the last malloc, by a plain best fit); False
        if it was freed the plain way instead (its trace entries then already written)."""
        n = b.next
        has_r = n is not None and n.state == 0  # the remainder the malloc split off
        rsz = n.size if has_r else 0
        after = n.next if has_r else n
        merged_split = b.prev is not None or after is not None
        if b.prev is not None and b.prev.state == 0:  # cannot happen after a best fit
            self._last = None
            self._free_requested(b)
            return False
        # inactive_split accumulation of one pair: the malloc's split of an unsplit block
        # adds a split block; the free's merge adds one if the merged block is a split.
        fresh = has_r and not merged_split
        net_n = (1 if merged_split else 0) - (1 if has_r else 0)
        net_b = (b.size + rsz if merged_split else 0) - rsz
        self._memo_split = ((1 if fresh else 0) + max(net_n, 0),
                            (rsz if fresh else 0) + max(net_b, 0))
        pool = b.fl.pool
        if net_n > 0:  # the free's peaks, as the deferred free would have set them now
            v = pool.n_split + net_n
            if v > pool.n_split_peak:
                pool.n_split_peak = v
            v = self.small.n_split + self.large.n_split + net_n
            if v > self._agg.n_split_peak:
                self._agg.n_split_peak = v
        if net_b > 0:
            v = pool.b_split + net_b
            if v > pool.b_split_peak:
                pool.b_split_peak = v
            v = self.small.b_split + self.large.b_split + net_b
            if v > self._agg.b_split_peak:
                self._agg.b_split_peak = v
        req = b.requested
        if self._rounding:
            lo, hi = req - 1, req  # the same request size only
        elif req <= 512:
            lo, hi = 0, 512
        else:
            hi = (req + 511) & -512
            lo = hi - 512
        self._memo_lo = lo
        self._memo_hi = hi
        self._memo_stream = b.fl.stream
        self._memo_rem = n if has_r else None
        self._memo_req0 = req
        # a pure hit: the same request again, nothing for the remainder to remember
        self._hit_size = req if not has_r or n.requested == req else -1
        sobj = self._last_stream
        self._hit_stream = sobj if type(sobj) is _Stream else _NO_STREAM
        # stream=None names the memo's stream in every thread while none has a stream
        # other than the default current (streams._custom empty)
        self._hit_none = self._memo_stream == 0 and self._tls_streams
        self._memo_hits = 0
        self._memo_req = 0  # sum over hits of (requested - req0)
        self._memo_req_max = req
        self._last = None
        b.state = _DEFERRED
        self._memo = b
        self._ready.append(b)
        # With a history hook whose entries carry nothing but a stamp (the time, and the
        # stack when stacks are recorded; no NVTX range), pairs of the memo's first request
        # are logged as (free stamp, alloc stamp) pairs, 0 for none, and written out by
        # _spill_log before any other entry.
        trace = self._trace
        if trace is not None and getattr(trace, "compact", None) is not None and trace.compact_ok():
            # bounded like the history's ring: stamps older than what it keeps are dropped
            cap = trace.capacity
            self._hit_log = log = deque(maxlen=None if cap is None or cap >= 1 << 60 else 2 * cap)
            self._hit_ap = log.append
            self._hit_now = trace.now
            self._hit_fnow = trace.free_now
        return True

    def _spill_log(self) -> None:
        """Write the memo pairs logged as stamps to the history (lock held)."""
        log = self._hit_log
        if log:
            trace = self._trace
            if trace is not None:
                trace.compact(self._memo.ptr, self._memo_req0, self._memo_stream, log)
            log.clear()

    def _trace_free(self, b: Block) -> None:
        """The history entries of a deferred free: requested and completed, as torch's."""
        trace = self._trace
        stream = b.fl.stream
        trace("free_requested", b.ptr, b.requested, stream)
        trace("free_completed", b.ptr, b.requested, stream)

    def _flush_memo(self) -> None:
        """Make the memo's deferred work real (lock held); no-op without a memo."""
        b = self._memo
        if b is None:
            return
        box = self._ready
        self._ready = []  # a deferring free in flight sees the swap (see free)
        try:
            box.pop()
            deferred = True
        except IndexError:  # handed out by a hit (or its free is still in flight)
            deferred = False
        log = self._hit_log
        if log is not None:
            if deferred and b.tfree:
                log.append(b.tfree)
                log.append(0)
            self._spill_log()
            self._hit_log = self._hit_ap = None
        b.tfree = 0
        self._memo = None
        self._hit_size = -1
        pool = b.fl.pool
        k = self._memo_hits
        req0 = self._memo_req0
        if k:
            # k hit mallocs and k deferred frees beyond the one done (or not yet due) below
            bsize = b.size
            pool.n_alloc_acc += k
            pool.b_alloc_acc += k * bsize
            pool.b_req_acc += k * req0 + self._memo_req
            dn, db = self._memo_split
            pool.n_split_acc += k * dn
            pool.b_split_acc += k * db
            extra = self._memo_req_max - req0  # the hits' requested-bytes peaks
            v = pool.b_req + extra
            if v > pool.b_req_peak:
                pool.b_req_peak = v
            v = self.small.b_req + self.large.b_req + extra
            if v > self._agg.b_req_peak:
                self._agg.b_req_peak = v
        pool.b_req += b.requested - req0  # the counters held the first pair's request
        b.state = _ALLOCATED
        if deferred:
            trace = self._trace
            self._trace = None  # the free was recorded (or not) when it was deferred
            try:
                self._free_requested(b)
            finally:
                self._trace = trace

    def owns(self, ptr: int) -> bool:
        return ptr in self._live

    def block_size(self, ptr: int) -> int:
        """The (rounded) size of the live block at ``ptr``."""
        b = self._live.get(ptr)
        if b is None:
            raise _bad_pointer(ptr)
        return b.size

    def record_stream(self, ptr: int, stream: Any) -> None:
        """torch's ``recordStream``: ``ptr`` is used on ``stream`` (a cudalab Stream).

        When the block is freed, one event is recorded on each such stream and the block is
        reused only after they complete. Use on the allocation stream is ignored.
        """
        dev, key = _stream_use(stream)
        with self._lock:
            b = self._live.get(ptr)
            if b is None:
                raise _bad_pointer(ptr)
            if dev == self.device and key == b.fl.stream:
                return
            if b.uses is None:
                b.uses = {stream}
            else:
                b.uses.add(stream)

    def empty_cache(self) -> None:
        """torch's ``emptyCache``: sync pending events, release every unsplit cached block."""
        with self._lock:
            self._flush_memo()
            self._last = None
            if self._pending_frees:
                self._drain_pending_frees()
            self._release_cached_blocks()

    def set_memory_fraction(self, fraction: float) -> None:
        total = _fraction_total(self.backend, self.device, fraction)
        with self._lock:
            self._flush_memo()
            self._total = total
            self._fraction = float(fraction)
            self._allowed = int(fraction * total)
            self._set_fraction = True
            self._gc_on = self._gc_threshold > 0.0

    def get_memory_fraction(self) -> float:
        if not self._set_fraction:
            return 1.0
        return self._allowed / self._total if self._total else self._fraction

    def add_free_memory_callback(self, callback: Callable[[], bool]) -> None:
        """torch's FreeMemoryCallback: called (without the lock) on a cache miss; return True
        if it freed memory so the search is repeated."""
        self._callbacks.append(callback)

    def sync_pending(self) -> None:
        if self._pending_frees or self._memo is not None:
            with self._lock:
                self._flush_memo()
                self._drain_pending_frees()

    def process_events(self) -> None:
        """Poll record_stream events now (malloc does this by itself)."""
        with self._lock:
            self._flush_memo()
            self._process_pending()

    def largest_free_block(self) -> int:
        """Size of the largest cached block (torch's ``cacheInfo`` without the free-memory guess)."""
        with self._lock:
            self._flush_memo()
            best = 0
            for pool in (self.small, self.large):
                for fl in pool.lists.values():
                    for k in reversed(fl.keys):
                        if fl.entries[k] is not None:
                            best = max(best, k >> _SHIFT)
                            break
            return best

    def segments(self) -> list[dict]:
        """torch's ``memory_snapshot()`` segments of this device (plain dicts and lists)."""
        with self._lock:
            self._flush_memo()
            if self._pending_frees:
                self._drain_pending_frees()
            heads = [b for b in self._all_blocks() if b.prev is None]
            out = []
            names = ("inactive", "active_allocated", "active_pending_free", "inactive")
            for head in heads:
                blocks = []
                ap = blocks.append
                rest = alloc = pending = req = 0
                b = head
                while b is not None:  # (allocated blocks, the common case, first)
                    if b.state == 1:  # _ALLOCATED
                        size = b.size
                        r = b.requested
                        ap({"address": b.ptr, "size": size, "requested_size": r,
                            "state": "active_allocated", "frames": []})
                        alloc += size
                        req += r
                    else:
                        st = b.state
                        size = b.size
                        r = b.requested
                        ap({"address": b.ptr, "size": size, "requested_size": r,
                            "state": names[st], "frames": []})
                        rest += size
                        if st == 2:  # _PENDING: active, not allocated
                            pending += size
                            req += r
                    b = b.next
                total = alloc + rest
                active = alloc + pending
                pool = head.fl.pool
                out.append({
                    "device": self.device,
                    "address": head.ptr,
                    "total_size": total,
                    "allocated_size": alloc,
                    "active_size": active,
                    "requested_size": req,
                    "stream": head.fl.stream,
                    "segment_type": "small" if pool.is_small else "large",
                    "segment_pool_id": (0, 0),
                    "is_expandable": False,
                    "frames": [],
                    "blocks": blocks,
                })
            out.sort(key=lambda s: s["address"])
            return out

    def _recount_block(self, b: Block, rc: dict) -> None:
        """Add one mapped block to the recount ``rc`` and check its state (invariants)."""
        rc["b_res"] += b.size
        if b.state == _ALLOCATED:
            rc["n_alloc"] += 1
            rc["b_alloc"] += b.size
            rc["b_req"] += b.requested
            assert self._live.get(b.ptr) is b or b in self._pending_frees, \
                f"{b!r} is allocated but not live"
        elif b.state == _PENDING:
            assert b.event_count > 0, f"{b!r} is pending without events"
            rc["n_pend"] += 1
            rc["b_pend"] += b.size
            rc["b_req"] += b.requested
        else:
            assert b.state == _FREE, f"{b!r} is in an impossible state"
            key = (b.size << _SHIFT) | b.ptr
            assert b.fl.entries.get(key) is b, f"{b!r} is free but not cached"

    def check_invariants(self) -> None:
        """Verify the allocator's internal structure (tests and debugging; O(blocks)).

        Raises AssertionError on the first inconsistency: blocks that do not tile their
        segment, free neighbours left unmerged, free lists out of step with block states,
        or counters that differ from a recount.
        """
        with self._lock:
            self._flush_memo()
            if self._pending_frees:
                self._drain_pending_frees()
            blocks = self._all_blocks()
            ids = {id(b) for b in blocks}
            recount = {name: {"n_alloc": 0, "b_alloc": 0, "b_req": 0, "n_seg": 0, "b_res": 0,
                              "n_split": 0, "b_split": 0, "n_pend": 0, "b_pend": 0}
                       for name in ("small", "large")}
            for head in (b for b in blocks if b.prev is None):
                pool = head.fl.pool
                rc = recount[pool.name]
                rc["n_seg"] += 1
                b, nblocks, end = head, 0, head.ptr
                while b is not None:
                    assert id(b) in ids, f"{b!r} is linked but unknown"
                    assert b.ptr == end, f"{b!r} does not start where its predecessor ends"
                    assert b.fl is head.fl, f"{b!r} changed stream or pool inside a segment"
                    if b.next is not None:
                        assert b.next.prev is b, f"broken links after {b!r}"
                        assert not (b.state == _FREE and b.next.state == _FREE), \
                            f"free neighbours {b!r} and {b.next!r} were not merged"
                    end += b.size
                    nblocks += 1
                    self._recount_block(b, rc)
                    b = b.next
                if nblocks > 1:
                    b = head
                    while b is not None:
                        if b.state == _FREE:
                            rc["n_split"] += 1
                            rc["b_split"] += b.size
                        b = b.next
            for pool in (self.small, self.large):
                for fl in pool.lists.values():
                    assert fl.keys == sorted(fl.keys), "free list keys out of order"
                    assert set(fl.keys) == set(fl.entries), "free list keys and entries differ"
                    for k, b in fl.entries.items():
                        if b is not None:
                            assert b.state == _FREE and id(b) in ids, f"stale cached {b!r}"
                            assert k == (b.size << _SHIFT) | b.ptr, f"wrong key for {b!r}"
                rc = recount[pool.name]
                for code, value in rc.items():
                    assert getattr(pool, code) == value, (
                        f"{pool.name} pool {code} = {getattr(pool, code)}, recount {value}")
            assert len(self._live) + len(self._pending_frees) == (
                recount["small"]["n_alloc"] + recount["large"]["n_alloc"])
            assert self._n_events == sum(len(dq) for dq in self._events.values())

    # ------------------------------------------------------------------ internals
    def _all_blocks(self) -> list[Block]:
        blocks: list[Block] = list(self._live.values())
        for pool in (self.small, self.large):
            for fl in pool.lists.values():
                blocks.extend(b for b in fl.entries.values() if b is not None)
        seen = set()
        for dq in [*self._events.values(), *self._in_sync]:
            for _, b, _ in dq:
                if id(b) not in seen and b.state == _PENDING:
                    seen.add(id(b))
                    blocks.append(b)
        blocks.extend(self._pending_frees)  # freed while the lock was busy: still allocated
        return blocks

    def _oversize_reject(self, rs: int, candidate: int) -> bool:
        ms = self._max_split
        if rs < ms:
            return candidate >= ms  # oversize blocks never serve small requests
        return candidate >= rs + self._max_non_split  # bounded slack for oversize requests

    def _oversize_alloc(self, delta: int) -> None:
        st = self.stats
        v = st.ov_alloc = st.ov_alloc + delta
        if delta > 0:
            st.ov_alloc_acc += delta
            if v > st.ov_alloc_peak:
                st.ov_alloc_peak = v

    def _free_requested(self, b: Block) -> None:
        """torch's ``free``: the request (allocation stats), then events or free_block."""
        pool = b.fl.pool
        bsize = b.size
        pool.n_alloc -= 1
        pool.b_alloc -= bsize
        if self._trace is not None:
            self._trace("free_requested", b.ptr, b.requested, b.fl.stream)
        if bsize >= self._max_split:
            self._oversize_alloc(-1)
        if b.uses:
            self._insert_events(b)
        else:
            self._free_block(b)

    def _free_block(self, b: Block) -> None:
        """torch's ``free_block``: merge with free neighbours, back into the pool, stats."""
        self._last = None
        if self._trace is not None:
            self._trace("free_completed", b.ptr, b.requested, b.fl.stream)
        fl = b.fl
        pool = fl.pool
        if b.state == 2:  # _PENDING: it was active without being allocated
            pool.n_pend -= 1
            pool.b_pend -= b.size
            self._n_pending -= 1
        net_n = 0
        net_b = 0
        entries = fl.entries
        p = b.prev
        if p is not None and p.state == 0:  # merge [p b]
            psize = p.size
            entries[(psize << 64) | p.ptr] = None
            b.ptr = p.ptr
            pp = b.prev = p.prev
            if pp is not None:
                pp.next = b
            b.size += psize
            net_n = -1
            net_b = -psize
            p.prev = p.next = None
            p.state = 3
            self._spare.append(p)
        n = b.next
        if n is not None and n.state == 0:  # merge [b n]
            nsize = n.size
            entries[(nsize << 64) | n.ptr] = None
            nn = b.next = n.next
            if nn is not None:
                nn.prev = b
            b.size += nsize
            net_n -= 1
            net_b -= nsize
            n.prev = n.next = None
            n.state = 3
            self._spare.append(n)
        b.state = 0
        size = b.size
        b.gc_base = pool.gc_calls
        key = (size << 64) | b.ptr
        if key in entries:
            entries[key] = b
        else:
            fl.add(key, b)
        if b.prev is not None or b.next is not None:
            net_n += 1
            net_b += size
        if net_n:
            pool.n_split += net_n
            if net_n > 0:
                pool.n_split_acc += net_n
                if pool.n_split > pool.n_split_peak:
                    pool.n_split_peak = pool.n_split
                v = self.small.n_split + self.large.n_split
                if v > self._agg.n_split_peak:
                    self._agg.n_split_peak = v
        if net_b:
            pool.b_split += net_b
            if net_b > 0:
                pool.b_split_acc += net_b
                if pool.b_split > pool.b_split_peak:
                    pool.b_split_peak = pool.b_split
                v = self.small.b_split + self.large.b_split
                if v > self._agg.b_split_peak:
                    self._agg.b_split_peak = v
        pool.b_req -= b.requested

    def _insert_events(self, b: Block) -> None:
        """torch's ``insert_events``: one pooled event per stream the block was used on."""
        uses = b.uses
        b.uses = None
        b.state = _PENDING
        pool = b.fl.pool
        pool.n_pend += 1
        pool.b_pend += b.size
        self._n_pending += 1
        backend = self.backend
        for s in uses:
            dev = s.device_index
            evpool = self._event_pools.get(dev)
            if evpool is None:
                evpool = self._event_pools[dev] = EventPool(backend, dev)
            ev = evpool.get()
            try:
                if s.cuda_stream == 0:
                    backend.set_context(dev)
                backend.event_record(ev, s._handle)
            except CudaError:
                # The stream is unusable (destroyed): wait for the device instead.
                evpool.put(ev)
                backend.synchronize(dev)
                continue
            b.event_count += 1
            dq = self._events.get(s)
            if dq is None:
                dq = self._events[s] = deque()
            dq.append((ev, b, evpool))
            self._n_events += 1
        if b.event_count == 0:
            self._free_block(b)

    def _process_pending(self) -> None:
        """Deferred frees, then torch's ``process_events`` (called with the lock held)."""
        if self._pending_frees:
            self._drain_pending_frees()
        if not self._n_events:
            return
        query = self.backend.event_query
        for key in list(self._events):
            dq = self._events[key]
            while dq:
                ev, b, evpool = dq[0]
                if not query(ev):
                    break
                dq.popleft()
                self._n_events -= 1
                evpool.put(ev)
                b.event_count -= 1
                if b.event_count == 0:
                    self._free_block(b)
            if not dq:
                del self._events[key]

    def _drain_pending_frees(self) -> None:
        dq = self._pending_frees
        if dq and self._memo is not None:
            self._flush_memo()
        while dq:
            self._free_requested(dq.popleft())

    # ------------------------------------------------------------------ slow path
    def _malloc_slow(self, rs: int, pool: BlockPool, skey: int) -> Block:
        """Cache miss: torch's ladder from free-memory callbacks to OutOfMemoryError."""
        alloc_size = allocation_size(rs, self._large_segment)
        if self._callbacks:
            b = self._run_callbacks_and_search(rs, pool, skey)
            if b is not None:
                return b
        if self._gc_on:
            self._garbage_collect()
        b = self._alloc_block(pool, skey, alloc_size, False)
        if b is None and self._release_available_cached_blocks(pool, skey, rs):
            b = self._alloc_block(pool, skey, alloc_size, False)
        if b is None:
            self._release_cached_blocks()
            b = self._alloc_block(pool, skey, alloc_size, True)
        if b is None:
            self._raise_oom(rs, alloc_size, skey)
        return b

    def _search(self, rs: int, pool: BlockPool, skey: int) -> Block | None:
        """get_free_block outside the hot path (after callbacks)."""
        if self._gc_on:
            pool.gc_calls += 1
        fl = pool.lists.get(skey)
        if fl is None:
            return None
        keys, entries = fl.keys, fl.entries
        i = bisect_left(keys, rs << _SHIFT)
        while i < len(keys):
            b = entries[keys[i]]
            if b is not None:
                if self._split_limited and self._oversize_reject(rs, b.size):
                    return None
                entries[keys[i]] = None
                return b
            i += 1
        return None

    def _run_callbacks_and_search(self, rs: int, pool: BlockPool, skey: int) -> Block | None:
        freed = False
        self._lock.release()
        try:
            for cb in list(self._callbacks):
                freed |= bool(cb())
        finally:
            self._lock.acquire()
        if not freed:
            return None
        if self._pending_frees or self._n_events:
            self._process_pending()
        return self._search(rs, pool, skey)

    def _alloc_block(self, pool: BlockPool, skey: int, alloc_size: int, is_retry: bool) -> Block | None:
        """torch's ``alloc_block``: a new segment, or None on a (soft) out-of-memory."""
        st = self.stats
        if is_retry:
            st.num_alloc_retries += 1
        if self._set_fraction and st.current("b_res") + alloc_size > self._allowed:
            return None
        lock = self._lock
        lock.release()
        try:
            ptr = self.backend.mem_alloc(self.device, alloc_size)
        except OutOfMemoryError:
            ptr = None
        finally:
            lock.acquire()
        if ptr is None:
            return None
        b = Block(ptr, alloc_size, pool.free_list(skey))
        st.increase(pool, "n_seg", 1)
        st.increase(pool, "b_res", alloc_size)
        if alloc_size >= self._max_split:
            st.increase_oversize_segments()
        st.num_device_alloc += 1
        if self._trace is not None:
            self._trace("segment_alloc", ptr, alloc_size, skey)
        return b

    def _detach_segment(self, b: Block) -> int:
        """Take a whole cached segment out of its pool (stats as torch's release_block)."""
        fl = b.fl
        fl.entries[(b.size << _SHIFT) | b.ptr] = None
        b.state = _DETACHED
        st = self.stats
        st.num_device_free += 1
        if self._trace is not None:
            self._trace("segment_free", b.ptr, b.size, fl.stream)
        st.decrease(fl.pool, "n_seg", 1)
        st.decrease(fl.pool, "b_res", b.size)
        if b.size >= self._max_split:
            st.ov_seg -= 1
        return b.ptr

    def _free_segments(self, ptrs: list[int]) -> None:
        """mem_free detached segments with the lock dropped."""
        if not ptrs:
            return
        lock = self._lock
        lock.release()
        try:
            error = None
            for ptr in ptrs:
                try:
                    self.backend.mem_free(self.device, ptr)
                except CudaError as exc:  # keep going: the rest can still be returned
                    error = error or exc
            if error is not None:
                raise error
        finally:
            lock.acquire()

    def _release_available_cached_blocks(self, pool: BlockPool, skey: int, rs: int) -> bool:
        """torch: with max_split_size set, release cached oversize blocks (one big enough,
        or the largest ones until their sizes add up to the request)."""
        if not self._split_limited:
            return False
        fl = pool.lists.get(skey)
        if fl is None:
            return False
        target = max(rs, self._max_split)
        blocks = fl.blocks()
        sizes = [b.size for b in blocks]
        i = bisect_left(sizes, target)
        if i < len(blocks):
            self._free_segments([self._detach_segment(blocks[i])])
            return True
        released = 0
        ptrs = []
        j = len(blocks) - 1
        while j >= 0 and released < target and blocks[j].size >= self._max_split:
            released += blocks[j].size
            ptrs.append(self._detach_segment(blocks[j]))
            j -= 1
        self._free_segments(ptrs)
        return released >= target

    def _release_cached_blocks(self) -> None:
        """torch's ``release_cached_blocks``: sync all events, release unsplit cached blocks."""
        self._synchronize_and_free_events()
        ptrs = []
        for pool in (self.large, self.small):
            for b in pool.free_blocks():
                if b.prev is None and b.next is None:
                    ptrs.append(self._detach_segment(b))
        for pool in (self.large, self.small):
            for fl in pool.lists.values():
                fl.sweep()
        self._free_segments(ptrs)

    def _synchronize_and_free_events(self) -> None:
        self.stats.num_sync_all_streams += 1
        if not self._events:
            return
        events, self._events = self._events, {}
        self._n_events = 0
        pending = [item for dq in events.values() for item in dq]
        self._in_sync.append(pending)  # still visible to segments() while unlocked
        done = 0
        lock = self._lock
        lock.release()
        try:
            for ev, _, _ in pending:
                self.backend.event_synchronize(ev)
                done += 1
        finally:
            lock.acquire()
            self._in_sync.remove(pending)
            for ev, b, evpool in pending[:done]:
                evpool.put(ev)
                b.event_count -= 1
                if b.event_count == 0:
                    self._free_block(b)
            if done < len(pending):  # synchronisation failed: keep the rest outstanding
                for item in pending[done:]:
                    for s, dq in events.items():
                        if item in dq:
                            self._events.setdefault(s, deque()).append(item)
                            self._n_events += 1
                            break

    def _garbage_collect(self) -> None:
        """torch's ``garbage_collect_cached_blocks``: free old unsplit large blocks."""
        threshold = int(self._gc_threshold * self._allowed)
        reserved = self.stats.current("b_res")
        if reserved <= threshold:
            return
        target = reserved - threshold
        calls = self.large.gc_calls
        candidates = [b for b in self.large.free_blocks() if b.prev is None and b.next is None]
        count = len(candidates)
        if count == 0:
            return
        total_age = sum(calls - b.gc_base for b in candidates)
        reclaimed = 0
        freed_any = True
        ptrs = []
        while reclaimed < target and freed_any and count > 0:
            age_threshold = total_age / count
            freed_any = False
            keep = []
            for b in candidates:
                age = calls - b.gc_base
                if age >= age_threshold:
                    freed_any = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    ptrs.append(self._detach_segment(b))
                else:
                    keep.append(b)
            candidates = keep
        self._free_segments(ptrs)

    def _raise_oom(self, rs: int, alloc_size: int, skey: int) -> None:
        free, total = self.backend.mem_get_info(self.device)
        st = self.stats
        if self._trace is not None:
            self._trace("oom", free, rs, skey)
        st.num_ooms += 1
        raise OutOfMemoryError(text=_oom_text(
            self.device, alloc_size, free, total, st.current("b_alloc"), st.current("b_res"),
            self._allowed if self._set_fraction else None))


def _oom_text(device: int, alloc_size: int, free: int, total: int, allocated: int,
              reserved: int, allowed: int | None) -> str:
    """torch's OOM message (cudalab's names; "this process" = total - free)."""
    allowed_info = f"{format_size(allowed)} allowed; " if allowed is not None else ""
    return (
        f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. "
        f"GPU {device} has a total capacity of {format_size(total)} of which "
        f"{format_size(free)} is free. Including non-cudalab memory, this process has "
        f"{format_size(total - free)} memory in use. {allowed_info}"
        f"Of the allocated memory {format_size(allocated)} is allocated by cudalab, and "
        f"{format_size(reserved - allocated)} is reserved by cudalab but unallocated."
        + _OOM_HINT
    )


# --------------------------------------------------------------------------- pass-through
class UncachedAllocator(Allocator):
    """``CUDALAB_NO_MEMORY_CACHING=1``: every malloc is a ``mem_alloc``, every free a
    ``mem_free`` (for compute-sanitizer and similar tools).

    Statistics are kept (each allocation counts as its own segment of exactly the requested
    size), so ``memory_allocated()`` still tells the truth; torch's uncached mode reports 0.
    ``record_stream`` needs no events: ``mem_free`` synchronises the device.
    """

    name = "native"

    def __init__(self, backend: Any, device: int = 0, config: AllocatorConfig | None = None,
                 stream_resolver: Callable[[], int] | None = None):
        self.backend = backend
        self.device = device
        self.config = config or AllocatorConfig()
        ms = self.config.max_split_size
        self.stats = DeviceStats(-1 if ms >= UNLIMITED else ms)
        self._live: dict[int, tuple[int, int, Counters]] = {}
        self._lock = threading.Lock()
        self._set_fraction = False
        self._allowed = 0
        self._total = 0
        self._trace: Callable[[str, int, int, int], None] | None = None

    def malloc(self, size: Any, stream: Any = None) -> int:
        size = _check_size(size)
        if size == 0:
            return 0
        if stream is not None:
            _stream_key(stream, self.device)
        st = self.stats
        pool = st.small if size <= SMALL_SIZE else st.large
        with self._lock:
            if self._set_fraction and st.current("b_res") + size > self._allowed:
                raise self._oom(size)
        try:
            ptr = self.backend.mem_alloc(self.device, size)
        except OutOfMemoryError:
            with self._lock:
                raise self._oom(size) from None
        with self._lock:
            self._live[ptr] = (size, size, pool)
            st.num_device_alloc += 1
            for code in ("n_seg", "n_alloc"):
                st.increase(pool, code, 1)
            for code in ("b_res", "b_alloc", "b_req"):
                st.increase(pool, code, size)
            if self._trace is not None:
                self._trace("segment_alloc", ptr, size, 0)
                self._trace("alloc", ptr, size, 0)
        return ptr

    def free(self, ptr: int) -> None:
        with self._lock:
            entry = self._live.pop(ptr, None)
            if entry is None:
                if ptr == 0 and type(ptr) is int:
                    return
                raise _bad_pointer(ptr)
            size, _, pool = entry
            st = self.stats
            for code in ("n_seg", "n_alloc"):
                st.decrease(pool, code, 1)
            for code in ("b_res", "b_alloc", "b_req"):
                st.decrease(pool, code, size)
            st.num_device_free += 1
            if self._trace is not None:
                for action in ("free_requested", "free_completed"):
                    self._trace(action, ptr, size, 0)
                self._trace("segment_free", ptr, size, 0)
        self.backend.mem_free(self.device, ptr)

    def owns(self, ptr: int) -> bool:
        return ptr in self._live

    def record_stream(self, ptr: int, stream: Any) -> None:
        if ptr not in self._live:
            raise _bad_pointer(ptr)

    def empty_cache(self) -> None:
        with self._lock:
            self.stats.num_sync_all_streams += 1

    def set_memory_fraction(self, fraction: float) -> None:
        total = _fraction_total(self.backend, self.device, fraction)
        with self._lock:
            self._total = total
            self._allowed = int(fraction * total)
            self._set_fraction = True

    def get_memory_fraction(self) -> float:
        return self._allowed / self._total if self._set_fraction and self._total else 1.0

    def segments(self) -> list[dict]:
        with self._lock:
            items = sorted(self._live.items())
        return [{
            "device": self.device, "address": ptr, "total_size": size, "allocated_size": size,
            "active_size": size, "requested_size": req, "stream": 0,
            "segment_type": "small" if pool is self.stats.small else "large",
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
            "blocks": [{"address": ptr, "size": size, "requested_size": req,
                        "state": "active_allocated", "frames": []}],
        } for ptr, (size, req, pool) in items]

    def _oom(self, size: int) -> OutOfMemoryError:
        free, total = self.backend.mem_get_info(self.device)
        st = self.stats
        st.num_ooms += 1
        if self._trace is not None:
            self._trace("oom", free, size, 0)
        return OutOfMemoryError(text=_oom_text(
            self.device, size, free, total, st.current("b_alloc"), st.current("b_res"),
            self._allowed if self._set_fraction else None))


# --------------------------------------------------------------------------- process registry
def create_allocator(backend: Any, device: int, config: AllocatorConfig | None = None,
                     no_caching: bool | None = None,
                     stream_resolver: Callable[[], int] | None = None) -> Allocator:
    """The allocator the settings ask for (raises ValueError / NotImplementedError).

    In order: the allocator installed by ``cudalab.memory.change_current_allocator`` (a
    :class:`~cudalab.allocator.pluggable.PluggableDeviceAllocator`); ``backend:cudaMallocAsync``
    (:class:`~cudalab.allocator.async_allocator.AsyncPoolAllocator`, which like torch ignores
    ``CUDALAB_NO_MEMORY_CACHING``); no caching (:class:`UncachedAllocator`); else the native
    :class:`DeviceCachingAllocator`.
    """
    if config is None:
        config = config_from_env()
    from cudalab.allocator import pluggable

    custom = pluggable.current_allocator()
    if custom is not None:
        return custom.device_allocator(backend, device, config, stream_resolver)
    if config.backend == "cudaMallocAsync":
        from cudalab.allocator.async_allocator import AsyncPoolAllocator

        return AsyncPoolAllocator(backend, device, config, stream_resolver)
    if no_caching is None:
        no_caching = no_caching_from_env()
    if no_caching:
        return UncachedAllocator(backend, device, config, stream_resolver)
    return DeviceCachingAllocator(backend, device, config, stream_resolver)


_registry_lock = threading.Lock()
_allocators: list[Allocator | None] = []
#: Allocators that exist, for pointer lookups (few: one per device used).
_active: list[Allocator] = []
_config: AllocatorConfig | None = None
#: Called with each allocator get_allocator() creates, before it is published (the history
#: recorder attaches itself here); a hook must not raise.
_on_create: list[Callable[[Allocator], None]] = []


def allocator_config() -> AllocatorConfig:
    """The process-wide settings (parsed from the environment once; ValueError if bad)."""
    global _config
    cfg = _config
    if cfg is None:
        cfg = _config = config_from_env()
    return cfg


def get_allocator(device: int) -> Allocator:
    """The allocator of ``device`` (a valid index), created on first use."""
    allocs = _allocators
    if device < len(allocs):
        a = allocs[device]
        if a is not None:
            return a
    with _registry_lock:
        if device >= len(_allocators):
            _allocators.extend([None] * (device + 1 - len(_allocators)))
        a = _allocators[device]
        if a is None:
            from cudalab import devices

            a = create_allocator(devices._backend(), device, allocator_config())
            for hook in _on_create:
                hook(a)
            _allocators[device] = a
            _active.append(a)
        return a


def existing_allocator(device: int) -> Allocator | None:
    """The allocator of ``device`` if one was created (never creates one)."""
    allocs = _allocators
    return allocs[device] if device < len(allocs) else None


def find_owner(ptr: int) -> Allocator | None:
    """The allocator holding live pointer ``ptr``, if any."""
    for a in _active:
        if a.owns(ptr):
            return a
    return None


def _reset_for_tests() -> None:
    """Forget every allocator and the parsed settings (tests only)."""
    global _config
    with _registry_lock:
        _allocators.clear()
        _active.clear()
        _config = None
