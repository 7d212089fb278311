"""Matplotlib figures of allocator snapshots, for scripts and static reports.

* :func:`plot_timeline` — allocated and reserved bytes over time, from a snapshot's history
  (``device_traces``), a ``history_frame()`` DataFrame, a snapshot pickle path, or cudalab's
  live recorded history (``None``);
* :func:`plot_segments` — one horizontal bar per segment, its blocks coloured by state
  (allocated, pending free, inactive), like pytorch.org/memory_viz's segment view.

Both return a :class:`matplotlib.figure.Figure` (or draw into ``ax`` and return its figure).
They build figures with ``matplotlib.figure.Figure`` directly, never through ``pyplot``, so
they neither need nor change a GUI backend. matplotlib (a dependency) is imported inside the
functions, and a missing one raises ImportError saying how to install it.

The helpers without ``plot_`` (:func:`load`, :func:`timeline`, :func:`filter_segments`,
:func:`segment_pool`, :func:`byte_scale`, :func:`load_matplotlib`) are shared with
:mod:`cudalab.widgets`; only :func:`load_matplotlib` imports matplotlib. Sizes for people are
written by :func:`cudalab._units.format_bytes`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from cudalab._atomic_write import atomic_write
from cudalab.memory_tools.trace_columns import (
    TraceColumns,
    device_index,
    resolve_snapshot,
    trace_of,
)

__all__ = [
    "STATE_COLORS",
    "STATE_LABELS",
    "byte_scale",
    "filter_segments",
    "load",
    "load_matplotlib",
    "plot_segments",
    "plot_timeline",
    "save_figure",
    "segment_pool",
    "timeline",
]

#: Block colours (memory_viz's convention: pending frees are red).
STATE_COLORS: dict[str, str] = {
    "active_allocated": "#1f77b4",
    "active_pending_free": "#d62728",
    "inactive": "#dddddd",
}
STATE_LABELS: dict[str, str] = {
    "active_allocated": "allocated",
    "active_pending_free": "pending free",
    "inactive": "inactive (cached, free)",
}
_SMALL_SEGMENT = 2 << 20  # torch's kSmallBuffer: the small pool's segments are 2 MiB
_SMALL_REQUEST = 1 << 20  # requests up to 1 MiB go to the small pool


def load_matplotlib() -> tuple[Any, Any]:
    """matplotlib's ``Figure`` class and its Agg canvas class, imported on first use.

    Returns
    -------
    tuple
        ``(Figure, FigureCanvasAgg)``: build figures with them directly, never through
        ``pyplot``, so no GUI backend is needed or changed.

    Raises
    ------
    ImportError
        matplotlib (a dependency of cudalab) is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - exercised only without matplotlib
        raise ImportError(
            "cudalab's plots need matplotlib, which is not installed: "
            "pip install matplotlib (a dependency of cudalab: reinstalling cudalab brings it)") from exc
    return Figure, FigureCanvasAgg


def byte_scale(peak: float) -> tuple[float, str]:
    """The unit to plot bytes in so that ``peak`` reads as a number of at least 1.

    Parameters
    ----------
    peak : float
        The largest value of the axis, in bytes.

    Returns
    -------
    tuple
        ``(divisor, unit)``: divide the bytes by ``divisor`` and label the axis ``unit``
        (``"B"``, ``"KiB"``, ``"MiB"``, ``"GiB"`` or ``"TiB"``).
    """
    for div, unit in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if peak >= div:
            return float(div), unit
    return 1.0, "B"


# --------------------------------------------------------------------------- inputs
def load(snapshot: Any = None) -> dict[str, Any]:
    """The snapshot dict for ``snapshot``: a dict (cudalab's or torch's schema) as is, a
    ``memory_snapshot()`` segment list wrapped, a path read with ``load_snapshot`` (torch's
    pickles too), ``None`` the live ``cudalab.memory._snapshot()``."""
    return resolve_snapshot(snapshot)


def segment_pool(seg: dict[str, Any]) -> str:
    """The pool of a snapshot segment as people read it: ``"small"``, ``"large"``, or a
    private pool's kind and id: ``"graph (n, 0)"`` (made by a graph capture) or
    ``"user (0, n)"`` (``graph_pool_handle()``, ``MemPool``)."""
    pool = seg.get("segment_pool_id")
    if pool and tuple(pool) != (0, 0):
        a, b = pool
        return f"{'graph' if a != 0 else 'user'} ({a}, {b})"
    t = seg.get("segment_type")
    if t in ("small", "large"):
        return t
    return "small" if seg.get("total_size", 0) == _SMALL_SEGMENT else "large"


def filter_segments(snap: dict[str, Any], device: int | None = None, stream: int | None = None,
                    pool: str | None = None) -> list[dict[str, Any]]:
    """``snap``'s segments on ``device`` / ``stream`` / in ``pool`` ("small", "large" or a
    private pool's label), each filter None for all; sorted by device, then address."""
    out = []
    for seg in snap.get("segments") or []:
        if device is not None and seg.get("device", 0) != device:
            continue
        if stream is not None and seg.get("stream", 0) != stream:
            continue
        if pool is not None and segment_pool(seg) != pool:
            continue
        out.append(seg)
    out.sort(key=lambda s: (s.get("device", 0), s.get("address", 0)))
    return out


def timeline(snapshot: Any = None, device: int | None = None) -> dict[int, dict[str, np.ndarray]]:
    """Per device with history: ``{"time_us", "allocated", "reserved"}`` numpy arrays (int64),
    one point per trace entry, in recorded order.

    ``allocated`` is the running sum of ``alloc`` minus ``free_completed`` sizes and
    ``reserved`` of ``segment_alloc``/``segment_map`` minus ``segment_free``/``segment_unmap``
    sizes, as :func:`cudalab.memory.history_frame` computes them, then lifted by what was
    already live before the first entry (history started late or the ring buffer wrapped):
    just enough that the curve never dips below 0 and ends at the snapshot's live requested
    bytes and segment sizes (for ``None``, the allocator's current statistics).
    """
    if snapshot is None:
        trace = trace_of(None, device, extras=False)
        ends = _live_ends()
    else:
        snap = load(snapshot)
        trace = TraceColumns(snap, device, extras=False)
        ends = _snapshot_ends(snap)
    out: dict[int, dict[str, np.ndarray]] = {}
    for d, a, b in trace.bounds:
        alloc = trace.allocated[a:b].copy()
        res = trace.reserved[a:b].copy()
        end_alloc, end_res = ends.get(d, (None, None))
        for arr, end in ((alloc, end_alloc), (res, end_res)):
            lift = max(0, -int(arr.min())) if arr.size else 0
            if end is not None and arr.size:
                lift = max(lift, int(end) - int(arr[-1]))
            if lift:
                arr += lift
        out[d] = {"time_us": trace.time_us[a:b].copy(), "allocated": alloc, "reserved": res}
    return out


def _snapshot_ends(snap: dict[str, Any]) -> dict[int, tuple[int, int]]:
    ends: dict[int, list[int]] = {}
    for seg in snap.get("segments") or []:
        e = ends.setdefault(seg.get("device", 0), [0, 0])
        e[1] += seg.get("total_size", 0)
        for b in seg.get("blocks") or ():
            if b.get("state") == "active_allocated" or b.get("state") == "active_pending_free":
                e[0] += b.get("requested_size") or b.get("size", 0)
    return {d: (a, r) for d, (a, r) in ends.items()}


def _live_ends() -> dict[int, tuple[int, int]]:
    from cudalab.allocator import registry

    out = {}
    for a in list(registry.active):
        st = a.memory_stats()
        out[a.device] = (st.get("requested_bytes.all.current", 0),
                         st.get("reserved_bytes.all.current", 0))
    return out


# --------------------------------------------------------------------------- figures
def _ensure_ipython_display(figure_cls: Any) -> None:
    """Inside IPython, make a returned Figure display as a PNG even without ``%matplotlib``
    (our figures never go through pyplot, which is what normally registers the formatter);
    a formatter someone already registered is kept."""
    ip_mod = sys.modules.get("IPython")
    ip = ip_mod.get_ipython() if ip_mod is not None else None
    if ip is None:
        return
    try:
        fmt = ip.display_formatter.formatters["image/png"]
        try:
            fmt.lookup_by_type(figure_cls)
            return
        except KeyError:
            pass
        from IPython.core.pylabtools import print_figure

        fmt.for_type(figure_cls, lambda fig: print_figure(fig, "png", bbox_inches="tight"))
    except Exception:  # a shell without formatters: the figure is still returned
        pass


def _new_axes(ax: Any, figsize: tuple[float, float]) -> tuple[Any, Any]:
    Figure, FigureCanvasAgg = load_matplotlib()
    if ax is not None:
        return ax.figure, ax
    _ensure_ipython_display(Figure)
    fig = Figure(figsize=figsize, dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(1, 1, 1)


def _history_arrays(obj: Any, device: int | None) -> dict[int, dict[str, np.ndarray]]:
    """Per-device arrays from a history DataFrame (``history_frame()``) or anything
    :func:`timeline` takes."""
    cols = getattr(obj, "columns", None)
    if cols is not None and "time_us" in cols and "allocated" in cols:
        df = obj
        out = {}
        devs = df["device"].to_numpy() if "device" in cols else np.zeros(len(df), np.int64)
        for d in sorted(set(devs.tolist())):
            if device is not None and d != device:
                continue
            m = devs == d
            out[int(d)] = {
                "time_us": df["time_us"].to_numpy()[m].astype(np.int64),
                "allocated": df["allocated"].to_numpy()[m].astype(np.int64),
                "reserved": (df["reserved"].to_numpy()[m].astype(np.int64) if "reserved" in cols
                             else np.zeros(int(m.sum()), np.int64)),
            }
        return out
    return timeline(obj, device)


def plot_timeline(snapshot_or_history: Any = None, *, device: Any = None, ax: Any = None,
                  x: str = "entry", figsize: tuple[float, float] = (9.0, 3.2),
                  title: str | None = None) -> Any:
    """Allocated (solid) and reserved (dashed) bytes over the history, one colour per device.

    ``snapshot_or_history``: a snapshot dict (cudalab's ``_snapshot()`` or torch's), a path
    to a snapshot pickle, a ``history_frame()`` DataFrame, or None for cudalab's live
    recorded history (start it with ``cudalab.memory.record_history()``). ``device`` keeps
    one device. ``x="entry"`` (default, as memory_viz's Active Memory Timeline) puts the
    trace entries in time order across devices on the x axis, so bursts are readable;
    ``x="time"`` uses seconds since the first entry. Returns the Figure.
    """
    if x not in ("entry", "time"):
        raise ValueError(f"x must be 'entry' or 'time', not {x!r}")
    dev = None if device is None else device_index(device)
    series = _history_arrays(snapshot_or_history, dev)
    fig, ax = _new_axes(ax, figsize)
    if not series:
        ax.text(0.5, 0.5, "no allocation history (start it with cudalab.memory.record_history())",
                ha="center", va="center", transform=ax.transAxes, fontsize=9, color="#666")
        ax.set_axis_off()
        return fig
    t0 = min(int(s["time_us"][0]) for s in series.values() if s["time_us"].size)
    peak = max(max(int(s["allocated"].max(initial=0)), int(s["reserved"].max(initial=0)))
               for s in series.values())
    div, unit = byte_scale(peak)
    colors = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")
    if x == "entry":  # rank of each entry in the merged time order (stable: devices in order)
        keys = sorted(series)
        times = np.concatenate([series[d]["time_us"] for d in keys])
        rank = np.empty(times.size, np.int64)
        rank[np.argsort(times, kind="stable")] = np.arange(times.size)
        xs, at = {}, 0
        for d in keys:
            n = series[d]["time_us"].size
            xs[d] = rank[at:at + n]
            at += n
    for k, (d, s) in enumerate(sorted(series.items())):
        t = xs[d] if x == "entry" else (s["time_us"] - t0) / 1e6
        c = colors[k % len(colors)]
        ax.step(t, s["allocated"] / div, where="post", color=c, lw=1.2, label=f"cuda:{d} allocated")
        ax.step(t, s["reserved"] / div, where="post", color=c, lw=1.0, ls="--",
                label=f"cuda:{d} reserved")
    ax.set_xlabel("trace entry (all devices, in time order)" if x == "entry"
                  else "time since the first entry (s)")
    ax.set_ylabel(unit)
    ax.set_ylim(0, max(peak / div, 1e-9) * 1.25)  # room for the legend
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8, ncols=2, frameon=False)
    simulated = isinstance(snapshot_or_history, dict) and \
        (snapshot_or_history.get("cudalab") or {}).get("simulated")
    ax.set_title(title or ("Active memory timeline" + (" (simulated)" if simulated else "")),
                 fontsize=10)
    return fig


def plot_segments(snapshot: Any = None, *, device: Any = None, stream: int | None = None,
                  pool: str | None = None, ax: Any = None, max_segments: int = 200,
                  figsize: tuple[float, float] | None = None, title: str | None = None) -> Any:
    """One horizontal bar per segment (x: offset inside the segment), blocks coloured by
    state: allocated (blue), pending free (red), inactive (grey).

    ``snapshot``: a snapshot dict (cudalab's or torch's), a segment list, a path, or None for
    the live allocator. ``device``, ``stream`` and ``pool`` ("small", "large") filter the
    segments; the ``max_segments`` largest are drawn (the title says how many were left
    out). Returns the Figure.
    """
    snap: dict[str, Any] = load(snapshot) if snapshot is not None else {"segments": _live_segments()}
    dev = None if device is None else device_index(device)
    segs = filter_segments(snap, dev, stream, pool)
    n_all = len(segs)
    if n_all > max_segments:
        keep = sorted(range(n_all), key=lambda i: -segs[i].get("total_size", 0))[:max_segments]
        segs = [segs[i] for i in sorted(keep)]
    rows = max(len(segs), 1)
    fig, ax = _new_axes(ax, figsize or (9.0, min(1.2 + 0.22 * rows, 14.0)))
    biggest = max((s.get("total_size", 0) for s in segs), default=0)
    div, unit = byte_scale(biggest)
    runs: dict[str, list[list[tuple[float, float]]]] = {k: [] for k in STATE_COLORS}
    labels = []
    for seg in segs:
        base = seg.get("address", 0)
        by_state: dict[str, list[tuple[float, float]]] = {k: [] for k in STATE_COLORS}
        for b in seg.get("blocks") or ():
            st = b.get("state", "inactive")
            by_state.setdefault(st, []).append(((b["address"] - base) / div, b["size"] / div))
        for k in runs:
            runs[k].append(by_state.get(k, []))
        labels.append(f"cuda:{seg.get('device', 0)} 0x{base:x} ({segment_pool(seg)})")
    for y in range(len(segs)):
        total = segs[y].get("total_size", 0) / div
        ax.broken_barh([(0, total)], (y - 0.4, 0.8), facecolors="white", edgecolors="#999",
                       linewidth=0.5)
        for k, color in STATE_COLORS.items():
            if runs[k][y]:
                ax.broken_barh(runs[k][y], (y - 0.4, 0.8), facecolors=color, edgecolors="white",
                               linewidth=0.3 if len(runs[k][y]) < 200 else 0)
    ax.set_yticks(range(len(segs)))
    ax.set_yticklabels(labels, fontsize=7 if rows < 60 else 5)
    ax.invert_yaxis()
    ax.set_xlabel(f"offset in segment ({unit})")
    ax.set_xlim(0, (biggest / div) * 1.01 if biggest else 1)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=c, label=STATE_LABELS[k]) for k, c in STATE_COLORS.items()],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), ncols=3, fontsize=8, frameon=False)
    shown = f"{len(segs)} of {n_all} segments" if n_all > len(segs) else f"{n_all} segments"
    simulated = isinstance(snap, dict) and (snap.get("cudalab") or {}).get("simulated")
    ax.set_title(title or f"Segments ({shown}){' (simulated)' if simulated else ''}", fontsize=10,
                 loc="left")
    return fig


def _live_segments() -> list[dict[str, Any]]:
    """The live allocator's segments without appending a ``snapshot`` history entry."""
    from cudalab.allocator import registry

    out: list[dict[str, Any]] = []
    for a in sorted(registry.active, key=lambda a: a.device):
        out.extend(a.segments())
    return out


def save_figure(fig: Any, path: str | os.PathLike[str], **kwargs: Any) -> str:
    """``fig.savefig(path, **kwargs)`` for a figure from this module, written atomically (a
    failure leaves a file that was there before intact); returns the path. The format is
    ``kwargs["format"]``, else ``path``'s extension, else matplotlib's default."""
    p = os.fspath(path)
    if kwargs.get("format") is None:
        ext = os.path.splitext(p)[1][1:].lower()
        kwargs["format"] = ext or None
    with atomic_write(p, "wb") as f:
        fig.savefig(f, **kwargs)
    return p
