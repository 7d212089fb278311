"""Shared helpers for cudalab's benchmark scripts: timing loops, tables, JSON.

Each script measures cudalab next to raw cuda.bindings, torch and CuPy in the same run
(those that are importable), prints a table and writes JSON beside it (``--json PATH``).
Per-call costs use the median of several repeats of a tight loop.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable


def _import_the_comm_package() -> None:
    """Import the ``comm`` package (ipywidgets' transport) with this folder off sys.path:
    Python puts a script's folder first, where ``benchmarks/comm.py`` would shadow it and
    every widget a benchmark makes would fail (``module 'comm' has no attribute
    'create_comm'``). Every benchmark imports this module before it imports ipywidgets."""
    here = os.path.dirname(os.path.abspath(__file__))
    shadowing = sys.modules.get("comm")
    if shadowing is not None and os.path.dirname(os.path.abspath(
            getattr(shadowing, "__file__", None) or os.curdir)) == here:
        del sys.modules["comm"]
    path = list(sys.path)
    sys.path[:] = [p for p in path if os.path.abspath(p or os.curdir) != here]
    try:
        import comm  # noqa: F401
    except ImportError:
        pass
    finally:
        sys.path[:] = path


_import_the_comm_package()


def time_per_call(fn: Callable[[], object], number: int = 20000, repeat: int = 7,
                  warmup: int = 1000) -> float:
    """Median seconds per call of ``fn`` over ``repeat`` loops of ``number`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
    return statistics.median(samples)


def interleaved_rounds(rounds: dict[str, Callable[[], float]], repeat: int,
                       between: Callable[[], object] | None = None,
                       gc_off: bool = False) -> dict[str, list[float]]:
    """The seconds each of ``rounds`` returns, called in ``repeat`` passes that take them in
    turn, so a drift in the host's speed during the run falls on all of them alike.

    ``between()`` runs after each call (a device synchronisation, so one library's queued
    work does not slow the next). ``gc_off`` turns the cyclic garbage collector off during
    each call, as timeit does (a collection costs milliseconds wherever it lands).
    """
    samples: dict[str, list[float]] = {name: [] for name in rounds}
    for _ in range(repeat):
        for name, one_round in rounds.items():
            if gc_off:
                gc.collect()
            try:
                if gc_off:
                    gc.disable()
                samples[name].append(one_round())
            finally:
                if gc_off:
                    gc.enable()
            if between is not None:
                between()
    return samples


def interleaved_time_per_call(fns: dict[str, Callable[[], object]], number: int = 5000,
                              repeat: int = 7, warmup: int = 500,
                              between: Callable[[], object] | None = None) -> dict[str, float]:
    """Median seconds per call of each of ``fns``: :func:`interleaved_rounds` of one loop of
    ``number`` calls each, after ``warmup`` calls of each."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
        if between is not None:
            between()

    def loop(fn: Callable[[], object]) -> Callable[[], float]:
        def one_round() -> float:
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            return (time.perf_counter() - t0) / number
        return one_round

    samples = interleaved_rounds({name: loop(fn) for name, fn in fns.items()}, repeat, between)
    return {name: statistics.median(values) for name, values in samples.items()}


def time_loop(loop: Callable[[int], object], number: int = 20000, repeat: int = 7) -> float:
    """Median seconds per iteration of ``loop(number)``, a function running its own loop.

    Use this form to compare against raw bindings without an extra Python frame per call.
    """
    loop(min(number, 1000))
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        loop(number)
        samples.append((time.perf_counter() - t0) / number)
    return statistics.median(samples)


def optional_import(name: str):
    try:
        return __import__(name, fromlist=["_"])
    except Exception:
        return None


class Table:
    """Rows of (metric, value, unit, note) printed as an aligned text table."""

    def __init__(self, title: str):
        self.title = title
        self.rows: list[dict] = []

    def add(self, metric: str, value: float | None, unit: str = "µs", note: str = "") -> None:
        self.rows.append({"metric": metric, "value": value, "unit": unit, "note": note})

    def render(self) -> str:
        w = max([len(r["metric"]) for r in self.rows] + [6])
        lines = [self.title, "=" * len(self.title)]
        for r in self.rows:
            v = r["value"]
            val = "n/a" if v is None else (f"{v:10.3f}" if isinstance(v, float) else f"{v:>10}")
            lines.append(f"{r['metric']:<{w}}  {val} {r['unit']:<4} {r['note']}")
        return "\n".join(lines)


def environment(backend_name: str, device_name: str) -> dict:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "backend": backend_name,
        "device": device_name,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def parse_args(description: str, flags: tuple[tuple[str, str], ...] = ()) -> argparse.Namespace:
    """``--json PATH`` and ``--quick``, plus a benchmark's own on/off ``flags`` ((name, help)
    pairs, such as ``("--fills-only", "...")``)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", default=None, help="write results as JSON to this path")
    p.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    for name, text in flags:
        p.add_argument(name, action="store_true", help=text)
    return p.parse_args()


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2, default=str)


def interleaved(loops: dict[str, Callable[[int], object]], number: int = 20000,
                rounds: int = 9) -> dict[str, float]:
    """Median seconds per iteration for each loop, measured round-robin.

    Alternating the contenders within each round spreads clock and cache drift evenly, so
    ratios between them are more stable than back-to-back measurements.
    """
    for loop in loops.values():
        loop(min(number, 1000))
    samples: dict[str, list[float]] = {k: [] for k in loops}
    for _ in range(rounds):
        for key, loop in loops.items():
            t0 = time.perf_counter()
            loop(number)
            samples[key].append((time.perf_counter() - t0) / number)
    return {k: statistics.median(v) for k, v in samples.items()}
