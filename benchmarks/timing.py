"""IPython extension benchmark (issue 6): the cost and accuracy of %%cuda_timed and the watch.

Rows (each next to cupyx.profiler.benchmark and torch CUDA events when they are importable):

* per-repeat overhead of ``%cuda_timed -n 1 -r R pass`` (an empty body), from the difference
  between two repeat counts so fixed costs cancel; the same for
  ``cupyx.profiler.benchmark(lambda: None, n_repeat=R)``. Target: <= 1/3 of cupyx's.
* median of a ~1 ms kernel (cudalab's ``gpu_sleep``) by %%cuda_timed, cupyx and a torch
  event loop, and the differences in percent. Target: within 1 %.
* the added cost per cell of ``%cuda_memory watch on`` (``run_cell("pass")`` with and
  without, interleaved). Target: <= 50 µs.
* ``%load_ext cudalab`` in a fresh interpreter (IPython already imported). Target: <= 300 ms.

    python benchmarks/timing.py [--json out.json] [--quick]

On the simulator only cudalab's own rows mean anything (the table says "simulated").
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout works uninstalled
from _harness import Table, environment, optional_import, parse_args, write_json  # noqa: E402

MS = 1_000_000


def load_ext_seconds(runs: int) -> float | None:
    """Median seconds of ``%load_ext cudalab`` in a fresh interpreter (first run discarded)."""
    code = ("from IPython.core.interactiveshell import InteractiveShell\n"
            "ip = InteractiveShell.instance()\nimport time\nt = time.perf_counter()\n"
            "ip.run_line_magic('load_ext', 'cudalab')\nprint(time.perf_counter() - t)")
    out = []
    for i in range(runs + 1):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=os.environ.copy())
        if r.returncode != 0:
            return None
        if i:
            out.append(float(r.stdout.strip().splitlines()[-1]))
    return statistics.median(out)


def per_repeat_overhead(run_with_repeats, r1: int, r2: int, rounds: int) -> float:
    """Seconds per extra repeat: median over rounds of (T(r2) - T(r1)) / (r2 - r1)."""
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        run_with_repeats(r1)
        t1 = time.perf_counter()
        run_with_repeats(r2)
        t2 = time.perf_counter()
        samples.append(((t2 - t1) - (t1 - t0)) / (r2 - r1))
    return statistics.median(samples)


def main() -> None:
    args = parse_args(__doc__)
    quick = args.quick
    from IPython.core.interactiveshell import InteractiveShell

    import cudalab
    from cudalab._kernels.spin import gpu_sleep

    cudalab.init()
    backend = cudalab.devices._backend()
    name = cudalab.get_device_name(0)
    sim = backend.simulated
    t = Table(f"cudalab %%cuda_timed / watch benchmark — {name} ({backend.name})"
              + (" [simulated: only cudalab's rows mean anything]" if sim else ""))
    results: dict = {"env": environment(backend.name, name), "us": {}, "pct": {}, "ms": {}}

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "cudalab")
    ip.user_ns["gpu_sleep"] = gpu_sleep
    magics = ip.magics_manager.registry["CudaLabMagics"]
    magics.nvml = False  # fixed per-call costs cancel anyway; keep the rounds short

    cupyx_profiler = optional_import("cupyx.profiler")
    torch = optional_import("torch")
    if torch is not None and not (hasattr(torch, "cuda") and torch.cuda.is_available()):
        torch = None
    if sim:
        cupyx_profiler = torch = None

    def put(key, seconds, note=""):
        us = None if seconds is None else seconds * 1e6
        results["us"][key] = us
        t.add(key, us, "µs", note)

    # ------------------------------------------------------------ per-repeat overhead
    r1, r2 = (50, 550) if quick else (200, 4200)
    rounds = 3 if quick else 7

    def ours(r):
        ip.run_line_magic("cuda_timed", f"-q -n 1 -w 0 -r {r} pass")

    ours_o = per_repeat_overhead(ours, r1, r2, rounds)
    put("%cuda_timed per-repeat overhead (empty body)", ours_o, "two events + two clock reads")
    cupy_o = None
    if cupyx_profiler is not None:
        def cupy_run(r):
            cupyx_profiler.benchmark(lambda: None, n_repeat=r, n_warmup=0)

        cupy_o = per_repeat_overhead(cupy_run, r1, r2, rounds)
        put("cupyx.profiler.benchmark per-repeat overhead", cupy_o, "events + sync per repeat")
        ratio = ours_o / cupy_o if cupy_o else None
        results["pct"]["overhead ratio ours/cupyx"] = None if ratio is None else ratio * 100
        t.add("overhead ratio ours / cupyx", None if ratio is None else ratio, "x",
              "target <= 0.333")
    else:
        put("cupyx.profiler.benchmark per-repeat overhead", None, "cupy not installed" if not sim
            else "skipped on the simulator")

    # ------------------------------------------------------------ ~1 ms kernel
    reps = 30 if quick else 200
    gpu_sleep(MS)
    cudalab.synchronize()
    res = ip.run_line_magic("cuda_timed", f"-o -q -n 1 -w 5 -r {reps} gpu_sleep({MS})")
    ours_single = res.median
    res10 = ip.run_line_magic("cuda_timed", f"-o -q -n 10 -w 1 -r {max(10, reps // 10)} "
                                            f"gpu_sleep({MS})")
    put("%cuda_timed median, 1 ms kernel (-n 1)", ours_single)
    put("%cuda_timed median, 1 ms kernel (-n 10)", res10.median)
    if cupyx_profiler is not None:
        bench = cupyx_profiler.benchmark(lambda: gpu_sleep(MS), n_repeat=reps, n_warmup=5)
        import numpy as np

        cupy_med = float(np.median(bench.gpu_times[0]))
        put("cupyx.profiler.benchmark median, 1 ms kernel", cupy_med)
        diff = (ours_single - cupy_med) / cupy_med * 100
        results["pct"]["1ms median diff vs cupyx"] = diff
        t.add("  difference vs cupyx", diff, "%", "target within ±1 %")
    if torch is not None:
        times = []
        torch.cuda.synchronize()
        for _ in range(5):
            gpu_sleep(MS)
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            gpu_sleep(MS)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        torch_med = statistics.median(times)
        put("torch events median, 1 ms kernel", torch_med)
        diff = (ours_single - torch_med) / torch_med * 100
        results["pct"]["1ms median diff vs torch"] = diff
        t.add("  difference vs torch", diff, "%", "target within ±1 %")
    elif not sim:
        put("torch events median, 1 ms kernel", None, "torch not installed")

    # ------------------------------------------------------------ watch cost per cell
    cells = 300 if quick else 2000
    rounds_w = 5 if quick else 9

    def cells_loop(n):
        for _ in range(n):
            ip.run_cell("pass", store_history=False)

    cells_loop(50)
    off, on = [], []
    for _ in range(rounds_w):
        t0 = time.perf_counter()
        cells_loop(cells)
        off.append((time.perf_counter() - t0) / cells)
        with contextlib.redirect_stdout(io.StringIO()):
            ip.run_line_magic("cuda_memory", "watch on --threshold 1TiB")  # measure, print nothing
            t0 = time.perf_counter()
            cells_loop(cells)
            on.append((time.perf_counter() - t0) / cells)
            ip.run_line_magic("cuda_memory", "watch off")
    put("run_cell('pass') without watch", statistics.median(off))
    put("run_cell('pass') with watch on", statistics.median(on))
    put("watch on: added cost per cell", statistics.median(on) - statistics.median(off),
        "target <= 50 µs")

    # ------------------------------------------------------------ %load_ext time
    s = load_ext_seconds(3 if quick else 7)
    results["ms"]["%load_ext cudalab"] = None if s is None else s * 1e3
    t.add("%load_ext cudalab (fresh interpreter)", None if s is None else s * 1e3, "ms",
          "target <= 300 ms")

    ip.run_line_magic("unload_ext", "cudalab")
    print(t.render())
    write_json(args.json, results)


if __name__ == "__main__":
    main()
