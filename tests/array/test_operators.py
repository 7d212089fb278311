"""DeviceArray's elementwise operators: values, torch's dtypes, in-place, reflected, errors.

Run on the simulator (numpy twins) and on a GPU (the compiled kernels) alike; the expected
dtypes are torch's (written out here from torch's promotion table, not computed by cudalab).
"""

from __future__ import annotations

import operator

import numpy as np
import pytest

import cudalab
from tests.helpers.strided import strided


def up(a, dtype=None):
    return cudalab.asarray(np.asarray(a, dtype=dtype))


A = np.array([-7, -3, -1, 0, 1, 3, 7, 100], dtype=np.int32)
B = np.array([2, -2, 3, 5, -3, 2, -4, 7], dtype=np.int32)


@pytest.mark.parametrize("op", [operator.add, operator.sub, operator.mul])
@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "uint8", "float16",
                                   "float32", "float64"])
def test_arithmetic_matches_numpy_in_the_same_dtype(op, dtype):
    a, b = A.astype(dtype), B.astype(dtype)
    r = op(up(a), up(b))
    assert r.dtype == np.dtype(dtype)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(r.numpy(), op(a, b))


@pytest.mark.parametrize("op,ref", [
    (operator.lt, np.less), (operator.le, np.less_equal), (operator.gt, np.greater),
    (operator.ge, np.greater_equal), (operator.eq, np.equal), (operator.ne, np.not_equal)])
def test_comparisons_give_bool(op, ref):
    r = op(up(A), up(B.astype(np.float32)))
    assert r.dtype == np.bool_
    np.testing.assert_array_equal(r.numpy(), ref(A, B))
    np.testing.assert_array_equal(op(up(A), 0).numpy(), ref(A, 0))


def test_true_division_of_integers_is_float32():
    r = up(A) / up(B)
    assert r.dtype == np.float32
    np.testing.assert_allclose(r.numpy(), A / B, rtol=1e-6)
    assert (up(A) / 2).dtype == np.float32
    assert (up(A.astype(np.float64)) / 2).dtype == np.float64


def test_floor_division_and_remainder_floor_like_torch():
    q, r = up(A) // up(B), up(A) % up(B)
    assert q.dtype == np.int32 and r.dtype == np.int32
    np.testing.assert_array_equal(q.numpy(), A // B)  # numpy floors as torch does
    np.testing.assert_array_equal(r.numpy(), A % B)
    fa, fb = A.astype(np.float32) + 0.5, B.astype(np.float32)
    np.testing.assert_array_equal((up(fa) // up(fb)).numpy(), fa // fb)
    np.testing.assert_array_equal((up(fa) % up(fb)).numpy(), np.remainder(fa, fb))
    np.testing.assert_array_equal((-7 // up(B)).numpy(), -7 // B)  # reflected


def test_power():
    np.testing.assert_array_equal((up(A) ** 2).numpy(), A ** 2)
    np.testing.assert_array_equal((2 ** up(np.arange(5, dtype=np.int64))).numpy(), 2 ** np.arange(5))
    f = np.array([0.5, 2.0, 3.0], dtype=np.float32)
    np.testing.assert_allclose((up(f) ** 1.5).numpy(), f ** 1.5, rtol=1e-6)


@pytest.mark.parametrize("a_dtype,b,expected", [
    ("uint8", np.int8, "int16"),
    ("float16", "bfloat16", "float32"),
    ("int64", np.float16, "float16"),
    ("bool", np.bool_, "bool"),
    ("int32", np.int64, "int64"),
    ("int8", 1000, "int8"),           # a Python int does not widen an int array
    ("int32", 1.5, "float32"),        # a Python float with ints: the default dtype
    ("bool", 3, "int64"),             # a Python int raises bool to int64
    ("float16", 2.5, "float16"),      # same category: the array wins
    ("int32", "f8_0d", "float64"),    # a 0-d float64 array raises an int32 array to float64
    ("float32", "f8_0d", "float32"),  # ... but not a float32 one
])
def test_type_promotion_follows_torch(a_dtype, b, expected):
    pytest.importorskip("ml_dtypes") if "bfloat16" in (a_dtype, b) else None
    a = cudalab.asarray(np.ones(3), dtype=a_dtype)
    if b == "f8_0d":
        other = cudalab.asarray(np.float64(2.0))
    elif isinstance(b, (int, float)) and not isinstance(b, bool):
        other = b
    else:
        other = cudalab.asarray(np.ones(3), dtype=b)
    assert (a + other).dtype == cudalab.asarray(np.ones(1), dtype=expected).dtype


def test_int8_plus_large_python_int_wraps():
    np.testing.assert_array_equal((up([1, 2], np.int8) + 1000).numpy(),
                                  (np.array([1, 2]) + 1000).astype(np.int8))


def test_bool_arithmetic_and_bitwise():
    t, f = up([True, True, False, False]), up([True, False, True, False])
    assert (t + f).dtype == np.bool_
    np.testing.assert_array_equal((t + f).numpy(), [True, True, True, False])   # or
    np.testing.assert_array_equal((t * f).numpy(), [True, False, False, False])  # and
    np.testing.assert_array_equal((t ^ f).numpy(), [False, True, True, False])
    np.testing.assert_array_equal((~t).numpy(), [False, False, True, True])
    np.testing.assert_array_equal((up(A) & up(B)).numpy(), A & B)
    np.testing.assert_array_equal((up(A) | 6).numpy(), A | 6)
    np.testing.assert_array_equal((~up(A)).numpy(), ~A)
    with pytest.raises(TypeError, match="bitwise_and_cuda\" not implemented for 'Float'"):
        up([1.0], np.float32) & up([2.0], np.float32)
    with pytest.raises(TypeError, match="not implemented for 'Float'"):
        ~up([1.0], np.float32)


def test_bool_negation_and_subtraction_refused_like_torch():
    t = up([True, False])
    with pytest.raises(RuntimeError, match="Negation, the `-` operator, on a bool tensor"):
        t.__neg__()
    with pytest.raises(RuntimeError, match="with two bool tensors is not supported"):
        t - t
    with pytest.raises(RuntimeError, match="with a bool tensor is not supported"):
        t - 1


def test_unary_minus_and_abs():
    np.testing.assert_array_equal((-up(A)).numpy(), -A)
    np.testing.assert_array_equal(abs(up(A)).numpy(), np.abs(A))
    f = np.array([-0.0, -1.5, np.inf, -np.inf], dtype=np.float32)
    got = up(f).abs().numpy()
    np.testing.assert_array_equal(got, np.abs(f))
    assert not np.signbit(got[0])
    assert +up(A) is not None


def test_in_place_forms_keep_the_dtype_and_refuse_unsafe_casts():
    x = up(A.copy())
    ptr = x.ptr
    x += 1
    x *= up(B)
    x -= 2
    assert x.ptr == ptr and x.dtype == np.int32
    np.testing.assert_array_equal(x.numpy(), (A + 1) * B - 2)
    with pytest.raises(RuntimeError, match="result type Float can't be cast to the desired "
                                           "output type Int"):
        x /= 2
    with pytest.raises(RuntimeError, match="result type Float can't be cast"):
        x += 1.5
    f = up(A.astype(np.float32))
    f += up(B)  # int into float is fine
    np.testing.assert_array_equal(f.numpy(), (A + B).astype(np.float32))
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        y = up(np.ones(3, np.float32))
        y += up(np.ones((2, 3), np.float32))


def test_reflected_forms_with_scalars():
    f = np.array([1.0, 2.0, 4.0], dtype=np.float32)
    np.testing.assert_array_equal((1 - up(f)).numpy(), 1 - f)
    np.testing.assert_allclose((1 / up(f)).numpy(), 1 / f)
    np.testing.assert_array_equal((3 * up(f)).numpy(), 3 * f)
    np.testing.assert_array_equal((True + up(f)).numpy(), 1 + f)


def test_unsupported_operands_return_not_implemented():
    with pytest.raises(TypeError):
        up(A) + "x"
    with pytest.raises(TypeError):
        up(A) + [1, 2]
    assert up(A).__add__(object()) is NotImplemented


def test_broadcasting_and_strided_operands():
    host = np.arange(32, dtype=np.float32)
    view, twin, keep = strided(host, (4, 4), (4, 32))  # a transpose of a (4, 8) array's half
    row = np.array([1, 2, 3, 4], dtype=np.float32)
    np.testing.assert_array_equal((view * up(row)).numpy(), twin * row)
    col = up(row.reshape(4, 1))
    np.testing.assert_array_equal((view + col).numpy(), twin + row.reshape(4, 1))


def test_where():
    cond = up([True, False, True])
    np.testing.assert_array_equal(cudalab.where(cond, up([1, 2, 3]), -1).numpy(), [1, -1, 3])
    r = up([1.0, 2.0, 3.0], np.float32).where(cond, up([0, 0, 0], np.int64))
    assert r.dtype == np.float32
    np.testing.assert_array_equal(r.numpy(), [1, 0, 3])
    with pytest.raises(TypeError, match="where expected condition to be a boolean tensor"):
        cudalab.where(up([1, 0]), 1, 2)


def test_astype_to_dtype_and_converting_copy():
    f = np.array([-1.7, 0.2, 2.9, 300.5], dtype=np.float32)
    a = up(f)
    i = a.astype(np.int32)
    assert i.dtype == np.int32
    np.testing.assert_array_equal(i.numpy(), f.astype(np.int32))  # truncation, as torch
    h = a.to(np.float16)
    np.testing.assert_array_equal(h.numpy(), f.astype(np.float16))
    assert a.to("float64").dtype == np.float64 and a.to(dtype=np.float32) is a
    assert a.astype(np.float32, copy=False) is a and a.astype(np.float32) is not a
    dst = cudalab.empty((2, 4), dtype=np.int64)
    dst.copy_(a)  # converts and broadcasts
    np.testing.assert_array_equal(dst.numpy(), np.broadcast_to(f.astype(np.int64), (2, 4)))
    dst.copy_(np.array([1.5, 2.5, 3.5, 4.5]))  # a host source of another dtype
    np.testing.assert_array_equal(dst.numpy(), np.broadcast_to([1, 2, 3, 4], (2, 4)))


def test_equality_is_elementwise_and_arrays_stay_hashable():
    a = up(A)
    assert (a == a).dtype == np.bool_
    assert {a: 1}[a] == 1


def test_read_only_arrays_refuse_in_place_operations():
    base = up(A)
    from tests.helpers.strided import CudaArrayInterface

    cai = dict(base.__cuda_array_interface__)
    cai["data"] = (base.ptr, True)
    ro = cudalab.asarray(CudaArrayInterface(**cai))
    with pytest.raises(ValueError, match="read-only"):
        ro += 1
    np.testing.assert_array_equal((ro + 1).numpy(), A + 1)
