"""The snapshot-facing readers and the self-check of the native caching allocator (a mixin of
``DeviceCachingAllocator``): ``segments()`` (torch's ``memory_snapshot()`` segments),
``largest_free_block()``, ``check_invariants()`` and the walk over every block. None of it is
on a hot path; each reader flushes the pair memo first, under the lock.
"""

from __future__ import annotations

from typing import Any

from cudalab.allocator.blocks import (
    ALLOCATED,
    FREE,
    KEY_SHIFT,
    PENDING,
    SNAPSHOT_STATES,
    Block,
    FreeList,
    SegmentDict,
)
from cudalab.allocator.cache_state import CacheState

__all__ = ["Inspection"]


class Inspection(CacheState):
    """Readers of the allocator's structure (snapshots, tests, debugging)."""

    def largest_free_block(self) -> int:
        """Size of the largest cached block (torch's ``cacheInfo`` without the free-memory guess)."""
        with self._lock:
            self._flush_memo()
            best = 0
            for pool in (self.small, self.large):
                for fl in pool.lists.values():
                    for k in reversed(fl.keys):
                        if fl.entries[k] is not None:
                            best = max(best, k >> KEY_SHIFT)
                            break
            return best

    def segments(self) -> list[SegmentDict]:
        """torch's ``memory_snapshot()`` segments of this device (plain dicts and lists)."""
        with self._lock:
            self._flush_memo()
            if self.pending_frees:
                self._drain_pending_frees()
            heads = [b for b in self._all_blocks() if b.prev is None]
            out: list[SegmentDict] = []
            names = SNAPSHOT_STATES
            for head in heads:
                blocks: list[dict[str, Any]] = []
                ap = blocks.append
                rest = alloc = pending = req = 0
                b: Block | None = head
                while b is not None:  # (allocated blocks, the common case, first)
                    if b.state == ALLOCATED:
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
                        if st == PENDING:  # active, not allocated
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
                    "segment_pool_id": (0, 0) if head.fl.owner is None else head.fl.owner.id,
                    "is_expandable": False,
                    "frames": [],
                    "blocks": blocks,
                })
            out.sort(key=lambda s: s["address"])
            return out

    def _recount_block(self, b: Block, rc: dict[str, int]) -> None:
        """Add one mapped block to the recount ``rc`` and check its state (invariants)."""
        rc["b_res"] += b.size
        if b.state == ALLOCATED:
            rc["n_alloc"] += 1
            rc["b_alloc"] += b.size
            rc["b_req"] += b.requested
            assert self.live.get(b.ptr) is b or b in self.pending_frees, \
                f"{b!r} is allocated but not live"
        elif b.state == PENDING:
            assert b.event_count > 0 or any(b is d for d, _ in self._deferred_uses), \
                f"{b!r} is pending without events"
            rc["n_pend"] += 1
            rc["b_pend"] += b.size
            rc["b_req"] += b.requested
        else:
            assert b.state == FREE, f"{b!r} is in an impossible state"
            key = (b.size << KEY_SHIFT) | b.ptr
            assert b.fl.entries.get(key) is b, f"{b!r} is free but not cached"

    def check_invariants(self) -> None:
        """Verify the allocator's internal structure (tests and debugging; O(blocks)).

        Raises AssertionError on the first inconsistency: blocks that do not tile their
        segment, free neighbours left unmerged, free lists out of step with block states,
        or counters that differ from a recount.
        """
        with self._lock:
            self._flush_memo()
            if self.pending_frees:
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
                nblocks, end = 0, head.ptr
                b: Block | None = head
                while b is not None:
                    assert id(b) in ids, f"{b!r} is linked but unknown"
                    assert b.ptr == end, f"{b!r} does not start where its predecessor ends"
                    assert b.fl is head.fl, f"{b!r} changed stream or pool inside a segment"
                    if b.next is not None:
                        assert b.next.prev is b, f"broken links after {b!r}"
                        assert not (b.state == FREE and b.next.state == FREE), \
                            f"free neighbours {b!r} and {b.next!r} were not merged"
                    end += b.size
                    nblocks += 1
                    self._recount_block(b, rc)
                    b = b.next
                if nblocks > 1:
                    b = head
                    while b is not None:
                        if b.state == FREE:
                            rc["n_split"] += 1
                            rc["b_split"] += b.size
                        b = b.next
            for fl in self._all_free_lists():
                assert fl.keys == sorted(fl.keys), "free list keys out of order"
                assert set(fl.keys) == set(fl.entries), "free list keys and entries differ"
                for k, b in fl.entries.items():
                    if b is not None:
                        assert b.state == FREE and id(b) in ids, f"stale cached {b!r}"
                        assert k == (b.size << KEY_SHIFT) | b.ptr, f"wrong key for {b!r}"
            self._check_pools(blocks)
            for pool in (self.small, self.large):
                rc = recount[pool.name]
                for code, value in rc.items():
                    assert getattr(pool, code) == value, (
                        f"{pool.name} pool {code} = {getattr(pool, code)}, recount {value}")
            assert len(self.live) + len(self.pending_frees) == (
                recount["small"]["n_alloc"] + recount["large"]["n_alloc"])
            assert self.outstanding_events == sum(len(dq) for dq in self._events.values())

    def _all_free_lists(self) -> list[FreeList]:
        """The free lists of the default pools, then those of every private pool."""
        lists = [*self.small.lists.values(), *self.large.lists.values()]
        for pp in self._pools.values():
            lists.extend(pp.free_lists())
        return lists

    def _all_blocks(self) -> list[Block]:
        blocks: list[Block] = list(self.live.values())
        for fl in self._all_free_lists():
            blocks.extend(b for b in fl.entries.values() if b is not None)
        seen = set()
        for dq in [*self._events.values(), *self._in_sync]:
            for _, b, _ in dq:
                if id(b) not in seen and b.state == PENDING:
                    seen.add(id(b))
                    blocks.append(b)
        blocks.extend(self.pending_frees)  # freed while the lock was busy: still allocated
        blocks.extend(b for b, _ in self._deferred_uses)  # freed during a capture: pending
        return blocks

    def _check_pools(self, blocks: list[Block]) -> None:
        """Invariants of the private pools: each pool's segment count is the number of its
        segments, the freeable ones have use count 0, every capture names a known pool."""
        heads: dict[tuple[int, int], int] = {}
        for b in blocks:
            owner = b.fl.owner
            if owner is not None:
                oid = owner.id
                assert self._pools.get(oid) is owner, f"{b!r} belongs to a forgotten pool"
                if b.prev is None:
                    heads[oid] = heads.get(oid, 0) + 1
        for pid, pp in self._pools.items():
            assert pp.segment_count == heads.get(pid, 0), (
                f"pool {pid} counts {pp.segment_count} segments, holds {heads.get(pid, 0)}")
            assert (pp.use_count == 0) == (pid in self._freeable), f"pool {pid} freeable state"
        for pid, _ in self._captures:
            assert pid in self._pools, f"capture routes to unknown pool {pid}"
