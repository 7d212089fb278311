"""Random-number benchmark: GB/s of rand/randn into 1 GiB float32, and launch cost.

Measures, in one run on one GPU: cudalab ``uniform_``/``normal_`` (what ``rand``/``randn``
run), torch's ``Tensor.uniform_``/``normal_`` and CuPy's generators writing the same 1 GiB
float32 buffer, plus the fill bandwidth (``DeviceArray.fill_``, a memset) measured in the
same run as the write-bandwidth reference, and the host cost of a small ``rand(1000)``
(cudalab vs ``torch.rand(1000, device="cuda")``). It also checks that cudalab's output equals
torch's bit for bit for the measured seed. torch and CuPy are imported lazily; their columns
are skipped when they are missing. On the simulator only cudalab's host costs mean anything.

    python benchmarks/rng.py [--json out.json] [--quick] [--gib 1.0] [--sweep]

``--sweep`` also times cudalab's kernels with other launch shapes (threads per block,
Philox iterations per thread): the values never depend on them.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout works uninstalled
from _harness import Table, environment, interleaved, optional_import, write_json  # noqa: E402


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write results as JSON to this path")
    p.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    p.add_argument("--gib", type=float, default=1.0, help="buffer size in GiB (default 1)")
    p.add_argument("--sweep", action="store_true", help="also sweep cudalab's launch shape")
    return p.parse_args()


def _gpu_seconds(run, record_start, record_end, elapsed, sync, reps: int, warmup: int = 3) -> float:
    """Median GPU seconds of ``run()`` measured with events (one pair per repetition)."""
    for _ in range(warmup):
        run()
    sync()
    times = []
    for _ in range(reps):
        record_start()
        run()
        record_end()
        sync()
        times.append(elapsed())
    times.sort()
    return times[len(times) // 2]


def _cudalab_timer(cudalab):
    start = cudalab.Event(enable_timing=True)
    end = cudalab.Event(enable_timing=True)
    return (start.record, end.record, lambda: start.elapsed_time(end) / 1e3,
            end.synchronize)


def _torch_timer(torch):
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    return (start.record, end.record, lambda: start.elapsed_time(end) / 1e3, end.synchronize)


def _cupy_timer(cupy):
    start = cupy.cuda.Event()
    end = cupy.cuda.Event()
    return (start.record, end.record,
            lambda: cupy.cuda.get_elapsed_time(start, end) / 1e3, end.synchronize)


def main() -> None:
    args = _parse()
    import numpy as np

    import cudalab
    import cudalab._internal
    from cudalab import random as R
    from cudalab.random import launch as RL
    from cudalab.random import sampling as RS

    cudalab.init()
    backend = cudalab._internal.backend()
    name = cudalab.get_device_name(0)
    sim = backend.simulated
    props = cudalab.get_device_properties(0)
    nbytes = int(args.gib * 2**30) // 16 * 16
    if sim:
        nbytes = min(nbytes, 64 * 2**20)  # the simulator computes on the host
    n = nbytes // 4
    reps = 5 if (args.quick or sim) else 20
    title = (f"cudalab RNG benchmark — {name} ({backend.name}), "
             f"{props.multi_processor_count} SMs, {nbytes / 2**30:.3g} GiB float32")
    t = Table(title)
    results: dict = {"env": environment(backend.name, name), "bytes": nbytes, "GBps": {},
                     "us": {}, "bit_exact": {}}

    torch = None if sim else optional_import("torch")
    if torch is not None and not torch.cuda.is_available():
        torch = None
    cupy = None if sim else optional_import("cupy")

    # ------------------------------------------------------------------ bandwidth
    a = cudalab.empty(n, np.float32)
    timer = _cudalab_timer(cudalab)
    gbps: dict[str, float] = {}

    def bw(label, run, tm):
        sec = _gpu_seconds(run, *tm, reps=reps)
        gbps[label] = nbytes / sec / 1e9
        results["GBps"][label] = gbps[label]

    bw("fill (cudalab memset)", lambda x=a: x.fill_(1.5), timer)
    R.manual_seed(1234)
    bw("cudalab rand", lambda x=a: R.uniform_(x), timer)
    bw("cudalab randn", lambda x=a: R.normal_(x), timer)
    if torch is not None:
        tt = torch.empty(n, device="cuda", dtype=torch.float32)
        tmr = _torch_timer(torch)
        bw("torch fill_", lambda: tt.fill_(1.5), tmr)
        bw("torch rand", lambda: tt.uniform_(), tmr)
        bw("torch randn", lambda: tt.normal_(), tmr)
    if cupy is not None:
        cm = _cupy_timer(cupy)
        try:
            rng = cupy.random.default_rng(1234)
            cbuf = cupy.empty(n, dtype=cupy.float32)
            bw("cupy rand", lambda: rng.random(n, dtype=cupy.float32, out=cbuf), cm)
            bw("cupy randn", lambda: rng.standard_normal(n, dtype=cupy.float32, out=cbuf), cm)
        except Exception as exc:  # older CuPy: no out=; allocation included
            results["cupy_note"] = f"default_rng(out=) unavailable ({exc}); legacy API"
            bw("cupy rand", lambda: cupy.random.random(n, dtype=cupy.float32), cm)
            bw("cupy randn", lambda: cupy.random.standard_normal(n, dtype=cupy.float32), cm)

    fill = gbps["fill (cudalab memset)"]
    for label, v in gbps.items():
        notes = [f"{100 * v / fill:.0f}% of fill"]
        op = label.split()[-1]
        if label.startswith("cudalab") and f"torch {op}" in gbps:
            ratio = v / gbps[f"torch {op}"]
            results["GBps"][f"ratio vs torch {op}"] = ratio
            notes.append(f"{ratio:.2f}x torch (goal >= 1.2x)")
        if sim:
            notes.append("simulator: host numpy, not meaningful")
        t.add(label, v, "GB/s", "; ".join(notes))

    if args.sweep and not sim:
        from cudalab._kernels import philox

        variants = {(op, tpt): philox.variant(suffix, tpt, prefix="bench_rng")
                    for op, suffix in (("rand", "uniform_f32"), ("randn", "normal_f32"))
                    for tpt in (1, 2, 4)}
        params = {"rand": (1.0, 0.0, 1.0), "randn": (1.0, 0.0)}
        for tpt in (4, 2, 1):
            for block, kpt in ((128, 1), (256, 1), (256, 2), (256, 4), (128, 8)):
                RL._set_launch_tuning(block=block, k_per_thread=kpt, tpt=tpt)
                for op in ("rand", "randn"):
                    label = f"sweep {op} tpt={tpt} block={block} k/thread={kpt}"
                    bw(label, lambda k=variants[(op, tpt)], p=params[op], x=a:
                       RS._generate(x, k, 4, p, None), timer)
                    t.add(label, gbps[label], "GB/s", f"{100 * gbps[label] / fill:.0f}% of fill")
        RL._set_launch_tuning(block=256, k_per_thread=1, tpt=philox.TPT)

    # ------------------------------------------------------------------ bit-exactness
    if torch is not None:
        for op in ("rand", "randn"):
            for size in (1000, 1_000_003, n):
                R.manual_seed(1234)
                torch.cuda.manual_seed(1234)
                ours = torch.from_dlpack(getattr(R, op)(size))
                theirs = getattr(torch, op)(size, device="cuda")
                same = bool(torch.equal(ours, theirs))
                results["bit_exact"][f"{op}({size})"] = same
                del ours, theirs
        t.add("bit-exact with torch (rand, randn; 1000, 1000003, n)",
              None, "", "yes" if all(results["bit_exact"].values()) else
              f"NO: {results['bit_exact']}")
    del a

    # ------------------------------------------------------------------ launch overhead
    number = 2000 if (args.quick or sim) else 20000

    def loop_ours(k, f=R.rand):
        for _ in range(k):
            f(1000)

    small = cudalab.empty(1000, np.float32)

    def loop_ours_inplace(k, f=R.uniform_, x=small):
        for _ in range(k):
            f(x)

    loops = {"cudalab rand(1000)": loop_ours, "cudalab uniform_(1000)": loop_ours_inplace}
    if torch is not None:
        ts = torch.empty(1000, device="cuda")

        def loop_torch(k, f=torch.rand):
            for _ in range(k):
                f(1000, device="cuda")

        def loop_torch_inplace(k, x=ts):
            for _ in range(k):
                x.uniform_()

        loops["torch rand(1000)"] = loop_torch
        loops["torch uniform_(1000)"] = loop_torch_inplace
    measured = interleaved(loops, number, rounds=5 if args.quick else 9)
    cudalab.synchronize()
    if torch is not None:
        torch.cuda.synchronize()
    for label, sec in measured.items():
        results["us"][label] = sec * 1e6
        note = ""
        if label.startswith("cudalab"):
            other = label.replace("cudalab", "torch")
            if other in measured:
                note = f"{sec / measured[other]:.2f}x torch (goal <= 1.0x)"
        t.add(label, sec * 1e6, "µs", note)
    print(t.render())
    write_json(args.json, results)


if __name__ == "__main__":
    main()
