"""How a collective reaches NCCL: the :class:`CollectiveCall` record, the one :func:`issue`
function that takes it, the one stream check (:func:`check_stream`), and the cache of
single-process cliques the collectives run on.

Every NCCL operation of cudalab is one :class:`CollectiveCall` built once by its caller and
handed to :func:`issue`:

* :mod:`cudalab.nccl`'s public functions (torch.cuda.nccl) build one per call after torch's
  checks (:data:`ROUTE_NCCL`): issued through the seam's checked group call, inside the NVTX
  range ``nccl.<name>``, reported to the collective observers as ``nccl.<name>``;
* :mod:`cudalab.comm`'s single-process collectives (``broadcast``, ``reduce_add``) build
  theirs with :func:`cudalab.nccl.clique_call` (:data:`ROUTE_CLIQUE`): issued through the
  cached clique's group runner (its communicators checked once, then one C call per
  collective), with no range or record of its own (the ``comm.*`` call has them);
* :class:`cudalab.comm.Communicator` builds one per operation for its rank
  (:data:`ROUTE_RANK`): one per-rank NCCL call (collectives and ``send``/``recv``) inside the
  NVTX range ``cudalab.comm.<name>``, reported as ``<name>``.

Every route tells the stream sanitizer what each rank reads and writes (derived from the
record, only while the sanitizer is on). Streams are checked once, where the record is built:
:func:`check_stream` raises :class:`cudalab.errors.StreamDeviceError` (a ValueError and a
RuntimeError) for a stream on another device than its rank.

Cliques
-------
As in torch, the communicators of a single-process clique are created on first use, one
clique per tuple of devices *in rank order*, with ``ncclCommInitAll``, and cached for the
process (:func:`communicators`). :func:`destroy_communicators` finalizes and destroys them
(also at interpreter exit); the next collective creates fresh ones. A forked child forgets
its parent's.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

from cudalab import _internal, _interrupts, _observe
from cudalab import nvtx as _nvtx
from cudalab._driver.base import (
    NCCL_CALL_ALL_GATHER,
    NCCL_CALL_ALL_REDUCE,
    NCCL_CALL_BROADCAST,
    NCCL_CALL_REDUCE,
    NCCL_CALL_REDUCE_SCATTER,
)
from cudalab.errors import NcclError, StreamDeviceError

if TYPE_CHECKING:
    from cudalab.streams import Stream

__all__ = [
    "CollectiveCall", "build", "issue", "check_stream", "communicators", "cached_cliques",
    "destroy_clique", "destroy_communicators",
    "ROUTE_NCCL", "ROUTE_CLIQUE", "ROUTE_RANK", "CALL_SEND", "CALL_RECV", "CALL_NAMES",
    "TYPE_BYTES",
]

#: Point-to-point operations, numbered after the seam's ``NCCL_CALL_*`` collectives
#: (:data:`ROUTE_RANK` only: the group call has no such calls).
CALL_SEND, CALL_RECV = 5, 6
#: Each operation's name, indexed by its number (``NCCL_CALL_*``, :data:`CALL_SEND`, ...).
CALL_NAMES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "send",
              "recv")
#: Bytes of one element of each NCCL data type, indexed by its code (``NCCL_INT8`` = 0 ...
#: ``NCCL_FLOAT8E5M2`` = 11).
TYPE_BYTES = (1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1)

#: :mod:`cudalab.nccl`'s public functions: the seam's checked group call, range and record
#: ``nccl.<name>``.
ROUTE_NCCL = 0
#: :mod:`cudalab.comm`'s single-process collectives: the cached clique's group runner, no
#: range, no record (the caller's ``comm.*`` call has them).
ROUTE_CLIQUE = 1
#: One rank of a :class:`cudalab.comm.Communicator`: its per-rank NCCL call, range
#: ``cudalab.comm.<name>``, record ``<name>``.
ROUTE_RANK = 2

# Per route, then per operation: the NVTX range, the collective record's name (None: the
# caller reports) and the sanitizer's label.
_RANGES = (tuple("nccl." + n for n in CALL_NAMES), (), tuple("cudalab.comm." + n for n in CALL_NAMES))
_RECORDS = (tuple("nccl." + n for n in CALL_NAMES), (), CALL_NAMES)
_ACCESS_LABELS = tuple("nccl." + n for n in CALL_NAMES)


class CollectiveCall(NamedTuple):
    """One NCCL operation over one or more ranks of this process, ready to :func:`issue`.

    Built once by the caller, after its own argument checks; :func:`issue` trusts every
    invariant below. "Entry ``i``" is the ``i``-th rank this process drives: every device of
    a single-process clique, or a Communicator's one rank.

    A frozen record with ``__slots__ = ()``: a NamedTuple rather than a frozen dataclass,
    because it is built on the collectives' hot paths: :func:`build` makes one in 0.14 µs,
    the NamedTuple's ``__new__`` in 0.28, a frozen slotted dataclass of these 14 fields in
    1.8 (the 1 KiB rows of benchmarks/comm.py). :func:`issue` unpacks it in one step, in
    field order.
    """

    kind: int  # the operation: an NCCL_CALL_* of the seam; CALL_SEND, CALL_RECV on ROUTE_RANK
    elements: int  # NCCL's count per rank (all_gather: sent, reduce_scatter: received), >= 0
    dtype: int  # the NCCL data type of every entry, 0 <= dtype < len(TYPE_BYTES)
    op: int  # NCCL_SUM ... NCCL_AVG (ROUTE_NCCL: any int, as torch); unused by data movement
    root: int  # broadcast's and reduce's root rank, send's and recv's peer; 0 <= root < nranks
    sends: Sequence[int]  # per entry, the device address read (0 where none: recv)
    recvs: Sequence[int]  # per entry, the address written (0 where none: send, reduce off root)
    streams: Sequence[Stream]  # per entry, the open stream its work is queued on, on devices[i]
    devices: tuple[int, ...]  # per entry, its device, pairwise distinct; len = len(sends) >= 1
    comms: Sequence[Any]  # per entry, a live communicator on devices[i]; () on ROUTE_CLIQUE
    seam: Any  # the backend's Nccl that issues it; None on ROUTE_CLIQUE (the runner has it)
    rank: int  # the rank of entry 0 (entry i is rank + i): 0 in a clique, a Communicator's own
    nranks: int  # the communicator's ranks (a clique's len(devices), a world size), >= 1
    route: int  # ROUTE_NCCL, ROUTE_CLIQUE or ROUTE_RANK: how it is issued and reported


#: ``build((kind, elements, dtype, op, root, sends, recvs, streams, devices, comms, seam, rank,
#: nranks, route))``: a :class:`CollectiveCall` from its fields in order, made by tuple's own
#: constructor: half the cost of the NamedTuple's ``__new__`` (a Python function), for the
#: builders on the hot paths (``tests/nccl/test_collective_call.py`` checks what they build).
build: Callable[[tuple[Any, ...]], CollectiveCall] = partial(tuple.__new__, CollectiveCall)


def issue(call: CollectiveCall) -> None:
    """Issue ``call`` on its route; tell the stream sanitizer what each entry reads and writes
    and (routes NCCL and RANK) the collective observers, inside the route's NVTX range.

    The one way a collective of cudalab reaches NCCL (see the module docstring). The
    caller's current device is current again afterwards. Ctrl-C waits while it runs (a
    group cut in half would leave some ranks waiting for the others for ever, a range
    open), except in a Communicator rank's own NCCL call (:func:`_issue_rank`, which may
    wait for its peers) and in the collective observers (:func:`_notify`): it is delivered
    there at once.

    Raises
    ------
    cudalab.NcclError
        When NCCL fails (nothing is reported then).
    """
    kind, count, dtype, op, root, sends, recvs, streams, devices, comms, seam, _, _, route = call
    current = _thread.device  # (put back after the group calls: torch's device guard)
    if route == ROUTE_CLIQUE:  # (first: the 1 KiB reduce_add row of benchmarks/comm.py)
        entry = _runners.get(devices)  # (_runner's hit, inline: one Python frame less)
        run = entry[1] if entry is not None and entry[0] is _cliques.get(devices) else \
            _runner(devices)
        try:
            run(kind, count, dtype, op, root, sends, recvs, [s.handle for s in streams])
        finally:
            if current is not None and current >= 0:  # (one thread-local check when it is)
                _internal.ensure_context(current)
        if _observe.access_on:  # the stream sanitizer (one flag read while it is off)
            _report_accesses(call)
        return
    _nvtx.range_push(_RANGES[route][kind])
    try:
        if route == ROUTE_RANK:
            _issue_rank(seam, kind, count, dtype, op, root, sends[0], recvs[0], comms[0],
                        streams[0].handle, devices[0])
        else:  # torch.cuda.nccl: the seam's checked group call (any op; the same errors everywhere)
            try:
                seam.group_call(kind, count, dtype, op, root, sends, recvs, comms,
                                [s.handle for s in streams])
            finally:
                if current is not None and current >= 0:
                    _internal.ensure_context(current)
        if _observe.access_on:
            _report_accesses(call)
        if _internal.collective_observers:  # (the figures only when someone listens)
            _notify(call, _RECORDS[route][kind])
    finally:
        _nvtx.range_pop()


def _issue_rank(seam: Any, kind: int, count: int, dtype: int, op: int, root: int, send: int,
                recv: int, comm: Any, handle: Any, device: int) -> None:
    """One Communicator rank's NCCL call of operation ``kind`` on ``device`` (Ctrl-C is
    delivered here at once: the call may wait for the other ranks)."""
    _internal.ensure_context(device)
    if kind == NCCL_CALL_ALL_REDUCE:
        seam.all_reduce(send, recv, count, dtype, op, comm, handle)
    elif kind == NCCL_CALL_BROADCAST:
        seam.broadcast(send, recv, count, dtype, root, comm, handle)
    elif kind == NCCL_CALL_REDUCE:
        seam.reduce(send, recv, count, dtype, op, root, comm, handle)
    elif kind == NCCL_CALL_ALL_GATHER:
        seam.all_gather(send, recv, count, dtype, comm, handle)
    elif kind == NCCL_CALL_REDUCE_SCATTER:
        seam.reduce_scatter(send, recv, count, dtype, op, comm, handle)
    elif kind == CALL_SEND:
        seam.send(send, count, dtype, root, comm, handle)
    else:
        seam.recv(recv, count, dtype, root, comm, handle)


def _report_accesses(call: CollectiveCall) -> None:
    """Tell the stream sanitizer each entry's reads and writes (NCCL's own rules: broadcast
    reads on the root only and writes elsewhere, and at the root only out of place; reduce
    writes on the root only)."""
    kind, root, rank = call.kind, call.root, call.rank
    element = TYPE_BYTES[call.dtype] * call.elements
    send_bytes = element * call.nranks if kind == NCCL_CALL_REDUCE_SCATTER else element
    recv_bytes = element * call.nranks if kind == NCCL_CALL_ALL_GATHER else element
    for i, (stream, send, recv) in enumerate(zip(call.streams, call.sends, call.recvs)):
        at_root = rank + i == root
        reads = [] if kind == CALL_RECV or (kind == NCCL_CALL_BROADCAST and not at_root) \
            else [(send, send_bytes)]
        writes = [] if (not recv or (kind == NCCL_CALL_REDUCE and not at_root)
                        or (kind == NCCL_CALL_BROADCAST and at_root and recv == send)) \
            else [(recv, recv_bytes)]
        _observe.access_tracker.access(stream, reads, writes, _ACCESS_LABELS[kind])


def _notify(call: CollectiveCall, name: str) -> None:
    """Tell the collective observers of ``call`` with nccl-tests' figures (S and the bus
    factor: see :class:`cudalab._observe.CollectiveRecord`)."""
    kind, n = call.kind, call.nranks
    size = TYPE_BYTES[call.dtype] * call.elements
    if kind == NCCL_CALL_ALL_REDUCE:
        algorithm_bytes, factor = size, 2 * (n - 1) / n
    elif kind == NCCL_CALL_ALL_GATHER or kind == NCCL_CALL_REDUCE_SCATTER:
        algorithm_bytes, factor = size * n, (n - 1) / n
    else:  # broadcast, reduce, send, recv: the root's (or the message's) link carries it all
        algorithm_bytes, factor = size, 1.0
    _internal.notify_collective(name, algorithm_bytes, n, factor, call.devices)


def check_stream(stream: Stream, device: int, what: str, owner: str,
                 index: int | None = None) -> Stream:
    """``stream``, when it is on ``device``: the one stream check of the collectives.

    Parameters
    ----------
    stream : cudalab.Stream
        The stream a caller chose for work on ``device``.
    device : int
        The device of the rank the stream serves.
    what : str
        The call, for the message (``"nccl.all_reduce()"``).
    owner : str
        What is on ``device``, for the message (``"input 1"``, ``"this rank's communicator"``).
    index : int, optional
        The stream's index in a list of streams.

    Raises
    ------
    cudalab.errors.StreamDeviceError
        The stream is on another device (a ValueError and a RuntimeError).
    """
    if stream.device_index != device:
        which = "the stream" if index is None else f"the stream at index {index}"
        raise StreamDeviceError(f"{what}: {which} is on cuda:{stream.device_index}, but "
                                f"{owner} is on cuda:{device}")
    return stream


_thread = _internal.thread_state()  # .device: this thread's current device (the one object)


# ------------------------------------------------------------------------------ cliques
# The communicator cache: devices in rank order -> the clique's handles. Invariant: every
# value is a complete clique of live communicators (a failed or interrupted creation is
# never stored). Guarded by _cliques_lock for changes; reads of a present key need no lock.
_cliques: dict[tuple[int, ...], list[Any]] = {}
# Each cached clique's group runner (the backend's ``group_runner`` of its communicators), made
# on first use: devices -> (the clique's list, its runner). An entry counts only while
# _cliques holds that very list for the key (checked by identity on every use), so the two
# cannot drift: a destroyed or re-created clique is never run through an old runner.
_runners: dict[tuple[int, ...], tuple[list[Any], Callable[..., None]]] = {}
_cliques_lock = threading.Lock()
_atexit_registered = False  # set (once) when the first clique is created


def communicators(nccl: Any, devices: tuple[int, ...]) -> list[Any]:
    """The cached clique of ``devices`` (rank i = devices[i]), created on first use with
    ``nccl`` (the backend's Nccl).

    Raises
    ------
    cudalab.NcclError
        The clique could not be created.
    """
    comms = _cliques.get(devices)
    return comms if comms is not None else _create_clique(nccl, devices)


def cached_cliques() -> dict[tuple[int, ...], list[Any]]:
    """A copy of the cache: devices in rank order -> the clique's communicator handles."""
    return dict(_cliques)


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
    nccl = _internal.backend().nccl()
    first: NcclError | None = None
    for comms in cliques:
        try:
            destroy_clique(nccl, comms)
        except NcclError as exc:
            first = first or exc
    if first is not None:
        raise first


def destroy_clique(nccl: Any, comms: list[Any]) -> None:
    """Finalize ``comms`` in one group, then destroy each; abort them all on failure.

    Raises
    ------
    cudalab.NcclError
        Finalize or destroy failed (every communicator is aborted then).
    """
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
                destroy_clique(nccl, comms)
            except NcclError:
                pass
            raise
    return comms


def _runner(devices: tuple[int, ...]) -> Callable[..., None]:
    """The group runner of the cached clique of ``devices`` (the clique created on first use)."""
    entry = _runners.get(devices)
    comms = _cliques.get(devices)
    if entry is not None and comms is not None and entry[0] is comms:
        return entry[1]
    nccl = _internal.backend().nccl()
    comms = communicators(nccl, devices)
    run = nccl.group_runner(comms)
    _runners[devices] = (comms, run)
    return run


def _destroy_at_exit() -> None:
    """atexit: destroy the cached cliques while CUDA is still up; never raises."""
    try:
        if _cliques and not sys.is_finalizing() and _internal.is_initialized():
            destroy_communicators()
    except BaseException:
        pass


def _forget_in_child() -> None:
    """After fork: the parent's communicators are not the child's (never destroy them)."""
    global _cliques_lock
    _cliques.clear()
    _runners.clear()
    _cliques_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)

_interrupts.guard(issue, _create_clique, destroy_communicators, destroy_clique)
_interrupts.open_code(_issue_rank.__code__)
_interrupts.open_code(_notify.__code__)
