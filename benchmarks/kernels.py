"""%%cuda_timed --kernels benchmark: what listing a cell's kernels costs, next to torch.profiler.

    python benchmarks/kernels.py [--json out.json] [--quick]

The cell launches 1,000 small kernels (torch's ``s.add_(1)`` on 16 floats; CuPy's
``cupy.add(s, 1, out=s)`` without torch; cudalab's own 0 ns spin without either), and every
variant runs it through the same IPython shell in the same process, on the same GPU. Each
row is the median over interleaved rounds of the *paired* difference between a variant and
its baseline in the same round (wall time of ``run_cell``, GPU work included):

* ``%%cuda_timed --kernels`` with CUPTI (activity records of kernels, memcpys and memsets,
  decoded and aggregated into the table) minus ``%%cuda_timed`` without ``--kernels``;
* the fallback (``CudaLabMagics.cupti = False``: cudalab's own launches, an event per
  launch), on a cell of 1,000 of cudalab's own kernels (it lists no other), minus that cell
  without ``--kernels``;
* ``torch.profiler.profile(activities=[CUDA])`` around the cell, plus ``key_averages()``
  (its kernel table), minus the cell with a ``torch.cuda.synchronize()``; and the same with
  torch.profiler's default activities (CPU and CUDA).

Goal: ``--kernels`` adds no more than torch.profiler (CUDA only) to the cell. The CUPTI rows
are measured before torch.profiler first runs in the process, then again after it (kineto
stays subscribed to CUPTI for the rest of the process).
On the simulator only the fallback row means anything.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout works uninstalled
from _harness import Table, environment, optional_import, parse_args, write_json  # noqa: E402

#: Kernels launched by the benchmark cell.
KERNELS = 1000


def paired(ip, variants: dict[str, tuple[str, str]], rounds: int) -> dict[str, float]:
    """Median over ``rounds`` of (variant cell - baseline cell) seconds, each pair run back
    to back and the variants interleaved within a round; after two warm-up rounds."""
    diffs: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds + 2):
        for key, (cell, base) in variants.items():
            t0 = time.perf_counter()
            ip.run_cell(base, store_history=False)
            t1 = time.perf_counter()
            ip.run_cell(cell, store_history=False)
            t2 = time.perf_counter()
            if r >= 2:
                diffs[key].append((t2 - t1) - (t1 - t0))
    return {k: statistics.median(v) for k, v in diffs.items()}


def cell_seconds(ip, cell: str, rounds: int) -> float:
    """Median seconds of ``run_cell(cell)`` (after one warm-up run)."""
    ip.run_cell(cell, store_history=False)
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        ip.run_cell(cell, store_history=False)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    args = parse_args(__doc__)
    rounds = 5 if args.quick else 15
    from IPython.core.interactiveshell import InteractiveShell

    import cudalab
    from cudalab import _internal
    from cudalab._kernels.spin import gpu_sleep

    cudalab.init()
    backend = _internal.backend()
    name = cudalab.get_device_name(0)
    sim = backend.simulated
    torch = None if sim else optional_import("torch")
    if torch is not None and not (hasattr(torch, "cuda") and torch.cuda.is_available()):
        torch = None
    cupy = None if (sim or torch is not None) else optional_import("cupy")
    cupti = None if sim else optional_import("cupti.cupti")

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "cudalab")
    magics = ip.magics_manager.registry["CudaLabMagics"]
    magics.nvml = False
    ns = ip.user_ns
    ns["gpu_sleep"] = gpu_sleep
    if torch is not None:
        ns["torch"] = torch
        ns["s_"] = torch.ones(16, device="cuda")
        source = "torch s.add_(1)"
        ip.run_cell(f"def body_():\n    for _ in range({KERNELS}):\n        s_.add_(1)\n")
        sync = "torch.cuda.synchronize()"
    elif cupy is not None:
        ns["cupy"] = cupy
        ns["s_"] = cupy.ones(16, dtype=cupy.float32)
        source = "CuPy add(s, 1, out=s)"
        ip.run_cell(f"def body_():\n    for _ in range({KERNELS}):\n        cupy.add(s_, 1, out=s_)\n")
        sync = "cupy.cuda.Device().synchronize()"
    else:
        source = "cudalab gpu_sleep(0)"
        ip.run_cell(f"def body_():\n    for _ in range({KERNELS}):\n        gpu_sleep(0)\n")
        ns["cudalab"] = cudalab
        sync = "cudalab.synchronize()"

    t = Table(f"%%cuda_timed --kernels overhead, a cell of {KERNELS} small kernels ({source}) — "
              f"{name} ({backend.name})" + (" [simulated: only the fallback row]" if sim else ""))
    results: dict = {"env": environment(backend.name, name), "kernels": KERNELS,
                     "source": source, "ms": {}, "us_per_kernel": {}, "listed": {}}

    def put(key: str, seconds: float | None, note: str = "") -> None:
        ms = None if seconds is None else seconds * 1e3
        results["ms"][key] = ms
        results["us_per_kernel"][key] = None if seconds is None else seconds / KERNELS * 1e6
        t.add(key, ms, "ms", note)

    base_magic = "%%cuda_timed -q\nbody_()"
    kern_magic = "%%cuda_timed -q --kernels -v r_\nbody_()"
    plain = f"body_()\n{sync}"
    put("the cell under %%cuda_timed (no --kernels)", cell_seconds(ip, base_magic, rounds),
        "baseline of the --kernels rows")

    def listed() -> tuple[int, str]:
        r = ns.get("r_")
        if r is None:
            return 0, "no result"
        return sum(k["count"] for k in r.kernels if k.get("kind", "kernel") == "kernel"), r.kernels_note

    ours = None
    if cupti is not None:
        ours = paired(ip, {"cupti": (kern_magic, base_magic)}, rounds)["cupti"]
        n, note = listed()
        results["listed"]["cupti"] = n
        put("--kernels with CUPTI: added", ours, f"{n} kernels listed; {note[:60]}")
    else:
        put("--kernels with CUPTI: added", None, "skipped on the simulator" if sim
            else "cupti-python is not importable")
    # the fallback lists cudalab's own launches: time it on 1,000 of them (a 0 ns spin)
    ip.run_cell(f"def own_():\n    for _ in range({KERNELS}):\n        gpu_sleep(0)\n",
                store_history=False)
    magics.cupti = False
    fallback = paired(ip, {"fallback": ("%%cuda_timed -q --kernels -v r_\nown_()",
                                        "%%cuda_timed -q\nown_()")}, rounds)["fallback"]
    magics.cupti = True
    n, _note = listed()
    results["listed"]["fallback"] = n
    put("--kernels fallback (cupti = False): added", fallback,
        f"{n} cudalab gpu_sleep(0) listed (an event per launch)")

    if torch is not None:
        ip.run_cell("from torch.profiler import profile as profile_, ProfilerActivity as PA_",
                    store_history=False)
        put("the cell plain (+ synchronize)", cell_seconds(ip, plain, rounds),
            "baseline of the torch.profiler rows")
        body = "\n".join("    " + line for line in plain.splitlines())
        prof_cuda = f"with profile_(activities=[PA_.CUDA]) as p_:\n{body}\nka_ = p_.key_averages()"
        prof_all = f"with profile_() as p_:\n{body}\nka_ = p_.key_averages()"
        tp = paired(ip, {"cuda": (prof_cuda, plain), "all": (prof_all, plain)}, rounds)
        put("torch.profiler(CUDA) + key_averages: added", tp["cuda"], "torch's kernel table")
        put("torch.profiler(CPU+CUDA) + key_averages: added", tp["all"],
            "torch.profiler's defaults")
        if ours is not None and tp["cuda"] > 0:
            ratio = ours / tp["cuda"]
            results["ratio_cupti_to_torch_profiler"] = ratio
            t.add("ratio --kernels (CUPTI) / torch.profiler(CUDA)", ratio, "x", "goal <= 1")
        if cupti is not None:
            after = paired(ip, {"cupti": (kern_magic, base_magic)}, rounds)["cupti"]
            n, note = listed()
            put("--kernels with CUPTI, after torch.profiler ran: added", after,
                f"{n} kernels listed; {note[:40]}")
    else:
        put("torch.profiler(CUDA) + key_averages: added", None,
            "skipped on the simulator" if sim else "torch is not importable")

    print(t.render())
    write_json(args.json, results)


if __name__ == "__main__":
    main()
