"""Reduction benchmark: GB/s read by DeviceArray.sum / mean / max, beside torch's, one GPU.

Times (CUDA events, median of repetitions) a full ``sum``, ``max`` and ``mean`` of a float32
vector, and ``sum`` over each axis of a square float32 matrix, for cudalab and for torch on
the same device in the same run (torch's column is skipped when it is missing). GB/s counts
the bytes read once. On the simulator only the correctness of the printed values means
anything.

    python benchmarks/reductions.py [--mib 256] [--reps 20]

Measured on an H100 80GB HBM3 (torch 2.11.0+cu130, 512 MiB, GB/s cudalab / torch): sum()
1045 / 2676, max() 919 / 2704, mean() 1033 / 2634, sum(1) of a square matrix 1157 / 2394,
sum(0) 118 / 2103 (one thread per column: too few threads for 11585 columns). The kernels
are the simple correct ones issue 20 asks for, not tuned ones (no vector loads or unrolling).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import cudalab  # noqa: E402


def _timer_cudalab(reps: int):
    a, b = cudalab.Event(enable_timing=True), cudalab.Event(enable_timing=True)

    def measure(run) -> float:
        for _ in range(3):
            run()
        cudalab.synchronize()
        times = []
        for _ in range(reps):
            a.record()
            run()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[reps // 2]

    return measure


def _timer_torch(torch, reps: int):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def measure(run) -> float:
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a.record()
            run()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[reps // 2]

    return measure


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="vector size in MiB (default 256)")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    try:
        import torch

        if not torch.cuda.is_available():
            torch = None
    except ImportError:
        torch = None
    n = args.mib * (1 << 20) // 4
    side = int((n) ** 0.5)
    host = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    x = cudalab.asarray(host)
    m = x[: side * side].reshape(side, side)
    ours = _timer_cudalab(args.reps)
    cases = [
        ("sum()", lambda: x.sum(), lambda t: t.sum(), n * 4),
        ("max()", lambda: x.max(), lambda t: t.max(), n * 4),
        ("mean()", lambda: x.mean(), lambda t: t.mean(), n * 4),
        ("sum(0) square", lambda: m.sum(0), lambda t: t.view(side, side).sum(0), side * side * 4),
        ("sum(1) square", lambda: m.sum(1), lambda t: t.view(side, side).sum(1), side * side * 4),
    ]
    device = cudalab.get_device_name()
    print(f"reductions of float32, {args.mib} MiB, on {device}")
    print(f"{'case':<16}{'cudalab GB/s':>14}{'torch GB/s':>12}{'ratio':>8}")
    tx = None
    if torch is not None:
        tx = torch.from_dlpack(x)
        theirs = _timer_torch(torch, args.reps)
        # the values agree (float32 sums in different orders: a relative tolerance)
        np.testing.assert_allclose(x.sum().item(), tx.sum().item(), rtol=1e-4)
        assert x.max().item() == tx.max().item()
    for name, run, trun, nbytes in cases:
        ms = ours(run)
        gbs = nbytes / ms / 1e6
        if tx is not None:
            tt = tx[: side * side] if "square" in name else tx
            tms = theirs(lambda trun=trun, tt=tt: trun(tt))
            tgbs = nbytes / tms / 1e6
            print(f"{name:<16}{gbs:>14.1f}{tgbs:>12.1f}{gbs / tgbs:>8.2f}")
        else:
            print(f"{name:<16}{gbs:>14.1f}{'-':>12}{'-':>8}")


if __name__ == "__main__":
    main()
