"""Hot-path benchmark of two checkouts side by side: before/after tables for a refactor.

Rows (µs per operation, cudalab's public API only, so an older BEFORE checkout runs them too):

* the allocator hit pair: ``caching_allocator_alloc`` + ``caching_allocator_delete`` (4 KiB);
* ``Event.record`` on a side stream;
* a small kernel launch: ``a += b`` (float32, 1,024 elements, in place) and ``fill_`` of an
  int64 array of 1,024 elements (an 8-byte pattern: cudalab's fill kernel, not a memset);
* ``CUDAGraph.replay()`` of a one-kernel graph (a loop of replays, then a synchronize);
* history with ``stacks="python"``: the allocator pair in a function, the free on another line,
  while ``_record_memory_history("all", stacks="python")`` records;
* ``memory_stats()``;
* with two devices or more: ``comm.broadcast``, ``reduce_add``, ``scatter`` and ``gather`` of
  1 KiB between devices 0 and 1 (the host's cost of a collective call, which
  ``benchmarks/comm.py``'s few rounds cannot resolve to a few per cent).

Each process (a fresh interpreter, its ``cudalab`` imported from one checkout) times every row
in interleaved rounds and reports the medians; the processes alternate between the BEFORE
checkout and this one (the order flips every round, so drift of the host favours neither),
and the table shows the median over the processes of each side with the ratio after / before.
The row code is this file's own (``--child``), run against either checkout, so BEFORE needs
no benchmark helper. On a GPU host torch's and CuPy's rows run in the same processes: their
code is the same on both sides, so how much they move shows the host's noise. A BEFORE
without its C extensions built (a fresh ``git worktree``) would time the pure-Python
fallbacks: the table warns, and ``--build`` builds them in BEFORE first.

    python benchmarks/house_ab.py BEFORE_DIR [--rounds N] [--json PATH] [--build] [--quick]
    (BEFORE_DIR: e.g. ``git worktree add /tmp/before <commit>``; CUDALAB_SIMULATOR=1 works)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = 4096  # bytes of the allocator pair
N = 1024  # elements of the launch rows


# --------------------------------------------------------------------------- the child
def _loops(sim: bool) -> tuple[dict, dict]:
    """``{library: {row: loop(k)}}`` for what is importable, and the per-row setup/teardown
    around a timed loop (``{(library, row): (start, stop)}``)."""
    import numpy as np

    import cudalab
    import cudalab.memory as cm

    cudalab.init()
    stream = cudalab.Stream()
    event = cudalab.Event()
    a = cudalab.zeros((N,), dtype=np.float32)
    b = cudalab.zeros((N,), dtype=np.float32)
    ints = cudalab.zeros((N,), dtype=np.int64)
    cudalab.synchronize()

    def pair(k, alloc=cm.caching_allocator_alloc, free=cm.caching_allocator_delete, size=SIZE):
        for _ in range(k):
            free(alloc(size))

    def record(k, rec=event.record, s=stream):
        for _ in range(k):
            rec(s)

    def add(k, x=a, y=b):
        for _ in range(k):
            x += y

    def fill(k, x=ints):
        for _ in range(k):
            x.fill_(7)

    ints.fill_(1)  # loads the kernel before the capture
    cudalab.synchronize()
    graph = cudalab.CUDAGraph()
    with cudalab.graph(graph):
        ints.fill_(3)
    cudalab.synchronize()

    def replay(k, g=graph.replay, sync=cudalab.synchronize):
        for _ in range(k):
            g()
        sync()

    def history(k, alloc=cm.caching_allocator_alloc, free=cm.caching_allocator_delete, size=SIZE):
        for _ in range(k):
            ptr = alloc(size)
            free(ptr)

    def stats(k, f=cm.memory_stats):
        for _ in range(k):
            f()

    ours = {"allocator hit pair (alloc+delete, 4 KiB)": pair, "Event.record": record,
            "launch: a += b (float32, 1024)": add, "launch: fill_ (int64, 1024, fill kernel)": fill,
            "CUDAGraph.replay (one kernel)": replay,
            'history stacks="python" (alloc+free pair)': history, "memory_stats()": stats}
    if cudalab.device_count() >= 2:
        ours.update(_comm_loops(cudalab))
    hooks = {("cudalab", 'history stacks="python" (alloc+free pair)'): (
        lambda: cm._record_memory_history("all", stacks="python", max_entries=100_000),
        lambda: cm._record_memory_history(None))}
    loops = {"cudalab": ours}
    if not sim:
        _other_libraries(loops, hooks)
    return loops, hooks


#: The collective rows (two devices or more): each call moves 1 KiB between devices 0 and 1,
#: so the row is the host's cost of the call (``benchmarks/comm.py``'s smallest size, timed
#: here in the interleaved processes that resolve a few per cent); a loop ends with a
#: synchronize of both devices, as comm.py's (nccl-tests') method does.
COMM_ROWS = {"broadcast": "comm.broadcast (1 KiB, devices 0 and 1)",
             "reduce_add": "comm.reduce_add (1 KiB, devices 0 and 1)",
             "scatter": "comm.scatter (1 KiB, devices 0 and 1)",
             "gather": "comm.gather (1 KiB, devices 0 and 1)"}
COMM_COUNT = 256  # float32 elements: 1 KiB


def _comm_rows(broadcast, reduce_add, scatter, gather, x0, x1, synchronize) -> dict:
    """One library's collective loops (its comm functions, its arrays on devices 0 and 1,
    its ``synchronize(device)``)."""

    def sync() -> None:
        for device in (0, 1):
            synchronize(device)

    calls = {"broadcast": lambda: broadcast(x0, devices=[0, 1]),
             "reduce_add": lambda: reduce_add([x0, x1], destination=0),
             "scatter": lambda: scatter(x0, devices=[0, 1]),
             "gather": lambda: gather([x0, x1], destination=0)}

    def loop_of(call):
        def loop(k, call=call, sync=sync):
            for _ in range(k):
                call()
            sync()
        return loop

    return {COMM_ROWS[op]: loop_of(call) for op, call in calls.items()}


def _comm_loops(cudalab) -> dict:
    import numpy as np

    from cudalab import comm

    x0 = cudalab.array.empty((COMM_COUNT,), dtype=np.float32, device=0)
    x0.fill_(1.0)
    x1 = cudalab.array.empty((COMM_COUNT,), dtype=np.float32, device=1)
    x1.fill_(2.0)
    return _comm_rows(comm.broadcast, comm.reduce_add, comm.scatter, comm.gather, x0, x1,
                      cudalab.synchronize)


def _other_libraries(loops: dict, hooks: dict) -> None:
    """torch's and CuPy's rows of the same names, when they import and see a GPU."""
    try:
        import torch

        if not torch.cuda.is_available():
            raise ImportError
    except Exception:
        torch = None
    if torch is not None:
        ts = torch.cuda.Stream()
        te = torch.cuda.Event()
        ta = torch.zeros(N, dtype=torch.float32, device="cuda")
        tb = torch.zeros(N, dtype=torch.float32, device="cuda")
        ti = torch.zeros(N, dtype=torch.int64, device="cuda")
        tg = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ti.fill_(1)  # warm-up outside the capture, as torch asks
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(tg):
            ti.fill_(3)
        torch.cuda.synchronize()

        def t_pair(k, alloc=torch.cuda.caching_allocator_alloc, free=torch.cuda.caching_allocator_delete):
            for _ in range(k):
                free(alloc(SIZE))

        def t_record(k, rec=te.record, s=ts):
            for _ in range(k):
                rec(s)

        def t_add(k, x=ta, y=tb):
            for _ in range(k):
                x += y

        def t_fill(k, x=ti):
            for _ in range(k):
                x.fill_(7)

        def t_replay(k, g=tg.replay, sync=torch.cuda.synchronize):
            for _ in range(k):
                g()
            sync()

        def t_history(k, alloc=torch.cuda.caching_allocator_alloc, free=torch.cuda.caching_allocator_delete):
            for _ in range(k):
                ptr = alloc(SIZE)
                free(ptr)

        def t_stats(k, f=torch.cuda.memory_stats):
            for _ in range(k):
                f()

        ours = loops["cudalab"]
        loops["torch"] = dict(zip(ours, (t_pair, t_record, t_add, t_fill, t_replay, t_history, t_stats)))
        if torch.cuda.device_count() >= 2 and COMM_ROWS["broadcast"] in ours:
            import torch.cuda.comm as tcomm

            t0 = torch.ones(COMM_COUNT, dtype=torch.float32, device="cuda:0")
            t1 = torch.full((COMM_COUNT,), 2.0, dtype=torch.float32, device="cuda:1")
            loops["torch"].update(_comm_rows(tcomm.broadcast, tcomm.reduce_add, tcomm.scatter,
                                             tcomm.gather, t0, t1, torch.cuda.synchronize))
        hooks[("torch", 'history stacks="python" (alloc+free pair)')] = (
            lambda: torch.cuda.memory._record_memory_history("all", stacks="python", max_entries=100_000),
            lambda: torch.cuda.memory._record_memory_history(None))
    try:
        import cupy
    except Exception:
        return
    pool = cupy.cuda.MemoryPool()
    cs = cupy.cuda.Stream(non_blocking=True)
    ce = cupy.cuda.Event(disable_timing=True)
    ca = cupy.zeros(N, dtype=cupy.float32)
    cb = cupy.zeros(N, dtype=cupy.float32)
    ci = cupy.zeros(N, dtype=cupy.int64)

    def c_pair(k, m=pool.malloc):
        for _ in range(k):
            m(SIZE)  # back to the pool when the MemoryPointer dies

    def c_record(k, rec=ce.record, s=cs):
        for _ in range(k):
            rec(s)

    def c_add(k, x=ca, y=cb):
        for _ in range(k):
            x += y

    def c_fill(k, x=ci):
        for _ in range(k):
            x.fill(7)

    names = list(loops["cudalab"])
    loops["cupy"] = {names[0]: c_pair, names[1]: c_record, names[2]: c_add, names[3]: c_fill}


def _calibrate(loop, start, stop, between, target: float) -> int:
    """Iterations for one timed loop of about ``target`` seconds."""
    k = 16
    while True:
        start()
        t0 = time.perf_counter()
        loop(k)
        took = time.perf_counter() - t0
        stop()
        between()
        if took >= target or k >= 1 << 22:
            return max(16, int(k * target / max(took, 1e-9)))
        k *= 4


def child(rounds: int, quick: bool, sim: bool) -> dict:
    """Every row's median µs per operation in this process (see the module notes)."""
    t_import = time.perf_counter()
    import cudalab

    out: dict = {"import_s": time.perf_counter() - t_import, "cudalab": {}, "errors": {},
                 "file": os.path.abspath(cudalab.__file__)}
    try:
        from cudalab.memory_tools import stacks

        out["stamp"] = stacks.stamp_implementation()
    except Exception as exc:  # an old checkout
        out["stamp"] = f"n/a ({type(exc).__name__})"
    out["fastcall"] = "not built"
    for name in ("cudalab._driver.fastcall", "cudalab._driver._fastcall"):  # (renamed in issue 35)
        try:
            importlib.import_module(name)
        except Exception:
            continue
        out["fastcall"] = "compiled"
        break
    loops, hooks = _loops(sim)
    syncs = [cudalab.synchronize]  # after each timed loop (untimed): no row pays for another's queue
    if "torch" in loops:
        import torch

        syncs.append(torch.cuda.synchronize)
    if "cupy" in loops:
        import cupy

        syncs.append(cupy.cuda.Device().synchronize)

    def between() -> None:
        for sync in syncs:
            sync()

    nothing = (lambda: None, lambda: None)
    target = 0.005 if quick else 0.02
    plan = {}
    for lib, rows in loops.items():
        for row, loop in rows.items():
            start, stop = hooks.get((lib, row), nothing)
            try:
                plan[(lib, row)] = (loop, start, stop, _calibrate(loop, start, stop, between, target))
            except Exception as exc:  # a row this checkout cannot run
                out["errors"][f"{lib} {row}"] = f"{type(exc).__name__}: {exc}"
    samples: dict = {key: [] for key in plan}
    for _ in range(rounds):
        for key, (loop, start, stop, k) in plan.items():
            start()
            t0 = time.perf_counter()
            loop(k)
            samples[key].append((time.perf_counter() - t0) / k)
            stop()
            between()
    for (lib, row), values in samples.items():
        out.setdefault(lib, {})[row] = statistics.median(values) * 1e6
    return out


# --------------------------------------------------------------------------- the parent
def _one(tree: str, quick: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.abspath(__file__), "--child"]
    proc = subprocess.run(cmd + (["--quick"] if quick else []), cwd=tree, env=env,
                          capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON")]
    if not lines:
        raise RuntimeError(f"the benchmark failed in {tree}:\n{proc.stderr[-3000:]}")
    result = json.loads(lines[0][4:])
    if not result["file"].startswith(os.path.join(os.path.realpath(tree), "")) and \
            not result["file"].startswith(os.path.join(tree, "")):
        raise RuntimeError(f"{tree}'s process imported cudalab from {result['file']}")
    return result


def _build(tree: str) -> None:
    print(f"building {tree}'s C extensions in place ...", flush=True)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree,
                   check=True, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", nargs="?", help="the checkout to compare with (its root folder)")
    parser.add_argument("--rounds", type=int, default=5, help="processes per side (default 5)")
    parser.add_argument("--json", default=None, help="also write the table and raw runs here")
    parser.add_argument("--build", action="store_true",
                        help="build BEFORE's C extensions in place first (setup.py build_ext)")
    parser.add_argument("--quick", action="store_true", help="shorter loops (a smoke run)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sim = os.environ.get("CUDALAB_SIMULATOR", "").strip().lower() in {"1", "true", "yes", "on"}
    if args.child:
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # cudalab from cwd's tree
        print("JSON" + json.dumps(child(3 if args.quick else 7, args.quick, sim)))
        return
    if not args.before or not os.path.isfile(os.path.join(args.before, "cudalab", "__init__.py")):
        parser.error(f"{args.before} is not a cudalab checkout")
    before_tree = os.path.abspath(args.before)
    if args.build:
        _build(before_tree)
    trees = [("before", before_tree), ("after", HERE)]
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for i in range(args.rounds):
        for name, tree in trees if i % 2 == 0 else trees[::-1]:
            runs[name].append(_one(tree, args.quick))
    table: dict = {}
    head = f"{'row (µs per op, medians of ' + str(args.rounds) + ' processes a side)':<58}"
    print(f"{head} {'before':>9} {'after':>9} {'ratio':>6}")
    for lib in ("cudalab", "torch", "cupy"):
        rows = runs["after"][0].get(lib, {})
        for row in rows:
            before = [r[lib][row] for r in runs["before"] if row in r.get(lib, {})]
            after = [r[lib][row] for r in runs["after"] if row in r.get(lib, {})]
            if not before or not after:
                continue
            b, a = statistics.median(before), statistics.median(after)
            table[f"{lib} {row}"] = {"before_us": b, "after_us": a, "ratio": a / b}
            print(f"{lib + ' ' + row:<58} {b:9.3f} {a:9.3f} {a / b:6.2f}")
    for name in ("before", "after"):
        r = runs[name][0]
        if r["errors"]:
            print(f"{name}: rows it could not run: {r['errors']}")
    setup = {name: (runs[name][0]["stamp"], runs[name][0]["fastcall"]) for name in runs}
    print(f"history stamp / fast calls: before {setup['before']}, after {setup['after']}"
          f"{'' if setup['before'] == setup['after'] else '  (DIFFERENT: run with --build)'}")
    if sim:
        print("(simulator: the rows time cudalab's Python and the simulator, not a GPU)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"before": before_tree, "after": HERE, "rounds": args.rounds, "simulator": sim,
                       "table": table, "setup": setup, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
