"""Questions asked of a :class:`~cudalab.memory_tools.trace_index.TraceIndex`, answered
from its columns: block lifetimes, the live set at a moment, the segment map then,
timeline tiles and search.

:class:`TraceViews` pairs each ``alloc`` with the ``free_completed`` of its address (per
device), and each ``segment_alloc``/``segment_map`` with its ``segment_free``/
``segment_unmap``, once (a sort of the paired rows, about a second per 10M entries), then
answers:

* :meth:`~TraceViews.live_at` — the live set just after an entry: bytes by stack (allocation
  site), by source line (the innermost user frame, :mod:`.user_frames`), by stream, by pool
  (small: blocks of at most 1 MiB; large), by notebook cell, and the largest blocks;
* :meth:`~TraceViews.segment_map_at` — the segments reserved then, with their live blocks;
* :meth:`~TraceViews.tile` — the timeline of allocated and reserved bytes between two rows
  in at most ``bins`` bins (min/max per bin, so no peak is lost), with the rows' cells;
* :meth:`~TraceViews.search` — entries by frame text, by address (the blocks that contain
  it) or by size range.

Moments are rows (entries in recorded order within one device's trace); a block allocated
before the recording started (a ring buffer's lost head) has no ``alloc`` row and is not in
any live set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from cudalab.memory_tools.trace_columns import stream_label
from cudalab.memory_tools.trace_index import TraceIndex
from cudalab.memory_tools.user_frames import frame_label, is_tool_frame

__all__ = ["LiveSet", "SMALL_BLOCK", "SearchResult", "TraceViews", "pool_label", "stack_lines"]

#: Blocks of at most this many bytes come from the small pool (torch's kSmallSize).
SMALL_BLOCK = 1 << 20


@dataclass(frozen=True, slots=True)
class LiveSet:
    """What was allocated just after entry ``row`` (see :meth:`TraceViews.live_at`).

    Every ``by_*`` list is ``[(label, bytes, blocks), ...]``, largest first, at most
    ``top`` long; ``blocks`` is ``[(address, size, stack id, row allocated), ...]``.
    """

    row: int  # the entry (0 <= row < n)
    device: int  # the device of that entry
    time_us: int  # its time
    allocated: int  # bytes allocated then (sum of the live blocks' sizes, >= 0)
    reserved: int  # bytes reserved then (the live segments' sizes, >= 0)
    n_blocks: int  # live blocks (>= 0)
    by_stack: list[tuple[str, int, int]]  # label: the stack's innermost user frame
    by_line: list[tuple[str, int, int]]  # "file:line (function)"
    by_stream: list[tuple[str, int, int]]
    by_pool: list[tuple[str, int, int]]  # "small" / "large" / "graph (n, 0)" / "user (0, n)"
    by_cell: list[tuple[str, int, int]]  # the cell's id, or "(no cell)"
    largest: list[tuple[int, int, int, int]]
    stack_ids: list[int]  # the stack of each by_stack row, same order


@dataclass(frozen=True, slots=True)
class SearchResult:
    """Entries found by :meth:`TraceViews.search`: the first ``len(rows)`` of ``count``."""

    rows: NDArray[np.int64]  # in recorded order, at most the limit asked
    count: int  # all matches (>= len(rows))
    what: str  # the query, as people read it


def _pairs(device: NDArray[Any], addr: NDArray[Any], rows: NDArray[np.int64],
           opens: NDArray[np.bool_], end: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """For rows (in increasing order) that open (``opens``) or close an address, each
    opening row and the row that closes it next (``end`` when none does), in row order."""
    n = len(rows)
    # (rows come in increasing order: stable sorts give the order of (device, addr, row))
    order = np.argsort(addr, kind="stable")
    multi = n > 0 and device.min() != device.max()
    if multi:
        order = order[np.argsort(device[order], kind="stable")]
    a = addr[order]
    same = a[1:] == a[:-1]
    if multi:
        d = device[order]
        same &= d[1:] == d[:-1]
    nxt = np.full(n, end, np.int64)
    if n > 1:
        closes = same & ~opens[order][1:]
        nxt[:-1] = np.where(closes, rows[order][1:], end)
    back = np.empty(n, np.int64)  # the inverse permutation: sorted place of each row
    back[order] = np.arange(n, dtype=np.int64)
    return rows[opens], nxt[back][opens]


def stack_lines(ix: TraceIndex) -> NDArray[np.int32]:
    """Each stack's innermost user frame (the "line" it is attributed to; -1: no frames):
    its first frame that is not a tool's (:func:`~.user_frames.is_tool_frame`), else its
    first."""
    tool = np.array([is_tool_frame(f) for f in ix.frames], bool)
    out = np.full(ix.n_stacks, -1, np.int32)
    offs, pool = ix.stack_offsets, ix.stack_frames
    for s in range(ix.n_stacks):
        ids = pool[offs[s]:offs[s + 1]]
        if len(ids):
            user = ids[~tool[ids]]
            out[s] = user[0] if len(user) else ids[0]
    return out


def pool_label(pool: Any, large: bool) -> str:
    """A block's pool as people read it: ``"small"``/``"large"`` in the default pool, else
    the private pool's kind and id, ``"graph (n, 0)"`` (a graph capture's) or
    ``"user (0, n)"`` (``graph_pool_handle()``, ``MemPool``)."""
    if isinstance(pool, tuple) and len(pool) == 2 and tuple(pool) != (0, 0):
        a, b = pool
        return f"{'graph' if a != 0 else 'user'} ({a}, {b})"
    return "large" if large else "small"


class TraceViews:
    """The questions of the module documentation, asked of one :class:`TraceIndex`.

    ``pairs=False`` skips pairing blocks and segments (the sorts): the running totals and
    :meth:`tile` only, for a timeline of a trace still being read."""

    def __init__(self, index: TraceIndex, *, pairs: bool = True):
        self.index = ix = index
        code = ix.action.astype(np.int16)
        names = ix.action_names

        def codes(*want: str) -> NDArray[np.bool_]:
            mask = np.zeros(len(code), bool)
            for w in want:
                c = ix.action_code(w) if w in names else -1
                if c >= 0:
                    mask |= code == c
            return mask

        alloc, free = codes("alloc"), codes("free_completed")
        seg_up, seg_down = codes("segment_alloc", "segment_map"), codes("segment_free",
                                                                         "segment_unmap")
        if pairs:
            rows_all = np.arange(ix.n, dtype=np.int64)
            sel = alloc | free
            self.block_row, self.block_end = _pairs(ix.device[sel], ix.addr[sel],
                                                    rows_all[sel], alloc[sel], ix.n)
            sel = seg_up | seg_down
            self.seg_row, self.seg_end = _pairs(ix.device[sel], ix.addr[sel], rows_all[sel],
                                                seg_up[sel], ix.n)
        else:  # (the totals only: a timeline of a trace still being read)
            self.block_row = self.block_end = self.seg_row = self.seg_end = np.zeros(0, np.int64)
        br, sr = self.block_row, self.seg_row
        self.block_addr, self.block_size = ix.addr[br], ix.size[br]
        self.block_stack, self.block_device = ix.stack[br], ix.device[br]
        self.seg_addr, self.seg_size, self.seg_device = ix.addr[sr], ix.size[sr], ix.device[sr]
        # running totals per device, in recorded order
        d_alloc = np.where(alloc, ix.size, 0) - np.where(free, ix.size, 0)
        d_res = np.where(seg_up, ix.size, 0) - np.where(seg_down, ix.size, 0)
        self.allocated = np.empty(ix.n, np.int64)
        self.reserved = np.empty(ix.n, np.int64)
        self.bounds: list[tuple[int, int, int]] = []
        if ix.n:
            edges = np.flatnonzero(np.diff(ix.device)) + 1
            starts = np.concatenate(([0], edges))
            stops = np.concatenate((edges, [ix.n]))
            for a, b in zip(starts.tolist(), stops.tolist()):
                np.cumsum(d_alloc[a:b], out=self.allocated[a:b])
                np.cumsum(d_res[a:b], out=self.reserved[a:b])
                self.bounds.append((int(ix.device[a]), a, b))
        # each stack's innermost user frame (the "line" it is attributed to)
        self.stack_line = self._stack_lines()
        self._pyramid: tuple[Any, ...] | None = None

    # ----------------------------------------------------------------------- labels
    def _stack_lines(self) -> NDArray[np.int32]:
        return stack_lines(self.index)

    def stack_label(self, stack: int) -> str:
        """A stack's innermost user frame, ``"file:line (function)"``."""
        if stack < 0:
            return "(no frames recorded)"
        f = int(self.stack_line[stack])
        return frame_label(self.index.frames[f]) if f >= 0 else "(no frames recorded)"

    def line_label(self, frame: int) -> str:
        """A frame id as ``"file:line (function)"``."""
        return frame_label(self.index.frames[frame]) if frame >= 0 else "(no frames recorded)"

    def device_range(self, device: int | None = None) -> tuple[int, int, int]:
        """``(device, first row, stop row)`` of a device's trace (default: the first)."""
        for d, a, b in self.bounds:
            if device is None or d == device:
                return d, a, b
        if device is None:
            return 0, 0, 0
        raise ValueError(f"no trace entries for device {device}; the trace has devices "
                         f"{[d for d, _, _ in self.bounds]}")

    # ----------------------------------------------------------------------- live set
    def live_mask(self, row: int) -> NDArray[np.bool_]:
        """The blocks (of :attr:`block_row`) live just after ``row``, on its device."""
        d = self.index.device[row]
        return (self.block_row <= row) & (self.block_end > row) & (self.block_device == d)

    def live_at(self, row: int, top: int = 20) -> LiveSet:
        """The live set just after entry ``row`` (see :class:`LiveSet`).

        Raises
        ------
        IndexError
            ``row`` is not an entry of the trace.
        """
        ix = self.index
        if not 0 <= row < ix.n:
            raise IndexError(f"row {row} is not an entry (the trace has {ix.n:,})")
        m = self.live_mask(row)
        size, stack = self.block_size[m], self.block_stack[m]
        rows = self.block_row[m]
        d = int(ix.device[row])
        seg = (self.seg_row <= row) & (self.seg_end > row) & (self.seg_device == d)

        def group(keys: NDArray[Any], label: Any) -> tuple[list[tuple[str, int, int]],
                                                             list[int]]:
            if not len(keys):
                return [], []
            uniq, inv = np.unique(keys, return_inverse=True)
            nbytes = np.bincount(inv, weights=size, minlength=len(uniq))
            count = np.bincount(inv, minlength=len(uniq))
            order = np.argsort(-nbytes, kind="stable")[:top]
            return ([(label(uniq[k]), int(nbytes[k]), int(count[k])) for k in order],
                    [int(uniq[k]) for k in order])

        by_stack, stack_ids = group(stack, lambda s: self.stack_label(int(s)))
        lines = np.where(stack >= 0, self.stack_line[np.maximum(stack, 0)], -1)
        by_line, _ = group(lines, lambda f: self.line_label(int(f)))
        by_stream, _ = group(ix.stream[rows], lambda s: stream_label(int(s)))
        pool = ix.pool[rows]
        pools = ix.pools
        # the default pool's blocks: small or large by size; a private pool's: its id
        kind = np.where(pool >= 0, pool + 2, (size > SMALL_BLOCK).astype(np.int64))
        by_pool, _ = group(kind, lambda p: pool_label(pools[int(p) - 2] if p >= 2 else None,
                                                      bool(p == 1)))
        cells = ix.cell[rows]
        by_cell, _ = group(cells, lambda c: ix.strings[int(c)] if c >= 0 else "(no cell)")
        k = min(top, len(size))
        big = np.argpartition(-size, k - 1)[:k] if k else np.zeros(0, np.int64)
        big = big[np.argsort(-size[big], kind="stable")]
        addr = self.block_addr[m]
        largest = [(int(addr[i]), int(size[i]), int(stack[i]), int(rows[i])) for i in big]
        return LiveSet(row=row, device=d, time_us=int(ix.time_us[row]),
                       allocated=int(size.sum()), reserved=int(self.seg_size[seg].sum()),
                       n_blocks=int(m.sum()), by_stack=by_stack, by_line=by_line,
                       by_stream=by_stream, by_pool=by_pool, by_cell=by_cell, largest=largest,
                       stack_ids=stack_ids)

    def segment_map_at(self, row: int, max_segments: int = 200, max_blocks: int = 2000
                       ) -> list[dict[str, Any]]:
        """The segments reserved just after ``row`` on its device (the largest
        ``max_segments``, by address), each with its live blocks: ``{"address", "size",
        "stream", "blocks": [(address, size, stack id), ...]}`` (``max_blocks`` in all, the
        rest counted in ``"more"``)."""
        ix = self.index
        d = ix.device[row]
        seg = np.flatnonzero((self.seg_row <= row) & (self.seg_end > row)
                             & (self.seg_device == d))
        if len(seg) > max_segments:
            seg = seg[np.argsort(-self.seg_size[seg], kind="stable")[:max_segments]]
        seg = seg[np.argsort(self.seg_addr[seg], kind="stable")]
        m = np.flatnonzero(self.live_mask(row))
        m = m[np.argsort(self.block_addr[m], kind="stable")]
        baddr = self.block_addr[m]
        out = []
        budget = max_blocks
        for s in seg.tolist():
            a, size = int(self.seg_addr[s]), int(self.seg_size[s])
            lo, hi = np.searchsorted(baddr, [a, a + size])
            take = m[lo:min(hi, lo + max(budget, 0))]
            budget -= len(take)
            out.append({"address": a, "size": size,
                        "stream": int(ix.stream[self.seg_row[s]]),
                        "blocks": list(zip(self.block_addr[take].tolist(),
                                           self.block_size[take].tolist(),
                                           self.block_stack[take].tolist())),
                        "more": int(hi - lo - len(take))})
        return out

    # ----------------------------------------------------------------------- timeline
    #: Rows per block of the timeline's summary level (:meth:`tile` reads blocks, not rows,
    #: for windows of more than :data:`PYRAMID_FROM` rows per bin).
    PYRAMID_BLOCK = 1024
    PYRAMID_FROM = 4  # blocks per bin at least

    def _blocks(self) -> tuple[Any, ...]:
        """Per block of :data:`PYRAMID_BLOCK` rows: allocated min and max, reserved max,
        and whether the cell changes inside (built once)."""
        if self._pyramid is None:
            b = self.PYRAMID_BLOCK
            idx = np.arange(0, self.index.n, b)
            cell = self.index.cell
            change = np.zeros(self.index.n, bool)
            change[1:] = cell[1:] != cell[:-1]
            self._pyramid = (np.minimum.reduceat(self.allocated, idx),
                             np.maximum.reduceat(self.allocated, idx),
                             np.maximum.reduceat(self.reserved, idx),
                             np.flatnonzero(change))
        return self._pyramid

    def tile(self, start: int, stop: int, bins: int = 1000) -> dict[str, Any]:
        """The timeline of rows ``[start, stop)`` (one device's) in at most ``bins`` bins:
        ``rows`` (each bin's first row), ``alloc_min``/``alloc_max`` and
        ``reserved_max`` (bytes), ``cells`` (``[(row, cell text), ...]`` where the cell
        changes, at most ``bins``) and ``time_us`` of each bin's first row. A window of
        many rows per bin is summarised from blocks of :data:`PYRAMID_BLOCK` rows (bin edges
        then fall on block edges), so a tile costs the same at any zoom."""
        start = max(0, start)
        stop = min(self.index.n, stop)
        n = max(0, stop - start)
        if n == 0:
            return {"rows": [], "alloc_min": [], "alloc_max": [], "reserved_max": [],
                    "time_us": [], "cells": []}
        k = min(bins, n)
        cell = self.index.cell
        if n // self.PYRAMID_BLOCK >= k * self.PYRAMID_FROM:
            b = self.PYRAMID_BLOCK
            lo_min, lo_max, r_max, changes = self._blocks()
            b0, b1 = start // b, -(-stop // b)
            nb = b1 - b0
            k = min(k, nb)
            bedges = b0 + (np.arange(k + 1, dtype=np.int64) * nb) // k
            bidx = bedges[:-1] - b0
            amin = np.minimum.reduceat(lo_min[b0:b1], bidx)
            amax = np.maximum.reduceat(lo_max[b0:b1], bidx)
            rmax = np.maximum.reduceat(r_max[b0:b1], bidx)
            first = np.maximum(bedges[:-1] * b, start)
            lo, hi = np.searchsorted(changes, [start + 1, stop])
            at = changes[lo:hi]
            if len(at) > bins:
                at = at[np.linspace(0, len(at) - 1, bins).astype(np.int64)]
            marks = np.concatenate(([start], at)) - start
        else:
            edges = start + (np.arange(k + 1, dtype=np.int64) * n) // k
            first = edges[:-1]
            a = self.allocated[start:stop]
            r = self.reserved[start:stop]
            idx = first - start
            amin = np.minimum.reduceat(a, idx)
            amax = np.maximum.reduceat(a, idx)
            rmax = np.maximum.reduceat(r, idx)
            c = cell[start:stop]
            change = np.flatnonzero(np.diff(c)) + 1
            if len(change) > bins:  # evenly over the window, not the first ones only
                change = change[np.linspace(0, len(change) - 1, bins).astype(np.int64)]
            marks = np.concatenate(([0], change))
        cell = cell[start:stop]
        strings = self.index.strings
        cells = [(int(start + i), strings[c] if c >= 0 else None)
                 for i, c in zip(marks.tolist(), cell[marks].tolist())]
        return {"rows": first.tolist(), "alloc_min": amin.tolist(), "alloc_max": amax.tolist(),
                "reserved_max": rmax.tolist(),
                "time_us": self.index.time_us[first].tolist(), "cells": cells}

    # ----------------------------------------------------------------------- search
    def search(self, text: str | None = None, *, address: int | None = None,
               size_range: tuple[int | None, int | None] | None = None,
               limit: int = 200) -> SearchResult:
        """Entries whose stack has a frame containing ``text`` (file, function or
        ``file:line``, case-insensitive), the ``alloc`` rows of the blocks that contain
        ``address``, and/or the ``alloc`` rows with a size in ``size_range`` (inclusive;
        None: open); the conditions given must all hold."""
        ix = self.index
        mask = np.ones(ix.n, bool)
        what = []
        if text:
            needle = text.lower()
            hits = np.array([needle in f"{fn}:{ln} {nm}".lower() for fn, nm, ln in ix.frames],
                            bool)
            frame_hit = hits[ix.stack_frames] if len(ix.stack_frames) else np.zeros(0, bool)
            owner = np.searchsorted(ix.stack_offsets, np.arange(len(ix.stack_frames)),
                                    side="right") - 1
            stack_hit = np.zeros(ix.n_stacks + 1, bool)  # (the last: no frames)
            stack_hit[owner[frame_hit]] = True
            mask &= stack_hit[ix.stack]
            what.append(f"frames containing {text!r}")
        if address is not None or size_range is not None:
            alloc = ix.action == ix.action_code("alloc")
            mask &= alloc
        if address is not None:
            inside = np.zeros(ix.n, bool)
            b = (self.block_addr <= address) & (self.block_addr + self.block_size > address)
            inside[self.block_row[b]] = True
            mask &= inside
            what.append(f"blocks containing 0x{address:x}")
        if size_range is not None:
            lo, hi = size_range
            if lo is not None:
                mask &= ix.size >= lo
            if hi is not None:
                mask &= ix.size <= hi
            what.append(f"sizes in [{lo if lo is not None else ''}, "
                        f"{hi if hi is not None else ''}]")
        found = np.flatnonzero(mask)
        return SearchResult(rows=found[:limit], count=len(found),
                            what=" and ".join(what) or "every entry")
