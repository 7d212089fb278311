"""make_graphed_callables for plain callables over DeviceArrays (torch's, without autograd)."""

from __future__ import annotations

import numpy as np
import pytest

import cudalab
from tests.graphs.conftest import add_new, sum2


def _full(value, n=64):
    return cudalab.array.full((n,), value, np.float32)


def test_graph_make_graphed_callables_single():
    calls = []

    def f(x):
        calls.append(1)
        return add_new(x, 1)

    sample = _full(0.0)
    gf = cudalab.make_graphed_callables(f, (sample,), num_warmup_iters=2)
    assert len(calls) == 3  # 2 warm-ups + the capture
    out = gf(_full(5.0))
    assert len(calls) == 3  # replays do not call f
    assert out.numpy()[0] == 6.0
    out2 = gf(_full(7.0))
    assert out2 is out and out.numpy()[0] == 8.0  # the static output, refreshed
    assert sample.numpy()[0] == 7.0  # the sample is the static input: calls copy into it
    sample.fill_(0.0)
    assert gf(sample).numpy()[0] == 1.0  # the static input itself: no copy


def test_graph_make_graphed_callables_tuple_share_a_pool():
    def f(x, y):
        return sum2(x, y), add_new(x, 1)

    def h(z):
        return add_new(z, 10)

    gf, gh = cudalab.make_graphed_callables((f, h), ((_full(0.0), _full(0.0)), (_full(0.0),)))
    s, p = gf(_full(1.0), _full(2.0))
    assert s.numpy()[0] == 3.0 and p.numpy()[0] == 2.0
    assert gh(_full(1.0)).numpy()[0] == 11.0
    assert gf.graph.pool() == gh.graph.pool()  # one shared pool, as torch


def test_make_graphed_callables_checks_its_arguments():
    with pytest.raises(TypeError, match="is not callable"):
        cudalab.make_graphed_callables(5, (_full(0.0),))
    with pytest.raises(TypeError, match="must be a cudalab DeviceArray"):
        cudalab.make_graphed_callables(lambda x: x, (np.zeros(3),))
    with pytest.raises(ValueError, match="num_warmup_iters must be >= 0"):
        cudalab.make_graphed_callables(lambda x: x, (_full(0.0),), num_warmup_iters=-1)
    with pytest.raises(ValueError, match="one tuple of arguments per callable"):
        cudalab.make_graphed_callables((lambda x: x, lambda x: x), ((_full(0.0),),))
    gf = cudalab.make_graphed_callables(lambda x: add_new(x, 1), (_full(0.0),))
    with pytest.raises(ValueError, match="argument 0 must be a DeviceArray of shape"):
        gf(_full(0.0, n=8))
    with pytest.raises(ValueError, match="takes 1 arguments, got 2"):
        gf(_full(0.0), _full(0.0))
