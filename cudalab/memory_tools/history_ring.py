"""The allocation history's ring buffer: torch's ``max_entries`` ring, stored in columns.

One :class:`HistoryRing` per device holds the trace entries that
:mod:`cudalab.memory_tools.history` records. An entry is the tuple ``(action, addr, size,
stream, time_ns, frames, nvtx_range, cell[, user_metadata])`` (``history.FIELDS``); once
the ring holds ``maxlen`` entries the oldest is dropped for each new one, and the entries
read back oldest to newest (:meth:`HistoryRing.entries`), as torch's ``alloc_trace``.

Why columns: a long recording (torch's default ``max_entries`` is ``sys.maxsize``; users
record whole training steps, 100,000 entries and more) must not keep one Python object per
entry. Each object would cost ~150 bytes, and the cyclic garbage collector would traverse
every entry holding a stack (a full collection over 1,000,000 entries took 116 ms), which
made every allocation slower the longer the recording ran. So:

* The recording path appends entry tuples to :attr:`HistoryRing.young`, a plain list (one
  C call, as a ``deque.append``); when it holds :data:`CHUNK` entries, the recorder calls
  :meth:`HistoryRing.compact`, which moves them into a *chunk*: one ``array('q')`` per
  integer field, a ``bytes`` of action codes, and the frames, NVTX range, cell and user
  metadata as indices into side tables (each distinct stack object and string is stored
  once). A chunk holds no object the garbage collector tracks, about 45 bytes an entry.
* Reading (:meth:`HistoryRing.entries`) rebuilds the tuples, at C speed (``zip`` and
  ``map`` over the columns).
* A batch that does not fit the columns (an integer beyond 64 bits, an action outside
  ``ACTIONS``, an unhashable NVTX message) is kept as a chunk of its tuples instead.
* The side tables are rebuilt, keeping only what the chunks still refer to, whenever they
  have doubled since the last rebuild (stacks of dropped entries are freed).

Threads: appending is a list append (atomic); :meth:`compact` and the readers take the
ring's own lock, a leaf lock (nothing is called while it is held); the recording path only
tries it (``compact`` returns at once when another thread holds it: ``young`` then grows a
little longer).
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Hashable, Iterable, Sequence
from itertools import repeat
from operator import itemgetter
from typing import Any, TypeAlias, cast

__all__ = ["ACTIONS", "CHUNK", "HistoryRing", "TraceEntry"]

#: One trace entry: ``(action, addr, size, stream, time_ns, frames, nvtx_range, cell[,
#: user_metadata])`` (``history.FIELDS``): 8 or 9 fields of mixed types.
TraceEntry: TypeAlias = tuple[Any, ...]
#: One chunk: its kind (``_COLUMNS`` or ``_TUPLES``), its entry count, then its columns.
_Chunk: TypeAlias = tuple[Any, ...]

#: Every trace action, in torch's order (``history.ACTIONS``); a column stores its index.
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "snapshot", "oom")
_ACTION_CODES = {a: i for i, a in enumerate(ACTIONS)}

#: Entries moved from ``young`` into one chunk of columns at a time.
CHUNK = 4096

# Chunk kinds (the first item of a chunk tuple).
_COLUMNS = 0  # (_COLUMNS, n, acts, addrs, sizes, streams, times, frames, nvtx, cells, metas)
_TUPLES = 1  # (_TUPLES, n, tuple of entry tuples): a batch the columns cannot hold
_INT_FIELDS = (1, 2, 3, 4)  # addr, size, stream, time_ns: array('q') columns
_TABLE_MIN = 1024  # side tables are rebuilt past max(_TABLE_MIN, 2 x their size after the last)


class _Table:
    """Values stored once, referred to by index: by identity (stacks, whose equal objects
    are shared anyway and whose hashing would cost a walk) or by value (strings, None)."""

    __slots__ = ("values", "index", "by_id", "rebuild_at")

    def __init__(self, by_id: bool):
        self.values: list[object] = []  # index -> value (invariant: index[key(values[i])] == i)
        self.index: dict[Hashable, int] = {}  # key (id(value) or value) -> its index in values
        self.by_id = by_id
        self.rebuild_at = _TABLE_MIN

    def codes(self, column: tuple[Any, ...]) -> array[int]:
        """The indices of ``column``'s values as ``array('i')``, adding new values."""
        index = self.index
        keys = tuple(map(id, column)) if self.by_id else column
        got = list(map(index.get, keys))
        if None in got:
            values = self.values
            for i, k in enumerate(keys):
                if got[i] is None:
                    j = index.get(k)
                    if j is None:
                        j = index[k] = len(values)
                        values.append(column[i])
                    got[i] = j
        return array("i", cast("list[int]", got))  # (every None was filled above)


class HistoryRing:
    """The trace entries of one device, oldest first, at most ``maxlen`` of them.

    Parameters
    ----------
    maxlen : int
        The most entries kept (torch's ``max_entries``, >= 1).

    Raises
    ------
    ValueError
        When ``maxlen`` is not an int >= 1.
    """

    __slots__ = ("maxlen", "young", "_chunks", "_head", "_old", "_frames", "_strings",
                 "_lock", "__weakref__")

    def __init__(self, maxlen: int):
        self.maxlen = _check_maxlen(maxlen)
        #: Entry tuples not yet in a chunk, oldest first; the recorder appends here and
        #: calls compact() once it holds CHUNK entries (it may hold more than maxlen).
        self.young: list[TraceEntry] = []
        self._chunks: list[_Chunk] = []  # oldest first (see _COLUMNS / _TUPLES)
        self._head = 0  # entries of _chunks[0] already dropped (invariant: < its length)
        self._old = 0  # entries in the chunks, less _head (invariant: <= maxlen)
        self._frames = _Table(by_id=True)
        self._strings = _Table(by_id=False)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ writing
    def append(self, entry: TraceEntry) -> None:
        """Add one entry (the recorder's own path appends to :attr:`young` inline)."""
        young = self.young
        young.append(entry)
        if len(young) >= CHUNK:
            self.compact()

    def set_maxlen(self, maxlen: int) -> None:
        """Keep at most ``maxlen`` entries from now on (the newest are kept; growing the
        ring brings back nothing that the old ``maxlen`` had dropped)."""
        maxlen = _check_maxlen(maxlen)
        with self._lock:
            self._compact_locked()  # under the old maxlen: young may hold more
            self.maxlen = maxlen
            self._trim()

    def compact(self) -> None:
        """Move the entries of :attr:`young` into a chunk of columns, and drop the oldest
        beyond ``maxlen``. Returns at once when another thread holds the ring's lock."""
        lock = self._lock
        if not lock.acquire(False):
            return
        try:
            self._compact_locked()
        finally:
            lock.release()

    def _compact_locked(self) -> None:
        young = self.young
        n = len(young)
        batch = young[:n]
        del young[:n]  # (only this method removes from young, under the lock)
        maxlen = self.maxlen
        if n > maxlen:  # only the newest maxlen can stay
            batch = batch[n - maxlen:]
            n = maxlen
        for i in range(0, n, CHUNK):
            part = batch[i:i + CHUNK]
            self._chunks.append(self._columns(part))
            self._old += len(part)
        self._trim()
        self._maybe_rebuild_tables()

    def _columns(self, batch: list[TraceEntry]) -> _Chunk:
        """One chunk of ``batch`` (a non-empty list of entry tuples)."""
        n = len(batch)
        try:
            width = max(map(len, batch))
            cols = list(zip(*batch)) if width == 8 else _zip_padded(batch, width)
            acts = bytes(map(_ACTION_CODES.__getitem__, cols[0]))
            ints = [array("q", cols[i]) for i in _INT_FIELDS]
            frames = self._frames.codes(cols[5])
            strings = self._strings
            nvtx = strings.codes(cols[6])
            cells = strings.codes(cols[7])
            metas = strings.codes(cols[8]) if width > 8 else None
        except (KeyError, OverflowError, TypeError, ValueError, IndexError):
            return (_TUPLES, n, tuple(batch))
        return (_COLUMNS, n, acts, *ints, frames, nvtx, cells, metas)

    def _trim(self) -> None:
        """Drop the oldest entries of the chunks beyond ``maxlen``."""
        excess = self._old - self.maxlen
        chunks = self._chunks
        while excess > 0:
            left = chunks[0][1] - self._head
            if left <= excess:
                chunks.pop(0)
                self._head = 0
                self._old -= left
                excess -= left
            else:
                self._head += excess
                self._old -= excess
                excess = 0

    def _maybe_rebuild_tables(self) -> None:
        """Forget the side tables' values that no chunk refers to any longer, once a table
        has doubled since its last rebuild (each rebuild costs a pass over the chunks)."""
        for table, cols in ((self._frames, (7,)), (self._strings, (8, 9, 10))):
            if len(table.values) <= table.rebuild_at:
                continue
            used: set[int] = set()
            for c in self._chunks:
                if c[0] == _COLUMNS:
                    for k in cols:
                        if c[k] is not None:
                            used.update(c[k])
            old = table.values
            remap = {}
            table.values = []
            table.index = {}
            for j in sorted(used):
                v = old[j]
                remap[j] = len(table.values)
                table.index[id(v) if table.by_id else v] = len(table.values)
                table.values.append(v)
            get = remap.__getitem__
            for ci, chunk in enumerate(self._chunks):
                if chunk[0] == _COLUMNS:
                    parts = list(chunk)
                    for k in cols:
                        if parts[k] is not None:
                            parts[k] = array("i", map(get, parts[k]))
                    self._chunks[ci] = tuple(parts)
            table.rebuild_at = max(_TABLE_MIN, 2 * len(table.values))

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self.young.clear()
            self._chunks.clear()
            self._head = self._old = 0
            self._frames = _Table(by_id=True)
            self._strings = _Table(by_id=False)

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return min(self.maxlen, self._old + len(self.young))

    def entries(self) -> list[TraceEntry]:
        """The entries, oldest to newest, as the tuples that were appended."""
        with self._lock:
            young = self.young[:]
            out: list[TraceEntry] = []
            head = self._head
            frames = self._frames.values
            strings = self._strings.values
            for c in self._chunks:
                out += _rows(c, head, frames, strings)
                head = 0
        out += young
        extra = len(out) - self.maxlen
        if extra > 0:
            del out[:extra]
        return out

    def nbytes(self) -> int:
        """Bytes held by the chunks' columns (the side tables and ``young`` aside)."""
        total = 0
        with self._lock:
            for c in self._chunks:
                if c[0] == _COLUMNS:
                    total += sum(len(a) * (a.itemsize if isinstance(a, array) else 1)
                                 for a in c[2:] if a is not None)
        return total


def _check_maxlen(maxlen: Any) -> int:
    if type(maxlen) is not int or maxlen < 1:
        raise ValueError(f"maxlen must be an int >= 1, got {maxlen!r}")
    return maxlen


def _zip_padded(batch: list[TraceEntry], width: int) -> list[tuple[Any, ...]]:
    """The columns of entries of 8 or ``width`` fields, the missing metadata as ``""``."""
    return list(zip(*[e if len(e) == width else (*e, "") for e in batch]))


def _rows(c: _Chunk, start: int, frames: list[object], strings: list[object]
          ) -> list[TraceEntry]:
    """The entry tuples of chunk ``c`` from its ``start``-th."""
    if c[0] == _TUPLES:
        return list(c[2][start:])
    _, n, acts, addrs, sizes, streams, times, fr, nvtx, cells, metas = c
    if start:
        acts, addrs, sizes, streams, times, fr, nvtx, cells = (
            acts[start:], addrs[start:], sizes[start:], streams[start:], times[start:],
            fr[start:], nvtx[start:], cells[start:])
        metas = None if metas is None else metas[start:]
    rows = list(zip(_lookup(acts, ACTIONS), _ints(addrs), _ints(sizes), _ints(streams), times,
                    _lookup(fr, frames), _lookup(nvtx, strings), _lookup(cells, strings)))
    if metas is not None:
        rows = [r if not m else (*r, m) for r, m in zip(rows, _lookup(metas, strings))]
    return rows


def _lookup(codes: array[int], table: Sequence[Any]) -> Iterable[Any]:
    """The values of ``table`` at indices ``codes``, as an iterable (at C speed)."""
    if len(codes) > 1:
        first = codes[0]
        if codes.count(first) == len(codes):  # a constant column (cells, NVTX ranges)
            return repeat(table[first], len(codes))
        return itemgetter(*codes)(table)
    return [table[i] for i in codes]


def _ints(column: array[int]) -> Iterable[int]:
    """The values of an integer column; a constant one (the pairs of a loop: one address,
    size and stream) as one int repeated, which makes no int object per entry."""
    if len(column) > 1 and column.count(column[0]) == len(column):
        return repeat(column[0], len(column))
    return column
