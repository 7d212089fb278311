"""Sources of :class:`~cudalab.memory_tools.samples.DeviceSample` records over real
allocators: :class:`CudalabSource`, over cudalab's own allocator (``cudalab.memory``'s
``memory_stats()`` and ``private_pools()``) and NVML.

This module sits just above :mod:`cudalab.memory` in the layers (``pyproject.toml``): the
record and the :class:`~cudalab.memory_tools.samples.SampleSource` protocol stay in
:mod:`cudalab.memory_tools` (below the memory API), and the sources that read the memory API,
or another library's allocator (torch's, CuPy's, to come), live here, so no lower layer
reaches up to ``cudalab.memory`` through the package.
"""

from __future__ import annotations

import os
import time
from typing import Any

from cudalab import devices as _devices
from cudalab import memory as _memory
from cudalab import nvml as _nvml_api
from cudalab.identity import Identity
from cudalab.memory_tools.samples import ALLOCATOR_FIGURES, DeviceSample
from cudalab.memory_tools.snapshot import take_snapshot

__all__ = ["CudalabSource", "NvmlState", "nvml_figures"]


class NvmlState:
    """One device's NVML handle for a source: resolved once (a failure is kept as text)."""

    __slots__ = ("nvml", "uuid", "error")

    def __init__(self, index: int):
        self.nvml: Any = None
        self.uuid = ""
        self.error = ""
        try:
            _, self.uuid, self.nvml = _nvml_api.resolve_device(index)
            self.nvml.uuids()  # probe: raises when NVML cannot be used
        except Exception as exc:  # NvmlError, NvmlUnavailableError, missing bindings
            self.nvml = None
            self.error = f"NVML unavailable ({type(exc).__name__})"


class CudalabSource:
    """Samples of cudalab's own allocator (``memory_stats()``, ``private_pools()``) and
    NVML, for :class:`~cudalab.widgets.MemoryDashboard`.

    Each device's identity, capacity and NVML handle are read once, on its first sample.
    """

    name = "cudalab"

    def __init__(self) -> None:
        self._identities: dict[int, tuple[Identity, int]] = {}
        self._nvml: dict[int, NvmlState] = {}

    def _device(self, index: int) -> tuple[Identity, int]:
        known = self._identities.get(index)
        if known is None:
            known = (Identity.current(device=index, allocator="cudalab"),
                     int(_devices.get_device_properties(index).total_memory))
            self._identities[index] = known
            self._nvml[index] = NvmlState(index)
        return known

    def sample(self, device: int, now: float | None = None) -> DeviceSample:
        """A :class:`DeviceSample` of ``device``: its ``memory_stats()`` figures, private
        pools and NVML figures (one NVML query failing leaves the others)."""
        identity, capacity = self._device(device)
        stats = _memory.memory_stats(device)
        figures: dict[str, Any] = {name: stats.get(key, 0) for name, key in ALLOCATOR_FIGURES}
        # private pools (graph captures, MemPool): [] without any, at no cost
        figures["pools"] = tuple(_memory.private_pools(device))
        state = self._nvml[device]
        figures["nvml_error"] = state.error
        if state.nvml is not None:
            figures.update(nvml_figures(state.nvml, state.uuid))
        return DeviceSample(time=time.time() if now is None else now, source=self.name,
                            identity=identity, capacity=capacity, **figures)

    def reset_peaks(self, device: int) -> None:
        """``cudalab.memory.reset_peak_memory_stats(device)``."""
        _memory.reset_peak_memory_stats(device)

    def release_cache(self) -> None:
        """``cudalab.memory.empty_cache()``."""
        _memory.empty_cache()

    def snapshot(self) -> dict[str, Any]:
        """``cudalab.memory._snapshot()``."""
        return take_snapshot()


def nvml_figures(nv: Any, uuid: str) -> dict[str, Any]:
    """The NVML figures of the device ``uuid``: those a query gave (a metric the device
    does not support is left out; the others still read)."""
    out: dict[str, Any] = {}
    queries: tuple[tuple[tuple[str | None, ...], Any], ...] = (
        (("utilization", "memory_utilization"), nv.utilization),
        (("temperature",), nv.temperature),
        (("power_draw",), nv.power_usage),
        (("clock_rate",), nv.clock_sm),
        (("nvml_total", None, "nvml_used"), nv.memory_info),
    )
    for keys, query in queries:
        try:
            value = query(uuid)
        except Exception:  # one metric not supported: the others still read
            continue
        if len(keys) == 1:
            out[keys[0] or ""] = value
        else:
            for k, v in zip(keys, value):
                if k is not None:
                    out[k] = v
    try:
        procs = nv.processes(uuid)
    except Exception:
        procs = None
    if procs is not None:
        pid = os.getpid()
        out["processes"] = len(procs)
        out["all_processes_used"] = sum(u for _, u in procs if u is not None)
        mine = [u for p, u in procs if p == pid]
        out["process_used"] = mine[0] if mine and mine[0] is not None else None
    return out
