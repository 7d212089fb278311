"""Every rank's allocator, live, in one notebook: publishing, watching and gathering.

* Inside a job: :func:`gather` collects every rank's records (``stats``, ``history_tail``,
  ``snapshot``) to one rank over the job's own engine (MPI through mpi4py, or
  ``torch.distributed`` when the job uses it), decoded by the bounded loader.
* Watching a job: ranks started with ``CUDALAB_CLUSTER=<directory>`` (or calling
  :func:`serve`) publish their samples at 2 Hz over ZeroMQ, signed with the key of their
  connection file; :func:`watch` returns a :class:`ClusterWatch` of one job's ranks
  (latest samples, lost ranks, least headroom, peaks, snapshots and histories on request);
  ``%cuda_memory cluster <directory>`` and :class:`cudalab.widgets.ClusterDashboard` show it.

Modules: :mod:`~cudalab.cluster.signing` (HMAC-SHA256 over the frames),
:mod:`~cudalab.cluster.connection` (connection files, jobs, stale files),
:mod:`~cudalab.cluster.wire` (bounded message decoding), :mod:`~cudalab.cluster.records`
(what a rank tells: :class:`RankRecords`), :mod:`~cudalab.cluster.publisher` (the rank's
thread), :mod:`~cudalab.cluster.watching` (the notebook's side), :mod:`~cudalab.cluster.gathering`
(inside a job). Names load on first use (pyzmq only when publishing or watching).
"""

from __future__ import annotations

from cudalab.lazy_names import lazy_names

_OWNERS = {
    "serve": "cudalab.cluster.publisher",
    "Publisher": "cudalab.cluster.publisher",
    "watch": "cudalab.cluster.watching",
    "ClusterWatch": "cudalab.cluster.watching",
    "Headroom": "cudalab.cluster.watching",
    "PeakRow": "cudalab.cluster.watching",
    "gather": "cudalab.cluster.gathering",
    "RankRecords": "cudalab.cluster.records",
    "ConnectionInfo": "cudalab.cluster.connection",
    "job_id": "cudalab.cluster.connection",
}

__all__ = list(_OWNERS)


__getattr__, __dir__ = lazy_names(__name__, _OWNERS, globals())
