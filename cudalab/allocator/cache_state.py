"""The state of the native caching allocator: its fields, their invariants, their start values.

:class:`CacheState` is the base of the concerns the allocator is made of (each in its own
module, all over these fields): the pair memo (:mod:`~cudalab.allocator.memo`), the slow
path and release ladder (:mod:`~cudalab.allocator.slow_path`), the snapshot-facing readers
and checks (:mod:`~cudalab.allocator.inspection`); :class:`~cudalab.allocator.caching.
DeviceCachingAllocator` joins them with the hot paths (cache-hit malloc and free).

Locking. One lock per device (``_lock``, a :class:`~cudalab.allocator.token_lock.TokenLock`)
guards every field below, except where a comment says otherwise (the ready box of the pair
memo, published without the lock, and ``pending_frees``, appended to without it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

from cudalab.allocator.base import Allocator, current_stream_key
from cudalab.allocator.blocks import Block, BlockPool, FreeList, StreamUses
from cudalab.allocator.config import UNLIMITED, AllocatorConfig, config_from_env
from cudalab.allocator.events import EventPool
from cudalab.allocator.stats import DeviceStats
from cudalab.allocator.token_lock import TokenLock

if TYPE_CHECKING:
    from cudalab._driver.base import Backend
    from cudalab.allocator.hooks import AllocatorTrace, StampLog
    from cudalab.allocator.private_pool import PrivatePool
    from cudalab.streams import Stream

__all__ = ["CacheState", "NO_STREAM"]

NO_STREAM = object()  # never a malloc's stream argument

#: One record_stream event of a PENDING block: (the driver event, the block, the event pool
#: it goes back to once it has completed).
EventUse: TypeAlias = "tuple[Any, Block, EventPool]"


def _no_stamp() -> int:
    """The memo's stamp makers while no history logs stamps: 0, "no entry"."""
    return 0


class CacheState(Allocator):
    """torch's DeviceCachingAllocator for one device, over a driver :class:`Backend`: its state.

    Parameters
    ----------
    backend
        The driver seam (``cudalab._internal.backend()``, or any Backend in tests).
    device
        The device ordinal.
    config
        The settings (default: parsed from the environment, see
        :mod:`cudalab.allocator.config`); ``expandable_segments`` must match the class
        (:func:`cudalab.allocator.registry.native_allocator` picks it).
    stream_resolver
        Maps ``stream=None`` to a stream key (default: the current stream of ``device``;
        tests over a private backend pass ``lambda: 0``).

    Raises
    ------
    ValueError
        The settings ask for another backend, or for the other expandable_segments value.
    """

    name = "native"
    #: Flavours that override malloc turn the pair memo off (turn_off_pair_memo: one instance).
    _memo_class_ok = True
    #: Whether this class grows segments page by page (expandable_segments:True).
    _expandable = False

    # The methods one concern calls in another (defined in caching.py and memo.py), for
    # the type checker.
    _free_requested: Callable[[Block], None]
    _free_block: Callable[[Block], None]
    _process_pending: Callable[[], None]
    _drain_pending_frees: Callable[[], None]
    _oversize_reject: Callable[[int, int], bool]
    _flush_memo: Callable[[], None]
    _all_blocks: Callable[[], list[Block]]
    _carve: Callable[[Block, int, BlockPool], Block]
    _account_alloc: Callable[[BlockPool, Block, int, int, int, int], int]
    _detach_segment: Callable[[Block], int]
    _garbage_collect: Callable[[], None]
    _raise_oom: Callable[[int, int, int], NoReturn]
    _settle_releases: Callable[[], None]
    _route: Callable[[int], PrivatePool | None]
    _best_fit_in: Callable[[FreeList, int], Block | None]
    _malloc_routed: Callable[[int, int], int]
    _record_use_events: Callable[[Block, StreamUses], None]

    if TYPE_CHECKING:  # (the two with a default argument, as method signatures)
        def _alloc_block(self, pool: BlockPool, skey: int, alloc_size: int, is_retry: bool,
                         pp: PrivatePool | None = None) -> Block | None: ...

        def _release_freeable_pools(self, only: tuple[int, int] | None = None) -> None: ...

    def __init__(self, backend: Backend, device: int = 0, config: AllocatorConfig | None = None,
                 stream_resolver: Callable[[], int] | None = None):
        if config is None:
            config = config_from_env()
        if config.backend != "native" or config.expandable_segments != self._expandable:
            asked = (f"backend:{config.backend}" if config.backend != "native"
                     else f"expandable_segments:{config.expandable_segments}")
            raise ValueError(
                f"{type(self).__name__} is the native backend with expandable_segments:"
                f"{self._expandable}, but the settings ({config.source or 'given'}) ask for "
                f"{asked}; use cudalab.allocator.registry.create_allocator() (or "
                "native_allocator()), which picks the right class"
            )
        self.backend = backend
        self.device = device
        self._default_stream = stream_resolver or (lambda: current_stream_key(device))
        self._tls_streams = stream_resolver is None  # malloc reads the thread's stream list
        ms = config.max_split_size
        self.small = BlockPool(True)
        self.large = BlockPool(False)
        self.stats = DeviceStats(-1 if ms >= UNLIMITED else ms, self.small, self.large)
        self._agg = self.stats.agg
        self._set_fraction = False
        self._fraction = 1.0
        self._allowed = 0
        self._total = 0
        # ---- private pools (allocator.pools; torch's graph_pools, graph_pools_freeable,
        # captures_underway)
        #: id -> PrivatePool, every pool that exists on this device (use count > 0, or
        #: freeable and still holding segments).
        self._pools: dict[tuple[int, int], PrivatePool] = {}
        #: id -> PrivatePool, the pools whose use count is 0 (a subset of _pools):
        #: empty_cache releases their free segments and forgets them once they hold none.
        self._freeable: dict[tuple[int, int], PrivatePool] = {}
        #: (id, filter) of the pools allocations are routed to now, oldest first (routing
        #: tries the newest first); each id is in _pools, at most once here. Non-empty
        #: turns off event polling, the release ladder and the pair memo (_memo_ok False).
        #: The hot path tests only its truth value.
        self._captures: list[tuple[tuple[int, int], Callable[[int], bool]]] = []
        #: (pool id, drop) of release_pool / drop_pool calls made while the lock was busy
        #: (appended without the lock, e.g. by a graph's finalizer inside this thread's
        #: allocator call); every pool operation and empty_cache makes them first.
        self._pending_releases: deque[tuple[tuple[int, int], bool]] = deque()
        #: (block, streams) of blocks freed during a capture while used on other streams:
        #: PENDING without events until the last capture ends, which records them.
        self._deferred_uses: list[tuple[Block, StreamUses]] = []
        self._apply_settings(config)  # the settings read on the hot path
        # state
        self._lock = lock = TokenLock()
        self._take = lock.take  # the hot paths inline acquire/release (see token_lock)
        self._give = lock.give
        #: ptr -> its ALLOCATED block, for every pointer handed out and not yet freed (a
        #: memo hit's block too). free pops it first, without the lock: a popped block has
        #: one holder.
        self.live: dict[int, Block] = {}
        #: Blocks freed while the lock was busy (appended without the lock): still
        #: ALLOCATED and counted; every lock holder drains them before reading counters.
        self.pending_frees: deque[Block] = deque()
        #: stream -> FIFO of (event, block, event pool) for PENDING blocks;
        #: outstanding_events == the total length (so the hot path tests one int).
        self._events: dict[Stream, deque[EventUse]] = {}
        self.outstanding_events = 0
        self._n_pending = 0  # blocks freed but awaiting events (PENDING: active, not allocated)
        self._in_sync: list[list[EventUse]] = []  # event lists being synchronised with the lock dropped
        self._event_pools: dict[int, EventPool] = {}
        self._spare: list[Block] = []  # DETACHED Block objects for reuse (no live references)
        self._callbacks: list[Callable[[], bool]] = []
        #: The listener's hook (cudalab.allocator.hooks.AllocatorTrace): called as
        #: trace(action, addr, size, stream) at torch's points; None (the default) costs
        #: one test per operation. Set through hooks.attach_trace / detach_trace.
        self._trace: AllocatorTrace | None = None
        # ---- the pair memo (see _establish_memo; _memo_ok is set by _apply_settings)
        self._last: Block | None = None  # the block the last malloc took by a plain best fit
        self._last_stream: Any = None  # the stream argument (or current Stream) of that malloc
        self.memo_block: Block | None = None
        #: Holds the memo block while its free is deferred (a list: append and pop are
        #: atomic, so free can publish it without the lock; see free and _flush_memo).
        self._ready: list[Block] = []
        self._memo_stream = 0
        self._hit_size = -1  # the request of a pure memo hit (-1: none)
        #: memo pairs logged compactly for the history: (free stamp, alloc stamp) pairs, 0
        #: for none (see _establish_memo); _hit_ap is its append, _hit_now and _hit_fnow
        #: make the alloc and free stamps; _hit_rec(tfree), where the log has it (the
        #: history's compiled HitLog), logs a pure hit's two stamps in one call (invariant:
        #: set only while _hit_ap is, both from the same log)
        self._hit_log: StampLog | None = None
        self._hit_ap: Callable[[Any], None] | None = None
        self._hit_rec: Callable[[Any], None] | None = None
        self._hit_now: Callable[[], Any] = _no_stamp  # (called only while _hit_ap is set)
        self._hit_fnow: Callable[[], Any] = _no_stamp
        self._hit_stream: Any = NO_STREAM  # the Stream object of a pure hit
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

    def _apply_settings(self, config: AllocatorConfig) -> None:
        """Keep ``config`` and the hot path's copies of its settings.

        The one place they are derived, at creation and by ``reconfigure``, so the two
        cannot drift. ``_gc_on`` is "a fraction is set and the threshold is > 0";
        ``_memo_ok`` is whether this allocator may defer frees at all (off for flavours
        with their own malloc, for max_split_size, and for tests that compare against the
        plain path).
        """
        self.config = config
        ms = config.max_split_size
        self._max_split = ms
        self._split_limited = ms < UNLIMITED
        self.stats.max_split_size = -1 if ms >= UNLIMITED else ms
        self._max_non_split = config.max_non_split_rounding_size
        self._large_segment = config.large_segment_size
        self._rounding = any(d > 1 for d in config.roundup_power2_divisions)
        self._gc_threshold = config.garbage_collection_threshold
        self._gc_on = self._set_fraction and self._gc_threshold > 0.0
        self._memo_ok = (self._memo_class_ok and not self._split_limited
                         and not self._captures)
