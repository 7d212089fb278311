"""The SVG pictures of :class:`~cudalab.widgets.SnapshotViewer`: the segment map (one bar
per segment, blocks coloured by state, aggregated to a bounded number of paths) and the
active-memory timeline, plus the short labels both use."""

from __future__ import annotations

import html
import os

import numpy as np

from cudalab._internal import format_bytes
from cudalab.memory_tools.plot import STATE_COLORS, STATE_LABELS, segment_pool
from cudalab.memory_tools.trace_columns import stream_label
from cudalab.memory_tools.user_frames import first_user_frame

#: ``render_segment_map`` for everyone; the rest for :mod:`cudalab.widgets.snapshot_viewer`,
#: which draws its timeline and frames with them.
__all__ = ["LABEL_WIDTH", "STATE_CODES", "frame_text", "render_segment_map", "timeline_svg"]

_STATES = ("active_allocated", "active_pending_free", "inactive")
STATE_CODES = {s: i for i, s in enumerate(_STATES)}
LABEL_WIDTH = 190  # px for the row labels




def frame_text(fr: dict) -> str:
    return f"{fr.get('name', '?')} ({os.path.basename(str(fr.get('filename', '?')))}:{fr.get('line', '?')})"


# --------------------------------------------------------------------------- segment map
def _fill_gaps(seg: dict) -> list[dict]:
    """The segment's blocks sorted by address, gaps (and bytes past the last block) filled
    with inactive pseudo-blocks."""
    base = seg.get("address", 0)
    end = base + seg.get("total_size", 0)
    out: list[dict] = []
    cur = base
    for b in sorted(seg.get("blocks") or (), key=lambda b: b["address"]):
        a = b["address"]
        if a > cur:
            out.append({"address": cur, "size": a - cur, "state": "inactive", "gap": True})
        out.append(b)
        cur = max(cur, a + b["size"])
    if cur < end:
        out.append({"address": cur, "size": end - cur, "state": "inactive", "gap": True})
    return out


def render_segment_map(segments: list[dict], width: int = 640, max_rows: int = 800,
                       max_titled: int = 3000, min_block_px: float = 4.0) -> tuple[str, dict]:
    """The SVG (as an HTML string) of ``segments`` and a dict of what was drawn.

    One row per segment (the ``max_rows`` largest when there are more, in address order),
    each pixel coloured by the state holding most of its bytes, equal runs merged into one
    path per colour and row; blocks at least ``min_block_px`` wide get their own outlined
    rectangle with a tooltip (the ``max_titled`` widest).
    """
    n_all = len(segments)
    segs = segments
    if n_all > max_rows:
        keep = sorted(range(n_all), key=lambda i: -segments[i].get("total_size", 0))[:max_rows]
        segs = [segments[i] for i in sorted(keep)]
    rows = len(segs)
    row_h = 14 if rows <= 60 else 10 if rows <= 300 else 6
    gap = 3 if row_h >= 10 else 1
    info = {"rows": rows, "segments": n_all, "blocks": 0, "runs": 0, "titled": 0}
    if rows == 0:
        return ('<div class="cudalab-segmap-empty" style="color:#777">no segments '
                '(nothing allocated, or everything filtered out)</div>'), info
    max_total = max(s.get("total_size", 0) for s in segs) or 1
    px = np.array([max(int(round(width * s.get("total_size", 0) / max_total)), width // 10)
                   for s in segs], np.int64)
    row_start = np.concatenate([[0], np.cumsum(px)[:-1]])  # global pixel offset of each row
    # every block of every row in one global coordinate (pixels, as floats)
    starts: list[float] = []
    lens: list[float] = []
    codes: list[int] = []
    filled: list[list[dict]] = []
    for r, seg in enumerate(segs):
        blocks = _fill_gaps(seg)
        filled.append(blocks)
        base = seg.get("address", 0)
        scale = px[r] / (seg.get("total_size", 0) or 1)
        g0 = row_start[r]
        for b in blocks:
            starts.append(g0 + (b["address"] - base) * scale)
            lens.append(b["size"] * scale)
            codes.append(STATE_CODES.get(b.get("state", ""), 2))
        info["blocks"] += sum(1 for b in blocks if not b.get("gap"))
    st = np.array(starts)
    ln = np.array(lens)
    cd = np.array(codes, np.int64)
    total_px = int(px.sum())
    # cumulative pixel-bytes of each state before each block, and coverage per pixel
    cum = np.zeros((3, st.size + 1))
    for c in range(3):
        np.cumsum(np.where(cd == c, ln, 0.0), out=cum[c, 1:])
    edges = np.arange(total_px + 1, dtype=np.float64)
    k = np.clip(np.searchsorted(st, edges, side="right") - 1, 0, st.size - 1)
    inside = np.clip(edges - st[k], 0.0, ln[k])
    at = cum[:, k].copy()  # (3, edges)
    at[cd[k], np.arange(edges.size)] += inside
    cover = np.diff(at, axis=1)  # (3, pixels)
    color = np.argmax(cover, axis=0)
    # runs of equal colour inside a row
    row_of = np.repeat(np.arange(rows), px)
    brk = np.flatnonzero((color[1:] != color[:-1]) | (row_of[1:] != row_of[:-1])) + 1
    run_s = np.concatenate([[0], brk])
    run_e = np.concatenate([brk, [total_px]])
    info["runs"] = int(run_s.size)
    paths: dict[tuple[int, int], list[str]] = {}
    for s0, e0 in zip(run_s.tolist(), run_e.tolist()):
        r = int(row_of[s0])
        x = s0 - int(row_start[r])
        paths.setdefault((r, int(color[s0])), []).append(f"M{x} 0h{e0 - s0}v{row_h}h-{e0 - s0}z")
    # wide blocks: outlined, with a tooltip
    wide = np.flatnonzero((ln >= min_block_px) & (cd != 2) | (ln >= 4 * min_block_px))
    if wide.size > max_titled:
        wide = wide[np.argsort(-ln[wide], kind="stable")[:max_titled]]
    titled: dict[int, list[int]] = {}
    if wide.size:
        rws = np.searchsorted(row_start, st[wide], side="right") - 1
        flat_blocks = [b for blocks in filled for b in blocks]
        for i, r in zip(wide.tolist(), rws.tolist()):
            titled.setdefault(r, []).append(i)
    else:
        flat_blocks = []
    info["titled"] = int(wide.size)
    out = [f'<svg class="cudalab-segmap" data-blocks="{info["blocks"]}" data-rows="{rows}" '
           f'xmlns="http://www.w3.org/2000/svg" width="{LABEL_WIDTH + width + 4}" '
           f'height="{rows * (row_h + gap) + 2}" style="font:9px sans-serif">']
    show_labels = row_h >= 10
    for r, seg in enumerate(segs):
        y = r * (row_h + gap) + 1
        blocks = filled[r]
        by = [0, 0, 0]
        nb = 0
        for b in blocks:
            by[STATE_CODES.get(b.get("state", ""), 2)] += b["size"]
            nb += 0 if b.get("gap") else 1
        summary = (f"cuda:{seg.get('device', 0)} segment 0x{seg.get('address', 0):x}: "
                   f"{format_bytes(seg.get('total_size', 0))}, {segment_pool(seg)} pool, "
                   f"{stream_label(seg.get('stream', 0))}, {nb} blocks; allocated {format_bytes(by[0])}, "
                   f"pending free {format_bytes(by[1])}, inactive {format_bytes(by[2])}")
        out.append(f'<g transform="translate({LABEL_WIDTH},{y})"><title>{html.escape(summary)}</title>')
        out.append(f'<rect width="{px[r]}" height="{row_h}" fill="none" stroke="#999" '
                   f'stroke-width="0.5"/>')
        for c in range(3):
            d = paths.get((r, c))
            if d:
                out.append(f'<path fill="{STATE_COLORS[_STATES[c]]}" d="{"".join(d)}"/>')
        for i in titled.get(r, ()):
            b = flat_blocks[i]
            x0 = st[i] - row_start[r]
            tip = _block_tip(b, seg)
            out.append(f'<rect x="{x0:.1f}" width="{ln[i]:.1f}" height="{row_h}" '
                       f'fill="#fff" fill-opacity="0" stroke="#fff" stroke-width="0.7">'
                       f'<title>{html.escape(tip)}</title></rect>')
        out.append("</g>")
        if show_labels:
            out.append(f'<text x="2" y="{y + row_h - 3}">cuda:{seg.get("device", 0)} '
                       f'0x{seg.get("address", 0):x} {format_bytes(seg.get("total_size", 0))}</text>')
    out.append("</svg>")
    return "".join(out), info


def _block_tip(b: dict, seg: dict) -> str:
    if b.get("gap"):
        return f"free gap 0x{b['address']:x}: {format_bytes(b['size'])}"
    user = first_user_frame(b.get("frames") or [])
    top = f"; {frame_text(user)}" if user else ""
    return (f"block 0x{b['address']:x}: {format_bytes(b['size'])} ({b.get('requested_size', 0):,} B "
            f"requested), {STATE_LABELS.get(b.get('state', ''), b.get('state'))}, "
            f"{stream_label(b.get('stream', seg.get('stream', 0)))}{top}")



def timeline_svg(alloc: np.ndarray, res: np.ndarray, marker: int | None, width: int,
                  time_us: np.ndarray, height: int = 90) -> str:
    n = alloc.size
    if n == 0:
        return ""
    top = max(int(alloc.max()), int(res.max()), 1)
    cols = min(width, n)
    edges = np.linspace(0, n, cols + 1).astype(np.int64)
    edges[-1] = n
    idx = edges[:-1]
    a_hi = np.maximum.reduceat(alloc, idx)
    r_hi = np.maximum.reduceat(res, idx)
    xs = np.linspace(0, width, cols)
    ya = height - 1 - a_hi * (height - 2) / top
    yr = height - 1 - r_hi * (height - 2) / top
    area = f"M0 {height} " + " ".join(f"L{x:.0f} {y:.0f}" for x, y in zip(xs, ya)) + \
        f" L{width} {height}Z"
    line = "M" + " L".join(f"{x:.0f} {y:.0f}" for x, y in zip(xs, yr))
    mk = ""
    if marker is not None:
        mx = width * marker / n
        mk = f'<line x1="{mx:.1f}" x2="{mx:.1f}" y1="0" y2="{height}" stroke="#d62728" stroke-width="1.5"/>'
    dur = (int(time_us[-1]) - int(time_us[0])) / 1e6 if time_us.size else 0.0
    return (f'<svg class="cudalab-timeline" xmlns="http://www.w3.org/2000/svg" width="{LABEL_WIDTH + width + 4}" '
            f'height="{height + 14}" style="font:9px sans-serif">'
            f'<text x="2" y="12">peak {format_bytes(top)}</text><text x="2" y="{height}">0</text>'
            f'<g transform="translate({LABEL_WIDTH},0)"><rect width="{width}" height="{height}" '
            f'fill="none" stroke="#ccc"/><path d="{area}" fill="#c6dbef" stroke="#1f77b4" '
            f'stroke-width="0.8"/><path d="{line}" fill="none" stroke="#e6550d" stroke-width="1"/>'
            f'{mk}<text x="0" y="{height + 11}">entry 0</text><text x="{width}" '
            f'y="{height + 11}" text-anchor="end">entry {n} ({dur:.3g} s)</text></g></svg>')


