"""Pinned host memory: the caching host allocator, its event guard, and real overlap on a GPU."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

import cudalab
from cudalab.allocator import pinned


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


@pytest.fixture
def sim(backend):
    if not backend.simulated:
        pytest.skip("needs the simulator's pause_stream/resume_stream test hooks")
    return backend


@pytest.fixture(autouse=True)
def _empty_cache_after():
    yield
    gc.collect()
    pinned.empty_pinned_cache()


def test_round_size():
    assert [pinned.round_size(n) for n in (0, 1, 512, 513, 1024, 3000, 5 << 20)] == [
        512, 512, 512, 1024, 1024, 4096, 8 << 20]


def test_empty_pinned_is_a_numpy_array():
    a = cudalab.empty_pinned((3, 5), dtype=np.float64)
    assert isinstance(a, np.ndarray) and a.shape == (3, 5) and a.dtype == np.float64
    assert a.flags.c_contiguous and a.flags.writeable
    assert cudalab.is_pinned(a) and cudalab.is_pinned(a[1:]) and cudalab.is_pinned(a.T)
    a[...] = 4.5
    assert a.sum() == 4.5 * 15
    assert not cudalab.is_pinned(np.zeros(4))
    assert not cudalab.is_pinned([1, 2])
    assert cudalab.empty_pinned(7).dtype == np.float32
    assert cudalab.empty_pinned(0).shape == (0,)
    assert cudalab.empty_pinned((), dtype=np.int16).shape == ()


def test_pin_memory():
    host = np.arange(100, dtype=np.int32).reshape(10, 10)
    p = cudalab.pin_memory(host)
    assert cudalab.is_pinned(p) and p is not host
    np.testing.assert_array_equal(p, host)
    assert cudalab.pin_memory(p) is p  # already pinned
    q = cudalab.pin_memory([1.0, 2.0])
    assert cudalab.is_pinned(q) and q.tolist() == [1.0, 2.0]


def test_bad_inputs():
    with pytest.raises(ValueError, match="negative"):
        cudalab.empty_pinned(-1)
    with pytest.raises(TypeError, match="unsupported dtype"):
        cudalab.empty_pinned(3, dtype=object)


def test_blocks_are_cached_and_reused():
    stats0 = pinned.pinned_memory_stats()
    a = cudalab.empty_pinned(1000, dtype=np.uint8)  # 1000 B -> 1024 B block
    p = _ptr(a)
    s = pinned.pinned_memory_stats()
    assert s["allocated_bytes"] == stats0["allocated_bytes"] + 1024
    assert s["allocated_blocks"] == stats0["allocated_blocks"] + 1
    assert s["requested_bytes"] == stats0["requested_bytes"] + 1000
    view = a[10:20]
    del a
    assert pinned.pinned_memory_stats()["allocated_blocks"] == s["allocated_blocks"]  # view
    del view
    s = pinned.pinned_memory_stats()
    assert s["cached_bytes"] >= 1024 and s["allocated_bytes"] == stats0["allocated_bytes"]
    b = cudalab.empty_pinned(700, dtype=np.uint8)  # same size class
    assert _ptr(b) == p
    s2 = pinned.pinned_memory_stats()
    assert s2["num_cache_hits"] == s["num_cache_hits"] + 1
    assert s2["num_host_alloc"] == s["num_host_alloc"]
    c = cudalab.empty_pinned(2000, dtype=np.uint8)  # another size class: a new block
    assert _ptr(c) != p
    assert s2["reserved_bytes"] == s2["allocated_bytes"] + s2["cached_bytes"]


def test_empty_pinned_cache_frees_blocks():
    a = cudalab.empty_pinned(1 << 16, dtype=np.uint8)
    del a
    s = pinned.pinned_memory_stats()
    assert s["cached_blocks"] >= 1
    pinned.empty_pinned_cache()
    s2 = pinned.pinned_memory_stats()
    assert s2["cached_bytes"] == 0 and s2["cached_blocks"] == 0
    assert s2["num_host_free"] >= s["num_host_free"] + 1


def test_out_of_pinned_memory_message(monkeypatch):
    keep = cudalab.empty_pinned((1 << 20,), dtype=np.uint8)  # 1 MiB in use
    alloc = pinned._allocator
    backend = alloc._b()
    calls = []

    def no_memory(size):
        calls.append(size)
        raise cudalab.OutOfMemoryError()

    monkeypatch.setattr(alloc, "_backend", type("NoHostMemory", (), {
        "host_alloc": staticmethod(no_memory), "host_free": backend.host_free,
        "event_query": backend.event_query})())
    with pytest.raises(cudalab.OutOfMemoryError) as info:
        cudalab.empty_pinned((3 << 20,), dtype=np.uint8)
    assert calls == [4 << 20, 4 << 20]  # tried again after emptying the cache
    assert str(info.value).startswith(
        "out of pinned host memory allocating 4.0 MiB (4194304 bytes; 1.0 MiB of pinned "
        "memory in use): ")
    del keep


def test_record_use_foreign_pointer_is_ignored():
    assert pinned.record_use(_ptr(np.zeros(4)), cudalab.current_stream()) is False


def test_pinned_copies_both_ways():
    host = cudalab.pin_memory(np.arange(4096, dtype=np.float32))
    d = cudalab.empty(4096)
    s = cudalab.Stream()
    with cudalab.stream(s):
        d.copy_(host, non_blocking=True)
    s.synchronize()
    out = cudalab.empty_pinned(4096)
    with cudalab.stream(s):
        d2 = cudalab.empty(4096)
    d2.copy_(d)
    cudalab.current_stream().synchronize()
    d2.numpy(out=out, non_blocking=True)
    d2.stream.synchronize()
    np.testing.assert_array_equal(out, host)


def test_event_guard_blocks_reuse_until_copy_done(sim):
    """A freed block whose async copy is still pending is not handed out again."""
    n = 1 << 12
    s = cudalab.Stream()
    host = cudalab.empty_pinned(n, dtype=np.float32)
    host[...] = np.arange(n)
    p = _ptr(host)
    d = cudalab.zeros(n)
    sim.pause_stream(s.handle)
    try:
        with cudalab.stream(s):
            d.copy_(host, non_blocking=True)  # returns at once: the copy is held back
        del host
        gc.collect()
        assert pinned.pinned_memory_stats()["cached_blocks_pending"] == 1
        other = cudalab.empty_pinned(n, dtype=np.float32)
        assert _ptr(other) != p  # not reused while the copy may still read it
        other_ptr = _ptr(other)
        pinned.empty_pinned_cache()  # a pending block is not freed either
        assert pinned.pinned_memory_stats()["cached_blocks_pending"] == 1
    finally:
        sim.resume_stream(s.handle)
    np.testing.assert_array_equal(d.numpy(), np.arange(n))
    del other
    allocs = pinned.pinned_memory_stats()["num_host_alloc"]
    x = cudalab.empty_pinned(n, dtype=np.float32)
    y = cudalab.empty_pinned(n, dtype=np.float32)
    assert {_ptr(x), _ptr(y)} == {p, other_ptr}  # both blocks are reusable now
    assert pinned.pinned_memory_stats()["num_host_alloc"] == allocs


def test_event_guard_device_to_host(sim):
    n = 256
    s = cudalab.Stream()
    with cudalab.stream(s):
        d = cudalab.full(n, 9, dtype=np.int64)
    s.synchronize()
    out = cudalab.empty_pinned(n, dtype=np.int64)
    out[...] = 0
    p = _ptr(out)
    sim.pause_stream(s.handle)
    try:
        d.numpy(out=out, non_blocking=True)  # d's stream is s: queued
        assert out.sum() == 0
        del out
        again = cudalab.empty_pinned(n, dtype=np.int64)
        assert _ptr(again) != p
    finally:
        sim.resume_stream(s.handle)


def test_pageable_non_blocking_waits(sim):
    """non_blocking with pageable memory is a synchronous copy (it cannot be deferred)."""
    s = cudalab.Stream()
    d = cudalab.zeros(8)
    host = np.ones(8, np.float32)  # kept alive: the held-back copy still reads it
    sim.pause_stream(s.handle)
    try:
        with cudalab.stream(s), pytest.raises(RuntimeError, match="paused"):
            d.copy_(host, non_blocking=True)
    finally:
        sim.resume_stream(s.handle)
    np.testing.assert_array_equal(d.numpy(), host)


def test_threads_alloc_and_free():
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(200):
                a = cudalab.empty_pinned(int(rng.integers(1, 5000)), dtype=np.uint8)
                a[...] = seed
                assert (a == seed).all()
                del a
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    before = pinned.pinned_memory_stats()["allocated_blocks"]
    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = pinned.pinned_memory_stats()
    assert s["allocated_blocks"] == before
    assert s["reserved_bytes"] == s["allocated_bytes"] + s["cached_bytes"]


@pytest.mark.gpu
def test_non_blocking_h2d_overlaps_on_gpu():
    """A 256 MiB H2D copy from pinned memory returns long before the copy completes."""
    n = 256 << 20
    host = cudalab.empty_pinned(n, dtype=np.uint8)
    host[...] = 1
    dev = cudalab.empty(n, dtype=np.uint8)
    s = cudalab.Stream()
    start, end = cudalab.Event(enable_timing=True), cudalab.Event(enable_timing=True)
    with cudalab.stream(s):
        dev.copy_(host, non_blocking=True)  # warm-up
        s.synchronize()
        start.record()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        host_ms = (time.perf_counter() - t0) * 1e3
        end.record()
    end.synchronize()
    copy_ms = start.elapsed_time(end)
    print(f"256 MiB pinned H2D: host returned after {host_ms:.3f} ms, copy took {copy_ms:.3f} ms")
    assert copy_ms > 1.0, copy_ms  # 256 MiB takes milliseconds even at 50+ GB/s
    assert host_ms < 0.25 * copy_ms, (host_ms, copy_ms)
    # the pageable path, for comparison, waits for the copy
    pageable = np.ones(n, dtype=np.uint8)
    t0 = time.perf_counter()
    dev.copy_(pageable, non_blocking=True)
    assert (time.perf_counter() - t0) * 1e3 > 0.5 * copy_ms
