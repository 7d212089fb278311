"""``SnapshotExplorer``: a memory trace of any size in the notebook, a moment in time, the
diff of two runs.

::

    from cudalab.widgets import SnapshotExplorer
    SnapshotExplorer("dump_snapshot.pickle")              # a 1 GB trace opens in seconds
    SnapshotExplorer("today.pickle", compare="yesterday.pickle")   # the diff of two runs

* **The kernel keeps the data; the browser gets tiles.** The trace is read into columns
  (:func:`cudalab.memory_tools.trace_index.open_trace`, in a thread: the first view is drawn
  from the part read so far, then redrawn as reading goes on). The timeline is one SVG of at
  most ``bins`` bins (allocated as the band between each bin's minimum and maximum, reserved
  as a line), so a view costs the same at 1k and 10M entries; zooming (the mouse wheel, or
  the buttons) and panning (drag, or the buttons) ask the kernel for the next tile.
* **A moment in time:** click the timeline (or search and click a result) to see the live
  set just after that entry: bytes by source line, by allocation site (stack, user frames
  first and IPython's folded), by stream, by pool and by notebook cell, the largest blocks,
  and the segment map then.
* **Cell markers:** the notebook cell of each entry (cudalab's history records it) is drawn
  on the timeline where it changes.
* **Search** by frame text (``model.py``, ``forward``), address (``0x7f00…``, the blocks that
  contain it) or size range (``1MiB-4MiB``, ``>=64MiB``); hits are ticks on the timeline.
* **Diff mode** (``compare=``): :func:`cudalab.memory.diff`'s table, and the other run's
  allocated line drawn over this one's.
* **Exports** (for a snapshot file or dict): the memory_viz pickle, Perfetto JSON and the
  history as parquet, as :class:`~cudalab.widgets.SnapshotViewer` writes them.

Only plain ipywidgets 8: the timeline's mouse handlers write commands into a hidden text
box that ipywidgets syncs to the kernel (see :mod:`cudalab.widgets.explorer_render`).
"""

from __future__ import annotations

import html
import os
import re
import shutil
import threading
import time
from typing import Any

import ipywidgets as W
import numpy as np

from cudalab import _internal
from cudalab._internal import format_bytes
from cudalab.memory_tools.trace_diff import TraceDiff, diff
from cudalab.memory_tools.trace_index import TraceIndex, index_snapshot, open_trace
from cudalab.memory_tools.trace_views import TraceViews
from cudalab.widgets.explorer_render import (
    live_set_html,
    saved_bundle,
    search_html,
    segments_for_map,
    timeline_html,
    view_widgets,
)
from cudalab.widgets.snapshot_render import render_segment_map

__all__ = ["PROGRESS_INTERVAL", "SnapshotExplorer", "parse_query"]

#: Seconds between two redraws of a trace still being read (the first part is drawn at once).
PROGRESS_INTERVAL = 0.5

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40,
          "tb": 10**12, "tib": 1 << 40}


def _size(text: str) -> int:
    m = _SIZE.match(text)
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def parse_query(text: str) -> dict[str, Any]:
    """A search box's text as :meth:`TraceViews.search` arguments: ``0x…`` an address,
    ``A-B`` / ``>=A`` / ``<=B`` / ``>A`` / ``<B`` a size range (``1MiB-4MiB``), anything
    else frame text. ValueError for a malformed size."""
    t = text.strip()
    if re.fullmatch(r"0x[0-9a-fA-F]+", t):
        return {"address": int(t, 16)}
    m = re.fullmatch(r"(>=|<=|>|<)\s*(.+)", t)
    if m:
        v = _size(m.group(2))
        op = m.group(1)
        lo = v + (op == ">") if op in (">=", ">") else None
        hi = v - (op == "<") if op in ("<=", "<") else None
        return {"size_range": (lo, hi)}
    m = re.fullmatch(r"([0-9.]+\s*[a-zA-Z]*)\s*-\s*([0-9.]+\s*[a-zA-Z]*)", t)
    if m:
        return {"size_range": (_size(m.group(1)), _size(m.group(2)))}
    return {"text": t}


class SnapshotExplorer(W.VBox):
    """A trace's timeline in tiles, the live set at a clicked moment, search, cell markers
    and a diff mode (see the module documentation).

    Parameters
    ----------
    source : str, os.PathLike, dict, TraceIndex or None
        A snapshot pickle (read safely, progressively), a snapshot dict, an index, or None:
        this process's recorded history now (``cudalab.memory._snapshot()``).
    compare : same, optional
        A second run: diff mode.
    device : int, optional
        The device whose trace is shown (default: the first with entries).
    width, height : int
        The timeline's size in pixels; ``bins`` (default ``width``) bins at most per view.
    wait : bool
        Read a file before returning (default: read it in a thread, drawing as it goes).
    step_bytes : int
        Bytes read by the thread at a time (default 4 MiB, about 50 ms: the reader holds the
        interpreter while it reads, so the kernel answers between steps).
    """

    def __init__(self, source: Any = None, *, compare: Any = None, device: int | None = None,
                 width: int = 900, height: int = 200, bins: int | None = None,
                 wait: bool = False, step_bytes: int = 4 << 20):
        self.width, self.height = int(width), int(height)
        self.bins = int(bins or width)
        self.device = device
        self.views: TraceViews | None = None
        self.index: TraceIndex | None = None
        self.window = (0, 0)
        self.moment: int | None = None
        self.hits: np.ndarray | None = None
        self.compare_views: TraceViews | None = None
        self.diff_result: TraceDiff | None = None
        self.error: str | None = None
        self.tiles_sent = 0
        self.bytes_sent = 0  # bytes of timeline HTML sent so far
        self._version = 0
        self._next_progress = -1e9
        self._lock = threading.RLock()
        self._source = source
        self._other = compare
        self._thread: threading.Thread | None = None
        self._summary, self._timeline, self._cmd, buttons = view_widgets(
            self.command,
            tuple((label, cmd, tip, f"cudalab-explorer-{tip.replace(' ', '-')}") for label, cmd, tip in (
                ("−", "zoom 0.5 2", "zoom out"), ("+", "zoom 0.5 0.5", "zoom in"),
                ("◀", "pan -0.25", "pan left"), ("▶", "pan 0.25", "pan right"),
                ("all", "reset", "the whole trace"),
                ("peak", "peak", "the moment of peak allocated"))))
        self._devices = W.Dropdown(description="device", layout=W.Layout(width="160px"))
        self._devices.observe(self._on_device, "value")
        self._search = W.Text(placeholder="search: frame text, 0xADDRESS, 1MiB-4MiB, >=64MiB",
                              continuous_update=False, layout=W.Layout(width="420px"))
        self._search.add_class("cudalab-explorer-query")
        self._search.observe(lambda c: self.search(c["new"]), "value")
        self._results = W.HTML()
        self._live = W.HTML("<i>click the timeline to see what was live then</i>")
        self._live.add_class("cudalab-explorer-live-panel")
        self._segmap = W.HTML()
        self._diff = W.HTML()
        self._diff.add_class("cudalab-explorer-diff")
        self._exports = self._export_row()
        super().__init__([self._summary, W.HBox([*buttons, self._devices, self._search]),
                          self._timeline, self._cmd, self._results, self._live, self._segmap,
                          self._diff, self._exports])
        self.add_class("cudalab-explorer")
        if isinstance(source, (str, os.PathLike)) and not wait:
            self._summary.value = f"reading {html.escape(os.fspath(source))} …"
            self._thread = threading.Thread(target=self._read, args=(step_bytes,),
                                            name="cudalab-explorer-read", daemon=True)
            self._thread.start()
        else:
            self._read(step_bytes)

    # ----------------------------------------------------------------------- reading
    def _read(self, step_bytes: int) -> None:
        try:
            src = self._source
            if src is None:
                from cudalab.memory_tools.snapshot import take_snapshot

                src = self._source = take_snapshot()
            if isinstance(src, TraceIndex):
                index = src
            elif isinstance(src, dict):
                index = index_snapshot(src)
            elif isinstance(src, (str, os.PathLike)):
                index = open_trace(src, on_progress=self._on_progress, step_bytes=step_bytes)
            else:
                raise TypeError(f"SnapshotExplorer takes a path, a snapshot dict or a "
                                f"TraceIndex, not {type(src).__name__}")
            views = TraceViews(index)
            compare = None
            if self._other is not None:
                self.diff_result = diff(views, self._other if not isinstance(
                    self._other, (str, os.PathLike)) else open_trace(self._other),
                    names=self._names())
                compare = self._compare_views()
            with self._lock:
                self.index, self.views, self.compare_views = index, views, compare
                d = self.device if self.device is not None else views.device_range()[0]
                self.device = d
                self._devices.options = [(f"cuda:{x}", x) for x, _, _ in views.bounds] or [
                    ("cuda:0", 0)]
                self._devices.value = d if views.bounds else 0
                _, a, b = views.device_range(d) if views.bounds else (0, 0, 0)
                self.window = (a, b)
                if self.diff_result is not None:
                    self._diff.value = self.diff_result._repr_html_()
                self._render()
        except Exception as exc:  # noqa: BLE001 - shown in the widget, never raised from a thread
            self.error = f"{type(exc).__name__}: {exc}"
            self._summary.value = (f"<span class='cudalab-explorer-error' style='color:#c0392b'>"
                                   f"cannot open the trace: {html.escape(self.error)}</span>")
            if threading.current_thread() is threading.main_thread():
                raise

    def _names(self) -> tuple[str, str]:
        def name(x: Any, dflt: str) -> str:
            return os.path.basename(os.fspath(x)) if isinstance(x, (str, os.PathLike)) else dflt

        a, b = name(self._source, "this run"), name(self._other, "the other run")
        return (a, b) if a != b else ("this run", "the other run")

    def _compare_views(self) -> TraceViews | None:
        c = self._other
        if isinstance(c, TraceViews):
            return c
        if isinstance(c, TraceIndex):
            return TraceViews(c)
        if isinstance(c, dict):
            return TraceViews(index_snapshot(c))
        if isinstance(c, (str, os.PathLike)):
            return TraceViews(open_trace(c))
        return None

    def _on_progress(self, partial: TraceIndex) -> None:
        now = time.monotonic()
        if partial.complete or now < self._next_progress:
            return  # (redrawn at most every PROGRESS_INTERVAL seconds while reading, and
            #         at most a tenth of the time: reading goes first)
        views = TraceViews(partial, pairs=False)
        if not views.bounds:
            return
        d, a, b = views.bounds[0]
        tile = views.tile(a, b, self.bins)
        pct = 100 * partial.bytes_read / max(partial.bytes_total, 1)
        self._version += 1
        self._set_timeline(timeline_html(
            tile, width=self.width, height=self.height, start=a, stop=b, total=b,
            moment=None, hits=None, version=self._version,
            progress=f" · reading: {pct:.0f}% ({partial.n:,} entries so far)"))
        self._summary.value = (f"<span class='cudalab-explorer-progress' data-rows='{partial.n}'>"
                               f"reading {html.escape(partial.source)}: {pct:.0f}%, "
                               f"{partial.n:,} entries so far</span>")
        spent = time.monotonic() - now
        self._next_progress = time.monotonic() + max(PROGRESS_INTERVAL, 9 * spent)

    def wait(self, timeout: float | None = None) -> SnapshotExplorer:
        """Wait until the trace is read (returns self; the error, if reading failed, is in
        :attr:`error` and the summary)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self

    # ----------------------------------------------------------------------- drawing
    def _set_timeline(self, value: str) -> None:
        self.tiles_sent += 1
        self.bytes_sent += len(value)
        self._timeline.value = value

    def _render(self) -> None:
        views = self.views
        if views is None:
            return
        a, b = self.window
        tile = views.tile(a, b, self.bins)
        overlay = None
        cv = self.compare_views
        if cv is not None and cv.bounds:
            _, ca, cb = cv.device_range(None)
            d0, d_a, d_b = views.device_range(self.device)
            # the other run on the same fraction of its trace as this window of this one
            span = max(d_b - d_a, 1)
            oa = ca + (a - d_a) * (cb - ca) // span
            ob = ca + (b - d_a) * (cb - ca) // span
            overlay = dict(cv.tile(oa, max(ob, oa + 1), self.bins), start=oa, stop=max(ob, oa + 1))
        self._version += 1
        self._set_timeline(timeline_html(
            tile, width=self.width, height=self.height, start=a, stop=b,
            total=views.index.n, moment=self.moment, hits=self.hits, version=self._version,
            overlay=overlay))
        ix = views.index
        peak = int(views.allocated[a:b].max()) if b > a else 0
        self._summary.value = (
            f"<span class='cudalab-explorer-ready' data-rows='{ix.n}'>"
            f"<b>{html.escape(ix.source)}</b>: {ix.n:,} entries, {ix.n_stacks:,} stacks, "
            f"{len(ix.frames):,} frames; showing entries {a:,}–{b:,} of cuda:{self.device} "
            f"(peak allocated here {format_bytes(peak)})</span>"
            + (" · <span style='color:#756bb1'>dashed: the other run</span>"
               if overlay else ""))

    def _show_moment(self, row: int) -> None:
        views = self.views
        if views is None:
            return
        self.moment = row
        live = views.live_at(row)
        self._live.value = live_set_html(views, live)
        svg, info = render_segment_map(segments_for_map(views, row), width=self.width)
        self._segmap.value = (f"<div class='cudalab-explorer-segmap' data-segments="
                              f"'{info['segments']}'><b>segment map at entry {row:,}</b> "
                              f"({info['segments']} segments){svg}</div>")

    # ----------------------------------------------------------------------- commands
    def command(self, text: str) -> None:
        """Run one timeline command: ``click F`` (the moment at fraction F of the view),
        ``zoom F K`` (scale the view by K around fraction F), ``pan D`` (move it by D views),
        ``goto ROW``, ``reset``, ``peak``."""
        with self._lock:
            views = self.views
            if views is None:
                return
            parts = text.split()
            _, d_a, d_b = views.device_range(self.device)
            a, b = self.window
            span = max(b - a, 1)
            op = parts[0]
            if op == "click":
                f = min(max(float(parts[1]), 0.0), 1.0)
                self._show_moment(min(a + int(f * span), b - 1))
            elif op == "zoom":
                f, k = float(parts[1]), float(parts[2])
                centre = a + f * span
                new = max(int(span * k), min(50, d_b - d_a))
                na = int(centre - f * new)
                na = min(max(na, d_a), max(d_b - new, d_a))
                self.window = (na, min(na + new, d_b))
            elif op == "pan":
                shift = int(float(parts[1]) * span)
                na = min(max(a + shift, d_a), max(d_b - span, d_a))
                self.window = (na, na + span)
            elif op == "goto":
                row = int(parts[1])
                if not d_a <= row < d_b:
                    d = int(views.index.device[row])
                    self.device = d
                    _, d_a, d_b = views.device_range(d)
                    self.window = (d_a, d_b)
                a, b = self.window
                if not a <= row < b:
                    half = max((b - a) // 2, 25)
                    na = min(max(row - half, d_a), max(d_b - 2 * half, d_a))
                    self.window = (na, min(na + 2 * half, d_b))
                self._show_moment(row)
            elif op == "reset":
                self.window = (d_a, d_b)
            elif op == "peak":
                row = d_a + int(np.argmax(views.allocated[d_a:d_b]))
                self._show_moment(row)
            else:
                raise ValueError(f"unknown command {op!r}")
            self._render()

    def _on_device(self, change: dict[str, Any]) -> None:
        views = self.views
        if views is None or change["new"] is None or change["new"] == self.device:
            return
        with self._lock:
            self.device = int(change["new"])
            _, a, b = views.device_range(self.device)
            self.window = (a, b)
            self.moment = None
            self._render()

    def search(self, query: str) -> None:
        """Search (see :func:`parse_query`); hits are listed (click one to jump to it) and
        drawn as ticks on the timeline."""
        views = self.views
        if views is None:
            return
        if not query.strip():
            self.hits = None
            self._results.value = ""
            self._render()
            return
        try:
            found = views.search(**parse_query(query), limit=100_000)
        except ValueError as exc:
            self._results.value = f"<span style='color:#c0392b'>{html.escape(str(exc))}</span>"
            return
        self.hits = found.rows
        self._results.value = search_html(views, found)
        self._render()

    # ----------------------------------------------------------------------- display
    def __repr__(self) -> str:
        ix = self.views.index if self.views is not None else None
        what = (f"{ix.source}: {ix.n:,} entries" if ix is not None
                else f"reading, error: {self.error}" if self.error else "reading")
        return f"SnapshotExplorer({what})"

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return saved_bundle(super()._repr_mimebundle_(**kwargs), repr(self),
                            f"{self._summary.value}{self._timeline.value}"
                            f"{self._live.value if self.moment is not None else ''}"
                            f"{self._diff.value}")

    # ----------------------------------------------------------------------- exports
    def _export_row(self) -> W.HBox:
        self._export_status = W.HTML()
        row = []
        for label, kind in (("memory_viz pickle", "pickle"), ("Perfetto JSON", "perfetto"),
                            ("history parquet", "parquet")):
            b = W.Button(description=label, layout=W.Layout(width="150px"))
            b.on_click(lambda _b, k=kind: self.export(k))
            row.append(b)
        return W.HBox([*row, self._export_status])

    def export(self, kind: str, path: str | None = None) -> str:
        """Write the trace as ``kind``: ``"pickle"`` (memory_viz, protocol 4), ``"perfetto"``
        or ``"parquet"`` (the history frame); returns the path written (atomically, by the
        same writers as :class:`~cudalab.widgets.SnapshotViewer`)."""
        from cudalab.memory_tools.export import history_frame, save_frame
        from cudalab.memory_tools.perfetto import export_perfetto
        from cudalab.memory_tools.trace_io import dumps_snapshot

        if kind not in ("pickle", "perfetto", "parquet"):
            raise ValueError(f"unknown export {kind!r}: pickle, perfetto or parquet")
        src = self._source
        if not isinstance(src, (str, os.PathLike, dict)):
            raise TypeError("exports need the snapshot file or dict the explorer was given")
        stem = (os.path.splitext(os.fspath(src))[0] if isinstance(src, (str, os.PathLike))
                else f"explorer_{int(time.time())}")
        out = path or {"pickle": f"{stem}.memory_viz.pickle", "perfetto": f"{stem}.json",
                       "parquet": f"{stem}.history.parquet"}[kind]
        if kind == "pickle":
            if isinstance(src, dict):
                _internal.write_bytes_atomic(out, dumps_snapshot(src))
            else:  # the file is already one (cudalab's or torch's): copied, then renamed
                tmp = f"{out}.tmp{os.getpid()}"
                try:
                    shutil.copyfile(src, tmp)
                    os.replace(tmp, out)
                finally:
                    if os.path.exists(tmp):
                        os.remove(tmp)
        elif kind == "perfetto":
            export_perfetto(out, src)
        else:
            out = save_frame(history_frame(src), out)
        self._export_status.value = f"wrote {html.escape(out)}"
        return out
