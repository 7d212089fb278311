"""The simulator's NCCL: single-process cliques over simulated devices, computed with numpy.

:class:`SimulatedNccl` implements the seam's :class:`~cudalab._driver.base.Nccl` for the
simulator backend. Communicators come from :meth:`SimulatedNccl.comm_init_all` only (one
process drives every rank); :meth:`SimulatedNccl.comm_init_rank` refuses with a clear
error, since a multi-process communicator needs the real NCCL.

Groups, as NCCL has them
------------------------
Calls between :meth:`~SimulatedNccl.group_start` and :meth:`~SimulatedNccl.group_end` are
collected per thread (nested groups count depth, as in NCCL). At the outermost
``group_end`` every collective must have been posted by every rank of its clique, in the
same order, with the same operation, count, type, reduction and root; every send must meet
the receive of its peer (same count and type). Anything else raises
:class:`cudalab.NcclError` explaining that the real NCCL would hang, and nothing of the group
is launched. A collective of a multi-rank clique posted outside a group is refused (one
thread must group its ranks' calls, or NCCL waits forever); a single-rank clique's collective
outside a group just runs.

How a collective runs (the simplest design that keeps stream order)
-------------------------------------------------------------------
Each collective (or matched send/receive pair) is one *unit* over the streams of its
ranks. For a unit on streams ``s_0 … s_k`` the simulator queues, with the backend's own
public calls:

1. on every ``s_i``: an event record ``arrived_i`` (the rank reached the collective);
2. on every ``s_i``: a wait for every other ``arrived_j`` (``stream_wait_event``);
3. on every ``s_i``: the same host function, which runs the whole unit once (a lock and a
   flag: the first stream to get there computes, the others find it done).

So the unit's inputs are read after the work queued earlier on *every* participant's stream
(the waits), its outputs are written before later work on *any* participant's stream runs
(each stream's step 3 precedes that work, and finds the result complete), and the unit reads
all inputs into copies before it writes any output (in-place forms are safe). A paused
stream (``pause_stream``) holds its ``arrived`` record back, so the other ranks wait: the
collective is delayed, not broken; synchronising then raises the simulator's usual
"would wait forever" error, which names the paused stream through the event waits.

Values follow NCCL's definitions with numpy: sum, prod, max, min in the element type (integer
overflow wraps); avg multiplies each input by ``1/n`` in the element type then sums
(NCCL's PreMulSum) for floating types, and sums then divides with truncation toward zero
(NCCL's SumPostDiv) for integer types. bfloat16 and the two float8 types need the optional
``ml_dtypes`` package (NcclError without it). Summation order is rank order.

:meth:`SimulatedNccl.version` is a fixed :data:`SIMULATED_VERSION` (2.28.5), and
:meth:`SimulatedNccl.unique_id` 128 random bytes.
"""

from __future__ import annotations

import functools
import operator
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from cudalab._driver.base import (
    EVENT_DISABLE_TIMING,
    NCCL_AVG,
    NCCL_BFLOAT16,
    NCCL_FLOAT8E4M3,
    NCCL_FLOAT8E5M2,
    NCCL_FLOAT16,
    NCCL_FLOAT32,
    NCCL_INT8,
    NCCL_INT32,
    NCCL_MAX,
    NCCL_MIN,
    NCCL_NUMPY_NAMES,
    NCCL_PROD,
    NCCL_RESULTS,
    NCCL_SUM,
    NCCL_UINT8,
    NCCL_UINT32,
    NCCL_UNIQUE_ID_SIZE,
    Nccl,
)
from cudalab._driver.handles import CommHandle, OpaqueHandle, StreamHandle
from cudalab._driver.sim.handles import SimStream
from cudalab.errors import CudaError, NcclError

__all__ = ["SIMULATED_VERSION", "SimulatedNccl"]

#: The NCCL version the simulator reports: 2.28.5, packed as NCCL packs it.
SIMULATED_VERSION = 2 * 10000 + 28 * 100 + 5

#: ncclResult_t values the simulator raises.
NCCL_INVALID_ARGUMENT = 4
NCCL_INVALID_USAGE = 5

_ML_DTYPES = (NCCL_BFLOAT16, NCCL_FLOAT8E4M3, NCCL_FLOAT8E5M2)
_OPS = (NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG)
_ROOTED = ("broadcast", "reduce")
#: The C call of each kind of post (for messages).
_CALLS = {"all_reduce": "ncclAllReduce", "broadcast": "ncclBroadcast", "reduce": "ncclReduce",
          "all_gather": "ncclAllGather", "reduce_scatter": "ncclReduceScatter",
          "send": "ncclSend", "recv": "ncclRecv"}
_REDUCING = ("all_reduce", "reduce", "reduce_scatter")

# Communicator states (a comm only moves forward: LIVE -> FINALIZED -> DESTROYED).
LIVE, FINALIZED, DESTROYED = 0, 1, 2


def nccl_error(call: str, code: int, detail: str) -> NcclError:
    """An :class:`NcclError` worded like the real one: ``call: name (code): text - detail``."""
    name, text = NCCL_RESULTS[code]
    return NcclError(f"{call}: {name} ({code}): {text} - {detail}", code, name)


class _Clique:
    """The ranks made by one :meth:`SimulatedNccl.comm_init_all` (``comms[r]`` is rank r)."""

    __slots__ = ("comms", "devices")

    def __init__(self, devices: tuple[int, ...]):
        self.devices = devices
        self.comms: list[_SimComm] = []


class _SimComm(OpaqueHandle):
    """One rank of a simulated clique. ``state`` is LIVE, FINALIZED or DESTROYED."""

    __slots__ = ("clique", "rank", "device", "state")

    def __init__(self, clique: _Clique, rank: int, device: int):
        self.clique = clique
        self.rank = rank
        self.device = device
        self.state = LIVE

    def __repr__(self) -> str:
        states = ("live", "finalized", "destroyed")
        return (f"<simulated NCCL communicator: rank {self.rank} of {len(self.clique.comms)} "
                f"on device {self.device}, {states[self.state]}>")


class _Post:
    """One rank's call of a collective or send/receive, checked and waiting for its group.

    ``send``/``recv`` are host addresses of the simulated memory (0: not used by this rank);
    ``count`` is in elements (the per-rank count for all_gather, the per-rank output count
    for reduce_scatter, the message for send/recv)."""

    __slots__ = ("kind", "comm", "stream", "send", "recv", "count", "dtype", "op", "root",
                 "peer")

    def __init__(self, kind: str, comm: _SimComm, stream: SimStream, send: int, recv: int,
                 count: int, dtype: int, op: int = -1, root: int = -1, peer: int = -1):
        self.kind = kind
        self.comm = comm
        self.stream = stream
        self.send = send
        self.recv = recv
        self.count = count
        self.dtype = dtype
        self.op = op
        self.root = root
        self.peer = peer

    def signature(self) -> tuple[Any, ...]:
        """What every rank of a collective must agree on."""
        return (self.kind, self.count, self.dtype,
                self.op if self.kind in _REDUCING else None,
                self.root if self.kind in _ROOTED else None)

    def describe(self) -> str:
        kind, count, dtype, op, root = self.signature()
        text = f"{kind}(count={count}, dtype={NCCL_NUMPY_NAMES.get(dtype, dtype)}"
        if op is not None:
            text += f", op={('sum', 'prod', 'max', 'min', 'avg')[op]}"
        if root is not None:
            text += f", root={root}"
        return text + ")"


class _Once:
    """The unit's host function, queued on every participant's stream: the first stream to
    reach it runs ``compute``; the others find it done (the lock makes them wait for it)."""

    __slots__ = ("compute", "lock", "done")

    def __init__(self, compute: Callable[[], None]):
        self.compute = compute
        self.lock = threading.Lock()
        self.done = False  # True once compute returned (set under lock)

    def __call__(self) -> None:
        with self.lock:
            if not self.done:
                self.compute()
                self.done = True


def _poisons_group(method: Callable[..., None]) -> Callable[..., None]:
    """A call whose failure inside a group poisons the group, as in NCCL: the outermost
    ``group_end`` then launches nothing and reports the failure."""

    @functools.wraps(method)
    def call(self: SimulatedNccl, *args: Any) -> None:
        try:
            method(self, *args)
        except NcclError as exc:
            t = self._tls
            if getattr(t, "depth", 0) and getattr(t, "failed", None) is None:
                t.failed = exc
            raise

    return call


class SimulatedNccl(Nccl):
    """NCCL for the simulator backend (see the module docstring for the model).

    Parameters
    ----------
    backend : SimulatorBackend
        The simulator whose devices, memory and streams the collectives use.
    """

    simulated = True

    def __init__(self, backend: Any):
        self._b = backend
        # per thread: .depth (open groups), .posts (collected calls), .failed (the first
        # NcclError of a call in the open group, or None)
        self._tls = threading.local()

    # ------------------------------------------------------------------ identity
    def version(self) -> int:
        return SIMULATED_VERSION

    def unique_id(self) -> bytes:
        return os.urandom(NCCL_UNIQUE_ID_SIZE)

    # ------------------------------------------------------------------ communicators
    def comm_init_all(self, devices: Sequence[int]) -> list[CommHandle]:
        call = "ncclCommInitAll"
        try:
            devs = tuple(operator.index(d) for d in devices)
        except TypeError:
            raise nccl_error(call, NCCL_INVALID_ARGUMENT,
                             f"devices must be ints, got {list(devices)!r}") from None
        if not devs:
            raise nccl_error(call, NCCL_INVALID_ARGUMENT, "no devices given")
        count = self._b.device_count()
        for d in devs:
            if not 0 <= d < count:
                raise nccl_error(call, NCCL_INVALID_ARGUMENT,
                                 f"device {d} does not exist ({count} simulated devices)")
        if len(set(devs)) != len(devs):
            raise nccl_error(call, NCCL_INVALID_ARGUMENT,
                             f"devices {list(devs)} are not pairwise distinct (one rank per "
                             "device)")
        clique = _Clique(devs)
        clique.comms = [_SimComm(clique, r, d) for r, d in enumerate(devs)]
        return [CommHandle(comm) for comm in clique.comms]

    def comm_init_rank(self, device: int, nranks: int, unique_id: bytes, rank: int) -> CommHandle:
        raise nccl_error(
            "ncclCommInitRank", NCCL_INVALID_USAGE,
            "multi-process communicators need the real NCCL (a GPU machine with nccl4py "
            "installed); the simulator is one process: use comm_init_all for a clique of "
            "simulated devices")

    def comm_finalize(self, comm: CommHandle) -> None:
        c = self._comm(comm, "ncclCommFinalize")
        if c.state != LIVE:
            raise nccl_error("ncclCommFinalize", NCCL_INVALID_ARGUMENT,
                             f"{c!r} was already finalized")
        c.state = FINALIZED

    def comm_destroy(self, comm: CommHandle) -> None:
        self._comm(comm, "ncclCommDestroy").state = DESTROYED

    def comm_abort(self, comm: CommHandle) -> None:
        self._comm(comm, "ncclCommAbort").state = DESTROYED

    def comm_async_error(self, comm: CommHandle) -> int:
        return 0

    def error_text(self, code: int, comm: CommHandle | None = None) -> str:
        return NCCL_RESULTS.get(code, ("", "unknown error"))[1]

    def comm_rank(self, comm: CommHandle) -> int:
        return self._comm(comm, "ncclCommUserRank").rank

    def comm_count(self, comm: CommHandle) -> int:
        return len(self._comm(comm, "ncclCommCount").clique.comms)

    def comm_device(self, comm: CommHandle) -> int:
        return self._comm(comm, "ncclCommCuDevice").device

    # ------------------------------------------------------------------ groups
    def group_start(self) -> None:
        t = self._tls
        depth = getattr(t, "depth", 0)
        if depth == 0:
            t.posts = []
            t.failed = None
        t.depth = depth + 1

    def group_end(self) -> None:
        t = self._tls
        depth = getattr(t, "depth", 0)
        if depth == 0:
            raise nccl_error("ncclGroupEnd", NCCL_INVALID_USAGE,
                             "ncclGroupEnd without a matching ncclGroupStart")
        t.depth = depth - 1
        if depth == 1:
            posts, t.posts = t.posts, []
            failed, t.failed = getattr(t, "failed", None), None
            if failed is not None:
                code = failed.code if failed.code in NCCL_RESULTS else NCCL_INVALID_USAGE
                raise nccl_error("ncclGroupEnd", code,
                                 f"a call of this group failed ({failed}); nothing of the "
                                 "group was launched")
            self._launch(posts)

    # ------------------------------------------------------------------ collectives
    @_poisons_group
    def all_reduce(self, send: int, recv: int, count: int, dtype: int, op: int, comm: CommHandle,
                   stream: StreamHandle) -> None:
        call = "ncclAllReduce"
        c, s, n, dt = self._common(call, comm, stream, count, dtype)
        self._op(call, op)
        self._post(_Post("all_reduce", c, s, self._buffer(call, send, n, dt, c, "sendbuff"),
                         self._buffer(call, recv, n, dt, c, "recvbuff"), n, dt, op=op))

    @_poisons_group
    def broadcast(self, send: int, recv: int, count: int, dtype: int, root: int, comm: CommHandle,
                  stream: StreamHandle) -> None:
        call = "ncclBroadcast"
        c, s, n, dt = self._common(call, comm, stream, count, dtype)
        r = self._root(call, root, c)
        src = self._buffer(call, send, n, dt, c, "sendbuff") if c.rank == r else 0
        self._post(_Post("broadcast", c, s, src, self._buffer(call, recv, n, dt, c, "recvbuff"),
                         n, dt, root=r))

    @_poisons_group
    def reduce(self, send: int, recv: int, count: int, dtype: int, op: int, root: int,
               comm: CommHandle, stream: StreamHandle) -> None:
        call = "ncclReduce"
        c, s, n, dt = self._common(call, comm, stream, count, dtype)
        self._op(call, op)
        r = self._root(call, root, c)
        dst = self._buffer(call, recv, n, dt, c, "recvbuff") if c.rank == r else 0
        self._post(_Post("reduce", c, s, self._buffer(call, send, n, dt, c, "sendbuff"), dst,
                         n, dt, op=op, root=r))

    @_poisons_group
    def all_gather(self, send: int, recv: int, send_count: int, dtype: int, comm: CommHandle,
                   stream: StreamHandle) -> None:
        call = "ncclAllGather"
        c, s, n, dt = self._common(call, comm, stream, send_count, dtype)
        total = n * len(c.clique.comms)
        self._post(_Post("all_gather", c, s, self._buffer(call, send, n, dt, c, "sendbuff"),
                         self._buffer(call, recv, total, dt, c, "recvbuff"), n, dt))

    @_poisons_group
    def reduce_scatter(self, send: int, recv: int, recv_count: int, dtype: int, op: int,
                       comm: CommHandle, stream: StreamHandle) -> None:
        call = "ncclReduceScatter"
        c, s, n, dt = self._common(call, comm, stream, recv_count, dtype)
        self._op(call, op)
        total = n * len(c.clique.comms)
        self._post(_Post("reduce_scatter", c, s,
                         self._buffer(call, send, total, dt, c, "sendbuff"),
                         self._buffer(call, recv, n, dt, c, "recvbuff"), n, dt, op=op))

    @_poisons_group
    def send(self, buffer: int, count: int, dtype: int, peer: int, comm: CommHandle,
             stream: StreamHandle) -> None:
        call = "ncclSend"
        c, s, n, dt = self._common(call, comm, stream, count, dtype)
        p = self._peer(call, peer, c)
        self._post(_Post("send", c, s, self._buffer(call, buffer, n, dt, c, "sendbuff"), 0,
                         n, dt, peer=p))

    @_poisons_group
    def recv(self, buffer: int, count: int, dtype: int, peer: int, comm: CommHandle,
             stream: StreamHandle) -> None:
        call = "ncclRecv"
        c, s, n, dt = self._common(call, comm, stream, count, dtype)
        p = self._peer(call, peer, c)
        self._post(_Post("recv", c, s, 0, self._buffer(call, buffer, n, dt, c, "recvbuff"),
                       n, dt, peer=p))

    # ================================================================ internals
    # -- argument checks (all before anything is queued)
    def _comm(self, comm: CommHandle, call: str) -> _SimComm:
        if type(comm) is not _SimComm:
            raise nccl_error(call, NCCL_INVALID_ARGUMENT,
                             f"{comm!r} is not a communicator of the simulated NCCL")
        if comm.state == DESTROYED:
            raise nccl_error(call, NCCL_INVALID_ARGUMENT, f"{comm!r} was destroyed or aborted")
        return comm

    def _common(self, call: str, comm: CommHandle, stream: StreamHandle, count: Any,
                dtype: Any) -> tuple[_SimComm, SimStream, int, int]:
        c = self._comm(comm, call)
        if c.state != LIVE:
            raise nccl_error(call, NCCL_INVALID_ARGUMENT, f"{c!r} was finalized")
        try:
            n = operator.index(count)
            dt = operator.index(dtype)
        except TypeError:
            raise nccl_error(call, NCCL_INVALID_ARGUMENT,
                             f"count and datatype must be ints, got {count!r} and "
                             f"{dtype!r}") from None
        if n < 0:
            raise nccl_error(call, NCCL_INVALID_ARGUMENT, f"negative count {n}")
        if dt not in NCCL_NUMPY_NAMES:
            raise nccl_error(call, NCCL_INVALID_ARGUMENT, f"unknown datatype {dt}")
        if dt in _ML_DTYPES:
            try:
                import ml_dtypes  # noqa: F401
            except ImportError:
                raise nccl_error(call, NCCL_INVALID_ARGUMENT,
                                 f"the simulator computes {NCCL_NUMPY_NAMES[dt]} with the optional "
                                 "'ml_dtypes' package, which is not installed") from None
        try:
            s = self._b.stream_of(stream, call)
        except CudaError as exc:
            raise nccl_error(call, NCCL_INVALID_ARGUMENT, str(exc)) from exc
        if s.device != c.device:
            raise nccl_error(call, NCCL_INVALID_ARGUMENT,
                             f"{s!r} is not on the communicator's device {c.device}")
        if s.capture is not None:
            raise nccl_error(call, NCCL_INVALID_USAGE,
                             "the simulator cannot capture NCCL calls into a CUDA graph "
                             f"({s!r} is capturing)")
        return c, s, n, dt

    @staticmethod
    def _op(call: str, op: Any) -> None:
        if not isinstance(op, int) or op not in _OPS:
            raise nccl_error(call, NCCL_INVALID_ARGUMENT,
                             f"unknown reduction operation {op!r} (0..4: sum, prod, max, min, "
                             "avg)")

    @staticmethod
    def _root(call: str, root: Any, c: _SimComm) -> int:
        n = len(c.clique.comms)
        if not isinstance(root, int) or not 0 <= root < n:
            raise nccl_error(call, NCCL_INVALID_ARGUMENT,
                             f"root {root!r} is not a rank of this {n}-rank communicator")
        return root

    @staticmethod
    def _peer(call: str, peer: Any, c: _SimComm) -> int:
        n = len(c.clique.comms)
        if not isinstance(peer, int) or not 0 <= peer < n:
            raise nccl_error(call, NCCL_INVALID_ARGUMENT,
                             f"peer {peer!r} is not a rank of this {n}-rank communicator")
        return peer

    def _buffer(self, call: str, ptr: Any, count: int, dtype: int, c: _SimComm,
                what: str) -> int:
        """Host address of ``count`` elements at device pointer ``ptr`` on the comm's device
        (0 when ``count`` is 0, where NCCL accepts any pointer)."""
        if count == 0:
            return 0
        try:
            p = operator.index(ptr)
        except TypeError:
            raise nccl_error(call, NCCL_INVALID_ARGUMENT,
                             f"{what} must be a device pointer (int), got {ptr!r}") from None
        owner = self._b.pointer_device(p)
        if owner is None:
            raise nccl_error(call, NCCL_INVALID_ARGUMENT,
                             f"{what} 0x{p:x} is not simulated device memory")
        if owner != c.device:
            raise nccl_error(call, NCCL_INVALID_ARGUMENT,
                             f"{what} allocated on device {owner} mismatches with NCCL device "
                             f"{c.device}")
        nbytes = count * _itemsize(dtype)
        try:
            return self._b.checked_address(p, nbytes, call)
        except CudaError as exc:
            raise nccl_error(call, NCCL_INVALID_ARGUMENT,
                             f"{what} 0x{p:x} + {nbytes} bytes: {exc}") from exc

    # -- groups and launch
    def _post(self, post: _Post) -> None:
        t = self._tls
        if getattr(t, "depth", 0):
            t.posts.append(post)
            return
        call = _CALLS[post.kind]
        if post.kind in ("send", "recv") or len(post.comm.clique.comms) > 1:
            raise nccl_error(
                call, NCCL_INVALID_USAGE,
                f"{post.describe()} on rank {post.comm.rank} of a "
                f"{len(post.comm.clique.comms)}-rank communicator was called outside "
                "ncclGroupStart/ncclGroupEnd: one thread driving several ranks must group the "
                "ranks' calls, or the real NCCL waits forever for the peers")
        self._launch([post])

    def _launch(self, posts: list[_Post]) -> None:
        """Check that the group's calls match across ranks, then queue one unit each."""
        units: list[tuple[int, list[_Post]]] = []  # (position of its first post, posts)
        by_clique: dict[int, tuple[_Clique, dict[int, list[tuple[int, _Post]]]]] = {}
        sends: dict[tuple[int, int, int], list[tuple[int, _Post]]] = {}
        recvs: dict[tuple[int, int, int], list[tuple[int, _Post]]] = {}
        for i, p in enumerate(posts):
            clique = p.comm.clique
            if p.kind == "send":
                sends.setdefault((id(clique), p.comm.rank, p.peer), []).append((i, p))
            elif p.kind == "recv":
                recvs.setdefault((id(clique), p.peer, p.comm.rank), []).append((i, p))
            else:
                entry = by_clique.setdefault(id(clique), (clique, {}))
                entry[1].setdefault(p.comm.rank, []).append((i, p))
        for clique, per_rank in by_clique.values():
            units += self._match_collectives(clique, per_rank)
        units += self._match_p2p(sends, recvs)
        units.sort(key=lambda unit: unit[0])
        for _, unit in units:
            self._queue(unit)

    @staticmethod
    def _match_collectives(clique: _Clique, per_rank: dict[int, list[tuple[int, _Post]]]
                           ) -> list[tuple[int, list[_Post]]]:
        n = len(clique.comms)
        lengths = [len(per_rank.get(r, ())) for r in range(n)]
        if len(set(lengths)) != 1:
            most = max(range(n), key=lambda r: lengths[r])
            least = min(range(n), key=lambda r: lengths[r])
            raise nccl_error(
                "ncclGroupEnd", NCCL_INVALID_USAGE,
                f"rank {most} (device {clique.devices[most]}) of a {n}-rank communicator "
                f"posted {lengths[most]} collective(s) in this group but rank {least} (device "
                f"{clique.devices[least]}) posted {lengths[least]}: the real NCCL would wait "
                "forever for the missing calls (every rank must issue the same collectives in "
                "the same order)")
        units = []
        for j in range(lengths[0]):
            row = [per_rank[r][j] for r in range(n)]
            first = row[0][1]
            for _, p in row[1:]:
                if p.signature() != first.signature():
                    raise nccl_error(
                        "ncclGroupEnd", NCCL_INVALID_USAGE,
                        f"collective #{j + 1} of the group differs across ranks: rank 0 posted "
                        f"{first.describe()}, rank {p.comm.rank} posted {p.describe()}; the "
                        "real NCCL would hang or compute garbage (every rank must issue the "
                        "same collectives, with the same count, type, operation and root, in "
                        "the same order)")
            units.append((min(i for i, _ in row), [p for _, p in row]))
        return units

    @staticmethod
    def _match_p2p(sends: dict[tuple[int, int, int], list[tuple[int, _Post]]],
                   recvs: dict[tuple[int, int, int], list[tuple[int, _Post]]]
                   ) -> list[tuple[int, list[_Post]]]:
        units = []
        for key in dict.fromkeys([*sends, *recvs]):
            s_list, r_list = sends.get(key, []), recvs.get(key, [])
            if len(s_list) != len(r_list):
                src, dst = key[1], key[2]
                raise nccl_error(
                    "ncclGroupEnd", NCCL_INVALID_USAGE,
                    f"rank {src} posted {len(s_list)} send(s) to rank {dst} but rank {dst} "
                    f"posted {len(r_list)} matching receive(s) from rank {src}: the real "
                    "NCCL would wait forever for the missing peer")
            for (i, s), (k, r) in zip(s_list, r_list):
                if (s.count, s.dtype) != (r.count, r.dtype):
                    raise nccl_error(
                        "ncclGroupEnd", NCCL_INVALID_USAGE,
                        f"rank {s.comm.rank} sends {s.count} x {NCCL_NUMPY_NAMES[s.dtype]} to rank "
                        f"{r.comm.rank}, which receives {r.count} x {NCCL_NUMPY_NAMES[r.dtype]}: "
                        "count and type must match")
                units.append((min(i, k), [s, r]))
        return units

    def _queue(self, unit: list[_Post]) -> None:
        """Queue one unit on its participants' streams (see the module docstring)."""
        b = self._b
        compute = _Once(lambda: _compute(unit))
        streams = list({id(p.stream): p.stream for p in unit}.values())
        if len(streams) == 1:
            b.submit(streams[0], compute, ())
            return
        arrived = []
        for s in streams:
            ev = b.event_create(s.device, EVENT_DISABLE_TIMING)
            b.event_record(ev, s)
            arrived.append(ev)
        for i, s in enumerate(streams):
            for j, ev in enumerate(arrived):
                if j != i:
                    b.stream_wait_event(s, ev)
            b.submit(s, compute, ())
        for ev in arrived:
            b.event_destroy(ev)  # the queued waits keep what they need
        b.pump()


# ------------------------------------------------------------------------------ values
def _numpy_dtype(dtype: int) -> Any:
    import numpy as np

    if dtype in _ML_DTYPES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, NCCL_NUMPY_NAMES[dtype]))
    return np.dtype(NCCL_NUMPY_NAMES[dtype])


def _itemsize(dtype: int) -> int:
    return 1 if dtype in (NCCL_INT8, NCCL_UINT8, NCCL_FLOAT8E4M3, NCCL_FLOAT8E5M2) else \
        2 if dtype in (NCCL_FLOAT16, NCCL_BFLOAT16) else \
        4 if dtype in (NCCL_INT32, NCCL_UINT32, NCCL_FLOAT32) else 8


def _view(addr: int, count: int, dtype: Any) -> Any:
    """A writable numpy view of ``count`` elements at host address ``addr``."""
    import ctypes

    import numpy as np

    raw = (ctypes.c_ubyte * (count * dtype.itemsize)).from_address(addr)
    return np.frombuffer(raw, dtype=dtype, count=count)


def _reduce(parts: list[Any], op: int, dtype: Any) -> Any:
    """NCCL's reduction of ``parts`` (equal-length arrays of ``dtype``), in rank order."""
    import numpy as np

    n = len(parts)
    if op == NCCL_AVG:
        if dtype.kind in "iu":
            total = parts[0].copy()
            for x in parts[1:]:
                total = np.add(total, x, dtype=dtype)
            quotient = np.abs(total.astype(np.int64 if dtype.kind == "i" else np.uint64)) // n
            signed = quotient if dtype.kind == "u" else np.where(total < 0, -quotient, quotient)
            return signed.astype(dtype)
        scale = dtype.type(1.0 / n)
        total = parts[0] * scale
        for x in parts[1:]:
            total = total + x * scale
        return total.astype(dtype)
    fn = {NCCL_SUM: np.add, NCCL_PROD: np.multiply, NCCL_MAX: np.maximum,
          NCCL_MIN: np.minimum}[op]
    total = parts[0].copy()
    for x in parts[1:]:
        total = fn(total, x).astype(dtype, copy=False)
    return total


def _compute(unit: list[_Post]) -> None:
    """Run one unit: read every input into a copy, compute, then write every output."""
    first = unit[0]
    kind, count = first.kind, first.count
    if count == 0:
        return
    dtype = _numpy_dtype(first.dtype)
    n = len(unit)
    if kind == "send":
        data = _view(first.send, count, dtype).copy()
        _view(unit[1].recv, count, dtype)[:] = data
        return
    if kind == "broadcast":
        root = next(p for p in unit if p.comm.rank == first.root)
        data = _view(root.send, count, dtype).copy()
        for p in unit:
            _view(p.recv, count, dtype)[:] = data
        return
    if kind == "all_gather":
        import numpy as np

        data = np.concatenate([_view(p.send, count, dtype) for p in unit])
        for p in unit:
            _view(p.recv, count * n, dtype)[:] = data
        return
    if kind == "reduce_scatter":
        parts = [_view(p.send, count * n, dtype).copy() for p in unit]
        result = _reduce(parts, first.op, dtype)
        for p in unit:
            _view(p.recv, count, dtype)[:] = result[p.comm.rank * count:(p.comm.rank + 1) * count]
        return
    parts = [_view(p.send, count, dtype).copy() for p in unit]
    result = _reduce(parts, first.op, dtype)
    for p in unit:
        if kind == "all_reduce" or p.comm.rank == first.root:
            _view(p.recv, count, dtype)[:] = result
