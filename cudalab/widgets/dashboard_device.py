"""One device of :class:`~cudalab.widgets.MemoryDashboard`: its identity, its NVML handle
and the ring buffers the sampler thread fills (:class:`_Device`)."""

from __future__ import annotations

import os
from collections import deque
from typing import Any

import numpy as np

__all__ = ["_Device"]


class _Device:
    """One device's identity, NVML handle and ring buffers."""

    def __init__(self, index: int, window: int):
        import cudalab
        from cudalab import nvml as nvml_mod

        self.index = index
        self.name = cudalab.get_device_name(index)
        props = cudalab.get_device_properties(index)
        self.capacity = int(props.total_memory)
        self.nvml: Any = None
        self.uuid = ""
        self.nvml_error = ""
        try:
            _, self.uuid, self.nvml = nvml_mod.resolve_device(index)
            self.nvml.uuids()  # probe: raises when NVML cannot be used
        except Exception as exc:  # NvmlError, NvmlUnavailableError, missing bindings
            self.nvml = None
            self.nvml_error = f"NVML unavailable ({type(exc).__name__})"
        self.t: deque = deque(maxlen=window)
        self.allocated: deque = deque(maxlen=window)
        self.reserved: deque = deque(maxlen=window)
        self.nvml_used: deque = deque(maxlen=window)
        self.last: dict[str, Any] = {}
        self.last_png = b""
        self.chart_time = 0.0
        self.ymax = 1024.0

    def sample(self, now: float) -> dict[str, Any]:
        import cudalab.memory as cm

        st = cm.memory_stats(self.index)
        s: dict[str, Any] = {
            "time": now,
            "allocated": st.get("allocated_bytes.all.current", 0),
            "reserved": st.get("reserved_bytes.all.current", 0),
            "peak_allocated": st.get("allocated_bytes.all.peak", 0),
            "peak_reserved": st.get("reserved_bytes.all.peak", 0),
            "requested": st.get("requested_bytes.all.current", 0),
            "allocations": st.get("allocation.all.current", 0),
            "allocations_total": st.get("allocation.all.allocated", 0),
            "segments": st.get("segment.all.current", 0),
            "num_ooms": st.get("num_ooms", 0),
            "num_alloc_retries": st.get("num_alloc_retries", 0),
            # private pools (graph captures, MemPool): [] without any, at no cost
            "pools": cm.private_pools(self.index),
            "utilization": None, "memory_utilization": None, "temperature": None,
            "power_draw": None, "clock_rate": None, "nvml_used": None,
            "nvml_total": None, "process_used": None, "all_processes_used": None,
            "processes": None,
        }
        nv = self.nvml
        if nv is not None:
            uuid = self.uuid
            for keys, query in ((("utilization", "memory_utilization"), nv.utilization),
                                (("temperature",), nv.temperature),
                                (("power_draw",), nv.power_usage),
                                (("clock_rate",), nv.clock_sm),
                                (("nvml_total", None, "nvml_used"), nv.memory_info)):
                try:
                    value = query(uuid)
                except Exception:  # one metric not supported: the others still read
                    continue
                if len(keys) == 1:
                    s[keys[0]] = value
                else:
                    for k, v in zip(keys, value):
                        if k is not None:
                            s[k] = v
            try:
                procs = nv.processes(uuid)
            except Exception:
                procs = None
            if procs is not None:
                pid = os.getpid()
                s["processes"] = len(procs)
                s["all_processes_used"] = sum(u for _, u in procs if u is not None)
                mine = [u for p, u in procs if p == pid]
                s["process_used"] = (mine[0] if mine and mine[0] is not None else None)
        self.t.append(now)
        self.allocated.append(s["allocated"])
        self.reserved.append(s["reserved"])
        self.nvml_used.append(s["nvml_used"] if s["nvml_used"] is not None else 0)
        self.last = s
        return s

    def arrays(self) -> dict[str, np.ndarray]:
        out = {"allocated": np.fromiter(self.allocated, np.float64, len(self.allocated)),
               "reserved": np.fromiter(self.reserved, np.float64, len(self.reserved))}
        if self.nvml is not None:
            out["nvml_used"] = np.fromiter(self.nvml_used, np.float64, len(self.nvml_used))
        return out

