"""CUDA graph benchmark: replay and capture host costs, 1,000 tiny kernels eager vs replayed,
and the private pool's memory, next to torch in the same run.

Rows (cudalab, then torch's ``torch.cuda.CUDAGraph`` when torch is importable):

* host cost of ``CUDAGraph.replay()`` of a one-kernel graph (a loop of replays, then one
  synchronize; each replay also refreshes the default generator's graph words, as torch's),
  the median of rounds interleaved with torch's (goal: cudalab <= torch);
* host time per captured kernel launch: capturing 1,000 ``fill_(i + 1)`` of a 4 KiB int64
  array (cudalab's ``DeviceArray.fill_``, which launches the runtime's own fill kernel;
  torch's ``Tensor.fill_``), from capture_begin to capture_end (instantiation included,
  the graph's destruction not), divided by 1,000, the median of 25 rounds interleaved with
  torch's, the garbage collector off during each (goal: cudalab <= torch); and the same
  through ``Kernel.launch`` directly (the kernel API, for reference);
* those 1,000 tiny fill kernels launched eagerly vs replayed as one graph: time per 1,000
  from events on the stream (goal: replay >= 5x faster);
* peak reserved bytes in the private pool for the same sequence of allocations and frees
  inside a capture (goal: equal to torch's);
* ``fill_`` by dtype: 1,000 ``x.fill_(value)`` of one 1,024-element array of float32
  (``1.0``, a uniform 4-byte pattern), float16 (``1.0``), uint8 (``7``, byte-uniform) and
  int64 (``5``), eager and captured into one graph: the eager GPU time per 1,000 (events),
  the eager host time, the replay's GPU time (events), the host time of one ``replay()``
  with the queue drained between rounds, replay + synchronize, and the graph's speed-up
  over eager (goals: every cudalab row <= torch's, the graph >= 5x eager); and cudalab's
  eager fills through the fill kernel (what a fill takes during a capture), beside its
  eager memset (which of the two an eager fill should take, per dtype), and the replay of
  the same graph captured with fill_'s other setting of programmatic fills
  (``_array_memory.PROGRAMMATIC_FILLS``, on by default on sm_90+; whether fill_ should
  launch them so); a fifth case,
  float16 starting 2 bytes into its buffer (1,024 elements), takes cuMemsetD16 eagerly
  (float16 elsewhere takes cuMemsetD32 of the doubled pattern);
* fill kernel variants: 1,000 launches of each fill kernel and launch shape (and with
  programmatic dependent launch, the kernel waiting for the previous one) on the float32
  array's 4 KiB, replayed as one graph, GPU time per 1,000 (events, the variants
  interleaved), beside torch's float32 ``fill_`` replay (which kernel and shape ``fill_``
  should take inside a graph: the goal is a graph >= 5x eager).

On the simulator every number is labelled simulated and torch is skipped.

    python benchmarks/graphs.py [--json out.json] [--quick] [--fills-only]
    (--fills-only: only the fill_ by dtype and fill kernel variant rows)
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout works uninstalled
from _harness import (  # noqa: E402
    Table,
    environment,
    interleaved_rounds,
    optional_import,
    parse_args,
    write_json,
)

KERNELS = 1000
FILL_BYTES = 4096
#: (size in bytes, free after) of the allocation sequence captured for the memory row.
ALLOCATIONS = [(512, False), (4096, True), (1 << 20, False), ((1 << 20) + 512, True),
               (3 << 20, False), (100, True), (10 << 20, False), (700 << 10, True),
               (12 << 20, True), (2048, False)]


def _event_seconds(make_events, run, repeat: int) -> float:
    """Median seconds of ``run()`` on the current stream, measured with events."""
    start, end = make_events()
    times = []
    for _ in range(repeat):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _capture(new_graph, body):
    """A graph (``new_graph()``: cudalab's or torch's CUDAGraph) holding what ``body`` queues."""
    g = new_graph()
    g.capture_begin()
    body()
    g.capture_end()
    return g


def _capture_seconds(stream_context, stream, new_graph, body) -> float:
    """Seconds from capture_begin to capture_end of ``body`` on ``stream`` (entered with the
    library's ``stream_context``); the graph is destroyed after the timed window."""
    with stream_context(stream):
        g = new_graph()
        t0 = time.perf_counter()
        g.capture_begin()
        body()
        g.capture_end()
        t = time.perf_counter() - t0
    del g
    return t


def _replay_seconds(stream_context, stream, graph, n: int) -> float:
    """Seconds for ``n`` replays of ``graph`` on ``stream``, then one synchronize."""
    with stream_context(stream):
        t0 = time.perf_counter()
        for _ in range(n):
            graph.replay()
        stream.synchronize()
        return time.perf_counter() - t0


# ----------------------------------------------------------------------------------- cudalab
def bench_cudalab(table: Table, results: dict, rounds: dict, quick: bool) -> None:
    import numpy as np

    import cudalab
    from cudalab._kernels.fill import fill_kernel
    from cudalab._kernels.kernel import launch_config_1d

    tag = " (simulated)" if cudalab.get_device_properties(0).simulated else ""
    repeat = 3 if quick else 7
    buf = cudalab.array.zeros((FILL_BYTES // 8,), np.int64)
    kernel = fill_kernel(8)
    count = FILL_BYTES // 8
    grid, block = launch_config_1d(count, 256, max_blocks=8192)

    def fills(n=KERNELS):  # (i + 1: never 0, which would be a memset instead of a kernel)
        for i in range(n):
            buf.fill_(i + 1)

    def kernel_fills(n=KERNELS):
        for i in range(n):
            kernel.launch(grid, block, (buf, i + 1, count))

    s = cudalab.Stream()
    s.wait_stream(cudalab.current_stream())
    with cudalab.stream(s):
        fills(10)  # loads the kernel
        s.synchronize()
        # replay host cost: a one-kernel graph; host time per captured launch (both timed in
        # main(), rounds interleaved with torch's)
        g1 = _capture(cudalab.CUDAGraph, lambda: fills(1))
        n = 200 if quick else 5000
        replays = functools.partial(_replay_seconds, cudalab.stream, s, g1, n)
        replays()
        rounds["cudalab CUDAGraph.replay() host cost"] = (replays, n, "cudalab_replay_us")
        for body, row, key in ((fills, "fill_", "cudalab_capture_per_launch_us"),
                               (kernel_fills, "Kernel.launch",
                                "cudalab_capture_per_kernel_launch_us")):
            capture_seconds = functools.partial(_capture_seconds, cudalab.stream, s,
                                                cudalab.CUDAGraph, body)
            capture_seconds()  # warm-up
            rounds[f"cudalab capture, host time per launch ({row})"] = (
                capture_seconds, KERNELS, key)

        # 1,000 fill kernels: eager vs replay
        g = _capture(cudalab.CUDAGraph, fills)

        def events():
            return cudalab.Event(enable_timing=True), cudalab.Event(enable_timing=True)

        eager = _event_seconds(events, fills, repeat)
        replay = _event_seconds(events, g.replay, repeat)
        table.add(f"cudalab {KERNELS} fills eager{tag}", eager * 1e6, "µs")
        table.add(f"cudalab {KERNELS} fills replay{tag}", replay * 1e6, "µs",
                  f"{eager / replay:.1f}x faster (goal >= 5x)")
        results["cudalab_fills_eager_us"] = eager * 1e6
        results["cudalab_fills_replay_us"] = replay * 1e6
        del g

        # private pool: the same allocations inside a capture
        cudalab.synchronize()
        cudalab.empty_cache()
        gm = cudalab.CUDAGraph()
        gm.capture_begin()
        fills(1)
        keep = []
        for size, free in ALLOCATIONS:
            a = cudalab.array.empty((size,), np.uint8)
            if not free:
                keep.append(a)
            del a
        gm.capture_end()
        pool = gm.pool()
        reserved = sum(seg["total_size"] for seg in cudalab.memory_snapshot()
                       if tuple(seg["segment_pool_id"]) == tuple(pool))
        table.add(f"cudalab private pool reserved after the capture{tag}", reserved, "B")
        results["cudalab_pool_reserved_bytes"] = reserved
        del keep, gm
    cudalab.current_stream().wait_stream(s)
    cudalab.synchronize()


# --------------------------------------------------------------------------- fill_ by dtype
#: (dtype name, value) of the fill_ rows: a uniform 4-byte pattern, a 2-byte one, a
#: byte-uniform one, an 8-byte one.
FILL_CASES = (("float32", 1.0), ("float16", 1.0), ("uint8", 7), ("int64", 5))
#: (row name, dtype name, value, start element) of the offset cases: an array of
#: FILL_ELEMENTS that starts ``start`` elements into its buffer.
OFFSET_CASES = (("float16+2B", "float16", 1.0, 1),)
FILL_ELEMENTS = 1024


def _drained_replay_seconds(stream_context, stream, graph, n: int) -> float:
    """Host seconds of ``graph.replay()`` alone, summed over ``n`` replays on ``stream``, the
    queue drained (synchronize) before each, outside the timed window."""
    total = 0.0
    with stream_context(stream):
        for _ in range(n):
            stream.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            total += time.perf_counter() - t0
        stream.synchronize()
    return total


def _replay_sync_seconds(stream_context, stream, graph, n: int) -> float:
    """Seconds of ``graph.replay()`` then ``stream.synchronize()``, summed over ``n`` rounds."""
    total = 0.0
    with stream_context(stream):
        stream.synchronize()
        for _ in range(n):
            t0 = time.perf_counter()
            graph.replay()
            stream.synchronize()
            total += time.perf_counter() - t0
    return total


def _eager_host_seconds(stream, fills) -> float:
    """Host seconds to queue ``fills()`` (the queue drained before, outside the window)."""
    stream.synchronize()
    t0 = time.perf_counter()
    fills()
    t = time.perf_counter() - t0
    stream.synchronize()
    return t


def bench_dtype_fills(lib: str, api: dict, table: Table, results: dict, rounds: dict,
                      quick: bool, tag: str = "") -> list:
    """The fill_ rows of one library (``api``: its ``zeros(dtype_name)``, ``Stream``,
    ``stream`` context, ``CUDAGraph``, ``Event``, and optionally ``kernel_fills`` (a
    context in which cudalab's eager fills take the kernel)); the host-time rounds go to
    ``rounds`` (interleaved with the other library's in main). Returns what must stay alive
    until the rounds ran (the graphs)."""
    repeat = 3 if quick else 7
    replays = 2 if quick or tag else 20
    keep = []
    s = api["Stream"]()

    def events():
        return api["Event"](enable_timing=True), api["Event"](enable_timing=True)

    cases = [(name, name, value, 0) for name, value in FILL_CASES] + list(OFFSET_CASES)
    for name, dtype_name, value, start in cases:
        x = api["zeros"](dtype_name, start)
        api["synchronize"]()

        def fills(n=KERNELS, x=x, value=value):
            for _ in range(n):
                x.fill_(value)

        with api["stream"](s):
            fills(10)  # loads the kernel
            s.synchronize()
            g = _capture(api["CUDAGraph"], fills)
            g.replay()
            s.synchronize()
            eager = _event_seconds(events, fills, repeat)
            replay = _event_seconds(events, g.replay, repeat)
            eager_host = statistics.median(_eager_host_seconds(s, fills) for _ in range(repeat))
            kernel_eager = None
            if "kernel_fills" in api:
                with api["kernel_fills"]():
                    kernel_eager = _event_seconds(events, fills, repeat)
            programmatic = None
            if "programmatic_fills" in api:  # the same graph, fill_'s other PDL setting
                with api["programmatic_fills"](None):
                    gp = _capture(api["CUDAGraph"], fills)
                gp.replay()
                s.synchronize()
                programmatic = _event_seconds(events, gp.replay, repeat)
                del gp
        keep.append(g)
        key = f"{lib}_fill_{name}"
        table.add(f"{lib} {KERNELS} fill_ {name} eager, GPU{tag}", eager * 1e6, "µs")
        table.add(f"{lib} {KERNELS} fill_ {name} eager, host{tag}", eager_host * 1e6, "µs")
        table.add(f"{lib} {KERNELS} fill_ {name} replay, GPU{tag}", replay * 1e6, "µs",
                  f"{eager / replay:.1f}x faster than eager (goal >= 5x)")
        results[f"{key}_eager_us"] = eager * 1e6
        results[f"{key}_eager_host_us"] = eager_host * 1e6
        results[f"{key}_replay_gpu_us"] = replay * 1e6
        results[f"{key}_graph_speedup"] = eager / replay
        if kernel_eager is not None:
            table.add(f"{lib} {KERNELS} fill_ {name} eager through the fill kernel, GPU{tag}",
                      kernel_eager * 1e6, "µs", f"{kernel_eager / eager:.2f}x the eager fill_")
            results[f"{key}_eager_kernel_us"] = kernel_eager * 1e6
        if programmatic is not None:
            other = "off" if api["programmatic_default"]() else "on"
            table.add(f"{lib} {KERNELS} fill_ {name} replay with programmatic fills {other}, "
                      f"GPU{tag}", programmatic * 1e6, "µs",
                      f"{eager / programmatic:.1f}x faster than eager (goal >= 5x)")
            results[f"{key}_replay_programmatic_{other}_gpu_us"] = programmatic * 1e6
            results[f"{key}_graph_speedup_programmatic_{other}"] = eager / programmatic
        rounds[f"{lib} fill_ {name}: replay() host time, queue drained"] = (
            functools.partial(_drained_replay_seconds, api["stream"], s, g, replays), replays,
            f"{key}_replay_host_us")
        rounds[f"{lib} fill_ {name}: replay + synchronize"] = (
            functools.partial(_replay_sync_seconds, api["stream"], s, g, replays), replays,
            f"{key}_replay_sync_us")
    return keep


# ------------------------------------------------------------------------ fill kernel variants
def fill_kernel_variants(table: Table, results: dict, quick: bool, simulated: bool) -> None:
    """1,000 launches of each fill kernel and launch shape on 4 KiB (float32's 1,024
    elements of 1.0), captured into one graph each; the GPU time of a replay (events), the
    variants interleaved in each repetition, beside torch's float32 fill_ replay."""
    import numpy as np

    import cudalab
    from cudalab._kernels.fill import FILL_KERNELS, VECTOR_FILL_KERNEL

    tag = " (simulated)" if simulated else ""
    x = cudalab.array.zeros((FILL_ELEMENTS,), np.float32)
    nbytes = x.nbytes
    one = 0x3F800000  # 1.0f
    two = one << 32 | one
    # label -> (kernel, grid, block, value, count, programmatic dependent launch); the second
    # is what fill_ takes in a graph on sm_90+ (the first with CUDALAB_PROGRAMMATIC_FILLS=0)
    variants = {
        "v16, 1 block of 256": (VECTOR_FILL_KERNEL, 1, 256, two, nbytes // 16, False),
        "v16, 1 block of 256, programmatic launch (fill_'s)": (VECTOR_FILL_KERNEL, 1, 256, two,
                                                               nbytes // 16, True),
        "v16, 2 blocks of 128": (VECTOR_FILL_KERNEL, 2, 128, two, nbytes // 16, False),
        "v16, 2 blocks of 128, programmatic launch": (VECTOR_FILL_KERNEL, 2, 128, two,
                                                      nbytes // 16, True),
        "v16, 4 blocks of 64": (VECTOR_FILL_KERNEL, 4, 64, two, nbytes // 16, False),
        "u64 grid-stride, 2 blocks of 256 (before)": (FILL_KERNELS[8], 2, 256, two, nbytes // 8,
                                                      False),
        "u32 grid-stride, 4 blocks of 256": (FILL_KERNELS[4], 4, 256, one, nbytes // 4, False),
        # the floor: one warp that stores nothing (a kernel node's own cost)
        "v16 storing nothing, 1 block of 32 (the floor)": (VECTOR_FILL_KERNEL, 1, 32, two, 0,
                                                           False),
        "v16 storing nothing, programmatic launch": (VECTOR_FILL_KERNEL, 1, 32, two, 0, True),
    }
    s = cudalab.Stream()
    s.wait_stream(cudalab.current_stream())
    graphs = {}
    with cudalab.stream(s):
        for label, (kernel, grid, block, value, count, programmatic) in variants.items():
            def launches(kernel=kernel, shape=((grid, 1, 1), (block, 1, 1)),
                         values=(x.ptr, value, count), programmatic=programmatic):
                for _ in range(KERNELS):
                    kernel.launch_prepared(shape[0], shape[1], values, s, programmatic)

            launches()  # loads the kernel
            graphs[label] = _capture(cudalab.CUDAGraph, launches)
            graphs[label].replay()
        s.synchronize()
        if not (x.numpy() == 1.0).all():
            raise AssertionError("a fill kernel variant wrote wrong values")
        start, end = cudalab.Event(enable_timing=True), cudalab.Event(enable_timing=True)
        times: dict = {label: [] for label in graphs}
        for _ in range(5 if quick else 15):
            for label, g in graphs.items():
                start.record()
                g.replay()
                end.record()
                end.synchronize()
                times[label].append(start.elapsed_time(end) * 1e3)
    cudalab.current_stream().wait_stream(s)
    torch_us = results.get("torch_fill_float32_replay_gpu_us")
    for i, (label, values) in enumerate(times.items()):
        us = statistics.median(values)
        note = f"min {min(values):.1f} µs"
        if torch_us:
            note += f"; {us / torch_us:.2f}x torch's fill_ replay"
        table.add(f"fill kernel {label}: {KERNELS} replayed, GPU{tag}", us, "µs", note)
        results[f"cudalab_fill_variant_{i}_replay_gpu_us"] = us
    del graphs


# ------------------------------------------------------------------------------------- torch
def bench_torch(torch, table: Table, results: dict, rounds: dict, quick: bool) -> None:
    repeat = 3 if quick else 7
    buf = torch.zeros(FILL_BYTES // 8, dtype=torch.int64, device="cuda")

    def fills(n=KERNELS):
        for i in range(n):
            buf.fill_(i + 1)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fills(10)
        s.synchronize()
        g1 = _capture(torch.cuda.CUDAGraph, lambda: fills(1))
        n = 200 if quick else 5000
        replays = functools.partial(_replay_seconds, torch.cuda.stream, s, g1, n)
        replays()
        rounds["torch CUDAGraph.replay() host cost"] = (replays, n, "torch_replay_us")
        capture_seconds = functools.partial(_capture_seconds, torch.cuda.stream, s,
                                            torch.cuda.CUDAGraph, fills)
        capture_seconds()  # warm-up
        rounds["torch capture, host time per launch (fill_)"] = (
            capture_seconds, KERNELS, "torch_capture_per_launch_us")
        g = _capture(torch.cuda.CUDAGraph, fills)

        def events():
            return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        eager = _event_seconds(events, fills, repeat)
        replay = _event_seconds(events, g.replay, repeat)
        table.add(f"torch {KERNELS} fills eager", eager * 1e6, "µs")
        table.add(f"torch {KERNELS} fills replay", replay * 1e6, "µs",
                  f"{eager / replay:.1f}x faster")
        results["torch_fills_eager_us"] = eager * 1e6
        results["torch_fills_replay_us"] = replay * 1e6
        del g

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        gm = torch.cuda.CUDAGraph()
        gm.capture_begin()
        fills(1)
        keep = []
        for size, free in ALLOCATIONS:
            a = torch.empty(size, dtype=torch.uint8, device="cuda")
            if not free:
                keep.append(a)
            del a
        gm.capture_end()
        pool = gm.pool()
        reserved = sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                       if tuple(seg.get("segment_pool_id", (0, 0))) == tuple(pool))
        table.add("torch private pool reserved after the capture", reserved, "B")
        results["torch_pool_reserved_bytes"] = reserved
        del keep, gm
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def cudalab_fill_api():
    """What :func:`bench_dtype_fills` needs of cudalab."""
    import numpy as np

    import cudalab
    from cudalab import _array_memory, streams

    @contextlib.contextmanager
    def programmatic_fills(on):
        # fill_'s switch for programmatic dependent launch of captured fills (None: the
        # setting fill_ does not take by default)
        before = _array_memory.PROGRAMMATIC_FILLS
        _array_memory.PROGRAMMATIC_FILLS = (not before) if on is None else on
        try:
            yield
        finally:
            _array_memory.PROGRAMMATIC_FILLS = before

    @contextlib.contextmanager
    def kernel_fills():
        # An entry in the open-capture map: eager fills take the fill kernel as they do while
        # a graph captures (key -1: never a capture id).
        streams.open_captures[-1] = None
        try:
            yield
        finally:
            del streams.open_captures[-1]

    return {"zeros": lambda name, start=0: cudalab.array.zeros(
                (start + FILL_ELEMENTS,), np.dtype(name))[start:],
            "Stream": cudalab.Stream, "stream": cudalab.stream, "CUDAGraph": cudalab.CUDAGraph,
            "Event": cudalab.Event, "synchronize": cudalab.synchronize,
            "kernel_fills": kernel_fills, "programmatic_fills": programmatic_fills,
            "programmatic_default": lambda: _array_memory.PROGRAMMATIC_FILLS}


def torch_fill_api(torch):
    """What :func:`bench_dtype_fills` needs of torch."""
    return {"zeros": lambda name, start=0: torch.zeros(
                start + FILL_ELEMENTS, dtype=getattr(torch, name), device="cuda")[start:],
            "Stream": torch.cuda.Stream, "stream": torch.cuda.stream,
            "CUDAGraph": torch.cuda.CUDAGraph, "Event": torch.cuda.Event,
            "synchronize": torch.cuda.synchronize}


def fill_rows(torch, table: Table, results: dict, quick: bool, simulated: bool) -> None:
    """The fill_ by dtype rows, cudalab's and torch's host-time rounds interleaved (the
    garbage collector off during each), then cudalab / torch for each (goal: <= 1)."""
    tag = " (simulated)" if simulated else ""
    rounds: dict = {}
    keep = bench_dtype_fills("cudalab", cudalab_fill_api(), table, results, rounds, quick, tag)
    if torch is not None:
        keep += bench_dtype_fills("torch", torch_fill_api(torch), table, results, rounds, quick)
    samples = interleaved_rounds({name: entry[0] for name, entry in rounds.items()},
                                 3 if quick or simulated else 15, gc_off=True)
    for name, values in samples.items():
        _fn, per, key = rounds[name]
        us = statistics.median(values) / per * 1e6
        table.add(name + (tag if name.startswith("cudalab") else ""), us, "µs",
                  f"min {min(values) / per * 1e6:.3f} µs")
        results[key] = us
    del keep
    if torch is None:
        return
    for name in [case[0] for case in FILL_CASES + OFFSET_CASES]:
        for what, suffix in (("eager, GPU", "eager_us"), ("eager, host", "eager_host_us"),
                             ("replay, GPU", "replay_gpu_us"),
                             ("replay() host time, queue drained", "replay_host_us"),
                             ("replay + synchronize", "replay_sync_us")):
            ratio = (results[f"cudalab_fill_{name}_{suffix}"]
                     / results[f"torch_fill_{name}_{suffix}"])
            results[f"ratio_fill_{name}_{suffix}"] = ratio
            table.add(f"fill_ {name} {what}, cudalab / torch", ratio, "x", "(goal: <= 1)")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], (
        ("--fills-only", "only the fill_ by dtype and fill kernel variant rows"),))
    import cudalab

    cudalab.init()
    props = cudalab.get_device_properties(0)
    table = Table(f"CUDA graphs on {props.name}")
    results: dict = {}
    rounds: dict = {}  # row -> (a function timing one round, calls per round, results key)
    torch = None if props.simulated else optional_import("torch")
    if args.fills_only:
        fills_only(torch, table, results, args, props)
        return
    bench_cudalab(table, results, rounds, args.quick)
    if torch is not None and torch.cuda.is_available():
        bench_torch(torch, table, results, rounds, args.quick)
    # The replay and capture rows: cudalab's and torch's rounds interleaved (the host's speed
    # drifts, within a run too, by tens of percent: interleaving keeps the comparison fair),
    # with the cyclic garbage collector off during each round, as timeit does (a collection
    # of the interpreter's heap, torch's objects included, costs milliseconds wherever it
    # lands). The median of the rounds is reported, their minimum beside it.
    samples = interleaved_rounds({name: entry[0] for name, entry in rounds.items()},
                                 3 if args.quick else 25, gc_off=True)
    tag = " (simulated)" if props.simulated else ""
    for name, values in samples.items():
        _fn, per, key = rounds[name]
        us = statistics.median(values) / per * 1e6
        table.add(name + (tag if name.startswith("cudalab") else ""), us, "µs",
                  f"min {min(values) / per * 1e6:.3f} µs")
        results[key] = us
        results[key.replace("_us", "_min_us")] = min(values) / per * 1e6
    if torch is not None and torch.cuda.is_available():
        if "torch_pool_reserved_bytes" in results:
            diff = results["cudalab_pool_reserved_bytes"] - results["torch_pool_reserved_bytes"]
            table.add("private pool reserved, cudalab - torch", diff, "B", "(goal: 0)")
        for key, what in (("replay_us", "replay() host cost"),
                          ("capture_per_launch_us", "capture, host time per launch")):
            if f"torch_{key}" in results:
                ratio = results[f"cudalab_{key}"] / results[f"torch_{key}"]
                results[f"ratio_{key}"] = ratio
                table.add(f"{what}, cudalab / torch", ratio, "x", "(goal: <= 1)")
    fill_rows(torch if torch is not None and torch.cuda.is_available() else None, table,
              results, args.quick, props.simulated)
    fill_kernel_variants(table, results, args.quick, props.simulated)
    finish(table, results, args, props)


def fills_only(torch, table: Table, results: dict, args, props) -> None:
    """The --fills-only run: the fill_ by dtype rows and the fill kernel variants."""
    fill_rows(torch if torch is not None and torch.cuda.is_available() else None, table,
              results, args.quick, props.simulated)
    fill_kernel_variants(table, results, args.quick, props.simulated)
    finish(table, results, args, props)


def finish(table: Table, results: dict, args, props) -> None:
    """Print the table and write the JSON."""
    print(table.render())
    from cudalab import _internal

    write_json(args.json, {"env": environment(_internal.backend().name, props.name),
                           "results": results})


if __name__ == "__main__":
    main()
