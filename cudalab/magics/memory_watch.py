"""``%cuda_memory watch``: one line per cell from ``pre_run_cell`` / ``post_run_cell``
hooks, with the cell's scoped peak and GPU time (see :class:`MemoryWatch`).

Per-cell cost is what the benchmark rows "watch hooks, called directly" and "watch on:
added cost per cell" (benchmarks/timing.py) measure: the hooks bind what they call once,
and record their events through :func:`cudalab.events.record_fast`.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from cudalab import _internal
from cudalab._internal import STATUS_NOT_READY as _NOT_READY
from cudalab._internal import format_bytes, format_time
from cudalab.magics.memory_args import is_simulated

__all__ = ["MemoryWatch"]

_event_handle = _internal.event_handle


class MemoryWatch:
    """pre/post_run_cell hooks printing one line per cell (see the module documentation).

    Per cell: ``pre`` opens a :class:`~cudalab.allocator.scope.PeakScope` and records the
    device's start event on its current stream (one driver call); ``post`` closes the scope
    and, only when a line is printed, records the end event and reads ``elapsed_time``,
    waiting for the end first only when it is not reached yet (``watch_sync``; "GPU
    running" otherwise): three driver calls per printed line (five when it waits), one per
    cell under the threshold. With no threshold (every cell prints) the end event is
    recorded first and the line built before the GPU time is read, so the GPU's latency
    from record to completion overlaps that work. The memory part of the line is reused
    while a cell leaves the numbers as the last one did. No dict, list or DataFrame is
    built.
    """

    def __init__(self, magics: Any, device: int | None, threshold: int):
        self.magics = magics
        self.device = device  # None: the current device at each cell start
        self.threshold = threshold
        self.scope: Any = None
        self.events: dict[int, tuple[Any, Any]] = {}  # device -> (start, end), made once
        self.ev_started: Any = None  # the (start, end) pair whose start this cell recorded
        self.t0 = 0.0
        self.dev = 0
        self.last_line: str | None = None
        self._sim: str | None = None  # ", simulated" or "", once CUDA is initialised
        from cudalab import streams
        from cudalab.allocator.scope import PeakScope
        from cudalab.events import Event, record_fast

        self._is_init = _internal.is_initialized
        self._tls = _internal.thread_state()  # the same object for the process's life
        self._record = record_fast
        self._current_stream = streams.current_stream
        self._head_key: tuple | None = None  # the last line's memory part, reused while equal
        self._head = ""
        self._Event = Event
        self._PeakScope = PeakScope
        self._scopes: dict[int, Any] = {}  # one PeakScope per device, restarted every cell
        #: Set for each cell by the torch/CuPy watch of ``--source auto`` (whose post hook runs
        #: first): True when it printed a library's line, and then a cell that left cudalab's
        #: allocator unchanged prints no cudalab line.
        self.idle_quiet = False

    def pre(self, info: Any = None) -> None:
        if getattr(info, "silent", False):
            return
        scope = self.scope
        if scope is not None and scope.running:  # a nested or repeated pre
            try:
                scope.stop()
            except RuntimeError:
                pass
        init = self._is_init()
        d = self.device if self.device is not None else (self._tls.device if init else 0)
        self.dev = d
        if init:
            scope = self._scopes.get(d)
            if scope is None:
                scope = self._scopes[d] = self._PeakScope(d)
            self.scope = scope.start()
        else:
            self.scope = self._PeakScope(None).start()
        self.ev_started = None
        if init:
            try:
                pair = self.events.get(d)
                if pair is None:
                    ev = self._Event
                    pair = self.events[d] = (ev(enable_timing=True), ev(enable_timing=True))
                self._record(pair[0], self._current_stream(d))
                self.ev_started = pair
            except Exception:
                self.ev_started = None
        self.t0 = time.perf_counter()

    def post(self, result: Any = None) -> None:
        scope = self.scope
        if scope is None or not scope.running:
            return
        info = getattr(result, "info", None)
        if getattr(info, "silent", False):
            return
        wall = time.perf_counter() - self.t0
        thr = self.threshold
        pair = self.ev_started
        # a recorded pair means CUDA was initialised at pre (and it stays initialised)
        gpu_text = "GPU n/a" if pair is not None or self._is_init() else "no CUDA context"
        ended = False
        if pair is not None and thr <= 0:
            # Every cell prints: record the end now, so that the GPU reaches it while the
            # line below is built (the wait for it is then mostly over).
            ended = self._end(pair)
            if not ended:
                pair = None
        scope.stop()
        self.scope = None
        start_alloc = scope.start_allocated
        d_alloc = scope.end_allocated - start_alloc
        d_res = scope.end_reserved - scope.start_reserved
        peak = scope.peak_allocated
        over = peak - start_alloc
        if thr > 0 and abs(d_alloc) < thr and abs(d_res) < thr and over < thr:
            self.last_line = None  # nothing printed: no end event, no wait
            return
        if self.idle_quiet and not (d_alloc or d_res or over):
            self.last_line = None  # cudalab's allocator idle beside torch's or CuPy's lines
            return
        key = (scope.device, d_alloc, d_res, peak, over)
        if key == self._head_key and self._sim is not None:
            head = self._head  # a cell that left memory as the last one did
        else:
            sim = self._sim
            if sim is None:
                sim = ", simulated" if is_simulated() else ""
                if self._is_init():
                    self._sim = sim  # the backend never changes once CUDA is initialised
            head = self._head = (
                f"[cudalab watch cuda:{scope.device}{sim}] Δallocated {format_bytes(d_alloc, signed=True)}"
                f" | Δreserved {format_bytes(d_res, signed=True)} | peak {format_bytes(peak)}"
                f" ({format_bytes(over, signed=True)} in cell) | ")
            self._head_key = key
        tail = f" | wall {format_time(wall)}"
        if pair is not None and (ended or self._end(pair)):
            try:
                ms = self._gpu_ms(*pair)
                gpu_text = "GPU running" if ms is None else f"GPU {format_time(ms / 1e3)}"
            except Exception:
                gpu_text = "GPU n/a"
        line = self.last_line = head + gpu_text + tail
        sys.stdout.write(line + "\n")  # one write (print makes two)

    def _gpu_ms(self, start: Any, end: Any) -> float | None:
        """The cell's GPU milliseconds: elapsed time is read first (by handle), and only if
        the end event is not reached yet is it waited for (``watch_sync``; None without)
        and read again, so a cell whose GPU work is over costs one driver call here. A
        failed status is read again through ``Event.elapsed_time``, which raises the
        driver's error."""
        fast: Any = _internal.fast_paths()
        fast = fast.event_elapsed_time
        hs, he = _event_handle(start), _event_handle(end)
        r = fast(hs, he)
        if r[0]:
            if r[0] != _NOT_READY:
                return start.elapsed_time(end)
            if not self.magics.watch_sync:
                return None
            end.synchronize()
            r = fast(hs, he)
            if r[0]:
                return start.elapsed_time(end)
        return r[1]

    def _end(self, pair: tuple[Any, Any]) -> bool:
        """Record the cell's end event on the current stream (False if that failed)."""
        try:
            self._record(pair[1], self._current_stream(self.dev))
            return True
        except Exception:
            return False

    def stop(self) -> None:
        if self.scope is not None and self.scope.running:
            try:
                self.scope.stop()
            except RuntimeError:
                pass
        self.scope = None

