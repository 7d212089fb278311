"""What a torch or numpy user does with a DeviceArray's attributes and 0-d results (issue 36,
items 0 and 11).

* The names users know (``shape``, ``dtype``, ``size``, ``nbytes``, ``base``, ``device``,
  ``strides``...) are read-only: assigning one raises AttributeError, as torch's do, rather
  than corrupting the array (the fields the hot paths read have other names).
* ``float``, ``int``, ``bool`` and ``complex`` of a one-element array work (torch, numpy, CuPy);
  ``full((4,), 2.0)`` is float32 (torch's default dtype); ``x.size()``, ``x.size(dim)`` and
  ``x.view(-1)`` work as torch's; a collective mixing dtypes names both.
"""

from __future__ import annotations

import numpy as np
import pytest

import cudalab


@pytest.mark.parametrize("name,value", [
    ("shape", (3, 2)), ("dtype", np.dtype(np.int32)), ("size", 3), ("nbytes", 4),
    ("base", None), ("device", 0), ("strides", (4,)), ("ndim", 1), ("itemsize", 8),
])
def test_user_names_are_read_only(name, value):
    a = cudalab.ones(6)
    before = (a.shape, a.dtype, a.size, a.nbytes, a.base)
    with pytest.raises(AttributeError):
        setattr(a, name, value)
    assert (a.shape, a.dtype, a.size, a.nbytes, a.base) == before
    assert a.numpy().tolist() == [1.0] * 6


def test_reads_still_give_the_values():
    a = cudalab.zeros((2, 3), dtype=np.int16)
    assert a.shape == (2, 3) and a.dtype == np.int16
    assert a.size == 6 and a.nbytes == 12 and a.base is None
    assert a[1].base is a and a[1].shape == (3,)
    assert isinstance(a.size, int) and a.size * 2 == 12


def test_torch_size_and_numel():
    a = cudalab.zeros((2, 3))
    assert a.size() == (2, 3)
    assert a.size(0) == 2 and a.size(-1) == 3
    assert a.numel() == 6
    with pytest.raises(IndexError, match="Dimension out of range"):
        a.size(2)


def test_torch_view_with_sizes():
    a = cudalab.ones((2, 3))
    assert a.view(-1).shape == (6,)
    assert a.view(3, 2).shape == (3, 2)
    assert a.view((1, 6)).shape == (1, 6)
    assert a.view(np.int32).shape == (2, 3)  # the dtype form stays


def test_scalar_conversions_of_0d_arrays():
    x = cudalab.ones(4)
    assert float(x.mean()) == 1.0
    assert int(x.sum()) == 4
    assert bool(x.sum() > 0) is True
    assert bool(cudalab.zeros(1)) is False
    assert complex(x.sum()) == 4 + 0j
    assert [10, 20, 30][cudalab.full((), 1, dtype=np.int64)] == 20
    with pytest.raises(RuntimeError, match="more than one value is ambiguous"):
        bool(x)
    with pytest.raises(RuntimeError, match="cannot be converted to Scalar"):
        float(x)
    with pytest.raises(TypeError, match="only integer tensors"):
        [1, 2][x.sum()]


def test_full_uses_torch_default_dtypes():
    assert cudalab.full((4,), 2.0).dtype == np.float32
    assert cudalab.full((4,), 2).dtype == np.int64
    assert cudalab.full((4,), True).dtype == np.bool_
    assert cudalab.full((4,), 1 + 2j).dtype == np.complex64
    assert cudalab.full((4,), np.float64(2.0)).dtype == np.float32  # a Python float too
    assert cudalab.full((4,), np.float16(2.0)).dtype == np.float16  # a numpy scalar keeps its
    assert cudalab.full((4,), np.int32(2)).dtype == np.int32
    assert cudalab.full((4,), 2.0, dtype=np.float64).dtype == np.float64


def test_collective_dtype_error_names_both_dtypes():
    import cudalab.nccl as nccl
    if cudalab.device_count() < 2:
        pytest.skip("needs two devices")
    a = cudalab.full((4,), 2.0, dtype=np.float64, device=0)
    b = cudalab.ones(4, device=1)
    with pytest.raises(RuntimeError, match=r"same Tensor dtype.*float64.*float32"):
        nccl.all_reduce([a, b])
