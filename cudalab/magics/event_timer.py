"""The event timer of ``%%cuda_timed``: a pool of timing events reused across runs, and
:class:`EventTimer`, which records them around every repeat on every timed stream and
reads the GPU times after the run's single host sync.

This is the hot path of the benchmark row "%%cuda_timed per-repeat overhead"
(benchmarks/timing.py): a repeat of an empty body costs one event record by handle, one
``elapsed_time`` (on the real backend all of a run's in one C call, the fast-call registry's
``event_elapsed_times``) and two clock reads, and the hooks bind everything they use
beforehand.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from cudalab import _internal

__all__ = ["EventPool", "EventTimer"]

_perf = time.perf_counter
_event_handle = _internal.event_handle
_stream_handle = _internal.stream_handle


class EventPool:
    """Timing events per device, reused across runs (creating events costs driver calls).

    Each device has a list of events and the parallel list of their driver handles (the hot
    path records by handle). :meth:`take` hands out the next ``n`` events and creates only
    what the pool lacks, so a run takes all it needs before its timed loop and a later run
    of the same length creates none."""

    def __init__(self) -> None:
        self._events: dict[int, list[Any]] = {}
        self._handles: dict[int, list[Any]] = {}
        self._missing: dict[int, bool] = {}  # a handle of the device's list may be None
        self._used: dict[int, int] = {}

    def reset(self) -> None:
        self._used.clear()

    def mark(self) -> dict[int, int]:
        """The cursor, to :meth:`release` back to (a nested %cuda_timed takes events beyond
        the outer run's)."""
        return dict(self._used)

    def release(self, mark: dict[int, int]) -> None:
        self._used = dict(mark)

    def take(self, device: int, n: int) -> list[Any]:
        """The next ``n`` events of ``device`` (a handle may still be missing: the driver
        refused to create it earlier, and :meth:`cudalab.Event.record` creates it)."""
        have, _handles, start = self._take(device, n)
        return have[start:start + n]

    def take_handles(self, device: int, n: int) -> tuple[list[Any], list[Any]]:
        """The next ``n`` events of ``device`` and their driver handles, all created (the
        driver's error is raised here, before any timed loop)."""
        have, handles, start = self._take(device, n)
        if self._missing.get(device):
            for i in range(len(have)):
                if handles[i] is None:
                    ev = have[i]
                    if _event_handle(ev) is None and start <= i < start + n:
                        _internal.create_event(ev, device)
                    handles[i] = _event_handle(ev)
            self._missing[device] = any(h is None for h in handles)
        return have[start:start + n], handles[start:start + n]

    def _take(self, device: int, n: int) -> tuple[list[Any], list[Any], int]:
        from cudalab.events import Event

        have = self._events.setdefault(device, [])
        handles = self._handles.setdefault(device, [])
        start = self._used.get(device, 0)
        while len(have) < start + n:
            ev = Event(enable_timing=True)
            try:
                _internal.create_event(ev, device)  # now, not at the first record in a repeat
            except Exception:
                self._missing[device] = True
            have.append(ev)
            handles.append(_event_handle(ev))
        self._used[device] = start + n
        return have, handles, start

    def trim(self, keep: int = 1 << 15) -> None:
        for events in self._events.values():
            del events[keep:]
        for handles in self._handles.values():
            del handles[keep:]


class _Group:
    """One (device, stream) a timer records on, with the events taken for it."""

    __slots__ = ("device", "stream", "sh", "events", "handles")

    def __init__(self, device: int, stream: Any):
        self.device = device
        self.stream = stream
        # the stream's seam handle, read once: the timer lives for one run, as the hot
        # path's closure (benchmark row "%%cuda_timed per-repeat overhead") binds it too
        self.sh = _stream_handle(stream)
        self.events: list[Any] = []
        self.handles: list[Any] = []


class EventTimer:
    """Events on every timed (device, stream) for up to ``capacity`` repeats, and host clocks.

    * **Shared boundaries** (``shared``: nothing untimed runs between repeats, i.e. no setup
      statement and no --cold flush): repeat j runs from boundary event ``b[j]`` to
      ``b[j + 1]``, so R repeats record R + 1 events per stream: one record per repeat.
    * **Split** (a setup statement or an L2 flush runs before every repeat): repeat j has its
      own start event (slot 2j, recorded after them) and end event (slot 2j + 1).

    The events are taken from the pool before the timed loop (for up to ``CHUNK`` repeats;
    longer runs take the next chunk between two repeats, and a shared run then starts the
    next repeat from a fresh event, so the pause is outside every repeat). Nothing is read
    while the repeats run: the host syncs once, on the last end events, then calls
    ``elapsed_time`` once per repeat and stream. To keep at most ``lag`` repeats in flight
    without a driver call per repeat, the end of repeat k - lag is queried only every
    ``stride`` repeats: the stride doubles (up to ``MAX_STRIDE``) while the GPU keeps up
    and drops to 1 (a wait on that event, outside the host clock) when it does not. The lag
    starts at two repeats; a wait shorter than ``LATENCY`` seconds means the GPU was not
    behind, only not there yet (an empty body's repeats take less than the GPU's latency
    from record to completion), so the lag doubles (up to ``MAX_LAG``) instead of waiting
    again and again; a longer wait puts it back to two. The work queued ahead thus stays
    within about two repeats or ``MAX_LAG`` x ``LATENCY``, which bounds how far a run can
    pass ``--max-time``.
    """

    CHUNK = 8192
    MAX_STRIDE = 32
    MAX_LAG = 32
    LATENCY = 50e-6

    def __init__(self, devs: list[int], streams: dict[int, Any], side: dict, pool: EventPool,
                 capacity: int, flush: Any = None, shared: bool = True):
        self.devs = devs
        self.pool = pool
        self.capacity = max(1, int(capacity))
        self.flush = flush  # callable run before the start events (--cold)
        self.shared = bool(shared) and flush is None
        self.dev_groups: list[list[_Group]] = []  # per timed device, the current stream first
        for d in devs:
            lst = [streams[d]] + [s for (dd, _sid), s in side.items() if dd == d]
            self.dev_groups.append([_Group(d, s) for s in lst])
        self.groups = [g for gs in self.dev_groups for g in gs]
        # one device, one context: record by handle (a failed record retries through
        # Event.record, which makes the context current and raises the driver's error)
        self.raw = len(devs) == 1
        self.fast: Any = _internal.fast_paths()
        self.reps = 0  # repeats the events taken so far cover
        self._take(min(self.capacity, self.CHUNK))
        self.cpu = [0.0] * self.capacity  # host seconds per repeat
        self.breaks: dict[int, list[Any]] = {}  # shared: repeat -> fresh start event per group
        self._stride = 1
        self._lag = 2  # repeats allowed in flight
        self._next_check = 2  # the first in-flight check: after repeat 1, on repeat 0's end
        self._nxt = [self._next_limit()]

    # ----------------------------------------------------------------- slots and events
    def _take(self, n: int) -> None:
        """Events for ``n`` more repeats on every group (before the loop, or between two)."""
        slots = (n + (self.reps == 0)) if self.shared else 2 * n
        for g in self.groups:
            evs, hs = self.pool.take_handles(g.device, slots)
            g.events.extend(evs)
            g.handles.extend(hs)
        self.reps += n

    def _next_limit(self) -> int:
        grow = self.reps if self.reps < self.capacity else self.capacity + 1
        return min(self._next_check, grow)

    def _end_slot(self, j: int) -> int:
        return j + 1 if self.shared else 2 * j + 1

    def _start_slot(self, j: int) -> int:
        return j if self.shared else 2 * j

    def _record(self, slot: int) -> None:
        """Record every group's event ``slot`` on its stream."""
        if self.raw:
            rec = self.fast.event_record
            for g in self.groups:
                if rec(g.handles[slot], g.sh)[0]:
                    g.events[slot].record(g.stream)
        else:
            for g in self.groups:
                g.events[slot].record(g.stream)

    def _between(self, k: int) -> None:
        """After repeat k - 1 (every few repeats): take more events when the taken ones run
        out, and keep at most ``lag`` repeats in flight."""
        if k == self.reps and k < self.capacity:
            self._take(min(self.CHUNK, self.capacity - k))
            if self.shared:  # repeat k starts after this pause, from a fresh event
                fresh = [self.pool.take(g.device, 1)[0] for g in self.groups]
                for g, ev in zip(self.groups, fresh):
                    ev.record(g.stream)
                self.breaks[k] = fresh
        if k >= self._next_check and k >= self._lag:
            slot = self._end_slot(k - self._lag)
            query = self.fast.event_query
            waited = -1.0
            for g in self.groups:
                if query(g.handles[slot])[0]:  # not done (or an error, which this raises)
                    if waited < 0:
                        waited = 0.0
                    t0 = _perf()
                    g.events[slot].synchronize()
                    waited += _perf() - t0
            if waited < 0:
                self._stride = min(2 * self._stride, self.MAX_STRIDE)
            else:
                self._stride = 1
                self._lag = (min(2 * self._lag, self.MAX_LAG) if waited < self.LATENCY else 2)
            self._next_check = max(k + self._stride, self._lag)
        self._nxt[0] = self._next_limit()

    # ----------------------------------------------------------------- the timed loop
    def loop_hooks(self, repeat: int, max_time: float = math.inf) -> tuple[Any, Any]:
        """``(begin, end)`` for the timing function, and the clock started: the function
        runs ``t0 = begin()`` before a repeat's loops and ``j = end(j, t0)`` after them;
        ``end`` returns j + 1 to go on, ``~(j + 1)`` to stop (``repeat`` repeats done, or
        ``max_time`` seconds would be passed by one more). Shared mode records the first
        boundary here."""
        repeat = min(int(repeat), self.capacity)
        perf, cpu, between, nxt = _perf, self.cpu, self._between, self._nxt
        if self.shared:
            self._record(0)
        t_start = perf()
        if self.shared and self.raw and len(self.groups) == 1:  # the hot path: one record
            g = self.groups[0]
            hs, sh, evs, s = g.handles, g.sh, g.events, g.stream
            rec = self.fast.event_record

            def end_one(j: int, t0: float) -> int:
                t = perf()
                cpu[j] = t - t0
                k = j + 1
                if rec(hs[k], sh)[0]:
                    evs[k].record(s)  # makes the context current, or raises the error
                if k >= nxt[0]:
                    between(k)
                if k < repeat and (t - t_start) * (k + 1) <= max_time * k:
                    return k
                return ~k

            return perf, end_one
        record, flush = self._record, self.flush
        cur = [0]
        step = 1 if self.shared else 2  # repeat j ends at slot step * j + 1 (_end_slot)

        def begin() -> float:
            if flush is not None:
                flush()
            record(2 * cur[0])
            return perf()

        def end(j: int, t0: float) -> int:  # every group, either flavour
            t = perf()
            cpu[j] = t - t0
            record(step * j + 1)
            k = cur[0] = j + 1
            if k >= nxt[0]:
                between(k)
            if k < repeat and (t - t_start) * (k + 1) <= max_time * k:
                return k
            return ~k

        return (perf if self.shared else begin), end

    # ----------------------------------------------------------------- single runs
    def begin_single(self) -> float:
        """Single mode: flush (--cold), record the start events; the host clock."""
        if self.flush is not None:
            self.flush()
        self._record(0)
        return _perf()

    def end_single(self) -> None:
        self._record(1)

    # ----------------------------------------------------------------- after the loop
    def finish(self, count: int) -> None:
        """Wait for the end events of repeat ``count - 1`` (the run's one host sync)."""
        if count <= 0:
            return
        slot = self._end_slot(count - 1)
        for g in self.groups:
            g.events[slot].synchronize()

    def abort(self) -> None:
        """After an exception: let the queued work finish before the events are reused."""
        for g in self.groups:
            try:
                g.stream.synchronize()
            except Exception:
                pass

    def _starts_ends(self, gi: int, g: _Group, count: int) -> tuple[list[Any], list[Any]]:
        hs = g.handles
        if self.shared:
            starts, ends = hs[:count], hs[1:count + 1]
            for k, fresh in self.breaks.items():
                if k < count:
                    starts[k] = _event_handle(fresh[gi])
            return starts, ends
        return hs[0:2 * count:2], hs[1:2 * count:2]

    def _device_ms(self, k: int, count: int) -> list[float]:
        """Milliseconds of repeats 0..count-1 on the k-th device: the latest end minus the
        earliest start over its streams (one elapsed_time per repeat and stream)."""
        eet = _internal.backend().event_elapsed_time
        gs = self.dev_groups[k]
        base = self.groups.index(gs[0])
        pairs = [self._starts_ends(base + i, g, count) for i, g in enumerate(gs)]
        starts0, ends0 = pairs[0]
        if len(pairs) == 1:
            batch = self.fast.event_elapsed_times
            if batch is not None:  # the real backend: every repeat in one C call
                status, ms = batch(starts0, ends0)
                if status:
                    return list(map(eet, starts0, ends0))  # raises the driver's error
                return ms
            # by handle, statuses checked at the end (a checked call per repeat costs two
            # Python frames more); a failure is read again through the checked method
            res = list(map(self.fast.event_elapsed_time, starts0, ends0))
            if not res:
                return []
            status, ms = zip(*res)
            if any(status):
                return list(map(eet, starts0, ends0))  # raises the driver's error
            return list(ms)
        out = []
        for j in range(count):
            ref = starts0[j]
            first = 0.0
            last = eet(ref, ends0[j])
            for st, en in pairs[1:]:
                first = min(first, eet(ref, st[j]))
                last = max(last, eet(ref, en[j]))
            out.append(last - first)
        return out

    def read(self, count: int) -> tuple[list[np.ndarray], np.ndarray]:
        """(GPU seconds per device and repeat, host seconds per repeat) after :meth:`finish`,
        as float64 arrays (converted at once: a run may hold millions of repeats)."""
        gpu = [np.asarray(self._device_ms(k, count), dtype=np.float64) * 1e-3
               for k in range(len(self.devs))]
        return gpu, np.asarray(self.cpu[:count], dtype=np.float64)

    def gpu_seconds(self, k: int, j: int) -> float:
        """GPU seconds of repeat ``j`` on the ``k``-th device."""
        return self._device_ms(k, j + 1)[j] * 1e-3

    def start_event(self, k: int, j: int = 0) -> Any:
        """The start event of repeat ``j`` on the ``k``-th device's current stream."""
        fresh = self.breaks.get(j) if self.shared else None
        if fresh is not None:
            return fresh[self.groups.index(self.dev_groups[k][0])]
        return self.dev_groups[k][0].events[self._start_slot(j)]

    def start_events(self, j: int = 0) -> dict[int, Any]:
        return {d: self.start_event(k, j) for k, d in enumerate(self.devs)}
