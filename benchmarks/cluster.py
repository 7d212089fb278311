"""The cluster view's benchmark: 8 ranks on one machine publishing to a notebook's watch,
and gathering every rank's history and snapshot.

Rows:

* **step slowdown**: every rank runs a training-like step (activations allocated, computed
  on, freed; each step ends with a synchronize, as a training step ends with its
  ``loss.item()``) continuously through **aligned wall-clock windows**: once every rank is
  ready, this process sends them all one schedule (:mod:`_cluster_windows`: a start on the
  host's monotonic clock a second ahead, and ``2 * --blocks`` windows of ``--block-seconds``,
  a multiple of the 0.5 s sample interval, so each window holds as many samples), and every
  rank steps from then until the last window ends, so no rank idles, pauses or stops inside
  the measured span. Every rank's publisher is toggled (``Publisher.paused``: no sample
  taken nor sent, the thread asleep) at the same boundaries, all ranks publishing together
  as in a real job, in pairs of one window publishing (and watched) and one paused, the
  order alternating from pair to pair (on, off, off, on, ...), so a drift of the machine's
  speed falls on both sides. A window's figure is its time per step (its seconds over the
  steps completed in it, the steps straddling its ends counted by the fraction of their time
  inside it; no settling margin: a toggle is a flag read at the next tick). A pair's
  slowdown is its on window's time per step over its off window's, minus 1; a **rank's
  slowdown is the median of its pairs'**, and the table gives the median and the worst of
  the ranks' (goal <= 1 % for every rank), all ranks' steps pooled, and for each of the
  three its **noise floor** (the same statistic, the measured effect taken out, with every
  pair's on/off swapped at random, the same pairs on every rank, 95th percentile of 2000
  draws: what the windows' noise alone shows), with every rank's line below
  (its pairs' median, their spread, its steps per window and its publisher thread's CPU per
  sample and per step: the second, independent estimate of the cost). ``--artificial-cost-ms
  X`` makes each rank's sampling hold the interpreter for X ms more (a busy loop in the sample
  source): the harness must then show about ``2 * X / 1000`` of a step where a rank's time is
  its own (its check that a real slowdown shows; ranks saturating a shared GPU give the stalled
  time to one another, and on a few loaded CPUs the spin is preempted and costs more);
* **panel rate**: samples per second the watch receives from each rank (goal 2 Hz);
* **least-headroom flag**: seconds from a rank's allocation to the watch naming it
  (goal <= 1 s);
* **fetch**: ``watch.fetch(("history_tail", "snapshot"))`` of every rank, each holding a
  100k-entry history, into the notebook (received, bounded-decoded, schema-checked; goal
  <= 2 s). The entries travel as columns (:mod:`cudalab.cluster.columns`); building them as
  torch's dicts happens on first access, timed on its own row;
* **lanes**: the fetched snapshots opened as the dashboard's button opens them, one lane per
  rank in a ``LanesExplorer`` (each rank's trace indexed from the columns it travelled as,
  and the first view drawn);
* **gather**: ``cudalab.cluster.gather(("stats", "history_tail", "snapshot"))`` over MPI
  under ``mpirun -n 8`` (when mpi4py and an mpirun are here), timed on rank 0, and its peaks
  compared byte for byte with every rank's own ``memory_stats()``.

Nothing here has a torch or CuPy equivalent to run beside it (neither ships a multi-rank
allocator view), so the table has cudalab's column only.

    python benchmarks/cluster.py [--ranks 8] [--entries 100000] [--blocks 32] [--gpu] [--quick]
                                 [--block-seconds 0.5] [--skip fetch,gather]
                                 [--artificial-cost-ms X] [--json out.json]

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
sys.path.insert(0, str(ROOT / "benchmarks"))
from _cluster_windows import (  # noqa: E402
    SAMPLE_INTERVAL,
    Schedule,
    noise_floors,
    pooled,
    rank_figures,
    rank_table,
    run_windows,
)

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


class CostlySource:
    """A sample source that holds the interpreter ``cost`` seconds more per sample (a busy
    loop) than the one it wraps: the harness's check that a real cost shows."""

    def __init__(self, source: object, cost: float):
        self.source, self.cost, self.name = source, cost, source.name  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.source, name)

    def sample(self, device: int, now: float | None = None) -> object:
        end = time.thread_time() + self.cost  # (CPU time: the same cost on a busy host)
        while time.thread_time() < end:
            pass
        return self.source.sample(device, now)  # type: ignore[attr-defined]


def profile_ticks(args: argparse.Namespace, results: Results) -> None:
    """In this process, alone on the machine: what one tick's parts cost (thread CPU, taken
    in a thread beside a busy step loop, as the publisher's), then the paired slowdown of one
    rank's step with this process's own publisher (no other rank's noise)."""
    import threading

    if "cudalab" not in sys.modules:  # (this process runs as the ranks do)
        if args.gpu:
            os.environ.pop("CUDALAB_SIMULATOR", None)
        else:
            os.environ["CUDALAB_SIMULATOR"] = "1"

    import cudalab
    from cudalab import memory
    from cudalab.cluster import records, serve, wire
    from cudalab.cluster.signing import Signer, new_key
    from cudalab.memory_sources.cudalab_source import DeviceFacts

    size = 1 << 16
    base = cudalab.zeros(8 * MiB // 4)
    for _ in range(40):
        _step(size)
    cudalab.synchronize()
    device = cudalab.current_device()
    source, facts = records.rank_source(), DeviceFacts("cudalab")
    signer = Signer(new_key())
    prefix = wire.samples_header_prefix("profile", 0, os.getpid())
    parts: dict[str, list[float]] = {}
    stop = threading.Event()

    walls: dict[str, list[float]] = {}

    def timed(name: str, fn: object) -> object:
        t0, w0 = time.thread_time(), time.perf_counter()
        out = fn()  # type: ignore[operator]
        parts.setdefault(name, []).append(time.thread_time() - t0)
        walls.setdefault(name, []).append(time.perf_counter() - w0)
        return out

    def sampler() -> None:
        while not stop.wait(0.5):
            # (each part on its own: NVML's figures are kept a few ms, so the sample comes
            # 10 ms after the parts)
            timed("NVML figures", lambda: facts.nvml(device))
            timed("memory_stats()", lambda: memory.memory_stats(device))
            time.sleep(0.01)
            s = timed("sample (memory_stats + NVML)", lambda: source.sample(device, time.time()))
            payload = timed("encode", lambda s=s: wire.encode_samples([s]))
            timed("header + sign", lambda payload=payload: signer.wrap(
                [wire.samples_header(prefix, 1, time.time(), 0, 0, b'""'), payload]))

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    end = time.perf_counter() + args.profile_ticks
    while time.perf_counter() < end:
        _step(size)
    stop.set()
    thread.join()
    for name, values in parts.items():
        results[f"one process: a tick's {name}, thread CPU median of {len(values)} (us)"] = \
            1e6 * statistics.median(values)
    for name in ("NVML figures", "sample (memory_stats + NVML)"):  # (NVML waits in the driver)
        results[f"one process: a tick's {name}, wall median (us)"] = \
            1e6 * statistics.median(walls[name])
    # the paired slowdown of this process's step, its own publisher on and paused
    with tempfile.TemporaryDirectory(prefix="cudalab-cluster-profile-") as directory:
        publisher = serve(directory, interval=SAMPLE_INTERVAL)
        try:
            schedule = Schedule.ahead(args.block_seconds, args.profile_pairs, lead=0.2)
            figures = rank_figures({"rank": 0, **run_windows(
                publisher, schedule, lambda: _step(size), cudalab.synchronize)})
        finally:
            publisher.stop()
    results[f"one process alone: step slowdown, median of {args.profile_pairs} paired "
            "windows (%)"] = 100 * figures["slowdown"]
    results["one process alone: noise floor (the effect taken out, on/off swapped at random, "
            "95th percentile) (%)"] = 100 * noise_floors([figures])["worst"]
    results["one process alone: publisher CPU per sample, median (us)"] = 1e6 * statistics.median(
        figures["ticks"]) if figures["ticks"] else 0.0
    del base


def rank_worker(args: argparse.Namespace) -> int:
    import cudalab
    from cudalab.cluster import records, serve

    rank = int(os.environ.get("RANK", "0"))
    if args.gpu:
        cudalab.set_device(rank % cudalab.device_count())
    base = cudalab.zeros((rank + 1) * 8 * MiB // 4)
    _fill_history(args.entries)
    size = 1 << 16
    for _ in range(20):
        _step(size)
    cudalab.synchronize()
    # "without publishing": the publisher paused (no sample taken nor sent; its thread
    # asleep), so each window measures the steady cost of publishing, not the publisher's start
    source = None
    if args.artificial_cost_ms:
        source = CostlySource(records.rank_source(), args.artificial_cost_ms / 1000)
    publisher = serve(args.directory, interval=SAMPLE_INTERVAL, source=source)
    # the first sample opens NVML and reads the device's identity (tens of ms, once): it is
    # taken before the windows, and shown on its own row
    end = time.monotonic() + 10
    while not publisher.tick_seconds and time.monotonic() < end:
        time.sleep(0.005)
    first = publisher.tick_seconds[0] if publisher.tick_seconds else None
    # ready: the benchmark's process answers with the schedule every rank shares, once
    # every rank is ready; the steps run from then until its last window ends
    print(json.dumps({"ready": rank}), flush=True)
    schedule = Schedule.from_line(sys.stdin.readline())
    figures = run_windows(publisher, schedule, lambda: _step(size), cudalab.synchronize)
    print(json.dumps({"rank": rank, "first_tick": first, **figures}), flush=True)
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
            str(args.block_seconds), "--directory", args.directory,
            "--artificial-cost-ms", str(args.artificial_cost_ms), *(["--gpu"] if args.gpu else [])]


def run_ranks(args: argparse.Namespace, results: dict) -> None:
    from cudalab.cluster import watch

    procs = [subprocess.Popen([sys.executable, __file__, "--rank-worker", *_worker_args(args)],
                              env=_env(args, r), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for r in range(args.ranks)]
    w = watch(args.directory, job="benchmark")
    try:
        for p in procs:  # every rank ready (history filled, publisher's first sample taken)
            line = p.stdout.readline()  # type: ignore[union-attr]
            assert line.startswith('{"ready"'), line
        # one schedule for all: every rank steps from now until its last window ends
        schedule = Schedule.ahead(args.block_seconds, args.blocks)
        for p in procs:
            p.stdin.write(schedule.line() + "\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        per_rank = []
        for p in procs:
            line = p.stdout.readline()  # type: ignore[union-attr]
            per_rank.append(rank_figures(json.loads(line)))
            assert p.stdout.readline().strip() == "serving"  # type: ignore[union-attr]
        slowdowns = [r["slowdown"] for r in per_rank]
        how = f"median of each rank's {args.blocks} pairs of {args.block_seconds:g} s windows"
        if args.artificial_cost_ms:
            how += f"; {args.artificial_cost_ms:g} ms of artificial cost per sample"
        # the noise floors: each statistic, the measured effect taken out, when each pair's
        # on/off labels are swapped at random (what it shows from the windows' noise alone),
        # 95th percentile
        floors = noise_floors(per_rank)
        floor = "noise floor: the effect taken out, on/off swapped at random, 95th pct."
        results[f"step slowdown, median of ranks ({how}) (%)"] = 100 * statistics.median(
            slowdowns)
        results[f"the same, {floor} (%)"] = 100 * floors["median"]
        results[f"step slowdown, worst rank ({how}) (%)"] = 100 * max(slowdowns)
        results[f"the same, worst rank's {floor} (%)"] = 100 * floors["worst"]
        results["step slowdown, all ranks' steps pooled (%)"] = 100 * pooled(per_rank)
        results[f"the same, pooled {floor} (%)"] = 100 * floors["pooled"]
        results["steps per window, median over ranks"] = statistics.median(
            r["steps_per_window"] for r in per_rank)
        results["publisher toggled after a window's boundary, latest (ms)"] = 1e3 * max(
            r["late"] for r in per_rank)
        # what publishing itself costs: the publisher thread's CPU time while publishing, a
        # share of the step's time (the bound of the slowdown it can cause, without the noise
        # of 8 processes sharing the CPUs and the GPU), and per sample; and a share of the
        # rank's CPU time (the bound where the CPUs are saturated: a rank then gets a fixed
        # share of a CPU, and the thread's CPU comes out of it)
        results["publisher thread CPU / step time, worst rank (%)"] = 100 * max(
            r["share"] for r in per_rank)
        cpu_shares = [r["cpu_share"] for r in per_rank if r["cpu_share"] is not None]
        if cpu_shares:
            results["publisher thread CPU / the rank's CPU while publishing, worst rank "
                    "(%)"] = 100 * max(cpu_shares)
        firsts = [r["first_tick"] for r in per_rank if r["first_tick"] is not None]
        if firsts:
            results["publisher's first sample (opens NVML, reads the device's identity; "
                    "before the windows), CPU, worst rank (ms)"] = 1e3 * max(firsts)
        ticks = [t for r in per_rank for t in r["ticks"]]
        if ticks:
            results["publisher CPU per sample, median of all ranks' samples (us)"] = \
                1e6 * statistics.median(ticks)
            results["publisher CPU per sample, slowest sample (us)"] = 1e6 * max(ticks)
        results.table("per rank", rank_table(per_rank))
        # every rank's windows, (on, off) seconds per step by pair, for the JSON file
        results.raw["pairs by rank"] = {r["rank"]: r["pairs"] for r in per_rank}
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
        if "flag" not in args.skip:
            # the least-headroom flag follows an allocation
            lags = []
            for rank in range(min(1 if args.quick else 3, args.ranks)):
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
        if "fetch" not in args.skip:
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
            lanes_row(got, w, results)
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


def lanes_row(got: dict, w: object, results: dict) -> None:
    """The fetched snapshots as the dashboard's lanes: every rank's trace indexed (from the
    columns it travelled as) and the explorer's first view drawn."""
    try:
        from cudalab.widgets import LanesExplorer
        from cudalab.widgets.cluster_dashboard import rank_lanes
    except ImportError as exc:  # (no ipywidgets)
        results["every rank's snapshot as lanes"] = f"skipped ({exc})"
        return
    t0 = time.perf_counter()
    lanes = rank_lanes(got, {}, w.samples(include_lost=True))  # type: ignore[attr-defined]
    explorer = LanesExplorer(lanes)
    took = time.perf_counter() - t0
    assert len(lanes) == len(got) and not any(x.lost for x in lanes.lanes), lanes
    results[f"every rank's snapshot as lanes ({len(lanes)} lanes, "
            f"{sum(x.entries for x in lanes.lanes):,} entries: indexed, first view) (s)"] = took
    explorer.close()


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


def _shown(value: object) -> str:
    """A row's value as the table prints it."""
    return f"{value:.3f}" if isinstance(value, float) else str(value)


class Results(dict):
    """The rows, each printed as soon as it is measured (a run cut short keeps its rows),
    and tables printed after them (:meth:`table`)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[str]] = {}
        self.raw: dict[str, object] = {}  # (written to the JSON file only)

    def __setitem__(self, name: str, value: object) -> None:
        super().__setitem__(name, value)
        print(f"  . {name}: {_shown(value)}", flush=True)

    def table(self, name: str, lines: list[str]) -> None:
        self.tables[name] = lines
        print(f"  . {name}:", *(f"      {line}" for line in lines), sep="\n", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--blocks", type=int, default=32,
                        help="pairs of windows (one publishing, one paused), every rank's")
    parser.add_argument("--block-seconds", type=float, default=SAMPLE_INTERVAL,
                        help="seconds per window, a multiple of 0.5 (one sample at 2 Hz)")
    parser.add_argument("--rate-seconds", type=float, default=4.0)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--skip", default="",
                        help="rows to leave out, comma-separated: flag, fetch, gather")
    parser.add_argument("--profile-ticks", type=float, default=0.0,
                        help="first, in this process: time a tick's parts for this many "
                             "seconds beside a busy step, then --profile-pairs paired windows")
    parser.add_argument("--profile-pairs", type=int, default=8)
    parser.add_argument("--artificial-cost-ms", type=float, default=0.0,
                        help="hold the interpreter this long more per sample (the harness's "
                             "check that a real cost shows)")
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
        args.blocks, args.rate_seconds = min(args.blocks, 6), min(args.rate_seconds, 2.0)
    args.skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    unknown = args.skip - {"flag", "fetch", "gather"}
    if unknown:
        parser.error(f"--skip: unknown rows {sorted(unknown)}; flag, fetch, gather")
    if args.blocks < 1 or args.profile_pairs < 1:
        parser.error("--blocks and --profile-pairs must be at least 1")
    windows = args.block_seconds / SAMPLE_INTERVAL
    if not (windows >= 1 and abs(windows - round(windows)) < 1e-9):
        # (a shorter window may hold no sample, and one of 0.75 s one or two: the median of
        # the pairs would then miss or blur a cost that comes in ticks)
        parser.error(f"--block-seconds must be a multiple of {SAMPLE_INTERVAL} (a sample's "
                     "interval), so that every window holds as many samples")
    results = Results()
    with tempfile.TemporaryDirectory(prefix="cudalab-cluster-bench-") as directory:
        args.directory = directory
        t0 = time.perf_counter()
        if args.profile_ticks > 0:
            profile_ticks(args, results)
        run_ranks(args, results)
        if "gather" not in args.skip:
            run_gather(args, results)
        took = time.perf_counter() - t0
    where = "GPU" if args.gpu else "simulator"
    print(f"cudalab.cluster, {args.ranks} ranks on one host ({where}; {os.cpu_count()} CPUs), "
          f"{took:.0f} s")
    width = max(map(len, results))
    for name, value in results.items():
        print(f"  {name:<{width}}  {_shown(value)}")
    for name, lines in results.tables.items():
        print(f"  {name}:")
        for line in lines:
            print(f"    {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"where": where, "ranks": args.ranks, **results, **results.raw,
                       "tables": results.tables}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
