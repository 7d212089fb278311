"""Operations a capture does not permit: each raises StreamCaptureError naming the cudalab
operation, the capture is invalidated and ended cleanly, and the next capture works; the
capture error modes refuse what the driver's modes define. Simulator and GPU alike."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import cudalab
from tests.graphs.conftest import add


def _ones(n=256):
    return cudalab.array.full((n,), 1.0, np.float32)


def _synchronize(a, ev):
    cudalab.synchronize()


def _event_query(a, ev):
    ev.query()


def _event_synchronize(a, ev):
    ev.synchronize()


def _stream_synchronize(a, ev):
    cudalab.current_stream().synchronize()


def _stream_query(a, ev):
    cudalab.current_stream().query()


def _numpy(a, ev):
    a.numpy()


def _copy_to_pageable(a, ev):
    b = cudalab.array.empty(a.shape, a.dtype)  # allocated on the capturing stream
    b.copy_(a)
    b.numpy(out=np.empty(a.shape, a.dtype))


def _empty_cache(a, ev):
    cudalab.memory.empty_cache()


ILLEGAL = [
    (_empty_cache, "cudalab.memory.empty_cache()"),
    (_synchronize, "cudalab.synchronize()"),
    (_event_query, "Event.query()"),
    (_event_synchronize, "Event.synchronize()"),
    (_stream_synchronize, "Stream.synchronize()"),
    (_stream_query, "Stream.query()"),
    (_numpy, "DeviceArray.numpy"),
    (_copy_to_pageable, "a copy to pageable host memory"),
]


@pytest.mark.parametrize(("operation", "name"), ILLEGAL, ids=[n for _, n in ILLEGAL])
def test_illegal_operation_names_itself_and_the_next_capture_works(operation, name):
    a = _ones()
    ev = cudalab.Event()
    ev.record()
    g = cudalab.CUDAGraph()
    with pytest.raises(cudalab.StreamCaptureError) as info, cudalab.graph(g):
        add(a, a, 1)
        operation(a, ev)
    assert name in str(info.value)
    assert "not allowed while a CUDA graph is being captured" in str(info.value)
    assert info.value.code == 900
    assert not cudalab.is_current_stream_capturing()
    assert "state=empty" in repr(g)
    # nothing of the failed capture ran, and a new capture (same object) works
    assert a.numpy()[0] == 1.0
    with cudalab.graph(g):
        add(a, a, 2)
    g.replay()
    assert a.numpy()[0] == 3.0
    ev.query()  # events work again once nothing captures
    cudalab.synchronize()


def test_capture_end_after_an_illegal_operation_raises_invalidated():
    a = _ones()
    g = cudalab.CUDAGraph()
    s = cudalab.Stream()
    with cudalab.stream(s):
        g.capture_begin()
        add(a, a, 1)
        with pytest.raises(cudalab.StreamCaptureError):
            cudalab.synchronize()
        with pytest.raises(cudalab.StreamCaptureError) as info:
            g.capture_end()
    assert info.value.code == 901
    assert not cudalab.is_current_stream_capturing()
    assert "state=empty" in repr(g)


def _in_thread(fn):
    box = []

    def run():
        try:
            fn()
            box.append(None)
        except BaseException as exc:  # noqa: BLE001
            box.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return box[0]


def test_global_mode_refuses_another_threads_stream_synchronize():
    a = _ones()
    other = cudalab.Stream()  # not part of the capture
    g = cudalab.CUDAGraph()
    with pytest.raises(cudalab.StreamCaptureError), cudalab.graph(g):
        add(a, a, 1)
        err = _in_thread(other.synchronize)
        assert isinstance(err, cudalab.StreamCaptureError)
        assert "Stream.synchronize()" in str(err)
        # the refused call invalidated this capture: leaving the block raises 901
    assert not cudalab.is_current_stream_capturing()


def test_thread_local_mode_allows_another_threads_stream_synchronize():
    a = _ones()
    other = cudalab.Stream()
    g = cudalab.CUDAGraph()
    with pytest.raises(cudalab.StreamCaptureError) as ended, \
            cudalab.graph(g, capture_error_mode="thread_local"):
        add(a, a, 1)
        assert _in_thread(other.synchronize) is None
        with pytest.raises(cudalab.StreamCaptureError):
            other.synchronize()  # but not the capturing thread's own
    assert ended.value.code == 901  # ...which invalidated the capture
    assert "state=empty" in repr(g)


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_device_synchronize_is_refused_in_every_mode_from_every_thread(mode):
    """cuCtxSynchronize would wait for the capturing stream too (the driver refuses it)."""
    a = _ones()
    g = cudalab.CUDAGraph()
    with pytest.raises(cudalab.StreamCaptureError), cudalab.graph(g, capture_error_mode=mode):
        add(a, a, 1)
        err = _in_thread(cudalab.synchronize)
        assert isinstance(err, cudalab.StreamCaptureError)
    assert not cudalab.is_current_stream_capturing()


def test_relaxed_mode_allows_the_capturing_threads_unsafe_calls():
    a = _ones()
    other = cudalab.Stream()
    ev = cudalab.Event()
    ev.record(other)
    g = cudalab.CUDAGraph()
    with cudalab.graph(g, capture_error_mode="relaxed"):
        add(a, a, 1)
        other.synchronize()
        assert ev.query()
    g.replay()
    assert a.numpy()[0] == 2.0


def test_relaxed_mode_still_refuses_syncing_the_capturing_stream():
    a = _ones()
    g = cudalab.CUDAGraph()
    with pytest.raises(cudalab.StreamCaptureError, match="Stream.synchronize"), \
            cudalab.graph(g, capture_error_mode="relaxed"):
        add(a, a, 1)
        cudalab.current_stream().synchronize()


def test_empty_graph_capture_on_a_stream_used_before():
    """A stream with finished work can capture; the graph has only the captured work."""
    a = _ones()
    s = cudalab.Stream()
    with cudalab.stream(s):
        add(a, a, 1)
    g = cudalab.CUDAGraph(keep_graph=True)
    with cudalab.graph(g, stream=s):
        add(a, a, 1)
    assert g.node_kinds() == ["kernel"]


@pytest.mark.parametrize("mode", ["global", "thread_local"])
def test_capture_end_from_another_thread_raises_and_ends_the_capture(mode):
    """torch: cudaErrorStreamCaptureWrongThread; the stream is no longer capturing,
    synchronize() works and the process captures again (issue 36, item 17)."""
    a = _ones()
    s = cudalab.Stream()
    g = cudalab.CUDAGraph()
    with cudalab.stream(s):
        g.capture_begin(capture_error_mode=mode)
        add(a, a, 1)

        def end():
            with cudalab.stream(s):
                g.capture_end()

        err = _in_thread(end)
        assert isinstance(err, cudalab.StreamCaptureError) and err.code == 908, err
        assert not cudalab.is_current_stream_capturing()
        assert "state=empty" in repr(g)
        with pytest.raises(RuntimeError, match="before capture_begin"):
            g.capture_end()
    cudalab.synchronize()
    cudalab.memory.empty_cache()
    g2 = cudalab.CUDAGraph()
    with cudalab.graph(g2):
        add(a, a, 1)
    before = a.numpy()[0]
    g2.replay()
    assert a.numpy()[0] == before + 1


def test_capture_end_from_another_thread_works_in_relaxed_mode():
    a = _ones()
    s = cudalab.Stream()
    g = cudalab.CUDAGraph()
    with cudalab.stream(s):
        g.capture_begin(capture_error_mode="relaxed")
        add(a, a, 1)

        def end():
            with cudalab.stream(s):
                g.capture_end()

        assert _in_thread(end) is None
        assert not cudalab.is_current_stream_capturing()
    g.replay()
    assert a.numpy()[0] == 2.0
