"""The collective library's seam: :class:`Nccl` (:meth:`Backend.nccl`) and NCCL's numbers.

Implemented by :class:`cudalab._driver.nccl.RealNccl` (``nccl4py``'s raw bindings and the C
group call) and :class:`cudalab._driver.sim.nccl.SimulatedNccl` (numpy cliques). Public
names: the ``NCCL_*`` data types, operators, calls and results, :data:`GroupRunner` and
:class:`Nccl`; communicators are :data:`~cudalab._driver.handles.CommHandle` values and
streams :data:`~cudalab._driver.handles.StreamHandle` values of the :class:`Backend`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

from cudalab._driver.handles import CommHandle, StreamHandle
from cudalab.errors import NcclError

__all__ = [
    "NCCL_INT8", "NCCL_UINT8", "NCCL_INT32", "NCCL_UINT32", "NCCL_INT64", "NCCL_UINT64",
    "NCCL_FLOAT16", "NCCL_FLOAT32", "NCCL_FLOAT64", "NCCL_BFLOAT16", "NCCL_FLOAT8E4M3",
    "NCCL_FLOAT8E5M2", "NCCL_SUM", "NCCL_PROD", "NCCL_MAX", "NCCL_MIN", "NCCL_AVG",
    "NCCL_NUMPY_NAMES", "NCCL_UNIQUE_ID_SIZE", "NCCL_CALL_ALL_REDUCE", "NCCL_CALL_BROADCAST",
    "NCCL_CALL_REDUCE", "NCCL_CALL_ALL_GATHER", "NCCL_CALL_REDUCE_SCATTER", "NCCL_CALL_NAMES",
    "GroupRunner", "NCCL_RESULTS", "Nccl",
]


# NCCL data types (ncclDataType_t) and reduction operators (ncclRedOp_t), as NCCL numbers them.
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
NCCL_FLOAT8E4M3, NCCL_FLOAT8E5M2 = 10, 11
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4

#: numpy's name of each NCCL data type (ml_dtypes' names for bfloat16 and the float8 types).
NCCL_NUMPY_NAMES = {
    NCCL_INT8: "int8", NCCL_UINT8: "uint8", NCCL_INT32: "int32", NCCL_UINT32: "uint32",
    NCCL_INT64: "int64", NCCL_UINT64: "uint64", NCCL_FLOAT16: "float16",
    NCCL_FLOAT32: "float32", NCCL_FLOAT64: "float64", NCCL_BFLOAT16: "bfloat16",
    NCCL_FLOAT8E4M3: "float8_e4m3fn", NCCL_FLOAT8E5M2: "float8_e5m2",
}

#: Size in bytes of an NCCL unique id (ncclUniqueId).
NCCL_UNIQUE_ID_SIZE = 128

#: The collectives :meth:`Nccl.group_call` issues, numbered as the real backend's C group call
#: numbers them (cudalab/_driver/ncclcall.c; tests/driver/test_ncclcall.py compares the two).
NCCL_CALL_ALL_REDUCE, NCCL_CALL_BROADCAST, NCCL_CALL_REDUCE = 0, 1, 2
NCCL_CALL_ALL_GATHER, NCCL_CALL_REDUCE_SCATTER = 3, 4
#: Each collective's name in NCCL's C API (error messages say which call failed).
NCCL_CALL_NAMES = ("ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather",
                   "ncclReduceScatter")

#: What :meth:`Nccl.group_runner` returns: ``run(call, count, dtype, op, root, sends, recvs,
#: streams)``, one collective on every rank of the clique it was made for.
GroupRunner = Callable[[int, int, int, int, int, Sequence[int], Sequence[int], Sequence[StreamHandle]],
                       None]

#: ncclResult_t: code -> (name, ncclGetErrorString's text), as nccl.h and NCCL spell them.
NCCL_RESULTS = {
    0: ("ncclSuccess", "no error"),
    1: ("ncclUnhandledCudaError", "unhandled cuda error (run with NCCL_DEBUG=INFO for details)"),
    2: ("ncclSystemError", "unhandled system error (run with NCCL_DEBUG=INFO for details)"),
    3: ("ncclInternalError", "internal error - please report this issue to the NCCL developers"),
    4: ("ncclInvalidArgument", "invalid argument (run with NCCL_DEBUG=WARN for details)"),
    5: ("ncclInvalidUsage", "invalid usage (run with NCCL_DEBUG=WARN for details)"),
    6: ("ncclRemoteError", "remote process exited or there was a network error"),
    7: ("ncclInProgress", "NCCL operation in progress"),
}


class Nccl(abc.ABC):
    """NCCL, the collective library, at the level of its C API (pointers, counts, handles).

    Conventions:

    * Communicators are opaque handles owned by the caller, who ends them with
      :meth:`comm_finalize` and :meth:`comm_destroy` (or :meth:`comm_abort` after an error).
    * Buffers are device pointers (``int``); counts are in elements of ``dtype`` (an
      ``NCCL_*`` type above); ``stream`` is a :class:`Backend` stream handle on the
      communicator's device. In-place operations pass the same pointer twice.
    * Several ranks driven by one thread (a single-process clique from
      :meth:`comm_init_all`) must issue their calls between :meth:`group_start` and
      :meth:`group_end`, or NCCL waits forever for the peers; callers always group them.
    * Failures raise :class:`cudalab.NcclError` carrying NCCL's result code, its name and
      NCCL's own message (``ncclGetLastError`` where it says more).
    """

    simulated: bool = False

    @abc.abstractmethod
    def version(self) -> int:
        """NCCL's version as NCCL packs it: ``major * 10000 + minor * 100 + patch``."""

    @abc.abstractmethod
    def unique_id(self) -> bytes:
        """A fresh ``ncclUniqueId`` (:data:`NCCL_UNIQUE_ID_SIZE` bytes) for :meth:`comm_init_rank`."""

    @abc.abstractmethod
    def comm_init_all(self, devices: Sequence[int]) -> list[CommHandle]:
        """One communicator per device of a single-process clique; rank ``i`` is ``devices[i]``
        (pairwise distinct). Leaves the calling thread's current context as it was."""

    @abc.abstractmethod
    def comm_init_rank(self, device: int, nranks: int, unique_id: bytes, rank: int) -> CommHandle:
        """This process's rank of an ``nranks`` communicator bootstrapped by ``unique_id``,
        bound to ``device``. Blocks until every rank has joined (a collective call)."""

    @abc.abstractmethod
    def comm_finalize(self, comm: CommHandle) -> None:
        """Flush the communicator's pending work (collective over its ranks; group it)."""

    @abc.abstractmethod
    def comm_destroy(self, comm: CommHandle) -> None:
        """Free the communicator's resources (after :meth:`comm_finalize`)."""

    @abc.abstractmethod
    def comm_abort(self, comm: CommHandle) -> None:
        """Abandon the communicator's pending work and free it (after an error)."""

    @abc.abstractmethod
    def comm_async_error(self, comm: CommHandle) -> int:
        """The communicator's asynchronous error code (0: none), never raising."""

    @abc.abstractmethod
    def error_text(self, code: int, comm: CommHandle | None = None) -> str:
        """NCCL's description of result ``code`` (``ncclGetErrorString``), followed by
        ``comm``'s last error message (``ncclGetLastError``) when NCCL keeps one. Never raises."""

    @abc.abstractmethod
    def comm_rank(self, comm: CommHandle) -> int:
        """The communicator's rank."""

    @abc.abstractmethod
    def comm_count(self, comm: CommHandle) -> int:
        """The communicator's number of ranks."""

    @abc.abstractmethod
    def comm_device(self, comm: CommHandle) -> int:
        """The device ordinal the communicator is bound to."""

    @abc.abstractmethod
    def group_start(self) -> None:
        """Open a group: the calls until :meth:`group_end` are launched together."""

    @abc.abstractmethod
    def group_end(self) -> None:
        """Close the group opened by :meth:`group_start` and launch its calls."""

    @abc.abstractmethod
    def all_reduce(self, send: int, recv: int, count: int, dtype: int, op: int, comm: CommHandle,
                   stream: StreamHandle) -> None:
        """``recv = op(send of every rank)`` on every rank."""

    @abc.abstractmethod
    def broadcast(self, send: int, recv: int, count: int, dtype: int, root: int, comm: CommHandle,
                  stream: StreamHandle) -> None:
        """``recv = send of root`` on every rank (``send`` is read on the root only)."""

    @abc.abstractmethod
    def reduce(self, send: int, recv: int, count: int, dtype: int, op: int, root: int,
               comm: CommHandle, stream: StreamHandle) -> None:
        """``recv = op(send of every rank)`` on the root (``recv`` is ignored elsewhere)."""

    @abc.abstractmethod
    def all_gather(self, send: int, recv: int, send_count: int, dtype: int, comm: CommHandle,
                   stream: StreamHandle) -> None:
        """``recv[r * send_count:(r + 1) * send_count] = send of rank r`` on every rank."""

    @abc.abstractmethod
    def reduce_scatter(self, send: int, recv: int, recv_count: int, dtype: int, op: int,
                       comm: CommHandle, stream: StreamHandle) -> None:
        """``recv = op(send[rank * recv_count:(rank + 1) * recv_count] of every rank)``."""

    def group_call(self, call: int, count: int, dtype: int, op: int, root: int,
                   sends: Sequence[int], recvs: Sequence[int], comms: Sequence[CommHandle],
                   streams: Sequence[StreamHandle]) -> None:
        """One collective on every rank of a single-process clique, in one group.

        Rank ``i`` runs collective ``call`` (an ``NCCL_CALL_*`` value) with ``sends[i]``,
        ``recvs[i]``, ``comms[i]`` and ``streams[i]`` and the shared ``count`` (the receive
        count of reduce_scatter, the send count of all_gather), ``dtype``, ``op`` (ignored by
        broadcast and all_gather) and ``root`` (used by broadcast and reduce only). The
        calling thread's current context is as it was afterwards. A failed call still closes
        the group, and raises its :class:`cudalab.NcclError`.

        This default makes :meth:`group_start`, the per-rank calls and :meth:`group_end`; a
        backend may make them in one step (the real one does, from C).
        """
        if not 0 <= call < len(NCCL_CALL_NAMES):
            raise ValueError(f"group_call(): unknown collective {call!r}")
        self.group_start()
        try:
            for send, recv, comm, stream in zip(sends, recvs, comms, streams):
                if call == NCCL_CALL_ALL_REDUCE:
                    self.all_reduce(send, recv, count, dtype, op, comm, stream)
                elif call == NCCL_CALL_BROADCAST:
                    self.broadcast(send, recv, count, dtype, root, comm, stream)
                elif call == NCCL_CALL_REDUCE:
                    self.reduce(send, recv, count, dtype, op, root, comm, stream)
                elif call == NCCL_CALL_ALL_GATHER:
                    self.all_gather(send, recv, count, dtype, comm, stream)
                else:
                    self.reduce_scatter(send, recv, count, dtype, op, comm, stream)
        except BaseException:
            try:
                self.group_end()  # NCCL launches nothing of a group with a failed call
            except NcclError:
                pass
            raise
        self.group_end()

    def group_runner(self, comms: Sequence[CommHandle]) -> GroupRunner:
        """:meth:`group_call` bound to one single-process clique, for a caller that issues many
        collectives on it (:mod:`cudalab.nccl`'s communicator cache).

        Returns ``run(call, count, dtype, op, root, sends, recvs, streams)``, which does what
        ``group_call(call, count, dtype, op, root, sends, recvs, comms, streams)`` does. The
        communicators are checked here, once; ``run`` trusts its other arguments to be what
        the caller has already checked (a known ``call``, ``count`` >= 0, an NCCL data type,
        an operator and a root in range, one send, receive and stream per rank), and refuses
        a destroyed communicator. This default binds :meth:`group_call`; a backend may check
        less per call (the real one calls its C group call directly).
        """
        bound = tuple(comms)

        def run(call: int, count: int, dtype: int, op: int, root: int, sends: Sequence[int],
                recvs: Sequence[int], streams: Sequence[StreamHandle]) -> None:
            self.group_call(call, count, dtype, op, root, sends, recvs, bound, streams)

        return run

    @abc.abstractmethod
    def send(self, buffer: int, count: int, dtype: int, peer: int, comm: CommHandle,
             stream: StreamHandle) -> None:
        """Send ``count`` elements to rank ``peer`` (which posts the matching :meth:`recv`)."""

    @abc.abstractmethod
    def recv(self, buffer: int, count: int, dtype: int, peer: int, comm: CommHandle,
             stream: StreamHandle) -> None:
        """Receive ``count`` elements from rank ``peer``."""
