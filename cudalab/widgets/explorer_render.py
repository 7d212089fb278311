"""HTML of the snapshot explorer (:mod:`cudalab.widgets.explorer`): the timeline tile as SVG,
the live-set panel, search results and the segment map's input.

The timeline's mouse handlers are inline attributes (plain ipywidgets renders HTML without
scripts): each writes a command (``click F``, ``zoom F K``, ``pan D``, ``goto ROW``) into the
explorer's hidden text box, whose ``input`` event ipywidgets sends to the kernel; the kernel
answers with the next tile. Nothing else runs in the browser.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

import numpy as np

from cudalab._internal import format_bytes
from cudalab.memory_tools.trace_views import LiveSet, SearchResult, TraceViews
from cudalab.memory_tools.user_frames import frames_html

__all__ = ["SEND_JS", "live_set_html", "run_page_command", "saved_bundle", "search_html",
           "segments_for_map", "timeline_html", "view_widgets"]

#: The JavaScript of an inline handler that sends ``text`` (a JS expression) to the kernel.
SEND_JS = ("var i=this.closest('.cudalab-explorer').querySelector("
           "'.cudalab-explorer-cmd input');i.value=({text})+' '+Date.now();"
           "i.dispatchEvent(new Event('input',{{bubbles:true}}));")


def _send(text: str) -> str:
    return html.escape(SEND_JS.format(text=text), quote=True)


_FRACTION = "(event.clientX-this.getBoundingClientRect().left)/this.getBoundingClientRect().width"
_DOWN = "this.dataset.x0=event.clientX;"
_UP = ("var dx=event.clientX-Number(this.dataset.x0||event.clientX);"
       "var w=this.getBoundingClientRect().width;"
       "var f=(event.clientX-this.getBoundingClientRect().left)/w;"
       "var t=Math.abs(dx)>4?'pan '+(-dx/w).toFixed(5):'click '+f.toFixed(5);")
_WHEEL = ("event.preventDefault();var f=" + _FRACTION + ";"
          "var t='zoom '+f.toFixed(5)+' '+(event.deltaY>0?1.5:0.6667);")


def _handler(prefix: str) -> str:
    return html.escape(prefix + SEND_JS.format(text="t"), quote=True)


def _steps(x0: np.ndarray, x1: np.ndarray, top: np.ndarray,
           bottom: np.ndarray | None = None) -> str:
    """An SVG path of steps (``H``/``V`` commands, integer pixels): each bin flat from its
    ``x0`` to its ``x1`` at ``top``; with ``bottom``, closed back along it (a band)."""
    out = [f"M{x0[0]} {top[0]}"]
    for b, t in zip(x1.tolist(), top.tolist()):
        out.append(f"V{t}H{b}")
    if bottom is not None:
        for a, bt in zip(x0[::-1].tolist(), bottom[::-1].tolist()):
            out.append(f"V{bt}H{a}")
        out.append("Z")
    return "".join(out)


def timeline_html(tile: dict[str, Any], *, width: int, height: int, start: int, stop: int,
                  total: int, moment: int | None, hits: np.ndarray | None, version: int,
                  overlay: dict[str, Any] | None = None, progress: str = "") -> str:
    """The SVG of one timeline tile: allocated (area between each bin's min and max, so no
    peak is lost), reserved (line), cell markers, the chosen moment, search hits and, in diff
    mode, the other run's allocated line (``overlay``, a tile of its own)."""
    rows = tile["rows"]
    k = len(rows)
    label_w = 64
    if k == 0:
        return (f'<svg class="cudalab-explorer-timeline" data-version="{version}" '
                f'data-bins="0" width="{width + label_w}" height="{height}">'
                f'<text x="4" y="16" font-size="11">no entries {html.escape(progress)}</text></svg>')
    amax = np.asarray(tile["alloc_max"], np.float64)
    amin = np.asarray(tile["alloc_min"], np.float64)
    rmax = np.asarray(tile["reserved_max"], np.float64)
    top = max(float(rmax.max()), float(amax.max()), 1.0)
    if overlay and overlay["rows"]:
        top = max(top, float(max(overlay["alloc_max"])))
    span = max(stop - start, 1)
    xs = (np.asarray(rows, np.float64) - start) * width / span
    step = width / max(k, 1) if k < width else 0.0
    xe = xs + step

    def y(v: np.ndarray) -> np.ndarray:
        return height - 16 - v * (height - 28) / top

    ya, yb, yr = (np.round(y(v)).astype(np.int64) for v in (amax, amin, rmax))
    xs_i = np.round(xs).astype(np.int64)
    xe_i = np.maximum(np.round(xe).astype(np.int64), xs_i + (1 if step else 0))
    parts = [f'<path d="{_steps(xs_i, xe_i, ya, yb)}" fill="#9ecae1" stroke="#3182bd" '
             f'stroke-width="0.6"/>',
             f'<path d="{_steps(xs_i, xe_i, yr)}" fill="none" stroke="#e6550d" '
             f'stroke-width="1"/>']
    if overlay and overlay["rows"]:
        o_rows = np.asarray(overlay["rows"], np.float64)
        o_span = max(overlay["stop"] - overlay["start"], 1)
        ox = (o_rows - overlay["start"]) * width / o_span
        oy = y(np.asarray(overlay["alloc_max"], np.float64))
        parts.append('<polyline class="cudalab-explorer-overlay" points="'
                     + " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(ox, oy))
                     + '" fill="none" stroke="#756bb1" stroke-width="1" stroke-dasharray="3,2"/>')
    cells = tile.get("cells") or []
    n_cells = 0
    last_x = -1e9
    for row, name in cells:
        if name is None or row <= start:
            continue
        x = (row - start) * width / span
        n_cells += 1
        parts.append(f'<line class="cudalab-explorer-cell" x1="{x:.1f}" x2="{x:.1f}" y1="10" '
                     f'y2="{height - 16}" stroke="#31a354" stroke-width="0.6" opacity="0.6"/>')
        if x - last_x > 40:
            parts.append(f'<text x="{x + 2:.1f}" y="9" font-size="9" fill="#31a354">'
                         f'{html.escape(str(name))[:16]}</text>')
            last_x = x
    if hits is not None and len(hits):
        inside = hits[(hits >= start) & (hits < stop)][:2000]
        hx = (inside - start) * width / span
        parts.append('<path class="cudalab-explorer-hits" d="'
                     + "".join(f"M{x:.1f} {height - 16}v6" for x in hx)
                     + '" stroke="#756bb1" stroke-width="1"/>')
    if moment is not None and start <= moment < stop:
        mx = (moment - start) * width / span
        parts.append(f'<line class="cudalab-explorer-moment" x1="{mx:.1f}" x2="{mx:.1f}" '
                     f'y1="0" y2="{height - 16}" stroke="#d62728" stroke-width="1.5"/>')
    first_t, last_t = tile["time_us"][0], tile["time_us"][-1]
    dur = (last_t - first_t) / 1e6
    axis = (f'<text x="0" y="{height - 3}" font-size="10">entry {start:,}</text>'
            f'<text x="{width}" y="{height - 3}" font-size="10" text-anchor="end">entry '
            f'{stop:,} ({dur:.3g} s shown){html.escape(progress)}</text>')
    handlers = (f'onmousedown="{html.escape(_DOWN, quote=True)}" onmouseup="{_handler(_UP)}" '
                f'onwheel="{_handler(_WHEEL)}"')
    return (f'<svg class="cudalab-explorer-timeline" xmlns="http://www.w3.org/2000/svg" '
            f'data-version="{version}" data-start="{start}" data-stop="{stop}" '
            f'data-total="{total}" data-bins="{k}" data-cells="{n_cells}" '
            f'data-moment="{"" if moment is None else moment}" width="{width + label_w}" '
            f'height="{height}" style="font-family:sans-serif;user-select:none">'
            f'<text x="2" y="20" font-size="10">{format_bytes(int(top))}</text>'
            f'<text x="2" y="{height - 16}" font-size="10">0</text>'
            f'<g transform="translate({label_w},0)"><rect class="cudalab-explorer-hit-area" '
            f'width="{width}" height="{height - 14}" fill="#fff" stroke="#ccc" '
            f'style="cursor:crosshair" {handlers}/>'
            f'<g style="pointer-events:none">{"".join(parts)}</g>{axis}</g></svg>')


def _rows_html(title: str, rows: list[tuple[str, int, int]], total: int) -> str:
    if not rows:
        return f"<div><b>{title}</b>: nothing live</div>"
    body = "".join(
        f"<tr><td style='text-align:left;max-width:360px;overflow:hidden;"
        f"text-overflow:ellipsis;white-space:nowrap' title='{html.escape(label)}'>"
        f"{html.escape(label)}</td><td>{format_bytes(nbytes)}</td>"
        f"<td>{100 * nbytes / max(total, 1):.1f}%</td><td>{count:,}</td></tr>"
        for label, nbytes, count in rows)
    return (f"<table style='font-size:12px;margin-right:12px'><tr><th style='text-align:left'>"
            f"{title}</th><th>bytes</th><th>share</th><th>blocks</th></tr>{body}</table>")


def live_set_html(views: TraceViews, live: LiveSet) -> str:
    """The live-set panel of a moment: totals, then bytes by source line, stack, stream,
    pool and cell, and the largest blocks with their stacks (user frames first, IPython's
    folded)."""
    ix = views.index
    t0 = int(ix.time_us[views.device_range(live.device)[1]])
    head = (f"<div class='cudalab-explorer-live-head' data-row='{live.row}' "
            f"data-allocated='{live.allocated}' data-blocks='{live.n_blocks}'>"
            f"<b>moment: entry {live.row:,}</b> (cuda:{live.device}, "
            f"+{(live.time_us - t0) / 1e6:.6f} s, {html.escape(ix.action_names[ix.action[live.row]])}"
            f"): <b>{format_bytes(live.allocated)}</b> allocated in {live.n_blocks:,} blocks, "
            f"{format_bytes(live.reserved)} reserved</div>")
    tables = "".join((
        _rows_html("by source line", live.by_line[:12], live.allocated),
        _rows_html("by stream", live.by_stream, live.allocated),
        _rows_html("by pool", live.by_pool, live.allocated),
        _rows_html("by notebook cell", live.by_cell[:12], live.allocated)))
    stacks = "".join(
        f"<details><summary>{format_bytes(nbytes)} · {count:,} blocks · "
        f"{html.escape(label)}</summary><div style='margin-left:12px'>"
        f"{frames_html(ix.stack_dicts(sid))}</div></details>"
        for (label, nbytes, count), sid in zip(live.by_stack[:10], live.stack_ids[:10]))
    largest = "".join(
        f"<tr><td><code>0x{addr:x}</code></td><td>{format_bytes(size)}</td>"
        f"<td>{row:,}</td><td style='text-align:left'>{html.escape(views.stack_label(sid))}"
        f"</td></tr>" for addr, size, sid, row in live.largest[:10])
    return (f"<div class='cudalab-explorer-live'>{head}"
            f"<div style='display:flex;flex-wrap:wrap;align-items:flex-start'>{tables}</div>"
            f"<div><b>allocation sites (stacks)</b>{stacks}</div>"
            f"<table style='font-size:12px'><tr><th>largest blocks</th><th>size</th>"
            f"<th>allocated at entry</th><th>site</th></tr>{largest}</table></div>")


def search_html(views: TraceViews, found: SearchResult, shown: int = 50) -> str:
    """Search results: each row a link that jumps to its entry (``goto ROW``)."""
    ix = views.index
    if not found.count:
        return (f"<div class='cudalab-explorer-search' data-count='0'>no entries with "
                f"{html.escape(found.what)}</div>")
    items = []
    for row in found.rows[:shown].tolist():
        label = (f"entry {row:,}: {ix.action_names[ix.action[row]]} "
                 f"{format_bytes(int(ix.size[row]))} at 0x{int(ix.addr[row]):x} · "
                 f"{views.stack_label(int(ix.stack[row]))}")
        items.append(f"<li><span role='link' class='cudalab-explorer-goto' data-row='{row}' "
                     f"style='cursor:pointer;color:#1f5fa8' "
                     f"onclick=\"{_send(repr(f'goto {row}'))}\">{html.escape(label)}</span></li>")
    more = f" (first {min(shown, found.count)})" if found.count > shown else ""
    return (f"<div class='cudalab-explorer-search' data-count='{found.count}'>"
            f"{found.count:,} entries with {html.escape(found.what)}{more}"
            f"<ol style='font-size:12px;margin:2px 0'>{''.join(items)}</ol></div>")


def segments_for_map(views: TraceViews, row: int, max_segments: int = 200
                     ) -> list[dict[str, Any]]:
    """The segment map at ``row`` as snapshot segments (what
    :func:`cudalab.widgets.snapshot_render.render_segment_map` draws)."""
    ix = views.index
    d = int(ix.device[row])
    out = []
    for seg in views.segment_map_at(row, max_segments=max_segments):
        blocks = [{"address": a, "size": s, "requested_size": s, "state": "active_allocated",
                   "frames": ix.stack_dicts(k)} for a, s, k in seg["blocks"]]
        out.append({"address": seg["address"], "total_size": seg["size"], "device": d,
                    "stream": seg["stream"],
                    "segment_type": "small" if seg["size"] <= (2 << 20) else "large",
                    "segment_pool_id": (0, 0), "blocks": blocks})
    return out


def saved_bundle(data: Any, text: str, picture: str) -> dict[str, Any]:
    """An explorer's MIME bundle: ``data`` (the widget's own bundle, or its ``(data,
    metadata)`` pair) with ``text`` as ``text/plain`` and ``picture`` as ``text/html``, the
    static view a saved notebook shows where no kernel answers."""
    if isinstance(data, tuple):
        data = data[0]
    out = dict(data or {})
    out["text/plain"] = text
    out["text/html"] = f"<div>{picture}</div>"
    return out


def run_page_command(change: dict[str, Any], command: Callable[[str], Any]) -> None:
    """Run the command a page sent (an explorer's hidden text box, written by :data:`SEND_JS`:
    ``"<command> <Date.now()>"``, the time making a repeated command a change) through ``command``; a malformed one
    (ValueError, IndexError) does nothing."""
    text = str(change["new"]).rsplit(" ", 1)[0] if change["new"] else ""
    if text:
        try:
            command(text)
        except (ValueError, IndexError):
            pass  # (a malformed command from the page: nothing to do)


def view_widgets(command: Callable[[str], Any], buttons: tuple[tuple[str, str, str, str], ...]
                 ) -> tuple[Any, Any, Any, list[Any]]:
    """The view's widgets both explorers share: the summary and the timeline (HTML), the
    hidden command box that :data:`SEND_JS` writes into (its CSS class is SEND_JS's selector,
    made here once so the two cannot drift; what the page writes there runs through
    :func:`run_page_command`), and one button per ``(label, command, tooltip, CSS class)`` of
    ``buttons``; both run ``command(command text)``."""
    import ipywidgets as W

    summary = W.HTML()
    summary.add_class("cudalab-explorer-summary")
    timeline = W.HTML()
    timeline.add_class("cudalab-explorer-tl")
    box = W.Text(continuous_update=True, layout=W.Layout(display="none"))
    box.add_class("cudalab-explorer-cmd")
    box.observe(lambda change: run_page_command(change, command), "value")
    made = []
    for label, text, tip, css in buttons:
        b = W.Button(description=label, tooltip=tip,
                     layout=W.Layout(width="56px" if len(label) > 1 else "40px"))
        b.add_class(css)
        b.on_click(lambda _b, c=text: command(c))
        made.append(b)
    return summary, timeline, box, made
