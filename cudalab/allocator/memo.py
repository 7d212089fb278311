"""The pair memo of the native caching allocator (a mixin of ``DeviceCachingAllocator``).

A loop that allocates and frees the same size on the same stream (a temporary buffer)
makes torch split a cached block and merge it back on every iteration. The memo defers such
a free, so the next matching malloc gets the block back with no split, merge or counter
update (a "hit"); everything else first flushes the memo, which performs the deferred work
and adds what the hits would have added to torch's counters.

Its hit paths (the *pure hit* of malloc and the lock-free free of a hit) are part of the
cache-hit path and live in :mod:`cudalab.allocator.caching` with it (benchmarks/allocator.py
rows "cache-hit pair"); this module sets the memo up, writes out its history stamps and
flushes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cudalab import streams as _streams
from cudalab.allocator.blocks import ALLOCATED, DEFERRED, FREE, Block
from cudalab.allocator.cache_state import NO_STREAM, CacheState

if TYPE_CHECKING:
    from cudalab.allocator.hooks import AllocatorTrace, CompactTrace

__all__ = ["PairMemo"]

_Stream = _streams.Stream


class PairMemo(CacheState):
    """The pair memo's set-up, history log and flush (see the module doc)."""

    # A loop that allocates and frees the same size on the same stream (a temporary buffer)
    # makes torch split a cached block and merge it back on every iteration. When a block is
    # freed right after the malloc that took it by a plain best fit, with nothing in
    # between, torch's free would restore exactly the structure that malloc found, so the next
    # request of the same rounded size on that stream would get the same block, split the
    # same way. The free is therefore deferred: the block stays physically split
    # (state DEFERRED) while the allocator is logically back in that structure, and a
    # matching malloc hands it out again with no split, merge or counter update ("hits").
    # Any other operation first calls _flush_memo, which performs the deferred free for real
    # and adds what the hit pairs would have added to torch's counters: every current and
    # peak is as after the first pair, except requested bytes (tracked per hit), so only
    # accumulated values and the requested-bytes peaks need the hit count.
    def _establish_memo(self, b: Block) -> bool:
        """Defer the free of ``b`` (allocated by the last malloc, by a plain best fit); False
        if it was freed the plain way instead (its trace entries then already written)."""
        n = b.next
        r = n if n is not None and n.state == FREE else None  # the remainder the malloc split off
        has_r = r is not None
        rsz = r.size if r is not None else 0
        after = r.next if r is not None else n
        merged_split = b.prev is not None or after is not None
        if b.prev is not None and b.prev.state == FREE:  # cannot happen after a best fit
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
        self._memo_rem = r
        self._memo_req0 = req
        # a pure hit: the same request again, nothing for the remainder to remember
        self._hit_size = req if r is None or r.requested == req else -1
        sobj = self._last_stream
        self._hit_stream = sobj if type(sobj) is _Stream else NO_STREAM
        # stream=None names the memo's stream in every thread while none has a stream
        # other than the default current (streams.custom_stream_tokens empty)
        self._hit_none = self._memo_stream == 0 and self._tls_streams
        self._memo_hits = 0
        self._memo_req = 0  # sum over hits of (requested - req0)
        self._memo_req_max = req
        self._last = None
        b.state = DEFERRED
        self.memo_block = b
        self._ready.append(b)
        # With a history hook whose entries carry nothing but a stamp (the time, and the
        # stack when stacks are recorded; no NVTX range), pairs of the memo's first request
        # are logged as (free stamp, alloc stamp) pairs, 0 for none, and written out by
        # _spill_log before any other entry.
        # (The compact half of the hook protocol is optional: hooks.CompactTrace.)
        trace: CompactTrace | None = self._trace  # type: ignore[assignment]
        if trace is not None and getattr(trace, "compact", None) is not None and trace.compact_ok():
            # bounded like the history's ring: stamps older than what it keeps are dropped
            cap = trace.capacity
            log = trace.new_log(None if cap is None or cap >= 1 << 60 else 2 * cap)
            self._hit_log = log
            self._hit_ap = log.append
            self._hit_rec = getattr(log, "hit", None)  # one call for a pure hit's two stamps
            self._hit_now = trace.now
            self._hit_fnow = trace.free_now
        return True

    def _spill_log(self) -> None:
        """Write the memo pairs logged as stamps to the history (lock held)."""
        log = self._hit_log
        if log:
            # set only while the hook has the compact half (see _establish_memo)
            trace: CompactTrace | None = self._trace  # type: ignore[assignment]
            memo = self.memo_block
            if trace is not None and memo is not None:
                trace.compact(memo.ptr, self._memo_req0, self._memo_stream, log)
            log.clear()

    def _trace_free(self, b: Block) -> None:
        """The history entries of a deferred free: requested and completed, as torch's."""
        trace: AllocatorTrace = self._trace  # type: ignore[assignment]  # (callers tested it)
        stream = b.fl.stream
        trace("free_requested", b.ptr, b.requested, stream)
        trace("free_completed", b.ptr, b.requested, stream)

    def forget_stream(self, stream: Any) -> None:
        """``stream`` was closed: a pure hit must not hand memory out on it any more (its
        test is ``stream is self._hit_stream``; a closed stream is never set up as one again:
        it is no longer of type Stream). The pair memo itself is flushed, as any other
        change of plan does."""
        if self._hit_stream is stream:
            with self._lock:
                if self._hit_stream is stream:
                    if self.memo_block is not None:
                        self._flush_memo()
                    self._hit_stream = NO_STREAM

    def turn_off_pair_memo(self) -> None:
        """Defer no malloc+free pair from now on (the deferred one, if any, is done now).

        For callers that read the counters after every call (a trace replay, see
        :class:`~cudalab.allocator.replay_target.ReplayTarget`): with the memo on, a hit
        pair leaves them as they were until the next flush. Results are the same either way;
        the memo only saves work. Settings changed later (``reconfigure``) keep it off.
        """
        with self._lock:
            self._flush_memo()
            self._last = None
            self._memo_class_ok = False  # (the instance's: _apply_settings reads it)
            self._memo_ok = False

    def _flush_memo(self) -> None:
        """Make the memo's deferred work real (lock held); no-op without a memo."""
        b = self.memo_block
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
            self._hit_log = self._hit_ap = self._hit_rec = None
        b.tfree = 0
        self.memo_block = None
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
        b.state = ALLOCATED
        if deferred:
            trace = self._trace
            self._trace = None  # the free was recorded (or not) when it was deferred
            try:
                self._free_requested(b)
            finally:
                self._trace = trace
