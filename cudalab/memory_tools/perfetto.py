"""The allocation history as a Chrome/Perfetto trace (open it in ui.perfetto.dev).

:func:`export_perfetto` writes one process per device with memory counters, one track per
stream lane of block lifetimes, and instants for OOMs and snapshots; it reads ``snap`` as the
DataFrame exports do (:mod:`cudalab.memory_tools.trace_columns`).
"""

from __future__ import annotations

import gzip
import io
import json
import os
from heapq import heappop, heappush
from typing import Any, TextIO

import numpy as np
from numpy.typing import NDArray

from cudalab._atomic_write import atomic_write
from cudalab._units import format_bytes
from cudalab.memory_tools.trace_columns import (
    ALLOC,
    FREE_COMPLETED,
    OOM,
    SEGMENT_ALLOC,
    SEGMENT_FREE,
    SEGMENT_MAP,
    SEGMENT_UNMAP,
    SNAPSHOT,
    TraceColumns,
    live_history,
    live_simulated,
    resolve_snapshot,
    stream_label,
)

__all__ = ["export_perfetto"]


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
      :func:`cudalab.memory_tools.export.history_frame`), one point per timestamp where a total changes;
    * per stream, one thread track per *lane* holding ``X`` slices for block lifetimes (alloc
      to ``free_completed``; blocks never freed run to the last timestamp; a
      ``free_completed`` whose alloc predates the trace starts at 0 with ``preexisting``).
      Blocks alive at the same time get different lanes, so slices on one track never
      overlap. Slice names are human-readable sizes; args hold addr, size, stream, top frame;
    * ``i`` instants (process scope) for ``oom`` (``OOM``) and ``snapshot`` entries;
    * the trace's metadata, ``otherData``: ``source`` and ``identity`` (where the history
      came from, :meth:`cudalab.identity.Identity.to_dict`: the snapshot's ``identity``, this
      process's for ``snap=None``; left out for a snapshot without one, as torch's).

    Timestamps are µs since the first entry. Thread ids are unique across the file (Perfetto
    keys threads by tid). A path ending in ``.gz`` is gzip-compressed (Perfetto opens it).
    Events are written incrementally, so memory stays proportional to the history, not to
    the JSON text. The file is replaced atomically: when writing fails, a file that was
    there before is left intact. Returns the path as a string.
    """
    raw = live_history() if snap is None else None
    simulated: bool
    if raw is not None:  # cudalab's own recorder, read directly
        t = TraceColumns(None, extras=False, raw=raw)
        simulated = live_simulated()
    else:
        s = resolve_snapshot(snap)
        flag = (s.get("cudalab") or {}).get("simulated")
        # torch's schema has no such flag: a live snapshot asks the backend
        simulated = (snap is None and live_simulated()) if flag is None else flag
        t = TraceColumns(s, extras=False)
    n_dev = max((d for d, _, _ in t.bounds), default=-1) + 1
    p = os.fspath(path)
    with atomic_write(p, "wb") as fh:  # a failure leaves the previous file intact
        f = (gzip.GzipFile(fileobj=fh, mode="wb", compresslevel=3) if p.endswith(".gz")
             else fh)
        out = io.TextIOWrapper(f, encoding="utf-8", newline="\n", write_through=False)
        _write_perfetto(out, t, simulated, n_dev)
        out.flush()
        out.detach()
        if f is not fh:
            f.close()
    return p


def _block_lifetimes(t: TraceColumns, a: int, b: int, t0: int, t_end: int
                     ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64],
                                NDArray[np.bool_]]:
    """Match each ``alloc`` of device rows [a, b) to the next ``free_completed`` of its
    address. Returns numpy arrays (start_us, end_us, entry index, preexisting) where the entry
    is the alloc (or, for a free whose alloc predates the trace, the free itself)."""
    code = t.code[a:b]
    sel = np.flatnonzero((code == ALLOC) | (code == FREE_COMPLETED))
    empty = np.zeros(0, np.int64)
    if sel.size == 0:
        return empty, empty, empty, np.zeros(0, bool)
    addr = t.addr[a:b][sel]
    c = code[sel]
    order = np.lexsort((sel, addr))  # by address, then trace order
    sa, sc, si = addr[order], c[order], sel[order]
    same = np.zeros(sa.size, bool)
    same[:-1] = sa[1:] == sa[:-1]
    is_alloc = sc == ALLOC
    paired = np.zeros(sa.size, bool)  # an alloc whose next row (same address) frees it
    paired[:-1] = is_alloc[:-1] & same[:-1] & (sc[1:] == FREE_COMPLETED)
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


def _write_perfetto(out: TextIO, t: TraceColumns, simulated: bool, n_dev: int) -> None:
    dumps = json.dumps
    other: dict[str, Any] = {"source": "cudalab memory history"}
    if t.identity is not None:
        other["identity"] = t.identity
    out.write('{"displayTimeUnit":"ms","otherData":' + dumps(other, separators=(",", ":"))
              + ',"traceEvents":[\n')
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
    by_key: dict[tuple[Any, Any, Any], str] = {}

    def frame_str(top: dict[str, Any] | None) -> str:
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
            v = names[n] = format_bytes(n)
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
            label = stream_label(int(stream[lo]))
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
        changes = np.flatnonzero((code_d == ALLOC) | (code_d == FREE_COMPLETED)
                                 | (code_d == SEGMENT_ALLOC) | (code_d == SEGMENT_FREE)
                                 | (code_d == SEGMENT_MAP) | (code_d == SEGMENT_UNMAP)) + a
        if changes.size:
            ts_c = t.time_us[changes]
            last = np.ones(changes.size, dtype=bool)
            last[:-1] = ts_c[1:] != ts_c[:-1]
            keep = changes[last]
            for lo in range(0, keep.size, chunk):
                rows = keep[lo:lo + chunk]
                write([f'{{"ph":"C","name":"memory","pid":{pid},"tid":{pid},"ts":{ts},'
                       f'"args":{{"allocated":{al},"reserved":{rs}}}}}'
                       for ts, al, rs in zip((t.time_us[rows] - t0).tolist(),
                                             t.allocated[rows].tolist(),
                                             t.reserved[rows].tolist())])

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
        for i in np.flatnonzero((code_d == OOM) | (code_d == SNAPSHOT)).tolist():
            i += a
            ts = int(t.time_us[i]) - t0
            if t.code[i] == OOM:
                inst.append(f'{{"ph":"i","s":"p","name":"OOM","cat":"oom","pid":{pid},"tid":{pid},'
                            f'"ts":{ts},"args":{{"size":{int(t.size[i])},'
                            f'"device_free":{int(t.device_free[i])},"stream":{int(t.stream[i])},'
                            f'"frame":{frame_str(tops[i])}}}}}')
            else:
                inst.append(f'{{"ph":"i","s":"p","name":"snapshot","cat":"snapshot","pid":{pid},'
                            f'"tid":{pid},"ts":{ts},"args":{{"size":{int(t.size[i])}}}}}')
        write(inst)
    out.write("\n]}\n")
