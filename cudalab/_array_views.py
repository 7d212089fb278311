"""Views of :class:`cudalab.DeviceArray` beyond first-axis indexing: ``narrow``.

A mixin that :class:`~cudalab.DeviceArray` inherits. ``narrow`` follows torch's
``Tensor.narrow``: a view (no copy) of ``length`` elements from ``start`` along ``dim``;
along the first dimension of a contiguous array the view is contiguous, along another it
is strided (the parent's strides), as torch's.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any as _ArrayBase  # the type checker sees the DeviceArray attributes

    from cudalab.array import DeviceArray
else:
    _ArrayBase = object

__all__ = ["ViewsMixin"]


class ViewsMixin(_ArrayBase):
    """``narrow`` for :class:`cudalab.DeviceArray`."""

    __slots__ = ()

    def narrow(self, dim: int, start: int, length: int) -> DeviceArray:
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
        ndim = len(self._shape)
        if ndim == 0:
            raise RuntimeError("narrow() cannot be applied to a 0-dim tensor.")
        dim = operator.index(dim)
        if not -ndim <= dim < ndim:
            raise IndexError(f"Dimension out of range (expected to be in range of [{-ndim}, "
                             f"{ndim - 1}], but got {dim})")
        dim %= ndim
        size = self._shape[dim]
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
        shape = self._shape[:dim] + (length,) + self._shape[dim + 1:]
        base = self if self._base is None else self._base
        if dim == 0 and self._strides is None:  # a contiguous slice: no strides to compute
            # (the 1 KiB scatter and gather rows of benchmarks/comm.py)
            ptr = self._ptr + start * (self._nbytes // size) if length else self._ptr
            return self._wrap(ptr, shape, self._dtype, None, self._device, self._stream, base,
                              self._read_only)
        strides = self.strides
        ptr = self._ptr + start * strides[dim] if length else self._ptr
        return self._wrap(ptr, shape, self._dtype, strides, self._device, self._stream,
                          base, self._read_only)
