"""Widgets benchmark: what a live dashboard costs, and the snapshot viewer's speed.

* slowdown of an allocation-heavy loop (``caching_allocator_alloc`` + ``delete`` of 4 KiB,
  and ``cudalab.empty`` + drop) while a ``MemoryDashboard`` of every device samples at 10 Hz,
  measured in alternating rounds with the sampler thread running and stopped;
* the sampler's own cost: milliseconds per tick (sample + push) and bytes sent per tick per
  device (every widget message, JSON + binary buffers) under allocation churn;
* ``SnapshotViewer`` on a 10k-block snapshot (Python side: build, first render, scrub) and
  the size of its segment-map SVG. The browser's first render is measured by
  tests/widgets/test_browser.py (budget 1 s).

    python benchmarks/widgets.py [--json out.json] [--quick]

Bounds (the targets this project set): slowdown <= 2 % at 10 Hz; <= 2 KB per tick per device; 10k-block viewer
first render <= 1 s.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import Table, environment, parse_args, write_json  # noqa: E402


def _calibrate(loop, seconds: float) -> int:
    n = 1000
    while True:
        t = time.perf_counter()
        loop(n)
        dt = time.perf_counter() - t
        if dt >= seconds / 4:
            return max(int(n * seconds / dt), 1000)
        n *= 4


def loop_slowdown(rounds: int, seconds: float) -> dict:
    import cudalab
    import cudalab.memory as cm
    from cudalab.widgets import MemoryDashboard

    def pairs(k, a=cm.caching_allocator_alloc, f=cm.caching_allocator_delete):
        for _ in range(k):
            f(a(4096))

    def arrays(k, e=cudalab.empty):
        for _ in range(k):
            e(1024)

    out = {}
    dash = MemoryDashboard(interval=0.1, max_rate=10.0, start=False)
    try:
        for name, loop in (("alloc+delete 4 KiB", pairs), ("cudalab.empty+drop", arrays)):
            n = _calibrate(loop, seconds)
            samples: dict[str, list[float]] = {"off": [], "on": []}
            ticks = 0
            for r in range(2 * rounds):
                on = r % 2 == 1
                if on:
                    n0 = dash._n
                    dash.start()
                t = time.perf_counter()
                loop(n)
                dt = time.perf_counter() - t
                if on:
                    dash._stop_sampler()
                    ticks += dash._n - n0
                samples["on" if on else "off"].append(dt / n)
            off, on = statistics.median(samples["off"]), statistics.median(samples["on"])
            out[name] = {"off_us": off * 1e6, "on_us": on * 1e6,
                         "slowdown_pct": 100.0 * (on - off) / off, "iterations": n,
                         "ticks_per_s": ticks / (rounds * n * on) if on else 0.0}
    finally:
        dash.close()
    return out


def tick_cost(ticks: int) -> dict:
    import ipywidgets as W

    import cudalab
    import cudalab.memory as cm
    from cudalab.widgets import MemoryDashboard

    n_dev = cudalab.device_count()
    sizes: list[int] = []
    orig = W.Widget._send

    def record(self, msg, buffers=None):
        sizes.append(len(json.dumps(msg, separators=(",", ":")).encode())
                     + sum(len(memoryview(b).cast("B")) for b in (buffers or ())))
        return orig(self, msg, buffers)

    W.Widget._send = record
    dash = MemoryDashboard(interval=0.1, start=False)
    ptrs: list[tuple[int, int]] = []
    per_tick_bytes, per_tick_ms, light_ms = [], [], []
    dash.chart_interval = 1e9  # the light ticks below never redraw
    try:
        for k in range(ticks):
            for d in range(n_dev):
                ptrs.append(cm.caching_allocator_alloc(((k * 7) % 13 + 1) << 20, d))
                if len(ptrs) > 20:
                    cm.caching_allocator_delete(ptrs.pop(0))
            sizes.clear()
            t = time.perf_counter()
            dash.refresh()  # sample + push, chart redrawn every time (the worst case)
            per_tick_ms.append((time.perf_counter() - t) * 1e3)
            per_tick_bytes.append(sum(sizes) / n_dev)
            t = time.perf_counter()
            dash._sample()
            dash._push(force_chart=False)  # a tick between chart redraws (8 of 10 at 10 Hz)
            light_ms.append((time.perf_counter() - t) * 1e3)
    finally:
        W.Widget._send = orig
        dash.close()
        for p in ptrs:
            cm.caching_allocator_delete(p)
    return {"devices": n_dev, "tick_ms_median": statistics.median(per_tick_ms),
            "tick_ms_per_device": statistics.median(per_tick_ms) / n_dev,
            "tick_no_chart_ms_median": statistics.median(light_ms),
            "bytes_per_tick_per_device_median": statistics.median(per_tick_bytes),
            "bytes_per_tick_per_device_max": max(per_tick_bytes)}


def viewer(n_blocks: int, repeat: int) -> dict:
    from cudalab.widgets.snapshot_viewer import SnapshotViewer, demo_snapshot

    snap = demo_snapshot(n_blocks)
    build, render, scrub = [], [], []
    svg = 0
    blocks = 0
    for _ in range(repeat):
        t = time.perf_counter()
        v = SnapshotViewer(snap)
        build.append(time.perf_counter() - t)
        render.append(v.render_seconds)
        svg = len(v._map.value)
        blocks = v.last_render["blocks"]
        t = time.perf_counter()
        v.position = v._scrub.max // 2
        scrub.append(time.perf_counter() - t)
        v.close()
    return {"blocks": blocks, "build_s": statistics.median(build),
            "segment_map_s": statistics.median(render), "first_scrub_s": statistics.median(scrub),
            "svg_bytes": svg}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import cudalab
    from cudalab import devices

    cudalab.init()
    sim = devices.backend().simulated
    name = cudalab.get_device_name(0)
    rounds, seconds = (3, 0.3) if args.quick else (7, 1.0)
    slow = loop_slowdown(rounds, seconds)
    cost = tick_cost(30 if args.quick else 200)
    view = viewer(10_000, 2 if args.quick else 5)
    t = Table(f"cudalab widgets ({name})")
    for loop, r in slow.items():
        t.add(f"{loop}: per iteration, no dashboard", r["off_us"], "µs")
        t.add(f"{loop}: per iteration, dashboard at 10 Hz", r["on_us"], "µs",
              f"{r['ticks_per_s']:.1f} ticks/s")
        t.add(f"{loop}: slowdown", r["slowdown_pct"], "%", "bound <= 2 %")
    t.add("sampler tick with chart redraw, all devices", cost["tick_ms_median"], "ms",
          f"{cost['devices']} devices")
    t.add("sampler tick without chart redraw", cost["tick_no_chart_ms_median"], "ms",
          "the chart redraws at most every 0.5 s")
    t.add("sent per tick per device (median)", cost["bytes_per_tick_per_device_median"], "B")
    t.add("sent per tick per device (max)", cost["bytes_per_tick_per_device_max"], "B",
          "bound <= 2048 B")
    t.add(f"SnapshotViewer build, {view['blocks']} blocks", view["build_s"] * 1e3, "ms",
          "python side; browser: test_browser.py")
    t.add("  of which segment map", view["segment_map_s"] * 1e3, "ms", f"{view['svg_bytes']} B SVG")
    t.add("  first scrub to the middle", view["first_scrub_s"] * 1e3, "ms")
    print(t.render())
    write_json(args.json, {"environment": environment("simulator" if sim else "cuda", name),
                           "slowdown": slow, "tick": cost, "viewer": view, "rows": t.rows})


if __name__ == "__main__":
    main()
