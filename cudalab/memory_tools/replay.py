"""Replay an allocation trace through a fresh allocator: what would these settings have done?

A trace is the sequence of ``alloc`` and ``free_requested`` events of one device, as cudalab's
history recorder and torch's ``_record_memory_history`` write them (any form
:func:`cudalab.memory_tools.trace_io.load_trace` reads: a snapshot dict or pickle, a
DataFrame, a list of tuples). :func:`replay` feeds it through a brand-new caching allocator
(the settings of your choice) over a brand-new private
:class:`~cudalab._driver.sim.SimulatorBackend`, so it needs no GPU and never touches the
process's own cudalab state, and reports what that allocator would have done
(:class:`ReplayResult`): peak reserved, peak allocated, the reserved/allocated ratio at the
reserved peak, device allocations and frees, retries, out-of-memory errors, and
reserved/allocated over time. :mod:`cudalab.memory_tools.what_if` replays one trace under a
sweep of settings and ranks them.

Replay rules. Only ``alloc`` and ``free_requested`` (the user's free; ``free`` is accepted as
an older name) are replayed; ``free_completed``, ``segment_*``, ``snapshot`` and ``oom``
entries describe what the recorded allocator did and are ignored. Stream ids are passed to
the allocator as its int stream keys, so per-stream caching is reproduced. The replay is
best effort where the trace is incomplete, and one :class:`ReplayWarning` counts what was
skipped: frees of addresses that the trace never allocated (a trace truncated by
``max_entries`` starts with such frees), second frees, allocations of an address that is
still live, and allocations (with their frees) whose size is not a positive integer: a
string such as ``"512"``, a fraction such as ``512.5``, a bool, NaN or a size of 2⁶² or
more is skipped, never replayed as some other number of bytes. An entry that lacks
``action`` or ``size``, or whose ``addr``/``stream`` is not an integer, is a
:class:`~cudalab.memory_tools.safe_pickle.SnapshotLoadError` naming it. An allocation that
runs out of memory during the replay is recorded (``ooms``) and the replay goes on without
it; its later free is skipped. Trace files larger than ``CUDALAB_MAX_SNAPSHOT_BYTES``
(default 4 GiB) are refused.

The simulated device has ``device_memory`` bytes. By default it is unconstraining: four
times the trace's peak of live requested memory rounded up to a GiB, at least 16 GiB, and
doubled (up to 1 TiB) and replayed again while the allocator ran out of memory or had to
free its cache and retry, so that results never depend on it. Pass the real GPU's memory to
model that device instead: out-of-memory errors and retries then happen where they would,
and ``per_process_memory_fraction`` / ``garbage_collection_threshold`` become meaningful (the
``max_split_size_mb`` release step, too, only acts when the device is full).

``backend:cudaMallocAsync`` replays on the simulator's model of a stream-ordered pool (2 MiB
chunks, best fit, nothing released): its numbers are an estimate, while the native allocator
(with or without expandable segments) follows torch's policy exactly.

Speed: the pairing of frees with their allocations is computed with numpy before the replay,
so the replay loop only calls ``malloc``/``free`` of the allocator (roughly the cost of the
allocator itself per entry).
"""

from __future__ import annotations

import bisect
import os
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from itertools import islice
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from cudalab import _internal
from cudalab._atomic_write import atomic_write
from cudalab._units import GiB, MiB, format_bytes
from cudalab.allocator.config import AllocatorConfig, parse_alloc_conf
from cudalab.allocator.replay_target import ReplayTarget
from cudalab.errors import OutOfMemoryError
from cudalab.memory_tools.progress import progress_callback
from cudalab.memory_tools.trace_io import TraceArrays, load_trace

if TYPE_CHECKING:
    from cudalab._internal import Backend

__all__ = [
    "ReplayPlan",
    "ReplayResult",
    "ReplayWarning",
    "as_config",
    "config_text",
    "plan_replay",
    "replay",
    "replay_planned",
    "save_plot",
    "skip_warning",
]

_MIN_DEVICE = 16 * GiB
_MAX_DEVICE = 1 << 40  # the simulator's limit per device
_SAMPLES = 1000  # timeline points (plus the reserved peak)
_MAX_OOM_RECORDS = 100

_SKIP_TEXT = {
    "free_before_alloc": "frees of addresses the trace had not allocated",
    "double_free": "second frees of an address",
    "alloc_of_live_address": "allocations of an address that was still live",
    "invalid_size": "allocations (and their frees) with a size that is not a positive "
                    "integer",
}


class ReplayWarning(UserWarning):
    """Trace entries were skipped during a replay (the message counts them)."""


# ====================================================================================== pairing
@dataclass
class ReplayPlan:
    """The replayable part of a trace: entry indices, actions, sizes, streams, slots."""

    index: np.ndarray  # original entry index of each kept entry
    action: list[int]
    size: list[int]
    stream: list[int]
    slot: list[int]  # alloc: its own entry index; free: the entry index of its alloc
    n_entries: int
    skipped: dict[str, int]
    truncated: bool
    peak_live: int  # peak of live requested bytes (rounded to 512)


def plan_replay(tr: TraceArrays) -> ReplayPlan:
    """The replayable part of ``tr``: each free paired with its allocation (vectorised),
    the entries a replay cannot use counted in ``skipped``. One plan serves every replay of
    the trace (what-if replays it under many settings)."""
    n = len(tr)
    act = tr.action
    addr = tr.addr
    size = tr.size
    skipped: dict[str, int] = {}
    keep = np.ones(n, dtype=bool)
    slot = np.arange(n, dtype=np.int64)
    truncated = False
    if n:
        # Group entries by address (stable: time order inside a group). A well-formed group
        # alternates alloc, free, alloc, ...; each free's alloc is the entry before it.
        order = np.argsort(addr, kind="stable")
        sa = addr[order]
        sact = act[order]
        m = len(order)
        new_group = np.ones(m, dtype=bool)
        new_group[1:] = sa[1:] != sa[:-1]
        prev_act = np.empty(m, dtype=np.int8)
        prev_act[0] = 0
        prev_act[1:] = sact[:-1]
        ok = np.where(new_group, sact == 1, sact != prev_act)
        gid = np.cumsum(new_group) - 1
        bad_groups = np.unique(gid[~ok])
        frees = np.flatnonzero((sact == 0) & ~new_group)
        slot[order[frees]] = order[frees - 1]
        if len(bad_groups):
            starts = np.flatnonzero(new_group)
            stops = np.append(starts[1:], m)
            truncated = bool(act[0] == 0)
            for g in bad_groups.tolist():
                live = -1
                seen = False
                for k in order[starts[g]:stops[g]].tolist():
                    if act[k]:
                        if live >= 0:
                            keep[k] = False
                            skipped["alloc_of_live_address"] = \
                                skipped.get("alloc_of_live_address", 0) + 1
                        else:
                            live = k
                            seen = True
                    elif live < 0:
                        keep[k] = False
                        reason = "double_free" if seen else "free_before_alloc"
                        skipped[reason] = skipped.get(reason, 0) + 1
                    else:
                        slot[k] = live
                        live = -1
        # Allocations whose size is not a positive integer are dropped with their frees.
        bad_size = act.astype(bool) & (size <= 0)
        if bad_size.any():
            bad_size |= keep & (act == 0) & bad_size[slot]
            skipped["invalid_size"] = int((bad_size & keep).sum())
            keep &= ~bad_size
    idx = np.flatnonzero(keep)
    kact = act[idx]
    ksize = size[idx]
    kslot = slot[idx]
    if len(idx):
        rounded = (size[kslot] + 511) & -512
        delta = np.where(kact == 1, rounded, -rounded)
        peak_live = int(np.cumsum(delta).max(initial=0))
    else:
        peak_live = 0
    streams = tr.stream
    kstream = streams if len(idx) == n else [streams[i] for i in idx.tolist()]
    return ReplayPlan(idx, kact.tolist(), ksize.tolist(), kstream, kslot.tolist(), n, skipped,
                 truncated, peak_live)


# ====================================================================================== results
@dataclass
class ReplayResult:
    """What one allocator configuration did with a trace (see :func:`replay`)."""

    #: The settings string replayed ("" = the native defaults).
    config: str
    #: "native" or "cudaMallocAsync".
    backend: str
    expandable_segments: bool
    #: Memory of the simulated device, bytes.
    device_memory: int
    #: Where the trace came from (a path, "DataFrame", "trace" or the benchmark's name).
    source: str
    #: Alloc/free entries of the trace (other actions are counted in ``ignored``).
    entries: int
    #: Allocator calls made (allocations tried + frees).
    replayed: int
    allocs: int
    frees: int
    peak_reserved: int
    peak_allocated: int
    #: Allocated bytes at the moment reserved reached its peak, and that entry's index.
    allocated_at_peak: int
    peak_index: int
    #: peak_reserved / allocated_at_peak (how much of the reserved peak was not in use; 0.0
    #: when nothing could be allocated).
    ratio: float
    num_device_alloc: int
    num_device_free: int
    retries: int
    ooms: int
    #: (entry index, requested bytes) of the first out-of-memory allocations.
    oom_entries: list[tuple[int, int]]
    final_reserved: int
    final_allocated: int
    #: Skipped entries by reason (see the module documentation).
    skipped: dict[str, int]
    #: Non-replayed trace entries by action (free_completed, segment_alloc, ...).
    ignored: dict[str, int]
    #: The trace looks truncated (it starts with a free of an address it never allocated).
    truncated: bool
    #: Timeline: entry index, reserved and allocated bytes after that entry (int64 arrays).
    timeline_index: np.ndarray = field(repr=False)
    timeline_reserved: np.ndarray = field(repr=False)
    timeline_allocated: np.ndarray = field(repr=False)
    elapsed_s: float = 0.0
    entries_per_s: float = 0.0
    #: Reference values found with the trace: ``torch_peak_reserved`` /
    #: ``torch_peak_allocated`` (benchmark pickles), ``recorded_peak_reserved`` (the peak the
    #: trace's own segment_alloc/segment_free entries imply), ``allocs_in_earlier_segments``
    #: (allocations in memory reserved before the history began: a mid-session start).
    reference: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.config or "default"

    @property
    def skipped_total(self) -> int:
        return sum(v for k, v in self.skipped.items() if k != "free_after_oom")

    @property
    def fragmentation(self) -> np.ndarray:
        """1 - allocated/reserved at each timeline point (0 where nothing is reserved)."""
        res = self.timeline_reserved.astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            out = 1.0 - self.timeline_allocated / res
        return np.where(res > 0, out, 0.0)

    def timeline(self) -> dict[str, np.ndarray]:
        return {"index": self.timeline_index, "reserved": self.timeline_reserved,
                "allocated": self.timeline_allocated}

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values (the CLI's --json), the timeline as lists."""
        return {
            "config": self.config, "label": self.label, "backend": self.backend,
            "expandable_segments": self.expandable_segments,
            "device_memory": self.device_memory, "source": self.source,
            "entries": self.entries, "replayed": self.replayed, "allocs": self.allocs,
            "frees": self.frees, "peak_reserved": self.peak_reserved,
            "peak_allocated": self.peak_allocated, "allocated_at_peak": self.allocated_at_peak,
            "peak_index": self.peak_index, "ratio": self.ratio,
            "num_device_alloc": self.num_device_alloc, "num_device_free": self.num_device_free,
            "retries": self.retries, "ooms": self.ooms,
            "oom_entries": [list(e) for e in self.oom_entries],
            "final_reserved": self.final_reserved, "final_allocated": self.final_allocated,
            "skipped": dict(self.skipped), "ignored": dict(self.ignored),
            "truncated": self.truncated, "elapsed_s": self.elapsed_s,
            "entries_per_s": self.entries_per_s, "reference": dict(self.reference),
            "timeline": {"index": self.timeline_index.tolist(),
                         "reserved": self.timeline_reserved.tolist(),
                         "allocated": self.timeline_allocated.tolist()},
        }

    def rows(self) -> list[tuple[str, str]]:
        """(name, value) pairs of the summary table."""
        rows = [
            ("trace", self.source),
            ("config", self.label + ("" if self.backend == "native" or self.config
                                     else f" ({self.backend})")),
            ("simulated device", format_bytes(self.device_memory, decimals=2)),
            ("entries", f"{self.entries:,} ({self.allocs:,} allocs, {self.frees:,} frees "
                        f"replayed)"),
            ("peak reserved", format_bytes(self.peak_reserved, decimals=2)),
            ("peak allocated", format_bytes(self.peak_allocated, decimals=2)),
            ("reserved/allocated at peak",
             f"{self.ratio:.3f} (allocated {format_bytes(self.allocated_at_peak, decimals=2)} "
             f"at entry {self.peak_index})"),
            ("device mallocs / frees", f"{self.num_device_alloc:,} / {self.num_device_free:,}"),
            ("alloc retries", f"{self.retries:,}"),
            ("OOMs", f"{self.ooms:,}"),
        ]
        for key in ("torch_peak_reserved", "recorded_peak_reserved"):
            ref = self.reference.get(key)
            if ref:
                name = "torch peak reserved" if key.startswith("torch") else \
                    "recorded peak reserved"
                rows.append((name, f"{format_bytes(ref, decimals=2)} (replay/recorded "
                                   f"{self.peak_reserved / ref:.4f})"))
        if self.skipped:
            rows.append(("skipped", ", ".join(f"{k} {v:,}" for k, v in self.skipped.items())))
        if self.truncated:
            rows.append(("truncated", "yes (the trace starts with frees of blocks allocated "
                                      "before it began: history started mid-session, or "
                                      "max_entries; the replay leaves those blocks out)"))
        earlier = self.reference.get("allocs_in_earlier_segments")
        if earlier:
            rows.append(("note", f"{earlier:,} allocations reused memory reserved before the "
                                 "history began (started mid-session): the recorded peak "
                                 "leaves that memory out, the replay starts from nothing, "
                                 "so replay/recorded above 1 is expected"))
        rows.append(("replay speed", f"{self.entries_per_s:,.0f} entries/s "
                                     f"({self.elapsed_s:.3f} s)"))
        return rows

    def __str__(self) -> str:
        rows = self.rows()
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k.ljust(w)}  {v}" for k, v in rows)

    def _repr_html_(self) -> str:
        import html

        body = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th>"
                       f"<td style='text-align:left'>{html.escape(v)}</td></tr>"
                       for k, v in self.rows())
        return f"<table class='cudalab-replay'>{body}</table>"


# ====================================================================================== replay
def _simulator(device_memory: int) -> Backend:
    """A private one-device simulator backend of ``device_memory`` bytes."""
    return _internal.private_simulator(device_count=1, memory=int(device_memory))


class _TraceAddresses:
    """The replay's simulator, handing out the trace's own segment addresses.

    torch's best fit breaks ties between equal-size free blocks by address, so where the
    segments sit decides which block is reused. While the replay asks for segments of the
    sizes the trace recorded, in the same order, each gets the address it had in the traced
    run (a replay with torch's settings then makes torch's choices); once the sequences part,
    or an address would overlap a live segment, segments get fresh addresses above every
    traced one. The simulator still holds the memory (capacity, out-of-memory).
    """

    def __init__(self, sim: Backend, segments: list[tuple[int, int]]):
        self._sim = sim
        self._queue = deque(segments)
        self._real: dict[int, int] = {}  # handed-out address -> simulator address
        self._starts: list[int] = []  # sorted live handed-out addresses
        self._sizes: dict[int, int] = {}
        top = max((a + n for a, n in segments), default=0)
        self._next = ((top + (1 << 30)) >> 21) << 21
        self.faithful = 0  # segments placed at their traced address

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sim, name)

    def _free_range(self, addr: int, size: int) -> bool:
        i = bisect.bisect_left(self._starts, addr)
        if i < len(self._starts) and self._starts[i] < addr + size:
            return False
        return not (i and self._starts[i - 1] + self._sizes[self._starts[i - 1]] > addr)

    def mem_alloc(self, device: int, nbytes: int) -> int:
        real = self._sim.mem_alloc(device, nbytes)
        q = self._queue
        if q and q[0][1] == nbytes and self._free_range(q[0][0], nbytes):
            addr = q.popleft()[0]
            self.faithful += 1
        else:
            q.clear()  # the runs have parted: no traced address is reliable any more
            addr = self._next
            self._next += ((nbytes + (2 << 20) - 1) >> 21) << 21
        self._real[addr] = real
        bisect.insort(self._starts, addr)
        self._sizes[addr] = nbytes
        return addr

    def mem_free(self, device: int, ptr: int) -> None:
        real = self._real.pop(ptr)
        del self._starts[bisect.bisect_left(self._starts, ptr)]
        del self._sizes[ptr]
        self._sim.mem_free(device, real)


def as_config(config: str | AllocatorConfig | None) -> AllocatorConfig:
    """An :class:`AllocatorConfig` from a settings string, a config or None (the defaults);
    ValueError for bad settings, TypeError for anything else."""
    if config is None:
        return AllocatorConfig()
    if isinstance(config, AllocatorConfig):
        return config
    if isinstance(config, str):
        return parse_alloc_conf(config.strip(), source="replay config")
    raise TypeError(f"config must be an allocator settings string or an AllocatorConfig, "
                    f"got {type(config).__name__}")


def config_text(cfg: AllocatorConfig) -> str:
    """The settings string of ``cfg``: as given when parsed, else rebuilt from the fields
    that differ from the defaults (for configs built in code), "" for the defaults."""
    if cfg.text.strip():
        return cfg.text.strip()
    default = AllocatorConfig()
    parts = []
    for f in fields(AllocatorConfig):
        name = f.name
        value = getattr(cfg, name)
        if name in ("text", "source", "keys") or value == getattr(default, name):
            continue
        if name in ("max_split_size", "max_non_split_rounding_size", "large_segment_size"):
            key = {"max_split_size": "max_split_size_mb",
                   "max_non_split_rounding_size": "max_non_split_rounding_mb",
                   "large_segment_size": "large_segment_size_mb"}[name]
            parts.append(f"{key}:{value // MiB}")
        elif name == "roundup_power2_divisions":
            if len(set(value)) == 1:
                parts.append(f"{name}:{value[0]}")
            else:
                parts.append(f"{name}:[" + ",".join(f"{1 << i}:{d}" for i, d in
                                                     enumerate(value)) + "]")
        else:
            parts.append(f"{name}:{value}")
    return ",".join(parts)


def _auto_memory(peak_live: int) -> int:
    want = max(_MIN_DEVICE, 4 * peak_live)
    return min(_MAX_DEVICE, -(-want // GiB) * GiB)


def _run(plan: ReplayPlan, cfg: AllocatorConfig, device_memory: int,
         progress: Callable[[int, int], None] | None,
         segments: list[tuple[int, int]] | None = None,
         stop_at_oom: bool = False) -> dict[str, Any]:
    """One replay over a fresh simulator; the raw numbers (up to the first out-of-memory
    with ``stop_at_oom``)."""
    sim = _simulator(device_memory)
    backend = (_TraceAddresses(sim, segments)
               if segments and not cfg.expandable_segments and cfg.backend == "native" else sim)
    target = ReplayTarget(cast("Backend", backend), cfg)
    is_async = target.is_async
    if is_async:
        keys = {s: target.stream_key(s) for s in set(plan.stream)}
        streams = [keys[s] for s in plan.stream]
    else:
        streams = plan.stream
    allocated = target.allocated
    reserved = target.reserved
    n = len(plan.action)
    index = plan.index
    stride = max(1, -(-n // _SAMPLES))
    t_index: list[int] = [0] if n else []
    t_res: list[int] = [0] if n else []
    t_alloc: list[int] = [0] if n else []
    malloc = target.malloc
    free = target.free
    stats = target.stats
    ptrs: list[int] = [0] * (plan.n_entries or 1)
    oom_entries: list[tuple[int, int]] = []
    failed: list[int] = []
    ooms = 0
    last_peak = 0
    peak_index = -1
    alloc_at_peak = 0
    on_plateau = False
    it = zip(plan.action, plan.size, streams, plan.slot)
    usage = target.pool_usage
    pool_reserved = 0  # (async) the pool's reserved bytes after the last malloc
    pool_grown = 0  # (async) mallocs that grew the pool: its device allocations
    done = 0
    t0 = time.perf_counter()
    while done < n:
        chunk = min(stride, n - done)
        # The hot loops: one malloc or free per entry. After each malloc, one attribute read
        # tells whether reserved reached a new peak; while reserved stays at its peak (a
        # plateau: reserved only moves inside malloc), the largest allocated value is kept,
        # so the ratio is reserved/allocated at the busiest moment of the reserved peak.
        if usage is not None:  # cudaMallocAsync: the pool's figures are a driver query
            c = stats.large
            for a, size, s, k in islice(it, chunk):
                if a:
                    try:
                        ptrs[k] = malloc(size, s)
                    except OutOfMemoryError:
                        ooms += 1
                        failed.append(k)
                        if len(oom_entries) < _MAX_OOM_RECORDS:
                            oom_entries.append((k, size))
                        if stop_at_oom:
                            break
                        continue
                    res, res_high, _, _ = usage()
                    if res != pool_reserved:  # the pool grows by one device allocation
                        if res > pool_reserved:
                            pool_grown += 1
                        pool_reserved = res
                    if res_high != last_peak:
                        last_peak = res_high
                        peak_index = k
                        alloc_at_peak = c.b_alloc
                        on_plateau = True
                    elif on_plateau and c.b_alloc > alloc_at_peak:
                        if res == last_peak:
                            alloc_at_peak = c.b_alloc
                            peak_index = k
                        else:
                            on_plateau = False
                else:
                    free(ptrs[k])
        else:
            agg = stats.agg
            sp = stats.small
            lp = stats.large
            for a, size, s, k in islice(it, chunk):
                if a:
                    try:
                        ptrs[k] = malloc(size, s)
                    except OutOfMemoryError:
                        ooms += 1
                        failed.append(k)
                        if len(oom_entries) < _MAX_OOM_RECORDS:
                            oom_entries.append((k, size))
                        if stop_at_oom:
                            break
                        continue
                    if agg.b_res_peak != last_peak:
                        last_peak = agg.b_res_peak
                        peak_index = k
                        alloc_at_peak = sp.b_alloc + lp.b_alloc
                        on_plateau = True
                    elif on_plateau and sp.b_alloc + lp.b_alloc > alloc_at_peak:
                        if sp.b_res + lp.b_res == last_peak:
                            alloc_at_peak = sp.b_alloc + lp.b_alloc
                            peak_index = k
                        else:
                            on_plateau = False
                else:
                    free(ptrs[k])  # 0 after an out-of-memory: free(0) is a no-op
        if stop_at_oom and ooms:
            break
        done += chunk
        t_index.append(int(index[done - 1]))
        t_res.append(reserved())
        t_alloc.append(allocated())
        if progress is not None:
            progress(done, n)
    elapsed = time.perf_counter() - t0
    final = target.memory_stats()
    if is_async:
        n_dev_alloc = pool_grown
        n_dev_free = 0
        retries = 0
    else:
        n_dev_alloc = final["num_device_alloc"]
        n_dev_free = final["num_device_free"]
        retries = final["num_alloc_retries"]
    peak_reserved = final["reserved_bytes.all.peak"]
    # Insert the exact reserved peak into the timeline (samples may straddle it).
    if peak_index >= 0:
        j = int(np.searchsorted(np.asarray(t_index), peak_index, side="right"))
        t_index.insert(j, peak_index)
        t_res.insert(j, last_peak)
        t_alloc.insert(j, alloc_at_peak)
    frees_after_oom = 0
    if failed:
        fail = np.asarray(failed, dtype=np.int64)
        acts = np.asarray(plan.action, dtype=np.int8)
        slots = np.asarray(plan.slot, dtype=np.int64)
        frees_after_oom = int(np.isin(slots[acts == 0], fail).sum())
    n_allocs = int(sum(plan.action))
    out = {
        "peak_reserved": peak_reserved,
        "peak_allocated": final["allocated_bytes.all.peak"],
        "allocated_at_peak": alloc_at_peak,
        "peak_index": peak_index,
        "num_device_alloc": n_dev_alloc,
        "num_device_free": n_dev_free,
        "retries": retries,
        "ooms": ooms,
        "oom_entries": oom_entries,
        "final_reserved": reserved(),
        "final_allocated": allocated(),
        "allocs": n_allocs,
        "frees": n - n_allocs - frees_after_oom,
        "frees_after_oom": frees_after_oom,
        "replayed": n - frees_after_oom,
        "elapsed": elapsed,
        "timeline": (np.asarray(t_index, dtype=np.int64), np.asarray(t_res, dtype=np.int64),
                     np.asarray(t_alloc, dtype=np.int64)),
    }
    try:
        target.close()
    except Exception:  # pragma: no cover - the private simulator is dropped anyway
        pass
    return out


def skip_warning(plan: ReplayPlan, source: str) -> str | None:
    """The :class:`ReplayWarning` text counting what ``plan`` skipped (None: nothing)."""
    if not plan.skipped:
        return None
    total = sum(plan.skipped.values())
    parts = [f"{v:,} {_SKIP_TEXT.get(k, k)}" for k, v in plan.skipped.items()]
    text = (f"replay of {source}: skipped {total:,} of {plan.n_entries:,} alloc/free entries: "
            + "; ".join(parts))
    if plan.truncated:
        text += (" (the trace starts with frees: the history was started mid-session or "
                 "truncated by max_entries, so memory allocated before it began is missing "
                 "from the replay)")
    return text


def replay_planned(tr: TraceArrays, plan: ReplayPlan, config: Any,
                   device_memory: int | None,
                   progress: Callable[[int, int], None] | None,
                   stop_at_oom: bool = False) -> ReplayResult:
    """One replay of ``plan`` (made from ``tr`` by :func:`plan_replay`) with ``config``;
    see :func:`replay` for the arguments. Issues no warning (see :func:`skip_warning`).
    ``stop_at_oom``: end the replay at its first out-of-memory (the searches rank such a
    setting last whatever follows; its figures are then those up to that entry)."""
    cfg = as_config(config)
    if device_memory is not None:
        memory = int(device_memory)
        if not (1 << 20) <= memory <= _MAX_DEVICE:
            raise ValueError(f"device_memory must be between 1 MiB and 1 TiB, got {memory}")
        auto = False
    else:
        memory = _auto_memory(plan.peak_live)
        auto = cfg.per_process_memory_fraction is None
    while True:
        raw = _run(plan, cfg, memory, progress, tr.segments, stop_at_oom)
        if not (auto and (raw["ooms"] or raw["retries"]) and memory < _MAX_DEVICE):
            break
        memory = min(_MAX_DEVICE, memory * 2)  # the simulated device was too small
    skipped = dict(plan.skipped)
    if raw["frees_after_oom"]:
        skipped["free_after_oom"] = raw["frees_after_oom"]
    at_peak = raw["allocated_at_peak"]
    peak_res = raw["peak_reserved"]
    ratio = peak_res / at_peak if at_peak else 0.0
    idx, res, alc = raw["timeline"]
    elapsed = raw["elapsed"]
    return ReplayResult(
        config=config_text(cfg), backend=cfg.backend,
        expandable_segments=cfg.expandable_segments and cfg.backend == "native",
        device_memory=memory, source=tr.source, entries=plan.n_entries,
        replayed=raw["replayed"], allocs=raw["allocs"], frees=raw["frees"],
        peak_reserved=peak_res, peak_allocated=raw["peak_allocated"],
        allocated_at_peak=at_peak, peak_index=raw["peak_index"], ratio=ratio,
        num_device_alloc=raw["num_device_alloc"], num_device_free=raw["num_device_free"],
        retries=raw["retries"], ooms=raw["ooms"], oom_entries=raw["oom_entries"],
        final_reserved=raw["final_reserved"], final_allocated=raw["final_allocated"],
        skipped=skipped, ignored=dict(tr.ignored), truncated=plan.truncated,
        timeline_index=idx, timeline_reserved=res, timeline_allocated=alc,
        elapsed_s=elapsed,
        entries_per_s=(raw["replayed"] / elapsed) if elapsed > 0 else float("inf"),
        reference=_reference(tr, plan),
    )


def _reference(tr: TraceArrays, plan: ReplayPlan) -> dict[str, Any]:
    ref = dict(tr.reference)
    if plan.truncated or plan.skipped.get("free_before_alloc"):
        # The trace began after memory was already reserved: its segment entries only give
        # the change since then, not the recorded run's peak.
        ref.pop("recorded_peak_reserved", None)
    return ref


def replay(trace: Any, config: str | AllocatorConfig | None = None, *,
           device_memory: int | None = None, device: int = 0,
           progress: bool | Callable[[int, int], None] = False) -> ReplayResult:
    """Replay ``trace`` through a fresh allocator with ``config`` on a private simulator.

    Parameters
    ----------
    trace
        A snapshot dict, a snapshot pickle path, a DataFrame (action, addr, size,
        stream[, device]) or a list of (action, addr, size, stream) tuples (see
        :func:`cudalab.memory_tools.trace_io.load_trace`).
    config : str, AllocatorConfig or None
        Allocator settings in ``PYTORCH_ALLOC_CONF`` grammar
        (``"expandable_segments:True,max_split_size_mb:128"``), an
        :class:`~cudalab.memory.AllocatorConfig`, or None for the native defaults.
    device_memory : int, optional
        Bytes of the simulated device (default: large enough, see the module documentation).
    device : int, optional
        Which device's trace of a snapshot to replay (default 0).
    progress : bool or callable, optional
        True for a text progress bar on stderr, or a ``callable(done, total)``.

    Returns
    -------
    ReplayResult
        What the allocator did; out-of-memory errors during the replay are counted in it,
        never raised. Skipped entries are reported by one :class:`ReplayWarning`.

    Raises
    ------
    TraceError
        (a ValueError, :mod:`cudalab.memory_tools.trace_io`) The trace cannot be read.
    SnapshotLoadError
        (a ValueError) The file is too large or too deeply nested, or a trace entry is
        malformed (the message names its index and key).
    ValueError
        Bad settings or ``device_memory``.
    """
    tr = load_trace(trace, device)
    plan = plan_replay(tr)
    fn, bar = progress_callback(progress, config_text(as_config(config)) or "default")
    try:
        result = replay_planned(tr, plan, config, device_memory, fn)
    finally:
        if bar is not None:
            bar.close()
    text = skip_warning(plan, tr.source)
    if text:
        warnings.warn(text, ReplayWarning, stacklevel=2)
    return result


# ====================================================================================== plots
def save_plot(results: ReplayResult | Sequence[ReplayResult], path: str | os.PathLike[str],
              title: str | None = None) -> None:
    """Save reserved (solid) and allocated (dashed) memory over the trace, one colour per
    config, as PNG or SVG (by ``path``'s extension). Needs matplotlib."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".png", ".svg"):
        raise ValueError(f"plot file must end in .png or .svg, got {path!r}")
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("install matplotlib to save plots (pip install matplotlib)") from None
    if isinstance(results, ReplayResult):
        results = [results]
    fig = Figure(figsize=(10, 5.5), layout="constrained")
    ax = fig.add_subplot()
    for i, r in enumerate(results):
        color = f"C{i % 10}"
        ax.plot(r.timeline_index, r.timeline_reserved / GiB, color=color, lw=1.4,
                label=f"{r.label} reserved (peak {format_bytes(r.peak_reserved, decimals=2)})")
        ax.plot(r.timeline_index, r.timeline_allocated / GiB, color=color, lw=1.0, ls="--",
                alpha=0.8, label=f"{r.label} allocated")
    ax.set_xlabel("trace entry")
    ax.set_ylabel("GiB")
    if title is None and results:
        title = f"allocator replay: {results[0].source}"
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left")
    with atomic_write(path, "wb") as f:  # a failure leaves the previous file intact
        fig.savefig(f, format=ext[1:])
