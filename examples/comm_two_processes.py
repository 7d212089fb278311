"""Two processes, one GPU each, summing an array with NCCL through cudalab.comm.Communicator.

    python examples/comm_two_processes.py            # the launcher: starts both ranks
    python examples/comm_two_processes.py --ranks 4  # more ranks (needs that many GPUs)

The launcher creates the job's NCCL unique id (it serves the id's bootstrap socket, so it
waits for its children) and starts each rank with ``launch_env``: the id as hex in
``CUDALAB_NCCL_UNIQUE_ID`` plus torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``.
Each rank builds its communicator with ``Communicator.from_env()`` on GPU ``LOCAL_RANK``.
Needs as many GPUs as ranks and nccl4py (``pip install 'cudalab[nccl]'``);
docs/comm_multiprocess.md shows the other launchers (mpirun, a shared file, two nodes).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import numpy as np

import cudalab
from cudalab.comm import Communicator
from cudalab.comm.rendezvous import launch_env, new_unique_id

ELEMENTS = 1 << 20


def rank_main() -> None:
    with Communicator.from_env() as comm:  # blocks until every rank has joined
        cudalab.set_device(comm.device)  # new arrays on this rank's GPU
        x = cudalab.full((ELEMENTS,), float(comm.rank + 1), dtype="float32")
        comm.all_reduce(x)  # in place, on the current stream
        total = sum(range(1, comm.world_size + 1))
        assert np.all(x.numpy() == total), "all_reduce gave a wrong sum"
        gathered = cudalab.empty(comm.world_size, dtype="int64")
        comm.all_gather(cudalab.full((1,), comm.rank, dtype="int64"), gathered)
        print(f"rank {comm.rank}/{comm.world_size} on cuda:{comm.device}: sum {x[:1].item()} "
              f"(expected {total}), ranks seen {gathered.tolist()}", flush=True)


def launch(ranks: int) -> int:
    if cudalab.device_count() < ranks:
        print(f"this example needs {ranks} GPUs; this machine has {cudalab.device_count()}")
        return 0
    uid = new_unique_id()  # this process serves its bootstrap socket: it waits below
    base = dict(os.environ)
    base.setdefault("NCCL_NVLS_ENABLE", "0")  # keep NVLink multicast off (our machines)
    children = [subprocess.Popen([sys.executable, __file__, "--rank-main"],
                                 env=launch_env(uid, rank, ranks, base=base))
                for rank in range(ranks)]
    codes = [child.wait() for child in children]
    print("all ranks finished" if not any(codes) else f"exit codes {codes}")
    return max(codes)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="all_reduce across processes with NCCL")
    parser.add_argument("--ranks", type=int, default=2, help="number of processes (GPUs)")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main()
    else:
        sys.exit(launch(args.ranks))
