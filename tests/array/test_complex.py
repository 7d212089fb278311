"""Complex DeviceArrays in the elementwise machinery: operators, promotion, conversions,
refusals and jiterator strings, against numpy.

Run on the simulator (numpy twins, the function bodies evaluated by c_expression) and on a
GPU (the compiled cudalab_complex kernels) alike. The expected dtypes are torch's, written
out here. tests/jiterator/test_gpu_torch_parity.py compares the GPU results with torch's.
"""

from __future__ import annotations

import operator
import warnings

import numpy as np
import pytest

import cudalab
from cudalab import jiterator as jit
from tests.helpers.strided import strided

COMPLEX = ["complex64", "complex128"]


def up(a, dtype=None):
    return cudalab.asarray(np.asarray(a, dtype=dtype))


def _values(dtype: str, seed: int, n: int = 257) -> np.ndarray:
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(n) * 10 + 1j * rng.standard_normal(n) * 10
    z[:4] = [0, 1j, -2.5, 3 - 4j]  # zero, pure imaginary, pure real
    return z.astype(dtype)


def _rtol(dtype) -> float:
    return 2e-6 if np.dtype(dtype) == np.complex64 else 1e-14


@pytest.mark.parametrize("dtype", COMPLEX)
@pytest.mark.parametrize("op", [operator.add, operator.sub, operator.mul, operator.truediv])
def test_arithmetic_matches_numpy(dtype, op):
    a, b = _values(dtype, 1), _values(dtype, 2)
    b[b == 0] = 1
    got = op(up(a), up(b))
    assert got.dtype == np.dtype(dtype)
    if op in (operator.add, operator.sub):
        np.testing.assert_array_equal(got.numpy(), op(a, b))
    else:
        np.testing.assert_allclose(got.numpy(), op(a, b), rtol=_rtol(dtype))


@pytest.mark.parametrize("a_dtype,other,expected", [
    ("float32", 1j, "complex64"),           # a Python complex: the default complex dtype
    ("float64", 1j, "complex128"),          # ... widened by a float64 array, as in torch
    ("int32", 2 + 1j, "complex64"),
    ("bool", 1j, "complex64"),
    ("complex64", 2.5, "complex64"),
    ("complex64", "float64", "complex128"),  # complex64 with a float64 array
    ("complex64", "complex128", "complex128"),
    ("float16", "complex64", "complex64"),
    ("complex128", np.complex64(1j), "complex128"),
])
def test_type_promotion_follows_torch(a_dtype, other, expected):
    a = up(np.ones(3), a_dtype)
    b = up(np.ones(3), other) if isinstance(other, str) else other
    r = a * b
    assert r.dtype == np.dtype(expected)
    np.testing.assert_array_equal(r.numpy(), (np.ones(3, a_dtype) * (
        np.ones(3, other) if isinstance(other, str) else other)).astype(expected))


def test_scalars_reflected_and_in_place():
    z = _values("complex64", 3)
    np.testing.assert_array_equal((up(z) + (1 - 2j)).numpy(), z + np.complex64(1 - 2j))
    np.testing.assert_array_equal(((1 - 2j) - up(z)).numpy(), np.complex64(1 - 2j) - z)
    np.testing.assert_allclose((2j * up(z)).numpy(), 2j * z, rtol=2e-6)
    x = up(z.copy())
    ptr = x.ptr
    x += up(np.arange(257, dtype=np.float32))  # a real array into a complex one
    x *= 1j
    assert x.ptr == ptr and x.dtype == np.complex64
    np.testing.assert_allclose(x.numpy(), (z + np.arange(257)) * 1j, rtol=2e-6)
    f = up(np.ones(3, np.float32))
    with pytest.raises(RuntimeError, match="result type ComplexFloat can't be cast to the "
                                           "desired output type Float"):
        f += 1j
    with pytest.raises(RuntimeError, match="result type ComplexFloat can't be cast"):
        f *= up(np.ones(3, np.complex64))


@pytest.mark.parametrize("dtype", COMPLEX)
def test_negation_equality_and_where(dtype):
    a = _values(dtype, 4)
    b = a.copy()
    b[::3] += 1j
    np.testing.assert_array_equal((-up(a)).numpy(), -a)
    np.testing.assert_array_equal((up(a) == up(b)).numpy(), a == b)
    np.testing.assert_array_equal((up(a) != up(b)).numpy(), a != b)
    np.testing.assert_array_equal((up(a) == 1j).numpy(), a == 1j)
    mask = np.arange(257) % 2 == 0
    r = cudalab.where(up(mask), up(a), 5)
    assert r.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(r.numpy(), np.where(mask, a, 5))


@pytest.mark.parametrize("dtype,real", [("complex64", "float32"), ("complex128", "float64")])
def test_abs_gives_the_real_dtype(dtype, real):
    a = _values(dtype, 5)
    got = abs(up(a))
    assert got.dtype == np.dtype(real)
    np.testing.assert_allclose(got.numpy(), np.abs(a), rtol=_rtol(dtype))
    assert got.numpy()[0] == 0 and got.numpy()[3] == 5  # |3 - 4j|


@pytest.mark.parametrize("dtype", COMPLEX)
def test_power(dtype):
    a = _values(dtype, 6, 64)
    np.testing.assert_array_equal((up(a) ** 2).numpy(), a * a)  # torch: base * base, exactly
    b = (_values(dtype, 7, 64) / 10).astype(dtype)
    want = np.power(a[1:].astype(np.complex128), b[1:].astype(np.complex128))
    np.testing.assert_allclose((up(a[1:]) ** up(b[1:])).numpy(), want, rtol=1e-4 if
                               dtype == "complex64" else 1e-12)
    np.testing.assert_allclose((up(a[1:]) ** 0.5).numpy(), np.sqrt(a[1:].astype(np.complex128)),
                               rtol=1e-5 if dtype == "complex64" else 1e-12)


def test_conversions_keep_the_real_part_and_warn_like_torch():
    z = np.array([1.5 + 2j, -3.25 - 1j, 0j, 1j, 300.5 + 0j], dtype=np.complex64)
    a = up(z)
    with pytest.warns(UserWarning, match="Casting complex values to real discards the "
                                         "imaginary part"):
        f = a.astype(np.float32)
    np.testing.assert_array_equal(f.numpy(), z.real)
    with pytest.warns(UserWarning, match="discards the imaginary part"):
        i = a.to(np.int32)
    np.testing.assert_array_equal(i.numpy(), z.real.astype(np.int32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert a.astype(bool).numpy().tolist() == [True, True, False, True, True]
        np.testing.assert_array_equal(a.astype(np.float16).numpy(), z.real.astype(np.float16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # widening and real -> complex do not warn
        w = a.astype(np.complex128)
        assert w.dtype == np.complex128
        np.testing.assert_array_equal(w.numpy(), z.astype(np.complex128))
        back = up(np.array([1, -2, 3], np.int16)).astype(np.complex64)
        np.testing.assert_array_equal(back.numpy(), np.array([1, -2, 3], np.complex64))
        np.testing.assert_array_equal(up([True, False]).astype(np.complex128).numpy(), [1, 0])
        dst = cudalab.empty((2, 5), dtype=np.complex128)
        dst.copy_(up(z.real.copy()))  # a real source, converted and broadcast
        np.testing.assert_array_equal(dst.numpy(), np.broadcast_to(z.real, (2, 5)))
    dst = cudalab.empty(5, dtype=np.float64)
    with pytest.warns(UserWarning, match="discards the imaginary part"):
        dst.copy_(a)
    np.testing.assert_array_equal(dst.numpy(), z.real)


@pytest.mark.parametrize("op,name", [
    (operator.lt, "lt"), (operator.le, "le"), (operator.gt, "gt"), (operator.ge, "ge"),
    (operator.floordiv, "floor_divide"), (operator.mod, "remainder"),
    (operator.and_, "bitwise_and"), (operator.or_, "bitwise_or"), (operator.xor, "bitwise_xor")])
def test_refused_like_torch(op, name):
    a = up(np.ones(3, np.complex64))
    with pytest.raises(TypeError, match=f"\"{name}_cuda\" not implemented for 'ComplexFloat'"):
        op(a, a)
    with pytest.raises(TypeError, match="not implemented for 'ComplexDouble'"):
        op(up(np.ones(3)), 1j)  # a float64 array with a Python complex: complex128


def test_bitwise_not_refused():
    with pytest.raises(TypeError, match="\"bitwise_not_cuda\" not implemented for 'ComplexFloat'"):
        ~up(np.ones(3, np.complex64))


def test_strided_and_broadcast_operands():
    host = _values("complex128", 8, 64).reshape(8, 8)
    view, twin = strided(host, (8, 4), (8 * 16, 2 * 16), offset=1)[:2]
    col = up(_values("complex128", 9, 8).reshape(8, 1))
    got = view * col
    np.testing.assert_allclose(got.numpy(), twin * _values("complex128", 9, 8).reshape(8, 1),
                               rtol=1e-14)
    assert got.is_contiguous()


def test_reductions_of_operator_results():
    z = _values("complex64", 10)
    s = (up(z) * 2).sum()
    np.testing.assert_allclose(s.item(), (z.astype(np.complex128) * 2).sum(), rtol=1e-5)


# --------------------------------------------------------------------------- jiterator
def test_jit_function_on_complex_inputs():
    code = ("template <typename T> T f(T x, T y, T alpha) "
            "{ return alpha * x * conj(y) + T(2) - abs(x); }")
    fn = jit._create_jit_fn(code, alpha=0.5)
    a, b = _values("complex64", 11), _values("complex64", 12)
    got = fn(up(a), up(b))
    assert got.dtype == np.complex64
    want = 0.5 * a * np.conj(b) + 2 - np.abs(a)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-4)
    # a float input and a Python complex scalar: promoted to complex64
    r = fn(up(np.arange(257, dtype=np.float32)), 1 + 1j, alpha=2)
    np.testing.assert_allclose(r.numpy(), 2 * np.arange(257) * (1 - 1j) + 2 - np.arange(257),
                               rtol=1e-6)


def test_multi_output_jit_function_on_complex():
    code = ("template <typename T> void parts(T z, T& conjugate, T& magnitude) "
            "{ conjugate = conj(z); magnitude = T(abs(z)); }")
    fn = jit._create_multi_output_jit_fn(code, num_outputs=2)
    z = _values("complex128", 13)
    c, m = fn(up(z))
    np.testing.assert_array_equal(c.numpy(), np.conj(z))
    np.testing.assert_allclose(m.numpy(), np.abs(z), rtol=1e-15)


def test_complex_extra_arguments_are_refused_clearly():
    code = "template <typename T> T f(T x, T alpha) { return alpha * x; }"
    with pytest.raises(TypeError, match="complex extra arguments are not supported.*as an "
                                        "input"):
        jit._create_jit_fn(code, alpha=1j)
    fn = jit._create_jit_fn(code, alpha=2.0)
    with pytest.raises(TypeError, match="complex extra arguments are not supported"):
        fn(up(np.ones(3, np.complex64)), alpha=np.complex64(1j))
    assert fn.kwargs_dict == {"alpha": 2.0}  # the refused value was not kept
    np.testing.assert_array_equal(fn(up(np.ones(3, np.complex64))).numpy(), [2] * 3)
