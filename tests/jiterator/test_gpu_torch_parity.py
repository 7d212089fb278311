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


# --------------------------------------------------------------------------- complex
def _complex_host(dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(4099) * 100 + 1j * rng.standard_normal(4099) * 100
    z[:6] = [0, 1j, -2.5, 3 - 4j, 1e-30 + 1e30j, -0.0 - 7j]
    return z.astype(dtype)


def _ordered(parts: np.ndarray) -> np.ndarray:
    """IEEE floats as integers in their numeric order (ulp distances by subtraction)."""
    bits = parts.view(np.int32 if parts.dtype == np.float32 else np.int64).astype(np.int64)
    low = np.int64(-(2**31)) if parts.dtype == np.float32 else np.iinfo(np.int64).min
    return np.where(bits < 0, low - bits, bits)


def max_ulps(got: np.ndarray, expected: np.ndarray) -> int:
    """Largest distance in ulps between the real and imaginary parts of two arrays (nan
    positions must agree)."""
    if got.dtype.kind == "c":
        got = got.view(np.float32 if got.dtype == np.complex64 else np.float64)
        expected = expected.view(got.dtype)
    assert got.dtype == expected.dtype
    nan = np.isnan(got)
    np.testing.assert_array_equal(nan, np.isnan(expected))
    return int(np.abs(_ordered(got[~nan]) - _ordered(expected[~nan])).max(initial=0))


COMPLEX_EXACT = {"add": operator.add, "sub": operator.sub, "eq": operator.eq, "ne": operator.ne,
                 "neg": lambda a, b: -a, "where": lambda a, b: a.where(abs(b) > 100, 5j)}


@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
@pytest.mark.parametrize("op", sorted(COMPLEX_EXACT))
def test_complex_operators_bit_for_bit(torch, dtype, op):
    host_a, host_b = _complex_host(dtype, 11), _complex_host(dtype, 12)
    a, ta = cudalab.asarray(host_a), torch.from_numpy(host_a).cuda()
    b, tb = cudalab.asarray(host_b), torch.from_numpy(host_b).cuda()
    fn = COMPLEX_EXACT[op]
    got, expected = fn(a, b), fn(ta, tb)
    assert str(got.dtype) == str(expected.dtype).replace("torch.", "")
    np.testing.assert_array_equal(got.numpy(), expected.cpu().numpy())
    scalar = fn(a, 2 - 1j) if op in ("add", "sub", "eq", "ne") else None
    if scalar is not None:
        np.testing.assert_array_equal(scalar.numpy(), fn(ta, 2 - 1j).cpu().numpy())


@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
@pytest.mark.parametrize("op", ["mul", "div", "mul_scalar", "div_scalar", "square", "abs",
                                "to_float", "to_bool", "from_float"])
def test_complex_operators_within_one_ulp(torch, dtype, op):
    host_a, host_b = _complex_host(dtype, 13), _complex_host(dtype, 14)
    a, ta = cudalab.asarray(host_a), torch.from_numpy(host_a).cuda()
    b, tb = cudalab.asarray(host_b), torch.from_numpy(host_b).cuda()
    real = "float32" if dtype == "complex64" else "float64"

    def dtype_for(x, name):  # the same dtype, spelled for torch or for cudalab
        return getattr(torch, name) if isinstance(x, torch.Tensor) else np.dtype(name)

    def real_part(x):
        return x.real.contiguous() if isinstance(x, torch.Tensor) else cudalab.asarray(
            host_a.real.copy())

    fns = {
        "mul": lambda x, y: x * y, "div": lambda x, y: x / y,
        "mul_scalar": lambda x, y: x * (0.3 - 2j), "div_scalar": lambda x, y: x / (0.3 - 2j),
        "square": lambda x, y: x ** 2, "abs": lambda x, y: abs(x),
        "to_float": lambda x, y: x.to(dtype_for(x, real)),
        "to_bool": lambda x, y: x.to(dtype_for(x, "bool")),
        "from_float": lambda x, y: real_part(x).to(dtype_for(x, dtype)),
    }
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (complex -> real discards: both warn)
        got, expected = fns[op](a, b), fns[op](ta, tb)
    assert str(got.dtype) == str(expected.dtype).replace("torch.", "")
    expected_host = expected.cpu().numpy()
    if got.dtype == np.bool_:
        np.testing.assert_array_equal(got.numpy(), expected_host)
    else:
        assert max_ulps(got.numpy(), expected_host) <= 1


@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_complex_power_close_to_torch(torch, dtype):
    host_a = _complex_host(dtype, 15)[6:]
    host_b = (_complex_host(dtype, 16)[6:] / 100).astype(dtype)
    a, ta = cudalab.asarray(host_a), torch.from_numpy(host_a).cuda()
    b, tb = cudalab.asarray(host_b), torch.from_numpy(host_b).cuda()
    rtol = 1e-5 if dtype == "complex64" else 1e-13
    np.testing.assert_allclose((a ** b).numpy(), (ta ** tb).cpu().numpy(), rtol=rtol)
    np.testing.assert_allclose((a ** 1.5).numpy(), (ta ** 1.5).cpu().numpy(), rtol=rtol)


def test_complex_jiterator_matches_torch_jiterator(torch):
    code = "template <typename T> T cfused(T x, T y, T alpha) { return alpha * x + y * y; }"
    theirs = torch.cuda.jiterator._create_jit_fn(code, alpha=2.0)
    ours = jit._create_jit_fn(code, alpha=2.0)
    host_a, host_b = _complex_host("complex64", 17), _complex_host("complex64", 18)
    ta, tb = torch.from_numpy(host_a).cuda(), torch.from_numpy(host_b).cuda()
    try:
        expected = theirs(ta, tb)
    except RuntimeError as exc:  # a torch build without complex jiterator support
        pytest.skip(f"torch's jiterator refuses complex inputs here: {exc}")
    got = ours(cudalab.asarray(host_a), cudalab.asarray(host_b)).numpy()
    # The same c10::complex formulas; the compiler fuses multiply-adds of the inlined
    # expression its own way, so the parts agree to float32 rounding of the products.
    # (1e-30 + 1e30j squared overflows float32: those parts must be non-finite alike)
    want = expected.cpu().numpy()
    for ours_part, torch_part in ((got.real, want.real), (got.imag, want.imag)):
        finite = np.isfinite(torch_part)
        np.testing.assert_array_equal(np.isfinite(ours_part), finite)
        scale = (2 * np.abs(host_a) + np.abs(host_b.astype(np.complex128)) ** 2)[finite]
        diff = np.abs(ours_part[finite].astype(np.float64) - torch_part[finite])
        assert np.all(diff <= 4 * np.finfo(np.float32).eps * scale)
    # a torch tensor straight in, with a float32 tensor promoted to complex64
    got = ours(ta, torch.ones(4099, device="cuda"))
    np.testing.assert_array_equal(got.numpy(), theirs(ta, torch.ones(4099, device="cuda")
                                                      .to(torch.complex64)).cpu().numpy())
