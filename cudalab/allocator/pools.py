"""Private memory pools of the caching allocator: torch's graph pools and ``MemPool``\\ s.

A *private pool* is a set of segments of one device that only allocations routed to it may
use (c10's ``PrivatePool`` in ``CUDACachingAllocator.cpp``). CUDA graphs route the
allocations of a capture to one (so replays find their memory where the capture left it);
``MemPool`` + ``use_mem_pool`` route the current thread's allocations to a user pool.

Ids (:mod:`~cudalab.allocator.private_pool`, with the pool record; re-exported here). A pool
id is a pair ``(int, int)``; ``(0, 0)`` is the default pool ("no pool"). Two
process-global counters start at 1, as in torch (``aten/src/ATen/core/MemPool.cpp``):
pools created by the user (:func:`graph_pool_handle`, ``MemPool()``) get ``(0, n)``, pools a
graph creates for itself (:func:`new_graph_pool_id`) get ``(n, 0)``.

The allocator's side (:class:`PrivatePools`, a mixin of ``DeviceCachingAllocator``):

* ``begin_allocate_to_pool(id, filter)`` creates the pool (use count 1) or adds a use, then
  pushes ``(id, filter)`` on the list of captures underway; ``filter(stream_key) -> bool``
  picks the allocations it routes (None: those of the calling thread). Routing walks the list
  newest first and takes the first pool whose filter accepts the allocation's stream;
  ``end_allocate_to_pool(id)`` pops it (the use count does not change).
* ``release_pool(id)``: one use less; at 0 the pool is *freeable*: the next ``empty_cache``
  releases its unsplit free segments and forgets the pool once it has none left (a block
  still allocated keeps its segment, which is released by the first ``empty_cache`` after it
  is freed).
* A private pool has its own free lists (per small/large pool and stream), so memory freed
  in it is reused only by allocations routed to it, and a block of it is never handed to an
  ordinary allocation. Its blocks are counted in the ordinary statistics (torch 2.11 keeps no
  per-pool counters in ``memory_stats()``): the free lists' ``pool`` is the device's small or
  large :class:`~cudalab.allocator.blocks.BlockPool`, their ``owner`` the private pool.
* While any pool is being allocated to (``captures_underway`` non-empty), device-wide:
  record_stream events are not polled (``cudaEventQuery`` is illegal in a capture), the
  out-of-memory ladder does not release cached blocks, ``empty_cache`` releases only the
  freeable private pools, and the pair memo is off. The cache-hit path pays one test of
  ``_captures`` for all of it.

Differences from torch: ``begin_allocate_to_pool`` checks "already recording" before it
adds a use (torch adds the use first, and leaks it when the check fails); the
``max_split_size`` release step, the free-memory callbacks and garbage collection are not
run while pools are allocated to (torch runs the last two, which would free memory inside a
capture); expandable segments (``expandable_segments:True``) do not support private pools
yet (NotImplementedError).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from cudalab.allocator.blocks import FREE, Block, BlockPool, FreeList
from cudalab.allocator.cache_state import CacheState
from cudalab.allocator.config import SMALL_SIZE
from cudalab.allocator.hooks import report_pool_segment
from cudalab.allocator.policy import allocation_size, round_size
from cudalab.allocator.private_pool import (  # (re-exported: the ids' historical home)
    DEFAULT_POOL_ID,
    KIND_GRAPH,
    KIND_USER,
    CurrentThreadFilter,
    PoolFilter,
    PrivatePool,
    SegmentSource,
    check_pool_id,
    graph_pool_handle,
    new_graph_pool_id,
    pool_kind,
)
from cudalab.errors import CudaError, OutOfMemoryError

__all__ = ["DEFAULT_POOL_ID", "KIND_GRAPH", "KIND_USER", "CurrentThreadFilter", "PoolFilter",
           "PrivatePool", "PrivatePools", "SegmentSource", "check_pool_id", "graph_pool_handle",
           "new_graph_pool_id", "pool_kind"]


class PrivatePools(CacheState):
    """The private pools of one caching allocator (a mixin; fields in ``CacheState``)."""

    # ------------------------------------------------------------------ torch's API
    def create_or_incref_pool(self, pool_id: Any, allocator: SegmentSource | None = None
                              ) -> None:
        """torch's ``createOrIncrefPool``: make the pool (use count 1) or add one use.

        Parameters
        ----------
        pool_id : tuple of (int, int)
            The pool's id.
        allocator : SegmentSource, optional
            Only when the pool is created: where its segments come from (a
            :class:`~cudalab.allocator.pluggable.PluggableAllocator`).

        Raises
        ------
        TypeError, ValueError
            A bad ``pool_id``; an ``allocator`` for a pool that exists already.
        RuntimeError
            The pool was released (use count 0) and still holds segments.
        """
        pid = check_pool_id(pool_id)
        with self._lock:
            self._incref(pid, allocator)

    def begin_allocate_to_pool(self, pool_id: Any, filter: PoolFilter | None = None) -> None:  # noqa: A002 - torch's name
        """torch's ``beginAllocateToPool``: route matching allocations to the pool ``pool_id``.

        Creates the pool or adds a use (:meth:`create_or_incref_pool`), then pushes it on the
        captures underway; routing tries them newest first.

        Parameters
        ----------
        pool_id : tuple of (int, int)
            The pool's id.
        filter : callable, optional
            ``filter(stream_key) -> bool`` (the allocation's stream as an int): whether an
            allocation goes to this pool. None: the allocations of the calling thread
            (``use_mem_pool``'s rule).

        Raises
        ------
        TypeError, ValueError
            A bad ``pool_id`` or ``filter``.
        RuntimeError
            ``beginAllocateToPool: already recording to mempool_id`` (torch's text).
        NotImplementedError
            With expandable segments.
        """
        pid = check_pool_id(pool_id)
        if filter is None:
            filter = CurrentThreadFilter()  # noqa: A001
        elif not callable(filter):
            raise TypeError(f"filter must be a callable (stream key -> bool) or None, got "
                            f"{type(filter).__name__} {filter!r}")
        if self._expandable:
            raise NotImplementedError(
                "private memory pools (CUDA graphs, MemPool) are not supported with "
                "expandable_segments:True yet; set CUDALAB_ALLOC_CONF=expandable_segments:False")
        with self._lock:
            for p, _ in self._captures:
                if p == pid:
                    raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
            self._flush_memo()  # the memo is off while pools are allocated to
            self._last = None
            self._incref(pid, None)
            self._captures.append((pid, filter))
            self._memo_ok = False

    def end_allocate_to_pool(self, pool_id: Any) -> None:
        """torch's ``endAllocateToPool``: stop routing to ``pool_id`` (its use count stays).

        Raises
        ------
        TypeError, ValueError
            A bad ``pool_id``.
        RuntimeError
            ``endAllocatePool: not currently recording to mempool_id`` (torch's text).
        """
        pid = check_pool_id(pool_id)
        with self._lock:
            caps = self._captures
            for i in range(len(caps)):
                if caps[i][0] == pid:
                    del caps[i]
                    break
            else:
                raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
            if not caps:
                self._last = None
                self._memo_ok = self._memo_class_ok and not self._split_limited
                deferred = self._deferred_uses
                while deferred:  # frees that waited for the capture's end: their events now
                    b, uses = deferred.pop(0)
                    self._record_use_events(b, uses)

    def release_pool(self, pool_id: Any) -> None:
        """torch's ``releasePool``: one use less; at 0 the pool's memory becomes releasable
        by :meth:`empty_cache` (its segments once all their blocks are free).

        Never waits for the allocator's lock: a graph's or a MemPool's finalizer may call it
        inside an allocator call of its own thread (garbage collection runs anywhere), so
        when the lock is busy the release is queued and made by the next holder, as
        ``free`` queues its frees (:meth:`get_pool_use_count` already counts it).

        Raises
        ------
        TypeError, ValueError
            A bad ``pool_id``, or no such pool on this device.
        RuntimeError
            The pool was released already (use count 0).
        """
        self._release(check_pool_id(pool_id), False)

    def drop_pool(self, pool_id: Any) -> None:
        """torch's ``~MemPool``: no ``use_on_oom`` any more, :meth:`release_pool`, then
        :meth:`empty_pool_cache` (the last only when the lock was free: a queued drop
        leaves the pool's memory to the next ``empty_cache()``). Never waits for the lock.

        Raises
        ------
        TypeError, ValueError, RuntimeError
            As :meth:`release_pool`.
        """
        self._release(check_pool_id(pool_id), True)

    def get_pool_use_count(self, pool_id: Any) -> int:
        """torch's ``getPoolUseCount``: the pool's use count (0 if there is no such pool)."""
        pid = check_pool_id(pool_id)
        pp = self._pools.get(pid)
        if pp is None:
            return 0
        queued = sum(1 for p, _ in list(self._pending_releases) if p == pid)
        return max(pp.use_count - queued, 0)

    def set_pool_options(self, pool_id: Any, use_on_oom: bool | None = None,
                         no_split: bool | None = None) -> None:
        """torch's ``setUseOnOOM`` / ``setNoSplit`` for an existing pool.

        Raises
        ------
        ValueError
            No such pool on this device.
        """
        pid = check_pool_id(pool_id)
        with self._lock:
            self._settle_releases()
            pp = self._pools.get(pid)
            if pp is None:
                raise ValueError(f"device {self.device} has no private pool {pid}")
            if use_on_oom is not None:
                pp.use_on_oom = bool(use_on_oom)
            if no_split is not None:
                pp.no_split = bool(no_split)

    def empty_pool_cache(self, pool_id: Any) -> None:
        """torch's ``emptyCache(mempool_id)``: release the free segments of that pool only,
        if it is freeable (use count 0); forget it once it holds no segment."""
        pid = check_pool_id(pool_id)
        with self._lock:
            self._settle_releases()
            self._flush_memo()
            if self.pending_frees:
                self._drain_pending_frees()
            self._release_freeable_pools(pid)

    def pools(self) -> list[dict[str, Any]]:
        """The private pools of this device, for reports (``%cuda_memory pools``).

        Returns
        -------
        list of dict
            One dict per pool, by id: ``id``, ``kind`` ("graph"/"user"), ``use_count``,
            ``segments``, ``reserved_bytes``, ``allocated_bytes``, ``freeable``, ``routed``
            (allocations are routed to it now).
        """
        if not self._pools:
            return []  # (the dashboard's sampler asks every tick)
        with self._lock:
            self._settle_releases()
            self._flush_memo()
            if self.pending_frees:
                self._drain_pending_frees()
            out: dict[tuple[int, int], dict[str, Any]] = {pid: {"id": pid, "kind": pp.kind, "use_count": pp.use_count,
                         "segments": 0, "reserved_bytes": 0, "allocated_bytes": 0,
                         "freeable": pid in self._freeable,
                         "routed": any(p == pid for p, _ in self._captures)}
                   for pid, pp in self._pools.items()}
            for b in self._all_blocks():
                owner = b.fl.owner
                if owner is None:
                    continue
                row = out.get(owner.id)
                if row is None:  # (cannot happen: a pool with blocks is kept)
                    continue
                row["reserved_bytes"] += b.size
                if b.prev is None:
                    row["segments"] += 1
                if b.state != FREE:  # allocated, or awaiting record_stream events
                    row["allocated_bytes"] += b.size
            return [out[k] for k in sorted(out)]

    # ------------------------------------------------------------------ internals
    def _release(self, pid: tuple[int, int], drop: bool) -> None:
        """release_pool / drop_pool: checked first (without the lock), then made now, or
        queued when the lock is busy (see release_pool)."""
        pp = self._pools.get(pid)
        if pp is None:
            raise ValueError(f"release_pool: device {self.device} has no private pool {pid}")
        if self.get_pool_use_count(pid) <= 0:
            raise RuntimeError(f"release_pool: pool {pid} of device {self.device} was "
                               "released already (use count 0)")
        lock = self._lock
        if not lock.acquire(False):
            # Busy: another thread, or a finalizer inside this thread's own allocator call.
            self._pending_releases.append((pid, drop))
            if lock.acquire(False):  # the holder left meanwhile: make it now
                try:
                    self._settle_releases()
                finally:
                    lock.release()
            return
        try:
            self._settle_releases()
            self._release_locked(pid, drop)
            if drop:
                self._flush_memo()
                if self.pending_frees:
                    self._drain_pending_frees()
                self._release_freeable_pools(pid)
        finally:
            lock.release()

    def _release_locked(self, pid: tuple[int, int], drop: bool) -> None:
        """One use of ``pid`` less (lock held); a pool gone or at 0 is left alone (a queued
        release that a race made stale)."""
        pp = self._pools.get(pid)
        if pp is None or pp.use_count <= 0:
            return
        if drop:
            pp.use_on_oom = False
        pp.use_count -= 1
        if pp.use_count == 0:
            pp.use_on_oom = False
            self._freeable[pid] = pp

    def _settle_releases(self) -> None:
        """Make the releases queued while the lock was busy (lock held)."""
        dq = self._pending_releases
        while dq:
            pid, drop = dq.popleft()
            self._release_locked(pid, drop)

    def _incref(self, pid: tuple[int, int], allocator: SegmentSource | None) -> None:
        """create_or_incref_pool with the lock held."""
        self._settle_releases()
        pp = self._pools.get(pid)
        if pp is None:
            self._pools[pid] = PrivatePool(pid, allocator)
            return
        if allocator is not None:
            raise ValueError(f"pool {pid} exists already on device {self.device}: an allocator "
                             "can only be given when the pool is created")
        if pp.use_count <= 0:
            raise RuntimeError(
                f"pool {pid} of device {self.device} was released (use count 0) and still "
                "holds memory; it cannot be used again (call empty_cache() once its blocks "
                "are freed, or use a new pool id)")
        pp.use_count += 1

    def _route(self, skey: int) -> PrivatePool | None:
        """The pool the newest matching capture routes ``skey``'s allocations to (lock held)."""
        caps = self._captures
        for i in range(len(caps) - 1, -1, -1):
            pid, filt = caps[i]
            if filt(skey):
                return self._pools[pid]
        return None

    def _malloc_routed(self, size: int, skey: int) -> int:
        """malloc while some pool is allocated to (lock held; called by malloc's plain path).

        torch's malloc with captures underway: no event polling, the routed pool's free
        lists (or the default ones when no filter matches), no release of cached blocks on a
        miss, torch's split rule unless the pool is ``no_split``."""
        if self.pending_frees:
            self._drain_pending_frees()
        rs = round_size(size, self.config)  # (malloc's hit path inlines it)
        small = rs <= SMALL_SIZE
        pool = self.small if small else self.large
        pp = self._route(skey)
        if self._gc_on:
            pool.gc_calls += 1
        fl = (pool.lists if pp is None else pp.lists_of(pool)).get(skey)
        b = None if fl is None else self._best_fit_in(fl, rs)
        if b is None:
            b = self._malloc_slow_routed(rs, pool, skey, pp)
        bsize = b.size
        remaining = bsize - rs
        was_split = b.prev is not None or b.next is not None
        st = self.stats
        if (not (pp is not None and pp.no_split)
                and ((remaining >= 512) if small
                     else (remaining > 1048576 and rs < self._max_split))):
            nb = self._carve(b, rs, pool)
            if was_split:
                st.decrease(pool, "b_split", rs)
            else:
                st.increase(pool, "n_split", 1)
                st.increase(pool, "b_split", remaining)
            b = nb
            bsize = rs
        elif was_split:
            st.decrease(pool, "n_split", 1)
            st.decrease(pool, "b_split", bsize)
        return self._account_alloc(pool, b, b.ptr, bsize, size, skey)

    def _malloc_slow_routed(self, rs: int, pool: BlockPool, skey: int,
                            pp: PrivatePool | None) -> Block:
        """The miss ladder with captures underway: no free-memory callback, no garbage
        collection and no release of cached blocks (each would free memory, which a capture
        forbids); a default allocation may fall back on use_on_oom pools."""
        alloc_size = allocation_size(rs, self._large_segment)
        b = self._alloc_block(pool, skey, alloc_size, False, pp)
        if b is None and pp is None:
            b = self._search_use_on_oom(rs, pool, skey)
        if b is None:
            self._raise_oom(rs, alloc_size, skey)
        return b

    def _search_use_on_oom(self, rs: int, pool: BlockPool, skey: int) -> Block | None:
        """An ordinary allocation found no memory: a free block of a ``use_on_oom`` pool
        (lock held; the block stays the pool's, and returns to it when freed)."""
        for pp in self._pools.values():
            if pp.use_on_oom:
                fl = pp.lists_of(pool).get(skey)
                if fl is not None:
                    b = self._best_fit_in(fl, rs)
                    if b is not None:
                        return b
        return None

    def _pool_segment_alloc(self, pp: PrivatePool, size: int, skey: int) -> int | None:
        """A segment from the pool's own allocator (lock dropped by the caller); None when
        it is out of memory (it returned 0 or raised OutOfMemoryError)."""
        spec = pp.allocator
        assert spec is not None
        try:
            ptr = spec.malloc_fn(size, self.device, skey)
        except OutOfMemoryError:
            return None
        if isinstance(ptr, bool) or not isinstance(ptr, int):
            raise TypeError(f"the allocator of pool {pp.id} returned {type(ptr).__name__} "
                            f"{ptr!r}, not a device pointer (int)")
        return int(ptr) if ptr > 0 else None

    def _release_freeable_pools(self, only: tuple[int, int] | None = None) -> None:
        """torch's loop over graph_pools_freeable in release_cached_blocks (lock held): the
        unsplit free segments of every freeable pool (or of ``only``) go back; a pool with
        no segment left is forgotten."""
        for pid, pp in list(self._freeable.items()):
            if only is not None and pid != only or any(p == pid for p, _ in self._captures):
                continue  # (a pool still routed to stays, even at use count 0)
            self._release_pool_segments(pp)
            if pp.segment_count == 0 and pp.use_count == 0:
                self._freeable.pop(pid, None)
                if self._pools.get(pid) is pp:
                    del self._pools[pid]

    def _release_pool_segments(self, pp: PrivatePool) -> None:
        """Release the pool's unsplit free blocks (whole segments), lock dropped for the
        driver (or the pool's allocator)."""
        segs: list[tuple[int, int, int]] = []
        for fl in list(pp.free_lists()):
            for b in fl.blocks():
                if b.prev is None and b.next is None:
                    size = b.size
                    segs.append((self._detach_segment(b), size, fl.stream))
                    if self._trace is not None:
                        report_pool_segment(self._trace, segs[-1][0], size, pp.id, False)
            fl.sweep()
        if not segs:
            return
        pp.segment_count -= len(segs)
        spec = pp.allocator
        lock = self._lock
        lock.release()
        try:
            error: CudaError | None = None
            for ptr, size, stream in segs:
                if spec is not None:
                    spec.free_fn(ptr, size, self.device, stream)
                    continue
                try:
                    self.backend.mem_free(self.device, ptr)
                except CudaError as exc:  # keep going: the rest can still be returned
                    error = error or exc
            if error is not None:
                raise error
        finally:
            lock.acquire()

    def _private_free_lists(self) -> Iterator[FreeList]:
        """Every free list of every private pool (lock held)."""
        for pp in self._pools.values():
            yield from pp.free_lists()
