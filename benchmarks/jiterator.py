"""Jiterator and elementwise operator benchmark: cudalab next to torch's jiterator and CuPy.

    python benchmarks/jiterator.py [--json out.json] [--quick]

Rows (torch and CuPy measured in the same run when importable, all on the same GPU):

* **bandwidth**: ``a * x + b`` on 1 GiB of float32 (read + write bytes per second) through
  ``cudalab.jiterator._create_jit_fn``, ``torch.cuda.jiterator._create_jit_fn`` and CuPy's
  ``ElementwiseKernel``, next to a device-to-device copy of the same size (cudalab's
  ``copy_``, a cuMemcpyAsync); then ``x + y`` (two reads, one write) through DeviceArray's
  operator, torch's and CuPy's. Goals: >= 0.95x torch and >= 90 % of the copy.
* **host time per call** of a cached function on a 1,000-element array (allocating its
  output), cudalab vs torch's jiterator vs CuPy's ElementwiseKernel, and the same for ``x + y``.
  Goal: cudalab <= both.
* **first call with a cold cache** (a code string never compiled before: NVRTC, module load,
  launch, synchronize), cudalab vs torch's jiterator. Goal: cudalab <= torch.

Each GPU time is the median of interleaved rounds of wall time over a loop of launches ended
by a device synchronisation. On the simulator the same rows run on 4 MiB and are labelled
*simulated* (numpy speeds, not a GPU's).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout works uninstalled
from _harness import (  # noqa: E402
    Table,
    environment,
    interleaved_time_per_call,
    optional_import,
    parse_args,
    write_json,
)

CODE = "template <typename T> T axpb(T x, T a, T b) { return a * x + b; }"
CUPY_AXPB = ("float32 x, float32 a, float32 b", "float32 y", "y = a * x + b", "cupy_axpb")


def gpu_seconds(fn, sync, iters: int, rounds: int) -> float:
    """Median seconds per call of ``fn`` (``iters`` calls then ``sync()``), after a warm-up."""
    fn()
    sync()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


def main() -> None:
    args = parse_args(__doc__)
    os.environ.setdefault("CUDALAB_CACHE_DIR", tempfile.mkdtemp(prefix="cudalab-bench-cache-"))
    import numpy as np

    import cudalab
    from cudalab import _internal
    from cudalab import jiterator as jit

    cudalab.init()
    backend = _internal.backend()
    sim = backend.simulated
    name = cudalab.get_device_name(0)
    torch = None if sim else optional_import("torch")
    if torch is not None and not torch.cuda.is_available():
        torch = None
    cupy = None if sim else optional_import("cupy")
    label = " [simulated]" if sim else ""
    n = (1 << 20) if sim else (1 << 28)  # 4 MiB simulated, 1 GiB on a GPU
    iters, rounds = (2, 3) if sim or args.quick else (10, 7)
    gib = n * 4 / 2**30
    sync = cudalab.synchronize

    t = Table(f"jiterator and elementwise operators, {gib:g} GiB float32 — {name} "
              f"({backend.name}){label}")
    results: dict = {"env": environment(backend.name, name), "n": n, "simulated": sim,
                     "GBps": {}, "host_us": {}, "first_call_ms": {}}

    def bw(key: str, seconds: float | None, streams: int, note: str = "") -> float | None:
        value = None if seconds is None else streams * n * 4 / seconds / 1e9
        results["GBps"][key] = value
        t.add(key, value, "GB/s", note + label)
        return value

    # ------------------------------------------------------------------ bandwidth: a*x+b
    x = cudalab.asarray(np.random.default_rng(0).random(n, dtype=np.float32))
    y = cudalab.asarray(np.random.default_rng(1).random(n, dtype=np.float32))
    out = cudalab.empty(n, dtype=np.float32)
    axpb = jit._create_jit_fn(CODE, a=2.0, b=1.0)
    ours = bw("a*x+b  cudalab jiterator", gpu_seconds(lambda: axpb(x), sync, iters, rounds), 2)
    copy = bw("d2d copy  cudalab copy_ (cuMemcpyAsync)",
              gpu_seconds(lambda: out.copy_(x), sync, iters, rounds), 2)
    theirs = None
    tx = ty = cx = cy = None
    if torch is not None:
        tx, ty = torch.from_dlpack(x).clone(), torch.from_dlpack(y).clone()
        tjit = torch.cuda.jiterator._create_jit_fn(CODE, a=2.0, b=1.0)
        tsync = torch.cuda.synchronize
        theirs = bw("a*x+b  torch jiterator", gpu_seconds(lambda: tjit(tx), tsync, iters, rounds), 2)
        tout = torch.empty_like(tx)
        bw("d2d copy  torch copy_", gpu_seconds(lambda: tout.copy_(tx), tsync, iters, rounds), 2)
    if cupy is not None:
        cx, cy = cupy.asarray(x).copy(), cupy.asarray(y).copy()
        ek = cupy.ElementwiseKernel(*CUPY_AXPB)
        two, one = np.float32(2.0), np.float32(1.0)
        bw("a*x+b  CuPy ElementwiseKernel",
           gpu_seconds(lambda: ek(cx, two, one), sync, iters, rounds), 2)
    if ours and theirs:
        t.add("ratio cudalab / torch jiterator", ours / theirs, "x", "goal >= 0.95")
        results["ratio_axpb_to_torch"] = ours / theirs
    if ours and copy:
        t.add("ratio cudalab / d2d copy", ours / copy, "x", "goal >= 0.90")
        results["ratio_axpb_to_copy"] = ours / copy

    # ------------------------------------------------------------------ bandwidth: x + y
    ours_add = bw("x+y  cudalab DeviceArray", gpu_seconds(lambda: x + y, sync, iters, rounds), 3)
    torch_add = None
    if tx is not None:
        torch_add = bw("x+y  torch", gpu_seconds(lambda: tx + ty, torch.cuda.synchronize, iters,
                                                 rounds), 3)
    if cx is not None:
        bw("x+y  CuPy", gpu_seconds(lambda: cx + cy, sync, iters, rounds), 3)
    if ours_add and torch_add:
        t.add("ratio x+y cudalab / torch", ours_add / torch_add, "x", "goal >= 0.95")
        results["ratio_add_to_torch"] = ours_add / torch_add
    if ours_add and copy:
        t.add("ratio x+y cudalab / d2d copy", ours_add / copy, "x", "goal >= 0.90")
        results["ratio_add_to_copy"] = ours_add / copy
    x = y = out = tx = ty = cx = cy = None  # free 1 GiB buffers before the small rows

    # ------------------------------------------------------------------ host time per call
    number, repeat = (200, 3) if sim or args.quick else (5000, 7)
    small = cudalab.asarray(np.arange(1000, dtype=np.float32))
    small2 = cudalab.asarray(np.ones(1000, dtype=np.float32))
    calls = {"host/call a*x+b  cudalab jiterator (1000 el.)": lambda: axpb(small),
             "host/call x+y  cudalab DeviceArray": lambda: small + small2}
    ts = None
    if torch is not None:
        ts, ts2 = torch.arange(1000, dtype=torch.float32, device="cuda"), torch.ones(1000, device="cuda")
        calls["host/call a*x+b  torch jiterator"] = lambda: tjit(ts)
        calls["host/call x+y  torch"] = lambda: ts + ts2
    if cupy is not None:
        cs, cs2 = cupy.arange(1000, dtype=cupy.float32), cupy.ones(1000, dtype=cupy.float32)
        calls["host/call a*x+b  CuPy ElementwiseKernel"] = lambda: ek(cs, two, one)
        calls["host/call x+y  CuPy"] = lambda: cs + cs2
    # Rounds interleaved across the libraries (the host's speed drifts during a run).
    per_call = interleaved_time_per_call(calls, number=number, repeat=repeat,
                                         warmup=min(number, 500), between=sync)
    host_us = {name: seconds * 1e6 for name, seconds in per_call.items()}
    for name, us in host_us.items():
        results["host_us"][name] = us
        t.add(name, us, "µs", label if "cudalab" in name else "")
    h_ours = host_us["host/call a*x+b  cudalab jiterator (1000 el.)"]
    h_add = host_us["host/call x+y  cudalab DeviceArray"]
    if torch is not None:
        t.add("ratio host cudalab / torch jiterator",
              h_ours / host_us["host/call a*x+b  torch jiterator"], "x", "goal <= 1")
        t.add("ratio host x+y cudalab / torch", h_add / host_us["host/call x+y  torch"], "x", "")
    if cupy is not None:
        t.add("ratio host cudalab / CuPy ElementwiseKernel",
              h_ours / host_us["host/call a*x+b  CuPy ElementwiseKernel"], "x", "goal <= 1")

    # ------------------------------------------------------------------ first call, cold cache
    def first_call(make, arg, synchronize) -> float:
        token = uuid.uuid4().hex[:12]  # a code string no cache has seen
        code = CODE.replace("axpb", f"axpb_{token}")
        t0 = time.perf_counter()
        make(code)(arg)
        synchronize()
        return (time.perf_counter() - t0) * 1e3

    ms = first_call(lambda c: jit._create_jit_fn(c, a=2.0, b=1.0), small, sync)
    results["first_call_ms"]["cudalab"] = ms
    t.add("first call, cold cache  cudalab (NVRTC + load + run)", ms, "ms",
          ("no NVRTC on the simulator" if sim else "") + label)
    if torch is not None:
        tms = first_call(lambda c: torch.cuda.jiterator._create_jit_fn(c, a=2.0, b=1.0), ts,
                         torch.cuda.synchronize)
        results["first_call_ms"]["torch"] = tms
        t.add("first call, cold cache  torch jiterator", tms, "ms", "")
        t.add("ratio first call cudalab / torch", ms / tms, "x", "goal <= 1")
    print(t.render())
    write_json(args.json, results)


if __name__ == "__main__":
    main()
