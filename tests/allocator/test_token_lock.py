"""cudalab.allocator.token_lock.TokenLock: threading.Lock's semantics from list.pop/append."""

from __future__ import annotations

import threading
import time

import pytest

from cudalab.allocator.token_lock import TokenLock


def test_acquire_release_and_errors():
    lk = TokenLock()
    assert not lk.locked()
    assert lk.acquire() is True and lk.locked()
    assert lk.acquire(False) is False  # not re-entrant
    assert lk.acquire(timeout=0.01) is False
    with pytest.raises(ValueError, match="non-blocking"):
        lk.acquire(False, 1.0)
    lk.release()
    with pytest.raises(RuntimeError, match="release unlocked lock"):
        lk.release()
    assert lk._box == [True]  # still exactly one token
    with lk:
        assert lk.locked()
        with pytest.raises(IndexError):
            lk.take()  # the hot-path form: IndexError while held
    assert not lk.locked() and "unlocked" in repr(lk)
    with pytest.raises(ValueError, match="non-negative"):
        lk.acquire(timeout=-5)


def test_mutual_exclusion_under_contention():
    lk = TokenLock()
    inside = [0]
    worst = [0]
    counter = [0]

    def work():
        for _ in range(3000):
            with lk:
                inside[0] += 1
                worst[0] = max(worst[0], inside[0])
                v = counter[0]
                time.sleep(0) if v % 97 == 0 else None  # hand the GIL over while holding it
                counter[0] = v + 1
                inside[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert worst[0] == 1
    assert counter[0] == 6 * 3000


def test_waiter_gets_the_lock_released_by_another_thread():
    lk = TokenLock()
    lk.acquire()
    got = threading.Event()

    def waiter():
        if lk.acquire(timeout=10):
            got.set()

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    assert not got.is_set()
    lk.release()
    t.join(10)
    assert got.is_set() and lk.locked()


def test_works_with_condition():
    lk = TokenLock()
    cond = threading.Condition(lk)
    box = []

    def producer():
        time.sleep(0.02)
        with cond:
            box.append(1)
            cond.notify()

    t = threading.Thread(target=producer)
    t.start()
    with cond:
        assert cond.wait_for(lambda: box, timeout=10)
    t.join(10)
    assert not lk.locked()


def test_with_acquire_and_the_raw_pair_move_one_token():
    lk = TokenLock()
    with lk as got:
        assert got is True and lk.locked()
        assert lk.acquire(False) is False
    assert lk.acquire() is True and lk._box == []
    with pytest.raises(IndexError):
        lk.take()
    lk.give(True)  # the raw release, as the allocator's hot path does it
    assert lk._box == [True]
    lk.take()
    lk.release()
    assert lk._box == [True] and not lk.locked()


def test_with_waits_for_a_holder_in_another_thread():
    lk = TokenLock()
    lk.acquire()
    entered = threading.Event()

    def waiter():
        with lk:
            entered.set()

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    assert not entered.is_set()
    lk.release()
    t.join(10)
    assert entered.is_set() and not lk.locked()
