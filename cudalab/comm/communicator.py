"""``cudalab.comm.Communicator``: one rank of an NCCL communicator spanning processes and nodes.

Each process owns one rank on one GPU. Rank 0 creates NCCL's 128-byte unique id, the id
travels to the other ranks (:mod:`cudalab.comm.rendezvous`: MPI, a shared file or an
environment variable), and every rank constructs ``Communicator(rank, world_size, uid,
device)``; the constructor returns once every rank has joined. Then every rank issues the
same collectives in the same order, with buffers of the same size and dtype::

    comm = Communicator(rank, world_size, uid, device=local_rank)
    cudalab.set_device(comm.device)
    x = cudalab.ones(1024, dtype="float32")
    comm.all_reduce(x)              # in place: x = the sum over the ranks
    comm.close()                    # every rank (finalize, then destroy)

Buffers are :class:`cudalab.DeviceArray`\\ s or any CUDA array of another library (CuPy,
torch, JAX: ``__cuda_array_interface__`` or DLPack), used in place without a copy. They must
be C-contiguous and on the communicator's device; host arrays are refused. Operations are
queued on ``stream=`` (a :class:`cudalab.Stream`) or on the device's current stream, and
return at once (NCCL is asynchronous); an array used on a stream other than the one its
memory came from is recorded on it (``record_stream``), so freeing it early is safe.

Every argument is checked before anything is queued: a rank whose arguments are wrong raises
a clear error instead of launching a mismatched collective (its peers still wait for it;
NCCL cannot know this rank gave up).

Lifetime: :meth:`Communicator.close` (``finalize`` then ``destroy``; every rank calls it),
:meth:`Communicator.abort` after an error, or the context manager (close on success, abort
on an exception). Communicators still open at interpreter exit are finalized and destroyed
by an ``atexit`` handler (errors ignored); one that is garbage-collected while open is
destroyed with a :class:`ResourceWarning`. On the simulator there is no multi-process NCCL:
constructing one raises :class:`cudalab.NcclError`.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Literal

import numpy as np

from cudalab import _internal, _interrupts
from cudalab import array as _array
from cudalab import devices as _devices
from cudalab import nccl as _nccl
from cudalab import streams as _streams
from cudalab._driver.base import (
    NCCL_AVG,
    NCCL_CALL_ALL_GATHER,
    NCCL_CALL_ALL_REDUCE,
    NCCL_CALL_BROADCAST,
    NCCL_CALL_REDUCE,
    NCCL_CALL_REDUCE_SCATTER,
    NCCL_FLOAT32,
    NCCL_FLOAT64,
    NCCL_MAX,
    NCCL_MIN,
    NCCL_PROD,
    NCCL_RESULTS,
    NCCL_SUM,
    NCCL_UINT8,
    ClosedHandle,
)
from cudalab.collective_call import (
    CALL_RECV,
    CALL_SEND,
    ROUTE_RANK,
    build,
    check_stream,
    issue,
)
from cudalab.comm import rendezvous as _rendezvous
from cudalab.comm.group_calls import group_depth
from cudalab.errors import NcclError

__all__ = ["Communicator", "REDUCTION_OPS", "live_communicators"]

#: Reduction operators by name, as NCCL numbers them (the ints are accepted too).
REDUCTION_OPS = {"sum": NCCL_SUM, "prod": NCCL_PROD, "max": NCCL_MAX, "min": NCCL_MIN,
                 "avg": NCCL_AVG}
_OP_NAMES = {code: name for name, code in REDUCTION_OPS.items()}

#: Complex numbers travel as pairs of their real type (sum and avg work on the pairs).
_COMPLEX_PARTS = {np.dtype(np.complex64): NCCL_FLOAT32, np.dtype(np.complex128): NCCL_FLOAT64}
#: Reductions that are still right on bool's 0/1 bytes (a sum could make 2: not a bool).
_BOOL_OPS = frozenset({NCCL_PROD, NCCL_MAX, NCCL_MIN})
_COMPLEX_OPS = frozenset({NCCL_SUM, NCCL_AVG})

NCCL_SUCCESS, NCCL_IN_PROGRESS = 0, 7  # ncclResult_t values that are not errors

# Every open communicator of this process, for the exit handler (and for a forked child,
# which must never touch its parent's). Invariant: holds exactly the Communicators whose
# ``_comm`` is not None.
_live: weakref.WeakSet[Communicator] = weakref.WeakSet()
_exiting = False  # True once the exit handler runs: finalizers then leave the comm alone


def live_communicators() -> list[Communicator]:
    """The communicators of this process that are still open (neither closed nor aborted)."""
    return list(_live)


# ----------------------------------------------------------------------------- helpers
def _reduction(op: Any, what: str) -> int:
    if isinstance(op, str):
        code = REDUCTION_OPS.get(op.strip().lower())
        if code is not None:
            return code
    elif isinstance(op, int) and not isinstance(op, bool) and int(op) in _OP_NAMES:
        return int(op)
    raise ValueError(f"{what}: op must be one of {', '.join(map(repr, REDUCTION_OPS))} or "
                     f"NCCL's number for it (0-4), got {_internal.echo(op)}")


_UNSEEN = object()
# numpy dtype -> its NCCL type in cudalab.nccl.DATA_TYPES (None: none), filled on first use.
_NATIVE_TYPES: dict[np.dtype, Any] = {}


def _wire_type(dtype: np.dtype, op: int | None, what: str) -> tuple[int, int]:
    """(NCCL type, NCCL elements per array element) for moving (``op`` None) or reducing."""
    native = _NATIVE_TYPES.get(dtype, _UNSEEN)
    if native is _UNSEEN:  # the one dtype table (bool travels as bytes), read once per dtype:
        # numpy's dtype.name is slow Python (the 1 KiB Communicator rows)
        native = _NATIVE_TYPES[dtype] = _nccl.DATA_TYPES.get(dtype.name)
    if op is None:  # data movement: any dtype, as its own type, its parts or its bytes
        if native is not None:
            return native, 1
        if dtype in _COMPLEX_PARTS:
            return _COMPLEX_PARTS[dtype], 2
        return NCCL_UINT8, dtype.itemsize
    name = _OP_NAMES[op]
    if dtype == np.bool_:
        if op in _BOOL_OPS:
            return NCCL_UINT8, 1
        raise TypeError(f"{what}: op={name!r} on bool would make values other than 0 and 1; "
                        f"use 'max' (any) or 'min' (all), or convert to an integer dtype")
    if dtype in _COMPLEX_PARTS:
        if op in _COMPLEX_OPS:
            return _COMPLEX_PARTS[dtype], 2
        raise TypeError(f"{what}: op={name!r} is not defined on {dtype} (only 'sum' and 'avg')")
    if native is None:
        raise TypeError(f"{what}: NCCL cannot reduce {dtype} (it reduces int8, uint8, int32, "
                        f"uint32, int64, uint64, float16, bfloat16, float32, float64)")
    return native, 1


def _overlaps(a: _array.DeviceArray, b: _array.DeviceArray) -> bool:
    return (a.byte_count > 0 and b.byte_count > 0 and a.ptr < b.ptr + b.byte_count
            and b.ptr < a.ptr + a.byte_count)


def _check_own_slice(part: _array.DeviceArray, whole: _array.DeviceArray, rank: int,
                     names: tuple[str, str], what: str) -> None:
    """In place, ``part`` (named ``names[0]``) must be this rank's slice of ``whole``
    (``names[1]``): any other overlap is refused (all_gather's send, reduce_scatter's recv)."""
    if _overlaps(part, whole) and part.ptr != whole.ptr + rank * part.byte_count:
        raise ValueError(f"{what}: {names[0]} overlaps {names[1]} but is not this rank's slice "
                         f"of it (in place needs {names[0]} = {names[1]}[rank * n:(rank + 1) * n])")


def _check_int(value: Any, name: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what}: {name} must be an int, got {_internal.echo(value)}")
    return int(value)


def _abort_quietly(nccl: Any, comm: Any) -> None:
    try:
        nccl.comm_abort(comm)
    except Exception:
        pass


# ----------------------------------------------------------------------------- the class
class Communicator:
    """One rank of an NCCL communicator across processes (one GPU per process).

    Parameters
    ----------
    rank : int
        This process's rank, ``0 <= rank < world_size``.
    world_size : int
        The number of ranks (processes), >= 1.
    unique_id : bytes
        The job's NCCL unique id (128 bytes), the same on every rank: created by one rank
        and carried to the others (:mod:`cudalab.comm.rendezvous`).
    device : int, str or cudalab.Device, optional
        The GPU of this rank. Default: the current device (:func:`cudalab.current_device`).
        With one process per GPU on a node, pass the node-local rank
        (:meth:`from_env` and :meth:`from_mpi` do). The current device is left as it was:
        call ``cudalab.set_device(comm.device)`` so new arrays land on the rank's GPU.

    Raises
    ------
    TypeError, ValueError
        A bad argument (checked before NCCL is called): rank out of range, world_size < 1,
        a unique id that is not 128 bytes, a device that does not exist.
    cudalab.NcclError
        NCCL cannot be loaded (``pip install 'cudalab[nccl]'``), the backend is the simulator,
        or NCCL's initialisation failed.

    Notes
    -----
    The constructor blocks until every rank has joined (NCCL's ``ncclCommInitRank``). Not
    thread-safe against :meth:`close`: do not close a communicator another thread uses.
    """

    __slots__ = ("_nccl", "_comm", "_rank", "_world_size", "_device", "_lock", "_finalizer",
                 "_closed_reason", "__weakref__")

    _comm: Any  # NCCL's handle; None once closed or aborted (then _closed_reason says how)
    _closed_reason: str  # "open", then what ended it ("closed", "aborted", ...)

    def __init__(self, rank: int, world_size: int, unique_id: Any, device: Any = None):
        what = "Communicator()"
        self._comm = None
        self._closed_reason = "not initialised"
        world_size = _check_int(world_size, "world_size", what)
        rank = _check_int(rank, "rank", what)
        if world_size < 1:
            raise ValueError(f"{what}: world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"{what}: rank {rank} is not in range(world_size={world_size})")
        uid = _rendezvous.check_unique_id(unique_id, what)
        dev = _internal.device_index(device)  # the current device for None; checks the range
        nccl = _internal.backend().nccl()
        if nccl.simulated:
            raise NcclError(f"{what}: a communicator across processes needs the real NCCL and a "
                            f"GPU; this process runs on cudalab's simulated backend "
                            f"(CUDALAB_SIMULATOR=1 or cudalab.use_simulator()), whose NCCL only "
                            f"connects the simulated devices of one process (cudalab.nccl, "
                            f"cudalab.comm.broadcast, ...)")
        self._nccl = nccl
        self._rank = rank
        self._world_size = world_size
        self._device = dev
        self._lock = threading.Lock()
        with _devices.device(dev):  # NCCL binds the rank to the current device
            _internal.ensure_context(dev)
            comm = nccl.comm_init_rank(dev, world_size, uid, rank)
        self._adopt(comm)

    def _adopt(self, comm: Any) -> None:
        """Own ``comm``: the handle, the registry entry and the finalizer come together."""
        label = (f"Communicator(rank={self._rank}, world_size={self._world_size}, "
                 f"device={self._device})")
        self._finalizer = weakref.finalize(self, _release_unclosed, self._nccl, comm,
                                           self._device, label)
        self._finalizer.atexit = False  # the exit handler below takes the live ones
        self._comm = comm
        self._closed_reason = "open"
        _live.add(self)

    def _detach(self, reason: str) -> Any:
        """Take the handle out (None if already out), marking the communicator ``reason``."""
        with self._lock:
            comm = self._comm
            if comm is None:
                return None
            self._comm = None
            self._closed_reason = reason
            self._finalizer.detach()
            _live.discard(self)
            return comm

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_env(cls, unique_id: Any = None, device: Any = None,
                 environ: Mapping[str, str] | None = None) -> Communicator:
        """A communicator from torchrun-style variables.

        ``RANK`` and ``WORLD_SIZE`` give the rank and size, ``LOCAL_RANK`` the device (unless
        ``device`` is given; without it, the current device), and the unique id comes from
        ``unique_id`` or ``CUDALAB_NCCL_UNIQUE_ID`` (256 hex digits, see
        :func:`cudalab.comm.rendezvous.launch_env`).

        Raises
        ------
        RuntimeError
            A required variable is not set.
        ValueError
            A variable holds a bad value.
        """
        info = _rendezvous.launch_info_from_env(environ)
        uid = _rendezvous.unique_id_from_env(environ=environ) if unique_id is None else unique_id
        if device is None and info.local_rank is not None:
            device = info.local_rank
        return cls(info.rank, info.world_size, uid, device)

    @classmethod
    def from_mpi(cls, comm: Any = None, device: Any = None) -> Communicator:
        """A communicator over the ranks of an MPI communicator (default ``COMM_WORLD``).

        MPI rank 0 creates the unique id and broadcasts it; ``device`` defaults to the
        node-local rank (``Split_type(COMM_TYPE_SHARED)``). Every MPI rank must call it.

        Raises
        ------
        ImportError
            mpi4py is not installed (``pip install 'cudalab[mpi]'``).
        """
        info = _rendezvous.launch_info_from_mpi(comm)
        uid = _rendezvous.unique_id_from_mpi(comm)
        return cls(info.rank, info.world_size, uid,
                   info.local_rank if device is None else device)

    # ------------------------------------------------------------------ identity
    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return self._world_size

    @property
    def device(self) -> int:
        """The index of this rank's GPU."""
        return self._device

    @property
    def closed(self) -> bool:
        """True once :meth:`close` or :meth:`abort` ended the communicator."""
        return self._comm is None

    def __repr__(self) -> str:
        state = "" if getattr(self, "_comm", None) is not None else ", closed"
        return (f"Communicator(rank={getattr(self, '_rank', '?')}, "
                f"world_size={getattr(self, '_world_size', '?')}, "
                f"device={getattr(self, '_device', '?')}{state})")

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Finalize (flush the pending work; a collective call) and destroy the communicator.

        Every rank calls it. Idempotent. If NCCL reports an asynchronous error, or the
        finalize fails, the communicator is aborted instead and the error raised.

        Raises
        ------
        cudalab.NcclError
            The communicator had failed (it is aborted), or finalize/destroy failed.
        """
        comm = self._detach("closed")
        if comm is None:
            return
        nccl = self._nccl
        try:
            _internal.ensure_context(self._device)
            code = nccl.comm_async_error(comm)
            if code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
                raise self._async_failure(code, "close()")
            nccl.comm_finalize(comm)
        except BaseException:  # a failed or interrupted finalize: never leave it half done
            _abort_quietly(nccl, comm)
            self._closed_reason = "aborted (close() failed)"
            raise
        nccl.comm_destroy(comm)

    def abort(self) -> None:
        """Abandon the pending work and free the communicator (after an error or a hang).

        Not collective; every rank should abort (NCCL's rule after a failure). Idempotent.
        """
        comm = self._detach("aborted")
        if comm is None:
            return
        _internal.ensure_context(self._device)
        self._nccl.comm_abort(comm)

    def async_error(self) -> None:
        """Raise NCCL's asynchronous error of this communicator, if it has one.

        Raises
        ------
        cudalab.NcclError
            NCCL reports an error (e.g. ``ncclRemoteError``: a peer exited). The
            communicator cannot be used after it: :meth:`abort` it on every rank.
        """
        comm = self._open("async_error()")
        code = self._nccl.comm_async_error(comm)
        if code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            raise self._async_failure(code, "async_error()")

    def _async_failure(self, code: int, what: str) -> NcclError:
        name = NCCL_RESULTS.get(code, (f"ncclResult({code})", ""))[0]
        text = self._nccl.error_text(code, self._comm)
        return NcclError(f"{self!r}.{what}: NCCL reports an asynchronous error: {name} "
                         f"({code}): {text}. The communicator cannot be used any more: abort "
                         f"it on every rank", code, name)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> Literal[False]:
        if exc is None:
            self.close()
        else:  # the peers may wait for work this rank will never queue: don't flush, abort
            self.abort()
        return False

    # ------------------------------------------------------------------ argument checks
    def _open(self, what: str) -> Any:
        comm = self._comm
        if comm is None:
            raise NcclError(f"Communicator.{what}: {self!r} is {self._closed_reason}; create a "
                            f"new Communicator")
        return comm

    def _buffer(self, obj: Any, role: str, what: str, writable: bool) -> _array.DeviceArray:
        """``obj`` as a DeviceArray (no copy), checked: CUDA memory on our device,
        C-contiguous, writable when NCCL writes it."""
        if isinstance(obj, _array.DeviceArray):
            arr = obj
        else:
            foreign = None if isinstance(obj, np.ndarray) else _array.foreign_cuda_array(obj)
            if foreign is None:
                raise TypeError(f"{what}: {role} must be a cudalab.DeviceArray or a CUDA array "
                                f"(__cuda_array_interface__ or DLPack), got "
                                f"{type(obj).__name__}; host memory must be copied to the "
                                f"device first (cudalab.asarray)")
            arr = foreign
        if arr.device_index != self._device:
            raise ValueError(f"{what}: {role} is on cuda:{arr.device_index}, but this rank's "
                             f"communicator is on cuda:{self._device}")
        if not arr.contiguous:
            raise ValueError(f"{what}: {role} must be C-contiguous; it has shape {arr.shape} "
                             f"and strides {arr.strides}")
        if writable and arr.read_only:  # (raises; the message built only then)
            _array.require_writable(arr, f"{what} {role}")
        return arr

    @staticmethod
    def _same_elements(first: _array.DeviceArray, second: _array.DeviceArray,
                       names: tuple[str, str], what: str, factor: int = 1) -> None:
        """``second`` has ``first``'s dtype and ``factor`` times its elements."""
        if first.element_dtype != second.element_dtype:
            raise TypeError(f"{what}: {names[0]} and {names[1]} must have the same dtype, got "
                            f"{first.dtype} and {second.dtype}")
        if second.element_count != factor * first.element_count:
            times = "" if factor == 1 else f"world_size ({factor}) x "
            raise ValueError(f"{what}: {names[1]} must hold {times}{names[0]}'s {first.size} "
                             f"elements = {factor * first.size}, got {second.size} (shape "
                             f"{second.shape})")

    def _root(self, root: Any, name: str, what: str) -> int:
        root = _check_int(root, name, what)
        if not 0 <= root < self._world_size:
            raise ValueError(f"{what}: {name} {root} is not a rank (0 <= {name} < world_size="
                             f"{self._world_size})")
        return root

    def _stream(self, stream: Any, what: str) -> _streams.Stream:
        if stream is None:
            s = _streams.current_stream(self._device)
        elif isinstance(stream, _streams.Stream):
            s = check_stream(stream, self._device, what, "this rank's communicator")
        else:
            raise TypeError(f"{what}: stream must be a cudalab.Stream or None (the current "
                            f"stream), got {type(stream).__name__}")
        handle = s.handle
        if type(handle) is ClosedHandle:
            raise handle.error()
        return s

    # ------------------------------------------------------------------ the launch
    def _issue(self, kind: int, s: _streams.Stream, comm: Any, count: int, dtype: int, *,
               send: int = 0, recv: int = 0, op: int = NCCL_SUM, root: int = 0) -> None:
        """This rank's :class:`~cudalab.collective_call.CollectiveCall` of operation ``kind``
        (an ``NCCL_CALL_*``, ``CALL_SEND`` or ``CALL_RECV``) on stream ``s``, issued: the NVTX
        range ``cudalab.comm.<name>``, the sanitizer's accesses and the collective record
        come with it (:func:`cudalab.collective_call.issue`)."""
        issue(build((kind, count, dtype, op, root, (send,), (recv,), (s,), (self._device,),
                     (comm,), self._nccl, self._rank, self._world_size, ROUTE_RANK)))

    @staticmethod
    def _keep_alive(s: _streams.Stream, arrays: tuple) -> None:
        """Memory from another stream must outlive the work queued on ``s``."""
        for arr in arrays:
            own = arr.stream
            if own is not s and (own.cuda_stream != s.cuda_stream
                                 or own.device_index != s.device_index):
                arr.record_stream(s)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, send: Any, recv: Any = None, op: Any = "sum", *,
                   stream: Any = None) -> Any:
        """``recv = op(send of every rank)`` on every rank (in place when ``recv`` is None).

        ``op``: ``"sum"``, ``"prod"``, ``"max"``, ``"min"``, ``"avg"`` or NCCL's int.
        Returns the receiving buffer (``recv``, or ``send`` in place).
        """
        what = "Communicator.all_reduce()"
        comm = self._open("all_reduce()")
        code = _reduction(op, what)
        src = self._buffer(send, "send", what, writable=recv is None)
        dst = src if recv is None else self._buffer(recv, "recv", what, writable=True)
        self._same_elements(src, dst, ("send", "recv"), what)
        if dst.ptr != src.ptr and _overlaps(src, dst):
            raise ValueError(f"{what}: send and recv overlap without being the same buffer")
        dtype, per = _wire_type(src.element_dtype, code, what)
        s = self._stream(stream, what)
        self._issue(NCCL_CALL_ALL_REDUCE, s, comm, src.size * per, dtype, send=src.ptr,
                    recv=dst.ptr, op=code)
        self._keep_alive(s, (src, dst))
        return send if recv is None else recv

    def all_gather(self, send: Any, recv: Any, *, stream: Any = None) -> Any:
        """``recv[r * send.size:(r + 1) * send.size] = send of rank r`` on every rank.

        ``recv`` holds ``world_size * send.size`` elements of ``send``'s dtype. In place when
        ``send`` is this rank's slice of ``recv``. Returns ``recv``.
        """
        what = "Communicator.all_gather()"
        comm = self._open("all_gather()")
        src = self._buffer(send, "send", what, writable=False)
        dst = self._buffer(recv, "recv", what, writable=True)
        self._same_elements(src, dst, ("send", "recv"), what, self._world_size)
        _check_own_slice(src, dst, self._rank, ("send", "recv"), what)
        dtype, per = _wire_type(src.element_dtype, None, what)
        s = self._stream(stream, what)
        self._issue(NCCL_CALL_ALL_GATHER, s, comm, src.element_count * per, dtype, send=src.ptr,
                    recv=dst.ptr)
        self._keep_alive(s, (src, dst))
        return recv

    def reduce_scatter(self, send: Any, recv: Any, op: Any = "sum", *,
                       stream: Any = None) -> Any:
        """``recv = op(send[rank * recv.size:(rank + 1) * recv.size] of every rank)``.

        ``send`` holds ``world_size * recv.size`` elements of ``recv``'s dtype. In place when
        ``recv`` is this rank's slice of ``send``. Returns ``recv``.
        """
        what = "Communicator.reduce_scatter()"
        comm = self._open("reduce_scatter()")
        code = _reduction(op, what)
        src = self._buffer(send, "send", what, writable=False)
        dst = self._buffer(recv, "recv", what, writable=True)
        self._same_elements(dst, src, ("recv", "send"), what, self._world_size)
        _check_own_slice(dst, src, self._rank, ("recv", "send"), what)
        dtype, per = _wire_type(src.element_dtype, code, what)
        s = self._stream(stream, what)
        self._issue(NCCL_CALL_REDUCE_SCATTER, s, comm, dst.element_count * per, dtype, send=src.ptr,
                    recv=dst.ptr, op=code)
        self._keep_alive(s, (src, dst))
        return recv

    def broadcast(self, send: Any, recv: Any = None, root: int = 0, *,
                  stream: Any = None) -> Any:
        """``recv = send of root`` on every rank: ``broadcast(array, root=r)`` in place, or
        ``broadcast(send, recv, root)`` (``send`` is read on the root only). Returns the
        receiving buffer."""
        what = "Communicator.broadcast()"
        comm = self._open("broadcast()")
        if isinstance(recv, int) and not isinstance(recv, bool):
            raise TypeError(f"{what}: the second argument is the receiving buffer; pass the "
                            f"root by keyword: broadcast(array, root={recv})")
        root = self._root(root, "root", what)
        src = self._buffer(send, "send" if recv is not None else "array", what,
                           writable=recv is None)
        dst = src if recv is None else self._buffer(recv, "recv", what, writable=True)
        self._same_elements(src, dst, ("send", "recv"), what)
        if dst.ptr != src.ptr and _overlaps(src, dst):
            raise ValueError(f"{what}: send and recv overlap without being the same buffer")
        dtype, per = _wire_type(src.element_dtype, None, what)
        s = self._stream(stream, what)
        self._issue(NCCL_CALL_BROADCAST, s, comm, src.element_count * per, dtype, send=src.ptr,
                    recv=dst.ptr, root=root)
        self._keep_alive(s, (src, dst))
        return send if recv is None else recv

    def reduce(self, send: Any, recv: Any = None, root: int = 0, op: Any = "sum", *,
               stream: Any = None) -> Any:
        """``recv = op(send of every rank)`` on the root (in place when ``recv`` is None;
        ``recv`` is not written on the other ranks). Returns the receiving buffer."""
        what = "Communicator.reduce()"
        comm = self._open("reduce()")
        if isinstance(recv, int) and not isinstance(recv, bool):
            raise TypeError(f"{what}: the second argument is the receiving buffer; pass the "
                            f"root by keyword: reduce(array, root={recv})")
        root = self._root(root, "root", what)
        code = _reduction(op, what)
        at_root = self._rank == root
        src = self._buffer(send, "send", what, writable=recv is None and at_root)
        dst = src if recv is None else self._buffer(recv, "recv", what, writable=at_root)
        self._same_elements(src, dst, ("send", "recv"), what)
        if dst.ptr != src.ptr and _overlaps(src, dst):
            raise ValueError(f"{what}: send and recv overlap without being the same buffer")
        dtype, per = _wire_type(src.element_dtype, code, what)
        s = self._stream(stream, what)
        self._issue(NCCL_CALL_REDUCE, s, comm, src.element_count * per, dtype, send=src.ptr,
                    recv=dst.ptr, op=code, root=root)
        self._keep_alive(s, (src, dst))
        return send if recv is None else recv

    # ------------------------------------------------------------------ point to point
    def _peer(self, peer: Any, what: str) -> int:
        peer = self._root(peer, "peer", what)
        if peer == self._rank and group_depth() == 0:
            raise ValueError(f"{what}: peer {peer} is this rank; a send to oneself completes "
                             f"only with its recv in the same cudalab.comm.group() block")
        return peer

    def send(self, array: Any, peer: int, *, stream: Any = None) -> None:
        """Send ``array`` to rank ``peer``, which posts a :meth:`recv` of the same size and
        dtype. Pair sends and receives in a :func:`cudalab.comm.group` block when a rank does
        both (an exchange), or they wait for each other."""
        what = "Communicator.send()"
        comm = self._open("send()")
        peer = self._peer(peer, what)
        buf = self._buffer(array, "array", what, writable=False)
        dtype, per = _wire_type(buf.element_dtype, None, what)
        s = self._stream(stream, what)
        self._issue(CALL_SEND, s, comm, buf.element_count * per, dtype, send=buf.ptr, root=peer)
        self._keep_alive(s, (buf,))

    def recv(self, array: Any, peer: int, *, stream: Any = None) -> Any:
        """Receive into ``array`` what rank ``peer`` sends (same size and dtype). Returns
        ``array``."""
        what = "Communicator.recv()"
        comm = self._open("recv()")
        peer = self._peer(peer, what)
        buf = self._buffer(array, "array", what, writable=True)
        dtype, per = _wire_type(buf.element_dtype, None, what)
        s = self._stream(stream, what)
        self._issue(CALL_RECV, s, comm, buf.element_count * per, dtype, recv=buf.ptr, root=peer)
        self._keep_alive(s, (buf,))
        return array


# Ctrl-C is deferred while the handle, the registry and the finalizer change together (the
# lock is never left held); never across NCCL calls, which may wait for peers.
_interrupts.guard(Communicator._adopt, Communicator._detach)


# ----------------------------------------------------------------------------- cleanup
def _release_unclosed(nccl: Any, comm: Any, device: int, label: str) -> None:
    """The finalizer of a communicator collected while open: warn, then destroy it."""
    if _exiting or sys.is_finalizing():
        return
    try:
        warnings.warn(f"{label} was garbage-collected without close(): destroying it (call "
                      f"close() on every rank, or use it as a context manager)",
                      ResourceWarning, stacklevel=2)
        _internal.ensure_context(device)
        nccl.comm_destroy(comm)
    except Exception:
        pass


def _close_all_at_exit() -> None:
    """At interpreter exit: finalize and destroy every open communicator (abort one that
    failed); never raises."""
    global _exiting
    _exiting = True
    for communicator in list(_live):
        try:
            comm = communicator._detach("destroyed at exit")
            if comm is None:
                continue
            nccl = communicator._nccl
            _internal.ensure_context(communicator._device)
            if nccl.comm_async_error(comm) not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
                _abort_quietly(nccl, comm)
                continue
            try:
                nccl.comm_finalize(comm)
            except Exception:
                _abort_quietly(nccl, comm)
                continue
            nccl.comm_destroy(comm)
        except Exception:
            pass


def _forget_after_fork() -> None:
    """A forked child must not touch its parent's communicators (nor destroy them at exit).

    No lock is taken: another thread of the parent may have held one at the fork."""
    for communicator in list(_live):
        communicator._finalizer.detach()
        communicator._comm = None
        communicator._closed_reason = "unusable: the parent of this forked process created it"
        communicator._lock = threading.Lock()
    _live.clear()


atexit.register(_close_all_at_exit)
if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_forget_after_fork)
