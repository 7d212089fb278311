"""``torch.cuda.nccl``: NCCL collectives over lists of device arrays, one per GPU, driven by
one process.

Each function takes one :class:`cudalab.DeviceArray` per device (objects with
``__cuda_array_interface__`` or DLPack are wrapped without copying), checks them with
torch's checks and messages, then issues one NCCL call per device inside one NCCL group, on
that device's *current* stream (or ``streams[i]``)::

    a = [cudalab.ones(1024, device=d) for d in (0, 1)]
    cudalab.nccl.all_reduce(a)          # every a[i] now holds 2.0
    cudalab.nccl.broadcast(a, root=1)

Functions: :func:`is_available`, :func:`version`, :func:`unique_id`, :func:`all_reduce`,
:func:`reduce`, :func:`broadcast`, :func:`all_gather`, :func:`reduce_scatter`, and
:func:`destroy_communicators`; reductions :data:`SUM`, :data:`PROD`, :data:`MAX`,
:data:`MIN`, :data:`AVG`.

Communicators
-------------
As in torch, the communicators are created on first use, one clique per tuple of devices
*in input order* (``[0, 1]`` and ``[1, 0]`` are different cliques: rank ``i`` is the device
of input ``i``), with ``ncclCommInitAll``, and cached for the process. Unlike torch, which
never destroys them, :func:`destroy_communicators` finalizes and destroys them (also run at
interpreter exit); the next collective creates fresh ones. Pass ``comms`` (one handle per
input, from the backend's ``nccl().comm_init_all``) to use communicators of your own.

Differences from torch, on purpose: :func:`broadcast` broadcasts from ``inputs[root]`` (torch
checks ``root`` and then always broadcasts from input 0); ``uint32`` and ``uint64`` arrays are
accepted (NCCL has those types); streams and communicators on another device than their input
are refused before anything is launched. On the simulator the collectives are computed with
numpy (see :mod:`cudalab._driver.sim.nccl`).

Every collective opens an NVTX range ``nccl.<name>``, tells
:data:`cudalab._internal.collective_observers` of it with nccl-tests' bandwidth definitions,
and reports its reads and writes to the stream sanitizer while that is on.

How it is issued: each function builds one :class:`~cudalab.collective_call.CollectiveCall`
after torch's checks and hands it to :func:`cudalab.collective_call.issue`, the one issue
function of every cudalab collective. For :mod:`cudalab.comm`, :func:`clique_call` builds the
record of a collective over arrays it has checked itself (the cached clique's runner), and
this module offers :func:`issue` and :class:`CollectiveCall` beside it (a test's stand-in
for this module replaces all three).
"""

from __future__ import annotations

import collections.abc
import os
import warnings
from typing import Any

from cudalab import _internal
from cudalab import devices as _devices
from cudalab import streams as _streams
from cudalab._driver.base import (
    NCCL_AVG,
    NCCL_CALL_ALL_GATHER,
    NCCL_CALL_ALL_REDUCE,
    NCCL_CALL_BROADCAST,
    NCCL_CALL_REDUCE,
    NCCL_CALL_REDUCE_SCATTER,
    NCCL_MAX,
    NCCL_MIN,
    NCCL_NUMPY_NAMES,
    NCCL_PROD,
    NCCL_SUM,
    NCCL_UINT8,
)
from cudalab.collective_call import (
    ROUTE_CLIQUE,
    ROUTE_NCCL,
    CollectiveCall,
    build,
    check_stream,
    communicators,
    destroy_communicators,
    issue,
)

__all__ = [
    "SUM", "PROD", "MAX", "MIN", "AVG",
    "is_available", "version", "unique_id",
    "all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter",
    "destroy_communicators",
]

#: Reduction operators (``ncclRedOp_t``), as torch passes them through.
SUM, PROD, MAX, MIN, AVG = NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG

#: NCCL's largest count (``size_t``), torch's ``count_max`` of ``ncclBcast``.
MAX_COUNT = (1 << 64) - 1

#: numpy dtype name -> NCCL data type (torch's map, plus uint32 and uint64; bool is bytes, so
#: SUM of bools is > 1). The one table: ``cudalab.comm.Communicator`` reads it too.
DATA_TYPES = {name: code for code, name in NCCL_NUMPY_NAMES.items()}  # (float8: ml_dtypes')
DATA_TYPES["bool"] = NCCL_UINT8

#: DLPack device types of CUDA memory (kDLCUDA, kDLCUDAManaged).
_DLPACK_CUDA = (2, 13)

# The backend whose NCCL answered (and its answer), for is_available.
_probe: tuple[Any, bool] | None = None


# ------------------------------------------------------------------------------ queries
def is_available(arrays: Any) -> bool:
    """Whether NCCL can run a collective over ``arrays`` (torch's predicate).

    True when NCCL can be loaded (nccl4py is installed, or the simulator runs) and every
    array is a contiguous device array, each on a different device. Never raises: anything
    else (host arrays, repeated devices, a missing nccl4py, no CUDA) gives False.
    """
    devices = set()
    try:
        for obj in arrays:
            if type(obj) is _DeviceArray:  # (its field, not is_contiguous(): the 1 KiB rows)
                if not obj.contiguous:
                    return False
                device = obj.device_index
            else:
                a = _device_array(obj)
                if a is None or not a.is_contiguous():
                    return False
                device = a.device_index
            if device in devices:
                return False
            devices.add(device)
    except Exception:
        return False
    return _nccl_loadable()


def version() -> tuple[int, int, int]:
    """NCCL's version as ``(major, minor, patch)`` (the simulator reports 2.28.5).

    Raises
    ------
    cudalab.NcclError
        When NCCL cannot be loaded.
    """
    packed = _nccl().version()
    if packed >= 10000:  # NCCL >= 2.9 packs major * 10000 + minor * 100 + patch
        return packed // 10000, packed % 10000 // 100, packed % 100
    return packed // 1000, packed % 1000 // 100, packed % 100


def unique_id() -> bytes:
    """A fresh 128-byte ``ncclUniqueId`` (to bootstrap a communicator across processes)."""
    return _nccl().unique_id()


# ------------------------------------------------------------------------------ collectives
def all_reduce(inputs: Any, outputs: Any = None, op: int = SUM, streams: Any = None,
               comms: Any = None) -> None:
    """``outputs[i] = op(inputs[0], …, inputs[n-1])`` on every device (in place by default).

    Parameters
    ----------
    inputs, outputs : sequence of DeviceArray
        One contiguous array per device, all of one dtype and size; ``outputs`` defaults to
        ``inputs``.
    op : int
        :data:`SUM`, :data:`PROD`, :data:`MAX`, :data:`MIN` or :data:`AVG`.
    streams : sequence of cudalab.Stream or None, optional
        Where each device's part runs (None: that device's current stream).
    comms : sequence of communicator handles, optional
        One per input (default: the cached clique of the inputs' devices).

    Raises
    ------
    TypeError, RuntimeError
        torch's checks (see the module docstring), before anything is launched.
    cudalab.NcclError
        When NCCL fails.
    """
    ins, outs, stream_list, comm_list = _unpack(inputs, inputs if outputs is None else outputs,
                                                streams, comms)
    _check_inputs(ins, outs, 1, 1)
    issue(_placed("all_reduce", ins, kind=NCCL_CALL_ALL_REDUCE, count=ins[0].element_count,
                  dtype=_nccl_type(ins[0]), op=op, root=0, recvs=[a.ptr for a in outs],
                  streams=stream_list, comms=comm_list))


def reduce(inputs: Any, output: Any = None, root: int = 0, op: int = SUM, streams: Any = None,
           comms: Any = None, *, outputs: Any = None) -> None:
    """``output = op(inputs[0], …, inputs[n-1])`` on ``inputs[root]``'s device.

    ``output`` defaults to ``inputs[root]`` (in place). ``outputs`` (a list, of which
    ``outputs[root]`` is used) is torch's deprecated form and warns (FutureWarning), as does
    a list passed as ``output``; passing both raises ValueError. Other parameters as
    :func:`all_reduce`.
    """
    _check_sequence_type(inputs)
    if outputs is not None:
        if output is not None:
            raise ValueError(
                "'output' and 'outputs' can not be both specified. 'outputs' is deprecated in "
                "favor of 'output', taking in a single output tensor. The signature of reduce is: "
                "reduce(inputs, output=None, root=0, op=SUM, streams=None, comms=None).")
        warnings.warn(
            "`nccl.reduce` with an output tensor list is deprecated. "
            "Please specify a single output tensor with argument 'output' instead instead.",
            FutureWarning, stacklevel=2)
        target = outputs[root]
    elif _device_array(output) is None and isinstance(output, collections.abc.Sequence):
        warnings.warn("nccl.reduce with an output tensor list is deprecated. "
                      "Please specify a single output tensor.", FutureWarning, stacklevel=2)
        target = output[root]
    else:
        target = inputs[root] if output is None else output
    ins = _arrays(inputs)
    out = _array(target, None)
    stream_list = _unpack_streams(streams, len(ins))
    comm_list = _unpack_comms(comms, len(ins))
    if not (isinstance(root, int) and 0 <= root < len(ins)):
        raise RuntimeError("invalid root")
    _check_inputs_rooted(ins, out, root)
    recvs = [0] * len(ins)
    recvs[root] = out.ptr
    issue(_placed("reduce", ins, kind=NCCL_CALL_REDUCE, count=ins[0].element_count,
                  dtype=_nccl_type(ins[0]), op=op, root=root, recvs=recvs, streams=stream_list,
                  comms=comm_list))


def broadcast(inputs: Any, root: int = 0, streams: Any = None, comms: Any = None) -> None:
    """Copy ``inputs[root]`` into every other array of ``inputs`` (in place).

    Other parameters as :func:`all_reduce`.
    """
    _check_sequence_type(inputs)
    ins = _arrays(inputs)
    if not (isinstance(root, int) and 0 <= root < len(ins)):
        raise RuntimeError("invalid root")
    stream_list = _unpack_streams(streams, len(ins))
    comm_list = _unpack_comms(comms, len(ins))
    _check_inputs(ins, ins, 1, 1)
    dtype = _nccl_type(ins[0])
    count = ins[0].element_count
    if count > MAX_COUNT:
        raise RuntimeError(f"Broadcast tensor has {count} elements, which exceeds the maximum "
                           f"NCCL supports ({MAX_COUNT})")
    issue(_placed("broadcast", ins, kind=NCCL_CALL_BROADCAST, count=count, dtype=dtype, op=SUM,
                  root=root, recvs=[a.ptr for a in ins], streams=stream_list, comms=comm_list))


def all_gather(inputs: Any, outputs: Any, streams: Any = None, comms: Any = None) -> None:
    """``outputs[i]`` = the concatenation of ``inputs[0] … inputs[n-1]``, on every device.

    Each output has ``n`` times the input's elements. Other parameters as :func:`all_reduce`.
    """
    ins, outs, stream_list, comm_list = _unpack(inputs, outputs, streams, comms)
    n = len(ins)
    _check_inputs(ins, outs, n, 1)
    issue(_placed("all_gather", ins, kind=NCCL_CALL_ALL_GATHER, count=ins[0].element_count,
                  dtype=_nccl_type(ins[0]), op=SUM, root=0, recvs=[a.ptr for a in outs],
                  streams=stream_list, comms=comm_list))


def reduce_scatter(inputs: Any, outputs: Any, op: int = SUM, streams: Any = None,
                   comms: Any = None) -> None:
    """``outputs[i]`` = part ``i`` (of ``n`` equal parts) of ``op(inputs[0], …, inputs[n-1])``.

    Each input has ``n`` times the output's elements. Other parameters as :func:`all_reduce`.
    """
    ins, outs, stream_list, comm_list = _unpack(inputs, outputs, streams, comms)
    n = len(ins)
    _check_inputs(ins, outs, 1, n)
    issue(_placed("reduce_scatter", ins, kind=NCCL_CALL_REDUCE_SCATTER, count=ins[0].element_count // n,
                  dtype=_nccl_type(ins[0]), op=op, root=0, recvs=[a.ptr for a in outs],
                  streams=stream_list, comms=comm_list))


# ------------------------------------------------------------------------------ for cudalab.comm
def clique_call(kind: int, ins: list[Any], outs: list[Any], root: int = 0,
                op: int = SUM) -> CollectiveCall:
    """The :class:`~cudalab.collective_call.CollectiveCall` of a collective over arrays already
    checked by the caller, on the current streams and the cached clique of their devices
    (:data:`~cudalab.collective_call.ROUTE_CLIQUE`): for :mod:`cudalab.comm`, whose public
    call has its own checks, NVTX range and collective record, and issues it with
    :func:`issue`. Not part of torch.cuda.nccl's API.

    ``kind`` is an ``NCCL_CALL_*`` of the seam. The caller guarantees what the public
    functions check: every array a contiguous DeviceArray, ``ins`` on pairwise distinct
    devices, all of one dtype, and sizes as the collective needs them (:func:`is_available`
    and the caller's own checks). ``outs[i]`` is rank ``i``'s receive array, or None for
    none (reduce off the root); broadcast is in place (``outs`` is ``ins``).

    Raises
    ------
    RuntimeError
        The dtype has no NCCL type (before anything is launched).
    """
    first = ins[0]
    dtype = _TYPE_OF_DTYPE.get(first.element_dtype)
    if dtype is None:
        dtype = _nccl_type(first)
    count = first.element_count
    if kind == NCCL_CALL_REDUCE_SCATTER:
        count //= len(ins)
    # (comprehensions, not a loop of appends: the 1 KiB reduce_add row of benchmarks/comm.py)
    # (comprehensions, not a loop of appends: the 1 KiB reduce_add row of benchmarks/comm.py)
    current_stream = _streams.current_stream
    devices = tuple([a.device_index for a in ins])
    sends = [a.ptr for a in ins]
    recvs = sends if outs is ins else [0 if o is None else o.ptr for o in outs]
    streams = [current_stream(d) for d in devices]
    # (no comms and no seam: the cached clique's runner has them)
    return build((kind, count, dtype, op, root, sends, recvs, streams, devices, (), None, 0,
                  len(ins), ROUTE_CLIQUE))


def _forget_in_child() -> None:
    """After fork: the parent's NCCL answer is not the child's."""
    global _probe
    _probe = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


# ------------------------------------------------------------------------------ placement
def _placed(name: str, ins: list[Any], *, kind: int, count: int, dtype: int, op: int, root: int,
            recvs: list[int], streams: list[Any], comms: list[Any] | None) -> CollectiveCall:
    """The record of a public collective (:data:`ROUTE_NCCL`) over checked ``ins``: each
    rank's stream (None: its device's current one) and communicator (None: the cached
    clique) resolved and checked against its input's device.

    Raises
    ------
    cudalab.NcclError
        NCCL cannot be loaded, or the clique cannot be created.
    RuntimeError
        A communicator is bound to another device than its input.
    cudalab.errors.StreamDeviceError
        A stream is on another device than its input (a RuntimeError).
    """
    devices = tuple([a.device_index for a in ins])
    nccl = _nccl()
    if comms is None:
        comms = communicators(nccl, devices)
    else:
        for i, c in enumerate(comms):
            bound = nccl.comm_device(c)
            if bound != devices[i]:
                raise RuntimeError(f"communicator at index {i} is bound to device {bound}, "
                                   f"but input {i} is on device {devices[i]}")
    current_stream = _streams.current_stream
    resolved = [current_stream(d) if s is None else
                check_stream(s, d, f"nccl.{name}()", f"input {i}", i)
                for i, (s, d) in enumerate(zip(streams, devices))]
    sends = [a.ptr for a in ins]
    return build((kind, count, dtype, op, root, sends, recvs, resolved, devices, comms, nccl, 0,
                  len(ins), ROUTE_NCCL))


# ------------------------------------------------------------------------------ checks
def _nccl() -> Any:
    """The backend's NCCL (NcclError when it cannot be loaded)."""
    return _internal.backend().nccl()


def _nccl_loadable() -> bool:
    global _probe
    try:
        b = _devices.backend()  # (not _internal's wrapper: one frame less, the 1 KiB rows)
    except Exception:  # no driver, no device: no NCCL either
        return False
    probe = _probe
    if probe is None or probe[0] is not b:
        try:
            b.nccl().version()
            ok = True
        except Exception:
            ok = False
        probe = _probe = (b, ok)
    return probe[1]


def _check_sequence_type(inputs: Any) -> None:
    if type(inputs) is list or type(inputs) is tuple:  # (an ABC check costs a microsecond)
        return
    if not isinstance(inputs, collections.abc.Container) or _device_array(inputs) is not None:
        raise TypeError("Inputs should be a collection of tensors")


_DeviceArray: Any = None  # cudalab.array.DeviceArray, bound on first use (a cheap check below)


def _device_array(obj: Any) -> Any:
    """``obj`` as a DeviceArray when it is device memory (wrapped without copying), else
    None (host arrays, other objects)."""
    global _DeviceArray
    if type(obj) is _DeviceArray:  # the common case first (host time of small collectives)
        return obj
    from cudalab.array import DeviceArray, asarray

    _DeviceArray = DeviceArray
    if isinstance(obj, DeviceArray):
        return obj
    if obj is None or isinstance(obj, (str, bytes)) or type(obj).__module__ == "numpy":
        return None
    if hasattr(obj, "__cuda_array_interface__"):
        return asarray(obj)
    probe = getattr(obj, "__dlpack_device__", None)
    if probe is not None:
        try:
            kind = probe()[0]
        except Exception:
            return None
        return asarray(obj) if kind in _DLPACK_CUDA else None
    return None


class _HostArray:
    """Stands for an input that is not device memory (a numpy array, a CPU tensor): torch's
    "have to be cuda dense Tensors" error names it."""


def _array(obj: Any, index: int | None) -> Any:
    a = _device_array(obj)
    if a is not None:
        return a
    if hasattr(obj, "__array_interface__") or hasattr(obj, "__dlpack__"):
        return _HostArray()
    where = "" if index is None else f" at {index}"
    raise TypeError(f"expected Tensor{where} (got {type(obj).__name__})")


def _arrays(seq: Any) -> list[Any]:
    if type(seq) is not list and type(seq) is not tuple and not isinstance(
            seq, collections.abc.Iterable):
        raise TypeError("expected a sequence")
    device_array = _DeviceArray
    return [obj if type(obj) is device_array else _array(obj, i) for i, obj in enumerate(seq)]


def _unpack(inputs: Any, outputs: Any, streams: Any,
            comms: Any) -> tuple[list[Any], list[Any], list[Any], list[Any] | None]:
    """torch's unpacking of a collective with inputs and outputs, in its order: the two
    sequences, then the streams and communicators (one per input)."""
    _check_sequence_type(inputs)
    _check_sequence_type(outputs)
    ins, outs = _arrays(inputs), _arrays(outputs)
    return ins, outs, _unpack_streams(streams, len(ins)), _unpack_comms(comms, len(ins))


def _unpack_streams(streams: Any, size: int) -> list[Any]:
    if streams is None:
        return [None] * size
    items = list(streams)
    if len(items) != size:
        raise RuntimeError("number of streams is not equal to number of inputs")
    for i, s in enumerate(items):
        if s is not None and not isinstance(s, _streams.Stream):
            raise TypeError(f"expected a cudalab.Stream or None at index {i} (got "
                            f"{type(s).__name__})")
    return items


def _unpack_comms(comms: Any, size: int) -> list[Any] | None:
    if comms is None:
        return None
    items = list(comms) if isinstance(comms, (list, tuple)) else [comms]
    if len(items) != size:
        raise RuntimeError("number of communicators is not equal to number of inputs")
    return items


def _check_one(a: Any, dtype: Any) -> None:
    if isinstance(a, _HostArray):
        raise RuntimeError("input and output elements have to be cuda dense Tensors")
    if a.dtype != dtype:
        raise RuntimeError(f"all inputs and outputs must be of the same Tensor dtype (got "
                           f"{dtype} and {a.dtype})")
    if not a.is_contiguous():
        raise RuntimeError("all inputs and outputs have to be contiguous")


def _check_tensor(a: Any, out: Any, input_multiplier: int, output_multiplier: int,
                  numel: int, dtype: Any) -> None:
    if (type(a) is _DeviceArray and a.element_dtype == dtype and a.contiguous
            and a.element_count == numel
            and (out is None or type(out) is _DeviceArray and out.element_dtype == dtype
                 and out.contiguous and out.device_index == a.device_index
                 and out.element_count * output_multiplier == numel * input_multiplier)):
        return  # every check passed in one expression (the 1 KiB rows of benchmarks/comm.py)
    _check_one(a, dtype)
    if a.element_count != numel:
        raise RuntimeError("all inputs must have the same number of elements")
    if out is not None:
        _check_one(out, dtype)
        if a.device_index != out.device_index:
            raise RuntimeError("input and output must be on the same device")
        if out.element_count * output_multiplier != numel * input_multiplier:
            raise RuntimeError("output must be of size input_size * size_multiplier")


def _reference(ins: list[Any]) -> tuple[int, Any]:
    if not ins:
        raise RuntimeError("input sequence can't be empty")
    first = ins[0]
    if isinstance(first, _HostArray):
        raise RuntimeError("input and output elements have to be cuda dense Tensors")
    return first.element_count, first.element_dtype


def _check_inputs(ins: list[Any], outs: list[Any], input_multiplier: int,
                  output_multiplier: int) -> None:
    """torch's ``check_inputs`` (inputs and outputs, in its order)."""
    if not ins:
        raise RuntimeError("input sequence can't be empty")
    if len(ins) != len(outs):
        raise RuntimeError("inputs and outputs sequences have to be of the same length, but got "
                           f"input of length {len(ins)} and output of length {len(outs)}")
    numel, dtype = _reference(ins)
    devices: set[int] = set()
    for a, out in zip(ins, outs):
        _check_tensor(a, out, input_multiplier, output_multiplier, numel, dtype)
        if a.device_index in devices:
            raise RuntimeError("inputs must be on unique devices")
        devices.add(a.device_index)


def _check_inputs_rooted(ins: list[Any], out: Any, root: int) -> None:
    """torch's ``check_inputs`` for reduce (the output is checked beside the root's input)."""
    numel, dtype = _reference(ins)
    devices: set[int] = set()
    for i, a in enumerate(ins):
        _check_tensor(a, out if i == root else None, 1, 1, numel, dtype)
        if a.device_index in devices:
            raise RuntimeError("inputs must be on unique devices")
        devices.add(a.device_index)


_TYPE_OF_DTYPE: dict[Any, int] = {}  # numpy dtype -> DATA_TYPES[dtype.name], filled on use


def _nccl_type(a: Any) -> int:
    dtype = a.element_dtype
    code = _TYPE_OF_DTYPE.get(dtype)  # dtype.name is slow Python in numpy: looked up once
    if code is None:
        code = DATA_TYPES.get(dtype.name)
        if code is None:
            raise RuntimeError(f"Unconvertible NCCL type {dtype.name}")
        _TYPE_OF_DTYPE[dtype] = code
    return code


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
