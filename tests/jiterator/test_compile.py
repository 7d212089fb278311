"""The generated CUDA C++ compiles with NVRTC (CI has NVRTC, not a GPU): every operator, every
element type, the vectorised, unaligned and strided variants, host scalars, extras, several
outputs; a compile error points into the user's string; the caches key by dtypes and width.
"""

from __future__ import annotations

import numpy as np
import pytest

from cudalab import KernelCompileError
from cudalab import jiterator as jit
from cudalab._array_operators import OPERATIONS
from cudalab._driver import nvrtc
from cudalab._kernels import kernel as kernel_facility
from cudalab._kernels.elementwise import kernels_for

ELF = b"\x7fELF"
ARCH = "sm_90"
ALL_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
              "float16", "bfloat16", "float32", "float64"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh disk cache and memory cache; counts real NVRTC compilations."""
    monkeypatch.setenv("CUDALAB_CACHE_DIR", str(tmp_path / "kcache"))
    kernel_facility._reset_caches_for_tests()
    calls = []
    real = nvrtc.compile_cubin

    def counting(source, name, arch="sm_90", options=()):
        calls.append(name)
        return real(source, name, arch, options)

    monkeypatch.setattr(nvrtc, "compile_cubin", counting)
    yield tmp_path / "kcache", calls
    kernel_facility._reset_caches_for_tests()


def _compiles(kernels):
    for k in kernels:
        assert k.cubin(ARCH)[:4] == ELF, k.name


def _dtypes_for(op):
    if op in ("bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not"):
        return ["int32", "bool"]
    if op in ("floor_divide", "remainder", "pow"):
        return ["int32", "float32"]
    return ["int32", "float32", "bool"] if op not in ("neg",) else ["int32", "float32"]


@pytest.mark.parametrize("op", sorted(OPERATIONS))
def test_every_operator_kernel_compiles(op, cache):
    fn = OPERATIONS[op]
    for dt in _dtypes_for(op):
        if op == "where":
            _compiles(kernels_for(fn, ["bool", dt, dt]))
        elif op in ("neg", "abs", "bitwise_not", "copy"):
            _compiles(kernels_for(fn, [dt]))
        else:
            _compiles(kernels_for(fn, [dt, dt]))
            _compiles(kernels_for(fn, [dt, int]))  # a host scalar operand


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_element_type_compiles_with_conversions(dtype, cache):
    _compiles(kernels_for(OPERATIONS["add"], [dtype, dtype]))
    _compiles(kernels_for(OPERATIONS["copy"], ["float32"], out_dtype=np.dtype(dtype)
                          if dtype != "bfloat16" else None))
    _compiles(kernels_for(OPERATIONS["lt"], [dtype, "float16"], strided=True))


def test_jit_variants_compile(cache):
    f = jit._create_jit_fn("template <typename T> T fused(T x, T y, T alpha, bool flip) "
                           "{ return flip ? y - alpha * x : alpha * x + y; }",
                           alpha=2.0, flip=False)
    _compiles(f.kernels(np.float32, np.float16))
    _compiles(f.kernels(np.float32, float, strided=True))
    large = f.kernels(np.float32, np.float16, large=True) + f.kernels(np.int8, float, strided=True,
                                                                       large=True)
    assert all("_i64_" in k.name for k in large)  # 64-bit indices from 2**31 elements
    _compiles(large)
    m = jit._create_multi_output_jit_fn(
        "template <typename T> void split(T x, long long k, T& lo, T& hi) "
        "{ lo = x - T(k); hi = x + T(k); }", 2, k=3)
    _compiles(m.kernels("bfloat16"))
    _compiles(m.kernels(np.int64, strided=True))


def test_compile_error_points_into_the_code_string(cache):
    f = jit._create_jit_fn("template <typename T>\nT broken(T x) {\n    return x +* 2;\n}\n")
    with pytest.raises(KernelCompileError) as info:
        f.kernels(np.float32)[0].cubin(ARCH)
    assert "jiterator_code(3): error" in str(info.value)
    assert "return x +* 2;" in str(info.value)


def test_kernels_are_cached_by_code_dtypes_and_vector_width(cache):
    directory, calls = cache
    code = "template <typename T> T sq(T x) { return x * x; }"
    vec, unaligned = jit._create_jit_fn(code).kernels(np.float32)
    assert vec.name.startswith("sq_v4_") and unaligned.name.startswith("sq_v1_")
    vec.cubin(ARCH)
    jit._create_jit_fn(code).kernels(np.float32)[0].cubin(ARCH)  # a new function, same code
    assert len(calls) == 1
    unaligned.cubin(ARCH)
    jit._create_jit_fn(code).kernels(np.float64)[0].cubin(ARCH)
    assert len(calls) == 3
    assert len(list(directory.glob("*.cubin"))) == 3
    kernel_facility._reset_caches_for_tests()  # memory gone: the disk cache answers
    jit._create_jit_fn(code).kernels(np.float64)[0].cubin(ARCH)
    assert len(calls) == 3


COMPLEX_OPS = ("abs", "add", "copy", "div", "eq", "mul", "ne", "neg", "pow", "sub", "where")


@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_complex_kernels_compile(dtype, cache):
    """Every operator that takes complex arrays, with complex scalars, mixed real operands,
    strided views, and conversions to and from every dtype."""
    for op in COMPLEX_OPS:
        fn = OPERATIONS[op]
        if op == "where":
            _compiles(kernels_for(fn, ["bool", dtype, complex]))
        elif op in ("neg", "abs", "copy"):
            _compiles(kernels_for(fn, [dtype], strided=True))
        else:
            _compiles(kernels_for(fn, [dtype, complex]))
            _compiles(kernels_for(fn, [dtype, "float16"], strided=True))
    for other in ALL_DTYPES:
        if other != "bfloat16":
            _compiles(kernels_for(OPERATIONS["copy"], [dtype], out_dtype=np.dtype(other)))
        _compiles(kernels_for(OPERATIONS["copy"], [other], out_dtype=np.dtype(dtype)))


def test_complex_jit_functions_compile(cache):
    f = jit._create_jit_fn(
        "template <typename T> T f(T x, T y, T alpha) { return std::exp(x) * sqrt(y) "
        "+ pow(x, y) / norm(x) - conj(x) * T(2) + 3 * x + x.real() + sin(x) + tanh(y) "
        "+ log10(x) + std::abs(x) + arg(y) + (x == y ? x : y) + (x != 1 ? alpha : x); }",
        alpha=2)  # an int extra argument converts to the complex T parameter
    _compiles(f.kernels(np.complex64, np.complex64))
    _compiles(f.kernels(np.complex128, float, strided=True))
    _compiles(f.kernels(np.float32, complex))
