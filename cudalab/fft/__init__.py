"""``cudalab.fft``: torch.fft's transforms over cuFFT (the simulator: ``numpy.fft``).

``fft``, ``ifft``, ``rfft``, ``irfft``, ``fft2``, ``ifft2``, ``fftn``, ``ifftn``,
``rfftn``, ``irfftn`` with torch's signatures (:mod:`cudalab.fft.transforms`); the plans
live in each device's LRU cache (:mod:`cudalab.fft.plan_cache`,
``cudalab.backends.cuda.cufft_plan_cache``).
"""

from __future__ import annotations

from cudalab.fft.transforms import fft, fft2, fftn, ifft, ifft2, ifftn, irfft, irfftn, rfft, rfftn

__all__ = ["fft", "fft2", "fftn", "ifft", "ifft2", "ifftn", "irfft", "irfftn", "rfft", "rfftn"]
