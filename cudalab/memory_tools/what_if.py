"""What-if: replay one trace under a sweep of allocator settings and rank them.

"Which allocator config would have fit my run in less memory?" :func:`what_if` replays a
trace (any form :func:`cudalab.memory_tools.trace_io.load_trace` reads) with
:func:`cudalab.memory_tools.replay.replay`'s engine under each setting and ranks them by peak
reserved memory against the native defaults; :func:`format_what_if` prints the ranking as
the ``cudalab what-if`` table.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

from cudalab._units import format_bytes
from cudalab.allocator.config import AllocatorConfig
from cudalab.memory_tools.progress import progress_callback
from cudalab.memory_tools.replay import (
    ReplayResult,
    ReplayWarning,
    as_config,
    config_text,
    plan_replay,
    replay_planned,
    skip_warning,
)
from cudalab.memory_tools.trace_io import load_trace

__all__ = [
    "DEFAULT_WHAT_IF_CONFIGS",
    "GC_CONFIG",
    "format_what_if",
    "what_if",
]

#: The settings :func:`what_if` tries by default (the native defaults always come first).
DEFAULT_WHAT_IF_CONFIGS: tuple[str, ...] = (
    "",
    "expandable_segments:True",
    "max_split_size_mb:64",
    "max_split_size_mb:128",
    "max_split_size_mb:256",
    "max_split_size_mb:512",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
    "backend:cudaMallocAsync",
)
#: Added to the default sweep when the device's memory is known (``device_memory=``):
#: garbage collection only acts under a memory fraction of a real device.
GC_CONFIG = "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9"


def _labels(configs: Iterable[Any]) -> list[tuple[str, AllocatorConfig]]:
    out: list[tuple[str, AllocatorConfig]] = []
    seen: set[str] = set()
    for c in configs:
        cfg = as_config(c)
        label = config_text(cfg) or "default"
        if label not in seen:
            seen.add(label)
            out.append((label, cfg))
    return out


def what_if(trace: Any, configs: Iterable[str | AllocatorConfig] | None = None, *,
            device_memory: int | None = None, device: int = 0,
            progress: bool | Callable[[int, int], None] = False) -> Any:
    """Replay ``trace`` under several allocator settings; a DataFrame ranked by peak reserved.

    ``configs`` default to :data:`DEFAULT_WHAT_IF_CONFIGS` (native defaults, expandable
    segments, max_split_size_mb 64/128/256/512, two roundup_power2_divisions settings and
    backend:cudaMallocAsync), plus :data:`GC_CONFIG` (garbage collection at 0.6 of a 0.9
    memory fraction) when ``device_memory`` is given: garbage collection acts relative to the
    device's memory, so it is only meaningful for a known device. The native defaults are
    always replayed and are the baseline of ``saving_vs_default``.

    Columns: config, peak_reserved, peak_allocated, ratio (reserved/allocated at the reserved
    peak), saving_vs_default (bytes), saving_vs_default_pct, device_mallocs, retries, ooms;
    index "rank" from 1, best (least peak reserved, no OOM) first. ``df.attrs["results"]``
    holds the :class:`ReplayResult` of each row (same order).
    """
    import pandas as pd

    tr = load_trace(trace, device)
    plan = plan_replay(tr)
    note = None
    if configs is None:
        configs = list(DEFAULT_WHAT_IF_CONFIGS)
        if device_memory is not None:
            configs.append(GC_CONFIG)
        else:
            note = ("garbage_collection_threshold was not tried: it acts relative to the "
                    "device's memory; pass device_memory= (CLI: --device-memory) to include it")
    elif isinstance(configs, (str, AllocatorConfig)):
        configs = [configs]
    todo = _labels(configs)
    if not any(label == "default" for label, _ in todo):
        todo.insert(0, ("default", AllocatorConfig()))
    fn, bar = progress_callback(progress, "")
    results: list[ReplayResult] = []
    n_cfg = len(todo)
    try:
        for i, (label, cfg) in enumerate(todo):
            step = None
            if fn is not None:

                def step(done: int, total: int, _i: int = i, _label: str = label) -> None:
                    if bar is not None:
                        bar(_i * total + done, n_cfg * total, f"[{_i + 1}/{n_cfg}] {_label}")
                    else:
                        fn(_i * total + done, n_cfg * total)
            results.append(replay_planned(tr, plan, cfg, device_memory, step))
    finally:
        if bar is not None:
            bar.close()
    text = skip_warning(plan, tr.source)
    if text:
        warnings.warn(text, ReplayWarning, stacklevel=2)
    base = next(r for r in results if r.label == "default")
    ranked = sorted(enumerate(results), key=lambda ir: (ir[1].ooms > 0, ir[1].peak_reserved,
                                                        ir[0]))
    rows = []
    for _, r in ranked:
        saving = base.peak_reserved - r.peak_reserved
        rows.append({
            "config": r.label,
            "peak_reserved": r.peak_reserved,
            "peak_allocated": r.peak_allocated,
            "ratio": r.ratio,
            "saving_vs_default": saving,
            "saving_vs_default_pct": (100.0 * saving / base.peak_reserved
                                      if base.peak_reserved else 0.0),
            "device_mallocs": r.num_device_alloc,
            "retries": r.retries,
            "ooms": r.ooms,
        })
    df = pd.DataFrame(rows, columns=["config", "peak_reserved", "peak_allocated", "ratio",
                                     "saving_vs_default", "saving_vs_default_pct",
                                     "device_mallocs", "retries", "ooms"])
    df.index = pd.RangeIndex(1, len(df) + 1, name="rank")
    df.attrs["results"] = [r for _, r in ranked]
    df.attrs["source"] = tr.source
    if note:
        df.attrs["note"] = note
    return df


# ====================================================================================== text
def format_what_if(df: Any) -> str:
    """The ranked what-if table as text (what ``cudalab what-if`` prints)."""
    header = ["rank", "config", "peak reserved", "peak allocated", "ratio", "saving",
              "saving %", "device mallocs", "retries", "OOMs"]
    rows = []
    for rank, r in zip(df.index, df.itertuples(index=False)):
        rows.append([str(rank), r.config, format_bytes(r.peak_reserved, decimals=2),
                     format_bytes(r.peak_allocated, decimals=2), f"{r.ratio:.3f}",
                     format_bytes(r.saving_vs_default, signed=True, decimals=2),
                     f"{r.saving_vs_default_pct:+.1f} %", f"{r.device_mallocs:,}",
                     f"{r.retries:,}", f"{r.ooms:,}"])
    right = {0, 2, 3, 4, 5, 6, 7, 8, 9}
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]
    lines = []
    results = df.attrs.get("results") or []
    if results:
        r0 = results[0]
        mems = sorted({r.device_memory for r in results})
        mem = format_bytes(mems[0], decimals=2) if len(mems) == 1 else \
            f"{format_bytes(mems[0], decimals=2)} to {format_bytes(mems[-1], decimals=2)}"
        lines.append(f"what-if: {r0.source}: {r0.entries:,} alloc/free entries, replayed on a "
                     f"simulated device of {mem}")
    for row in [header, *rows]:
        lines.append("  ".join(c.rjust(w) if i in right else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    if len(df):
        best = df.iloc[0]
        if best["saving_vs_default"] > 0:
            lines.append(f"best: {best['config']} saves {format_bytes(best['saving_vs_default'], decimals=2)} "
                         f"({best['saving_vs_default_pct']:.1f} %) of peak reserved memory "
                         "against the defaults")
        else:
            lines.append("best: the defaults (no config tried reserves less)")
    if df.attrs.get("note"):
        lines.append(f"note: {df.attrs['note']}")
    return "\n".join(lines)
