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
from typing import Any

from cudalab import devices as _devices

__all__ = ["PeakScope", "peak_scope"]


def _allocator(device: int):
    global _existing
    if _existing is None:  # (imported on first use: the allocator module imports this one)
        from cudalab.allocator.allocator import existing_allocator

        _existing = existing_allocator
    return _existing(device)


_existing: Any = None


def _take(a) -> None:
    """Acquire allocator ``a``'s lock (its uncontended take without the method call of
    ``acquire``; scopes open and close around every notebook cell)."""
    try:
        a._take()
    except (IndexError, AttributeError):  # busy, or a lock without the token fast path
        a._lock.acquire()


def _current(a) -> tuple[int, int]:
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

    def __init__(self, device: Any = None):
        self.device = None if device is None else _devices._device_index(device)
        self.start_allocated = self.start_reserved = 0
        self.end_allocated = self.end_reserved = 0
        self._peak = 0
        self._seen = 0
        self._alloc = None
        self._t0 = 0.0
        self.elapsed = 0.0
        self.running = False

    def start(self) -> PeakScope:
        if self.running:
            raise RuntimeError("this peak scope is already running")
        if self.device is None:
            self.device = _devices.current_device() if _devices._initialized else 0
        a = _allocator(self.device) if _devices._initialized else None
        self._alloc = a
        if a is not None:
            a.sync_pending()
            _take(a)
            try:
                cur, res = _current(a)
                a._fold_mark()  # open scopes keep what it saw; the watermark drops to `cur`
                if not isinstance(a._scopes, list):
                    a._scopes = []
                a._scopes.append(self)
            finally:
                a._lock.release()
        else:
            cur = res = 0
        self.start_allocated, self.start_reserved = cur, res
        self._seen = cur
        self._t0 = time.perf_counter()
        self.running = True
        return self

    def _live_peak(self) -> int:
        a = self._alloc
        if a is None:  # the allocator appeared inside the scope: its whole life counts
            a = _allocator(self.device) if _devices._initialized else None
            return max(self._seen, a._mark) if a is not None else self._seen
        a.sync_pending()
        return max(self._seen, a._mark)

    def stop(self) -> PeakScope:
        if not self.running:
            raise RuntimeError("this peak scope is not running")
        self.elapsed = time.perf_counter() - self._t0
        a = self._alloc
        if a is not None:
            a.sync_pending()
            _take(a)
            try:
                peak = max(self._seen, a._mark)
                if self in a._scopes:
                    a._scopes.remove(self)
            finally:
                a._lock.release()
            self.end_allocated, self.end_reserved = _current(a)
        else:
            peak = self._live_peak()
            self.end_allocated, self.end_reserved = _current(
                _allocator(self.device) if _devices._initialized else None)
        self._peak = max(peak, self.start_allocated, self.end_allocated)
        self.running = False
        return self

    @property
    def peak_allocated(self) -> int:
        if self.running:
            return max(self._live_peak(), self.start_allocated)
        return self._peak

    @property
    def delta_allocated(self) -> int:
        return self.end_allocated - self.start_allocated

    @property
    def delta_reserved(self) -> int:
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
    """A :class:`PeakScope` for ``device`` (default: the current device), not yet started:
    use it in a ``with`` block, or call ``start()``/``stop()``."""
    return PeakScope(device)
