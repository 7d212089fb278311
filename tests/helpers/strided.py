"""Non-contiguous and offset DeviceArrays for tests, with their numpy twins.

:func:`strided` imports a view of a device array through ``__cuda_array_interface__`` (the
way a CuPy or torch view arrives) and returns it with the same view of the host copy.
"""

from __future__ import annotations

import numpy as np

import cudalab


class CudaArrayInterface:
    """A foreign object exposing only ``__cuda_array_interface__``."""

    def __init__(self, **cai):
        self.__cuda_array_interface__ = cai


def strided(host: np.ndarray, shape, strides, offset: int = 0):
    """(DeviceArray view, numpy view): ``host`` uploaded, then viewed with byte ``strides``
    starting ``offset`` elements in. Returns the device array that owns the memory too."""
    host = np.ascontiguousarray(host)
    base = cudalab.asarray(host)
    ptr = base.ptr + offset * host.itemsize
    cai = {"shape": tuple(shape), "typestr": host.dtype.str, "data": (ptr, False),
           "version": 3, "strides": tuple(strides), "stream": None}
    view = cudalab.asarray(CudaArrayInterface(**cai))
    twin = np.lib.stride_tricks.as_strided(host.reshape(-1)[offset:], shape, strides)
    return view, twin, base
