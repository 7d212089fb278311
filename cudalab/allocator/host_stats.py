"""The pinned (host) allocator's statistics in torch's layout (``torch.cuda.host_memory_stats``).

torch 2.11's ``HostStats`` (``aten/src/ATen/core/CachingHostAllocator.h``), as its Python
binding reports them:

* ``allocation``: blocks handed out to callers (current, peak, allocated, freed);
* ``allocated_bytes``: their (rounded) bytes;
* ``segment``: blocks obtained from the driver (``cuMemHostAlloc``), in use or cached;
* ``reserved_bytes``: their bytes;
* ``num_host_alloc`` / ``num_host_free``: driver allocations / frees (``segment``'s
  allocated / freed);
* ``host_alloc_time`` / ``host_free_time``: microseconds spent in those driver calls
  (total, max, min, count, avg).

:class:`HostStats` holds the counters; the pinned allocator updates them under its lock.
"""

from __future__ import annotations

__all__ = ["CountStat", "DurationStat", "HostStats", "flatten"]


class CountStat:
    """torch's ``Stat``: a current value with its peak and accumulated increases/decreases.

    Invariants: ``peak >= current`` and ``current == allocated - freed`` until a reset of
    the accumulated counters (which, as torch's, leaves ``current`` alone).
    """

    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.allocated = 0
        self.freed = 0

    def increase(self, amount: int) -> None:
        """Add ``amount`` (>= 0) to the current value."""
        self.current += amount
        self.allocated += amount
        if self.current > self.peak:
            self.peak = self.current

    def decrease(self, amount: int) -> None:
        """Subtract ``amount`` (>= 0) from the current value."""
        self.current -= amount
        self.freed += amount

    def reset_peak(self) -> None:
        """The peak becomes the current value."""
        self.peak = self.current

    def reset_accumulated(self) -> None:
        """``allocated`` and ``freed`` back to 0."""
        self.allocated = 0
        self.freed = 0

    def as_dict(self) -> dict[str, int]:
        """``{"current", "peak", "allocated", "freed"}``, torch's order."""
        return {"current": self.current, "peak": self.peak, "allocated": self.allocated,
                "freed": self.freed}


class DurationStat:
    """torch's ``DurationStat``: call durations in microseconds.

    ``min`` is 0 until the first call (and after :meth:`reset_peak`), as torch's.
    """

    __slots__ = ("total", "max", "min", "count")

    def __init__(self) -> None:
        self.total = 0
        self.max = 0
        self.min = 0
        self.count = 0

    def add(self, microseconds: int) -> None:
        """Count one call that took ``microseconds``."""
        self.total += microseconds
        self.count += 1
        if microseconds > self.max:
            self.max = microseconds
        if self.min == 0 or microseconds < self.min:
            self.min = microseconds

    def reset_peak(self) -> None:
        """``min`` and ``max`` back to 0."""
        self.min = 0
        self.max = 0

    def reset_accumulated(self) -> None:
        """``total`` and ``count`` back to 0."""
        self.total = 0
        self.count = 0

    def as_dict(self) -> dict[str, int]:
        """``{"total", "max", "min", "count", "avg"}`` (avg: integer microseconds)."""
        avg = self.total // self.count if self.count else 0
        return {"total": self.total, "max": self.max, "min": self.min, "count": self.count,
                "avg": avg}


class HostStats:
    """The pinned allocator's counters (see the module documentation for each one)."""

    __slots__ = ("allocation", "allocated_bytes", "segment", "reserved_bytes",
                 "host_alloc_time", "host_free_time")

    def __init__(self) -> None:
        self.allocation = CountStat()
        self.allocated_bytes = CountStat()
        self.segment = CountStat()
        self.reserved_bytes = CountStat()
        self.host_alloc_time = DurationStat()
        self.host_free_time = DurationStat()

    def _all(self) -> tuple[CountStat | DurationStat, ...]:
        return (self.allocation, self.allocated_bytes, self.segment, self.reserved_bytes,
                self.host_alloc_time, self.host_free_time)

    def reset_peak(self) -> None:
        """torch's ``resetPeakStats``: peaks become current values, durations' min/max 0."""
        for stat in self._all():
            stat.reset_peak()

    def reset_accumulated(self) -> None:
        """torch's ``resetAccumulatedStats``: allocated/freed and durations' total/count 0."""
        for stat in self._all():
            stat.reset_accumulated()

    def nested(self) -> dict[str, object]:
        """torch's ``_cuda_hostMemoryStats()`` dict (its key order)."""
        return {
            "num_host_alloc": self.segment.allocated,
            "num_host_free": self.segment.freed,
            "allocation": self.allocation.as_dict(),
            "segment": self.segment.as_dict(),
            "allocated_bytes": self.allocated_bytes.as_dict(),
            "reserved_bytes": self.reserved_bytes.as_dict(),
            "host_alloc_time": self.host_alloc_time.as_dict(),
            "host_free_time": self.host_free_time.as_dict(),
        }


def flatten(nested: dict[str, object]) -> dict[str, int]:
    """torch's flattening of a nested stats dict: keys joined with ``"."``, sorted.

    Parameters
    ----------
    nested : dict
        ``{name: int}`` or ``{name: {metric: int}}``.

    Returns
    -------
    dict of str to int
        ``{"allocation.current": ..., "num_host_alloc": ...}``, keys sorted.
    """
    out: list[tuple[str, int]] = []
    for key, value in nested.items():
        if isinstance(value, dict):
            out.extend((f"{key}.{metric}", v) for metric, v in value.items())
        else:
            out.append((key, value))  # type: ignore[arg-type]
    out.sort()
    return dict(out)
