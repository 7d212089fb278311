"""Pluggable allocators: ``PluggableAllocator(malloc_fn, free_fn)`` + ``change_current_allocator``.

The callables get torch's arguments, cudalab keeps its statistics (torch's pluggable
allocator has none), swapping after the first allocation raises torch's error, bad callables
and bad results give clear errors, and a failed ``free_fn`` loses nothing.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest

from cudalab.allocator.config import AllocatorConfig
from cudalab.allocator.hooks import attach_trace
from cudalab.allocator.pluggable import (
    PluggableAllocator,
    PluggableDeviceAllocator,
    change_current_allocator,
    current_allocator,
)
from cudalab.allocator.registry import create_allocator
from cudalab.errors import OutOfMemoryError

MiB = 1024 * 1024


class Recorder:
    """malloc_fn/free_fn over the driver seam's plain device allocation, logging calls."""

    def __init__(self, backend):
        self.backend = backend
        self.calls: list[tuple] = []
        self.live: dict[int, int] = {}

    def malloc(self, size, device, stream):
        self.calls.append(("malloc", size, device, stream))
        ptr = self.backend.mem_alloc(device, size)
        self.live[ptr] = size
        return ptr

    def free(self, ptr, size, device, stream):
        self.calls.append(("free", ptr, size, device, stream))
        assert self.live.pop(ptr) == size
        self.backend.mem_free(device, ptr)


@pytest.fixture
def registry(backend):
    """The process registry emptied for one test (and restored, pluggable reset, after)."""
    from cudalab.allocator import registry as A

    gc.collect()
    with A._registry_lock:
        saved = (list(A.allocators), list(A.active), A._config)
        A.allocators.clear()
        A.active.clear()
        A._config = AllocatorConfig()
    try:
        yield A
    finally:
        gc.collect()
        with A._registry_lock:
            made = list(A.active)
            A.allocators[:] = saved[0]
            A.active[:] = saved[1]
            A._config = saved[2]
        A._custom = None
        for a in made:
            for p in list(a.live):
                try:
                    a.free(p)
                except Exception:  # a test's deliberately failing free_fn
                    pass
            a.empty_cache()


@pytest.fixture
def rec(backend):
    return Recorder(backend)


# --------------------------------------------------------------------------- installation
def test_callables_get_torchs_arguments_and_stats_are_kept(registry, rec, backend):
    import cudalab
    from cudalab import memory as M

    assert M.get_allocator_backend() == "native"
    M.change_current_allocator(M.PluggableAllocator(rec.malloc, rec.free))
    assert M.get_allocator_backend() == "pluggable"
    s0 = cudalab.current_stream().cuda_stream
    p = cudalab.caching_allocator_alloc(1000)
    assert isinstance(registry.get_allocator(0), PluggableDeviceAllocator)
    assert rec.calls == [("malloc", 1000, 0, s0)]
    s = cudalab.Stream()
    q = cudalab.caching_allocator_alloc(3 * MiB, 0, s)
    assert rec.calls[-1] == ("malloc", 3 * MiB, 0, s.cuda_stream)
    st = M.memory_stats()
    assert st["allocated_bytes.all.current"] == st["reserved_bytes.all.current"] == 3 * MiB + 1000
    assert st["requested_bytes.all.current"] == st["active_bytes.all.current"] == 3 * MiB + 1000
    assert st["allocation.all.current"] == st["segment.all.current"] == 2
    assert st["allocated_bytes.small_pool.current"] == 1000
    assert st["allocated_bytes.large_pool.current"] == 3 * MiB
    assert st["num_device_alloc"] == 2 and st["num_device_free"] == 0
    assert M.memory_allocated() == M.memory_reserved() == 3 * MiB + 1000
    cudalab.caching_allocator_delete(q)
    assert rec.calls[-1] == ("free", q, 3 * MiB, 0, s.cuda_stream)
    cudalab.caching_allocator_delete(p)
    assert rec.calls[-1] == ("free", p, 1000, 0, s0)
    st = M.memory_stats()
    assert st["allocated_bytes.all.current"] == st["reserved_bytes.all.current"] == 0
    assert st["allocated_bytes.all.peak"] == 3 * MiB + 1000
    assert st["allocated_bytes.all.freed"] == 3 * MiB + 1000
    assert st["num_device_free"] == 2
    assert len(st) == 122
    assert rec.live == {}


def test_device_arrays_and_snapshot_over_a_pluggable_allocator(registry, rec, backend):
    import numpy as np

    import cudalab
    from cudalab import memory as M

    M.change_current_allocator(M.PluggableAllocator(rec.malloc, rec.free))
    x = cudalab.asarray(np.arange(100, dtype=np.float64))
    assert (x.numpy() == np.arange(100)).all()
    assert rec.calls[0][:3] == ("malloc", 800, 0)
    segs = M.memory_snapshot()
    assert [(s["address"], s["total_size"]) for s in segs] == [(x.data_ptr(), 800)]
    del x
    gc.collect()
    assert rec.calls[-1][0] == "free" and M.memory_allocated() == 0


def test_device_index_is_passed(registry, rec, two_devices):
    import cudalab
    from cudalab import memory as M

    M.change_current_allocator(M.PluggableAllocator(rec.malloc, rec.free))
    p = cudalab.caching_allocator_alloc(100, device=1)
    assert rec.calls[-1] == ("malloc", 100, 1, cudalab.current_stream(1).cuda_stream)
    assert M.memory_allocated(1) == 100 and M.memory_allocated(0) == 0
    cudalab.caching_allocator_delete(p)
    assert rec.calls[-1][3] == 1


def test_swap_after_first_allocation_raises_like_torch(registry, rec):
    import cudalab
    from cudalab import memory as M

    one = M.PluggableAllocator(rec.malloc, rec.free)
    two = M.PluggableAllocator(rec.malloc, rec.free)
    M.change_current_allocator(one)
    M.change_current_allocator(two)  # nothing allocated yet: allowed
    M.change_current_allocator(None)  # back to the settings' choice
    assert current_allocator() is None and M.get_allocator_backend() == "native"
    M.change_current_allocator(one)
    assert current_allocator() is one
    p = cudalab.caching_allocator_alloc(10)
    with pytest.raises(RuntimeError, match="Can't swap an already initialized allocator"):
        M.change_current_allocator(two)
    with pytest.raises(RuntimeError, match="Can't swap an already initialized allocator"):
        M.change_current_allocator(None)
    assert current_allocator() is one
    cudalab.caching_allocator_delete(p)


def test_swap_after_the_native_allocator_exists_raises(registry):
    import cudalab
    from cudalab import memory as M

    cudalab.caching_allocator_delete(cudalab.caching_allocator_alloc(10))
    with pytest.raises(RuntimeError, match="Can't swap"):
        M.change_current_allocator(M.PluggableAllocator(lambda *a: 0, lambda *a: None))
    assert M.get_allocator_backend() == "native"


def test_fresh_process_with_the_environment_setting(backend):
    """change_current_allocator wins over CUDALAB_ALLOC_CONF (as torch's swap does)."""
    code = textwrap.dedent("""
        import cudalab
        from cudalab import memory as M, devices
        calls = []
        def m(size, device, stream):
            calls.append(size)
            return devices.backend().mem_alloc(device, size)
        def f(ptr, size, device, stream):
            devices.backend().mem_free(device, ptr)
        M.change_current_allocator(M.PluggableAllocator(m, f))
        x = cudalab.zeros((8,), "float32")
        print(M.get_allocator_backend(), calls, M.memory_allocated(), float(x.numpy().sum()))
    """)
    env = dict(os.environ, CUDALAB_ALLOC_CONF="backend:cudaMallocAsync")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["pluggable", "[32]", "32", "0.0"]


# --------------------------------------------------------------------------- validation
def test_bad_callables_raise_type_error():
    with pytest.raises(TypeError, match="malloc_fn must be callable"):
        PluggableAllocator(1, lambda *a: None)
    with pytest.raises(TypeError, match="free_fn must be callable"):
        PluggableAllocator(lambda *a: 1, "free")
    with pytest.raises(TypeError, match="PluggableAllocator"):
        change_current_allocator(lambda *a: 1)
    pa = PluggableAllocator(lambda *a: 1, lambda *a: None)
    assert pa.allocator() is pa
    assert "PluggableAllocator(malloc_fn=" in repr(pa)


@pytest.mark.parametrize("result, what", [
    (None, "returned NoneType None"),
    (0, "returned 0"),
    (-5, "returned -5"),
    (1.5, "returned float 1.5"),
    ("0x1000", "returned str '0x1000'"),
    (True, "returned bool True"),
])
def test_bad_malloc_results_raise_out_of_memory(backend, result, what):
    def bad_malloc(size, device, stream):
        return result

    a = PluggableAllocator(bad_malloc, lambda *a: None).device_allocator(
        backend, 0, stream_resolver=lambda: 0)
    with pytest.raises(OutOfMemoryError) as ei:
        a.malloc(4096)
    text = str(ei.value)
    assert "malloc_fn" in text and "bad_malloc" in text and what in text
    assert "size=4096, device=0, stream=0x0" in text
    st = a.memory_stats()
    assert st["num_ooms"] == 1
    assert st["allocation.all.current"] == st["num_device_alloc"] == 0
    assert a.malloc(0) == 0  # size 0 never calls malloc_fn


def test_malloc_fn_exceptions_propagate_and_change_nothing(backend):
    def failing(size, device, stream):
        raise MemoryError("no room in my arena")

    a = PluggableDeviceAllocator(PluggableAllocator(failing, lambda *a: None), backend, 0,
                                 stream_resolver=lambda: 0)
    with pytest.raises(MemoryError, match="arena"):
        a.malloc(10)
    assert a.memory_stats()["allocation.all.allocated"] == 0


def test_failing_free_fn_loses_nothing(backend, rec):
    fail = [True]

    def free(ptr, size, device, stream):
        if fail[0]:
            raise RuntimeError("free failed")
        rec.free(ptr, size, device, stream)

    a = PluggableDeviceAllocator(PluggableAllocator(rec.malloc, free), backend, 0,
                                 stream_resolver=lambda: 0)
    p = a.malloc(100)
    with pytest.raises(RuntimeError, match="free failed"):
        a.free(p)
    assert a.owns(p) and a.memory_stats()["allocated_bytes.all.current"] == 100
    fail[0] = False
    a.free(p)
    assert a.memory_stats()["allocated_bytes.all.current"] == 0 and rec.live == {}


def test_double_free_foreign_pointer_and_duplicate_results(backend, rec):
    a = PluggableDeviceAllocator(PluggableAllocator(rec.malloc, rec.free), backend, 0,
                                 stream_resolver=lambda: 0)
    p = a.malloc(100)
    a.free(p)
    with pytest.raises(ValueError, match=f"{p:#x}"):
        a.free(p)
    with pytest.raises(ValueError, match="0x4321"):
        a.free(0x4321)
    a.free(0)
    assert [c[0] for c in rec.calls] == ["malloc", "free"]
    same = [0x7000_0000]

    def dup(size, device, stream):
        return same[0]

    d = PluggableDeviceAllocator(PluggableAllocator(dup, lambda *a: None), backend, 0,
                                 stream_resolver=lambda: 0)
    d.malloc(1)
    with pytest.raises(RuntimeError, match="still live"):
        d.malloc(1)
    assert d.memory_stats()["allocation.all.current"] == 1
    with pytest.raises(ValueError, match=">= 0"):
        d.malloc(-1)


def test_memory_fraction(backend, rec):
    a = PluggableDeviceAllocator(PluggableAllocator(rec.malloc, rec.free), backend, 0,
                                 stream_resolver=lambda: 0)
    _, total = backend.mem_get_info(0)
    a.set_memory_fraction(4 * MiB / total)
    p = a.malloc(3 * MiB)
    with pytest.raises(OutOfMemoryError, match="allowed;"):
        a.malloc(2 * MiB)
    assert len(rec.calls) == 1  # refused before calling malloc_fn
    assert a.memory_stats()["num_ooms"] == 1
    a.free(p)
    a.free(a.malloc(2 * MiB))
    assert a.get_memory_fraction() == pytest.approx(4 * MiB / total)
    with pytest.raises(ValueError):
        a.set_memory_fraction(-0.1)


def test_create_allocator_honours_the_current_pluggable(registry, backend, rec):

    pa = PluggableAllocator(rec.malloc, rec.free)
    change_current_allocator(pa)
    a = create_allocator(backend, 0, AllocatorConfig(), stream_resolver=lambda: 0)
    assert isinstance(a, PluggableDeviceAllocator) and a.spec is pa and a.name == "pluggable"
    change_current_allocator(None)


@pytest.mark.skipif(os.environ.get("CUDALAB_SIMULATOR") != "1",
                    reason="pause_stream is a simulator test hook")
def test_record_stream_orders_the_allocation_stream_after_usage_streams(backend, rec):
    import cudalab

    A, B = cudalab.Stream(), cudalab.Stream()
    a = PluggableDeviceAllocator(PluggableAllocator(rec.malloc, rec.free), backend, 0)
    p = a.malloc(100, A)
    a.record_stream(p, A)  # the allocation stream: ignored
    assert not a._uses
    backend.pause_stream(B.handle)
    try:
        a.record_stream(p, B)
        # free_fn is called at once (no host sync) with the allocation stream, which now
        # waits for B's work
        freed = []
        a.spec.free_fn = lambda ptr, size, dev, s: freed.append((ptr, s))
        a.free(p)
        assert freed == [(p, A.cuda_stream)]
        assert not backend.stream_query(A.handle)
    finally:
        backend.resume_stream(B.handle)
    assert backend.stream_query(A.handle)
    backend.mem_free(0, p)
    with pytest.raises(TypeError, match="cudalab.Stream"):
        a.record_stream(a.malloc(10), 3)


def test_pluggable_allocator_trace_hook(backend, rec):
    a = PluggableDeviceAllocator(PluggableAllocator(rec.malloc, rec.free), backend, 0,
                                 stream_resolver=lambda: 0)
    seen = []
    attach_trace(a, lambda action, ptr, size, stream: seen.append((action, size)))
    a.free(a.malloc(64))
    assert seen == [("segment_alloc", 64), ("alloc", 64), ("free_requested", 64),
                    ("free_completed", 64), ("segment_free", 64)]
