"""What-if benchmark: the allocator settings search on a ragged-batch inference trace.

The workload (``cudalab.memory_tools.synthetic.ragged_inference_workload``): continuous
batching of up to 16 requests with log-normal prompt and generation lengths, a K and a V
cache per request and layer grown by concatenation at every decode step, activations
proportional to tokens × width freed in nearly LIFO order. It is run for real through
cudalab's allocator (``cudalab.empty``) on the simulator with the history recorder on, and
the recorded snapshot is what ``what_if`` searches (pass ``--synthetic`` to use the
generator's own trace instead: same requests, no recording).

Everything here is simulated: the replays run cudalab's allocator (torch's policy) on a
private simulator, so the numbers are what torch's native allocator would reserve for the
same requests, not measurements of a GPU. The table shows, per setting, peak reserved / peak
allocated (res/alloc, the issue's measure) and peak reserved / the trace's peak of live
requested bytes (res/live), the best setting, where the reserved peak goes, whether
``--target`` is reached and the search's run time.

``--autotune`` measures the autotuner (``cudalab.memory.autotune``) instead: (1) replay
throughput, entries/s on one core, on the ragged trace and on a ~1M-entry one; (2) the wall
time of the default grid (73 settings) × 3 capacities on the ~1M-entry trace with every
available core (``--workers``), replays run and rows derived; (3) on the ragged trace of the
defaults, the best setting per capacity (unconstraining; a device 10 % above the defaults'
peak; one 10 % above the expandable segments' peak) against ``--target``, with what each
costs (retries, driver allocations).

    python benchmarks/what_if.py [--steps 400] [--layers 4] [--seed 0] [--target 1.10]
                                 [--batching continuous|static] [--device-memory 80GiB]
                                 [--synthetic] [--json out.json] [--quick]
                                 [--autotune [--grid-layers 30] [--workers N]]
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import environment, write_json  # noqa: E402


def record(workload: dict) -> dict:
    """The workload run through cudalab.empty on the simulator, recorded: a snapshot."""
    import cudalab

    cudalab.use_simulator()
    cudalab.empty_cache()
    live: dict[int, object] = {}

    def allocate(nbytes: int) -> int:
        array = cudalab.empty(nbytes, dtype="uint8")
        live[id(array)] = array
        return id(array)

    def free(handle: int) -> None:
        del live[handle]

    from cudalab.memory_tools.synthetic import ragged_inference_workload

    cudalab.memory._record_memory_history(max_entries=10_000_000)
    try:
        ragged_inference_workload(allocate, free, **workload)
        return cudalab.memory._snapshot()
    finally:
        cudalab.memory._record_memory_history(None)


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have ended (the workers)."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400, help="decode steps (default 400)")
    p.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                   help="continuous batching (default) or padded static batches")
    p.add_argument("--target", type=float, default=1.10,
                   help="goal for peak reserved / peak allocated (default 1.10)")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="model this device (e.g. 80GiB); default: fractions of a device the "
                        "defaults exactly fill")
    p.add_argument("--synthetic", action="store_true",
                   help="search the generator's trace instead of a recorded one")
    p.add_argument("--json", default=None, help="write results as JSON to this path")
    p.add_argument("--quick", action="store_true", help="a small trace (smoke run)")
    p.add_argument("--autotune", action="store_true",
                   help="measure the autotuner (throughput, the 1M-entry grid, the ragged "
                        "recommendation) instead of the what-if search")
    p.add_argument("--grid-layers", type=int, default=30,
                   help="layers of the grid's trace (default 30: ~1M entries)")
    p.add_argument("--workers", type=int, default=None,
                   help="autotune worker processes (default: every available CPU)")
    p.add_argument("--sections", default="throughput,grid,ragged",
                   help="with --autotune: which of throughput, grid, ragged to run")
    args = p.parse_args()
    if args.autotune:
        autotune_main(args)
        return

    from cudalab._units import parse_size
    from cudalab.memory_tools.synthetic import ragged_inference_trace

    wi = importlib.import_module("cudalab.memory_tools.what_if")
    workload = {"steps": 120 if args.quick else args.steps,
                "layers": 2 if args.quick else args.layers, "seed": args.seed,
                "batching": args.batching}
    t0 = time.perf_counter()
    if args.synthetic:
        trace: object = ragged_inference_trace(**workload)
        how = "generated (synthetic.ragged_inference_trace)"
    else:
        trace = record(workload)
        how = "recorded through cudalab.empty on the simulator (_record_memory_history)"
    t_trace = time.perf_counter() - t0
    memory = parse_size(args.device_memory, allow_zero=False) if args.device_memory else None
    df = wi.what_if(trace, device_memory=memory)
    print("what-if on a ragged-batch inference trace (SIMULATED: cudalab's allocator, "
          "torch's policy, replayed on a private simulator; no GPU measured)")
    print(f"workload: {workload}; trace {how} in {t_trace:.2f} s")
    print(wi.format_what_if(df, target=args.target))
    best = df.iloc[0]
    default = df[df["config"] == "default"].iloc[0]
    write_json(args.json, {
        "environment": environment("simulator (replay)", f"{os.cpu_count()} CPUs"),
        "workload": workload, "trace": how, "peak_live": df.attrs["peak_live"],
        "search_s": df.attrs["elapsed_s"], "target": args.target,
        "default": {"peak_reserved": int(default["peak_reserved"]),
                    "peak_ratio": float(default["peak_ratio"]),
                    "live_ratio": float(default["live_ratio"])},
        "best": {"config": best["config"], "peak_reserved": int(best["peak_reserved"]),
                 "peak_ratio": float(best["peak_ratio"]),
                 "live_ratio": float(best["live_ratio"]), "retries": int(best["retries"])},
        "rows": [{k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
                 for row in df.to_dict("records")],
    })


def autotune_main(args: argparse.Namespace) -> None:
    """The autotuner's figures (see the module documentation)."""
    from cudalab._units import format_bytes
    from cudalab.memory_tools import autotune as at
    from cudalab.memory_tools.replay import replay
    from cudalab.memory_tools.replay_workers import available_cpus
    from cudalab.memory_tools.synthetic import ragged_inference_trace

    cpus = available_cpus()
    workload = {"steps": 120 if args.quick else args.steps,
                "layers": 2 if args.quick else args.layers, "seed": args.seed,
                "batching": args.batching}
    print("autotune benchmark (SIMULATED: cudalab's allocator, torch's policy, replayed on "
          f"private simulators; {cpus} CPUs available)")
    out: dict = {"environment": environment("simulator (replay)", f"{cpus} CPUs"),
                 "workload": workload}
    sections = set(args.sections.split(","))
    ragged = record(workload) if sections & {"throughput", "ragged"} else None
    grid_layers = 4 if args.quick else args.grid_layers
    big = ragged_inference_trace(steps=workload["steps"], layers=grid_layers, seed=args.seed) \
        if sections & {"throughput", "grid"} else []
    # (1) throughput, one core
    rows = []
    for name, trace in (("ragged (recorded)", ragged), (f"ragged, {grid_layers} layers", big)):
        if "throughput" not in sections:
            break
        for setting in ("", "expandable_segments:True")[:2 if trace is ragged else 1]:
            r = replay(trace, setting)
            rows.append((name, setting or "default", r.entries, r.entries_per_s))
    if rows:
        print("\n(1) replay throughput, one core")
        print(f"  {'trace':<22} {'setting':<26} {'entries':>10} {'entries/s':>12}")
    for name, setting, n, rate in rows:
        print(f"  {name:<22} {setting:<26} {n:>10,} {rate / 1e6:>10.3f} M")
    out["throughput"] = [{"trace": a, "setting": b, "entries": c, "entries_per_s": d}
                         for a, b, c, d in rows]
    # (2) the grid on the ~1M-entry trace: 3 capacities, every core
    if "grid" in sections:
        from cudalab.memory_tools.replay import plan_replay
        from cudalab.memory_tools.trace_io import load_trace

        t0 = time.perf_counter()
        live = plan_replay(load_trace(big)).peak_live  # (no replay: numpy only)
        # an unconstraining device, a roomy one (2 x the live peak) and one the run barely
        # fits (1.1 x): the last needs its own replay of nearly every setting
        caps = [None, int(live * 2.0) >> 20 << 20, int(live * 1.1) >> 20 << 20]
        print(f"\n(2) grid on {len(big):,} entries (capacities: unconstraining, "
              f"{format_bytes(caps[1], decimals=2)}, {format_bytes(caps[2], decimals=2)}: "
              "2 and 1.1 x the live peak)", flush=True)
        seen = [0]

        def tick(done: int, total: int) -> None:
            seen[0] += 1
            if seen[0] % 25 == 0:
                print(f"  {done}/{total} rows at {time.perf_counter() - t0:.1f} s", flush=True)

        cpu0 = _cpu_seconds()
        grid = at.autotune(big, caps, workers=args.workers, progress=tick)
        wall = time.perf_counter() - t0
        cpu = _cpu_seconds() - cpu0
        n_set = grid["setting"].nunique()
        derived = int(grid["derived"].sum())
        print(f"  {n_set} settings x {len(caps)} capacities ({len(grid)} rows): wall "
              f"{wall:.1f} s with {grid.attrs['workers'] or cpus} workers; "
              f"{grid.attrs['replays']} replays run, {derived} rows derived, "
              f"{grid.attrs['replays'] * len(big) / wall / 1e6:.2f} M entries/s in all; "
              f"CPU {cpu:.1f} s in all processes (the figure a shared machine's load does "
              "not inflate)")
        out["grid"] = {"settings": n_set, "capacities": caps, "entries": len(big),
                       "rows": len(grid), "wall_s": wall, "cpu_s": cpu,
                       "replays": grid.attrs["replays"],
                       "derived": derived, "workers": grid.attrs["workers"] or cpus}
    # (3) the ragged trace: the recommendation per capacity, against the target
    if "ragged" not in sections:
        write_json(args.json, out)
        return
    default = replay(ragged, "")
    es = replay(ragged, "expandable_segments:True")
    own, how = at.trace_capacity(ragged)
    caps3 = [own, None, int(es.peak_reserved * 1.1) >> 20 << 20]
    t0 = time.perf_counter()
    df = at.autotune(ragged, caps3, workers=args.workers)
    wall = time.perf_counter() - t0
    print(f"\n(3) ragged trace ({df.attrs['entries']:,} entries), target res/alloc <= "
          f"{args.target:.2f}; {df['setting'].nunique()} settings in {wall:.1f} s")
    print(f"  defaults: res/alloc {default.peak_reserved / default.peak_allocated:.3f}; "
          f"expandable segments: {es.peak_reserved / es.peak_allocated:.3f}; the trace's own "
          f"device: {how}")
    picks = []
    for cap in caps3:
        rec = at.recommendation(df, cap)
        where = "unconstraining" if cap is None else format_bytes(cap, decimals=0)
        print(f"  {rec['text']}")
        part = df[at._same_capacity(df["capacity"], cap) & (df["status"] == "ok")]
        free = part[part["retries"] == 0]
        best_free = free.iloc[0] if len(free) else None
        reach = part[part["reserved_over_allocated"] <= args.target]
        print(f"  capacity {where}: recommended {rec['setting'] or 'default'}: res/alloc "
              f"{rec.get('reserved_over_allocated', float('nan')):.3f}, "
              f"{rec.get('retries', 0)} retries")
        if best_free is not None:
            print(f"    best without a retry: {best_free['setting']}: res/alloc "
                  f"{best_free['reserved_over_allocated']:.3f}, "
                  f"{int(best_free['driver_allocs'])} driver allocations")
        if len(reach):
            r = reach.iloc[0]
            print(f"    target reached by {len(reach)} settings; cheapest in retries: "
                  f"{reach.sort_values(['retries', 'peak_reserved']).iloc[0]['setting']} "
                  f"({int(reach['retries'].min())} retries); best: {r['setting']} at "
                  f"{r['reserved_over_allocated']:.3f} with {int(r['retries'])} retries")
        else:
            print("    target NOT reached at this capacity")
        picks.append({"capacity": cap, "recommended": rec.get("setting"),
                      "res_alloc": rec.get("reserved_over_allocated"),
                      "retries": rec.get("retries"), "reached": int(len(reach))})
    out["ragged"] = {"wall_s": wall, "capacities": caps3, "picks": picks,
                     "default_res_alloc": default.peak_reserved / default.peak_allocated,
                     "es_res_alloc": es.peak_reserved / es.peak_allocated}
    write_json(args.json, out)


if __name__ == "__main__":
    main()
