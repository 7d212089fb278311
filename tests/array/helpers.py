"""Strided DeviceArrays for the array tests: a view of another array's memory with any
strides, imported through ``__cuda_array_interface__`` as a user's CuPy or torch view is."""

from __future__ import annotations

import numpy as np

import cudalab

__all__ = ["strided"]


class _Interface:
    """An object exposing a strided window on ``base`` (kept alive) by the CUDA array interface."""

    def __init__(self, base: cudalab.DeviceArray, view: np.ndarray, offset: int):
        self.base = base
        self.__cuda_array_interface__ = {
            "shape": view.shape, "typestr": view.dtype.str, "version": 3,
            "data": (base.data_ptr() + offset, False), "strides": view.strides, "stream": None,
        }


def strided(host: np.ndarray) -> cudalab.DeviceArray:
    """A DeviceArray with ``host``'s shape, strides and values (``host`` may be a transposed,
    sliced or reversed numpy view): the whole base buffer goes to the device, then the view
    is rebuilt over it."""
    base = host.base if host.base is not None else host
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    buffer = np.frombuffer(base, np.uint8) if not isinstance(base, np.ndarray) \
        else base.reshape(-1).view(np.uint8)
    dev = cudalab.asarray(np.ascontiguousarray(buffer))
    offset = host.__array_interface__["data"][0] - buffer.__array_interface__["data"][0]
    out = cudalab.asarray(_Interface(dev, host, offset))
    assert not out.is_contiguous() or host.flags.c_contiguous
    return out
