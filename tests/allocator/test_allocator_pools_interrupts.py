"""Ctrl-C never leaves the private-pool bookkeeping half updated: SIGINT simulated at every
line and bytecode of begin/end_allocate_to_pool, routed allocations (hit and miss),
release_pool and the empty_cache that releases a freeable pool. Afterwards the interrupt
reached the caller, the lock is free, the invariants (pool segment counts, freeable set,
captures) hold, and the pool's state is the one before or the one after the operation."""

from __future__ import annotations

import pytest

from cudalab.allocator import pools
from tests.allocator.test_allocator_interrupts import (
    KiB,
    MiB,
    check_after,
    in_allocator,
    make,
)
from tests.helpers.interrupts import count_events, interrupt_at

CAPTURE = 7


def _capture(key: int):
    return lambda s: s == key


def _scenarios(backend):
    """name -> set-up returning (allocator, pool id, operation, allowed (use count, routed)
    states after it)."""

    def begin():
        a = make(backend)
        pid = pools.graph_pool_handle()
        return a, pid, lambda: a.begin_allocate_to_pool(pid, _capture(CAPTURE)), {(0, False), (1, True)}

    def routed_hit():
        a = make(backend)
        pid = pools.graph_pool_handle()
        a.begin_allocate_to_pool(pid, _capture(CAPTURE))
        a.free(a.malloc(64, CAPTURE))
        return a, pid, lambda: a.malloc(4 * KiB, CAPTURE), {(1, True)}

    def routed_miss():
        a = make(backend)
        pid = pools.graph_pool_handle()
        a.begin_allocate_to_pool(pid, _capture(CAPTURE))
        return a, pid, lambda: a.malloc(3 * MiB, CAPTURE), {(1, True)}

    def end():
        a = make(backend)
        pid = pools.graph_pool_handle()
        a.begin_allocate_to_pool(pid, _capture(CAPTURE))
        a.malloc(KiB, CAPTURE)
        return a, pid, lambda: a.end_allocate_to_pool(pid), {(1, True), (1, False)}

    def release_and_empty():
        a = make(backend)
        pid = pools.graph_pool_handle()
        a.begin_allocate_to_pool(pid, _capture(CAPTURE))
        a.free(a.malloc(3 * MiB, CAPTURE))
        a.free(a.malloc(KiB, CAPTURE))
        a.end_allocate_to_pool(pid)

        def op():
            a.release_pool(pid)
            a.empty_cache()

        return a, pid, op, {(1, False), (0, False)}

    return {f.__name__: f for f in (begin, routed_hit, routed_miss, end, release_and_empty)}


def _state(a, pid) -> tuple[int, bool]:
    return a.get_pool_use_count(pid), any(p == pid for p, _ in a._captures)


def _clean(a) -> None:
    for pid, _ in list(a._captures):
        a.end_allocate_to_pool(pid)
    for ptr in list(a.live):
        a.free(ptr)
    for pid, pp in list(a._pools.items()):
        while pp.use_count > 0:
            a.release_pool(pid)
    a.empty_cache()
    assert a.segments() == [] and a._pools == {}


@pytest.mark.parametrize("name", ["begin", "routed_hit", "routed_miss", "end",
                                  "release_and_empty"])
def test_interrupt_at_every_line_and_bytecode_of_the_pool_paths(backend, deferring, name):  # noqa: F811
    setup = _scenarios(backend)[name]
    for opcodes in (False, True):
        a, pid, op, allowed = setup()
        n = count_events(op, in_allocator, opcodes)
        _clean(a)
        assert n > 3
        for k in range(1, n + 1):
            a, pid, op, allowed = setup()
            returned, exc, tripped = interrupt_at(op, in_allocator, k, opcodes)
            assert tripped and (returned or exc is not None), f"event {k}: nothing came back"
            check_after(a, exc)
            assert _state(a, pid) in allowed, f"event {k}: pool state {_state(a, pid)}"
            _clean(a)
