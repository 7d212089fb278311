"""``cudalab_fill_u8/u16/u32/u64(ptr, value, n)``: grid-stride fills of n elements.

The four kernels share one source, so they are compiled (and cached) once. The value is
passed as a 32-bit parameter for the narrow types and truncated in the kernel.
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
    const {elem} v = static_cast<{elem}>(value);
    const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
    for (unsigned long long i = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
         i < n; i += stride) {{
        ptr[i] = v;
    }}
}}
"""

SOURCE = "".join(
    _TEMPLATE.format(suffix=suffix, elem=elem, param=param) for suffix, elem, param, _, _ in _TYPES
)


def _sim_impl(dtype):
    mask = (1 << (8 * np.dtype(dtype).itemsize)) - 1

    def impl(sim, grid, block, shared_mem, ptr, value, n):
        if n:
            sim.array(ptr, dtype, n)[...] = dtype(value & mask)

    return impl


#: Kernels by element size in bytes: {1: cudalab_fill_u8, 2: ..., 4: ..., 8: ...}.
FILL_KERNELS = {
    np.dtype(dtype).itemsize: Kernel(
        f"cudalab_fill_{suffix}", SOURCE, ("p", code, "u8"), sim=_sim_impl(dtype),
        access=("w", "", ""),
    )
    for suffix, _, _, code, dtype in _TYPES
}


def fill_kernel(itemsize: int) -> Kernel:
    """The fill kernel for elements of ``itemsize`` bytes (1, 2, 4 or 8)."""
    try:
        return FILL_KERNELS[itemsize]
    except KeyError:
        raise ValueError(f"no fill kernel for {itemsize}-byte elements (1, 2, 4 or 8)") from None
