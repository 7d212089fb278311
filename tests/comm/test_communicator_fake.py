"""A fake of the seam's ``Nccl`` for the simulator: ranks are threads of this process.

(Support for test_communicator*.py; it holds no tests of its own.)

``FakeNccl`` implements the FIXED ``cudalab._driver.base.Nccl`` interface with numpy over the
simulator's memory, so :class:`cudalab.comm.Communicator` can be tested end to end (argument
checks, pointers, counts, NCCL types, in-place forms, roots, groups) without a GPU. A clique
is keyed by the unique id; ``comm_init_rank`` waits for every rank (a barrier), each
collective exchanges the ranks' inputs through the clique, and point-to-point messages go
through mailboxes. Every call is recorded in ``calls`` as ``(name, args, nvtx ranges)``.

``lonely=True`` makes ``comm_init_rank`` return without waiting for the other ranks, for
tests that check one rank's argument errors (no collective may then be called).
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict, deque
from typing import Any

import numpy as np

from cudalab import nvtx
from cudalab._driver.base import NCCL_RESULTS, Nccl

WAIT_SECONDS = 20.0  # no test may hang: a rank that waits longer fails
NUMPY_TYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64,
               6: np.float16, 7: np.float32, 8: np.float64}
COLLECTIVES = {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "send",
               "recv"}


class FakeComm:
    def __init__(self, clique: Clique, rank: int, device: int):
        self.clique = clique
        self.rank = rank
        self.device = device
        self.error = 0  # what comm_async_error reports
        self.state = "open"  # then "finalized", "destroyed", "aborted"


class Clique:
    def __init__(self, nranks: int):
        self.nranks = nranks
        self.barrier = threading.Barrier(nranks, timeout=WAIT_SECONDS)
        self.slots: list[Any] = [None] * nranks
        self.mail: dict[tuple[int, int], deque] = defaultdict(deque)
        self.mail_ready = threading.Condition()

    def exchange(self, rank: int, value: Any) -> list[Any]:
        """Every rank's ``value`` (a collective step: all ranks must call it)."""
        self.slots[rank] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return values


def _reduce(values: list[np.ndarray], op: int) -> np.ndarray:
    stack = np.stack(values)
    if op == 0:
        return stack.sum(axis=0, dtype=stack.dtype)
    if op == 1:
        return stack.prod(axis=0, dtype=stack.dtype)
    if op == 2:
        return stack.max(axis=0)
    if op == 3:
        return stack.min(axis=0)
    if op == 4:
        total = stack.sum(axis=0, dtype=stack.dtype)
        if np.issubdtype(stack.dtype, np.integer):
            return (total // len(values)).astype(stack.dtype)
        return (total / len(values)).astype(stack.dtype)
    raise AssertionError(f"bad op {op}")


class FakeNccl(Nccl):
    simulated = False

    def __init__(self, backend: Any, lonely: bool = False):
        self.b = backend
        self.lonely = lonely
        self.calls: list[tuple[str, tuple, tuple[str, ...]]] = []
        self._lock = threading.Lock()
        self._cliques: dict[bytes, Clique] = {}
        self._thread = threading.local()  # .depth, .pending (recvs deferred to group_end)
        self.fail_finalize = False
        self.fail_group_end = False

    # ---------------------------------------------------------------- bookkeeping
    def _record(self, name: str, *args: Any) -> None:
        with self._lock:
            self.calls.append((name, args, nvtx.current_ranges()))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def collective_calls(self) -> list[tuple[str, tuple, tuple[str, ...]]]:
        return [c for c in self.calls if c[0] in COLLECTIVES]

    def _array(self, ptr: int, dtype: int, count: int, stream: Any) -> np.ndarray:
        """The ``count`` elements at ``ptr`` after ``stream``'s work: on the simulator a view
        of its memory, on a GPU a host copy."""
        self.b.stream_synchronize(stream)
        if self.b.simulated:
            return self.b.array(ptr, NUMPY_TYPES[dtype], count)
        host = np.empty(count, NUMPY_TYPES[dtype])
        if count:
            self.b.memcpy(self.b.pointer_device(ptr), host.ctypes.data, ptr, host.nbytes)
        return host

    def _store(self, ptr: int, dtype: int, count: int, stream: Any, values: Any) -> None:
        """Write ``values`` (``count`` elements) at ``ptr`` after ``stream``'s work."""
        host = np.ascontiguousarray(np.broadcast_to(values, (count,)), dtype=NUMPY_TYPES[dtype])
        self.b.stream_synchronize(stream)
        if self.b.simulated:
            self.b.array(ptr, NUMPY_TYPES[dtype], count)[:] = host
        elif count:
            self.b.memcpy(self.b.pointer_device(ptr), ptr, host.ctypes.data, host.nbytes)

    # ---------------------------------------------------------------- the interface
    def version(self) -> int:
        return 22800

    def unique_id(self) -> bytes:
        self._record("unique_id")
        return os.urandom(128)

    def comm_init_all(self, devices: Any) -> list[Any]:
        raise NotImplementedError("not used by Communicator")

    def comm_init_rank(self, device: int, nranks: int, unique_id: bytes, rank: int) -> Any:
        self._record("comm_init_rank", device, nranks, unique_id, rank)
        with self._lock:
            clique = self._cliques.setdefault(unique_id, Clique(nranks))
        assert clique.nranks == nranks
        if not self.lonely:
            clique.barrier.wait()
        return FakeComm(clique, rank, device)

    def comm_finalize(self, comm: Any) -> None:
        self._record("comm_finalize", comm)
        if self.fail_finalize:
            from cudalab.errors import NcclError

            raise NcclError("ncclCommFinalize: ncclInternalError (3): fake failure", 3,
                            "ncclInternalError")
        comm.state = "finalized"

    def comm_destroy(self, comm: Any) -> None:
        self._record("comm_destroy", comm)
        comm.state = "destroyed"

    def comm_abort(self, comm: Any) -> None:
        self._record("comm_abort", comm)
        comm.state = "aborted"

    def comm_async_error(self, comm: Any) -> int:
        return comm.error

    def error_text(self, code: int, comm: Any = None) -> str:
        return NCCL_RESULTS[code][1]

    def comm_rank(self, comm: Any) -> int:
        return comm.rank

    def comm_count(self, comm: Any) -> int:
        return comm.clique.nranks

    def comm_device(self, comm: Any) -> int:
        return comm.device

    def group_start(self) -> None:
        self._record("group_start")
        t = self._thread
        t.depth = getattr(t, "depth", 0) + 1
        if t.depth == 1:
            t.pending = []

    def group_end(self) -> None:
        self._record("group_end")
        t = self._thread
        t.depth -= 1
        if self.fail_group_end:
            from cudalab.errors import NcclError

            raise NcclError("ncclGroupEnd: ncclInvalidUsage (5): fake failure", 5,
                            "ncclInvalidUsage")
        if t.depth == 0:
            pending, t.pending = t.pending, []
            for work in pending:
                work()

    def all_reduce(self, send, recv, count, dtype, op, comm, stream) -> None:
        self._record("all_reduce", send, recv, count, dtype, op, comm, stream)
        mine = self._array(send, dtype, count, stream).copy()
        values = comm.clique.exchange(comm.rank, mine)
        self._store(recv, dtype, count, stream, _reduce(values, op))

    def broadcast(self, send, recv, count, dtype, root, comm, stream) -> None:
        self._record("broadcast", send, recv, count, dtype, root, comm, stream)
        mine = self._array(send, dtype, count, stream).copy() if comm.rank == root else None
        values = comm.clique.exchange(comm.rank, mine)
        self._store(recv, dtype, count, stream, values[root])

    def reduce(self, send, recv, count, dtype, op, root, comm, stream) -> None:
        self._record("reduce", send, recv, count, dtype, op, root, comm, stream)
        mine = self._array(send, dtype, count, stream).copy()
        values = comm.clique.exchange(comm.rank, mine)
        if comm.rank == root:
            self._store(recv, dtype, count, stream, _reduce(values, op))

    def all_gather(self, send, recv, send_count, dtype, comm, stream) -> None:
        self._record("all_gather", send, recv, send_count, dtype, comm, stream)
        mine = self._array(send, dtype, send_count, stream).copy()
        values = comm.clique.exchange(comm.rank, mine)
        self._store(recv, dtype, send_count * comm.clique.nranks, stream, np.concatenate(values))

    def reduce_scatter(self, send, recv, recv_count, dtype, op, comm, stream) -> None:
        self._record("reduce_scatter", send, recv, recv_count, dtype, op, comm, stream)
        mine = self._array(send, dtype, recv_count * comm.clique.nranks, stream).copy()
        values = comm.clique.exchange(comm.rank, mine)
        total = _reduce(values, op)
        start = comm.rank * recv_count
        self._store(recv, dtype, recv_count, stream, total[start:start + recv_count])

    def send(self, buffer, count, dtype, peer, comm, stream) -> None:
        self._record("send", buffer, count, dtype, peer, comm, stream)
        message = self._array(buffer, dtype, count, stream).copy()
        clique = comm.clique
        with clique.mail_ready:
            clique.mail[(comm.rank, peer)].append(message)
            clique.mail_ready.notify_all()

    def recv(self, buffer, count, dtype, peer, comm, stream) -> None:
        self._record("recv", buffer, count, dtype, peer, comm, stream)

        def work() -> None:
            clique = comm.clique
            with clique.mail_ready:
                box = clique.mail[(peer, comm.rank)]
                if not clique.mail_ready.wait_for(lambda: box, timeout=WAIT_SECONDS):
                    raise TimeoutError(f"fake recv: rank {comm.rank} got nothing from {peer}")
                message = box.popleft()
            assert message.size == count and message.dtype == NUMPY_TYPES[dtype]
            self._store(buffer, dtype, count, stream, message)

        if getattr(self._thread, "depth", 0):
            self._thread.pending.append(work)
        else:
            work()


def run_ranks(world_size: int, body: Any, timeout: float = 60.0) -> list[Any]:
    """``body(rank)`` in one thread per rank; returns the results in rank order, re-raising
    the first rank's exception (and failing if a rank does not finish in time)."""
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as exc:  # re-raised in the test's thread
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank did not finish: the fake clique hangs"
    for exc in errors:
        if exc is not None:
            raise exc
    return results
