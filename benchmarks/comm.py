"""Collectives benchmark: ``cudalab.comm`` next to ``torch.cuda.comm``, and the multi-process
``all_reduce`` next to NCCL's own (driven from ``nccl4py`` directly), in the same run.

Rows, on the first two GPUs, for sizes 1 KiB ... 1 GiB (float32):

* ``broadcast(x, devices=[0, 1])``, ``reduce_add([x0, x1], destination=0)``,
  ``scatter(x, devices=[0, 1])`` and ``gather([x0, x1], destination=0)``: GB/s of cudalab
  and torch, and their ratio (goal: >= 1.0x torch at every size). Time = ``iters`` calls,
  then one synchronize of both devices, / ``iters`` (nccl-tests' method); the two libraries
  alternate in rounds and the median round counts. Bytes per call, as nccl-tests counts them:
  the array for broadcast and reduce_add, the whole array for scatter and gather.
* a peer copy (``y.copy_(x)`` from cuda:0 to cuda:1) at 1 GiB, the link's reference;
* ``Communicator.all_reduce`` with one process per GPU (started with ``subprocess``, the
  unique id through a file), against NCCL's own communicator driven from ``nccl4py``'s
  raw bindings in the same processes on the same buffers: bus bandwidth (2(n-1)/n x size /
  time) and the ratio (goal at 1 GiB: within 5 %).

Needs two GPUs (skips the rows otherwise). On the simulator nothing is measured: the
simulator has no links to time, so the script says so and stops.

    python benchmarks/comm.py [--json out.json] [--quick]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout works uninstalled
from _harness import Table, environment, optional_import, parse_args, write_json  # noqa: E402

from cudalab._units import format_bytes as _size  # noqa: E402 - the one size formatter

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = [KiB, 16 * KiB, 256 * KiB, 4 * MiB, 64 * MiB, 256 * MiB, GiB]
QUICK_SIZES = [KiB, 256 * KiB, 64 * MiB]
OPERATIONS = ("broadcast", "reduce_add", "scatter", "gather")


def _iters(size: int, quick: bool) -> int:
    """Calls per round: enough to hide the host for small sizes, few for big ones."""
    cap = 20 if quick else 100
    return max(3, min(cap, (2 * GiB) // max(size, 1)))


def _rounds(contenders: dict, iters: int, rounds: int) -> dict[str, float]:
    """Median seconds per call of each contender, alternating them in ``rounds`` rounds."""
    for run, sync in contenders.values():  # warm-up: allocations, peer access, NCCL cliques
        run(2)
        sync()
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, (run, sync) in contenders.items():
            sync()
            t0 = time.perf_counter()
            run(iters)
            sync()
            samples[name].append((time.perf_counter() - t0) / iters)
    return {name: statistics.median(v) for name, v in samples.items()}


def _single_process(table: Table, results: dict, quick: bool) -> None:
    import numpy as np
    import torch

    import cudalab

    sizes = QUICK_SIZES if quick else SIZES
    rounds = 3 if quick else 9

    def sync_cudalab() -> None:
        cudalab.synchronize(0)
        cudalab.synchronize(1)

    def sync_torch() -> None:
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)

    rows = []
    for size in sizes:
        rows += _one_size(size, quick, rounds, sync_cudalab, sync_torch)
        cudalab.empty_cache()
        torch.cuda.empty_cache()
    results["single_process"] = rows
    w = max(len(f"{r['op']} {_size(r['bytes'])}") for r in rows)
    print(f"{'operation':<{w}}  {'cudalab GB/s':>12}  {'torch GB/s':>10}  {'ratio':>6}  "
          f"{'cudalab µs':>11}  {'torch µs':>10}")
    for r in rows:
        print(f"{r['op'] + ' ' + _size(r['bytes']):<{w}}  {r['cudalab_GBps']:12.2f}  "
              f"{r['torch_GBps']:10.2f}  {r['ratio']:6.3f}  {r['cudalab_us']:11.1f}  "
              f"{r['torch_us']:10.1f}")
    worst = min(rows, key=lambda r: r["ratio"])
    table.add("worst cudalab/torch GB/s ratio (goal >= 1.0)", worst["ratio"], "x",
              f"{worst['op']} {_size(worst['bytes'])}")
    for r in rows:
        if r["op"] == "broadcast" and r["bytes"] == max(sizes):
            table.add(f"cudalab broadcast {_size(r['bytes'])}", r["cudalab_GBps"], "GB/s")
            table.add(f"torch.cuda.comm broadcast {_size(r['bytes'])}", r["torch_GBps"], "GB/s")
    # the link's reference: one peer copy of the biggest size
    size = max(sizes)
    src = cudalab.array.empty((size // 4,), dtype=np.float32, device=0)
    dst = cudalab.array.empty((size // 4,), dtype=np.float32, device=1)
    ts, td = torch.empty(size // 4, device="cuda:0"), torch.empty(size // 4, device="cuda:1")

    def copy_ours(n: int) -> None:
        for _ in range(n):
            dst.copy_(src)

    def copy_theirs(n: int) -> None:
        for _ in range(n):
            td.copy_(ts)

    t = _rounds({"cudalab": (copy_ours, sync_cudalab), "torch": (copy_theirs, sync_torch)},
                _iters(size, quick), rounds)
    results["peer_copy_GBps"] = {k: size / v / 1e9 for k, v in t.items()}
    table.add(f"cudalab peer copy {_size(size)}", size / t["cudalab"] / 1e9, "GB/s")
    table.add(f"torch peer copy {_size(size)}", size / t["torch"] / 1e9, "GB/s")


def _one_size(size: int, quick: bool, rounds: int, sync_cudalab, sync_torch) -> list[dict]:
    """The four operations at one size, cudalab and torch alternating."""
    import numpy as np
    import torch
    import torch.cuda.comm

    import cudalab
    from cudalab import comm as ccomm

    tcomm = torch.cuda.comm
    count = size // 4
    x0 = cudalab.array.empty((count,), dtype=np.float32, device=0)
    x0.fill_(1.0)
    x1 = cudalab.array.empty((count,), dtype=np.float32, device=1)
    x1.fill_(2.0)
    t0 = torch.ones(count, dtype=torch.float32, device="cuda:0")
    t1 = torch.full((count,), 2.0, dtype=torch.float32, device="cuda:1")
    calls = {
        "broadcast": (lambda: ccomm.broadcast(x0, devices=[0, 1]),
                      lambda: tcomm.broadcast(t0, devices=[0, 1])),
        "reduce_add": (lambda: ccomm.reduce_add([x0, x1], destination=0),
                       lambda: tcomm.reduce_add([t0, t1], destination=0)),
        "scatter": (lambda: ccomm.scatter(x0, devices=[0, 1]),
                    lambda: tcomm.scatter(t0, devices=[0, 1])),
        "gather": (lambda: ccomm.gather([x0, x1], destination=0),
                   lambda: tcomm.gather([t0, t1], destination=0)),
    }
    rows = []
    for op in OPERATIONS:
        ours, theirs = calls[op]
        # bytes per call as nccl-tests counts them: the array (broadcast, reduce), the whole
        # array (scatter: the source; gather: the result)
        nbytes = 2 * size if op == "gather" else size

        def run_ours(n: int, ours=ours) -> None:
            for _ in range(n):
                ours()

        def run_theirs(n: int, theirs=theirs) -> None:
            for _ in range(n):
                theirs()

        t = _rounds({"cudalab": (run_ours, sync_cudalab), "torch": (run_theirs, sync_torch)},
                    _iters(size, quick), rounds)
        ours_gbs, theirs_gbs = nbytes / t["cudalab"] / 1e9, nbytes / t["torch"] / 1e9
        rows.append({"op": op, "bytes": size, "cudalab_GBps": ours_gbs,
                     "torch_GBps": theirs_gbs, "ratio": ours_gbs / theirs_gbs,
                     "cudalab_us": t["cudalab"] * 1e6, "torch_us": t["torch"] * 1e6})
    return rows


def _multi_process(table: Table, results: dict, quick: bool) -> None:
    sizes = QUICK_SIZES if quick else [MiB, 64 * MiB, GiB]
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_comm_worker.py")
    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, WORLD_SIZE="2", COMM_BENCH_DIR=folder,
                   COMM_BENCH_SIZES=",".join(map(str, sizes)),
                   COMM_BENCH_ROUNDS="3" if quick else "5")
        env.setdefault("NCCL_NVLS_ENABLE", "0")  # the workplace's rule for these machines
        procs = [subprocess.Popen([sys.executable, worker], env=dict(env, RANK=str(r)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=300))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
    for p, (_out, err) in zip(procs, outs):
        if p.returncode:
            raise RuntimeError(f"a rank failed (exit {p.returncode}):\n{err[-3000:]}")
    line = next(x for x in outs[0][0].splitlines() if x.startswith("RESULT "))
    payload = json.loads(line[len("RESULT "):])
    results["multi_process_all_reduce"] = payload["rows"]
    print(f"\n{'all_reduce, 2 processes':<24}  {'cudalab busbw':>13}  {'nccl4py busbw':>13}  "
          f"{'ratio':>6}")
    for r in payload["rows"]:
        ratio = r["cudalab_busbw"] / r["nccl4py_busbw"]
        r["ratio"] = ratio
        print(f"{_size(r['bytes']):<24}  {r['cudalab_busbw']:13.2f}  {r['nccl4py_busbw']:13.2f}  "
              f"{ratio:6.3f}")
    big = payload["rows"][-1]
    table.add(f"multi-process all_reduce busbw {_size(big['bytes'])}, cudalab",
              big["cudalab_busbw"], "GB/s")
    table.add(f"multi-process all_reduce busbw {_size(big['bytes'])}, nccl4py",
              big["nccl4py_busbw"], "GB/s", f"ratio {big['ratio']:.3f} (goal >= 0.95)")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import cudalab

    table = Table("cudalab.comm vs torch.cuda.comm and NCCL")
    results: dict = {}
    name = cudalab.get_device_name(0) if cudalab.is_available() else "none"
    if cudalab.get_device_properties(0).simulated:
        print("simulated devices: collectives have no links to time here; run this on a GPU "
              "machine with two GPUs")
        return
    if cudalab.device_count() < 2:
        print(f"needs two GPUs, found {cudalab.device_count()}: nothing measured")
        return
    torch = optional_import("torch")
    if torch is None or torch.cuda.device_count() < 2:
        print("torch with two GPUs is needed for the comparison rows: skipped")
    else:
        _single_process(table, results, args.quick)
    if optional_import("nccl.bindings.nccl") is None:
        print("nccl4py is not installed: the multi-process rows are skipped")
    else:
        _multi_process(table, results, args.quick)
    print()
    print(table.render())
    write_json(args.json, {"environment": environment("cuda", f"2 x {name}"),
                           "rows": table.rows, "results": results})


if __name__ == "__main__":
    main()
