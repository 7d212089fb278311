"""Collectives: ``torch.cuda.comm`` over NCCL and peer copies, and NCCL communicators
across processes and nodes.

Single process, several GPUs (torch's names, arguments and errors):
:func:`broadcast`, :func:`broadcast_coalesced`, :func:`reduce_add`,
:func:`reduce_add_coalesced`, :func:`scatter`, :func:`gather`. They use NCCL (through
:mod:`cudalab.nccl`) where torch does, and peer copies otherwise.

Across processes and nodes: :class:`Communicator` (one rank per process, NCCL's unique-id
bootstrap), the unique id carried by MPI (:func:`unique_id_from_mpi`), a file on a shared
filesystem (:func:`unique_id_from_file`) or an environment variable
(:func:`unique_id_from_env`), and :func:`group` (NCCL's ``groupStart``/``groupEnd``).

Names load on first use, so ``import cudalab`` stays cheap.
"""

from __future__ import annotations

from cudalab.lazy_names import lazy_names

#: Each public name and the submodule that owns it.
_OWNERS = {
    "broadcast": "cudalab.comm.collectives",
    "broadcast_coalesced": "cudalab.comm.coalesced",
    "reduce_add": "cudalab.comm.collectives",
    "reduce_add_coalesced": "cudalab.comm.coalesced",
    "scatter": "cudalab.comm.scatter_gather",
    "gather": "cudalab.comm.scatter_gather",
    "Communicator": "cudalab.comm.communicator",
    "group": "cudalab.comm.group_calls",
    "unique_id_from_mpi": "cudalab.comm.rendezvous",
    "unique_id_from_file": "cudalab.comm.rendezvous",
    "unique_id_from_env": "cudalab.comm.rendezvous",
}

__all__ = list(_OWNERS)


__getattr__, __dir__ = lazy_names(__name__, _OWNERS, globals())
