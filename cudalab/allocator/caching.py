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

Data structures: :mod:`cudalab.allocator.blocks` (blocks, free lists sorted by packed
``size << 64 | address`` keys, pools); the fields and their invariants:
:mod:`cudalab.allocator.cache_state`. The concerns off the hot path are mixins in their own
modules: the pair memo's set-up and flush (:mod:`~cudalab.allocator.memo`), the slow path
and release ladder (:mod:`~cudalab.allocator.slow_path`), snapshots and self-checks
(:mod:`~cudalab.allocator.inspection`).

Locking. One lock per device (a :class:`~cudalab.allocator.token_lock.TokenLock`: a
``threading.Lock`` whose uncontended acquire and release are one ``list.pop`` and one
``list.append``, inlined on the hot paths), held briefly and never across a blocking driver
call: it is dropped around ``mem_alloc``, ``mem_free`` and event synchronisation (blocks in
flight are detached from every pool first, so nothing another thread can see changes).
``free`` never waits: if the lock is busy (another thread, or a finalizer running inside
this thread's own allocator call) the block goes to a pending list that the next
allocator call on that device merges in (CuPy's scheme), so frees from finalizers cannot
deadlock. The free of a pair-memo hit takes no lock at all (see ``free``).

Hot path. This module is the cache-hit path, in one place: ``malloc`` (pure memo hit,
memo hit, best fit and split), ``_carve``, ``_account_alloc``, ``free`` (the lock-free free
of a memo hit, then the plain free) and ``_free_block``. They exist for the rows of
benchmarks/allocator.py "cudalab allocator.malloc+free", "cudalab allocator.malloc+free
(current stream)" and "cudalab caching_allocator_alloc+delete" (the "cache-hit pair" of
issue 17): they call no helper on a hit, inline the lock (TokenLock) and the statistics
counters (the peak updates are written-out copies of ``DeviceStats.increase``, pinned to it
by tests/allocator/test_allocator_policy.py), and compare the block states by name. A cache
hit makes no driver call, builds no dict and logs nothing; the hook of the history recorder
(``self._trace``, see :mod:`cudalab.allocator.hooks`) is tested once per operation and
costs nothing when it is None. The commonest hit, a temporary buffer allocated and freed
again with the same request on the same stream, is the memo's *pure hit*: malloc checks the
request, the Stream object and the ready box, and free hands the block back to the box.
"""

from __future__ import annotations

import os
import warnings
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from typing import Any

from cudalab import streams as _streams
from cudalab._driver.base import ClosedHandle
from cudalab.allocator.base import bad_pointer, fraction_total, stream_key, stream_use
from cudalab.allocator.blocks import (
    ALLOCATED,
    DEFERRED,
    DETACHED,
    FREE,
    PENDING,
    Block,
    BlockPool,
    StreamUses,
)
from cudalab.allocator.cache_state import NO_STREAM
from cudalab.allocator.config import AllocatorConfig
from cudalab.allocator.events import EventPool
from cudalab.allocator.inspection import Inspection
from cudalab.allocator.memo import PairMemo
from cudalab.allocator.policy import MAX_ALLOCATION_SIZE, check_size, round_size
from cudalab.allocator.pools import PrivatePools
from cudalab.allocator.slow_path import SlowPath
from cudalab.allocator.token_lock import TokenLock
from cudalab.errors import CudaError

__all__ = ["DeviceCachingAllocator", "compiled_pair"]

_Stream = _streams.Stream
_tls = _streams.per_thread  # per thread: .device and .streams (the current stream of each device)
_custom = _streams.custom_stream_tokens  # empty: stream=None is the default stream in every thread


class DeviceCachingAllocator(PairMemo, PrivatePools, SlowPath, Inspection):
    """torch's DeviceCachingAllocator for one device, over a driver :class:`Backend`.

    The state and its constructor are :class:`~cudalab.allocator.cache_state.CacheState`'s
    (parameters there); the concerns are mixins: the pair memo
    (:class:`~cudalab.allocator.memo.PairMemo`), the private pools
    (:class:`~cudalab.allocator.pools.PrivatePools`), the slow path
    (:class:`~cudalab.allocator.slow_path.SlowPath`) and the readers
    (:class:`~cudalab.allocator.inspection.Inspection`). The hot paths are here.
    """

    # What the cache hit and the memo's free read live in slots; so do the memo's other
    # fields and the flags of the plain paths, so that the instance dict keeps at most 30
    # names (CPython's limit for an object's attributes to stay inline, in the class's shared
    # keys). Past it the object's dict is materialised, and then no method call on the
    # allocator (``a.malloc(...)``, ``a.free(...)`` in cudalab.memory's torch-style pair)
    # can be specialised by the interpreter: each looks the method up in full (~40 ns).
    # tests/allocator/test_pair_fast_path.py keeps it so. The rest (and subclasses') in
    # the instance dict.
    __slots__ = ("_take", "_give", "_hit_size", "_hit_stream", "_hit_none",
                 "_ready", "pending_frees", "live", "_memo_hits", "_trace", "memo_block",
                 "_tls_streams", "device", "_hit_log", "_hit_ap", "_hit_rec", "_hit_now", "_hit_fnow",
                 "_memo_req0", "_captures",
                 "_memo_stream", "_memo_rem", "_memo_lo", "_memo_hi", "_memo_req", "_memo_req_max",
                 "_memo_split", "_memo_ok", "_last", "_last_stream", "_gc_on", "_lock",
                 "outstanding_events", "_n_pending", "_rounding", "_default_stream")

    # ------------------------------------------------------------------ public API
    def malloc(self, size: Any, stream: Any = None) -> int:
        """A block of at least ``size`` bytes for ``stream`` (default: the current stream)."""
        try:
            self._take()  # the allocator lock (a TokenLock), inlined
        except IndexError:
            self._lock.wait()
        try:
            m: Block | None  # (an annotation only: no code)
            # The pure memo hit (see memo.py): the same request on the same Stream object as
            # the pair that set up the memo, so only the hit count changes. (Hot path:
            # benchmarks/allocator.py cache-hit pair rows; see the module doc.)
            if (size == self._hit_size and type(size) is int and self._ready
                    and (stream is self._hit_stream
                         or stream is None and self._hit_none and not _custom
                         or stream is None and self._tls_streams and (cur := _tls.streams) is not None
                         and cur[self.device] is self._hit_stream)
                    and not self.pending_frees):
                m = self._ready.pop()  # (its state is left as is: _flush_memo sets it)
                self.live[m.ptr] = m
                self._memo_hits += 1
                if self._trace is not None:
                    rec = self._hit_rec
                    if rec is not None:  # its free's stamp and its own, in one call
                        rec(m.tfree)
                    elif (ap := self._hit_ap) is not None:  # see _establish_memo
                        ap(m.tfree)  # its free's stamp (0: none, skipped when written)
                        ap(self._hit_now())
                    else:
                        self._trace("alloc", m.ptr, size, self._memo_stream)
                return m.ptr
            if type(size) is not int or size <= 0 or size >= MAX_ALLOCATION_SIZE:
                size = check_size(size)
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
                skey = stream_key(stream, self.device)
            m = self.memo_block
            if m is not None:
                # The pair memo: the block the last free deferred is exactly what torch's
                # best fit would return for this request (see _establish_memo). It is in
                # the ready box while deferred; only lock holders take it out.
                ready = self._ready
                if (ready and skey == self._memo_stream and self._memo_lo < size <= self._memo_hi
                        and not self.pending_frees):
                    ready.pop()
                    m.state = ALLOCATED
                    if m.tfree:  # its free, deferred without the lock, left a stamp
                        if self._hit_ap is not None:
                            self._hit_ap(m.tfree)
                            self._hit_ap(0)
                        m.tfree = 0
                    r = self._memo_rem
                    if r is not None:  # torch's split leaves the old request on the remainder
                        r.requested = m.requested
                    m.requested = size
                    self.live[m.ptr] = m
                    self._memo_hits += 1
                    if size != self._memo_req0:
                        self._memo_req += size - self._memo_req0
                        if size > self._memo_req_max:
                            self._memo_req_max = size
                        self._hit_size = -1
                    else:
                        self._hit_size = size if r is None or r.requested == size else -1
                        self._hit_stream = sobj if type(sobj) is _Stream else NO_STREAM
                    if self._trace is not None:
                        if self._hit_log:
                            self._spill_log()
                        self._trace("alloc", m.ptr, size, skey)
                    return m.ptr
                self._flush_memo()
            self._last = None
            if self._captures:  # some private pool is allocated to (see allocator/pools.py)
                return self._malloc_routed(size, skey)
            if self.outstanding_events or self.pending_frees:
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
                    # = stats.increase(pool, "n_split", 1) and (pool, "b_split", remaining),
                    # written out for the cache-hit pair rows of benchmarks/allocator.py
                    # (pinned to DeviceStats.increase by test_inline_peaks_match_increase)
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
        b.state = FREE
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
        b.state = ALLOCATED
        b.requested = size
        self.live[ptr] = b
        # allocation, allocated_bytes, requested_bytes (active is derived): the pool's
        # current/peak/allocated, then the total's peak. = stats.increase(pool, code, n) for
        # the three codes, written out for the cache-hit pair rows of benchmarks/allocator.py
        # (pinned to DeviceStats.increase by test_inline_peaks_match_increase), plus the
        # peak_scope watermark.
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
        # Hot path (cache-hit pair rows of benchmarks/allocator.py): the free of a memo hit
        # takes no lock; the plain free inlines the lock and torch's free request.
        b = self.live.pop(ptr, None)
        if b is None:
            if ptr == 0 and type(ptr) is int:
                return  # torch: freeing the null pointer is a no-op
            raise bad_pointer(ptr)
        box = self._ready  # read before the memo (a flush swaps the box, then clears it)
        if b is self.memo_block and b.uses is None and (
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
            b.state = ALLOCATED  # the flush saw it allocated: free it the plain way below
            b.tfree = 0
        try:
            self._take()  # the allocator lock, never waited for here
        except IndexError:
            # Busy: another thread, or a finalizer inside this thread's own allocator call.
            self.pending_frees.append(b)
            lock = self._lock
            if lock.acquire(False):
                try:
                    self._drain_pending_frees()
                finally:
                    lock.release()
            return
        try:
            m = self.memo_block
            if m is not None:
                if b is m and b.uses is None:  # a memo hit comes back (history on): defer
                    b.state = DEFERRED
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
            if self.pending_frees:
                self._drain_pending_frees()
            if (b is self._last and self._memo_ok and b.uses is None
                    and not self._gc_on and not self.outstanding_events and not self._n_pending):
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

    def owns(self, ptr: int) -> bool:
        return ptr in self.live

    def block_size(self, ptr: int) -> int:
        """The (rounded) size of the live block at ``ptr``."""
        b = self.live.get(ptr)
        if b is None:
            raise bad_pointer(ptr)
        return b.size

    def record_stream(self, ptr: int, stream: Any) -> None:
        """torch's ``recordStream``: ``ptr`` is used on ``stream`` (a cudalab Stream).

        When the block is freed, one event is recorded on each such stream and the block is
        reused only after they complete. Use on the allocation stream is ignored.
        """
        dev, key = stream_use(stream)
        with self._lock:
            b = self.live.get(ptr)
            if b is None:
                raise bad_pointer(ptr)
            if dev == self.device and key == b.fl.stream:
                return
            if b.uses is None:
                b.uses = {stream}
            else:
                b.uses.add(stream)

    def empty_cache(self) -> None:
        """torch's ``emptyCache``: sync pending events, release every unsplit cached block."""
        with self._lock:
            if self._pending_releases:
                self._settle_releases()
            self._flush_memo()
            self._last = None
            if self.pending_frees:
                self._drain_pending_frees()
            self._release_cached_blocks()

    def set_memory_fraction(self, fraction: float) -> None:
        total = fraction_total(self.backend, self.device, fraction)
        with self._lock:
            self._flush_memo()
            self._total = total
            self._fraction = float(fraction)
            self._allowed = int(fraction * total)
            self._set_fraction = True
            self._gc_on = self._gc_threshold > 0.0

    def reconfigure(self, config: AllocatorConfig) -> None:
        """Apply settings changed at run time: the size rules (``max_split_size_mb``,
        ``max_non_split_rounding_mb``, ``large_segment_size_mb``,
        ``roundup_power2_divisions``), ``garbage_collection_threshold`` and
        ``per_process_memory_fraction``; they take effect from the next allocation, as
        torch's. Deferred memo work is done first (the memo depends on the split rules).

        Parameters
        ----------
        config : AllocatorConfig
            The new settings, with this allocator's ``backend`` and ``expandable_segments``.
        """
        with self._lock:
            self._flush_memo()
            self._last = None
            if self.pending_frees:
                self._drain_pending_frees()
            self._apply_settings(config)
        if config.per_process_memory_fraction is not None:
            self.set_memory_fraction(config.per_process_memory_fraction)

    def add_free_memory_callback(self, callback: Callable[[], bool]) -> None:
        """torch's FreeMemoryCallback: called (without the lock) on a cache miss; return True
        if it freed memory so the search is repeated."""
        self._callbacks.append(callback)

    def sync_pending(self) -> None:
        if self.pending_frees or self.memo_block is not None:
            with self._lock:
                self._flush_memo()
                self._drain_pending_frees()

    def process_events(self) -> None:
        """Poll record_stream events now (malloc does this by itself)."""
        with self._lock:
            self._flush_memo()
            self._process_pending()


    def _oversize_reject(self, rs: int, candidate: int) -> bool:
        ms = self._max_split
        if rs < ms:
            return candidate >= ms  # oversize blocks never serve small requests
        return candidate >= rs + self._max_non_split  # bounded slack for oversize requests

    def _oversize_alloc(self, delta: int) -> None:
        """torch's ``oversize_allocations`` moves by ``delta`` (a device-level counter, so not
        DeviceStats.increase, which updates a pool's; only with max_split_size set)."""
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
        if b.state == PENDING:  # it was active without being allocated
            pool.n_pend -= 1
            pool.b_pend -= b.size
            self._n_pending -= 1
        net_n = 0
        net_b = 0
        entries = fl.entries
        p = b.prev
        if p is not None and p.state == FREE:  # merge [p b]
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
            p.state = DETACHED
            self._spare.append(p)
        n = b.next
        if n is not None and n.state == FREE:  # merge [b n]
            nsize = n.size
            entries[(nsize << 64) | n.ptr] = None
            nn = b.next = n.next
            if nn is not None:
                nn.prev = b
            b.size += nsize
            net_n -= 1
            net_b -= nsize
            n.prev = n.next = None
            n.state = DETACHED
            self._spare.append(n)
        b.state = FREE
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
        # = stats.increase / decrease(pool, "n_split" / "b_split", net), written out for the
        # cache-hit pair rows of benchmarks/allocator.py (pinned to DeviceStats.increase by
        # test_inline_peaks_match_increase)
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
        """torch's ``insert_events``: one pooled event per stream the block was used on.

        While a private pool is allocated to (a capture), no event is recorded: the block
        waits, pending, until the last capture ends (torch's deferred frees; see
        ``end_allocate_to_pool``)."""
        uses = b.uses or set()  # (called only when it is a non-empty set)
        b.uses = None
        b.state = PENDING
        pool = b.fl.pool
        pool.n_pend += 1
        pool.b_pend += b.size
        self._n_pending += 1
        if self._captures:
            self._deferred_uses.append((b, uses))
            return
        self._record_use_events(b, uses)

    def _record_use_events(self, b: Block, uses: StreamUses) -> None:
        """The events of a PENDING block's uses (its free completes when they have; at once
        if none could be recorded)."""
        backend = self.backend
        for s in uses:
            dev = s.device_index
            evpool = self._event_pools.get(dev)
            if evpool is None:
                evpool = self._event_pools[dev] = EventPool(backend, dev)
            if type(s.handle) is ClosedHandle:  # nothing more can be queued on it: wait for the device instead
                backend.synchronize(dev)
                continue
            ev = evpool.get()
            try:
                if s.cuda_stream == 0:
                    backend.set_context(dev)
                backend.event_record(ev, s.handle)
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
            self.outstanding_events += 1
        if b.event_count == 0:
            self._free_block(b)

    def _process_pending(self) -> None:
        """Deferred frees, then torch's ``process_events`` (called with the lock held)."""
        if self.pending_frees:
            self._drain_pending_frees()
        if not self.outstanding_events:
            return
        query = self.backend.event_query
        for key in list(self._events):
            dq = self._events[key]
            while dq:
                ev, b, evpool = dq[0]
                if not query(ev):
                    break
                dq.popleft()
                self.outstanding_events -= 1
                evpool.put(ev)
                b.event_count -= 1
                if b.event_count == 0:
                    self._free_block(b)
            if not dq:
                del self._events[key]

    def _drain_pending_frees(self) -> None:
        dq = self.pending_frees
        if dq and self.memo_block is not None:
            self._flush_memo()
        while dq:
            self._free_requested(dq.popleft())


# ------------------------------------------------------------------ the pair's C twins
#: The fields of DeviceCachingAllocator that cudalab/allocator/_pair.c reads, in its order:
#: the pure hit of malloc and the lock-free free of a memo hit, above.
PAIR_FIELDS = ("_hit_size", "_ready", "_hit_none", "pending_frees", "live", "_memo_hits",
               "_trace", "memo_block", "_lock", "_tls_streams", "_hit_stream")


def compiled_pair(py_alloc: Callable[..., int], py_delete: Callable[[int], None],
                  allocators: list[Any], active: list[Any], devices_globals: dict[str, Any],
                  observe_globals: dict[str, Any], custom: list[None],
                  module_name: str) -> tuple[Callable[..., int], Callable[[int], None]] | None:
    """The C twins of cudalab.memory's ``caching_allocator_alloc`` and
    ``caching_allocator_delete`` (:mod:`cudalab.allocator._pair`): the pair memo's pure hit
    (``malloc``'s first branch and ``free``'s lock-free one, above) in one C call each way,
    other calls on the allocator through its ``malloc`` / ``free``, everything else through
    ``py_alloc`` / ``py_delete``; named and documented as those.

    None where the extension is not built (another Python, no compiler at install time; see
    setup.py), ``CUDALAB_PURE_PYTHON`` or ``CUDALAB_FASTPAIR=0`` is set, or a stale build does
    not fit (reported). The other arguments are the objects the twins read, never rebound:
    the registry's allocator lists, ``cudalab.devices``' and ``cudalab._observe``'s module
    dicts (``sole_device``, ``access_on``) and ``streams.custom_stream_tokens``.
    """
    if (os.environ.get("CUDALAB_PURE_PYTHON", "0") not in ("", "0")
            or os.environ.get("CUDALAB_FASTPAIR", "1") == "0"):
        return None
    try:
        from cudalab.allocator import _pair  # type: ignore[attr-defined]  # C, no stub
    except ImportError:
        return None
    try:
        api = getattr(_pair, "API", None)
        if api != 2:
            raise TypeError(f"API {api!r}, expected 2")
        twins: tuple[Callable[..., int], Callable[[int], None]] = _pair.bind(
            py_alloc, py_delete, DeviceCachingAllocator, PAIR_FIELDS, Block, TokenLock,
            allocators, active, devices_globals, observe_globals, custom, module_name)
    except Exception as exc:  # noqa: BLE001  (a stale build must not break allocation)
        warnings.warn(f"cudalab.allocator._pair ({_pair.__file__}) is not usable, using the "
                      f"Python pair: {exc}. Reinstall cudalab to rebuild it.", RuntimeWarning,
                      stacklevel=2)
        return None
    return twins
