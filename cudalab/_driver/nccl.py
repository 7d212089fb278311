"""The real NCCL backend: :class:`RealNccl` over nccl4py's raw bindings (``nccl.bindings.nccl``).

nccl4py 0.6's raw layer is a 1:1 Cython binding of NCCL's C API: buffers and streams are
ints, communicators are ``nccl.bindings.nccl.Comm`` objects (what ``comm_init_all`` and
``comm_init_rank`` return), and every failed call raises ``nccl.bindings.nccl.NCCLError``
whose ``status`` is the ``ncclResult_t``. This module imports it on first use (constructing
:class:`RealNccl`), never at ``import cudalab``.

Handles
-------
The communicator handles this backend returns are :class:`RealComm` objects: the nccl4py
``Comm`` (kept alive here, so NCCL's communicator lives as long as the handle is not
destroyed) with the device, rank and size read once at creation. After
:meth:`RealNccl.comm_destroy` or :meth:`RealNccl.comm_abort` the handle holds no ``Comm``
and every further use raises :class:`cudalab.NcclError` (``ncclInvalidArgument``) instead of
touching freed memory.

Contexts
--------
Calls bound to a device (``comm_init_rank``, every collective and send/receive) first make
that device's primary context current through the backend (``backend.set_context``).
``comm_init_all`` and ``group_end`` leave the thread's current context as it was (NCCL may
switch devices inside them); stream handles are the backend's, converted with
``backend.handle_int``.

Errors
------
Every failure becomes :class:`cudalab.NcclError` with NCCL's code and name and a message
like ``ncclAllReduce: ncclInvalidArgument (4): invalid argument (run with NCCL_DEBUG=WARN for
details) - <ncclGetLastError text>``. Cheap arguments (counts, types, reductions, roots, the
unique id's size) are checked here before NCCL is called.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

from cudalab._driver.base import (
    NCCL_AVG,
    NCCL_FLOAT8E5M2,
    NCCL_INT8,
    NCCL_RESULTS,
    NCCL_SUM,
    NCCL_UNIQUE_ID_SIZE,
    Nccl,
)
from cudalab._driver.cuda_api import FAST, _cuCtxGetCurrent, _cuCtxSetCurrent
from cudalab.errors import NcclError

__all__ = ["RealComm", "RealNccl", "NOT_INSTALLED"]

#: The message when nccl4py cannot be imported.
NOT_INSTALLED = ("NCCL is not available: the 'nccl4py' package is not installed "
                 "(pip install 'cudalab[nccl]')")

#: ncclResult_t names, as nccl.h spells them.
RESULT_NAMES = {code: name for code, (name, _text) in NCCL_RESULTS.items()}  # from the one table
NCCL_INVALID_ARGUMENT = 4


class RealComm:
    """A communicator handle of :class:`RealNccl`.

    ``comm`` is nccl4py's ``Comm`` (None once destroyed or aborted: the handle is then
    dead); ``device``, ``rank`` and ``nranks`` are NCCL's answers read at creation.
    """

    __slots__ = ("comm", "device", "rank", "nranks", "__weakref__")

    def __init__(self, comm: Any, device: int, rank: int, nranks: int):
        self.comm = comm
        self.device = device
        self.rank = rank
        self.nranks = nranks

    def __repr__(self) -> str:
        state = "" if self.comm is not None else ", destroyed"
        return (f"<NCCL communicator: rank {self.rank} of {self.nranks} on device "
                f"{self.device}{state}>")


class RealNccl(Nccl):
    """NCCL through nccl4py's raw bindings (see the module docstring).

    Parameters
    ----------
    backend : CudaBackend
        The driver backend: its primary contexts and stream handles.

    Raises
    ------
    cudalab.NcclError
        When nccl4py is not installed (code None; the ImportError is chained).
    """

    simulated = False

    def __init__(self, backend: Any):
        try:
            from nccl.bindings import nccl as bindings
        except ImportError as exc:
            raise NcclError(NOT_INSTALLED, None) from exc
        self._b = backend
        self._nccl = bindings

    # ------------------------------------------------------------------ identity
    def version(self) -> int:
        return int(self._call("ncclGetVersion", None, self._nccl.get_version))

    def unique_id(self) -> bytes:
        uid = self._call("ncclGetUniqueId", None, self._nccl.get_unique_id)
        data = bytes(uid)
        if len(data) != NCCL_UNIQUE_ID_SIZE:
            raise NcclError(f"ncclGetUniqueId: nccl4py returned {len(data)} bytes, expected "
                            f"{NCCL_UNIQUE_ID_SIZE}", None)
        return data

    # ------------------------------------------------------------------ communicators
    def comm_init_all(self, devices: Sequence[int]) -> list[Any]:
        call = "ncclCommInitAll"
        try:
            devs = [operator.index(d) for d in devices]
        except TypeError:
            raise _invalid(call, f"devices must be ints, got {list(devices)!r}") from None
        if not devs:
            raise _invalid(call, "no devices given")
        if len(set(devs)) != len(devs):
            raise _invalid(call, f"devices {devs} are not pairwise distinct (one rank per device)")
        saved = self._current_context()
        try:
            comms = self._call(call, None, self._nccl.comm_init_all, len(devs), devs)
        finally:
            self._restore_context(saved)
        # Keep the Comm objects: rank i is devs[i] (ncclCommInitAll's contract).
        return [RealComm(self._wrap(c), d, r, len(devs))
                for r, (c, d) in enumerate(zip(comms, devs))]

    def comm_init_rank(self, device: int, nranks: int, unique_id: bytes, rank: int) -> Any:
        call = "ncclCommInitRank"
        uid = bytes(unique_id) if isinstance(unique_id, (bytes, bytearray, memoryview)) else None
        if uid is None or len(uid) != NCCL_UNIQUE_ID_SIZE:
            got = "not bytes" if uid is None else f"{len(uid)} bytes"
            raise _invalid(call, f"invalid unique_id (expected {NCCL_UNIQUE_ID_SIZE} bytes, "
                                 f"got {got})")
        n, r = operator.index(nranks), operator.index(rank)
        if n < 1 or not 0 <= r < n:
            raise _invalid(call, f"rank {r} is not in [0, {n})")
        d = operator.index(device)
        self._b.set_context(d)
        # a writable 128-byte buffer: nccl4py reads it as the ncclUniqueId
        comm = self._call(call, None, self._nccl.comm_init_rank, n, bytearray(uid), r)
        return RealComm(self._wrap(comm), d, r, n)

    def comm_finalize(self, comm: Any) -> None:
        c = self._comm(comm, "ncclCommFinalize")
        self._call("ncclCommFinalize", c.comm, self._nccl.comm_finalize, c.comm)

    def comm_destroy(self, comm: Any) -> None:
        c = self._comm(comm, "ncclCommDestroy")
        self._call("ncclCommDestroy", c.comm, self._nccl.comm_destroy, c.comm)
        c.comm = None

    def comm_abort(self, comm: Any) -> None:
        c = self._comm(comm, "ncclCommAbort")
        try:
            self._call("ncclCommAbort", c.comm, self._nccl.comm_abort, c.comm)
        finally:
            c.comm = None  # an aborted communicator is gone, even when abort reported an error

    def comm_async_error(self, comm: Any) -> int:
        if not isinstance(comm, RealComm) or comm.comm is None:
            return NCCL_INVALID_ARGUMENT
        try:
            return int(self._nccl.comm_get_async_error(comm.comm))
        except self._nccl.NCCLError as exc:
            return int(exc.status)
        except Exception:
            return NCCL_INVALID_ARGUMENT

    def comm_rank(self, comm: Any) -> int:
        return self._comm(comm, "ncclCommUserRank").rank

    def comm_count(self, comm: Any) -> int:
        return self._comm(comm, "ncclCommCount").nranks

    def comm_device(self, comm: Any) -> int:
        return self._comm(comm, "ncclCommCuDevice").device

    # ------------------------------------------------------------------ groups
    def group_start(self) -> None:
        self._call("ncclGroupStart", None, self._nccl.group_start)

    def group_end(self) -> None:
        saved = self._current_context()
        try:
            self._call("ncclGroupEnd", None, self._nccl.group_end)
        finally:
            self._restore_context(saved)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, send: int, recv: int, count: int, dtype: int, op: int, comm: Any,
                   stream: Any) -> None:
        call = "ncclAllReduce"
        c = self._ready(comm, call, count, dtype, op)
        self._call(call, c.comm, self._nccl.all_reduce, _ptr(send), _ptr(recv), count, dtype,
                   op, c.comm, self._b.handle_int(stream))

    def broadcast(self, send: int, recv: int, count: int, dtype: int, root: int, comm: Any,
                  stream: Any) -> None:
        call = "ncclBroadcast"
        c = self._ready(comm, call, count, dtype, NCCL_SUM, root)
        self._call(call, c.comm, self._nccl.broadcast, _ptr(send), _ptr(recv), count, dtype,
                   root, c.comm, self._b.handle_int(stream))

    def reduce(self, send: int, recv: int, count: int, dtype: int, op: int, root: int,
               comm: Any, stream: Any) -> None:
        call = "ncclReduce"
        c = self._ready(comm, call, count, dtype, op, root)
        self._call(call, c.comm, self._nccl.reduce, _ptr(send), _ptr(recv), count, dtype, op,
                   root, c.comm, self._b.handle_int(stream))

    def all_gather(self, send: int, recv: int, send_count: int, dtype: int, comm: Any,
                   stream: Any) -> None:
        call = "ncclAllGather"
        c = self._ready(comm, call, send_count, dtype, NCCL_SUM)
        self._call(call, c.comm, self._nccl.all_gather, _ptr(send), _ptr(recv), send_count,
                   dtype, c.comm, self._b.handle_int(stream))

    def reduce_scatter(self, send: int, recv: int, recv_count: int, dtype: int, op: int,
                       comm: Any, stream: Any) -> None:
        call = "ncclReduceScatter"
        c = self._ready(comm, call, recv_count, dtype, op)
        self._call(call, c.comm, self._nccl.reduce_scatter, _ptr(send), _ptr(recv), recv_count,
                   dtype, op, c.comm, self._b.handle_int(stream))

    def send(self, buffer: int, count: int, dtype: int, peer: int, comm: Any,
             stream: Any) -> None:
        call = "ncclSend"
        c = self._ready(comm, call, count, dtype, NCCL_SUM, peer=peer)
        self._call(call, c.comm, self._nccl.send, _ptr(buffer), count, dtype, peer, c.comm,
                   self._b.handle_int(stream))

    def recv(self, buffer: int, count: int, dtype: int, peer: int, comm: Any,
             stream: Any) -> None:
        call = "ncclRecv"
        c = self._ready(comm, call, count, dtype, NCCL_SUM, peer=peer)
        self._call(call, c.comm, self._nccl.recv, _ptr(buffer), count, dtype, peer, c.comm,
                   self._b.handle_int(stream))

    # ================================================================ internals
    def _comm(self, comm: Any, call: str) -> RealComm:
        if not isinstance(comm, RealComm):
            raise _invalid(call, f"{comm!r} is not a communicator of this NCCL backend")
        if comm.comm is None:
            raise _invalid(call, f"{comm!r} was destroyed or aborted")
        return comm

    def _ready(self, comm: Any, call: str, count: Any, dtype: Any, op: Any,
               root: Any = None, peer: Any = None) -> RealComm:
        """Check the cheap arguments, then make the communicator's device current."""
        if (type(comm) is RealComm and comm.comm is not None and type(count) is int
                and count >= 0 and type(dtype) is int and NCCL_INT8 <= dtype <= NCCL_FLOAT8E5M2
                and type(op) is int and NCCL_SUM <= op <= NCCL_AVG
                and (root is None or type(root) is int and 0 <= root < comm.nranks)
                and (peer is None or type(peer) is int and 0 <= peer < comm.nranks)):
            # plain ints, all in range: the common case in one expression (the 1 KiB rows of
            # benchmarks/comm.py); anything else takes the checks below, which name the fault
            self._b.set_context(comm.device)
            return comm
        c = self._comm(comm, call)
        n = _int(count)
        if n is None or n < 0:
            raise _invalid(call, f"count must be an int >= 0, got {count!r}")
        dt = _int(dtype)
        if dt is None or not NCCL_INT8 <= dt <= NCCL_FLOAT8E5M2:
            raise _invalid(call, f"unknown datatype {dtype!r}")
        o = _int(op)
        if o is None or not NCCL_SUM <= o <= NCCL_AVG:
            raise _invalid(call, f"unknown reduction operation {op!r} (0..4: sum, prod, max, "
                                 "min, avg)")
        for what, value in (("root", root), ("peer", peer)):
            rank = _int(value)
            if value is not None and (rank is None or not 0 <= rank < c.nranks):
                raise _invalid(call, f"{what} {value!r} is not a rank of this {c.nranks}-rank "
                                     "communicator")
        self._b.set_context(c.device)
        return c

    def _call(self, call: str, comm: Any, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, nccl4py's failures turned into :class:`NcclError`."""
        try:
            return fn(*args)
        except self._nccl.NCCLError as exc:
            status = getattr(exc, "status", None)
            code = int(status) if status is not None else -1
            raise self._error(call, comm, code) from exc
        except (TypeError, ValueError, OverflowError) as exc:
            raise _invalid(call, f"{type(exc).__name__}: {exc}") from exc
        except RuntimeError as exc:  # libnccl not found or too old (nccl4py's loader)
            raise NcclError(f"{call}: NCCL could not be loaded or called "
                            f"({type(exc).__name__}: {exc})", None) from exc

    def _error(self, call: str, comm: Any, code: int) -> NcclError:
        name = RESULT_NAMES.get(code, f"ncclResult({code})")
        return NcclError(f"{call}: {name} ({code}): {self.error_text(code, comm)}", code, name)

    def error_text(self, code: int, comm: Any = None) -> str:
        try:
            text = self._nccl.get_error_string(code)
        except Exception:
            text = NCCL_RESULTS.get(code, ("", "unknown error"))[1]
        try:
            inner = getattr(comm, "comm", comm)  # a RealComm's nccl4py Comm (None once ended)
            last = self._nccl.get_last_error(inner if inner is not None else self._nccl.Comm())
        except Exception:
            last = ""
        return f"{text} - {last}" if last else text

    def _wrap(self, comm: Any) -> Any:
        """nccl4py's ``Comm`` (an older binding's plain handle int is wrapped in one)."""
        return self._nccl.Comm(comm) if isinstance(comm, int) else comm

    def _current_context(self) -> Any:
        get = FAST.ctx_get_current
        if get is not None:  # from C: an int address (group_end's check, every collective)
            return get()
        err, ctx = _cuCtxGetCurrent()
        return ctx if not int(err) else None

    def _restore_context(self, ctx: Any) -> None:
        if ctx is None:
            return
        get, set_current = FAST.ctx_get_current, FAST.ctx_set_current
        if type(ctx) is int and get is not None and set_current is not None:
            if get() != ctx:
                set_current(ctx)
            return
        err, now = _cuCtxGetCurrent()
        if not int(err) and int(now) != int(ctx):
            _cuCtxSetCurrent(ctx)


def _invalid(call: str, detail: str) -> NcclError:
    """ncclInvalidArgument, detected before NCCL is called."""
    return NcclError(f"{call}: ncclInvalidArgument ({NCCL_INVALID_ARGUMENT}): invalid argument "
                     f"- {detail}", NCCL_INVALID_ARGUMENT, "ncclInvalidArgument")


def _int(value: Any) -> int | None:
    """``value`` as an int (numpy integers too), or None when it is not an integer."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _ptr(value: Any) -> int:
    """A device pointer as an int (0 for None: NCCL's null, e.g. reduce's recv off the root)."""
    return 0 if value is None else operator.index(value)
