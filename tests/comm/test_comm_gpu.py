"""cudalab.comm against torch.cuda.comm on two real GPUs: values, return types, identities and
error messages (skipped on the simulator and with fewer than two GPUs)."""

from __future__ import annotations

import numpy as np
import pytest

import cudalab
from cudalab import comm
from tests.helpers.gpu import HAS_GPU

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

torch = pytest.importorskip("torch") if HAS_GPU else None
if torch is not None:
    import torch.cuda.comm  # noqa: F401 - a submodule torch.cuda does not import itself


@pytest.fixture(autouse=True)
def _two_gpus():
    if cudalab.device_count() < 2 or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")


def _ours(t):
    """The torch tensor as a DeviceArray (no copy; keep ``t`` alive)."""
    # through __cuda_array_interface__ only: torch's DLPack export refuses a tensor of another
    # device than its current one, and torch.cuda.device(...) would switch the thread's CUDA
    # context behind cudalab's back
    return cudalab.asarray(_InterfaceOnly(t))


class _InterfaceOnly:
    """A torch tensor seen only through ``__cuda_array_interface__`` (keeps it alive)."""

    def __init__(self, tensor):
        self.tensor = tensor
        self.__cuda_array_interface__ = tensor.__cuda_array_interface__


def _host(x):
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "numpy") and not isinstance(x, cudalab.DeviceArray):
        return x.detach().cpu().numpy()
    return x.cpu()


def _same_error(ours_call, theirs_call):
    with pytest.raises(Exception) as theirs:
        theirs_call()
    with pytest.raises(Exception) as ours:
        ours_call()
    assert type(ours.value).__name__ == type(theirs.value).__name__, (ours.value, theirs.value)
    assert str(ours.value) == str(theirs.value).splitlines()[0]


DTYPES = ["float32", "float64", "float16", "int64", "int32", "uint8"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_matches_torch(dtype):
    t = (torch.arange(60, device="cuda:0") % 17).to(getattr(torch, dtype)).reshape(4, 15)
    theirs = torch.cuda.comm.broadcast(t, [0, 1])
    ours_src = _ours(t)
    ours = comm.broadcast(ours_src, [0, 1])
    assert type(ours) is type(theirs)
    assert theirs[0].data_ptr() == t.data_ptr() and ours[0] is ours_src
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(_host(a), _host(b))
    big = torch.randn(16 * 1024 * 1024, device="cuda:1")  # 64 MiB peer copy
    ours_big = comm.broadcast(_ours(big), [0])[0]
    np.testing.assert_array_equal(_host(ours_big), _host(big))


def test_broadcast_from_the_host_matches_torch():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    theirs = torch.cuda.comm.broadcast(t, [1, 0])
    ours = comm.broadcast(t.numpy(), [1, 0])
    assert [o.device_index for o in ours] == [x.get_device() for x in theirs]
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(_host(a), _host(b))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "float16"])
def test_reduce_add_matches_torch(dtype):
    a = (torch.arange(1000, device="cuda:0") % 13).to(getattr(torch, dtype))
    b = (torch.arange(1000, device="cuda:1") % 7).to(getattr(torch, dtype))
    theirs = torch.cuda.comm.reduce_add([a, b], destination=1)
    ours = comm.reduce_add([_ours(a), _ours(b)], destination=1)
    assert ours.device_index == theirs.get_device() == 1
    np.testing.assert_array_equal(_host(ours), _host(theirs))  # two inputs: exact either way


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter_and_gather_match_torch(dim):
    t = torch.randn(6, 5, device="cuda:0")
    theirs = torch.cuda.comm.scatter(t, [0, 1], dim=dim)
    src = _ours(t)
    ours = comm.scatter(src, [0, 1], dim=dim)
    assert type(ours) is type(theirs) and len(ours) == len(theirs)
    assert ours[0].ptr == src.ptr and theirs[0].data_ptr() == t.data_ptr()
    for a, b in zip(ours, theirs):
        assert a.shape == tuple(b.shape)
        np.testing.assert_array_equal(_host(a), _host(b))
    gathered = torch.cuda.comm.gather(theirs, dim=dim, destination=1)
    ours_gathered = comm.gather(ours, dim=dim, destination=1)
    np.testing.assert_array_equal(_host(ours_gathered), _host(gathered))
    np.testing.assert_array_equal(comm.gather(ours, dim=dim, destination="cpu"), _host(t))


def test_scatter_with_sizes_and_streams_matches_torch():
    t = torch.randn(7, 3, device="cuda:1")
    s0 = torch.cuda.Stream(device=0)
    theirs = torch.cuda.comm.scatter(t, [0, 1], chunk_sizes=[3, 4], streams=[s0, None])
    ours_stream = cudalab.ExternalStream(s0.cuda_stream, device=0)
    ours = comm.scatter(_ours(t), [0, 1], chunk_sizes=[3, 4], streams=[ours_stream, None])
    ours_stream.synchronize()
    s0.synchronize()
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(_host(a), _host(b))


def test_coalesced_match_torch():
    tensors = [torch.randn(5, device="cuda:0").long(), torch.randn(5, device="cuda:0"),
               torch.randn(3, 2, device="cuda:0").double(), torch.randn(5, device="cuda:0").long(),
               torch.randn(7, device="cuda:0"), torch.randn(4, device="cuda:0").half()]
    buffer_size = 5 * 8 * 5 // 2
    theirs = torch.cuda.comm.broadcast_coalesced(tensors, [0, 1], buffer_size=buffer_size)
    ours_in = [_ours(t) for t in tensors]
    ours = comm.broadcast_coalesced(ours_in, [0, 1], buffer_size=buffer_size)
    assert type(ours) is type(theirs) and type(ours[1]) is type(theirs[1])
    for a, b in zip(ours[1], theirs[1]):
        assert a.device_index == 1 and str(a.dtype) == str(b.dtype).replace("torch.", "")
        np.testing.assert_array_equal(_host(a), _host(b))
    summed = torch.cuda.comm.reduce_add_coalesced([tensors, list(theirs[1])], destination=0,
                                                  buffer_size=buffer_size)
    ours_summed = comm.reduce_add_coalesced([ours_in, ours[1]], destination=0,
                                            buffer_size=buffer_size)
    assert type(ours_summed) is type(summed)
    for a, b in zip(ours_summed, summed):
        np.testing.assert_array_equal(_host(a), _host(b))


def test_error_messages_match_torch():
    t = torch.zeros(4, 2, device="cuda:0")
    u = torch.zeros(2, 4, device="cuda:1")
    tc = torch.cuda.comm
    o, p = _ours(t), _ours(u)
    _same_error(lambda: comm.broadcast(o), lambda: tc.broadcast(t))
    _same_error(lambda: comm.broadcast(o, out=[p]), lambda: tc.broadcast(t, out=[u]))
    _same_error(lambda: comm.broadcast(o, [0, -1]), lambda: tc.broadcast(t, [0, -1]))
    _same_error(lambda: comm.reduce_add([o, p], 0), lambda: tc.reduce_add([t, u], 0))
    _same_error(lambda: comm.reduce_add([o, o], 1), lambda: tc.reduce_add([t, t], 1))
    _same_error(lambda: comm.broadcast_coalesced([o, p], [0, 1]),
                lambda: tc.broadcast_coalesced([t, u], [0, 1]))
    _same_error(lambda: comm.scatter(o, []), lambda: tc.scatter(t, []))
    _same_error(lambda: comm.scatter(o, [0, 1], chunk_sizes=[4]),
                lambda: tc.scatter(t, [0, 1], chunk_sizes=[4]))
    _same_error(lambda: comm.scatter(o, [0, 1], chunk_sizes=[3, 2]),
                lambda: tc.scatter(t, [0, 1], chunk_sizes=[3, 2]))
    _same_error(lambda: comm.scatter(o, [0, 1], dim=2), lambda: tc.scatter(t, [0, 1], dim=2))
    _same_error(lambda: comm.scatter(o, out=[p]), lambda: tc.scatter(t, out=[u]))
    _same_error(lambda: comm.scatter(o, out=[p[:1]]), lambda: tc.scatter(t, out=[u[:1]]))
    _same_error(lambda: comm.scatter(o, [0], out=[p]), lambda: tc.scatter(t, [0], out=[u]))
    _same_error(lambda: comm.gather([]), lambda: tc.gather([]))
    _same_error(lambda: comm.gather([o, p]), lambda: tc.gather([t, u]))
    _same_error(lambda: comm.gather([o, p], dim=3), lambda: tc.gather([t, u], dim=3))
    _same_error(lambda: comm.gather([o, o], out=p), lambda: tc.gather([t, t], out=u))
    _same_error(lambda: comm.gather([o, o], destination=0, out=p),
                lambda: tc.gather([t, t], destination=0, out=u))
