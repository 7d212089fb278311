"""One device of :class:`~cudalab.widgets.MemoryDashboard`: the ring buffers of its samples
and its last sample (:class:`DashboardDevice`), and the text of its figures and private pools
(:func:`figures_text`, :func:`pools_html`).

The figures come from the dashboard's
:class:`~cudalab.memory_tools.samples.SampleSource` as
:class:`~cudalab.memory_tools.samples.DeviceSample` records; nothing here reads an
allocator or NVML.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from cudalab._internal import format_bytes
from cudalab.memory_tools.samples import DeviceSample, SampleSource

#: The names :mod:`cudalab.widgets.dashboard` uses.
__all__ = ["DashboardDevice", "figures_text", "pools_html"]


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
        #: Why the last sample failed ("" when it did not): the source went away, ...
        self.error = ""
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


def figures_text(dev: DashboardDevice) -> str:
    """``allocated X, reserved Y, peak Z of C`` from the device's last sample."""
    s = dev.last
    a, r, pk = (0, 0, 0) if s is None else (s.allocated, s.reserved, s.peak_allocated)
    return (f"allocated {format_bytes(a)}, reserved {format_bytes(r)}, peak "
            f"{format_bytes(pk)} of {format_bytes(dev.capacity)}")


def pools_html(pools: list[dict]) -> str:
    """The private pools of a device, the line below its counts ("" without any): each as
    its kind (graph or user), id, reserved and allocated bytes, use count. A widget of its
    own in the dashboard, so a tick sends it only when a pool changed (not with every
    allocation count: a device with many pools sent kilobytes a tick)."""
    if not pools:
        return ""
    items = [f'<span class="cudalab-dash-pool" data-kind="{p["kind"]}" '
             f'title="use count {p["use_count"]}{", released" if p["freeable"] else ""}">'
             f'{p["kind"]} pool ({p["id"][0]}, {p["id"][1]}) <b>{format_bytes(p["reserved_bytes"])}</b>'
             f' ({format_bytes(p["allocated_bytes"])} allocated)</span>' for p in pools]
    return (f'<div class="cudalab-dash-pools" data-pools="{len(pools)}">private pools: '
            + " &middot; ".join(items) + "</div>")
