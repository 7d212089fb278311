"""A private memory pool of the caching allocator: its id, its routing filter, its record.

The record (:class:`PrivatePool`) and the ids live here, below both the allocator's state
(:mod:`cudalab.allocator.cache_state`, which keeps a map of them) and its private-pool
concern (:mod:`cudalab.allocator.pools`, the ``PrivatePools`` mixin that routes allocations
to them), so neither imports the other's module for the type. :mod:`~cudalab.allocator.pools`
describes the pools and re-exports every name of this module.

Ids. A pool id is a pair ``(int, int)``; ``(0, 0)`` is the default pool ("no pool"). Two
process-global counters start at 1, as in torch (``aten/src/ATen/core/MemPool.cpp``):
pools created by the user (:func:`graph_pool_handle`, ``MemPool()``) get ``(0, n)``, pools a
graph creates for itself (:func:`new_graph_pool_id`) get ``(n, 0)``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from cudalab.allocator.blocks import BlockPool, FreeList

__all__ = ["DEFAULT_POOL_ID", "KIND_GRAPH", "KIND_USER", "CurrentThreadFilter", "PoolFilter",
           "PrivatePool", "SegmentSource", "check_pool_id", "graph_pool_handle",
           "new_graph_pool_id", "pool_kind"]


class SegmentSource(Protocol):
    """Where a private pool's segments come from when not from the driver: what the pool
    needs of a :class:`~cudalab.allocator.pluggable.PluggableAllocator` (``MemPool(allocator=)``).

    ``malloc_fn(size, device, stream_key)`` returns a device pointer (0 or
    :class:`~cudalab.OutOfMemoryError` when out of memory); ``free_fn(ptr, size, device,
    stream_key)`` gives one back. Both are called without the allocator's lock.
    """

    @property
    def malloc_fn(self) -> Callable[[int, int, int], int]: ...

    @property
    def free_fn(self) -> Callable[[int, int, int, int], None]: ...


#: The id of the default pool ("no private pool"), as in torch's snapshots.
DEFAULT_POOL_ID = (0, 0)
#: The kind of a pool whose id is ``(n, 0)``: made by a graph capture for itself.
KIND_GRAPH = "graph"
#: The kind of a pool whose id is ``(0, n)``: ``graph_pool_handle()`` or ``MemPool()``.
KIND_USER = "user"

# Process-global id counters (next() on an itertools.count is atomic under the GIL).
_graph_ids = itertools.count(1)
_user_ids = itertools.count(1)

#: Type of a routing filter: called with the allocation's stream key (the driver's stream
#: handle as an int, 0 for the legacy default stream).
PoolFilter = Callable[[int], bool]


def new_graph_pool_id() -> tuple[int, int]:
    """A fresh id for a pool a graph capture makes for itself: ``(n, 0)``, n = 1, 2, ...

    Returns
    -------
    tuple of (int, int)
        torch's ``MempoolId_t`` of an internal (graph-created) pool.
    """
    return (next(_graph_ids), 0)


def graph_pool_handle() -> tuple[int, int]:
    """torch's ``graph_pool_handle()``: a fresh id ``(0, n)`` for a pool to share between graphs.

    Pass it as ``pool=`` to several captures so they allocate from one private pool (see
    ``docs/concepts`` on pools: graphs sharing a pool must be replayed in capture order).

    Returns
    -------
    tuple of (int, int)
        A user pool id; no pool exists until a capture (or ``begin_allocate_to_pool``) uses it.
    """
    return (0, next(_user_ids))


def check_pool_id(pool_id: Any, name: str = "pool_id") -> tuple[int, int]:
    """``pool_id`` as a ``(int, int)`` tuple with exactly one non-zero, non-negative element.

    Raises
    ------
    TypeError
        Not a pair of ints.
    ValueError
        ``(0, 0)`` (the default pool), both elements non-zero, or a negative element.
    """
    if (not isinstance(pool_id, (tuple, list)) or len(pool_id) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in pool_id)):
        raise TypeError(f"{name} must be a pair of ints (a pool id from graph_pool_handle(), "
                        f"MemPool().id or CUDAGraph.pool()), got {type(pool_id).__name__} "
                        f"{pool_id!r}")
    a, b = int(pool_id[0]), int(pool_id[1])
    if a < 0 or b < 0 or (a == 0) == (b == 0):
        raise ValueError(f"{name} must have exactly one non-zero element (graph pools are "
                         f"(n, 0), user pools (0, n)), got {pool_id!r}")
    return (a, b)


def pool_kind(pool_id: tuple[int, int]) -> str:
    """:data:`KIND_GRAPH` for ``(n, 0)``, :data:`KIND_USER` for ``(0, n)``."""
    return KIND_GRAPH if pool_id[0] != 0 else KIND_USER


class CurrentThreadFilter:
    """The routing filter of ``use_mem_pool``: accepts the allocations of one thread.

    Parameters
    ----------
    thread_id : int, optional
        ``threading.get_ident()`` of the thread (default: the calling one).
    """

    __slots__ = ("thread_id",)

    def __init__(self, thread_id: int | None = None):
        self.thread_id = threading.get_ident() if thread_id is None else thread_id

    def __call__(self, stream: int) -> bool:
        return threading.get_ident() == self.thread_id

    def __repr__(self) -> str:
        return f"<CurrentThreadFilter thread={self.thread_id}>"


class PrivatePool:
    """torch's ``PrivatePool``: one private pool of one device (fields under the device lock).

    Parameters
    ----------
    pool_id : tuple of (int, int)
        Its id (checked by the caller).
    allocator : SegmentSource, optional
        Where its segments come from (default: the driver, like the default pool's).
    """

    __slots__ = ("id", "use_count", "segment_count", "small_lists", "large_lists", "allocator",
                 "use_on_oom", "no_split")

    def __init__(self, pool_id: tuple[int, int], allocator: SegmentSource | None = None):
        self.id = pool_id
        #: Graphs and MemPools (and open use_mem_pool blocks) using it; >= 0. At 0 the pool
        #: is in the allocator's freeable map and never used again.
        self.use_count = 1
        #: torch's cudaMalloc_count: segments allocated for it and not released yet. The
        #: pool is forgotten when it is freeable and this is 0.
        self.segment_count = 0
        #: stream key -> free list, for its small and its large blocks; each list's ``pool``
        #: is the device's ordinary BlockPool (statistics), its ``owner`` this pool.
        self.small_lists: dict[int, FreeList] = {}
        self.large_lists: dict[int, FreeList] = {}
        self.allocator = allocator
        self.use_on_oom = False  # searched (free blocks only) when a default allocation fails
        self.no_split = False  # its blocks are never split

    @property
    def kind(self) -> str:
        """:data:`KIND_GRAPH` or :data:`KIND_USER`."""
        return pool_kind(self.id)

    def lists_of(self, pool: BlockPool) -> dict[int, FreeList]:
        """Its free lists of ``pool``'s size class (small or large), by stream key."""
        return self.small_lists if pool.is_small else self.large_lists

    def free_list(self, pool: BlockPool, stream: int) -> FreeList:
        """Its free list of ``pool``'s size class on ``stream`` (created on first use)."""
        lists = self.lists_of(pool)
        fl = lists.get(stream)
        if fl is None:
            fl = lists[stream] = FreeList(pool, stream)
            fl.owner = self
        return fl

    def free_lists(self) -> Iterator[FreeList]:
        """Every free list of the pool (large ones first, as torch releases them)."""
        yield from self.large_lists.values()
        yield from self.small_lists.values()

    def __repr__(self) -> str:
        return (f"<PrivatePool {self.id} {self.kind} use_count={self.use_count} "
                f"segments={self.segment_count}>")
