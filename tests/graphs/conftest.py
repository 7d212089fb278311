"""Fixtures of the CUDA graph tests: an elementwise kernel to capture (with its numpy twin),
and a clean capture state around every test."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import cudalab
from cudalab.kernels import Kernel, launch_config_1d

ADD_SOURCE = r"""
extern "C" __global__ void cudalab_test_graph_add(float* out, const float* in, float value,
                                                  unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i] + value;
}
"""


def _add_twin(sim, grid, block, smem, out, src, value, n):
    o = sim.array(out, np.float32, n)
    o[:] = sim.array(src, np.float32, n) + np.float32(value)


ADD = Kernel("cudalab_test_graph_add", ADD_SOURCE, ("p", "p", "f4", "u8"), sim=_add_twin)

SUM_SOURCE = r"""
extern "C" __global__ void cudalab_test_graph_sum2(float* out, const float* a, const float* b,
                                                   unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}
"""


def _sum2_twin(sim, grid, block, smem, out, a, b, n):
    sim.array(out, np.float32, n)[:] = sim.array(a, np.float32, n) + sim.array(b, np.float32, n)


SUM2 = Kernel("cudalab_test_graph_sum2", SUM_SOURCE, ("p", "p", "p", "u8"), sim=_sum2_twin)


def add(out, src, value):
    """out = src + value on the current stream (float32 arrays of one size)."""
    n = src.size
    grid, block = launch_config_1d(n)
    ADD.launch(grid, block, (out, src, float(value), n))
    return out


def add_new(src, value):
    """A new array src + value (allocated on the current stream, like torch's b + 1)."""
    return add(cudalab.array.empty(src.shape, np.float32), src, value)


def sum2(a, b):
    """A new array a + b (torch's ``a + b``)."""
    out = cudalab.array.empty(a.shape, np.float32)
    grid, block = launch_config_1d(a.size)
    SUM2.launch(grid, block, (out, a, b, a.size))
    return out


def clone(x):
    """A copy of ``x`` in new memory (torch's ``clone()``)."""
    y = cudalab.array.empty(x.shape, x.dtype)
    y.copy_(x)
    return y


@pytest.fixture(scope="session")
def _warm_kernels():
    """Every kernel the tests capture, launched once eagerly: a capture cannot contain a
    kernel's first launch (it compiles and loads the module)."""
    cudalab.init()
    x = cudalab.array.full((8,), 1.0, np.float32)
    add(x, x, 1)
    sum2(x, x)
    cudalab.rand(8)
    cudalab.randn(8)
    cudalab.random.uniform_(x)
    cudalab.random.normal_(x)
    cudalab.random.bernoulli_(x, 0.5)
    cudalab.synchronize()


@pytest.fixture(autouse=True)
def _no_capture_left(_warm_kernels):
    cudalab.init()
    yield
    # a test must never leave a stream capturing (the next test's allocations would route)
    assert not cudalab.is_current_stream_capturing()
    gc.collect()  # graphs kept by a traceback: their pools and RNG words go now
    cudalab.synchronize()
