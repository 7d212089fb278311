"""``LanesExplorer``: several traces (every rank of a job) as stacked lanes on one time axis.

::

    from cudalab.widgets import LanesExplorer
    LanesExplorer({"rank 0": snap0, "rank 1": snap1}, errors={"rank 2": "did not answer"})
    ClusterDashboard(directory)   # its "Snapshots of every rank" button opens one

Each lane is one trace's device timeline (:mod:`cudalab.memory_tools.trace_lanes`), labelled
(the cluster view: host, rank and GPU), drawn as the single-trace
:class:`~cudalab.widgets.SnapshotExplorer` draws its timeline (allocated as the band between
each bin's minimum and maximum, reserved as a line) on one time axis and one byte scale
shared by every lane, so the ranks compare at a glance. A lane without a trace (a rank that
did not answer) stays in its place, labelled "lost" with the reason.

The same controls as the single-trace explorer: the mouse wheel zooms, a drag pans (every
lane together), the buttons zoom, pan and show everything; a click on a lane picks that
moment, drawn across every lane, and shows that lane's live set then (the single-trace
explorer's panel). Each view is a tile of at most ``bins`` bins per lane, computed in the
kernel; the browser gets one SVG. Only plain ipywidgets 8 (the handlers write commands into a
hidden text box, as :mod:`cudalab.widgets.explorer_render` describes).
"""

from __future__ import annotations

import html
import threading
from collections.abc import Mapping
from typing import Any

import ipywidgets as W
import numpy as np

from cudalab._internal import format_bytes
from cudalab.memory_tools.trace_lanes import TraceLanes, trace_lanes
from cudalab.widgets.explorer_render import (
    SEND_JS,
    live_set_html,
    saved_bundle,
    view_widgets,
)

__all__ = ["LanesExplorer", "lanes_html"]

_LABEL_W = 220
_DOWN = "this.dataset.x0=event.clientX;"
_UP = ("var dx=event.clientX-Number(this.dataset.x0||event.clientX);"
       "var w=this.getBoundingClientRect().width;"
       "var f=(event.clientX-this.getBoundingClientRect().left)/w;"
       "var t=Math.abs(dx)>4?'pan '+(-dx/w).toFixed(5):'click '+f.toFixed(5)+' {lane}';")
_WHEEL = ("event.preventDefault();var f=(event.clientX-this.getBoundingClientRect().left)/"
          "this.getBoundingClientRect().width;"
          "var t='zoom '+f.toFixed(5)+' '+(event.deltaY>0?1.5:0.6667);")
#: The narrowest view, microseconds.
MIN_SPAN_US = 50


def _handler(prefix: str) -> str:
    return html.escape(prefix + SEND_JS.format(text="t"), quote=True)


def _path(x0: np.ndarray, x1: np.ndarray, top: np.ndarray,
          bottom: np.ndarray | None = None) -> str:
    out = [f"M{x0[0]} {top[0]}"]
    at = int(x0[0])
    for a, b, t in zip(x0.tolist(), x1.tolist(), top.tolist()):
        out.append(f"V{t}H{b}" if a == at else f"H{a}V{t}H{b}")  # (bins usually abut)
        at = b
    if bottom is not None:
        for a, b, bt in zip(x0[::-1].tolist(), x1[::-1].tolist(), bottom[::-1].tolist()):
            out.append(f"V{bt}H{a}" if b == at else f"H{b}V{bt}H{a}")
            at = a
        out.append("Z")
    return "".join(out)


def lanes_html(lanes: TraceLanes, tiles: list[dict[str, Any]], *, start: float, stop: float,
               width: int, lane_height: int, moment: tuple[int, float] | None,
               version: int) -> str:
    """The SVG of the lanes between two times (``tiles``: each lane's
    :meth:`TraceLanes.tile`), one byte scale for every lane; ``moment``: (lane, time) of
    the moment picked, drawn across every lane."""
    span = max(stop - start, 1e-9)
    top = 1.0
    for tile in tiles:
        if tile["rows"]:
            top = max(top, max(tile["alloc_max"]), max(tile["reserved_max"]))
    base = lanes.bounds[0]
    parts = []
    for i, (x, tile) in enumerate(zip(lanes.lanes, tiles)):
        y0 = i * lane_height
        inner = lane_height - 6
        label = html.escape(x.label)
        if x.lost:
            parts.append(
                f'<g class="cudalab-lanes-lane cudalab-lanes-lost" data-lane="{i}" '
                f'data-label="{label}" data-lost="1" data-bins="0" '
                f'transform="translate(0,{y0})"><text x="2" y="{inner // 2 + 4}" '
                f'font-size="11" fill="#777"><tspan font-weight="bold">{label}</tspan></text>'
                f'<rect x="{_LABEL_W}" y="1" width="{width}" height="{inner}" fill="#f4f4f4" '
                f'stroke="#ccc"/><text x="{_LABEL_W + 8}" y="{inner // 2 + 4}" font-size="11" '
                f'fill="#c0392b">lost: {html.escape(x.error[:160])}</text></g>')
            continue
        k = len(tile["rows"])
        peak = int(max(tile["alloc_max"])) if k else 0
        body = []
        if k:
            def y(v: list[int], inner: int = inner) -> np.ndarray:
                return np.round(inner - np.asarray(v, np.float64) * (inner - 4) / top
                                ).astype(np.int64)

            xs = np.round((np.asarray(tile["x_us"], np.float64) - start) * width / span
                          ).astype(np.int64)
            xe = np.maximum(np.round((np.asarray(tile["end_us"], np.float64) - start)
                                     * width / span).astype(np.int64), xs + 1)
            body.append(f'<path d="{_path(xs, xe, y(tile["alloc_max"]), y(tile["alloc_min"]))}" '
                        f'fill="#9ecae1" stroke="#3182bd" stroke-width="0.6"/>')
            body.append(f'<path d="{_path(xs, xe, y(tile["reserved_max"]))}" fill="none" '
                        f'stroke="#e6550d" stroke-width="1"/>')
        handlers = (f'onmousedown="{html.escape(_DOWN, quote=True)}" '
                    f'onmouseup="{_handler(_UP.format(lane=i))}" onwheel="{_handler(_WHEEL)}"')
        parts.append(
            f'<g class="cudalab-lanes-lane" data-lane="{i}" data-label="{label}" '
            f'data-lost="0" data-bins="{k}" data-entries="{x.entries}" '
            f'transform="translate(0,{y0})">'
            f'<text x="2" y="{inner // 2}" font-size="11"><tspan font-weight="bold">{label}'
            f'</tspan></text><text x="2" y="{inner // 2 + 13}" font-size="10" fill="#555">'
            f'cuda:{x.device} · {x.entries:,} entries · peak here {format_bytes(peak)}</text>'
            f'<g transform="translate({_LABEL_W},0)"><rect class="cudalab-explorer-hit-area" '
            f'y="1" width="{width}" height="{inner}" fill="#fff" stroke="#ccc" '
            f'style="cursor:crosshair" {handlers}/><g style="pointer-events:none">'
            f'{"".join(body)}</g></g></g>')
    n = len(lanes.lanes)
    height = n * lane_height + 18
    if moment is not None and start <= moment[1] <= stop:
        mx = _LABEL_W + (moment[1] - start) * width / span
        parts.append(f'<line class="cudalab-explorer-moment" x1="{mx:.1f}" x2="{mx:.1f}" '
                     f'y1="0" y2="{n * lane_height}" stroke="#d62728" stroke-width="1.5" '
                     f'style="pointer-events:none"/>')
    axis = (f'<text x="{_LABEL_W}" y="{height - 4}" font-size="10">+{(start - base) / 1e6:.6g} s'
            f'</text><text x="{_LABEL_W + width}" y="{height - 4}" font-size="10" '
            f'text-anchor="end">+{(stop - base) / 1e6:.6g} s ({span / 1e6:.3g} s shown; one '
            f'scale: {format_bytes(int(top))} full)</text>')
    return (f'<svg class="cudalab-lanes-timeline" xmlns="http://www.w3.org/2000/svg" '
            f'data-version="{version}" data-lanes="{n}" data-start="{start:.0f}" '
            f'data-stop="{stop:.0f}" width="{_LABEL_W + width + 8}" height="{height}" '
            f'style="font-family:sans-serif;user-select:none">{"".join(parts)}{axis}</svg>')


class LanesExplorer(W.VBox):
    """Traces as stacked lanes on one time axis (see the module documentation).

    Parameters
    ----------
    sources : mapping of str to snapshot dict, path, TraceIndex, TraceViews or None; or TraceLanes
        The lanes, top first, by label (a None value: a lane without a trace; ``errors``
        says why).
    errors : mapping of str to str, optional
        Why a lane has no trace (its label may be absent from ``sources``: it is then
        added below them).
    devices : mapping of str to int, optional
        The device each lane shows (default: its first with entries).
    keys : mapping of str to object, optional
        Each lane's key (:attr:`~cudalab.memory_tools.trace_lanes.Lane.key`; the cluster
        view: the rank).
    width, lane_height, bins : int
        The timeline's width (740: with the 220-pixel label column, a notebook's width)
        and each lane's height in pixels; bins per lane and view
        (default ``width // 2``: two pixels a bin, so a view of 8 lanes stays a few hundred
        KB of SVG; each bin keeps its minimum and maximum, so no peak is lost).
    """

    def __init__(self, sources: Mapping[str, Any] | TraceLanes, *,
                 errors: Mapping[str, str] | None = None,
                 devices: Mapping[str, int] | None = None, keys: Mapping[str, Any] | None = None,
                 width: int = 740, lane_height: int = 64, bins: int | None = None):
        self.width, self.lane_height = int(width), int(lane_height)
        self.bins = int(bins or width // 2)
        if self.width < 50 or self.lane_height < 24 or self.bins < 1:
            raise ValueError(f"LanesExplorer: width {width}, lane_height {lane_height} and "
                             f"bins {bins} must be at least 50, 24 and 1")
        #: The lanes shown.
        self.lanes = (sources if isinstance(sources, TraceLanes)
                      else trace_lanes(sources, errors, devices=devices, keys=keys))
        #: The view: (first, last) time shown, microseconds.
        self.window: tuple[float, float] = tuple(map(float, self.lanes.bounds))  # type: ignore[assignment]
        #: The moment picked: (lane, time in microseconds), or None.
        self.moment: tuple[int, float] | None = None
        #: The row of the picked lane at the moment (None: before its first entry).
        self.moment_row: int | None = None
        self.tiles_sent = 0
        self._version = 0
        self._lock = threading.RLock()
        self._summary, self._timeline, self._cmd, buttons = view_widgets(
            self.command, tuple(
                (label, cmd, tip, f"cudalab-lanes-{name}") for label, cmd, tip, name in (
                    ("−", "zoom 0.5 2", "zoom out", "zoom-out"),
                    ("+", "zoom 0.5 0.5", "zoom in", "zoom-in"),
                    ("◀", "pan -0.25", "pan left", "pan-left"),
                    ("▶", "pan 0.25", "pan right", "pan-right"),
                    ("all", "reset", "every lane's whole trace", "reset"),
                    ("peak", "peak", "the moment of the highest peak of any lane", "peak"))))
        self._live = W.HTML("<i>click a lane to see what was live there then</i>")
        self._live.add_class("cudalab-explorer-live-panel")
        super().__init__([self._summary, W.HBox(buttons), self._timeline, self._cmd,
                          self._live])
        self.add_class("cudalab-explorer")
        self.add_class("cudalab-explorer-lanes")
        self._render()

    # ----------------------------------------------------------------------- drawing
    def tiles(self) -> list[dict[str, Any]]:
        """Every lane's tile of the current view (:meth:`TraceLanes.tile`)."""
        a, b = self.window
        return [self.lanes.tile(i, a, b, self.bins) for i in range(len(self.lanes))]

    def _render(self) -> None:
        a, b = self.window
        self._version += 1
        self.tiles_sent += 1
        self._timeline.value = lanes_html(self.lanes, self.tiles(), start=a, stop=b,
                                          width=self.width, lane_height=self.lane_height,
                                          moment=self.moment, version=self._version)
        lanes = self.lanes.lanes
        lost = [x.label for x in lanes if x.lost]
        self._summary.value = (
            f"<span class='cudalab-explorer-ready' data-lanes='{len(lanes)}' "
            f"data-lost='{len(lost)}'><b>{len(lanes)} lane{'s' if len(lanes) != 1 else ''}</b>"
            f", {sum(x.entries for x in lanes):,} entries on one time axis"
            + (f"; <span style='color:#c0392b'>lost: {html.escape(', '.join(lost))}</span>"
               if lost else "") + "</span>")

    # ----------------------------------------------------------------------- commands
    def command(self, text: str) -> None:
        """Run one command: ``click F LANE`` (the moment at fraction F of the view, in lane
        LANE), ``zoom F K`` (scale the view by K around fraction F), ``pan D`` (move it by
        D views), ``reset``, ``peak`` (:meth:`peak`, picked)."""
        with self._lock:
            parts = text.split()
            lo, hi = map(float, self.lanes.bounds)
            a, b = self.window
            span = max(b - a, 1.0)
            op = parts[0]
            if op == "click":
                f = min(max(float(parts[1]), 0.0), 1.0)
                self.pick(int(parts[2]), a + f * span)
                return
            if op == "zoom":
                f, k = float(parts[1]), float(parts[2])
                new = min(max(span * k, min(MIN_SPAN_US, hi - lo)), hi - lo)
                na = min(max(a + f * span - f * new, lo), hi - new)
                self.window = (na, na + new)
            elif op == "pan":
                na = min(max(a + float(parts[1]) * span, lo), max(hi - span, lo))
                self.window = (na, na + span)
            elif op == "reset":
                self.window = (lo, hi)
            elif op == "peak":
                found = self.peak()
                if found is not None:
                    self.pick(*found)
                return
            else:
                raise ValueError(f"unknown command {op!r}")
            self._render()

    def peak(self) -> tuple[int, float] | None:
        """``(lane, time)`` of the highest allocated level of any lane (the first lane and
        moment reaching it); None when no lane has entries."""
        best: tuple[int, int, float] | None = None
        for i, x in enumerate(self.lanes.lanes):
            if x.views is None or not x.entries:
                continue
            levels = x.views.allocated[x.start:x.stop]
            k = int(np.argmax(levels))
            if best is None or int(levels[k]) > best[0]:
                best = (int(levels[k]), i, float(x.views.index.time_us[x.start + k]))
        return None if best is None else (best[1], best[2])

    def pick(self, lane: int, time_us: float) -> int | None:
        """Pick the moment ``time_us`` in lane ``lane``: drawn across every lane, and that
        lane's live set then shown below; returns the lane's row then (None before its
        first entry or in a lost lane).

        Raises
        ------
        IndexError
            No such lane.
        """
        if not 0 <= lane < len(self.lanes):
            raise IndexError(f"lane {lane}: the explorer has {len(self.lanes)} lanes")
        with self._lock:
            x = self.lanes.lanes[lane]
            self.moment = (lane, float(time_us))
            row = self.moment_row = self.lanes.row_at(lane, time_us)
            base = self.lanes.bounds[0]
            head = (f"<div class='cudalab-lanes-moment' data-lane='{lane}'><b>"
                    f"{html.escape(x.label)}</b> at +{(time_us - base) / 1e6:.6f} s</div>")
            if x.views is None:
                self._live.value = head + (f"<div style='color:#c0392b'>lost: "
                                           f"{html.escape(x.error)}</div>")
            elif row is None:
                self._live.value = head + "<i>before this lane's first entry</i>"
            else:
                self._live.value = head + live_set_html(x.views, x.views.live_at(row))
            self._render()
            return row

    # ----------------------------------------------------------------------- display
    def __repr__(self) -> str:
        return f"LanesExplorer({self.lanes!r})"

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return saved_bundle(super()._repr_mimebundle_(**kwargs), repr(self),
                            f"{self._summary.value}{self._timeline.value}"
                            f"{self._live.value if self.moment is not None else ''}")
