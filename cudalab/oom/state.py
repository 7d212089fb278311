"""What a device's memory is made of at one moment: every allocator's blocks, NVML, the driver.

:func:`capture_state` reads, for one device, each allocator present in the process
(cudalab's own, torch's from ``sys.modules`` when it has initialised CUDA, CuPy's default
pool), the driver's free and total bytes and NVML's per-process figures, into a
:class:`DeviceState`. Each allocator's part is an :class:`AllocatorFigures`: its live bytes,
its cached free bytes per pool with the largest free hole, its private pools (CUDA graphs,
``MemPool``), its frees waiting on other streams. torch's figures come from
``torch.cuda.memory_stats`` and ``torch.cuda.memory_snapshot()`` (segments only); nothing
here imports torch or CuPy or initialises their CUDA.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from cudalab import devices as _devices
from cudalab import memory as _memory
from cudalab.allocator.registry import existing_allocator
from cudalab.memory_sources import DeviceFacts, cupy_backing
from cudalab.memory_sources.torch_source import torch_ready
from cudalab.memory_tools import history as _history
from cudalab.memory_tools import stacks as _stacks
from cudalab.memory_tools.trace_columns import live_simulated

__all__ = ["CONTEXT_ESTIMATE", "AllocatorFigures", "DeviceState", "capture_state", "live_blocks",
           "site_of"]

#: The CUDA context's typical size with lazy module loading (CUDA 12/13, measured 520 MiB on
#: an H200 with torch or CuPy; NVML cannot tell it apart from the rest of the process).
CONTEXT_ESTIMATE = 520 << 20


@dataclass(frozen=True, slots=True)
class AllocatorFigures:
    """One allocator's bytes on one device (every count is an int >= 0)."""

    #: "cudalab", "torch" or "cupy".
    source: str
    #: Bytes of live blocks outside private pools (allocated, rounded as the allocator does).
    live: int
    #: Cached free bytes of the small pool (<= 1 MiB requests) and its largest free block.
    free_small: int
    largest_small: int
    #: Cached free bytes of the large pool and its largest free block.
    free_large: int
    largest_large: int
    #: Bytes reserved by private pools (CUDA graphs, MemPool), live or free inside.
    private: int
    #: Bytes freed by the user but waiting on other streams' work (pending frees).
    pending: int
    #: Bytes the allocator holds from the driver (live + free + private + pending).
    reserved: int
    #: The per-process memory limit in bytes, None when no fraction is set.
    limit: int | None
    #: The settings string the allocator runs with ("" = defaults).
    settings: str
    #: A sentence about how the figures were read ("" when exact).
    note: str = ""


@dataclass(frozen=True, slots=True)
class DeviceState:
    """One device's memory at one moment (bytes are ints >= 0, None when unknown)."""

    device: int
    #: When it was read (``time.time()``).
    time: float
    #: The driver's total and free bytes (``cuMemGetInfo``).
    total: int
    free: int
    #: Each allocator present, cudalab's first.
    allocators: tuple[AllocatorFigures, ...]
    #: NVML: this process's bytes on the device, and every other process's together.
    process_used: int | None
    other_processes: int | None
    #: Why NVML could not give its figures ("" when it did).
    nvml_error: str
    #: The device is the simulator's.
    simulated: bool

    @property
    def reserved(self) -> int:
        """Bytes every allocator holds."""
        return sum(a.reserved for a in self.allocators)

    def allocator(self, source: str) -> AllocatorFigures | None:
        """The figures of ``source`` ("cudalab", "torch", "cupy"), None when absent."""
        return next((a for a in self.allocators if a.source == source), None)


def _from_segments(source: str, segments: list[dict[str, Any]], limit: int | None,
                   settings: str, note: str = "") -> AllocatorFigures:
    live = free_s = big_s = free_l = big_l = private = pending = reserved = 0
    for seg in segments:
        total = int(seg.get("total_size", 0))
        reserved += total
        pool = seg.get("segment_pool_id", (0, 0))
        if tuple(pool) != (0, 0):
            private += total
            continue
        small = seg.get("segment_type") == "small"
        for b in seg.get("blocks", ()):
            size = int(b.get("size", 0))
            state = b.get("state")
            if state == "active_allocated":
                live += size
            elif state == "active_pending_free":
                pending += size
            elif small:
                free_s += size
                big_s = max(big_s, size)
            else:
                free_l += size
                big_l = max(big_l, size)
    return AllocatorFigures(source, live, free_s, big_s, free_l, big_l, private, pending,
                            reserved, limit, settings, note)


def _cudalab_figures(device: int) -> AllocatorFigures | None:
    a = existing_allocator(device)
    if a is None:
        return None
    limit = None
    if _memory.get_per_process_memory_fraction(device) < 1.0:
        total = int(_devices.get_device_properties(device).total_memory)
        limit = int(_memory.get_per_process_memory_fraction(device) * total)
    cfg = getattr(a, "config", None)
    settings = str(getattr(cfg, "text", "") or "")
    try:
        segments = a.segments()
    except RuntimeError:  # cudaMallocAsync keeps no blocks: its pool's totals only
        stats = a.memory_stats()
        reserved = int(stats.get("reserved_bytes.all.current", 0))
        live = int(stats.get("allocated_bytes.all.current", 0))
        return AllocatorFigures("cudalab", live, 0, 0, max(0, reserved - live), 0, 0, 0,
                                reserved, limit, settings,
                                "cudaMallocAsync keeps no blocks: the pool's free bytes and "
                                "its largest free block are not known")
    return _from_segments("cudalab", segments, limit, settings)


def _torch_figures(device: int) -> AllocatorFigures | None:
    torch = sys.modules.get("torch")
    if torch is None or torch_ready(torch):
        return None
    cuda = torch.cuda
    try:
        segments = [s for s in cuda.memory_snapshot() if s.get("device", device) == device]
    except Exception as exc:  # an older torch or a broken state: totals only
        stats = cuda.memory_stats(device)
        reserved = int(stats.get("reserved_bytes.all.current", 0))
        live = int(stats.get("allocated_bytes.all.current", 0))
        return AllocatorFigures("torch", live, 0, 0, reserved - live, 0, 0, 0, reserved, None,
                                "", f"torch's segments could not be read ({type(exc).__name__})")
    limit = None
    fraction = getattr(cuda, "get_per_process_memory_fraction", None)
    try:
        value = float(fraction(device)) if callable(fraction) else 1.0
        if value < 1.0:
            limit = int(value * cuda.mem_get_info(device)[1])
    except Exception:  # an older torch: no fraction reader
        pass
    settings = os.environ.get("PYTORCH_ALLOC_CONF", "") or \
        os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    return _from_segments("torch", segments, limit, settings)


def _cupy_figures(device: int) -> AllocatorFigures | None:
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return None
    try:
        if cupy_backing(cupy) != "pool":
            return None  # cudalab's pool backs it (counted there), or one cudalab cannot read
        with cupy.cuda.Device(device):
            pool = cupy.get_default_memory_pool()
            used = int(pool.used_bytes())
            total = int(pool.total_bytes())
    except Exception:
        return None
    if not total:
        return None
    free = total - used
    return AllocatorFigures("cupy", used, 0, 0, free, 0, 0, 0, total, None, "",
                            "CuPy's pool gives no block sizes: its largest free block is "
                            "unknown")


def capture_state(device: int) -> DeviceState:
    """The memory of ``device`` now (see the module documentation)."""
    allocators = tuple(f for f in (_cudalab_figures(device), _torch_figures(device),
                                   _cupy_figures(device)) if f is not None)
    free, total = _memory.mem_get_info(device)
    facts = DeviceFacts("cudalab")
    nv = facts.nvml(device)
    process_used = nv.get("process_used")
    every = nv.get("all_processes_used")
    other = None if every is None or process_used is None else max(0, every - process_used)
    return DeviceState(device, time.time(), int(total), int(free), allocators, process_used,
                       other, str(nv.get("nvml_error") or ""), live_simulated())


def live_blocks(device: int) -> list[tuple[int, int, tuple[Any, ...] | None]]:
    """cudalab's live blocks of ``device`` as (address, bytes, recorded stack or None)."""
    a = existing_allocator(device)
    if a is None:
        return []
    rec = _history.recorder_of(a)
    frames = rec.blocks if rec is not None else {}
    out = []
    try:
        segments = a.segments()
    except RuntimeError:  # cudaMallocAsync: no blocks
        return []
    for seg in segments:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                out.append((b["address"], b["size"], frames.get(b["address"])))
    return out


def site_of(stack: Any) -> str:
    """The allocation site of a recorded stack: its innermost frame outside cudalab."""
    frames = _stacks.frames_to_dicts(stack) if stack else []
    for f in frames:
        name = str(f.get("filename", ""))
        if "/cudalab/" in name or name.startswith("<frozen"):
            continue
        return f"{name}:{f.get('line')} ({f.get('name')})"
    return "(no Python frame)" if not frames else \
        f"{frames[0].get('filename')}:{frames[0].get('line')} ({frames[0].get('name')})"
