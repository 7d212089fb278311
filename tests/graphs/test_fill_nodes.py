"""``fill_`` inside a capture records a kernel node, never a memset node (a memset node costs
far more host time per replay: issue 37, section 1), and the graph's fills write what the
eager ones write. Simulator and GPU alike."""

from __future__ import annotations

import numpy as np
import pytest

import cudalab
from cudalab import streams

# (dtype, value, element count): byte-uniform, uniform 4-byte, 2-byte, 8-byte patterns, zero,
# and sizes that are not a multiple of 8 bytes (the kernel is not widened there).
FILLS = [
    (np.float32, 1.0, 1024),
    (np.float16, 1.0, 1024),
    (np.uint8, 7, 1024),
    (np.uint8, 7, 1023),
    (np.int64, 5, 1024),
    (np.int32, 0, 1024),
    (np.int16, -2, 1023),
    (np.float32, 2.5, 1),
    (np.complex64, 1 + 2j, 100),
]


def _side_stream():
    s = cudalab.Stream()
    s.wait_stream(cudalab.current_stream())
    return s


@pytest.mark.parametrize("dtype, value, n", FILLS)
def test_a_fill_in_a_capture_is_a_kernel_node(dtype, value, n):
    a = cudalab.array.zeros((n,), dtype)
    s = _side_stream()
    g = cudalab.CUDAGraph(keep_graph=True)
    with cudalab.stream(s):
        g.capture_begin()
        a.fill_(value)
        g.capture_end()
    assert g.node_kinds() == ["kernel"]
    np.testing.assert_array_equal(a.numpy(), np.zeros(n, dtype))  # nothing ran yet
    g.replay()
    expected = np.full(n, value, dtype)
    np.testing.assert_array_equal(a.numpy(), expected)
    # the eager fill (memset or kernel, whichever it takes) writes the same
    b = cudalab.array.zeros((n,), dtype)
    b.fill_(value)
    np.testing.assert_array_equal(b.numpy(), expected)


def test_an_offset_fill_in_a_capture_is_right():
    """A view starting 1 byte in: not 8-byte aligned, so the 1-byte kernel fills it."""
    base = cudalab.array.zeros((64,), np.uint8)
    view = base[1:62]
    s = _side_stream()
    g = cudalab.CUDAGraph(keep_graph=True)
    with cudalab.stream(s):
        g.capture_begin()
        view.fill_(9)
        g.capture_end()
    assert g.node_kinds() == ["kernel"]
    g.replay()
    expected = np.zeros(64, np.uint8)
    expected[1:62] = 9
    np.testing.assert_array_equal(base.numpy(), expected)


def test_the_capture_map_empties_when_the_capture_ends_or_fails():
    assert not streams.open_captures
    s = _side_stream()
    g = cudalab.CUDAGraph()
    with cudalab.stream(s):
        g.capture_begin()
        assert len(streams.open_captures) == 1
        cudalab.array.zeros((8,), np.float32)  # a fill: the graph is not empty
        g.capture_end()
    assert not streams.open_captures
    bad = cudalab.CUDAGraph()
    with cudalab.stream(s):
        bad.capture_begin()
    assert streams.open_captures
    with cudalab.stream(s), pytest.raises(RuntimeError):
        cudalab.synchronize()  # refused while capturing: the capture is invalidated
    with cudalab.stream(s), pytest.raises(Exception):  # noqa: B017 - the broken capture's end
        bad.capture_end()
    assert not streams.open_captures


def test_an_eager_fill_beside_a_capture_is_right():
    """Another stream's fill while a capture is open takes the kernel too, eagerly."""
    a = cudalab.array.zeros((256,), np.float32)
    other = cudalab.array.zeros((256,), np.float32)
    s = _side_stream()
    eager = cudalab.Stream()
    g = cudalab.CUDAGraph()
    with cudalab.stream(s):
        g.capture_begin(capture_error_mode="relaxed")
        a.fill_(1.0)
        with cudalab.stream(eager):
            other.fill_(3.0)
        g.capture_end()
    eager.synchronize()
    np.testing.assert_array_equal(other.numpy(), np.full(256, 3.0, np.float32))
    g.replay()
    np.testing.assert_array_equal(a.numpy(), np.full(256, 1.0, np.float32))


def test_the_fill_kernels_load_before_the_capture(monkeypatch):
    """A fill in a capture takes a kernel even where an eager warm-up took a memset: the
    kernels are loaded at capture_begin, so no module load happens inside the capture."""
    from cudalab import _internal
    from cudalab._kernels.fill import ALL_FILL_KERNELS

    backend = _internal.backend()
    for kernel in ALL_FILL_KERNELS:  # as in a process that never launched them
        monkeypatch.setattr(kernel, "_functions", {})
        monkeypatch.setattr(kernel, "_tls", type(kernel._tls)())
    loads = []
    load = backend.module_load

    def spy(device, image):
        loads.append(bool(streams.open_captures))
        return load(device, image)

    monkeypatch.setattr(backend, "module_load", spy)
    a = cudalab.array.zeros((256,), np.float32)
    a.fill_(1.0)  # the eager warm-up: a memset, no kernel
    assert loads == []
    s = _side_stream()
    g = cudalab.CUDAGraph(keep_graph=True)
    with cudalab.stream(s):
        g.capture_begin()
        a.fill_(2.0)
        g.capture_end()
    assert g.node_kinds() == ["kernel"]
    assert len(loads) == len(ALL_FILL_KERNELS) and not any(loads)  # all before the capture
    g.replay()
    np.testing.assert_array_equal(a.numpy(), np.full(256, 2.0, np.float32))
