"""A snapshot's history as columns: the shared reader of the DataFrame and Perfetto exports.

:func:`trace_of` reads the trace entries of a snapshot (or, for ``snap=None``, cudalab's
recorder directly: no snapshot dict is built, so no ``snapshot`` entry is appended) into a
:class:`TraceColumns`: numpy arrays and lists, one row per entry, with per-device running
``allocated``/``reserved`` totals. :mod:`cudalab.memory_tools.export` (DataFrames),
:mod:`cudalab.memory_tools.perfetto` and :mod:`cudalab.memory_tools.plot` build on it.

What ``snap`` may be, everywhere in the exports (:func:`resolve_snapshot`): a snapshot dict in
torch's schema (``cudalab.memory._snapshot()`` or ``torch.cuda.memory._snapshot()``); a
``str``/``os.PathLike``, read with :func:`cudalab.memory_tools.trace_io.load_snapshot`
(torch's pickles included); a list, taken as ``memory_snapshot()``'s segment list; None, the
live process. The keys cudalab adds to trace entries (``device``, ``nvtx_range``, ``cell``)
and to the snapshot (``"cudalab": {"simulated": ...}``) are optional everywhere, so torch's
own snapshots read the same way. Each reading keeps the snapshot's ``identity`` (or, for the
live process, :func:`live_identity`) for the exports to pass on.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

import numpy as np
from numpy.typing import NDArray

from cudalab import _internal
from cudalab.identity import Identity
from cudalab.memory_tools import history as _history
from cudalab.memory_tools.history import ACTIONS
from cudalab.memory_tools.history_ring import TraceEntry
from cudalab.memory_tools.snapshot import memory_snapshot, take_snapshot
from cudalab.memory_tools.snapshot_check import check_snapshot, check_trace_entries
from cudalab.memory_tools.stacks import FrameCache, FrameDict, Stack, line_of
from cudalab.memory_tools.trace_io import load_snapshot

__all__ = [
    "ACTIONS",
    "TraceColumns",
    "device_index",
    "int_array",
    "live_history",
    "live_identity",
    "live_simulated",
    "resolve_segments",
    "resolve_snapshot",
    "stream_label",
    "trace_of",
]

#: The code of each action in :attr:`TraceColumns.code`: its index in :data:`ACTIONS`
#: (history's tuple, so the two cannot drift; unknown actions get codes after these).
(ALLOC, FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP,
 SNAPSHOT, OOM) = range(9)
assert ACTIONS[OOM] == "oom" and ACTIONS[SEGMENT_UNMAP] == "segment_unmap" and len(ACTIONS) == 9


def stream_label(stream: int) -> str:
    """A stream key as people read it: ``"stream 0 (legacy default)"``, ``"stream 0x7f00aa"``.

    Parameters
    ----------
    stream : int
        The allocator's stream key (the stream handle value; 0 is the legacy default stream).
    """
    return "stream 0 (legacy default)" if stream == 0 else f"stream 0x{stream:x}"


def resolve_snapshot(snap: Any) -> dict[str, Any]:
    """The snapshot dict to read (see the module docstring for what ``snap`` may be).

    A dict or segment list given is checked against torch's schema
    (:func:`cudalab.memory_tools.snapshot_check.check_snapshot`: SnapshotLoadError naming a
    malformed entry); a file is checked when it is loaded; the live snapshot is cudalab's own.
    """
    if snap is None:
        return take_snapshot()
    if isinstance(snap, (str, os.PathLike)):
        return load_snapshot(snap)
    if isinstance(snap, list):  # memory_snapshot()'s segment list
        return check_snapshot({"segments": snap, "device_traces": []}, entries=False)
    if not isinstance(snap, dict):
        raise TypeError(f"snap must be a snapshot dict, a segment list or a path, "
                        f"not {type(snap).__name__}")
    return check_snapshot(snap, entries=False)  # (the entries: as TraceColumns reads them)


def live_simulated() -> bool:
    """Whether this process runs on the simulator (False before CUDA is initialised)."""
    try:
        return bool(_internal.is_initialized() and _internal.backend().simulated)
    except Exception:  # no backend: not simulated
        return False


def live_identity() -> dict[str, Any]:
    """This process's :class:`~cudalab.identity.Identity` (its current device, cudalab's
    allocator) as the plain dict that snapshots carry under ``"identity"``."""
    return Identity.current(allocator="cudalab").to_dict()


def resolve_segments(snap: Any) -> dict[str, Any]:
    """Like :func:`resolve_snapshot`, but None reads only the segments (``memory_snapshot()``)
    and this process's identity."""
    if snap is None:
        return {"segments": memory_snapshot(), "identity": live_identity()}
    return resolve_snapshot(snap)


def device_index(device: Any) -> int:
    """The device number of a device argument (int, ``"cuda:N"``, ``"N"`` or an object with
    an int ``index``), not checked against this machine's devices: a snapshot may come from
    another one. ValueError for anything else."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    idx = getattr(device, "index", None)
    if isinstance(idx, int):
        return idx
    if isinstance(device, str):
        s = device.strip().lower()
        if s.startswith("cuda:"):
            return int(s[5:])
        if s.isdigit():
            return int(s)
    raise ValueError(f"not a device: {device!r}")


class _Codes(dict[str, int]):
    """action -> small int code; unknown actions get the next code (kept in ``names``)."""

    def __init__(self, names: tuple[str, ...]):
        super().__init__((n, i) for i, n in enumerate(names))
        self.names = list(names)

    def __missing__(self, key: str) -> int:
        code = len(self.names)
        self.names.append(key)
        self[key] = code
        return code


def int_array(values: Sequence[int]) -> NDArray[np.int64] | NDArray[np.uint64]:
    """int64, or uint64 if some value does not fit (a 64-bit handle with the top bit set)."""
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        return np.array(values, dtype=np.uint64)


def _column(entries: list[dict[str, Any]], key: str, default: Any) -> list[Any]:
    """``[e.get(key, default) for e in entries]``, via itemgetter when every entry has it."""
    if entries and key not in entries[0]:
        return [e.get(key, default) for e in entries]
    try:
        return list(map(itemgetter(key), entries))
    except KeyError:
        return [e.get(key, default) for e in entries]


def _concat(parts: list[list[Any]]) -> list[Any]:
    if not parts:
        return []
    if len(parts) == 1:
        return parts[0]
    out: list[Any] = []
    for p in parts:
        out += p
    return out


def _dict_columns(entries: list[dict[str, Any]], codes: _Codes, extras: bool, device: int = 0
                  ) -> dict[str, Any]:
    """Columns of one device's torch-schema trace entry dicts, checked as they are read
    (:func:`cudalab.memory_tools.snapshot_check.check_trace_entries`: SnapshotLoadError
    naming a malformed entry)."""
    n = len(entries)
    # one C-level pass per key (map + itemgetter) beats one Python loop over 1M dicts; the
    # check reads them and hands them over
    checked = check_trace_entries(entries, f"device_traces[{device}]", "snapshot")

    def column(key: str, default: Any) -> list[Any]:
        got = checked[key]
        return got if got is not None else [e.get(key, default) for e in entries]

    frames = column("frames", None)
    cols: dict[str, Any] = {
        "time_us": np.fromiter(column("time_us", 0), np.int64, n),
        "code": np.fromiter(map(codes.__getitem__, column("action", "")), np.int16, n),
        "size": np.fromiter(column("size", 0), np.int64, n),
        "addr": int_array(column("addr", 0)),  # (oom entries have device_free instead)
        "stream": int_array(column("stream", 0)),
        "top": [f[0] if f else None for f in frames],
    }
    if extras:  # cudalab's keys (not needed by the Perfetto export)
        cols["cell"] = column("cell", None)
        cols["nvtx_range"] = column("nvtx_range", None)
    oom = np.flatnonzero(cols["code"] == OOM)
    cols["oom"] = (oom, [entries[i].get("device_free", -1) for i in oom.tolist()])
    return cols


def _raw_columns(entries: list[TraceEntry], codes: _Codes, extras: bool, cache: FrameCache
                 ) -> dict[str, Any]:
    """Columns of one device's raw history tuples (``cudalab.memory_tools.history.FIELDS``:
    action, addr, size, stream, time_ns, frames, nvtx_range, cell), without building the
    trace entry dicts first."""
    n = len(entries)

    def miss(frames: Stack, key: tuple[int, int]) -> FrameDict:
        code = frames[0]
        d: FrameDict = {"filename": code.co_filename, "line": line_of(code, frames[1]),
                          "name": code.co_name}
        cache[key] = d
        cache[("code", key[0])] = code  # keep the code alive while its id is a key
        return d

    get = cache.get
    # top frame = (code, lasti) of the innermost frame, keyed by the code's id (hashing a
    # code object is slow); hits cost one dict lookup, no call
    tops = [(get(k := (id(f[0]), f[1])) or miss(f, k)) if f else None
            for f in map(itemgetter(5), entries)]
    cols: dict[str, Any] = {
        "time_us": np.fromiter(map(itemgetter(4), entries), np.int64, n) // 1000,
        "code": np.fromiter(map(codes.__getitem__, map(itemgetter(0), entries)), np.int16, n),
        "size": np.fromiter(map(itemgetter(2), entries), np.int64, n),
        "addr": int_array(list(map(itemgetter(1), entries))),
        "stream": int_array(list(map(itemgetter(3), entries))),
        "top": tops,
    }
    if extras:
        cols["cell"] = list(map(itemgetter(7), entries))
        cols["nvtx_range"] = list(map(itemgetter(6), entries))
    oom = np.flatnonzero(cols["code"] == OOM)  # addr holds device_free there
    cols["oom"] = (oom, cols["addr"][oom].tolist())
    cols["addr"][oom] = 0
    return cols


#: The layout of history's raw entry tuples that :func:`_raw_columns` reads by index.
_RAW_FIELDS = ("action", "addr", "size", "stream", "time_ns", "frames", "nvtx_range", "cell")


def live_history() -> dict[int, list[TraceEntry]] | None:
    """Each device's raw history tuples straight from cudalab's recorder, or None when the
    recorder stores another layout than :func:`_raw_columns` reads (then a snapshot is
    taken: the check keeps the two from drifting apart silently)."""
    if _history.FIELDS != _RAW_FIELDS:
        return None
    return {d: _history.raw_entries(d) for d in _history.devices_with_history()}


class TraceColumns:
    """The trace entries of a snapshot as columns (numpy arrays and lists), devices in
    ``device_traces`` order, each device's entries in recorded order.

    ``raw`` (device -> cudalab's raw history tuples) replaces ``snap``'s ``device_traces``.
    ``identity`` is where the entries came from: ``snap["identity"]`` (None when the snapshot
    has none, as torch's), or this process's (:func:`live_identity`) with ``raw``.
    """

    __slots__ = ("n", "device", "time_us", "code", "addr", "size", "stream", "device_free",
                 "top", "cell", "nvtx_range", "allocated", "reserved", "names", "bounds",
                 "identity")

    def __init__(self, snap: dict[str, Any] | None, device: int | None = None,
                 extras: bool = True, raw: dict[int, list[TraceEntry]] | None = None):
        self.identity: dict[str, Any] | None
        sources: list[tuple[int, list[Any]]]
        if raw is not None:
            sources = sorted(raw.items())
            self.identity = live_identity()
        else:
            sources = list(enumerate((snap or {}).get("device_traces") or []))
            self.identity = (snap or {}).get("identity")
        codes = _Codes(ACTIONS)
        cache: FrameCache = {}
        parts: dict[str, list[Any]] = defaultdict(list)
        self.bounds: list[tuple[int, int, int]] = []  # (device, start, stop)
        start = 0
        for d, entries in sources:
            if not entries or (device is not None and d != device):
                continue
            n = len(entries)
            cols = (_raw_columns(entries, codes, extras, cache) if raw is not None
                    else _dict_columns(entries, codes, extras, d))
            for k, v in cols.items():
                parts[k].append(v)
            parts["device"].append(np.full(n, d, dtype=np.int64))
            self.bounds.append((d, start, start + n))
            start += n
        self.n = start
        self.names = codes.names

        def arr(key: str, dtype: type[np.integer[Any]]) -> NDArray[Any]:
            p = parts[key]
            if not p:
                return np.zeros(0, dtype)
            if len(p) > 1 and any(x.dtype == np.uint64 for x in p):  # keep 64-bit handles exact
                p = [x.astype(np.uint64) for x in p]
            return np.concatenate(p)

        self.device = arr("device", np.int64)
        self.time_us = arr("time_us", np.int64)
        self.code = arr("code", np.int16)
        self.addr = arr("addr", np.int64)
        self.size = arr("size", np.int64)
        self.stream = arr("stream", np.int64)
        self.top = _concat(parts["top"])
        self.cell = _concat(parts["cell"])
        self.nvtx_range = _concat(parts["nvtx_range"])
        # oom entries carry device_free instead of addr (torch); -1 on every other row
        self.device_free = np.full(self.n, -1, dtype=np.int64)
        for (_, a, _), (idx, values) in zip(self.bounds, parts["oom"]):
            if values:
                self.device_free[idx + a] = values
        # running totals, per device, in recorded order
        code, size = self.code, self.size
        d_alloc = np.where(code == ALLOC, size, 0) - np.where(code == FREE_COMPLETED, size, 0)
        up = (code == SEGMENT_ALLOC) | (code == SEGMENT_MAP)
        down = (code == SEGMENT_FREE) | (code == SEGMENT_UNMAP)
        d_res = np.where(up, size, 0) - np.where(down, size, 0)
        self.allocated = np.empty(self.n, np.int64)
        self.reserved = np.empty(self.n, np.int64)
        for _, a, b in self.bounds:
            np.cumsum(d_alloc[a:b], out=self.allocated[a:b])
            np.cumsum(d_res[a:b], out=self.reserved[a:b])


def trace_of(snap: Any, device: int | None = None, extras: bool = True) -> TraceColumns:
    """The trace of ``snap``; for None, read cudalab's recorder directly (no snapshot dict,
    no ``snapshot`` entry appended), falling back to ``cudalab.memory._snapshot()``."""
    if snap is None:
        raw = live_history()
        if raw is not None:
            return TraceColumns(None, device, extras, raw=raw)
    return TraceColumns(resolve_snapshot(snap), device, extras)
