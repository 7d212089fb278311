"""Replay an allocation trace through a fresh allocator, and sweep allocator settings (what-if).

A trace is the sequence of ``alloc`` and ``free_requested`` events of one device, as cudalab's
history recorder and torch's ``_record_memory_history`` write them. :func:`replay` feeds it
through a brand-new caching allocator (the settings of your choice) over a brand-new private
:class:`~cudalab._driver.sim.SimulatorBackend`, so it needs no GPU and never touches the
process's own cudalab state, and reports what that allocator would have done: peak reserved,
peak allocated, the reserved/allocated ratio at the reserved peak, device allocations and
frees, retries, out-of-memory errors, and reserved/allocated over time.
:func:`what_if` replays the same trace under a sweep of settings and ranks them by peak
reserved memory: "which allocator config would have fit my run in less memory?".

Accepted traces (``trace`` argument):

* a snapshot dict (``cudalab.memory._snapshot()`` or ``torch.cuda.memory._snapshot()``): the
  entries of ``device_traces[device]``;
* the path of a snapshot pickle (cudalab's ``_dump_snapshot`` or torch's), read with the
  restricted unpickler of :func:`cudalab.memory.load_snapshot` (a pickle from a stranger
  cannot run code); a pickled dict ``{"trace": [(action, addr, size, stream), ...]}`` (the
  allocator benchmark's format) is read too;
* a pandas DataFrame with columns ``action``, ``addr``, ``size``, ``stream`` (and optionally
  ``device``), as :func:`cudalab.memory.history_frame` returns;
* a list of ``(action, addr, size, stream)`` tuples, or of trace entry dicts.

Replay rules. Only ``alloc`` and ``free_requested`` (the user's free; ``free`` is accepted as
an older name) are replayed; ``free_completed``, ``segment_*``, ``snapshot`` and ``oom``
entries describe what the recorded allocator did and are ignored. Stream ids are passed to
the allocator as its int stream keys, so per-stream caching is reproduced. The replay is
best effort where the trace is incomplete, and one :class:`ReplayWarning` counts what was
skipped: frees of addresses that the trace never allocated (a trace truncated by
``max_entries`` starts with such frees), second frees, and allocations of an address that is
still live. An allocation that runs out of memory during the replay is recorded (``ooms``)
and the replay goes on without it; its later free is skipped.

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
import math
import os
import pickle
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from itertools import islice
from typing import Any

import numpy as np

from cudalab.errors import OutOfMemoryError
from cudalab.allocator.config import AllocatorConfig, parse_alloc_conf

__all__ = [
    "ReplayResult",
    "ReplayWarning",
    "TraceError",
    "DEFAULT_WHAT_IF_CONFIGS",
    "GC_CONFIG",
    "load_trace",
    "replay",
    "what_if",
    "save_plot",
    "format_what_if",
    "parse_size",
]

GiB = 1 << 30
MiB = 1 << 20
_MIN_DEVICE = 16 * GiB
_MAX_DEVICE = 1 << 40  # the simulator's limit per device
_SAMPLES = 1000  # timeline points (plus the reserved peak)
_MAX_OOM_RECORDS = 100

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

_SKIP_TEXT = {
    "free_before_alloc": "frees of addresses the trace had not allocated",
    "double_free": "second frees of an address",
    "alloc_of_live_address": "allocations of an address that was still live",
    "invalid_size": "allocations (and their frees) with a size that is not a positive "
                    "integer",
}


class TraceError(ValueError):
    """The trace cannot be read or has the wrong shape (a one-line message)."""


class ReplayWarning(UserWarning):
    """Trace entries were skipped during a replay (the message counts them)."""


# ====================================================================================== loading
@dataclass
class _Trace:
    """A trace reduced to parallel numpy arrays of its alloc/free entries."""

    source: str
    action: np.ndarray  # int8: 1 alloc, 0 free
    addr: np.ndarray  # int64 (dense ids when the addresses do not fit int64)
    size: np.ndarray  # int64
    stream: list[int]
    ignored: dict[str, int] = field(default_factory=dict)
    reference: dict[str, Any] = field(default_factory=dict)
    #: (address, size) of the trace's segment_alloc entries, in order (see _TraceAddresses).
    segments: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.action)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _load_pickle(path: str) -> Any:
    """Read a trace pickle without running code from it.

    Snapshots go through :func:`cudalab.memory.load_snapshot` (its restricted unpickler);
    plain-data pickles that are not snapshots (the allocator benchmark's
    ``{"trace": [...]}`` dicts, lists of tuples) are then read by this module's own
    restricted unpickler, which equally refuses every class and function reference.
    """
    try:
        from cudalab.memory_tools.snapshot import load_snapshot
    except ImportError:  # pragma: no cover - snapshot.py ships with cudalab
        return _restricted_load(path)
    try:
        return load_snapshot(path)
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # refused, truncated, not a snapshot: one line, no traceback
        why = _first_line(exc)
    try:
        obj = _restricted_load(path)
    except TraceError:
        obj = None
    if (isinstance(obj, dict) and isinstance(obj.get("trace"), list)) or \
            (isinstance(obj, list) and obj and isinstance(obj[0], (tuple, list))):
        return obj
    raise TraceError(why if path in why else f"cannot load {path}: {why}")


class _PlainUnpickler(pickle.Unpickler):
    """Only plain builtins (dict, list, tuple, str, bytes, int, float, bool, None)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name}: a trace pickle may only hold plain Python "
            "values (dict, list, tuple, str, int, float, bool, None)")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refusing to load a persistent id: a trace pickle may "
                                     "only hold plain Python values")


def _restricted_load(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            return _PlainUnpickler(f).load()
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None
    except RecursionError:
        raise TraceError(f"cannot load {path}: nested too deeply") from None
    except Exception as exc:
        raise TraceError(f"cannot load {path}: not a trace pickle ({_first_line(exc)})") \
            from None


def _is_dataframe(obj: Any) -> bool:
    mod = type(obj).__module__ or ""
    return mod.startswith("pandas") and hasattr(obj, "columns") and hasattr(obj, "to_numpy")


_ACTION_CODE = {"alloc": 1, "free_requested": 0, "free": 0}
_SEGMENT_SIGN = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def _int_array(values: Any, what: str, source: str) -> np.ndarray:
    try:
        arr = np.asarray(values)
        if arr.dtype.kind == "f" and np.isfinite(arr).all() and (arr == np.round(arr)).all():
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            arr = np.asarray([int(v) for v in values], dtype=np.int64)
        return arr.astype(np.int64, copy=False)
    except (OverflowError, TypeError, ValueError):
        raise TraceError(f"{source}: trace {what} values must be integers") from None


def _from_columns(source: str, actions: Sequence[Any], addrs: Any, sizes: Any,
                  streams: Any) -> _Trace:
    """Keep alloc/free entries, count the others by action (vectorised)."""
    n = len(actions)
    if n == 0:
        z = np.zeros(0, np.int64)
        return _Trace(source, np.zeros(0, np.int8), z, z, [])
    get = _ACTION_CODE.get
    try:
        codes = np.array([get(a, 2) for a in actions], dtype=np.int8)
    except TypeError:  # unhashable actions
        codes = np.array([get(a, 2) if isinstance(a, str) else 2 for a in actions],
                         dtype=np.int8)
    keep = np.flatnonzero(codes < 2)
    ignored: dict[str, int] = {}
    ref: dict[str, Any] = {}
    seg_allocs: list = []
    if len(keep) < n:
        other = np.flatnonzero(codes == 2).tolist()
        sign = []
        seg_idx = []
        for i in other:
            a = actions[i]
            a = a if isinstance(a, str) else str(a)
            ignored[a] = ignored.get(a, 0) + 1
            sg = _SEGMENT_SIGN.get(a)
            if sg is not None:
                sign.append(sg)
                seg_idx.append(i)
        if seg_idx:
            try:
                seg_allocs = [(int(addrs[i]), int(sizes[i])) for i, sg in zip(seg_idx, sign)
                              if sg > 0 and actions[i] == "segment_alloc"]
            except (OverflowError, TypeError, ValueError):
                seg_allocs = []
            try:
                seg_sizes = np.asarray([sizes[i] for i in seg_idx], dtype=np.int64)
                ref["recorded_peak_reserved"] = int(
                    np.cumsum(seg_sizes * np.asarray(sign, dtype=np.int64)).max(initial=0))
            except (OverflowError, TypeError, ValueError):
                pass
    all_kept = len(keep) == n

    def pick(values: Any) -> Any:
        if all_kept:
            return values
        if isinstance(values, np.ndarray):
            return values[keep]
        return [values[i] for i in keep.tolist()]

    try:
        addr = np.asarray(pick(addrs), dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        addr = _object_keys(pick(addrs))
    size_in = pick(sizes)
    try:
        size = np.asarray(size_in, dtype=np.int64)
        if size.dtype.kind == "f":
            raise TypeError
    except (OverflowError, TypeError, ValueError):
        size = np.asarray([s if isinstance(s, (int, np.integer)) and 0 < s < (1 << 62) else -1
                           for s in size_in], dtype=np.int64)
    stream = _int_array(pick(streams), "stream", source).tolist()
    return _Trace(source, codes[keep], addr, size, stream, ignored, ref, seg_allocs)


def _object_keys(values: Sequence[Any]) -> np.ndarray:
    """Addresses that do not fit int64 (or are not ints): dense int ids by equality."""
    ids: dict[Any, int] = {}
    return np.asarray([ids.setdefault(v, len(ids)) for v in values], dtype=np.int64)


def _from_entries(source: str, entries: Sequence[Any]) -> _Trace:
    if not entries:
        return _from_columns(source, [], [], [], [])
    first = entries[0]
    if isinstance(first, dict):
        try:
            actions = [e["action"] for e in entries]
            addrs = [e.get("addr", 0) for e in entries]
            sizes = [e.get("size", 0) for e in entries]
            streams = [e.get("stream", 0) for e in entries]
        except (KeyError, TypeError, AttributeError):
            raise TraceError(f"{source}: trace entries must be dicts with 'action', 'addr', "
                             "'size' and 'stream'") from None
        return _from_columns(source, actions, addrs, sizes, streams)
    try:  # (zip(*entries) is quadratic-ish for a million tuples: pick columns one by one)
        actions = [e[0] for e in entries]
        addrs = [e[1] for e in entries]
        sizes = [e[2] for e in entries]
        streams = [e[3] for e in entries]
    except (TypeError, IndexError, KeyError):
        raise TraceError(f"{source}: a trace list must hold (action, addr, size, stream) tuples "
                         "or trace entry dicts") from None
    return _from_columns(source, actions, addrs, sizes, streams)


def _from_dataframe(source: str, df: Any, device: int | None) -> _Trace:
    missing = [c for c in ("action", "addr", "size", "stream") if c not in df.columns]
    if missing:
        raise TraceError(f"{source}: the DataFrame lacks column(s) {', '.join(missing)} "
                         "(needs action, addr, size, stream)")
    if device is not None and "device" in df.columns:
        dev = df["device"]
        df = df[(dev == device) | dev.isna()]

    def col(name: str) -> np.ndarray:
        c = df[name]
        if c.isna().any():
            c = c.fillna(0)
        return c.to_numpy()

    return _from_columns(source, df["action"].tolist(), col("addr"), col("size"), col("stream"))


def _from_snapshot(source: str, snap: dict, device: int) -> _Trace:
    traces = snap.get("device_traces")
    if not isinstance(traces, list):
        raise TraceError(f"{source}: the snapshot has no 'device_traces' list (was history "
                         "recording on? cudalab.memory.record_history() / "
                         "torch.cuda.memory._record_memory_history())")
    if not 0 <= device < len(traces):
        raise TraceError(f"{source}: no trace for device {device} (the snapshot has "
                         f"{len(traces)} device trace(s))")
    entries = traces[device]
    if not isinstance(entries, list):
        raise TraceError(f"{source}: device_traces[{device}] is not a list")
    if not entries:
        others = [i for i, t in enumerate(traces) if t]
        if others:
            raise TraceError(f"{source}: the trace of device {device} is empty; devices with "
                             f"entries: {', '.join(map(str, others))} (use device=...)")
    return _from_entries(source, entries)


def load_trace(trace: Any, device: int = 0) -> _Trace:
    """Read any accepted trace form (see the module documentation) into arrays."""
    if not isinstance(device, int) or isinstance(device, bool) or device < 0:
        raise TraceError(f"device must be a device index (int >= 0), got {device!r}")
    source = "trace"
    reference: dict[str, Any] = {}
    if isinstance(trace, (str, os.PathLike)):
        source = os.fspath(trace)
        if os.path.isdir(source):
            raise TraceError(f"cannot read {source}: it is a directory, not a trace pickle")
        trace = _load_pickle(source)
    if isinstance(trace, _Trace):
        return trace
    if _is_dataframe(trace):
        return _from_dataframe("DataFrame" if source == "trace" else source, trace, device)
    if isinstance(trace, dict):
        if "device_traces" in trace or "segments" in trace:
            return _from_snapshot(source, trace, device)
        if "trace" in trace:  # the allocator benchmark's {"name", "trace", "torch_peak_*"}
            for key in ("torch_peak_reserved", "torch_peak_allocated"):
                if isinstance(trace.get(key), int):
                    reference[key] = trace[key]
            if isinstance(trace.get("name"), str) and source == "trace":
                source = trace["name"]
            tr = _from_entries(source, trace["trace"])
            tr.reference.update(reference)
            return tr
        raise TraceError(f"{source}: a dict trace must be a memory snapshot (with "
                         "'device_traces') or hold a 'trace' list")
    if isinstance(trace, (list, tuple)):
        return _from_entries(source, trace)
    raise TraceError(f"cannot replay a {type(trace).__name__}: give a snapshot dict, a snapshot "
                     "pickle path, a DataFrame (action, addr, size, stream) or a list of "
                     "(action, addr, size, stream) tuples")


# ====================================================================================== pairing
@dataclass
class _Plan:
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


def _plan(tr: _Trace) -> _Plan:
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
    return _Plan(idx, kact.tolist(), ksize.tolist(), kstream, kslot.tolist(), n, skipped,
                 truncated, peak_live)


# ====================================================================================== results
def _fmt_bytes(n: int | float) -> str:
    n = float(n)
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


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
    #: trace's own segment_alloc/segment_free entries imply).
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
            ("simulated device", _fmt_bytes(self.device_memory)),
            ("entries", f"{self.entries:,} ({self.allocs:,} allocs, {self.frees:,} frees "
                        f"replayed)"),
            ("peak reserved", _fmt_bytes(self.peak_reserved)),
            ("peak allocated", _fmt_bytes(self.peak_allocated)),
            ("reserved/allocated at peak", f"{self.ratio:.3f} (allocated "
                                           f"{_fmt_bytes(self.allocated_at_peak)} at entry "
                                           f"{self.peak_index})"),
            ("device mallocs / frees", f"{self.num_device_alloc:,} / {self.num_device_free:,}"),
            ("alloc retries", f"{self.retries:,}"),
            ("OOMs", f"{self.ooms:,}"),
        ]
        for key in ("torch_peak_reserved", "recorded_peak_reserved"):
            ref = self.reference.get(key)
            if ref:
                name = "torch peak reserved" if key.startswith("torch") else \
                    "recorded peak reserved"
                rows.append((name, f"{_fmt_bytes(ref)} (replay/recorded "
                                   f"{self.peak_reserved / ref:.4f})"))
        if self.skipped:
            rows.append(("skipped", ", ".join(f"{k} {v:,}" for k, v in self.skipped.items())))
        if self.truncated:
            rows.append(("truncated", "yes (the trace starts with frees: max_entries?)"))
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
_ENV_LOCK = threading.Lock()


def _simulator(device_memory: int) -> Any:
    """A private one-device SimulatorBackend of ``device_memory`` bytes."""
    from cudalab._driver.sim import SimulatorBackend

    keys = ("CUDALAB_SIMULATOR_DEVICES", "CUDALAB_SIMULATOR_MEMORY", "CUDA_VISIBLE_DEVICES")
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in keys}
        try:
            os.environ["CUDALAB_SIMULATOR_DEVICES"] = "1"
            os.environ["CUDALAB_SIMULATOR_MEMORY"] = str(int(device_memory))
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            sim = SimulatorBackend()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    sim.init()
    return sim


class _TraceAddresses:
    """The replay's simulator, handing out the trace's own segment addresses.

    torch's best fit breaks ties between equal-size free blocks by address, so where the
    segments sit decides which block is reused. While the replay asks for segments of the
    sizes the trace recorded, in the same order, each gets the address it had in the traced
    run (a replay with torch's settings then makes torch's choices); once the sequences part,
    or an address would overlap a live segment, segments get fresh addresses above every
    traced one. The simulator still holds the memory (capacity, out-of-memory).
    """

    def __init__(self, sim: Any, segments: list[tuple[int, int]]):
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


def _as_config(config: str | AllocatorConfig | None) -> AllocatorConfig:
    if config is None:
        return AllocatorConfig()
    if isinstance(config, AllocatorConfig):
        return config
    if isinstance(config, str):
        return parse_alloc_conf(config.strip(), source="replay config")
    raise TypeError(f"config must be an allocator settings string or an AllocatorConfig, "
                    f"got {type(config).__name__}")


def _config_text(cfg: AllocatorConfig) -> str:
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


class _Progress:
    """Plain-text progress bar on stderr (redrawn at most ten times a second)."""

    def __init__(self, label: str = "", stream: Any = None, delay: float = 0.5):
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self._start = time.monotonic()
        self._delay = delay  # short replays never show a bar
        self._last = 0.0
        self._width = 0
        self._drawn = False

    def __call__(self, done: int, total: int, label: str | None = None) -> None:
        now = time.monotonic()
        if now - self._start < self._delay and not self._drawn:
            return
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        text = label if label is not None else self.label
        line = (f"[{bar:<30}] {frac * 100:5.1f}% {done:,}/{total:,} entries"
                f"{'  ' + text if text else ''}")
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def _progress_fn(progress: Any, label: str) -> tuple[Callable[[int, int], None] | None,
                                                        _Progress | None]:
    if progress is None or progress is False:
        return None, None
    if progress is True:
        bar = _Progress(label)
        return bar, bar
    if callable(progress):
        return progress, None
    raise TypeError("progress must be a bool or a callable(done, total)")


def _run(plan: _Plan, cfg: AllocatorConfig, device_memory: int,
         progress: Callable[[int, int], None] | None,
         segments: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    """One replay over a fresh simulator; the raw numbers."""
    sim = _simulator(device_memory)
    is_async = cfg.backend == "cudaMallocAsync"
    if is_async:
        from cudalab.allocator.async_allocator import AsyncPoolAllocator

        alloc = AsyncPoolAllocator(sim, 0, cfg, stream_resolver=lambda: 0)
        # Streams of the trace become streams of the private simulator (0, 1, 2 are the
        # default streams there too).
        keys: dict[int, int] = {}
        for s in set(plan.stream):
            keys[s] = s if s in (0, 1, 2) else sim.handle_int(sim.stream_create(0))
        streams = [keys[s] for s in plan.stream]
        pool = alloc._pool
    else:
        from cudalab.allocator.allocator import DeviceCachingAllocator

        backend = (_TraceAddresses(sim, segments) if segments and not cfg.expandable_segments
                   else sim)
        alloc = DeviceCachingAllocator(backend, 0, cfg, stream_resolver=lambda: 0)
        alloc._trace = None  # never recorded into anyone's history
        alloc._memo_ok = False  # counters are sampled after every event
        streams = plan.stream

    def allocated() -> int:
        if is_async:
            return alloc._c.b_alloc
        st = alloc.stats
        return st.small.b_alloc + st.large.b_alloc

    def reserved() -> int:
        if is_async:
            return pool.reserved
        st = alloc.stats
        return st.small.b_res + st.large.b_res

    n = len(plan.action)
    index = plan.index
    stride = max(1, -(-n // _SAMPLES))
    t_index: list[int] = [0] if n else []
    t_res: list[int] = [0] if n else []
    t_alloc: list[int] = [0] if n else []
    malloc = alloc.malloc
    free = alloc.free
    ptrs: list[int] = [0] * (plan.n_entries or 1)
    oom_entries: list[tuple[int, int]] = []
    failed: list[int] = []
    ooms = 0
    last_peak = 0
    peak_index = -1
    alloc_at_peak = 0
    on_plateau = False
    it = zip(plan.action, plan.size, streams, plan.slot)
    done = 0
    t0 = time.perf_counter()
    while done < n:
        chunk = min(stride, n - done)
        # The hot loops: one malloc or free per entry. After each malloc, one attribute read
        # tells whether reserved reached a new peak; while reserved stays at its peak (a
        # plateau: reserved only moves inside malloc), the largest allocated value is kept,
        # so the ratio is reserved/allocated at the busiest moment of the reserved peak.
        if is_async:
            c = alloc._c
            for a, size, s, k in islice(it, chunk):
                if a:
                    try:
                        ptrs[k] = malloc(size, s)
                    except OutOfMemoryError:
                        ooms += 1
                        failed.append(k)
                        if len(oom_entries) < _MAX_OOM_RECORDS:
                            oom_entries.append((k, size))
                        continue
                    if pool.reserved_high != last_peak:
                        last_peak = pool.reserved_high
                        peak_index = k
                        alloc_at_peak = c.b_alloc
                        on_plateau = True
                    elif on_plateau and c.b_alloc > alloc_at_peak:
                        if pool.reserved == last_peak:
                            alloc_at_peak = c.b_alloc
                            peak_index = k
                        else:
                            on_plateau = False
                else:
                    free(ptrs[k])
        else:
            agg = alloc.stats.agg
            sp = alloc.stats.small
            lp = alloc.stats.large
            for a, size, s, k in islice(it, chunk):
                if a:
                    try:
                        ptrs[k] = malloc(size, s)
                    except OutOfMemoryError:
                        ooms += 1
                        failed.append(k)
                        if len(oom_entries) < _MAX_OOM_RECORDS:
                            oom_entries.append((k, size))
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
        done += chunk
        t_index.append(int(index[done - 1]))
        t_res.append(reserved())
        t_alloc.append(allocated())
        if progress is not None:
            progress(done, n)
    elapsed = time.perf_counter() - t0
    stats = alloc.memory_stats()
    if is_async:
        n_dev_alloc = len(pool.chunks)
        n_dev_free = 0
        retries = 0
    else:
        n_dev_alloc = stats["num_device_alloc"]
        n_dev_free = stats["num_device_free"]
        retries = stats["num_alloc_retries"]
    peak_reserved = stats["reserved_bytes.all.peak"]
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
        "peak_allocated": stats["allocated_bytes.all.peak"],
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
    if is_async:
        try:
            alloc.close()
        except Exception:  # pragma: no cover - the private simulator is dropped anyway
            pass
    return out


def _skip_warning(plan: _Plan, source: str) -> str | None:
    if not plan.skipped:
        return None
    total = sum(plan.skipped.values())
    parts = [f"{v:,} {_SKIP_TEXT.get(k, k)}" for k, v in plan.skipped.items()]
    text = (f"replay of {source}: skipped {total:,} of {plan.n_entries:,} alloc/free entries: "
            + "; ".join(parts))
    if plan.truncated:
        text += (" (the trace starts with frees: it was probably truncated by max_entries, "
                 "so memory allocated before it began is missing from the replay)")
    return text


def _replay_plan(tr: _Trace, plan: _Plan, config: Any, device_memory: int | None,
                 progress: Callable[[int, int], None] | None) -> ReplayResult:
    cfg = _as_config(config)
    if device_memory is not None:
        memory = int(device_memory)
        if not (1 << 20) <= memory <= _MAX_DEVICE:
            raise ValueError(f"device_memory must be between 1 MiB and 1 TiB, got {memory}")
        auto = False
    else:
        memory = _auto_memory(plan.peak_live)
        auto = cfg.per_process_memory_fraction is None
    while True:
        raw = _run(plan, cfg, memory, progress, tr.segments)
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
        config=_config_text(cfg), backend=cfg.backend,
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


def _reference(tr: _Trace, plan: _Plan) -> dict[str, Any]:
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

    Args:
        trace: a snapshot dict, a snapshot pickle path, a DataFrame (action, addr, size,
            stream[, device]) or a list of (action, addr, size, stream) tuples.
        config: an allocator settings string in ``PYTORCH_ALLOC_CONF`` grammar
            (``"expandable_segments:True,max_split_size_mb:128"``), an
            :class:`~cudalab.memory.AllocatorConfig`, or None for the native defaults.
        device_memory: bytes of the simulated device (default: large enough, see the module
            documentation).
        device: which device's trace of a snapshot to replay (default 0).
        progress: True for a text progress bar on stderr, or a callable(done, total).

    Skipped entries are reported by one :class:`ReplayWarning`; out-of-memory errors during
    the replay are counted in the result, never raised. Raises :class:`TraceError` for a
    trace that cannot be read and ValueError for bad settings.
    """
    tr = load_trace(trace, device)
    plan = _plan(tr)
    fn, bar = _progress_fn(progress, _config_text(_as_config(config)) or "default")
    try:
        result = _replay_plan(tr, plan, config, device_memory, fn)
    finally:
        if bar is not None:
            bar.close()
    text = _skip_warning(plan, tr.source)
    if text:
        warnings.warn(text, ReplayWarning, stacklevel=2)
    return result


# ====================================================================================== what-if
def _labels(configs: Iterable[Any]) -> list[tuple[str, AllocatorConfig]]:
    out: list[tuple[str, AllocatorConfig]] = []
    seen: set[str] = set()
    for c in configs:
        cfg = _as_config(c)
        label = _config_text(cfg) or "default"
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
    plan = _plan(tr)
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
    fn, bar = _progress_fn(progress, "")
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
            results.append(_replay_plan(tr, plan, cfg, device_memory, step))
    finally:
        if bar is not None:
            bar.close()
    text = _skip_warning(plan, tr.source)
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


# ====================================================================================== plots
def save_plot(results: ReplayResult | Sequence[ReplayResult], path: str | os.PathLike,
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
                label=f"{r.label} reserved (peak {_fmt_bytes(r.peak_reserved)})")
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
    fig.savefig(path)


# ====================================================================================== text
def parse_size(text: str | int) -> int:
    """``"80GiB"``, ``"80 GB"``, ``"1.5TiB"``, ``"1073741824"`` -> bytes (ValueError if bad)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    units = {"": 1, "b": 1, "k": 1024, "kb": 10**3, "kib": 1024, "m": MiB, "mb": 10**6,
             "mib": MiB, "g": GiB, "gb": 10**9, "gib": GiB, "t": 1 << 40, "tb": 10**12,
             "tib": 1 << 40}
    raw = str(text).strip()
    num = raw.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ").strip()
    unit = raw[len(raw.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    factor = units.get(unit.lower())
    if factor is None or not value > 0 or not math.isfinite(value):
        raise ValueError(f"cannot read the size {text!r}: give bytes or a number with a unit, "
                         "e.g. 80GiB, 80GB, 512MiB")
    return int(value * factor)


def format_what_if(df: Any) -> str:
    """The ranked what-if table as text (what ``cudalab what-if`` prints)."""
    header = ["rank", "config", "peak reserved", "peak allocated", "ratio", "saving",
              "saving %", "device mallocs", "retries", "OOMs"]
    rows = []
    for rank, r in zip(df.index, df.itertuples(index=False)):
        rows.append([str(rank), r.config, _fmt_bytes(r.peak_reserved),
                     _fmt_bytes(r.peak_allocated), f"{r.ratio:.3f}",
                     ("+" if r.saving_vs_default > 0 else "") + _fmt_bytes(r.saving_vs_default),
                     f"{r.saving_vs_default_pct:+.1f} %", f"{r.device_mallocs:,}",
                     f"{r.retries:,}", f"{r.ooms:,}"])
    right = {0, 2, 3, 4, 5, 6, 7, 8, 9}
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]
    lines = []
    results = df.attrs.get("results") or []
    if results:
        r0 = results[0]
        mems = sorted({r.device_memory for r in results})
        mem = _fmt_bytes(mems[0]) if len(mems) == 1 else \
            f"{_fmt_bytes(mems[0])} to {_fmt_bytes(mems[-1])}"
        lines.append(f"what-if: {r0.source}: {r0.entries:,} alloc/free entries, replayed on a "
                     f"simulated device of {mem}")
    for row in [header, *rows]:
        lines.append("  ".join(c.rjust(w) if i in right else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    if len(df):
        best = df.iloc[0]
        if best["saving_vs_default"] > 0:
            lines.append(f"best: {best['config']} saves {_fmt_bytes(best['saving_vs_default'])} "
                         f"({best['saving_vs_default_pct']:.1f} %) of peak reserved memory "
                         "against the defaults")
        else:
            lines.append("best: the defaults (no config tried reserves less)")
    if df.attrs.get("note"):
        lines.append(f"note: {df.attrs['note']}")
    return "\n".join(lines)
