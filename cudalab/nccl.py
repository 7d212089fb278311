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
"""

from __future__ import annotations

import atexit
import collections.abc
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

from cudalab import _internal, _interrupts, _observe
from cudalab import nvtx as _nvtx
from cudalab import streams as _streams
from cudalab._driver.base import (
    NCCL_AVG,
    NCCL_CALL_ALL_GATHER,
    NCCL_CALL_ALL_REDUCE,
    NCCL_CALL_BROADCAST,
    NCCL_CALL_REDUCE,
    NCCL_CALL_REDUCE_SCATTER,
    NCCL_FLOAT8E4M3,
    NCCL_FLOAT8E5M2,
    NCCL_MAX,
    NCCL_MIN,
    NCCL_NUMPY_NAMES,
    NCCL_PROD,
    NCCL_SUM,
    NCCL_UINT8,
)
from cudalab.errors import NcclError

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
DATA_TYPES = {name: code for code, name in NCCL_NUMPY_NAMES.items()
              if code not in (NCCL_FLOAT8E4M3, NCCL_FLOAT8E5M2)}  # (DeviceArray has no float8)
DATA_TYPES["bool"] = NCCL_UINT8

#: DLPack device types of CUDA memory (kDLCUDA, kDLCUDAManaged).
_DLPACK_CUDA = (2, 13)

# The communicator cache: devices in rank order -> the clique's handles. Invariant: every
# value is a complete clique of live communicators (a failed or interrupted creation is
# never stored). Guarded by _cliques_lock for changes; reads of a present key need no lock.
_cliques: dict[tuple[int, ...], list[Any]] = {}
# Each cached clique's group runner (the backend's ``group_runner`` of its communicators), made
# on first use: devices -> (the clique's list, its runner). An entry counts only while
# _cliques holds that very list for the key (checked by identity on every use), so the two
# cannot drift: a destroyed or re-created clique is never run through an old runner.
_runners: dict[tuple[int, ...], tuple[list[Any], Callable[..., None]]] = {}
_thread = _internal.thread_state()  # .device: this thread's current device (the one object)
_cliques_lock = threading.Lock()
_atexit_registered = False  # set (once) when the first clique is created
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
            a = obj if type(obj) is _DeviceArray else _device_array(obj)
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
    dtype = _nccl_type(ins[0])
    count = ins[0].size
    n = len(ins)
    _execute("all_reduce", NCCL_CALL_ALL_REDUCE, count, dtype, op, 0, ins,
             [a.ptr for a in ins], [a.ptr for a in outs], stream_list, comm_list,
             lambda: [((ins[i],), (outs[i],)) for i in range(n)],
             count * ins[0].itemsize, 2 * (n - 1) / n)


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
    dtype = _nccl_type(ins[0])
    count = ins[0].size
    recvs = [0] * len(ins)
    recvs[root] = out.ptr
    _execute("reduce", NCCL_CALL_REDUCE, count, dtype, op, root, ins, [a.ptr for a in ins],
             recvs, stream_list, comm_list,
             lambda: [((ins[i],), (out,) if i == root else ()) for i in range(len(ins))],
             count * ins[0].itemsize, 1.0)


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
    count = ins[0].size
    if count > MAX_COUNT:
        raise RuntimeError(f"Broadcast tensor has {count} elements, which exceeds the maximum "
                           f"NCCL supports ({MAX_COUNT})")

    pointers = [a.ptr for a in ins]
    _execute("broadcast", NCCL_CALL_BROADCAST, count, dtype, SUM, root, ins, pointers,
             pointers, stream_list, comm_list,
             lambda: [((ins[i],) if i == root else (), (ins[i],) if i != root else ())
                      for i in range(len(ins))],
             count * ins[0].itemsize, 1.0)


def all_gather(inputs: Any, outputs: Any, streams: Any = None, comms: Any = None) -> None:
    """``outputs[i]`` = the concatenation of ``inputs[0] … inputs[n-1]``, on every device.

    Each output has ``n`` times the input's elements. Other parameters as :func:`all_reduce`.
    """
    ins, outs, stream_list, comm_list = _unpack(inputs, outputs, streams, comms)
    n = len(ins)
    _check_inputs(ins, outs, n, 1)
    dtype = _nccl_type(ins[0])
    count = ins[0].size

    _execute("all_gather", NCCL_CALL_ALL_GATHER, count, dtype, SUM, 0, ins,
             [a.ptr for a in ins], [a.ptr for a in outs], stream_list, comm_list,
             lambda: [((ins[i],), (outs[i],)) for i in range(n)],
             count * n * ins[0].itemsize, (n - 1) / n)


def reduce_scatter(inputs: Any, outputs: Any, op: int = SUM, streams: Any = None,
                   comms: Any = None) -> None:
    """``outputs[i]`` = part ``i`` (of ``n`` equal parts) of ``op(inputs[0], …, inputs[n-1])``.

    Each input has ``n`` times the output's elements. Other parameters as :func:`all_reduce`.
    """
    ins, outs, stream_list, comm_list = _unpack(inputs, outputs, streams, comms)
    n = len(ins)
    _check_inputs(ins, outs, 1, n)
    dtype = _nccl_type(ins[0])
    count = ins[0].size // n

    _execute("reduce_scatter", NCCL_CALL_REDUCE_SCATTER, count, dtype, op, 0, ins,
             [a.ptr for a in ins], [a.ptr for a in outs], stream_list, comm_list,
             lambda: [((ins[i],), (outs[i],)) for i in range(n)],
             ins[0].size * ins[0].itemsize, (n - 1) / n)


# ------------------------------------------------------------------------------ for cudalab.comm
#: The collectives :func:`issue_checked` takes, by name.
_CALLS = {"all_reduce": NCCL_CALL_ALL_REDUCE, "broadcast": NCCL_CALL_BROADCAST,
          "reduce": NCCL_CALL_REDUCE, "all_gather": NCCL_CALL_ALL_GATHER,
          "reduce_scatter": NCCL_CALL_REDUCE_SCATTER}


def issue_checked(name: str, ins: list[Any], outs: list[Any], root: int = 0,
                  op: int = SUM) -> None:
    """A collective over arrays already checked by the caller, on the current streams: for
    :mod:`cudalab.comm`, whose public call has its own checks, NVTX range and collective
    record. Not part of torch.cuda.nccl's API.

    The caller guarantees what the public functions check: every array a contiguous
    DeviceArray, ``ins`` on pairwise distinct devices, all of one dtype, and sizes as the
    collective needs them (:func:`is_available` and the caller's own checks). ``outs[i]`` is
    rank ``i``'s receive array, or None for none (reduce off the root); broadcast is in
    place (``outs`` is ``ins``). The clique of the inputs' devices is the cached one.

    Raises
    ------
    RuntimeError
        The dtype has no NCCL type (before anything is launched).
    cudalab.NcclError
        When NCCL fails.
    """
    call = _CALLS[name]
    first = ins[0]
    dtype = _TYPE_OF_DTYPE.get(first.dtype)
    if dtype is None:
        dtype = _nccl_type(first)
    count = first.size // len(ins) if call == NCCL_CALL_REDUCE_SCATTER else first.size
    # (comprehensions, not a loop of appends: the 1 KiB reduce_add row of benchmarks/comm.py)
    current_stream = _streams.current_stream
    devices = tuple([a.device_index for a in ins])
    streams = [current_stream(d) for d in devices]
    _issue_run(_runner(devices), call, count, dtype, op, root, [a.ptr for a in ins],
               [0 if o is None else o.ptr for o in outs], [s.handle for s in streams])
    if _observe.access_on:  # the stream sanitizer (one flag read while it is off)
        for i, (stream, a, o) in enumerate(zip(streams, ins, outs)):
            reads = [] if call == NCCL_CALL_BROADCAST and i != root else [(a.ptr, a.nbytes)]
            writes = [] if o is None or (call == NCCL_CALL_BROADCAST and i == root) else \
                [(o.ptr, o.nbytes)]
            _observe.access_tracker.access(stream, reads, writes, f"nccl.{name}")


# ------------------------------------------------------------------------------ communicators
def destroy_communicators() -> None:
    """Finalize and destroy every cached communicator (torch never does; cudalab can).

    Each clique's ranks are finalized inside one NCCL group (finalize is collective), then
    destroyed. The cache is emptied first, so the next collective creates fresh
    communicators. Also runs at interpreter exit (silently). Communicators passed as
    ``comms`` are the caller's and are not touched.

    Raises
    ------
    cudalab.NcclError
        The first failure (the other cliques are still destroyed; a clique that failed is
        aborted).
    """
    with _cliques_lock:
        cliques = list(_cliques.values())
        _cliques.clear()
        _runners.clear()
    if not cliques:
        return
    nccl = _nccl()
    first: NcclError | None = None
    for comms in cliques:
        try:
            _destroy_clique(nccl, comms)
        except NcclError as exc:
            first = first or exc
    if first is not None:
        raise first


def _destroy_clique(nccl: Any, comms: list[Any]) -> None:
    """Finalize ``comms`` in one group, then destroy each; abort them all on failure."""
    try:
        nccl.group_start()
        try:
            for c in comms:
                nccl.comm_finalize(c)
        finally:
            nccl.group_end()
        for c in comms:
            nccl.comm_destroy(c)
    except NcclError:
        for c in comms:
            try:
                nccl.comm_abort(c)
            except NcclError:
                pass  # already destroyed, or NCCL is gone: nothing more to free
        raise


def _communicators(nccl: Any, devices: tuple[int, ...]) -> list[Any]:
    """The cached clique of ``devices`` (rank i = devices[i]), created on first use."""
    comms = _cliques.get(devices)
    return comms if comms is not None else _create_clique(nccl, devices)


def _create_clique(nccl: Any, devices: tuple[int, ...]) -> list[Any]:
    """Create and cache the clique of ``devices`` (Ctrl-C waits until it is cached)."""
    global _atexit_registered
    with _cliques_lock:
        comms = _cliques.get(devices)
        if comms is not None:
            return comms
        comms = nccl.comm_init_all(devices)
        try:
            _cliques[devices] = comms
            if not _atexit_registered:
                atexit.register(_destroy_at_exit)
                _atexit_registered = True
        except BaseException:
            _cliques.pop(devices, None)
            try:
                _destroy_clique(nccl, comms)
            except NcclError:
                pass
            raise
    return comms


def _destroy_at_exit() -> None:
    """atexit: destroy the cached cliques while CUDA is still up; never raises."""
    try:
        if _cliques and not sys.is_finalizing() and _internal.is_initialized():
            destroy_communicators()
    except BaseException:
        pass


def _forget_in_child() -> None:
    """After fork: the parent's communicators are not the child's (never destroy them)."""
    global _cliques_lock, _probe
    _cliques.clear()
    _runners.clear()
    _cliques_lock = threading.Lock()
    _probe = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


# ------------------------------------------------------------------------------ execution
def _execute(name: str, call: int, count: int, dtype: int, op: int, root: int,
             ins: list[Any], sends: list[int], recvs: list[int], streams: list[Any],
             comms: list[Any] | None,
             accesses: Callable[[], list[tuple[tuple[Any, ...], tuple[Any, ...]]]],
             algorithm_bytes: int, bus_factor: float) -> None:
    """Resolve communicators and streams, issue collective ``call`` (an ``NCCL_CALL_*``) on
    every device in one NCCL group, then tell the sanitizer and the collective observers."""
    devices = tuple([a.device_index for a in ins])
    with _nvtx.range(f"nccl.{name}"):
        nccl = _nccl()
        if comms is None:
            comms = _communicators(nccl, devices)
        else:
            for i, c in enumerate(comms):
                bound = nccl.comm_device(c)
                if bound != devices[i]:
                    raise RuntimeError(f"communicator at index {i} is bound to device {bound}, "
                                       f"but input {i} is on device {devices[i]}")
        resolved = []
        for i, s in enumerate(streams):
            stream = _streams.current_stream(devices[i]) if s is None else s
            if stream.device_index != devices[i]:
                raise RuntimeError(f"stream at index {i} is on device {stream.device_index}, "
                                   f"but input {i} is on device {devices[i]}")
            resolved.append(stream)
        # (the checked group call, not the clique's runner: the public functions take any
        # op, and the seam's checks give the same errors on every backend)
        _issue_group(nccl, call, count, dtype, op, root, sends, recvs, comms,
                     [_internal.stream_handle(s) for s in resolved])
        if _observe.access_on:  # the stream sanitizer (one flag read while it is off)
            for stream, (reads, writes) in zip(resolved, accesses()):
                _observe.access_tracker.access(
                    stream, [(a.ptr, a.nbytes) for a in reads],
                    [(a.ptr, a.nbytes) for a in writes], f"nccl.{name}")
        _internal.notify_collective(f"nccl.{name}", algorithm_bytes, len(ins), bus_factor,
                                    devices)


def _issue_group(nccl: Any, call: int, count: int, dtype: int, op: int, root: int,
                 sends: list[int], recvs: list[int], comms: list[Any],
                 handles: list[Any]) -> None:
    """One NCCL group of the per-device calls (Ctrl-C waits until the group is closed: a
    group cut in half would leave some ranks waiting for the others for ever), then the
    caller's device current again (torch's guard)."""
    current = _thread.device
    try:
        nccl.group_call(call, count, dtype, op, root, sends, recvs, comms, handles)
    finally:
        if current is not None and current >= 0:  # (one thread-local check when it is)
            _internal.ensure_context(current)


def _runner(devices: tuple[int, ...]) -> Callable[..., None]:
    """The group runner of the cached clique of ``devices`` (the clique created on first use)."""
    entry = _runners.get(devices)
    comms = _cliques.get(devices)
    if entry is not None and comms is not None and entry[0] is comms:
        return entry[1]
    nccl = _nccl()
    comms = _communicators(nccl, devices)
    run = nccl.group_runner(comms)
    _runners[devices] = (comms, run)
    return run


def _issue_run(run: Callable[..., None], call: int, count: int, dtype: int, op: int,
               root: int, sends: list[int], recvs: list[int], handles: list[Any]) -> None:
    """:func:`_issue_group` through a clique's runner (Ctrl-C waits, the caller's device is
    current again afterwards)."""
    current = _thread.device
    try:
        run(call, count, dtype, op, root, sends, recvs, handles)
    finally:
        if current is not None and current >= 0:  # (one thread-local check when it is)
            _internal.ensure_context(current)


_interrupts.guard(_create_clique, destroy_communicators, _destroy_clique, _issue_group,
                  _issue_run)


# ------------------------------------------------------------------------------ checks
def _nccl() -> Any:
    """The backend's NCCL (NcclError when it cannot be loaded)."""
    return _internal.backend().nccl()


def _nccl_loadable() -> bool:
    global _probe
    try:
        b = _internal.backend()
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
        raise RuntimeError("all inputs and outputs must be of the same Tensor dtype")
    if not a.is_contiguous():
        raise RuntimeError("all inputs and outputs have to be contiguous")


def _check_tensor(a: Any, out: Any, input_multiplier: int, output_multiplier: int,
                  numel: int, dtype: Any) -> None:
    if (type(a) is _DeviceArray and a.dtype == dtype and a.contiguous and a.size == numel
            and (out is None or type(out) is _DeviceArray and out.dtype == dtype
                 and out.contiguous and out.device_index == a.device_index
                 and out.size * output_multiplier == numel * input_multiplier)):
        return  # every check passed in one expression (the 1 KiB rows of benchmarks/comm.py)
    _check_one(a, dtype)
    if a.size != numel:
        raise RuntimeError("all inputs must have the same number of elements")
    if out is not None:
        _check_one(out, dtype)
        if a.device_index != out.device_index:
            raise RuntimeError("input and output must be on the same device")
        if out.size * output_multiplier != numel * input_multiplier:
            raise RuntimeError("output must be of size input_size * size_multiplier")


def _reference(ins: list[Any]) -> tuple[int, Any]:
    if not ins:
        raise RuntimeError("input sequence can't be empty")
    first = ins[0]
    if isinstance(first, _HostArray):
        raise RuntimeError("input and output elements have to be cuda dense Tensors")
    return first.size, first.dtype


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
    dtype = a.dtype
    code = _TYPE_OF_DTYPE.get(dtype)  # dtype.name is slow Python in numpy: looked up once
    if code is None:
        code = DATA_TYPES.get(dtype.name)
        if code is None:
            raise RuntimeError(f"Unconvertible NCCL type {dtype.name}")
        _TYPE_OF_DTYPE[dtype] = code
    return code


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
