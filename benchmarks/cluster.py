"""The cluster view's benchmark: 8 ranks on one machine publishing to a notebook's watch,
and gathering every rank's history and snapshot.

Rows:

* **step slowdown**: each rank runs a training-like step (activations allocated, computed
  on, freed) in blocks of about a second (two samples at 2 Hz), alternating blocks with its
  publisher publishing (and watched) and paused (``Publisher.paused``: no sample taken nor
  sent, the thread idle); the slowdown is median(on) / median(off) - 1 per rank (goal
  <= 1 %);
* **panel rate**: samples per second the watch receives from each rank (goal 2 Hz);
* **least-headroom flag**: seconds from a rank's allocation to the watch naming it
  (goal <= 1 s);
* **fetch**: ``watch.fetch(("history_tail", "snapshot"))`` of every rank, each holding a
  100k-entry history, into the notebook (received, bounded-decoded, schema-checked; goal
  <= 2 s). The entries travel as columns (:mod:`cudalab.cluster.columns`); building them as
  torch's dicts happens on first access, timed on its own row;
* **gather**: ``cudalab.cluster.gather(("stats", "history_tail", "snapshot"))`` over MPI
  under ``mpirun -n 8`` (when mpi4py and an mpirun are here), timed on rank 0, and its peaks
  compared byte for byte with every rank's own ``memory_stats()``.

Nothing here has a torch or CuPy equivalent to run beside it (neither ships a multi-rank
allocator view), so the table has cudalab's column only.

    python benchmarks/cluster.py [--ranks 8] [--entries 100000] [--gpu] [--quick] [--json out.json]

Without ``--gpu`` the ranks run on the simulator (``CUDALAB_SIMULATOR=1``); with it they
share the host's real GPU(s) (rank r on device r % count).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MiB = 1 << 20


# ----------------------------------------------------------------------------- a rank
def _fill_history(entries: int) -> None:
    import cudalab
    from cudalab import memory

    memory.record_history(max_entries=entries)
    for i in range(entries // 2 + 1):
        a = cudalab.empty(1024 + (i % 7) * 512)
        del a


def _step(size: int) -> None:
    import cudalab

    x = cudalab.ones(size)
    acts = []
    for _ in range(6):
        x = x * 1.0001 + 1.0
        acts.append(x)
    del acts, x


def rank_worker(args: argparse.Namespace) -> int:
    import cudalab
    from cudalab.cluster import serve

    rank = int(os.environ.get("RANK", "0"))
    if args.gpu:
        cudalab.set_device(rank % cudalab.device_count())
    base = cudalab.zeros((rank + 1) * 8 * MiB // 4)
    _fill_history(args.entries)
    size = 1 << 16
    for _ in range(20):
        _step(size)
    cudalab.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        _step(size)
    cudalab.synchronize()
    per_step = (time.perf_counter() - t0) / 20
    steps = max(int(args.block_seconds / per_step), 10)  # blocks of ~block_seconds
    on: list[float] = []
    off: list[float] = []
    # "without publishing": the publisher paused (no sample taken nor sent; its thread idle),
    # so each block measures the steady cost of publishing, not the publisher's start
    publisher = serve(args.directory, interval=0.5)
    busy = 0.0
    for block in range(2 * args.blocks):
        publishing = block % 2 == (rank % 2)  # half the ranks start with it on
        publisher.paused = not publishing
        time.sleep(0.05)
        b0 = publisher.busy_seconds
        t0 = time.perf_counter()
        for _ in range(steps):
            _step(size)
        cudalab.synchronize()
        (on if publishing else off).append(time.perf_counter() - t0)
        busy += publisher.busy_seconds - b0
    publisher.paused = False
    print(json.dumps({"rank": rank, "on": on, "off": off, "busy": busy}), flush=True)
    print("serving", flush=True)
    kept = [base]
    for line in sys.stdin:
        words = line.split()
        if words and words[0] == "alloc":
            kept.append(cudalab.zeros(int(words[1]) // 4))
        elif words and words[0] == "free":
            del kept[1:]
        elif words and words[0] == "quit":
            break
        print("done", flush=True)
    return 0


def gather_worker(args: argparse.Namespace) -> int:
    import cudalab
    from cudalab import memory
    from cudalab._driver import mpi as _mpi
    from cudalab.cluster import gather

    world = _mpi.mpi().COMM_WORLD
    rank = world.Get_rank()
    if args.gpu:
        cudalab.set_device(rank % cudalab.device_count())
    base = cudalab.zeros((rank + 1) * 8 * MiB // 4)
    _fill_history(args.entries)
    own = memory.memory_stats()["allocated_bytes.all.peak"]
    world.Barrier()
    t0 = time.perf_counter()
    got = gather(("stats", "history_tail", "snapshot"), tail=args.entries, engine="mpi")
    took = time.perf_counter() - t0
    owns = world.gather(own, root=0)  # (ints this script made: the benchmark's own check)
    if got is not None:
        device = cudalab.current_device()
        exact = all(got[r].stats[device if args.gpu else 0]["allocated_bytes.all.peak"] == owns[r]
                    for r in range(len(owns)))
        t0 = time.perf_counter()
        entries = min(len(r.history_tail.get(device, [])) for r in got.values())
        built = time.perf_counter() - t0
        print(json.dumps({"gather_s": took, "exact": exact, "entries": entries,
                          "built_s": built}), flush=True)
    del base
    return 0


# ----------------------------------------------------------------------------- the notebook
def _env(args: argparse.Namespace, rank: int) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                    os.environ.get("PYTHONPATH")])),
               RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank),
               CUDALAB_CLUSTER_JOB="benchmark", NCCL_NVLS_ENABLE="0")
    env.pop("CUDALAB_CLUSTER", None)
    if args.gpu:
        env.pop("CUDALAB_SIMULATOR", None)
    else:
        env["CUDALAB_SIMULATOR"] = "1"
    return env


def _worker_args(args: argparse.Namespace) -> list[str]:
    return ["--entries", str(args.entries), "--blocks", str(args.blocks), "--block-seconds",
            str(args.block_seconds), "--directory", args.directory, *(["--gpu"] if args.gpu else [])]


def run_ranks(args: argparse.Namespace, results: dict) -> None:
    from cudalab.cluster import watch

    procs = [subprocess.Popen([sys.executable, __file__, "--rank-worker", *_worker_args(args)],
                              env=_env(args, r), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for r in range(args.ranks)]
    w = watch(args.directory, job="benchmark")
    try:
        slowdowns, shares, on_all, off_all = [], [], 0.0, 0.0
        for p in procs:
            line = p.stdout.readline()  # type: ignore[union-attr]
            data = json.loads(line)
            slowdowns.append(statistics.median(data["on"]) / statistics.median(data["off"]) - 1)
            shares.append(data["busy"] / sum(data["on"]))
            on_all, off_all = on_all + sum(data["on"]), off_all + sum(data["off"])
            assert p.stdout.readline().strip() == "serving"  # type: ignore[union-attr]
        results["step slowdown, median of ranks (%)"] = 100 * statistics.median(slowdowns)
        results["step slowdown, worst rank (%)"] = 100 * max(slowdowns)
        results["step slowdown, all ranks' blocks pooled (%)"] = 100 * (on_all / off_all - 1)
        # what publishing itself costs: the publisher thread's CPU time while publishing, a
        # share of the step's time (the bound of the slowdown it can cause, without the noise
        # of 8 processes sharing the CPUs and the GPU)
        results["publisher thread CPU / step time, worst rank (%)"] = 100 * max(shares)
        end = time.monotonic() + 20
        while len([v for v in w.samples().values() if v]) < args.ranks and time.monotonic() < end:
            time.sleep(0.05)
        # panel rate: distinct samples per rank over a few seconds
        seen: dict[int, set[float]] = {}
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.rate_seconds:
            for rank, samples in w.samples().items():
                if samples:
                    seen.setdefault(rank, set()).add(samples[0].time)
            time.sleep(0.02)
        rates = [len(v) / args.rate_seconds for v in seen.values()]
        results["panel rate per rank, min (Hz)"] = min(rates) if len(rates) == args.ranks else 0.0
        # the least-headroom flag follows an allocation
        lags = []
        for rank in (0, 1, 2)[: 1 if args.quick else 3]:
            grow = (args.ranks + 2) * 8 * MiB * (1 + len(lags))
            procs[rank].stdin.write(f"alloc {grow}\n")  # type: ignore[union-attr]
            procs[rank].stdin.flush()  # type: ignore[union-attr]
            t0 = time.monotonic()
            assert procs[rank].stdout.readline().strip() == "done"  # type: ignore[union-attr]
            while (h := w.least_headroom()) is None or h.rank != rank:
                if time.monotonic() - t0 > 10:
                    break
                time.sleep(0.01)
            lags.append(time.monotonic() - t0)
            procs[rank].stdin.write("free\n")  # type: ignore[union-attr]
            procs[rank].stdin.flush()  # type: ignore[union-attr]
            procs[rank].stdout.readline()  # type: ignore[union-attr]
            time.sleep(0.6)
        results["least-headroom flag follows, worst (s)"] = max(lags)
        # fetch every rank's history and snapshot into this process
        took = []
        for _ in range(1 if args.quick else 3):
            t0 = time.perf_counter()
            got = w.fetch(("history_tail", "snapshot"), tail=args.entries, timeout=60)
            took.append(time.perf_counter() - t0)
            assert len(got) == args.ranks, (sorted(got), w.fetch_errors, w.lost(),
                                            sorted(w.samples()), w.ranks())
        results[f"fetch {args.ranks} ranks' {args.entries:,}-entry histories + snapshots (s)"] = \
            statistics.median(took)
        t0 = time.perf_counter()
        results["entries per rank fetched, min"] = min(
            len(next(iter(r.history_tail.values()), [])) for r in got.values())
        for r in got.values():
            assert r.snapshot is not None
        results["fetched entries as dicts, built on first access (s)"] = time.perf_counter() - t0
    finally:
        w.close()
        for p in procs:
            try:
                p.stdin.write("quit\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


def _mpirun() -> list[str] | None:
    text = os.environ.get("CUDALAB_MPIRUN", "").strip()
    if text:
        return text.split()
    here = Path(sys.executable).parent / "mpirun"
    found = str(here) if here.exists() else shutil.which("mpirun")
    if found is None:
        return None
    return [found, *(["--allow-run-as-root"] if os.geteuid() == 0 else [])]


def run_gather(args: argparse.Namespace, results: dict) -> None:
    launcher = _mpirun()
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        launcher = None
    if launcher is None:
        results["gather over MPI"] = "skipped (no mpi4py / mpirun)"
        return
    env = _env(args, 0)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name)
    prefix = Path(launcher[0]).resolve().parent.parent
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if (prefix / "lib").is_dir():
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(prefix / "lib"),
                                                               env.get("LD_LIBRARY_PATH")]))
        env["OPAL_PREFIX"] = str(prefix)
    exports = [a for n in ("PYTHONPATH", "LD_LIBRARY_PATH", "CUDALAB_SIMULATOR",
                           "NCCL_NVLS_ENABLE") if n in env for a in ("-x", n)]
    res = subprocess.run([*launcher, "--oversubscribe", *exports, "-n", str(args.ranks),
                          sys.executable, __file__, "--gather-worker", *_worker_args(args)],
                         env=env, capture_output=True, text=True, timeout=300)
    line = next((x for x in res.stdout.splitlines() if x.startswith("{")), None)
    if res.returncode != 0 or line is None:
        results["gather over MPI"] = f"failed: {(res.stdout + res.stderr)[-300:]}"
        return
    data = json.loads(line)
    results[f"gather {args.ranks} ranks' {args.entries:,}-entry histories + snapshots over "
            "MPI (s)"] = data["gather_s"]
    results["gathered peaks byte-exact vs memory_stats()"] = data["exact"]
    results["entries per rank gathered, min"] = data["entries"]
    results["gathered entries as dicts, built on first access (s)"] = data["built_s"]


class Results(dict):
    """The rows, each printed as soon as it is measured (a run cut short keeps its rows)."""

    def __setitem__(self, name: str, value: object) -> None:
        super().__setitem__(name, value)
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"  . {name}: {shown}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--blocks", type=int, default=8, help="blocks on and off, each")
    parser.add_argument("--block-seconds", type=float, default=1.0,
                        help="seconds per block (2 samples at 2 Hz)")
    parser.add_argument("--rate-seconds", type=float, default=4.0)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--directory", default=None)
    parser.add_argument("--rank-worker", action="store_true")
    parser.add_argument("--gather-worker", action="store_true")
    args = parser.parse_args()
    if args.rank_worker:
        return rank_worker(args)
    if args.gather_worker:
        return gather_worker(args)
    if args.quick:
        args.blocks, args.rate_seconds = min(args.blocks, 4), min(args.rate_seconds, 2.0)
    results: dict = Results()
    with tempfile.TemporaryDirectory(prefix="cudalab-cluster-bench-") as directory:
        args.directory = directory
        t0 = time.perf_counter()
        run_ranks(args, results)
        run_gather(args, results)
        took = time.perf_counter() - t0
    where = "GPU" if args.gpu else "simulator"
    print(f"cudalab.cluster, {args.ranks} ranks on one host ({where}; {os.cpu_count()} CPUs), "
          f"{took:.0f} s")
    width = max(map(len, results))
    for name, value in results.items():
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"  {name:<{width}}  {shown}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"where": where, "ranks": args.ranks, **results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
