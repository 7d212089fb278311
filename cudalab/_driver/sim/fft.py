"""The simulator's FFT: :class:`SimulatedFft`, ``numpy.fft`` run in stream order.

A plan records cuFFT's advanced layout (sizes, embeddings, strides, distances, type,
batch); executing it reads the signals from simulated device memory through that layout,
transforms them with ``numpy.fft`` unnormalised (as cuFFT: an inverse is not divided by
its size) and writes the output layout when the stream reaches it. The work-area size a
plan reports is simulated: one signal's complex size.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from cudalab._driver.fft_seam import C2C, C2R, D2Z, FORWARD, R2C, Z2D, Z2Z, Fft
from cudalab._driver.handles import StreamHandle
from cudalab._driver.sim.library_call import LibraryCall, library_op
from cudalab.errors import CufftError

__all__ = ["SimulatedFft"]

#: fft type -> (input dtype, output dtype).
_TYPES = {
    C2C: (np.complex64, np.complex64), Z2Z: (np.complex128, np.complex128),
    R2C: (np.float32, np.complex64), D2Z: (np.float64, np.complex128),
    C2R: (np.complex64, np.float32), Z2D: (np.complex128, np.float64),
}


class _Plan:
    """One simulated plan: cuFFT's advanced layout."""

    __slots__ = ("device", "sizes", "inembed", "istride", "idist", "onembed", "ostride",
                 "odist", "fft_type", "batch")

    def __init__(self, device: int, sizes: tuple[int, ...], inembed: tuple[int, ...],
                 istride: int, idist: int, onembed: tuple[int, ...], ostride: int, odist: int,
                 fft_type: int, batch: int) -> None:
        self.device = device
        self.sizes = sizes
        self.inembed = inembed
        self.istride = istride
        self.idist = idist
        self.onembed = onembed
        self.ostride = ostride
        self.odist = odist
        self.fft_type = fft_type
        self.batch = batch


def _view(flat_at: Any, ptr: int, dtype: Any, logical: tuple[int, ...],
          embed: tuple[int, ...], stride: int, dist: int, batch: int, writeable: bool) -> Any:
    """``batch`` signals of shape ``logical`` laid out as cuFFT's advanced layout says."""
    dt = np.dtype(dtype)
    item = dt.itemsize
    strides = []
    for j in range(len(logical)):
        strides.append(stride * math.prod(embed[j + 1:]) * item)
    extent = (batch - 1) * dist + sum((d - 1) * s // item for d, s in zip(logical, strides)) + 1
    flat = flat_at(ptr, dt, extent)
    return np.lib.stride_tricks.as_strided(flat, (batch, *logical), (dist * item, *strides),
                                           writeable=writeable)


class SimulatedFft(Fft):
    """The seam's FFT on the simulator (``numpy.fft`` in stream order)."""

    simulated = True

    def __init__(self, backend: Any) -> None:
        # the SimulatorBackend (typed Any, as the NCCL seam's: naming it would be a cycle)
        self._backend = backend
        self._lock = threading.Lock()
        self._plans: dict[int, _Plan] = {}  # plan -> layout; plans count from 1
        self._next = 1

    def version(self) -> int:
        return 12000  # simulated: cuFFT 12.0's number

    def plan(self, device: int, sizes: Sequence[int], inembed: Sequence[int], istride: int,
             idist: int, onembed: Sequence[int], ostride: int, odist: int, fft_type: int,
             batch: int) -> tuple[int, int]:
        if fft_type not in _TYPES:
            raise CufftError(f"cufftMakePlanMany64 failed: CUFFT_INVALID_TYPE (3) "
                             f"(simulated: type {fft_type:#x})", 3)
        if not 1 <= len(sizes) <= 3 or min(sizes) < 1 or batch < 1:
            raise CufftError(f"cufftMakePlanMany64 failed: CUFFT_INVALID_SIZE (8) "
                             f"(simulated: sizes {tuple(sizes)}, batch {batch})", 8)
        record = _Plan(device, tuple(sizes), tuple(inembed), istride, idist, tuple(onembed),
                       ostride, odist, fft_type, batch)
        with self._lock:
            plan, self._next = self._next, self._next + 1
            self._plans[plan] = record
        complex_item = np.dtype(_TYPES[fft_type][1 if fft_type in (R2C, D2Z, C2C, Z2Z)
                                                 else 0]).itemsize
        return plan, math.prod(sizes) * complex_item

    def _plan(self, plan: int, call: str) -> _Plan:
        record = self._plans.get(plan)
        if record is None:
            raise CufftError(f"{call} failed: CUFFT_INVALID_PLAN (1) (simulated: plan {plan} "
                             f"is not live)", 1)
        return record

    def destroy(self, plan: int) -> None:
        with self._lock:
            self._plan(plan, "cufftDestroy")
            del self._plans[plan]

    def execute(self, plan: int, stream: StreamHandle, work_area: int, fft_type: int,
                source: int, destination: int, direction: int) -> None:
        record = self._plan(plan, "cufftExec")
        if record.fft_type != fft_type:
            raise CufftError("cufftExec failed: CUFFT_INVALID_TYPE (3) (simulated: the plan's "
                             "type differs)", 3)
        backend = self._backend
        s = backend.stream_of(stream, "cufftExec")
        name = {C2C: "cufftExecC2C", Z2Z: "cufftExecZ2Z", R2C: "cufftExecR2C", D2Z: "cufftExecD2Z",
                C2R: "cufftExecC2R", Z2D: "cufftExecZ2D"}[fft_type]
        backend.submit(s, library_op, (LibraryCall(name, self._run,
                                                   (record, source, destination, direction)),
                                       (1, 1, 1), (1, 1, 1)))

    def _run(self, p: _Plan, source: int, destination: int, direction: int) -> None:
        in_type, out_type = _TYPES[p.fft_type]
        sizes = p.sizes
        half = sizes[:-1] + (sizes[-1] // 2 + 1,)
        logical_in = half if p.fft_type in (C2R, Z2D) else sizes
        logical_out = half if p.fft_type in (R2C, D2Z) else sizes
        flat_at = self._backend.array
        x = _view(flat_at, source, in_type, logical_in, p.inembed, p.istride, p.idist,
                  p.batch, False)
        axes = tuple(range(1, len(sizes) + 1))
        y: Any
        if p.fft_type in (C2C, Z2Z):
            if direction == FORWARD:
                y = np.fft.fftn(x, axes=axes)
            else:
                y = np.fft.ifftn(x, axes=axes, norm="forward")
        elif p.fft_type in (R2C, D2Z):
            y = np.fft.rfftn(x, axes=axes)
        else:
            y = np.fft.irfftn(x, s=sizes, axes=axes, norm="forward")
        out = _view(flat_at, destination, out_type, logical_out, p.onembed, p.ostride, p.odist,
                    p.batch, True)
        out[...] = y.astype(out_type, copy=False)
