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

* the snapshot: a dict; ``segments`` a list, ``device_traces`` a list of lists;
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
from operator import itemgetter
from typing import Any

import numpy as np

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


def _type_name(value: Any) -> str:
    return "None" if value is None else type(value).__name__


def _is_int_type(t: type) -> bool:
    return (t is int or issubclass(t, (int, np.integer))) and not issubclass(t, (bool, np.bool_))


class _Where:
    """Builds the location of an offending value: ``what: segments[3]['blocks'][7]``."""

    __slots__ = ("what",)

    def __init__(self, what: str):
        self.what = what

    def fail(self, path: str, text: str) -> SnapshotLoadError:
        return SnapshotLoadError(f"{self.what}: {path}{text}")


def _dicts(rows: Any, path: str, where: _Where, name: str) -> list:
    """``rows`` checked to be a list of dicts."""
    if type(rows) is not list:
        raise where.fail(path, f" is {_type_name(rows)}, expected a list of {name}s (dicts)")
    if rows and set(map(type, rows)) != {dict}:
        for j, r in enumerate(rows):
            if type(r) is not dict:
                raise where.fail(f"{path}[{j}]", f" is {_show(r)}, expected a {name} (a dict)")
    return rows


def _column(rows: list, key: str, required: bool, path: str, where: _Where
            ) -> tuple[list, list[int] | None]:
    """The values of ``key`` over ``rows`` and their row indices (None: every row)."""
    try:
        return list(map(itemgetter(key), rows)), None
    except KeyError:
        if required:
            j = next(j for j, r in enumerate(rows) if key not in r)
            raise where.fail(f"{path}[{j}]", f" lacks the key {key!r}") from None
    idx = [j for j, r in enumerate(rows) if key in r]
    return [rows[j][key] for j in idx], idx


def _bad(values: list, idx: list[int] | None, ok: Callable[[Any], bool]) -> tuple[int, Any]:
    for k, v in enumerate(values):
        if not ok(v):
            return (k if idx is None else idx[k]), v
    raise AssertionError("no offending value")  # (only called after a pass failed)


def _ints(values: list, idx: list[int] | None, key: str, path: str, where: _Where,
          bounds: tuple[int, int]) -> None:
    if not values:
        return
    if not all(map(_is_int_type, set(map(type, values)))):
        j, v = _bad(values, idx, lambda v: _is_int_type(type(v)))
        raise where.fail(f"{path}[{j}][{key!r}]", f" is {_show(v)} ({_type_name(v)}), expected "
                         "an integer")
    lo, hi = bounds
    if min(values) < lo or max(values) >= hi:
        j, v = _bad(values, idx, lambda v: lo <= v < hi)
        raise where.fail(f"{path}[{j}][{key!r}]", f" is {v!r:.60}, out of range (expected "
                         f"{lo:,} <= {key} < {hi:,})")


def _texts(values: list, idx: list[int] | None, key: str, path: str, where: _Where,
           none_ok: bool = False) -> None:
    allowed = {str, type(None)} if none_ok else {str}
    if values and not set(map(type, values)) <= allowed:
        j, v = _bad(values, idx, lambda v: type(v) in allowed)
        raise where.fail(f"{path}[{j}][{key!r}]", f" is {_show(v)} ({_type_name(v)}), expected "
                         f"text{' or None' if none_ok else ''}")


def _frames(values: list, idx: list[int] | None, path: str, where: _Where,
            every: bool = False) -> None:
    """Each value a list of frames; the top (first) frame of each (``every``: each frame) a
    dict with filename, line and name (what the exports and the viewer read)."""
    if not values:
        return
    if set(map(type, values)) != {list}:
        j, v = _bad(values, idx, lambda v: type(v) is list)
        raise where.fail(f"{path}[{j}]['frames']", f" is {_show(v)}, expected a list of frames")
    if every:  # (segments and blocks: few, and the viewer shows their whole stacks)
        for k, f in enumerate(values):
            for m in range(1, len(f)):
                if type(f[m]) is not dict:
                    j = k if idx is None else idx[k]
                    raise where.fail(f"{path}[{j}]['frames'][{m}]", f" is {_show(f[m])}, "
                                     "expected a frame (a dict)")
    rows = [j if idx is None else idx[j] for j, f in enumerate(values) if f]
    tops = [f[0] for f in values if f]
    if not tops:
        return
    if set(map(type, tops)) != {dict}:
        k, v = _bad(tops, None, lambda v: type(v) is dict)
        raise where.fail(f"{path}[{rows[k]}]['frames'][0]", f" is {_show(v)}, expected a frame "
                         "(a dict with filename, line, name)")
    for key in ("filename", "line", "name"):
        try:
            got = list(map(itemgetter(key), tops))
        except KeyError:
            k = next(k for k, t in enumerate(tops) if key not in t)
            raise where.fail(f"{path}[{rows[k]}]['frames'][0]", f" lacks the key {key!r}") \
                from None
        inner = f"{path}[{{}}]['frames'][0]"
        if key == "line":
            if not all(map(_is_int_type, set(map(type, got)))):
                k, v = _bad(got, None, lambda v: _is_int_type(type(v)))
                raise where.fail(inner.format(rows[k]), f"['line'] is {_show(v)}, expected an "
                                 "integer")
            if min(got) < -_I63 or max(got) >= _I63:
                k, v = _bad(got, None, lambda v: -_I63 <= v < _I63)
                raise where.fail(inner.format(rows[k]), f"['line'] is {v!r:.60}, out of range")
        elif not set(map(type, got)) <= {str}:
            k, v = _bad(got, None, lambda v: type(v) is str)
            raise where.fail(inner.format(rows[k]), f"[{key!r}] is {_show(v)}, expected text")


# (key, required, kind) of a trace entry
_ENTRY_KEYS = (("action", True, "text"), ("size", True, "int"), ("addr", False, "int"),
               ("stream", False, "int"), ("time_us", False, "int"),
               ("device_free", False, "int"), ("frames", False, "frames"),
               ("cell", False, "text?"), ("nvtx_range", False, "text?"))
_SEGMENT_KEYS = (("address", True, "int"), ("total_size", True, "int"), ("device", False, "int"),
                 ("stream", False, "int"), ("allocated_size", False, "int"),
                 ("active_size", False, "int"), ("requested_size", False, "int"),
                 ("segment_type", False, "text"), ("frames", False, "frames"))
_BLOCK_KEYS = (("address", True, "int"), ("size", True, "int"), ("state", True, "text"),
               ("requested_size", False, "int"), ("stream", False, "int"),
               ("frames", False, "frames"))


def _check_rows(rows: list, path: str, where: _Where, keys: tuple, skip_bad_sizes: bool = False,
                every_frame: bool = False) -> None:
    for key, required, kind in keys:
        values, idx = _column(rows, key, required, path, where)
        if kind == "int":
            if key == "size" and skip_bad_sizes:
                continue  # (the replay counts and skips sizes that are not integers)
            _ints(values, idx, key, path, where, _INT_RANGES.get(key, _SIZE))
        elif kind == "frames":
            _frames(values, idx, path, where, every_frame)
        else:
            _texts(values, idx, key, path, where, none_ok=kind == "text?")


def check_trace_entries(entries: Any, path: str, what: str,
                        keys: tuple[str, ...] | None = None) -> list:
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
    list
        ``entries``.

    Raises
    ------
    SnapshotLoadError
        The first malformed entry, named by index and key.
    """
    where = _Where(what)
    _dicts(entries, path, where, "trace entry")
    spec = _ENTRY_KEYS if keys is None else tuple(k for k in _ENTRY_KEYS if k[0] in keys)
    _check_rows(entries, path, where, spec, skip_bad_sizes=keys == TRACE_KEYS_FOR_REPLAY)
    return entries


def check_snapshot(snap: Any, what: str = "snapshot") -> dict:
    """Check ``snap`` against torch's snapshot schema (see the module documentation).

    Parameters
    ----------
    snap : dict
        A snapshot dict (``segments`` and/or ``device_traces``).
    what : str, optional
        The snapshot, for the messages (e.g. ``"snapshot 'run.pickle'"``).

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
    if type(snap) is not dict:
        raise where.fail("the snapshot", f" is {_type_name(snap)}, expected a dict")
    segments = snap.get("segments")
    if segments is not None:
        _dicts(segments, "segments", where, "segment")
        _check_rows(segments, "segments", where, _SEGMENT_KEYS, every_frame=True)
        if segments and sum(map(itemgetter("total_size"), segments)) >= _I63:
            raise where.fail("segments", ": the total_size values add up to 2**63 bytes or more")
        sizes = 0
        for i, seg in enumerate(segments):
            path = f"segments[{i}]"
            blocks = seg.get("blocks")
            if blocks is None:
                raise where.fail(path, " lacks the key 'blocks'")
            _dicts(blocks, f"{path}['blocks']", where, "block")
            _check_rows(blocks, f"{path}['blocks']", where, _BLOCK_KEYS, every_frame=True)
            if blocks:
                sizes += sum(map(itemgetter("size"), blocks))
                sizes += sum(b.get("requested_size", 0) for b in blocks)
            if sizes >= _I63:
                raise where.fail(path, ": the block sizes add up to 2**63 bytes or more")
            pool = seg.get("segment_pool_id")
            if pool is not None and not (type(pool) in (list, tuple) and len(pool) == 2
                                         and all(_is_int_type(type(x)) for x in pool)):
                raise where.fail(f"{path}['segment_pool_id']", f" is {_show(pool)}, expected "
                                 "two integers")
    traces = snap.get("device_traces")
    if traces is not None:
        if type(traces) is not list:
            raise where.fail("device_traces", f" is {_type_name(traces)}, expected a list of "
                             "lists of trace entries")
        for d, entries in enumerate(traces):
            check_trace_entries(entries, f"device_traces[{d}]", what)
    return snap
