"""Export benchmark: DataFrames and Perfetto JSON from a 1M-entry history.

A self-consistent torch-schema snapshot with N trace entries is generated
(``cudalab.memory_tools.synthetic.synthetic_snapshot``: random alloc/free on two streams, segments,
OOMs and snapshots, cudalab's extra keys) and exported; next to each export, the naive way
it replaces:

* ``history_frame``  vs ``pd.DataFrame(list_of_entry_dicts)`` (which gives neither the top
  frame, the categorical action nor the running totals);
* ``export_perfetto`` (f-string events written in chunks) vs the same events built as dicts
  and written with ``json.dumps`` per event;
* ``snapshot_frame`` / ``segments_frame`` on the generated final state;
* live: N entries recorded by cudalab's recorder on the simulator (alloc/free pairs), then
  ``history_frame()`` / ``export_perfetto(path)`` reading the recorder directly, next to
  ``history_frame(cudalab.memory._snapshot())`` (snapshot dict first).

Times are wall-clock medians; the note gives the process CPU time too (the two differ when
the machine is shared).

    python benchmarks/export.py [--entries 1000000] [--no-live] [--json out.json] [--quick]

The target: 1M history entries to a DataFrame in <= 2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import Table, environment, write_json  # noqa: E402

_CPU: dict[float, float] = {}


def _time(fn, repeat: int) -> float:
    """Median wall seconds of ``fn()`` over ``repeat`` runs (median CPU seconds kept in
    ``_CPU[result]`` for the table's note)."""
    wall, cpu = [], []
    for _ in range(repeat):
        c0 = time.process_time()
        t0 = time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    w = statistics.median(wall)
    _CPU[w] = statistics.median(cpu)
    return w


def _cpu(w: float) -> str:
    return f"cpu {_CPU.get(w, float('nan')):.2f} s"


def _live(n: int, rep: int, table: Table, results: dict) -> None:
    """Record ``n`` entries with cudalab's recorder on the simulator and export them."""
    os.environ.setdefault("CUDALAB_SIMULATOR", "1")
    import cudalab
    import cudalab.memory as cm
    from cudalab.memory_tools import export as ex
    from cudalab.memory_tools import perfetto as pf

    if not hasattr(cm, "_record_memory_history"):
        table.add("live recorder", None, "s", "not in this build")
        return
    cudalab.init()
    cm._record_memory_history("all", max_entries=n)
    alloc, free = cm.caching_allocator_alloc, cm.caching_allocator_delete
    t0 = time.perf_counter()
    for i in range(n // 3 + 1):  # alloc + free_requested + free_completed per pair
        free(alloc(1000 + (i % 7) * 512))
    t_rec = time.perf_counter() - t0
    table.add("live: record alloc/free pairs (setup)", t_rec, "s", f"{n} entries, stacks on")
    s_h = _time(lambda: ex.history_frame(), rep)
    table.add("live: history_frame() (recorder read directly)", s_h, "s", _cpu(s_h))
    s_p = _time(lambda: pf.export_perfetto(os.path.join(tempfile.gettempdir(),
                                                        f"cudalab_live_{os.getpid()}.json")), 1)
    os.unlink(os.path.join(tempfile.gettempdir(), f"cudalab_live_{os.getpid()}.json"))
    table.add("live: export_perfetto(path)", s_p, "s", _cpu(s_p) + ", one run")
    snap: dict = {}
    s_snap = _time(lambda: snap.update(cm._snapshot()), 1)
    table.add("live: cudalab.memory._snapshot()", s_snap, "s", _cpu(s_snap) + ", one run")
    s_hs = _time(lambda: ex.history_frame(snap), rep)
    table.add("live: history_frame(_snapshot() dict)", s_hs, "s", _cpu(s_hs))
    cm._record_memory_history(None)
    results.update(live_record_s=t_rec, live_history_frame_s=s_h, live_perfetto_s=s_p,
                   live_snapshot_s=s_snap, live_history_frame_of_snapshot_s=s_hs)


def _perfetto_json_dumps(path: str, snap: dict) -> None:
    """The baseline: the same X/C events built as dicts, ``json.dumps`` one by one."""
    from cudalab._units import format_bytes
    from cudalab.memory_tools import perfetto as pf
    from cudalab.memory_tools.trace_columns import TraceColumns

    t = TraceColumns(snap, extras=False)
    t0 = int(t.time_us.min())
    t_end = int(t.time_us.max()) - t0
    with open(path, "w") as f:
        f.write('{"displayTimeUnit":"ms","traceEvents":[\n')
        first = True
        for d, a, b in t.bounds:
            pid = d + 1
            for i in range(a, b):
                ev = {"ph": "C", "name": "memory", "pid": pid, "tid": pid,
                      "ts": int(t.time_us[i]) - t0,
                      "args": {"allocated": int(t.allocated[i]), "reserved": int(t.reserved[i])}}
                f.write(("" if first else ",\n") + json.dumps(ev))
                first = False
            start, end, idx, _pre = pf._block_lifetimes(t, a, b, t0, t_end)
            for s0, e0, i in zip(start.tolist(), end.tolist(), idx.tolist()):
                top = t.top[i]
                ev = {"ph": "X", "name": format_bytes(int(t.size[i])), "cat": "block", "pid": pid,
                      "tid": 100, "ts": s0, "dur": e0 - s0,
                      "args": {"addr": hex(int(t.addr[i])), "size": int(t.size[i]),
                               "stream": int(t.stream[i]),
                               "frame": "" if top is None else
                               f"{top['filename']}:{top['line']} {top['name']}"}}
                f.write(",\n" + json.dumps(ev))
        f.write("\n]}\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", type=int, default=1_000_000, help="trace entries (default 1M)")
    p.add_argument("--repeat", type=int, default=3, help="runs per measurement (median)")
    p.add_argument("--json", default=None, help="write results as JSON to this path")
    p.add_argument("--quick", action="store_true", help="100k entries, one run each")
    p.add_argument("--no-live", action="store_true", help="skip the live-recorder rows")
    args = p.parse_args()
    n = 100_000 if args.quick else args.entries
    rep = 1 if args.quick else args.repeat

    import pandas as pd

    from cudalab.memory_tools import export as ex
    from cudalab.memory_tools import perfetto as pf
    from cudalab.memory_tools.synthetic import synthetic_snapshot

    t0 = time.perf_counter()
    snap = synthetic_snapshot(n)
    t_gen = time.perf_counter() - t0
    entries = snap["device_traces"][0]
    n_seg = len(snap["segments"])
    n_blk = sum(len(s["blocks"]) for s in snap["segments"])

    label = f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n // 1000}k"
    table = Table(f"cudalab memory exports, {label} trace entries "
                  f"({n_seg} segments, {n_blk} blocks at the end), median of {rep}")
    results: dict = {"entries": n, "segments": n_seg, "blocks": n_blk, "repeat": rep}

    table.add("generate synthetic snapshot (setup)", t_gen, "s", "not an export")
    s_hist = _time(lambda: ex.history_frame(snap), rep)
    table.add("history_frame", s_hist, "s",
              f"{_cpu(s_hist)}; {n / s_hist / 1e6:.2f} M entries/s; bound 2 s per 1M")
    s_naive = _time(lambda: pd.DataFrame(entries), rep)
    table.add("  baseline: pd.DataFrame(list of dicts)", s_naive, "s",
              f"{_cpu(s_naive)}; raw columns only")
    results.update(history_frame_s=s_hist, dataframe_of_dicts_s=s_naive)

    with tempfile.TemporaryDirectory() as tmp:
        pj = os.path.join(tmp, "t.json")
        s_pf = _time(lambda: pf.export_perfetto(pj, snap), rep)
        size_mb = os.path.getsize(pj) / 1e6
        with open(pj) as f:
            n_ev = sum(1 for line in f if line.startswith("{\"ph\""))
        table.add("export_perfetto (.json)", s_pf, "s",
                  f"{_cpu(s_pf)}; {n_ev} events, {size_mb:.0f} MB")
        pg = os.path.join(tmp, "t.json.gz")
        s_gz = _time(lambda: pf.export_perfetto(pg, snap), rep)
        table.add("export_perfetto (.json.gz)", s_gz, "s",
                  f"{_cpu(s_gz)}; {os.path.getsize(pg) / 1e6:.0f} MB")
        pb = os.path.join(tmp, "b.json")
        s_base = _time(lambda: _perfetto_json_dumps(pb, snap), 1)
        table.add("  baseline: dict events + json.dumps each", s_base, "s",
                  f"{_cpu(s_base)}; counter per entry, one run")
        results.update(perfetto_s=s_pf, perfetto_gz_s=s_gz, perfetto_json_dumps_s=s_base,
                       perfetto_events=n_ev, perfetto_mb=size_mb)

    s_blk = _time(lambda: ex.snapshot_frame(snap), rep)
    s_seg = _time(lambda: ex.segments_frame(snap), rep)
    table.add("snapshot_frame", s_blk, "s", f"{n_blk} blocks")
    table.add("segments_frame", s_seg, "s", f"{n_seg} segments")
    results.update(snapshot_frame_s=s_blk, segments_frame_s=s_seg)
    snap = entries = None  # free the synthetic history before recording a live one
    if not args.no_live:
        _live(n, rep, table, results)

    print(table.render())
    write_json(args.json, {"environment": environment("none (pure host code)", f"{os.cpu_count()} CPUs"),
                           "results": results, "table": table.rows})


if __name__ == "__main__":
    main()
