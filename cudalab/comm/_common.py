"""What :mod:`cudalab.comm`'s single-process collectives share: argument parsing in torch's
words, the NCCL switch, copies between any two arrays, and views.

* :func:`nccl_for` answers torch's question "use NCCL for these arrays?": ``cudalab.nccl``
  is imported on first use (it may be absent, or a stub without ``is_available``: then the
  copy path runs), and asked ``is_available(arrays)`` (every array on the device,
  contiguous, on pairwise distinct devices).
* :func:`copy_into` is ``dst.copy_(src, non_blocking=True)`` for every pair the
  collectives meet: a host (numpy) or device source, a contiguous or strided destination
  (a slice of a gather's result along a dimension other than 0). Work goes to the current
  streams (the destination's; a copy between devices runs on the source device's, ordered
  both ways with the destination's, see :meth:`cudalab.DeviceArray.copy_`). The plain cases
  of scatter, gather and broadcast copy runs of bytes with
  :func:`cudalab._array_memory.device_copy`, the same copy without building views.
* Peer access is enabled lazily by the copies themselves (``DeviceArray.copy_``, through
  ``cudalab._internal.enable_peer_access``), as torch's ``get_p2p_access`` does.
* Messages quote shapes as torch prints ``IntArrayRef`` (``[2, 3]``) and devices as torch
  prints them (``cuda:1``, ``cpu``).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from cudalab import _internal
from cudalab import streams as _streams
from cudalab._array_operators import converting_copy
from cudalab.array import DeviceArray, asarray, empty, output_array

__all__ = [
    "HOST",
    "copy_into",
    "describe_device",
    "device_of",
    "distinct",
    "empty_on",
    "flat_buffer",
    "is_device_array",
    "narrow",
    "nccl_for",
    "new_like",
    "nccl_module",
    "parse_devices",
    "shape_text",
    "same_dtype",
    "total_bytes",
    "unflatten",
    "wrap_dim",
]

#: The device index torch uses for the host (``_get_device_index("cpu", allow_cpu=True)``).
HOST = -1



# --------------------------------------------------------------------------- NCCL
_NOT_LOOKED_UP = object()
_nccl_module: Any = _NOT_LOOKED_UP  # nccl_module()'s answer, once it has one


def nccl_module() -> Any:
    """:mod:`cudalab.nccl` when it offers ``is_available`` (torch.cuda.nccl's API), else None.
    (Looked up once: every small collective asks, the 1 KiB rows of benchmarks/comm.py.)"""
    global _nccl_module
    found = _nccl_module
    if found is _NOT_LOOKED_UP:
        try:
            from cudalab import nccl
        except ImportError:
            found = None
        else:
            found = nccl if callable(getattr(nccl, "is_available", None)) else None
        _nccl_module = found
    return found


def nccl_for(arrays: Sequence[Any], checked: bool = False) -> Any:
    """The NCCL module when torch would use NCCL for ``arrays`` (``nccl.is_available``),
    else None (then the caller copies). Host arrays never go to NCCL (``checked``: the
    caller knows every array is a DeviceArray)."""
    if not checked:
        for a in arrays:
            if not isinstance(a, DeviceArray):
                return None
    nccl = nccl_module()
    if nccl is None or not nccl.is_available(arrays):
        return None
    return nccl


# --------------------------------------------------------------------------- arguments
def is_device_array(value: Any) -> bool:
    """Whether ``value`` is a :class:`cudalab.DeviceArray` (torch: ``tensor.is_cuda``)."""
    return isinstance(value, DeviceArray)


def device_of(value: Any) -> int:
    """The device index of a DeviceArray, :data:`HOST` for anything else (torch's
    ``get_device()`` of a CPU tensor)."""
    return value.device_index if isinstance(value, DeviceArray) else HOST


def describe_device(value: Any) -> str:
    """The device as torch prints it: ``cuda:N`` or ``cpu``."""
    return f"cuda:{value.device_index}" if isinstance(value, DeviceArray) else "cpu"


def shape_text(shape: Iterable[int]) -> str:
    """A shape as torch prints ``tensor.sizes()``: ``[2, 3]``."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


def parse_devices(devices: Iterable[Any]) -> list[int]:
    """Device indices from ints, ``"cuda:N"`` or Devices (torch's ``_get_device_index``
    per item, then its C++ check on negative indices).

    Raises
    ------
    RuntimeError
        A negative int (``Expected non-negative device index, but got -1``).
    ValueError, TypeError
        An index out of range, or something that is not a device.
    """
    result = []
    for device in devices:
        if type(device) is int and device < 0:
            raise RuntimeError(f"Expected non-negative device index, but got {device}")
        result.append(_internal.device_index(device))
    return result


def wrap_dim(dim: Any, ndim: int) -> int:
    """torch's ``maybe_wrap_dim``: a dimension in ``[-ndim, ndim - 1]`` as a non-negative
    index (a 0-d array counts as 1-d).

    Raises
    ------
    IndexError
        ``Dimension out of range (expected to be in range of [-2, 1], but got 2)``.
    """
    dim = operator.index(dim)
    rank = max(ndim, 1)
    if not -rank <= dim < rank:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-rank}, "
                         f"{rank - 1}], but got {dim})")
    return dim + rank if dim < 0 else dim


def distinct(devices: Iterable[int]) -> tuple[int, ...]:
    """The devices in order of first appearance, each once, the host left out."""
    seen: dict[int, None] = {}
    for d in devices:
        if d != HOST:
            seen.setdefault(d, None)
    return tuple(seen)


def same_dtype(arrays: Sequence[Any]) -> bool:
    """Whether the arrays all have the first one's dtype (what NCCL needs of a collective)."""
    dtype = arrays[0].dtype
    for a in arrays:
        if a.dtype != dtype:
            return False
    return True


def total_bytes(arrays: Iterable[Any]) -> int:
    """The bytes of the arrays' elements together."""
    return sum(a.nbytes for a in arrays)


# --------------------------------------------------------------------------- views and copies
def narrow(array: Any, dim: int, start: int, length: int) -> Any:
    """``array.narrow(dim, start, length)``: a view (numpy for a host array).

    Along dimension 0 of a contiguous DeviceArray the view is contiguous (a slice); along
    another dimension it is strided, as torch's.
    """
    if not isinstance(array, DeviceArray):
        index = [slice(None)] * array.ndim
        index[dim] = slice(start, start + length)
        return array[tuple(index)]
    return array.narrow(dim, start, length)


def copy_into(dst: DeviceArray, src: Any) -> DeviceArray:
    """``dst.copy_(src, non_blocking=True)`` for a host or device ``src`` and a contiguous
    or strided ``dst`` (dtypes converted as torch's ``copy_``). Returns ``dst``.

    Runs on the current stream of ``dst``'s device; a source on another device is copied
    peer to peer (``copy_`` enables peer access, once per pair) and, for a strided ``dst``,
    converted there by an elementwise kernel.
    """
    if not isinstance(src, DeviceArray):
        src = np.ascontiguousarray(src)  # (copy_ takes C-contiguous host arrays only)
        if not dst.is_contiguous():
            src = asarray(src, device=dst.device_index)
    if dst.is_contiguous():
        return dst.copy_(src, non_blocking=True)
    if src.device_index != dst.device_index:
        src = src.to(dst.device_index, non_blocking=True)
    return converting_copy(dst, src)


def empty_on(shape: tuple[int, ...], dtype: np.dtype, device: int) -> DeviceArray:
    """``empty(shape, dtype=dtype, device=device)`` on the device's current stream, for
    arguments known to be valid (a tuple of ints, a supported dtype, a device index): not
    re-checked (the 1 KiB rows of benchmarks/comm.py)."""
    return output_array(shape, dtype, device, _streams.current_stream(device))


def new_like(array: Any, device: int) -> DeviceArray:
    """A new C-contiguous array of ``array``'s shape and dtype on ``device`` (a valid index):
    :func:`empty_on` for a DeviceArray; a host array's dtype is checked by ``empty``."""
    if isinstance(array, DeviceArray):
        return empty_on(array.dims, array.element_dtype, device)
    return empty(tuple(array.shape), dtype=array.dtype, device=device)


def flat_buffer(arrays: Sequence[DeviceArray]) -> DeviceArray:
    """torch's ``flatten_dense_tensors``: the arrays' elements one after another in one
    1-d array on their device (the one array's own memory, viewed 1-d, when it is alone
    and contiguous; otherwise a new array from the allocator and one device copy per
    array, on the current stream)."""
    if len(arrays) == 1:
        only = arrays[0]
        if not only.is_contiguous():
            only = only.astype(only.dtype)
        return only.reshape(-1)
    first = arrays[0]
    flat = empty(sum(a.element_count for a in arrays), dtype=first.element_dtype, device=first.device_index)
    offset = 0
    for a in arrays:
        n = a.element_count
        if n:
            flat[offset:offset + n].reshape(a.shape).copy_(a)
        offset += n
    return flat


def unflatten(flat: DeviceArray, like: Sequence[Any]) -> list[DeviceArray]:
    """torch's ``unflatten_dense_tensors``: views of ``flat`` with the shapes of ``like``."""
    views = []
    offset = 0
    for a in like:
        n = a.size
        views.append(flat[offset:offset + n].reshape(a.shape))
        offset += n
    return views
