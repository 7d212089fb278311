"""Stream capture and graphs at the seam (Backend), on the simulator and on a GPU alike;
the simulator-only cases are the driver rules a GPU cannot be asked about safely."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from cudalab._driver.base import (
    CAPTURE_MODE_GLOBAL,
    CAPTURE_MODE_RELAXED,
    CAPTURE_MODE_THREAD_LOCAL,
    CAPTURE_STATUS_ACTIVE,
    CAPTURE_STATUS_INVALIDATED,
    CAPTURE_STATUS_NONE,
    EVENT_DISABLE_TIMING,
)
from cudalab.errors import CudaError, StreamCaptureError
from tests.helpers.gpu import HAS_GPU

sim_only = pytest.mark.skipif(HAS_GPU, reason="a driver rule checked on the simulator")


@pytest.fixture
def dev(backend):
    """(backend, a stream, a device buffer of 4 KiB, a host buffer of 4 KiB)."""
    s = backend.stream_create(0)
    ptr = backend.mem_alloc(0, 4096)
    host = backend.host_alloc(4096)
    yield backend, s, ptr, host
    backend.stream_synchronize(s)
    backend.mem_free(0, ptr)
    backend.host_free(host)
    backend.stream_destroy(s)


def _read(b, s, ptr, host, n=16):
    b.memcpy_async(0, host, ptr, n, s)
    b.stream_synchronize(s)
    return ctypes.string_at(host, n)


def test_capture_records_and_launch_replays(dev):
    b, s, ptr, host = dev
    b.memset_d8_async(0, ptr, 0, 4096, s)
    assert b.stream_capture_info(s) == (CAPTURE_STATUS_NONE, 0)
    b.stream_begin_capture(s, CAPTURE_MODE_GLOBAL)
    status, cid = b.stream_capture_info(s)
    assert status == CAPTURE_STATUS_ACTIVE and cid > 0
    assert b.stream_is_capturing(s)
    b.memset_d8_async(0, ptr, 7, 8, s)
    b.memcpy_async(0, ptr + 8, ptr, 8, s)
    g = b.stream_end_capture(s)
    assert not b.stream_is_capturing(s)
    assert b.stream_capture_info(s) == (CAPTURE_STATUS_NONE, 0)
    assert sorted(b.graph_node_kinds(g)) == ["memcpy", "memset"]
    assert b.graph_node_count(g) == 2
    assert _read(b, s, ptr, host) == bytes(16)  # nothing ran
    ex = b.graph_instantiate(g)
    b.graph_destroy(g)  # the executable stays valid
    b.graph_launch(ex, s)
    assert _read(b, s, ptr, host) == bytes([7] * 16)
    b.memset_d8_async(0, ptr, 0, 16, s)
    b.graph_launch(ex, s)
    assert _read(b, s, ptr, host) == bytes([7] * 16)
    b.graph_exec_destroy(ex)


def test_capture_ids_are_unique(dev):
    b, s, ptr, _host = dev
    ids = []
    for _ in range(3):
        b.stream_begin_capture(s, CAPTURE_MODE_RELAXED)
        ids.append(b.stream_capture_info(s)[1])
        b.memset_d8_async(0, ptr, 1, 4, s)
        b.graph_destroy(b.stream_end_capture(s))
    assert len(set(ids)) == 3


def test_fork_and_join_through_events(dev):
    b, s, ptr, host = dev
    side = b.stream_create(0)
    fork, join = b.event_create(0, EVENT_DISABLE_TIMING), b.event_create(0, EVENT_DISABLE_TIMING)
    b.memset_d8_async(0, ptr, 0, 4096, s)
    b.stream_synchronize(s)
    b.stream_begin_capture(s, CAPTURE_MODE_GLOBAL)
    b.event_record(fork, s)
    b.stream_wait_event(side, fork)
    assert b.stream_capture_info(side)[1] == b.stream_capture_info(s)[1]
    b.memset_d8_async(0, ptr, 3, 4, side)
    b.event_record(join, side)
    b.stream_wait_event(s, join)
    b.memset_d8_async(0, ptr + 4, 4, 4, s)
    g = b.stream_end_capture(s)
    assert not b.stream_is_capturing(side)
    assert sorted(b.graph_node_kinds(g)) == ["memset", "memset"]
    ex = b.graph_instantiate(g)
    b.graph_launch(ex, s)
    assert _read(b, s, ptr, host, 8) == bytes([3] * 4 + [4] * 4)
    for h in (fork, join):
        b.event_destroy(h)
    b.graph_exec_destroy(ex)
    b.graph_destroy(g)
    b.stream_destroy(side)


def test_unjoined_fork_fails_the_end(dev):
    b, s, ptr, _host = dev
    side = b.stream_create(0)
    fork = b.event_create(0, EVENT_DISABLE_TIMING)
    b.stream_begin_capture(s, CAPTURE_MODE_GLOBAL)
    b.event_record(fork, s)
    b.stream_wait_event(side, fork)
    b.memset_d8_async(0, ptr, 3, 4, side)
    with pytest.raises(StreamCaptureError) as info:
        b.stream_end_capture(s)
    assert info.value.code == 904
    assert not b.stream_is_capturing(s) and not b.stream_is_capturing(side)
    b.event_destroy(fork)
    b.stream_destroy(side)


def test_synchronize_during_capture_invalidates_it(dev):
    b, s, ptr, _host = dev
    b.stream_begin_capture(s, CAPTURE_MODE_GLOBAL)
    b.memset_d8_async(0, ptr, 3, 4, s)
    with pytest.raises(StreamCaptureError) as info:
        b.stream_synchronize(s)
    assert info.value.code == 900
    assert b.stream_capture_info(s)[0] == CAPTURE_STATUS_INVALIDATED
    with pytest.raises(StreamCaptureError) as ended:
        b.stream_end_capture(s)
    assert ended.value.code == 901
    assert not b.stream_is_capturing(s)


def test_thread_exchange_capture_mode_round_trip(backend):
    old = backend.thread_exchange_capture_mode(CAPTURE_MODE_RELAXED)
    assert old == CAPTURE_MODE_GLOBAL
    assert backend.thread_exchange_capture_mode(CAPTURE_MODE_THREAD_LOCAL) == CAPTURE_MODE_RELAXED
    assert backend.thread_exchange_capture_mode(old) == CAPTURE_MODE_THREAD_LOCAL


def test_relaxed_thread_mode_allows_unsafe_calls(dev):
    b, s, ptr, _host = dev
    other = b.stream_create(0)
    b.stream_begin_capture(s, CAPTURE_MODE_GLOBAL)
    b.memset_d8_async(0, ptr, 3, 4, s)
    old = b.thread_exchange_capture_mode(CAPTURE_MODE_RELAXED)
    try:
        b.stream_synchronize(other)  # another stream: allowed for a relaxed thread
    finally:
        b.thread_exchange_capture_mode(old)
    g = b.stream_end_capture(s)
    b.graph_destroy(g)
    b.stream_destroy(other)


def test_debug_dot_print_writes_a_dot_file(dev, tmp_path):
    b, s, ptr, _host = dev
    b.stream_begin_capture(s, CAPTURE_MODE_GLOBAL)
    b.memset_d8_async(0, ptr, 3, 4, s)
    g = b.stream_end_capture(s)
    path = tmp_path / "g.dot"
    b.graph_debug_dot_print(g, str(path))
    assert path.read_text().startswith("digraph")
    b.graph_destroy(g)


def test_capture_of_the_null_stream_is_refused(backend):
    backend.set_context(0)
    with pytest.raises(CudaError):
        backend.stream_begin_capture(backend.null_stream(0), CAPTURE_MODE_GLOBAL)
    s = backend.stream_create(0)
    assert not backend.stream_is_capturing(s)
    backend.stream_destroy(s)


@sim_only
def test_query_of_a_captured_event_is_refused(dev):
    b, s, ptr, _host = dev
    ev = b.event_create(0, EVENT_DISABLE_TIMING)
    b.stream_begin_capture(s, CAPTURE_MODE_RELAXED)
    b.event_record(ev, s)
    with pytest.raises(StreamCaptureError) as info:
        b.event_query(ev)
    assert info.value.code == 907
    with pytest.raises(StreamCaptureError):
        b.stream_end_capture(s)
    assert b.event_query(ev)  # the capture is over: the event was never recorded
    b.event_destroy(ev)


@sim_only
def test_async_copy_to_pageable_memory_is_refused(dev):
    b, s, ptr, _host = dev
    buf = np.zeros(16, np.uint8)
    b.stream_begin_capture(s, CAPTURE_MODE_RELAXED)
    with pytest.raises(StreamCaptureError, match="pageable"):
        b.memcpy_async(0, buf.ctypes.data, ptr, 16, s)
    with pytest.raises(StreamCaptureError):
        b.stream_end_capture(s)


@sim_only
def test_two_captures_cannot_merge(dev):
    b, s, ptr, _host = dev
    s2 = b.stream_create(0)
    ev = b.event_create(0, EVENT_DISABLE_TIMING)
    b.stream_begin_capture(s, CAPTURE_MODE_RELAXED)
    b.stream_begin_capture(s2, CAPTURE_MODE_RELAXED)
    b.event_record(ev, s)
    with pytest.raises(StreamCaptureError) as info:
        b.stream_wait_event(s2, ev)
    assert info.value.code == 902
    for st in (s, s2):
        with pytest.raises(StreamCaptureError):
            b.stream_end_capture(st)
    b.event_destroy(ev)
    b.stream_destroy(s2)


@sim_only
def test_end_from_another_thread_is_refused_unless_relaxed(dev):
    import threading

    b, s, ptr, _host = dev
    b.stream_begin_capture(s, CAPTURE_MODE_GLOBAL)
    b.memset_d8_async(0, ptr, 1, 4, s)
    box = []
    t = threading.Thread(target=lambda: box.append(_try(b.stream_end_capture, s)))
    t.start()
    t.join()
    assert isinstance(box[0], StreamCaptureError) and box[0].code == 908
    assert not b.stream_is_capturing(s)  # the capture is over (as on a GPU)
    with pytest.raises(StreamCaptureError) as info:
        b.stream_end_capture(s)
    assert info.value.code == 903
    b.stream_begin_capture(s, CAPTURE_MODE_RELAXED)
    b.memset_d8_async(0, ptr, 1, 4, s)
    t = threading.Thread(target=lambda: box.append(_try(b.stream_end_capture, s)))
    t.start()
    t.join()
    b.graph_destroy(box[1])


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001
        return exc
