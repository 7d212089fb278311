"""``torch.cuda.comm.broadcast`` and ``reduce_add`` over cudalab's arrays.

Both use NCCL (:mod:`cudalab.nccl`) exactly where torch does (``nccl.is_available`` of the
arrays: all on the device, contiguous, on pairwise distinct devices) and copies otherwise:
``out.copy_(source)`` per destination for broadcast; for reduce_add the other inputs copied
to the destination and summed there by DeviceArray's ``+`` and ``+=`` in torch's order (the
destination's input, then the others in input order), so floating-point sums match torch's
copy path bit for bit. Results come from the caching allocator; all work is queued on the
current streams of the devices involved.

:func:`broadcast_to_devices` and :func:`sum_to_device` are the same operations without the
NVTX range and the collective record, for :mod:`cudalab.comm.coalesced` (one record per
public call).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from cudalab import _internal, nvtx
from cudalab import streams as _streams
from cudalab._array_memory import device_copy
from cudalab._driver.base import NCCL_CALL_BROADCAST, NCCL_CALL_REDUCE
from cudalab.array import DeviceArray, output_array
from cudalab.comm import _common

__all__ = ["broadcast", "reduce_add"]

#: nccl-tests' bus bandwidth factor of broadcast and reduce (the root's link carries it all).
ROOTED_BUS_FACTOR = 1.0


class Operand(NamedTuple):
    """What reduce_add checks of one input: its device (:data:`_common.HOST` for a host
    array) and shape."""

    device: int
    shape: tuple[int, ...]


# --------------------------------------------------------------------------- broadcast
def broadcast(array: Any, devices: Iterable[Any] | None = None, *,
              out: Sequence[Any] | None = None) -> list[Any]:
    """Copy ``array`` to several devices (``torch.cuda.comm.broadcast``).

    Parameters
    ----------
    array : DeviceArray or numpy.ndarray
        The source, on a device or on the host.
    devices : iterable of int, str or Device, optional
        The devices to copy to (``0``, ``"cuda:1"``, a :class:`cudalab.Device`). Where one
        is the source's own device, the result there is ``array`` itself (no copy).
    out : sequence of DeviceArray, optional, keyword-only
        Existing arrays to copy into (each with ``array``'s shape; dtypes are converted).
        Exactly one of ``devices`` and ``out`` is given.

    Returns
    -------
    list of DeviceArray
        One array per device (new ones from the caching allocator, or ``array`` itself on
        its own device), or the ``out`` arrays themselves.

    Raises
    ------
    RuntimeError
        Both or neither of ``devices`` and ``out``; a negative device index; an ``out``
        array on the host or of another shape (torch's messages).
    TypeError
        ``array`` is neither a DeviceArray nor a numpy array.

    Notes
    -----
    NCCL (one ``ncclBroadcast`` per array, root = the source, in one group) when
    ``cudalab.nccl.is_available([array, *destinations])``; otherwise copies, each on the
    current streams of its two devices (:meth:`DeviceArray.copy_`). One destination that
    can read the source's memory gets one peer copy instead of NCCL (faster, see
    :func:`broadcast_into`). Reported to the collective observers as
    ``"comm.broadcast"`` with S = ``array.nbytes`` and bus factor 1.
    """
    if (devices is None) == (out is None):
        raise RuntimeError(f"Exactly one of 'devices' and 'out' must be specified, but got "
                           f"devices={devices} and out={out}")
    if type(array) is not DeviceArray:
        _check_source(array, "broadcast")
    nvtx.range_push("comm.broadcast")  # (not nvtx.range's object: the 1 KiB broadcast row)
    try:
        if devices is not None:
            results = broadcast_to_devices(array, _common.parse_devices(devices))
        else:
            results = list(out)  # type: ignore[arg-type]
            _check_outputs(array, results)
            broadcast_into(array, results)
        if _internal.collective_observers:  # (the ranks only when someone listens)
            ranks = _common.distinct([_common.device_of(array)]
                                     + [r.device_index for r in results])
            _internal.notify_collective("comm.broadcast", array.nbytes, len(ranks),
                                        ROOTED_BUS_FACTOR, ranks)
    finally:
        nvtx.range_pop()
    return results


def _check_source(array: Any, operation: str) -> None:
    if not isinstance(array, (DeviceArray, np.ndarray)):
        raise TypeError(f"{operation}(): the source must be a cudalab.DeviceArray or a numpy "
                        f"array, not {type(array).__name__}")


def _check_outputs(array: Any, outs: list[Any]) -> None:
    """torch's ``broadcast_out`` checks: every output on a device, with the source's shape."""
    for i, o in enumerate(outs):
        if not isinstance(o, DeviceArray):
            raise RuntimeError(f"Expected all output tensors to be CUDA tensors, but output "
                               f"tensor at index {i} has device '{_common.describe_device(o)}'")
        if o.shape != tuple(array.shape):
            raise RuntimeError(f"Expected all output tensors to have same shape as the source "
                               f"tensor {_common.shape_text(array.shape)}, but output tensor "
                               f"at index {i} has shape {_common.shape_text(o.shape)}")


def broadcast_to_devices(array: Any, devices: Sequence[int]) -> list[Any]:
    """:func:`broadcast`'s ``devices`` form on parsed indices, without range or record.

    ``array`` itself stands for every device it is on; the other devices get new arrays.
    """
    source = _common.device_of(array)
    outs = [_common.new_like(array, d) for d in devices if d != source]
    broadcast_into(array, outs)
    if len(outs) == len(devices):
        return outs
    fresh = iter(outs)
    return [array if d == source else next(fresh) for d in devices]


def broadcast_into(array: Any, outs: Sequence[DeviceArray]) -> None:
    """torch's ``_broadcast_out_impl``: NCCL when available for ``[array, *outs]``, else
    ``out.copy_(array)`` for each (no checks).

    One exception, for speed: a broadcast to one other device that can read the source's
    memory directly is one peer copy (a copy engine), not NCCL. The bytes are the same; the
    copy engine moves them faster and with less host work (benchmarks/comm.py, the broadcast
    rows: 392 GB/s for a peer copy against 357 for NCCL's broadcast on 2 x H200 at 1 GiB,
    and a third of the host time at 1 KiB). Between about 2 and 16 MiB it depends on the
    host (docs/comm.md, "Performance"). With more destinations NCCL's pipeline wins,
    because the source's links would carry every copy.
    """
    if not outs:
        return
    if len(outs) == 1 and _one_peer_copy(array, outs[0]):
        out = outs[0]
        nbytes = array.byte_count
        if nbytes:
            device_copy(out.device_index, out.ptr, array.device_index, array.ptr, nbytes)
        return
    group = [array, *outs]
    nccl = _common.nccl_for(group)
    if nccl is not None:
        if _common.same_dtype(group):
            nccl.issue(nccl.clique_call(NCCL_CALL_BROADCAST, group, group))
        else:  # the public call raises torch's error
            with _internal.collective_muted():  # the comm.* call reports itself, once
                nccl.broadcast(group)
        return
    for o in outs:
        _common.copy_into(o, array)


def _one_peer_copy(array: Any, out: DeviceArray) -> bool:
    """Whether ``array`` reaches ``out`` as one direct peer copy: both contiguous device
    arrays of one dtype on two devices with peer access (enabled here, once per pair)."""
    return (type(array) is DeviceArray and array.contiguous and out.contiguous
            and array.element_dtype == out.element_dtype and array.device_index != out.device_index
            and _internal.enable_peer_access(out.device_index, array.device_index))


# --------------------------------------------------------------------------- reduce_add
def reduce_add(inputs: Iterable[Any], destination: Any = None) -> DeviceArray:
    """Sum arrays of several devices into one on ``destination`` (``torch.cuda.comm.reduce_add``).

    Parameters
    ----------
    inputs : iterable of DeviceArray
        Arrays of one shape; one of them must be on ``destination``.
    destination : int, str or Device, optional
        Where the sum goes (default: the current device).

    Returns
    -------
    DeviceArray
        A new array from the caching allocator on ``destination`` (the dtype follows torch's
        promotion of ``+`` on the copy path), or ``inputs[0]`` itself when there is one input.

    Raises
    ------
    AssertionError
        An input is not a DeviceArray (``reduce_add expects all inputs to be on GPUs``).
    ValueError
        Shapes differ (``input 1 has invalid size: got 2x3, but expected 3x2``).
    RuntimeError
        No input is on ``destination``.

    Notes
    -----
    NCCL's reduce (root = the destination's input) when ``cudalab.nccl.is_available(inputs)``;
    otherwise ``result = root + others[0].to(destination)`` then ``result += other.to(...)``
    for the rest, on the destination's current stream. When several inputs are on the
    destination the last of them is the root, as in torch. Reported to the collective
    observers as ``"comm.reduce_add"`` with S = the bytes of one input and bus factor 1.
    """
    nvtx.range_push("comm.reduce_add")  # (not nvtx.range's object: the 1 KiB reduce_add row)
    try:
        inputs = list(inputs)
        result = sum_to_device(inputs, destination)
        if _internal.collective_observers:  # (the ranks only when someone listens)
            ranks = _common.distinct(a.device_index for a in inputs)
            _internal.notify_collective("comm.reduce_add", inputs[0].nbytes, len(ranks),
                                        ROOTED_BUS_FACTOR, ranks)
    finally:
        nvtx.range_pop()
    return result


def reduce_root(operands: Sequence[Operand], destination: int) -> int:
    """torch's reduce_add checks: the index of the input on ``destination`` (the last one).

    Raises the errors documented in :func:`reduce_add` (``IndexError`` for no input).
    """
    if not operands:
        raise IndexError("reduce_add expects at least one input (got an empty list)")
    expected_shape = operands[0].shape
    root = None
    for i, operand in enumerate(operands):
        if operand.device == _common.HOST:
            raise AssertionError("reduce_add expects all inputs to be on GPUs")
        if operand.device == destination:
            root = i
        if operand.shape != expected_shape:
            got = "x".join(str(d) for d in operand.shape)
            expected = "x".join(str(d) for d in expected_shape)
            raise ValueError(f"input {i} has invalid size: got {got}, but expected {expected}")
    if root is None:
        raise RuntimeError("reduce_add expects destination to be on the same GPU with one of "
                           "the tensors")
    return root


def _plain_root(inputs: Sequence[Any], destination: int) -> int | None:
    """:func:`reduce_root` for the common case, in one pass: every input a DeviceArray of the
    first one's shape and dtype (the 1 KiB reduce_add row of benchmarks/comm.py). None when
    that is not so, or no input is on ``destination``: then :func:`reduce_root` says what is
    wrong (and a dtype mismatch is NCCL's error to raise)."""
    if not inputs or type(inputs[0]) is not DeviceArray:
        return None
    shape, dtype = inputs[0].dims, inputs[0].element_dtype
    root = None
    for i, a in enumerate(inputs):
        if type(a) is not DeviceArray or a.dims != shape or a.element_dtype != dtype:
            return None
        if a.device_index == destination:
            root = i
    return root


def operand(array: Any) -> Operand:
    """The :class:`Operand` of an input (a host or foreign object counts as the host)."""
    return Operand(_common.device_of(array), tuple(getattr(array, "shape", ())))


def sum_to_device(inputs: Sequence[Any], destination: Any) -> DeviceArray:
    """:func:`reduce_add` without range or record (``destination`` unparsed: None is the
    current device)."""
    dest = _internal.device_index(destination)
    plain_root = _plain_root(inputs, dest)
    plain = plain_root is not None
    # (else torch's checks, with their messages)
    root = plain_root if plain_root is not None else reduce_root(
        [operand(a) for a in inputs], dest)
    if len(inputs) == 1:
        return inputs[0]
    nccl = _common.nccl_for(inputs, checked=plain)
    if nccl is not None:
        first = inputs[root]
        # (_common.empty_on inline: one frame less, the 1 KiB reduce_add row)
        result = output_array(first.dims, first.element_dtype, dest, _streams.current_stream(dest))
        if plain or _common.same_dtype(inputs):
            outs: list[Any] = [None] * len(inputs)
            outs[root] = result
            nccl.issue(nccl.clique_call(NCCL_CALL_REDUCE, inputs, outs, root=root))
        else:  # the public call raises torch's error
            with _internal.collective_muted():  # the comm.* call reports itself, once
                nccl.reduce(list(inputs), output=result, root=root)
        return result
    others = [a for i, a in enumerate(inputs) if i != root]
    result = inputs[root] + _moved(others[0], dest)
    for other in others[1:]:
        result += _moved(other, dest)
    return result


def _moved(array: DeviceArray, device: int) -> DeviceArray:
    """``array.to(device, non_blocking=True)`` (itself when already there; the copy enables
    peer access, once per pair)."""
    return array.to(device, non_blocking=True)
