"""Allocator benchmark: cache-hit latency, stats getters, fragmentation on real traces.

In one run, side by side:

* cache-hit alloc+free pair for 512 B, 1 MiB, 8 MiB, 64 MiB: cudalab's
  ``caching_allocator_alloc/delete`` and the allocator object's own methods, CuPy's
  ``MemoryPool.malloc`` (Cython), torch's ``caching_allocator_alloc/delete`` (Python API),
  ``torch.empty`` + drop, and raw ``cuMemAllocAsync``/``cuMemFreeAsync``;
* ``memory_allocated()`` and ``memory_stats()`` against torch's;
* fragmentation: allocation traces recorded from torch running real models (a transformer
  encoder and a ResNet-style conv net, with varying batch sizes) are replayed through
  cudalab's allocator on the simulator; peak reserved is compared with torch's own.

Beside the pair rows, ``cudalab pair / CuPy pair`` per size (goal: <= 1.0) where CuPy runs.
``--latency-only`` runs the latency rows alone (no traces: a quick check).

    python benchmarks/allocator.py [--json out.json] [--quick] [--latency-only]
    (CUDALAB_BENCH_TRACES=DIR keeps the recorded torch traces there)
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import Table, environment, interleaved, optional_import, parse_args, write_json  # noqa: E402

SIZES = [("512 B", 512), ("1 MiB", 1 << 20), ("8 MiB", 8 << 20), ("64 MiB", 64 << 20)]


# --------------------------------------------------------------------------- latency
def latency(n: int, rounds: int, sim: bool) -> dict:
    import cudalab
    import cudalab.memory as cm

    torch = None if sim else optional_import("torch")
    cupy = None if sim else optional_import("cupy")
    out: dict = {}
    stream = cudalab.current_stream()
    for label, size in SIZES:
        loops = {}

        def ours(k, a=cm.caching_allocator_alloc, f=cm.caching_allocator_delete, sz=size):
            for _ in range(k):
                f(a(sz))

        loops["cudalab caching_allocator_alloc+delete"] = ours
        from cudalab.allocator.registry import get_allocator

        alloc_obj = get_allocator(0)
        if alloc_obj is not None and hasattr(alloc_obj, "malloc") and hasattr(alloc_obj, "free"):
            def ours_raw(k, a=alloc_obj.malloc, f=alloc_obj.free, sz=size, st=stream):
                for _ in range(k):
                    f(a(sz, st))

            loops["cudalab allocator.malloc+free"] = ours_raw

            def ours_cur(k, a=alloc_obj.malloc, f=alloc_obj.free, sz=size):
                for _ in range(k):
                    f(a(sz))  # the current stream, as CuPy's malloc finds it

            loops["cudalab allocator.malloc+free (current stream)"] = ours_cur
        if cupy is not None:
            pool = cupy.cuda.MemoryPool()

            def cupy_pair(k, m=pool.malloc, sz=size):
                for _ in range(k):
                    m(sz)  # freed back to the pool when the MemoryPointer dies

            loops["CuPy MemoryPool.malloc+drop"] = cupy_pair
        if torch is not None and torch.cuda.is_available():
            def torch_pair(k, a=torch.cuda.caching_allocator_alloc,
                           f=torch.cuda.caching_allocator_delete, sz=size):
                for _ in range(k):
                    f(a(sz))

            def torch_empty(k, e=torch.empty, sz=size, u8=torch.uint8):
                for _ in range(k):
                    e(sz, dtype=u8, device="cuda")

            loops["torch caching_allocator_alloc+delete"] = torch_pair
            loops["torch.empty+drop"] = torch_empty
        if not sim:
            from cuda.bindings import driver as d

            err, rs = d.cuStreamCreate(1)

            def raw_async(k, a=d.cuMemAllocAsync, f=d.cuMemFreeAsync, sz=size, st=rs):
                for _ in range(k):
                    f(a(sz, st)[1], st)

            loops["raw cuMemAllocAsync+cuMemFreeAsync"] = raw_async
        out[label] = {k: v * 1e6 for k, v in interleaved(loops, n, rounds).items()}
        if not sim:
            d.cuStreamSynchronize(rs)
            d.cuStreamDestroy(rs)
    # stats getters
    def calls(f):
        def loop(k):
            for _ in range(k):  # results are dropped at once (a list would keep k dicts alive)
                f()
        return loop

    getters = {
        "cudalab memory_allocated()": calls(cm.memory_allocated),
        "cudalab memory_stats()": calls(cm.memory_stats),
    }
    if torch is not None and torch.cuda.is_available():
        getters["torch memory_allocated()"] = calls(torch.cuda.memory_allocated)
        getters["torch memory_stats()"] = calls(torch.cuda.memory_stats)
    # Getters are measured one contender at a time: interleaving them with torch's 190 µs
    # dict-building calls evicts the other contender's code from the CPU caches.
    out["getters"] = {k: interleaved({k: loop}, max(n // 10, 200), rounds)[k] * 1e6
                      for k, loop in getters.items()}
    return out


# --------------------------------------------------------------------------- traces
def _transformer(torch, nn, dev, quick, batch, seq):
    layer = nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=6).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(3 if quick else 6):
        b = batch + (step % 3) * (batch // 2)  # varying batch sizes
        x = torch.randn(b, seq, 512, device=dev)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _convnet(torch, nn, dev, quick, batch, hw):
    layers, c = [], 3
    for width in (64, 128, 256, 512):
        layers += [nn.Conv2d(c, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                   nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                   nn.MaxPool2d(2)]
        c = width
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 1000)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3 if quick else 6):
        b = batch + (step % 3) * (batch // 4)
        x = torch.randn(b, 3, hw, hw, device=dev)
        y = torch.randint(0, 1000, (b,), device=dev)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


WORKLOADS = [("transformer b16 s256", _transformer, (16, 256)),
             ("transformer b8 s1024", _transformer, (8, 1024)),
             ("convnet b32 224px", _convnet, (32, 224)),
             ("convnet b96 128px", _convnet, (96, 128))]


def _record_one(index: int, directory: str, quick: bool) -> dict:
    """Run one workload in this (fresh) process with torch's history recording on."""
    import torch
    from torch import nn

    name, fn, args = WORKLOADS[index]
    dev = torch.device("cuda:0")
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python", context="alloc")
    fn(torch, nn, dev, quick, *args)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    # The segment entries travel too: the replay places each segment at its traced address,
    # since torch's best fit breaks ties between equal-size blocks by address.
    trace = [(e["action"], e["addr"], e["size"], e["stream"])
             for e in snap["device_traces"][0]
             if e["action"] in ("alloc", "free_requested", "segment_alloc", "segment_free")]
    path = os.path.join(directory, name.replace(" ", "_") + ".pkl")
    with open(path, "wb") as f:
        pickle.dump({"name": name, "trace": trace,
                     "torch_peak_reserved": torch.cuda.max_memory_reserved(),
                     "torch_peak_allocated": torch.cuda.max_memory_allocated()}, f, protocol=4)
    return {"name": name, "path": path, "entries": len(trace)}


def record_torch_traces(directory: str, quick: bool) -> list[dict]:
    """Record torch's allocator trace of each workload, each in a fresh process.

    A fresh process matters: blocks that outlive one workload (cuBLAS workspaces, cached
    segments) would otherwise shape the next workload's placement without being in its trace.
    """
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    runs = []
    for i in range(len(WORKLOADS)):
        with ctx.Pool(1) as pool:
            runs.append(pool.apply(_record_one, (i, directory, quick)))
    return runs


def replay_traces(runs: list[dict], conf: str = "") -> list[dict]:
    """Replay each torch trace through cudalab's allocator (``cudalab.memory_tools.replay``), which
    builds a fresh allocator over a private simulator for every run."""
    import time

    from cudalab.memory_tools.replay import replay

    rows = []
    for run in runs:
        with open(run["path"], "rb") as f:
            data = pickle.load(f)
        t0 = time.perf_counter()
        try:
            res = replay(data["trace"], conf)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            rows.append({"name": run["name"], "error": f"{type(exc).__name__}: {exc}"})
            continue
        dt = time.perf_counter() - t0
        rows.append({
            "name": run["name"], "entries": len(data["trace"]),
            "torch_peak_reserved": data["torch_peak_reserved"],
            "torch_peak_allocated": data["torch_peak_allocated"],
            "cudalab_peak_reserved": res.peak_reserved, "cudalab_peak_allocated": res.peak_allocated,
            "skipped": sum(res.skipped.values()), "replay_entries_per_s": len(data["trace"]) / dt,
        })
    return rows


def main() -> None:
    args = parse_args(__doc__, (("--latency-only", "only the latency and getter rows"),))
    import cudalab

    cudalab.init()
    backend = cudalab.devices.backend()
    sim = backend.simulated
    name = cudalab.get_device_name(0)
    n = 2000 if args.quick else 20000
    results = {"env": environment(backend.name, name)}
    lat = latency(n, 5 if args.quick else 9, sim)
    results["latency_us"] = lat
    t = Table(f"cudalab allocator benchmark — {name} ({backend.name})")
    for label, _ in SIZES:
        for k, v in lat[label].items():
            t.add(f"{label:>6}  {k}", v)
        cupy_us = lat[label].get("CuPy MemoryPool.malloc+drop")
        if cupy_us:
            ratio = lat[label]["cudalab caching_allocator_alloc+delete"] / cupy_us
            lat[label]["ratio cudalab pair / CuPy pair"] = ratio
            t.add(f"{label:>6}  cudalab pair / CuPy pair", ratio, "x", "(goal: <= 1)")
    for k, v in lat["getters"].items():
        t.add(k, v)
    torch = None if sim else optional_import("torch")
    if args.latency_only:
        pass
    elif torch is not None and torch.cuda.is_available():
        directory = os.environ.get("CUDALAB_BENCH_TRACES") or tempfile.mkdtemp()
        os.makedirs(directory, exist_ok=True)
        runs = record_torch_traces(directory, args.quick)
        results["fragmentation"] = {}
        for conf in ("", "expandable_segments:True"):
            rows = replay_traces(runs, conf)
            results["fragmentation"][conf or "default"] = rows
            for row in rows:
                label = f"peak reserved {row['name']} [{conf or 'default'}]"
                if "error" in row:
                    t.add(label, None, "", f"error {row['error']}")
                    continue
                ratio = row["cudalab_peak_reserved"] / row["torch_peak_reserved"]
                t.add(label, row["cudalab_peak_reserved"] / 2**20, "MiB",
                      f"torch {row['torch_peak_reserved'] / 2**20:.1f} MiB, ratio {ratio:.4f}; "
                      f"{row['entries']} entries, replay {row['replay_entries_per_s']:.0f}/s, "
                      f"skipped {row['skipped']}")
    else:
        t.add("fragmentation", None, "", "needs torch on a GPU (traces recorded there)")
    print(t.render())
    write_json(args.json, results)


if __name__ == "__main__":
    main()
