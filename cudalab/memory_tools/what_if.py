"""What-if: replay one trace under a sweep of allocator settings and rank them.

"Which allocator config would have fit my run in less memory?" :func:`what_if` replays a
trace (any form :func:`cudalab.memory_tools.trace_io.load_trace` reads) with
:func:`cudalab.memory_tools.replay.replay`'s engine under each setting and ranks them by peak
reserved memory against the native defaults; :func:`format_what_if` prints the ranking as
the ``cudalab what-if`` table.

By default the settings come from the bounded search of
:mod:`cudalab.memory_tools.what_if_grid` (settings alone, their combinations, garbage
collection under memory-fraction caps). Each row has two ratios: ``peak_ratio`` (peak
reserved / peak allocated) and ``live_ratio`` (peak reserved / the trace's peak of live
requested bytes, the same denominator for every setting: rounding such as
``roundup_power2_divisions`` inflates "allocated" and so flatters the first, never the
second). :func:`explain` splits each notable setting's reserved peak into requested bytes,
rounding and cached memory never allocated at once (fragmentation), and says what each
setting changed.
"""

from __future__ import annotations

import time
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
from cudalab.memory_tools.what_if_grid import (
    FRACTIONS,
    MAX_REPLAYS,
    ROUNDUP_SETTINGS,
    SINGLE_SETTINGS,
    search,
)

__all__ = [
    "COLUMNS",
    "DEFAULT_WHAT_IF_CONFIGS",
    "GC_CONFIG",
    "MAX_REPLAYS",
    "explain",
    "format_what_if",
    "what_if",
]

#: Each setting alone: the first stage of the default search (the native defaults first;
#: :mod:`cudalab.memory_tools.what_if_grid` adds combinations and memory caps).
DEFAULT_WHAT_IF_CONFIGS: tuple[str, ...] = SINGLE_SETTINGS
#: A garbage-collection setting with the memory fraction torch requires for it (to pass as
#: ``configs``; the default search tries several fractions).
GC_CONFIG = "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9"
#: The columns of :func:`what_if`'s table.
COLUMNS: tuple[str, ...] = ("config", "peak_reserved", "peak_allocated", "ratio", "peak_ratio",
                            "live_ratio", "saving_vs_default", "saving_vs_default_pct",
                            "device_mallocs", "retries", "ooms")


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


def what_if(trace: Any = None, configs: Iterable[str | AllocatorConfig] | None = None, *,
            source: Any = None, device_memory: int | None = None, device: int = 0,
            progress: bool | Callable[[int, int], None] = False) -> Any:
    """Replay ``trace`` under several allocator settings; a DataFrame ranked by peak reserved.

    Parameters
    ----------
    trace
        Any form :func:`cudalab.memory_tools.trace_io.load_trace` reads; or None with
        ``source``.
    configs : iterable of str or AllocatorConfig, optional
        The settings to try (one string is one setting). Default: the bounded search of
        :mod:`cudalab.memory_tools.what_if_grid` (each setting alone, expandable segments
        combined with ``max_split_size_mb`` and ``roundup_power2_divisions``, then
        ``garbage_collection_threshold`` under decreasing ``per_process_memory_fraction``
        caps). The native defaults are always replayed and are the baseline of
        ``saving_vs_default``.
    device_memory : int, optional
        The real device's memory in bytes: every replay runs on such a device and the
        search's memory fractions are of it. Default: each replay gets an unconstraining
        device, and the fractions are of a device the defaults exactly fill.
    device : int, optional
        Which device's trace of a snapshot to replay (default 0).
    progress : bool or callable, optional
        True for a text progress bar on stderr, or a ``callable(done, total)``.
    source : str or SampleSource, optional
        Replay the live trace of this allocator instead of ``trace``: ``"torch"`` (what
        ``torch.cuda.memory._record_memory_history`` recorded: its ``_snapshot()``),
        ``"cudalab"`` (cudalab's recorded history), ``"auto"`` (torch's when the
        process runs torch and cudalab's allocator holds nothing, else cudalab's) or a sample source's
        ``snapshot()``. ``df.attrs["allocator"]`` names the allocator replayed.

    Returns
    -------
    pandas.DataFrame
        Columns: config, peak_reserved, peak_allocated, ratio (reserved/allocated at the
        reserved peak), peak_ratio (peak reserved / peak allocated), live_ratio (peak
        reserved / the trace's peak of live requested bytes: the same denominator for every
        setting, so rounding cannot flatter it), saving_vs_default (bytes),
        saving_vs_default_pct, device_mallocs, retries, ooms; index "rank" from 1, best
        (least peak reserved, no OOM) first. ``df.attrs``: ``results`` (the
        :class:`ReplayResult` of each row, same order), ``source``, ``peak_live``,
        ``elapsed_s`` (the whole run), ``searched`` (the default search ran),
        ``cap_memory`` (the device the search's fractions refer to), ``breakdown`` (per row:
        the split of its peak reserved bytes, see :func:`explain`) and ``note``.

    Raises
    ------
    TraceError
        (a ValueError) The trace cannot be read.
    ValueError
        Bad settings or ``device_memory``; both ``trace`` and ``source``, or neither.
    SourceUnavailableError
        ``source`` cannot be read (no torch, torch without CUDA initialised, CuPy).
    """
    import pandas as pd

    start = time.perf_counter()
    trace, allocator = _trace_of_source(trace, source)
    tr = load_trace(trace, device)
    plan = plan_replay(tr)
    note = None
    fn, bar = progress_callback(progress, "")
    searched = configs is None
    bound = MAX_REPLAYS if searched else 0
    count = [0]

    def run(cfg: str | AllocatorConfig, memory: int | None) -> ReplayResult:
        i = count[0]
        count[0] += 1
        step = None
        if fn is not None:
            n_cfg = max(bound, i + 1)
            label = config_text(as_config(cfg)) or "default"

            def step(done: int, total: int) -> None:
                if bar is not None:
                    bar(i * total + done, n_cfg * total, f"[{i + 1}/{n_cfg}] {label}")
                else:
                    fn(i * total + done, n_cfg * total)
        return replay_planned(tr, plan, cfg, memory, step)

    cap_memory = None
    try:
        if configs is None:
            results, cap_memory = search(run, peak_live=plan.peak_live,
                                         device_memory=device_memory)
            if not any("per_process_memory_fraction" in r.config for r in results):
                note = (f"no per_process_memory_fraction was tried: none from {FRACTIONS[0]} "
                        f"to {FRACTIONS[-1]} of {format_bytes(cap_memory, decimals=2)} both "
                        "caps this trace and leaves room for its live bytes")
            elif device_memory is None:
                note = (f"memory fractions are of a device the defaults exactly fill "
                        f"({format_bytes(cap_memory, decimals=2)}); pass device_memory= "
                        "(CLI: --device-memory) to model your GPU")
        else:
            if isinstance(configs, (str, AllocatorConfig)):
                configs = [configs]
            todo = _labels(configs)
            if not any(label == "default" for label, _ in todo):
                todo.insert(0, ("default", AllocatorConfig()))
            bound = len(todo)
            results = [run(cfg, device_memory) for _, cfg in todo]
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
    breakdown = []
    for _, r in ranked:
        saving = base.peak_reserved - r.peak_reserved
        rows.append({
            "config": r.label,
            "peak_reserved": r.peak_reserved,
            "peak_allocated": r.peak_allocated,
            "ratio": r.ratio,
            "peak_ratio": r.peak_reserved / r.peak_allocated if r.peak_allocated else 0.0,
            "live_ratio": r.peak_reserved / plan.peak_live if plan.peak_live else 0.0,
            "saving_vs_default": saving,
            "saving_vs_default_pct": (100.0 * saving / base.peak_reserved
                                      if base.peak_reserved else 0.0),
            "device_mallocs": r.num_device_alloc,
            "retries": r.retries,
            "ooms": r.ooms,
        })
        breakdown.append({"requested": plan.peak_live,
                          "rounding": r.peak_allocated - plan.peak_live,
                          "free_cached": r.peak_reserved - r.peak_allocated})
    df = pd.DataFrame(rows, columns=COLUMNS)
    df.index = pd.RangeIndex(1, len(df) + 1, name="rank")
    df.attrs["results"] = [r for _, r in ranked]
    df.attrs["source"] = tr.source
    df.attrs["allocator"] = allocator
    df.attrs["peak_live"] = plan.peak_live
    df.attrs["breakdown"] = breakdown
    df.attrs["searched"] = searched
    df.attrs["cap_memory"] = cap_memory
    df.attrs["elapsed_s"] = time.perf_counter() - start
    if note:
        df.attrs["note"] = note
    return df


# ====================================================================================== text
def _trace_of_source(trace: Any, source: Any) -> tuple[Any, str | None]:
    """``(the trace to read, the allocator it is of)`` for what_if's ``trace`` and
    ``source`` (the allocator: None for a trace given, unless it names one)."""
    if source is None:
        if trace is None:
            raise ValueError("what_if needs a trace, or source= (e.g. source='torch': the trace "
                             "torch records)")
        identity = trace.get("identity") if isinstance(trace, dict) else None
        return trace, identity.get("allocator") if isinstance(identity, dict) else None
    if trace is not None:
        raise ValueError("what_if: give a trace or a source, not both")
    from cudalab.memory_tools.libraries import source_snapshot
    from cudalab.memory_tools.snapshot import take_snapshot

    snap = source_snapshot(source)
    if snap is None:  # cudalab's own: its live snapshot, with the history it recorded
        snap = take_snapshot()
    identity = snap.get("identity") or {}
    return snap, identity.get("allocator") or getattr(source, "name", None)


def format_what_if(df: Any, *, target: float | None = None) -> str:
    """The ranked what-if table as text (what ``cudalab what-if`` prints).

    Parameters
    ----------
    df : pandas.DataFrame
        A table returned by :func:`what_if`.
    target : float, optional
        A goal for peak reserved / peak allocated: the text says which settings reach it,
        or which comes closest.

    Returns
    -------
    str
        The header line, the table, the best setting, and (for tables with the breakdown
        :func:`what_if` attaches) where each notable setting's reserved peak went.
    """
    header = ["rank", "config", "peak reserved", "peak allocated", "ratio", "res/alloc",
              "res/live", "saving", "saving %", "device mallocs", "retries", "OOMs"]
    rows = []
    for rank, r in zip(df.index, df.itertuples(index=False)):
        rows.append([str(rank), r.config, format_bytes(r.peak_reserved, decimals=2),
                     format_bytes(r.peak_allocated, decimals=2), f"{r.ratio:.3f}",
                     f"{r.peak_ratio:.3f}", f"{r.live_ratio:.3f}",
                     format_bytes(r.saving_vs_default, signed=True, decimals=2),
                     f"{r.saving_vs_default_pct:+.1f} %", f"{r.device_mallocs:,}",
                     f"{r.retries:,}", f"{r.ooms:,}"])
    right = set(range(len(header))) - {1}
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]
    lines = []
    results = df.attrs.get("results") or []
    if results:
        r0 = results[0]
        mems = sorted({r.device_memory for r in results})
        mem = format_bytes(mems[0], decimals=2) if len(mems) == 1 else \
            f"{format_bytes(mems[0], decimals=2)} to {format_bytes(mems[-1], decimals=2)}"
        how = "searched" if df.attrs.get("searched") else "tried"
        lines.append(f"what-if: {r0.source}: {r0.entries:,} alloc/free entries, {len(results)} "
                     f"settings {how}, replayed on a simulated device of {mem}")
    for row in [header, *rows]:
        lines.append("  ".join(c.rjust(w) if i in right else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    lines.append("ratio: peak reserved / allocated at that moment; res/alloc: peak reserved / "
                 "peak allocated; res/live: peak reserved / the trace's peak of live "
                 "requested bytes (the same for every setting)")
    if len(df):
        best = df.iloc[0]
        if best["saving_vs_default"] > 0:
            lines.append(f"best: {best['config']} saves "
                         f"{format_bytes(best['saving_vs_default'], decimals=2)} "
                         f"({best['saving_vs_default_pct']:.1f} %) of peak reserved memory "
                         f"against the defaults (res/alloc {best['peak_ratio']:.3f}, res/live "
                         f"{best['live_ratio']:.3f})")
            if best["retries"]:
                lines.append(f"      it gets there with {best['retries']:,} allocation retries "
                             "(each frees the cache and synchronises the device)")
        else:
            lines.append("best: the defaults (no config tried reserves less)")
    recorded = results[0].reference.get("recorded_peak_reserved") if results else None
    if df.attrs.get("allocator") == "cupy" and recorded:  # (a CuPy recording's trace)
        lines.append(f"CuPy's own pool: the segments it took reached "
                     f"{format_bytes(recorded, decimals=2)} (of what the recording saw); the "
                     "rows are what cudalab's caching allocator (torch's) would reserve with "
                     "each setting for the same allocations")
    if "breakdown" in df.attrs and len(df):
        lines.extend(explain(df, target=target))
    elif target is not None and len(df):
        lines.extend(_goal_lines(df, target))
    if df.attrs.get("note"):
        lines.append(f"note: {df.attrs['note']}")
    if "elapsed_s" in df.attrs:
        lines.append(f"run time: {df.attrs['elapsed_s']:.2f} s for {len(df)} replays "
                     "(simulated: cudalab's allocator on a private simulator)")
    return "\n".join(lines)


def _goal_lines(df: Any, target: float) -> list[str]:
    """Whether a setting reaches ``target``, judged on res/live (peak reserved over the
    trace's peak of live requested bytes). res/live is never below res/alloc (allocated
    blocks hold at least the requested bytes), and rounding cannot flatter it, so a setting
    that reaches the target there reaches it on res/alloc too."""
    if not df.attrs.get("peak_live", 1):
        return [f"goal <= {target:.2f}: nothing to measure (the trace allocates nothing)"]
    fine = df[df["ooms"] == 0]
    ok = fine[fine["live_ratio"] <= target]
    uncapped = fine[~fine["config"].str.contains("per_process_memory_fraction")]
    if len(ok):
        r = ok.iloc[0]
        lines = [f"goal <= {target:.2f}: reached by {len(ok)} setting(s) on res/live (so on "
                 f"res/alloc too); the best, {r['config']}, gives res/alloc "
                 f"{r['peak_ratio']:.3f}, res/live {r['live_ratio']:.3f} with "
                 f"{r['retries']:,} retries"]
        if len(uncapped) and not (uncapped["live_ratio"] <= target).any():
            u = uncapped.loc[uncapped["live_ratio"].idxmin()]
            lines.append(f"  only under a memory cap: without one the closest is {u['config']} "
                         f"at res/live {u['live_ratio']:.3f} (res/alloc "
                         f"{u['peak_ratio']:.3f})")
        return lines
    if not len(fine):
        return [f"goal <= {target:.2f}: NOT reached (every setting ran out of memory)"]
    r = fine.loc[fine["live_ratio"].idxmin()]
    lines = [f"goal <= {target:.2f}: NOT reached on res/live by any setting; closest: "
             f"{r['config']} at res/live {r['live_ratio']:.3f} (res/alloc "
             f"{r['peak_ratio']:.3f}, {r['retries']:,} retries)"]
    uncapped = fine[~fine["config"].str.contains("per_process_memory_fraction")]
    if len(uncapped) and "per_process_memory_fraction" in r["config"]:
        u = uncapped.loc[uncapped["live_ratio"].idxmin()]
        lines.append(f"  without a memory cap the closest is {u['config']} at res/live "
                     f"{u['live_ratio']:.3f} (res/alloc {u['peak_ratio']:.3f})")
    flattered = fine[fine["peak_ratio"] <= target]
    if len(flattered):
        f = flattered.iloc[0]
        lines.append(f"  ({len(flattered)} setting(s) reach it on res/alloc only, e.g. "
                     f"{f['config']} at {f['peak_ratio']:.3f}: rounding inflates their "
                     "allocated bytes, not the memory they leave free)")
    return lines


def _find(df: Any, predicate: Callable[[str], bool]) -> int | None:
    """Position of the best row (no OOM) whose config satisfies ``predicate``."""
    for pos, (config, ooms) in enumerate(zip(df["config"], df["ooms"])):
        if not ooms and predicate(config):
            return pos
    return None


def explain(df: Any, *, target: float | None = None) -> list[str]:
    """Why the settings differ: where each notable setting's reserved peak went.

    Each replay's peak reserved bytes split into the trace's peak of live requested bytes
    (``requested``, the same for every setting), plus rounding (``rounding``: peak
    allocated over that; block sizes over the requests: power-of-two divisions, remainders
    under 1 MiB left unsplit), plus cached memory that was never allocated at once
    (``free_cached``: peak reserved over peak allocated; free blocks the requests could not
    use: fragmentation). The three parts give the table's ratios: res/alloc is
    (requested + rounding + free_cached) / (requested + rounding), res/live is the same
    over ``requested``. The lines compare the defaults,
    expandable segments alone, the best setting without a memory cap and the best overall,
    and name what each setting changed.

    Parameters
    ----------
    df : pandas.DataFrame
        A table returned by :func:`what_if` (with ``attrs["breakdown"]``).
    target : float, optional
        A goal for peak reserved / peak allocated (see :func:`format_what_if`).

    Returns
    -------
    list of str
        Lines of text.
    """
    breakdown = df.attrs["breakdown"]
    configs = list(df["config"])
    picks: list[tuple[str, int]] = []
    for name, pos in (
        ("defaults", _find(df, lambda c: c == "default")),
        ("expandable segments", _find(df, lambda c: c == "expandable_segments:True")),
        ("best without a cap", _find(df, lambda c: "per_process_memory_fraction" not in c)),
        ("best", _find(df, lambda c: True)),
    ):
        if pos is not None and all(pos != p for _, p in picks):
            picks.append((name, pos))
    if not picks:
        return []
    lines = ["where the reserved peak goes: peak live requested + rounding (peak allocated - "
             "that) + cached but never allocated at once (peak reserved - peak allocated) = "
             "peak reserved:"]
    width = max(len(configs[p]) for _, p in picks)
    for name, pos in picks:
        b = breakdown[pos]
        res = int(df["peak_reserved"].iloc[pos])
        lines.append(f"  {configs[pos].ljust(width)}  {format_bytes(b['requested'], decimals=1)}"
                     f" + {format_bytes(b['rounding'], decimals=1)} + "
                     f"{format_bytes(b['free_cached'], decimals=1)} = "
                     f"{format_bytes(res, decimals=1)}  ({name})")
    default_pos = dict((n, p) for n, p in picks).get("defaults")
    es_pos = dict((n, p) for n, p in picks).get("expandable segments")
    if default_pos is not None:
        free = breakdown[default_pos]["free_cached"]
        res = int(df["peak_reserved"].iloc[default_pos])
        lines.append(f"why: with the defaults {100 * free / res if res else 0:.0f} % of the "
                     "reserved peak is never allocated at once. That is fragmentation: "
                     "blocks freed earlier are too small for later requests (e.g. a buffer "
                     "freed after its slightly larger copy was allocated, as a KV cache grown "
                     "by torch.cat is, or activations of an earlier batch shape), and free "
                     "remainders of split 2 MiB / 20 MiB segments stay reserved while any "
                     "block of their segment is live.")
        if es_pos is not None:
            es_free = breakdown[es_pos]["free_cached"]
            lines.append(f"  expandable segments map pages onto one growing segment, so free "
                         f"space at its end merges with new pages and no segment is rounded up: "
                         f"never allocated at once {format_bytes(free, decimals=1)} -> "
                         f"{format_bytes(es_free, decimals=1)}; what remains are holes between "
                         "live blocks inside the segment, whose pages stay mapped (garbage "
                         "collection never frees expandable blocks; only a retry or "
                         "empty_cache unmaps them).")
        split_same = [c for c, p in zip(configs, df["peak_reserved"])
                      if c.startswith("max_split_size_mb:") and "," not in c
                      and p == int(df["peak_reserved"].iloc[default_pos])]
        if split_same:
            lines.append(f"  max_split_size_mb changed nothing here ({', '.join(split_same)}): "
                         "it only stops large cached blocks from being split for smaller "
                         "requests and frees them when the device is full.")
        default_peak = int(df["peak_reserved"].iloc[default_pos])
        for c in ROUNDUP_SETTINGS:
            pos = _find(df, c.__eq__)
            if pos is None:
                continue
            b = breakdown[pos]
            if int(df["peak_reserved"].iloc[pos]) == default_peak:
                lines.append(f"  {c} changed nothing here: the band sets 1 division (no "
                             "rounding) below its first size, and the blocks are smaller.")
            else:
                lines.append(f"  {c} trades holes for rounding: rounding "
                             f"{format_bytes(b['rounding'], decimals=1)}, never allocated at "
                             f"once {format_bytes(b['free_cached'], decimals=1)} (it also inflates "
                             "'allocated', so res/alloc flatters it; res/live does not).")
    capped = [p for p, c in enumerate(configs) if "per_process_memory_fraction" in c]
    if capped:
        fine = [p for p in capped if not df["ooms"].iloc[p]]
        failed = [p for p in capped if df["ooms"].iloc[p]]
        text = ("  a memory fraction caps reserved memory: at the cap the allocator frees its "
                "cached blocks and retries instead of reserving more")
        if fine:
            p = fine[0]
            text += (f"; best capped: {configs[p]} at res/live {df['live_ratio'].iloc[p]:.3f} "
                     f"with {df['retries'].iloc[p]:,} retries")
        if failed:
            text += (f"; a tighter cap ran out of memory ({configs[failed[0]]}): the live bytes "
                     "plus holes no retry can free no longer fit")
        lines.append(text + ".")
    if target is not None:
        lines.extend(_goal_lines(df, target))
    return lines
