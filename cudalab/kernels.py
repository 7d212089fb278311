"""Compile and launch your own CUDA C++ kernels: source -> CUBIN (NVRTC, cached) -> stream.

::

    fill = Kernel("my_fill", SOURCE, ("p", "u4", "u8"), sim=my_numpy_fill)
    fill(launch_config_1d(n)[0], 256, (ptr, 7, n))           # on the current stream
    fill.launch(grid, block, (arr, 7, n), stream=s)          # arr: any __cuda_array_interface__

This is the public face of the kernel facility, which lives in :mod:`cudalab._kernels.kernel`
(the runtime's own kernels import it from there, so there is no import cycle):

* CUBINs are compiled once per device architecture and cached in memory and on disk
  (:func:`cache_dir`, :func:`cache_key`, :func:`get_cubin`); an unusable disk cache gives one
  :class:`KernelCacheWarning` and the cache stays memory-only.
* On the simulator backend nothing is compiled: the kernel's numpy ``sim`` implementation is
  registered with the simulator (``cudalab._driver.sim.register_kernel``).
* ``CUDA_LAUNCH_BLOCKING=1`` (read when the facility is imported) or
  :func:`set_launch_blocking` synchronises the stream after every launch.
* Code that wants to hear about every launch appends to
  :data:`cudalab._internal.launch_observers`.

:func:`gpu_sleep` (``gpu_sleep(ns, stream=None)``) occupies a stream for a known time, like
torch's ``torch.cuda._sleep``: for demos and timing experiments.
"""

from __future__ import annotations

from cudalab._kernels.kernel import (
    Kernel,
    KernelCacheWarning,
    cache_dir,
    cache_key,
    get_cubin,
    is_launch_blocking,
    launch_config_1d,
    registered_kernels,
    set_launch_blocking,
)
from cudalab._kernels.spin import gpu_sleep

__all__ = [
    "Kernel",
    "all_kernels",
    "compile_all",
    "launch_config_1d",
    "set_launch_blocking",
    "is_launch_blocking",
    "cache_dir",
    "cache_key",
    "get_cubin",
    "KernelCacheWarning",
    "gpu_sleep",
]


def all_kernels() -> list[Kernel]:
    """Every kernel cudalab itself defines (for compiling them all in CI).

    Returns
    -------
    list of Kernel
        The fills, the spin kernels and the RNG's kernels (their modules are imported here).
    """
    import cudalab._kernels.fill  # noqa: F401  (define the runtime's kernels)
    import cudalab._kernels.philox  # noqa: F401  (and the RNG's, loaded lazily elsewhere)
    import cudalab._kernels.spin  # noqa: F401

    return registered_kernels()


def compile_all(arch: str = "sm_90") -> dict[str, bytes]:
    """CUBIN of every kernel in :func:`all_kernels` for ``arch``.

    Parameters
    ----------
    arch
        The target architecture, e.g. ``"sm_90"``.

    Returns
    -------
    dict
        Kernel name -> CUBIN image.

    Raises
    ------
    cudalab.KernelCompileError
        NVRTC is missing or a kernel fails to compile.
    """
    return {k.name: k.cubin(arch) for k in all_kernels()}
