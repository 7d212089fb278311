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
    NCCL_CALL_ALL_GATHER,
    NCCL_CALL_BROADCAST,
    NCCL_CALL_NAMES,
    NCCL_CALL_REDUCE,
    NCCL_FLOAT8E5M2,
    NCCL_INT8,
    NCCL_RESULTS,
    NCCL_SUM,
    NCCL_UNIQUE_ID_SIZE,
    GroupRunner,
    Nccl,
)
from cudalab._driver.cuda_api import (
    FAST,
    cuCtxGetCurrent,
    cuCtxSetCurrent,
    cuda_error,
    fastcall_turned_off,
)
from cudalab._driver.handles import CommHandle, OpaqueHandle, StreamHandle
from cudalab.errors import NcclError

try:  # optional C group call (setup.py builds it; see RealNccl._bind_group_call)
    from cudalab._driver import ncclcall  # type: ignore[attr-defined]  # C, no stub
except ImportError:  # pragma: no cover - a pure-Python install
    ncclcall = None

__all__ = ["RealComm", "RealNccl", "NOT_INSTALLED"]

#: The message when nccl4py cannot be imported.
NOT_INSTALLED = ("NCCL is not available: the 'nccl4py' package is not installed "
                 "(pip install 'cudalab[nccl]')")

#: The NCCL entry points the C group call takes, in ncclcall.setup's order.
_GROUP_CALL_SYMBOLS = ("ncclGroupStart", "ncclGroupEnd", *NCCL_CALL_NAMES)

#: ncclResult_t names, as nccl.h spells them.
RESULT_NAMES = {code: name for code, (name, _text) in NCCL_RESULTS.items()}  # from the one table
NCCL_INVALID_ARGUMENT = 4


class RealComm(OpaqueHandle):
    """A communicator handle of :class:`RealNccl`.

    ``comm`` is nccl4py's ``Comm`` (None once destroyed or aborted: the handle is then
    dead); ``device``, ``rank`` and ``nranks`` are NCCL's answers read at creation. For the C
    group call, read once: ``address``, the ``ncclComm_t`` as an int (0 where nccl4py's
    handle has none), and ``context``, the address of the device's primary context (which
    the backend retains for the life of the process).
    """

    __slots__ = ("comm", "address", "context", "device", "rank", "nranks", "__weakref__")

    def __init__(self, comm: Any, device: int, rank: int, nranks: int, context: int = 0):
        self.comm = comm  # nccl4py's Comm; None once destroyed or aborted
        try:
            self.address = int(comm)
        except (TypeError, ValueError):
            self.address = 0
        self.context = context
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
        #: ncclcall.group_call once its entry points are set (None: nccl4py's Python calls)
        self._group_call: Callable[..., Any] | None = self._bind_group_call()

    def _bind_group_call(self) -> Callable[..., Any] | None:
        """Give the C group call the entry points of the libnccl nccl4py loaded and the
        driver's context calls; None (nccl4py's Python calls) where the extension is not
        built, ``CUDALAB_FASTCALL=0`` or an address is missing."""
        if ncclcall is None or fastcall_turned_off():
            return None
        try:
            from nccl.bindings._internal import nccl as loader

            def nccl_address(name: str) -> int:
                for key in (name, "__" + name, "_" + name):
                    try:
                        address = int(loader._inspect_function_pointer(key))
                    except Exception:  # noqa: BLE001 - an unknown name: the next spelling
                        continue
                    if address:
                        return address
                return 0

            addresses = [nccl_address(n) for n in _GROUP_CALL_SYMBOLS]
            addresses += [self._b.entry_point(b"cuCtxGetCurrent"),
                          self._b.entry_point(b"cuCtxSetCurrent")]
        except Exception:  # noqa: BLE001 - an nccl4py without the loader's inspection, a fake
            return None
        if not all(addresses):
            return None
        ncclcall.setup(*addresses)
        return ncclcall.group_call

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
    def comm_init_all(self, devices: Sequence[int]) -> list[CommHandle]:
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
        return [CommHandle(RealComm(self._wrap(c), d, r, len(devs), self._b.context_int(d)))
                for r, (c, d) in enumerate(zip(comms, devs))]

    def comm_init_rank(self, device: int, nranks: int, unique_id: bytes, rank: int) -> CommHandle:
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
        return CommHandle(RealComm(self._wrap(comm), d, r, n, self._b.context_int(d)))

    def comm_finalize(self, comm: CommHandle) -> None:
        c = self._comm(comm, "ncclCommFinalize")
        self._call("ncclCommFinalize", c.comm, self._nccl.comm_finalize, c.comm)

    def comm_destroy(self, comm: CommHandle) -> None:
        c = self._comm(comm, "ncclCommDestroy")
        self._call("ncclCommDestroy", c.comm, self._nccl.comm_destroy, c.comm)
        c.comm = None

    def comm_abort(self, comm: CommHandle) -> None:
        c = self._comm(comm, "ncclCommAbort")
        try:
            self._call("ncclCommAbort", c.comm, self._nccl.comm_abort, c.comm)
        finally:
            c.comm = None  # an aborted communicator is gone, even when abort reported an error

    def comm_async_error(self, comm: CommHandle) -> int:
        if not isinstance(comm, RealComm) or comm.comm is None:
            return NCCL_INVALID_ARGUMENT
        try:
            return int(self._nccl.comm_get_async_error(comm.comm))
        except self._nccl.NCCLError as exc:
            return int(exc.status)
        except Exception:
            return NCCL_INVALID_ARGUMENT

    def comm_rank(self, comm: CommHandle) -> int:
        return self._comm(comm, "ncclCommUserRank").rank

    def comm_count(self, comm: CommHandle) -> int:
        return self._comm(comm, "ncclCommCount").nranks

    def comm_device(self, comm: CommHandle) -> int:
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

    def group_call(self, call: int, count: int, dtype: int, op: int, root: int,
                   sends: Sequence[int], recvs: Sequence[int], comms: Sequence[CommHandle],
                   streams: Sequence[StreamHandle]) -> None:
        """:meth:`Nccl.group_call` in one C call where it is built (the whole group, the
        contexts set and put back, with the GIL released); else the per-rank Python calls.

        The cheap arguments are checked first, with the messages of the per-rank calls."""
        fast = self._group_call
        if fast is None or not 0 <= call < len(NCCL_CALL_NAMES):
            return super().group_call(call, count, dtype, op, root, sends, recvs, comms,
                                      streams)
        name = NCCL_CALL_NAMES[call]
        rooted = call == NCCL_CALL_BROADCAST or call == NCCL_CALL_REDUCE
        checked_op = op if call != NCCL_CALL_BROADCAST and call != NCCL_CALL_ALL_GATHER else \
            NCCL_SUM
        checked_root = root if rooted else 0
        first = comms[0] if comms else None
        ranks: list[tuple[Any, ...]] = []
        if (type(first) is RealComm and type(count) is int and count >= 0
                and type(dtype) is int and NCCL_INT8 <= dtype <= NCCL_FLOAT8E5M2
                and type(checked_op) is int and NCCL_SUM <= checked_op <= NCCL_AVG
                and type(checked_root) is int and 0 <= checked_root < first.nranks):
            # The shared arguments checked once, then each rank's handle: plain values in one
            # pass (the 1 KiB reduce_add row of benchmarks/comm.py). Streams go to C as they
            # are (int() of a handle object there). Anything else: the per-rank checks below.
            for send, recv, comm, stream in zip(sends, recvs, comms, streams):
                if (type(comm) is not RealComm or comm.comm is None or not comm.address
                        or not comm.context or comm.nranks != first.nranks
                        or type(send) is not int or type(recv) is not int):
                    break
                ranks.append((comm.context, send, recv, comm.address, stream))
        if len(ranks) != len(comms):
            ranks = []
            for send, recv, comm, stream in zip(sends, recvs, comms, streams):
                c = self._checked(comm, name, count, dtype, checked_op,
                                  root if rooted else None)
                if not (c.address and c.context):  # (no addresses: nccl4py's calls)
                    return super().group_call(call, count, dtype, op, root, sends, recvs,
                                              comms, streams)
                ranks.append((c.context, _ptr(send), _ptr(recv), c.address,
                              self._b.handle_int(stream)))
        failure = fast(call, count, dtype, checked_op, checked_root, tuple(ranks))
        if failure is not None:
            self._raise_group_failure(name, failure, comms)

    def group_runner(self, comms: Sequence[CommHandle]) -> GroupRunner:
        """:meth:`Nccl.group_runner`: where the C group call is bound and every communicator
        is a live :class:`RealComm` with its addresses, each rank's context and
        ``ncclComm_t`` are read here, once, and ``run`` passes them to C with the per-call
        values (the small-size rows of benchmarks/comm.py); otherwise the checked
        :meth:`group_call`."""
        fast = self._group_call
        bound = tuple(comms)
        first = bound[0] if bound else None
        if (fast is None or type(first) is not RealComm
                or not all(type(c) is RealComm and c.comm is not None and c.address
                           and c.context and c.nranks == first.nranks for c in bound)):
            return super().group_runner(bound)
        contexts = tuple(c.context for c in bound)
        addresses = tuple(c.address for c in bound)
        raise_failure = self._raise_group_failure

        def run(call: int, count: int, dtype: int, op: int, root: int, sends: Sequence[int],
                recvs: Sequence[int], streams: Sequence[StreamHandle]) -> None:
            for c in bound:  # (destroyed since: its address is stale, never pass it to NCCL)
                if c.comm is None:
                    raise _invalid(NCCL_CALL_NAMES[call], f"{c!r} was destroyed or aborted")
            failure = fast(call, count, dtype, op, root,
                           tuple(zip(contexts, sends, recvs, addresses, streams)))
            if failure is not None:
                raise_failure(NCCL_CALL_NAMES[call], failure, bound)

        return run

    def _raise_group_failure(self, name: str, failure: tuple[int, int, int],
                             comms: Sequence[CommHandle]) -> None:
        """Raise what the per-rank calls would have raised for ncclcall's ``failure``."""
        stage, rank, code = failure
        if stage in (ncclcall.STAGE_SAVE_CONTEXT, ncclcall.STAGE_SET_CONTEXT,
                     ncclcall.STAGE_RESTORE_CONTEXT):
            call = "cuCtxGetCurrent" if stage == ncclcall.STAGE_SAVE_CONTEXT else \
                "cuCtxSetCurrent"
            raise cuda_error(code, call)
        if stage == ncclcall.STAGE_CALL:
            raise self._error(name, getattr(comms[rank], "comm", None), code)
        call = "ncclGroupStart" if stage == ncclcall.STAGE_GROUP_START else "ncclGroupEnd"
        raise self._error(call, None, code)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, send: int, recv: int, count: int, dtype: int, op: int, comm: CommHandle,
                   stream: StreamHandle) -> None:
        call = "ncclAllReduce"
        c = self._ready(comm, call, count, dtype, op)
        self._call(call, c.comm, self._nccl.all_reduce, _ptr(send), _ptr(recv), count, dtype,
                   op, c.comm, self._b.handle_int(stream))

    def broadcast(self, send: int, recv: int, count: int, dtype: int, root: int, comm: CommHandle,
                  stream: StreamHandle) -> None:
        call = "ncclBroadcast"
        c = self._ready(comm, call, count, dtype, NCCL_SUM, root)
        self._call(call, c.comm, self._nccl.broadcast, _ptr(send), _ptr(recv), count, dtype,
                   root, c.comm, self._b.handle_int(stream))

    def reduce(self, send: int, recv: int, count: int, dtype: int, op: int, root: int,
               comm: CommHandle, stream: StreamHandle) -> None:
        call = "ncclReduce"
        c = self._ready(comm, call, count, dtype, op, root)
        self._call(call, c.comm, self._nccl.reduce, _ptr(send), _ptr(recv), count, dtype, op,
                   root, c.comm, self._b.handle_int(stream))

    def all_gather(self, send: int, recv: int, send_count: int, dtype: int, comm: CommHandle,
                   stream: StreamHandle) -> None:
        call = "ncclAllGather"
        c = self._ready(comm, call, send_count, dtype, NCCL_SUM)
        self._call(call, c.comm, self._nccl.all_gather, _ptr(send), _ptr(recv), send_count,
                   dtype, c.comm, self._b.handle_int(stream))

    def reduce_scatter(self, send: int, recv: int, recv_count: int, dtype: int, op: int,
                       comm: CommHandle, stream: StreamHandle) -> None:
        call = "ncclReduceScatter"
        c = self._ready(comm, call, recv_count, dtype, op)
        self._call(call, c.comm, self._nccl.reduce_scatter, _ptr(send), _ptr(recv), recv_count,
                   dtype, op, c.comm, self._b.handle_int(stream))

    def send(self, buffer: int, count: int, dtype: int, peer: int, comm: CommHandle,
             stream: StreamHandle) -> None:
        call = "ncclSend"
        c = self._ready(comm, call, count, dtype, NCCL_SUM, peer=peer)
        self._call(call, c.comm, self._nccl.send, _ptr(buffer), count, dtype, peer, c.comm,
                   self._b.handle_int(stream))

    def recv(self, buffer: int, count: int, dtype: int, peer: int, comm: CommHandle,
             stream: StreamHandle) -> None:
        call = "ncclRecv"
        c = self._ready(comm, call, count, dtype, NCCL_SUM, peer=peer)
        self._call(call, c.comm, self._nccl.recv, _ptr(buffer), count, dtype, peer, c.comm,
                   self._b.handle_int(stream))

    # ================================================================ internals
    def _comm(self, comm: CommHandle, call: str) -> RealComm:
        if not isinstance(comm, RealComm):
            raise _invalid(call, f"{comm!r} is not a communicator of this NCCL backend")
        if comm.comm is None:
            raise _invalid(call, f"{comm!r} was destroyed or aborted")
        return comm

    def _ready(self, comm: CommHandle, call: str, count: Any, dtype: Any, op: Any,
               root: Any = None, peer: Any = None) -> RealComm:
        """Check the cheap arguments, then make the communicator's device current."""
        c = self._checked(comm, call, count, dtype, op, root, peer)
        self._b.set_context(c.device)
        return c

    def _checked(self, comm: CommHandle, call: str, count: Any, dtype: Any, op: Any,
                 root: Any = None, peer: Any = None) -> RealComm:
        """The live communicator ``comm`` once the cheap arguments are checked."""
        if (type(comm) is RealComm and comm.comm is not None and type(count) is int
                and count >= 0 and type(dtype) is int and NCCL_INT8 <= dtype <= NCCL_FLOAT8E5M2
                and type(op) is int and NCCL_SUM <= op <= NCCL_AVG
                and (root is None or type(root) is int and 0 <= root < comm.nranks)
                and (peer is None or type(peer) is int and 0 <= peer < comm.nranks)):
            # plain ints, all in range: the common case in one expression (the 1 KiB rows of
            # benchmarks/comm.py); anything else takes the checks below, which name the fault
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

    def error_text(self, code: int, comm: CommHandle | None = None) -> str:
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
        err, ctx = cuCtxGetCurrent()
        return ctx if not int(err) else None

    def _restore_context(self, ctx: Any) -> None:
        if ctx is None:
            return
        get, set_current = FAST.ctx_get_current, FAST.ctx_set_current
        if type(ctx) is int and get is not None and set_current is not None:
            if get() != ctx:
                set_current(ctx)
            return
        err, now = cuCtxGetCurrent()
        if not int(err) and int(now) != int(ctx):
            cuCtxSetCurrent(ctx)


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
