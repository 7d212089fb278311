"""``cudalab_spin``: a kernel of known length, for timing tests."""

from __future__ import annotations

import time

from cudalab._kernels.kernel import Kernel

_WAIT = r"""
__device__ __forceinline__ void cudalab_wait_ns(unsigned long long ns,
                                                unsigned long long* first,
                                                unsigned long long* last)
{
    // Busy-wait until the global nanosecond timer has advanced by ns; its first and last
    // readings go to *first and *last.
    unsigned long long start;
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
    *first = start;
    *last = now;
}
"""

SOURCE = _WAIT + r"""
extern "C" __global__ void cudalab_spin(unsigned long long ns)
{
    // One thread busy-waits until the global nanosecond timer has advanced by ns.
    if (threadIdx.x != 0 || threadIdx.y != 0 || threadIdx.z != 0 ||
        blockIdx.x != 0 || blockIdx.y != 0 || blockIdx.z != 0) {
        return;
    }
    unsigned long long first;
    unsigned long long last;
    cudalab_wait_ns(ns, &first, &last);
}
"""

STAMPED_SOURCE = _WAIT + r"""
extern "C" __global__ void cudalab_spin_stamped(unsigned long long ns,
                                                unsigned long long* stamps,
                                                unsigned long long slot)
{
    // cudalab_spin that also writes its first and last %globaltimer readings to
    // stamps[2 * slot] and stamps[2 * slot + 1] (its own duration, for benchmarks).
    if (threadIdx.x != 0 || threadIdx.y != 0 || threadIdx.z != 0 ||
        blockIdx.x != 0 || blockIdx.y != 0 || blockIdx.z != 0) {
        return;
    }
    cudalab_wait_ns(ns, &stamps[2 * slot], &stamps[2 * slot + 1]);
}
"""


def _sim_spin(sim, grid, block, shared_mem, ns):
    time.sleep(ns / 1e9)


def _sim_spin_stamped(sim, grid, block, shared_mem, ns, ptr, slot):
    import numpy as np

    t0 = time.perf_counter_ns()
    time.sleep(ns / 1e9)
    t1 = time.perf_counter_ns()
    stamps = sim.array(ptr, np.uint64, 2 * (slot + 1))
    stamps[2 * slot], stamps[2 * slot + 1] = t0, t1


#: ``spin((1,), (1,), (ns,))`` occupies the stream for ``ns`` nanoseconds.
spin = Kernel("cudalab_spin", SOURCE, ("u8",), sim=_sim_spin)

#: ``spin_stamped`` with ``(ns, stamps_ptr, slot)``: the same, writing its own start and end
#: (``%globaltimer``, ns) to ``stamps[2 * slot]`` and ``stamps[2 * slot + 1]``.
spin_stamped = Kernel("cudalab_spin_stamped", STAMPED_SOURCE, ("u8", "p", "u8"),
                      sim=_sim_spin_stamped, access=("", "w", ""))


def gpu_sleep(ns: int, stream=None) -> None:
    """Occupy ``stream`` for ``ns`` nanoseconds of GPU time (public as
    :func:`cudalab.kernels.gpu_sleep`; torch's nearest is ``torch.cuda._sleep(cycles)``).

    One thread busy-waits on ``%globaltimer``, so the duration is wall time, not clock
    cycles; on the simulator the stream's worker sleeps for that long.

    Parameters
    ----------
    ns
        How long, in nanoseconds (a non-negative int).
    stream
        A :class:`cudalab.Stream` (default: the current stream).

    Raises
    ------
    ValueError
        ``ns`` is not a non-negative int.
    """
    if isinstance(ns, bool) or not isinstance(ns, int) or ns < 0:
        raise ValueError(f"ns must be a non-negative int, got {ns!r}")
    spin.launch(1, 1, (ns,), stream=stream)
