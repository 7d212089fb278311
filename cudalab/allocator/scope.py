"""Scoped peaks: the peak of allocated memory inside a region, without resetting anyone's peak.

``torch.cuda.reset_peak_memory_stats()`` is global: a notebook cell or a profiler that
resets it to measure its own region destroys the peak another part of the program is
watching. :func:`peak_scope` measures a region instead::

    with cudalab.memory.peak_scope() as scope:
        step()
    print(scope.peak_allocated - scope.start_allocated)   # extra memory the step needed

Each allocator keeps a watermark of allocated bytes next to its peak (one comparison on the
allocation path, the same one that updates the peak). A scope opening first hands the
watermark's value to the scopes already open, then lowers it to the current value; a scope's
peak is the larger of what it was handed and the watermark when it closes. Scopes may
overlap in any order (a cell's watch scope and a ``%cuda_memory mark``), and
``max_memory_allocated`` is never touched. ``reset_peak_memory_stats``
inside a scope is fine too: the scope keeps what it had seen.

Scopes are per device and process-wide (allocations from every thread count), like the
allocator's own peak.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from cudalab import devices as _devices
from cudalab.allocator.registry import existing_allocator

if TYPE_CHECKING:
    from cudalab.allocator.stats import DeviceStats

__all__ = ["PeakScope", "peak_scope"]


class _ScopeHost(Protocol):
    """What a peak scope uses of an allocator (every
    :class:`~cudalab.allocator.base.Allocator` has it, declared there):

    * ``stats`` and ``sync_pending()``, to read the counters;
    * ``_lock``, a :class:`~cudalab.allocator.token_lock.TokenLock` or a
      ``threading.Lock``, taken with its own ``acquire()``/``release()`` (the cheap way in
      for both; see token_lock);
    * the watermark ``_mark``, the open scopes ``_scopes`` and ``_fold_mark()``, which
      hands the watermark to the open scopes' ``_seen`` and lowers it to the current value.
    """

    stats: DeviceStats
    _lock: Any
    _mark: int
    _scopes: Any

    def sync_pending(self) -> None: ...

    def _fold_mark(self) -> None: ...


#: The allocator of a device, None when it has none yet (the registry's function itself:
#: no wrapper call on the watch's per-cell path, see start).
_allocator: Callable[[int], _ScopeHost | None] = existing_allocator


def _current(a: _ScopeHost | None) -> tuple[int, int]:
    """(allocated, reserved) bytes of ``a`` now ((0, 0) without an allocator)."""
    if a is None:
        return 0, 0
    st = a.stats
    return st.small.b_alloc + st.large.b_alloc, st.small.b_res + st.large.b_res


class PeakScope:
    """The allocated-memory peak of one device over a region (see the module doc).

    Use as a context manager, or call :meth:`start` and :meth:`stop` (IPython's pre/post
    cell hooks do). After :meth:`stop`: ``start_allocated``, ``end_allocated``,
    ``peak_allocated`` (the highest allocated value inside the region, at least the start
    and end values), ``start_reserved``, ``end_reserved``, ``elapsed`` (seconds, host clock).
    While running, :attr:`peak_allocated` reads the live value.
    """

    __slots__ = ("device", "start_allocated", "start_reserved", "end_allocated", "end_reserved",
                 "_peak", "_seen", "_alloc", "_t0", "elapsed", "running")

    def __init__(self, device: Any = None) -> None:
        #: The device index; None until :meth:`start` when the scope was made for the current
        #: device.
        self.device: int | None = None if device is None else _devices.device_index(device)
        self.start_allocated = self.start_reserved = 0
        self.end_allocated = self.end_reserved = 0
        #: The peak once stopped: at least start_allocated and end_allocated.
        self._peak = 0
        #: The highest watermark handed to this scope while open (by ``_fold_mark``).
        #: Invariant: the scope's live peak is ``max(_seen, allocator._mark)``.
        self._seen = 0
        self._alloc: _ScopeHost | None = None
        self._t0 = 0.0
        self.elapsed = 0.0
        self.running = False

    def start(self) -> PeakScope:
        """Open the scope: its peak starts from the allocated bytes now.

        Returns
        -------
        PeakScope
            ``self``, running.

        Raises
        ------
        RuntimeError
            When the scope is already running.
        """
        if self.running:
            raise RuntimeError("this peak scope is already running")
        if self.device is None:
            self.device = _devices.current_device() if _devices.initialized else 0
        # Written out (no helper calls) for benchmark row "watch on: added cost per cell"
        # (benchmarks/timing.py): the watch opens and closes a scope around every cell.
        a = _allocator(self.device) if _devices.initialized else None
        self._alloc = a
        if a is not None:
            a.sync_pending()
            lock = a._lock
            lock.acquire()  # the lock's own API, for a TokenLock and a threading.Lock alike
            try:
                st = a.stats
                cur = st.small.b_alloc + st.large.b_alloc
                res = st.small.b_res + st.large.b_res
                a._fold_mark()  # open scopes keep what it saw; the watermark drops to `cur`
                if not isinstance(a._scopes, list):
                    a._scopes = []
                a._scopes.append(self)
            finally:
                lock.release()
        else:
            cur = res = 0
        self.start_allocated, self.start_reserved = cur, res
        self._seen = cur
        self._t0 = time.perf_counter()
        self.running = True
        return self

    def _late_allocator(self) -> _ScopeHost | None:
        """The allocator of a scope that started before its device had one."""
        if not _devices.initialized or self.device is None:
            return None
        return _allocator(self.device)

    def _live_peak(self) -> int:
        a = self._alloc
        if a is None:  # the allocator appeared inside the scope: its whole life counts
            a = self._late_allocator()
            return max(self._seen, a._mark) if a is not None else self._seen
        a.sync_pending()
        return max(self._seen, a._mark)

    def stop(self) -> PeakScope:
        """Close the scope and fix its ``end_*``, ``peak_allocated`` and ``elapsed``.

        Returns
        -------
        PeakScope
            ``self``, stopped.

        Raises
        ------
        RuntimeError
            When the scope is not running.
        """
        if not self.running:
            raise RuntimeError("this peak scope is not running")
        self.elapsed = time.perf_counter() - self._t0
        a = self._alloc
        if a is not None:
            a.sync_pending()
            lock = a._lock
            lock.acquire()
            try:
                peak = max(self._seen, a._mark)
                if self in a._scopes:
                    a._scopes.remove(self)
            finally:
                lock.release()
            self.end_allocated, self.end_reserved = _current(a)
        else:
            peak = self._live_peak()
            self.end_allocated, self.end_reserved = _current(self._late_allocator())
        self._peak = max(peak, self.start_allocated, self.end_allocated)
        self.running = False
        return self

    @property
    def peak_allocated(self) -> int:
        """The highest allocated bytes inside the region (the live value while running)."""
        if self.running:
            return max(self._live_peak(), self.start_allocated)
        return self._peak

    @property
    def delta_allocated(self) -> int:
        """``end_allocated - start_allocated``."""
        return self.end_allocated - self.start_allocated

    @property
    def delta_reserved(self) -> int:
        """``end_reserved - start_reserved``."""
        return self.end_reserved - self.start_reserved

    def __enter__(self) -> PeakScope:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "done"
        return (f"<PeakScope device={self.device} {state} start={self.start_allocated} "
                f"peak={self.peak_allocated} end={self.end_allocated}>")


def peak_scope(device: Any = None) -> PeakScope:
    """A :class:`PeakScope` for ``device``, not yet started.

    Parameters
    ----------
    device : int, str, Device or None, optional
        The device (default: the current device when the scope starts).

    Returns
    -------
    PeakScope
        Use it in a ``with`` block, or call ``start()`` and ``stop()``.

    Raises
    ------
    ValueError
        For a device index out of range.
    """
    return PeakScope(device)
