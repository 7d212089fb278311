"""``ClusterDashboard``: every rank of a job, live, in one notebook (ipywidgets 8).

::

    from cudalab.widgets import ClusterDashboard
    dash = ClusterDashboard("/tmp/myjob")   # the directory the ranks publish into
    dash                                    # shows it; dash.close() stops it

It watches the ranks of one job (:func:`cudalab.cluster.watch`) and shows

* a header: the job, its ranks, the lost ones, the rank with the least headroom;
* a live panel per rank and allocator (host, rank, GPU): :class:`RankPanel`, the
  single-process :class:`~cudalab.widgets.MemoryDashboard`'s rendering of the rank's samples
  (its bar, time series, NVML figures and counts), titled with the rank and its host,
  flagged "least headroom" or "lost";
* a table of every rank's peaks (allocated and reserved, per device and allocator);
* a button that fetches every rank's snapshot and opens them in the
  :class:`~cudalab.widgets.LanesExplorer`, one lane per rank on one time axis, each labelled
  with its host, rank and GPU (:func:`rank_lanes`); a rank that did not answer (or is lost)
  keeps its lane, marked lost with the reason. The snapshots stay in
  :attr:`ClusterDashboard.snapshots`, the explorer in :attr:`ClusterDashboard.explorer`.

A panel's figures come from the watch, which the ranks feed at 2 Hz; nothing here talks
to a rank but the snapshot button (a signed request, its answer decoded by the bounded
loader). The "Reset peaks" and "Empty cache" buttons of a panel are disabled: those act in
the rank's own process.

A saved notebook shows a static HTML table (``_repr_mimebundle_``): each rank's figures and
flags, and the peaks.
"""

from __future__ import annotations

import contextlib
import html
import os
import threading
import time
import weakref
from typing import Any

import ipywidgets as W

from cudalab._internal import format_bytes
from cudalab.cluster.records import RankRecords
from cudalab.cluster.watching import ClusterWatch, Headroom, RankSource, watch
from cudalab.memory_tools.column_index import index_columns
from cudalab.memory_tools.samples import DeviceSample
from cudalab.memory_tools.trace_lanes import TraceLanes, lane, lost_lane
from cudalab.widgets.dashboard import MemoryDashboard

__all__ = ["ClusterDashboard", "RankPanel", "close_all", "rank_label", "rank_lanes"]

_live: weakref.WeakSet[ClusterDashboard] = weakref.WeakSet()

_FLAG_C, _LOST_C = "#d62728", "#777"


class RankPanel(MemoryDashboard):
    """One rank's (and allocator's) live panel: a :class:`MemoryDashboard` over a
    :class:`~cudalab.cluster.watching.RankSource`, titled with the rank and its host and
    flagged by :class:`ClusterDashboard` (:attr:`flag`)."""

    def __init__(self, source: RankSource, interval: float = 0.5, window: int = 240,
                 start: bool = True):
        #: "" or the flag shown in the title ("least headroom", "lost").
        self.flag = ""
        #: The rank shown.
        self.rank = source.rank
        super().__init__(devices=source.devices(), interval=interval, window=window,
                         source=source, start=start, fallback=False, max_rate=4.0)
        for button in (self._reset, self._empty):
            button.disabled = True
            button.tooltip = "acts in the rank's own process: call it there"
        self._snap.tooltip = "fetch this rank's snapshot and open it below"
        self.add_class("cudalab-cluster-rank")

    def _title_html(self, dev: Any, level: str, frac: float) -> str:
        source = self.source
        assert isinstance(source, RankSource)
        flag = ""
        if self.flag:
            color = _LOST_C if self.flag == "lost" else _FLAG_C
            flag = (f' <span class="cudalab-cluster-flag" style="background:{color};color:#fff;'
                    f'padding:0 5px;border-radius:3px">{html.escape(self.flag)}</span>')
        head = (f'<div class="cudalab-cluster-rank-title" data-rank="{self.rank}">'
                f'<b>rank {self.rank}</b> &middot; {html.escape(source.host())} &middot; '
                f'{html.escape(source.allocator)}{flag}</div>')
        return head + super()._title_html(dev, level, frac)


class ClusterDashboard(W.VBox):
    """The live view of one job's ranks (see the module documentation).

    Parameters
    ----------
    directory : str or os.PathLike, or ClusterWatch
        The cluster directory the ranks publish into, or a watch already made.
    job : str, optional
        The job (default: the newest one in the directory).
    interval : float
        Seconds between two refreshes (default 0.5, the ranks' own rate).
    window : int
        Samples kept per panel (its time series spans ``window * interval`` seconds).
    start : bool
        Start refreshing now (else call :meth:`start`).
    """

    def __init__(self, directory: str | os.PathLike[str] | ClusterWatch, job: str | None = None,
                 interval: float = 0.5, window: int = 240, start: bool = True):
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        super().__init__()
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not (
                0.05 <= interval <= 3600):
            raise ValueError(f"ClusterDashboard: interval is {interval!r:.40}, expected seconds "
                             "in [0.05, 3600]")
        self._own_watch = not isinstance(directory, ClusterWatch)
        #: The watch read.
        self.watch: ClusterWatch = (directory if isinstance(directory, ClusterWatch)
                                    else watch(directory, job))
        self.interval = float(interval)
        self.window = int(window)
        #: Panels by (rank, allocator), in the order they appeared.
        self.panels: dict[tuple[int, str], RankPanel] = {}
        #: The snapshots the button fetched last, by rank.
        self.snapshots: dict[int, dict[str, Any]] = {}
        #: The lanes explorer the button opened last (None before).
        self.explorer: Any = None
        #: The least-headroom rank at the last refresh (None before any sample).
        self.least: Headroom | None = None
        self._lock = threading.RLock()
        self._header = W.HTML()
        self._header.add_class("cudalab-cluster-header")
        self._peaks = W.HTML()
        self._peaks.add_class("cudalab-cluster-peaks")
        self._fetch = W.Button(description="Snapshots of every rank", icon="camera",
                               tooltip="fetch every live rank's snapshot (signed request, "
                                       "bounded decoding) and open it below",
                               layout=W.Layout(width="auto"))
        self._fetch.on_click(_weak_callback(self, "fetch_snapshots"))
        self._status = W.HTML()
        self._panels_box = W.VBox()
        self._snapshot_box = W.VBox()
        self.children = (self._header, W.HBox([self._fetch, self._status]), self._panels_box,
                         self._peaks, self._snapshot_box)
        self.add_class("cudalab-cluster-dashboard")
        _live.add(self)
        self.refresh()
        if start:
            self.start()

    # ------------------------------------------------------------------ refreshing
    def start(self) -> None:
        """Start the refresh thread (no-op when it runs or the dashboard is closed)."""
        if self._closed or (self._thread is not None and self._thread.is_alive()):
            return
        self._stop.clear()
        self._thread = threading.Thread(target=_refresher, args=(weakref.ref(self), self._stop),
                                        name="cudalab-cluster-dashboard", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the refresh thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def refresh(self) -> None:
        """Follow the watch now: panels for new ranks, flags, the header and the peaks."""
        with self._lock:
            if self._closed:
                return
            every = self.watch.samples(include_lost=True)
            lost = set(self.watch.lost())
            self.least = self.watch.least_headroom()
            for rank, samples in every.items():
                for allocator in dict.fromkeys(s.identity.allocator for s in samples):
                    if (rank, allocator) not in self.panels:
                        source = self.watch.rank_source(rank, allocator)
                        self.panels[rank, allocator] = RankPanel(
                            source, interval=self.interval, window=self.window)
            for (rank, _), panel in self.panels.items():
                panel.flag = ("lost" if rank in lost else "least headroom"
                              if self.least is not None and rank == self.least.rank else "")
            ordered = tuple(self.panels[k] for k in sorted(self.panels))
            if self._panels_box.children != ordered:
                self._panels_box.children = ordered
            header = self._header_html(every, lost)
            if self._header.value != header:
                self._header.value = header
            table = self._peaks_html()
            if self._peaks.value != table:
                self._peaks.value = table

    def _header_html(self, every: dict[int, Any], lost: set[int]) -> str:
        w = self.watch
        least = self.least
        parts = [f"<b>job</b> {html.escape(w.job or '(none yet)')}",
                 f"<b>{len(every) - len(lost)}</b> rank{'s' if len(every) - len(lost) != 1 else ''}"
                 " live"]
        if lost:
            parts.append(f'<span style="color:{_FLAG_C}">lost: '
                         f'{", ".join(map(str, sorted(lost)))}</span>')
        if least is not None:
            parts.append(f'least headroom: <b>rank {least.rank}</b> (cuda:{least.device}, '
                         f'{format_bytes(max(least.headroom, 0))} free of '
                         f'{format_bytes(least.capacity)})')
        if w.rejected:
            parts.append(f"{w.rejected} message(s) with a bad signature dropped")
        stale = len(w.stale())
        if stale:
            parts.append(f"{stale} stale connection file(s) ignored")
        return (f'<div class="cudalab-cluster-summary" data-ranks="{len(every)}" '
                f'data-lost="{len(lost)}">' + " &middot; ".join(parts) + "</div>")

    def _peaks_html(self) -> str:
        rows = self.watch.peaks()
        if not rows:
            return "<i>no rank has published yet</i>"
        head = ("<tr><th>rank</th><th>host</th><th>device</th><th>allocator</th>"
                "<th>peak allocated</th><th>peak reserved</th><th>allocated</th>"
                "<th>reserved</th><th>capacity</th><th></th></tr>")
        body = []
        for r in rows:
            flag = ("lost" if r.lost else "least headroom"
                    if self.least is not None and r.rank == self.least.rank
                    and r.device == self.least.device else "")
            body.append(
                f'<tr data-rank="{r.rank}"><td>{r.rank}</td><td>{html.escape(r.host)}</td>'
                f"<td>cuda:{r.device}</td><td>{html.escape(r.allocator)}</td>"
                f"<td>{format_bytes(r.peak_allocated)}</td><td>{format_bytes(r.peak_reserved)}</td>"
                f"<td>{format_bytes(r.allocated)}</td><td>{format_bytes(r.reserved)}</td>"
                f"<td>{format_bytes(r.capacity)}</td><td>{flag}</td></tr>")
        return ('<table class="cudalab-cluster-peaks-table" style="font-size:12px">'
                f"<caption style='text-align:left'><b>per-rank peaks</b></caption>{head}"
                + "".join(body) + "</table>")

    # ------------------------------------------------------------------ snapshots
    def fetch_snapshots(self, _: Any = None) -> dict[int, dict[str, Any]]:
        """Fetch every live rank's snapshot (a signed request each, answers decoded by the
        bounded loader), keep them in :attr:`snapshots` and open them below in a
        :class:`~cudalab.widgets.LanesExplorer`, one lane per rank (every rank the watch
        knows, a lost or silent one marked lost in its lane); returns the snapshots."""
        from cudalab.widgets.explorer_lanes import LanesExplorer

        got = self.watch.fetch(("snapshot",))
        errors = dict(self.watch.fetch_errors)
        for rank in self.watch.lost():
            errors.setdefault(rank, "the rank stopped publishing")
        self.snapshots = {k: r.snapshot for k, r in sorted(got.items())
                          if r.snapshot is not None}
        note = f"{len(self.snapshots)} snapshot(s) fetched"
        if errors:
            note += "; " + "; ".join(f"rank {k}: {v}" for k, v in sorted(errors.items()))
        self._status.value = f'<span style="font-size:12px">{html.escape(note)}</span>'
        lanes = rank_lanes(got, errors, self.watch.samples(include_lost=True))
        if len(lanes):
            explorer = LanesExplorer(lanes)
            for widget in self._snapshot_box.children:
                with contextlib.suppress(Exception):
                    widget.close()
            self.explorer = explorer
            self._snapshot_box.children = (explorer,)
        return self.snapshots

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop refreshing, close the panels and (when it made it) the watch."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        for panel in self.panels.values():
            with contextlib.suppress(Exception):
                panel.close()
        if self._own_watch:
            self.watch.close()
        super().close()

    def to_html(self) -> str:
        """The dashboard now as static HTML: the header and the peaks table."""
        with self._lock:
            return self._header.value + self._peaks.value

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        # (ipywidgets' own bundle as ipywidgets 8 builds it, with the static HTML beside it;
        # not through repr(), which would walk every child widget)
        data: dict[str, Any] = {"text/plain": repr(self.watch), "text/html": self.to_html()}
        if self._view_name is not None and self.model_id:
            data["application/vnd.jupyter.widget-view+json"] = {
                "version_major": 2, "version_minor": 0, "model_id": self.model_id}
        return data


def rank_label(rank: int, host: str, samples: list[DeviceSample] | None,
               device: int | None = None) -> str:
    """A rank's lane label: ``rank R · host · cuda:D (GPU name)`` (the device and its name
    from the rank's latest sample of ``device``, or its first)."""
    text = f"rank {rank} · {host}" if host else f"rank {rank}"
    chosen = [s for s in samples or () if device is None or s.device == device]
    if chosen:
        s = chosen[0]
        text += f" · cuda:{s.device}"
        if s.identity.device_name:
            text += f" ({s.identity.device_name})"
    elif device is not None and device >= 0:
        text += f" · cuda:{device}"
    return text


def rank_lanes(records: dict[int, RankRecords], errors: dict[int, str],
               samples: dict[int, list[DeviceSample]] | None = None) -> TraceLanes:
    """One lane per rank, in rank order: each rank of ``records`` whose snapshot came
    (the device of its latest sample when that device has entries), labelled with its host,
    rank and GPU (:func:`rank_label`); each rank of ``errors`` (or of ``samples`` without
    records) as a lost lane saying why. A snapshot that cannot be read is a lost lane too."""
    samples = samples or {}
    out = []
    for rank in sorted(set(records) | set(errors) | set(samples)):
        mine = samples.get(rank) or []
        r = records.get(rank)
        host = r.identity.host if r is not None else (mine[0].identity.host if mine else "")
        device = mine[0].device if mine else None
        if r is None or r.sent_snapshot is None:
            why = errors.get(rank, "no snapshot came")
            out.append(lost_lane(rank_label(rank, host, mine), why, rank))
            continue
        try:
            made = lane(rank_label(rank, host, mine), _rank_trace(r, f"rank {rank}"),
                        device=device, key=rank)
        except (ValueError, TypeError) as exc:  # (shown in its lane, not raised)
            out.append(lost_lane(rank_label(rank, host, mine),
                                 f"cannot read its snapshot: {exc}"[:300], rank))
            continue
        if made.device != device:  # (its trace is on another device: say which)
            made = lane(rank_label(rank, host, mine, made.device), made.views, key=rank,
                        device=made.device)
        out.append(made)
    return TraceLanes(out)


def _rank_trace(records: RankRecords, source: str) -> Any:
    """A rank's trace for its lane: indexed from the columns it travelled as when every
    entry did (no entry dict built), else its snapshot."""
    sent = records.sent_snapshot
    assert sent is not None
    if records.trace_columns and not any(sent.get("device_traces") or ()):
        return index_columns(sent, records.trace_columns, source=source)
    return records.snapshot


def close_all() -> int:
    """Close every cluster dashboard not yet closed; returns how many."""
    open_ones = [d for d in list(_live) if not d._closed]
    for d in open_ones:
        d.close()
    return len(open_ones)


def _weak_callback(owner: Any, method: str) -> Any:
    ref = weakref.ref(owner)

    def call(*args: Any) -> Any:
        target = ref()
        return None if target is None else getattr(target, method)(*args)

    return call


def _refresher(ref: weakref.ref[ClusterDashboard], stop: threading.Event) -> None:
    """The refresh thread: :meth:`ClusterDashboard.refresh` every ``interval`` seconds until
    ``stop`` or the dashboard is gone; never raises (an error shows in the status line)."""
    while True:
        d = ref()
        if d is None or d._closed:
            return
        interval = d.interval
        del d
        if stop.wait(interval):
            return
        d = ref()
        if d is None:
            return
        try:
            d.refresh()
        except Exception as exc:  # noqa: BLE001 - shown, never raised from the thread
            with contextlib.suppress(Exception):
                d._status.value = f'<span style="color:{_FLAG_C}">{html.escape(str(exc))}</span>'
        del d
        time.sleep(0)
