"""Ctrl-C never leaves the allocator broken: SIGINT simulated at every line and every bytecode
of its malloc and free paths (cache hit, memo hits, slow path, plain and lock-free frees,
frees queued while the lock is busy, empty_cache), then: the KeyboardInterrupt reached the
caller (never raised inside the allocator), the lock is free, the invariants hold, and the
next allocation succeeds from this thread and from another one (within a timeout, so a
wedged lock fails instead of hanging)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

import cudalab
from cudalab import _interrupts
from cudalab.allocator.caching import DeviceCachingAllocator
from cudalab.allocator.config import AllocatorConfig
from tests.helpers.interrupts import count_events, frames_of, interrupt_at

ALLOCATOR_DIR = os.path.dirname(os.path.abspath(DeviceCachingAllocator.__init__.__code__.co_filename))
KiB = 1024
MiB = 1024 * 1024


def in_allocator(frame) -> bool:
    return os.path.dirname(frame.f_code.co_filename) == ALLOCATOR_DIR


def make(backend) -> DeviceCachingAllocator:
    return DeviceCachingAllocator(backend, 0, AllocatorConfig(), stream_resolver=lambda: 0)


def _alloc_in_thread(a: DeviceCachingAllocator) -> None:
    done: list[int] = []
    t = threading.Thread(target=lambda: done.append(a.malloc(3 * KiB)), daemon=True)
    t.start()
    t.join(5.0)
    assert done, "an allocation from another thread did not finish: the lock is wedged"
    a.free(done[0])


def check_after(a: DeviceCachingAllocator, exc: BaseException | None) -> None:
    assert isinstance(exc, KeyboardInterrupt), "the interrupt was lost"
    inside = [f.f_code.co_name for f in frames_of(exc.__traceback__) if in_allocator(f)]
    assert not inside, f"KeyboardInterrupt raised inside the allocator ({inside})"
    assert not a._lock.locked(), "the allocator lock is still held"
    a.check_invariants()
    p = a.malloc(5 * KiB)
    a.free(p)
    _alloc_in_thread(a)
    for ptr in list(a.live):
        a.free(ptr)
    a.check_invariants()
    a.empty_cache()


def _scenarios(backend):
    """name -> set-up returning (allocator, the operation to interrupt)."""
    s = cudalab.default_stream(0)

    def cache_hit():
        a = make(backend)
        a.free(a.malloc(64))  # a cached small segment
        return a, lambda: a.malloc(4 * KiB)

    def memo_hit():
        a = make(backend)
        a.free(a.malloc(64))
        a.free(a.malloc(4 * KiB))  # sets the memo up
        return a, lambda: a.malloc(4 * KiB - 100)  # same rounded size, another request

    def pure_hit_and_free():
        a = make(backend)
        a.free(a.malloc(64, s))
        a.free(a.malloc(4 * KiB, s))
        return a, lambda: a.free(a.malloc(4 * KiB, s))

    def slow_path():
        a = make(backend)
        return a, lambda: a.malloc(3 * MiB)

    def plain_free():
        a = make(backend)
        p = a.malloc(64)
        q = a.malloc(4 * KiB)  # (not the last malloc's block: no memo)
        del q
        return a, lambda: a.free(p)

    def memo_free():
        a = make(backend)
        a.free(a.malloc(64))
        p = a.malloc(4 * KiB)
        return a, lambda: a.free(p)

    def free_while_busy():
        a = make(backend)
        p = a.malloc(4 * KiB)
        a.malloc(64)

        def op():
            a._lock.acquire()  # a finalizer inside the allocator's own call
            try:
                a.free(p)  # queued
            finally:
                a._lock.release()
            a.free(a.malloc(8 * KiB))  # drains the queue

        return a, op

    def empty_cache():
        a = make(backend)
        p = a.malloc(4 * KiB)
        a.free(a.malloc(3 * MiB))
        a.free(p)
        return a, a.empty_cache

    return {f.__name__: f for f in (cache_hit, memo_hit, pure_hit_and_free, slow_path,
                                     plain_free, memo_free, free_while_busy, empty_cache)}


SCENARIOS = ["cache_hit", "memo_hit", "pure_hit_and_free", "slow_path", "plain_free",
             "memo_free", "free_while_busy", "empty_cache"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_interrupt_at_every_line_and_bytecode(backend, deferring, name):
    setup = _scenarios(backend)[name]
    for opcodes in (False, True):
        a, op = setup()
        n = count_events(op, in_allocator, opcodes)
        for ptr in list(a.live):
            a.free(ptr)
        a.empty_cache()
        assert n > 5
        for k in range(1, n + 1):
            a, op = setup()
            returned, exc, tripped = interrupt_at(op, in_allocator, k, opcodes)
            # the interrupt is delivered once the main thread left the allocator: after the
            # operation, or between two of its allocator calls (free_while_busy and
            # pure_hit_and_free make several), never inside one (check_after)
            assert tripped and (returned or exc is not None), f"event {k}: nothing came back"
            check_after(a, exc)


def test_without_the_wrapper_an_interrupt_breaks_the_allocator(backend):
    """The injection is real: with Python's own handler, some event of the malloc path raises
    KeyboardInterrupt inside the allocator and leaves it broken (its lock held, or its
    structure inconsistent)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        setup = _scenarios(backend)["cache_hit"]
        a, op = setup()
        n = count_events(op, in_allocator)
        broken = 0
        for k in range(1, n + 1):
            a, op = setup()
            _, exc, _ = interrupt_at(op, in_allocator, k)
            assert isinstance(exc, KeyboardInterrupt)
            if a._lock.locked():
                broken += 1
                continue
            try:
                a.check_invariants()
            except AssertionError:
                broken += 1
        assert broken
    finally:
        signal.signal(signal.SIGINT, old)


def test_deferring_is_decided_by_the_first_guarded_or_open_frame(deferring):
    import sys

    here = sys._getframe()
    assert not _interrupts.deferring(here)
    _interrupts.guard(test_deferring_is_decided_by_the_first_guarded_or_open_frame)
    try:
        assert _interrupts.deferring(here)
        _interrupts.open_code(here.f_code)
        assert not _interrupts.deferring(here)
    finally:
        _interrupts.close_code(here.f_code)
        _interrupts._guarded_codes.discard(here.f_code)
    with pytest.raises(TypeError, match="functions or code objects"):
        _interrupts.guard(42)


def test_a_forked_child_forgets_an_owed_interrupt(deferring):
    """The helper thread does not survive fork: a child starts with nothing owed, a free lock
    and the switch interval put back."""
    import os
    import sys
    import time

    switch = sys.getswitchinterval()
    here = sys._getframe()
    _interrupts.guard(here.f_code)  # an interrupt arriving in this test is owed, not raised
    try:
        _interrupts._DeferringHandler(signal.default_int_handler)(signal.SIGINT, here)
        assert _interrupts._owed and _interrupts._poller is not None
        with _interrupts._lock:  # (the helper could hold it at the fork)
            pid = os.fork()
            if pid == 0:
                ok = (not _interrupts._owed and _interrupts._poller is None
                      and _interrupts._lock.acquire(timeout=1)
                      and sys.getswitchinterval() == switch)
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        _interrupts._owed = False  # (nothing to deliver in this test)
    finally:
        _interrupts._guarded_codes.discard(here.f_code)
    deadline = time.monotonic() + 2
    while _interrupts._poller is not None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert _interrupts._poller is None and sys.getswitchinterval() == switch
