"""The slow path of the native caching allocator (a mixin of ``DeviceCachingAllocator``):
torch's ladder on a cache miss, from free-memory callbacks and garbage collection to new
segments, the release of cached blocks, and finally :class:`cudalab.OutOfMemoryError` with
torch's message.

Driver calls (``mem_alloc``, ``mem_free``, event synchronisation) run with the allocator's
lock dropped; blocks in flight are detached from every pool first, so nothing another
thread can see changes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from cudalab.allocator.base import oom_text
from cudalab.allocator.blocks import DETACHED, KEY_SHIFT, Block, BlockPool, FreeList
from cudalab.allocator.cache_state import CacheState
from cudalab.allocator.hooks import report_pool_segment
from cudalab.allocator.oom_observers import notify_out_of_memory
from cudalab.allocator.oom_observers import observers as _oom_observers  # never rebound
from cudalab.allocator.policy import allocation_size
from cudalab.errors import CudaError, OutOfMemoryError

if TYPE_CHECKING:
    from cudalab.allocator.private_pool import PrivatePool

__all__ = ["SlowPath"]


class SlowPath(CacheState):
    """Cache misses: new segments, the release ladder, out-of-memory."""

    # (defined in allocator.pools)
    _pool_segment_alloc: Callable[[PrivatePool, int, int], int | None]
    _search_use_on_oom: Callable[[int, BlockPool, int], Block | None]

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
        if b is None and self._pools:
            b = self._search_use_on_oom(rs, pool, skey)
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
        return None if fl is None else self._best_fit_in(fl, rs)

    def _best_fit_in(self, fl: FreeList, rs: int) -> Block | None:
        """torch's get_free_block in one free list (the default pools' or a private
        pool's); takes the block out of it. (malloc's hit path inlines the same search.)"""
        keys, entries = fl.keys, fl.entries
        i = bisect_left(keys, rs << KEY_SHIFT)
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
        if self.pending_frees or self.outstanding_events:
            self._process_pending()
        return self._search(rs, pool, skey)

    def _alloc_block(self, pool: BlockPool, skey: int, alloc_size: int, is_retry: bool,
                     pp: PrivatePool | None = None) -> Block | None:
        """torch's ``alloc_block``: a new segment, or None on a (soft) out-of-memory.

        ``pp``: the private pool the segment is for (its free lists; its allocator, if it
        has one, instead of the driver; its segment count)."""
        st = self.stats
        if is_retry:
            st.num_alloc_retries += 1
        if self._set_fraction and st.current("b_res") + alloc_size > self._allowed:
            return None
        lock = self._lock
        lock.release()
        try:
            if pp is not None and pp.allocator is not None:
                ptr = self._pool_segment_alloc(pp, alloc_size, skey)
            else:
                ptr = self.backend.mem_alloc(self.device, alloc_size)
        except OutOfMemoryError:
            ptr = None
        finally:
            lock.acquire()
        if ptr is None:
            return None
        if pp is None:
            b = Block(ptr, alloc_size, pool.free_list(skey))
        else:
            b = Block(ptr, alloc_size, pp.free_list(pool, skey))
            pp.segment_count += 1
        st.increase(pool, "n_seg", 1)
        st.increase(pool, "b_res", alloc_size)
        if alloc_size >= self._max_split:
            st.increase_oversize_segments()
        st.num_device_alloc += 1
        if self._trace is not None:
            if pp is not None:
                report_pool_segment(self._trace, ptr, alloc_size, pp.id, True)
            self._trace("segment_alloc", ptr, alloc_size, skey)
        return b

    def _detach_segment(self, b: Block) -> int:
        """Take a whole cached segment out of its pool (stats as torch's release_block)."""
        fl = b.fl
        fl.entries[(b.size << KEY_SHIFT) | b.ptr] = None
        b.state = DETACHED
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
        """torch's ``release_cached_blocks``: sync all events, release unsplit cached blocks
        (only while no pool is allocated to), then the free segments of freeable private
        pools (see :mod:`cudalab.allocator.pools`)."""
        if not self._captures:
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
        if self._freeable:
            self._release_freeable_pools()

    def _synchronize_and_free_events(self) -> None:
        self.stats.num_sync_all_streams += 1
        if not self._events:
            return
        events, self._events = self._events, {}
        self.outstanding_events = 0
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
                            self.outstanding_events += 1
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

    def _raise_oom(self, rs: int, alloc_size: int, skey: int) -> NoReturn:
        free, total = self.backend.mem_get_info(self.device)
        st = self.stats
        if self._trace is not None:
            self._trace("oom", free, rs, skey)
        st.num_ooms += 1
        in_pools = sum(b.size for pp in self._pools.values() for fl in pp.free_lists()
                       for b in fl.blocks())  # torch: the free blocks of the graph pools
        exc = OutOfMemoryError(text=oom_text(
            self.device, alloc_size, free, total, st.current("b_alloc"), st.current("b_res"),
            self._allowed if self._set_fraction else None, in_pools))
        if _oom_observers:  # torch calls them with the allocator's lock released
            allowed = self._allowed if self._set_fraction else total
            lock = self._lock
            lock.release()
            try:
                notify_out_of_memory(self.device, alloc_size, allowed, free)
            finally:
                lock.acquire()
        raise exc
