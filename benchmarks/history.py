"""History, snapshot and replay benchmark (issue 4), side by side with torch in one run.

* added cost of allocation history per alloc+free pair: cudalab's
  ``caching_allocator_alloc/delete`` and ``DeviceArray`` creation+drop with history off,
  ``stacks=None`` and ``stacks="python"``, next to ``torch.empty``+drop with torch's
  ``_record_memory_history`` off and on (``stacks="python"``);
* ``memory_snapshot()`` with 2000 live blocks, cudalab against torch;
* replay throughput (trace entries per second) on a synthetic 200k-entry trace.

    python benchmarks/history.py [--json out.json] [--quick]

Bounds (issue 4): history with python stacks adds <= 0.5x torch's added cost; with
stacks=None <= 0.3 us; snapshot of 2000 blocks <= torch's time; replay >= 200k entries/s.
"""

from __future__ import annotations

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


def history_cost(n: int, rounds: int, sim: bool) -> dict:
    import cudalab
    import cudalab.memory as cm

    torch = None if sim else optional_import("torch")
    have_torch = torch is not None and torch.cuda.is_available()
    size = 4096

    def ours(k, a=cm.caching_allocator_alloc, f=cm.caching_allocator_delete):
        for _ in range(k):
            f(a(size))

    def ours_array(k, e=cudalab.empty):
        for _ in range(k):
            e(size // 4)

    def torch_pair(k):
        for _ in range(k):
            torch.empty(size, dtype=torch.uint8, device="cuda")

    # The recording modes alternate within every round (each timed loop runs between its
    # mode's start and stop, which are not timed), so host drift between modes cancels in
    # the "added" differences. Stopping stack-less recording writes out the memo pairs that
    # were logged as bare times; that cost, paid once by whoever reads or stops the
    # history, is reported on its own row (torch likewise builds its Python entries only
    # when _snapshot() is called).
    def ours_on(kw):
        return lambda: cm._record_memory_history("all", max_entries=100_000, **kw)

    def ours_off():
        cm._record_memory_history(None)

    def nothing():
        pass

    cases: dict = {}
    for mode, kw in (("off", None), ("stacks=None", dict(stacks=None)),
                     ("stacks=python", dict(stacks="python"))):
        start = nothing if kw is None else ours_on(kw)
        stop = nothing if kw is None else ours_off
        cases[(mode, "cudalab caching_allocator_alloc+delete")] = (ours, start, stop)
        cases[(mode, "cudalab empty+drop")] = (ours_array, start, stop)
    if have_torch:
        torch.empty(1, device="cuda")

        def torch_on():
            torch.cuda.memory._record_memory_history(enabled="all", stacks="python",
                                                     max_entries=100_000)

        def torch_off():
            torch.cuda.memory._record_memory_history(enabled=None)

        cases[("off", "torch.empty+drop")] = (torch_pair, nothing, nothing)
        cases[("stacks=python", "torch.empty+drop")] = (torch_pair, torch_on, torch_off)
    samples: dict = {k: [] for k in cases}
    stops: list[float] = []
    for loop, start, stop in cases.values():  # warm-up
        start()
        loop(min(n, 1000))
        stop()
    for _ in range(rounds):
        for key, (loop, start, stop) in cases.items():
            start()
            t0 = time.perf_counter()
            loop(n)
            t1 = time.perf_counter()
            stop()
            samples[key].append((t1 - t0) / n)
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
    from cudalab.memory.export import _synthetic_snapshot
    from cudalab.memory.replay import replay

    snap = _synthetic_snapshot(entries, oom_every=10**9, snapshot_every=10**9)
    n = sum(len(t) for t in snap["device_traces"])
    out = {}
    for conf in (None, "expandable_segments:True"):
        t = _median_time(lambda c=conf: replay(snap, c), repeat)
        out[f"replay {conf or 'default'}"] = n / t
    return out


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import cudalab

    cudalab.init()
    sim = cudalab.devices._backend().simulated
    n, rounds = (2000, 5) if args.quick else (20000, 9)
    res = {"env": environment(cudalab.devices._backend().name, cudalab.get_device_name())}
    res["history"] = history_cost(n, rounds, sim)
    res["snapshot_ms"] = snapshot_time(2000, 5 if args.quick else 21, sim)
    res["replay_entries_per_s"] = replay_rate(20_000 if args.quick else 200_000, 3)

    t = Table(f"History cost per alloc+free pair ({res['env']['device']})")
    h = dict(res["history"])
    write_out = h.pop("write_out_per_pair_us")
    added = h.pop("added")
    for mode, row in h.items():
        for k, v in row.items():
            t.add(f"{k} [{mode}]", v)
    for k in ("cudalab caching_allocator_alloc+delete", "cudalab empty+drop"):
        for mode in ("stacks=None", "stacks=python"):
            t.add(f"added: {k} [{mode}]", added[mode][k], "µs",
                  "median of per-round differences" + ("; bound <= 0.3" if mode == "stacks=None"
                                                       else ""))
    t.add("stacks=None: writing out the pairs logged as times", write_out, "µs",
          "per pair, once, when the history is read or stopped (not in the rows above)")
    if "torch.empty+drop" in added.get("stacks=python", {}):
        theirs = added["stacks=python"]["torch.empty+drop"]
        t.add("added: torch.empty+drop [stacks=python]", theirs)
        ours = added["stacks=python"]["cudalab empty+drop"]
        t.add("ratio cudalab/torch added (python stacks)", ours / theirs if theirs else None, "×",
              "bound <= 0.5")
    print(t.render())
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
