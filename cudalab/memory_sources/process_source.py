"""The ``process`` source: :class:`ProcessSource`, the memory of this process no allocator
accounts for.

NVML lists what each process uses on a device (its process list: the CUDA context, every
library's workspaces, every allocator's reservations). This source subtracts what the
allocators it is given hold (their ``reserved``) from this process's NVML figure: the rest
is the CUDA context (hundreds of MiB), cuBLAS/cuFFT/NCCL workspaces, ``cudaMalloc`` calls
outside any caching allocator, and an allocator cudalab does not know. Its samples' allocated
and reserved are that remainder (never below 0), the peaks the highest remainder sampled,
the NVML figures the device's; the note says how the figure was made.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from cudalab._internal import format_bytes
from cudalab.memory_sources.cudalab_source import DeviceFacts
from cudalab.memory_tools.samples import DeviceSample, SampleSource

__all__ = ["ProcessSource"]


def _reserved(source: SampleSource, device: int) -> int:
    """Bytes ``source``'s allocator holds on ``device`` (its ``reserved()`` when it has one,
    else a sample's)."""
    reserved = getattr(source, "reserved", None)
    if callable(reserved):
        return int(reserved(device))
    return source.sample(device).reserved


class ProcessSource:
    """This process's device memory that no allocator of ``accounted`` holds (see the module).

    Parameters
    ----------
    accounted : sequence of SampleSource
        The allocators whose reservations are subtracted (``resolve_sources`` gives every
        allocator present in the process).
    """

    name = "process"

    def __init__(self, accounted: Sequence[SampleSource] = ()):
        #: The sources whose ``reserved`` is subtracted from NVML's figure, in order.
        self.accounted: tuple[SampleSource, ...] = tuple(accounted)
        self._facts = DeviceFacts("process")
        self._peaks: dict[int, int] = {}

    def sample(self, device: int, now: float | None = None) -> DeviceSample:
        """A :class:`DeviceSample` of the unaccounted memory on ``device`` (0 with a note
        when NVML cannot say what this process uses)."""
        identity, capacity, _ = self._facts.get(device)
        figures: dict[str, Any] = self._facts.nvml(device)
        held = []
        for source in self.accounted:
            try:
                held.append((source.name, _reserved(source, device)))
            except Exception as exc:  # a source that went away: said in the note
                held.append((f"{source.name} (unreadable: {type(exc).__name__})", 0))
        accounted = sum(n for _, n in held)
        used = figures.get("process_used")
        names = ", ".join(f"{name} {format_bytes(n)}" for name, n in held) or "no allocator"
        if used is None:
            rest = 0
            why = figures["nvml_error"] or "NVML does not list this process's memory"
            note = f"the memory no allocator accounts for is unknown: {why}"
        else:
            rest = max(used - accounted, 0)
            note = (f"NVML: this process uses {format_bytes(used)} on cuda:{device}; the "
                    f"allocators hold {format_bytes(accounted)} ({names}); the rest (the CUDA "
                    "context, library workspaces, other allocations) is "
                    f"{format_bytes(rest)}")
        peak = self._peaks[device] = max(self._peaks.get(device, 0), rest)
        figures.update(allocated=rest, reserved=rest, peak_allocated=peak, peak_reserved=peak,
                       requested=rest, allocations=0, allocations_total=0, segments=0,
                       num_ooms=0, num_alloc_retries=0, note=note[:512])
        return DeviceSample(time=time.time() if now is None else now, source=self.name,
                            identity=identity, capacity=capacity, **figures)

    def reserved(self, device: int) -> int:
        """The unaccounted bytes on ``device`` now (0 when NVML cannot say)."""
        return self.sample(device).reserved

    def reset_peaks(self, device: int) -> None:
        """Forget the highest remainder sampled on ``device`` (nobody else's figure changes)."""
        self._peaks.pop(device, None)

    def release_cache(self) -> None:
        """Nothing: no allocator holds this memory."""

    def snapshot(self) -> dict[str, Any]:
        """An empty snapshot in torch's schema (no allocator's blocks are this memory)."""
        from cudalab.identity import Identity

        return {"segments": [], "device_traces": [], "allocator_settings": {},
                "external_annotations": [],
                "identity": Identity.current(allocator="process").to_dict()}
