"""CUDAGraph and graph(): capture, replay, reset, errors and their texts, debug dumps, the repr
(torch's test names from test/test_cuda.py where they apply). Simulator and GPU alike."""

from __future__ import annotations

import os
import threading
import warnings

import numpy as np
import pytest

import cudalab
from cudalab import graphs
from tests.graphs.conftest import add, add_new


def _ones(n=1000):
    return cudalab.array.full((n,), 1.0, np.float32)


def _side_stream():
    s = cudalab.Stream()
    s.wait_stream(cudalab.current_stream())
    return s


def test_graph_is_current_stream_capturing():
    assert not cudalab.is_current_stream_capturing()
    s = _side_stream()
    g = cudalab.CUDAGraph()
    with cudalab.stream(s):
        a = _ones()
        g.capture_begin()
        assert cudalab.is_current_stream_capturing()
        add(a, a, 1)
        g.capture_end()
    assert not cudalab.is_current_stream_capturing()


def test_graph_capture_simple():
    s = _side_stream()
    a = _ones()
    with cudalab.stream(s):
        add_new(a, 0)  # warm up: the kernel loads outside the capture
        g = cudalab.CUDAGraph()
        g.capture_begin()
        b = a
        for _ in range(10):
            b = add_new(b, 1)
        g.capture_end()
    cudalab.current_stream().wait_stream(s)
    g.replay()
    assert b.numpy().sum() == 11000.0


def test_capture_records_instead_of_running():
    a = _ones()
    s = _side_stream()
    g = cudalab.CUDAGraph()
    with cudalab.stream(s):
        add(a, a, 0)
        cudalab.current_stream().synchronize()
        g.capture_begin()
        add(a, a, 5)
        g.capture_end()
    assert a.numpy().sum() == 1000.0  # captured, not run
    g.replay()
    g.replay()
    assert a.numpy().sum() == 11000.0  # every replay runs it once


def test_graph_capture_reset_recapture():
    s = _side_stream()
    a = _ones()
    with cudalab.stream(s):
        add_new(a, 0)
        g = cudalab.CUDAGraph()
        g.capture_begin()
        b = a
        for _ in range(10):
            b = add_new(b, 1)
        g.capture_end()
    cudalab.current_stream().wait_stream(s)
    g.replay()
    assert b.numpy().sum() == 11000.0
    g.reset()
    assert "state=empty" in repr(g)
    with cudalab.stream(s):
        g.capture_begin()
        b = a
        for _ in range(10):
            b = add_new(b, 2)
        g.capture_end()
    cudalab.current_stream().wait_stream(s)
    g.replay()
    assert b.numpy().sum() == 21000.0
    del g


def test_graph_error():
    g = cudalab.CUDAGraph()
    with pytest.raises(RuntimeError, match=r"CUDA graphs must be captured on a non-default "
                                           r"stream\. \(However, after capture, it's ok to "
                                           r"replay them on the default stream\.\)"):
        g.capture_begin()
    assert not cudalab.is_current_stream_capturing()
    assert "state=empty" in repr(g)
    with pytest.raises(RuntimeError, match="capture_end\\(\\) called before capture_begin\\(\\)."):
        g.capture_end()
    with pytest.raises(RuntimeError, match="Called CUDAGraph::replay without a preceding "
                                           "successful capture."):
        g.replay()
    with pytest.raises(RuntimeError, match="Called CUDAGraph::pool\\(\\) without a preceding "
                                           "successful capture."):
        g.pool()
    with pytest.raises(RuntimeError, match="Unknown capture error mode. Expected `global`, "
                                           "`thread_local`, or `relaxed`, got local"):
        g.capture_begin(capture_error_mode="local")
    with pytest.raises(TypeError, match="capture_error_mode must be a str"):
        g.capture_begin(capture_error_mode=0)
    with pytest.raises(TypeError, match="keep_graph must be a bool"):
        cudalab.CUDAGraph(keep_graph=1)
    with pytest.raises(TypeError, match="cuda_graph must be a cudalab.CUDAGraph"):
        cudalab.graph(object())


def test_capture_begin_twice_and_end_on_other_stream():
    a = _ones()
    s, other = _side_stream(), _side_stream()
    g = cudalab.CUDAGraph()
    with cudalab.stream(s):
        g.capture_begin()
        add(a, a, 1)
        with pytest.raises(RuntimeError, match="already owns a captured graph"):
            g.capture_begin()
        with cudalab.stream(other), pytest.raises(
                RuntimeError, match="Capture must end on the same stream it began on."):
            g.capture_end()
        g.capture_end()
    with cudalab.stream(s), pytest.raises(RuntimeError, match="already owns a captured graph. "
                                                                "To capture a new graph, create "
                                                                "a new instance."):
        g.capture_begin()


def test_graph_warn_if_has_zero_nodes():
    g = cudalab.CUDAGraph()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cudalab.graph(g):
            pass
    assert any("The CUDA Graph is empty. This usually means that the graph was attempted to "
               "be captured on wrong device or stream." in str(w.message) for w in caught)
    g.replay()  # an empty graph replays (nothing happens)


def test_graph_debugdump(tmp_path):
    a = _ones()
    g = cudalab.CUDAGraph()
    g.enable_debug_mode()
    with cudalab.graph(g):
        add(a, a, 1)
        add(a, a, 1)
    path = tmp_path / "graph.dot"
    path.write_text("old")
    g.debug_dump(path)
    text = path.read_text()
    assert text.startswith("digraph") and text != "old"
    assert not [p for p in os.listdir(tmp_path) if p != "graph.dot"]  # no temporary left
    g.replay()
    assert a.numpy()[0] == 3.0


def test_debug_dump_without_debug_mode_warns(tmp_path):
    g = cudalab.CUDAGraph()
    a = _ones()
    with cudalab.graph(g):
        add(a, a, 1)
    with pytest.warns(UserWarning, match=r"CUDA Graphs debug not enabled, set with "
                                         r"\[graph\]\.enable_debug_mode\(\)"):
        g.debug_dump(tmp_path / "g.dot")
    assert not (tmp_path / "g.dot").exists()


def test_keep_graph_instantiate_and_raw_handles():
    a = _ones()
    g = cudalab.CUDAGraph(keep_graph=True)
    with pytest.raises(RuntimeError, match="until capture_end\\(\\) has been called"):
        g.raw_cuda_graph()
    with pytest.raises(RuntimeError, match="capture_end\\(\\) must have been called before "
                                           "calling instantiate"):
        g.instantiate()
    with cudalab.graph(g):
        add(a, a, 1)
    assert "state=captured" in repr(g)
    assert g.raw_cuda_graph() != 0
    with pytest.raises(RuntimeError, match="until instantiate\\(\\) has been called"):
        g.raw_cuda_graph_exec()
    g.instantiate()
    assert "state=ready" in repr(g) and g.raw_cuda_graph_exec() != 0
    g.replay()
    g.instantiate()  # again: a new executable
    g.replay()
    assert a.numpy()[0] == 3.0

    plain = cudalab.CUDAGraph()
    with cudalab.graph(plain):
        add(a, a, 1)
    with pytest.raises(RuntimeError, match="unless CUDAGraph was initialized with "
                                           "keep_graph=true"):
        plain.raw_cuda_graph()
    with pytest.raises(RuntimeError, match="instantiate\\(\\) is intended to be called by the "
                                           "user only when keep_graph=true"):
        plain.instantiate()


def test_keep_graph_replay_instantiates_on_first_replay():
    a = _ones()
    g = cudalab.CUDAGraph(keep_graph=True)
    with cudalab.graph(g):
        add(a, a, 1)
    g.replay()
    assert "state=ready" in repr(g) and a.numpy()[0] == 2.0


def test_repr_shows_the_state_and_nodes():
    g = cudalab.CUDAGraph(keep_graph=True)
    assert repr(g) == "<cudalab.CUDAGraph state=empty keep_graph=True>"
    a = _ones()
    s = _side_stream()
    with cudalab.stream(s):
        g.capture_begin()
        assert "state=capturing" in repr(g)
        add(a, a, 1)
        a.fill_(3.0)
        g.capture_end()
    r = repr(g)
    assert "state=captured" in r and "nodes=2" in r and f"pool={g.pool()}" in r
    assert g.node_kinds() == ["kernel", "kernel"]  # (a fill in a capture is a kernel node)
    g.instantiate()
    assert "state=ready" in repr(g)
    plain = cudalab.CUDAGraph()
    with cudalab.graph(plain):
        add(a, a, 1)
    with pytest.raises(RuntimeError, match="keep_graph=True"):
        plain.node_kinds()


def test_graph_context_ends_the_capture_when_the_body_raises():
    g = cudalab.CUDAGraph()
    a = _ones()
    with pytest.raises(ZeroDivisionError), cudalab.graph(g):
        add(a, a, 1)
        1 / 0  # noqa: B018
    assert not cudalab.is_current_stream_capturing()
    assert cudalab.current_stream() == cudalab.default_stream()
    # the graph captured what came before: capture_end ran
    g.replay()
    assert a.numpy()[0] == 2.0


def test_graph_context_shares_one_default_capture_stream():
    g1, g2 = cudalab.CUDAGraph(), cudalab.CUDAGraph()
    c1, c2 = cudalab.graph(g1), cudalab.graph(g2)
    assert c1.capture_stream is c2.capture_stream is cudalab.graph.default_capture_stream
    s = cudalab.Stream()
    assert cudalab.graph(g1, stream=s).capture_stream is s
    a = _ones()
    with c1:
        assert cudalab.current_stream() == c1.capture_stream
        add(a, a, 1)
    assert cudalab.current_stream() == cudalab.default_stream()


def test_replay_on_the_default_stream_after_capture():
    a = _ones()
    g = cudalab.CUDAGraph()
    with cudalab.graph(g):
        add(a, a, 2)
    with cudalab.stream(cudalab.default_stream()):
        g.replay()
    assert a.numpy()[0] == 3.0


def test_get_currently_capturing_graph():
    g = cudalab.CUDAGraph()
    with pytest.raises(RuntimeError, match="The current stream is not currently capturing."):
        cudalab.CUDAGraph.get_currently_capturing_graph()
    a = _ones()
    with cudalab.graph(g):
        assert cudalab.CUDAGraph.get_currently_capturing_graph() is g
        add(a, a, 1)


def test_multi_stream_capture_fork_and_join():
    a, b = _ones(), _ones()
    g = cudalab.CUDAGraph(keep_graph=True)
    side = cudalab.Stream()
    with cudalab.graph(g):
        main = cudalab.current_stream()
        side.wait_stream(main)  # fork: side joins the capture
        add(a, a, 1)
        with cudalab.stream(side):
            assert cudalab.is_current_stream_capturing()
            add(b, b, 2)
        main.wait_stream(side)  # join
    with cudalab.stream(side):
        assert not cudalab.is_current_stream_capturing()  # the end took side out too
    assert g.node_kinds().count("kernel") == 2
    g.replay()
    assert a.numpy()[0] == 2.0 and b.numpy()[0] == 3.0


def test_multi_stream_capture_unjoined_fork_fails_and_recovers():
    b = _ones()
    g = cudalab.CUDAGraph()
    side = cudalab.Stream()
    with pytest.raises(cudalab.StreamCaptureError) as info, cudalab.graph(g):
        side.wait_stream(cudalab.current_stream())
        with cudalab.stream(side):
            add(b, b, 2)  # never joined back
    assert info.value.code == 904
    assert not cudalab.is_current_stream_capturing()
    with cudalab.stream(side):
        assert not cudalab.is_current_stream_capturing()
    g2 = cudalab.CUDAGraph()
    with cudalab.graph(g2):
        add(b, b, 1)
    g2.replay()
    assert b.numpy()[0] == 2.0


def test_get_currently_capturing_graph_from_unrelated_stream():
    g = cudalab.CUDAGraph()
    other = cudalab.Stream()
    a = _ones()
    with cudalab.graph(g):
        add(a, a, 1)
        with cudalab.stream(other), pytest.raises(
                RuntimeError, match="The current stream is not currently capturing."):
            cudalab.CUDAGraph.get_currently_capturing_graph()


def test_graph_module_names():
    assert cudalab.CUDAGraph is graphs.CUDAGraph
    assert cudalab.graph is graphs.graph
    assert cudalab.make_graphed_callables is graphs.make_graphed_callables
    assert cudalab.is_current_stream_capturing is graphs.is_current_stream_capturing
    assert graphs.graph_pool_handle is cudalab.graph_pool_handle


def test_capture_in_two_threads_thread_local():
    """Two threads capture at the same time in thread_local mode: each graph gets its own
    thread's work only."""
    arrays = [_ones(), _ones()]
    graphs_ = [cudalab.CUDAGraph(), cudalab.CUDAGraph()]
    both_capturing = threading.Barrier(2, timeout=30)
    errors = []

    def run(i):
        try:
            s = cudalab.Stream()
            with cudalab.stream(s):
                graphs_[i].capture_begin(capture_error_mode="thread_local")
                both_capturing.wait()
                add(arrays[i], arrays[i], i + 1)
                both_capturing.wait()
                graphs_[i].capture_end()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
            both_capturing.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert arrays[0].numpy()[0] == 1.0 and arrays[1].numpy()[0] == 1.0  # captured, not run
    graphs_[1].replay()
    assert arrays[0].numpy()[0] == 1.0 and arrays[1].numpy()[0] == 3.0
    graphs_[0].replay()
    assert arrays[0].numpy()[0] == 2.0


def test_reads_of_captured_arrays_wait_for_a_replay_on_another_stream():
    """An array allocated in the capture is read on the capture stream (its allocation
    stream): a replay on another stream must be ordered before such reads."""
    from cudalab import _internal
    from tests.helpers.gpu import HAS_GPU

    if HAS_GPU:
        pytest.skip("holds a stream back with the simulator's pause_stream hook")
    a = _ones()
    g = cudalab.CUDAGraph()
    with cudalab.graph(g):
        b = add_new(a, 1)
    replay_stream = cudalab.Stream()
    b_backend = _internal.backend()
    b_backend.pause_stream(_internal.stream_handle(replay_stream))
    try:
        with cudalab.stream(replay_stream):
            g.replay()  # queued behind the pause
        host = np.zeros(b.shape, b.dtype)  # kept alive: the copy stays queued
        with pytest.raises(RuntimeError, match="would wait forever"):
            b.numpy(out=host)  # ordered after the replay: it cannot run yet
        assert host[0] == 0.0
    finally:
        b_backend.resume_stream(_internal.stream_handle(replay_stream))
    cudalab.synchronize()
    assert host[0] == 2.0  # the queued copy ran after the replay


def test_graphs_without_allocations_add_nothing_to_a_replay():
    """A replay is one graph launch, plus the join event only when the capture allocated
    (and the generator refresh only when it drew random numbers)."""
    from cudalab.testing import count_calls

    names = ("graph_launch", "event_record", "stream_wait_event", "launch", "launch_values")
    a = _ones()
    g = cudalab.CUDAGraph()
    with cudalab.graph(g):
        add(a, a, 1)
    with count_calls(names) as calls:
        g.replay()
    assert dict(calls) == {"graph_launch": 1}
    g2 = cudalab.CUDAGraph()
    with cudalab.graph(g2):
        add_new(a, 1)
    with count_calls(names) as calls:
        g2.replay()
    assert dict(calls) == {"graph_launch": 1, "event_record": 1, "stream_wait_event": 1}


def test_graph_timing_with_external_events():
    """torch's test_graph_timing: events made with ``external=True`` recorded inside the
    capture become event-record nodes; each replay records them (issue 36, item 5)."""
    x = cudalab.array.full((1 << 16,), 1.0, np.float32)
    add(x, x, 0)  # warm up
    g = cudalab.CUDAGraph(keep_graph=True)
    start_event = cudalab.Event(enable_timing=True, external=True)
    end_event = cudalab.Event(enable_timing=True, external=True)
    assert start_event.external and not cudalab.Event().external
    with cudalab.graph(g):
        start_event.record()
        add(x, x, 1)
        end_event.record()
    assert g.node_kinds() == ["event_record", "kernel", "event_record"]
    cudalab.synchronize()
    g.replay()
    cudalab.synchronize()
    assert start_event.query() and end_event.query()
    assert start_event.elapsed_time(end_event) >= 0
    assert x.numpy()[0] == 2.0
    g.replay()
    end_event.synchronize()
    assert x.numpy()[0] == 3.0


def test_external_event_outside_a_capture_records_as_usual():
    s = cudalab.Stream()
    a, b = cudalab.Event(enable_timing=True, external=True), cudalab.Event(enable_timing=True)
    a.record(s)
    b.record(s)
    b.synchronize()
    assert a.query() and a.elapsed_time(b) >= 0
