"""``torch.cuda.comm.scatter`` and ``gather``: always copies (torch never uses NCCL here).

scatter cuts an array along ``dim`` (``chunk`` or ``split_with_sizes``, torch's rules: ``chunk``
may give fewer pieces than devices) and copies each piece to its device; a piece meant for
the source's own device is returned as a view of the source. gather concatenates arrays of
several devices along ``dim`` into a new array on one device (or on the host: numpy).
Results come from the caching allocator; copies run on the current streams (scatter's
``streams`` make a stream current for its piece, as torch's stream guard does).
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from cudalab import _internal, nvtx
from cudalab import streams as _streams
from cudalab._array_memory import device_copies, device_copy
from cudalab.array import DeviceArray
from cudalab.comm import _common

__all__ = ["scatter", "gather"]

_HOST_NAME = "cpu"
_DEPRECATED_HOST_INDEX = ('Using -1 to represent CPU tensor is deprecated. Please use a '
                          'device object or string instead, e.g., "cpu".')


def _half_factor(nranks: int) -> float:
    """nccl-tests' bus factor of scatter and gather: (n - 1) / n."""
    return (nranks - 1) / nranks if nranks else 0.0


# --------------------------------------------------------------------------- splitting
def chunk_sizes_of(size: int, chunks: int) -> list[int]:
    """The sizes torch's ``tensor.chunk(chunks, dim)`` gives a dimension of ``size``
    (``ceil(size / chunks)`` each, the last smaller; possibly fewer than ``chunks``)."""
    split = -(-size // chunks)
    if split == 0 and size == 0:
        return [0] * chunks
    count = max(-(-size // split), 1)
    return [split] * (count - 1) + [size - split * (count - 1)]


def split_with_sizes(array: Any, sizes: Sequence[int], dim: int) -> list[Any]:
    """torch's ``split_with_sizes`` (views, with its checks and messages)."""
    if array.ndim == 0:
        raise RuntimeError("split expects at least a 1-dimensional tensor")
    if min(sizes, default=0) < 0:
        raise RuntimeError(f"split_with_sizes expects split_sizes have only non-negative "
                           f"entries, but got split_sizes={_common.shape_text(sizes)}")
    if sum(sizes) != array.shape[dim]:
        raise RuntimeError(f"split_with_sizes expects split_sizes to sum exactly to "
                           f"{array.shape[dim]} (input tensor's size at dimension {dim}), but "
                           f"got split_sizes={_common.shape_text(sizes)}")
    pieces = []
    start = 0
    for s in sizes:
        pieces.append(_common.narrow(array, dim, start, s))
        start += s
    return pieces


def _stream_for(streams: Sequence[Any] | None, index: int, device: int) -> Any:
    """``streams[index]`` (None when absent), checked against ``device`` as torch does."""
    if streams is None or index >= len(streams) or streams[index] is None:
        return None
    stream = streams[index]
    if not isinstance(stream, _streams.Stream):
        raise TypeError(f"scatter(): streams[{index}] must be a cudalab.Stream or None, got "
                        f"{type(stream).__name__}")
    if stream.device_index != device:
        raise RuntimeError(f"Expected the device associated with the stream at index {index} "
                           f"(was {stream.device_index}) to match the device supplied at that "
                           f"index (expected {device})")
    return stream


# --------------------------------------------------------------------------- scatter
def scatter(array: Any, devices: Iterable[Any] | None = None,
            chunk_sizes: Iterable[int] | None = None, dim: int = 0,
            streams: Sequence[Any] | None = None, *,
            out: Sequence[Any] | None = None) -> tuple[Any, ...]:
    """Cut ``array`` along ``dim`` and copy the pieces to devices
    (``torch.cuda.comm.scatter``).

    Parameters
    ----------
    array : DeviceArray or numpy.ndarray
        The source, on a device or on the host.
    devices : iterable of int, str or Device
        One device per piece (without ``out``).
    chunk_sizes : iterable of int, optional
        The pieces' sizes along ``dim`` (one per device, summing to ``array.shape[dim]``);
        default: ``chunk`` into ``len(devices)`` equal pieces (the last smaller, maybe fewer
        pieces than devices).
    dim : int
        The dimension to cut (negative counts from the end).
    streams : sequence of Stream or None, optional
        Per piece, a stream on its device to copy on (made current for that copy).
    out : sequence of DeviceArray, optional, keyword-only
        Existing arrays to copy the pieces into (their sizes along ``dim`` give the pieces);
        excludes ``devices`` and ``chunk_sizes``.

    Returns
    -------
    tuple of DeviceArray
        Per piece: a view of ``array`` when it is on that device already, else a new array
        from the caching allocator on the device; or the ``out`` arrays themselves.

    Raises
    ------
    RuntimeError
        torch's checks: no device or output, ``devices``/``chunk_sizes`` with ``out``,
        lengths or sizes that do not match, an output on the host or of the wrong shape, a
        stream on another device than its piece.
    IndexError
        ``dim`` out of range.

    Notes
    -----
    Reported to the collective observers as ``"comm.scatter"`` with S = ``array.nbytes``
    and bus factor (n - 1) / n, n = the devices taking part (the source's and the targets).
    """
    if not isinstance(array, (DeviceArray, np.ndarray)):
        raise TypeError(f"scatter(): the source must be a cudalab.DeviceArray or a numpy "
                        f"array, not {type(array).__name__}")
    with nvtx.range("comm.scatter"):
        if out is None:
            results = _scatter_to_devices(array, _common.parse_devices(devices),  # type: ignore[arg-type]
                                          chunk_sizes, dim, streams)
        else:
            if devices is not None:
                raise RuntimeError(f"'devices' must not be specified when 'out' is specified, "
                                   f"but got devices={devices}")
            if chunk_sizes is not None:
                raise RuntimeError(f"'chunk_sizes' must not be specified when 'out' is "
                                   f"specified, but got chunk_sizes={chunk_sizes}")
            results = _scatter_into(array, list(out), dim, streams)
        if _internal.collective_observers:  # (the ranks only when someone listens)
            ranks = _common.distinct([_common.device_of(array),
                                      *(_common.device_of(r) for r in results)])
            _internal.notify_collective("comm.scatter", array.nbytes, len(ranks),
                                        _half_factor(len(ranks)), ranks)
    return results


def _chunk_size(size: Any) -> int:
    """One of ``chunk_sizes`` as an int: an integer (Python's or numpy's), else TypeError
    (torch: a tuple of ints; 2.5 is not truncated to 2)."""
    try:
        return operator.index(size)
    except TypeError:
        raise TypeError(f"scatter(): argument 'chunk_sizes' must be a sequence of ints, but "
                        f"found an element of type {type(size).__name__}") from None


def _scatter_to_devices(array: Any, devices: list[int], chunk_sizes: Iterable[int] | None,
                        dim: int, streams: Sequence[Any] | None) -> tuple[Any, ...]:
    if not devices:
        raise RuntimeError("Expected at least one device to scatter to")
    sizes = None
    if chunk_sizes is not None:
        sizes = [_chunk_size(s) for s in chunk_sizes]
        if len(sizes) != len(devices):
            raise RuntimeError(f"Expected devices and chunk_sizes to be of same length, but got "
                               f"len(devices) = {len(devices)} and len(chunk_sizes) = "
                               f"{len(sizes)}")
    dim = _common.wrap_dim(dim, array.ndim)
    if (sizes is None and streams is None and dim == 0 and type(array) is DeviceArray
            and array.contiguous and array.dims):
        return _scatter_rows(array, devices)
    if sizes is None:
        if array.ndim == 0:
            raise RuntimeError("chunk expects at least a 1-dimensional tensor")
        sizes = chunk_sizes_of(array.shape[dim], len(devices))
    pieces = split_with_sizes(array, sizes, dim)
    source = _common.device_of(array)
    chosen = [None if devices[i] == source else _stream_for(streams, i, devices[i])
              for i in range(len(pieces))]  # every check before the first copy
    results = []
    for piece, device, stream in zip(pieces, devices, chosen):
        if device == source:
            results.append(piece)
        elif stream is None:  # (no stream guard to enter: the 1 KiB scatter row)
            results.append(_common.copy_into(_common.new_like(piece, device), piece))
        else:
            with _streams.stream(stream):
                results.append(_common.copy_into(_common.new_like(piece, device), piece))
    return tuple(results)


def _scatter_rows(array: DeviceArray, devices: list[int]) -> tuple[Any, ...]:
    """:func:`_scatter_to_devices` for a contiguous DeviceArray cut along dimension 0 into
    ``chunk`` pieces with no streams: each piece is a run of bytes, copied without building
    its view (the 1 KiB scatter row of benchmarks/comm.py)."""
    shape = array.dims
    rows = shape[0]
    row_bytes = array.byte_count // rows if rows else 0
    source = array.device_index
    results: list[Any] = []
    start = 0
    for size, device in zip(chunk_sizes_of(rows, len(devices)), devices):
        if device == source:
            results.append(array.narrow(0, start, size))
        else:
            piece = _common.empty_on((size, *shape[1:]), array.element_dtype, device)
            nbytes = size * row_bytes
            if nbytes:
                device_copy(device, piece.ptr, source, array.ptr + start * row_bytes, nbytes)
            results.append(piece)
        start += size
    return tuple(results)


def _scatter_into(array: Any, outs: list[Any], dim: int,
                  streams: Sequence[Any] | None) -> tuple[Any, ...]:
    if not outs:
        raise RuntimeError("Expected at least one output tensor to scatter to")
    dim = _common.wrap_dim(dim, array.ndim)
    if array.ndim == 0:
        raise IndexError("dimension specified as 0 but tensor has no dimensions")
    source_shape = tuple(array.shape)
    total = 0
    sizes = []
    for i, o in enumerate(outs):
        if not isinstance(o, DeviceArray):
            raise RuntimeError(f"Expected all output tensors to be CUDA tensors, but output "
                               f"tensor at index {i} has device '{_common.describe_device(o)}'")
        shape = list(o.shape)
        same_ndim = len(shape) == len(source_shape)
        if same_ndim:
            total += shape[dim]
            sizes.append(shape[dim])
            shape[dim] = source_shape[dim]
        if not same_ndim or tuple(shape) != source_shape:
            raise RuntimeError(f"Output tensor at index {i} has incorrect shape: "
                               f"{_common.shape_text(o.shape)}. Expected same shape except for "
                               f"scatter dim {dim} as the source tensor: "
                               f"{_common.shape_text(source_shape)}")
    if total != source_shape[dim]:
        raise RuntimeError(f"Total size for output tensors along scatter dim {dim} does not "
                           f"match the source tensor size at dim {dim}. Expected "
                           f"{source_shape[dim]}, but got total size {total}")
    pieces = split_with_sizes(array, sizes, dim)
    chosen = [_stream_for(streams, i, o.device_index) for i, o in enumerate(outs)]
    for piece, o, stream in zip(pieces, outs, chosen):
        if stream is None:
            _common.copy_into(o, piece)
        else:
            with _streams.stream(stream):
                _common.copy_into(o, piece)
    return tuple(outs)


# --------------------------------------------------------------------------- gather
def gather(arrays: Iterable[Any], dim: int = 0, destination: Any = None, *,
           out: Any = None) -> Any:
    """Concatenate arrays of several devices along ``dim`` on one device
    (``torch.cuda.comm.gather``).

    Parameters
    ----------
    arrays : iterable of DeviceArray
        Same number of dimensions and the same sizes except along ``dim``.
    dim : int
        The dimension to concatenate along (negative counts from the end).
    destination : int, str or Device, optional
        The result's device (default: the current device); ``"cpu"`` (or the deprecated
        ``-1``, which warns) gathers to the host.
    out : DeviceArray or numpy.ndarray, optional, keyword-only
        An existing array of the concatenated shape to fill; excludes ``destination``.

    Returns
    -------
    DeviceArray or numpy.ndarray
        A new array from the caching allocator (numpy for the host), or ``out`` itself.

    Raises
    ------
    RuntimeError
        torch's checks: no input, an input on the host, differing numbers of dimensions or
        sizes, ``destination`` with ``out``, an ``out`` of the wrong shape.
    IndexError
        ``dim`` out of range.

    Notes
    -----
    Reported to the collective observers as ``"comm.gather"`` with S = the result's bytes
    and bus factor (n - 1) / n, n = the devices taking part (the inputs' and the
    destination).
    """
    with nvtx.range("comm.gather"):
        arrays = list(arrays)
        result = _gather_rows(arrays, dim, destination) if out is None else None
        if result is None:
            result = _gather_checked(arrays, dim, destination, out)
        if _internal.collective_observers:  # (the ranks only when someone listens)
            ranks = _common.distinct([*(a.device_index for a in arrays),
                                      _common.device_of(result)])
            _internal.notify_collective("comm.gather", result.nbytes, len(ranks),
                                        _half_factor(len(ranks)), ranks)
    return result


def _gather_rows(arrays: list[Any], dim: Any, destination: Any) -> DeviceArray | None:
    """:func:`gather` of contiguous DeviceArrays of one dtype along dimension 0 to a device:
    each input is a run of bytes of the result, copied without building its view (the 1 KiB
    gather row of benchmarks/comm.py). None when the call is not of that kind: then
    :func:`_gather_checked` makes torch's checks and the general copies."""
    if not arrays or not (destination is None or type(destination) is int and destination >= 0):
        return None
    first = arrays[0]
    if type(first) is not DeviceArray:
        return None
    shape, dtype = first.dims, first.element_dtype
    if type(dim) is not int or not shape or not (dim == 0 or dim == -len(shape)):
        return None
    rest = shape[1:]
    total = 0
    for a in arrays:
        if (type(a) is not DeviceArray or not a.contiguous or a.element_dtype != dtype
                or len(a.dims) != len(shape) or a.dims[1:] != rest):
            return None
        total += a.dims[0]
    device = _internal.device_index(destination)
    result = _common.empty_on((total, *rest), dtype, device)
    offset = result.ptr
    copies = []
    for a in arrays:
        nbytes = a.byte_count
        copies.append((offset, a.device_index, a.ptr, nbytes))
        offset += nbytes
    device_copies(device, copies)  # (at once, not one after another as torch's copy_ calls)
    return result


def _gather_checked(arrays: list[Any], dim: Any, destination: Any, out: Any) -> Any:
    """:func:`gather` with torch's checks and messages, any layout and destination."""
    if out is None:
        host = _is_host(destination)
        if isinstance(destination, int) and destination == _common.HOST:
            warnings.warn(_DEPRECATED_HOST_INDEX, FutureWarning, stacklevel=3)  # gather's caller
        shape, dim = _gathered_shape(arrays, dim, quote_device=False)
        first = arrays[0]
        if host:
            result: Any = np.empty(shape, first.dtype)
        else:
            result = _common.empty_on(shape, first.dtype,
                                      _internal.device_index(destination))
    else:
        if destination is not None:
            raise RuntimeError(f"'destination' must not be specified when 'out' is "
                               f"specified, but got destination={destination}")
        shape, dim = _gathered_shape(arrays, dim, quote_device=True)
        if not isinstance(out, (DeviceArray, np.ndarray)):
            raise TypeError(f"gather(): out must be a cudalab.DeviceArray or a numpy array, "
                            f"not {type(out).__name__}")
        if tuple(out.shape) != shape:
            raise RuntimeError(f"Expected out tensor to have shape "
                               f"{_common.shape_text(shape)}, but got "
                               f"{_common.shape_text(out.shape)}")
        result = out
    _gather_into(result, arrays, dim)
    return result


def _is_host(destination: Any) -> bool:
    if isinstance(destination, str):
        return destination.strip().lower() == _HOST_NAME
    return (isinstance(destination, int) and not isinstance(destination, bool)
            and destination == _common.HOST)


def _gathered_shape(arrays: list[Any], dim: int, quote_device: bool) -> tuple[tuple[int, ...], int]:
    """torch's gather checks; the result's shape and the wrapped ``dim``."""
    if not arrays:
        raise RuntimeError("Expected at least one tensor to gather from")
    first = arrays[0]
    ndim = getattr(first, "ndim", 0)
    dim = _common.wrap_dim(dim, ndim)
    if ndim == 0 and isinstance(first, DeviceArray):
        raise IndexError("dimension specified as 0 but tensor has no dimensions")
    expected = list(getattr(first, "shape", ()))
    total = 0
    for i, a in enumerate(arrays):
        if not isinstance(a, DeviceArray):
            where = _common.describe_device(a)
            where = f"'{where}'" if quote_device else where
            raise RuntimeError(f"Expected all input tensors to be CUDA tensors, but tensor at "
                               f"index {i} has device {where}")
        if a.ndim != len(expected):
            raise RuntimeError(f"Expected all input tensors to have the same number of "
                               f"dimensions, but tensor at index {i}has {a.ndim} dimensions, "
                               f"(expected {len(expected)})")
        expected[dim] = a.shape[dim]
        if tuple(expected) != a.shape:
            raise RuntimeError(f"Input tensor at index {i} has invalid shape "
                               f"{_common.shape_text(a.shape)}, but expected "
                               f"{_common.shape_text(expected)}")
        total += a.shape[dim]
    expected[dim] = total
    return tuple(expected), dim


def _gather_into(result: Any, arrays: list[DeviceArray], dim: int) -> None:
    """``result.narrow(dim, start, n).copy_(array)`` for each array in turn."""
    start = 0
    for a in arrays:
        n = a.shape[dim]
        target = _common.narrow(result, dim, start, n)
        if isinstance(result, DeviceArray):
            _common.copy_into(target, a)
        elif math.prod(a.shape):
            target[...] = a.cpu()
        start += n
