"""One rank of a multi-process NCCL check, launched by tests/comm/test_communicator_gpu.py.

    python tests/comm/multiprocess_worker.py --rank R --world-size N --uid-file PATH
    mpirun -n N python tests/comm/multiprocess_worker.py --mpi

Builds a :class:`cudalab.comm.Communicator` (device = rank, or the node-local rank under
MPI), runs every operation (all_reduce, all_gather, reduce_scatter, broadcast, reduce,
send/recv, a grouped exchange, a side stream), compares each result with numpy and exits 1
on the first mismatch (0 when all agree). A watchdog ends the process if it hangs.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys

import numpy as np

# Runnable as a script from anywhere: the repository's root first on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import cudalab  # noqa: E402
from cudalab.comm import rendezvous  # noqa: E402
from cudalab.comm.communicator import Communicator  # noqa: E402

N = 1031  # elements per rank (odd: no alignment luck)
HANG_SECONDS = 180


class Mismatch(AssertionError):
    pass


def check(name: str, got: np.ndarray, expected: np.ndarray, rank: int) -> None:
    if got.shape != expected.shape or not np.allclose(got, expected, rtol=1e-5, atol=1e-5):
        bad = np.flatnonzero(~np.isclose(got.ravel(), expected.ravel()))[:5] \
            if got.shape == expected.shape else "shape"
        raise Mismatch(f"rank {rank}: {name}: got {got.ravel()[:6]}..., expected "
                       f"{expected.ravel()[:6]}... (first bad indices {bad})")
    print(f"rank {rank}: {name} ok", flush=True)


def inputs(rank: int, dtype) -> np.ndarray:
    return (np.arange(N) % 97 * (rank + 1) + rank).astype(dtype)


def run(comm: Communicator) -> None:
    rank, world, dev = comm.rank, comm.world_size, comm.device
    cudalab.set_device(dev)
    peer = (rank + 1) % world
    source = (rank - 1) % world
    every = [inputs(r, np.float32) for r in range(world)]

    for dtype in (np.float32, np.int32, np.float64):
        x = cudalab.asarray(inputs(rank, dtype))
        comm.all_reduce(x)
        check(f"all_reduce sum {np.dtype(dtype).name}", x.numpy(),
              sum(inputs(r, dtype) for r in range(world)).astype(dtype), rank)

    x = cudalab.asarray(every[rank])
    y = cudalab.zeros(N, dtype="float32")
    comm.all_reduce(x, y, op="max")
    check("all_reduce max (out of place)", y.numpy(), np.maximum.reduce(every), rank)
    comm.all_reduce(x, y, op="avg")
    check("all_reduce avg", y.numpy(), sum(every) / world, rank)

    z = cudalab.asarray((np.arange(N) * (1 + 1j) * (rank + 1)).astype(np.complex64))
    comm.all_reduce(z)
    check("all_reduce complex64", z.numpy(),
          np.arange(N) * (1 + 1j) * sum(r + 1 for r in range(world)), rank)

    gathered = cudalab.zeros(world * N, dtype="float32")
    comm.all_gather(cudalab.asarray(every[rank]), gathered)
    check("all_gather", gathered.numpy(), np.concatenate(every), rank)
    whole = cudalab.zeros(world * N, dtype="float32")
    whole[rank * N:(rank + 1) * N] = every[rank]
    comm.all_gather(whole[rank * N:(rank + 1) * N], whole)
    check("all_gather in place", whole.numpy(), np.concatenate(every), rank)

    big = [np.arange(world * N, dtype=np.float32) % 89 * (r + 1) for r in range(world)]
    part = cudalab.zeros(N, dtype="float32")
    comm.reduce_scatter(cudalab.asarray(big[rank]), part)
    check("reduce_scatter", part.numpy(), sum(big)[rank * N:(rank + 1) * N], rank)

    b = cudalab.asarray(np.full(N, rank + 10, dtype=np.int64))
    comm.broadcast(b, root=world - 1)
    check("broadcast in place (last rank)", b.numpy(), np.full(N, world - 1 + 10), rank)
    recv = cudalab.zeros(N, dtype="float32")
    comm.broadcast(cudalab.asarray(every[rank]), recv, 0)
    check("broadcast two buffers (root 0)", recv.numpy(), every[0], rank)

    out = cudalab.asarray(np.full(N, -1, dtype=np.float32))
    comm.reduce(cudalab.asarray(every[rank]), out, root=0)
    check("reduce (root 0)", out.numpy(), sum(every) if rank == 0 else np.full(N, -1), rank)

    if world > 1:
        got = cudalab.zeros(N, dtype="float32")
        if rank == 0:
            comm.send(cudalab.asarray(every[0]), 1)
        elif rank == 1:
            comm.recv(got, 0)
        check("send/recv", got.numpy(), every[0] if rank == 1 else np.zeros(N), rank)

    incoming = cudalab.zeros(N, dtype="float32")
    with cudalab.comm.group():
        comm.send(cudalab.asarray(every[rank]), peer)
        comm.recv(incoming, source)
    check("grouped ring exchange", incoming.numpy(), every[source], rank)

    side = cudalab.Stream()
    s = cudalab.asarray(every[rank])
    cudalab.synchronize()
    comm.all_reduce(s, stream=side)
    side.synchronize()
    check("all_reduce on a side stream", s.numpy(), sum(every), rank)

    comm.async_error()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--uid-file")
    parser.add_argument("--mpi", action="store_true", help="rank, size and id from MPI")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)  # never hang CI
    if args.mpi:
        info = rendezvous.launch_info_from_mpi()
        uid = rendezvous.unique_id_from_mpi()
        rank, world, device = info.rank, info.world_size, info.local_rank
    else:
        rank, world = args.rank, args.world_size
        uid = rendezvous.unique_id_from_file(args.uid_file, rank, timeout=120)
        device = rank
    device %= cudalab.device_count()
    try:
        with Communicator(rank, world, uid, device=device) as comm:
            run(comm)
    except Mismatch as exc:
        print(f"MISMATCH {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"rank {rank}: all checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
