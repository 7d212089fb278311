"""One rank of ``benchmarks/comm.py``'s multi-process all_reduce rows (not run by hand).

Launched once per GPU by ``comm.py`` with ``RANK``, ``WORLD_SIZE`` and ``COMM_BENCH_DIR`` in
the environment (device = rank). The rank joins two communicators over the same GPUs:

* cudalab's :class:`cudalab.comm.Communicator` (unique id through a file in the directory);
* NCCL's own, created and driven from ``nccl4py``'s raw bindings directly (its own unique
  id, through a second file), on the same buffer and the same stream;

then times ``all_reduce`` in place for each size, alternating the two in rounds (nccl-tests'
method: ``iters`` launches, one synchronize, time / iters; bus bandwidth = size / time x
2(n-1)/n). Rank 0 prints one JSON line, ``RESULT {...}``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout works uninstalled


def main() -> int:
    import numpy as np
    from nccl.bindings import nccl as raw

    import cudalab
    from cudalab import comm

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    folder = os.environ["COMM_BENCH_DIR"]
    sizes = [int(s) for s in os.environ["COMM_BENCH_SIZES"].split(",")]
    rounds = int(os.environ.get("COMM_BENCH_ROUNDS", "5"))
    cudalab.set_device(rank)
    uid = comm.unique_id_from_file(os.path.join(folder, "cudalab.uid"), rank)
    ours = comm.Communicator(rank, world, uid, device=rank)
    # NCCL's own communicator gets its own id (an ncclUniqueId is the same bytes whoever
    # asked NCCL for it), carried the same way
    raw_uid = comm.unique_id_from_file(os.path.join(folder, "raw.uid"), rank)
    theirs = raw.comm_init_rank_scalable(world, rank, 1, bytearray(raw_uid), 0)
    stream = cudalab.Stream()
    handle = stream.cuda_stream
    factor = 2 * (world - 1) / world
    rows = []
    biggest = cudalab.array.empty((max(sizes) // 4,), dtype=np.float32, device=rank)
    biggest.fill_(1.0)
    for size in sizes:
        count = size // 4
        buf = biggest[:count]
        iters = max(5, min(200, (4 << 30) // max(size, 1)))

        def run_ours(n: int, buf=buf) -> None:
            with cudalab.stream(stream):
                for _ in range(n):
                    ours.all_reduce(buf)

        def run_raw(n: int, buf=buf, count=count) -> None:
            for _ in range(n):
                raw.all_reduce(buf.ptr, buf.ptr, count, 7, 0, theirs, handle)

        times: dict[str, list[float]] = {"cudalab": [], "nccl4py": []}
        for fn in (run_ours, run_raw):  # warm-up: connections, first launches
            fn(2)
        stream.synchronize()
        for _ in range(rounds):
            for key, fn in (("cudalab", run_ours), ("nccl4py", run_raw)):
                stream.synchronize()
                t0 = time.perf_counter()
                fn(iters)
                stream.synchronize()
                times[key].append((time.perf_counter() - t0) / iters)
        row = {"bytes": size}
        for key, samples in times.items():
            t = statistics.median(samples)
            row[f"{key}_us"] = t * 1e6
            row[f"{key}_busbw"] = size / t / 1e9 * factor
        rows.append(row)
    ours.close()
    raw.comm_finalize(theirs)
    raw.comm_destroy(theirs)
    if rank == 0:
        print("RESULT " + json.dumps({"world_size": world, "rows": rows}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
