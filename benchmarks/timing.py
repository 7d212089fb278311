"""IPython extension benchmark: the cost and accuracy of %%cuda_timed and the watch.

    python benchmarks/timing.py [--json out.json] [--quick]

Rows (next to cupyx.profiler.benchmark and torch CUDA events when they are importable):

**Per-repeat overhead** of ``%cuda_timed -n 1 -w 0 -r R pass`` (an empty body), from the
difference between two repeat counts so fixed costs cancel; the same end to end as a
user's cell runs (``InteractiveShell.run_cell`` of ``%%cuda_timed -n 1 -w 0 -r R`` over
``pass``: IPython's input transforms and the cell magic's dispatch included); the same for
``cupyx.profiler.benchmark(lambda: None, n_repeat=R)``. Target: <= 1/3 of cupyx's. With no
setup statement and no ``--cold``, repeat j runs from boundary event j to boundary event
j + 1, so a repeat costs one ``cuEventRecord`` and, after the run's single sync, one
``cuEventElapsedTime``; with a setup statement (also shown) a repeat has its own start
event, two records. The driver calls per repeat are counted at the end of the run (the
backend wrapped by counters, untimed).

**A ~1 ms kernel, like with like.** Each tool times the same kernel: a ``%globaltimer``
spin of 1 ms that also writes its own first and last ``%globaltimer`` reading to a buffer,
so every launch's own duration is known (the "kernel's own time" row, the reference every
tool is compared with). An event pair measures from the moment the GPU reaches the start
event to the moment it reaches the end event, so the result depends on what the GPU was
doing when the start event was recorded:

* *GPU kept busy* — ``%%cuda_timed`` by design: repeats are queued back to back (two in
  flight, more for repeats shorter than the GPU's latency), so each boundary event fires
  when the previous kernel ends and the next kernel is already waiting. It measures the
  kernel plus the GPU's own launch cost (a few µs). The torch loop is run the same way
  too, with a 200 µs spin queued before each start event (the host has launched the
  kernel before the spin ends, even on a slow host where torch's record and the launch
  take tens of µs).
* *idle GPU at the start event* — ``cupyx.profiler.benchmark`` and the usual torch loop
  (``a.record(); f(); b.record(); b.synchronize()``) sync the host after every repeat, so
  the start event fires at once on an idle GPU, and the time also holds the host's path from
  the record to the launch plus the launch's trip to the GPU (on an H100 host about
  7 µs for the torch loop and 17 µs for cupyx: 0.7-1.7 % of 1 ms).
  ``%%cuda_timed`` is put in the same regime by a ``cudalab.synchronize()`` setup statement
  (setup runs before every repeat, untimed), without changing how it measures.

The table gives each median, its excess over the kernel's own time, and the differences
between tools measured in the same regime (target: within 1 %), then the cross-regime
differences that were first quoted (ours against the idle-start tools), which hold the
launch gap and are not a like-with-like comparison. cupyx cannot be run with a busy GPU
(its start event is recorded inside ``benchmark`` right after its own sync), so it is only
compared in the idle regime; its host path from the start event to the launch is longer
than the torch loop's (after the record it restores the current device with a
``cudaSetDevice`` call, reads the clock, then calls the function), which is why it read
higher than torch in earlier H100 runs.

**Watch cost per cell**: the ``pre_run_cell`` + ``post_run_cell`` hooks of ``%cuda_memory
watch on`` called directly (the default threshold 0 prints one line per cell, into a
buffer here; with a threshold nothing is printed, waited for or read below it), and
``run_cell("pass")`` with and without the watch, in paired rounds (median of the per-round
differences): cudalab's line alone (``--source cudalab``; target: <= 50 µs), and the default
``auto``, which adds torch's line while torch holds CUDA (as it does on a GPU host here, after
the torch rows) and CuPy's while its pool holds memory. torch's line reads torch's counters
(``torch.cuda.memory_stats_as_nested_dict``) before and after every cell; that call's own
time is a row beside it.

**``%load_ext cudalab``** in a fresh interpreter (IPython already imported). Target: <= 300 ms.

On the simulator only cudalab's rows mean anything (the table says "simulated"; simulated
kernels sleep on the host, and events read the host clock).
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout works uninstalled
from _harness import Table, environment, optional_import, parse_args, write_json  # noqa: E402

MS = 1_000_000  # ns


class StampedSpin:
    """A 1 ms spin per call, each launch recording its own duration in a device buffer."""

    def __init__(self, slots: int):
        import cudalab
        from cudalab._kernels.spin import spin_stamped

        self.kernel = spin_stamped
        self.buf = cudalab.zeros((2 * slots,), dtype="uint64")
        self.ptr = self.buf.__cuda_array_interface__["data"][0]
        self.slots = slots
        self.next = 0
        launch, ptr, state = self.kernel.launch, self.ptr, self

        def call() -> None:
            i = state.next
            state.next = i + 1
            launch(1, 1, (MS, ptr, i))

        self.call = call

    def durations(self, first: int, last: int) -> list[float]:
        """Own durations (seconds) of launches ``first`` .. ``last - 1``."""
        import cudalab

        if last > self.slots:
            raise RuntimeError("stamp buffer too small")
        cudalab.synchronize()
        st = self.buf.numpy()[2 * first:2 * last].reshape(-1, 2)
        return [(int(b) - int(a)) / 1e9 for a, b in st]


def load_ext_seconds(runs: int) -> float | None:
    """Median seconds of ``%load_ext cudalab`` in a fresh interpreter (first run discarded)."""
    code = ("from IPython.core.interactiveshell import InteractiveShell\n"
            "ip = InteractiveShell.instance()\nimport time\nt = time.perf_counter()\n"
            "ip.run_line_magic('load_ext', 'cudalab')\nprint(time.perf_counter() - t)")
    out = []
    for i in range(runs + 1):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=os.environ.copy())
        if r.returncode != 0:
            return None
        if i:
            out.append(float(r.stdout.strip().splitlines()[-1]))
    return statistics.median(out)


def per_repeat_overhead(run_with_repeats, r1: int, r2: int, rounds: int) -> float:
    """Seconds per extra repeat: median over rounds of (T(r2) - T(r1)) / (r2 - r1)."""
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        run_with_repeats(r1)
        t1 = time.perf_counter()
        run_with_repeats(r2)
        t2 = time.perf_counter()
        samples.append(((t2 - t1) - (t1 - t0)) / (r2 - r1))
    return statistics.median(samples)


def count_driver_calls(ip, lines: dict[str, str], r1: int = 100, r2: int = 600) -> dict:
    """Driver calls per repeat of each ``%cuda_timed`` line (a format string with {r}),
    from the difference between two repeat counts: the backend's methods and the event
    fast paths are wrapped by counters for the duration (untimed)."""
    from cudalab.testing import count_calls

    out = {}
    magics = ip.magics_manager.registry["CudaLabMagics"]
    magics._event_pool = None  # events bind the fast paths when made: count with new ones
    try:
        with count_calls() as counts:
            for label, fmt in lines.items():
                ip.run_cell(fmt.format(r=r2), store_history=False)  # the pool holds the events
                totals = []
                for r in (r1, r2):
                    counts.clear()
                    ip.run_cell(fmt.format(r=r), store_history=False)
                    totals.append(dict(counts))
                keys = set(totals[0]) | set(totals[1])
                out[label] = {k: (totals[1].get(k, 0) - totals[0].get(k, 0)) / (r2 - r1)
                              for k in sorted(keys)}
    finally:
        magics._event_pool = None
    return out


def main() -> None:
    args = parse_args(__doc__)
    quick = args.quick
    from IPython.core.interactiveshell import InteractiveShell

    import cudalab
    from cudalab import _internal
    from cudalab._kernels.spin import gpu_sleep

    cudalab.init()
    backend = _internal.backend()
    name = cudalab.get_device_name(0)
    sim = backend.simulated
    t = Table(f"cudalab %%cuda_timed / watch benchmark — {name} ({backend.name})"
              + (" [simulated: only cudalab's rows mean anything]" if sim else ""))
    results: dict = {"env": environment(backend.name, name), "us": {}, "pct": {}, "ms": {},
                     "calls_per_repeat": {}}

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "cudalab")
    ip.user_ns["gpu_sleep"] = gpu_sleep
    ip.user_ns["cudalab"] = cudalab
    magics = ip.magics_manager.registry["CudaLabMagics"]
    magics.nvml = False  # fixed per-call costs cancel anyway; keep the rounds short

    cupyx_profiler = optional_import("cupyx.profiler")
    torch = optional_import("torch")
    if torch is not None and not (hasattr(torch, "cuda") and torch.cuda.is_available()):
        torch = None
    if sim:
        cupyx_profiler = torch = None

    def put(key, seconds, note=""):
        us = None if seconds is None else seconds * 1e6
        results["us"][key] = us
        t.add(key, us, "µs", note)

    def pct(key, value, note=""):
        results["pct"][key] = value
        t.add(key, value, "%", note)

    # ------------------------------------------------------------ per-repeat overhead
    r1, r2 = (50, 550) if quick else (200, 4200)
    rounds = 3 if quick else 7

    def ours(r):
        ip.run_line_magic("cuda_timed", f"-q -n 1 -w 0 -r {r} pass")

    def ours_setup(r):
        ip.run_cell_magic("cuda_timed", f"-q -n 1 -w 0 -r {r} _x = 0", "pass")

    ours_o = per_repeat_overhead(ours, r1, r2, rounds)
    put("%cuda_timed per-repeat overhead (empty body)", ours_o,
        "shared boundaries: 1 record + 1 elapsed_time per repeat")
    put("  the same with a setup statement", per_repeat_overhead(ours_setup, r1, r2, rounds),
        "split: 2 records + 1 elapsed_time per repeat")

    def ours_cell(r):  # as a user's cell runs: IPython's run_cell, its transforms, the magic
        ip.run_cell(f"%%cuda_timed -q -n 1 -w 0 -r {r}\npass", store_history=False)

    ours_cell(r1)  # (the pool holds the events)
    cell_o = per_repeat_overhead(ours_cell, r1, r2, rounds)
    put("%%cuda_timed per-repeat overhead, a cell through run_cell (empty body)", cell_o,
        "end to end, as a user's cell runs")
    if cupyx_profiler is not None:
        def cupy_run(r):
            cupyx_profiler.benchmark(lambda: None, n_repeat=r, n_warmup=0)

        cupy_o = per_repeat_overhead(cupy_run, r1, r2, rounds)
        put("cupyx.profiler.benchmark per-repeat overhead", cupy_o,
            "2 records + sync + elapsed_time per repeat")
        ratio = ours_o / cupy_o if cupy_o else None
        results["pct"]["overhead ratio ours/cupyx"] = None if ratio is None else ratio * 100
        t.add("overhead ratio ours / cupyx", ratio, "x", "target <= 0.333")
        cell_ratio = cell_o / cupy_o if cupy_o else None
        results["pct"]["overhead ratio ours (run_cell)/cupyx"] = (
            None if cell_ratio is None else cell_ratio * 100)
        t.add("overhead ratio ours (a cell through run_cell) / cupyx", cell_ratio, "x",
              "target <= 0.333")
    else:
        put("cupyx.profiler.benchmark per-repeat overhead", None, "cupy not installed" if not sim
            else "skipped on the simulator")

    # ------------------------------------------------------------ ~1 ms kernel, like with like
    reps = 30 if quick else 200
    reps10 = max(10, reps // 10)
    spin = StampedSpin(slots=8 * (reps + 20) + 10 * reps10 + 64)
    stamped = spin.call
    ip.user_ns["stamped_"] = stamped
    for _ in range(3):
        stamped()  # compile, load
    cudalab.synchronize()
    own: list[float] = []
    meds: dict[str, float] = {}

    def measured(key, fn):
        """Run ``fn`` (returns the tool's median, s); keep the own times of its launches."""
        first = spin.next
        med = fn()
        own.extend(spin.durations(first, spin.next))
        meds[key] = med
        return med

    ours_busy = measured("ours", lambda: ip.run_line_magic(
        "cuda_timed", f"-o -q -n 1 -w 5 -r {reps} stamped_()").median)
    ours_busy10 = measured("ours10", lambda: ip.run_line_magic(
        "cuda_timed", f"-o -q -n 10 -w 1 -r {reps10} stamped_()").median)
    ours_idle = measured("ours_idle", lambda: ip.run_cell_magic(
        "cuda_timed", f"-o -q -n 1 -w 5 -r {reps} cudalab.synchronize()", "stamped_()").median)

    torch_busy = torch_idle = cupy_idle = None
    if torch is not None:
        def torch_loop(busy: bool) -> float:
            times = []
            torch.cuda.synchronize()
            for _ in range(5):
                stamped()
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if busy:
                    gpu_sleep(200_000)  # the start event fires when this ends: kernel queued
                a.record()
                stamped()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            return statistics.median(times)

        torch_idle = measured("torch_idle", lambda: torch_loop(False))
        torch_busy = measured("torch_busy", lambda: torch_loop(True))
    if cupyx_profiler is not None:
        import numpy as np

        cupy_idle = measured("cupyx", lambda: float(np.median(cupyx_profiler.benchmark(
            stamped, n_repeat=reps, n_warmup=5).gpu_times[0])))

    own_med = statistics.median(own)
    put("kernel's own time (%globaltimer in the kernel)", own_med,
        f"median of {len(own)} launches, all runs below")

    def row(label, med, note=""):
        if med is None:
            put(label, None, "skipped on the simulator" if sim else "not installed")
            return
        ex = med - own_med
        put(label, med, f"{ex * 1e6:+.1f} µs ({ex / own_med * 100:+.2f} %) over the kernel"
            + (f"; {note}" if note else ""))

    # busy: the start event is behind queued work; idle: a host sync before every repeat
    row("[busy] %cuda_timed -n 1", ours_busy, "default: repeats queued back to back")
    row("[busy] %cuda_timed -n 10", ours_busy10)
    row("[busy] torch events, 200 µs spin before the start", torch_busy)
    row("[idle] %cuda_timed -n 1, setup cudalab.synchronize()", ours_idle)
    row("[idle] torch events (a.record; f; b.record; b.sync)", torch_idle)
    row("[idle] cupyx.profiler.benchmark", cupy_idle)

    def diff(label, a, b, note):
        if a is None or b is None:
            results["pct"][label] = None
            return
        pct(label, (a - b) / b * 100, note)

    diff("ours vs torch, both [busy]", ours_busy, torch_busy, "like with like; target ±1 %")
    diff("ours vs torch, both [idle]", ours_idle, torch_idle, "like with like; target ±1 %")
    diff("ours vs cupyx, both [idle]", ours_idle, cupy_idle,
         "same regime; cupyx's record-to-launch host path is longer (see the docstring)")
    diff("ours [busy] vs kernel's own time", ours_busy, own_med, "what %cuda_timed adds")
    diff("ours [busy] vs torch [idle]", ours_busy, torch_idle,
         "across regimes: torch's includes the launch gap")
    diff("ours [busy] vs cupyx [idle]", ours_busy, cupy_idle,
         "across regimes: cupyx's includes the launch gap")
    if torch_idle is not None and torch_busy is not None:
        put("launch gap in an idle-start pair (torch idle - busy)", torch_idle - torch_busy)

    # ------------------------------------------------------------ watch cost per cell
    cells = 300 if quick else 2000
    rounds_w = 5 if quick else 9
    sink = io.StringIO()

    class _Info:
        silent = False
        cell_id = None

    class _Result:
        info = _Info()

    def hooks_direct(threshold: str) -> float:
        ip.run_line_magic("cuda_memory", f"watch on --threshold {threshold}")
        w = magics._memory.watch
        info, res = _Info(), _Result()
        samples = []
        for _ in range(rounds_w):
            sink.seek(0)
            sink.truncate()
            t0 = time.perf_counter()
            for _ in range(cells):
                w.pre(info)
                w.post(res)
            samples.append((time.perf_counter() - t0) / cells)
        ip.run_line_magic("cuda_memory", "watch off")
        return statistics.median(samples)

    def cells_loop(n):
        for _ in range(n):
            ip.run_cell("pass", store_history=False)

    # The watch's modes in paired rounds: off, cudalab's line alone (--source cudalab: the
    # target), and the default (auto), which adds torch's and CuPy's lines while they hold
    # CUDA and so reads torch's counters before and after every cell.
    modes = {"cudalab": "watch on --source cudalab", "auto": "watch on"}
    with contextlib.redirect_stdout(sink):
        direct0 = hooks_direct("0")
        direct_thr = hooks_direct("1TiB")
        cells_loop(50)
        off: list[float] = []
        on: dict[str, list[float]] = {m: [] for m in modes}
        diffs: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(rounds_w):
            sink.seek(0)
            sink.truncate()
            t0 = time.perf_counter()
            cells_loop(cells)
            a = (time.perf_counter() - t0) / cells
            off.append(a)
            for mode, line in modes.items():  # threshold 0: a line per cell
                ip.run_line_magic("cuda_memory", line)
                t0 = time.perf_counter()
                cells_loop(cells)
                b = (time.perf_counter() - t0) / cells
                ip.run_line_magic("cuda_memory", "watch off")
                on[mode].append(b)
                diffs[mode].append(b - a)
    put("watch hooks, called directly (a line per cell)", direct0,
        "2 records + sync + elapsed_time, format, print")
    put("watch hooks, called directly (--threshold, silent)", direct_thr,
        "1 record; no wait below the threshold")
    put("run_cell('pass') without watch", statistics.median(off))
    put("run_cell('pass') with watch on --source cudalab", statistics.median(on["cudalab"]))
    put("watch on --source cudalab: added cost per cell", statistics.median(diffs["cudalab"]),
        "median of paired rounds; target <= 50 µs")
    torch_live = torch is not None and torch.cuda.is_initialized()
    put("run_cell('pass') with watch on (auto)", statistics.median(on["auto"]))
    put("watch on (auto): added cost per cell", statistics.median(diffs["auto"]),
        "torch's line too (torch holds CUDA here)" if torch_live else "cudalab's line alone here")
    if torch_live:
        stats = torch.cuda.memory_stats_as_nested_dict
        samples = []
        for _ in range(rounds_w):
            t0 = time.perf_counter()
            for _ in range(200):
                stats(0)
            samples.append((time.perf_counter() - t0) / 200)
        put("torch.cuda.memory_stats_as_nested_dict(0)", statistics.median(samples),
            "torch's counters: the auto watch reads them twice a cell")

    # ------------------------------------------------------------ %load_ext time
    s = load_ext_seconds(3 if quick else 7)
    results["ms"]["%load_ext cudalab"] = None if s is None else s * 1e3
    t.add("%load_ext cudalab (fresh interpreter)", None if s is None else s * 1e3, "ms",
          "target <= 300 ms")

    # ------------------------------------------------------------ driver calls (untimed)
    calls = count_driver_calls(ip, {
        "empty body": "%cuda_timed -q -n 1 -w 0 -r {r} pass",
        "setup statement": "%%cuda_timed -q -n 1 -w 0 -r {r} _x = 0\npass",
        "--cold": "%cuda_timed -q --cold -n 1 -w 0 -r {r} pass",
    })
    results["calls_per_repeat"] = calls
    for label, c in calls.items():
        text = ", ".join(f"{k} {v:g}" for k, v in c.items() if v)
        t.add(f"driver calls per repeat, {label}", float(sum(c.values())), "call", text)

    ip.run_line_magic("unload_ext", "cudalab")
    print(t.render())
    write_json(args.json, results)


if __name__ == "__main__":
    main()
