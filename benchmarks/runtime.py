"""Runtime core benchmark: import cost and hot-path call overheads of cudalab.

Compares cudalab with raw cuda.bindings calls, torch.cuda and CuPy in the same run:
``import`` time, ``Event.record``, ``Event.query``, ``Stream.query``, ``current_stream()``,
``current_device()``. Run on a GPU machine; on the simulator only cudalab's own columns
are meaningful (and the table says so).

    python benchmarks/runtime.py [--json out.json] [--quick]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout works uninstalled
from _harness import Table, environment, interleaved, optional_import, parse_args, write_json  # noqa: E402


def import_seconds(stmt: str, runs: int = 7) -> float | None:
    """Median wall time of ``stmt`` in a fresh interpreter (first run discarded: disk cache)."""
    code = f"import time; t=time.perf_counter(); {stmt}; print(time.perf_counter()-t)"
    out = []
    for i in range(runs + 1):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=os.environ.copy())
        if r.returncode != 0:
            return None
        if i:
            out.append(float(r.stdout.strip().splitlines()[-1]))
    return statistics.median(out)


def _drop(f, k, *args) -> None:
    """Call ``f(*args)`` k times, dropping results (like the cudalab loops do)."""
    for _ in range(k):
        f(*args)


def _done(obj, k) -> None:
    for _ in range(k):
        obj.done  # noqa: B018 - CuPy's query is a property


def context_after_import() -> str:
    code = ("import cudalab\nfrom cuda.bindings import driver as d\nd.cuInit(0)\n"
            "err, ctx = d.cuCtxGetCurrent()\nprint(int(ctx) if ctx is not None else 0)")
    env = {k: v for k, v in os.environ.items() if k != "CUDALAB_SIMULATOR"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        return f"n/a ({r.stderr.strip().splitlines()[-1] if r.stderr else 'error'})"
    return "none" if r.stdout.strip() == "0" else f"CONTEXT {r.stdout.strip()}"


def main() -> None:
    args = parse_args(__doc__)
    n = 2000 if args.quick else 50000
    import cudalab
    import cudalab._internal

    cudalab.init()
    backend = cudalab._internal.backend()
    name = cudalab.get_device_name(0)
    sim = backend.simulated
    t = Table(f"cudalab runtime benchmark — {name} ({backend.name})")
    results: dict = {"env": environment(backend.name, name), "us": {}}

    def put(key, seconds, note=""):
        us = None if seconds is None else seconds * 1e6
        results["us"][key] = us
        t.add(key, us, "µs", note)

    # ---------------------------------------------------------------- import
    for label, stmt in [("import cudalab", "import cudalab"), ("import cupy", "import cupy"),
                        ("import torch", "import torch")]:
        s = import_seconds(stmt, runs=3 if args.quick else 7)
        results["us"][label] = None if s is None else s * 1e6
        t.add(label, None if s is None else s * 1e3, "ms", "" if s is not None else "not installed")
    if not sim:
        ctx = context_after_import()
        results["context_after_import"] = ctx
        t.add("CUDA context after `import cudalab`", None, "", ctx)

    # ---------------------------------------------------------------- cudalab hot paths
    s = cudalab.Stream()
    e = cudalab.Event()
    e.record(s)
    s.synchronize()

    def loop_record(k, rec=e.record, st=s):
        for _ in range(k):
            rec(st)

    def loop_equery(k, q=e.query):
        for _ in range(k):
            q()

    def loop_squery(k, q=s.query):
        for _ in range(k):
            q()

    def loop_cur_stream(k, f=cudalab.current_stream):
        for _ in range(k):
            f()

    def loop_cur_device(k, f=cudalab.current_device):
        for _ in range(k):
            f()

    torch = None if sim else optional_import("torch")
    cupy = None if sim else optional_import("cupy")
    contenders: dict[str, dict] = {
        "Event.record": {"cudalab": loop_record},
        "Event.query": {"cudalab": loop_equery},
        "Stream.query": {"cudalab": loop_squery},
        "current_stream()": {"cudalab": loop_cur_stream},
        "current_device()": {"cudalab": loop_cur_device},
    }
    cleanup = []
    if not sim:
        from cuda.bindings import driver as d

        err, rs = d.cuStreamCreate(1)
        err, rev = d.cuEventCreate(2)

        def raw_record(k, f=d.cuEventRecord, ev=rev, st=rs):
            for _ in range(k):
                if f(ev, st)[0]:
                    raise RuntimeError

        def raw_equery(k, f=d.cuEventQuery, ev=rev):
            for _ in range(k):
                f(ev)

        def raw_squery(k, f=d.cuStreamQuery, st=rs):
            for _ in range(k):
                f(st)

        contenders["Event.record"]["raw"] = raw_record
        contenders["Event.query"]["raw"] = raw_equery
        contenders["Stream.query"]["raw"] = raw_squery
        cleanup.append(lambda: (d.cuStreamSynchronize(rs), d.cuEventDestroy(rev), d.cuStreamDestroy(rs)))
    if torch is not None and torch.cuda.is_available():
        ts = torch.cuda.Stream()
        te = torch.cuda.Event()
        te.record(ts)
        contenders["Event.record"]["torch"] = lambda k, r=te.record, st=ts: _drop(r, k, st)
        contenders["Event.query"]["torch"] = lambda k, q=te.query: _drop(q, k)
        contenders["Stream.query"]["torch"] = lambda k, q=ts.query: _drop(q, k)
        contenders["current_stream()"]["torch"] = lambda k, f=torch.cuda.current_stream: _drop(f, k)
        contenders["current_device()"]["torch"] = lambda k, f=torch.cuda.current_device: _drop(f, k)
        cleanup.append(ts.synchronize)
    if cupy is not None:
        cs = cupy.cuda.Stream(non_blocking=True)
        ce = cupy.cuda.Event(disable_timing=True)
        ce.record(cs)
        contenders["Event.record"]["cupy"] = lambda k, r=ce.record, st=cs: _drop(r, k, st)
        contenders["Event.query"]["cupy"] = lambda k, e_=ce: _done(e_, k)
        contenders["Stream.query"]["cupy"] = lambda k, s_=cs: _done(s_, k)
        contenders["current_stream()"]["cupy"] = lambda k, f=cupy.cuda.get_current_stream: _drop(f, k)
        contenders["current_device()"]["cupy"] = lambda k, f=cupy.cuda.runtime.getDevice: _drop(f, k)
        cleanup.append(cs.synchronize)
    measured = {key: interleaved(loops, n, rounds=5 if args.quick else 9)
                for key, loops in contenders.items()}
    s.synchronize()
    for fn in cleanup:
        fn()
    ours = {k: v["cudalab"] for k, v in measured.items()}
    raw = {k: v["raw"] for k, v in measured.items() if "raw" in v}
    tor = {k: v["torch"] for k, v in measured.items() if "torch" in v}
    cpy = {k: v["cupy"] for k, v in measured.items() if "cupy" in v}

    results["raw_us"] = {k: v * 1e6 for k, v in raw.items()}
    results["torch_us"] = {k: v * 1e6 for k, v in tor.items()}
    results["cupy_us"] = {k: v * 1e6 for k, v in cpy.items()}
    for key, sec in ours.items():
        notes = []
        if key in raw:
            notes.append(f"raw {raw[key] * 1e6:.3f} µs, ratio {sec / raw[key]:.2f}x")
        if key in tor:
            notes.append(f"torch {tor[key] * 1e6:.3f}")
        if key in cpy:
            notes.append(f"cupy {cpy[key] * 1e6:.3f}")
        if sim:
            notes.append("simulator: no raw/torch/CuPy comparison")
        put(key, sec, "; ".join(notes))
        if key in raw:
            results.setdefault("ratio_vs_raw", {})[key] = sec / raw[key]
    print(t.render())
    write_json(args.json, results)


if __name__ == "__main__":
    main()
