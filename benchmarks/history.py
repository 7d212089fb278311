"""History, snapshot and replay benchmark, side by side with torch in one run.

* added cost of allocation history per alloc+free pair: cudalab's
  ``caching_allocator_alloc/delete`` and ``DeviceArray`` creation+drop with history off,
  ``stacks=None`` and ``stacks="python"``, next to ``torch.empty``+drop with torch's
  ``_record_memory_history`` off and on (``stacks="python"``, and torch's default
  ``stacks="all"``, Python and C++ frames); the loops run in a function 4 frames deep, 22
  frames deeper, and in an IPython cell (through ``InteractiveShell.run_cell``); each also
  with the allocation in a user's function and its ``del`` on the next line (the free's stack
  differs from the allocation's, each call a new frame), torch beside; with the compiled stamp built
  (``cudalab.memory_tools._stackstamp``), ``stacks="python"`` is timed with it and with the
  pure-Python stamp, alternating;
* steady state of a long recording: the added cost per ``empty``+drop pair once the ring
  already holds 100k and 1M entries (``max_entries`` = N, so it wraps), cudalab
  ``stacks=None`` / ``"python"`` next to torch ``"python"``, the memory per recorded entry
  (RSS growth) and a full ``gc.collect()``'s time with the ring full, each in a fresh process;
* ``memory_snapshot()`` with 2000 live blocks, cudalab against torch;
* replay throughput (trace entries per second) on a synthetic 200k-entry trace.

    python benchmarks/history.py [--json out.json] [--quick]

Bounds (the targets this project set): history with python stacks adds <= 0.5x torch's added cost; with
stacks=None <= 0.3 us (also once the ring holds 1M entries); memory per recorded entry <=
torch's; snapshot of 2000 blocks <= torch's time; replay >= 200k entries/s.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import (  # noqa: E402
    Table,
    environment,
    optional_import,
    parse_args,
    time_per_call,
    write_json,
)


def _median_time(fn, repeat: int) -> float:
    return time_per_call(fn, number=1, repeat=repeat, warmup=0)


def _nest(depth: int, fn, k: int):
    """``fn(k)`` called ``depth`` Python frames deeper (a deep call stack, as in a model's
    forward pass)."""
    return fn(k) if depth <= 0 else _nest(depth - 1, fn, k)


# The timed loop, with the operation written in its body as a user's loop would have it:
# in a function (a script) or at the top level of a notebook cell, above IPython's ~25
# frames, as it runs when a user records history in a notebook.
_LOOP = """\
def loop(_k):
    _t0 = _pc()
    for _ in range(_k):
        {op}
    return _pc() - _t0
"""
_CELL = """\
_t0 = _pc()
for _ in range(_k):
    {op}
_took.append(_pc() - _t0)
"""


# A user's function allocating on one line and freeing on another: the free's stack differs
# from the allocation's, and each call is a new frame (issue 37, section 2).
_ALLOC_DEL = """\
def alloc_del(n):
    x = {make}
    del x
"""
FUNC = "cudalab empty in a function, del on the next line"
TORCH_FUNC = "torch.empty in a function, del on the next line"


def _user_function(src: str, ns: dict):
    """The function ``alloc_del(n)`` of ``src``, compiled as a user's module's code."""
    g = {"__name__": "__main__", **ns}
    exec(compile(src, "<benchmark user code>", "exec"), g)
    return g["alloc_del"]


def _script_loop(op: str, ns: dict):
    """A function ``loop(k)`` running the statement ``op`` k times; its seconds."""
    ns = {"__name__": "__main__", "_pc": time.perf_counter, **ns}
    exec(compile(_LOOP.format(op=op), "<benchmark loop>", "exec"), ns)
    return ns["loop"]


def _cell_loop(op: str, ns: dict):
    """Like _script_loop, the loop running in an IPython cell; None without IPython."""
    try:
        from IPython.core.interactiveshell import InteractiveShell
    except ImportError:
        return None
    shell = InteractiveShell.instance()
    took: list = []
    src = _CELL.format(op=op)

    def loop(k: int) -> float:
        shell.user_ns.update(ns, _pc=time.perf_counter, _took=took, _k=k)
        res = shell.run_cell(src, store_history=False, silent=True)
        res.raise_error()
        return took.pop()

    return loop


def history_cost(n: int, rounds: int, sim: bool, where: str) -> dict | None:
    """Per-pair times with each recording mode, the loop running ``where``: ``"script"``
    (a function 4 Python frames deep), ``"deep"`` (22 frames deeper) or ``"cell"`` (a
    notebook cell). None when the place is not available (IPython missing)."""
    import cudalab
    import cudalab.memory as cm
    from cudalab.memory_tools import stacks

    torch = None if sim else optional_import("torch")
    have_torch = torch is not None and torch.cuda.is_available()
    size = 4096
    ops = {"cudalab caching_allocator_alloc+delete": "_f(_a(_s))",
           "cudalab empty+drop": "_e(_n)",
           FUNC: "_g(_n)"}
    ns = dict(_f=cm.caching_allocator_delete, _a=cm.caching_allocator_alloc,
              _e=cudalab.empty, _s=size, _n=size // 4)
    ns["_g"] = _user_function(_ALLOC_DEL.format(make="_e(n)"), ns)
    if have_torch:
        ops["torch.empty+drop"] = '_te(_s, dtype=_u, device="cuda")'
        ns.update(_te=torch.empty, _u=torch.uint8)
        ops[TORCH_FUNC] = "_tg(_s)"
        ns["_tg"] = _user_function(
            _ALLOC_DEL.format(make='_te(n, dtype=_u, device="cuda")'), ns)
    loops = {}
    for name, op in ops.items():
        if where == "cell":
            loop = _cell_loop(op, ns)
            if loop is None:
                return None
        elif where == "deep":
            loop = functools.partial(_nest, 20, _script_loop(op, ns))
        else:
            loop = _script_loop(op, ns)
        loops[name] = loop

    # The recording modes alternate within every round (each timed loop runs between its
    # mode's start and stop, which are not timed), so host drift between modes cancels in
    # the "added" differences. Stopping stack-less recording writes out the memo pairs that
    # were logged as bare times; that cost, paid once by whoever reads or stops the
    # history, is reported on its own row (torch likewise builds its Python entries only
    # when _snapshot() is called).
    stamp = stacks.stamp_implementation()

    def ours_on(kw, use):
        def start():
            stacks._use_stamp(use)
            cm._record_memory_history("all", max_entries=100_000, **kw)
        return start

    def ours_off():
        cm._record_memory_history(None)
        stacks._use_stamp(stamp)

    def nothing():
        pass

    modes = [("off", None, stamp), ("stacks=None", dict(stacks=None), stamp),
             ("stacks=python", dict(stacks="python"), stamp)]
    if stamp == "compiled":
        modes.append((PURE, dict(stacks="python"), "python"))
    cases: dict = {}
    for mode, kw, use in modes:
        start = nothing if kw is None else ours_on(kw, use)
        stop = nothing if kw is None else ours_off
        for name in ("cudalab caching_allocator_alloc+delete", "cudalab empty+drop", FUNC):
            cases[(mode, name)] = (loops[name], start, stop)
    if have_torch:
        torch.empty(1, device="cuda")

        def torch_on(stacks):
            return lambda: torch.cuda.memory._record_memory_history(
                enabled="all", stacks=stacks, max_entries=100_000)

        def torch_off():
            torch.cuda.memory._record_memory_history(enabled=None)

        tl = loops["torch.empty+drop"]
        cases[("off", "torch.empty+drop")] = (tl, nothing, nothing)
        cases[("stacks=python", "torch.empty+drop")] = (tl, torch_on("python"), torch_off)
        # torch's default (_record_memory_history() with no arguments): Python and C++
        # frames; cudalab's "all" is its Python frames, the stacks=python rows above
        cases[("stacks=all", "torch.empty+drop")] = (tl, torch_on("all"), torch_off)
        tf = loops[TORCH_FUNC]
        cases[("off", TORCH_FUNC)] = (tf, nothing, nothing)
        cases[("stacks=python", TORCH_FUNC)] = (tf, torch_on("python"), torch_off)
    samples: dict = {k: [] for k in cases}
    stops: list[float] = []
    for loop, start, stop in cases.values():  # warm-up
        start()
        loop(min(n, 1000))
        stop()
    for _ in range(rounds):
        for key, (loop, start, stop) in cases.items():
            start()
            took = loop(n)
            t1 = time.perf_counter()
            stop()
            samples[key].append(took / n)
            if key == ("stacks=None", "cudalab caching_allocator_alloc+delete"):
                stops.append((time.perf_counter() - t1) / n)
    out: dict = {}
    for (mode, name), v in samples.items():
        out.setdefault(mode, {})[name] = statistics.median(v) * 1e6
    # added costs: the median over rounds of each round's difference (the modes alternate
    # within a round, so host drift between rounds cancels)
    added: dict = {}
    for (mode, name), v in samples.items():
        if mode != "off" and ("off", name) in samples:
            diffs = [a - b for a, b in zip(v, samples[("off", name)])]
            added.setdefault(mode, {})[name] = statistics.median(diffs) * 1e6
    out["added"] = added
    out["write_out_per_pair_us"] = statistics.median(stops) * 1e6
    return out


def _rss() -> int:
    """The process's resident bytes (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _steady_one(cap: int, who: str, stacks: str | None, n: int, rounds: int) -> dict:
    """One row of :func:`history_steady`, in a fresh process (so that the RSS growth is
    the recording's own): seconds per pair with nothing recording (before and after),
    then with ``who`` ("cudalab" or "torch") recording once its ring holds ``cap``
    entries (medians over rounds), the RSS growth over those entries and a full
    ``gc.collect()``'s time."""
    import gc

    import cudalab
    import cudalab.memory as cm
    from cudalab.memory_tools import history

    if hasattr(os, "sched_setaffinity"):  # fewer migrations: steadier times
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[-2:])
    cudalab.init()
    size = 4096
    if who == "cudalab":
        loop = _script_loop("_e(_n)", dict(_e=cudalab.empty, _n=size // 4))

        def start() -> None:
            cm._record_memory_history("all", stacks=stacks, max_entries=cap)

        def stop() -> None:
            cm._record_memory_history(None)

        sync = history._sync_allocators
    else:
        import torch

        torch.empty(1, device="cuda")
        loop = _script_loop('_te(_s, dtype=_u, device="cuda")',
                            dict(_te=torch.empty, _u=torch.uint8, _s=size))

        def start() -> None:
            torch.cuda.memory._record_memory_history(enabled="all", stacks=stacks,
                                                     max_entries=cap)

        def stop() -> None:
            torch.cuda.memory._record_memory_history(enabled=None)

        def sync() -> None:
            pass

    def time_off() -> list:
        return [loop(n) / n for _ in range(rounds)]

    loop(1000)
    off = time_off()
    gc.collect()
    rss0 = _rss()
    start()
    for _ in range(0, cap // 3 + 1, 10_000):  # each pair records 3 entries
        loop(10_000)
        sync()
    rss1 = _rss()
    t0 = time.perf_counter()
    gc.collect()
    gc_ms = (time.perf_counter() - t0) * 1e3
    times = []
    paired = []
    for _ in range(rounds):  # each round long enough for the garbage collector's passes
        times.append(loop(n) / n)
        sync()  # (not timed: see the write-out row of the short-recording tables)
        if who == "cudalab":
            # the recording path alone: the same loop with the hooks detached, the ring
            # (and what it costs the garbage collector) still there
            from cudalab.allocator import hooks, registry

            traced = [(a, a._trace) for a in list(registry.active) if a._trace is not None]
            for a, _ in traced:
                hooks.detach_trace(a)
            paired.append(times[-1] - loop(n) / n)
            for a, t in traced:
                hooks.attach_trace(a, t)
    stop()
    off_s = statistics.median(off + time_off())  # before and after the recording
    on = statistics.median(times)
    return {"on_us": on * 1e6, "off_us": off_s * 1e6, "added_us": (on - off_s) * 1e6,
            "bytes_per_entry": (rss1 - rss0) / cap, "gc_collect_ms": gc_ms,
            "paired_added_us": statistics.median(paired) * 1e6 if paired else None}


def history_steady(sizes: tuple, n: int, rounds: int, sim: bool) -> dict:
    """The added cost per ``empty``+drop pair once the ring already holds N entries (for
    each N of ``sizes``; ``max_entries=N``, so the ring stays full and wraps), with
    cudalab's ``stacks=None`` and ``stacks="python"`` and torch's ``stacks="python"``; the
    memory each recorded entry costs (the process's RSS growth over the N entries, for
    both); and the time of a full ``gc.collect()`` with the ring full.

    Each row runs in a fresh process (:func:`_steady_one`); times are medians over
    ``rounds`` loops of ``n`` pairs each, long enough that every loop pays its share of
    the garbage collector's full passes (one per ~125,000 pairs with a tracked ring)."""
    import json
    import subprocess

    torch = None if sim else optional_import("torch")
    modes = [("cudalab", "stacks=None", None), ("cudalab", "stacks=python", "python")]
    if torch is not None and torch.cuda.is_available():
        modes.append(("torch", "stacks=python", "python"))
    out: dict = {}
    for cap in sizes:
        res: dict = {}
        for who, mode, stacks in modes:
            here = os.path.dirname(os.path.abspath(__file__))
            code = (f"import json, sys; sys.path.insert(0, {here!r}); import history as h; "
                    f"print(json.dumps(h._steady_one({cap}, {who!r}, {stacks!r}, {n}, "
                    f"{rounds})))")
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                  text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"steady-state row {who} {mode} N={cap} failed:\n"
                                   f"{proc.stderr[-3000:]}")
            res[f"{who} [{mode}]"] = json.loads(proc.stdout.strip().splitlines()[-1])
        out[cap] = res
    return out


def _steady_table(res: dict, device: str) -> Table:
    t = Table(f"History once the ring holds N entries (empty+drop pairs, {device})")
    for cap, rows in res.items():
        for key, r in rows.items():
            note = ("bound <= 0.3" if key.endswith("[stacks=None]") else "")
            t.add(f"N={cap:,}: added: {key}", r["added_us"], "µs", note)
        for key, r in rows.items():
            if r.get("paired_added_us") is not None:
                t.add(f"N={cap:,}: added, hooks on/off alternating: {key}",
                      r["paired_added_us"], "µs", "the recording path alone, ring kept")
        for key, r in rows.items():
            t.add(f"N={cap:,}: memory per entry: {key}", r["bytes_per_entry"], "B",
                  "process RSS growth / N")
        for key, r in rows.items():
            t.add(f"N={cap:,}: full gc.collect(): {key}", r["gc_collect_ms"], "ms")
        ours = rows.get("cudalab [stacks=python]")
        theirs = rows.get("torch [stacks=python]")
        if ours and theirs:
            t.add(f"N={cap:,}: ratio cudalab / torch added [stacks=python]",
                  ours["added_us"] / theirs["added_us"] if theirs["added_us"] else None, "×",
                  "bound <= 0.5")
            t.add(f"N={cap:,}: ratio cudalab / torch memory per entry [stacks=python]",
                  ours["bytes_per_entry"] / theirs["bytes_per_entry"]
                  if theirs["bytes_per_entry"] else None, "×", "bound <= 1")
    return t


def snapshot_time(blocks: int, repeat: int, sim: bool) -> dict:
    import cudalab
    import cudalab.memory as cm

    torch = None if sim else optional_import("torch")
    out = {}
    live = [cudalab.empty(1024 + 512 * (i % 7), dtype="uint8") for i in range(blocks)]
    fns = {"cudalab memory_snapshot()": cm.memory_snapshot,
           "cudalab _snapshot() (with history off)": cm._snapshot}
    tl = None
    if torch is not None and torch.cuda.is_available():
        tl = [torch.empty(1024 + 512 * (i % 7), dtype=torch.uint8, device="cuda")
              for i in range(blocks)]
        fns["torch memory_snapshot()"] = torch.cuda.memory_snapshot
    # alternated call by call, so both live sets exist throughout and drift cancels
    samples: dict = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            samples[k].append(_median_time(fn, 1))
    for k, v in samples.items():
        out[k] = statistics.median(v) * 1e3
    del live, tl
    return out


def replay_rate(entries: int, repeat: int) -> dict:
    from cudalab.memory_tools.replay import replay
    from cudalab.memory_tools.synthetic import synthetic_snapshot

    snap = synthetic_snapshot(entries, oom_every=10**9, snapshot_every=10**9)
    n = sum(len(t) for t in snap["device_traces"])
    out = {}
    for conf in (None, "expandable_segments:True"):
        t = _median_time(lambda c=conf: replay(snap, c), repeat)
        out[f"replay {conf or 'default'}"] = n / t
    return out


PURE = "stacks=python, pure-Python stamp"
_PLACES = {"script": "script, 4 frames deep", "deep": "script, 26 frames deep",
           "cell": "notebook cell (IPython)"}


def _history_table(res: dict, where: str, stamp: str) -> Table:
    t = Table(f"History cost per alloc+free pair ({where})")
    h = dict(res)
    write_out = h.pop("write_out_per_pair_us")
    added = h.pop("added")
    for mode, row in h.items():
        for k, v in row.items():
            t.add(f"{k} [{mode}]", v)
    ours_modes = [m for m in ("stacks=None", "stacks=python", PURE) if m in added]
    for k in ("cudalab caching_allocator_alloc+delete", "cudalab empty+drop", FUNC):
        for mode in ours_modes:
            t.add(f"added: {k} [{mode}]", added[mode][k], "µs",
                  "median of per-round differences" + ("; bound <= 0.3" if mode == "stacks=None"
                                                       else ""))
    t.add("stacks=None: writing out the pairs logged as times", write_out, "µs",
          "per pair, once, when the history is read or stopped (not in the rows above)")
    for mode, note in (("stacks=python", "bound <= 0.5"),
                       ("stacks=all", "torch's default; cudalab's 'all' is its Python stacks")):
        theirs = added.get(mode, {}).get("torch.empty+drop")
        if theirs is None:
            continue
        t.add(f"added: torch.empty+drop [{mode}]", theirs)
        for ours_mode, label in (("stacks=python", f"python, {stamp} stamp"),
                                 (PURE, "python, pure-Python stamp")):
            if ours_mode in added:
                ours = added[ours_mode]["cudalab empty+drop"]
                t.add(f"ratio cudalab empty+drop [{label}] / torch [{mode}] added",
                      ours / theirs if theirs else None, "×", note)
    theirs = added.get("stacks=python", {}).get(TORCH_FUNC)
    if theirs is not None:
        t.add(f"added: {TORCH_FUNC} [stacks=python]", theirs)
        for ours_mode, label in (("stacks=python", f"python, {stamp} stamp"),
                                 (PURE, "python, pure-Python stamp")):
            if ours_mode in added:
                ours = added[ours_mode][FUNC]
                t.add(f"ratio {FUNC} [{label}] / torch [stacks=python] added",
                      ours / theirs if theirs else None, "×", "bound <= 0.5")
    return t


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import cudalab

    cudalab.init()
    sim = cudalab.devices.backend().simulated
    n, rounds = (2000, 5) if args.quick else (20000, 15)
    from cudalab.memory_tools import stacks

    res = {"env": environment(cudalab.devices.backend().name, cudalab.get_device_name())}
    res["env"]["stamp"] = stamp = stacks.stamp_implementation()
    res["history"] = {w: history_cost(n, rounds, sim, w) for w in _PLACES}
    sizes = (10_000, 100_000) if args.quick else (100_000, 1_000_000)
    res["steady"] = history_steady(sizes, 10 * n, rounds if args.quick else 7, sim)
    res["snapshot_ms"] = snapshot_time(2000, 5 if args.quick else 21, sim)
    res["replay_entries_per_s"] = replay_rate(20_000 if args.quick else 200_000, 3)

    for where, h in res["history"].items():
        if h is not None:
            print(_history_table(h, f"{_PLACES[where]}, {res['env']['device']}, {stamp} stamp",
                                 stamp).render())
    print(_steady_table(res["steady"], res["env"]["device"]).render())
    t = Table("memory_snapshot() with 2000 live blocks")
    for k, v in res["snapshot_ms"].items():
        t.add(k, v, "ms")
    print(t.render())
    t = Table("Replay throughput")
    for k, v in res["replay_entries_per_s"].items():
        t.add(k, v / 1e3, "k entries/s", "bound >= 200")
    print(t.render())
    write_json(args.json, res)


if __name__ == "__main__":
    main()
