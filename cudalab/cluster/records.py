"""What one rank tells the others: :class:`RankRecords` (its identity, each device's
``memory_stats()``, its samples, the tail of its allocation history, its snapshot), and the
bytes they travel as.

A rank builds its records with :func:`collect` (plain data: dicts, lists, str, int, float,
None) and :func:`encode` pickles them with the highest protocol; the receiver decodes
them with :func:`decode`, which never unpickles plainly: the bytes are bounded in size
(:func:`cudalab.memory_tools.safe_pickle.max_snapshot_bytes`), loaded by the restricted,
nesting-bounded unpickler (:func:`cudalab.memory_tools.safe_pickle.unpickle`: no classes,
no functions) and every part is checked (the snapshot by
:func:`~cudalab.memory_tools.snapshot_check.check_snapshot`, history entries by
:func:`~cudalab.memory_tools.snapshot_check.check_trace_entries`, samples by
:meth:`DeviceSample.from_dict`, identities by :meth:`Identity.from_dict`). Anything
malformed is a :class:`~cudalab.memory_tools.safe_pickle.SnapshotLoadError` (a
ValueError) naming the rank and the part.

The records come from the rank's :class:`~cudalab.memory_tools.samples.SampleSource`
(:func:`rank_source`): cudalab's own allocator, or the allocator of a library the process
already uses when :mod:`cudalab.memory_sources` has a source for it.
"""

from __future__ import annotations

import operator
import pickle
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cudalab.cluster.columns import TraceColumns, to_wire
from cudalab.identity import Identity
from cudalab.memory_tools.safe_pickle import SnapshotLoadError, max_snapshot_bytes, unpickle
from cudalab.memory_tools.samples import DeviceSample, SampleSource
from cudalab.memory_tools.snapshot_check import check_snapshot, check_trace_entries

__all__ = ["WHAT", "DEFAULT_TAIL", "RankRecords", "rank_source", "source_devices", "collect",
           "encode", "decode", "check_what"]

#: The parts a rank can be asked for.
WHAT: tuple[str, ...] = ("stats", "samples", "history_tail", "snapshot")
#: How many of the newest history entries per device ``history_tail`` holds by default.
DEFAULT_TAIL = 100_000
#: The most history entries per device a request may ask for.
MAX_TAIL = 10_000_000
_STAT_LIMIT = 1 << 63


def check_what(what: Any, where: str) -> tuple[str, ...]:
    """``what`` (one part's name or an iterable of them) as a tuple of names of
    :data:`WHAT`; ValueError naming the unknown one, TypeError for a non-str."""
    names = (what,) if isinstance(what, str) else tuple(what)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"{where}: what= names parts as str, got {type(name).__name__}")
        if name not in WHAT:
            raise ValueError(f"{where}: unknown part {name!r}; the parts are "
                             f"{', '.join(map(repr, WHAT))}")
    if not names:
        raise ValueError(f"{where}: what= names no part; the parts are "
                         f"{', '.join(map(repr, WHAT))}")
    return names


def check_tail(tail: Any, where: str) -> int:
    """``tail`` as an int in [0, MAX_TAIL], or TypeError/ValueError."""
    if isinstance(tail, bool) or not isinstance(tail, int):
        raise TypeError(f"{where}: tail must be an int, got {type(tail).__name__}")
    if not 0 <= tail <= MAX_TAIL:
        raise ValueError(f"{where}: tail is {tail}, expected 0 <= tail <= {MAX_TAIL:,}")
    return tail


@dataclass(frozen=True, slots=True)
class RankRecords:
    """One rank's records, as gathered or fetched (every part checked on arrival).

    A snapshot's trace entries arrive as checked columns (:attr:`trace_columns`); the
    dicts of :attr:`snapshot` and :attr:`history_tail` are built on first access.
    """

    #: The rank's process (host, pid, rank, world size; no device), never None.
    identity: Identity
    #: Each device's ``memory_stats()`` (str keys, int values >= 0 or any int for the
    #: few signed keys), by device index; empty when not asked for.
    stats: Mapping[int, Mapping[str, int]] = field(default_factory=dict)
    #: One sample per device the rank uses, in device order; empty when not asked for.
    samples: tuple[DeviceSample, ...] = ()
    #: The snapshot's trace entries of each device as checked columns, by device index
    #: (numpy arrays for the integer keys): what a tool reads without building dicts.
    trace_columns: Mapping[int, TraceColumns] = field(default_factory=dict)
    #: The snapshot as it travelled (the traces sent as columns empty); None when not asked.
    sent_snapshot: dict[str, Any] | None = None
    #: The history tails as they travelled: a list of entries, or the number of the
    #: snapshot trace's newest entries that make the tail.
    sent_history: Mapping[int, list[dict[str, Any]] | int] = field(default_factory=dict)
    _built: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def snapshot(self) -> dict[str, Any] | None:
        """The rank's snapshot in torch's schema (its trace entries built from the columns on
        first access); None when not asked for."""
        sent = self.sent_snapshot
        if sent is None or not self.trace_columns:
            return sent
        if "snapshot" not in self._built:
            traces = list(sent.get("device_traces", []))
            for d, cols in self.trace_columns.items():
                traces[d] = cols.entries()
            self._built["snapshot"] = {**sent, "device_traces": traces}
        return self._built["snapshot"]  # type: ignore[no-any-return]

    @property
    def history_tail(self) -> dict[int, list[dict[str, Any]]]:
        """The newest history entries of each device (torch's trace-entry dicts, oldest
        first; the snapshot's own entry objects when both travelled), by device index; empty
        when not asked for or not recording."""
        out: dict[int, list[dict[str, Any]]] = {}
        for d, sent in self.sent_history.items():
            if isinstance(sent, int):
                entries = self.trace_columns[d].entries()
                out[d] = entries[len(entries) - sent:]
            else:
                out[d] = sent
        return out

    @property
    def rank(self) -> int | None:
        """The rank (``identity.rank``)."""
        return self.identity.rank

    def peaks(self) -> dict[int, int]:
        """Each device's ``allocated_bytes.all.peak`` from :attr:`stats` (or the samples'
        peaks when stats were not asked for)."""
        if self.stats:
            return {d: int(s.get("allocated_bytes.all.peak", 0)) for d, s in self.stats.items()}
        return {s.device: s.peak_allocated for s in self.samples}


# ----------------------------------------------------------------------------- the rank's side
def rank_sources() -> tuple[SampleSource, ...]:
    """A source for every allocator this process uses: cudalab's always, torch's when torch
    is imported and has initialised CUDA, CuPy's when CuPy is imported
    (:func:`cudalab.memory_sources.allocator_sources`; ``sys.modules`` only)."""
    from cudalab import memory_sources

    return tuple(memory_sources.allocator_sources())


def rank_source() -> SampleSource:
    """The source of this process's records (stats, history, snapshot): torch's when the
    process uses torch's allocator, else cudalab's own."""
    sources = rank_sources()
    return next((s for s in sources if s.name == "torch"), sources[0])


def source_devices(source: SampleSource) -> list[int]:
    """The devices ``source`` has figures for now, ascending (never initialises CUDA): its
    ``devices()`` when it has one; cudalab's: the devices with an allocator; torch's and
    CuPy's: the current device and those where the allocator holds memory."""
    devices = getattr(source, "devices", None)
    if callable(devices):
        return sorted(int(d) for d in devices())
    if source.name == "cudalab":
        registry: Any = sys.modules.get("cudalab.allocator.registry")  # (no import per sample)
        if registry is None:
            from cudalab.allocator import registry
        return [i for i, a in enumerate(list(registry.allocators)) if a is not None]
    if source.name == "torch":
        cuda = source.torch.cuda  # type: ignore[attr-defined]
        if not cuda.is_initialized():
            return []
        return sorted({int(cuda.current_device())} | {
            d for d in range(cuda.device_count()) if cuda.memory_reserved(d) > 0})
    if source.name == "cupy":
        try:
            return [int(sys.modules["cupy"].cuda.runtime.getDevice())]
        except Exception:  # no CuPy or no device: nothing to show
            return []
    return []


def _stats(source: SampleSource, device: int) -> dict[str, int]:
    if source.name == "torch":  # torch's own flat memory_stats()
        return dict(source.torch.cuda.memory_stats(device))  # type: ignore[attr-defined]
    stats = getattr(source, "memory_stats", None)
    if callable(stats):
        return dict(stats(device))
    from cudalab import memory

    return dict(memory.memory_stats(device))


def _history_tail(source: SampleSource, devices: Iterable[int], tail: int,
                  snapshot: dict[str, Any] | None) -> dict[int, list[dict[str, Any]]]:
    """The newest ``tail`` entries per device: the snapshot's own trace entries when one is
    taken too (the same objects, so the pickle carries them once), else the history's."""
    if snapshot is not None or source.name != "cudalab":
        snap = snapshot if snapshot is not None else source.snapshot()
        traces = snap.get("device_traces", [])
        return {d: list(t[-tail:]) for d, t in enumerate(traces) if t and tail}
    from cudalab.memory_tools import history

    out: dict[int, list[dict[str, Any]]] = {}
    cache: dict[Any, Any] = {}
    for d in sorted(set(devices) | set(history.devices_with_history())):
        raw = history.raw_entries(d)
        if raw and tail:
            out[d] = [history.entry_to_dict(e, d, cache) for e in raw[-tail:]]
    return out


def collect(what: Iterable[str] = ("stats", "samples"), source: SampleSource | None = None,
            tail: int = DEFAULT_TAIL) -> dict[str, Any]:
    """This rank's records as plain data (what :func:`encode` sends).

    Parameters
    ----------
    what : iterable of str
        The parts (:data:`WHAT`).
    source : SampleSource, optional
        Where the figures come from (default :func:`rank_source`).
    tail : int
        The newest history entries per device for ``history_tail``.

    Returns
    -------
    dict
        ``identity`` and each part asked for.
    """
    parts = check_what(what, "collect()")
    tail = check_tail(tail, "collect()")
    src = rank_source() if source is None else source
    devices = source_devices(src)
    out: dict[str, Any] = {"identity": Identity.current(allocator=src.name).to_dict()}
    snapshot = src.snapshot() if "snapshot" in parts else None
    if "stats" in parts:
        out["stats"] = {d: _stats(src, d) for d in devices}
    if "samples" in parts:
        import time

        now = time.time()
        out["samples"] = [src.sample(d, now).to_dict() for d in devices]
    if "history_tail" in parts:
        out["history_tail"] = _history_tail(src, devices, tail, snapshot)
    if snapshot is not None:
        out["snapshot"] = snapshot
    return out


def encode(records: Mapping[str, Any]) -> bytes:
    """``records`` (plain data, as :func:`collect` makes) as bytes: a pickle of plain data
    only (the receiver's unpickler refuses anything else). The snapshot's trace entries
    travel as columns (:func:`cudalab.cluster.columns.to_wire`), and a history tail made of
    the newest of them as their number."""
    out = dict(records)
    snapshot = out.get("snapshot")
    traces = snapshot.get("device_traces") if isinstance(snapshot, dict) else None
    if traces:
        columns: dict[int, Any] = {}
        kept: list[Any] = []
        for d, entries in enumerate(traces):
            wire_columns = to_wire(entries) if isinstance(entries, list) else None
            if wire_columns is None:
                kept.append(entries)
            else:
                columns[d] = wire_columns
                kept.append([])
        out["snapshot"] = {**snapshot, "device_traces": kept}  # type: ignore[dict-item]
        out["trace_columns"] = columns
        tails = out.get("history_tail")
        if isinstance(tails, dict):
            out["history_tail"] = {
                d: (len(t) if d in columns and _is_tail(t, traces[d]) else t)
                for d, t in tails.items()}
    return pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)


def _is_tail(tail: Any, entries: list[Any]) -> bool:
    """Whether ``tail`` is made of the newest objects of ``entries``."""
    return (isinstance(tail, list) and len(tail) <= len(entries)
            and all(map(operator.is_, tail, entries[len(entries) - len(tail):])))


# ----------------------------------------------------------------------------- the receiver's side
def decode(data: bytes, what: str = "rank records", max_bytes: int | str | None = None
           ) -> RankRecords:
    """Records sent by :func:`encode`, bounded and checked (see the module documentation).

    Parameters
    ----------
    data : bytes
        The payload.
    what : str
        Its name in the messages (e.g. ``"rank 3's records"``).
    max_bytes : int or str, optional
        The largest payload accepted (default
        :func:`~cudalab.memory_tools.safe_pickle.max_snapshot_bytes`).

    Raises
    ------
    SnapshotLoadError
        Too large, not a plain-data pickle, nested too deeply, or a part malformed.
    """
    limit = max_snapshot_bytes(max_bytes)
    if len(data) > limit:
        raise SnapshotLoadError(f"cannot read {what}: {len(data):,} bytes, more than the "
                                f"limit of {limit:,} (set CUDALAB_MAX_SNAPSHOT_BYTES)")
    raw = unpickle(bytes(data), what)
    if not isinstance(raw, dict):
        raise SnapshotLoadError(f"{what} is a {type(raw).__name__}, expected a dict")
    try:
        identity = Identity.from_dict(raw.get("identity"), f"{what}: identity")
        stats = _check_stats(raw.get("stats", {}), what)
        samples = raw.get("samples", [])
        if not isinstance(samples, list):
            raise ValueError(f"{what}: samples is a {type(samples).__name__}, expected a list")
        checked = tuple(DeviceSample.from_dict(s, f"{what}: samples[{i}]")
                        for i, s in enumerate(samples))
        snapshot = raw.get("snapshot")
        if snapshot is not None:
            check_snapshot(snapshot, f"{what}: snapshot")
        columns = _check_columns(raw.get("trace_columns", {}), snapshot, what)
        history = _check_history(raw.get("history_tail", {}), what, snapshot, columns)
    except SnapshotLoadError:
        raise
    except ValueError as exc:
        raise SnapshotLoadError(str(exc)) from None
    return RankRecords(identity=identity, stats=stats, samples=checked, trace_columns=columns,
                       sent_snapshot=snapshot, sent_history=history)


def _device_key(key: Any, what: str) -> int:
    if type(key) is not int or not 0 <= key < (1 << 31):
        raise ValueError(f"{what} has the device key {key!r:.40}, expected an int >= 0")
    return key


def _check_stats(stats: Any, what: str) -> dict[int, dict[str, int]]:
    if not isinstance(stats, dict):
        raise ValueError(f"{what}: stats is a {type(stats).__name__}, expected a dict")
    out: dict[int, dict[str, int]] = {}
    for key, values in stats.items():
        d = _device_key(key, f"{what}: stats")
        if not isinstance(values, dict):
            raise ValueError(f"{what}: stats[{d}] is a {type(values).__name__}, expected a dict")
        for name, value in values.items():
            if type(name) is not str or type(value) is not int or not (
                    -_STAT_LIMIT <= value < _STAT_LIMIT):
                raise ValueError(f"{what}: stats[{d}][{name!r:.60}] is {value!r:.40}, "
                                 "expected an int (str keys)")
        out[d] = values
    return out


def _check_columns(columns: Any, snapshot: dict[str, Any] | None, what: str
                   ) -> dict[int, TraceColumns]:
    """The trace columns checked, each for a device whose snapshot trace travelled empty."""
    if not isinstance(columns, dict) or (columns and snapshot is None):
        raise ValueError(f"{what}: trace_columns is malformed (or comes without a snapshot)")
    traces = snapshot.get("device_traces", []) if snapshot is not None else []
    out: dict[int, TraceColumns] = {}
    for key, data in columns.items():
        d = _device_key(key, f"{what}: trace_columns")
        if d >= len(traces) or traces[d]:
            raise ValueError(f"{what}: trace_columns[{d}] has no empty device trace to fill")
        out[d] = TraceColumns.from_wire(data, f"device_traces[{d}]", what)
    return out


def _check_history(history: Any, what: str, snapshot: dict[str, Any] | None,
                   columns: Mapping[int, TraceColumns]
                   ) -> dict[int, list[dict[str, Any]] | int]:
    """The history tails checked: a list of entries (checked, unless made of the checked
    snapshot's own entry objects), or the number of the newest entries of a device's trace
    columns."""
    if not isinstance(history, dict):
        raise ValueError(f"{what}: history_tail is a {type(history).__name__}, expected a dict")
    traces = snapshot.get("device_traces", []) if snapshot is not None else []
    out: dict[int, list[dict[str, Any]] | int] = {}
    for key, entries in history.items():
        d = _device_key(key, f"{what}: history_tail")
        if type(entries) is int:
            if d not in columns or not 0 <= entries <= columns[d].n:
                raise ValueError(f"{what}: history_tail[{d}] counts {entries} entries of a "
                                 "trace that does not hold them")
            out[d] = entries
            continue
        if not (isinstance(entries, list) and d < len(traces) and len(entries) <= len(traces[d])
                and all(map(operator.is_, entries, traces[d][len(traces[d]) - len(entries):]))):
            check_trace_entries(entries, f"history_tail[{d}]", what)
        out[d] = entries
    return out
