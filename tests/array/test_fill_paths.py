"""``fill_`` takes one path per pattern, size and alignment (issue 37, section 1), and every
path writes exactly the bits numpy writes, nothing outside the range: eagerly cuMemsetD8 /
D16 / D32 or the fill kernels, inside a capture the 16-byte vector kernel or the narrower
ones. Each case names the path it must take, so a path that changes is seen, and the bytes
around the filled range are checked, so a kernel that writes past its range is seen."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import cudalab
from cudalab import _internal
from cudalab._kernels.fill import FILL_KERNELS, VECTOR_FILL_KERNEL

#: Backend calls and kernels a fill may take, by the name the cases use.
_KERNEL_NAMES = {VECTOR_FILL_KERNEL.name: "v16", **{k.name: f"u{8 * i}" for i, k in FILL_KERNELS.items()}}

# (dtype, value, start element, element count, eager path, captured path)
CASES = [
    # float32 1.0: a 4-byte pattern -> D32; 4 KiB aligned -> the vector kernel
    (np.float32, 1.0, 0, 1024, "d32", "v16"),
    (np.float32, 1.0, 1, 1023, "d32", "u32"),  # starts 4 bytes in: not 8-byte aligned
    (np.float32, 0.0, 0, 1024, "d8", "v16"),  # byte-uniform
    # float16 1.0 (0x3C00): D32 of the doubled pattern where 4-byte aligned, else D16
    (np.float16, 1.0, 0, 1024, "d32", "v16"),
    (np.float16, 1.0, 0, 1023, "d16", "u16"),  # 2046 bytes: not a multiple of 4
    (np.float16, 1.0, 1, 1023, "d16", "u16"),  # starts 2 bytes in
    (np.float16, 1.0, 4, 1020, "d32", "u64"),  # starts 8 bytes in: 8-byte aligned
    (np.float16, -2.5, 8, 8, "d32", "v16"),  # 16 bytes at 16
    # uint8 7: byte-uniform -> D8
    (np.uint8, 7, 0, 1024, "d8", "v16"),
    (np.uint8, 7, 0, 1023, "d8", "u8"),
    (np.uint8, 7, 3, 61, "d8", "u8"),
    (np.uint8, 7, 8, 8, "d8", "u64"),
    # int64 5: 8-byte pattern -> the kernel eagerly too
    (np.int64, 5, 0, 1024, "v16", "v16"),
    (np.int64, 5, 1, 1023, "u64", "u64"),  # starts 8 bytes in
    (np.int64, 5, 0, 1, "u64", "u64"),
    (np.int64, -1, 0, 1024, "d8", "v16"),  # byte-uniform
    # sizes around the vector kernel's one block (256 vectors = 4 KiB) and past it
    (np.int64, 5, 0, 2 * 257, "v16", "v16"),
    (np.int64, 5, 0, 2 * 3000, "v16", "v16"),
    (np.int32, 0x01020304, 0, 4, "d32", "v16"),
    (np.int16, -2, 0, 1023, "d16", "u16"),
    (np.complex64, 1 + 2j, 0, 101, "u64", "u64"),  # 808 bytes: not a multiple of 16
    (np.complex64, 1 + 2j, 0, 128, "v16", "v16"),
    (np.complex128, 1 + 1j, 0, 64, "v16", "v16"),  # equal halves: an 8-byte pattern
]


@pytest.fixture
def paths(monkeypatch):
    """The paths fills take, in order: "d8", "d16", "d32" or a kernel's short name."""
    taken: list[str] = []
    backend = _internal.backend()
    for name in ("memset_d8_async", "memset_d16_async", "memset_d32_async"):
        real = getattr(backend, name)

        def spy(*args, _real=real, _name=name):
            taken.append(_name.split("_")[1])
            return _real(*args)

        monkeypatch.setattr(backend, name, spy)
    for kernel in (*FILL_KERNELS.values(), VECTOR_FILL_KERNEL):
        real = kernel.launch_prepared

        def spy_launch(grid, block, values, stream, programmatic=False, *, _real=real,
                       _name=_KERNEL_NAMES[kernel.name]):
            taken.append(_name)
            return _real(grid, block, values, stream, programmatic)

        monkeypatch.setattr(kernel, "launch_prepared", spy_launch)
    return taken


def _filled(dtype, value, start, n, capture, paths):
    """The whole base array's bytes after filling elements [start, start + n) of a
    sentinel-filled array, eagerly or through a replayed capture; ``paths`` then holds the
    paths the fill took (and nothing else's)."""
    total = start + n + 3
    base = cudalab.array.empty((total,), dtype)
    base.view(np.uint8).copy_(np.full(base.nbytes, 0xA5, np.uint8))
    view = base[start:start + n]
    if capture:
        s = cudalab.Stream()
        s.wait_stream(cudalab.current_stream())
        g = cudalab.CUDAGraph(keep_graph=True)
        with cudalab.stream(s):
            g.capture_begin()
            paths.clear()
            view.fill_(value)
            g.capture_end()
        assert g.node_kinds() == ["kernel"]
        g.replay()
        s.synchronize()
    else:
        paths.clear()
        view.fill_(value)
    return base.numpy().view(np.uint8)


def _expected(dtype, value, start, n):
    host = np.frombuffer(np.full((start + n + 3) * np.dtype(dtype).itemsize, 0xA5, np.uint8).tobytes(),
                         dtype).copy()
    host[start:start + n] = value
    return host.view(np.uint8)


@pytest.mark.parametrize("dtype, value, start, n, eager, captured", CASES)
def test_each_fill_path_writes_the_right_bits(paths, dtype, value, start, n, eager, captured):
    got = _filled(dtype, value, start, n, False, paths)
    np.testing.assert_array_equal(got, _expected(dtype, value, start, n))
    assert paths == [eager]
    got = _filled(dtype, value, start, n, True, paths)
    np.testing.assert_array_equal(got, _expected(dtype, value, start, n))
    assert paths == [captured]


def test_the_vector_kernel_covers_the_range_exactly(paths):
    """One thread per 16-byte vector and no loop: the launch must cover every vector (a
    grid one block short would leave the tail unwritten), and write none past it."""
    for n in (2, 62, 64, 66, 510, 512, 514, 4094, 4096, 4098):  # int64 elements
        got = _filled(np.int64, 0x0102030405060708, 0, n, False, paths)
        np.testing.assert_array_equal(got, _expected(np.int64, 0x0102030405060708, 0, n))
        assert paths == ["v16"]


def test_the_vector_kernel_launch_shape(monkeypatch):
    """Up to 4 KiB: one block of whole warps; past it blocks of 256 threads."""
    shapes = []
    real = VECTOR_FILL_KERNEL.launch_prepared
    monkeypatch.setattr(VECTOR_FILL_KERNEL, "launch_prepared",
                        lambda grid, block, values, stream, programmatic=False: (
                            shapes.append((grid, block, values[2])),
                            real(grid, block, values, stream, programmatic)))
    for n in (2, 6, 512, 514, 8192):  # int64 elements: 1, 3, 256, 257 and 4096 vectors
        cudalab.array.empty((n,), np.int64).fill_(3)
    assert shapes == [((1, 1, 1), (32, 1, 1), 1), ((1, 1, 1), (32, 1, 1), 3),
                      ((1, 1, 1), (256, 1, 1), 256), ((2, 1, 1), (256, 1, 1), 257),
                      ((16, 1, 1), (256, 1, 1), 4096)]


def test_programmatic_fills_in_a_capture(monkeypatch):
    """With PROGRAMMATIC_FILLS on a device of compute capability 9.0+, a captured fill is
    launched with programmatic dependent launch, and a chain of such fills, then a kernel
    that reads the array, keep their order (each fill waits for the previous kernel). On
    the simulator the launch is an ordinary one (the attribute is only an optimisation);
    on a GPU the ordering is the driver's and the kernel's griddepcontrol.wait."""
    from cudalab import _array_memory

    backend = _internal.backend()
    calls = []
    real = backend.launch_values_programmatic

    def spy(*args):
        calls.append(args[1])  # the grid
        return real(*args)

    monkeypatch.setattr(backend, "launch_values_programmatic", spy)
    monkeypatch.setattr(_array_memory, "PROGRAMMATIC_FILLS", True)
    x = cudalab.array.zeros((4096,), np.float32)
    s = cudalab.Stream()
    s.wait_stream(cudalab.current_stream())
    g = cudalab.CUDAGraph()
    with cudalab.stream(s):
        g.capture_begin()
        for i in range(1, 201):
            x.fill_(float(i))
            x[: 64 * (i % 7)].fill_(-1.0)  # sizes alternate: some 16-byte vector, some not
        y = x + 1.0
        g.capture_end()
    g.replay()
    s.synchronize()
    expected = np.full(4096, 200.0, np.float32)
    expected[: 64 * (200 % 7)] = -1.0
    np.testing.assert_array_equal(x.numpy(), expected)
    np.testing.assert_array_equal(y.numpy(), expected + 1.0)
    major = cudalab.get_device_properties(0).major
    assert len(calls) == (400 - 200 // 7 if major >= 9 else 0)  # (x[:0] fills nothing)
    calls.clear()
    x.fill_(3.0)  # eagerly: a memset, never programmatic
    assert calls == []


def test_programmatic_fills_after_a_join_and_a_copy(monkeypatch):
    """Programmatic fills whose previous node is not a kernel (a copy) or is two nodes (a
    second stream joined through an event) capture and replay right too."""
    from cudalab import _array_memory

    monkeypatch.setattr(_array_memory, "PROGRAMMATIC_FILLS", True)
    x = cudalab.array.zeros((1024,), np.float32)
    y = cudalab.array.zeros((1024,), np.float32)
    source = cudalab.array.zeros((1024,), np.float32)
    source.fill_(5.0)
    cudalab.synchronize()
    s, side = cudalab.Stream(), cudalab.Stream()
    s.wait_stream(cudalab.current_stream())
    g = cudalab.CUDAGraph()
    with cudalab.stream(s):
        g.capture_begin()
        x.copy_(source)          # a copy node ...
        x[:512].fill_(1.0)       # ... then a fill
        side.wait_stream(s)      # fork
        with cudalab.stream(side):
            y.fill_(2.0)
            y[256:].fill_(3.0)
        x[512:].fill_(4.0)
        s.wait_stream(side)      # join: the next fill depends on both streams
        x[:256].fill_(6.0)
        y[:128].fill_(7.0)
        g.capture_end()
    x.fill_(0.0)
    y.fill_(0.0)
    g.replay()
    s.synchronize()
    expected_x = np.concatenate([np.full(256, 6.0), np.full(256, 1.0), np.full(512, 4.0)])
    expected_y = np.concatenate([np.full(128, 7.0), np.full(128, 2.0), np.full(768, 3.0)])
    np.testing.assert_array_equal(x.numpy(), expected_x.astype(np.float32))
    np.testing.assert_array_equal(y.numpy(), expected_y.astype(np.float32))


def test_programmatic_fills_are_on_unless_turned_off():
    code = "from cudalab import _array_memory as m; print(m.PROGRAMMATIC_FILLS)"
    seen = {}
    for value in (None, "0", "1"):
        env = {k: v for k, v in os.environ.items() if k != "CUDALAB_PROGRAMMATIC_FILLS"}
        if value is not None:
            env["CUDALAB_PROGRAMMATIC_FILLS"] = value
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        seen[value] = r.stdout.strip()
    assert seen == {None: "True", "0": "False", "1": "True"}
