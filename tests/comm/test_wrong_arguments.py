"""cudalab.comm refuses wrong argument types and values (issue 36, item 24): chunk sizes
that are not integers (torch: a tuple of ints) and a negative ``buffer_size``."""

from __future__ import annotations

import pytest

import cudalab
from cudalab import comm


@pytest.fixture
def two_devices():
    if cudalab.device_count() < 2:
        pytest.skip("needs two devices")


def test_scatter_refuses_fractional_chunk_sizes(two_devices):
    a = cudalab.ones(4)
    with pytest.raises(TypeError, match="chunk_sizes.*float"):
        comm.scatter(a, devices=[0, 1], chunk_sizes=[2.5, 1.5])
    with pytest.raises(TypeError, match="chunk_sizes"):
        comm.scatter(a, devices=[0, 1], chunk_sizes=["2", "2"])
    assert [p.shape for p in comm.scatter(a, devices=[0, 1], chunk_sizes=[3, 1])] == [(3,), (1,)]


@pytest.mark.parametrize("size", [-1, -(2**20)])
def test_coalesced_refuses_a_negative_buffer_size(two_devices, size):
    a = cudalab.ones(4)
    with pytest.raises(ValueError, match="buffer_size"):
        comm.broadcast_coalesced([a], [0, 1], buffer_size=size)
    b = cudalab.ones(4, device=1)
    with pytest.raises(ValueError, match="buffer_size"):
        comm.reduce_add_coalesced([[a], [b]], 0, buffer_size=size)
    with pytest.raises(TypeError, match="buffer_size"):
        comm.broadcast_coalesced([a], [0, 1], buffer_size=2.5)
