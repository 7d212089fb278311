"""Explorer benchmark: a gigabyte trace opened, a moment in time, the diff of two runs.

A torch-format trace of N entries is written by
``cudalab.memory_tools.synthetic.write_synthetic_pickle`` (a new frames list per entry, as
torch's pickles; cudalab's cell/NVTX keys), then, each in a fresh child process so its peak
RSS is its own:

* ``open_trace`` (the C reader): first paint (the first partial index and a 2,000-bin
  timeline tile of it), the whole index (read + block lifetimes + running totals, i.e.
  ``TraceViews``), peak RSS against the file size;
* baselines: ``load_snapshot`` (cudalab's bounded restricted unpickler, dicts per entry) and
  ``pickle.load`` (what torch's tools do: unbounded and unsafe), at N <= 3M only (their
  memory grows ~650 B per entry);
* the live set at the peak (``live_at``), the segment map then, search by frame text,
  address and size range, and the bytes of one timeline tile as JSON (what a view sends);
* ``cudalab.memory.diff`` of two traces of N/2 entries (different seeds), reading included
  and with both indexes ready.

    python benchmarks/explorer.py [--entries 1000000] [--json out.json] [--quick]

Targets at 10M entries (~1 GB): first paint <= 3 s, whole index <= 20 s, RSS <= 3x the
file, live set <= 500 ms, diff of two 5M traces <= 5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import Table, environment, write_json  # noqa: E402


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child(mode: str, path: str, other: str | None) -> dict:
    """One measurement in this (fresh) process; returns what it measured."""
    import numpy as np

    from cudalab.memory_tools.trace_index import open_trace
    from cudalab.memory_tools.trace_views import TraceViews

    base = _rss()
    out: dict = {"rss_base": base}
    c0 = time.process_time()
    t0 = time.perf_counter()
    if mode == "open":
        first: dict = {}

        def progress(ix):
            if not first:
                views = TraceViews(ix)
                _, a, b = views.device_range()
                views.tile(a, b, 2000)
                first["s"] = time.perf_counter() - t0
                first["rows"] = ix.n

        ix = open_trace(path, on_progress=progress)
        out["read_s"] = time.perf_counter() - t0
        out["read_cpu_s"] = time.process_time() - c0
        views = TraceViews(ix)
        out["index_s"] = time.perf_counter() - t0
        out["index_cpu_s"] = time.process_time() - c0
        out["first_paint_s"], out["first_rows"] = first["s"], first["rows"]
        out["rows"], out["stacks"], out["frames"] = ix.n, ix.n_stacks, len(ix.frames)
        out["rss"] = _rss()
        d, a, b = views.device_range()
        peak = a + int(np.argmax(views.allocated[a:b]))
        rows = [peak, a + (b - a) // 3, a + 2 * (b - a) // 3, b - 1]
        times = []
        for r in rows:
            t = time.perf_counter()
            live = views.live_at(r)
            times.append(time.perf_counter() - t)
        out["live_s"] = statistics.median(times)
        out["live_max_s"] = max(times)
        out["live_blocks"] = live.n_blocks
        t = time.perf_counter()
        segs = views.segment_map_at(peak)
        out["segment_map_s"] = time.perf_counter() - t
        out["segments"] = len(segs)
        t = time.perf_counter()
        found = views.search("model.py:")
        out["search_text_s"], out["search_text_hits"] = time.perf_counter() - t, found.count
        t = time.perf_counter()
        found = views.search(address=int(views.block_addr[len(views.block_addr) // 2]) + 8)
        out["search_addr_s"], out["search_addr_hits"] = time.perf_counter() - t, found.count
        t = time.perf_counter()
        found = views.search(size_range=(1 << 20, 4 << 20))
        out["search_size_s"], out["search_size_hits"] = time.perf_counter() - t, found.count
        t = time.perf_counter()
        tile = views.tile(a, b, 2000)
        out["tile_s"] = time.perf_counter() - t
        out["tile_bytes"] = len(json.dumps(tile))
    elif mode == "load_snapshot":
        from cudalab.memory_tools.trace_io import load_snapshot

        snap = load_snapshot(path)
        out["read_s"] = time.perf_counter() - t0
        out["rows"] = sum(len(t) for t in snap["device_traces"])
        out["rss"] = _rss()
    elif mode == "pickle":
        import pickle

        with open(path, "rb") as f:
            snap = pickle.load(f)  # noqa: S301 - the baseline: what torch's tools do
        out["read_s"] = time.perf_counter() - t0
        out["rss"] = _rss()
    elif mode == "diff":
        from cudalab.memory_tools.trace_diff import diff

        assert other is not None
        result = diff(path, other)
        out["diff_s"] = time.perf_counter() - t0
        if not os.environ.get("EXPLORER_BENCH_NO_SERIAL"):
            t = time.perf_counter()
            diff(path, other, parallel=False)
            out["diff_serial_s"] = time.perf_counter() - t
        a_ix, b_ix = open_trace(path), open_trace(other)
        va, vb = TraceViews(a_ix), TraceViews(b_ix)
        t = time.perf_counter()
        result = diff(va, vb)
        out["diff_ready_s"] = time.perf_counter() - t
        out["lines"] = len(result.allocated_lines)
        out["rows_a"], out["rows_b"] = a_ix.n, b_ix.n
        out["rss"] = _rss()
    return out


def _run_child(mode: str, path: str, other: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, path] + ([other] if other else [])
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", type=int, default=1_000_000)
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="100k entries")
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--no-diff", action="store_true")
    p.add_argument("--no-serial-diff", action="store_true",
                   help="skip the diff that reads the two files one after the other")
    p.add_argument("--dir", default=None, help="where the trace files go (default: a temp dir)")
    p.add_argument("--trace", default=None,
                   help="a trace of --entries entries written already (write_synthetic_pickle)")
    p.add_argument("--diff-files", nargs=2, default=None,
                   help="two trace files written already, for the diff")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        mode, path, *rest = args.child
        print(json.dumps(_child(mode, path, rest[0] if rest else None)))
        return
    from cudalab.memory_tools.synthetic import write_synthetic_pickle
    from cudalab.memory_tools.trace_index import scanner_available

    n = 100_000 if args.quick else args.entries
    label = f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n // 1000}k"
    table = Table(f"cudalab explorer, {label}-entry torch-format trace, one process per row "
                  f"({os.cpu_count()} CPUs; C reader: {scanner_available()})")
    results: dict = {"entries": n}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = args.trace or os.path.join(tmp, "trace.pickle")
        t = time.perf_counter()
        if args.trace:
            size = os.path.getsize(path)
        else:
            size = write_synthetic_pickle(path, n, seed=0)
            table.add("write the synthetic trace (setup)", time.perf_counter() - t, "s",
                      f"{size / 1e6:.0f} MB, {size / n:.0f} B/entry")
        results["file_bytes"] = size
        got = _run_child("open", path)
        results["open"] = got
        if "error" in got:
            table.add("open_trace", None, "s", got["error"])
        else:
            mb = size / 1e6
            table.add("first paint (partial index + 2,000-bin tile)", got["first_paint_s"], "s",
                      f"{got['first_rows']:,} rows; target <= 3 s at 10M")
            table.add("read (open_trace)", got["read_s"], "s",
                      f"CPU {got['read_cpu_s']:.1f} s; {mb / got['read_s']:.0f} MB/s; "
                      f"{got['rows']:,} rows, {got['stacks']:,} stacks, {got['frames']:,} frames")
            table.add("whole index (read + lifetimes + totals)", got["index_s"], "s",
                      f"CPU {got['index_cpu_s']:.1f} s; target <= 20 s at 10M")
            table.add("peak RSS", got["rss"] / 1e6, "MB",
                      f"{got['rss'] / size:.2f}x the file (target <= 3x); "
                      f"{got['rss_base'] / 1e6:.0f} MB before reading")
            table.add("live set at a moment (median of 4)", got["live_s"] * 1e3, "ms",
                      f"max {got['live_max_s'] * 1e3:.0f} ms; {got['live_blocks']:,} blocks; "
                      "target <= 500 ms at 10M")
            table.add("segment map at the peak", got["segment_map_s"] * 1e3, "ms",
                      f"{got['segments']} segments")
            table.add("search: frame text", got["search_text_s"] * 1e3, "ms",
                      f"{got['search_text_hits']:,} hits")
            table.add("search: address", got["search_addr_s"] * 1e3, "ms",
                      f"{got['search_addr_hits']:,} hits")
            table.add("search: size range", got["search_size_s"] * 1e3, "ms",
                      f"{got['search_size_hits']:,} hits")
            table.add("timeline tile, 2,000 bins", got["tile_s"] * 1e3, "ms",
                      f"{got['tile_bytes'] / 1e3:.0f} kB as JSON (budget 5 MB per view)")
        if not args.no_baselines and n <= 3_000_000:
            for mode, what in (("load_snapshot", "baseline: load_snapshot (dicts, bounded)"),
                               ("pickle", "baseline: pickle.load (torch's way, unsafe)")):
                got = _run_child(mode, path)
                results[mode] = got
                if "error" in got:
                    table.add(what, None, "s", got["error"])
                else:
                    table.add(what, got["read_s"], "s",
                              f"RSS {got['rss'] / 1e6:.0f} MB ({got['rss'] / size:.1f}x)")
        if args.no_serial_diff:
            os.environ["EXPLORER_BENCH_NO_SERIAL"] = "1"  # (read by the child)
        if not args.no_diff:
            half = max(1000, n // 2)
            if args.diff_files:
                pa, pb = args.diff_files
            else:
                pa, pb = os.path.join(tmp, "a.pickle"), os.path.join(tmp, "b.pickle")
                if not args.trace:
                    os.remove(path)
                write_synthetic_pickle(pa, half, seed=1)
                write_synthetic_pickle(pb, half, seed=2)
            got = _run_child("diff", pa, pb)
            results["diff"] = got
            if "error" in got:
                table.add("diff", None, "s", got["error"])
            else:
                table.add(f"diff of {got['rows_a']:,} and {got['rows_b']:,}-entry "
                          "traces, reading included",
                          got["diff_s"], "s", "both read at once in two worker processes; "
                          "target <= 5 s for two 5M traces")
                if "diff_serial_s" in got:
                    table.add("  the same, read one after the other", got["diff_serial_s"],
                              "s", "parallel=False")
                table.add("  the same, indexes ready", got["diff_ready_s"], "s",
                          f"{got['lines']} lines")
    print(table.render())
    write_json(args.json, {"environment": environment("none (pure host code)",
                                                      f"{os.cpu_count()} CPUs"),
                           "results": results, "table": table.rows})


if __name__ == "__main__":
    main()
