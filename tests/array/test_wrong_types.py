"""Wrong types and values are refused as torch refuses them (issue 36, item 24): a
non-bool ``keepdim``, an integer array to a negative integer power, complex comparisons
(NotImplementedError, torch's "not implemented for" error), ``Kernel.cubin`` without an
architecture string."""

from __future__ import annotations

import numpy as np
import pytest

import cudalab
from cudalab.kernels import Kernel


@pytest.mark.parametrize("method", ["sum", "mean", "max", "min", "amax", "amin"])
def test_keepdim_must_be_a_bool(method):
    a = cudalab.ones((2, 3))
    with pytest.raises(TypeError, match="keepdim"):
        getattr(a, method)(0, keepdim="yes")
    assert getattr(a, method)(0, keepdim=np.bool_(True)) is not None  # numpy's bool is one


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint8])
def test_integers_to_negative_integer_powers(dtype):
    a = cudalab.full((3,), 2, dtype=dtype)
    with pytest.raises(RuntimeError, match="Integers to negative integer powers are not allowed."):
        a ** -1
    with pytest.raises(RuntimeError, match="Integers to negative integer powers are not allowed."):
        a **= -2
    assert (a ** 0).numpy().tolist() == [1, 1, 1]
    assert (a ** -1.0).numpy().tolist() == [0.5, 0.5, 0.5]  # a float exponent: a float result


@pytest.mark.parametrize("op", ["__lt__", "__le__", "__gt__", "__ge__"])
def test_complex_comparisons_raise_not_implemented(op):
    z = cudalab.ones(3, dtype=np.complex64)
    with pytest.raises(NotImplementedError, match="not implemented for 'ComplexFloat'"):
        getattr(z, op)(z)


def test_kernel_cubin_needs_an_architecture_string():
    k = Kernel("f", 'extern "C" __global__ void f(float* x) { x[0] = 1; }', ("p",))
    for arch in (None, 90, b"sm_90"):
        with pytest.raises(TypeError, match="sm_90"):
            k.cubin(arch)
