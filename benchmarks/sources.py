"""Sources benchmark: what watching torch costs a torch user, and whether the views agree
with torch's own figures.

* a torch training step (an MLP, Adam; forward, backward, step) timed in alternating rounds
  with and without a ``MemoryDashboard(source="torch")`` sampling at 10 Hz: the slowdown
  (goal <= 1 %);
* the torch source's sample (``torch.cuda.memory_stats_as_nested_dict`` + NVML) and torch's
  flat ``memory_stats()`` beside it, per call;
* the watch's torch line: pre + post hooks per cell;
* ``%%cuda_timed`` on a torch matmul against ``torch.cuda.Event`` timing of the same matmul,
  back to back (goal: within 2 %);
* what the CuPy recording (``%cuda_memory history start --source cupy``: CuPy's memory hooks)
  costs a CuPy allocation and free (``cupy.empty`` of 4 KiB and its release), with and
  without the recording, alternating; and a snapshot of the recording.

    python benchmarks/sources.py [--json out.json] [--quick]

Needs torch with CUDA for the torch rows and CuPy for the CuPy rows (each skipped without
it, saying so).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # (_harness imports the comm package past benchmarks/comm.py)
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import Table, environment, optional_import, parse_args, write_json  # noqa: E402


def _model(torch):
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(512, 1024, device="cuda")

    def step():
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def step_slowdown(torch, rounds: int, seconds: float) -> dict:
    """Rounds of ``seconds`` each (the steps per round calibrated once), alternating without
    and with the dashboard's sampler thread running."""
    from cudalab.widgets import MemoryDashboard

    step = _model(torch)
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    steps = max(20, int(seconds / ((time.perf_counter() - t) / 20)))
    dash = MemoryDashboard(source="torch", interval=0.1, max_rate=10.0, start=False)
    samples: dict[str, list[float]] = {"off": [], "on": []}
    ticks = 0
    try:
        for r in range(2 * rounds):
            on = r % 2 == 1
            if on:
                n0 = dash._n
                dash.start()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            if on:
                dash._stop_sampler()
                ticks += dash._n - n0
            samples["on" if on else "off"].append(dt / steps)
    finally:
        dash.close()
    off, on = statistics.median(samples["off"]), statistics.median(samples["on"])
    spent = sum(samples["on"]) * steps
    return {"off_ms": off * 1e3, "on_ms": on * 1e3, "slowdown_pct": 100.0 * (on - off) / off,
            "ticks_per_s": ticks / spent if spent else 0.0, "steps": steps, "rounds": rounds}


def per_call(fn, number: int) -> float:
    for _ in range(number // 10):
        fn()
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(number):
            fn()
        runs.append((time.perf_counter() - t) / number)
    return statistics.median(runs)


def sample_costs(torch, number: int) -> dict:
    from cudalab.magics.memory_watch_sources import TorchCellWatch
    from cudalab.memory_sources import TorchSource

    source = TorchSource(torch)
    quiet = TorchSource(torch, nvml=False)
    watch = TorchCellWatch(torch, None, lambda: False)

    def hooks():
        watch.pre()
        watch.post(0.0, 0)

    return {"sample_us": per_call(lambda: source.sample(0), number) * 1e6,
            "sample_no_nvml_us": per_call(lambda: quiet.sample(0), number) * 1e6,
            "memory_stats_us": per_call(lambda: torch.cuda.memory_stats(0), number) * 1e6,
            "watch_hooks_us": per_call(hooks, number) * 1e6}


def timed_vs_events(torch, repeats: int) -> dict:
    from IPython.testing import globalipapp
    from IPython.utils.capture import capture_output

    a = torch.randn(4096, 4096, device="cuda")
    b = torch.randn(4096, 4096, device="cuda")
    for _ in range(5):
        torch.mm(a, b)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]
    events[0].record()
    for i in range(repeats):
        torch.mm(a, b)
        events[i + 1].record()
    torch.cuda.synchronize()
    theirs = statistics.median(events[i].elapsed_time(events[i + 1])
                               for i in range(repeats)) / 1e3
    ip = globalipapp.get_ipython()
    ip.run_line_magic("load_ext", "cudalab")
    ip.user_ns.update(a_=a, b_=b, torch=torch)
    with capture_output():
        r = ip.run_cell(f"%%cuda_timed -o -q -n 1 -r {repeats} -w 5\ntorch.mm(a_, b_)")
    ours = r.result.median
    return {"torch_events_ms": theirs * 1e3, "cuda_timed_ms": ours * 1e3,
            "difference_pct": 100.0 * (ours - theirs) / theirs}


def cupy_recording(cupy, number: int, rounds: int) -> dict:
    """Per ``cupy.empty(4096)`` and its release: CuPy alone and under the recording, in
    alternating rounds (medians); and one snapshot of a recording of ``number`` pairs."""
    from cudalab.memory import record_cupy_history

    empty, uint8 = cupy.empty, cupy.uint8

    def pairs() -> float:
        t = time.perf_counter()
        for _ in range(number):
            a = empty(4096, dtype=uint8)
            del a
        return (time.perf_counter() - t) / number

    class Empty(cupy.cuda.MemoryHook):  # CuPy's own cost of calling any hook
        name = "benchmark_empty_hook"

    pairs()  # warm: the pool's segment
    off, on, bare, empty_hook = [], [], [], []
    snapshot_s = 0.0
    for _ in range(rounds):
        off.append(pairs())
        rec = record_cupy_history(cupy, max_entries=1 << 20)  # stacks at allocs and frees
        try:
            on.append(pairs())
            t = time.perf_counter()
            snap = rec.snapshot()
            snapshot_s = time.perf_counter() - t
        finally:
            rec.stop()
        with record_cupy_history(cupy, max_entries=1 << 20, stacks=None):
            bare.append(pairs())
        with Empty():
            empty_hook.append(pairs())
    entries = sum(len(tr) for tr in snap["device_traces"])
    return {"alone_us": statistics.median(off) * 1e6,
            "recorded_us": statistics.median(on) * 1e6,
            "recorded_no_stacks_us": statistics.median(bare) * 1e6,
            "empty_hook_us": statistics.median(empty_hook) * 1e6,
            "snapshot_ms": snapshot_s * 1e3, "snapshot_entries": entries, "pairs": number,
            "rounds": rounds}


def cupy_rows(quick: bool) -> tuple[list[tuple], dict]:
    cupy = optional_import("cupy")
    if cupy is None or not cupy.cuda.is_available():
        print("cudalab sources: CuPy with CUDA is not installed here: no CuPy rows")
        return [], {"skipped": "no CuPy with CUDA"}
    rec = cupy_recording(cupy, 2000 if quick else 20000, 3 if quick else 7)
    return [
        ("cupy.empty(4 KiB) + release, CuPy alone", rec["alone_us"], "µs", "per pair"),
        ("cupy.empty(4 KiB) + release, recorded (CuPy's memory hooks)", rec["recorded_us"],
         "µs", f"+{rec['recorded_us'] - rec['alone_us']:.2f} µs per pair, stacks of both"),
        ("cupy.empty(4 KiB) + release, recorded with stacks=None", rec["recorded_no_stacks_us"],
         "µs", f"+{rec['recorded_no_stacks_us'] - rec['alone_us']:.2f} µs per pair"),
        ("cupy.empty(4 KiB) + release, an empty CuPy MemoryHook", rec["empty_hook_us"], "µs",
         f"+{rec['empty_hook_us'] - rec['alone_us']:.2f} µs: CuPy's own cost of any hook"),
        ("snapshot of the CuPy recording", rec["snapshot_ms"], "ms",
         f"{rec['snapshot_entries']:,} trace entries"),
    ], rec


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    torch = optional_import("torch")
    if torch is None or not torch.cuda.is_available():
        print("cudalab sources: torch with CUDA is not installed here: no torch rows")
        rows, cupy_figures = cupy_rows(args.quick)
        if rows:
            t = Table("cudalab sources, CuPy")
            for row in rows:
                t.add(*row)
            print(t.render())
        write_json(args.json, {"skipped": "no torch with CUDA", "cupy": cupy_figures})
        return
    import cudalab

    torch.zeros(1, device="cuda")
    cudalab.init()
    name = torch.cuda.get_device_name(0)
    slow = step_slowdown(torch, 5 if args.quick else 11, 0.5 if args.quick else 2.0)
    # (each part's figures as it ends: a run cut short still says what it measured)
    print(f"step: {slow['off_ms']:.3f} ms without, {slow['on_ms']:.3f} ms with the dashboard "
          f"({slow['slowdown_pct']:+.2f} %)", flush=True)
    costs = sample_costs(torch, 200 if args.quick else 2000)
    print(f"sample costs: {costs}", flush=True)
    timing = timed_vs_events(torch, 50 if args.quick else 200)
    t = Table(f"cudalab sources, torch {torch.__version__} ({name})")
    t.add("torch training step, no dashboard", slow["off_ms"], "ms", f"{slow['steps']} steps/round")
    t.add("torch training step, dashboard sampling torch at 10 Hz", slow["on_ms"], "ms",
          f"{slow['ticks_per_s']:.1f} ticks/s")
    t.add("slowdown", slow["slowdown_pct"], "%", f"goal <= 1 %, {slow['rounds']} rounds each")
    t.add("TorchSource.sample (with NVML)", costs["sample_us"], "µs")
    t.add("TorchSource.sample (no NVML)", costs["sample_no_nvml_us"], "µs")
    t.add("torch.cuda.memory_stats()", costs["memory_stats_us"], "µs", "torch's flat dict")
    t.add("watch's torch line: pre + post per cell", costs["watch_hooks_us"], "µs")
    t.add("matmul 4096², torch.cuda.Event median", timing["torch_events_ms"], "ms")
    t.add("matmul 4096², %%cuda_timed median", timing["cuda_timed_ms"], "ms")
    t.add("%%cuda_timed vs torch events", timing["difference_pct"], "%", "goal within 2 %")
    rows, cupy_figures = cupy_rows(args.quick)
    for row in rows:
        t.add(*row)
    print(t.render())
    write_json(args.json, {"environment": environment("cuda", name), "slowdown": slow,
                           "costs": costs, "timing": timing, "cupy": cupy_figures})


if __name__ == "__main__":
    main()
