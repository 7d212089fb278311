"""The runtime's own CUDA kernels, each with its numpy implementation for the simulator.

Importing this package defines them all (``cudalab.kernels.all_kernels()`` relies on it).
"""

from cudalab._kernels import philox  # noqa: F401 - the RNG kernels (cudalab.random)
from cudalab._kernels.fill import FILL_KERNELS, fill_kernel
from cudalab._kernels.spin import spin

__all__ = ["FILL_KERNELS", "fill_kernel", "spin"]
