"""On a GPU, next to torch: operators bit for bit (+ - * and comparisons; / within 1 ulp) over
a dtype matrix, the jiterator against torch's jiterator, and jit functions fed torch and CuPy
arrays. Skipped on the simulator and without torch.
"""

from __future__ import annotations

import operator
import re

import numpy as np
import pytest

import cudalab
from cudalab import jiterator as jit

pytestmark = pytest.mark.gpu

DTYPES = ["bool", "uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
EXACT_OPS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
             "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
             "eq": operator.eq, "ne": operator.ne}


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


def _host(dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.random(4099) < 0.5
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), 4099).astype(dtype)
    return (rng.standard_normal(4099) * 100).astype(np.float32)


def _pair(torch, host: np.ndarray, dtype: str):
    """(DeviceArray, torch tensor) holding the same values of ``dtype``."""
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    t = torch.from_numpy(np.ascontiguousarray(host)).to("cuda").to(getattr(torch, dtype))
    ours = cudalab.from_dlpack(t.clone())
    return ours, t


def _bits(torch, t) -> np.ndarray:
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.view(torch.int16).cpu().numpy()
    return t.cpu().numpy()


def _ours_bits(torch, a) -> np.ndarray:
    if a.itemsize == 2 and a.dtype.kind not in "iu":  # float16, bfloat16: compare the bits
        return a.view(np.int16).numpy()
    return a.numpy()


@pytest.mark.parametrize("op", sorted(EXACT_OPS))
@pytest.mark.parametrize("a_dtype", DTYPES)
@pytest.mark.parametrize("b_dtype", ["same", "float32", "int64", "scalar_int", "scalar_float"])
def test_operators_bit_for_bit(torch, op, a_dtype, b_dtype):
    if b_dtype in ("float32", "int64", "scalar_int") and op not in ("add", "mul", "lt", "eq"):
        pytest.skip("mixed dtypes are covered by add, mul, lt and eq (the same promotion)")
    fn = EXACT_OPS[op]
    a, ta = _pair(torch, _host(a_dtype, 1), a_dtype)
    if b_dtype.startswith("scalar"):
        b = tb = 3 if b_dtype == "scalar_int" else 0.1
    else:
        dt = a_dtype if b_dtype == "same" else b_dtype
        b, tb = _pair(torch, _host(dt, 2), dt)
    try:
        expected = fn(ta, tb)
    except RuntimeError as exc:  # torch refuses (bool subtraction): so must cudalab
        with pytest.raises(RuntimeError, match=re.escape(str(exc).split(",")[0][:30])):
            fn(a, b)
        return
    got = fn(a, b)
    assert str(got.dtype) == str(expected.dtype).replace("torch.", "")
    np.testing.assert_array_equal(_ours_bits(torch, got), _bits(torch, expected))


@pytest.mark.parametrize("a_dtype", ["float16", "bfloat16", "float32", "float64", "int32"])
@pytest.mark.parametrize("b_dtype", ["same", "scalar"])
def test_true_division_within_one_ulp(torch, a_dtype, b_dtype):
    a, ta = _pair(torch, _host(a_dtype, 3), a_dtype)
    if b_dtype == "scalar":
        b = tb = 7.3
    else:
        host = _host(a_dtype, 4)
        host[host == 0] = 1
        b, tb = _pair(torch, host, a_dtype)
    expected = ta / tb
    got = torch.from_dlpack(a / b)
    assert got.dtype == expected.dtype
    if got.dtype in (torch.float16, torch.bfloat16):
        diff = (got.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    elif got.dtype == torch.float32:
        diff = (got.view(torch.int32).long() - expected.view(torch.int32).long()).abs()
    else:
        diff = (got.view(torch.int64) - expected.view(torch.int64)).abs()
    assert int(diff.max()) <= 1


def test_floor_division_and_remainder_match_torch(torch):
    for dtype in ("int32", "int64", "float32"):
        a, ta = _pair(torch, _host(dtype, 5), dtype)
        host = _host(dtype, 6)
        host[host == 0] = 3
        b, tb = _pair(torch, host, dtype)
        np.testing.assert_array_equal(torch.from_dlpack(a // b).cpu().numpy(),
                                      (ta // tb).cpu().numpy())
        np.testing.assert_array_equal(torch.from_dlpack(a % b).cpu().numpy(),
                                      (ta % tb).cpu().numpy())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int32"])
def test_jiterator_matches_torch_jiterator(torch, dtype):
    code = "template <typename T> T fused(T x, T y, T alpha, T beta) { return alpha * x + beta * y; }"
    ours = jit._create_jit_fn(code, alpha=2, beta=-1)
    theirs = torch.cuda.jiterator._create_jit_fn(code, alpha=2, beta=-1)
    a, ta = _pair(torch, _host(dtype, 7), dtype)
    b, tb = _pair(torch, _host(dtype, 8), dtype)
    np.testing.assert_array_equal(_ours_bits(torch, ours(a, b)), _bits(torch, theirs(ta, tb)))
    # torch tensors straight in (DLPack), a transposed view among them
    t2 = ta[:4096].reshape(64, 64)
    got = ours(t2.t(), tb[:4096].reshape(64, 64), alpha=3.0)
    expected = theirs(t2.t(), tb[:4096].reshape(64, 64), alpha=3.0)
    np.testing.assert_array_equal(_ours_bits(torch, got), _bits(torch, expected))


def test_jit_function_on_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    f = jit._create_jit_fn("template <typename T> T sq(T x) { return x * x; }")
    x = cupy.arange(100, dtype=cupy.float32)
    np.testing.assert_array_equal(f(x).numpy(), np.arange(100, dtype=np.float32) ** 2)
    np.testing.assert_array_equal(f(x[::3]).numpy(), (np.arange(100, dtype=np.float32)[::3]) ** 2)


def test_unaligned_views_use_the_scalar_kernel(torch):
    host = np.arange(1027, dtype=np.float32)
    a = cudalab.asarray(host)
    view = a[1:]  # 4-byte offset: no 16-byte vector loads
    np.testing.assert_array_equal((view + view).numpy(), host[1:] * 2)
