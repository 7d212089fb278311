"""The allocator's trace hook: the one protocol through which a listener (the history
recorder of :mod:`cudalab.memory_tools.history`) observes an allocator.

The allocator calls the hook; it does not know who listens, and it never imports the
listener. A listener is any object satisfying :class:`AllocatorTrace` (a plain function
does); one that also satisfies :class:`CompactTrace` lets the caching allocator log the
pairs of its pair memo as bare stamps instead of full entries (the history's fast path for
the loop that allocates and frees one temporary buffer).

How a listener attaches
-----------------------
* To an existing allocator: :func:`attach_trace` (``sync_pending()``, then set the
  allocator's ``_trace`` attribute); :func:`detach_trace` undoes it. The
  ``cudaMallocAsync`` allocator cannot be traced: attaching raises RuntimeError there and
  changes nothing.
* To allocators created later: append a callable to the registry's create hooks
  (:func:`cudalab.allocator.registry.add_create_hook`); it is called with each new
  allocator before the allocator is published, and it must not raise.
* The allocators that exist are ``cudalab.allocator.registry.active`` (one per device
  used), plus private ones the listener was handed.

Every allocator keeps the attribute ``_trace: AllocatorTrace | None``; None (the default)
costs one ``is not None`` test per operation and nothing else. The attach functions keep
the observer bus's allocation-trace family (:mod:`cudalab._observe`) in step: its list
holds the trace of each allocator traced (recomputed from ``_attached``, also when a traced
allocator is garbage collected), its flag says whether there is one. This module holds only
types and the two attach functions; it imports nothing of cudalab but the bus, so every
allocator module can name it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Literal, Protocol

from cudalab import _observe

__all__ = [
    "TRACE_ACTIONS",
    "TraceAction",
    "AllocatorTrace",
    "CompactTrace",
    "PoolTrace",
    "StampLog",
    "Traceable",
    "attach_trace",
    "detach_trace",
    "report_pool_segment",
]

#: The actions an allocator reports, at torch's points (``TraceEntry::Action``).
TraceAction = Literal["alloc", "free_requested", "free_completed", "segment_alloc",
                      "segment_free", "segment_map", "segment_unmap", "oom"]
#: The same names at run time, in torch's order (so the two cannot drift, a test compares
#: them with ``TraceAction``'s arguments).
TRACE_ACTIONS: tuple[str, ...] = ("alloc", "free_requested", "free_completed",
                                  "segment_alloc", "segment_free", "segment_map",
                                  "segment_unmap", "oom")


class AllocatorTrace(_observe.AllocationTraceObserver, Protocol):
    """The hook an allocator calls as ``trace(action, addr, size, stream)`` (the bus's
    :class:`cudalab._observe.AllocationTraceObserver`, with its contract written out).

    The calls, in the order torch makes them:

    ``"alloc"`` (block address, requested bytes, stream key)
        a block was handed out by ``malloc`` (every hit of the pair memo included).
    ``"free_requested"`` (block address, requested bytes, stream key)
        ``free`` was called for the block.
    ``"free_completed"`` (block address, requested bytes, stream key)
        the block is back in its pool: inside the same ``free`` call, or later (from any
        allocator call on that device) once the events of ``record_stream`` completed.
    ``"segment_alloc"`` / ``"segment_free"`` (segment address, segment bytes, stream key)
        a segment was obtained from / is being returned to the driver.
    ``"segment_map"`` / ``"segment_unmap"`` (address, bytes, stream key)
        pages were mapped into / unmapped from an expandable segment.
    ``"oom"`` (device free bytes, rounded request bytes, stream key)
        ``malloc`` is about to raise OutOfMemoryError.

    The stream key is the stream's handle value (0: the legacy default stream).

    Invariants the listener must keep (the allocator relies on them):

    * It is called by the allocator method doing the work, in the calling thread, mostly
      with the allocator's lock held: it must not call back into that allocator (no
      ``malloc``, ``free``, ``sync_pending``, statistics), or it deadlocks or defers.
    * It must not raise: the allocator's structures may be half updated around the call.
    * It is called from the allocator's own frames (modules of cudalab), which a listener
      skips to find the user's stack. ``"free_requested"`` is called directly by the method
      freeing, and a ``"free_completed"`` inside the same free call by that method or by
      one it calls directly (the history pairs the two by frame).
    * It must be cheap: it runs on every allocator operation while attached.
    """

    def __call__(self, action: str, addr: int, size: int, stream: int, /) -> None: ...


class CompactTrace(AllocatorTrace, Protocol):
    """An :class:`AllocatorTrace` that also takes memo pairs as stamps (optional).

    The caching allocator checks for the attribute ``compact`` when its pair memo is set
    up; while a listener has it and ``compact_ok()`` said yes, the pairs of the memo's
    first request are not reported through ``__call__`` but as stamps in a log, written out
    by ``compact`` before any other entry of that allocator, when the memo is flushed, and
    on ``sync_pending()`` (so a listener calls ``sync_pending()`` before reading what it
    recorded, and before detaching).
    """

    #: ``compact(addr, size, stream, stamps)``: write out logged memo pairs. ``stamps`` is a
    #: flat sequence ``free stamp, alloc stamp, free stamp, alloc stamp, ...`` (0: no such
    #: entry), oldest first; ``addr``, ``size`` (the memo's first request) and ``stream`` as
    #: in ``__call__``. Called with the lock held; it must consume ``stamps`` before it
    #: returns (the allocator clears the log afterwards) and must not raise.
    compact: Callable[[int, int, int, StampLog], None]
    #: ``compact_ok()``: whether pairs may be logged as stamps from now on (False when the
    #: entries would carry more than a stamp, e.g. an NVTX range). Asked when a memo is set
    #: up, with the lock held.
    compact_ok: Callable[[], bool]
    #: ``now()``: the stamp of a memo hit's allocation (truthy; a time, or a (time, stack)
    #: pair). Called on the hit path with the lock held: must be cheap.
    now: Callable[[], Any]
    #: ``free_now()``: the stamp of a deferred memo free (truthy). Called WITHOUT the lock,
    #: from the lock-free free of a memo hit, possibly in several threads at once.
    free_now: Callable[[], Any]
    #: The listener's entry capacity (None: unbounded). The allocator keeps at most
    #: ``2 * capacity`` stamps in its log (older ones would be dropped by the listener
    #: anyway); read when a memo is set up.
    capacity: int | None
    #: ``new_log(maxlen)``: the log the allocator keeps the stamps in (a :class:`StampLog`
    #: bounded to the newest ``maxlen`` stamps, None: unbounded), made when a memo is set up.
    #: Its optional ``hit(tfree)`` logs a pure hit's free stamp then ``now()``, in one call.
    new_log: Callable[[int | None], StampLog]


class StampLog(Protocol):
    """The log of memo stamps a :class:`CompactTrace` makes (``new_log``): a bounded
    ``collections.deque`` does; oldest first, at most its bound (the oldest dropped)."""

    def append(self, stamp: Any, /) -> None: ...

    def clear(self) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Any: ...


class PoolTrace(AllocatorTrace, Protocol):
    """An :class:`AllocatorTrace` that also hears which segments belong to private pools
    (optional; the history uses it to tag the trace entries of graph and user pools).

    The caching allocator calls ``pool_segment(addr, size, pool_id, live)`` for a segment of
    a private pool (:mod:`cudalab.allocator.pools`): with ``live=True`` just before its
    ``"segment_alloc"`` entry, with ``live=False`` just after its ``"segment_free"`` entry.
    Same rules as ``__call__`` (lock held, must not raise, must not call back).
    """

    pool_segment: Callable[[int, int, tuple[int, int], bool], None]


def report_pool_segment(trace: AllocatorTrace, addr: int, size: int,
                        pool_id: tuple[int, int], live: bool) -> None:
    """Tell ``trace`` that the segment at ``addr`` of a private pool starts (``live``) or
    ends, if it listens for that (:class:`PoolTrace`); nothing otherwise."""
    note = getattr(trace, "pool_segment", None)
    if note is not None:
        note(addr, size, pool_id, live)


class Traceable(Protocol):
    """What :func:`attach_trace` needs of an allocator (every cudalab allocator has it)."""

    _trace: AllocatorTrace | None

    def sync_pending(self) -> None: ...


#: allocator -> the trace attach_trace gave it, for the allocators traced now (weak keys: an
#: allocator dropped while traced leaves by itself). Invariant: the bus's allocation-trace
#: list is ``list(_attached.values())`` (``_publish`` writes it after every change).
_attached: weakref.WeakKeyDictionary[Traceable, AllocatorTrace] = weakref.WeakKeyDictionary()
#: allocator -> the finalizer that republishes once it is garbage collected (one each).
_watched: weakref.WeakKeyDictionary[Traceable, weakref.finalize[[], Traceable]] = (
    weakref.WeakKeyDictionary())


def _publish() -> None:
    """Set the bus's allocation-trace list (and so its flag) from :data:`_attached`; also
    a traced allocator's finalizer (its entry is gone from ``_attached`` by then)."""
    _observe.trace_subscribers[:] = list(_attached.values())


def attach_trace(allocator: Traceable, trace: AllocatorTrace) -> None:
    """Make ``trace`` the allocator's hook (replacing any previous one).

    Parameters
    ----------
    allocator
        A cudalab allocator (``cudalab.allocator.registry.get_allocator(device)`` or a
        private one).
    trace
        The hook; see :class:`AllocatorTrace` for what it may and may not do.

    Raises
    ------
    RuntimeError
        The allocator cannot be traced (``backend:cudaMallocAsync``); nothing changed.

    Notes
    -----
    Frees deferred before the call are applied first (``sync_pending``), so they are not
    reported to the new hook. The bus's allocation-trace list gets ``trace`` in place of the
    hook it replaces (and loses it when the allocator is garbage collected).
    """
    allocator.sync_pending()
    allocator._trace = trace
    _attached[allocator] = trace
    if allocator not in _watched:
        watch = _watched[allocator] = weakref.finalize(allocator, _publish)
        watch.atexit = False  # (nothing to publish at exit)
    _publish()


def detach_trace(allocator: Traceable) -> None:
    """Remove the allocator's hook, after writing out what it deferred (memo pairs logged
    as stamps go to the old hook first).

    Parameters
    ----------
    allocator
        A cudalab allocator; one without a hook is left as it is.
    """
    allocator.sync_pending()
    allocator._trace = None
    if _attached.pop(allocator, None) is not None:
        _publish()
