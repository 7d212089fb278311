"""The allocator interface (:class:`Allocator`) and the argument checks every allocator shares.

cudalab's memory API talks to one :class:`Allocator` per device (RMM-style composition):
the native caching allocator (:mod:`cudalab.allocator.caching`, with expandable segments
in :mod:`cudalab.allocator.expandable`), the pass-through :mod:`~cudalab.allocator.uncached`
one, ``backend:cudaMallocAsync`` (:mod:`cudalab.allocator.async_allocator`) and pluggable
allocators (:mod:`cudalab.allocator.pluggable`). :mod:`cudalab.allocator.registry` picks
one per device. This module imports none of them.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

from cudalab import streams as _streams
from cudalab._driver.base import ClosedHandle
from cudalab.allocator.blocks import SegmentDict, StreamUses
from cudalab.allocator.stats import DeviceStats, format_size

if TYPE_CHECKING:
    from cudalab._driver.base import Backend
    from cudalab.allocator.config import AllocatorConfig
    from cudalab.allocator.hooks import AllocatorTrace

__all__ = ["Allocator", "bad_pointer", "current_stream_key", "fraction_total", "oom_text",
           "stream_key", "stream_use"]

_OOM_HINT = (
    " If reserved but unallocated memory is large try setting"
    " CUDALAB_ALLOC_CONF=expandable_segments:True (PYTORCH_CUDA_ALLOC_CONF is also read) to avoid"
    " fragmentation.  See documentation for Memory Management "
    " (https://docs.pytorch.org/docs/stable/notes/cuda.html"
    "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
)



def bad_pointer(ptr: Any) -> Exception:
    """The exception for freeing (or asking about) ``ptr``, which no allocator handed out:
    ValueError for an int, TypeError for anything else."""
    if isinstance(ptr, int) and not isinstance(ptr, bool):
        return ValueError(
            f"pointer {ptr:#x} was not allocated by cudalab's caching allocator "
            "(double free or foreign pointer)"
        )
    return TypeError(f"expected a device pointer (int), got {type(ptr).__name__} {ptr!r}")


class Allocator(abc.ABC):
    """One device's allocator behind cudalab's memory API (RMM-style composition).

    Implementations: ``DeviceCachingAllocator`` (backend "native", module ``caching``),
    ``UncachedAllocator`` (``CUDALAB_NO_MEMORY_CACHING``); expandable segments,
    cudaMallocAsync and pluggable allocators slot in as further implementations. Every one
    keeps :attr:`stats` (a :class:`~cudalab.allocator.stats.DeviceStats`) current, because the
    public getters read its counters directly.

    The friend interface. Beyond the methods, these fields are read from outside
    ``cudalab.allocator`` (by :mod:`cudalab.memory`'s getters and ``caching_allocator_delete``
    on their hot paths, where a method call would cost more than the read), so they are
    spelled without an underscore; they are read-only there (only the allocator writes them):

    ``stats``
        The counters (:class:`~cudalab.allocator.stats.DeviceStats`; ``small``, ``large``
        and ``agg`` hold torch's figures).
    ``live``
        ``ptr -> record`` of every pointer handed out and not freed (``ptr in live`` is
        :meth:`owns`, without the call).
    ``pending_frees``
        Frees that waited for the lock; while it is non-empty, or ``memo_block`` is set,
        counters lag: call :meth:`sync_pending` before reading them.
    ``memo_block``
        The native allocator's pair-memo block (None for the other allocators).
    ``outstanding_events`` (``DeviceCachingAllocator`` only)
        ``record_stream`` events not yet seen complete (``memory_stats(extended=True)``).

    Everything else with an underscore is the allocator package's own. Other private state
    has methods: :meth:`is_locked` (graphs' finalizers), ``turn_off_pair_memo`` and
    :class:`~cudalab.allocator.replay_target.ReplayTarget` (trace replays).
    """

    #: torch's backend name, as ``get_allocator_backend()`` reports it.
    name = "native"
    device: int
    stats: DeviceStats
    #: Live allocations keyed by pointer (the registry finds a pointer's owner here).
    live: dict[int, Any]
    #: Frees deferred while the lock was busy (the getters check it before reading).
    pending_frees: Any = ()
    #: The native allocator's pair memo (see DeviceCachingAllocator); the getters call
    #: sync_pending() first while it is set, so they never see deferred counters.
    memo_block: Any = None
    #: Watermark of allocated bytes for :func:`cudalab.memory.peak_scope` (never above the
    #: peak; a scope opening hands it to the open scopes, then lowers it to the current value).
    _mark: int = 0
    _scopes: tuple[()] | list[Any] = ()  # open PeakScopes (a list once one is opened)
    #: The listener's hook (see :mod:`cudalab.allocator.hooks`), None while nobody listens.
    _trace: AllocatorTrace | None
    backend: Backend
    _lock: Any  # the device's allocator lock (a TokenLock or a threading.Lock)
    _uses: dict[int, StreamUses]  # ptr -> streams it was used on (allocators using _record_use)

    def is_locked(self) -> bool:
        """Whether the device's allocator lock is held now (by any thread).

        For finalizers that must not call the allocator while it is busy (the lock is not
        re-entrant; a finalizer may run inside this thread's own allocator call): they defer
        their call instead (``cudalab.graphs``' pool release)."""
        return bool(self._lock.locked())

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

    def forget_stream(self, stream: Any) -> None:
        """``stream`` was closed: keep no fast path that would still hand memory out on it.

        Parameters
        ----------
        stream : cudalab.Stream
            The stream :meth:`cudalab.Stream.close` closed (called by the registry's close
            listener). The default does nothing: only the native allocator's pair memo
            remembers a Stream object.
        """
        return

    # ---- private pools (CUDA graphs, MemPool): the native caching allocator implements
    # them (cudalab.allocator.pools.PrivatePools); the others refuse, naming themselves.
    def _no_private_pools(self) -> NotImplementedError:
        return NotImplementedError(
            f"private memory pools (CUDA graphs, MemPool) need the native caching allocator; "
            f"device {self.device} uses {type(self).__name__} (backend {self.name!r})")

    def create_or_incref_pool(self, pool_id: Any, allocator: Any = None) -> None:
        """torch's ``createOrIncrefPool`` (see :mod:`cudalab.allocator.pools`)."""
        raise self._no_private_pools()

    def begin_allocate_to_pool(self, pool_id: Any, filter: Any = None) -> None:  # noqa: A002
        """torch's ``beginAllocateToPool`` (see :mod:`cudalab.allocator.pools`)."""
        raise self._no_private_pools()

    def end_allocate_to_pool(self, pool_id: Any) -> None:
        """torch's ``endAllocateToPool`` (see :mod:`cudalab.allocator.pools`)."""
        raise self._no_private_pools()

    def release_pool(self, pool_id: Any) -> None:
        """torch's ``releasePool`` (see :mod:`cudalab.allocator.pools`)."""
        raise self._no_private_pools()

    def set_pool_options(self, pool_id: Any, use_on_oom: bool | None = None,
                         no_split: bool | None = None) -> None:
        """torch's ``setUseOnOOM`` / ``setNoSplit`` (see :mod:`cudalab.allocator.pools`)."""
        raise self._no_private_pools()

    def drop_pool(self, pool_id: Any) -> None:
        """torch's ``~MemPool`` (see :mod:`cudalab.allocator.pools`)."""
        raise self._no_private_pools()

    def empty_pool_cache(self, pool_id: Any) -> None:
        """torch's ``emptyCache(mempool_id)`` (see :mod:`cudalab.allocator.pools`)."""
        raise self._no_private_pools()

    def get_pool_use_count(self, pool_id: Any) -> int:
        """torch's ``getPoolUseCount``: 0 here (this allocator has no private pools)."""
        return 0

    def pools(self) -> list[dict[str, Any]]:
        """The private pools of this device (none here); see ``PrivatePools.pools``."""
        return []

    @abc.abstractmethod
    def empty_cache(self) -> None:
        """Return every cached block that can be returned to the driver."""

    @abc.abstractmethod
    def set_memory_fraction(self, fraction: float) -> None:
        """Cap reserved memory at ``fraction`` of the device's total memory."""

    #: The fraction :meth:`set_memory_fraction` last set, exactly as given (torch stores
    #: it); 1.0 until then. Every allocator sets it in ``__init__`` and in
    #: :meth:`set_memory_fraction`, so :meth:`get_memory_fraction` is this one method.
    _fraction: float

    def get_memory_fraction(self) -> float:
        """The cap set by :meth:`set_memory_fraction` (1.0 when none)."""
        return self._fraction

    @abc.abstractmethod
    def segments(self) -> list[SegmentDict]:
        """torch's ``memory_snapshot()`` segment dicts for this device, sorted by address."""

    def sync_pending(self) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Apply frees deferred because the lock was busy (before reading statistics)."""

    def reconfigure(self, config: AllocatorConfig) -> None:
        """Apply settings changed at run time (``cudalab.memory._set_allocator_settings``).

        The base version keeps ``config`` and applies its ``per_process_memory_fraction``;
        the native caching allocator also applies its size rules.

        Parameters
        ----------
        config : AllocatorConfig
            The new settings; ``backend`` and ``expandable_segments`` are the ones this
            allocator was created with (the caller checks).
        """
        self.config = config  # type: ignore[attr-defined]
        if config.per_process_memory_fraction is not None:
            self.set_memory_fraction(config.per_process_memory_fraction)

    def memory_stats(self) -> dict[str, int]:
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
        """``record_stream`` for allocators that keep ``live[ptr]`` as a tuple (the
        allocation stream key at ``stream_field``) and the streams a pointer was used on in
        ``_uses[ptr]``; use on the allocation stream is ignored."""
        dev, key = stream_use(stream, need_handle=True)
        rec = self.live.get(ptr)
        if rec is None:
            raise bad_pointer(ptr)
        if dev == self.device and key == rec[stream_field]:
            return
        with self._lock:
            uses = self._uses.get(ptr)
            if uses is None:
                uses = self._uses[ptr] = set()
            uses.add(stream)


def stream_use(stream: Any, need_handle: bool = False) -> tuple[int, int]:
    """(device index, stream key) of a stream passed to ``record_stream`` (TypeError if it is
    not a cudalab Stream; ``need_handle`` also requires the driver handle events need)."""
    dev = getattr(stream, "device_index", None)
    key = getattr(stream, "cuda_stream", None)
    if (not isinstance(key, int) or not isinstance(dev, int)
            or (need_handle and not hasattr(stream, "handle"))):
        raise TypeError(f"record_stream needs a cudalab.Stream, got {type(stream).__name__}")
    h = getattr(stream, "handle", None)
    if type(h) is ClosedHandle:  # a closed Stream: no work can be queued on it any more
        raise h.error()
    return dev, key


def fraction_total(backend: Backend, device: int, fraction: float) -> int:
    """Check a per-process memory fraction (torch's rule and message); the device's total."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    return backend.mem_get_info(device)[1]


def stream_key(stream: Any, device: int) -> int:
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
    h = getattr(stream, "handle", None)
    if type(h) is ClosedHandle:  # a closed Stream (which never takes malloc's fast path)
        raise h.error()
    dev = getattr(stream, "device_index", device)
    if dev != device:
        raise ValueError(f"stream {stream!r} belongs to device {dev}, not to device {device}")
    return key


def current_stream_key(device: int) -> int:
    """The stream key of the current stream of ``device`` in this thread."""
    return _streams.current_stream(device).cuda_stream


def oom_text(device: int, alloc_size: int, free: int, total: int, allocated: int,
             reserved: int, allowed: int | None, in_private_pools: int = 0) -> str:
    """torch's OOM message (cudalab's names; "this process" = total - free).

    ``in_private_pools``: the free bytes cached in private pools (CUDA graphs, MemPools),
    which torch counts as allocated ("with ... allocated in private pools")."""
    allowed_info = f"{format_size(allowed)} allowed; " if allowed is not None else ""
    pools_info = (f"with {format_size(in_private_pools)} allocated in private pools (e.g., "
                  "CUDA Graphs), " if in_private_pools > 0 else "")
    return (
        f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. "
        f"GPU {device} has a total capacity of {format_size(total)} of which "
        f"{format_size(free)} is free. Including non-cudalab memory, this process has "
        f"{format_size(total - free)} memory in use. {allowed_info}"
        f"Of the allocated memory {format_size(allocated + in_private_pools)} is allocated by "
        f"cudalab, {pools_info}and "
        f"{format_size(reserved - allocated - in_private_pools)} is reserved by cudalab but "
        "unallocated."
        + _OOM_HINT
    )
