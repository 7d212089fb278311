"""``cudalab_spin``: a kernel of known length, for timing tests."""

from __future__ import annotations

import time

from cudalab.kernels import Kernel

SOURCE = r"""
extern "C" __global__ void cudalab_spin(unsigned long long ns)
{
    // One thread busy-waits until the global nanosecond timer has advanced by ns.
    if (threadIdx.x != 0 || threadIdx.y != 0 || threadIdx.z != 0 ||
        blockIdx.x != 0 || blockIdx.y != 0 || blockIdx.z != 0) {
        return;
    }
    unsigned long long start;
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""


def _sim_spin(sim, grid, block, shared_mem, ns):
    time.sleep(ns / 1e9)


#: ``spin((1,), (1,), (ns,))`` occupies the stream for ``ns`` nanoseconds.
spin = Kernel("cudalab_spin", SOURCE, ("u8",), sim=_sim_spin)


def gpu_sleep(ns: int, stream=None) -> None:
    """Occupy ``stream`` (default: the current stream) for ``ns`` nanoseconds of GPU time."""
    if isinstance(ns, bool) or not isinstance(ns, int) or ns < 0:
        raise ValueError(f"ns must be a non-negative int, got {ns!r}")
    spin.launch(1, 1, (ns,), stream=stream)
