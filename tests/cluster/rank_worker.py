"""One rank of the cluster tests and benchmark, as a process of its own.

    CUDALAB_CLUSTER=DIR RANK=r WORLD_SIZE=n python tests/cluster/rank_worker.py [--mib M]

Allocates ``(rank + 1) * M`` MiB (M = 1 by default) with history recording on, publishes
(``CUDALAB_CLUSTER`` makes ``import cudalab`` serve), prints ``ready`` and reads commands
from stdin, one per line: ``alloc <bytes>`` (keeps one more array), ``free`` (drops those),
``quit`` (exits 0). Ctrl-C (SIGINT) prints ``interrupted`` and exits 130; the exit handlers
stop the publisher and remove its connection file. A watchdog ends it after 120 s.

    python tests/cluster/rank_worker.py --gather [--mib M]      (under mpirun)

gathers every rank's stats, history tail and snapshot to rank 0 over MPI and checks the
gathered peaks against each rank's own ``memory_stats()`` (sent along by every rank's own
printout: rank 0 prints ``peaks <json>`` of the gathered ones, each rank ``own <rank>
<peak>``).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import cudalab  # noqa: E402
from cudalab import memory  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=1.0)
    parser.add_argument("--gather", action="store_true")
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--backend", default="gloo", help="torch.distributed's, for --engine torch")
    parser.add_argument("--torch-tensors", action="store_true",
                        help="hold the memory in torch tensors (the rank is torch's allocator)")
    parser.add_argument("--hold", action="store_true",
                        help="publish until Ctrl-C (no stdin: under mpirun only rank 0 has one)")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(120, exit=True)
    rank = int(os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)
    if args.engine == "torch":  # the job already uses torch.distributed
        import torch.distributed as dist

        dist.init_process_group(args.backend)
    size = int((rank + 1) * args.mib * (1 << 20)) // 4
    if args.torch_tensors:  # a torch job: its allocator is torch's
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        kept = [torch.zeros(size, device="cuda")]
        scratch = torch.zeros(1000, device="cuda")
        del scratch

        def own_peak() -> int:
            return int(torch.cuda.memory_stats()["allocated_bytes.all.peak"])
    else:
        memory.record_history()
        kept = [cudalab.zeros(size, dtype="float32")]
        scratch = cudalab.zeros(1000)
        del scratch

        def own_peak() -> int:
            return int(memory.memory_stats(0)["allocated_bytes.all.peak"])
    if args.gather:
        from cudalab.cluster import gather

        got = gather(engine=args.engine)
        print(f"own {rank} {own_peak()}", flush=True)
        print(f"device {rank} {cudalab.get_device_name(0)}", flush=True)
        if got is not None:
            print("peaks " + json.dumps({k: next(iter(r.peaks().values()))
                                         for k, r in got.items()}), flush=True)
            print("allocators " + json.dumps({k: r.identity.allocator for k, r in got.items()}),
                  flush=True)
            print("tails " + json.dumps({k: len(r.history_tail.get(0, []))
                                         for k, r in got.items()}), flush=True)
            print("snapshots " + json.dumps({k: len(r.snapshot["segments"])  # type: ignore[index]
                                             for k, r in got.items()}), flush=True)
        return 0
    try:
        print("ready", flush=True)  # (in the try: a Ctrl-C right after it is the rank's too)
        if args.hold:
            import time

            while True:
                time.sleep(0.05)
        for line in sys.stdin:
            command = line.split()
            if not command:
                continue
            if command[0] == "alloc":
                kept.append(cudalab.zeros(int(command[1]) // 4, dtype="float32"))
            elif command[0] == "free":
                del kept[1:]
            elif command[0] == "child":  # a subprocess inheriting the environment
                import subprocess

                subprocess.run([sys.executable, "-c", "import cudalab, time; "
                                "from cudalab.cluster import publisher; "
                                "print(len(publisher.publishers()))"], check=True)
            elif command[0] == "quit":
                return 0
            print("done", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
