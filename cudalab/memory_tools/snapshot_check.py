"""The one check of a snapshot's schema, shared by every reader of snapshot files and dicts.

A pickle that loads is not yet a snapshot: a segment may lack ``address``, an entry
``size``, a time may be a string or NaN, a size ``2**70``, a list may stand where a dict
belongs. :func:`check_snapshot` finds the first such entry and raises
:class:`~cudalab.memory_tools.safe_pickle.SnapshotLoadError` (a ValueError) naming it,
e.g. ``device_traces[0][12]['size'] is a str ('512'), expected an integer``, so the exports
(``history_frame``, ``snapshot_frame``, ``segments_frame``, ``export_perfetto``), the plots,
the ``SnapshotViewer`` and the replay never fail later with a bare ``KeyError``,
``AttributeError``, ``OverflowError`` or ``TypeError``.

What it checks (torch's schema; keys beyond these, metadata, are not looked at):

* the snapshot: a dict; ``segments`` a list, ``device_traces`` a list of lists, cudalab's
  ``cudalab`` a dict with a bool ``simulated``, cudalab's ``identity`` (optional: torch's
  snapshots and older files lack it) a dict that
  :meth:`cudalab.identity.Identity.from_dict` accepts (every field's type and range);
* a segment: a dict with ``address`` and ``total_size`` (integers) and ``blocks`` (a list of
  dicts with ``address``, ``size`` and ``state``); the optional ``device``, ``stream``,
  ``allocated_size``, ``active_size``, ``requested_size`` integers, ``segment_type`` text,
  ``frames`` a list of frames; the sizes of a segment's blocks add up to no more than 2⁶³;
* a trace entry: a dict with ``action`` (text) and ``size``; the optional ``addr``,
  ``stream``, ``time_us``, ``device_free`` integers, ``frames`` a list whose first (top)
  frame is a dict with ``filename``, ``line`` and ``name``, ``cell``/``nvtx_range`` text or
  None.

Integers are ``int`` or numpy integers (not ``bool``), sizes in [0, 2⁶³), addresses and
streams in [0, 2⁶⁴), devices in [0, 2³¹), times in int64. The checks run one C-level pass
per key over a device's entries (a million entries cost a fraction of a second); the
offending index is looked for only after a pass failed.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from itertools import chain, repeat
from operator import is_not, itemgetter
from typing import Any

import numpy as np

from cudalab.identity import Identity
from cudalab.memory_tools.safe_pickle import SnapshotLoadError

__all__ = ["check_snapshot", "check_trace_entries", "TRACE_KEYS_FOR_REPLAY"]

_U64 = 1 << 64
_I63 = 1 << 63
_INT_RANGES = {
    "size": (0, _I63), "address": (0, _U64), "addr": (0, _U64), "stream": (0, _U64),
    "device": (0, 1 << 31), "time_us": (-_I63, _I63), "device_free": (-_I63, _I63),
    "line": (-_I63, _I63),
}
_SIZE = (0, _I63)

#: The trace-entry keys the replay reads: it skips entries whose size is not an integer
#: (``"512"``, ``512.5``, counted in its warning), so ``size`` is only required there.
TRACE_KEYS_FOR_REPLAY = ("action", "size", "addr", "stream")


def _show(value: Any) -> str:
    """A short, safe picture of ``value`` (containers by type only: no deep repr)."""
    if value is None or isinstance(value, (str, int, float, bool, np.generic)):
        return f"{value!r:.60}"
    return f"a {type(value).__name__}"


def _only(values: list[Any], cls: type) -> bool:
    """Whether every value is a ``cls`` (subclasses too), one C-level pass."""
    return all(issubclass(t, cls) for t in set(map(type, values)))


def _bound(n: int) -> str:
    """``2**63``, ``-2**63``, ``0``: a range bound as people read it."""
    m = abs(n)
    if m > 1 and m & (m - 1) == 0:
        return f"{'-' if n < 0 else ''}2**{m.bit_length() - 1}"
    return str(n)


def _type_name(value: Any) -> str:
    return "None" if value is None else type(value).__name__


def _is_int_type(t: type) -> bool:
    return (t is int or issubclass(t, (int, np.integer))) and not issubclass(t, (bool, np.bool_))


class _Where:
    """The snapshot's name, for the messages: ``what: segments[3]['blocks'][7] ...``."""

    __slots__ = ("what",)

    def __init__(self, what: str):
        self.what = what

    def fail(self, path: str, text: str) -> SnapshotLoadError:
        return SnapshotLoadError(f"{self.what}: {path}{text}")


Locate = Callable[[int], str]  # row index -> the row's path, e.g. "device_traces[0][12]"


def _dicts(rows: Any, path: str, locate: Locate, where: _Where, name: str
           ) -> list[dict[str, Any]]:
    """``rows`` checked to be a list of dicts."""
    if not isinstance(rows, list):
        plural = "trace entries" if name == "trace entry" else f"{name}s"
        raise where.fail(path, f" is {_show(rows)}, expected a list of {plural} (dicts)")
    if rows and not _only(rows, dict):
        for j, r in enumerate(rows):
            if not isinstance(r, dict):
                raise where.fail(locate(j), f" is {_show(r)}, expected a {name} (a dict)")
    return rows


_MISSING = object()
_present = partial(is_not, _MISSING)


class _Column:
    """The values of one key over rows (one C-level pass), and the row of each value."""

    __slots__ = ("rows", "key", "values", "partial")

    def __init__(self, rows: list[dict[str, Any]], key: str, required: bool, locate: Locate,
                 where: _Where):
        self.rows = rows
        self.key = key
        try:
            self.values = list(map(itemgetter(key), rows))
            self.partial = False
        except KeyError:
            if required:
                j = next(j for j, r in enumerate(rows) if key not in r)
                raise where.fail(locate(j), f" lacks the key {key!r}") from None
            got = map(dict.get, rows, repeat(key), repeat(_MISSING))  # (C-level passes)
            self.values = list(filter(_present, got))
            self.partial = True

    def row_of(self, k: int) -> int:
        """The row of ``values[k]`` (looked for only when a check failed)."""
        if not self.partial:
            return k
        return [j for j, r in enumerate(self.rows) if self.key in r][k]

    def first_bad(self, ok: Callable[[Any], bool]) -> tuple[int, Any]:
        for k, v in enumerate(self.values):
            if not ok(v):
                return self.row_of(k), v
        raise AssertionError("no offending value")  # (only called after a pass failed)


def _ints(col: _Column, locate: Locate, where: _Where, bounds: tuple[int, int]) -> None:
    values = col.values
    if not values:
        return
    key = col.key
    if not all(map(_is_int_type, set(map(type, values)))):
        j, v = col.first_bad(lambda v: _is_int_type(type(v)))
        raise where.fail(f"{locate(j)}[{key!r}]", f" is {_show(v)} ({_type_name(v)}), "
                         "expected an integer")
    lo, hi = bounds
    if min(values) < lo or max(values) >= hi:
        j, v = col.first_bad(lambda v: lo <= v < hi)
        raise where.fail(f"{locate(j)}[{key!r}]", f" is {v!r:.60}, out of range (expected "
                         f"{_bound(lo)} <= {key} < {_bound(hi)})")


def _texts(col: _Column, locate: Locate, where: _Where, none_ok: bool = False) -> None:
    allowed = {str, type(None)} if none_ok else {str}
    if col.values and not set(map(type, col.values)) <= allowed:
        j, v = col.first_bad(lambda v: type(v) in allowed)
        raise where.fail(f"{locate(j)}[{col.key!r}]", f" is {_show(v)} ({_type_name(v)}), "
                         f"expected text{' or None' if none_ok else ''}")


_FRAME_KEYS = (("filename", True, "text"), ("line", True, "int"), ("name", True, "text"))


def _frames(col: _Column, locate: Locate, where: _Where, every: bool = False) -> None:
    """Each value a list of frames; the top (first) frame of each (``every``: each frame) a
    dict with filename, line and name (what the exports and the viewer read)."""
    values = col.values
    if not values:
        return
    if not _only(values, list):
        j, v = col.first_bad(lambda v: isinstance(v, list))
        raise where.fail(f"{locate(j)}['frames']", f" is {_show(v)}, expected a list of frames")
    stacks = list(filter(None, values))  # (C-level: the non-empty stacks)
    frames = list(chain.from_iterable(stacks)) if every else list(map(itemgetter(0), stacks))
    if not frames:
        return
    if not every and _only(frames, dict):  # shared frames are checked once
        unique = dict(zip(map(id, frames), frames))
        if len(unique) < len(frames):
            try:
                _check_rows(list(unique.values()), str, where, _FRAME_KEYS)
                return
            except SnapshotLoadError:
                pass  # (found one: again over every frame, to name where it is)

    def frame_path(m: int) -> str:  # the m-th frame checked -> its path
        if every:
            for k, f in enumerate(values):
                if m < len(f):
                    return f"{locate(col.row_of(k))}['frames'][{m}]"
                m -= len(f)
        k = [k for k, f in enumerate(values) if f][m]
        return f"{locate(col.row_of(k))}['frames'][0]"

    _dicts(frames, "frames", frame_path, where, "frame")
    _check_rows(frames, frame_path, where, _FRAME_KEYS)


# (key, required, kind) of a trace entry
_ENTRY_KEYS = (("action", True, "text"), ("size", True, "int"), ("addr", False, "int"),
               ("stream", False, "int"), ("time_us", False, "int"),
               ("device_free", False, "int"), ("frames", False, "frames"),
               ("cell", False, "text?"), ("nvtx_range", False, "text?"))
_SEGMENT_KEYS = (("address", True, "int"), ("total_size", True, "int"), ("device", False, "int"),
                 ("stream", False, "int"), ("allocated_size", False, "int"),
                 ("active_size", False, "int"), ("requested_size", False, "int"),
                 ("segment_type", False, "text"), ("frames", False, "frames*"))
_BLOCK_KEYS = (("address", True, "int"), ("size", True, "int"), ("state", True, "text"),
               ("requested_size", False, "int"), ("stream", False, "int"),
               ("frames", False, "frames*"))


def _check_rows(rows: list[dict[str, Any]], locate: Locate, where: _Where,
                keys: tuple[tuple[str, bool, str], ...],
                skip_bad_sizes: bool = False) -> dict[str, _Column]:
    cols: dict[str, _Column] = {}
    for key, required, kind in keys:
        col = cols[key] = _Column(rows, key, required, locate, where)
        if kind == "int":
            if key == "size" and skip_bad_sizes:
                continue  # (the replay counts and skips sizes that are not integers)
            _ints(col, locate, where, _INT_RANGES.get(key, _SIZE))
        elif kind.startswith("frames"):
            _frames(col, locate, where, every=kind == "frames*")
        else:
            _texts(col, locate, where, none_ok=kind == "text?")
    return cols


def check_trace_entries(entries: Any, path: str, what: str,
                        keys: tuple[str, ...] | None = None) -> dict[str, list[Any] | None]:
    """Check one device's trace entries (see the module documentation).

    Parameters
    ----------
    entries : list
        ``device_traces[d]``.
    path : str
        Where they are, for the messages (``"device_traces[0]"``).
    what : str
        The snapshot, for the messages (a file name or ``"snapshot"``).
    keys : tuple of str, optional
        Check only these keys (:data:`TRACE_KEYS_FOR_REPLAY` also lets ``size`` be anything:
        the replay skips entries whose size is not an integer). Default: every key.

    Returns
    -------
    dict
        Each key checked -> the list of its values, one per entry (what the exports read,
        so they need not read it again), or None where some entries lack the key.

    Raises
    ------
    SnapshotLoadError
        The first malformed entry, named by index and key.
    """
    where = _Where(what)

    def locate(j: int) -> str:
        return f"{path}[{j}]"

    _dicts(entries, path, locate, where, "trace entry")
    spec = _ENTRY_KEYS if keys is None else tuple(k for k in _ENTRY_KEYS if k[0] in keys)
    cols = _check_rows(entries, locate, where, spec,
                       skip_bad_sizes=keys == TRACE_KEYS_FOR_REPLAY)
    return {k: None if c.partial else c.values for k, c in cols.items()}


def _check_segments(segments: Any, where: _Where) -> None:
    def seg_path(i: int) -> str:
        return f"segments[{i}]"

    _dicts(segments, "segments", seg_path, where, "segment")
    cols = _check_rows(segments, seg_path, where, _SEGMENT_KEYS)
    if sum(cols["total_size"].values) >= _I63:
        raise where.fail("segments", ": the total_size values add up to 2**63 or more")
    for i, pool in enumerate(seg.get("segment_pool_id") for seg in segments):
        if pool is not None and not (type(pool) in (list, tuple) and len(pool) == 2
                                     and all(_is_int_type(type(x)) for x in pool)):
            raise where.fail(f"segments[{i}]['segment_pool_id']", f" is {_show(pool)}, "
                             "expected two integers")
    lists = _Column(segments, "blocks", True, seg_path, where)
    if not _only(lists.values, list):
        i, v = lists.first_bad(lambda v: isinstance(v, list))
        raise where.fail(f"segments[{i}]['blocks']", f" is {_show(v)}, expected a list of "
                         "blocks (dicts)")
    blocks = list(chain.from_iterable(lists.values))  # every block, checked in one pass

    def block_path(m: int) -> str:
        for i, b in enumerate(lists.values):
            if m < len(b):
                return f"segments[{i}]['blocks'][{m}]"
            m -= len(b)
        raise AssertionError("no such block")

    _dicts(blocks, "blocks", block_path, where, "block")
    cols = _check_rows(blocks, block_path, where, _BLOCK_KEYS)
    if sum(cols["size"].values) + sum(cols["requested_size"].values) >= _I63:
        raise where.fail("segments", ": the block sizes add up to 2**63 or more")


def _entry_locator(path: str) -> Locate:
    def locate(j: int) -> str:
        return f"{path}[{j}]"
    return locate


def check_snapshot(snap: Any, what: str = "snapshot", *, entries: bool = True
                   ) -> dict[str, Any]:
    """Check ``snap`` against torch's snapshot schema (see the module documentation).

    Parameters
    ----------
    snap : dict
        A snapshot dict (``segments`` and/or ``device_traces``).
    what : str, optional
        The snapshot, for the messages (e.g. ``"snapshot 'run.pickle'"``).
    entries : bool, optional
        Check the trace entries' keys too (default). False checks only that each device's
        trace is a list of dicts: for readers that call :func:`check_trace_entries` as they
        read the entries (the exports), so a million entries are read once, not twice.

    Returns
    -------
    dict
        ``snap`` itself (nothing is copied or changed).

    Raises
    ------
    SnapshotLoadError
        (a ValueError) The first malformed part, named by its path, e.g.
        ``segments[2]['blocks'][5] lacks the key 'size'``.
    """
    where = _Where(what)
    if not isinstance(snap, dict):
        raise where.fail("the snapshot", f" is {_show(snap)}, expected a dict")
    extra = snap.get("cudalab")  # cudalab's own key: {"simulated": bool}
    if extra is not None and not (isinstance(extra, dict)
                                  and type(extra.get("simulated", False)) in (bool, int)):
        raise where.fail("cudalab", f" is {_show(extra)}, expected a dict "
                         "{'simulated': bool}")
    identity = snap.get("identity")  # cudalab's own key: Identity.to_dict()
    if identity is not None:
        try:
            Identity.from_dict(identity, "identity")
        except ValueError as exc:
            raise where.fail("", str(exc)) from None
    segments = snap.get("segments")
    if segments is not None:
        _check_segments(segments, where)
    traces = snap.get("device_traces")
    if traces is not None:
        if not isinstance(traces, list):
            raise where.fail("device_traces", f" is {_show(traces)}, expected a list of "
                             "lists of trace entries")
        for d, trace in enumerate(traces):
            path = f"device_traces[{d}]"
            if entries:
                check_trace_entries(trace, path, what)
            else:
                _dicts(trace, path, _entry_locator(path), where, "trace entry")
    return snap
