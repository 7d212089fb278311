"""The ``cudalab`` source: :class:`CudalabSource`, over cudalab's own allocator
(``cudalab.memory``'s ``memory_stats()`` and ``private_pools()``) and NVML; and what every
source shares: a device's identity, capacity and NVML handle (:class:`DeviceFacts`) and the
NVML figures of a sample (:func:`nvml_figures`).
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

__all__ = ["CudalabSource", "DeviceFacts", "NvmlState", "nvml_figures"]


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


class DeviceFacts:
    """What a source reads once per device, on its first sample: the device's
    :class:`~cudalab.identity.Identity` naming the source's allocator, its capacity (the
    driver's ``total_memory``, bytes) and its NVML handle (:class:`NvmlState`).

    The identity and capacity come from cudalab's driver (the same device numbering as
    torch's and CuPy's: the process's, after ``CUDA_VISIBLE_DEVICES``), so the samples of
    every source of a device carry the same UUID.
    """

    __slots__ = ("allocator", "_known")

    def __init__(self, allocator: str):
        #: The allocator the identities name (``Identity.allocator``), non-empty.
        self.allocator = allocator
        self._known: dict[int, tuple[Identity, int, NvmlState]] = {}

    def get(self, index: int) -> tuple[Identity, int, NvmlState]:
        """``(identity, capacity, nvml state)`` of device ``index``, read on first use."""
        known = self._known.get(index)
        if known is None:
            known = (Identity.current(device=index, allocator=self.allocator),
                     int(_devices.get_device_properties(index).total_memory),
                     NvmlState(index))
            self._known[index] = known
        return known

    def nvml(self, index: int) -> dict[str, Any]:
        """The NVML figures of device ``index`` with ``nvml_error`` (every figure missing
        when NVML cannot be used)."""
        state = self.get(index)[2]
        figures: dict[str, Any] = {"nvml_error": state.error}
        if state.nvml is not None:
            figures.update(nvml_figures(state.nvml, state.uuid))
        return figures


class CudalabSource:
    """Samples of cudalab's own allocator (``memory_stats()``, ``private_pools()``) and
    NVML, for :class:`~cudalab.widgets.MemoryDashboard`.

    Each device's identity, capacity and NVML handle are read once, on its first sample.
    """

    name = "cudalab"

    def __init__(self) -> None:
        self._facts = DeviceFacts("cudalab")

    def sample(self, device: int, now: float | None = None) -> DeviceSample:
        """A :class:`DeviceSample` of ``device``: its ``memory_stats()`` figures, private
        pools and NVML figures (one NVML query failing leaves the others)."""
        identity, capacity, _ = self._facts.get(device)
        stats = _memory.memory_stats(device)
        figures: dict[str, Any] = {name: stats.get(key, 0) for name, key in ALLOCATOR_FIGURES}
        # private pools (graph captures, MemPool): [] without any, at no cost
        figures["pools"] = tuple(_memory.private_pools(device))
        figures.update(self._facts.nvml(device))
        return DeviceSample(time=time.time() if now is None else now, source=self.name,
                            identity=identity, capacity=capacity, **figures)

    def reserved(self, device: int) -> int:
        """Bytes cudalab's allocator holds on ``device`` now (``memory_reserved``)."""
        return int(_memory.memory_reserved(device))

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
