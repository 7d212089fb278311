"""What a dashboard shows for one device at one moment: :class:`DeviceSample`, and the
:class:`SampleSource` protocol that produces them.

A view (:class:`cudalab.widgets.MemoryDashboard`) renders samples and never reads an
allocator or NVML itself: it asks its source for a sample of each device every tick, and
for the actions behind its buttons (reset the peaks, release the cache, take a snapshot).
:class:`cudalab.memory_sources.CudalabSource` is the source over cudalab's own allocator and
NVML (a module above :mod:`cudalab.memory`, whose figures it reads); a source over another
allocator (:mod:`cudalab.memory_sources`: ``torch``, ``cupy``, and ``process`` for the memory
no allocator accounts for) implements the same four members and names itself and its
allocator in each sample's :class:`~cudalab.identity.Identity`.

Every sample says where it came from (``identity``: host, pid, rank, the device's index,
UUID and name, the allocator) and when (``time``), so samples gathered from many processes
can be told apart, and :meth:`DeviceSample.to_dict` is plain data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Protocol

from cudalab.identity import Identity

__all__ = ["DeviceSample", "SampleSource", "ALLOCATOR_FIGURES", "NVML_FIGURES"]

#: The allocator's figures of a sample, each with the ``memory_stats()`` key it is read from
#: (cudalab's and torch's key names).
ALLOCATOR_FIGURES: tuple[tuple[str, str], ...] = (
    ("allocated", "allocated_bytes.all.current"),
    ("reserved", "reserved_bytes.all.current"),
    ("peak_allocated", "allocated_bytes.all.peak"),
    ("peak_reserved", "reserved_bytes.all.peak"),
    ("requested", "requested_bytes.all.current"),
    ("allocations", "allocation.all.current"),
    ("allocations_total", "allocation.all.allocated"),
    ("segments", "segment.all.current"),
    ("num_ooms", "num_ooms"),
    ("num_alloc_retries", "num_alloc_retries"),
)
#: The NVML figures of a sample (each None when NVML cannot give it).
NVML_FIGURES: tuple[str, ...] = (
    "utilization", "memory_utilization", "temperature", "power_draw", "clock_rate",
    "nvml_used", "nvml_total", "processes", "process_used", "all_processes_used",
)


@dataclass(frozen=True, slots=True)
class DeviceSample:
    """One device at one moment, as a dashboard shows it.

    Byte counts and counts are ints >= 0; every NVML figure is an int >= 0 or None (None
    when NVML cannot give it, and all of them None when ``nvml_error`` is set).
    """

    #: When the sample was taken: seconds since the epoch (``time.time()``), finite.
    time: float
    #: The name of the :class:`SampleSource` that made it (e.g. ``"cudalab"``), non-empty.
    source: str
    #: Where it came from: host, pid, rank, the device (``identity.device``, never None),
    #: its UUID and name, and the allocator the figures were read from.
    identity: Identity
    #: The device's total memory in bytes (the driver's, as ``total_memory``).
    capacity: int
    #: Bytes of live allocations now (``allocated_bytes.all.current``).
    allocated: int
    #: Bytes the allocator holds from the driver now (``reserved_bytes.all.current``).
    reserved: int
    #: The highest ``allocated`` since the last peak reset (``allocated_bytes.all.peak``).
    peak_allocated: int
    #: The highest ``reserved`` since the last peak reset (``reserved_bytes.all.peak``).
    peak_reserved: int
    #: Bytes the live allocations asked for, before rounding (``requested_bytes.all.current``).
    requested: int
    #: Live allocations now (``allocation.all.current``).
    allocations: int
    #: Allocations made since the last accumulated-statistics reset (``allocation.all.allocated``).
    allocations_total: int
    #: Segments (driver allocations) held now (``segment.all.current``).
    segments: int
    #: Out-of-memory errors raised so far (``num_ooms``).
    num_ooms: int
    #: Allocations that had to free the cache and retry (``num_alloc_retries``).
    num_alloc_retries: int
    #: The device's private pools (graph captures, ``MemPool``), each the dict of
    #: :func:`cudalab.memory.private_pools`; empty without any (or for an allocator
    #: without private pools).
    pools: tuple[dict[str, Any], ...] = ()
    #: "" when NVML answered; otherwise why it cannot be used (e.g. ``"NVML unavailable
    #: (NvmlError)"``), and then every NVML figure below is None.
    nvml_error: str = ""
    #: GPU utilization, % (NVML).
    utilization: int | None = None
    #: Memory-controller utilization, % (NVML).
    memory_utilization: int | None = None
    #: Temperature, °C (NVML).
    temperature: int | None = None
    #: Power draw, mW (NVML).
    power_draw: int | None = None
    #: SM clock, MHz (NVML).
    clock_rate: int | None = None
    #: Bytes in use on the device by every process and the driver (NVML's memory info).
    nvml_used: int | None = None
    #: The device's total memory as NVML reports it, bytes.
    nvml_total: int | None = None
    #: How many processes use the device (NVML's process list).
    processes: int | None = None
    #: Bytes this process uses on the device (NVML's process list; None when NVML does not
    #: list it or does not say).
    process_used: int | None = None
    #: Bytes all listed processes use on the device, summed over those NVML gives a figure for.
    all_processes_used: int | None = None
    #: A sentence the view shows beside the figures, "" without: e.g. that cudalab's
    #: allocator backs CuPy (so its arrays are counted in the ``cudalab`` source), that a
    #: figure is a bound, or that the source went away. At most 512 characters.
    note: str = ""
    #: The source's own counts that have no field here, as ``(name, value)`` pairs in a
    #: fixed order (e.g. CuPy's ``("free_blocks", n)``): names non-empty str of at most 64
    #: characters, values ints >= 0; empty for most sources.
    extra: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if not (isinstance(self.time, (int, float)) and math.isfinite(self.time)):
            raise ValueError(f"DeviceSample.time is {self.time!r}, expected finite seconds")
        if self.identity.device is None:
            raise ValueError("DeviceSample.identity names no device")
        if type(self.note) is not str or len(self.note) > _NOTE_LIMIT:
            raise ValueError(f"DeviceSample.note is {self.note!r:.40}, expected a str of at "
                             f"most {_NOTE_LIMIT} characters")
        _check_extra(self.extra, "DeviceSample.extra")

    @property
    def device(self) -> int:
        """The device index (``identity.device``)."""
        device = self.identity.device
        assert device is not None  # (checked on construction)
        return device

    # torch's spellings of the allocator's figures (``memory_stats()``'s key stems), for
    # readers of samples gathered from many ranks (``cudalab.cluster.watch(...).samples()``)
    @property
    def allocated_bytes(self) -> int:
        """:attr:`allocated` (``allocated_bytes.all.current``)."""
        return self.allocated

    @property
    def reserved_bytes(self) -> int:
        """:attr:`reserved` (``reserved_bytes.all.current``)."""
        return self.reserved

    @property
    def peak_allocated_bytes(self) -> int:
        """:attr:`peak_allocated` (``allocated_bytes.all.peak``)."""
        return self.peak_allocated

    @property
    def peak_reserved_bytes(self) -> int:
        """:attr:`peak_reserved` (``reserved_bytes.all.peak``)."""
        return self.peak_reserved

    def to_dict(self) -> dict[str, Any]:
        """The sample as plain data: every field by name (``identity`` as its dict, ``pools``
        as a list of copies of its dicts) and ``device``."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["identity"] = self.identity.to_dict()
        out["pools"] = [dict(p) for p in self.pools]
        out["extra"] = dict(self.extra)
        out["device"] = self.device
        return out

    @classmethod
    def from_dict(cls, data: Any, what: str = "sample") -> DeviceSample:
        """Read a sample written by :meth:`to_dict` (e.g. gathered from another process),
        checking every field.

        Parameters
        ----------
        data : dict
            The plain dict: ``time``, ``source``, ``identity``, ``capacity`` and the
            allocator's figures are required; ``pools`` (default empty), ``nvml_error``
            (default ""), ``note`` (default ""), ``extra`` (a dict of names to ints,
            default empty) and the NVML figures (default None) may be missing; ``device``,
            when present, must be ``identity['device']``; other keys are ignored.
        what : str, optional
            The dict's name in the messages.

        Returns
        -------
        DeviceSample

        Raises
        ------
        ValueError
            A missing key, a wrong type or a value out of range (the message names it, e.g.
            ``sample['allocated'] is a str ('1'), expected an int >= 0``).
        """
        if not isinstance(data, dict):
            raise ValueError(f"{what} is a {type(data).__name__}, expected a dict")
        for key in _REQUIRED:
            if key not in data:
                raise ValueError(f"{what} lacks the key {key!r}")
        identity = Identity.from_dict(data["identity"], f"{what}['identity']")
        if identity.device is None or data.get("device", identity.device) != identity.device:
            raise ValueError(f"{what}['device'] is {data.get('device')!r}, expected "
                             f"identity['device'] ({identity.device!r}), an int")
        t = data["time"]
        if type(t) not in (int, float) or not math.isfinite(t):
            raise ValueError(f"{what}['time'] is {t!r:.40}, expected finite seconds")
        values: dict[str, Any] = {"time": float(t), "identity": identity}
        for key, limit in (("source", 64), ("nvml_error", 256), ("note", _NOTE_LIMIT)):
            text = data.get(key, "")
            if type(text) is not str or len(text) > limit or (key == "source" and not text):
                raise ValueError(f"{what}[{key!r}] is {text!r:.40}, expected a "
                                 f"{'non-empty ' if key == 'source' else ''}str of at most "
                                 f"{limit} characters")
            values[key] = text
        for key in ("capacity", *(name for name, _ in ALLOCATOR_FIGURES), *NVML_FIGURES):
            value = data.get(key)
            if value is None and key in NVML_FIGURES:
                values[key] = None
                continue
            if type(value) is not int or not 0 <= value < _I63:
                raise ValueError(f"{what}[{key!r}] is {value!r:.40}, expected an int >= 0"
                                 f"{' or None' if key in NVML_FIGURES else ''}")
            values[key] = value
        pools = data.get("pools", [])
        if not isinstance(pools, (list, tuple)) or not all(isinstance(p, dict) for p in pools):
            raise ValueError(f"{what}['pools'] is a {type(pools).__name__}, expected a list "
                             "of dicts")
        values["pools"] = tuple(dict(p) for p in pools)
        extra = data.get("extra", {})
        if not isinstance(extra, dict) or len(extra) > 64:
            raise ValueError(f"{what}['extra'] is a {type(extra).__name__}, expected a dict "
                             "of at most 64 names")
        values["extra"] = tuple(extra.items())
        _check_extra(values["extra"], f"{what}['extra']")
        if values["nvml_error"] and any(values[k] is not None for k in NVML_FIGURES):
            raise ValueError(f"{what} has NVML figures and an nvml_error")
        return cls(**values)


_I63 = 1 << 63
_NOTE_LIMIT = 512


def _check_extra(extra: Any, what: str) -> None:
    """ValueError naming ``what`` unless ``extra`` is a tuple of ``(name, int >= 0)`` pairs."""
    if type(extra) is not tuple:
        raise ValueError(f"{what} is a {type(extra).__name__}, expected a tuple of pairs")
    for pair in extra:
        if type(pair) is not tuple or len(pair) != 2:
            raise ValueError(f"{what} holds {pair!r:.40}, expected (name, count) pairs")
        name, value = pair
        if type(name) is not str or not 0 < len(name) <= 64:
            raise ValueError(f"{what} has the name {name!r:.40}, expected a non-empty str of "
                             "at most 64 characters")
        if type(value) is not int or not 0 <= value < _I63:
            raise ValueError(f"{what}[{name!r}] is {value!r:.40}, expected an int >= 0")
_REQUIRED = ("time", "source", "identity", "capacity", *(name for name, _ in ALLOCATOR_FIGURES))


class SampleSource(Protocol):
    """Where a view's samples come from, and what its buttons do."""

    #: The source's name, which every sample it makes carries (``DeviceSample.source``).
    name: str

    def sample(self, device: int, now: float | None = None) -> DeviceSample:
        """A sample of ``device`` (an index) now; ``now``: its time (default ``time.time()``),
        so the samples of one tick share one time. Never asks anything of the view."""
        ...

    def reset_peaks(self, device: int) -> None:
        """Reset ``device``'s peak figures (``peak_allocated``, ``peak_reserved``)."""
        ...

    def release_cache(self) -> None:
        """Give the allocator's cached, unused memory back to the driver."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """A memory snapshot in torch's schema (what the snapshot viewer shows)."""
        ...
