"""The ``cupy`` source: :class:`CupySource`, samples of CuPy's default memory pools.

CuPy is read from ``sys.modules`` only (imported when the user names the source:
:func:`cudalab.memory_tools.libraries.cupy_module`). A sample reads the default ``MemoryPool``
(``used_bytes()`` as allocated, ``total_bytes()`` as reserved, ``n_free_blocks()``) and the
default ``PinnedMemoryPool`` (``n_free_blocks()``; it has no byte counters). CuPy's pool
keeps no peaks, counts no allocations, segments or out-of-memory errors: the sample's peaks
are the highest figures *this source's samples saw* (a lower bound of the true peak; reset
by :meth:`CupySource.reset_peaks`), and those counts are 0 (its ``note`` says so).

When cudalab's caching allocator backs CuPy (``cupy.cuda.set_allocator(
cudalab.memory.cupy_allocator)``, :mod:`cudalab.interop`), CuPy's arrays are cudalab's
allocations and the ``cudalab`` source counts them; the CuPy pool then holds only what it
had before, and the sample's note says so rather than counting anything twice.

CuPy's pool keeps no per-block state nor trace: :meth:`CupySource.snapshot` is the snapshot
of the CuPy recording (:mod:`cudalab.memory_tools.cupy_history`, started by
``%cuda_memory history start --source cupy`` or ``cudalab.memory.record_cupy_history()``),
which sees what was allocated since it started.
"""

from __future__ import annotations

import time
from typing import Any

from cudalab.memory_sources.cudalab_source import DeviceFacts
from cudalab.memory_tools.libraries import (
    cupy_backing,
    cupy_history_snapshot,
    cupy_module,
    cupy_pool_figures,
    cupy_with_cuda,
)
from cudalab.memory_tools.samples import DeviceSample

#: ``cupy_module`` and ``cupy_backing`` live in :mod:`cudalab.memory_tools.libraries` (so the
#: CuPy recording below the memory API reads them too) and stay importable from here.
__all__ = ["CupySource", "cupy_backing", "cupy_module"]

_NO_COUNTS = ("CuPy's pool keeps no peaks nor allocation counts: the peaks are the highest "
              "figures sampled")


class CupySource:
    """Samples of CuPy's default memory pool, for every memory view (see the module).

    Parameters
    ----------
    cupy : module, optional
        The CuPy module (default: :func:`cupy_module` with ``explicit=True``).
    nvml : bool, optional
        Add the device's NVML figures to each sample (default True).

    Raises
    ------
    SourceUnavailableError
        CuPy is not installed, or cannot use CUDA here.
    """

    name = "cupy"

    def __init__(self, cupy: Any = None, nvml: bool = True):
        cupy = cupy_with_cuda(cupy)
        self._cupy = cupy
        self._nvml = bool(nvml)
        self._facts = DeviceFacts("cupy")
        #: device -> [highest used, highest total] seen by this source's samples
        self._peaks: dict[int, list[int]] = {}

    def pool_figures(self, device: int) -> tuple[int, int, int]:
        """``(used_bytes, total_bytes, n_free_blocks)`` of the default pool on ``device``
        (CuPy's pool answers for the calling thread's current device: the device is made
        current for the call when it is another)."""
        return cupy_pool_figures(self._cupy, device)

    def sample(self, device: int, now: float | None = None) -> DeviceSample:
        """A :class:`DeviceSample` of CuPy's default pools on ``device``."""
        used, total, free_blocks = self.pool_figures(device)
        identity, capacity, _ = self._facts.get(device)
        peaks = self._peaks.setdefault(device, [0, 0])
        peaks[0], peaks[1] = max(peaks[0], used), max(peaks[1], total)
        try:
            pinned_free = int(self._cupy.get_default_pinned_memory_pool().n_free_blocks())
        except Exception:
            pinned_free = 0
        backing = cupy_backing(self._cupy)
        note = _NO_COUNTS
        if backing == "cudalab":
            note = ("cudalab's allocator backs CuPy (cudalab.interop.cupy_allocator): CuPy's "
                    "arrays are counted in the 'cudalab' source; these are CuPy's own pool's "
                    "figures, not counted twice")
        elif backing == "other":
            note = ("CuPy allocates through another allocator (cupy.cuda.set_allocator): its "
                    "arrays are not in these figures of CuPy's default pool")
        figures: dict[str, Any] = {
            "allocated": used, "reserved": total, "peak_allocated": peaks[0],
            "peak_reserved": peaks[1], "requested": used, "allocations": 0,
            "allocations_total": 0, "segments": 0, "num_ooms": 0, "num_alloc_retries": 0,
            "note": note,
            "extra": (("free_blocks", free_blocks), ("pinned_free_blocks", pinned_free)),
        }
        if self._nvml:
            figures.update(self._facts.nvml(device))
        return DeviceSample(time=time.time() if now is None else now, source=self.name,
                            identity=identity, capacity=capacity, **figures)

    def reserved(self, device: int) -> int:
        """Bytes CuPy's default pool holds on ``device`` now (``total_bytes()``)."""
        return self.pool_figures(device)[1]

    def reset_peaks(self, device: int) -> None:
        """Start this source's sampled peaks of ``device`` again from the figures now
        (CuPy keeps no peaks of its own: nobody else's figure changes)."""
        used, total, _ = self.pool_figures(device)
        self._peaks[device] = [used, total]

    def release_cache(self) -> None:
        """``free_all_blocks()`` of CuPy's default pool and pinned pool."""
        self._cupy.get_default_memory_pool().free_all_blocks()
        self._cupy.get_default_pinned_memory_pool().free_all_blocks()

    def snapshot(self) -> dict[str, Any]:
        """The snapshot of the CuPy recording (:mod:`cudalab.memory_tools.cupy_history`): the
        segments and live blocks seen since it started, its trace, and the pool's totals
        beside them. SourceUnavailableError when no recording was started (CuPy's pool keeps
        no per-block state of its own)."""
        return cupy_history_snapshot()
