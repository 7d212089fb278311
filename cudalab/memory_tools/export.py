"""Tidy exports of allocator snapshots: pandas DataFrames.

Every function reads a snapshot dict in torch's schema (what ``cudalab.memory._snapshot()``
and ``torch.cuda.memory._snapshot()`` return), a snapshot pickle path, a segment list, or
None for the live process (see :mod:`cudalab.memory_tools.trace_columns`, which reads them):

* :func:`history_frame` - one row per trace entry, with running ``allocated``/``reserved`` totals;
* :func:`snapshot_frame` - one row per block, with its segment's columns;
* :func:`segments_frame` - one row per segment, with free-space fragmentation;
* :func:`stats_frame` - one row per device, torch's 122 ``memory_stats()`` keys as columns.

The trace for ui.perfetto.dev is :func:`cudalab.memory_tools.perfetto.export_perfetto`, the
pickle for pytorch.org/memory_viz ``cudalab.memory.export_memory_viz``. The frames save with
:func:`save_frame` (parquet, which needs pyarrow, or CSV; atomically, and a value that does
not belong in a column is named, not written as its ``str()``);
:func:`cudalab.memory_tools.trace_io.read_history_csv` reads a saved history back with its
dtypes. pandas is imported only inside the functions that build frames, so importing this
module costs nothing.

Every frame says where its data came from: ``df.attrs["identity"]`` is the snapshot's
``identity`` dict (:meth:`cudalab.identity.Identity.to_dict`; this process's for the live
process, None for a snapshot without one, as torch's). pandas keeps ``attrs`` through
copies and selections, and writes them into a parquet file's metadata (``PANDAS_ATTRS``),
so :func:`save_frame`'s parquet files carry it and ``pandas.read_parquet`` restores it; a
CSV has no place for it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from cudalab._atomic_write import atomic_write
from cudalab.memory_tools.history import ACTIONS
from cudalab.memory_tools.stacks import FrameDict
from cudalab.memory_tools.trace_columns import (
    device_index,
    int_array,
    live_identity,
    resolve_segments,
    trace_of,
)
from cudalab.memory_tools.trace_io import categorical

if TYPE_CHECKING:
    from types import ModuleType

    import pandas

__all__ = [
    "ACTIONS",
    "BLOCK_STATES",
    "SEGMENT_TYPES",
    "history_frame",
    "save_frame",
    "segments_frame",
    "snapshot_frame",
    "stats_frame",
]

#: torch's block states, in the order of ``snapshot_frame()["state"]``'s categories.
BLOCK_STATES: tuple[str, ...] = ("active_allocated", "active_pending_free", "inactive")
#: The pools of ``segment_type``, in the order of its categories.
SEGMENT_TYPES: tuple[str, ...] = ("small", "large")

_HISTORY_COLUMNS = (
    "time", "time_us", "device", "stream", "action", "addr", "size", "device_free",
    "filename", "line", "name", "cell", "nvtx_range", "allocated", "reserved",
)


def _top_columns(pd: ModuleType, tops: list[FrameDict | None]) -> dict[str, Any]:
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
def history_frame(snap: Any = None, device: Any = None, *, source: Any = None
                  ) -> pandas.DataFrame:
    """One row per trace entry of ``snap`` (default: cudalab's recorded history, see
    :func:`cudalab.memory.record_history`), or of the trace of the allocator ``source``
    names: ``"torch"`` (the trace ``torch.cuda.memory._record_memory_history`` records, from
    ``torch.cuda.memory._snapshot()``), ``"cudalab"``, ``"auto"`` (torch's when the
    process runs torch and cudalab's allocator holds nothing, else cudalab's) or a
    :class:`~cudalab.memory_tools.samples.SampleSource`; give ``snap`` or ``source``, not
    both. A source that cannot be read raises
    :class:`~cudalab.memory_tools.libraries.SourceUnavailableError` saying why.

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

    if source is not None:
        if snap is not None:
            raise ValueError("history_frame: give a snapshot or a source, not both")
        from cudalab.memory_tools.libraries import source_snapshot

        snap = source_snapshot(source)
    t = trace_of(snap, None if device is None else device_index(device))
    order = None
    if len(t.bounds) > 1:  # interleave devices by time
        order = np.argsort(t.time_us, kind="stable")

    def o(a: list[Any] | NDArray[Any]) -> Any:
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
    return _with_identity(pd.DataFrame(cols, columns=list(_HISTORY_COLUMNS)), t.identity)


def _with_identity(df: Any, identity: dict[str, Any] | None) -> Any:
    """``df`` with ``attrs["identity"]``: where its rows came from (a copy of the dict)."""
    df.attrs["identity"] = None if identity is None else dict(identity)
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


def snapshot_frame(snap: Any = None) -> pandas.DataFrame:
    """One row per block of ``snap``'s segments, with the segment's columns.

    Columns: ``device`` (int64), ``segment_address``, ``segment_total_size`` (int64),
    ``segment_type`` (category small/large), ``segment_stream`` (int64), ``is_expandable``
    (bool), the block's ``address``, ``size``, ``requested_size`` (int64), ``state`` (category:
    :data:`BLOCK_STATES`) and its top frame ``filename``, ``line`` (Int64), ``name`` (None/<NA>
    without frames). Rows in snapshot order (torch: by segment address).
    """
    import pandas as pd

    s = resolve_segments(snap)
    rows: dict[str, list[Any]] = {k: [] for k in _BLOCK_COLUMNS
                                  if k not in ("filename", "line", "name")}
    tops: list[FrameDict | None] = []
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
        "segment_address": int_array(rows["segment_address"]),
        "segment_total_size": np.array(rows["segment_total_size"], dtype=np.int64),
        "segment_type": categorical(pd, rows["segment_type"], SEGMENT_TYPES),
        "segment_stream": int_array(rows["segment_stream"]),
        "is_expandable": np.array(rows["is_expandable"], dtype=bool),
        "address": int_array(rows["address"]),
        "size": np.array(rows["size"], dtype=np.int64),
        "requested_size": np.array(rows["requested_size"], dtype=np.int64),
        "state": categorical(pd, rows["state"], BLOCK_STATES),
        **_top_columns(pd, tops),
    }
    return _with_identity(pd.DataFrame(cols, columns=list(_BLOCK_COLUMNS)), s.get("identity"))


def segments_frame(snap: Any = None) -> pandas.DataFrame:
    """One row per segment of ``snap``.

    Columns: ``device`` (int64), ``address``, ``total_size``, ``allocated_size``,
    ``active_size``, ``requested_size`` (int64, as in the snapshot), ``stream`` (int64),
    ``segment_type`` (category small/large), ``is_expandable`` (bool), ``n_blocks`` (int64),
    ``free_size`` (bytes in ``inactive`` blocks), ``largest_free_block`` (the biggest inactive
    block, 0 if none) and ``fragmentation`` (float64: ``1 - largest_free_block / free_size``,
    0.0 when nothing is free: 0 = the free bytes are one block, near 1 = scattered crumbs).
    """
    import pandas as pd

    s = resolve_segments(snap)
    rows: dict[str, list[Any]] = {k: [] for k in _SEGMENT_COLUMNS}
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
            cols[k] = int_array(v)
        elif k == "segment_type":
            cols[k] = categorical(pd, v, SEGMENT_TYPES)
        elif k == "is_expandable":
            cols[k] = np.array(v, dtype=bool)
        elif k == "fragmentation":
            cols[k] = np.array(v, dtype=np.float64)
        else:
            cols[k] = np.array(v, dtype=np.int64)
    return _with_identity(pd.DataFrame(cols, columns=list(_SEGMENT_COLUMNS)), s.get("identity"))


def stats_frame(devices: Any = None) -> pandas.DataFrame:
    """One row per device (index ``device``), columns exactly torch's 122 ``memory_stats()``
    keys (sorted, int64), read with ``cudalab.memory.memory_stats(d)``.

    ``devices``: None (every device), one device, or an iterable of them. A device cudalab has
    not initialised reads as all zeros (torch's ``memory_stats()`` returns ``{}`` there).
    """
    import pandas as pd

    import cudalab
    from cudalab.allocator.stats import STAT_KEYS

    if devices is None:
        idx = list(range(cudalab.device_count()))
    elif isinstance(devices, (int, str)) or isinstance(getattr(devices, "index", None), int):
        idx = [device_index(devices)]
    else:
        idx = [device_index(d) for d in devices]
    data = np.zeros((len(idx), len(STAT_KEYS)), dtype=np.int64)
    for r, d in enumerate(idx):
        st = cudalab.memory_stats(d)
        if st:
            data[r] = [st.get(k, 0) for k in STAT_KEYS]
    df = pd.DataFrame(data, columns=list(STAT_KEYS),
                      index=pd.Index(idx, dtype=np.int64, name="device"))
    return _with_identity(df, live_identity())


# --------------------------------------------------------------------------- saving
#: The types a text column of the frames may hold (None/NaN are missing values).
_CELL_TYPES = (str, int, float, bool, type(None))
FRAME_FORMATS = ("parquet", "csv")


def _check_cells(df: Any, path: str) -> None:
    """TypeError naming the column, row and type of the first value of an object column
    that is not text, a number or missing (a ``bytes``, ``set``, ``dict``... from user data)."""
    for col in df.columns:
        values = df[col]
        if values.dtype != object:
            continue
        if all(issubclass(t, _CELL_TYPES) for t in set(map(type, values))):
            continue
        for row, v in zip(df.index, values):
            if not isinstance(v, _CELL_TYPES):
                raise TypeError(
                    f"cannot write {path}: column {col!r}, row {row!r} holds a "
                    f"{type(v).__module__}.{type(v).__qualname__} ({v!r:.60}); a frame saves "
                    "only text, numbers and missing values (None)")


def save_frame(df: Any, path: str | os.PathLike[str], format: str | None = None) -> str:
    """Write one of this module's frames to ``path`` atomically: parquet or CSV.

    The file replaces ``path`` only once it is complete, so a failure (an unserialisable
    value, a full disk, Ctrl-C) leaves a file that was there before intact.

    Parameters
    ----------
    df : pandas.DataFrame
        The frame (:func:`history_frame`, :func:`snapshot_frame`, ...).
    path : str or os.PathLike
        The file to write.
    format : {"parquet", "csv"}, optional
        Default: by ``path``'s extension (``.csv`` is CSV, anything else parquet). CSV is
        written without the index (:func:`cudalab.memory_tools.trace_io.read_history_csv`
        reads a history back with its dtypes).

    Returns
    -------
    str
        The path written.

    Raises
    ------
    TypeError
        A text column holds something else than text, numbers or None (the message names
        the column, the row and the type).
    ValueError
        ``format`` is not ``"parquet"`` or ``"csv"``.
    ImportError
        Parquet without a parquet engine for pandas (pyarrow); nothing is written.
    OSError
        The file cannot be written.
    """
    p = os.fspath(path)
    if format is None:
        format = "csv" if p.lower().endswith(".csv") else "parquet"
    if format not in FRAME_FORMATS:
        raise ValueError(f"save_frame: format must be 'parquet' or 'csv', got {format!r}")
    _check_cells(df, p)
    if format == "csv":
        with atomic_write(p, "w", newline="") as f:
            df.to_csv(f, index=False)
    else:
        with atomic_write(p, "wb") as f:
            df.to_parquet(f)
    return p
