"""Several traces on one time axis: :class:`TraceLanes`, one :class:`Lane` per trace (a rank
of a job, a run), for the explorer's lanes (:class:`cudalab.widgets.LanesExplorer`).

Each lane is one device's trace of one :class:`~cudalab.memory_tools.trace_views.TraceViews`
(the device the caller names, else the first with entries), labelled by the caller (the
cluster view labels a rank's lane with its host, rank and GPU). A lane whose trace could not
be had (a rank that did not answer) is kept, empty, with the reason (:attr:`Lane.error`),
so the lanes keep their order and a missing one shows where it belongs.

The axis is time: an entry's ``time_us`` (microseconds since the epoch, as torch records
them), shared by every lane. :meth:`TraceLanes.tile` gives a lane's timeline between two
times in at most ``bins`` bins, from :meth:`TraceViews.tile` over the rows recorded then
(plus the row before, whose level holds at the window's start), each bin placed at the time
of its first row: the same min/max bins as the single-trace explorer, so no peak is lost.
Times within one device's trace are taken in recorded order (a clock that stepped back
does not reorder entries: each row's time is the largest seen up to it).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from cudalab.memory_tools.trace_index import TraceIndex, index_snapshot, open_trace
from cudalab.memory_tools.trace_views import TraceViews

__all__ = ["Lane", "TraceLanes", "lane", "lost_lane", "trace_lanes"]


@dataclass(frozen=True, slots=True)
class Lane:
    """One lane: a device's trace, or why there is none.

    ``views`` is None exactly when ``error`` is set; then ``device`` is -1 and
    ``start == stop == 0``.
    """

    label: str  # shown beside the lane (non-empty)
    views: TraceViews | None  # the trace's views; None: no trace (see error)
    device: int  # the device whose entries the lane shows (-1: none)
    start: int  # its first row in views.index (0 <= start <= stop)
    stop: int  # one past its last row (stop - start: the lane's entries, >= 0)
    error: str = ""  # "" when the lane has a trace; otherwise why not (non-empty)
    key: Any = None  # the caller's name for it (the cluster view: the rank)

    def __post_init__(self) -> None:
        if not isinstance(self.label, str) or not self.label:
            raise ValueError(f"Lane: label is {self.label!r:.40}, expected a non-empty str")
        if (self.views is None) != bool(self.error):
            raise ValueError("Lane: a lane has a trace (views) or an error, exactly one")
        if not 0 <= self.start <= self.stop:
            raise ValueError(f"Lane: rows [{self.start}, {self.stop}) are not a range")

    @property
    def lost(self) -> bool:
        """Whether the lane has no trace (:attr:`error` says why)."""
        return self.views is None

    @property
    def entries(self) -> int:
        """The lane's entries (0 for a lost lane)."""
        return self.stop - self.start


def _views(source: Any, label: str) -> TraceViews:
    if isinstance(source, TraceViews):
        return source
    if isinstance(source, TraceIndex):
        return TraceViews(source)
    if isinstance(source, dict):
        return TraceViews(index_snapshot(source, source=label))
    if isinstance(source, (str, os.PathLike)):
        return TraceViews(open_trace(source))
    raise TypeError(f"lane {label!r}: expected a snapshot dict, a path, a TraceIndex or "
                    f"TraceViews, not {type(source).__name__}")


def lane(label: str, source: Any, *, device: int | None = None, key: Any = None) -> Lane:
    """A lane of ``source`` (a snapshot dict, a snapshot file, a TraceIndex or TraceViews),
    showing ``device``'s entries when it has any, else the first device's.

    Raises
    ------
    TypeError
        ``source`` is none of those.
    SnapshotLoadError
        The snapshot is malformed (a ValueError saying why).
    """
    views = _views(source, label)
    if not views.bounds:
        return Lane(label, views, -1, 0, 0, key=key)
    known = [d for d, _, _ in views.bounds]
    d, a, b = views.device_range(device if device in known else None)
    return Lane(label, views, d, a, b, key=key)


def lost_lane(label: str, error: str, key: Any = None) -> Lane:
    """A lane without a trace: ``error`` says why (e.g. the rank did not answer)."""
    return Lane(label, None, -1, 0, 0, error=str(error) or "no trace", key=key)


class TraceLanes:
    """Lanes on one time axis (see the module documentation).

    Parameters
    ----------
    lanes : iterable of Lane
        In the order shown (top first).
    """

    def __init__(self, lanes: Iterable[Lane]):
        self.lanes: tuple[Lane, ...] = tuple(lanes)
        for x in self.lanes:
            if not isinstance(x, Lane):
                raise TypeError(f"TraceLanes: expected Lane records, got {type(x).__name__}")
        # each lane's times in recorded order, made non-decreasing (searched, never reordered)
        self._times: list[NDArray[np.int64]] = []
        for x in self.lanes:
            if x.views is None or not x.entries:
                self._times.append(np.zeros(0, np.int64))
            else:
                times = x.views.index.time_us[x.start:x.stop].astype(np.int64)
                self._times.append(np.maximum.accumulate(times))

    def __len__(self) -> int:
        return len(self.lanes)

    def __repr__(self) -> str:
        lost = sum(x.lost for x in self.lanes)
        return (f"TraceLanes({len(self.lanes)} lanes, {lost} lost, "
                f"{sum(x.entries for x in self.lanes):,} entries)")

    def lane_bounds(self, i: int) -> tuple[int, int] | None:
        """``(first, last)`` entry time of lane ``i`` (microseconds), None without entries."""
        t = self._times[i]
        return (int(t[0]), int(t[-1])) if len(t) else None

    @property
    def bounds(self) -> tuple[int, int]:
        """``(first, last)`` time over every lane's entries (microseconds): the shared axis;
        ``(0, 1)`` when no lane has entries, and never an empty span."""
        spans = [b for b in map(self.lane_bounds, range(len(self.lanes))) if b is not None]
        if not spans:
            return 0, 1
        first, last = min(a for a, _ in spans), max(b for _, b in spans)
        return first, max(last, first + 1)

    def row_at(self, i: int, time_us: float) -> int | None:
        """Lane ``i``'s row (of its views' index) in effect at ``time_us``: its last entry
        recorded at or before then; None before its first entry, or for a lost lane."""
        t = self._times[i]
        k = int(np.searchsorted(t, time_us, side="right")) - 1
        return None if k < 0 else self.lanes[i].start + k

    def tile(self, i: int, start_us: float, stop_us: float, bins: int = 1000) -> dict[str, Any]:
        """Lane ``i``'s timeline between two times in at most ``bins`` bins:
        :meth:`TraceViews.tile`'s ``rows``, ``alloc_min``, ``alloc_max``, ``reserved_max``
        and ``cells`` of the rows recorded then (and the row before, whose level holds at
        ``start_us``), with ``x_us`` (each bin's start, its first row's time clipped to
        ``start_us``) and ``end_us`` (the next bin's start; the last bin ends at the last
        row's time, clipped to ``stop_us``). Empty lists for a lost lane or no rows."""
        x, t = self.lanes[i], self._times[i]
        empty: dict[str, Any] = {"rows": [], "alloc_min": [], "alloc_max": [],
                                 "reserved_max": [], "time_us": [], "cells": [],
                                 "x_us": [], "end_us": []}
        if x.views is None or not len(t) or stop_us <= start_us:
            return empty
        lo = int(np.searchsorted(t, start_us, side="left"))
        hi = int(np.searchsorted(t, stop_us, side="right"))
        lo = max(lo - 1, 0)  # (the level in effect at start_us)
        if hi <= lo or t[lo] > stop_us:
            return empty
        tile = x.views.tile(x.start + lo, x.start + hi, max(int(bins), 1))
        first = np.asarray(tile["rows"], np.int64) - x.start
        xs = np.maximum(t[first], start_us)
        ends = np.concatenate((xs[1:], [min(int(t[hi - 1]), stop_us)]))
        tile["x_us"] = xs.tolist()
        tile["end_us"] = np.maximum(ends, xs).tolist()
        return tile


def trace_lanes(sources: Mapping[str, Any], errors: Mapping[str, str] | None = None, *,
                devices: Mapping[str, int] | None = None,
                keys: Mapping[str, Any] | None = None) -> TraceLanes:
    """Lanes of ``sources`` (label -> snapshot dict, file, TraceIndex or TraceViews; a value
    None: no trace) in their order, then of ``errors``' labels not among them (label -> why
    it has no trace). A source that cannot be read becomes a lost lane saying why.

    Parameters
    ----------
    sources : mapping of str to snapshot, path, TraceIndex, TraceViews or None
    errors : mapping of str to str, optional
        Why a lane has no trace (used for a None source, and for labels not in sources).
    devices : mapping of str to int, optional
        The device each lane shows (default: its first with entries).
    keys : mapping of str to object, optional
        Each lane's :attr:`Lane.key`.
    """
    errors = dict(errors or {})
    devices, keys = dict(devices or {}), dict(keys or {})
    out = []
    for label, source in sources.items():
        key = keys.get(label)
        if source is None:
            out.append(lost_lane(label, errors.get(label, "no trace"), key))
            continue
        try:
            out.append(lane(label, source, device=devices.get(label), key=key))
        except (ValueError, TypeError, OSError) as exc:  # shown in its lane, not raised
            out.append(lost_lane(label, f"cannot read the trace: {type(exc).__name__}: "
                                        f"{exc}"[:300], key))
    out.extend(lost_lane(label, why, keys.get(label)) for label, why in errors.items()
               if label not in sources)
    return TraceLanes(out)
