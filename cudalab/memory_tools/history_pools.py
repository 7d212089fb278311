"""Which private pool (CUDA graph pool, MemPool) each entry of the allocation history is in.

The history's entries keep torch's fields only; the pool of an entry follows from where and
when it happened. The allocator reports every segment of a private pool when it starts and
when it ends (``pool_segment`` of :class:`cudalab.allocator.hooks.PoolTrace`), and this
module keeps those lifetimes per device: ``[start, end, pool id, t0_ns, t1_ns or None]``.
:func:`tag` then gives each trace entry dict that lies in such a segment while it lived a
``segment_pool_id`` key (the snapshot segments' field); entries of the default pool have
none (readers treat a missing key as ``(0, 0)``).

Segments alive when recording starts are taken from the allocator (:func:`seed`, with start
time 0). Ended segments are kept until :data:`MAX_ENDED` of them have ended on a device
(the oldest are dropped first; the entries of a dropped one are then untagged).

Threads: one leaf lock guards the table (nothing is called while it is held).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeAlias

from cudalab.memory_tools.history_ring import TraceEntry

__all__ = ["MAX_ENDED", "clear", "hook", "note", "pool_of", "seed", "tag"]

#: Ended pool segments remembered per device.
MAX_ENDED = 4096
#: Actions whose ``addr`` is a device address (``oom`` carries the free bytes there).
_ADDR_ACTIONS = frozenset(("alloc", "free_requested", "free_completed", "segment_alloc",
                           "segment_free", "segment_map", "segment_unmap"))

_lock = threading.Lock()
#: One remembered segment: ``[start, end, pool id, t0_ns, t1_ns (None while alive)]`` (a list:
#: its end time is set in place).
_Segment: TypeAlias = list[Any]
#: device -> segments, by start time; at most MAX_ENDED of them ended.
_segments: dict[int, list[_Segment]] = {}


def note(device: int, addr: int, size: int, pool_id: tuple[int, int], live: bool,
         t_ns: int | None = None) -> None:
    """A segment of ``pool_id`` at ``addr`` starts (``live``) or ends now (or at ``t_ns``)."""
    t = time.time_ns() if t_ns is None else t_ns
    pid = (int(pool_id[0]), int(pool_id[1]))
    with _lock:
        segs = _segments.setdefault(device, [])
        if live:
            if not any(s[0] == addr and s[4] is None for s in segs):
                segs.append([addr, addr + size, pid, t, None])
            return
        for s in reversed(segs):
            if s[0] == addr and s[4] is None:
                s[4] = t
                break
        ended = [i for i, s in enumerate(segs) if s[4] is not None]
        if len(ended) > MAX_ENDED:
            drop = set(ended[:len(ended) - MAX_ENDED])
            segs[:] = [s for i, s in enumerate(segs) if i not in drop]


def hook(device: int) -> Callable[[int, int, tuple[int, int], bool], None]:
    """The ``pool_segment`` attribute of a history hook of ``device``."""

    def pool_segment(addr: int, size: int, pool_id: tuple[int, int], live: bool) -> None:
        note(device, addr, size, pool_id, live)

    return pool_segment


def seed(allocator: Any) -> None:
    """Note the private-pool segments ``allocator`` holds now (recording starts)."""
    if not allocator.pools():  # (the allocator interface: [] when it has none)
        return
    for seg in allocator.segments():
        pid = seg.get("segment_pool_id") or (0, 0)
        if tuple(pid) != (0, 0):
            note(allocator.device, seg["address"], seg["total_size"], tuple(pid), True, 0)


def clear() -> None:
    """Forget every segment (the history was cleared)."""
    with _lock:
        _segments.clear()


def pool_of(device: int, addr: int, t_ns: int) -> tuple[int, int] | None:
    """The pool whose segment held ``addr`` at ``t_ns`` on ``device`` (None: default)."""
    with _lock:
        segs = list(_segments.get(device, ()))
    return _find(segs, addr, t_ns)


def _find(segs: list[_Segment], addr: int, t: int) -> tuple[int, int] | None:
    for s in reversed(segs):
        if s[0] <= addr < s[1] and s[3] <= t and (s[4] is None or t <= s[4]):
            return s[2]
    return None


def tag(device: int, raw: list[TraceEntry], dicts: list[dict[str, Any]]) -> None:
    """Add ``segment_pool_id`` to the dicts (built from the raw entries ``raw``, in the same
    order) of entries that lie in a private pool's segment."""
    with _lock:
        segs = list(_segments.get(device, ()))
    if not segs:
        return
    for e, d in zip(raw, dicts):
        if e[0] in _ADDR_ACTIONS:
            pid = _find(segs, e[1], e[4])
            if pid is not None:
                d["segment_pool_id"] = pid
