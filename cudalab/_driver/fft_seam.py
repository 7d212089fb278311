"""The FFT library's seam: :class:`Fft` (:meth:`Backend.fft`), implemented by
:class:`cudalab._driver.cufft.RealFft` (cuFFT through ctypes) and
:class:`cudalab._driver.sim.fft.SimulatedFft` (``numpy.fft``, in stream order).

A plan is cuFFT's advanced data layout (``cufftMakePlanMany64``): ``rank`` (1 to 3)
transform sizes, ``batch`` signals, and for input and output the embedding, the stride
between elements and the distance between signals. cudalab creates plans with automatic
work-area allocation off and hands each execution a work area from its own allocator
(``cufftSetWorkArea``), as torch does.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from cudalab._driver.handles import StreamHandle

__all__ = ["Fft", "R2C", "C2R", "C2C", "D2Z", "Z2D", "Z2Z", "FORWARD", "INVERSE"]

#: cufftType values.
R2C = 0x2A
C2R = 0x2C
C2C = 0x29
D2Z = 0x6A
Z2D = 0x6C
Z2Z = 0x69
#: Directions of a complex-to-complex transform.
FORWARD = -1
INVERSE = 1


class Fft(abc.ABC):
    """An FFT library bound to one backend. Plans are plain ints.

    Every method may raise :class:`cudalab.CufftError` naming the call and the result (or,
    when the library cannot be loaded, the extra to install).
    """

    simulated: bool = False

    @abc.abstractmethod
    def version(self) -> int:
        """The library's version number (cufftGetVersion)."""

    @abc.abstractmethod
    def plan(self, device: int, sizes: Sequence[int], inembed: Sequence[int], istride: int,
             idist: int, onembed: Sequence[int], ostride: int, odist: int, fft_type: int,
             batch: int) -> tuple[int, int]:
        """A plan on ``device`` (its context current) and its work-area size in bytes.

        The plan allocates no work area of its own (``cufftSetAutoAllocation(0)``).
        """

    @abc.abstractmethod
    def destroy(self, plan: int) -> None:
        """Release ``plan``."""

    @abc.abstractmethod
    def execute(self, plan: int, stream: StreamHandle, work_area: int, fft_type: int,
                source: int, destination: int, direction: int) -> None:
        """Run ``plan`` on ``stream`` with ``work_area`` (device memory of the plan's work
        size); ``direction`` is read for complex-to-complex plans only. Unnormalised, as
        cuFFT: an inverse transform is not divided by its size."""
