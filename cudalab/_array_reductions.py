"""Reductions of :class:`cudalab.DeviceArray`: ``sum``, ``mean``, ``max``, ``min``, ``amax``, ``amin``.

A mixin that :class:`~cudalab.DeviceArray` inherits; the kernels are
:mod:`cudalab._kernels.reduce` (each with its numpy twin, so all of this runs on the
simulator). torch's semantics:

* result dtypes: ``sum`` of bool or integers is int64, of floating and complex types the
  same dtype (float16 and bfloat16 accumulate in float32); ``mean`` takes floating and
  complex types only; ``max``/``min``/``amax``/``amin`` keep the dtype and refuse complex;
* NaN propagates through every reduction (``max`` of ``[1, nan]`` is nan, and its index is
  the first NaN's); ties keep the first index;
* an empty ``sum`` is 0 and an empty ``mean`` nan; ``max``/``min`` of an empty array, or
  over an empty dimension, raise (torch's messages);
* the results are new arrays from the caching allocator on the current stream (0-d for a
  full reduction); the work is queued there, the host does not wait.

Inputs may be strided (DLPack or CUDA-array-interface imports, transposes): the kernels
read them in place.
"""

from __future__ import annotations

import operator
from collections import namedtuple
from typing import Any

import numpy as np

from cudalab import _array_state
from cudalab._array_memory import stream_of
from cudalab._array_state import ArrayState, ArrayT

__all__ = ["ReductionsMixin", "torch_dtype_name"]

#: ``max(dim)``/``min(dim)`` results, as torch's ``torch.return_types.max`` / ``min``.
MaxResult = namedtuple("MaxResult", ["values", "indices"])
MinResult = namedtuple("MinResult", ["values", "indices"])

_INT64 = np.dtype(np.int64)

_TORCH_NAMES = {
    "bool": "Bool", "uint8": "Byte", "int8": "Char", "int16": "Short", "int32": "Int",
    "int64": "Long", "float16": "Half", "bfloat16": "BFloat16", "float32": "Float",
    "float64": "Double", "complex64": "ComplexFloat", "complex128": "ComplexDouble",
    "uint16": "UInt16", "uint32": "UInt32", "uint64": "UInt64",
}


def torch_dtype_name(dtype: np.dtype) -> str:
    """torch's ScalarType name of ``dtype`` (``Long`` for int64), as its messages print it."""
    return _TORCH_NAMES.get(dtype.name, dtype.name)


def _reduce_module() -> Any:
    from cudalab._kernels import reduce

    return reduce


def _dims_arg(what: str, dim: Any, axis: Any, ndim: int, many: bool) -> tuple[int, ...] | None:
    """The reduced axes (sorted, non-negative), or None for all of them."""
    if axis is not None:
        if dim is not None:
            raise TypeError(f"{what}() got both dim= and axis= (axis is an alias of dim)")
        dim = axis
    if dim is None:
        return None
    items = dim if isinstance(dim, (tuple, list)) else (dim,)
    if not many and len(items) != 1:
        raise TypeError(f"{what}(): dim must be one int, got {dim!r}")
    bound = max(ndim, 1)
    seen: list[int] = []
    for d in items:
        if isinstance(d, (bool, np.bool_)):
            raise TypeError(f"{what}(): dim must be an int or a tuple of ints, got {dim!r}")
        try:
            d = operator.index(d)
        except TypeError:
            raise TypeError(f"{what}(): dim must be an int or a tuple of ints, got {dim!r}"
                            ) from None
        if not -bound <= d < bound:
            raise IndexError(f"Dimension out of range (expected to be in range of "
                             f"[{-bound}, {bound - 1}], but got {d})")
        d %= bound
        if d in seen:
            raise RuntimeError(f"dim {d} appears multiple times in the list of dims")
        seen.append(d)
    if ndim == 0:
        return ()
    return tuple(sorted(seen))


class ReductionsMixin:
    """``sum``, ``mean``, ``max``, ``min``, ``amax`` and ``amin`` of a DeviceArray."""

    __slots__ = ()

    # ------------------------------------------------------------------ public
    def sum(self: ArrayT, dim: Any = None, keepdim: bool = False, *,
            axis: Any = None) -> ArrayT:
        """Sum over all elements, or over ``dim`` (an int or a tuple of ints), as torch.

        Parameters
        ----------
        dim, axis
            The dimensions to reduce (``axis`` is numpy's name); None: all.
        keepdim
            Keep the reduced dimensions with size 1.

        Returns
        -------
        DeviceArray
            int64 for bool and integer inputs, else the input's dtype (0-d when every
            dimension is reduced). An empty sum is 0.

        Raises
        ------
        TypeError
            ``dim`` is not an int or a tuple of ints.
        IndexError
            A dimension is out of range.
        RuntimeError
            A dimension is given twice.
        """
        return _reduction(self, "sum", _dims_arg("sum", dim, axis, self.ndim, True), keepdim)

    def mean(self: ArrayT, dim: Any = None, keepdim: bool = False, *,
             axis: Any = None) -> ArrayT:
        """Arithmetic mean over all elements, or over ``dim``, as torch.

        Parameters
        ----------
        dim, axis
            The dimensions to reduce (an int or a tuple of ints); None: all.
        keepdim
            Keep the reduced dimensions with size 1.

        Returns
        -------
        DeviceArray
            The input's dtype; nan for an empty reduction.

        Raises
        ------
        RuntimeError
            The dtype is not floating or complex (torch's "could not infer output dtype").
        TypeError, IndexError
            A bad ``dim``, as for :meth:`sum`.
        """
        if self.element_dtype.kind not in "fc" and self.element_dtype.name != "bfloat16":
            raise RuntimeError("mean(): could not infer output dtype. Input dtype must be "
                               "either a floating point or complex dtype. Got: "
                               f"{torch_dtype_name(self.element_dtype)}")
        return _reduction(self, "mean", _dims_arg("mean", dim, axis, self.ndim, True), keepdim)

    def max(self: ArrayState, dim: Any = None, keepdim: bool = False, *,
            axis: Any = None) -> Any:
        """The largest element, or the largest along ``dim`` with its indices, as torch.

        Parameters
        ----------
        dim, axis
            One dimension; None: over all elements.
        keepdim
            Keep the reduced dimension with size 1.

        Returns
        -------
        DeviceArray or MaxResult
            Without ``dim``: a 0-d array. With ``dim``: ``(values, indices)`` (a named tuple,
            indices int64): the first maximal element's index, the first NaN's if any.

        Raises
        ------
        RuntimeError
            A complex array, or an empty one without ``dim``.
        IndexError
            ``dim`` is out of range or has size 0.
        """
        return _extreme(self, "max", dim, axis, keepdim)

    def min(self: ArrayState, dim: Any = None, keepdim: bool = False, *,
            axis: Any = None) -> Any:
        """The smallest element, or the smallest along ``dim`` with its indices, as torch.

        Same parameters, results and errors as :meth:`max` (``MinResult`` with ``dim``).
        """
        return _extreme(self, "min", dim, axis, keepdim)

    def amax(self: ArrayT, dim: Any = (), keepdim: bool = False) -> ArrayT:
        """The maximum over ``dim`` (an int or a tuple; ``()`` means all), no indices.

        Raises RuntimeError for complex inputs and IndexError when a reduced dimension is
        empty, as torch.
        """
        return _amax_amin(self, "amax", dim, keepdim)

    def amin(self: ArrayT, dim: Any = (), keepdim: bool = False) -> ArrayT:
        """The minimum over ``dim`` (an int or a tuple; ``()`` means all), no indices."""
        return _amax_amin(self, "amin", dim, keepdim)



# --------------------------------------------------------------------------- checks
def _keepdim(what: str, keepdim: Any) -> bool:
    """``keepdim`` as a bool: a Python or numpy bool, else TypeError (torch's argument
    parser takes nothing else)."""
    if keepdim is True or keepdim is False:
        return keepdim
    if isinstance(keepdim, np.bool_):
        return bool(keepdim)
    raise TypeError(f"{what}(): argument 'keepdim' must be bool, not {type(keepdim).__name__}")


def _extreme(array: ArrayState, what: str, dim: Any, axis: Any, keepdim: bool) -> Any:
    keepdim = _keepdim(what, keepdim)
    if array.dtype.kind == "c":
        raise RuntimeError(f"{what}(): does not support complex input")
    dims = _dims_arg(what, dim, axis, array.ndim, False)
    if dims is None:
        if array.element_count == 0:
            raise RuntimeError(
                f"{what}(): Expected reduction dim to be specified for input.numel() == 0. "
                "Specify the reduction dim with the 'dim' argument.")
        return _reduction(array, what, None, False)
    _check_nonempty_dims(array, what, dims)
    values, indices = _reduction(array, what, dims, keepdim, with_indices=True)
    return (MaxResult if what == "max" else MinResult)(values, indices)


def _amax_amin(array: ArrayState, what: str, dim: Any, keepdim: bool) -> Any:
    if array.dtype.kind == "c":
        raise RuntimeError(f"{what}(): does not support complex input")
    dims = _dims_arg(what, None if dim == () else dim, None, array.ndim, True)
    if dims is None:
        dims = tuple(range(array.ndim))
    _check_nonempty_dims(array, what, dims)
    return _reduction(array, what[1:], dims, keepdim)


def _check_nonempty_dims(array: ArrayState, what: str, dims: tuple[int, ...]) -> None:
    for d in dims:
        if array.ndim and array.shape[d] == 0:
            raise IndexError(f"{what}(): Expected reduction dim {d} to have non-zero size.")


# --------------------------------------------------------------------------- the work
def _reduction(array: ArrayState, op: str, dims: tuple[int, ...] | None, keepdim: bool,
               with_indices: bool = False) -> Any:
    """Reduce ``dims`` (None: all) of ``array`` with ``op`` ("sum", "mean",
    "max", "min")."""
    keepdim = _keepdim(op, keepdim)
    rk = _reduce_module()
    ndim = array.ndim
    axes = tuple(range(ndim)) if dims is None else dims
    dtype = array.element_dtype
    shape = list(array.dims)
    itemsize = dtype.itemsize
    strides = list(array.strides)
    complex_input = dtype.kind == "c"
    real = np.dtype(f"float{itemsize * 4}") if complex_input else dtype
    if complex_input:  # reduce the (re, im) pairs as a trailing axis of size 2, kept
        shape.append(2)
        strides.append(real.itemsize)
    if any(s % real.itemsize for s in strides):
        raise ValueError(f"{op}(): strides {array.strides} are not multiples of the item "
                         f"size {itemsize}")
    elems = [s // real.itemsize for s in strides]
    out_dims = [(shape[i], elems[i]) for i in range(len(shape)) if i not in axes]
    red_dims = [(shape[i], elems[i]) for i in axes]
    n_out = 1
    for size, _ in out_dims:
        n_out *= size
    n_red = 1
    for size, _ in red_dims:
        n_red *= size
    out_dims, red_dims = rk.coalesce(out_dims), rk.coalesce(red_dims)
    if len(out_dims) > rk.MAX_DIMS or len(red_dims) > rk.MAX_DIMS:
        raise ValueError(f"{op}(): this strided layout (shape {array.shape}, strides "
                         f"{array.strides}) needs more than {rk.MAX_DIMS} dimensions "
                         "after merging; reduce a contiguous copy instead")
    code = rk.dtype_code(real)
    acc, out_code = rk.acc_code(op, code), rk.out_code(op, code)
    result_shape = tuple(1 if i in axes else array.shape[i] for i in range(ndim)) if keepdim \
        else tuple(array.shape[i] for i in range(ndim) if i not in axes)
    out_dtype = np.dtype(np.int64) if out_code == "i64" else dtype
    device = array.device_index
    stream = stream_of(device)
    output = _array_state.output
    result = output(result_shape, out_dtype, device, stream)
    indices = output(result_shape, _INT64, device, stream) if with_indices else None
    if n_out == 0:
        return (result, indices) if with_indices else result
    factor = 1.0 / n_red if n_red else float("inf")
    out_ptr = result.data_ptr()
    idx_ptr = 0 if indices is None else indices.data_ptr()
    adjacent = bool(out_dims) and out_dims[-1][1] == 1
    splits = rk.split_count(n_out, n_red, adjacent)
    if with_indices and splits > 1:  # indices come from a single pass
        splits = 1
    if splits <= 1:
        _launch(rk, (op, code, acc, out_code), array.data_ptr(), 0, out_ptr, idx_ptr,
                n_out, n_red, splits, factor, out_dims, red_dims, stream)
    else:
        first = "sum" if op == "mean" else op
        partial = output((n_out * splits,), rk.np_dtype(acc), device, stream)
        _launch(rk, (first, code, acc, acc), array.data_ptr(), 0, partial.data_ptr(), 0,
                n_out, n_red, splits, 1.0, out_dims, red_dims, stream)
        _launch(rk, (op, acc, acc, out_code), partial.data_ptr(), 0, out_ptr, 0, n_out,
                splits, 1, factor, [(n_out, splits)], [(splits, 1)], stream)
        del partial  # back to the allocator, ordered after the second pass on `stream`
    if with_indices:
        return result, indices
    return result


def _launch(rk: Any, key: tuple[str, str, str, str], in_ptr: int, in_idx: int, out_ptr: int,
            out_idx: int, n_out: int, n_red: int, splits: int, factor: float,
            out_dims: list[tuple[int, int]], red_dims: list[tuple[int, int]],
            stream: Any) -> None:
    def packed(dims: list[tuple[int, int]]) -> list[int]:
        pad = rk.MAX_DIMS - len(dims)
        return ([s for s, _ in dims] + [1] * pad) + ([t for _, t in dims] + [0] * pad)

    blocks = n_out * splits if splits else -(-n_out // rk.BLOCK)
    grid = min(blocks, 65536)
    args = [in_ptr, in_idx, out_ptr, out_idx, n_out, n_red, splits, factor,
            len(out_dims), *packed(out_dims), len(red_dims), *packed(red_dims)]
    rk.reduce_kernel(*key).launch(grid, rk.BLOCK, args, stream=stream)
