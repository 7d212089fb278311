"""Expandable segments (``expandable_segments:True``): torch's ``ExpandableSegment`` in Python.

Instead of one ``mem_alloc`` per segment, the allocator reserves, once per (stream, pool),
a range of virtual addresses as large as 1.125 × the device's memory and maps physical pages
into it on demand (``vmm_reserve`` / ``vmm_create`` / ``vmm_map`` of the driver seam, i.e.
cuMemAddressReserve / cuMemCreate / cuMemMap + cuMemSetAccess). Pages are 2 MiB in the small
pool and ``large_segment_size`` (20 MiB) in the large pool. A request that finds no cached
block maps pages at the lowest address that has enough free + unmapped room, so the free tail
of the mapped range merges with the new pages and freed memory coalesces into a few large
blocks instead of many slivers of separate segments (torch's Note [Expandable Segments]).

Rules, as torch's DeviceCachingAllocator applies them when expandable segments are on:

* best fit by (stream, size, address), except that a block followed by unmapped space counts
  as its size plus that space ("expandable size"): starting from the smallest fitting block
  the search moves to the next larger one while that one's expandable size is smaller;
* split whenever the remainder is at least 512 bytes, in both pools;
* each mapping is one ``num_device_alloc`` and one ``segment_map`` trace entry and raises
  ``reserved_bytes``; ``segment`` and ``oversize_segments`` do not move, and blocks of
  expandable segments never count as ``inactive_split``;
* ``empty_cache`` (and the out-of-memory retry) unmaps every page that lies wholly inside a
  free block, after synchronising the segment's stream (cuMemUnmap does not wait for work
  in flight): one ``num_device_free`` and one ``segment_unmap`` entry per free block; the
  address range is given back once nothing of it is mapped;
* garbage collection and the ``max_split_size`` release step never free expandable blocks
  (torch PR #134338), so with every block expandable they free nothing.

Differences from torch: the setting is fixed for an allocator's lifetime (torch can turn it
off at run time and then serves new requests from ordinary segments); pages are not mapped
for peer devices and cannot be shared by IPC; where the backend cannot reserve 1.125 × the
device's memory at once (the simulator's host address space), smaller reservations are
tried down to what the request needs. Snapshots report each contiguous mapped range of a
segment as one segment with ``is_expandable: True``, like torch's.

Locking. Driver calls (reserve, create, map, unmap, stream synchronisation) run with the
device lock dropped, like ``mem_alloc`` in the native allocator. One mapping operation runs
at a time per allocator (others wait on a condition of the device lock, then search the
cache again, as torch's single lock would make them do); the blocks it works on are taken
out of the free lists (state "detached") while the lock is dropped, so cache hits and frees
on other threads carry on and never touch them.
"""

from __future__ import annotations

import threading
from bisect import bisect_left, bisect_right
from typing import Any

from cudalab import streams as _streams
from cudalab.allocator.base import stream_key
from cudalab.allocator.blocks import (
    ALLOCATED,
    DETACHED,
    FREE,
    KEY_SHIFT,
    PENDING,
    SNAPSHOT_STATES,
    UNMAPPED,
    Block,
    BlockPool,
    FreeList,
    SegmentDict,
)
from cudalab.allocator.caching import DeviceCachingAllocator
from cudalab.allocator.config import SMALL_BUFFER
from cudalab.allocator.expandable_segment import ExpandableSegment, address_space_size
from cudalab.allocator.policy import MAX_ALLOCATION_SIZE, allocation_size, check_size, round_size
from cudalab.errors import CudaError, OutOfMemoryError

__all__ = ["ExpandableCachingAllocator"]


class ExpandableCachingAllocator(DeviceCachingAllocator):
    """torch's DeviceCachingAllocator with ``expandable_segments:True`` (see the module doc).

    :func:`cudalab.allocator.registry.native_allocator` (and ``create_allocator``) make one
    of these when the settings ask for expandable segments.
    """

    # Its own fields in slots, so that its instance dict keeps at most 30 names, as
    # DeviceCachingAllocator's (see there: past that, no method call on it is specialised).
    __slots__ = ("_resolver_is_current", "_vm_cond", "_vm_busy", "_xsegs", "_xseg_starts",
                 "_unmapped", "_pages", "_vm_total")

    _memo_class_ok = False  # its own malloc does not know the pair memo
    _expandable = True

    name = "native"

    def __init__(self, backend: Any, device: int = 0, config: Any = None,
                 stream_resolver: Any = None):
        super().__init__(backend, device, config, stream_resolver)
        self._resolver_is_current = stream_resolver is None
        self._vm_cond = threading.Condition(self._lock)
        self._vm_busy = False
        #: Live segments, sorted by address (parallel list of their start addresses).
        self._xsegs: list[ExpandableSegment] = []
        self._xseg_starts: list[int] = []
        #: Unmapped blocks by (pool is small, stream key).
        self._unmapped: dict[tuple[bool, int], list[Block]] = {}
        self._pages: dict[bool, int] = {}
        self._vm_total = 0

    # ------------------------------------------------------------------ public API
    def malloc(self, size: Any, stream: Any = None) -> int:
        """A block of at least ``size`` bytes for ``stream`` (default: the current stream)."""
        if type(size) is not int or size <= 0 or size >= MAX_ALLOCATION_SIZE:
            size = check_size(size)
            if size == 0:
                return 0
        sobj = None
        if type(stream) is int:
            skey = stream
        elif stream is None:
            skey = self._default_stream()
        else:
            skey = stream_key(stream, self.device)
            sobj = stream
        lock = self._lock
        lock.acquire()
        try:
            if self.outstanding_events or self.pending_frees:
                self._process_pending()
            if size <= 512:
                rs = 512
            elif self._rounding:
                rs = round_size(size, self.config)
            else:
                rs = (size + 511) & -512
            pool = self.small if rs <= 1048576 else self.large
            if self._gc_on:
                pool.gc_calls += 1
            b = self._best_fit(rs, pool, skey)
            if b is None:
                if sobj is None and stream is None and self._resolver_is_current:
                    sobj = _streams.current_stream(self.device)
                b = self._malloc_slow(rs, pool, skey, sobj)
            # ---- torch's alloc_found_block; should_split: remainder >= 512 in both pools,
            # and no inactive_split accounting for expandable blocks
            bsize = b.size
            remaining = bsize - rs
            if remaining >= 512:
                b = self._carve(b, rs, pool)
                ptr = b.ptr
                bsize = rs
            else:
                ptr = b.ptr
            return self._account_alloc(pool, b, ptr, bsize, size, skey)
        finally:
            lock.release()

    def segments(self) -> list[SegmentDict]:
        """torch's snapshot segments: one per contiguous mapped range, ``is_expandable``."""
        with self._lock:
            self._vm_idle()
            if self.pending_frees:
                self._drain_pending_frees()
            heads = [b for b in self._all_blocks()
                     if b.prev is None or b.prev.state == UNMAPPED]
            out = []
            for head in heads:
                blocks = []
                total = alloc = active = req = 0
                b: Block | None = head
                while b is not None and b.state != UNMAPPED:
                    st = b.state
                    is_active = st == ALLOCATED or st == PENDING
                    blocks.append({
                        "address": b.ptr,
                        "size": b.size,
                        "requested_size": b.requested,
                        "state": SNAPSHOT_STATES[st],
                        "frames": [],
                    })
                    total += b.size
                    if st == ALLOCATED:
                        alloc += b.size
                    if is_active:
                        active += b.size
                        req += b.requested
                    b = b.next
                out.append({
                    "device": self.device,
                    "address": head.ptr,
                    "total_size": total,
                    "allocated_size": alloc,
                    "active_size": active,
                    "requested_size": req,
                    "stream": head.fl.stream,
                    "segment_type": "small" if head.fl.pool.is_small else "large",
                    "segment_pool_id": (0, 0),
                    "is_expandable": True,
                    "frames": [],
                    "blocks": blocks,
                })
            out.sort(key=lambda s: s["address"])
            return out

    def expandable_reservations(self) -> list[dict[str, Any]]:
        """The reserved ranges (address, size, page size, mapped pages, stream, pool)."""
        with self._lock:
            self._vm_idle()
            return [{"address": es.ptr, "size": es.size, "page_size": es.page,
                     "mapped_pages": sum(h is not None for h in es.handles),
                     "stream": es.stream, "segment_type": "small" if es.is_small else "large"}
                    for es in self._xsegs]

    def check_invariants(self) -> None:
        """Verify blocks, pages, free lists and counters (tests and debugging; O(blocks))."""
        b: Block | None
        with self._lock:
            self._vm_idle()
            if self.pending_frees:
                self._drain_pending_frees()
            recount = {name: {"n_alloc": 0, "b_alloc": 0, "b_req": 0, "n_seg": 0, "b_res": 0,
                              "n_split": 0, "b_split": 0, "n_pend": 0, "b_pend": 0}
                       for name in ("small", "large")}
            mapped_blocks = {id(b) for b in self._all_blocks()}
            unmapped_index = {id(b) for lst in self._unmapped.values() for b in lst}
            for (small, skey), lst in self._unmapped.items():
                for b in lst:
                    assert b.state == UNMAPPED, f"{b!r} is indexed as unmapped"
                    assert b.fl.pool.is_small == small and b.fl.stream == skey, \
                        f"{b!r} is indexed under the wrong pool or stream"
            assert self._xseg_starts == sorted(self._xseg_starts)
            assert self._xseg_starts == [es.ptr for es in self._xsegs]
            heads: dict[int, Block] = {}
            for b in [*self._all_blocks(), *(u for lst in self._unmapped.values() for u in lst)]:
                if b.prev is None:
                    es = self._segment_of(b.ptr)
                    assert b.ptr == es.ptr and es.ptr not in heads, \
                        f"{b!r} starts a chain inside {es!r}"
                    heads[es.ptr] = b
            seen = 0
            for es in self._xsegs:
                head = heads.get(es.ptr)
                assert head is not None, f"{es!r} has no block at its start"
                pool = head.fl.pool
                assert pool.is_small == es.is_small and head.fl.stream == es.stream
                rc = recount[pool.name]
                b, end, prev = head, es.ptr, None
                while b is not None:
                    seen += 1
                    assert b.prev is prev, f"broken links before {b!r}"
                    assert b.ptr == end, f"{b!r} does not start where its predecessor ends"
                    assert b.fl is head.fl, f"{b!r} changed stream or pool inside a segment"
                    assert b.size > 0
                    if prev is not None:
                        assert not (prev.state == FREE and b.state == FREE), \
                            f"free neighbours {prev!r} and {b!r} were not merged"
                        assert not (prev.state == UNMAPPED and b.state == UNMAPPED), \
                            f"unmapped neighbours {prev!r} and {b!r} were not merged"
                    first = (b.ptr - es.ptr) // es.page
                    if b.state == UNMAPPED:
                        assert id(b) in unmapped_index, f"{b!r} is unmapped but not indexed"
                        assert (b.ptr - es.ptr) % es.page == 0 and b.size % es.page == 0, \
                            f"{b!r} is not page aligned"
                        stop = first + b.size // es.page
                        assert all(h is None for h in es.handles[first:stop]), \
                            f"{b!r} has pages mapped"
                    else:
                        assert id(b) in mapped_blocks, f"{b!r} is linked but unknown"
                        stop = -(-(b.ptr + b.size - es.ptr) // es.page)
                        assert all(h is not None for h in es.handles[first:stop]), \
                            f"{b!r} lies on unmapped pages"
                        self._recount_block(b, rc)
                    end += b.size
                    prev, b = b, b.next
                assert end == es.end, f"blocks of {es!r} end at {end:#x}"
            assert seen == len(mapped_blocks) + len(unmapped_index), \
                "blocks outside every expandable segment"
            for pool in (self.small, self.large):
                for fl in pool.lists.values():
                    assert fl.keys == sorted(fl.keys), "free list keys out of order"
                    assert set(fl.keys) == set(fl.entries), "free list keys and entries differ"
                    for k, b in fl.entries.items():
                        if b is not None:
                            assert b.state == FREE and id(b) in mapped_blocks, \
                                f"stale cached {b!r}"
                            assert k == (b.size << KEY_SHIFT) | b.ptr, f"wrong key for {b!r}"
                rc = recount[pool.name]
                for code, value in rc.items():
                    assert getattr(pool, code) == value, (
                        f"{pool.name} pool {code} = {getattr(pool, code)}, recount {value}")
            assert self.stats.ov_seg == 0
            assert len(self.live) + len(self.pending_frees) == (
                recount["small"]["n_alloc"] + recount["large"]["n_alloc"])
            assert self.outstanding_events == sum(len(dq) for dq in self._events.values())

    # ------------------------------------------------------------------ search
    def _best_fit(self, rs: int, pool: BlockPool, skey: int) -> Block | None:
        """torch's get_free_block with expandable segments; takes the block out of its list."""
        fl = pool.lists.get(skey)
        if fl is None:
            return None
        keys = fl.keys
        entries = fl.entries
        n = len(keys)
        i = bisect_left(keys, rs << 64)
        b = None
        while i < n:  # skip stale keys
            b = entries[keys[i]]
            if b is not None:
                break
            i += 1
        if b is None:
            return None
        nx = b.next
        xs = b.size + nx.size if nx is not None and nx.state == UNMAPPED else b.size
        j = i + 1
        while j < n:  # prefer a larger block that cannot grow into unmapped space
            c = entries[keys[j]]
            if c is not None:
                nx = c.next
                cs = c.size + nx.size if nx is not None and nx.state == UNMAPPED else c.size
                if cs >= xs:
                    break
                b, xs, i = c, cs, j
            j += 1
        if self._split_limited and self._oversize_reject(rs, b.size):
            return None
        entries[keys[i]] = None
        return b

    def _search(self, rs: int, pool: BlockPool, skey: int) -> Block | None:
        if self._gc_on:
            pool.gc_calls += 1
        return self._best_fit(rs, pool, skey)

    # ------------------------------------------------------------------ free path
    def _free_block(self, b: Block) -> None:
        """torch's free_block: merge with free neighbours (never with unmapped space), back
        into the pool; expandable blocks are not counted as inactive_split."""
        if self._trace is not None:
            self._trace("free_completed", b.ptr, b.requested, b.fl.stream)
        fl = b.fl
        pool = fl.pool
        if b.state == PENDING:
            pool.n_pend -= 1
            pool.b_pend -= b.size
            self._n_pending -= 1
        entries = fl.entries
        p = b.prev
        if p is not None and p.state == FREE:
            entries[(p.size << 64) | p.ptr] = None
            b.ptr = p.ptr
            pp = b.prev = p.prev
            if pp is not None:
                pp.next = b
            b.size += p.size
            p.prev = p.next = None
            p.state = DETACHED
            self._spare.append(p)
        n = b.next
        if n is not None and n.state == FREE:
            entries[(n.size << 64) | n.ptr] = None
            nn = b.next = n.next
            if nn is not None:
                nn.prev = b
            b.size += n.size
            n.prev = n.next = None
            n.state = DETACHED
            self._spare.append(n)
        b.state = FREE
        b.gc_base = pool.gc_calls
        key = (b.size << 64) | b.ptr
        if key in entries:
            entries[key] = b
        else:
            fl.add(key, b)
        pool.b_req -= b.requested

    # ------------------------------------------------------------------ slow path
    def _malloc_slow(self, rs: int, pool: BlockPool, skey: int, sobj: Any = None) -> Block:
        """torch's ladder with expandable segments: callbacks, (GC), map pages, release
        every fully free page, map again, OutOfMemoryError."""
        alloc_size = allocation_size(rs, self._large_segment)
        if self._callbacks:
            b = self._run_callbacks_and_search(rs, pool, skey)
            if b is not None:
                return b
        if self._gc_on:
            self._garbage_collect()
        b = self._alloc_expandable(pool, skey, rs, alloc_size, False, sobj)
        # release_available_cached_blocks frees no expandable block: nothing to retry
        if b is None:
            self._release_cached_blocks()
            b = self._alloc_expandable(pool, skey, rs, alloc_size, True, sobj)
        if b is None:
            self._raise_oom(rs, alloc_size, skey)
        return b

    def _garbage_collect(self) -> None:
        """torch's GC never frees expandable blocks (PR #134338): nothing to do."""

    def _release_available_cached_blocks(self, pool: BlockPool, skey: int, rs: int) -> bool:
        return False  # oversize freeing skips expandable blocks (PR #134338)

    def _alloc_block(self, pool: BlockPool, skey: int, alloc_size: int, is_retry: bool,
                     pp: Any = None) -> Block | None:
        raise AssertionError("expandable segments grow by mapping pages, never by mem_alloc")

    def _vm_idle(self) -> None:
        """Wait (lock held) until no mapping operation is in flight."""
        while self._vm_busy:
            self._vm_cond.wait()

    def _alloc_expandable(self, pool: BlockPool, skey: int, rs: int, alloc_size: int,
                          is_retry: bool, sobj: Any) -> Block | None:
        """torch's alloc_block with expandable segments (None: out of memory)."""
        st = self.stats
        if is_retry:
            st.num_alloc_retries += 1
        if self._vm_busy:  # another thread is mapping: torch's lock would have waited
            self._vm_idle()
            b = self._best_fit(rs, pool, skey)
            if b is not None:
                return b
        if self._set_fraction and st.current("b_res") + alloc_size > self._allowed:
            return None
        self._vm_busy = True
        try:
            return self._try_allocate_expandable_block(pool, skey, rs, sobj)
        finally:
            self._vm_busy = False
            self._vm_cond.notify_all()

    def _try_allocate_expandable_block(self, pool: BlockPool, skey: int, rs: int,
                                       sobj: Any) -> Block | None:
        cand = self._find_expandable_block(pool, skey, rs, sobj)
        if cand is None:
            return None
        # The chain from the candidate alternates free and unmapped blocks; plan which
        # unmapped blocks get how many bytes mapped (torch's try_allocate_expandable_block).
        detached: list[Block] = []
        plan: list[tuple[Block, ExpandableSegment, int]] = []
        acc = 0
        b: Block | None = cand
        if cand.state == FREE:
            acc = cand.size
            detached.append(cand)
            b = cand.next
        while acc < rs and b is not None and b.state == UNMAPPED:
            es = self._segment_of(b.ptr)
            want = min(rs - acc, b.size)
            nbytes = -(-want // es.page) * es.page
            plan.append((b, es, nbytes))
            acc += nbytes
            if nbytes < b.size:
                break
            b = b.next
            if acc < rs and b is not None and b.state == FREE:
                acc += b.size
                detached.append(b)
                b = b.next
        if acc < rs:  # only a reservation smaller than the request gets here
            return None
        if not plan:
            self._fl_remove(cand)
            return cand
        for f in detached:
            self._fl_remove(f)
            f.state = DETACHED
        for u, _, _ in plan:
            self._index_remove(u)
            u.state = DETACHED
        done = 0
        lock = self._lock
        lock.release()
        try:
            for u, es, nbytes in plan:
                first = (u.ptr - es.ptr) // es.page
                if not es.map(first, first + nbytes // es.page):
                    break
                done += 1
        finally:
            lock.acquire()
            for f in detached:  # a neighbour may have been freed meanwhile: merge
                f.state = FREE
                self._merge_free(f)
                f.gc_base = pool.gc_calls
                self._fl_insert(f)
            last = None
            for k, (u, es, nbytes) in enumerate(plan):
                if k < done:
                    last = self._integrate_map(u, es, nbytes)
                else:
                    u.state = UNMAPPED
                    self._index_add(u)
        if done < len(plan) or last is None:  # (last is set when every mapping was done)
            return None
        self._fl_remove(last)
        return last

    def _find_expandable_block(self, pool: BlockPool, skey: int, rs: int,
                               sobj: Any) -> Block | None:
        """The lowest-address free/unmapped run with room for ``rs`` bytes, in a new
        segment if none has room (None when no address range can be reserved)."""
        lst = self._unmapped.get((pool.is_small, skey))
        if lst:
            for c in sorted(lst, key=lambda u: u.ptr):
                p = c.prev
                if p is not None and p.state == FREE:
                    c = p
                room = 0
                x: Block | None = c
                while room < rs and x is not None and (x.state == FREE or x.state == UNMAPPED):
                    room += x.size
                    x = x.next
                if room >= rs:
                    return c
        es = self._create_segment(pool, skey, rs, sobj)
        if es is None:
            return None
        b = Block(es.ptr, es.size, pool.free_list(skey))
        b.state = UNMAPPED
        self._index_add(b)
        i = bisect_left(self._xseg_starts, es.ptr)
        self._xseg_starts.insert(i, es.ptr)
        self._xsegs.insert(i, es)
        return b

    def _create_segment(self, pool: BlockPool, skey: int, rs: int,
                        sobj: Any) -> ExpandableSegment | None:
        """Reserve 1.125 × the device's memory (less, down to ``rs``, if the backend
        cannot), with the lock dropped."""
        backend, dev = self.backend, self.device
        lock = self._lock
        lock.release()
        try:
            page = self._pages.get(pool.is_small)
            if page is None:
                gran = backend.vmm_granularity(dev)
                want = SMALL_BUFFER if pool.is_small else self._large_segment
                page = -(-want // gran) * gran
                self._pages[pool.is_small] = page
            if not self._vm_total:
                self._vm_total = backend.mem_get_info(dev)[1]
            size = address_space_size(self._vm_total, page)
            need = -(-rs // page) * page
            if need > size:  # more than the device could ever map: do not reserve
                return None
            while True:
                try:
                    ptr = backend.vmm_reserve(dev, size)
                    break
                except OutOfMemoryError:
                    if size <= need:
                        return None
                    size = max(need, size // 2 // page * page)
        finally:
            lock.acquire()
        return ExpandableSegment(backend, dev, skey, sobj, pool.is_small, page, ptr, size)

    def _integrate_map(self, u: Block, es: ExpandableSegment, nbytes: int) -> Block:
        """torch's map_block bookkeeping once pages are mapped at the start of ``u``."""
        fl = u.fl
        pool = fl.pool
        if nbytes < u.size:
            r = self._new_block(u.ptr + nbytes, u.size - nbytes, fl)
            r.state = UNMAPPED
            r.prev = u
            r.next = u.next
            if u.next is not None:
                u.next.prev = r
            u.next = r
            u.size = nbytes
            self._index_add(r)
        mapped_ptr = u.ptr
        u.state = FREE
        self._merge_free(u)
        u.gc_base = pool.gc_calls
        self._fl_insert(u)
        self.stats.increase(pool, "b_res", nbytes)
        self.stats.num_device_alloc += 1
        if self._trace is not None:
            self._trace("segment_map", mapped_ptr, nbytes, fl.stream)
        return u

    # ------------------------------------------------------------------ release
    def _release_cached_blocks(self) -> None:
        """torch's release_cached_blocks: sync all events, then unmap every page lying
        wholly inside a free block (large pool first) and return empty reservations."""
        self._synchronize_and_free_events()
        self._vm_idle()
        self._vm_busy = True
        try:
            self._unmap_free_pages()
        finally:
            self._vm_busy = False
            self._vm_cond.notify_all()

    def _unmap_free_pages(self) -> None:
        plan: list[tuple[Block, ExpandableSegment, int, int]] = []
        for pool in (self.large, self.small):
            for b in pool.free_blocks():
                es = self._segment_of(b.ptr)
                first, stop = es.pages_inside(b.ptr, b.size)
                if first < stop:
                    plan.append((b, es, first, stop))
        for b, _, _, _ in plan:
            self._fl_remove(b)
            b.state = DETACHED
        counts: list[int] = []
        error: BaseException | None = None
        if plan:
            lock = self._lock
            lock.release()
            try:
                synced: set[int] = set()
                for _, es, first, stop in plan:
                    n = 0
                    if error is None:
                        try:
                            if id(es) not in synced:
                                es.synchronize()
                                synced.add(id(es))
                            n, error = es.unmap(first, stop)
                        except Exception as exc:  # noqa: BLE001 - re-raised below
                            error = exc
                    counts.append(n)
            finally:
                lock.acquire()
                counts += [0] * (len(plan) - len(counts))
                for (b, es, first, _), n in zip(plan, counts):
                    self._integrate_unmap(b, es, first, n)
        # Reservations with nothing mapped any more are given back (torch's
        # release_expandable_segment). cudalab also gives back those whose very first mapping
        # failed, which torch keeps; no statistic moves either way.
        released: list[ExpandableSegment] = []
        for lst in list(self._unmapped.values()):
            for u in list(lst):
                if u.prev is None and u.next is None:
                    es = self._segment_of(u.ptr)
                    self._index_remove(u)
                    u.state = DETACHED
                    self._spare.append(u)
                    i = bisect_left(self._xseg_starts, es.ptr)
                    del self._xseg_starts[i]
                    del self._xsegs[i]
                    released.append(es)
        for pool in (self.large, self.small):
            for fl in pool.lists.values():
                fl.sweep()
        if released:
            lock = self._lock
            lock.release()
            try:
                for es in released:
                    try:
                        es.release()
                    except CudaError as exc:
                        error = error or exc
            finally:
                lock.acquire()
        if error is not None:
            raise error

    def _integrate_unmap(self, b: Block, es: ExpandableSegment, first: int, n: int) -> None:
        """torch's unmap_block bookkeeping once ``n`` pages from ``first`` are unmapped."""
        fl = b.fl
        pool = fl.pool
        if n == 0:
            b.state = FREE
            self._merge_free(b)
            b.gc_base = pool.gc_calls
            self._fl_insert(b)
            return
        ustart = es.ptr + first * es.page
        usize = n * es.page
        before = ustart - b.ptr
        after = b.ptr + b.size - (ustart + usize)
        if before > 0:
            bf = self._new_block(b.ptr, before, fl)
            bf.prev = b.prev
            bf.next = b
            if b.prev is not None:
                b.prev.next = bf
            b.prev = bf
        if after > 0:
            af = self._new_block(ustart + usize, after, fl)
            af.prev = b
            af.next = b.next
            if b.next is not None:
                b.next.prev = af
            b.next = af
        b.ptr = ustart
        b.size = usize
        b.state = UNMAPPED
        for part in ((bf,) if before > 0 else ()) + ((af,) if after > 0 else ()):
            part.state = FREE
            self._merge_free(part)
            part.gc_base = pool.gc_calls
            self._fl_insert(part)
        for nb in (b.prev, b.next):  # merge with unmapped neighbours
            if nb is not None and nb.state == UNMAPPED:
                self._index_remove(nb)
                self._absorb(b, nb)
        self._index_add(b)
        self.stats.decrease(pool, "b_res", usize)
        self.stats.num_device_free += 1
        if self._trace is not None:
            self._trace("segment_unmap", ustart, usize, fl.stream)

    # ------------------------------------------------------------------ helpers (lock held)
    def _segment_of(self, ptr: int) -> ExpandableSegment:
        i = bisect_right(self._xseg_starts, ptr) - 1
        assert i >= 0 and ptr < self._xsegs[i].end, f"{ptr:#x} is in no expandable segment"
        return self._xsegs[i]

    def _new_block(self, ptr: int, size: int, fl: FreeList) -> Block:
        spare = self._spare
        b = spare.pop() if spare else Block(0, 0, fl)
        b.ptr = ptr
        b.size = size
        b.fl = fl
        b.prev = b.next = None
        b.requested = 0
        b.event_count = 0
        b.uses = None
        return b

    def _absorb(self, dst: Block, src: Block) -> None:
        """Merge neighbour ``src`` into ``dst`` (torch's try_merge_blocks, dst survives)."""
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        src.prev = src.next = None
        src.state = DETACHED
        self._spare.append(src)

    def _merge_free(self, b: Block) -> None:
        """Merge the (free, not yet listed) block ``b`` with every free neighbour."""
        while b.prev is not None and b.prev.state == FREE:
            self._fl_remove(b.prev)
            self._absorb(b, b.prev)
        while b.next is not None and b.next.state == FREE:
            self._fl_remove(b.next)
            self._absorb(b, b.next)

    @staticmethod
    def _fl_remove(b: Block) -> None:
        entries = b.fl.entries
        key = (b.size << KEY_SHIFT) | b.ptr
        if entries.get(key) is b:
            entries[key] = None

    @staticmethod
    def _fl_insert(b: Block) -> None:
        fl = b.fl
        key = (b.size << KEY_SHIFT) | b.ptr
        if key in fl.entries:
            fl.entries[key] = b
        else:
            fl.add(key, b)

    def _index_add(self, b: Block) -> None:
        key = (b.fl.pool.is_small, b.fl.stream)
        lst = self._unmapped.get(key)
        if lst is None:
            lst = self._unmapped[key] = []
        lst.append(b)

    def _index_remove(self, b: Block) -> None:
        key = (b.fl.pool.is_small, b.fl.stream)
        lst = self._unmapped[key]
        for i, u in enumerate(lst):
            if u is b:
                del lst[i]
                break
        if not lst:
            del self._unmapped[key]

