"""torch-style sizes for empty/zeros/ones (issue 22, defect 3), on both backends."""

from __future__ import annotations

import numpy as np
import pytest

import cudalab


@pytest.mark.parametrize("make", [cudalab.empty, cudalab.zeros, cudalab.ones])
@pytest.mark.parametrize(
    ("args", "shape"),
    [((2, 3), (2, 3)), (((2, 3),), (2, 3)), (([2, 3],), (2, 3)), ((5,), (5,)),
     ((np.int64(2), 3), (2, 3)), ((2, 3, 4), (2, 3, 4)), (((),), ()), ((0, 4), (0, 4))],
)
def test_sizes_as_ints_or_one_sequence(make, args, shape):
    a = make(*args)
    assert a.shape == shape and a.dtype == np.float32
    b = make(*args, dtype=np.int32)
    assert b.shape == shape and b.dtype == np.int32


def test_values_and_dtype_keyword():
    np.testing.assert_array_equal(cudalab.zeros(2, 3).numpy(), np.zeros((2, 3), np.float32))
    np.testing.assert_array_equal(cudalab.ones(2, 3, dtype="int16").numpy(),
                                  np.ones((2, 3), np.int16))
    np.testing.assert_array_equal(cudalab.zeros([4], dtype=np.uint8).numpy(), np.zeros(4, np.uint8))
    assert cudalab.empty(2, 3, device="cuda:0").device_index == 0


def test_numpy_positional_dtype_still_works():
    assert cudalab.empty(5, np.float64).dtype == np.float64
    assert cudalab.zeros((2, 2), "int8").dtype == np.int8
    assert cudalab.ones(3, None).dtype == np.float32


@pytest.mark.parametrize("make", [cudalab.empty, cudalab.zeros, cudalab.ones])
@pytest.mark.parametrize(
    "args",
    [((2, 3), 4),  # a shape, then an int: a size or a dtype?
     (2, 3, np.float32),  # sizes, then a positional dtype
     (2, 3.5),  # neither a size nor a dtype
     (2, True),
     (2, [3])],
)
def test_ambiguous_arguments_say_what_was_expected(make, args):
    with pytest.raises(TypeError, match=r"sizes as ints or one tuple; pass the dtype as dtype="):
        make(*args)


def test_dtype_given_twice():
    with pytest.raises(TypeError, match="dtype twice"):
        cudalab.zeros(3, np.float32, dtype=np.int8)


def test_bad_dtypes_and_sizes_keep_their_messages():
    with pytest.raises(TypeError, match="unsupported dtype 'int128'"):
        cudalab.zeros(2, "int128")
    with pytest.raises(ValueError, match="negative dimension"):
        cudalab.zeros(2, -3)
    with pytest.raises(TypeError, match="shape must be"):
        cudalab.zeros(2.5)
