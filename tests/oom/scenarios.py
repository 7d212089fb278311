"""Out-of-memory scenarios with known causes, one per verdict of cudalab.oom.

Each scenario fills the current device (sizes are fractions of its memory, so the same code
runs on the simulator and on a GPU), makes an allocation fail, explains the error with
``cudalab.oom.explain_oom(error=...)`` while the cause is still in place, then undoes
everything. :func:`run` returns ``(expected verdict, explanation)``.

On the simulator, ``other_process`` uses the simulator's ``occupy_as_other_process``; on a
GPU it starts a child process that holds the memory. ``outside_allocator`` allocates with
the driver directly (``cuMemAlloc``), outside every allocator.
"""

from __future__ import annotations

import contextlib
import gc
import os
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


def _explain(exc: BaseException, **kwargs: Any) -> Any:
    return explain_oom(error=exc, **kwargs)


def live_arrays() -> Any:
    free, total = _free_total()
    keep = [cudalab.empty(int(free * 0.35), dtype="uint8") for _ in range(2)]
    exc = _fail(free * 0.5)
    try:
        return _explain(exc)
    finally:
        del keep, exc


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
    exc = _fail(chunk * 2)
    try:
        return _explain(exc)
    finally:
        del keep, exc
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
    exc = _fail(free * 0.5)
    try:
        expl = _explain(exc)
        return expl
    finally:
        del exc
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
    exc = _fail(free * 0.5)
    try:
        return _explain(exc)
    finally:
        del exc, pool
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
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # NVML's process list catches up
        yield
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=60)


def other_process() -> Any:
    free, total = _free_total()
    with contextlib.contextmanager(_other_process)(int(free * 0.7)):
        exc = _fail(free * 0.5)
        try:
            return _explain(exc)
        finally:
            del exc


def outside_allocator() -> Any:
    free, total = _free_total()
    backend = _internal.backend()
    ptr = backend.mem_alloc(0, int(free * 0.7))  # a raw cuMemAlloc, outside every allocator
    try:
        exc = _fail(free * 0.5)
        try:
            return _explain(exc)
        finally:
            del exc
    finally:
        backend.mem_free(0, ptr)


def request_too_large() -> Any:
    free, total = _free_total()
    exc = _fail(total * 2)
    try:
        return _explain(exc)
    finally:
        del exc


def fraction_limit() -> Any:
    free, total = _free_total()
    cm.set_per_process_memory_fraction(0.3)
    try:
        keep = cudalab.empty(int(total * 0.2), dtype="uint8")
        exc = _fail(total * 0.15)
        try:
            return _explain(exc)
        finally:
            del keep, exc
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
        exc = _fail(free * 0.5)
        try:
            return _explain(exc)
        finally:
            del exc
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
