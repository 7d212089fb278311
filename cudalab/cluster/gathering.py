"""Gathering every rank's records to one rank, inside a job: :func:`gather`.

Every rank calls ``gather(what=(...))`` at the same point (it is a collective); the root
(rank 0 by default) gets ``{rank: RankRecords}``, the others None. The bytes travel over the
job's own engine, no other transport:

* ``"mpi"``: mpi4py (through :mod:`cudalab._driver.mpi`, imported on first use) with buffer
  collectives only: ``Gather`` of the sizes, then ``Gatherv`` of the bytes. Never mpi4py's
  pickle-based lowercase ``gather``, which would unpickle other processes' data plainly;
* ``"torch"``: ``torch.distributed`` when the job already uses it (``torch.distributed`` in
  ``sys.modules`` and initialised; cudalab never imports torch): an ``all_gather`` of the
  sizes and a ``gather`` of ``uint8`` tensors padded to the largest, on the GPU for NCCL and
  on the host otherwise;
* any object with ``rank``, ``world_size`` and ``gather_bytes(data, root)`` (a list of
  every rank's bytes on the root, None elsewhere): :class:`GatherEngine`.

``"auto"`` (the default) picks torch when its process group is initialised, else MPI. Each
rank's payload is :func:`cudalab.cluster.records.encode` of its records, decoded on the root
by :func:`cudalab.cluster.records.decode` (bounded size and nesting, no classes, schema
checked). The records are collected before any byte moves, so the gather's own buffers are
not in them, and the gather runs under
:func:`cudalab._internal.collective_muted`: its collectives do not report themselves to
cudalab's collective observers.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, Protocol

from cudalab import _internal
from cudalab.cluster import records as _records
from cudalab.cluster.records import RankRecords
from cudalab.memory_tools.samples import SampleSource

__all__ = ["gather", "GatherEngine", "MpiEngine", "TorchEngine", "engine_for"]

_DEFAULT_WHAT = ("stats", "history_tail", "snapshot")


class GatherEngine(Protocol):
    """How bytes reach the root: one rank's view of the job."""

    #: This process's rank, in [0, world_size).
    rank: int
    #: The number of ranks, >= 1.
    world_size: int

    def gather_bytes(self, data: bytes, root: int) -> list[bytes] | None:
        """Every rank's ``data`` on ``root`` (in rank order), None on the other ranks."""
        ...


class MpiEngine:
    """:class:`GatherEngine` over an mpi4py communicator (default ``COMM_WORLD``)."""

    def __init__(self, comm: Any = None):
        from cudalab._driver import mpi as _mpi

        self._mpi = _mpi.mpi()
        self.comm = self._mpi.COMM_WORLD if comm is None else comm
        self.rank = int(self.comm.Get_rank())
        self.world_size = int(self.comm.Get_size())

    def gather_bytes(self, data: bytes, root: int) -> list[bytes] | None:
        import numpy as np

        mpi = self._mpi
        size = np.array([len(data)], dtype=np.int64)
        sizes = np.zeros(self.world_size, dtype=np.int64) if self.rank == root else None
        self.comm.Gather([size, mpi.INT64_T], [sizes, mpi.INT64_T] if sizes is not None else None,
                         root=root)
        send = np.frombuffer(data, dtype=np.uint8) if data else np.zeros(0, np.uint8)
        if self.rank != root:
            self.comm.Gatherv([send, mpi.BYTE], None, root=root)
            return None
        assert sizes is not None
        offsets = np.zeros(self.world_size, dtype=np.int64)
        np.cumsum(sizes[:-1], out=offsets[1:])
        buffer = np.empty(int(sizes.sum()), dtype=np.uint8)
        self.comm.Gatherv([send, mpi.BYTE], [buffer, (sizes, offsets), mpi.BYTE], root=root)
        raw = buffer.tobytes()
        return [raw[o:o + n] for o, n in zip(offsets.tolist(), sizes.tolist())]


class TorchEngine:
    """:class:`GatherEngine` over the job's ``torch.distributed`` default process group
    (read from ``sys.modules``; cudalab never imports torch)."""

    def __init__(self) -> None:
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("gather(engine='torch'): torch.distributed is not initialised "
                               "in this process (call torch.distributed.init_process_group "
                               "first)")
        self._dist = dist
        self._torch = sys.modules["torch"]
        self.rank = int(dist.get_rank())
        self.world_size = int(dist.get_world_size())
        backend = str(dist.get_backend()).lower()
        self.device = (self._torch.device("cuda", self._torch.cuda.current_device())
                       if "nccl" in backend else self._torch.device("cpu"))

    def gather_bytes(self, data: bytes, root: int) -> list[bytes] | None:
        torch, dist = self._torch, self._dist
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        lengths = [int(s.item()) for s in sizes]
        longest = max(lengths + [1])
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        mine = mine.to(self.device)
        if self.rank == root:
            received = [torch.empty(longest, dtype=torch.uint8, device=self.device)
                        for _ in range(self.world_size)]
            dist.gather(mine, gather_list=received, dst=root)
            return [t[:n].cpu().numpy().tobytes() for t, n in zip(received, lengths)]
        dist.gather(mine, dst=root)
        return None


def engine_for(engine: Any = "auto") -> GatherEngine:
    """The :class:`GatherEngine` that ``engine`` names (``"auto"``, ``"mpi"``, ``"torch"``,
    or an engine object, returned as is).

    Raises
    ------
    ImportError
        ``"mpi"`` (or ``"auto"`` without torch.distributed) and mpi4py cannot be imported.
    RuntimeError
        ``"torch"`` and torch.distributed is not initialised.
    ValueError
        An unknown name.
    """
    if not isinstance(engine, str):
        for name in ("rank", "world_size", "gather_bytes"):
            if not hasattr(engine, name):
                raise TypeError(f"gather(): engine {type(engine).__name__} has no {name!r}; "
                                "pass 'auto', 'mpi', 'torch' or a GatherEngine")
        return engine  # type: ignore[no-any-return]
    if engine == "auto":
        dist = sys.modules.get("torch.distributed")
        try:
            torch_ready = dist is not None and dist.is_available() and dist.is_initialized()
        except Exception:  # a broken torch: MPI
            torch_ready = False
        return TorchEngine() if torch_ready else MpiEngine()
    if engine == "mpi":
        return MpiEngine()
    if engine == "torch":
        return TorchEngine()
    raise ValueError(f"gather(): engine {engine!r:.40} is not 'auto', 'mpi' or 'torch'")


def gather(what: Iterable[str] | str = _DEFAULT_WHAT, root: int = 0, engine: Any = "auto",
           tail: int = _records.DEFAULT_TAIL, source: SampleSource | None = None,
           max_bytes: int | str | None = None) -> dict[int, RankRecords] | None:
    """Collect every rank's records on ``root`` (a collective: every rank calls it).

    Parameters
    ----------
    what : str or iterable of str
        The parts: ``"stats"`` (each device's ``memory_stats()``), ``"samples"``,
        ``"history_tail"`` (the newest ``tail`` history entries per device), ``"snapshot"``.
    root : int
        The rank that receives (default 0).
    engine : {"auto", "mpi", "torch"} or GatherEngine
        How the bytes move (see the module documentation).
    tail : int
        History entries per device for ``history_tail`` (default 100,000).
    source : SampleSource, optional
        Where this rank's figures come from (default
        :func:`cudalab.cluster.records.rank_source`).
    max_bytes : int or str, optional
        The largest payload accepted per rank on the root (default: the snapshot loader's
        limit, ``CUDALAB_MAX_SNAPSHOT_BYTES``).

    Returns
    -------
    dict of int to RankRecords, or None
        On the root, every rank's records by rank (checked); None on the other ranks.

    Raises
    ------
    ValueError
        A bad part, tail or root (raised on every rank, before any collective).
    cudalab.memory_tools.safe_pickle.SnapshotLoadError
        On the root: a rank's payload was refused (the message names the rank).
    """
    parts = _records.check_what(what, "gather()")
    tail = _records.check_tail(tail, "gather()")
    eng = engine_for(engine)
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < eng.world_size:
        raise ValueError(f"gather(): root must be a rank (0 <= root < {eng.world_size}), got "
                         f"{root!r:.40}")
    payload = _records.encode(_records.collect(parts, source, tail))
    with _internal.collective_muted():
        received = eng.gather_bytes(payload, root)
    if received is None:
        return None
    if len(received) != eng.world_size:
        raise RuntimeError(f"gather(): the engine returned {len(received)} payloads for "
                           f"{eng.world_size} ranks")
    out: dict[int, RankRecords] = {}
    for rank, data in enumerate(received):
        out[rank] = _records.decode(data, f"rank {rank}'s records", max_bytes)
    return out
