"""The race catalogue with cudalab's real operations as the racing accesses.

Fills, device and host copies, RNG draws, kernel launches (a :class:`cudalab.kernels.Kernel`
with access annotations), ``numpy()`` reads and frees, each racing on two streams, then the
same program correctly synchronised, which must give no report (no false positives).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import cudalab
from cudalab import sanitizer
from cudalab._kernels.fill import fill_kernel


def kinds(session):
    return [r.kind for r in session.reports]


# ----------------------------------------------------------------- two-stream write/write
@pytest.mark.parametrize("ordered", [False, True])
def test_two_stream_fills_write_write(session, ordered):
    a = cudalab.empty(256)
    s1, s2 = cudalab.Stream(), cudalab.Stream()
    with cudalab.stream(s1):
        a.fill_(1.5)
    if ordered:
        s2.wait_stream(s1)
    with cudalab.stream(s2):
        a.fill_(2.5)
    assert kinds(session) == ([] if ordered else [sanitizer.RACE])
    if not ordered:
        assert session.reports[0].title == "possible data race (write after write)"


@pytest.mark.parametrize("ordered", [False, True])
def test_read_on_b_of_data_written_on_a(session, ordered):
    a, b = cudalab.empty(256), cudalab.empty(256)
    s1, s2 = cudalab.Stream(), cudalab.Stream()
    with cudalab.stream(s1):
        a.copy_(np.ones(256, np.float32))  # host to device, waits: still a write on s1
        a.fill_(3.0)
        event = s1.record_event()
    if ordered:
        s2.wait_event(event)
    with cudalab.stream(s2):
        b.copy_(a)  # device to device: reads a on s2
    assert kinds(session) == ([] if ordered else [sanitizer.RACE])
    if not ordered:
        r = session.reports[0]
        assert r.title == "possible data race (read after write)"
        assert r.current.operation == "copy (device to device)"
        assert r.previous.operation == "fill"


@pytest.mark.parametrize("ordered", [False, True])
def test_write_after_read_by_a_copy(session, ordered):
    a, b = cudalab.zeros(64), cudalab.empty(64)
    s1, s2 = cudalab.Stream(), cudalab.Stream()
    s1.wait_stream(cudalab.current_stream())
    with cudalab.stream(s1):
        b.copy_(a)
    if ordered:
        s2.wait_stream(s1)
    with cudalab.stream(s2):
        a.fill_(7)
    assert kinds(session) == ([] if ordered else [sanitizer.RACE])


# ----------------------------------------------------------------- host reads
@pytest.mark.parametrize("ordered", ["none", "stream", "event", "device", "wait_stream"])
def test_host_read_after_a_side_stream_write(session, ordered):
    a = cudalab.empty(128)
    side = cudalab.Stream()
    with cudalab.stream(side):
        a.fill_(1.0)
        e = side.record_event()
    if ordered == "stream":
        side.synchronize()
    elif ordered == "event":
        e.synchronize()
    elif ordered == "device":
        cudalab.synchronize()
    elif ordered == "wait_stream":
        cudalab.current_stream().wait_stream(side)
    out = a.numpy()
    assert out.shape == (128,)
    if ordered == "none":
        assert kinds(session) == [sanitizer.HOST_READ]
        assert session.reports[0].current.operation == "copy (device to host)"
    else:
        assert session.reports == []


def test_host_read_on_the_writing_stream_is_ordered(session):
    a = cudalab.empty(32)
    a.fill_(2.0)
    a.numpy()
    a.fill_(3.0)  # the host waited for the copy: a new write is after it
    assert session.reports == []


# ----------------------------------------------------------------- RNG and kernels
@pytest.mark.parametrize("ordered", [False, True])
def test_rng_draw_races_with_a_read(session, ordered):
    a, b = cudalab.empty(1000), cudalab.empty(1000)
    s1, s2 = cudalab.Stream(), cudalab.Stream()
    with cudalab.stream(s1):
        cudalab.uniform_(a)
    if ordered:
        s2.wait_stream(s1)
    with cudalab.stream(s2):
        b.copy_(a)
    assert kinds(session) == ([] if ordered else [sanitizer.RACE])
    if not ordered:
        assert session.reports[0].previous.operation.startswith("kernel cudalab_rng_uniform")


@pytest.mark.parametrize("ordered", [False, True])
def test_annotated_kernel_launch(session, ordered):
    a = cudalab.zeros(64, dtype=np.uint32)
    s1, s2 = cudalab.Stream(), cudalab.Stream()
    s1.wait_stream(cudalab.current_stream())
    fill_kernel(4).launch(1, 64, (a.data_ptr(), 9, 64), stream=s1)
    if ordered:
        s2.wait_stream(s1)
    fill_kernel(4).launch(1, 64, (a.data_ptr(), 5, 64), stream=s2)
    assert kinds(session) == ([] if ordered else [sanitizer.RACE])
    if not ordered:
        assert session.reports[0].current.operation == "kernel cudalab_fill_u32"


def test_kernel_access_annotation_is_checked():
    from cudalab.kernels import Kernel

    src = 'extern "C" __global__ void k(float* a, int n) {}'
    with pytest.raises(ValueError, match="access has 1 entries"):
        Kernel("k_bad1", src, ("p", "i4"), access=("w",))
    with pytest.raises(ValueError, match="parameter 1 is not a pointer"):
        Kernel("k_bad2", src, ("p", "i4"), access=("w", "r"))
    with pytest.raises(ValueError, match="must be 'r', 'w', 'rw' or ''"):
        Kernel("k_bad3", src, ("p", "i4"), access=("x", ""))
    with pytest.raises(TypeError, match="not a string"):
        Kernel("k_bad4", src, ("p", "i4"), access="w")
    k = Kernel("k_ok", src, ("p", "p", "p", "i4"), access=("r", "w", "rw", ""))
    assert (k.reads, k.writes) == ((0,), (1, 2))
    assert Kernel("k_default", src, ("p", "i4")).writes == (0,)  # unannotated: written


# ----------------------------------------------------------------- views and overlap
@pytest.mark.parametrize("overlap", [False, True])
def test_disjoint_views_do_not_race(session, overlap):
    a = cudalab.empty(200)
    s1, s2 = cudalab.Stream(), cudalab.Stream()
    with cudalab.stream(s1):
        a[:100].fill_(1)
    with cudalab.stream(s2):
        a[90 if overlap else 100:].fill_(2)
    assert kinds(session) == ([sanitizer.RACE] if overlap else [])


# ----------------------------------------------------------------- frees
@pytest.mark.parametrize("fix", ["none", "record_stream", "wait_stream", "synchronize"])
def test_free_while_another_stream_reads(session, fix):
    a, b = cudalab.zeros(512), cudalab.empty(512)
    owner = cudalab.current_stream()
    user = cudalab.Stream()
    user.wait_stream(owner)
    with cudalab.stream(user):
        b.copy_(a)  # user reads a
    if fix == "record_stream":
        a.record_stream(user)
    elif fix == "wait_stream":
        owner.wait_stream(user)
    elif fix == "synchronize":
        user.synchronize()
    del a
    gc.collect()
    if fix == "none":
        assert kinds(session) == [sanitizer.UNSAFE_REUSE]
        r = session.reports[0]
        assert r.current.operation.startswith("free")
        assert "record_stream" in r.fix
    else:
        assert session.reports == []


def test_free_through_caching_allocator_delete(session):
    import cudalab.memory as cm

    ptr = cm.caching_allocator_alloc(4096)
    user = cudalab.Stream()
    sanitizer.record_launch(writes=[(ptr, 4096)], stream=user, name="foreign write")
    cm.caching_allocator_delete(ptr)
    assert kinds(session) == [sanitizer.UNSAFE_REUSE]


def test_freed_memory_starts_a_new_history(session):
    a = cudalab.empty(256)
    side = cudalab.Stream()
    with cudalab.stream(side):
        a.fill_(1)
    side.synchronize()
    del a
    b = cudalab.empty(256)  # the same block: its history is new
    b.fill_(2)
    assert session.reports == []


# ----------------------------------------------------------------- memory seen late
def test_memory_allocated_before_the_sanitizer_is_tracked_from_its_first_access():
    a = cudalab.empty(64)
    with sanitizer.sanitize("collect") as session:
        s1, s2 = cudalab.Stream(), cudalab.Stream()
        with cudalab.stream(s1):
            a.fill_(1)
        with cudalab.stream(s2):
            a.fill_(2)
    assert kinds(session) == [sanitizer.RACE]
    assert session.reports[0].allocation_stack is None
    assert "Trace for the allocation not found" in str(session.reports[0])


# ----------------------------------------------------------------- devices
def test_peer_copy_is_ordered_by_the_cross_device_rule(session, two_devices):
    src = cudalab.empty(64, device=1)
    with cudalab.device(1):
        src.fill_(4.0)  # on device 1's current stream, which the peer copy waits for
    dst = src.to(0)
    assert session.reports == []
    side = cudalab.Stream(device=1)
    with cudalab.stream(side):
        src.fill_(6.0)  # not ordered with the copy that read src
    assert [r.kind for r in session.reports] == [sanitizer.RACE]
    assert session.reports[0].previous.operation == "copy (peer)"
    del dst
