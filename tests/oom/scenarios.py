"""Out-of-memory scenarios with known causes, one per verdict of cudalab.oom.

Each scenario fills the current device (sizes are fractions of its free memory, so the same
code runs on the simulator and on a GPU), makes an allocation fail, explains the error with
``cudalab.oom.explain_oom(error=...)`` while the cause is still in place, then undoes
everything. :func:`run` returns ``(expected verdict, explanation)``.

A large device is first scaled down (:func:`scaled_device`): one live cudalab array (the
*ballast*, a model's weights as the verdicts see them) takes all but :data:`SCENARIO_BYTES`
of the free memory, so each scenario allocates, fills and frees a few GiB instead of a
140 GB H200's whole memory, and the device is still really full at each error (the
accounting still covers the whole device). The ballast is live memory of cudalab's that
Python names keep (not disposable), so it is what the ``live_arrays`` verdict stands for and
never the cause another verdict names.

On the simulator, ``other_process`` uses the simulator's ``occupy_as_other_process``; on a
GPU it starts a child process that holds the memory (bounded: :data:`CHILD_TIMEOUT_S`).
``outside_allocator`` allocates with the driver directly (``cuMemAlloc``), outside every
allocator.
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import cudalab
import cudalab.memory as cm
from cudalab import _internal
from cudalab.errors import OutOfMemoryError
from cudalab.oom import explain_oom

GiB = 1 << 30
MiB = 1 << 20
#: Free bytes a scenario works in: a device with more than twice this free is scaled down
#: to it by :func:`scaled_device`.
SCENARIO_BYTES = 16 * GiB
#: Seconds a scenario's child process may take to start (CUDA context, allocation) or end.
CHILD_TIMEOUT_S = 60
#: The ballast array while :func:`scaled_device` holds one (a module global: a name the
#: user would keep, so never disposable).
BALLAST: list[Any] = []


@contextlib.contextmanager
def scaled_device() -> Iterator[int]:
    """Hold a live array of all but :data:`SCENARIO_BYTES` of the free memory while a device
    has more than twice that free (see the module documentation); yields its bytes (0: no
    ballast, the device is small enough as it is)."""
    free, _ = _free_total()
    extra = (free - SCENARIO_BYTES) >> 21 << 21
    if free <= 2 * SCENARIO_BYTES or extra <= 0:
        yield 0
        return
    BALLAST.append(cudalab.empty(extra, dtype="uint8"))
    try:
        yield extra
    finally:
        BALLAST.pop()  # (this one: an outer scaled_device keeps its own)
        gc.collect()
        cm.empty_cache()


def _free_total() -> tuple[int, int]:
    cm.empty_cache()
    return cm.mem_get_info()


def _fail(nbytes: int) -> OutOfMemoryError:
    try:
        x = cudalab.empty(int(nbytes), dtype="uint8")
    except OutOfMemoryError as exc:
        return exc
    del x
    raise AssertionError(f"allocating {nbytes} bytes did not run out of memory")


def _fail_and_explain(nbytes: float) -> Any:
    """Allocate ``nbytes`` (it must run out of memory) and explain that error while its
    cause is in place (the explanation keeps the error; this frame's reference goes)."""
    return explain_oom(error=_fail(int(nbytes)))


def live_arrays() -> Any:
    free, total = _free_total()
    keep = [cudalab.empty(int(free * 0.35), dtype="uint8") for _ in range(2)]
    try:
        return _fail_and_explain(free * 0.5)
    finally:
        del keep


def fragmentation() -> Any:
    free, total = _free_total()
    chunk = max(64 * MiB, (free // 64) >> 21 << 21)  # ~64 segments of 2 halves
    halves: list[Any] = []
    keep: list[Any] = []
    n = int(free // chunk) - 1
    for _ in range(n):
        a = cudalab.empty(chunk, dtype="uint8")
        del a  # a cached segment of `chunk` bytes ...
        x = cudalab.empty(chunk // 2, dtype="uint8")  # ... split in two halves
        y = cudalab.empty(chunk // 2, dtype="uint8")
        halves.append(x)
        keep.append(y)
    del x, y
    halves.clear()  # every segment keeps a free half that cannot be released
    try:
        return _fail_and_explain(chunk * 2)
    finally:
        del keep
        cm.empty_cache()


def _hold_in_traceback(nbytes: int) -> None:
    big = cudalab.empty(nbytes, dtype="uint8")  # noqa: F841 - kept alive by the traceback
    raise RuntimeError("a cell failed after allocating")


def held_by_python() -> Any:
    free, total = _free_total()
    try:
        _hold_in_traceback(int(free * 0.7))
    except RuntimeError as err:
        sys.last_type, sys.last_value, sys.last_traceback = type(err), err, err.__traceback__
    try:
        return _fail_and_explain(free * 0.5)
    finally:
        _clear_last()


def _clear_last() -> None:
    for name in ("last_type", "last_value", "last_traceback"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()
    cm.empty_cache()


def private_pool() -> Any:
    free, total = _free_total()
    pool = cm.MemPool()
    with cm.use_mem_pool(pool):
        inside = cudalab.empty(int(free * 0.7), dtype="uint8")
    del inside  # the pool keeps its segment (the pool is alive)
    try:
        return _fail_and_explain(free * 0.5)
    finally:
        del pool
        gc.collect()
        cm.empty_cache()


def _other_process(nbytes: int) -> Iterator[None]:
    backend = _internal.backend()
    if backend.simulated:
        ptr = backend.occupy_as_other_process(0, nbytes, pid=4242)
        try:
            yield
        finally:
            backend.mem_free(0, ptr)
        return
    code = ("import sys, time, cudalab\n"
            f"x = cudalab.empty({nbytes}, dtype='uint8')\n"
            "cudalab.synchronize()\nprint('ready', flush=True)\nsys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "CUDALAB_SIMULATOR": ""})
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], CHILD_TIMEOUT_S)
        line = child.stdout.readline().strip() if ready else "(no answer)"
        assert line == "ready", (f"the child process holding {nbytes:,} bytes did not start "
                                 f"within {CHILD_TIMEOUT_S} s: {line!r}")
        time.sleep(0.5)  # NVML's process list catches up
        yield
    finally:
        assert child.stdin is not None
        child.stdin.close()
        try:
            child.wait(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise


def other_process() -> Any:
    free, total = _free_total()
    with contextlib.contextmanager(_other_process)(int(free * 0.7)):
        return _fail_and_explain(free * 0.5)


def outside_allocator() -> Any:
    free, total = _free_total()
    backend = _internal.backend()
    ptr = backend.mem_alloc(0, int(free * 0.7))  # a raw cuMemAlloc, outside every allocator
    try:
        return _fail_and_explain(free * 0.5)
    finally:
        backend.mem_free(0, ptr)


def request_too_large() -> Any:
    free, total = _free_total()
    return _fail_and_explain(total * 2)


def fraction_limit() -> Any:
    """A fraction that leaves 30 % of the free memory to this process's allocator (whatever
    it holds already, the ballast included): 20 % is kept, a request of 15 % is refused
    while the device still has 80 % free."""
    free, total = _free_total()
    cm.set_per_process_memory_fraction((cm.memory_reserved() + 0.3 * free) / total)
    try:
        keep = cudalab.empty(int(free * 0.2), dtype="uint8")
        try:
            return _fail_and_explain(free * 0.15)
        finally:
            del keep
    finally:
        cm.set_per_process_memory_fraction(1.0)
        cm.empty_cache()


def _hold(stream: Any) -> Callable[[], None]:
    """Keep ``stream``'s queued work from completing (paused on the simulator, a long sleep
    kernel on a GPU); returns the function that lets it finish."""
    backend = _internal.backend()
    if hasattr(backend, "pause_stream"):
        backend.pause_stream(stream.handle)

        def resume() -> None:
            backend.resume_stream(stream.handle)
            stream.synchronize()
        return resume
    from cudalab._kernels.spin import gpu_sleep

    gpu_sleep(1_000_000_000, stream=stream)  # (the observer reads the state at the error)
    return stream.synchronize


def pending_frees() -> Any:
    """A block used on a busy side stream (record_stream) is freed while a CUDA-graph
    capture is underway on another stream: the allocator cannot synchronise the events at
    the out-of-memory (torch skips it during captures), so the freed bytes stay pending."""
    from cudalab.allocator import pools
    from cudalab.allocator.registry import existing_allocator

    free, total = _free_total()
    side = cudalab.Stream()
    resume = _hold(side)
    x = cudalab.empty(int(free * 0.7), dtype="uint8")
    cm.record_stream(x.data_ptr(), side)
    del x  # pending until the side stream's work is done
    alloc = existing_allocator(0)
    pid = pools.graph_pool_handle()
    alloc.begin_allocate_to_pool(pid, lambda stream: False)  # a capture on another stream
    try:
        return _fail_and_explain(free * 0.5)
    finally:
        alloc.end_allocate_to_pool(pid)
        alloc.release_pool(pid)
        resume()
        cm.empty_cache()


#: verdict -> the scenario that must produce it.
SCENARIOS: dict[str, Callable[[], Any]] = {
    "live_arrays": live_arrays,
    "fragmentation": fragmentation,
    "held_by_python": held_by_python,
    "private_pool": private_pool,
    "other_process": other_process,
    "outside_allocator": outside_allocator,
    "request_too_large": request_too_large,
    "fraction_limit": fraction_limit,
    "pending_frees": pending_frees,
}


def run(name: str) -> tuple[str, Any]:
    """(expected verdict, explanation) of scenario ``name``."""
    gc.collect()
    expl = SCENARIOS[name]()
    gc.collect()
    cm.empty_cache()
    return name, expl
