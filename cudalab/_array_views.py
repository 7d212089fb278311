"""Views of :class:`cudalab.DeviceArray`: ``view(dtype)``, ``reshape``, indexing, ``narrow``.

A mixin that :class:`~cudalab.DeviceArray` inherits. A view shares the memory of the array
it was made from and keeps the owning array alive (its ``base``); nothing is copied.
``a[i]``, ``a[start:stop]`` (step 1) and ``a[...]`` index the first axis of a contiguous
array. ``narrow`` follows torch's
``Tensor.narrow``: a view (no copy) of ``length`` elements from ``start`` along ``dim``;
along the first dimension of a contiguous array the view is contiguous, along another it
is strided (the parent's strides), as torch's.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from cudalab import _array_state
from cudalab._array_state import ArrayT, require_contiguous
from cudalab._dtypes import normalize_dtype

__all__ = ["ViewsMixin"]


def _view(array: ArrayT, ptr: int, shape: tuple[int, ...], dtype: np.dtype) -> ArrayT:
    """A C-contiguous view of ``array``'s memory from ``ptr`` (``array``'s device, stream and
    read-only flag; its base, or itself, keeps the memory alive)."""
    base = array if array.owner is None else array.owner
    return _array_state.wrap(ptr, shape, dtype, None, array.device_index, array.stream, base,
                             array.read_only)


class ViewsMixin:
    """``view``, ``reshape``, ``[]`` and ``narrow`` for :class:`cudalab.DeviceArray`."""

    __slots__ = ()

    def view(self: ArrayT, *shape_or_dtype: Any) -> ArrayT:
        """The same memory with another shape or dtype, as torch's ``view``.

        ``view(dtype)``: seen as ``dtype`` (the last axis rescales, like numpy).
        ``view(*shape)`` / ``view(shape)`` (ints, one of them may be -1): :meth:`reshape`.
        """
        if len(shape_or_dtype) != 1 or isinstance(
                shape_or_dtype[0], (int, np.integer, tuple, list)):
            return self.reshape(*shape_or_dtype)
        dt = normalize_dtype(shape_or_dtype[0])
        if dt == self.element_dtype:
            return _view(self, self.ptr, self.dims, dt)
        require_contiguous(self, "DeviceArray.view(dtype)")
        old, new = self.element_dtype.itemsize, dt.itemsize
        if not self.dims:
            if old != new:
                raise ValueError(f"cannot view a 0-d {self.element_dtype} array as {dt}: the item "
                                 "sizes differ")
            return _view(self, self.ptr, (), dt)
        last = self.dims[-1] * old
        if last % new:
            raise ValueError(f"cannot view {self.element_dtype} as {dt}: the last axis is {last} bytes, "
                             f"not a multiple of {new}")
        return _view(self, self.ptr, self.dims[:-1] + (last // new,), dt)

    def reshape(self: ArrayT, *shape: Any) -> ArrayT:
        """A view with a new shape (one dimension may be -1); the array must be contiguous."""
        spec: Any = shape[0] if len(shape) == 1 else shape
        try:
            dims = [operator.index(spec)]
        except TypeError:
            try:
                dims = [operator.index(d) for d in spec]
            except TypeError:
                raise TypeError(f"reshape: shape must be ints, got {spec!r}") from None
        require_contiguous(self, "DeviceArray.reshape()")
        unknown = [i for i, d in enumerate(dims) if d == -1]
        if len(unknown) > 1:
            raise ValueError("reshape: only one dimension can be -1")
        if any(d < -1 for d in dims):
            raise ValueError(f"reshape: invalid dimension in {tuple(dims)}")
        if unknown:
            known = math.prod(d for d in dims if d != -1)
            if known == 0 or self.element_count % known:
                raise ValueError(f"cannot reshape array of size {self.element_count} into shape "
                                 f"{tuple(dims)}")
            dims[unknown[0]] = self.element_count // known
        new = tuple(dims)
        if math.prod(new) != self.element_count:
            raise ValueError(f"cannot reshape array of size {self.element_count} into shape {new}")
        return _view(self, self.ptr, new, self.element_dtype)

    def __getitem__(self: ArrayT, key: Any) -> ArrayT:
        """Basic indexing along the first axis: ``a[i]`` and ``a[start:stop]`` (step 1) are
        views; nothing is copied."""
        if isinstance(key, tuple):
            if len(key) != 1:
                raise IndexError("DeviceArray supports indexing along the first axis only "
                                 "(one integer or one slice)")
            key = key[0]
        if key is Ellipsis:
            return _view(self, self.ptr, self.dims, self.element_dtype)
        if not self.dims:
            raise IndexError("a 0-d DeviceArray cannot be indexed")
        require_contiguous(self, "DeviceArray indexing")
        n = self.dims[0]
        row = math.prod(self.dims[1:]) * self.element_dtype.itemsize
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                raise ValueError(f"DeviceArray slices must have step 1, got step {step}")
            length = max(0, stop - start)
            # torch: a view starts at its offset even when empty (base[5:] of 5 elements
            # has data_ptr() base + 5 * itemsize), so pointer arithmetic on views agrees
            ptr = self.ptr + start * row
            return _view(self, ptr, (length,) + self.dims[1:], self.element_dtype)
        if isinstance(key, (bool, np.bool_)):
            raise TypeError("boolean indices are not supported")
        try:
            i = operator.index(key)
        except TypeError:
            raise TypeError(f"DeviceArray indices must be integers or slices, got "
                            f"{type(key).__name__}") from None
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {operator.index(key)} is out of bounds for axis 0 with "
                             f"size {n}")
        return _view(self, self.ptr + i * row, self.dims[1:], self.element_dtype)

    def narrow(self: ArrayT, dim: int, start: int, length: int) -> ArrayT:
        """A view of ``length`` elements from ``start`` along ``dim`` (torch's ``narrow``).

        Parameters
        ----------
        dim
            The dimension, negative counting from the end.
        start
            The first index kept; negative counts from the end of ``dim``.
        length
            How many indices are kept (>= 0).

        Returns
        -------
        DeviceArray
            A view sharing this array's memory (strided unless ``dim`` is the first
            dimension of a contiguous array, or every other dimension has size 1).

        Raises
        ------
        IndexError
            ``dim`` out of range (torch's text).
        RuntimeError
            ``start``/``length`` outside the dimension (torch's text).
        """
        ndim = len(self.dims)
        if ndim == 0:
            raise RuntimeError("narrow() cannot be applied to a 0-dim tensor.")
        dim = operator.index(dim)
        if not -ndim <= dim < ndim:
            raise IndexError(f"Dimension out of range (expected to be in range of [{-ndim}, "
                             f"{ndim - 1}], but got {dim})")
        dim %= ndim
        size = self.dims[dim]
        start, length = operator.index(start), operator.index(length)
        if not -size <= start <= size:
            raise IndexError(f"start out of range (expected to be in range of [{-size}, "
                             f"{size}], but got {start})")
        if start < 0:
            start += size
        if length < 0:
            raise RuntimeError("narrow(): length must be non-negative.")
        if start > size - length:
            raise RuntimeError(f"start ({start}) + length ({length}) exceeds dimension size "
                               f"({size}).")
        shape = self.dims[:dim] + (length,) + self.dims[dim + 1:]
        base = self if self.owner is None else self.owner
        if dim == 0 and self.strides_or_none is None:  # a contiguous slice: no strides to compute
            # (the 1 KiB scatter and gather rows of benchmarks/comm.py)
            ptr = self.ptr + start * (self.byte_count // size) if length else self.ptr
            return _array_state.wrap(ptr, shape, self.element_dtype, None, self.device_index,
                                     self.stream, base, self.read_only)
        strides = self.strides
        ptr = self.ptr + start * strides[dim] if length else self.ptr
        return _array_state.wrap(ptr, shape, self.element_dtype, strides, self.device_index,
                                 self.stream, base, self.read_only)
