"""Issue 20's kernels inside a CUDA graph: array operators, jiterator functions and
reductions are captured like any launch, and each replay recomputes from the inputs' current
contents (simulator and GPU alike)."""

from __future__ import annotations

import numpy as np

import cudalab
from cudalab.jiterator import _create_jit_fn


def test_operators_jit_functions_and_reductions_replay_on_new_inputs():
    axpb = _create_jit_fn("template <typename T> T axpb(T x, T a, T b) { return a * x + b; }",
                          a=2.0, b=1.0)
    x = cudalab.asarray(np.arange(8, dtype=np.float32))
    g = cudalab.CUDAGraph()
    cudalab.synchronize()
    with cudalab.graph(g):
        y = axpb(x)          # 2x + 1
        z = y * y - x        # elementwise on the graph's private pool
        total = z.sum()
    g.replay()
    host = np.arange(8, dtype=np.float32)
    expected = (2 * host + 1) ** 2 - host
    np.testing.assert_array_equal(z.numpy(), expected)
    assert total.item() == expected.sum()
    x.copy_(np.full(8, 3.0, np.float32))  # new contents: the replay reads them
    g.replay()
    np.testing.assert_array_equal(z.numpy(), np.full(8, 46.0, np.float32))
    assert total.item() == 8 * 46.0
    del y, z, total
    g.reset()
