"""``DeviceArray.narrow``: torch's view along any dimension, with torch's errors."""

from __future__ import annotations

import numpy as np
import pytest

import cudalab


def test_narrow_matches_numpy_slices_along_every_dimension():
    host = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    a = cudalab.array.asarray(host)
    for dim in range(-3, 3):
        size = host.shape[dim]
        for start in range(-size, size):
            for length in range(0, size - (start % size) + 1):
                view = a.narrow(dim, start, length)
                index = [slice(None)] * 3
                first = start % size
                index[dim] = slice(first, first + length)
                np.testing.assert_array_equal(view.cpu(), host[tuple(index)])


def test_narrow_is_a_view_with_the_parents_strides():
    host = np.arange(24, dtype=np.int32).reshape(4, 6)
    a = cudalab.array.asarray(host)
    first = a.narrow(0, 1, 2)
    assert first.is_contiguous() and first.ptr == a.ptr + 6 * 4
    cols = a.narrow(1, 2, 3)
    assert not cols.is_contiguous() and cols.strides == (24, 4) and cols.ptr == a.ptr + 8
    np.testing.assert_array_equal(cols.cpu(), host[:, 2:5])
    a.fill_(7)  # the view shares the parent's memory
    np.testing.assert_array_equal(cols.cpu(), np.full((4, 3), 7, np.int32))
    assert cols.base is a


def test_narrow_errors_are_torchs():
    a = cudalab.array.zeros((5, 2), np.float32)
    with pytest.raises(IndexError, match=r"Dimension out of range \(expected to be in range of "
                                         r"\[-2, 1\], but got 2\)"):
        a.narrow(2, 0, 1)
    with pytest.raises(IndexError, match=r"start out of range \(expected to be in range of "
                                         r"\[-5, 5\], but got 6\)"):
        a.narrow(0, 6, 0)
    with pytest.raises(RuntimeError, match=r"start \(3\) \+ length \(4\) exceeds dimension "
                                           r"size \(5\)\."):
        a.narrow(0, 3, 4)
    with pytest.raises(RuntimeError, match=r"narrow\(\): length must be non-negative\."):
        a.narrow(0, 0, -1)
    with pytest.raises(RuntimeError, match="0-dim"):
        cudalab.array.zeros((), np.float32).narrow(0, 0, 0)
