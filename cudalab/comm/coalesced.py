"""``torch.cuda.comm.broadcast_coalesced`` and ``reduce_add_coalesced``.

Many small arrays are packed into a few flat buffers (one per chunk), each buffer is
broadcast or summed once, and the results are views of the flat results. The chunks are
torch's, so the results (and the order of floating-point work) are too:

* :func:`broadcast_coalesced` chunks with C++ ``take_tensors`` (``tensor_flatten.cpp``): one
  group per dtype; an array joins its dtype's group, and a group whose bytes reach
  ``buffer_size`` is emitted at once; the groups left at the end are emitted in the order of
  torch's ``ScalarType`` numbers (uint8, int8, int16, int32, int64, float16, float32,
  float64, complex64, complex128, bool, bfloat16, uint16, uint32, uint64). When chunks of
  several dtypes were seen, each device's list is put back in input order.
* :func:`reduce_add_coalesced` chunks each device's list with Python ``_take_tensors``
  (``torch/_utils.py``): a dtype's buffer is emitted before an array that would take it
  over ``buffer_size`` (unless it is empty); the leftovers follow in order of first
  appearance; the results are put back in input order.

Flat buffers come from the caching allocator (a lone contiguous array is its own flat
buffer, viewed 1-d, as torch's ``flatten_dense_tensors`` does); copies into them and every
later step run on the current streams.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from cudalab import _internal, nvtx
from cudalab.array import DeviceArray
from cudalab.comm import _common
from cudalab.comm.collectives import (
    ROOTED_BUS_FACTOR,
    Operand,
    broadcast_to_devices,
    reduce_root,
    sum_to_device,
)

__all__ = ["broadcast_coalesced", "reduce_add_coalesced", "DEFAULT_BUFFER_SIZE"]

#: torch's default ``buffer_size`` (10 MiB).
DEFAULT_BUFFER_SIZE = 10485760

#: torch's ``ScalarType`` numbers (c10/core/ScalarType.h), which order the dtype groups
#: that ``take_tensors`` emits at the end.
SCALAR_TYPE_NUMBERS = {
    "uint8": 0, "int8": 1, "int16": 2, "int32": 3, "int64": 4, "float16": 5, "float32": 6,
    "float64": 7, "complex64": 9, "complex128": 10, "bool": 11, "bfloat16": 15,
    "uint16": 27, "uint32": 28, "uint64": 29,
}


def _scalar_type_number(dtype: np.dtype) -> int:
    return SCALAR_TYPE_NUMBERS[dtype.name]


# --------------------------------------------------------------------------- chunking
def take_tensors(arrays: Sequence[Any], size_limit: int) -> list[list[Any]]:
    """torch's C++ ``take_tensors(tensors, size_limit, fine_grained=false)``."""
    groups: dict[int, tuple[list[Any], list[int]]] = {}  # ScalarType -> (arrays, [bytes])
    chunks: list[list[Any]] = []
    for a in arrays:
        key = _scalar_type_number(a.dtype)
        group = groups.get(key)
        if group is None:
            group = groups[key] = ([], [0])
        group[0].append(a)
        group[1][0] += a.nbytes
        if group[1][0] >= size_limit:
            chunks.append(group[0])
            groups[key] = ([], [0])
    for key in sorted(groups):
        if groups[key][0]:
            chunks.append(groups[key][0])
    return chunks


def take_tensors_python(arrays: Sequence[Any], size_limit: int) -> Iterator[list[Any]]:
    """torch's Python ``_take_tensors(tensors, size_limit)`` (dense arrays)."""
    buffers: dict[Any, tuple[list[Any], int]] = {}  # dtype -> (arrays, bytes), first seen first
    for a in arrays:
        key = a.dtype
        items, size = buffers.get(key, ((), 0))
        if size + a.nbytes > size_limit and size > 0:
            yield list(items)
            items, size = (), 0
        buffers[key] = ([*items, a], size + a.nbytes)
    for items, _ in buffers.values():
        if items:
            yield list(items)


def reorder_like(arrays: Sequence[Any], order: Sequence[Any]) -> list[Any]:
    """torch's ``reorder_tensors_like`` / ``_reorder_tensors_as``: for each array of
    ``order``, the next one of ``arrays`` with its dtype."""
    by_dtype: dict[Any, list[Any]] = {}
    for a in arrays:
        by_dtype.setdefault(a.dtype, []).append(a)
    iterators = {dtype: iter(items) for dtype, items in by_dtype.items()}
    return [next(iterators[a.dtype]) for a in order]


def _buffer_size(size: Any) -> int:
    """``buffer_size`` as an int >= 0 (torch's is a C++ size_t): TypeError for a non-integer,
    ValueError for a negative one."""
    try:
        size = operator.index(size)
    except TypeError:
        raise TypeError(f"buffer_size must be an int (bytes), got "
                        f"{type(size).__name__}") from None
    if size < 0:
        raise ValueError(f"buffer_size must be >= 0 (bytes), got {size}")
    return size


# --------------------------------------------------------------------------- broadcast
def broadcast_coalesced(arrays: Iterable[DeviceArray], devices: Iterable[Any],
                        buffer_size: int = DEFAULT_BUFFER_SIZE) -> list[list[DeviceArray]]:
    """Broadcast many arrays of one device to several devices, packed into flat buffers
    (``torch.cuda.comm.broadcast_coalesced``).

    Parameters
    ----------
    arrays : iterable of DeviceArray
        All on ``devices[0]``.
    devices : iterable of int, str or Device
        The devices; the first is the arrays' own.
    buffer_size : int
        The most bytes packed into one flat buffer (see the module notes for the chunking).

    Returns
    -------
    list of lists of DeviceArray
        Per device, the arrays in input order: the inputs themselves for ``devices[0]``,
        views of new flat buffers (from the caching allocator) for the others.

    Raises
    ------
    RuntimeError
        An array is not on ``devices[0]`` (``All tensors must be on devices[0]: 0``), or a
        device index is negative.
    TypeError, ValueError
        ``buffer_size`` is not an int, or is negative.

    Notes
    -----
    Each chunk is one :func:`cudalab.comm.broadcast` of its flat buffer (NCCL where torch
    uses it). Reported to the collective observers once, as ``"comm.broadcast_coalesced"``
    with S = the bytes of all the arrays and bus factor 1.
    """
    buffer_size = _buffer_size(buffer_size)
    with nvtx.range("comm.broadcast_coalesced"):
        devices = _common.parse_devices(devices)
        arrays = list(arrays)
        if not devices:
            raise RuntimeError("Expected at least one device to broadcast to")
        root = devices[0]
        if not all(_common.device_of(a) == root for a in arrays):
            raise RuntimeError(f"All tensors must be on devices[0]: {root}")
        outputs: list[list[DeviceArray]] = [list(arrays)] + [[] for _ in devices[1:]]
        dtypes_seen = set()
        for chunk in take_tensors(arrays, buffer_size):
            dtypes_seen.add(chunk[0].dtype)
            results = broadcast_to_devices(_common.flat_buffer(chunk), devices)
            for i in range(1, len(devices)):
                outputs[i].extend(_common.unflatten(results[i], chunk))
        if len(dtypes_seen) > 1:
            outputs = [reorder_like(o, arrays) for o in outputs]
        ranks = _common.distinct(devices)
        _internal.notify_collective("comm.broadcast_coalesced", _common.total_bytes(arrays),
                                    len(ranks), ROOTED_BUS_FACTOR, ranks)
    return outputs


# --------------------------------------------------------------------------- reduce
def reduce_add_coalesced(inputs: Iterable[Iterable[DeviceArray]], destination: Any = None,
                         buffer_size: int = DEFAULT_BUFFER_SIZE) -> tuple[DeviceArray, ...]:
    """Sum lists of arrays from several devices, packed into flat buffers
    (``torch.cuda.comm.reduce_add_coalesced``).

    Parameters
    ----------
    inputs : iterable of iterables of DeviceArray
        One list per device, of the same length, shapes and dtypes position by position.
    destination : int, str or Device, optional
        Where the sums go (default: the current device); one list must be on it.
    buffer_size : int
        The most bytes packed into one flat buffer (see the module notes for the chunking).

    Returns
    -------
    tuple of DeviceArray
        The sums in input order: views of new flat buffers on ``destination``.

    Raises
    ------
    AssertionError, ValueError, RuntimeError
        As :func:`cudalab.comm.reduce_add` for each chunk's flat buffers, all checked before
        anything is queued; RuntimeError when one device's list mixes devices.

    Notes
    -----
    Each chunk is one :func:`cudalab.comm.reduce_add` of the devices' flat buffers (NCCL
    where torch uses it). Reported to the collective observers once, as
    ``"comm.reduce_add_coalesced"`` with S = the bytes of one device's list and bus factor 1.
    """
    buffer_size = _buffer_size(buffer_size)
    with nvtx.range("comm.reduce_add_coalesced"):
        lists = [list(per_device) for per_device in inputs]
        dest = _internal.device_index(destination)
        columns = list(zip(*lists))
        dense: list[list[Any]] = [[] for _ in lists]  # per device, the arrays zip keeps
        for column in columns:
            for per_device, a in zip(dense, column):
                per_device.append(a)
        order = dense[0] if dense else []
        chunk_rows = list(zip(*[take_tensors_python(per_device, buffer_size)
                                for per_device in dense]))
        for chunks in chunk_rows:  # every check before the first copy
            reduce_root([_flat_operand(chunk) for chunk in chunks], dest)
        outputs: list[DeviceArray] = []
        for chunks in chunk_rows:
            flats = [_common.flat_buffer(chunk) for chunk in chunks]
            outputs.extend(_common.unflatten(sum_to_device(flats, dest), chunks[0]))
        result = tuple(reorder_like(outputs, order))
        ranks = _common.distinct(_common.device_of(per_device[0])
                                 for per_device in dense if per_device)
        _internal.notify_collective("comm.reduce_add_coalesced", _common.total_bytes(order),
                                    len(ranks), ROOTED_BUS_FACTOR, ranks)
    return result


def _flat_operand(chunk: Sequence[Any]) -> Operand:
    """The :class:`Operand` a chunk's flat buffer will be (checked before it exists)."""
    devices = {_common.device_of(a) for a in chunk}
    if _common.HOST in devices:
        return Operand(_common.HOST, (0,))
    if len(devices) > 1:
        first, second = (f"cuda:{d}" for d in sorted(devices)[:2])
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at "
                           f"least two devices, {first} and {second}!")
    return Operand(devices.pop(), (sum(a.size for a in chunk),))
