"""Tidy exports of allocator snapshots: pandas DataFrames and Chrome/Perfetto trace JSON.

Every function reads a snapshot dict in torch's schema (what
``cudalab.memory._snapshot()`` and ``torch.cuda.memory._snapshot()`` return); a
``str``/``os.PathLike`` is read with ``cudalab.memory.load_snapshot`` (torch's pickles
included) and a list is taken as ``memory_snapshot()``'s segment list. ``snap=None`` reads the
live process: the history straight from cudalab's recorder (``cudalab.memory_tools.history``; no
snapshot dict is built, so no ``snapshot`` entry is appended), the segments from
``memory_snapshot()``. The keys cudalab adds to trace entries (``device``,
``nvtx_range``, ``cell``) and to the snapshot (``"cudalab": {"simulated": ...}``) are optional
everywhere, so torch's own snapshots export the same way.

* :func:`history_frame` - one row per trace entry, with running ``allocated``/``reserved`` totals;
* :func:`snapshot_frame` - one row per block, with its segment's columns;
* :func:`segments_frame` - one row per segment, with free-space fragmentation;
* :func:`stats_frame` - one row per device, torch's 122 ``memory_stats()`` keys as columns;
* :func:`export_perfetto` - a trace for ui.perfetto.dev / chrome://tracing.

(The pickle for pytorch.org/memory_viz is ``cudalab.memory.export_memory_viz``.)

The frames save with pandas' own ``to_parquet`` (needs pyarrow) and ``to_csv``;
:func:`read_history_csv` reads a saved history back with its dtypes. pandas is imported only
inside the functions that build frames, so importing this module costs nothing.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random
from collections import defaultdict
from heapq import heappop, heappush
from operator import itemgetter
from typing import Any

import numpy as np

__all__ = [
    "ACTIONS",
    "BLOCK_STATES",
    "export_perfetto",
    "history_frame",
    "read_history_csv",
    "segments_frame",
    "snapshot_frame",
    "stats_frame",
]

#: torch's trace-entry actions, in the order of ``history_frame()["action"]``'s categories.
ACTIONS: tuple[str, ...] = (
    "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap", "snapshot", "oom",
)
#: torch's block states, in the order of ``snapshot_frame()["state"]``'s categories.
BLOCK_STATES: tuple[str, ...] = ("active_allocated", "active_pending_free", "inactive")
SEGMENT_TYPES: tuple[str, ...] = ("small", "large")

_ALLOC, _FREE_REQ, _FREE_DONE, _SEG_ALLOC, _SEG_FREE, _SEG_MAP, _SEG_UNMAP, _SNAP, _OOM = range(9)

_HISTORY_COLUMNS = (
    "time", "time_us", "device", "stream", "action", "addr", "size", "device_free",
    "filename", "line", "name", "cell", "nvtx_range", "allocated", "reserved",
)


# --------------------------------------------------------------------------- inputs
def _resolve(snap: Any) -> dict:
    """The snapshot dict to read (see the module docstring for what ``snap`` may be)."""
    if snap is None:
        import cudalab.memory as cm

        take = getattr(cm, "_snapshot", None)
        if take is None:
            raise RuntimeError("cudalab.memory._snapshot() is not available in this build; "
                               "pass a snapshot dict explicitly")
        return take()
    if isinstance(snap, (str, os.PathLike)):
        import cudalab.memory as cm

        return cm.load_snapshot(snap)
    if isinstance(snap, list):  # memory_snapshot()'s segment list
        return {"segments": snap, "device_traces": []}
    if not isinstance(snap, dict):
        raise TypeError(f"snap must be a snapshot dict, a segment list or a path, "
                        f"not {type(snap).__name__}")
    return snap


def _live_simulated() -> bool:
    from cudalab import devices

    try:
        return bool(devices.is_initialized() and devices._backend().simulated)
    except Exception:  # no backend: not simulated
        return False


def _resolve_segments(snap: Any) -> dict:
    """Like :func:`_resolve`, but None reads only the segments (``memory_snapshot()``)."""
    if snap is None:
        import cudalab.memory as cm

        return {"segments": cm.memory_snapshot()}
    return _resolve(snap)


def _device_index(device: Any) -> int:
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


class _Codes(dict):
    """action -> small int code; unknown actions get the next code (kept in ``names``)."""

    def __init__(self, names: tuple[str, ...]):
        super().__init__((n, i) for i, n in enumerate(names))
        self.names = list(names)

    def __missing__(self, key: str) -> int:
        code = len(self.names)
        self.names.append(key)
        self[key] = code
        return code


def _int_array(values: list) -> np.ndarray:
    """int64, or uint64 if some value does not fit (a 64-bit handle with the top bit set)."""
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        return np.array(values, dtype=np.uint64)


def _column(entries: list, key: str, default: Any) -> list:
    """``[e.get(key, default) for e in entries]``, via itemgetter when every entry has it."""
    if entries and key not in entries[0]:
        return [e.get(key, default) for e in entries]
    try:
        return list(map(itemgetter(key), entries))
    except KeyError:
        return [e.get(key, default) for e in entries]


def _concat(parts: list) -> list:
    if not parts:
        return []
    if len(parts) == 1:
        return parts[0]
    out: list = []
    for p in parts:
        out += p
    return out


def _dict_columns(entries: list, codes: _Codes, extras: bool) -> dict:
    """Columns of one device's torch-schema trace entry dicts."""
    n = len(entries)
    # one C-level pass per column (map + itemgetter) beats one Python loop over 1M dicts
    cols = {
        "time_us": np.fromiter(map(itemgetter("time_us"), entries), np.int64, n),
        "code": np.fromiter(map(codes.__getitem__, map(itemgetter("action"), entries)),
                            np.int16, n),
        "size": np.fromiter(map(itemgetter("size"), entries), np.int64, n),
        # oom entries have device_free instead of addr: no itemgetter fast path here
        "addr": _int_array([e.get("addr", 0) for e in entries]),
        "stream": _int_array(_column(entries, "stream", 0)),
        "top": ([f[0] if f else None for f in map(itemgetter("frames"), entries)]
                if "frames" in entries[0] else
                [f[0] if (f := e.get("frames")) else None for e in entries]),
    }
    if extras:  # cudalab's keys (not needed by the Perfetto export)
        cols["cell"] = _column(entries, "cell", None)
        cols["nvtx_range"] = _column(entries, "nvtx_range", None)
    oom = np.flatnonzero(cols["code"] == _OOM)
    cols["oom"] = (oom, [entries[i].get("device_free", -1) for i in oom.tolist()])
    return cols


def _raw_columns(entries: list, codes: _Codes, extras: bool, cache: dict) -> dict:
    """Columns of one device's raw history tuples (``cudalab.memory_tools.history.FIELDS``:
    action, addr, size, stream, time_ns, frames, nvtx_range, cell), without building the
    trace entry dicts first."""
    from cudalab.memory_tools.history import _line_of

    n = len(entries)

    def miss(frames, key):
        code = frames[0]
        d = cache[key] = {"filename": code.co_filename, "line": _line_of(code, frames[1]),
                          "name": code.co_name}
        cache[("code", key[0])] = code  # keep the code alive while its id is a key
        return d

    get = cache.get
    # top frame = (code, lasti) of the innermost frame, keyed by the code's id (hashing a
    # code object is slow); hits cost one dict lookup, no call
    tops = [(get(k := (id(f[0]), f[1])) or miss(f, k)) if f else None
            for f in map(itemgetter(5), entries)]
    cols = {
        "time_us": np.fromiter(map(itemgetter(4), entries), np.int64, n) // 1000,
        "code": np.fromiter(map(codes.__getitem__, map(itemgetter(0), entries)), np.int16, n),
        "size": np.fromiter(map(itemgetter(2), entries), np.int64, n),
        "addr": _int_array(list(map(itemgetter(1), entries))),
        "stream": _int_array(list(map(itemgetter(3), entries))),
        "top": tops,
    }
    if extras:
        cols["cell"] = list(map(itemgetter(7), entries))
        cols["nvtx_range"] = list(map(itemgetter(6), entries))
    oom = np.flatnonzero(cols["code"] == _OOM)  # addr holds device_free there
    cols["oom"] = (oom, cols["addr"][oom].tolist())
    cols["addr"][oom] = 0
    return cols


def _live_raw() -> dict[int, list] | None:
    """Each device's raw history tuples straight from cudalab's recorder, or None when
    that recorder is not there (or stores another layout): then a snapshot is taken."""
    try:
        from cudalab.memory_tools import history as h
    except ImportError:
        return None
    if getattr(h, "FIELDS", None) != ("action", "addr", "size", "stream", "time_ns", "frames",
                                      "nvtx_range", "cell"):
        return None
    return {d: h.raw_entries(d) for d in h.devices_with_history()}


class _Trace:
    """The trace entries of a snapshot as columns (numpy arrays and lists), devices in
    ``device_traces`` order, each device's entries in recorded order.

    ``raw`` (device -> cudalab's raw history tuples) replaces ``snap``'s ``device_traces``.
    """

    __slots__ = ("n", "device", "time_us", "code", "addr", "size", "stream", "device_free",
                 "top", "cell", "nvtx_range", "allocated", "reserved", "names", "bounds")

    def __init__(self, snap: dict | None, device: int | None = None, extras: bool = True,
                 raw: dict[int, list] | None = None):
        if raw is not None:
            sources = sorted(raw.items())
        else:
            sources = list(enumerate((snap or {}).get("device_traces") or []))
        codes = _Codes(ACTIONS)
        cache: dict = {}
        parts: dict[str, list] = defaultdict(list)
        self.bounds: list[tuple[int, int, int]] = []  # (device, start, stop)
        start = 0
        for d, entries in sources:
            if not entries or (device is not None and d != device):
                continue
            n = len(entries)
            cols = (_raw_columns(entries, codes, extras, cache) if raw is not None
                    else _dict_columns(entries, codes, extras))
            for k, v in cols.items():
                parts[k].append(v)
            parts["device"].append(np.full(n, d, dtype=np.int64))
            self.bounds.append((d, start, start + n))
            start += n
        self.n = start
        self.names = codes.names

        def arr(key, dtype):
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
        d_alloc = np.where(code == _ALLOC, size, 0) - np.where(code == _FREE_DONE, size, 0)
        up = (code == _SEG_ALLOC) | (code == _SEG_MAP)
        down = (code == _SEG_FREE) | (code == _SEG_UNMAP)
        d_res = np.where(up, size, 0) - np.where(down, size, 0)
        self.allocated = np.empty(self.n, np.int64)
        self.reserved = np.empty(self.n, np.int64)
        for _, a, b in self.bounds:
            np.cumsum(d_alloc[a:b], out=self.allocated[a:b])
            np.cumsum(d_res[a:b], out=self.reserved[a:b])


def _trace_of(snap: Any, device: int | None = None, extras: bool = True) -> _Trace:
    """The trace of ``snap``; for None, read cudalab's recorder directly (no snapshot dict,
    no ``snapshot`` entry appended), falling back to ``cudalab.memory._snapshot()``."""
    if snap is None:
        raw = _live_raw()
        if raw is not None:
            return _Trace(None, device, extras, raw=raw)
    return _Trace(_resolve(snap), device, extras)


def _categorical(pd, values, known: tuple[str, ...]):
    """A Categorical with ``known`` categories first, then any unknown values seen."""
    extra = sorted({v for v in values if v not in known and v is not None})
    return pd.Categorical(values, categories=list(known) + extra)


def _top_columns(pd, tops: list) -> dict:
    """filename/line/name of each top frame (None/<NA> where an entry has no frames)."""
    no = _NO_LINE
    line = np.fromiter([t["line"] if t is not None else no for t in tops], np.int64, len(tops))
    return {
        "filename": pd.Series([t["filename"] if t is not None else None for t in tops],
                              dtype=object),
        "line": pd.arrays.IntegerArray(line, line == no),
        "name": pd.Series([t["name"] if t is not None else None for t in tops], dtype=object),
    }


_NO_LINE = -(1 << 63)


# --------------------------------------------------------------------------- history
def history_frame(snap: Any = None, device: Any = None):
    """One row per trace entry of ``snap`` (default: cudalab's recorded history, see
    :func:`cudalab.memory.record_history`).

    Columns (dtypes):

    * ``time`` (datetime64[us]): ``time_us`` as a timestamp (torch records µs since the epoch);
    * ``time_us`` (int64), ``device`` (int64), ``stream`` (int64: the stream handle, 0 = the
      legacy default stream);
    * ``action`` (category: :data:`ACTIONS` first, then any unknown action names);
    * ``addr`` (int64; 0 for ``oom`` and ``snapshot`` entries), ``size`` (int64: the bytes the
      entry reports - the requested size for ``alloc``/``free_*``, the segment size for
      ``segment_*``, the failed request for ``oom``);
    * ``device_free`` (int64): for ``oom`` entries the bytes the driver reported free, -1 on
      every other row;
    * ``filename``, ``line`` (Int64, nullable), ``name``: the entry's top (innermost) frame,
      None/<NA> when it has no frames;
    * ``cell``, ``nvtx_range`` (object): cudalab's notebook cell id and innermost NVTX range,
      None when unknown (always None in torch's snapshots);
    * ``allocated`` (int64): per device, the running sum of ``alloc`` sizes minus
      ``free_completed`` sizes, i.e. requested bytes live after the entry;
    * ``reserved`` (int64): per device, the running sum of ``segment_alloc``/``segment_map`` sizes
      minus ``segment_free``/``segment_unmap`` sizes, i.e. bytes held from the driver.

    The totals count from 0 at the first recorded entry: when the ring buffer wrapped
    (``max_entries``) or history started after memory was in use, they are relative to that
    starting point and can dip below 0. Rows come in time order (stable: within one device,
    the recorded order); ``device`` (None, an int or ``"cuda:N"``) keeps one device's rows.
    """
    import pandas as pd

    t = _trace_of(snap, None if device is None else _device_index(device))
    order = None
    if len(t.bounds) > 1:  # interleave devices by time
        order = np.argsort(t.time_us, kind="stable")

    def o(a):
        if order is None:
            return a
        if isinstance(a, list):
            arr = np.empty(len(a), dtype=object)  # (np.array would unpack nested lists)
            arr[:] = a
            return arr[order].tolist()
        return a[order]

    time_us = o(t.time_us)
    action = pd.Categorical.from_codes(o(t.code).astype(np.int16), categories=t.names)
    cols = {
        "time": pd.Series(time_us.astype("datetime64[us]")),
        "time_us": time_us,
        "device": o(t.device),
        "stream": o(t.stream),
        "action": action,
        "addr": o(t.addr),
        "size": o(t.size),
        "device_free": o(t.device_free),
        **_top_columns(pd, o(t.top)),
        "cell": pd.Series(o(t.cell), dtype=object),
        "nvtx_range": pd.Series(o(t.nvtx_range), dtype=object),
        "allocated": o(t.allocated),
        "reserved": o(t.reserved),
    }
    return pd.DataFrame(cols, columns=list(_HISTORY_COLUMNS))


def read_history_csv(path: Any):
    """Read a ``history_frame().to_csv(path, index=False)`` file back with the same dtypes."""
    import pandas as pd

    df = pd.read_csv(path, dtype={"filename": object, "name": object, "cell": object,
                                  "nvtx_range": object})
    for col in ("time_us", "device", "stream", "addr", "size", "device_free", "allocated",
                "reserved"):
        if col in df:
            df[col] = df[col].astype(np.int64)
    if "time_us" in df:
        df["time"] = pd.Series(df["time_us"].to_numpy().astype("datetime64[us]"), index=df.index)
    if "action" in df:
        df["action"] = _categorical(pd, df["action"].astype(object).tolist(), ACTIONS)
    if "line" in df:
        df["line"] = df["line"].astype("Int64")
    for col in ("filename", "name", "cell", "nvtx_range"):
        if col in df:
            df[col] = df[col].astype(object).where(df[col].notna(), None)
    return df


# --------------------------------------------------------------------------- snapshot frames
_BLOCK_COLUMNS = (
    "device", "segment_address", "segment_total_size", "segment_type", "segment_stream",
    "is_expandable", "address", "size", "requested_size", "state", "filename", "line", "name",
)
_SEGMENT_COLUMNS = (
    "device", "address", "total_size", "allocated_size", "active_size", "requested_size",
    "stream", "segment_type", "is_expandable", "n_blocks", "free_size", "largest_free_block",
    "fragmentation",
)


def snapshot_frame(snap: Any = None):
    """One row per block of ``snap``'s segments, with the segment's columns.

    Columns: ``device`` (int64), ``segment_address``, ``segment_total_size`` (int64),
    ``segment_type`` (category small/large), ``segment_stream`` (int64), ``is_expandable``
    (bool), the block's ``address``, ``size``, ``requested_size`` (int64), ``state`` (category:
    :data:`BLOCK_STATES`) and its top frame ``filename``, ``line`` (Int64), ``name`` (None/<NA>
    without frames). Rows in snapshot order (torch: by segment address).
    """
    import pandas as pd

    s = _resolve_segments(snap)
    rows: dict[str, list] = {k: [] for k in _BLOCK_COLUMNS if k not in ("filename", "line", "name")}
    tops: list = []
    for seg in s.get("segments") or []:
        blocks = seg.get("blocks") or []
        n = len(blocks)
        rows["device"] += [seg.get("device", 0)] * n
        rows["segment_address"] += [seg["address"]] * n
        rows["segment_total_size"] += [seg["total_size"]] * n
        rows["segment_type"] += [seg.get("segment_type", "large")] * n
        rows["segment_stream"] += [seg.get("stream", 0)] * n
        rows["is_expandable"] += [bool(seg.get("is_expandable", False))] * n
        for b in blocks:
            rows["address"].append(b["address"])
            rows["size"].append(b["size"])
            rows["requested_size"].append(b.get("requested_size", 0))
            rows["state"].append(b["state"])
            f = b.get("frames")
            tops.append(f[0] if f else None)
    cols = {
        "device": np.array(rows["device"], dtype=np.int64),
        "segment_address": _int_array(rows["segment_address"]),
        "segment_total_size": np.array(rows["segment_total_size"], dtype=np.int64),
        "segment_type": _categorical(pd, rows["segment_type"], SEGMENT_TYPES),
        "segment_stream": _int_array(rows["segment_stream"]),
        "is_expandable": np.array(rows["is_expandable"], dtype=bool),
        "address": _int_array(rows["address"]),
        "size": np.array(rows["size"], dtype=np.int64),
        "requested_size": np.array(rows["requested_size"], dtype=np.int64),
        "state": _categorical(pd, rows["state"], BLOCK_STATES),
        **_top_columns(pd, tops),
    }
    return pd.DataFrame(cols, columns=list(_BLOCK_COLUMNS))


def segments_frame(snap: Any = None):
    """One row per segment of ``snap``.

    Columns: ``device`` (int64), ``address``, ``total_size``, ``allocated_size``,
    ``active_size``, ``requested_size`` (int64, as in the snapshot), ``stream`` (int64),
    ``segment_type`` (category small/large), ``is_expandable`` (bool), ``n_blocks`` (int64),
    ``free_size`` (bytes in ``inactive`` blocks), ``largest_free_block`` (the biggest inactive
    block, 0 if none) and ``fragmentation`` (float64: ``1 - largest_free_block / free_size``,
    0.0 when nothing is free: 0 = the free bytes are one block, near 1 = scattered crumbs).
    """
    import pandas as pd

    s = _resolve_segments(snap)
    rows: dict[str, list] = {k: [] for k in _SEGMENT_COLUMNS}
    for seg in s.get("segments") or []:
        blocks = seg.get("blocks") or []
        free = [b["size"] for b in blocks if b["state"] == "inactive"]
        rows["device"].append(seg.get("device", 0))
        for k in ("address", "total_size", "allocated_size", "active_size", "requested_size"):
            rows[k].append(seg.get(k, 0))
        rows["stream"].append(seg.get("stream", 0))
        rows["segment_type"].append(seg.get("segment_type", "large"))
        rows["is_expandable"].append(bool(seg.get("is_expandable", False)))
        rows["n_blocks"].append(len(blocks))
        total_free = sum(free)
        largest = max(free, default=0)
        rows["free_size"].append(total_free)
        rows["largest_free_block"].append(largest)
        rows["fragmentation"].append(1.0 - largest / total_free if total_free > 0 else 0.0)
    cols: dict[str, Any] = {}
    for k, v in rows.items():
        if k in ("address", "stream"):
            cols[k] = _int_array(v)
        elif k == "segment_type":
            cols[k] = _categorical(pd, v, SEGMENT_TYPES)
        elif k == "is_expandable":
            cols[k] = np.array(v, dtype=bool)
        elif k == "fragmentation":
            cols[k] = np.array(v, dtype=np.float64)
        else:
            cols[k] = np.array(v, dtype=np.int64)
    return pd.DataFrame(cols, columns=list(_SEGMENT_COLUMNS))


def stats_frame(devices: Any = None):
    """One row per device (index ``device``), columns exactly torch's 122 ``memory_stats()``
    keys (sorted, int64), read with ``cudalab.memory.memory_stats(d)``.

    ``devices``: None (every device), one device, or an iterable of them. A device cudalab has
    not initialised reads as all zeros (torch's ``memory_stats()`` returns ``{}`` there).
    """
    import pandas as pd

    import cudalab
    import cudalab.memory as cm
    from cudalab.allocator.stats import STAT_KEYS

    if devices is None:
        idx = list(range(cudalab.device_count()))
    elif isinstance(devices, (int, str)) or isinstance(getattr(devices, "index", None), int):
        idx = [_device_index(devices)]
    else:
        idx = [_device_index(d) for d in devices]
    data = np.zeros((len(idx), len(STAT_KEYS)), dtype=np.int64)
    for r, d in enumerate(idx):
        st = cm.memory_stats(d)
        if st:
            data[r] = [st.get(k, 0) for k in STAT_KEYS]
    return pd.DataFrame(data, columns=list(STAT_KEYS),
                        index=pd.Index(idx, dtype=np.int64, name="device"))


# --------------------------------------------------------------------------- Perfetto
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def _human(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``; below 1 KiB, whole bytes."""
    if n < 1024:
        return f"{n} B"
    e = min((n.bit_length() - 1) // 10, 6)
    v = n / (1 << (10 * e))
    if v >= 1023.95 and e < 6:  # would print as "1024.0 KiB"
        e += 1
        v /= 1024
    return f"{v:.1f} {_UNITS[e]}" if v < 100 else f"{v:.0f} {_UNITS[e]}"


def _stream_label(s: int) -> str:
    return "stream 0 (legacy default)" if s == 0 else f"stream 0x{s:x}"


def _assign_lanes(starts: list[int], ends: list[int]) -> list[int]:
    """Greedy interval colouring of intervals sorted by start: the lowest lane whose last
    slice has ended (end <= start), so slices in one lane are disjoint."""
    lanes = [0] * len(starts)
    busy: list[tuple[int, int]] = []  # (end, lane) of lanes in use
    free: list[int] = []  # lanes whose last slice has ended
    n_lanes = 0
    for k, (s0, e0) in enumerate(zip(starts, ends)):
        while busy and busy[0][0] <= s0:
            heappush(free, heappop(busy)[1])
        if free:
            lane = heappop(free)
        else:
            lane = n_lanes
            n_lanes += 1
        heappush(busy, (e0, lane))
        lanes[k] = lane
    return lanes


def export_perfetto(path: Any, snap: Any = None) -> str:
    """Write ``snap``'s history as Chrome/Perfetto trace JSON (open it in ui.perfetto.dev).

    ``{"displayTimeUnit": "ms", "traceEvents": [...]}`` with, per device that has entries:

    * a process (pid = device + 1: Perfetto reserves pid 0) named ``cuda:N``, plus
      ``" (simulated)"`` when ``snap["cudalab"]["simulated"]`` is true (or, for ``snap=None``
      without that key, when cudalab runs on the simulator);
    * ``C`` counters ``memory allocated`` / ``memory reserved`` (bytes, the running totals of
      :func:`history_frame`), one point per timestamp where a total changes;
    * per stream, one thread track per *lane* holding ``X`` slices for block lifetimes (alloc
      to ``free_completed``; blocks never freed run to the last timestamp; a
      ``free_completed`` whose alloc predates the trace starts at 0 with ``preexisting``).
      Blocks alive at the same time get different lanes, so slices on one track never
      overlap. Slice names are human-readable sizes; args hold addr, size, stream, top frame;
    * ``i`` instants (process scope) for ``oom`` (``OOM``) and ``snapshot`` entries.

    Timestamps are µs since the first entry. Thread ids are unique across the file (Perfetto
    keys threads by tid). A path ending in ``.gz`` is gzip-compressed (Perfetto opens it).
    Events are written incrementally, so memory stays proportional to the history, not to
    the JSON text. Returns the path as a string.
    """
    raw = _live_raw() if snap is None else None
    if raw is not None:  # cudalab's own recorder, read directly
        t = _Trace(None, extras=False, raw=raw)
        simulated = _live_simulated()
    else:
        s = _resolve(snap)
        simulated = (s.get("cudalab") or {}).get("simulated")
        if simulated is None:  # torch's schema has no such flag: a live snapshot asks the backend
            simulated = snap is None and _live_simulated()
        t = _Trace(s, extras=False)
    n_dev = max((d for d, _, _ in t.bounds), default=-1) + 1
    p = os.fspath(path)
    fh = open(p, "wb")  # noqa: SIM115 - closed below
    try:
        f = (gzip.GzipFile(fileobj=fh, mode="wb", compresslevel=3) if p.endswith(".gz")
             else fh)
        out = io.TextIOWrapper(f, encoding="utf-8", newline="\n", write_through=False)
        _write_perfetto(out, t, simulated, n_dev)
        out.flush()
        out.detach()
        if f is not fh:
            f.close()
    finally:
        fh.close()
    return p


def _block_lifetimes(t: _Trace, a: int, b: int, t0: int, t_end: int):
    """Match each ``alloc`` of device rows [a, b) to the next ``free_completed`` of its
    address. Returns numpy arrays (start_us, end_us, entry index, preexisting) where the entry
    is the alloc (or, for a free whose alloc predates the trace, the free itself)."""
    code = t.code[a:b]
    sel = np.flatnonzero((code == _ALLOC) | (code == _FREE_DONE))
    empty = np.zeros(0, np.int64)
    if sel.size == 0:
        return empty, empty, empty, np.zeros(0, bool)
    addr = t.addr[a:b][sel]
    c = code[sel]
    order = np.lexsort((sel, addr))  # by address, then trace order
    sa, sc, si = addr[order], c[order], sel[order]
    same = np.zeros(sa.size, bool)
    same[:-1] = sa[1:] == sa[:-1]
    is_alloc = sc == _ALLOC
    paired = np.zeros(sa.size, bool)  # an alloc whose next row (same address) frees it
    paired[:-1] = is_alloc[:-1] & same[:-1] & (sc[1:] == _FREE_DONE)
    freed_by = np.zeros(sa.size, bool)  # a free_completed paired with the alloc before it
    freed_by[1:] = paired[:-1]
    rel = t.time_us[a:b] - t0
    # paired allocs: alloc -> free; unpaired allocs: alloc -> end; unpaired frees: 0 -> free
    k_pair = np.flatnonzero(paired)
    k_live = np.flatnonzero(is_alloc & ~paired)
    k_pre = np.flatnonzero(~is_alloc & ~freed_by)
    start = np.concatenate([rel[si[k_pair]], rel[si[k_live]], np.zeros(k_pre.size, np.int64)])
    end = np.concatenate([rel[si[k_pair + 1]], np.full(k_live.size, t_end, np.int64),
                          rel[si[k_pre]]])
    idx = np.concatenate([si[k_pair], si[k_live], si[k_pre]]) + a
    pre = np.zeros(idx.size, bool)
    pre[k_pair.size + k_live.size:] = True
    end = np.maximum(end, start)  # clocks that step back never give dur < 0
    return start, end, idx, pre


def _write_perfetto(out, t: _Trace, simulated: bool, n_dev: int) -> None:
    dumps = json.dumps
    out.write('{"displayTimeUnit":"ms","otherData":{"source":"cudalab memory history"},'
              '"traceEvents":[\n')
    state = {"first": True}

    def write(events: list[str]) -> None:
        if events:
            if not state["first"]:
                out.write(",\n")
            out.write(",\n".join(events))
            state["first"] = False

    if t.n == 0:
        out.write("]}\n")
        return
    chunk = 65536
    t0 = int(t.time_us.min())
    t_end = int(t.time_us.max()) - t0
    tops = t.top
    by_id: dict[int, str] = {}
    by_key: dict[tuple, str] = {}

    def frame_str(top) -> str:
        if top is None:
            return '""'
        v = by_id.get(id(top))
        if v is None:
            key = (top.get("filename"), top.get("line"), top.get("name"))
            v = by_key.get(key)
            if v is None:
                v = by_key[key] = dumps(f"{key[0]}:{key[1]} {key[2]}")
            by_id[id(top)] = v
        return v

    names: dict[int, str] = {}

    def human(n: int) -> str:
        v = names.get(n)
        if v is None:
            v = names[n] = _human(n)
        return v

    pre_s = ',"preexisting":true'
    next_tid = n_dev + 1  # tids above every pid: Perfetto keys threads by tid alone
    for d, a, b in t.bounds:
        pid = d + 1
        pname = f"cuda:{d}" + (" (simulated)" if simulated else "")
        meta = [f'{{"ph":"M","name":"process_name","pid":{pid},"tid":{pid},"ts":0,'
                f'"args":{{"name":{dumps(pname)}}}}}',
                f'{{"ph":"M","name":"process_sort_index","pid":{pid},"tid":{pid},"ts":0,'
                f'"args":{{"sort_index":{d}}}}}']

        # block lifetimes: one track per (stream, lane)
        start, end, idx, pre = _block_lifetimes(t, a, b, t0, t_end)
        stream = t.stream[idx]
        order = np.lexsort((end, start, stream))
        start, end, idx, pre, stream = start[order], end[order], idx[order], pre[order], stream[order]
        tid = np.empty(idx.size, np.int64)
        cuts = np.flatnonzero(np.diff(stream)) + 1
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), idx.size]):
            if lo == hi:
                continue
            lanes = _assign_lanes(start[lo:hi].tolist(), end[lo:hi].tolist())
            n_lanes = max(lanes) + 1
            tid[lo:hi] = np.asarray(lanes, np.int64) + next_tid
            label = _stream_label(int(stream[lo]))
            for k in range(n_lanes):
                tname = label if k == 0 else f"{label} #{k + 1}"
                meta.append(f'{{"ph":"M","name":"thread_name","pid":{pid},"tid":{next_tid + k},'
                            f'"ts":0,"args":{{"name":{dumps(tname)}}}}}')
                meta.append(f'{{"ph":"M","name":"thread_sort_index","pid":{pid},'
                            f'"tid":{next_tid + k},"ts":0,"args":{{"sort_index":{next_tid + k}}}}}')
            next_tid += n_lanes
        write(meta)

        # counters: the last value at each timestamp where a total changes
        code_d = t.code[a:b]
        changes = np.flatnonzero((code_d == _ALLOC) | (code_d == _FREE_DONE)
                                 | (code_d == _SEG_ALLOC) | (code_d == _SEG_FREE)
                                 | (code_d == _SEG_MAP) | (code_d == _SEG_UNMAP)) + a
        if changes.size:
            ts_c = t.time_us[changes]
            last = np.ones(changes.size, dtype=bool)
            last[:-1] = ts_c[1:] != ts_c[:-1]
            keep = changes[last]
            for lo in range(0, keep.size, chunk):
                k = keep[lo:lo + chunk]
                write([f'{{"ph":"C","name":"memory","pid":{pid},"tid":{pid},"ts":{ts},'
                       f'"args":{{"allocated":{al},"reserved":{rs}}}}}'
                       for ts, al, rs in zip((t.time_us[k] - t0).tolist(), t.allocated[k].tolist(),
                                             t.reserved[k].tolist())])

        # X slices
        for lo in range(0, idx.size, chunk):
            sl = slice(lo, lo + chunk)
            ii = idx[sl].tolist()
            write([f'{{"ph":"X","name":"{human(sz)}","cat":"block","pid":{pid},"tid":{td},'
                   f'"ts":{s0},"dur":{e0 - s0},"args":{{"addr":"0x{ad:x}","size":{sz},'
                   f'"stream":{st},"frame":{frame_str(tops[i])}'
                   f'{pre_s if p else ""}}}}}'
                   for i, s0, e0, td, sz, ad, st, p in zip(
                       ii, start[sl].tolist(), end[sl].tolist(), tid[sl].tolist(),
                       t.size[idx[sl]].tolist(), t.addr[idx[sl]].tolist(), stream[sl].tolist(),
                       pre[sl].tolist())])

        # instants: OOMs and snapshots
        inst = []
        for i in np.flatnonzero((code_d == _OOM) | (code_d == _SNAP)).tolist():
            i += a
            ts = int(t.time_us[i]) - t0
            if t.code[i] == _OOM:
                inst.append(f'{{"ph":"i","s":"p","name":"OOM","cat":"oom","pid":{pid},"tid":{pid},'
                            f'"ts":{ts},"args":{{"size":{int(t.size[i])},'
                            f'"device_free":{int(t.device_free[i])},"stream":{int(t.stream[i])},'
                            f'"frame":{frame_str(tops[i])}}}}}')
            else:
                inst.append(f'{{"ph":"i","s":"p","name":"snapshot","cat":"snapshot","pid":{pid},'
                            f'"tid":{pid},"ts":{ts},"args":{{"size":{int(t.size[i])}}}}}')
        write(inst)
    out.write("\n]}\n")


# --------------------------------------------------------------------------- synthetic data
_SYN_FILES = ("train.py", "model.py", "layers.py", "optim.py", "data.py")
_SYN_FUNCS = ("forward", "backward", "step", "__call__", "matmul", "attention", "collate")


def _synthetic_snapshot(n_entries: int, *, devices: int = 1, streams: tuple[int, ...] = (0, 0x5A1E0),
                        seed: int = 0, cudalab_keys: bool = True, simulated: bool = True,
                        start_us: int = 1_700_000_000_000_000, oom_every: int = 50_000,
                        snapshot_every: int = 20_000) -> dict:
    """A self-consistent snapshot dict in torch's schema with about ``n_entries`` trace
    entries per device (for tests and benchmarks).

    A bump allocator per (stream, pool) carves 512-B-rounded blocks out of 2 MiB small and
    >= 20 MiB large segments; frees are random; an emptied segment is sometimes released;
    ``oom`` and ``snapshot`` entries appear every so often. The final ``segments`` list holds
    the live blocks and the gaps between them. ``cudalab_keys=False`` leaves out the keys
    torch lacks (``device``, ``nvtx_range``, ``cell``, ``"cudalab"``).
    """
    rng = random.Random(seed)
    rnd = rng.random
    stacks = []
    for k in range(40):
        depth = 1 + k % 4
        stacks.append([{"filename": f"/home/user/proj/{_SYN_FILES[(k + j) % 5]}",
                        "line": 10 + 7 * k + j, "name": _SYN_FUNCS[(k * 3 + j) % 7]}
                       for j in range(depth)])
    stacks.append([])  # some entries without frames
    n_stacks = len(stacks)
    ranges = (None, "forward", "backward", "optimizer")
    cells = (None, "cell-1", "cell-2")
    n_streams = len(streams)
    out_traces: list[list[dict]] = []
    out_segments: list[dict] = []
    for d in range(devices):
        trace: list[dict] = []
        add = trace.append
        now = start_us + d * 3
        next_addr = 0x7F0000000000 + (d << 36)
        segs: dict[int, dict] = {}  # address -> segment
        open_seg: dict[tuple[int, bool], dict] = {}
        cached: dict[tuple[int, bool], list] = {}  # emptied segments kept for reuse
        live_addrs: list[int] = []
        live: dict[int, tuple] = {}  # addr -> (requested, size, stream, frames, segment)
        target = 200 + int(rnd() * 800)
        p_snap = 1.0 / snapshot_every if snapshot_every else -1.0
        p_oom = 1.0 / oom_every if oom_every else -1.0

        def entry(action, addr, size, stream, frames):
            if cudalab_keys:
                u = rnd()
                e = {"action": action, "addr": addr, "size": size, "stream": stream,
                     "time_us": now, "frames": frames, "compile_context": "",  # noqa: B023
                     "user_metadata": "", "device": d, "nvtx_range": ranges[int(u * 4)],  # noqa: B023
                     "cell": cells[int(u * 12) % 3]}
            else:
                e = {"action": action, "addr": addr, "size": size, "stream": stream,
                     "time_us": now, "frames": frames, "compile_context": "",  # noqa: B023
                     "user_metadata": ""}
            add(e)  # noqa: B023
            return e

        while len(trace) < n_entries:
            now += 1 + int(rnd() * 20)
            frames = stacks[int(rnd() * n_stacks)]
            r = rnd()
            if r < p_snap:
                entry("snapshot", 0, 0, 0, [])
                continue
            if r > 1.0 - p_oom:
                e = entry("oom", 0, 1 << (30 + int(rnd() * 4)), streams[int(rnd() * n_streams)],
                          frames)
                e["device_free"] = e.pop("addr") + int(rnd() * (1 << 30))
                continue
            if live_addrs and (len(live_addrs) > target or r < 0.45):
                k = int(rnd() * len(live_addrs))
                addr = live_addrs[k]
                live_addrs[k] = live_addrs[-1]
                live_addrs.pop()
                req, size, st, fr, seg = live.pop(addr)
                entry("free_requested", addr, req, st, fr)
                entry("free_completed", addr, req, st, fr)
                seg["live"] -= 1
                if seg["live"] == 0:  # the blocks merge back into one free block
                    seg["used"] = 0
                    if open_seg.get(seg["key"]) is not seg:
                        if rnd() < 0.3:
                            entry("segment_free", seg["address"], seg["total_size"], seg["stream"],
                                  [])
                            del segs[seg["address"]]
                        else:  # cached: reused by a later allocation
                            cached.setdefault(seg["key"], []).append(seg)
                if rnd() < 0.0002:
                    target = 200 + int(rnd() * 800)
                continue
            small = rnd() < 0.7  # log-uniform sizes: 512 B..1 MiB small, 1..64 MiB large
            req = int(2.0 ** (9 + 11 * rnd())) if small else int(2.0 ** (20 + 6 * rnd()))
            size = (req + 511) // 512 * 512
            st = streams[int(rnd() * n_streams)]
            key = (st, small)
            seg = open_seg.get(key)
            if seg is None or seg["used"] + size > seg["total_size"] or seg["address"] not in segs:
                pool = cached.get(key)
                while pool:
                    seg = pool.pop()
                    if seg["address"] in segs and seg["live"] == 0 and seg["total_size"] >= size:
                        open_seg[key] = seg
                        break
                    seg = None
                else:
                    seg = None
            if seg is None:
                total = (2 << 20) if small else max(20 << 20, -(-size // (2 << 20)) * (2 << 20))
                seg = {"address": next_addr, "total_size": total, "used": 0, "live": 0,
                       "stream": st, "key": key}
                next_addr += total + (2 << 20)
                segs[seg["address"]] = seg
                open_seg[key] = seg
                entry("segment_alloc", seg["address"], total, st, frames)
            addr = seg["address"] + seg["used"]
            seg["used"] += size
            seg["live"] += 1
            live[addr] = (req, size, st, frames, seg)
            live_addrs.append(addr)
            entry("alloc", addr, req, st, frames)
        out_traces.append(trace)
        # final segment state: live blocks plus the gaps between them
        by_seg: dict[int, list] = {}
        for addr, (req, size, _st, fr, seg) in live.items():
            by_seg.setdefault(seg["address"], []).append((addr, size, req, fr))
        for base in sorted(segs):
            seg = segs[base]
            blocks = []
            cur = base
            alloc_sz = req_sz = 0
            for addr, size, req, fr in sorted(by_seg.get(base, []), key=itemgetter(0)):
                if addr > cur:
                    blocks.append({"address": cur, "size": addr - cur, "requested_size": 0,
                                   "state": "inactive", "frames": []})
                blocks.append({"address": addr, "size": size, "requested_size": req,
                               "state": "active_allocated", "frames": fr})
                alloc_sz += size
                req_sz += req
                cur = addr + size
            end = base + seg["total_size"]
            if cur < end:
                blocks.append({"address": cur, "size": end - cur, "requested_size": 0,
                               "state": "inactive", "frames": []})
            out_segments.append({
                "device": d, "address": base, "total_size": seg["total_size"],
                "allocated_size": alloc_sz, "active_size": alloc_sz, "requested_size": req_sz,
                "stream": seg["stream"], "segment_type": "small" if seg["key"][1] else "large",
                "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
                "blocks": blocks,
            })
    snap = {"segments": out_segments, "device_traces": out_traces,
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": None, "max_split_size": -1,
                                   "garbage_collection_threshold": 0.0,
                                   "expandable_segments": False, "pinned_num_register_threads": 1,
                                   "release_lock_on_cudamalloc": False,
                                   "pinned_use_host_register": False,
                                   "roundup_power2_divisions": {}},
            "external_annotations": []}
    if cudalab_keys:
        snap["cudalab"] = {"simulated": simulated}
    return snap
