"""Many replays of one trace at once: worker processes sharing the trace's columns.

The replays of a settings search (:func:`cudalab.memory_tools.autotune.autotune`) are
independent: each drives a fresh allocator over a private simulator. :func:`run_replays`
runs a list of ``(settings, device_memory)`` jobs over one
:class:`~cudalab.memory_tools.replay.ReplayPlan`, in this process (one worker) or in worker
processes. The plan travels once, as columns: its int64 arrays are copied into one
``multiprocessing.shared_memory`` block that every worker maps, so a 1M-entry trace costs
each worker one ``tolist()`` of those columns (no pickled dicts, no copy per job). Each job
returns a :class:`~cudalab.memory_tools.replay.ReplayResult` (its timeline is ~1,000 points).

Workers are forked on Linux when this process runs one thread (nothing is imported again),
else started by ``forkserver`` (safe in a process with threads, as a Jupyter kernel is; a
script must then guard its top level with ``if __name__ == "__main__":``, as
:mod:`multiprocessing` requires), ``spawn`` where neither exists; ``CUDALAB_REPLAY_START``
names another start method. If the workers cannot start, the replays run serially here, with
a warning. The
worker count defaults to the CPUs this process may use (``os.sched_getaffinity``), at most
one per job; one worker (or ``CUDALAB_REPLAY_WORKERS=1``) replays serially in this process.
A job whose settings cannot be replayed comes back as its error text, never dropped.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cudalab.memory_tools.replay import ReplayPlan, ReplayResult, replay_planned
from cudalab.memory_tools.trace_io import TraceArrays

__all__ = ["Follow", "Job", "JobOutcome", "available_cpus", "default_workers", "run_replays"]

#: One replay: (settings string, device memory in bytes or None for an unconstraining one).
Job = tuple[str, "int | None"]
#: A job's outcome: its result, or the text of the error that stopped it.
JobOutcome = "ReplayResult | str"

_COLUMNS = ("index", "action", "size", "stream", "slot")
# The worker's copy of the trace (set once per worker process by _attach).
_STATE: dict[str, Any] = {}


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - macOS, Windows
        return max(1, os.cpu_count() or 1)


def default_workers(jobs: int) -> int:
    """``CUDALAB_REPLAY_WORKERS`` when set (an int >= 1), else the available CPUs; at most
    ``jobs``."""
    text = os.environ.get("CUDALAB_REPLAY_WORKERS", "").strip()
    if text:
        try:
            wanted = int(text)
        except ValueError:
            raise ValueError(f"CUDALAB_REPLAY_WORKERS must be a whole number >= 1, got "
                             f"{text!r}") from None
        if wanted < 1:
            raise ValueError(f"CUDALAB_REPLAY_WORKERS must be >= 1, got {wanted}")
    else:
        wanted = available_cpus()
    return max(1, min(wanted, jobs))


def _columns(plan: ReplayPlan) -> dict[str, np.ndarray]:
    return {
        "index": np.ascontiguousarray(plan.index, dtype=np.int64),
        "action": np.asarray(plan.action, dtype=np.int64),
        "size": np.asarray(plan.size, dtype=np.int64),
        "stream": np.asarray(plan.stream, dtype=np.int64),
        "slot": np.asarray(plan.slot, dtype=np.int64),
    }


def _attach(shm_name: str, n: int, meta: dict[str, Any]) -> None:
    """Worker initializer: map the shared columns and rebuild the plan once."""
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name=shm_name)
    try:
        block = np.ndarray((len(_COLUMNS), n), dtype=np.int64, buffer=shm.buf)
        cols = {name: block[i] for i, name in enumerate(_COLUMNS)}
        plan = ReplayPlan(
            index=cols["index"].copy(), action=cols["action"].tolist(),
            size=cols["size"].tolist(), stream=cols["stream"].tolist(),
            slot=cols["slot"].tolist(), n_entries=meta["n_entries"],
            skipped=meta["skipped"], truncated=meta["truncated"],
            peak_live=meta["peak_live"])
        del block, cols
    finally:
        shm.close()
    tr = TraceArrays(source=meta["source"], action=np.zeros(0, np.int8),
                     addr=np.zeros(0, np.int64), size=np.zeros(0, np.int64), stream=[],
                     ignored=meta["ignored"], reference=meta["reference"],
                     segments=meta["segments"])
    _STATE["plan"] = plan
    _STATE["trace"] = tr
    _STATE["stop_at_oom"] = bool(meta.get("stop_at_oom", False))


def _run_one(job: tuple[str, int | None]) -> ReplayResult | str:
    config, memory = job
    try:
        return replay_planned(_STATE["trace"], _STATE["plan"], config, memory, None,
                              _STATE["stop_at_oom"])
    except (ValueError, TypeError, MemoryError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _start_method() -> str:
    import multiprocessing as mp

    wanted = os.environ.get("CUDALAB_REPLAY_START", "").strip()
    methods = mp.get_all_start_methods()
    if wanted:
        if wanted not in methods:
            raise ValueError(f"CUDALAB_REPLAY_START must be one of {', '.join(methods)}, "
                             f"got {wanted!r}")
        return wanted
    if "fork" in methods and sys.platform.startswith("linux") and threading.active_count() == 1:
        return "fork"  # nothing to inherit a held lock from; no module is imported again
    return "forkserver" if "forkserver" in methods else "spawn"


Follow = Callable[[tuple[str, "int | None"], "ReplayResult | str"],
                  Sequence[tuple[str, "int | None"]]]


def run_replays(tr: TraceArrays, plan: ReplayPlan, jobs: Sequence[tuple[str, int | None]], *,
                workers: int | None = None,
                progress: Callable[[int, int], None] | None = None,
                follow: Follow | None = None,
                stop_at_oom: bool = False) -> list[ReplayResult | str]:
    """Replay ``plan`` once per job, in parallel worker processes when there are several.

    Parameters
    ----------
    tr : TraceArrays
        The trace ``plan`` was made from (its source, segments and reference values).
    plan : ReplayPlan
        :func:`~cudalab.memory_tools.replay.plan_replay` of ``tr``.
    jobs : sequence of (str, int or None)
        Settings string and device memory (None: an unconstraining device) of each replay.
    workers : int, optional
        Worker processes (default :func:`default_workers`); 1 replays in this process.
    progress : callable, optional
        ``progress(done, total)`` after each job.
    follow : callable, optional
        ``follow(job, outcome) -> more jobs``, called in this process as each job (given or
        followed) finishes: the jobs it returns are queued at once (the workers never wait
        for a batch to end).

    Returns
    -------
    list of ReplayResult or str
        One per job of ``jobs``, in their order: the result, or the error text of a job
        whose settings could not be replayed (followed jobs reach ``follow`` only).
    """
    jobs = list(jobs)
    if workers is None:
        workers = default_workers(len(jobs))
    elif not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    workers = min(workers, max(1, len(jobs)))
    if workers == 1:
        return _run_serial(tr, plan, jobs, progress, follow, stop_at_oom)
    from concurrent.futures.process import BrokenProcessPool

    try:
        return _run_parallel(tr, plan, jobs, workers, progress, follow, stop_at_oom)
    except (BrokenProcessPool, OSError) as exc:
        warnings.warn(f"replay workers could not run ({type(exc).__name__}: {exc}); replaying "
                      "serially in this process", RuntimeWarning, stacklevel=2)
        return _run_serial(tr, plan, jobs, progress, follow, stop_at_oom)


def _run_serial(tr: TraceArrays, plan: ReplayPlan, jobs: list[tuple[str, int | None]],
                progress: Callable[[int, int], None] | None, follow: Follow | None,
                stop_at_oom: bool = False) -> list[ReplayResult | str]:
    queue = list(jobs)
    out: list[ReplayResult | str] = []
    i = 0
    while i < len(queue):
        config, memory = queue[i]
        outcome: ReplayResult | str
        try:
            outcome = replay_planned(tr, plan, config, memory, None, stop_at_oom)
        except (ValueError, TypeError) as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        if i < len(jobs):
            out.append(outcome)
        if follow is not None:
            queue.extend(follow(queue[i], outcome))
        i += 1
        if progress is not None:
            progress(i, len(queue))
    return out


def _run_parallel(tr: TraceArrays, plan: ReplayPlan, jobs: list[tuple[str, int | None]],
                  workers: int, progress: Callable[[int, int], None] | None,
                  follow: Follow | None, stop_at_oom: bool = False
                  ) -> list[ReplayResult | str]:
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from multiprocessing import shared_memory

    cols = _columns(plan)
    n = len(plan.action)
    shm = shared_memory.SharedMemory(create=True, size=max(8, 8 * n * len(_COLUMNS)))
    try:
        block = np.ndarray((len(_COLUMNS), n), dtype=np.int64, buffer=shm.buf)
        for i, name in enumerate(_COLUMNS):
            block[i] = cols[name]
        del block
        meta = {"n_entries": plan.n_entries, "skipped": dict(plan.skipped),
                "truncated": plan.truncated, "peak_live": plan.peak_live,
                "source": tr.source, "ignored": dict(tr.ignored),
                "reference": dict(tr.reference), "segments": list(tr.segments),
                "stop_at_oom": stop_at_oom}
        # Longest first (unconstraining devices replay more, async replays are slower), so
        # the last worker to finish does not start the longest job last.
        order = sorted(range(len(jobs)), key=lambda i: (jobs[i][1] is not None, i))
        results: dict[int, ReplayResult | str] = {}
        ctx = mp.get_context(_start_method())
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_attach,
                                 initargs=(shm.name, n, meta)) as pool:
            futures = {pool.submit(_run_one, jobs[i]): (i, jobs[i]) for i in order}
            total = len(jobs)
            done = 0
            while futures:
                finished, _ = wait(futures, return_when=FIRST_COMPLETED)
                for future in finished:
                    i, job = futures.pop(future)
                    outcome = future.result()
                    if i >= 0:
                        results[i] = outcome
                    if follow is not None:
                        for more in follow(job, outcome):
                            futures[pool.submit(_run_one, more)] = (-1, more)
                            total += 1
                    done += 1
                    if progress is not None:
                        progress(done, total)
        return [results[i] for i in range(len(jobs))]
    finally:
        shm.close()
        shm.unlink()
