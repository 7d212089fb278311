"""Thread safety: an 8-thread soak, frees from finalizers inside the allocator's own calls,
and the lock being dropped around blocking driver calls."""

from __future__ import annotations

import gc
import queue
import random
import threading
import time

import pytest

from cudalab.allocator.caching import DeviceCachingAllocator
from cudalab.allocator.config import AllocatorConfig
from cudalab.allocator.hooks import attach_trace

KiB = 1024
MiB = 1024 * 1024


def make(backend):
    return DeviceCachingAllocator(backend, 0, AllocatorConfig(), stream_resolver=lambda: 0)


def test_eight_thread_soak(backend):
    import cudalab

    streams = [cudalab.Stream() for _ in range(3)]
    keys = [0] + [s.cuda_stream for s in streams]
    a = make(backend)
    handoff: queue.Queue = queue.Queue()  # pointers freed by another thread than their owner
    errors: list[BaseException] = []
    counts = [0] * 8
    stop = time.monotonic() + 2.0

    def worker(n: int) -> None:
        rng = random.Random(n)
        mine: list[int] = []
        try:
            while time.monotonic() < stop:
                r = rng.random()
                if mine and (len(mine) > 16 or r < 0.45):
                    p = mine.pop(rng.randrange(len(mine)))
                    if rng.random() < 0.2:
                        handoff.put(p)
                    else:
                        a.free(p)
                elif r < 0.5:
                    try:
                        a.free(handoff.get_nowait())
                    except queue.Empty:
                        pass
                else:
                    size = rng.choice((rng.randint(1, 4 * KiB), rng.randint(4 * KiB, 2 * MiB),
                                       rng.randint(2 * MiB, 24 * MiB)))
                    p = a.malloc(size, rng.choice(keys))
                    if rng.random() < 0.1:
                        a.record_stream(p, rng.choice(streams))
                    mine.append(p)
                if rng.random() < 0.005:
                    a.empty_cache()
                if rng.random() < 0.01:
                    a.memory_stats()
                    a.segments()
                counts[n] += 1
            for p in mine:
                a.free(p)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a worker is stuck (deadlock?)"
    assert errors == []
    while not handoff.empty():
        a.free(handoff.get_nowait())
    assert min(counts) > 100
    for s in streams:
        s.synchronize()
    a.process_events()
    a.check_invariants()
    s = a.memory_stats()
    assert s["allocation.all.current"] == 0 and s["allocated_bytes.all.current"] == 0
    assert s["active.all.current"] == 0 and s["requested_bytes.all.current"] == 0
    assert s["allocation.all.allocated"] == s["allocation.all.freed"] > 1000
    a.empty_cache()
    s = a.memory_stats()
    assert s["reserved_bytes.all.current"] == 0 and s["segment.all.current"] == 0
    assert s["num_device_alloc"] == s["num_device_free"]


def test_free_while_this_thread_holds_the_lock_is_deferred(backend):
    a = make(backend)
    p = a.malloc(1000)
    with a._lock:  # as if a finalizer ran inside this thread's own allocator call
        a.free(p)  # must not deadlock
        assert len(a.pending_frees) == 1
    s = a.memory_stats()  # readers apply deferred frees first
    assert s["allocated_bytes.all.current"] == 0 and not a.pending_frees
    with pytest.raises(ValueError, match="double free"):
        a.free(p)
    a.check_invariants()
    a.empty_cache()


def test_finalizer_freeing_inside_malloc_does_not_deadlock(backend):
    a = make(backend)

    class Owner:
        def __init__(self, ptr: int):
            self.ptr = ptr
            self.cycle = self  # only the cycle collector can free it

        def __del__(self):
            a.free(self.ptr)

    owners = [Owner(a.malloc(n)) for n in (100, 5000, 3 * MiB)]
    del owners
    # The trace hook runs inside malloc with the lock held: collect garbage right there.
    a._trace = lambda *args: gc.collect()
    p = a.malloc(2000)
    a._trace = None
    assert len(a.pending_frees) == 3
    q = a.malloc(2000)  # the next call merges the deferred frees
    assert not a.pending_frees
    s = a.memory_stats()
    assert s["allocation.all.current"] == 2 and s["allocation.all.freed"] == 3
    a.free(p)
    a.free(q)
    a.check_invariants()
    a.empty_cache()
    assert a.memory_stats()["reserved_bytes.all.current"] == 0


class _SlowAllocBackend:
    """Delegates to a backend; mem_alloc blocks until ``release`` is set."""

    def __init__(self, inner):
        self._inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()

    def mem_alloc(self, device, nbytes):
        self.entered.set()
        assert self.release.wait(30)
        return self._inner.mem_alloc(device, nbytes)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_lock_is_not_held_across_device_allocation(backend):
    slow = _SlowAllocBackend(backend)
    slow.release.set()
    a = make(slow)
    warm = a.malloc(1000)  # a cached small segment
    a.free(warm)
    slow.release.clear()
    slow.entered.clear()
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("p", a.malloc(30 * MiB)))
    t.start()
    assert slow.entered.wait(30)
    # While the other thread waits in mem_alloc, cache hits and frees still work here.
    for _ in range(100):
        a.free(a.malloc(1000))
    s = a.memory_stats()
    assert s["segment.all.current"] == 1
    slow.release.set()
    t.join(30)
    assert not t.is_alive()
    a.free(result["p"])
    a.check_invariants()
    a.empty_cache()
    assert a.memory_stats()["reserved_bytes.all.current"] == 0


def _lockfree_lines() -> tuple[int, int]:
    """The first and last line of free()'s lock-free deferral, up to its check for a flush
    (the lines after it run only when a flush came in between, which the test causes)."""
    import inspect

    src, first = inspect.getsourcelines(DeviceCachingAllocator.free)
    start = next(i for i, s in enumerate(src) if "box = self._ready" in s)
    end = next(i for i, s in enumerate(src) if "if self._ready is box:" in s)
    return first + start, first + end


def _deferral_scenario(backend, history: bool, inject_at: int | None):
    """Two allocators (memo on / off) with a memo hit out; the memo one frees it while a
    flush is injected before line ``inject_at`` of free(). Returns the lines free() ran."""
    import sys

    import cudalab
    from cudalab.memory_tools import history as h

    allocs = [make(backend), make(backend)]
    allocs[1]._memo_ok = False
    logs: list[list] = [[], []]
    s = cudalab.default_stream(0)  # a Stream object: pure hits
    if history:
        for a, log in zip(allocs, logs):
            attach_trace(a, h._make_trace(h._Recorder(0), h._NEVER, log.append))
    for a in allocs:
        a.free(a.malloc(64, s))  # a cached segment to carve from
        for _ in range(3):
            a.free(a.malloc(4096, s))
    a = allocs[0]
    assert a.memo_block is not None
    p = a.malloc(4096, s)  # a hit: the memo block is allocated
    q = allocs[1].malloc(4096, s)
    lo, hi = _lockfree_lines()
    ran: list[int] = []

    def tracer(frame, event, arg):
        if frame.f_code is DeviceCachingAllocator.free.__code__:
            if event == "line" and lo <= frame.f_lineno <= hi:
                ran.append(frame.f_lineno)
                if frame.f_lineno == inject_at and ran.count(inject_at) == 1:
                    with a._lock:  # what a flush in another thread does
                        a._flush_memo()
            return tracer
        return None

    sys.settrace(tracer)
    try:
        a.free(p)
    finally:
        sys.settrace(None)
    allocs[1].free(q)
    assert a.memory_stats() == allocs[1].memory_stats()
    a.check_invariants()
    if history:  # (memory_stats wrote out what was logged as times)
        assert [(e[0], e[2]) for e in logs[0]] == [(e[0], e[2]) for e in logs[1]]
        assert [e[4] for e in logs[0]] == sorted(e[4] for e in logs[0])
    assert a.owns(p) is False
    with pytest.raises(ValueError, match="double free"):
        a.free(p)
    r = a.malloc(4096, s)  # the block is usable again, once
    assert r == p and a.memory_stats()["allocation.all.current"] == 1
    a.free(r)
    a.check_invariants()
    return ran


@pytest.mark.parametrize("history", [False, True], ids=["no-history", "stackless-history"])
def test_flush_at_any_point_of_a_lockfree_deferral(backend, history):
    """Another thread's flush (lock held) may run between any two lines of free()'s
    lock-free deferral: the block is then freed exactly once, by one side or the other;
    every counter (and, with history, every entry) matches the same operations without
    the memo."""
    lines = sorted(set(_deferral_scenario(backend, history, None)))
    assert len(lines) >= 4  # the deferral ran without the lock
    for line in lines:
        ran = _deferral_scenario(backend, history, line)
        assert line in ran
