"""One device of :class:`~cudalab.widgets.MemoryDashboard`: the ring buffers of its samples
and its last sample (:class:`DashboardDevice`).

The figures come from the dashboard's
:class:`~cudalab.memory_tools.samples.SampleSource` as
:class:`~cudalab.memory_tools.samples.DeviceSample` records; nothing here reads an
allocator or NVML.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from cudalab.memory_tools.samples import DeviceSample, SampleSource

#: The one name, for :mod:`cudalab.widgets.dashboard`.
__all__ = ["DashboardDevice"]


class DashboardDevice:
    """One device's ring buffers, last sample and chart state."""

    def __init__(self, index: int, window: int, source: SampleSource):
        self.index = index
        self.source = source
        self.t: deque[float] = deque(maxlen=window)
        self.allocated: deque[int] = deque(maxlen=window)
        self.reserved: deque[int] = deque(maxlen=window)
        self.nvml_used: deque[int] = deque(maxlen=window)
        #: The last sample (None before the first).
        self.last: DeviceSample | None = None
        self.last_png = b""
        self.chart_time = 0.0
        self.ymax = 1024.0

    @property
    def name(self) -> str:
        """The device's name, from its last sample's identity."""
        last = self.last
        return (last.identity.device_name if last is not None else None) or f"cuda:{self.index}"

    @property
    def capacity(self) -> int:
        """The device's total memory (bytes), from its last sample (0 before the first)."""
        return self.last.capacity if self.last is not None else 0

    @property
    def has_nvml(self) -> bool:
        """Whether the last sample has NVML figures (NVML could be used)."""
        return self.last is not None and not self.last.nvml_error

    def sample(self, now: float) -> DeviceSample:
        """Ask the source for a sample taken at ``now`` and keep it in the ring buffers."""
        s = self.source.sample(self.index, now)
        self.t.append(s.time)
        self.allocated.append(s.allocated)
        self.reserved.append(s.reserved)
        self.nvml_used.append(s.nvml_used if s.nvml_used is not None else 0)
        self.last = s
        return s

    def arrays(self) -> dict[str, np.ndarray]:
        out = {"allocated": np.fromiter(self.allocated, np.float64, len(self.allocated)),
               "reserved": np.fromiter(self.reserved, np.float64, len(self.reserved))}
        if self.has_nvml:
            out["nvml_used"] = np.fromiter(self.nvml_used, np.float64, len(self.nvml_used))
        return out
