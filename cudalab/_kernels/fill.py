"""``cudalab_fill_u8/u16/u32/u64(ptr, value, n)``: grid-stride fills of n elements, and
``cudalab_fill_v16(ptr, value, n)``: n 16-byte vectors, one per thread, no loop. Each waits
for the stream's previous kernel first (``griddepcontrol.wait``, a no-op unless launched with
programmatic dependent launch: see ``_PROLOGUE``).

The five kernels share one source, so they are compiled (and cached) once. The value is
passed as a 32-bit parameter for the narrow types and truncated in the kernel.

``cudalab_fill_v16`` is the fill of a 16-byte aligned range whose pattern repeats every 8
bytes (every fill of 1, 2, 4 or 8-byte items, widened): each thread stores the 64-bit value
twice in one 16-byte store, as torch's vectorized fill stores 4 floats, and the launch covers
the range exactly (one thread per vector, no grid-stride loop), so a 4 KiB fill is one block.
A fill is tiny and many are queued back to back (1,000 ``fill_`` in a CUDA graph: issue 37,
section 1), so each node's GPU time is mostly the launch: fewer blocks and fewer stores a node.
"""

from __future__ import annotations

import numpy as np

from cudalab._kernels.kernel import Kernel

# (suffix, C element type, C value parameter type, signature code of the value, numpy dtype)
_TYPES = (
    ("u8", "unsigned char", "unsigned int", "u4", np.uint8),
    ("u16", "unsigned short", "unsigned int", "u4", np.uint16),
    ("u32", "unsigned int", "unsigned int", "u4", np.uint32),
    ("u64", "unsigned long long", "unsigned long long", "u8", np.uint64),
)

_TEMPLATE = r"""
extern "C" __global__ void cudalab_fill_{suffix}({elem}* __restrict__ ptr, {param} value,
                                                 unsigned long long n)
{{
    WAIT_FOR_PREVIOUS_KERNEL();
    const {elem} v = static_cast<{elem}>(value);
    const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
    for (unsigned long long i = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
         i < n; i += stride) {{
        ptr[i] = v;
    }}
}}
"""

_VECTOR = r"""
extern "C" __global__ void cudalab_fill_v16(ulonglong2* __restrict__ ptr, unsigned long long value,
                                            unsigned long long n)
{
    WAIT_FOR_PREVIOUS_KERNEL();
    const unsigned long long i = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) {
        ptr[i] = make_ulonglong2(value, value);
    }
}
"""

# Programmatic dependent launch (compute capability 9.0+): launched with the attribute (a fill
# captured into a graph, see cudalab._array_memory.fill), a kernel may begin while the
# previous kernel on the stream still runs; it waits here until that kernel has finished and
# its writes are visible, then lets the next kernel begin launching, then stores. Launched
# without the attribute both instructions return at once.
_PROLOGUE = r"""
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define WAIT_FOR_PREVIOUS_KERNEL() \
    asm volatile("griddepcontrol.wait;" ::: "memory"); \
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define WAIT_FOR_PREVIOUS_KERNEL() ((void)0)
#endif
"""

SOURCE = _PROLOGUE + "".join(
    _TEMPLATE.format(suffix=suffix, elem=elem, param=param) for suffix, elem, param, _, _ in _TYPES
) + _VECTOR


def _sim_impl(dtype):
    mask = (1 << (8 * np.dtype(dtype).itemsize)) - 1

    def impl(sim, grid, block, shared_mem, ptr, value, n):
        if n:
            sim.array(ptr, dtype, n)[...] = dtype(value & mask)

    return impl


def _sim_vector(sim, grid, block, shared_mem, ptr, value, n):
    # only the vectors the launch covers, as the kernel (one thread each, no loop)
    n = min(n, grid[0] * grid[1] * grid[2] * block[0] * block[1] * block[2])
    if n:
        sim.array(ptr, np.uint64, 2 * n)[...] = np.uint64(value)


#: Kernels by element size in bytes: {1: cudalab_fill_u8, 2: ..., 4: ..., 8: ...}.
FILL_KERNELS = {
    np.dtype(dtype).itemsize: Kernel(
        f"cudalab_fill_{suffix}", SOURCE, ("p", code, "u8"), sim=_sim_impl(dtype),
        access=("w", "", ""),
    )
    for suffix, _, _, code, dtype in _TYPES
}


#: The 16-byte vector fill (``cudalab_fill_v16``): ``(ptr, value, n)`` writes n 16-byte vectors,
#: each the 8-byte ``value`` twice; ``ptr`` 16-byte aligned, one thread per vector.
VECTOR_FILL_KERNEL = Kernel("cudalab_fill_v16", SOURCE, ("p", "u8", "u8"), sim=_sim_vector,
                            access=("w", "", ""))
#: Every fill kernel (loaded together before a capture begins).
ALL_FILL_KERNELS = (*FILL_KERNELS.values(), VECTOR_FILL_KERNEL)


def fill_kernel(itemsize: int) -> Kernel:
    """The fill kernel for elements of ``itemsize`` bytes (1, 2, 4 or 8)."""
    try:
        return FILL_KERNELS[itemsize]
    except KeyError:
        raise ValueError(f"no fill kernel for {itemsize}-byte elements (1, 2, 4 or 8)") from None
