"""The runtime's own CUDA kernels, each with its numpy implementation for the simulator.

Importing this package defines the runtime's own kernels; the RNG's (``philox``) are defined
when :mod:`cudalab.random` first needs them. ``cudalab.kernels.all_kernels()`` imports both.
"""

from cudalab._kernels.fill import FILL_KERNELS, fill_kernel
from cudalab._kernels.spin import spin

__all__ = ["FILL_KERNELS", "fill_kernel", "spin"]
