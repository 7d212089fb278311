"""The allocator's interface for trace replays: one fresh allocator that a replay drives.

:mod:`cudalab.memory_tools.replay` (and the what-if sweeps over it) feeds a recorded
allocation trace through a brand-new allocator, over a backend of its own, to see what other
settings would have done. :class:`ReplayTarget` is everything the replay needs of the
allocator runtime, and the only way it reaches it: the replay writes no allocator field and
reads only the public counters (``stats``) named below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from cudalab.allocator.async_allocator import AsyncPoolAllocator
from cudalab.allocator.config import AllocatorConfig
from cudalab.allocator.registry import native_allocator
from cudalab.allocator.stats import DeviceStats

if TYPE_CHECKING:
    from cudalab._driver.base import Backend
    from cudalab.allocator.base import Allocator

__all__ = ["ReplayTarget"]

#: The stream ids that are default streams on every backend (legacy, per-thread, and 2 as
#: the simulator numbers them): a replay uses them as they are.
_DEFAULT_STREAMS = (0, 1, 2)


def _stream_zero() -> int:
    """``stream=None`` of a replayed allocator: the legacy default stream."""
    return 0


class ReplayTarget:
    """One allocator of device 0 over ``backend``, made for a trace replay.

    The allocator is registered nowhere (no history recorder, hook or observer attaches to
    it), resolves ``stream=None`` to stream 0, and, for the native one, has its pair memo
    off (:meth:`~cudalab.allocator.memo.PairMemo.turn_off_pair_memo`), so its counters are
    current after every call.

    Parameters
    ----------
    backend : Backend
        A backend of the replay's own (``cudalab._internal.private_simulator()``), never
        the process's: the allocator allocates from it.
    config : AllocatorConfig
        The settings replayed: ``backend:cudaMallocAsync`` gives an
        :class:`~cudalab.allocator.async_allocator.AsyncPoolAllocator`, anything else the
        native caching allocator (with expandable segments when they are asked for).

    Attributes
    ----------
    allocator : Allocator
        The allocator.
    is_async : bool
        Whether it is the ``cudaMallocAsync`` one (then :attr:`pool_usage` is set).
    malloc : callable
        ``malloc(size, stream_key) -> pointer``: the allocator's own bound method, so a
        replay loop calling it per entry pays for no layer in between.
    free : callable
        ``free(pointer)``, the allocator's own bound method (0 is a no-op).
    stats : DeviceStats
        The counters, read between calls: ``small.b_alloc + large.b_alloc`` allocated bytes,
        ``small.b_res + large.b_res`` reserved bytes, ``agg.b_res_peak`` the reserved peak
        (native); ``large.b_alloc`` allocated bytes (async, whose reserved bytes come from
        :attr:`pool_usage`).
    pool_usage : callable or None
        The async allocator's ``pool_usage() -> (reserved, reserved high, used, used high)``
        (one driver query); None for the native one.
    """

    __slots__ = ("allocator", "is_async", "malloc", "free", "stats", "pool_usage", "_backend",
                 "_streams")

    def __init__(self, backend: Backend, config: AllocatorConfig) -> None:
        self._backend = backend
        #: trace stream id -> stream key of ``backend`` (async only; filled on first use)
        self._streams: dict[int, int] = {}
        self.is_async = config.backend == "cudaMallocAsync"
        allocator: Allocator
        if self.is_async:
            pool_allocator = AsyncPoolAllocator(backend, 0, config, stream_resolver=_stream_zero)
            self.pool_usage: Callable[[], tuple[int, int, int, int]] | None = \
                pool_allocator.pool_usage
            allocator = pool_allocator
        else:
            native = native_allocator(backend, 0, config, stream_resolver=_stream_zero)
            native.turn_off_pair_memo()
            self.pool_usage = None
            allocator = native
        self.allocator = allocator
        self.malloc: Callable[[int, int], int] = allocator.malloc
        self.free: Callable[[int], None] = allocator.free
        self.stats: DeviceStats = allocator.stats

    def stream_key(self, trace_stream: int) -> int:
        """The stream key that replays the trace's stream ``trace_stream``.

        The native allocator takes stream keys as they are (its free lists are per key).
        The async one queues work on real streams of the backend: a default stream id
        (0, 1, 2) is kept, any other gets a stream of its own, made on first use.
        """
        if not self.is_async or trace_stream in _DEFAULT_STREAMS:
            return trace_stream
        key = self._streams.get(trace_stream)
        if key is None:
            backend = self._backend
            key = self._streams[trace_stream] = backend.handle_int(backend.stream_create(0))
        return key

    def allocated(self) -> int:
        """Bytes allocated now (requested sizes for async, rounded blocks for native)."""
        st = self.stats
        if self.is_async:
            return st.large.b_alloc
        return st.small.b_alloc + st.large.b_alloc

    def reserved(self) -> int:
        """Bytes reserved from the backend now."""
        if self.pool_usage is not None:
            return self.pool_usage()[0]
        st = self.stats
        return st.small.b_res + st.large.b_res

    def memory_stats(self) -> dict[str, int]:
        """torch's ``memory_stats()`` of the allocator."""
        return self.allocator.memory_stats()

    def close(self) -> None:
        """Give the async allocator's pool back (nothing to do for the native one: the
        private backend is dropped with it)."""
        allocator = self.allocator
        if isinstance(allocator, AsyncPoolAllocator):
            allocator.close()
