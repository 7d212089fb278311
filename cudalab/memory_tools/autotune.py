"""The allocator autotuner: which settings would have needed the least memory, per device size.

:func:`autotune` replays one trace (any form :func:`~cudalab.memory_tools.trace_io.load_trace`
reads) under a grid of allocator settings (:data:`DEFAULT_SETTINGS`: ``expandable_segments``
× ``max_split_size_mb`` × ``roundup_power2_divisions``, ``backend:cudaMallocAsync``, and
``garbage_collection_threshold`` / expandable segments under ``per_process_memory_fraction``
caps) at one or more device capacities, in parallel worker processes
(:mod:`cudalab.memory_tools.replay_workers`), and ranks the rows of each capacity by peak
reserved memory, then driver allocations, then retries; a setting that ran out of memory
ranks after every one that did not. :func:`recommendation` turns the best row into one line
for ``CUDALAB_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF``; :func:`format_autotune` prints the
table (``cudalab what-if --search``).

Capacities. ``None`` is an unconstraining device (four times the trace's live peak, grown
until nothing runs out of memory); an int is a device of that many bytes. By default the
trace's own device is modelled when the trace says how large it was (:func:`trace_capacity`: cudalab's snapshots record it; for torch's, an ``oom`` entry's free bytes plus what was
reserved then), and ``df.attrs["capacity_note"]`` says where the capacity came from.

Exactness and cost. Without a memory fraction, capacity matters only when a device
allocation fails: a replay that never failed and never retried on a larger device is what
the same settings do on any device that holds its peak reserved bytes, so that row is
derived (``derived`` True) instead of replayed. Likewise a ``max_split_size_mb`` larger
than any segment the trace can create changes nothing (:func:`_idle_split`): the setting
takes the rows of the same setting without it, and a ``roundup_power2_divisions`` that rounds
every request of the trace as another setting (otherwise the same) does takes that
setting's rows (:func:`_aliases`: the native allocator sees only rounded sizes, so its
choices are the same). Every other row is a replay of cudalab's
allocator, which follows torch's policy (the replays of torch's own traces reproduce torch's
peaks exactly; ``backend:cudaMallocAsync`` is an estimate, see
:mod:`cudalab.memory_tools.replay`).

Refused settings (a string the settings parser rejects, or a replay that failed) are rows
too, with ``status`` naming the reason and no numbers: nothing asked for is dropped.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from cudalab._units import format_bytes, parse_size
from cudalab.memory_tools.progress import progress_callback
from cudalab.memory_tools.replay import (
    ReplayResult,
    as_config,
    config_text,
    plan_replay,
)
from cudalab.memory_tools.replay_workers import run_replays
from cudalab.memory_tools.trace_io import load_trace

__all__ = [
    "COLUMNS",
    "DEFAULT_SETTINGS",
    "autotune",
    "format_autotune",
    "recommendation",
    "trace_capacity",
]

_ES = "expandable_segments:True"
#: ``max_split_size_mb`` values of the grid (None: unset).
GRID_MAX_SPLIT_MB: tuple[int | None, ...] = (None, 64, 128, 256, 512)
#: ``roundup_power2_divisions`` values of the grid (None: unset): uniform powers of two and
#: torch's per-band example.
GRID_ROUNDUP: tuple[str | None, ...] = (None, "2", "4", "8", "16", "[256:1,512:2,1024:4,>:8]")
#: Memory fractions of the capped settings (of each capacity given).
GRID_FRACTIONS: tuple[float, ...] = (0.95, 0.9, 0.85, 0.8)
#: Caps tuned to the trace, as multiples of its peak of live bytes: with the default grid,
#: each capacity also gets ``expandable_segments:True`` (alone and with
#: ``roundup_power2_divisions:8``) under ``per_process_memory_fraction`` = this × the live
#: peak / the capacity (when below the grid's fractions). At the cap the allocator frees its
#: cache and retries instead of reserving more: less reserved memory, paid in retries.
TUNED_CAPS: tuple[float, ...] = (1.05, 1.1, 1.2)


def _join(*parts: str | None) -> str:
    return ",".join(p for p in parts if p)


def _grid() -> tuple[str, ...]:
    out: list[str] = []
    for es, split, rounding in itertools.product((False, True), GRID_MAX_SPLIT_MB,
                                                 GRID_ROUNDUP):
        out.append(_join(_ES if es else None,
                         f"max_split_size_mb:{split}" if split else None,
                         f"roundup_power2_divisions:{rounding}" if rounding else None))
    out.append("backend:cudaMallocAsync")
    for f in GRID_FRACTIONS:
        out.append(f"garbage_collection_threshold:0.8,per_process_memory_fraction:{f:g}")
        out.append(f"{_ES},per_process_memory_fraction:{f:g}")
        out.append(f"{_ES},roundup_power2_divisions:8,per_process_memory_fraction:{f:g}")
    return tuple(out)


#: The default grid: 60 native combinations (expandable segments × max_split_size_mb ×
#: roundup_power2_divisions), cudaMallocAsync, and 12 capped settings; "" is the defaults.
DEFAULT_SETTINGS: tuple[str, ...] = _grid()

#: Entries × settings × capacities up to which :func:`autotune` replays in this process
#: when ``workers`` is not given (about two seconds of replays).
SERIAL_WORK = 1_000_000

#: The frame's columns.
COLUMNS: tuple[str, ...] = (
    "setting", "capacity", "rank", "peak_reserved", "peak_allocated",
    "reserved_over_allocated", "live_ratio", "driver_allocs", "retries", "ooms", "first_oom",
    "first_oom_bytes", "status", "derived",
)


# ============================================================================ capacity
def trace_capacity(trace: Any, device: int = 0) -> tuple[int | None, str]:
    """How much device memory the trace's run had, when the trace says.

    Parameters
    ----------
    trace
        A snapshot dict (other forms carry no capacity).
    device : int, optional
        Which device's trace.

    Returns
    -------
    (int or None, str)
        The bytes and how they were found (None and the reason when unknown): cudalab's
        snapshots carry ``device_memory`` (the device's total); for torch's, the first
        ``oom`` entry's ``device_free`` plus the bytes reserved at that moment (the
        snapshot's segments minus the segment changes after it) is the memory the allocator
        could have had.
    """
    if not isinstance(trace, dict):
        return None, "the trace does not record its device's memory"
    totals = trace.get("device_memory")
    if isinstance(totals, list) and 0 <= device < len(totals):
        total = totals[device]
        if isinstance(total, int) and not isinstance(total, bool) and total > 0:
            return total, f"recorded in the snapshot ({format_bytes(total, decimals=2)})"
    traces = trace.get("device_traces")
    if not isinstance(traces, list) or not 0 <= device < len(traces) \
            or not isinstance(traces[device], list):
        return None, "the trace does not record its device's memory"
    entries = traces[device]
    oom_at = next((i for i, e in enumerate(entries) if isinstance(e, dict)
                   and e.get("action") == "oom" and isinstance(e.get("device_free"), int)), None)
    if oom_at is None:
        return None, "the trace does not record its device's memory (no oom entry)"
    segments = trace.get("segments")
    reserved = 0
    if isinstance(segments, list):
        reserved = sum(int(s.get("total_size", 0)) for s in segments
                       if isinstance(s, dict) and s.get("device", device) == device
                       and isinstance(s.get("total_size"), int))
    for e in entries[oom_at + 1:]:
        if not isinstance(e, dict) or not isinstance(e.get("size"), int):
            continue
        action = e.get("action")
        if action in ("segment_alloc", "segment_map"):
            reserved -= e["size"]
        elif action in ("segment_free", "segment_unmap"):
            reserved += e["size"]
    total = int(entries[oom_at]["device_free"]) + max(0, reserved)
    shown = format_bytes(total, decimals=2)
    return total, (f"estimated from the trace's out-of-memory entry: {shown} (free then + "
                   "reserved then)")


def _top_level_items(text: str) -> list[str]:
    """The ``key:value`` items of a settings string (commas inside brackets kept)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    items.append(text[start:].strip())
    return [x for x in items if x]


def _idle_split(setting: str, max_request: int) -> str | None:
    """The setting without its ``max_split_size_mb`` when that limit can change nothing on a
    trace whose largest request is ``max_request`` bytes, else None.

    The native caching allocator (without expandable segments) only compares the limit with
    blocks, and a block is never larger than its segment; the largest segment the trace can
    create is ``allocation_size(round_size(max_request))`` (both are monotone). When that is
    below the limit, no block is refused, every split happens as without the limit, and the
    release of oversize blocks at out-of-memory finds none: the replay is the same.
    """
    from cudalab.allocator.config import UNLIMITED
    from cudalab.allocator.policy import allocation_size, round_size

    try:
        cfg = as_config(setting)
    except ValueError:
        return None
    if cfg.max_split_size >= UNLIMITED or cfg.expandable_segments or cfg.backend != "native":
        return None
    largest = allocation_size(round_size(max(max_request, 1), cfg), cfg.large_segment_size)
    if largest >= cfg.max_split_size:
        return None
    return ",".join(x for x in _top_level_items(setting)
                    if not x.replace(" ", "").startswith("max_split_size_mb:"))


def rounded_sizes(sizes: Any, config: Any) -> Any:
    """:func:`cudalab.allocator.policy.round_size` of every size of an int64 array (> 0,
    < 2**53) under ``config`` (an AllocatorConfig), vectorised: the block sizes the native
    allocator gives those requests."""
    import numpy as np

    s = np.asarray(sizes, dtype=np.int64)
    out = (s + 511) & -512
    out[s < 512] = 512
    table = np.asarray(config.roundup_power2_divisions, dtype=np.int64)
    if not (table > 1).any() or not len(s):
        return out
    bits = np.frexp(s.astype(np.float64))[1].astype(np.int64)  # bit_length (exact < 2**53)
    index = np.clip(bits - 21, 0, len(table) - 1)
    d = table[index]
    use = (s >= 512) & (d > 1) & (s > 512 * d)
    if not use.any():
        return out
    v, b, dv = s[use], bits[use], d[use]
    floor2 = np.left_shift(np.int64(1), b - 1)
    dbits = np.frexp(dv.astype(np.float64))[1].astype(np.int64)
    step = np.right_shift(floor2, dbits - 1)
    low = v & ~(step - 1)
    rounded = np.where(low == v, v, low + step)
    rounded = np.where(step == 0, floor2 << 1, rounded)
    out[use] = np.where((v & (v - 1)) == 0, v, rounded)
    return out


def _aliases(labels: Sequence[str], action: Any, size: Any) -> dict[str, str]:
    """{setting: the setting whose replay it takes} for the settings of ``labels`` whose
    replay is provably another's, on a trace of ``action``/``size`` (its plan's columns):

    * an idle ``max_split_size_mb`` (:func:`_idle_split`) takes the setting without it;
    * a native setting whose ``roundup_power2_divisions`` rounds every request of the
      trace to the same block size as an earlier setting that differs from it only in that
      key takes that setting's (the native allocator, with or without expandable segments,
      decides on rounded sizes only: the requested size is a statistic). Roundings are
      compared in full (:func:`rounded_sizes` of each distinct request size).

    Every value is a setting of ``labels`` that is not itself an alias."""
    import numpy as np

    acts = np.asarray(action, dtype=np.int8)
    requests = np.asarray(size, dtype=np.int64)[acts == 1]
    max_request = int(requests.max()) if len(requests) else 0
    alias: dict[str, str] = {}
    for s in labels:
        base = _idle_split(s, max_request)
        if base is not None and base in labels:
            alias[s] = base
    distinct = np.unique(requests)
    if len(distinct) and int(distinct[-1]) < (1 << 53):
        seen: dict[tuple[str, bytes], str] = {}
        for s in labels:
            if s in alias:
                continue
            try:
                cfg = as_config(s)
            except ValueError:
                continue
            if cfg.backend != "native":
                continue
            rest = ",".join(x for x in _top_level_items(s) if not x.replace(" ", "")
                            .startswith("roundup_power2_divisions:"))
            key = (config_text(as_config(rest)), rounded_sizes(distinct, cfg).tobytes())
            first = seen.setdefault(key, s)
            if first != s:
                alias[s] = first

    def root(s: str) -> str:
        while s in alias:
            s = alias[s]
        return s

    return {s: root(b) for s, b in alias.items()}


def _cap_base(setting: str) -> str:
    """``setting`` without its ``per_process_memory_fraction`` and
    ``garbage_collection_threshold`` (what it does while the cap is never reached)."""
    return ",".join(x for x in _top_level_items(setting)
                    if not x.replace(" ", "").startswith(("per_process_memory_fraction:",
                                                          "garbage_collection_threshold:")))


def _cap_idle(setting: str, base: ReplayResult, capacity: int) -> bool:
    """Whether ``setting``'s cap (and garbage collection) cannot act on a device of
    ``capacity`` bytes, given the replay of its base there: the base never failed nor
    retried, and its reserved bytes never passed the cap (``int(fraction * capacity)``, the
    allocator's own figure) nor the collection threshold (``int(threshold * cap)``). The
    allocator then makes the same choices with the cap as without: the replay is the same."""
    if base.ooms or base.retries:
        return False
    try:
        cfg = as_config(setting)
    except ValueError:
        return False
    if cfg.per_process_memory_fraction is None:
        return False
    allowed = int(cfg.per_process_memory_fraction * capacity)
    limit = allowed
    if cfg.garbage_collection_threshold > 0:
        limit = min(limit, int(cfg.garbage_collection_threshold * allowed))
    return base.peak_reserved <= limit


def _capacity(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, str):
        return parse_size(value, allow_zero=False)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"a capacity must be bytes (int), a size such as '80GiB' or None, got "
                        f"{type(value).__name__}")
    if not (1 << 20) <= value <= (1 << 40):
        raise ValueError(f"a capacity must be between 1 MiB and 1 TiB, got {value}")
    return value


def _key(r: ReplayResult) -> tuple[bool, int, int, int]:
    return (r.ooms > 0, r.peak_reserved, r.num_device_alloc, r.retries)


# ============================================================================ autotune
def autotune(trace: Any, capacities: Iterable[int | str | None] | int | str | None = None,
             settings: Iterable[str] | None = None, *, device: int = 0,
             workers: int | None = None,
             progress: bool | Callable[[int, int], None] = False) -> Any:
    """Replay ``trace`` under a grid of allocator settings at each capacity; ranked rows.

    Parameters
    ----------
    trace
        Any form :func:`~cudalab.memory_tools.trace_io.load_trace` reads (a snapshot dict,
        a path to torch's or cudalab's pickle, a history CSV, a DataFrame, a list).
    capacities : iterable of (int, str or None), optional
        Device sizes to model: bytes, a size such as ``"80GiB"``, or None for an
        unconstraining device. Default: the trace's own device when it records it
        (:func:`trace_capacity`), else one unconstraining device.
    settings : iterable of str, optional
        Settings strings in ``PYTORCH_CUDA_ALLOC_CONF`` grammar (default
        :data:`DEFAULT_SETTINGS`); the defaults ("") are always added. A
        ``per_process_memory_fraction`` is of each capacity; on an unconstraining device
        such a setting is refused (a fraction of no device means nothing).
    device : int, optional
        Which device's trace of a snapshot to replay.
    workers : int, optional
        Worker processes (default: the CPUs available, see
        :func:`~cudalab.memory_tools.replay_workers.default_workers`); 1 is serial.
    progress : bool or callable, optional
        True for a progress bar on stderr, or ``callable(done, total)`` per replay.

    Returns
    -------
    pandas.DataFrame
        One row per setting and capacity, capacities in the order given, best first
        within each (``rank`` from 1; refused settings last, with ``rank`` 0). Columns
        :data:`COLUMNS`: ``capacity`` (bytes; <NA> for an unconstraining device),
        ``reserved_over_allocated`` (peak reserved / peak allocated), ``live_ratio`` (peak
        reserved / the trace's peak of live requested bytes), ``driver_allocs`` (device
        allocations), ``first_oom`` / ``first_oom_bytes`` (the trace entry and request of
        the first out-of-memory, <NA> without one; the replay of such a setting stops there,
        so its other figures are those up to it), ``status`` ("ok", "out of memory" or
        "refused: <reason>"), ``derived`` (not replayed: the same settings' replay on a
        larger device never needed the difference, or a ``max_split_size_mb`` no segment of
        the trace reaches, which changes nothing, took the rows of the setting without it). ``df.attrs``: ``recommendation``
        (:func:`recommendation`), ``capacity_note``, ``refused`` ({setting: reason}),
        ``results`` (the :class:`ReplayResult` per row, None for refused rows),
        ``peak_live``, ``replays`` (replays run), ``elapsed_s``, ``workers``, ``source``.

    Raises
    ------
    TraceError
        (a ValueError) The trace cannot be read.
    ValueError, TypeError
        A bad capacity or ``workers``.
    """
    import pandas as pd

    start = time.perf_counter()
    raw = trace
    if isinstance(raw, str) or hasattr(raw, "__fspath__"):
        from cudalab.memory_tools.trace_io import load_snapshot

        try:
            raw = load_snapshot(raw)
        except ValueError:
            raw = trace  # not a snapshot pickle: load_trace reads the other file forms
    tr = load_trace(raw, device)
    plan = plan_replay(tr)
    note = ""
    if capacities is None:
        cap, how = trace_capacity(raw, device)
        caps: list[int | None] = [cap]
        note = (f"capacity taken from the trace: {how}" if cap is not None else
                f"{how}: replayed on an unconstraining device (pass capacities= to model "
                "a GPU)")
    else:
        if isinstance(capacities, (int, str)):
            capacities = [capacities]
        caps = []
        for c in capacities:
            value = _capacity(c)
            if value not in caps:
                caps.append(value)
        if not caps:
            raise ValueError("capacities is empty: give at least one device size (or None)")
        cap, how = trace_capacity(raw, device)
        if cap is not None and cap not in caps:
            note = (f"the trace comes from a device of another size ({how}); the "
                    f"capacities given are modelled")
    wanted = list(DEFAULT_SETTINGS if settings is None else
                  ([settings] if isinstance(settings, str) else settings))
    refused: dict[str, str] = {}
    labels: list[str] = []
    for text in ["", *wanted]:
        if not isinstance(text, str):
            refused[repr(text)] = f"not a settings string ({type(text).__name__})"
            continue
        try:
            label = config_text(as_config(text))
        except ValueError as exc:
            refused[text] = str(exc).splitlines()[0]
            continue
        if label not in labels:
            labels.append(label)
    # A max_split_size_mb no segment of the trace reaches, or a rounding that gives every
    # request of the trace the block another setting gives it, changes nothing (exact, see
    # _aliases): such a setting takes the rows of the setting it equals.
    alias = _aliases(labels, plan.action, plan.size)
    # The default grid also caps each given device just above the trace's live peak
    # (TUNED_CAPS): fractions no preset names, which trade retries for reserved memory.
    tuned: dict[int, list[str]] = {}
    if settings is None and plan.peak_live:
        for c in caps:
            if c is None:
                continue
            extra: list[str] = []
            tuned[c] = extra
            for k in TUNED_CAPS:
                f = math.ceil(k * plan.peak_live / c * 1e4) / 1e4
                if 0 < f < GRID_FRACTIONS[-1]:
                    for base in (_ES, f"{_ES},roundup_power2_divisions:8"):
                        extra.append(f"{base},per_process_memory_fraction:{f:g}")
    fn, bar = progress_callback(progress, "autotune")
    outcomes: dict[tuple[str, int | None], ReplayResult | str] = {}
    derived: set[tuple[str, int | None]] = set()
    replays = 0
    order = sorted(caps, key=lambda c: -(c if c is not None else 1 << 62))
    plain = [s for s in labels if "per_process_memory_fraction" not in s and s not in alias]
    # The stream-ordered pool's replay is the slowest (a driver query per allocation): it
    # starts first, so that it does not end last on many CPUs.
    plain.sort(key=lambda s: "cudaMallocAsync" not in s)
    capped = [s for s in labels if "per_process_memory_fraction" in s and s not in alias]
    total = len(labels) * len(caps) + sum(len(v) for v in tuned.values())
    done = [0]

    def step(_: int, __: int) -> None:
        done[0] += 1
        if fn is not None:
            if bar is not None:
                bar(done[0], total, "autotune")
            else:
                fn(done[0], total)

    # Little work (a short trace) is replayed here: starting worker processes would cost
    # more than it saves.
    chosen = workers
    if chosen is None and plan.n_entries * len(labels) * len(caps) <= SERIAL_WORK:
        chosen = 1

    def run_all(jobs: list[tuple[str, int | None]], follow: Any) -> int:
        """Run ``jobs`` (and what ``follow`` queues); the number of replays made."""
        count = [0]

        def counted(job: tuple[str, int | None], got: ReplayResult | str
                    ) -> list[tuple[str, int | None]]:
            count[0] += 1
            return follow(job, got)

        if jobs:  # (a setting that runs out of memory ranks last: its replay stops there)
            run_replays(tr, plan, jobs, workers=chosen, follow=counted, stop_at_oom=True)
        return count[0]

    try:
        # Every plain setting on the largest device at once; as a plain setting's replay
        # ends, its replays on the smaller devices are queued (or derived when the larger
        # one never came near them). A capped setting waits for its uncapped base on the
        # same device: it is derived when the base never came near the cap (_cap_idle),
        # else queued.
        for s in capped:
            if None in caps:  # a fraction of no particular device means nothing
                outcomes[(s, None)] = ("a per_process_memory_fraction needs a capacity (tried "
                                       "only on the devices given)")
                step(0, 0)
        plain_set = set(plain)
        first = [(s, order[0]) for s in plain]
        waiting: dict[tuple[str, int | None], list[str]] = {}
        for c in order:
            if c is None:
                continue
            for s in [*capped, *tuned.get(c, ())]:
                base = _cap_base(s)
                base = alias.get(base, base)  # (the replay it equals)
                if base in plain_set:
                    waiting.setdefault((base, c), []).append(s)
                else:
                    first.append((s, c))

        def settle(s: str, c: int | None, got: ReplayResult | str
                   ) -> list[tuple[str, int | None]]:
            """Record ``got`` for (s, c); the capped settings waiting on it, derived or
            queued."""
            outcomes[(s, c)] = got
            step(0, 0)
            more: list[tuple[str, int | None]] = []
            for t in waiting.pop((s, c), ()):
                if c is not None and isinstance(got, ReplayResult) and _cap_idle(t, got, c):
                    outcomes[(t, c)] = replace(got, config=t)
                    derived.add((t, c))
                    step(0, 0)
                else:
                    more.append((t, c))
            return more

        def follow(job: tuple[str, int | None], got: ReplayResult | str
                   ) -> list[tuple[str, int | None]]:
            s, c = job
            more = settle(s, c, got)
            if s not in plain_set or c != order[0]:
                return more
            for smaller in order[1:]:
                if isinstance(got, ReplayResult) and not got.ooms and not got.retries \
                        and smaller is not None and got.peak_reserved <= smaller:
                    derived.add((s, smaller))
                    more.extend(settle(s, smaller, replace(got, device_memory=smaller)))
                else:
                    more.append((s, smaller))
            return more

        replays += run_all(first, follow)
        for s, base in alias.items():
            for c in caps:
                got = outcomes[(base, c)]
                outcomes[(s, c)] = replace(got, config=s) if isinstance(got, ReplayResult) \
                    else got
                derived.add((s, c))
                step(0, 0)
    finally:
        if bar is not None:
            bar.close()
    rows: list[dict[str, Any]] = []
    results: list[ReplayResult | None] = []
    peak_live = plan.peak_live
    for c in caps:
        good = []
        bad = []
        for s in [*labels, *(tuned.get(c, ()) if c is not None else ())]:
            r = outcomes[(s, c)]
            if isinstance(r, ReplayResult):
                good.append((s, r))
            else:
                bad.append((s, r))
        good.sort(key=lambda sr: _key(sr[1]))
        for rank, (s, r) in enumerate(good, 1):
            oom_at = r.oom_entries[0] if r.oom_entries else None
            rows.append({
                "setting": s or "default", "capacity": c, "rank": rank,
                "peak_reserved": r.peak_reserved, "peak_allocated": r.peak_allocated,
                "reserved_over_allocated": (r.peak_reserved / r.peak_allocated
                                            if r.peak_allocated else 0.0),
                "live_ratio": r.peak_reserved / peak_live if peak_live else 0.0,
                "driver_allocs": r.num_device_alloc, "retries": r.retries, "ooms": r.ooms,
                "first_oom": oom_at[0] if oom_at else None,
                "first_oom_bytes": oom_at[1] if oom_at else None,
                "status": "out of memory" if r.ooms else "ok",
                "derived": (s, c) in derived,
            })
            results.append(r)
        for s, text in bad:
            refused.setdefault(s or "default", text)
            rows.append(_refused_row(s or "default", c, text))
            results.append(None)
    for s, text in refused.items():
        if not any(row["setting"] == s for row in rows):
            for c in caps:
                rows.append(_refused_row(s, c, text))
                results.append(None)
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    for name in ("capacity", "peak_reserved", "peak_allocated", "driver_allocs", "retries",
                 "ooms", "first_oom", "first_oom_bytes"):
        df[name] = df[name].astype("Int64")
    df.attrs["results"] = results
    df.attrs["refused"] = refused
    df.attrs["capacity_note"] = note
    df.attrs["capacities"] = caps
    df.attrs["peak_live"] = peak_live
    df.attrs["replays"] = replays
    df.attrs["source"] = tr.source
    df.attrs["entries"] = plan.n_entries
    df.attrs["workers"] = chosen
    df.attrs["elapsed_s"] = time.perf_counter() - start
    df.attrs["recommendation"] = recommendation(df)
    return df


def _refused_row(setting: str, capacity: int | None, reason: str) -> dict[str, Any]:
    return {"setting": setting, "capacity": capacity, "rank": 0, "peak_reserved": None,
            "peak_allocated": None, "reserved_over_allocated": float("nan"),
            "live_ratio": float("nan"), "driver_allocs": None, "retries": None, "ooms": None,
            "first_oom": None, "first_oom_bytes": None, "status": f"refused: {reason}",
            "derived": False}


def recommendation(df: Any, capacity: int | None | str = "first") -> dict[str, Any]:
    """The best setting of one capacity of an :func:`autotune` frame, as a line to paste.

    Parameters
    ----------
    df : pandas.DataFrame
        :func:`autotune`'s frame.
    capacity : int, None or "first", optional
        Which capacity's rows (default: the first capacity of the frame).

    Returns
    -------
    dict
        ``setting`` (the settings string, "" for the defaults), ``line``
        (``PYTORCH_CUDA_ALLOC_CONF=...`` to paste; cudalab reads it too, or
        ``CUDALAB_ALLOC_CONF``), ``capacity``, ``peak_reserved``,
        ``reserved_over_allocated``, ``retries``, ``saving`` (bytes against the defaults; None
        when they run out of memory there) and
        ``text`` (one sentence with what it costs); ``setting`` None when every setting ran
        out of memory at that capacity.
    """
    caps = df.attrs.get("capacities", [])
    if isinstance(capacity, str):
        if capacity != "first":
            raise ValueError(f"capacity must be bytes, None or 'first', got {capacity!r}")
        capacity = caps[0] if caps else None
    rows = df[(df["status"] == "ok") & _same_capacity(df["capacity"], capacity)]
    where = "an unconstraining device" if capacity is None else \
        f"a {format_bytes(int(capacity), decimals=2)} device"
    if not len(rows):
        return {"setting": None, "line": "", "capacity": capacity,
                "text": f"no setting fits the trace on {where}: every one ran out of memory"}
    best = rows.iloc[0]
    setting = "" if best["setting"] == "default" else str(best["setting"])
    base = df[(df["setting"] == "default") & _same_capacity(df["capacity"], capacity)]
    base_fits = bool(len(base)) and base["status"].iloc[0] == "ok"
    saving = int(base["peak_reserved"].iloc[0]) - int(best["peak_reserved"]) if base_fits \
        else None
    retries = int(best["retries"])
    if not setting:
        text = f"keep the defaults on {where}: no setting tried reserves less"
        line = ""
    else:
        line = f"PYTORCH_CUDA_ALLOC_CONF={setting}"
        cost = (f"; it costs {retries:,} allocation retries (each frees the cache and "
                "synchronises the device)" if retries else "; it costs no retry")
        peak = format_bytes(int(best["peak_reserved"]), decimals=2)
        against = (f"{format_bytes(saving, decimals=2)} less than the defaults" if saving
                   is not None else "the defaults run out of memory there")
        text = (f"on {where}, {setting} reserves {peak} at the peak ({against}, "
                f"reserved/allocated {best['reserved_over_allocated']:.3f}){cost}")
        calm = rows[rows["retries"] == 0]
        if retries and len(calm):
            alt = calm.iloc[0]
            text += (f"; without a retry the best is {alt['setting']} at "
                     f"{format_bytes(int(alt['peak_reserved']), decimals=2)} "
                     f"(reserved/allocated {alt['reserved_over_allocated']:.3f})")
    return {"setting": setting, "line": line, "capacity": capacity,
            "peak_reserved": int(best["peak_reserved"]),
            "reserved_over_allocated": float(best["reserved_over_allocated"]),
            "retries": retries, "saving": saving, "text": text}


def _isna(value: Any) -> bool:
    import pandas as pd

    return bool(pd.isna(value))


def _same_capacity(column: Any, capacity: int | None) -> Any:
    if capacity is None:
        return column.isna()
    return column.fillna(-1) == int(capacity)


# ============================================================================ text
def format_autotune(df: Any, *, top: int = 10) -> str:
    """The autotuner's table as text (``cudalab what-if --search``): per capacity its ``top``
    rows, then the refused settings, the recommendation and the run's cost."""
    lines = [f"autotune: {df.attrs.get('source', 'trace')}: {df.attrs.get('entries', 0):,} "
             f"alloc/free entries, {df['setting'].nunique()} settings x "
             f"{len(df.attrs.get('capacities', []))} capacities (SIMULATED replays of "
             "cudalab's allocator, torch's policy)"]
    if df.attrs.get("capacity_note"):
        lines.append(f"note: {df.attrs['capacity_note']}")
    header = ["rank", "setting", "peak reserved", "peak allocated", "res/alloc", "res/live",
              "driver allocs", "retries", "first OOM"]
    for capacity in df.attrs.get("capacities", []):
        part = df[_same_capacity(df["capacity"], capacity) & (df["rank"] > 0)]
        where = "unconstraining device" if capacity is None else \
            f"capacity {format_bytes(int(capacity), decimals=2)}"
        lines.append(f"-- {where}: {len(part)} settings, best first")
        rows = []
        for r in part.head(top).itertuples(index=False):
            first = "-" if _isna(r.first_oom) else \
                f"entry {int(r.first_oom):,} ({format_bytes(int(r.first_oom_bytes), decimals=1)})"
            rows.append([str(r.rank), str(r.setting),
                         format_bytes(int(r.peak_reserved), decimals=2),
                         format_bytes(int(r.peak_allocated), decimals=2),
                         f"{r.reserved_over_allocated:.3f}", f"{r.live_ratio:.3f}",
                         f"{int(r.driver_allocs):,}", f"{int(r.retries):,}", first])
        widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            lines.append("  ".join(c.ljust(w) if i == 1 else c.rjust(w)
                                   for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        rec = recommendation(df, capacity)
        lines.append(f"recommended: {rec['line'] or '(the defaults)'}")
        lines.append(f"  {rec['text']}")
    refused = df.attrs.get("refused") or {}
    for setting, reason in refused.items():
        lines.append(f"refused: {setting}: {reason}")
    lines.append(f"run time: {df.attrs.get('elapsed_s', 0.0):.2f} s, "
                 f"{df.attrs.get('replays', 0)} replays ({int(df['derived'].sum())} rows "
                 "derived without a replay: see the derived column)")
    return "\n".join(lines)


def settings_of(df: Any) -> Sequence[str]:
    """The settings of an :func:`autotune` frame, in first-seen order."""
    return list(dict.fromkeys(df["setting"]))
