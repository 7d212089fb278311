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

    python benchmarks/what_if.py [--steps 400] [--layers 4] [--seed 0] [--target 1.10]
                                 [--batching continuous|static] [--device-memory 80GiB]
                                 [--synthetic] [--json out.json] [--quick]
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
    args = p.parse_args()

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


if __name__ == "__main__":
    main()
