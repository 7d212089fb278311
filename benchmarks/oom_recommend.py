"""Benchmark: does the autotuner's recommended setting do what it predicts? Three workloads.

For each workload (a ragged-batch inference server, a training loop with activations of
varying batch shapes, a KV cache grown by concatenation) this script:

1. runs it in a fresh process through ``cudalab.empty`` with the history recorded, and keeps
   the snapshot and the real peak reserved bytes of the native defaults;
2. runs ``cudalab.memory.autotune`` on the snapshot at the device's capacity (the default
   grid) and takes the recommended setting and its predicted peak reserved bytes;
3. runs the workload again in a fresh process with ``CUDALAB_ALLOC_CONF`` set to it, and
   compares the real peak reserved bytes (``max_memory_reserved``) with the prediction.

The defaults' replay is compared with their real run too (the replay reproduces the allocator
exactly, so it should read x1.000). On the simulator every run is simulated; on a GPU the
runs allocate real memory (sizes scale with ``--scale``, GiB of peak live memory).

    python benchmarks/oom_recommend.py [--scale 8] [--workers N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import environment, write_json  # noqa: E402

MiB = 1 << 20
WORKLOADS = ("ragged", "training", "kvcache")


def _ragged(allocate, free, scale: float) -> None:
    from cudalab.memory_tools.synthetic import ragged_inference_workload

    ragged_inference_workload(allocate, free, steps=200, layers=4, seed=1,
                              hidden=int(4096 * scale), kv_dim=int(1024 * scale))


def _training(allocate, free, scale: float) -> None:
    rng = random.Random(2)
    unit = int(scale * 16 * MiB)
    params = [allocate(rng.randint(1, 8) * unit // 4) for _ in range(12)]
    moments = [allocate(rng.randint(1, 8) * unit // 4) for _ in range(12)]
    for _ in range(40):  # steps with batch shapes that change
        batch = rng.choice((1, 2, 3, 5, 8))
        acts = [allocate(batch * rng.randint(2, 6) * unit // 8) for _ in range(16)]
        grads = []
        while acts:  # backward: activations freed in reverse, gradients made
            free(acts.pop())
            if rng.random() < 0.5:
                grads.append(allocate(rng.randint(1, 4) * unit // 8))
        for g in grads:
            free(g)
    for h in params + moments:
        free(h)


def _kvcache(allocate, free, scale: float) -> None:
    rng = random.Random(3)
    step = int(scale * 2 * MiB)
    caches: list = []
    sizes: list = []
    for _ in range(120):
        if caches and rng.random() < 0.15:  # a request ends
            i = rng.randrange(len(caches))
            free(caches.pop(i))
            sizes.pop(i)
        if len(caches) < 6 and rng.random() < 0.3:  # a request arrives
            caches.append(allocate(step))
            sizes.append(step)
        for i in range(len(caches)):  # torch.cat: the grown copy, then the old one freed
            bigger = allocate(sizes[i] + step)
            free(caches[i])
            caches[i] = bigger
            sizes[i] += step
    for h in caches:
        free(h)


def child(workload: str, scale: float, record: str | None) -> None:
    """Run one workload in this process; print its peak reserved bytes as JSON."""
    import cudalab
    import cudalab.memory as cm

    live: dict[int, object] = {}

    def allocate(nbytes: int) -> int:
        a = cudalab.empty(int(nbytes), dtype="uint8")
        live[id(a)] = a
        return id(a)

    def free(handle: int) -> None:
        del live[handle]

    cudalab.init()
    if record:
        cm._record_memory_history(max_entries=10_000_000)
    {"ragged": _ragged, "training": _training, "kvcache": _kvcache}[workload](
        allocate, free, scale)
    cudalab.synchronize()
    if record:
        cm._dump_snapshot(record)
        cm._record_memory_history(None)
    print(json.dumps({"peak_reserved": cm.max_memory_reserved(),
                      "peak_allocated": cm.max_memory_allocated(),
                      "total": cudalab.get_device_properties(0).total_memory,
                      "settings": os.environ.get("CUDALAB_ALLOC_CONF", "")}))


def _run_child(workload: str, scale: float, record: str | None, setting: str | None) -> dict:
    env = dict(os.environ)
    env.pop("CUDALAB_ALLOC_CONF", None)
    if setting:
        env["CUDALAB_ALLOC_CONF"] = setting
    cmd = [sys.executable, __file__, "--child", workload, "--scale", str(scale)]
    if record:
        cmd += ["--record", record]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if out.returncode:
        raise RuntimeError(f"{workload} ({setting or 'defaults'}) failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=None,
                   help="size scale (default: 1 on the simulator, 8 on a GPU)")
    p.add_argument("--workers", type=int, default=None, help="autotune worker processes")
    p.add_argument("--json", default=None, help="write results as JSON to this path")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--record", default=None, help=argparse.SUPPRESS)
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help="comma-separated subset of " + ", ".join(WORKLOADS))
    args = p.parse_args()
    if args.child:
        child(args.child, args.scale or 1.0, args.record)
        return
    import cudalab
    from cudalab._units import format_bytes
    from cudalab.memory_tools.autotune import autotune

    simulated = cudalab.devices.backend().simulated
    scale = args.scale or (1.0 if simulated else 8.0)
    print(f"recommended settings, predicted vs real ({'SIMULATED' if simulated else 'GPU'}; "
          f"scale {scale:g})")
    print(f"  {'workload':<9} {'setting':<58} {'predicted':>11} {'real':>11} {'ratio':>7}"
          f" {'defaults x':>10}")
    rows = []
    worst = 0.0
    names = args.workloads.split(",")
    from concurrent.futures import ThreadPoolExecutor

    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(len(names)) as pool:
        t0 = time.perf_counter()
        paths = {w: os.path.join(tmp, f"{w}.pickle") for w in names}
        # the workloads run side by side (each in its own process: its own peaks)
        bases = dict(zip(names, pool.map(lambda w: _run_child(w, scale, paths[w], None),
                                          names)))
        t_record = time.perf_counter() - t0
        recs = {}
        for w in names:
            df = autotune(paths[w], [bases[w]["total"]], workers=args.workers)
            default_row = df[df["setting"] == "default"].iloc[0]
            recs[w] = (df.attrs["recommendation"], int(default_row["peak_reserved"]))
        t_tune = time.perf_counter() - t0 - t_record
        reruns = dict(zip(names, pool.map(
            lambda w: _run_child(w, scale, None, recs[w][0]["setting"])
            if recs[w][0]["setting"] else bases[w], names)))
        t_rerun = time.perf_counter() - t0 - t_record - t_tune
        for w in names:
            rec, default_predicted = recs[w]
            setting = rec["setting"] or ""
            base = bases[w]
            real = reruns[w]
            default_ratio = base["peak_reserved"] / default_predicted
            ratio = real["peak_reserved"] / rec["peak_reserved"]
            worst = max(worst, abs(ratio - 1))
            print(f"  {w:<9} {(setting or 'default')[:58]:<58} "
                  f"{format_bytes(rec['peak_reserved'], decimals=1):>11} "
                  f"{format_bytes(real['peak_reserved'], decimals=1):>11} {ratio:>7.4f} "
                  f"{default_ratio:>10.4f}")
            rows.append({"workload": w, "setting": setting,
                         "predicted_peak_reserved": rec["peak_reserved"],
                         "real_peak_reserved": real["peak_reserved"], "ratio": ratio,
                         "default_real": base["peak_reserved"],
                         "default_predicted": default_predicted,
                         "retries": rec["retries"]})
    print(f"  (recording {t_record:.1f} s, autotune {t_tune:.1f} s, reruns {t_rerun:.1f} s)")
    verdict = "PASS" if worst <= 0.02 else "FAIL"
    print(f"  worst |real/predicted - 1| = {100 * worst:.2f} % (goal <= 2 %): {verdict}")
    write_json(args.json, {"environment": environment(
        "simulator" if simulated else "gpu", cudalab.get_device_properties(0).name),
        "scale": scale, "rows": rows, "worst": worst})


if __name__ == "__main__":
    main()
