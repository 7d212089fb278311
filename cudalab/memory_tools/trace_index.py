"""A snapshot's trace as numpy columns, read safely, at scale and progressively.

:func:`open_trace` reads a snapshot pickle (cudalab's ``_dump_snapshot``, torch's, a saved
history) into a :class:`TraceIndex`: one row per trace entry in columns (time, address, size,
action code, stream, device, device_free, an interned stack id, cell and NVTX range ids), the
frame and stack tables, and the rest of the snapshot (segments, settings, identity) as the
plain dict :func:`cudalab.memory_tools.trace_io.load_snapshot` returns, with empty traces.
No dict per entry is kept: a 10M-entry (~1 GB) file costs about 40 bytes per entry.

Reading is as safe as ``load_snapshot`` (:mod:`cudalab.memory_tools.safe_pickle`): no code
runs (an opcode that names or calls a class or function is refused), containers nest at
most :data:`~cudalab.memory_tools.safe_pickle.MAX_NESTING` deep, a file larger than
:func:`~cudalab.memory_tools.safe_pickle.max_snapshot_bytes` is refused before it is read,
every length inside the file is checked against the bytes left (the file is mapped, and the
pages read are let go as reading goes on), the process's memory is bounded while reading (:data:`MEMORY_FACTOR` × the file, plus :data:`MEMORY_SLACK`), and
entries are checked against torch's schema as they are read; every failure is a
:class:`~cudalab.memory_tools.safe_pickle.SnapshotLoadError` saying why.

Progressive: :func:`iter_trace` yields the index of the part read so far every
``step_bytes`` (a view of the same arrays, ``complete`` False), then the whole one;
``open_trace(path, on_progress=f)`` calls ``f`` with each.

The reading is done by the C extension ``cudalab.memory_tools._tracescan`` (see its
comment); without it (``CUDALAB_PURE_PYTHON=1``, no compiler), or for a protocol 0/1 pickle,
the file is read by ``load_snapshot`` and converted by a Python loop: the same columns and
tables, with the memory of the full unpickle.
"""

from __future__ import annotations

import gc
import mmap
import os
import resource
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from numpy.typing import NDArray

from cudalab.memory_tools.history import ACTIONS
from cudalab.memory_tools.safe_pickle import (
    MAX_NESTING,
    SnapshotLoadError,
    check_pickle_start,
    max_snapshot_bytes,
)
from cudalab.memory_tools.snapshot_check import check_snapshot, check_trace_entries
from cudalab.memory_tools.trace_io import load_snapshot

__all__ = [
    "COLUMNS",
    "DEFAULTS",
    "MEMORY_FACTOR",
    "MEMORY_SLACK",
    "TraceIndex",
    "index_snapshot",
    "iter_trace",
    "open_trace",
    "scanner_available",
]

#: The entry columns and their dtypes, in the C scanner's order.
COLUMNS: tuple[tuple[str, Any], ...] = (
    ("time_us", np.int64), ("addr", np.int64), ("size", np.int64), ("stream", np.int64),
    ("device_free", np.int64), ("action", np.uint8), ("device", np.int16),
    ("stack", np.int32), ("cell", np.int32), ("nvtx", np.int32), ("pool", np.int32))
#: Reading may grow the process's peak memory by this many times the file size ...
MEMORY_FACTOR = 4
#: ... plus this many bytes (a hostile pickle is refused once past it).
MEMORY_SLACK = 512 << 20
_STEP = 32 << 20  # bytes read between progress reports
_FIRST_STEP = 2 << 20  # bytes read before the first one (the first paint)
_BYTES_PER_ENTRY = 48  # a first guess of the rows a file holds (grown when passed)
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)


def scanner_available() -> bool:
    """Whether the C reader (``cudalab.memory_tools._tracescan``) is built."""
    try:
        from cudalab.memory_tools import _tracescan  # type: ignore[attr-defined]  # noqa: F401
    except ImportError:
        return False
    return True


class TraceIndex:
    """A snapshot's trace entries as columns, with their tables (see the module).

    Attributes (arrays have one row per entry, devices' traces one after another, each in
    recorded order):

    ``time_us, addr, size, stream, device_free`` (int64; ``addr``/``stream`` uint64 when a
    value needs the top bit; ``device_free`` -1 except on ``oom`` rows), ``action`` (uint8
    code into ``action_names``, whose first codes are
    :data:`cudalab.memory_tools.history.ACTIONS`), ``device`` (int16), ``stack`` (int32 into
    the stack table, -1: no frames), ``cell``/``nvtx`` (int32 into ``strings``, -1: none).
    ``pool`` (int32 into ``pools``, the ``segment_pool_id`` cudalab tags a private pool's
    entries with, -1: the default pool). ``frames``: ``(filename, name, line)`` per frame id; the frames of stack ``s`` are
    ``stack_frames[stack_offsets[s]:stack_offsets[s + 1]]``, innermost first.
    ``snapshot``: the rest of the snapshot (its ``device_traces`` are empty lists).
    ``complete``: False for a view of a file still being read; ``bytes_read``/``bytes_total``.
    """

    __slots__ = ("n", "time_us", "addr", "size", "stream", "device_free", "action", "device",
                 "stack", "cell", "nvtx", "pool", "action_names", "strings", "pools", "frames",
                 "stack_offsets",
                 "stack_frames", "snapshot", "complete", "bytes_read", "bytes_total", "source",
                 "_cache")

    def __init__(self, columns: dict[str, NDArray[Any]], tables: dict[str, Any],
                 snapshot: dict[str, Any] | None, *, complete: bool, bytes_read: int,
                 bytes_total: int, source: str):
        n = len(columns["time_us"])
        self.n = n
        self.time_us = columns["time_us"]
        self.addr = columns["addr"]
        self.size = columns["size"]
        self.stream = columns["stream"]
        self.device_free = columns["device_free"]
        self.action = columns["action"]
        self.device = columns["device"]
        self.stack = columns["stack"]
        self.cell = columns["cell"]
        self.nvtx = columns["nvtx"]
        self.pool = columns["pool"]
        if tables.get("addr_unsigned"):
            self.addr = self.addr.view(np.uint64)
        if tables.get("stream_unsigned"):
            self.stream = self.stream.view(np.uint64)
        self.action_names: list[str] = list(tables["actions"])
        self.strings: list[str] = list(tables["strings"])
        self.pools: list[Any] = list(tables.get("pools", ()))
        self.frames: list[tuple[str, str, int]] = list(tables["frames"])
        self.stack_offsets: NDArray[np.int64] = np.frombuffer(tables["stack_offsets"], np.int64)
        self.stack_frames: NDArray[np.int32] = np.frombuffer(tables["stack_frames"], np.int32)
        self.snapshot = snapshot
        self.complete = complete
        self.bytes_read = bytes_read
        self.bytes_total = bytes_total
        self.source = source
        self._cache: dict[str, Any] = {}

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        state = "" if self.complete else f", {self.bytes_read:,} of {self.bytes_total:,} bytes read"
        return (f"TraceIndex({self.source}: {self.n:,} entries, {len(self.frames):,} frames, "
                f"{self.n_stacks:,} stacks{state})")

    @property
    def n_stacks(self) -> int:
        """The number of distinct stacks."""
        return len(self.stack_offsets) - 1

    @property
    def identity(self) -> dict[str, Any] | None:
        """The snapshot's ``identity`` (None when it has none, as torch's)."""
        ident = (self.snapshot or {}).get("identity")
        return ident if isinstance(ident, dict) else None

    def action_code(self, name: str) -> int:
        """The code of an action name in :attr:`action` (-1 when no entry has it)."""
        try:
            return self.action_names.index(name)
        except ValueError:
            return -1

    def stack_frame_ids(self, stack: int) -> NDArray[np.int32]:
        """The frame ids of ``stack``, innermost first (empty for -1)."""
        if stack < 0:
            return self.stack_frames[:0]
        return self.stack_frames[self.stack_offsets[stack]:self.stack_offsets[stack + 1]]

    def stack_dicts(self, stack: int) -> list[dict[str, Any]]:
        """The frames of ``stack`` as torch writes them (``filename``, ``line``, ``name``)."""
        return [{"filename": f, "line": ln, "name": nm}
                for f, nm, ln in (self.frames[i] for i in self.stack_frame_ids(stack).tolist())]

    def devices(self) -> list[int]:
        """The devices with entries, in order."""
        return np.unique(self.device).tolist() if self.n else []


# --------------------------------------------------------------------------- reading
#: What a column holds for an entry without its key (and on every row of a column that
#: ``columns=`` leaves unread).
DEFAULTS: dict[str, int] = {"time_us": 0, "addr": 0, "stream": 0, "device_free": -1,
                            "stack": -1, "cell": -1, "nvtx": -1, "pool": -1}
#: The columns every read keeps (the action codes and the devices' bounds).
_ALWAYS = frozenset({"action", "device", "size"})


def _kept(columns: Any) -> frozenset[str] | None:
    if columns is None:
        return None
    names = {name for name, _ in COLUMNS}
    wanted = frozenset([columns] if isinstance(columns, str) else columns)
    unknown = sorted(wanted - names)
    if unknown:
        raise ValueError(f"unknown trace columns {unknown}; the columns are "
                         f"{', '.join(n for n, _ in COLUMNS)}")
    return wanted | _ALWAYS


def _new_columns(rows: int, kept: frozenset[str] | None = None) -> list[NDArray[Any]]:
    if kept is None:
        return [np.empty(rows, dtype) for _, dtype in COLUMNS]
    # The columns not kept are all written into one scratch array (the reader needs a
    # buffer of `rows` values per column; nothing reads them back): less memory to touch.
    scratch = np.empty(rows, np.int64)
    return [np.empty(rows, dtype) if name in kept else scratch.view(dtype)[:rows]
            for name, dtype in COLUMNS]


def _view(cols: list[NDArray[Any]], n: int, kept: frozenset[str] | None
          ) -> dict[str, NDArray[Any]]:
    """The first ``n`` rows of each column; a column not kept reads its default on every
    row (a read-only array of no memory)."""
    return {name: (c[:n] if kept is None or name in kept
                   else np.broadcast_to(np.asarray(DEFAULTS[name], dtype), (n,)))
            for (name, dtype), c in zip(COLUMNS, cols)}


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def iter_trace(path: str | os.PathLike[str], *, max_bytes: int | str | None = None,
               step_bytes: int = _STEP, columns: Any = None) -> Iterator[TraceIndex]:
    """Read a snapshot pickle into a :class:`TraceIndex`, yielding the part read so far
    every ``step_bytes`` and the whole index last (see the module documentation).

    Parameters
    ----------
    path : str or os.PathLike
        The snapshot pickle.
    max_bytes : int or str, optional
        The largest file to read (default :func:`~.safe_pickle.max_snapshot_bytes`).
    step_bytes : int, optional
        Bytes read between two partial indexes (default 32 MiB).
    columns : iterable of str, optional
        The entry columns a tool needs (default: all of :data:`COLUMNS`; ``action``,
        ``device`` and ``size`` are always read). The others hold their :data:`DEFAULTS`
        on every row (read-only), which saves the reader memory and time. The entries are
        checked in full all the same. (The Python reader, without the C extension, reads
        every column.)

    Raises
    ------
    SnapshotLoadError
        A refused, empty, truncated, corrupt, too large, too deeply nested or hostile pickle,
        one that is not a snapshot, or a malformed entry (the message names it).
    OSError
        The file cannot be read.
    """
    what = f"snapshot {os.fsdecode(path)!r}"
    kept = _kept(columns)
    limit = max_snapshot_bytes(max_bytes)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise SnapshotLoadError(
                f"cannot read {what}: it is larger than the limit of {limit:,} bytes (set "
                "CUDALAB_MAX_SNAPSHOT_BYTES, or pass max_bytes=, to read larger files)")
        if size == 0:
            raise SnapshotLoadError(f"cannot read {what}: the file is empty")
        check_pickle_start(what)(f.read(1))
        if not scanner_available():
            yield index_snapshot(load_snapshot(path, max_bytes=max_bytes), source=what,
                                 bytes_total=size)
            return
        from cudalab.memory_tools import _tracescan  # type: ignore[attr-defined]  # C, no stub

        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    first = min(step_bytes, _FIRST_STEP)
    dropped = 0
    try:
        rss_kb = (_peak_rss_bytes() + MEMORY_FACTOR * size + MEMORY_SLACK) // 1024
        scanner = _tracescan.Scanner(data, what, SnapshotLoadError, _bad_entry(what), ACTIONS,
                                     MAX_NESTING, rss_kb)
        cols = _new_columns(size // _BYTES_PER_ENTRY + 4096, kept)
        scanner.set_columns(cols)
        while True:
            collecting = gc.isenabled()
            gc.disable()  # (the entries are containers made and dropped by the million: the
            try:          # cyclic collector would walk them over and over, for no cycle)
                state = scanner.scan(max(1, step_bytes if scanner.rows else first))
            except NotImplementedError:  # a protocol 0/1 pickle: the restricted unpickler
                del scanner
                yield index_snapshot(load_snapshot(path, max_bytes=max_bytes), source=what,
                                     bytes_total=size)
                return
            finally:
                if collecting:
                    gc.enable()
            done = (scanner.pos // mmap.PAGESIZE) * mmap.PAGESIZE
            if _DONTNEED is not None and done > dropped:
                # the bytes read are never read again: their pages leave this process's
                # resident memory (the page cache keeps them)
                data.madvise(_DONTNEED, dropped, done - dropped)
                dropped = done
            if state == 2:  # the columns are full: twice the room
                cols = _new_columns(2 * len(cols[0]), kept)
                scanner.set_columns(cols)
                continue
            n = scanner.rows
            view = _view(cols, n, kept)
            if state == 1:
                snap = _rest_of(scanner.result, what)
                yield TraceIndex(view, scanner.tables(),
                                 snap, complete=True, bytes_read=size, bytes_total=size,
                                 source=what)
                return
            yield TraceIndex(view, scanner.tables(), None, complete=False,
                             bytes_read=scanner.pos, bytes_total=size, source=what)
    finally:
        try:
            del scanner
        except NameError:
            pass
        data.close()


def _bad_entry(what: str) -> Callable[[int, int, Any], SnapshotLoadError]:
    """The C reader's maker of the error for a malformed entry: the schema check's own
    message (so both readers name it alike), at the entry's index."""

    def make(d: int, j: int, entry: Any) -> SnapshotLoadError:
        path = f"device_traces[{d}]"
        try:
            check_trace_entries([entry], path, what)
        except SnapshotLoadError as exc:
            return SnapshotLoadError(str(exc).replace(f"{path}[0]", f"{path}[{j}]", 1))
        return SnapshotLoadError(f"{what}: {path}[{j}] is not a trace entry as torch writes "
                                 "them (a frame that is not a dict with filename, line and "
                                 "name)")

    return make


def _rest_of(obj: Any, what: str) -> dict[str, Any]:
    """The unpickled snapshot (entries taken out) checked as ``load_snapshot`` checks it."""
    if isinstance(obj, list) and obj and all(isinstance(s, dict) and "blocks" in s for s in obj):
        obj = {"segments": obj, "device_traces": []}
    if not isinstance(obj, dict) or not isinstance(obj.get("segments"), list):
        got = (f"a dict with keys {sorted(k for k in obj if isinstance(k, str))[:8]}"
               if isinstance(obj, dict) else f"a {type(obj).__name__}")
        raise SnapshotLoadError(
            f"{what} is not a memory snapshot: expected a dict with a 'segments' list (as "
            f"written by cudalab.memory._dump_snapshot or torch.cuda.memory._dump_snapshot), "
            f"got {got}")
    traces = obj.setdefault("device_traces", [])
    if not isinstance(traces, list):
        raise SnapshotLoadError(f"{what} is not a memory snapshot: 'device_traces' must be a "
                                "list of lists of trace entries")
    return check_snapshot(obj, what)


def open_trace(path: str | os.PathLike[str], *, max_bytes: int | str | None = None,
               on_progress: Callable[[TraceIndex], Any] | None = None,
               step_bytes: int = _STEP, columns: Any = None) -> TraceIndex:
    """Read a snapshot pickle into a :class:`TraceIndex` (see :func:`iter_trace`, and its
    ``columns``); ``on_progress`` is called with each partial index and with the whole
    one."""
    index = None
    for index in iter_trace(path, max_bytes=max_bytes, step_bytes=step_bytes,
                            columns=columns):
        if on_progress is not None:
            on_progress(index)
    assert index is not None
    return index


# --------------------------------------------------------------------------- from dicts
def index_snapshot(snap: dict[str, Any], *, source: str = "snapshot",
                   bytes_total: int = 0) -> TraceIndex:
    """The :class:`TraceIndex` of a snapshot dict already in memory (checked against
    torch's schema; its entries are read, not changed). The Python twin of the C reader:
    the same columns and tables."""
    if isinstance(snap, list):
        snap = {"segments": snap, "device_traces": []}
    check_snapshot(snap, source)
    traces = snap.get("device_traces") or []
    n = sum(len(t) for t in traces)
    cols = {name: np.empty(n, dtype) for name, dtype in COLUMNS}
    action_codes = {a: i for i, a in enumerate(ACTIONS)}
    actions = list(ACTIONS)
    string_ids: dict[str, int] = {}
    strings: list[str] = []
    pool_ids: dict[Any, int] = {}
    pools: list[Any] = []
    frame_ids: dict[tuple[str, str, int], int] = {}
    frames: list[tuple[str, str, int]] = []
    stack_ids: dict[tuple[int, ...], int] = {}
    offsets = [0]
    pool: list[int] = []
    by_list: dict[int, tuple[Any, int]] = {}  # id(frames list) -> (list, stack id)
    unsigned = {"addr": False, "stream": False}

    def text_id(v: Any) -> int:
        if v is None:
            return -1
        got = string_ids.get(v)
        if got is None:
            got = string_ids[v] = len(strings)
            strings.append(v)
        return got

    def pool_id(v: Any) -> int:
        if v is None:
            return -1
        if isinstance(v, list):
            v = tuple(v)
        try:
            got = pool_ids.get(v)
        except TypeError:  # (not hashable: not a pool id)
            return -1
        if got is None:
            got = pool_ids[v] = len(pools)
            pools.append(v)
        return got

    def stack_of(fr: Any) -> int:
        if not fr:
            return -1
        got = by_list.get(id(fr))
        if got is not None and got[0] is fr:
            return got[1]
        ids = []
        for f in fr:
            key = (f["filename"], f["name"], f["line"])
            fid = frame_ids.get(key)
            if fid is None:
                fid = frame_ids[key] = len(frames)
                frames.append(key)
            ids.append(fid)
        t = tuple(ids)
        sid = stack_ids.get(t)
        if sid is None:
            sid = stack_ids[t] = len(offsets) - 1
            pool.extend(ids)
            offsets.append(len(pool))
        by_list[id(fr)] = (fr, sid)
        return sid

    r = 0
    for d, entries in enumerate(traces):
        for e in entries:
            a = e["action"]
            code = action_codes.get(a)
            if code is None:
                code = action_codes[a] = len(actions)
                actions.append(a)
            addr, stream = e.get("addr", 0), e.get("stream", 0)
            if addr >= 1 << 63:
                unsigned["addr"], addr = True, addr - (1 << 64)
            if stream >= 1 << 63:
                unsigned["stream"], stream = True, stream - (1 << 64)
            cols["time_us"][r] = e.get("time_us", 0)
            cols["addr"][r] = addr
            cols["size"][r] = e["size"]
            cols["stream"][r] = stream
            cols["device_free"][r] = e.get("device_free", -1)
            cols["action"][r] = code
            cols["device"][r] = d
            cols["stack"][r] = stack_of(e.get("frames"))
            cols["cell"][r] = text_id(e.get("cell"))
            cols["nvtx"][r] = text_id(e.get("nvtx_range"))
            cols["pool"][r] = pool_id(e.get("segment_pool_id"))
            r += 1
    tables = {"actions": actions, "strings": strings, "pools": pools, "frames": frames,
              "stack_offsets": np.array(offsets, np.int64).tobytes(),
              "stack_frames": np.array(pool, np.int32).tobytes(),
              "addr_unsigned": unsigned["addr"], "stream_unsigned": unsigned["stream"]}
    rest = {k: v for k, v in snap.items() if k != "device_traces"}
    rest["device_traces"] = [[] for _ in traces]
    return TraceIndex(cols, tables, rest, complete=True, bytes_read=bytes_total,
                      bytes_total=bytes_total, source=source)
