"""float8 arrays (ml_dtypes' float8_e4m3fn and float8_e5m2, issue 36 item 7): created,
copied between the host and devices, and broadcast by cudalab.nccl as torch's NCCL tests
broadcast them. Elementwise math and converting copies to float8 stay unsupported (a
TypeError naming the dtype), as the differences page says."""

from __future__ import annotations

import numpy as np
import pytest

import cudalab
from cudalab import nccl

ml_dtypes = pytest.importorskip("ml_dtypes")
FLOAT8 = ["float8_e4m3fn", "float8_e5m2"]


@pytest.mark.parametrize("name", FLOAT8)
def test_float8_arrays_and_copies(name):
    dt = np.dtype(getattr(ml_dtypes, name))
    host = np.array([0.5, 1.0, -2.0, 4.0], dtype=dt)
    for spelling in (name, dt, getattr(ml_dtypes, name)):
        assert cudalab.empty(4, dtype=spelling).dtype == dt
    a = cudalab.asarray(host)
    assert a.dtype == dt and a.nbytes == 4
    np.testing.assert_array_equal(a.numpy().astype(np.float32), host.astype(np.float32))
    b = cudalab.zeros(4, dtype=dt)
    b.copy_(a)  # device to device
    c = cudalab.full((4,), 1.5, dtype=dt)
    assert c.numpy().astype(np.float32).tolist() == [1.5] * 4
    b.copy_(np.ones(4, np.float32))  # converted by numpy on the host
    assert b.numpy().astype(np.float32).tolist() == [1.0] * 4
    b.copy_(a)
    b[1:3] = host[:2]
    assert b.numpy().astype(np.float32).tolist() == [0.5, 0.5, 1.0, 4.0]
    with pytest.raises(TypeError, match=name):
        a + a


@pytest.mark.parametrize("name", FLOAT8)
def test_nccl_broadcast_of_float8(name):
    if cudalab.device_count() < 2 or not nccl.is_available([cudalab.ones(1)]):
        pytest.skip("needs two devices and NCCL")
    dt = np.dtype(getattr(ml_dtypes, name))
    host = np.array([0.5, 1.0, -2.0, 4.0], dtype=dt)
    arrays = [cudalab.asarray(host, device=0), cudalab.zeros(4, dtype=dt, device=1)]
    nccl.broadcast(arrays, root=0)
    cudalab.synchronize(1)
    np.testing.assert_array_equal(arrays[1].numpy().astype(np.float32),
                                  host.astype(np.float32))
