"""Reading and writing traces and snapshots: files from strangers never run code.

* **Pickles.** The one restricted unpickler
  (:func:`cudalab.memory_tools.safe_pickle.unpickle`) builds only what pickle opcodes build
  by themselves: any reference to a class or function (GLOBAL, STACK_GLOBAL, INST, OBJ,
  EXT*, persistent ids) is refused, so loading a file from a stranger cannot execute code.
  Its input is bounded: files larger than ``CUDALAB_MAX_SNAPSHOT_BYTES`` (default 4 GiB)
  and pickles nested too deeply are refused rather than exhausting memory or the C stack.
  Snapshots are then checked against torch's schema
  (:func:`cudalab.memory_tools.snapshot_check.check_snapshot`). It reads snapshots (:func:`load_snapshot`, cudalab's and torch's ``_dump_snapshot``
  files, raising :class:`SnapshotLoadError`) and plain-data trace pickles (the allocator
  benchmark's ``{"trace": [...]}`` dicts, raising :class:`TraceError`).
* **Writing snapshots.** :func:`to_plain` and :func:`dumps_snapshot`: a snapshot as plain
  Python types (dict, list, tuple, str, int, float, bool, None) pickled with protocol 4,
  which is what pytorch.org/memory_viz's own unpickler and ``torch.cuda._memory_viz`` read.
* **Traces for replay.** :func:`load_trace` reads any accepted trace form into
  :class:`TraceArrays` (parallel numpy arrays of the alloc/free entries) for
  :mod:`cudalab.memory_tools.replay`:

  - a snapshot dict (``cudalab.memory._snapshot()`` or ``torch.cuda.memory._snapshot()``):
    the entries of ``device_traces[device]``;
  - the path of a file, told apart by its content: a snapshot pickle (cudalab's
    ``_dump_snapshot`` or ``%cuda_memory history save X.pickle``, torch's), read with
    :func:`load_snapshot`, or a pickled dict ``{"trace": [(action, addr, size, stream), ...]}``
    (the allocator benchmark's format); a history CSV (``history save X.csv``, read with
    :func:`read_history_csv`); a snapshot dict or entry list saved as JSON. A Perfetto JSON
    (``history save X.json``) is refused with a message naming these: it keeps no event order;
  - a pandas DataFrame with columns ``action``, ``addr``, ``size``, ``stream`` (and
    optionally ``device``), as :func:`cudalab.memory.history_frame` returns;
  - a list of ``(action, addr, size, stream)`` tuples, or of trace entry dicts.
* **CSV.** :func:`read_history_csv` reads a saved ``history_frame()`` back with its dtypes.

pandas is imported only inside the functions that need it.
"""

from __future__ import annotations

import io
import numbers
import os
import pickle
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from cudalab.memory_tools.history import ACTIONS
from cudalab.memory_tools.safe_pickle import (
    SnapshotLoadError,
    check_pickle_start,
    container_levels,
    gunzip_bounded,
    max_snapshot_bytes,
    read_bounded,
    read_path_bounded,
    unpickle,
)
from cudalab.memory_tools.snapshot_check import (
    TRACE_KEYS_FOR_REPLAY,
    check_snapshot,
    check_trace_entries,
)

if TYPE_CHECKING:
    import pandas

__all__ = [
    "PICKLE_PROTOCOL",
    "SnapshotLoadError",
    "TraceArrays",
    "TraceError",
    "categorical",
    "dumps_snapshot",
    "load_snapshot",
    "load_trace",
    "read_history_csv",
    "to_plain",
]

#: memory_viz's unpickler reads protocols 2 to 4 (newer copies also 5).
PICKLE_PROTOCOL = 4


class TraceError(ValueError):
    """The trace cannot be read or has the wrong shape (a one-line message)."""


# --------------------------------------------------------------------------- plain types
class _NotPlain(TypeError):
    def __init__(self, value: Any):
        self.value = value
        self.path: list[str] = []
        super().__init__()

    def __str__(self) -> str:
        where = "".join(reversed(self.path)) or "the top level"
        return (f"snapshot value at {where} has type {type(self.value).__module__}."
                f"{type(self.value).__qualname__} ({self.value!r:.60}); a snapshot may hold "
                "only dict, list, tuple, str, int, float, bool and None")


def _scalar(x: Any) -> Any:
    """A plain scalar for ``x`` (numpy scalars, int/str subclasses) or raise _NotPlain."""
    if isinstance(x, bool):
        return bool(x)
    if type(x).__module__ == "numpy" and hasattr(x, "item"):  # numpy scalars
        v = x.item()
        if type(v) in (int, float, bool, str):
            return v
        raise _NotPlain(x)
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        return float(x)
    if isinstance(x, str):
        return str(x)
    raise _NotPlain(x)


_SCALARS = frozenset({str, int, float, bool, type(None)})


def to_plain(obj: Any) -> Any:
    """``obj`` with only dict/list/tuple/str/int/float/bool/None inside: numpy numbers and
    subclasses of int/float/str/bool are converted (containers are copied only where
    something changed; shared sub-objects stay shared); anything else raises TypeError
    naming where it is."""
    memo: dict[int, Any] = {}
    scalars = _SCALARS

    def walk(x: Any) -> Any:
        t = type(x)
        if t in scalars:
            return x
        if t is not dict and t is not list and t is not tuple:
            return _scalar(x)
        got = memo.get(id(x))
        if got is not None:
            return got[1]
        out = x
        if t is dict:
            new = None
            for i, (k, v) in enumerate(x.items()):
                if type(k) in scalars and type(v) in scalars:
                    if new is not None:
                        new.append((k, v))
                    continue
                try:
                    nk = walk(k)
                    nv = walk(v)
                except _NotPlain as e:
                    e.path.append(f"[{k!r}]")
                    raise
                if new is None and (nk is not k or nv is not v):
                    new = list(x.items())[:i]
                if new is not None:
                    new.append((nk, nv))
            if new is not None:
                out = dict(new)
        else:
            new = None
            for i, v in enumerate(x):
                if type(v) in scalars:
                    if new is not None:
                        new.append(v)
                    continue
                try:
                    nv = walk(v)
                except _NotPlain as e:
                    e.path.append(f"[{i}]")
                    raise
                if new is None and nv is not v:
                    new = list(x[:i])
                if new is not None:
                    new.append(nv)
            if new is not None:
                out = new if t is list else tuple(new)
        memo[id(x)] = (x, out)
        return out

    return walk(obj)


#: Types the pickler writes natively that are not plain data (memory_viz cannot read them).
_NATIVE_NOT_PLAIN = frozenset({bytes, bytearray, set, frozenset})


class _PlainPickler(pickle.Pickler):
    """Pickles the exact builtin types as usual; the C pickler consults
    ``reducer_override`` for nothing else, so plain data costs no check at all."""

    def reducer_override(self, obj: Any) -> Any:
        raise _NotPlain(obj)


def dumps_snapshot(snapshot: dict[str, Any]) -> bytes:
    """``snapshot`` pickled for memory_viz (plain types, protocol 4).

    A snapshot cudalab built (dicts, lists, tuples, str, int, float, bool, None by
    construction) is pickled straight away (benchmark row "snapshot" of
    benchmarks/history.py); anything else in it (a numpy integer from a pluggable allocator,
    say) is converted by :func:`to_plain` first.

    Parameters
    ----------
    snapshot : dict
        Any snapshot-like dict.

    Returns
    -------
    bytes
        The pickle.

    Raises
    ------
    TypeError
        A value that is not plain data and cannot be converted (the message says where).
    ValueError
        The snapshot nests containers deeper than the interpreter's recursion limit.
    """
    buf = io.BytesIO()
    try:
        try:
            _PlainPickler(buf, protocol=PICKLE_PROTOCOL).dump(snapshot)
            clean = _natively_plain(snapshot)
        except _NotPlain:
            clean = False
        if clean:
            return buf.getvalue()
        return pickle.dumps(to_plain(snapshot), protocol=PICKLE_PROTOCOL)  # or TypeError: where
    except RecursionError:
        raise ValueError("cannot pickle the snapshot: it nests containers too deeply (deeper "
                         f"than the recursion limit, {sys.getrecursionlimit()})") from None


_CONTAINERS = frozenset({dict, list, tuple})
_MAX_LEVELS = 100_000  # (a container that holds itself would go on forever)


def _natively_plain(obj: Any) -> bool:
    """Whether no bytes, bytearray, set or frozenset hides in ``obj``: the pickler writes
    those natively, past ``reducer_override``. Breadth first, one C-level pass per level
    (``gc.get_referents``), so a snapshot of a million entries costs a fraction of a
    second."""
    bad = _NATIVE_NOT_PLAIN
    return all(bad.isdisjoint(types)
               for _, types in container_levels(obj, _CONTAINERS, _MAX_LEVELS))


# --------------------------------------------------------------------------- loading
def _read(path_or_file: Any, max_bytes: int | str | None) -> tuple[bytes, str]:
    limit = max_snapshot_bytes(max_bytes)
    if hasattr(path_or_file, "read"):
        name = getattr(path_or_file, "name", None)
        what = f"snapshot {name!r}" if isinstance(name, str) else "the snapshot file object"
        return read_bounded(path_or_file, what, limit, check_pickle_start(what)), what
    if isinstance(path_or_file, (str, bytes, os.PathLike)):
        what = f"snapshot {os.fsdecode(path_or_file)!r}"
        return read_path_bounded(path_or_file, what, limit, check_pickle_start(what)), what
    raise TypeError("load_snapshot() takes a path or a binary file object, got "
                    f"{type(path_or_file).__name__}")


def _keys_text(obj: dict[Any, Any]) -> str:
    """A dict's first keys for a message (text keys only: no repr of a hostile key)."""
    keys = sorted(k for k in obj if isinstance(k, str))[:8]
    others = sum(1 for k in obj if not isinstance(k, str))
    return f"{keys}" + (f" and {others} key(s) that are not text" if others else "")


def _as_snapshot(obj: Any, what: str, check: bool = True) -> dict[str, Any]:
    """``obj`` (unpickled) as a snapshot dict, or SnapshotLoadError saying why it is not one
    (``check``: and checked against the schema, :func:`.snapshot_check.check_snapshot`)."""
    if isinstance(obj, list) and obj and all(isinstance(s, dict) and "blocks" in s for s in obj):
        obj = {"segments": obj, "device_traces": []}
    if not isinstance(obj, dict) or not isinstance(obj.get("segments"), list):
        if isinstance(obj, dict) and "segments" in obj:
            got = f"a dict whose 'segments' is a {type(obj['segments']).__name__}"
        elif isinstance(obj, dict):
            got = f"a dict with keys {_keys_text(obj)}"
        else:
            got = f"a {type(obj).__name__}"
        raise SnapshotLoadError(
            f"{what} is not a memory snapshot: expected a dict with a 'segments' list (as "
            f"written by cudalab.memory._dump_snapshot or torch.cuda.memory._dump_snapshot), "
            f"got {got}")
    traces = obj.setdefault("device_traces", [])
    if not isinstance(traces, list):
        raise SnapshotLoadError(f"{what} is not a memory snapshot: 'device_traces' must be a "
                                "list of lists of trace entries")
    return check_snapshot(obj, what) if check else obj


def load_snapshot(path_or_file: Any, *, max_bytes: int | str | None = None
                  ) -> dict[str, Any]:
    """Read a memory snapshot pickle (cudalab's ``_dump_snapshot`` or torch's) safely.

    The unpickler refuses every reference to a class or function, so loading a file from a
    stranger cannot run code; the file's size and nesting are bounded and its content is
    checked against torch's schema (see :mod:`cudalab.memory_tools.safe_pickle` and
    :mod:`cudalab.memory_tools.snapshot_check`). A pickled ``memory_snapshot()`` list of
    segments is accepted and wrapped into the dict form; missing ``device_traces`` is filled
    with ``[]``.

    Parameters
    ----------
    path_or_file : str, bytes, os.PathLike or binary file object
        The snapshot pickle.
    max_bytes : int or str, optional
        The largest file to read (bytes or a size such as ``"512MiB"``). Default: the
        environment variable ``CUDALAB_MAX_SNAPSHOT_BYTES``, else 4 GiB.

    Returns
    -------
    dict
        The snapshot, in torch's schema.

    Raises
    ------
    SnapshotLoadError
        (a ValueError) A refused, empty, truncated, corrupt, too large or too deeply nested
        pickle, one that is not a snapshot, or a malformed entry (the message names it).
    OSError
        The file cannot be read.
    TypeError
        ``path_or_file`` is neither a path nor a file object.
    ValueError
        ``max_bytes`` (or ``CUDALAB_MAX_SNAPSHOT_BYTES``) is not a size.
    """
    data, what = _read(path_or_file, max_bytes)
    return _as_snapshot(unpickle(data, what), what)


@dataclass
class TraceArrays:
    """A trace reduced to parallel numpy arrays of its alloc/free entries (what
    :func:`load_trace` returns and :func:`cudalab.memory_tools.replay.replay` replays)."""

    source: str
    action: NDArray[np.int8]  # 1 alloc, 0 free
    addr: NDArray[np.int64]  # (dense ids when the addresses do not fit int64)
    size: NDArray[np.int64]  # -1: not a positive integer (skipped by the replay)
    stream: list[int]
    ignored: dict[str, int] = field(default_factory=dict)
    reference: dict[str, Any] = field(default_factory=dict)
    #: (address, size) of the trace's segment_alloc entries, in order (the replay hands out
    #: these addresses again, see replay._TraceAddresses).
    segments: list[tuple[int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.action)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


#: What a trace file may be, for error messages.
TRACE_FILES = ("a snapshot pickle (%cuda_memory history save X.pickle, "
               "cudalab.memory._dump_snapshot or torch's) or a history CSV "
               "(%cuda_memory history save X.csv, history_frame().to_csv)")


def _load_file(path: str, max_bytes: int | str | None = None) -> Any:
    """Read a trace file, told apart by its content: a pickle (by the restricted
    unpickler), a history CSV (a DataFrame), a JSON snapshot or entry list; a
    Perfetto/Chrome trace JSON or anything else is refused naming the formats read. Files
    (and gzip contents) over ``max_bytes`` are refused (SnapshotLoadError)."""
    limit = max_snapshot_bytes(max_bytes)
    what = f"trace {path!r}"
    try:
        data = read_path_bounded(path, what, limit)
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None
    head = data[:1]
    if data[:2] == b"\x1f\x8b":  # gzip: cudalab writes only Perfetto JSON that way
        try:
            data = gunzip_bounded(data, what, limit)  # (a gzip bomb stops at the limit)
        except (OSError, EOFError) as exc:
            raise TraceError(f"cannot read {path}: corrupt gzip file ({exc})") from None
        head = data.lstrip()[:1]
    elif head != b"\x80":  # not a pickle (protocol 2+): text?
        head = data.lstrip()[:1]
    if head in (b"{", b"["):
        return _load_json(path, data)
    first = data.split(b"\n", 1)[0]
    if head != b"\x80" and b"," in first and b"action" in first.split(b","):
        return _load_csv(path)
    if head != b"\x80" and path.lower().endswith(".csv"):
        raise TraceError(f"cannot read {path}: not a history CSV (its first line has no "
                         f"'action' column); replay reads {TRACE_FILES}")
    return _load_pickle(path, data)  # (protocol 0 and 1 pickles are text: refused there)


def _load_csv(path: str) -> Any:
    try:
        return read_history_csv(path)
    except ImportError:
        raise TraceError(f"cannot read {path}: reading a history CSV needs pandas "
                         "(pip install pandas)") from None
    except (ValueError, TypeError, KeyError, OverflowError) as exc:
        raise TraceError(f"cannot read history CSV {path}: {_first_line(exc)}") from None


def _load_json(path: str, data: bytes) -> Any:
    import json

    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise TraceError(f"cannot read {path}: invalid JSON ({_first_line(exc)}); replay "
                         f"reads {TRACE_FILES}") from None
    if isinstance(obj, dict) and "traceEvents" in obj:
        raise TraceError(
            f"cannot replay {path}: it is a Perfetto/Chrome trace JSON (a timeline for "
            "ui.perfetto.dev, which keeps block lifetimes but not the order of the "
            f"allocator's events); replay reads {TRACE_FILES}")
    return obj  # a snapshot dict or entry list written as JSON: checked by load_trace


def _load_pickle(path: str, data: bytes) -> Any:
    """Read a trace pickle without running code from it (the restricted unpickler of
    :func:`load_snapshot`): a snapshot, else plain data that is a trace (the allocator
    benchmark's ``{"trace": [...]}`` dicts, lists of tuples); TraceError otherwise."""
    what = f"snapshot {path!r}"
    obj: Any = None  # (stays None when the pickle itself is refused or corrupt)
    try:
        obj = unpickle(data, what)
    except SnapshotLoadError as exc:  # refused, too deep, truncated: one line
        why = _first_line(exc)
    else:
        try:  # (its entries are checked for the replay by _from_snapshot)
            return _as_snapshot(obj, what, check=False)
        except SnapshotLoadError as exc:  # not a snapshot: maybe a plain trace
            why = _first_line(exc)
    if (isinstance(obj, dict) and isinstance(obj.get("trace"), list)) or \
            (isinstance(obj, list) and obj and isinstance(obj[0], (tuple, list))):
        return obj
    if why.endswith(")") and "truncated or corrupt pickle" in why:
        why += f"; replay reads {TRACE_FILES}"
    raise TraceError(why if path in why else f"cannot load {path}: {why}")


def _is_dataframe(obj: Any) -> bool:
    mod = type(obj).__module__ or ""
    return mod.startswith("pandas") and hasattr(obj, "columns") and hasattr(obj, "to_numpy")


_ACTION_CODE = {"alloc": 1, "free_requested": 0, "free": 0}
_SEGMENT_SIGN = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def _int_array(values: Any, what: str, source: str) -> NDArray[np.int64]:
    try:
        arr = np.asarray(values)
        if arr.dtype.kind == "f" and np.isfinite(arr).all() and (arr == np.round(arr)).all():
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            arr = np.asarray([int(v) for v in values], dtype=np.int64)
        return arr.astype(np.int64, copy=False)
    except (OverflowError, TypeError, ValueError):
        raise TraceError(f"{source}: trace {what} values must be integers") from None


def _from_columns(source: str, actions: Sequence[Any], addrs: Any, sizes: Any,
                  streams: Any) -> TraceArrays:
    """Keep alloc/free entries, count the others by action (vectorised)."""
    n = len(actions)
    if n == 0:
        z = np.zeros(0, np.int64)
        return TraceArrays(source, np.zeros(0, np.int8), z, z, [])
    get = _ACTION_CODE.get
    try:
        codes = np.array([get(a, 2) for a in actions], dtype=np.int8)
    except TypeError:  # unhashable actions
        codes = np.array([get(a, 2) if isinstance(a, str) else 2 for a in actions],
                         dtype=np.int8)
    keep = np.flatnonzero(codes < 2)
    ignored: dict[str, int] = {}
    ref: dict[str, Any] = {}
    seg_allocs: list[tuple[int, int]] = []
    if len(keep) < n:
        other = np.flatnonzero(codes == 2).tolist()
        sign = []
        seg_idx = []
        for i in other:
            a = actions[i]
            a = a if isinstance(a, str) else str(a)
            ignored[a] = ignored.get(a, 0) + 1
            sg = _SEGMENT_SIGN.get(a)
            if sg is not None:
                sign.append(sg)
                seg_idx.append(i)
        if seg_idx:
            try:
                seg_allocs = [(int(addrs[i]), int(sizes[i])) for i, sg in zip(seg_idx, sign)
                              if sg > 0 and actions[i] == "segment_alloc"]
            except (OverflowError, TypeError, ValueError):
                seg_allocs = []
            try:
                seg_sizes = np.asarray([sizes[i] for i in seg_idx], dtype=np.int64)
                ref["recorded_peak_reserved"] = int(
                    np.cumsum(seg_sizes * np.asarray(sign, dtype=np.int64)).max(initial=0))
            except (OverflowError, TypeError, ValueError):
                pass
    all_kept = len(keep) == n

    def pick(values: Any) -> Any:
        if all_kept:
            return values
        if isinstance(values, np.ndarray):
            return values[keep]
        return [values[i] for i in keep.tolist()]

    try:
        addr = np.asarray(pick(addrs), dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        addr = _object_keys(pick(addrs))
    size = _sizes(pick(sizes))
    stream = _int_array(pick(streams), "stream", source).tolist()
    if "recorded_peak_reserved" in ref and addr.dtype == np.int64:
        _count_earlier(ref, [i for i, sg in zip(seg_idx, sign) if sg > 0], addrs, sizes,
                       addr[codes[keep] == 1])
    return TraceArrays(source, codes[keep], addr, size, stream, ignored, ref, seg_allocs)


def _valid_size(s: Any) -> bool:
    return bool(isinstance(s, (int, np.integer)) and not isinstance(s, (bool, np.bool_))
                and 0 < s < (1 << 62))


def _sizes(values: Any) -> NDArray[np.int64]:
    """int64 sizes; -1 where a size is not a positive integer (a string such as ``"512"``,
    a fraction such as ``512.5``, a bool, a NaN, 2**70): the replay skips those entries
    (``invalid_size``). Whole floats of a numpy column (a DataFrame with gaps) count as
    integers."""
    if isinstance(values, np.ndarray):
        if values.dtype.kind in "iu":
            return values.astype(np.int64, copy=False)
        if values.dtype.kind == "f":
            ok = np.isfinite(values) & (values == np.round(values)) & (values > 0) \
                & (values < 2.0 ** 62)
            return np.where(ok, values, -1).astype(np.int64)
        values = values.tolist()
    types = set(map(type, values))
    if types <= {int} and (not values or (min(values) > 0 and max(values) < (1 << 62))):
        return np.asarray(values, dtype=np.int64)
    return np.asarray([s if _valid_size(s) else -1 for s in values], dtype=np.int64)


def _count_earlier(ref: dict[str, Any], seg_rows: list[int], addrs: Any, sizes: Any,
                   alloc_addr: NDArray[np.int64]) -> None:
    """``ref["allocs_in_earlier_segments"]``: allocations at addresses outside every segment
    the trace reserved (a history started mid-session: they reused memory reserved before
    it, which the recorded peak does not count)."""
    try:
        lo = np.asarray([int(addrs[i]) for i in seg_rows], dtype=np.int64)
        hi = lo + np.asarray([int(sizes[i]) for i in seg_rows], dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        return
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], np.maximum.accumulate(hi[order])
    j = np.searchsorted(lo, alloc_addr, side="right") - 1
    inside = (j >= 0) & (alloc_addr < hi[np.maximum(j, 0)])
    n = int(alloc_addr.size - inside.sum())
    if n:
        ref["allocs_in_earlier_segments"] = n


def _object_keys(values: Sequence[Any]) -> NDArray[np.int64]:
    """Addresses that do not fit int64 (or are not ints): dense int ids by equality."""
    ids: dict[Any, int] = {}
    return np.asarray([ids.setdefault(v, len(ids)) for v in values], dtype=np.int64)


def _from_entries(source: str, entries: Sequence[Any]) -> TraceArrays:
    if not entries:
        return _from_columns(source, [], [], [], [])
    first = entries[0]
    if isinstance(first, dict):
        try:
            actions = [e["action"] for e in entries]
            addrs = [e.get("addr", 0) for e in entries]
            sizes = [e.get("size", 0) for e in entries]
            streams = [e.get("stream", 0) for e in entries]
        except (KeyError, TypeError, AttributeError):
            raise TraceError(f"{source}: trace entries must be dicts with 'action', 'addr', "
                             "'size' and 'stream'") from None
        return _from_columns(source, actions, addrs, sizes, streams)
    try:  # (zip(*entries) is quadratic-ish for a million tuples: pick columns one by one)
        actions = [e[0] for e in entries]
        addrs = [e[1] for e in entries]
        sizes = [e[2] for e in entries]
        streams = [e[3] for e in entries]
    except (TypeError, IndexError, KeyError):
        raise TraceError(f"{source}: a trace list must hold (action, addr, size, stream) tuples "
                         "or trace entry dicts") from None
    return _from_columns(source, actions, addrs, sizes, streams)


def _from_dataframe(source: str, df: Any, device: int | None) -> TraceArrays:
    missing = [c for c in ("action", "addr", "size", "stream") if c not in df.columns]
    if missing:
        raise TraceError(f"{source}: the DataFrame lacks column(s) {', '.join(missing)} "
                         "(needs action, addr, size, stream)")
    if device is not None and "device" in df.columns:
        dev = df["device"]
        df = df[(dev == device) | dev.isna()]

    def col(name: str) -> NDArray[Any]:
        c = df[name]
        if c.isna().any():
            c = c.fillna(0)
        return c.to_numpy()

    return _from_columns(source, df["action"].tolist(), col("addr"), col("size"), col("stream"))


def _from_snapshot(source: str, snap: dict[str, Any], device: int) -> TraceArrays:
    traces = snap.get("device_traces")
    if not isinstance(traces, list):
        raise TraceError(f"{source}: the snapshot has no 'device_traces' list (was history "
                         "recording on? cudalab.memory.record_history() / "
                         "torch.cuda.memory._record_memory_history())")
    if not 0 <= device < len(traces):
        raise TraceError(f"{source}: no trace for device {device} (the snapshot has "
                         f"{len(traces)} device trace(s))")
    entries = traces[device]
    if not isinstance(entries, list):
        raise TraceError(f"{source}: device_traces[{device}] is not a list")
    # the keys the replay reads, named when malformed (sizes that are not integers are
    # skipped by the replay, counted in its warning); the check hands over their columns
    cols = check_trace_entries(entries, f"device_traces[{device}]", source,
                               TRACE_KEYS_FOR_REPLAY)
    if not entries:
        others = [i for i, t in enumerate(traces) if t]
        if others:
            raise TraceError(f"{source}: the trace of device {device} is empty; devices with "
                             f"entries: {', '.join(map(str, others))} (use device=...)")

    def column(key: str) -> list[Any]:
        got = cols[key]
        return got if got is not None else [e.get(key, 0) for e in entries]

    return _from_columns(source, column("action"), column("addr"), column("size"),
                         column("stream"))


def load_trace(trace: Any, device: int = 0, *, max_bytes: int | str | None = None
               ) -> TraceArrays:
    """Read any accepted trace form into arrays.

    Parameters
    ----------
    trace
        A snapshot dict, a snapshot (or trace) pickle or history CSV path, a DataFrame (action, addr, size,
        stream[, device]), a list of (action, addr, size, stream) tuples or of trace entry
        dicts (see the module documentation), or a :class:`TraceArrays` (returned as is).
    device : int, optional
        Which device's trace of a snapshot or DataFrame to read (default 0).
    max_bytes : int or str, optional
        The largest trace file to read (bytes or a size such as ``"512MiB"``; gzip files:
        decompressed). Default: ``CUDALAB_MAX_SNAPSHOT_BYTES``, else 4 GiB.

    Returns
    -------
    TraceArrays
        The alloc/free entries; other actions are counted in ``ignored``.

    Raises
    ------
    TraceError
        (a ValueError) The trace cannot be read or has the wrong shape.
    SnapshotLoadError
        (a ValueError) The file is larger than ``max_bytes``, or a snapshot's trace entry is
        malformed (the message names its index and key; sizes that are not integers are not
        an error: the replay skips those entries and counts them in its warning).
    """
    if not isinstance(device, int) or isinstance(device, bool) or device < 0:
        raise TraceError(f"device must be a device index (int >= 0), got {device!r}")
    source = "trace"
    reference: dict[str, Any] = {}
    if isinstance(trace, (str, os.PathLike)):
        source = os.fspath(trace)
        if os.path.isdir(source):
            raise TraceError(f"cannot read {source}: it is a directory, not a trace file")
        trace = _load_file(source, max_bytes)
    if isinstance(trace, TraceArrays):
        return trace
    if _is_dataframe(trace):
        return _from_dataframe("DataFrame" if source == "trace" else source, trace, device)
    if isinstance(trace, dict):
        if "device_traces" in trace or "segments" in trace:
            return _from_snapshot(source, trace, device)
        if "trace" in trace:  # the allocator benchmark's {"name", "trace", "torch_peak_*"}
            for key in ("torch_peak_reserved", "torch_peak_allocated"):
                if isinstance(trace.get(key), int):
                    reference[key] = trace[key]
            if isinstance(trace.get("name"), str) and source == "trace":
                source = trace["name"]
            tr = _from_entries(source, trace["trace"])
            tr.reference.update(reference)
            return tr
        raise TraceError(f"{source}: a dict trace must be a memory snapshot (with "
                         "'device_traces') or hold a 'trace' list")
    if isinstance(trace, (list, tuple)):
        return _from_entries(source, trace)
    raise TraceError(f"cannot replay a {type(trace).__name__}: give a snapshot dict, a snapshot "
                     "pickle path, a DataFrame (action, addr, size, stream) or a list of "
                     "(action, addr, size, stream) tuples")


# --------------------------------------------------------------------------- CSV
def categorical(pd: Any, values: Any, known: tuple[str, ...]) -> Any:
    """A Categorical with ``known`` categories first, then any unknown values seen."""
    extra = sorted({v for v in values if v not in known and v is not None})
    return pd.Categorical(values, categories=list(known) + extra)


def _csv_offender(column: Any, name: str) -> str:
    """``"column 'size', row 3 is '1e400'"``: the first value of ``column`` that is not an
    int64 (as written), for the message of :func:`read_history_csv`."""
    for row, v in zip(column.index, column.tolist()):
        try:
            ok = float(v) == int(v) and -(1 << 63) <= int(v) < (1 << 63)
        except (OverflowError, TypeError, ValueError):
            ok = False
        if not ok:
            return f"column {name!r}, row {row} is {v!r:.40}"
    return f"column {name!r}"


def read_history_csv(path: Any) -> pandas.DataFrame:
    """Read a saved history frame back with the dtypes it was saved with.

    Parameters
    ----------
    path
        A file written by ``history_frame().to_csv(path, index=False)`` (anything
        ``pandas.read_csv`` reads).

    Returns
    -------
    pandas.DataFrame
        The columns of :func:`cudalab.memory_tools.export.history_frame`, with its dtypes.

    Raises
    ------
    ValueError
        An integer column holds something else (text, a fraction, a gap, a number beyond
        int64): the message names the column and the row.
    """
    import pandas as pd

    df = pd.read_csv(path, dtype={"filename": object, "name": object, "cell": object,
                                  "nvtx_range": object})
    for col in ("time_us", "device", "stream", "addr", "size", "device_free", "allocated",
                "reserved"):
        if col in df:
            try:
                values = df[col]
                if values.dtype.kind == "f" and not (values == np.round(values)).all():
                    raise ValueError  # (astype would cut 512.5 to 512 silently)
                df[col] = values.astype(np.int64)
            except (OverflowError, TypeError, ValueError):
                raise ValueError(f"{_csv_offender(df[col], col)}, expected an integer that "
                                 "fits int64") from None
    if "time_us" in df:
        df["time"] = pd.Series(df["time_us"].to_numpy().astype("datetime64[us]"), index=df.index)
    if "action" in df:
        df["action"] = categorical(pd, df["action"].astype(object).tolist(), ACTIONS)
    if "line" in df:
        df["line"] = df["line"].astype("Int64")
    for col in ("filename", "name", "cell", "nvtx_range"):
        if col in df:
            df[col] = df[col].astype(object).where(df[col].notna(), None)
    return df
