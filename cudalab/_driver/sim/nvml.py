"""NVML for the simulator: device management values derived from the simulator's own state.

:class:`SimulatedNvml` sees every simulated device (it ignores ``CUDA_VISIBLE_DEVICES``,
like the real NVML) and labels itself simulated.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import os
from collections.abc import Iterable

import numpy as np

from cudalab._driver.base import Nvml
from cudalab._driver.sim.core import ACTIVITY_KERNEL, SimulatorCore, now
from cudalab.errors import NvmlError

__all__ = ["SimulatedNvml", "busy_percent"]

_END = operator.itemgetter(1)


def busy_percent(activity: Iterable[tuple[int, int, int]]) -> tuple[int, int]:
    """(gpu %, memory %) over the last second from an activity log of (start ns, end ns,
    ACTIVITY_*) entries: the share of the second spent in kernels (memory: copies and fills
    plus half the kernel time), at least 1% when anything ran."""
    lo = now() - 1_000_000_000
    # the log is appended as work ends (end times ascending): the second's entries are a
    # tail found by bisection, then summed as one numpy array (a busy log holds 4096)
    entries = list(activity)
    window = entries[bisect.bisect_left(entries, lo, key=_END):]
    n = len(window)
    table = np.fromiter(itertools.chain.from_iterable(window), np.int64, 3 * n).reshape(n, 3)
    spans = table[:, 1] - np.maximum(table[:, 0], lo)  # (an entry begun before: from lo)
    kernels = table[:, 2] == ACTIVITY_KERNEL
    kern = int(spans[kernels].sum())
    copy = int(spans.sum()) - kern
    any_kern = bool(kernels.any())
    any_copy = n > 0 and not bool(kernels.all())

    def pct(ns: float, active: bool) -> int:
        return max(1, min(100, round(ns / 1e7))) if active else 0

    return pct(kern, any_kern), pct(copy + kern / 2, any_kern or any_copy)


class SimulatedNvml(Nvml):
    """NVML for the simulator: every value is derived from the simulator's own state.

    Sees all simulated devices (it ignores CUDA_VISIBLE_DEVICES, like the real NVML).
    Utilisation is the share of the last second spent in kernels (memory: copies and fills
    plus half the kernel time), at least 1% when anything ran; memory used is exactly the
    simulator's allocations, so it agrees with ``mem_get_info`` (the simulator has no
    context overhead).
    """

    simulated = True
    #: Nanoseconds a device's utilisation is kept before it is computed again (the real
    #: NVML's figure changes at most every 1/6 s; one sample's four queries that derive from
    #: it, utilisation, temperature, power and clock, then scan the activity log once).
    UTILIZATION_PERIOD_NS = 2_000_000

    def __init__(self, backend: SimulatorCore):
        self._backend = backend
        self._utilization: dict[int, tuple[int, tuple[int, int]]] = {}

    def __repr__(self) -> str:
        return f"<SimulatedNvml: {self.device_count()} simulated devices (not a real NVML)>"

    def device_count(self) -> int:
        return self._backend.total_devices

    def uuids(self) -> list[str]:
        return list(self._backend.physical_uuids)

    def name(self, uuid: str) -> str:
        self._index(uuid)
        return "cudalab simulated GPU (H100-like)"

    def _index(self, uuid: str) -> int:
        text = str(uuid).strip().lower()
        if not text.startswith("gpu-"):
            text = "gpu-" + text
        for i, u in enumerate(self._backend.physical_uuids):
            if u.lower() == text:
                return i
        raise NvmlError(f"NVML (simulated): no simulated device has UUID {uuid!r}")

    def _used(self, phys: int) -> tuple[int, int]:
        b = self._backend
        dev = b.by_physical.get(phys)
        if dev is None:  # hidden from this process by CUDA_VISIBLE_DEVICES
            return b.memory_per_device, 0
        return dev.capacity, dev.used

    def utilization(self, uuid: str) -> tuple[int, int]:
        phys = self._index(uuid)
        t = now()
        known = self._utilization.get(phys)
        if known is not None and 0 <= t - known[0] < self.UTILIZATION_PERIOD_NS:
            return known[1]
        value = busy_percent(self._backend.activity[phys])
        self._utilization[phys] = (t, value)
        return value

    def memory_info(self, uuid: str) -> tuple[int, int, int]:
        total, used = self._used(self._index(uuid))
        return total, total - used, used

    def temperature(self, uuid: str) -> int:
        return 35 + self.utilization(uuid)[0] // 4

    def power_usage(self, uuid: str) -> int:
        return 70000 + self.utilization(uuid)[0] * 6000

    def clock_sm(self, uuid: str) -> int:
        return 1980 if self.utilization(uuid)[0] > 0 else 345

    def clock_event_reasons(self, uuid: str) -> int | None:
        """None: simulated devices have no clocks for anything to limit (the %cuda_timed
        context then shows no reasons, and says the device is simulated)."""
        self._index(uuid)  # an unknown UUID still raises, like every query here
        return None

    def processes(self, uuid: str) -> list[tuple[int, int | None]]:
        phys = self._index(uuid)
        dev = self._backend.by_physical.get(phys)
        if dev is None or not dev.touched:
            return []
        listed = getattr(self._backend, "other_processes", None)  # (SimMemory's)
        others: dict[int, int] = listed(dev.ordinal) if listed is not None else {}
        mine = self._used(phys)[1] - sum(others.values())
        return [(os.getpid(), mine), *sorted(others.items())]
