"""Random numbers inside captures: every replay draws fresh numbers at exactly the offsets the
same calls would use eagerly (torch's arithmetic), bit-exact with torch on a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import cudalab
from cudalab import random as crandom

N = 1000


def _generator_offset():
    return crandom.default_generators[cudalab.current_device()].get_offset()


def _eager(seed, calls):
    cudalab.manual_seed(seed)
    return [fn() for fn in calls]


def test_graph_rng_replays_match_eager_calls():
    cudalab.manual_seed(7)
    cudalab.rand(N)  # warm up
    cudalab.manual_seed(7)
    g = cudalab.CUDAGraph()
    with cudalab.graph(g):
        x = cudalab.rand(N)
    assert _generator_offset() == 0  # capture consumes nothing
    replays = []
    for _ in range(3):
        g.replay()
        replays.append(x.numpy().copy())
    after = cudalab.rand(N).numpy()
    offset = _generator_offset()
    expected = [a.numpy() for a in _eager(7, [lambda: cudalab.rand(N)] * 4)]
    for got, want in zip(replays + [after], expected, strict=True):
        np.testing.assert_array_equal(got, want)
    assert offset == _generator_offset()  # eager calls continue from the replays' offset
    assert not np.array_equal(replays[0], replays[1])


def test_graph_rng_functional_interleaved_with_eager():
    """graph(2 ops) -> eager(2 ops) -> graph(2 ops) equals 6 eager ops after one seed."""
    cudalab.manual_seed(128)
    g = cudalab.CUDAGraph()
    with cudalab.graph(g):
        u = cudalab.rand(N)
        n = cudalab.randn(N)
    cudalab.manual_seed(128)
    got = []
    g.replay()
    got += [u.numpy().copy(), n.numpy().copy()]
    got += [cudalab.rand(N).numpy(), cudalab.randn(N).numpy()]
    g.replay()
    got += [u.numpy().copy(), n.numpy().copy()]
    want = _eager(128, [lambda: cudalab.rand(N), lambda: cudalab.randn(N)] * 3)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b.numpy())


def test_graph_rng_distributions_in_place():
    a = cudalab.array.empty((N,), np.float32)
    b = cudalab.array.empty((N,), np.float32)
    c = cudalab.array.zeros((N,), np.float32)
    g = cudalab.CUDAGraph()
    cudalab.manual_seed(9999)
    with cudalab.graph(g):
        crandom.uniform_(a, -1.0, 1.0)
        crandom.normal_(b, 2.0, 0.5)
        crandom.bernoulli_(c, 0.25)
    assert not c.numpy().any()  # untouched before the replay
    cudalab.manual_seed(9999)
    g.replay()
    got = [a.numpy(), b.numpy(), c.numpy()]
    cudalab.manual_seed(9999)
    ea, eb, ec = (cudalab.array.empty((N,), np.float32) for _ in range(3))
    crandom.uniform_(ea, -1.0, 1.0)
    crandom.normal_(eb, 2.0, 0.5)
    crandom.bernoulli_(ec, 0.25)
    for x, y in zip(got, [ea.numpy(), eb.numpy(), ec.numpy()], strict=True):
        np.testing.assert_array_equal(x, y)


def test_replay_picks_up_a_new_manual_seed():
    g = cudalab.CUDAGraph()
    with cudalab.graph(g):
        x = cudalab.rand(N)
    cudalab.manual_seed(3)
    g.replay()
    first = x.numpy().copy()
    cudalab.manual_seed(3)
    g.replay()
    np.testing.assert_array_equal(first, x.numpy())
    cudalab.manual_seed(3)
    np.testing.assert_array_equal(first, cudalab.rand(N).numpy())


def test_register_generator_state_of_another_generator():
    gen = crandom.Generator()
    gen.manual_seed(11)
    cudalab.rand(N, generator=gen)  # warm up
    gen.manual_seed(11)
    g = cudalab.CUDAGraph()
    g.register_generator_state(gen)
    with cudalab.graph(g):
        x = cudalab.rand(N, generator=gen)
    g.replay()
    first = x.numpy().copy()
    g.replay()
    second = x.numpy().copy()
    gen.manual_seed(11)
    np.testing.assert_array_equal(first, cudalab.rand(N, generator=gen).numpy())
    np.testing.assert_array_equal(second, cudalab.rand(N, generator=gen).numpy())
    with pytest.raises(TypeError, match="register_generator_state expects"):
        g.register_generator_state(5)


def test_unregistered_generator_in_capture_is_refused_and_recovers():
    gen = crandom.Generator()
    g = cudalab.CUDAGraph()
    with pytest.raises(RuntimeError, match="not in capture mode"), cudalab.graph(g):
        cudalab.rand(N, generator=gen)
    x = cudalab.rand(N)  # eager generation works again
    assert x.numpy().shape == (N,)


def test_manual_seed_during_capture_is_refused():
    cudalab.manual_seed(5)
    g = cudalab.CUDAGraph()
    with pytest.raises(RuntimeError, match="set_current_seed can be called during stream "
                       "capture only if new seed is the same as the original seed"), \
            cudalab.graph(g):
        cudalab.rand(N)
        crandom.default_generators[0].manual_seed(1)
    assert crandom.default_generators[0].initial_seed() == 5


def test_manual_seed_during_capture_with_the_same_seed_is_a_no_op():
    # torch's CUDAGeneratorImpl::set_current_seed: the same seed during a capture changes
    # nothing (the offset is not reset either), so replays match the eager calls.
    cudalab.manual_seed(7)
    cudalab.rand(N)  # warm up
    cudalab.manual_seed(7)
    g = cudalab.CUDAGraph()
    with cudalab.graph(g):
        x = cudalab.rand(N)
        cudalab.manual_seed(7)
        crandom.default_generators[0].manual_seed(7)
        y = cudalab.rand(N)
    assert crandom.default_generators[0].initial_seed() == 7
    g.replay()
    got = x.numpy().copy(), y.numpy().copy()
    cudalab.manual_seed(7)
    want = cudalab.rand(N).numpy(), cudalab.rand(N).numpy()
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_reset_unregisters_the_generator_states():
    st = crandom.default_generators[cudalab.current_device()].graph_state
    g = cudalab.CUDAGraph()
    with cudalab.graph(g):
        cudalab.rand(N)
    assert id(g) in st._graphs
    g.reset()
    assert id(g) not in st._graphs


@pytest.mark.gpu
def test_graph_rng_bit_exact_with_torch():
    torch = pytest.importorskip("torch")
    for seed in (6, 128, 9999):
        torch.manual_seed(seed)
        torch.rand(N, device="cuda")  # warm up outside the capture
        torch.manual_seed(seed)
        tg = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            tg.capture_begin()
            tx = torch.rand(N, device="cuda")
            tn = torch.randn(N, device="cuda")
            tg.capture_end()
        torch.cuda.current_stream().wait_stream(s)
        theirs = []
        for _ in range(3):
            tg.replay()
            theirs.append((tx.cpu().numpy().copy(), tn.cpu().numpy().copy()))
        their_after = torch.rand(N, device="cuda").cpu().numpy()

        cudalab.manual_seed(seed)
        g = cudalab.CUDAGraph()
        with cudalab.graph(g):
            x = cudalab.rand(N)
            n = cudalab.randn(N)
        ours = []
        for _ in range(3):
            g.replay()
            ours.append((x.numpy().copy(), n.numpy().copy()))
        our_after = cudalab.rand(N).numpy()
        for (a, b), (c, d) in zip(ours, theirs, strict=True):
            np.testing.assert_array_equal(a, c)
            np.testing.assert_array_equal(b, d)
        np.testing.assert_array_equal(our_after, their_after)
