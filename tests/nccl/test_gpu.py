"""The real NCCL (nccl4py) on two GPUs: the seam's RealNccl and cudalab.nccl's values,
compared with numpy and, where torch is importable, with torch.cuda.nccl. Skips cleanly with
fewer than two GPUs or without nccl4py."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import cudalab
from cudalab import _internal, collective_call, nccl
from cudalab._driver.base import NCCL_FLOAT32, NCCL_SUM, NCCL_UNIQUE_ID_SIZE
from cudalab.errors import NcclError

pytestmark = pytest.mark.gpu


@pytest.fixture
def gpus():
    if cudalab.device_count() < 2:
        pytest.skip("needs two GPUs")
    if importlib.util.find_spec("nccl") is None:
        pytest.skip("nccl4py is not installed")
    b = _internal.backend()
    if b.simulated:
        pytest.skip("needs the real backend")
    yield b
    nccl.destroy_communicators()


def test_real_seam_identity(gpus):
    n = gpus.nccl()
    assert not n.simulated
    assert n.version() >= 22000
    assert len(n.unique_id()) == NCCL_UNIQUE_ID_SIZE


def test_real_comm_init_all_keeps_the_context_and_names_ranks(gpus):
    n = gpus.nccl()
    cudalab.set_device(1)
    x = cudalab.zeros(1)  # device 1's context is current now
    comms = n.comm_init_all([1, 0])
    try:
        assert gpus.resync_context() == 1  # the driver's current context is device 1's again
        assert [n.comm_rank(c) for c in comms] == [0, 1]
        assert [n.comm_device(c) for c in comms] == [1, 0]
        assert [n.comm_count(c) for c in comms] == [2, 2]
        assert n.comm_async_error(comms[0]) == 0
        y = cudalab.ones(1)  # still allocates on device 1
        assert y.device_index == 1 and x.device_index == 1
    finally:
        collective_call.destroy_clique(n, comms)  # (finalize in one group, then destroy each)
    with pytest.raises(NcclError, match="destroyed"):
        n.comm_rank(comms[0])
    cudalab.set_device(0)


def test_real_seam_all_reduce_and_bad_arguments(gpus):
    n = gpus.nccl()
    comms = n.comm_init_all([0, 1])
    try:
        a = [cudalab.asarray(np.arange(4, dtype=np.float32) + d, device=d) for d in (0, 1)]
        n.group_start()
        for d in (0, 1):
            n.all_reduce(a[d].ptr, a[d].ptr, 4, NCCL_FLOAT32, NCCL_SUM, comms[d],
                         _internal.stream_handle(cudalab.current_stream(d)))
        n.group_end()
        assert a[0].numpy().tolist() == a[1].numpy().tolist() == [1, 3, 5, 7]
        with pytest.raises(NcclError) as info:
            n.all_reduce(a[0].ptr, a[0].ptr, 4, 99, NCCL_SUM, comms[0], None)
        assert info.value.code == 4 and info.value.name == "ncclInvalidArgument"
        with pytest.raises(NcclError, match="expected 128 bytes"):
            n.comm_init_rank(0, 2, b"short", 0)
    finally:
        collective_call.destroy_clique(n, comms)  # (finalize in one group, then destroy each)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64", "uint8"])
def test_real_collectives_match_numpy(gpus, dtype):
    host = [(np.arange(64) % 7 + 1 + r).astype(dtype) for r in (0, 1)]
    a = [cudalab.asarray(h, device=d) for h, d in zip(host, (0, 1))]
    nccl.all_reduce(a)
    for x in a:
        np.testing.assert_array_equal(x.numpy(), (host[0] + host[1]).astype(dtype))
    b = [cudalab.asarray(h, device=d) for h, d in zip(host, (0, 1))]
    nccl.broadcast(b, root=1)
    np.testing.assert_array_equal(b[0].numpy(), host[1])
    c = [cudalab.asarray(h, device=d) for h, d in zip(host, (0, 1))]
    out = cudalab.zeros(64, dtype=dtype, device=1)
    nccl.reduce(c, out, root=1, op=nccl.MAX)
    np.testing.assert_array_equal(out.numpy(), np.maximum(host[0], host[1]))
    gathered = [cudalab.zeros(128, dtype=dtype, device=d) for d in (0, 1)]
    nccl.all_gather([cudalab.asarray(h, device=d) for h, d in zip(host, (0, 1))], gathered)
    for g in gathered:
        np.testing.assert_array_equal(g.numpy(), np.concatenate(host))
    parts = [cudalab.zeros(32, dtype=dtype, device=d) for d in (0, 1)]
    nccl.reduce_scatter([cudalab.asarray(h, device=d) for h, d in zip(host, (0, 1))], parts)
    total = (host[0] + host[1]).astype(dtype)
    for r, p in enumerate(parts):
        np.testing.assert_array_equal(p.numpy(), total[32 * r:32 * r + 32])


def test_real_collective_on_user_streams(gpus):
    streams = [cudalab.Stream(d) for d in (0, 1)]
    a = [cudalab.asarray(np.full(1 << 20, d + 1.0, np.float32), device=d) for d in (0, 1)]
    for s, x in zip(streams, a):
        s.wait_stream(cudalab.current_stream(x.device_index))
    nccl.all_reduce(a, streams=streams)
    for s in streams:
        s.synchronize()
    assert float(a[0].numpy()[-1]) == float(a[1].numpy()[0]) == 3.0


def test_matches_torch_cuda_nccl(gpus):
    torch = pytest.importorskip("torch")
    if not torch.cuda.nccl.is_available([torch.zeros(1, device=f"cuda:{d}") for d in (0, 1)]):
        pytest.skip("torch has no NCCL")
    host = [np.random.default_rng(r).standard_normal(1000).astype(np.float32) for r in (0, 1)]
    ours = [cudalab.asarray(h, device=d) for h, d in zip(host, (0, 1))]
    theirs = [torch.from_numpy(h).to(f"cuda:{d}") for h, d in zip(host, (0, 1))]
    nccl.all_reduce(ours)
    torch.cuda.nccl.all_reduce(theirs)
    for o, t in zip(ours, theirs):
        np.testing.assert_allclose(o.numpy(), t.cpu().numpy(), rtol=1e-6, atol=1e-6)
