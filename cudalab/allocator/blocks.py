"""Blocks, free lists and pools: the data structures of the native caching allocator.

A segment (one ``mem_alloc``, or one mapped range of an expandable segment) is tiled by
:class:`Block` objects linked by ``prev``/``next``. Free blocks of one pool and one stream
live in a :class:`FreeList`: a sorted list of packed keys ``size << KEY_SHIFT | address``
(one ``bisect`` gives the best fit) and a dict from key to block. Removal only marks the
dict entry stale (``None``), so a block that is split and merged again over and over (the
common alloc/free pair) re-uses its list entries and the list is only touched when a new
(size, address) appears; stale keys are skipped by the search and swept out when the list
has grown to twice its live size. A :class:`BlockPool` is the small or the large pool of one
device: one free list per stream, and its own statistics counters.
"""

from __future__ import annotations

from bisect import insort
from typing import TYPE_CHECKING, Any, TypeAlias

from cudalab.allocator.stats import Counters

if TYPE_CHECKING:
    from cudalab.streams import Stream

__all__ = ["ALLOCATED", "DEFERRED", "DETACHED", "FREE", "PENDING", "UNMAPPED", "STATE_NAMES", "SNAPSHOT_STATES",
           "KEY_SHIFT", "Block", "BlockPool", "FreeList", "StreamUses", "SegmentDict"]

#: The streams a block was used on besides its allocation stream (``record_stream``).
StreamUses: TypeAlias = "set[Stream]"
#: One segment of torch's ``memory_snapshot()`` (its keys: ``cudalab.memory_tools.snapshot``).
SegmentDict: TypeAlias = "dict[str, Any]"

#: Packed free-list key: ``size << KEY_SHIFT | address`` (addresses are below 2**64). The
#: hot paths write the literal 64 (a constant load, not a global lookup).
KEY_SHIFT = 64
LIST_MIN = 64  # a free list is swept when it holds this many keys and twice its live blocks

# Block states (Block.state). The hot paths compare and assign these names; the numbers are
# indices into STATE_NAMES.
FREE = 0  # cached, in its pool's free list
ALLOCATED = 1  # handed out
PENDING = 2  # freed, waiting for record_stream events
DETACHED = 3  # out of every structure (segment being released, or a fresh segment)
UNMAPPED = 4  # expandable segments: reserved address space with no memory mapped behind it
DEFERRED = 5  # freed into the pair memo: logically free and merged, physically still split
#: The name of each state, indexed by it (for repr).
STATE_NAMES = ("free", "allocated", "pending_free", "detached", "unmapped", "deferred_free")
#: torch's snapshot state of a block in each state that a snapshot can see (indexed by it).
SNAPSHOT_STATES = ("inactive", "active_allocated", "active_pending_free", "inactive", "inactive")


class Block:
    """A contiguous range of one segment: cached (free), handed out, or awaiting events."""

    __slots__ = ("ptr", "size", "requested", "fl", "state", "prev", "next", "event_count",
                 "uses", "gc_base", "tfree")

    def __init__(self, ptr: int, size: int, fl: FreeList):
        self.ptr = ptr
        self.size = size
        #: Bytes asked for by the malloc holding it (0 when free).
        self.requested = 0
        #: The free list of its (pool, stream); fixed for the block's segment.
        self.fl = fl
        #: One of the states above; FREE exactly when it is a live entry of ``fl``.
        self.state = DETACHED
        #: Neighbours in the segment (None at its ends); neighbours are never both FREE.
        self.prev: Block | None = None
        self.next: Block | None = None
        #: Outstanding record_stream events (> 0 exactly when PENDING).
        self.event_count = 0
        self.uses: StreamUses | None = None  # streams (other than the allocation stream) it was used on
        self.gc_base = 0
        self.tfree: object = 0  # stamp of its deferred memo free, for the history (0: none)

    def __repr__(self) -> str:
        return f"<Block {self.ptr:#x} size={self.size} {STATE_NAMES[self.state]}>"


class FreeList:
    """The free blocks of one pool on one stream, ordered by (size, address)."""

    __slots__ = ("keys", "entries", "limit", "stream", "pool", "owner")

    def __init__(self, pool: BlockPool, stream: int):
        self.keys: list[int] = []  # sorted packed keys, some possibly stale
        self.entries: dict[int, Block | None] = {}  # key -> block (None: stale key)
        self.limit = LIST_MIN
        self.stream = stream
        #: The small or large pool of the device: its statistics count these blocks.
        self.pool = pool
        #: The private pool (allocator.pools.PrivatePool) whose list this is; None for the
        #: default pool's lists (those in ``pool.lists``).
        self.owner: Any = None

    def add(self, key: int, b: Block) -> None:
        """Insert a key the list does not hold yet (callers first try ``entries[key] = b``
        when the key is already there, stale)."""
        insort(self.keys, key)
        self.entries[key] = b
        if len(self.keys) >= self.limit:
            self.sweep()

    def sweep(self) -> None:
        """Drop stale keys (done when the list reaches twice its live size)."""
        live: dict[int, Block | None] = {k: b for k, b in self.entries.items() if b is not None}
        self.keys = sorted(live)
        self.entries = live
        self.limit = max(LIST_MIN, 2 * len(live))

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
        self.lists: dict[int, FreeList] = {}
        #: get_free_block calls (counted only while garbage collection is on), for ages.
        self.gc_calls = 0
        self.name = "small" if is_small else "large"

    def free_list(self, stream: int) -> FreeList:
        fl = self.lists.get(stream)
        if fl is None:
            fl = self.lists[stream] = FreeList(self, stream)
        return fl

    def free_blocks(self) -> list[Block]:
        """All cached blocks in torch's set order (stream, size, address)."""
        out: list[Block] = []
        for stream in sorted(self.lists):
            out.extend(self.lists[stream].blocks())
        return out
