"""``backend:cudaMallocAsync``: the stream-ordered pool allocator (AsyncPoolAllocator).

Statistics (only torch's non-zero keys move, values from the pool), empty_cache, the
unifying-stream free after ``record_stream`` (paused simulator streams show that nothing is
reused or freed early and that the host never waits), the memory-fraction OOM text,
unsupported snapshots, clean errors, the switch through ``CUDALAB_ALLOC_CONF`` in a fresh
process and, on a GPU, the same sequence against torch's cudaMallocAsync backend.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from cudalab.allocator.async_allocator import AsyncPoolAllocator
from cudalab.allocator.config import parse_alloc_conf
from cudalab.allocator.hooks import attach_trace, detach_trace
from cudalab.allocator.registry import create_allocator
from cudalab.allocator.stats import STAT_KEYS
from cudalab.errors import OutOfMemoryError
from tests.helpers.counting_backend import CountingBackend

KiB = 1024
MiB = 1024 * 1024
ASYNC = "backend:cudaMallocAsync"
#: The keys torch's cudaMallocAsync backend fills in (plus allocated/freed of
#: allocated_bytes.all, which cudalab also counts).
MOVING = {
    "allocated_bytes.all.current", "allocated_bytes.all.peak",
    "allocated_bytes.all.allocated", "allocated_bytes.all.freed",
    "active_bytes.all.current", "active_bytes.all.peak",
    "reserved_bytes.all.current", "reserved_bytes.all.peak",
}


@pytest.fixture
def make(backend):
    """Factory of private async allocators (stream 0 by default), closed after the test."""
    made: list[AsyncPoolAllocator] = []

    def factory(conf: str = ASYNC, resolver=lambda: 0, b=None) -> AsyncPoolAllocator:
        a = create_allocator(b or backend, 0, parse_alloc_conf(conf), stream_resolver=resolver)
        assert isinstance(a, AsyncPoolAllocator)
        made.append(a)
        return a

    yield factory
    for a in made:
        for p in list(a.live):
            a.free(p)
        a.close()


def nonzero(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if v}


# --------------------------------------------------------------------------- selection
def test_create_allocator_picks_the_async_backend(backend):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = parse_alloc_conf("backend:cudaMallocAsync,expandable_segments:True")
    a = create_allocator(backend, 0, cfg)
    assert isinstance(a, AsyncPoolAllocator) and a.name == "cudaMallocAsync"
    a.close()
    # like torch, the no-caching switch only concerns the native allocator
    b = create_allocator(backend, 0, parse_alloc_conf(ASYNC), no_caching=True)
    assert isinstance(b, AsyncPoolAllocator)
    b.close()


def test_native_only_options_warn_once_and_are_ignored(backend):
    with pytest.warns(UserWarning, match="ignores max_split_size_mb, garbage_collection"):
        cfg = parse_alloc_conf("backend:cudaMallocAsync,max_split_size_mb:64,"
                               "garbage_collection_threshold:0.5")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # building the allocator warns no more
        a = create_allocator(backend, 0, cfg, stream_resolver=lambda: 0)
    a.free(a.malloc(3 * MiB))
    assert a.memory_stats()["max_split_size"] == 0
    a.close()


# --------------------------------------------------------------------------- statistics
def test_stats_have_torchs_keys_and_only_torchs_nonzero_ones_move(make, backend):
    a = make()
    s = a.memory_stats()
    assert list(s) == list(STAT_KEYS) and len(s) == 122
    assert all(type(v) is int for v in s.values())
    assert nonzero(s) == {}  # max_split_size is 0 under this backend, as torch
    sizes = [1, 1000, 3 * MiB, MiB + 1, 40 * MiB]
    ptrs = [a.malloc(n) for n in sizes]
    assert len(set(ptrs)) == len(ptrs)
    backend.synchronize(0)
    s = a.memory_stats()
    assert set(nonzero(s)) <= MOVING
    reserved, reserved_high, used, used_high = a.pool_usage()
    assert s["allocated_bytes.all.current"] == s["allocated_bytes.all.peak"] == sum(sizes)
    assert s["allocated_bytes.all.allocated"] == sum(sizes)
    assert s["active_bytes.all.current"] == used >= sum(sizes)
    assert s["active_bytes.all.peak"] == used_high
    assert s["reserved_bytes.all.current"] == reserved >= used
    assert s["reserved_bytes.all.peak"] == reserved_high
    if backend.simulated:  # the simulated pool counts 512-byte granules
        assert used == sum(-(-n // 512) * 512 for n in sizes)
    a.free(ptrs[4])
    a.free(ptrs[0])
    backend.synchronize(0)
    s = a.memory_stats()
    live = sum(sizes) - sizes[4] - sizes[0]
    assert s["allocated_bytes.all.current"] == live
    assert s["allocated_bytes.all.peak"] == sum(sizes)
    assert s["allocated_bytes.all.freed"] == sizes[4] + sizes[0]
    assert s["active_bytes.all.current"] == a.pool_usage()[2] < used
    assert s["reserved_bytes.all.current"] == reserved  # the pool keeps what it has
    assert set(nonzero(s)) <= MOVING


def test_public_getters_read_the_async_counters(make, backend):
    """The getters read ``stats.large``/``stats.agg`` directly; the async stats object
    answers them (reserved from the pool)."""
    a = make()
    p = a.malloc(5 * MiB)
    backend.synchronize(0)
    st = a.stats
    assert st.small.b_alloc + st.large.b_alloc == 5 * MiB
    assert st.agg.b_alloc_peak == 5 * MiB
    assert st.small.b_res + st.large.b_res == a.pool_usage()[0]
    assert st.agg.b_res_peak == a.pool_usage()[1]
    assert st.current("n_pend") == 0 and st.current("b_alloc") == 5 * MiB
    assert st.as_dict() == a.memory_stats()
    a.free(p)


def test_reset_peak_and_accumulated(make, backend):
    a = make()
    big = a.malloc(30 * MiB)
    small = a.malloc(MiB)
    a.free(big)
    backend.synchronize(0)
    s = a.memory_stats()
    assert s["allocated_bytes.all.peak"] == 31 * MiB
    assert s["active_bytes.all.peak"] > s["active_bytes.all.current"]
    a.reset_peak_stats()
    s = a.memory_stats()
    assert s["allocated_bytes.all.peak"] == s["allocated_bytes.all.current"] == MiB
    assert s["active_bytes.all.peak"] == s["active_bytes.all.current"]
    assert s["reserved_bytes.all.peak"] == s["reserved_bytes.all.current"]
    a.reset_accumulated_stats()
    s = a.memory_stats()
    assert s["allocated_bytes.all.allocated"] == s["allocated_bytes.all.freed"] == 0
    a.free(small)
    s = a.memory_stats()
    assert s["allocated_bytes.all.freed"] == MiB and s["allocated_bytes.all.current"] == 0


def test_empty_cache_trims_the_pool(make, backend):
    a = make()
    ptrs = [a.malloc(8 * MiB) for _ in range(3)]
    keep = a.malloc(1000)
    for p in ptrs:
        a.free(p)
    backend.synchronize(0)
    before = a.memory_stats()["reserved_bytes.all.current"]
    assert before >= 24 * MiB  # freed memory stays cached (unlimited release threshold)
    free_before, _ = backend.mem_get_info(0)
    a.empty_cache()
    # A chunk holding a live allocation stays (the real driver grows pools in 32 MiB chunks,
    # so `keep` may pin everything; the simulator's 2 MiB chunks release the rest).
    after = a.memory_stats()["reserved_bytes.all.current"]
    assert after <= before
    free_after, _ = backend.mem_get_info(0)
    assert free_after - free_before >= before - after - 2 * MiB  # given back to the device
    assert a.memory_stats()["allocated_bytes.all.current"] == 1000
    a.free(keep)
    backend.synchronize(0)
    a.empty_cache()
    assert a.memory_stats()["reserved_bytes.all.current"] == 0
    free_end, _ = backend.mem_get_info(0)
    assert free_end - free_before >= before - 2 * MiB  # everything went back


# --------------------------------------------------------------------------- streams
def test_hot_path_makes_only_the_pool_calls(make, backend):
    import cudalab

    counting = CountingBackend(backend)
    s = cudalab.Stream()
    a = make(b=counting)
    a.free(a.malloc(1000, s))  # warm up
    a.free(a.malloc(1000, s.cuda_stream))  # (the int handle's lookup is cached)
    counting.calls.clear()
    for n in (1, 1000, 3 * MiB):
        a.free(a.malloc(n, s))
    a.free(a.malloc(64, s.cuda_stream))  # an int handle: cached, no lookup
    assert counting.calls == ["pool_alloc_async", "mem_free_async"] * 4
    with cudalab.stream(s):
        b = make(b=counting, resolver=None)  # the current stream
        counting.calls.clear()
        b.free(b.malloc(100))
    assert counting.calls == ["pool_alloc_async", "mem_free_async"]


def test_allocation_stream_is_honoured(make, backend):
    import cudalab

    s = cudalab.Stream()
    a = make(resolver=None)
    with cudalab.stream(s):
        p = a.malloc(100)
    q = a.malloc(100, s)
    r = a.malloc(100)  # the default stream now
    assert a.live[p][2] == a.live[q][2] == s.cuda_stream
    assert a.live[r][2] == 0
    other = cudalab.Stream(1) if cudalab.device_count() > 1 else None
    if other is not None:
        with pytest.raises(ValueError, match="belongs to device 1"):
            a.malloc(100, other)
    with pytest.raises(TypeError, match="stream must be"):
        a.malloc(100, "s")
    for x in (p, q, r):
        a.free(x)


@pytest.mark.skipif(os.environ.get("CUDALAB_SIMULATOR") != "1",
                    reason="pause_stream is a simulator test hook")
def test_record_stream_frees_on_the_unifying_stream_without_host_sync(make, backend):
    import cudalab

    A = cudalab.Stream()
    B = cudalab.Stream()
    a = make()
    p = a.malloc(MiB, A)
    used0 = a.pool_usage()[2]
    a.record_stream(p, A)  # the allocation stream itself: ignored
    assert not a._uses
    backend.pause_stream(B.handle)
    try:
        a.record_stream(p, B)
        a.free(p)  # would raise on the simulator if it waited for the paused stream
        assert a._unifier is not None
        assert not backend.stream_query(a._unifier)  # the free waits for B's event
        assert a.memory_stats()["allocated_bytes.all.current"] == 0
        assert a.pool_usage()[2] == used0  # the pool still counts p as used
        q = a.malloc(MiB, A)  # the block is not reused while B's work is pending
        assert q != p
    finally:
        backend.resume_stream(B.handle)
    assert backend.stream_query(a._unifier)
    assert a.pool_usage()[2] == used0  # p went back to the pool, q is live
    r = a.malloc(MiB, A)
    assert r == p  # now it can be reused
    a.free(q)
    a.free(r)


@pytest.mark.skipif(os.environ.get("CUDALAB_SIMULATOR") != "1",
                    reason="pause_stream is a simulator test hook")
def test_record_stream_waits_for_every_usage_stream_and_the_allocation_stream(make, backend):
    import cudalab

    A, B, C = cudalab.Stream(), cudalab.Stream(), cudalab.Stream()
    a = make()
    p = a.malloc(4 * MiB, A)
    used0 = a.pool_usage()[2]
    for s in (B, C):
        a.record_stream(p, s)
    a.record_stream(p, B)  # twice: one event
    for s in (A, B, C):
        backend.pause_stream(s.handle)
    a.free(p)
    for s in (B, C):  # still held back by the allocation stream (and the other usage one)
        backend.resume_stream(s.handle)
        assert a.pool_usage()[2] == used0
    backend.resume_stream(A.handle)
    assert a.pool_usage()[2] == used0 - 4 * MiB


@pytest.mark.skipif(os.environ.get("CUDALAB_SIMULATOR") != "1",
                    reason="pause_stream is a simulator test hook")
def test_record_stream_on_another_device(make, backend, two_devices):
    import cudalab

    other = cudalab.Stream(1)
    a = make()
    p = a.malloc(MiB)
    used0 = a.pool_usage()[2]
    backend.pause_stream(other.handle)
    a.record_stream(p, other)
    a.free(p)
    assert a.pool_usage()[2] == used0
    backend.resume_stream(other.handle)
    assert a.pool_usage()[2] == used0 - MiB


def test_record_stream_then_free_on_any_backend(make, backend):
    """Without paused streams (also on a GPU): the memory comes back after the work."""
    import cudalab

    A, B = cudalab.Stream(), cudalab.Stream()
    a = make()
    p = a.malloc(2 * MiB, A)
    backend.memset_d8_async(0, p, 1, 2 * MiB, B.handle)
    a.record_stream(p, B)
    a.free(p)
    backend.synchronize(0)
    assert a.memory_stats()["active_bytes.all.current"] == 0
    with pytest.raises(TypeError, match="cudalab.Stream"):
        a.record_stream(a.malloc(10), 5)
    with pytest.raises(ValueError, match="0x"):
        a.record_stream(0xDEAD000, A)


def test_closed_or_destroyed_usage_stream_falls_back_to_a_device_sync(make, backend):
    import cudalab

    a = make()
    p = a.malloc(MiB)
    s = cudalab.Stream()
    a.record_stream(p, s)
    s.close()
    a.free(p)  # no exception: synchronises the device instead of recording an event
    backend.synchronize(0)
    assert a.memory_stats()["active_bytes.all.current"] == 0


# --------------------------------------------------------------------------- limits and OOM
def test_memory_fraction_is_enforced_with_torchs_text(make, backend):
    a = make()
    _, total = backend.mem_get_info(0)
    frac = (8.5 * MiB) / total  # limit = int(frac * total): leave room for float truncation
    a.set_memory_fraction(frac)
    assert a.get_memory_fraction() == pytest.approx(frac)
    limit = int(frac * total)
    p = a.malloc(5 * MiB)
    with pytest.raises(OutOfMemoryError) as ei:
        a.malloc(4 * MiB)
    text = str(ei.value)
    lines = text.splitlines()
    assert lines[0] == "Allocation on device 0 would exceed allowed memory. (out of memory)"
    assert lines[1] == "Currently allocated     : 5.00 MiB"
    assert lines[2] == "Requested               : 4.00 MiB"
    assert lines[3].startswith("Device limit            : ")
    assert lines[4].startswith("Free (according to CUDA): ")
    assert lines[5] == "cudalab limit (set by user-supplied memory fraction)"
    assert lines[6].strip() == f": {limit / MiB:.2f} MiB"
    # nothing changed; what fits still works, and freeing makes room again
    assert a.memory_stats()["allocated_bytes.all.current"] == 5 * MiB
    q = a.malloc(3 * MiB)
    a.free(p)
    r = a.malloc(4 * MiB)
    for x in (q, r):
        a.free(x)
    with pytest.raises(ValueError):
        a.set_memory_fraction(1.5)


def test_fraction_from_the_settings(make):
    a = make("backend:cudaMallocAsync,per_process_memory_fraction:0.25")
    assert a.get_memory_fraction() == 0.25
    a2 = make()
    assert a2.get_memory_fraction() == 1.0


def test_driver_oom_raises_torchs_text_and_keeps_state(make, backend):
    a = make()
    p = a.malloc(1000)
    _, total = backend.mem_get_info(0)
    with pytest.raises(OutOfMemoryError, match="would exceed allowed memory") as ei:
        a.malloc(total + 4 * MiB)
    assert "Currently allocated     : 1000 bytes" in str(ei.value)
    assert a.memory_stats()["allocated_bytes.all.current"] == 1000
    a.free(p)
    a.free(a.malloc(MiB))
    with pytest.raises(OutOfMemoryError, match="more than 1EB"):
        a.malloc(1 << 60)


# --------------------------------------------------------------------------- unsupported
def test_snapshot_and_history_are_unsupported(make):
    a = make()
    with pytest.raises(RuntimeError, match="not supported with the cudaMallocAsync backend"):
        a.segments()
    with pytest.raises(RuntimeError, match="history"):
        attach_trace(a, lambda *args: None)
    detach_trace(a)
    assert a._trace is None


# --------------------------------------------------------------------------- errors
def test_errors_lose_nothing(make, backend):
    a = make()
    p = a.malloc(3000)
    snap = a.memory_stats()
    a.free(p)
    after_free = a.memory_stats()
    with pytest.raises(ValueError, match=f"{p:#x}"):
        a.free(p)  # double free
    with pytest.raises(ValueError, match="0x1234"):
        a.free(0x1234)  # foreign
    with pytest.raises(TypeError):
        a.free("x")
    assert a.memory_stats() == after_free
    a.free(0)  # null: no-op
    assert a.malloc(0) == 0
    with pytest.raises(ValueError, match=">= 0"):
        a.malloc(-1)
    with pytest.raises(TypeError):
        a.malloc(1.5)
    with pytest.raises(TypeError):
        a.malloc(True)
    # the pool still works and counts right
    q = a.malloc(3000)
    assert a.memory_stats()["allocated_bytes.all.current"] == snap["allocated_bytes.all.current"]
    assert a.owns(q) and a.block_size(q) == 3000
    a.free(q)
    assert not a.owns(q)


def test_failed_driver_free_keeps_the_pointer_live(make, backend):
    class Failing(CountingBackend):
        fail = False

        def __getattr__(self, name):
            if name == "mem_free_async" and self.fail:
                def boom(*args):
                    from cudalab.errors import CudaError

                    raise CudaError(1, "CUDA_ERROR_INVALID_VALUE", "injected")
                return boom
            return super().__getattr__(name)

    fb = Failing(backend)
    fb.fail = True
    a = make(b=fb)
    p = a.malloc(100)
    from cudalab.errors import CudaError

    with pytest.raises(CudaError, match="injected"):
        a.free(p)
    assert a.owns(p) and a.memory_stats()["allocated_bytes.all.current"] == 100
    a._free_async = backend.mem_free_async
    a.free(p)
    assert a.memory_stats()["allocated_bytes.all.current"] == 0


def test_threads_soak(make, backend):
    import cudalab

    a = make()
    errors = []

    def work(i):
        try:
            s = cudalab.Stream()
            for j in range(200):
                ptrs = [a.malloc(512 * (1 + (i + j + k) % 7), s) for k in range(3)]
                for p in ptrs:
                    a.free(p)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    backend.synchronize(0)
    s = a.memory_stats()
    assert s["allocated_bytes.all.current"] == 0 and s["active_bytes.all.current"] == 0
    assert s["allocated_bytes.all.allocated"] == s["allocated_bytes.all.freed"] > 0


def test_frees_while_the_lock_is_busy_are_applied_later(make):
    a = make()
    p = a.malloc(4096)
    with a._lock:  # as if a finalizer ran inside this thread's own allocator call
        a.free(p)
        assert list(a.pending_frees) == [4096]
    assert a.stats.large.b_alloc == 4096  # applied on the next read
    assert a.memory_stats()["allocated_bytes.all.current"] == 0
    assert not a.pending_frees


# --------------------------------------------------------------------------- process level
@pytest.fixture
def async_registry(backend):
    """The process registry emptied and set to backend:cudaMallocAsync for one test."""
    from cudalab.allocator import registry as A

    gc.collect()
    with A._registry_lock:
        saved = (list(A.allocators), list(A.active), A._config)
        A.allocators.clear()
        A.active.clear()
        A._config = parse_alloc_conf(ASYNC)
    try:
        yield A
    finally:
        gc.collect()
        with A._registry_lock:
            made = list(A.active)
            A.allocators[:] = saved[0]
            A.active[:] = saved[1]
            A._config = saved[2]
        for a in made:
            for p in list(a.live):
                a.free(p)
            a.close()


def test_public_api_in_process(async_registry, backend):
    import cudalab
    from cudalab import memory as M

    assert M.get_allocator_backend() == "cudaMallocAsync"
    assert M.memory_stats()["max_split_size"] == 0  # nothing allocated yet: zeros as torch
    p = cudalab.caching_allocator_alloc(3 * MiB)
    assert isinstance(async_registry.get_allocator(0), AsyncPoolAllocator)
    assert M.memory_allocated() == 3 * MiB == M.max_memory_allocated()
    assert M.memory_reserved() >= 3 * MiB and M.max_memory_reserved() >= M.memory_reserved()
    arr = cudalab.asarray(__import__("numpy").arange(1000, dtype="float32"))
    assert (arr.numpy() == __import__("numpy").arange(1000, dtype="float32")).all()
    assert M.memory_allocated() == 3 * MiB + 4000
    s = cudalab.Stream()
    M.record_stream(p, s)
    cudalab.caching_allocator_delete(p)
    del arr
    gc.collect()
    assert M.memory_allocated() == 0
    stats = M.memory_stats()
    assert set(nonzero(stats)) <= MOVING
    ext = M.memory_stats(extended=True)
    assert ext["pending_free_blocks"] == 0 and ext["largest_free_block"] == 0
    assert "Allocated memory" in M.memory_summary()
    with pytest.raises(RuntimeError, match="cudaMallocAsync"):
        M.memory_snapshot()
    M.reset_peak_memory_stats()
    assert M.max_memory_allocated() == 0
    M.empty_cache()
    assert M.memory_reserved() == 0
    M.set_per_process_memory_fraction(0.5)
    assert M.get_per_process_memory_fraction() == 0.5
    with pytest.raises(ValueError):
        cudalab.caching_allocator_delete(0xBAD0)


_SUBPROCESS = textwrap.dedent("""
    import gc, json, warnings
    import numpy as np
    import cudalab
    from cudalab import memory as M
    out = {"backend_before": M.get_allocator_backend()}
    x = cudalab.asarray(np.arange(256, dtype=np.int32))
    p = cudalab.caching_allocator_alloc(5 << 20)
    from cudalab.allocator.registry import get_allocator
    out["type"] = type(get_allocator(0)).__name__
    out["backend"] = M.get_allocator_backend()
    out["roundtrip"] = bool((x.numpy() == np.arange(256, dtype=np.int32)).all())
    out["allocated"] = M.memory_allocated()
    out["nonzero"] = sorted(k for k, v in M.memory_stats().items() if v)
    try:
        M.memory_snapshot()
        out["snapshot"] = "no error"
    except RuntimeError as exc:
        out["snapshot"] = str(exc)
    cudalab.caching_allocator_delete(p)
    del x
    gc.collect()
    M.empty_cache()
    out["after"] = [M.memory_allocated(), M.memory_reserved()]
    print(json.dumps(out))
""")


@pytest.mark.parametrize("var", ["CUDALAB_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_switching_through_the_environment(var):
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDALAB_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    env[var] = "backend:cudaMallocAsync,max_split_size_mb:64,roundup_power2_divisions:4"
    proc = subprocess.run([sys.executable, "-c", _SUBPROCESS], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["backend_before"] == "cudaMallocAsync"
    assert out["type"] == "AsyncPoolAllocator" and out["backend"] == "cudaMallocAsync"
    assert out["roundtrip"] is True
    assert out["allocated"] == (5 << 20) + 1024
    assert set(out["nonzero"]) <= MOVING
    assert "not supported with the cudaMallocAsync backend" in out["snapshot"]
    assert out["after"] == [0, 0]
    assert proc.stderr.count("ignores max_split_size_mb, roundup_power2_divisions") == 1


# --------------------------------------------------------------------------- against torch
_TORCH_RUNNER = textwrap.dedent("""
    import json, sys, torch
    script = json.loads(sys.argv[1])
    torch.cuda.init()
    s = torch.cuda.current_stream()
    ptrs, snaps = {}, []
    for op in script:
        if op[0] == "alloc":
            ptrs[op[1]] = torch.cuda.caching_allocator_alloc(op[2], 0, s)
        elif op[0] == "free":
            torch.cuda.caching_allocator_delete(ptrs.pop(op[1]))
        elif op[0] == "sync":
            torch.cuda.synchronize()
        elif op[0] == "empty_cache":
            torch.cuda.empty_cache()
        elif op[0] == "reset_peak":
            torch.cuda.reset_peak_memory_stats()
        elif op[0] == "snap":
            torch.cuda.synchronize()
            snaps.append(dict(torch.cuda.memory_stats()))
    print(json.dumps({"snaps": snaps, "backend": torch.cuda.get_allocator_backend(),
                      "version": torch.__version__}))
""")

TORCH_SCRIPT = [
    ("alloc", "a", 1), ("alloc", "b", 1000), ("snap",),
    ("alloc", "c", 3 * MiB), ("alloc", "d", 1_500_000), ("alloc", "e", 40 * MiB), ("snap",),
    ("free", "e"), ("free", "a"), ("snap",),
    ("alloc", "f", 64 * MiB), ("free", "c"), ("reset_peak",), ("snap",),
    ("free", "f"), ("empty_cache",), ("snap",),
    ("free", "b"), ("free", "d"), ("empty_cache",), ("snap",),
]


def _run_torch_async(script) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTORCH_ALLOC_CONF", "CUDALAB_ALLOC_CONF",
                        "PYTORCH_NO_CUDA_MEMORY_CACHING")}
    env["PYTORCH_CUDA_ALLOC_CONF"] = ASYNC
    out = subprocess.run([sys.executable, "-c", _TORCH_RUNNER, json.dumps(script)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run_cudalab_async(backend, script) -> list[dict]:
    a = AsyncPoolAllocator(backend, 0, parse_alloc_conf(ASYNC))
    ptrs, snaps = {}, []
    try:
        for op in script:
            if op[0] == "alloc":
                ptrs[op[1]] = a.malloc(op[2])
            elif op[0] == "free":
                a.free(ptrs.pop(op[1]))
            elif op[0] == "sync":
                backend.synchronize(0)
            elif op[0] == "empty_cache":
                a.empty_cache()
            elif op[0] == "reset_peak":
                a.reset_peak_stats()
            elif op[0] == "snap":
                backend.synchronize(0)
                snaps.append(a.memory_stats())
    finally:
        for p in ptrs.values():
            a.free(p)
        a.close()
    return snaps


@pytest.mark.gpu
def test_reserved_and_active_equal_torchs_cudamallocasync(backend):
    pytest.importorskip("torch")
    theirs = _run_torch_async(TORCH_SCRIPT)
    assert theirs["backend"] == "cudaMallocAsync"
    ours = _run_cudalab_async(backend, TORCH_SCRIPT)
    assert len(ours) == len(theirs["snaps"])
    live = 0
    sizes = {}
    steps = iter(ours)
    report = []
    for op in TORCH_SCRIPT:
        if op[0] == "alloc":
            sizes[op[1]] = op[2]
            live += op[2]
        elif op[0] == "free":
            live -= sizes.pop(op[1])
        elif op[0] == "snap":
            report.append((next(steps), live))
    for i, ((o, expect_alloc), t) in enumerate(zip(report, theirs["snaps"])):
        # torch's nonzero keys are exactly the six pool-derived ones
        assert {k for k, v in t.items() if v} <= MOVING - {"allocated_bytes.all.allocated",
                                                           "allocated_bytes.all.freed"}
        assert t["max_split_size"] == o["max_split_size"] == 0
        for key in ("reserved_bytes.all.current", "reserved_bytes.all.peak",
                    "active_bytes.all.current", "active_bytes.all.peak"):
            assert o[key] == t[key], (i, key, o[key], t[key], theirs["version"])
        # torch reports the pool's used memory as allocated; cudalab its own byte count
        assert t["allocated_bytes.all.current"] == t["active_bytes.all.current"]
        assert o["allocated_bytes.all.current"] == expect_alloc


@pytest.mark.gpu
def test_real_pool_reports_growth_granularity(backend):
    """Records (in the assertion message on failure) how the driver's pool rounds: used
    memory for odd sizes and reserved growth; the only hard rule is used >= requested."""
    a = AsyncPoolAllocator(backend, 0, parse_alloc_conf(ASYNC))
    try:
        for n in (1, 1000, 4097, MiB + 1, 20 * MiB + 3):
            p = a.malloc(n)
            backend.synchronize(0)
            reserved, _, used, _ = a.pool_usage()
            assert used >= n and reserved >= used, (n, used, reserved)
            a.free(p)
            backend.synchronize(0)
    finally:
        a.close()
