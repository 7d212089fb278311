"""A :class:`~cudalab.memory_tools.trace_index.TraceIndex` of a trace already held as
columns, without an entry dict: :func:`index_columns`.

The cluster view receives each rank's trace entries as checked columns
(:class:`cudalab.cluster.columns.TraceColumns`: integer keys as numpy arrays, the others as
lists whose repeated values are one object). Building torch's entry dicts and then indexing
them (:func:`~cudalab.memory_tools.trace_index.index_snapshot`) costs about 0.6 s per
100,000 entries; reading the columns directly costs a few C-level passes and one interning
pass over the distinct values (the frames lists, texts and pool ids, memoised by object
identity as ``index_snapshot`` does). The result is the same index: the same columns and
tables as ``index_snapshot`` of the same snapshot (tests/cluster/test_lanes.py checks it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from cudalab.memory_tools.history import ACTIONS
from cudalab.memory_tools.safe_pickle import SnapshotLoadError
from cudalab.memory_tools.snapshot_check import check_snapshot
from cudalab.memory_tools.trace_index import COLUMNS, TraceIndex

__all__ = ["index_columns"]

_TOP = 1 << 63


class _Tables:
    """The index's tables, interned as ``index_snapshot`` interns them."""

    def __init__(self) -> None:
        self.actions = list(ACTIONS)
        self.action_codes = {a: i for i, a in enumerate(ACTIONS)}
        self.strings: list[str] = []
        self.string_ids: dict[str, int] = {}
        self.pools: list[Any] = []
        self.pool_ids: dict[Any, int] = {}
        self.frames: list[tuple[str, str, int]] = []
        self.frame_ids: dict[tuple[str, str, int], int] = {}
        self.stack_ids: dict[tuple[int, ...], int] = {}
        self.offsets = [0]
        self.stack_pool: list[int] = []
        self.by_list: dict[int, tuple[Any, int]] = {}

    def action(self, a: Any) -> int:
        code = self.action_codes.get(a)
        if code is None:
            code = self.action_codes[a] = len(self.actions)
            self.actions.append(a)
        return code

    def text(self, v: Any) -> int:
        if v is None:
            return -1
        got = self.string_ids.get(v)
        if got is None:
            got = self.string_ids[v] = len(self.strings)
            self.strings.append(v)
        return got

    def pool(self, v: Any) -> int:
        if v is None:
            return -1
        if isinstance(v, list):
            v = tuple(v)
        try:
            got = self.pool_ids.get(v)
        except TypeError:  # (not hashable: not a pool id)
            return -1
        if got is None:
            got = self.pool_ids[v] = len(self.pools)
            self.pools.append(v)
        return got

    def stack(self, fr: Any) -> int:
        if not fr:
            return -1
        got = self.by_list.get(id(fr))
        if got is not None and got[0] is fr:
            return got[1]
        ids = []
        for f in fr:
            key = (f["filename"], f["name"], f["line"])
            fid = self.frame_ids.get(key)
            if fid is None:
                fid = self.frame_ids[key] = len(self.frames)
                self.frames.append(key)
            ids.append(fid)
        t = tuple(ids)
        sid = self.stack_ids.get(t)
        if sid is None:
            sid = self.stack_ids[t] = len(self.offsets) - 1
            self.stack_pool.extend(ids)
            self.offsets.append(len(self.stack_pool))
        self.by_list[id(fr)] = (fr, sid)
        return sid


def _mapped(values: Sequence[Any], fn: Any, n: int, dtype: Any) -> NDArray[Any]:
    """``fn`` of each value, called once per distinct object (a column's repeats are one
    object), the rest C-level passes: the objects by id, ``fn`` of each, then a lookup per
    entry."""
    ids = list(map(id, values))
    distinct = dict(zip(ids, values))  # (values holds every object: the ids stay theirs)
    codes = {i: fn(v) for i, v in distinct.items()}
    return np.fromiter(map(codes.__getitem__, ids), dtype, n)


def _has_none(col: Any) -> bool:
    """Whether a column lacks a value somewhere (a numpy column never does)."""
    return not isinstance(col, np.ndarray) and None in col


def _ints(col: Any, n: int, default: int) -> tuple[NDArray[np.int64], bool]:
    """An integer column as int64 (a value >= 2**63 kept as its bit pattern) and whether it
    has such a value; ``default`` where an entry lacks the key."""
    if col is None:
        return np.full(n, default, np.int64), False
    if isinstance(col, np.ndarray):
        if col.dtype == np.uint64:
            return col.view(np.int64), bool(len(col) and int(col.max()) >= _TOP)
        return col.astype(np.int64, copy=False), False
    values = [default if v is None else int(v) for v in col]
    wide = any(v >= _TOP for v in values)
    if wide:
        values = [v - (1 << 64) if v >= _TOP else v for v in values]
    return np.array(values, np.int64), wide


def index_columns(snapshot: Mapping[str, Any], traces: Mapping[int, Any], *,
                  source: str = "snapshot") -> TraceIndex:
    """The :class:`TraceIndex` of ``snapshot`` whose trace entries are ``traces`` (device ->
    columns: an object with ``n`` and ``columns``, a mapping of key -> a numpy integer array
    or a list with None where an entry lacks the key, as :class:`cudalab.cluster.columns
    .TraceColumns` holds them, already checked against the snapshot schema).

    The snapshot's own ``device_traces`` must be empty (the entries are the columns); the
    rest is checked as :func:`index_snapshot` checks it.

    Raises
    ------
    SnapshotLoadError
        The snapshot is malformed, still holds entries, or a column lacks ``action`` or
        ``size`` values.
    """
    rest = {k: v for k, v in snapshot.items() if k != "device_traces"}
    held = snapshot.get("device_traces") or []
    if any(held):
        raise SnapshotLoadError(f"{source}: index_columns() takes a snapshot whose entries "
                                "are all in the columns")
    devices = sorted(d for d, t in traces.items() if t.n)
    rest["device_traces"] = [[] for _ in range(max([len(held), *(d + 1 for d in devices)]))]
    check_snapshot(rest, source)
    n = sum(traces[d].n for d in devices)
    cols = {name: np.empty(n, dtype) for name, dtype in COLUMNS}
    tables = _Tables()
    unsigned = {"addr": False, "stream": False}
    r = 0
    for d in devices:
        t = traces[d]
        k, c = t.n, t.columns
        part = slice(r, r + k)
        for key, name, default in (("time_us", "time_us", 0), ("addr", "addr", 0),
                                   ("size", "size", None), ("stream", "stream", 0),
                                   ("device_free", "device_free", -1)):
            if default is None and (c.get(key) is None or _has_none(c[key])):
                raise SnapshotLoadError(f"{source}: device {d}: an entry lacks {key!r}")
            values, wide = _ints(c.get(key), k, -1 if default is None else default)
            cols[name][part] = values
            if wide and name in unsigned:
                unsigned[name] = True
        if c.get("action") is None or _has_none(c["action"]):
            raise SnapshotLoadError(f"{source}: device {d}: an entry lacks 'action'")
        cols["action"][part] = _mapped(c["action"], tables.action, k, np.int64)
        cols["device"][part] = d
        none = [None] * k
        cols["stack"][part] = _mapped(c.get("frames", none), tables.stack, k, np.int32)
        cols["cell"][part] = _mapped(c.get("cell", none), tables.text, k, np.int32)
        cols["nvtx"][part] = _mapped(c.get("nvtx_range", none), tables.text, k, np.int32)
        cols["pool"][part] = _mapped(c.get("segment_pool_id", none), tables.pool, k, np.int32)
        r += k
    out = {"actions": tables.actions, "strings": tables.strings, "pools": tables.pools,
           "frames": tables.frames,
           "stack_offsets": np.array(tables.offsets, np.int64).tobytes(),
           "stack_frames": np.array(tables.stack_pool, np.int32).tobytes(),
           "addr_unsigned": unsigned["addr"], "stream_unsigned": unsigned["stream"]}
    return TraceIndex(cols, out, rest, complete=True, bytes_read=0, bytes_total=0,
                      source=source)
