"""``SnapshotViewer``: an allocator snapshot in the notebook (the views memory_viz offers).

::

    from cudalab.widgets import SnapshotViewer
    SnapshotViewer()                          # the live allocator (cudalab.memory._snapshot())
    SnapshotViewer("dump_snapshot.pickle")    # a saved snapshot, cudalab's or torch's

* **Segment map**: one bar per segment (length proportional to its size, at least a tenth of
  the width), blocks coloured by state: allocated (blue), pending free (red), inactive
  (grey). Blocks narrower than a few pixels are aggregated: each pixel takes the state that
  holds most of its bytes, and runs of equal pixels are drawn as one SVG path, so a snapshot
  of 10k (or 100k) blocks costs a bounded number of elements. Hovering a bar shows the
  segment's summary, hovering a wide block its size, requested size, stream and top frame.
* **Block details**: pick a segment and a block (or type an address) for the block's full
  record and stack.
* **Filters**: device, stream and pool (small, large, and the graph pools "graph (n, 0)" and
  user pools "user (0, n)" of CUDA graphs and MemPools; the history tags their entries).
* **History** (when the snapshot has ``device_traces``): the active-memory timeline
  (allocated area, reserved line, entries in recorded order across devices) and a scrubber:
  the segment map then shows the allocator state after that entry, rebuilt by undoing the
  later entries from the final snapshot (as memory_viz does), with checkpoints so scrubbing
  stays fast.
* **Export**: parquet (``snapshot_frame``/``history_frame``; needs pyarrow, which
  ``cudalab[parquet]`` brings: without a parquet engine the frames are written as CSV, with a
  ``RuntimeWarning`` and a note in the export line saying so), the memory_viz pickle
  (protocol 4) and Perfetto JSON. Each file is replaced atomically: a failed export (a value
  that cannot be written, named in the export line; Ctrl-C) leaves an earlier file intact.
* **Checked input**: a snapshot (dict or file) is checked against torch's schema; a
  malformed one is a ``SnapshotLoadError`` naming the entry and the key.

Only plain ipywidgets 8 (HTML with inline SVG, Dropdown, IntSlider, Button), so it renders
wherever ipywidgets does (tested: JupyterLab 4, Notebook 7, html-manager; see docs/widgets.md).
"""

from __future__ import annotations

import html
import random
import time
import warnings
from typing import Any

import ipywidgets as W

from cudalab import _internal
from cudalab._internal import format_bytes
from cudalab.memory_tools.libraries import source_snapshot
from cudalab.memory_tools.plot import (
    STATE_COLORS,
    STATE_LABELS,
    filter_segments,
    load,
    segment_pool,
)
from cudalab.memory_tools.trace_columns import stream_label
from cudalab.memory_tools.user_frames import fold_frames, is_tool_frame
from cudalab.widgets.snapshot_history import SnapshotHistory
from cudalab.widgets.snapshot_render import (
    LABEL_WIDTH,
    STATE_CODES,
    frame_text,
    render_segment_map,
    timeline_svg,
)

__all__ = ["SnapshotViewer", "demo_snapshot"]

_SMALL_SEGMENT = 2 << 20
_ALL = "all"  # the filters' "no filter" value (a Dropdown shows None as an empty box)


def _folded_html(frames: list[dict], folded: int) -> str:
    """The notebook machinery's frames of a stack, in a ``<details>`` (one click away)."""
    hidden = "".join(f"<div>{html.escape(frame_text(x))}</div>" for x in frames
                     if is_tool_frame(x))
    return (f"<details class='cudalab-folded' style='display:inline'><summary>{folded} "
            f"IPython/ipykernel frame{'s' if folded != 1 else ''} folded</summary>{hidden}"
            "</details>")


# --------------------------------------------------------------------------- the widget
class SnapshotViewer(W.VBox):
    """A memory snapshot's segment map, block details, filters, history scrubber and
    exports (see the module documentation).

    ``snapshot``: a snapshot dict (``cudalab.memory._snapshot()`` or torch's
    ``torch.cuda.memory._snapshot()``), a ``memory_snapshot()`` segment list, a path to a
    pickle (read with the safe ``load_snapshot``), or None for the live allocator now.
    ``source``: with no ``snapshot``, which live allocator: ``"cudalab"`` (the default),
    ``"torch"`` (``torch.cuda.memory._snapshot()``, its stacks and trace included),
    ``"auto"`` (torch's when the process runs torch and cudalab's allocator holds
    nothing, else cudalab's) or a :class:`~cudalab.memory_tools.samples.SampleSource`; a
    source that cannot be read raises
    :class:`~cudalab.memory_sources.SourceUnavailableError` saying why.
    ``width``: pixels of the longest segment bar; ``max_rows``: segments drawn at most (the
    largest; the summary says how many were left out).
    """

    def __init__(self, snapshot: Any = None, *, width: int = 640, max_rows: int = 800,
                 prefix: str = "memory_snapshot", source: Any = None):
        if source is not None:
            if snapshot is not None:
                raise ValueError("SnapshotViewer: give a snapshot or a source, not both")
            snapshot = source_snapshot(source)  # (None: cudalab's live allocator)
        super().__init__()
        t0 = time.perf_counter()
        self.snapshot = load(snapshot)
        self.width = int(width)
        self.max_rows = int(max_rows)
        snap = self.snapshot
        segs = snap.get("segments") or []
        traces = snap.get("device_traces") or []
        self.history = SnapshotHistory(snap) if any(traces) else None
        devices = sorted({s.get("device", 0) for s in segs} |
                         {d for d, tr in enumerate(traces) if tr})
        streams = sorted({s.get("stream", 0) for s in segs})
        # pools of the segments, and the graph and user pools the history saw (gone since)
        pools = sorted({segment_pool(s) for s in segs} | {
            segment_pool({"segment_pool_id": e["segment_pool_id"]})
            for e in (self.history.entries if self.history else ()) if e.get("segment_pool_id")})
        lay = W.Layout(width="auto")
        self._device = W.Dropdown(options=[("all", _ALL)] + [(f"cuda:{d}", d) for d in devices],
                                  value=_ALL, description="device", layout=W.Layout(width="170px"))
        self._stream = W.Dropdown(options=[("all", _ALL)] + [(stream_label(s), s) for s in streams],
                                  value=_ALL, description="stream", layout=W.Layout(width="210px"))
        self._pool = W.Dropdown(options=[("all", _ALL)] + [(p, p) for p in pools],
                                value=_ALL, description="pool", layout=W.Layout(width="190px"))
        self._summary = W.HTML()
        self._map = W.HTML(layout=W.Layout(max_height="460px", overflow="auto"))
        self._timeline = W.HTML()
        self._entry = W.HTML()
        n = self.history.n if self.history else 0
        self._scrub = W.IntSlider(value=n, min=0, max=n, step=1, continuous_update=False,
                                  description="after entry", readout=True,
                                  layout=W.Layout(width=f"{LABEL_WIDTH + self.width + 100}px"),
                                  style={"description_width": "initial"})
        self._seg_pick = W.Dropdown(description="segment", layout=W.Layout(width="420px"))
        self._block_pick = W.Dropdown(description="block", layout=W.Layout(width="420px"))
        self._addr = W.Text(placeholder="0x7f... (an address inside a block)", description="find",
                            continuous_update=False, layout=W.Layout(width="330px"))
        self._detail = W.HTML()
        self._prefix = W.Text(value=prefix, description="save as", layout=W.Layout(width="300px"))
        self._btn_parquet = W.Button(description="Parquet", icon="table", layout=lay,
                                     tooltip="snapshot_frame (and history_frame) as .parquet")
        self._btn_pickle = W.Button(description="memory_viz pickle", icon="download", layout=lay,
                                    tooltip="pickle (protocol 4) for pytorch.org/memory_viz")
        self._btn_perfetto = W.Button(description="Perfetto", icon="line-chart", layout=lay,
                                      tooltip="Chrome/Perfetto trace JSON of the history")
        self._export_status = W.HTML()
        self._btn_parquet.on_click(lambda _: self._run_export(self.export_parquet))
        self._btn_pickle.on_click(lambda _: self._run_export(self.export_memory_viz))
        self._btn_perfetto.on_click(lambda _: self._run_export(self.export_perfetto))
        for w in (self._device, self._stream, self._pool):
            w.observe(self._on_filter, "value")
        self._scrub.observe(self._on_scrub, "value")
        self._seg_pick.observe(self._on_seg_pick, "value")
        self._block_pick.observe(self._on_block_pick, "value")
        self._addr.observe(self._on_addr, "value")
        legend = " ".join(f'<span style="color:{c}">&#9632;</span> {STATE_LABELS[s]}'
                          for s, c in STATE_COLORS.items())
        kids: list[W.Widget] = [
            self._summary,
            W.HBox([self._device, self._stream, self._pool,
                    W.HTML(f'<span style="font-size:11px;margin-left:8px">{legend}</span>')],
                   layout=W.Layout(flex_flow="row wrap", align_items="center")),
        ]
        if self.history is not None:
            kids += [self._timeline, self._scrub, self._entry]
        kids += [self._map,
                 W.HBox([self._seg_pick, self._block_pick], layout=W.Layout(flex_flow="row wrap")),
                 self._addr, self._detail,
                 W.HBox([self._prefix, self._btn_parquet, self._btn_pickle, self._btn_perfetto],
                        layout=W.Layout(flex_flow="row wrap", align_items="center")),
                 self._export_status]
        self.children = tuple(kids)
        self.add_class("cudalab-snapshot-viewer")
        self._view_segments: list[dict] = []
        self._timeline_cache: tuple | None = None
        self.render_seconds = 0.0
        self._render(timeline=True)
        self.build_seconds = time.perf_counter() - t0

    # ----------------------------------------------------------------- state
    @property
    def filters(self) -> dict[str, Any]:
        """The filters in effect (None: all)."""
        return {k: (None if w.value == _ALL else w.value)
                for k, w in (("device", self._device), ("stream", self._stream), ("pool", self._pool))}

    @property
    def position(self) -> int:
        """The scrubber: the segment map shows the state after this many trace entries."""
        return self._scrub.value

    @position.setter
    def position(self, i: int) -> None:
        self._scrub.value = max(0, min(int(i), self._scrub.max))

    def segments(self) -> list[dict]:
        """The segments shown now (filters and scrubber applied)."""
        return list(self._view_segments)

    # ----------------------------------------------------------------- rendering
    def _current_segments(self) -> list[dict]:
        if self.history is not None and self.position < self.history.n:
            base = {"segments": self.history.state_at(self.position)}
        else:
            base = self.snapshot
        f = self.filters
        return filter_segments(base, f["device"], f["stream"], f["pool"])

    def _render(self, timeline: bool = False) -> None:
        t0 = time.perf_counter()
        segs = self._current_segments()
        self._view_segments = segs
        svg, info = render_segment_map(segs, self.width, self.max_rows)
        self.render_seconds = time.perf_counter() - t0
        self.last_render = info
        by = [0, 0, 0]
        for s in segs:
            for b in s.get("blocks") or ():
                by[STATE_CODES.get(b.get("state", ""), 2)] += b.get("size", 0)
        reserved = sum(s.get("total_size", 0) for s in segs)
        shown = (f"{info['rows']} of {info['segments']} segments (the largest)"
                 if info["rows"] < info["segments"] else f"{info['segments']} segments")
        ours = self.snapshot.get("cudalab")
        ours = ours if isinstance(ours, dict) else {}
        sim = ours.get("simulated")
        # what the snapshot can and cannot show (a CuPy recording's: only what it saw)
        note = ours.get("note") if isinstance(ours.get("note"), str) else ""
        note_html = (f'<br><span class="cudalab-snap-note" style="font-size:11px">'
                     f'{html.escape(note[:2000])}</span>' if note else "")
        when = ("final state" if self.history is None or self.position >= self.history.n
                else f"state after entry {self.position} of {self.history.n}")
        self._summary.value = (
            f'<div class="cudalab-snap-summary"><b>Memory snapshot</b>{" (simulated)" if sim else ""}'
            f'{_origin_html(self.snapshot.get("identity"))}: '
            f'{shown}, {info["blocks"]:,} blocks, reserved {format_bytes(reserved)}: allocated '
            f'{format_bytes(by[0])}, pending free {format_bytes(by[1])}, inactive {format_bytes(by[2])} '
            f'&middot; {when}{note_html}</div>')
        self._map.value = svg
        if timeline or self.history is not None:
            self._render_timeline(recompute=timeline)
        self._fill_pickers(segs)

    def _render_timeline(self, recompute: bool) -> None:
        h = self.history
        if h is None:
            return
        f = self.filters
        if recompute or self._timeline_cache is None:
            self._timeline_cache = h.totals(f["device"], f["stream"], f["pool"])
        alloc, res = self._timeline_cache
        i = self.position
        self._timeline.value = timeline_svg(alloc, res, i, self.width, h.time_us)
        if i == 0:
            txt = "before the first entry"
        else:
            e = h.entries[i - 1]
            shown, folded = fold_frames(e.get("frames") or [])
            stack = "".join(f"<br>&nbsp;&nbsp;{html.escape(frame_text(x))}" for x in shown[:8])
            if folded:
                stack += _folded_html(e.get("frames") or [], folded)
            extra = (f", device free {format_bytes(e['device_free'])}" if "device_free" in e else "")
            t_rel = (int(h.time_us[i - 1]) - int(h.time_us[0])) / 1e6
            txt = (f"entry {i - 1}: <b>{html.escape(str(e.get('action')))}</b> cuda:{int(h.dev[i - 1])} "
                   f"addr 0x{e.get('addr', 0):x} size {format_bytes(e.get('size', 0))} "
                   f"{stream_label(e.get('stream', 0))} at +{t_rel:.6f} s{extra}{stack}")
        self._entry.value = f'<div class="cudalab-snap-entry" style="font-size:12px">{txt}</div>'

    def _fill_pickers(self, segs: list[dict]) -> None:
        opts = [(f"cuda:{s.get('device', 0)} 0x{s.get('address', 0):x} "
                 f"{format_bytes(s.get('total_size', 0))} {segment_pool(s)} ({len(s.get('blocks') or ())} blocks)",
                 k) for k, s in enumerate(segs[:2000])]
        self._seg_pick.options = opts
        self._seg_pick.value = opts[0][1] if opts else None
        if not opts:
            self._block_pick.options = []
            self._detail.value = ""

    # ----------------------------------------------------------------- events
    def _on_filter(self, _: Any) -> None:
        self._render(timeline=True)

    def _on_scrub(self, _: Any) -> None:
        self._render(timeline=False)

    def _on_seg_pick(self, change: dict) -> None:
        k = change["new"]
        if k is None or k >= len(self._view_segments):
            self._block_pick.options = []
            return
        seg = self._view_segments[k]
        blocks = seg.get("blocks") or []
        self._block_pick.options = [
            (f"0x{b['address']:x} {format_bytes(b['size'])} {STATE_LABELS.get(b.get('state'), '?')}", j)
            for j, b in enumerate(blocks[:2000])]
        self._block_pick.value = 0 if blocks else None
        # (explicitly: the value may not have changed, and then nothing is observed)
        self._detail.value = (self._block_detail(blocks[0], seg) if blocks
                              else self._segment_detail(seg))

    def _on_block_pick(self, change: dict) -> None:
        j = change["new"]
        k = self._seg_pick.value
        if j is None or k is None or k >= len(self._view_segments):
            return
        seg = self._view_segments[k]
        self._detail.value = self._block_detail(seg["blocks"][j], seg)

    def _on_addr(self, change: dict) -> None:
        text = str(change["new"]).strip()
        if not text:
            return
        try:
            addr = int(text, 0)
        except ValueError:
            self._detail.value = f'<span style="color:#d62728">not an address: {html.escape(text)}</span>'
            return
        found = self.find(addr)
        if found is None:
            self._detail.value = f"no segment shown contains 0x{addr:x}"
            return
        k, j = found
        self._seg_pick.value = k
        if j is not None:
            self._block_pick.value = j

    def find(self, addr: int) -> tuple[int, int | None] | None:
        """(segment index, block index or None) of the shown block containing ``addr``."""
        for k, s in enumerate(self._view_segments):
            a = s.get("address", 0)
            if a <= addr < a + s.get("total_size", 0):
                for j, b in enumerate(s.get("blocks") or ()):
                    if b["address"] <= addr < b["address"] + b["size"]:
                        return k, j
                return k, None
        return None

    def _segment_detail(self, seg: dict) -> str:
        return (f"segment 0x{seg.get('address', 0):x} on cuda:{seg.get('device', 0)}: "
                f"{format_bytes(seg.get('total_size', 0))}, {segment_pool(seg)} pool, "
                f"{stream_label(seg.get('stream', 0))}, no blocks")

    def _block_detail(self, b: dict, seg: dict) -> str:
        fr = b.get("frames") or []
        shown, folded = fold_frames(fr)
        stack = "".join(f"<li>{html.escape(frame_text(x))}</li>" for x in shown) or "<li>(no frames: "\
            "record history with a context to capture stacks)</li>"
        if folded:
            stack += f"<li style='list-style:none'>{_folded_html(fr, folded)}</li>"
        return (f'<div class="cudalab-snap-detail" style="font-size:12px">'
                f'<b>block 0x{b["address"]:x}</b> &middot; {STATE_LABELS.get(b.get("state", ""), b.get("state"))}'
                f' &middot; size {b["size"]:,} B ({format_bytes(b["size"])}) &middot; requested '
                f'{b.get("requested_size", 0):,} B &middot; '
                f'{stream_label(b.get("stream", seg.get("stream", 0)))} &middot; segment '
                f'0x{seg.get("address", 0):x} (cuda:{seg.get("device", 0)}, {segment_pool(seg)} pool, '
                f'{format_bytes(seg.get("total_size", 0))})<ul style="margin:2px 0">{stack}</ul></div>')

    # ----------------------------------------------------------------- exports
    def _run_export(self, fn: Any) -> None:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                paths = fn(self._prefix.value or "memory_snapshot")
            notes = ""
            for w in caught:  # the exports' own notes (CSV instead of parquet) go on the line
                if issubclass(w.category, RuntimeWarning):
                    notes += f'<br><span style="color:#e6550d">{html.escape(str(w.message))}</span>'
                else:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            self._export_status.value = "wrote " + ", ".join(
                f"<code>{html.escape(p)}</code>" for p in paths) + notes
        except Exception as exc:
            self._export_status.value = (f'<span style="color:#d62728">{type(exc).__name__}: '
                                         f'{html.escape(str(exc))}</span>')

    def export_parquet(self, prefix: str = "memory_snapshot") -> list[str]:
        """``PREFIX_blocks.parquet`` (``snapshot_frame``) and, with history,
        ``PREFIX_history.parquet`` (``history_frame``); returns the paths. Needs a parquet
        engine for pandas (pyarrow: ``pip install 'cudalab[parquet]'``); without one the same
        frames are written as ``.csv`` and a ``RuntimeWarning`` says so (the button shows it
        in the export line)."""
        from cudalab.memory_tools.export import history_frame, save_frame, snapshot_frame

        frames = [("blocks", snapshot_frame(self.snapshot))]
        if self.history is not None:
            frames.append(("history", history_frame(self.snapshot)))
        out = []
        missing = ""
        for name, df in frames:
            path = f"{prefix}_{name}.parquet"
            try:  # (atomically: a failed export leaves an earlier file intact)
                save_frame(df, path, "parquet")
            except ImportError as exc:  # pandas found no parquet engine
                missing = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                path = f"{prefix}_{name}.csv"
                save_frame(df, path, "csv")
            out.append(path)
        if missing:
            warnings.warn(f"no parquet engine for pandas ({missing}): wrote CSV instead "
                          f"({', '.join(out)}); pip install 'cudalab[parquet]' (pyarrow) for parquet",
                          RuntimeWarning, stacklevel=2)
        return out

    def export_memory_viz(self, prefix: str = "memory_snapshot") -> list[str]:
        """``PREFIX.pickle`` for pytorch.org/memory_viz (plain types, protocol 4)."""
        from cudalab.memory_tools.trace_io import dumps_snapshot

        path = prefix if prefix.endswith(".pickle") else f"{prefix}.pickle"
        _internal.write_bytes_atomic(path, dumps_snapshot(self.snapshot))
        return [path]

    def export_perfetto(self, prefix: str = "memory_snapshot") -> list[str]:
        """``PREFIX.perfetto.json.gz``: the history as a Chrome/Perfetto trace."""
        from cudalab.memory_tools.perfetto import export_perfetto

        path = prefix if prefix.endswith((".json", ".json.gz")) else f"{prefix}.perfetto.json.gz"
        return [export_perfetto(path, self.snapshot)]

    # ----------------------------------------------------------------- display
    def _text(self) -> str:
        info = self.last_render
        return (f"SnapshotViewer({info['segments']} segments, {info['blocks']} blocks"
                f"{', ' + str(self.history.n) + ' trace entries' if self.history else ''})")

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        data = super()._repr_mimebundle_(**kwargs) or {}
        if isinstance(data, tuple):
            data = data[0]
        data = dict(data)
        data["text/plain"] = self._text()
        if len(self._map.value) <= 300_000:  # a static picture for saved notebooks
            data["text/html"] = (f'<div>{self._summary.value}{self._timeline.value}'
                                 f'{self._map.value}</div>')
        return data


# --------------------------------------------------------------------------- demo data
def _origin_html(identity: Any) -> str:
    """`` from HOST, pid P, rank R of N, DEVICE NAME`` for a snapshot's ``identity`` dict
    (checked when the snapshot was read); "" for a snapshot without one (torch's)."""
    if not isinstance(identity, dict):
        return ""
    parts = [f"{identity.get('host')}", f"pid {identity.get('pid')}"]
    if identity.get("rank") is not None:
        size = identity.get("world_size")
        parts.append(f"rank {identity['rank']}" + ("" if size is None else f" of {size}"))
    if identity.get("device_name"):
        parts.append(f"{identity['device_name']}")
    return (f' <span class="cudalab-snap-origin" data-pid="{html.escape(str(identity.get("pid")))}">'
            f'from {html.escape(", ".join(parts))}</span>')


def demo_snapshot(n_blocks: int = 10_000, *, devices: int = 1, seed: int = 0,
                   streams: tuple[int, ...] = (0, 0x5A1E0), simulated: bool = True) -> dict:
    """A consistent snapshot dict with about ``n_blocks`` blocks (allocated, pending free and
    inactive), densely packed into 2 MiB small and 20-64 MiB large segments, with the trace
    that produced it (for tests, benchmarks and the tour notebook)."""
    rng = random.Random(seed)
    t = 1_700_000_000_000_000
    traces: list[list[dict]] = [[] for _ in range(devices)]
    segments: list[dict] = []
    stacks = [[{"filename": f"/home/user/proj/{f}.py", "line": 10 + 3 * k, "name": fn}]
              for k, (f, fn) in enumerate([("model", "forward"), ("layers", "attention"),
                                           ("optim", "step"), ("data", "collate")])]
    next_addr = [0x7F0000000000 + (d << 40) for d in range(devices)]
    count = 0
    k = 0
    while count < n_blocks:
        d = k % devices
        k += 1
        small = rng.random() < 0.7
        total = _SMALL_SEGMENT if small else (20 + 2 * rng.randrange(23)) << 20
        stream = streams[rng.randrange(len(streams))]
        base = next_addr[d]
        next_addr[d] += total + (2 << 20)
        tr = traces[d]
        t += rng.randrange(1, 20)
        tr.append({"action": "segment_alloc", "addr": base, "size": total, "stream": stream,
                   "time_us": t, "frames": [], "compile_context": "", "user_metadata": ""})
        blocks: list[dict] = []
        cur = base
        while cur < base + total:
            req = (int(2 ** (9 + 7 * rng.random())) if small else int(2 ** (17 + 5 * rng.random())))
            size = (req + 511) // 512 * 512
            if cur + size > base + total:
                break
            fr = stacks[rng.randrange(len(stacks))]
            t += rng.randrange(1, 20)
            tr.append({"action": "alloc", "addr": cur, "size": req, "stream": stream, "time_us": t,
                       "frames": fr, "compile_context": "", "user_metadata": ""})
            blocks.append({"address": cur, "size": size, "requested_size": req,
                           "state": "active_allocated", "frames": fr})
            cur += size
        for b in blocks:
            r = rng.random()
            if r < 0.35:
                t += rng.randrange(1, 20)
                ev = {"addr": b["address"], "size": b["requested_size"], "stream": stream,
                      "frames": b["frames"], "compile_context": "", "user_metadata": ""}
                tr.append(dict(ev, action="free_requested", time_us=t))
                if r < 0.32:
                    tr.append(dict(ev, action="free_completed", time_us=t))
                    b["state"] = "inactive"
                else:
                    b["state"] = "active_pending_free"
        merged: list[dict] = []
        for b in blocks:  # adjacent free blocks merge, as in the allocator
            if b["state"] == "inactive" and merged and merged[-1]["state"] == "inactive":
                merged[-1]["size"] += b["size"]
            else:
                merged.append(dict(b, requested_size=b["requested_size"] if b["state"] != "inactive" else 0,
                                   frames=b["frames"] if b["state"] != "inactive" else []))
        if cur < base + total:
            if merged and merged[-1]["state"] == "inactive":
                merged[-1]["size"] += base + total - cur
            else:
                merged.append({"address": cur, "size": base + total - cur, "requested_size": 0,
                               "state": "inactive", "frames": []})
        live = [b for b in merged if b["state"] != "inactive"]
        segments.append({
            "device": d, "address": base, "total_size": total,
            "allocated_size": sum(b["size"] for b in live),
            "active_size": sum(b["size"] for b in live),
            "requested_size": sum(b["requested_size"] for b in live),
            "stream": stream, "segment_type": "small" if small else "large",
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": merged})
        count += len(merged)
    segments.sort(key=lambda s: (s["device"], s["address"]))
    return {"segments": segments, "device_traces": traces,
            "allocator_settings": {}, "external_annotations": [],
            "cudalab": {"simulated": simulated}}
