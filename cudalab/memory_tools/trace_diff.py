"""The diff of two runs: ``cudalab.memory.diff(a, b)``.

Each run's trace (a path read with :func:`~cudalab.memory_tools.trace_index.open_trace`, a
snapshot dict, or a :class:`~cudalab.memory_tools.trace_index.TraceIndex`) gives its peak
allocated and peak reserved bytes and, at each peak, the live blocks (at the peak
allocated moment) and the live segments (at the peak reserved moment) grouped by source
line: the innermost user frame of the stack that allocated them
(:mod:`~cudalab.memory_tools.user_frames`: IPython's frames do not count). The diff is
``b - a`` per line, the top 20 by size of the change, and the lines that appear only in
``b`` (appeared) or only in ``a`` (vanished). Lines are matched by ``file:line
(function)`` with the file's last path part, so two checkouts of one project compare.

Two traces from different devices (name or memory size), from different allocators
(torch's and cudalab's) or one simulated and one not are still compared, and
:attr:`TraceDiff.notes` says so.
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cudalab._internal import format_bytes
from cudalab.memory_tools.trace_index import TraceIndex, index_snapshot, open_trace
from cudalab.memory_tools.trace_views import TraceViews, stack_lines
from cudalab.memory_tools.user_frames import frame_label

__all__ = ["LineDelta", "TraceDiff", "diff", "peak_by_line", "peak_lines"]


@dataclass(frozen=True, slots=True)
class LineDelta:
    """One source line's bytes at the peak in each run."""

    line: str  # "file:line (function)"
    a: int  # bytes in run a at its peak (>= 0)
    b: int  # bytes in run b at its peak (>= 0)

    @property
    def delta(self) -> int:
        """``b - a``."""
        return self.b - self.a


@dataclass(frozen=True, slots=True)
class TraceDiff:
    """``cudalab.memory.diff(a, b)``'s answer (see the module documentation)."""

    peak_allocated: tuple[int, int]  # (a, b) bytes
    peak_reserved: tuple[int, int]  # (a, b) bytes
    allocated_lines: list[LineDelta]  # top lines by |delta| at the peak allocated moment
    reserved_lines: list[LineDelta]  # the same for the segments live at the peak reserved
    appeared: list[LineDelta]  # lines live at b's peak only, largest first
    vanished: list[LineDelta]  # lines live at a's peak only, largest first
    notes: list[str] = field(default_factory=list)  # differences of origin, said plainly
    names: tuple[str, str] = ("a", "b")

    @property
    def allocated_delta(self) -> int:
        """Peak allocated bytes of b minus a."""
        return self.peak_allocated[1] - self.peak_allocated[0]

    @property
    def reserved_delta(self) -> int:
        """Peak reserved bytes of b minus a."""
        return self.peak_reserved[1] - self.peak_reserved[0]

    def to_frame(self) -> Any:
        """The allocated lines as a pandas DataFrame (line, a, b, delta)."""
        import pandas as pd

        return pd.DataFrame([(d.line, d.a, d.b, d.delta) for d in self.allocated_lines],
                            columns=["line", "a", "b", "delta"])

    def __repr__(self) -> str:
        a, b = self.names
        out = [f"diff {a} -> {b}: peak allocated {format_bytes(self.peak_allocated[0])} -> "
               f"{format_bytes(self.peak_allocated[1])} ({_signed(self.allocated_delta)}), "
               f"peak reserved {format_bytes(self.peak_reserved[0])} -> "
               f"{format_bytes(self.peak_reserved[1])} ({_signed(self.reserved_delta)})"]
        out += [f"  note: {n}" for n in self.notes]
        out += [f"  {_signed(d.delta):>12}  {d.line}" for d in self.allocated_lines[:10]]
        return "\n".join(out)

    def _repr_html_(self) -> str:
        a, b = (html.escape(n) for n in self.names)

        def table(title: str, rows: list[LineDelta]) -> str:
            if not rows:
                return f"<p><b>{title}</b>: none</p>"
            body = "".join(
                f"<tr><td style='text-align:left'>{html.escape(d.line)}</td>"
                f"<td>{format_bytes(d.a)}</td><td>{format_bytes(d.b)}</td>"
                f"<td style='color:{'#c0392b' if d.delta > 0 else '#1e8449'}'>"
                f"{_signed(d.delta)}</td></tr>" for d in rows)
            return (f"<p><b>{title}</b></p><table><tr><th>source line</th><th>{a}</th>"
                    f"<th>{b}</th><th>change</th></tr>{body}</table>")

        notes = "".join(f"<li>{html.escape(n)}</li>" for n in self.notes)
        return (f"<div class='cudalab-diff'><p>peak allocated {format_bytes(self.peak_allocated[0])}"
                f" → {format_bytes(self.peak_allocated[1])} (<b>{_signed(self.allocated_delta)}"
                f"</b>); peak reserved {format_bytes(self.peak_reserved[0])} → "
                f"{format_bytes(self.peak_reserved[1])} (<b>{_signed(self.reserved_delta)}</b>)"
                f"</p>{f'<ul>{notes}</ul>' if notes else ''}"
                + table("at the peak allocated moment, by source line", self.allocated_lines)
                + table("appeared", self.appeared[:10]) + table("vanished", self.vanished[:10])
                + table("at the peak reserved moment (segments), by source line",
                        self.reserved_lines[:10]) + "</div>")


def _signed(n: int) -> str:
    return ("+" if n > 0 else "−" if n < 0 else "±") + format_bytes(abs(n))


#: The columns a diff reads (:func:`peak_lines` needs no others).
DIFF_COLUMNS = ("addr", "size", "action", "device", "stack")


def _as_run(x: Any) -> tuple[TraceViews | TraceIndex, str]:
    if isinstance(x, TraceViews):
        return x, x.index.source
    if isinstance(x, TraceIndex):
        return x, x.source
    if isinstance(x, (str, os.PathLike)):
        return open_trace(x, columns=DIFF_COLUMNS), os.path.basename(os.fspath(x))
    if isinstance(x, dict):
        return index_snapshot(x), "snapshot"
    raise TypeError(f"diff() takes paths, snapshot dicts or TraceIndex objects, not "
                    f"{type(x).__name__}")


def _run_summary(run: TraceViews | TraceIndex, device: int | None
                 ) -> tuple[int, int, dict[str, int], dict[str, int]]:
    if isinstance(run, TraceViews):
        return peak_by_line(run, device)
    return peak_lines(run, device)


def _kinds(ix: TraceIndex) -> Any:
    """Per entry: 1 alloc, 2 free_completed, 3 segment_alloc/map, 4 segment_free/unmap,
    0 anything else (uint8, one lookup of the action codes)."""
    table = np.zeros(max(256, len(ix.action_names)), np.uint8)
    for kind, names in ((1, ("alloc",)), (2, ("free_completed",)),
                        (3, ("segment_alloc", "segment_map")),
                        (4, ("segment_free", "segment_unmap"))):
        for name in names:
            c = ix.action_code(name)
            if c >= 0:
                table[c] = kind
    return table[ix.action]


def _open_at(rows: Any, addr: Any, opens: Any) -> Any:
    """Of ``rows`` (increasing, one device's, up to some moment) that open (``opens``) or
    close an address, the opening rows not closed by a later row of the same address, in
    row order: what :class:`TraceViews` pairs as live at the last of those rows (an opening
    row is closed by the next row of its address when that row closes)."""
    if not len(rows):
        return rows
    order = np.argsort(addr, kind="stable")  # (by address, then row)
    a = addr[order]
    o = opens[order]
    keep = o.copy()
    keep[:-1] &= (a[1:] != a[:-1]) | o[1:]
    return np.sort(rows[order[keep]])


def _peak(rows: Any, delta: Any, a: int) -> tuple[int, int]:
    """The first row of ``[a, ...)`` where a running total that moves by ``delta`` at
    ``rows`` (increasing, >= a; 0 before the first) is largest, and that total."""
    if not len(rows):
        return a, 0
    total = np.cumsum(delta)
    k = int(np.argmax(total))
    best = int(total[k])
    if rows[0] > a and best <= 0:
        return a, 0  # (the total is 0 from row a until the first move)
    return int(rows[k]), best


def _running_max(rows: Any, delta: Any, a: int) -> int:
    return _peak(rows, delta, a)[1]


def peak_lines(ix: TraceIndex, device: int | None = None
               ) -> tuple[int, int, dict[str, int], dict[str, int]]:
    """:func:`peak_by_line` of ``TraceViews(ix)``, from the index's columns alone: the
    running totals over the rows that move them, then the blocks and segments live at the
    two peaks from the rows before them (one sort of those rows' addresses), without
    pairing the whole trace."""
    if not ix.n:
        return 0, 0, {}, {}
    kind = _kinds(ix)
    edges = np.flatnonzero(np.diff(ix.device)) + 1
    bounds = [(int(ix.device[a]), a, b) for a, b in
              zip(np.concatenate(([0], edges)).tolist(), np.concatenate((edges, [ix.n])).tolist())]
    blocks = np.flatnonzero((kind == 1) | (kind == 2))
    segs = np.flatnonzero(kind >= 3)
    size = ix.size

    def moves(rows: Any, a: int, b: int, opening: int) -> tuple[Any, Any]:
        lo, hi = np.searchsorted(rows, [a, b])
        r = rows[lo:hi]
        d = size[r]
        d[kind[r] != opening] *= -1
        return r, d

    if device is None:
        device = max(bounds, key=lambda t: _running_max(*moves(blocks, t[1], t[2], 1),
                                                        t[1]))[0]
    got = next(((d, a, b) for d, a, b in bounds if d == device), None)
    if got is None:
        raise ValueError(f"no trace entries for device {device}; the trace has devices "
                         f"{[d for d, _, _ in bounds]}")
    d, a, b = got
    b_rows, b_delta = moves(blocks, a, b, 1)
    alloc_row, alloc_peak = _peak(b_rows, b_delta, a)
    s_rows, s_delta = moves(segs, a, b, 3)
    res_row, res_peak = _peak(s_rows, s_delta, a)
    line = stack_lines(ix)
    frames = ix.frames

    def label(f: int) -> str:
        return frame_label(frames[f]) if f >= 0 else "(no frames recorded)"

    sel = b_rows[:np.searchsorted(b_rows, alloc_row, side="right")]
    live = _open_at(sel, ix.addr[sel], kind[sel] == 1)
    by_alloc = _by_line(line, label, ix.stack[live], size[live])
    sel = s_rows[:np.searchsorted(s_rows, res_row, side="right")]
    held = _open_at(sel, ix.addr[sel], kind[sel] == 3)
    by_res = _by_line(line, label, ix.stack[held], size[held])
    return alloc_peak, res_peak, by_alloc, by_res


def peak_by_line(views: TraceViews, device: int | None = None
                 ) -> tuple[int, int, dict[str, int], dict[str, int]]:
    """``(peak allocated, peak reserved, bytes by line at the first, at the second)`` of
    one device's trace (default: the device with the highest peak allocated)."""
    if device is None and views.bounds:
        device = max(views.bounds, key=lambda t: int(views.allocated[t[1]:t[2]].max()))[0]
    d, a, b = views.device_range(device)
    if b == a:
        return 0, 0, {}, {}
    alloc_row = a + int(np.argmax(views.allocated[a:b]))
    res_row = a + int(np.argmax(views.reserved[a:b]))
    m = views.live_mask(alloc_row)
    by_alloc = _by_line(views.stack_line, views.line_label, views.block_stack[m],
                        views.block_size[m])
    s = ((views.seg_row <= res_row) & (views.seg_end > res_row) & (views.seg_device == d))
    seg_stack = views.index.stack[views.seg_row[s]]
    by_res = _by_line(views.stack_line, views.line_label, seg_stack, views.seg_size[s])
    return (int(views.allocated[alloc_row]), int(views.reserved[res_row]), by_alloc, by_res)


def _by_line(stack_line: Any, line_label: Any, stacks: Any, sizes: Any) -> dict[str, int]:
    lines = np.where(stacks >= 0, stack_line[np.maximum(stacks, 0)], -1)
    if not len(lines):
        return {}
    uniq, inv = np.unique(lines, return_inverse=True)
    nbytes = np.bincount(inv, weights=sizes, minlength=len(uniq))
    out: dict[str, int] = {}
    for f, nb in zip(uniq.tolist(), nbytes.tolist()):
        label = line_label(int(f))
        out[label] = out.get(label, 0) + int(nb)
    return out


#: What a run's origin notes read: the snapshot's identity and the keys of its meta data.
_Origin = tuple[dict[str, Any], dict[str, Any]]


def _origin(run: TraceViews | TraceIndex) -> _Origin:
    ix = run.index if isinstance(run, TraceViews) else run
    snap = ix.snapshot or {}
    meta: dict[str, Any] = {k: snap[k] for k in ("device_memory", "cudalab") if k in snap}
    return dict(ix.identity or {}), meta


def _summary(path: str, device: int | None) -> tuple[Any, ...]:
    """One run read and reduced to what the diff needs (run in a worker process)."""
    ix = open_trace(path, columns=DIFF_COLUMNS)
    return (*peak_lines(ix, device), _origin(ix))


def _summaries_in_parallel(paths: tuple[str, str], device: int | None
                           ) -> list[tuple[Any, ...]] | None:
    """Both runs read at once in two worker processes (None when they cannot start, or
    this process may use one CPU only: then they are read here, one after the other)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    if cpus < 2 or os.environ.get("CUDALAB_DIFF_WORKERS") == "1":
        return None
    import multiprocessing as mp
    import sys
    import threading
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    methods = mp.get_all_start_methods()
    if "fork" in methods and sys.platform.startswith("linux") and threading.active_count() == 1:
        method = "fork"  # nothing to inherit a held lock from
    else:  # (a kernel runs threads: a fresh server process forks the workers)
        method = "forkserver" if "forkserver" in methods else "spawn"
    try:
        with ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context(method)) as pool:
            futures = [pool.submit(_summary, p, device) for p in paths]
            return [f.result() for f in futures]
    except (BrokenProcessPool, OSError):
        return None


def _origin_notes(oa: _Origin, ob: _Origin, names: tuple[str, str]) -> list[str]:
    notes = []
    ia, ib = oa[0], ob[0]
    sa, sb = oa[1], ob[1]

    def allocator(ident: dict[str, Any], snap: dict[str, Any]) -> str:
        if ident.get("allocator"):
            return str(ident["allocator"])
        return "cudalab" if "cudalab" in snap else "torch"

    for key, what in (("device_name", "devices"), ("device_uuid", None)):
        va, vb = ia.get(key), ib.get(key)
        if va and vb and va != vb and what:
            notes.append(f"the runs are from different {what}: {names[0]} on {va}, "
                         f"{names[1]} on {vb}")
    ma, mb = sa.get("device_memory"), sb.get("device_memory")
    if isinstance(ma, int) and isinstance(mb, int) and ma != mb:
        notes.append(f"the devices' memory differs: {format_bytes(ma)} vs {format_bytes(mb)}")
    al, bl = allocator(ia, sa), allocator(ib, sb)
    if al != bl:
        notes.append(f"the runs come from different sources: {names[0]} from {al}'s "
                     f"allocator, {names[1]} from {bl}'s")
    sim_a = bool((sa.get("cudalab") or {}).get("simulated"))
    sim_b = bool((sb.get("cudalab") or {}).get("simulated"))
    if sim_a != sim_b:
        which = names[0] if sim_a else names[1]
        notes.append(f"{which} was recorded on cudalab's simulator, the other on a device")
    return notes


def diff(a: Any, b: Any, *, top: int = 20, device: int | None = None,
         names: tuple[str, str] | None = None, parallel: bool = True) -> TraceDiff:
    """The diff of two runs' memory (see the module documentation).

    Parameters
    ----------
    a, b : str, os.PathLike, dict or TraceIndex
        The runs: snapshot pickles, snapshot dicts or indexes already read.
    top : int, optional
        Lines kept by size of the change (default 20).
    device : int, optional
        The device compared in each (default: each trace's device with the highest peak).
    names : (str, str), optional
        What to call the runs (default: the file names).
    parallel : bool, optional
        Two files are read at once in two worker processes (default), where this process
        may use two CPUs (``CUDALAB_DIFF_WORKERS=1``: never); each returns only its peaks
        and lines.

    Returns
    -------
    TraceDiff
        The peaks, the lines that changed most, the lines that appeared or vanished, and
        notes on the runs' origins.
    """
    got = None
    if isinstance(a, (str, os.PathLike)) and isinstance(b, (str, os.PathLike)) and parallel:
        got = _summaries_in_parallel((os.fspath(a), os.fspath(b)), device)
    if got is not None:
        na, nb = (os.path.basename(os.fspath(x)) for x in (a, b))
        (pa_alloc, pa_res, a_lines, a_res, oa), (pb_alloc, pb_res, b_lines, b_res, ob) = got
    else:
        va, na = _as_run(a)
        vb, nb = _as_run(b)
        pa_alloc, pa_res, a_lines, a_res = _run_summary(va, device)
        pb_alloc, pb_res, b_lines, b_res = _run_summary(vb, device)
        oa, ob = _origin(va), _origin(vb)
    if names is None:
        names = (na, nb) if na != nb else ("a", "b")

    def deltas(x: dict[str, int], y: dict[str, int]) -> list[LineDelta]:
        rows = [LineDelta(k, x.get(k, 0), y.get(k, 0)) for k in set(x) | set(y)]
        rows = [r for r in rows if r.delta]
        rows.sort(key=lambda r: (-abs(r.delta), r.line))
        return rows

    appeared = sorted((LineDelta(k, 0, v) for k, v in b_lines.items() if k not in a_lines),
                      key=lambda r: (-r.b, r.line))
    vanished = sorted((LineDelta(k, v, 0) for k, v in a_lines.items() if k not in b_lines),
                      key=lambda r: (-r.a, r.line))
    return TraceDiff(peak_allocated=(pa_alloc, pb_alloc), peak_reserved=(pa_res, pb_res),
                     allocated_lines=deltas(a_lines, b_lines)[:top],
                     reserved_lines=deltas(a_res, b_res)[:top], appeared=appeared,
                     vanished=vanished, notes=_origin_notes(oa, ob, names), names=names)
