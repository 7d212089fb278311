"""The C++ of an elementwise kernel: element types, torch's code-string parser, the source.

:func:`build_kernel` wraps the user's templated function (kept verbatim between ``#line``
directives, so NVRTC's messages give line numbers into the user's string) in an
``extern "C"`` kernel: a vectorised grid-stride loop for contiguous operands, or a strided
loop whose merged sizes and byte strides are kernel parameters. The kernel's name carries a
hash of its source, which spells out every dtype and the vector width; the kernel facility
caches the CUBIN by source and architecture. Used by :mod:`cudalab._kernels.elementwise`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cudalab._kernels import type_promotion as tp
from cudalab._kernels.kernel import Kernel, unregister_kernel

__all__ = ["c_type", "ParsedCode", "parse_code", "build_kernel", "OPTIONS", "PREAMBLE",
           "COMPLEX_PREAMBLE", "EXTRA_INT", "EXTRA_BOOL", "EXTRA_DOUBLE"]

#: NVRTC options of every elementwise kernel (the rest is NVRTC's default, as in torch:
#: --fmad=true, IEEE division and square root, no flush to zero).
OPTIONS = ("-std=c++17", "-default-device")

# --------------------------------------------------------------------------- C types
_C_TYPES = {
    "bool": "bool", "int8": "signed char", "int16": "short", "int32": "int",
    "int64": "long long", "uint8": "unsigned char", "uint16": "unsigned short",
    "uint32": "unsigned int", "uint64": "unsigned long long", "float16": "cudalab_half",
    "bfloat16": "cudalab_bfloat16", "float32": "float", "float64": "double",
    "complex64": "cudalab_complex<float>", "complex128": "cudalab_complex<double>",
}
#: compute dtype -> (kernel parameter type code, C parameter type) for host scalars (a
#: complex scalar is two parameters of its part's type, real then imaginary).
_SCALAR_PARAMS = {
    "bool": ("u4", "unsigned int"), "int8": ("i4", "int"), "int16": ("i4", "int"),
    "int32": ("i4", "int"), "int64": ("i8", "long long"), "uint8": ("u4", "unsigned int"),
    "uint16": ("u4", "unsigned int"), "uint32": ("u4", "unsigned int"),
    "uint64": ("u8", "unsigned long long"), "float32": ("f4", "float"),
    "float64": ("f8", "double"), "complex64": ("f4", "float"), "complex128": ("f8", "double"),
}
#: Python type of an extra argument -> (type code, C type), torch's as_scalar.
EXTRA_INT = ("i8", "long long")
EXTRA_BOOL = ("u4", "unsigned int")
EXTRA_DOUBLE = ("f8", "double")

PREAMBLE = r"""
struct __align__(2) cudalab_half {
    unsigned short x;
    cudalab_half() = default;
    __device__ cudalab_half(float f) { asm("cvt.rn.f16.f32 %0, %1;" : "=h"(x) : "f"(f)); }
    template <typename U> __device__ explicit cudalab_half(U u) : cudalab_half(static_cast<float>(u)) {}
    __device__ operator float() const { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f; }
};
struct __align__(2) cudalab_bfloat16 {
    unsigned short x;
    cudalab_bfloat16() = default;
    __device__ cudalab_bfloat16(float f) {
        unsigned int u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) { x = 0x7fc0; }
        else { u += 0x7fffu + ((u >> 16) & 1u); x = static_cast<unsigned short>(u >> 16); }
    }
    template <typename U> __device__ explicit cudalab_bfloat16(U u) : cudalab_bfloat16(static_cast<float>(u)) {}
    __device__ operator float() const { return __uint_as_float(static_cast<unsigned int>(x) << 16); }
};
template <typename T, int N> struct alignas(sizeof(T) * N) cudalab_vec { T v[N]; };
template <typename To, typename From> __device__ __forceinline__ To cudalab_cvt(From v) { return static_cast<To>(v); }
"""

#: C++ of complex64/complex128 elements (``cudalab_complex<float>``/``<double>``), added to a
#: kernel's source only when one of its dtypes is complex, so real kernels' sources (and their
#: disk-cache keys) stay as they were. The arithmetic is c10::complex's (c10/util/complex.h):
#: the same formulas in the same order, so results follow torch's kernels: ``+ - ==`` exactly,
#: ``*`` and ``/`` up to how the compiler contracts multiply-adds (tested against torch on
#: the GPU). Python scalars and mixed real operands behave as in c10: ``z * r`` scales both
#: parts. Conversions follow torch: complex to real keeps the real part, to bool tests both
#: parts. The math functions (``abs arg norm conj real imag exp log log10 sqrt pow sin cos
#: tan sinh cosh tanh``) are textbook formulas, within a few ulp of torch's (thrust's), and
#: are also in ``std::`` so ``std::exp(z)`` in a jiterator string works.
COMPLEX_PREAMBLE = r"""
template <typename U> struct cudalab_is_real { static constexpr bool value = false; };
#define CUDALAB_REAL(U) template <> struct cudalab_is_real<U> { static constexpr bool value = true; };
CUDALAB_REAL(bool) CUDALAB_REAL(char) CUDALAB_REAL(signed char) CUDALAB_REAL(unsigned char)
CUDALAB_REAL(short) CUDALAB_REAL(unsigned short) CUDALAB_REAL(int) CUDALAB_REAL(unsigned int)
CUDALAB_REAL(long) CUDALAB_REAL(unsigned long) CUDALAB_REAL(long long) CUDALAB_REAL(unsigned long long)
CUDALAB_REAL(float) CUDALAB_REAL(double) CUDALAB_REAL(cudalab_half) CUDALAB_REAL(cudalab_bfloat16)
#undef CUDALAB_REAL
template <bool B, typename R> struct cudalab_enable_if {};
template <typename R> struct cudalab_enable_if<true, R> { typedef R type; };
#define CUDALAB_IF_REAL(U, R) typename cudalab_enable_if<cudalab_is_real<U>::value, R>::type

template <typename T> struct alignas(2 * sizeof(T)) cudalab_complex {
    typedef T value_type;
    T real_, imag_;
    cudalab_complex() = default;
    __device__ cudalab_complex(T re, T im = T(0)) : real_(re), imag_(im) {}
    template <typename U> __device__ explicit cudalab_complex(const cudalab_complex<U>& other)
        : real_(static_cast<T>(other.real_)), imag_(static_cast<T>(other.imag_)) {}
    __device__ T real() const { return real_; }
    __device__ T imag() const { return imag_; }
    __device__ void real(T value) { real_ = value; }
    __device__ void imag(T value) { imag_ = value; }
    __device__ explicit operator bool() const { return real_ != T(0) || imag_ != T(0); }
    __device__ cudalab_complex& operator+=(const cudalab_complex& rhs) { real_ += rhs.real_; imag_ += rhs.imag_; return *this; }
    __device__ cudalab_complex& operator-=(const cudalab_complex& rhs) { real_ -= rhs.real_; imag_ -= rhs.imag_; return *this; }
    __device__ cudalab_complex& operator*=(const cudalab_complex& rhs) {
        // (a + bi) * (c + di) = (ac - bd) + (ad + bc)i
        T a = real_, b = imag_, c = rhs.real_, d = rhs.imag_;
        real_ = a * c - b * d;
        imag_ = a * d + b * c;
        return *this;
    }
    __device__ cudalab_complex& operator/=(const cudalab_complex& rhs) {
        // Smith's scaling, as numpy and c10 divide
        T a = real_, b = imag_, c = rhs.real_, d = rhs.imag_;
        T abs_c = c < T(0) ? -c : c, abs_d = d < T(0) ? -d : d;
        if (abs_c >= abs_d) {
            if (abs_c == T(0) && abs_d == T(0)) { real_ = a / abs_c; imag_ = b / abs_d; }
            else { T rat = d / c; T scl = T(1.0) / (c + d * rat);
                   real_ = (a + b * rat) * scl; imag_ = (b - a * rat) * scl; }
        } else {
            T rat = c / d; T scl = T(1.0) / (d + c * rat);
            real_ = (a * rat + b) * scl; imag_ = (b * rat - a) * scl;
        }
        return *this;
    }
    template <typename U> __device__ CUDALAB_IF_REAL(U, cudalab_complex&) operator+=(const U& rhs) { real_ += static_cast<T>(rhs); return *this; }
    template <typename U> __device__ CUDALAB_IF_REAL(U, cudalab_complex&) operator-=(const U& rhs) { real_ -= static_cast<T>(rhs); return *this; }
    template <typename U> __device__ CUDALAB_IF_REAL(U, cudalab_complex&) operator*=(const U& rhs) { real_ *= static_cast<T>(rhs); imag_ *= static_cast<T>(rhs); return *this; }
    template <typename U> __device__ CUDALAB_IF_REAL(U, cudalab_complex&) operator/=(const U& rhs) { real_ /= static_cast<T>(rhs); imag_ /= static_cast<T>(rhs); return *this; }
};
template <typename T> __device__ cudalab_complex<T> operator+(const cudalab_complex<T>& z) { return z; }
template <typename T> __device__ cudalab_complex<T> operator-(const cudalab_complex<T>& z) { return cudalab_complex<T>(-z.real_, -z.imag_); }
#define CUDALAB_COMPLEX_OP(OP)                                                                               \
template <typename T> __device__ cudalab_complex<T> operator OP(cudalab_complex<T> lhs, const cudalab_complex<T>& rhs) { return lhs OP##= rhs; } \
template <typename T, typename U> __device__ CUDALAB_IF_REAL(U, cudalab_complex<T>) operator OP(cudalab_complex<T> lhs, const U& rhs) { return lhs OP##= rhs; }
CUDALAB_COMPLEX_OP(+) CUDALAB_COMPLEX_OP(-) CUDALAB_COMPLEX_OP(*) CUDALAB_COMPLEX_OP(/)
#undef CUDALAB_COMPLEX_OP
template <typename T, typename U> __device__ CUDALAB_IF_REAL(U, cudalab_complex<T>) operator+(const U& lhs, const cudalab_complex<T>& rhs) { return cudalab_complex<T>(static_cast<T>(lhs) + rhs.real_, rhs.imag_); }
template <typename T, typename U> __device__ CUDALAB_IF_REAL(U, cudalab_complex<T>) operator-(const U& lhs, const cudalab_complex<T>& rhs) { return cudalab_complex<T>(static_cast<T>(lhs) - rhs.real_, -rhs.imag_); }
template <typename T, typename U> __device__ CUDALAB_IF_REAL(U, cudalab_complex<T>) operator*(const U& lhs, const cudalab_complex<T>& rhs) { return cudalab_complex<T>(static_cast<T>(lhs) * rhs.real_, static_cast<T>(lhs) * rhs.imag_); }
template <typename T, typename U> __device__ CUDALAB_IF_REAL(U, cudalab_complex<T>) operator/(const U& lhs, const cudalab_complex<T>& rhs) { return cudalab_complex<T>(static_cast<T>(lhs)) / rhs; }
template <typename T> __device__ bool operator==(const cudalab_complex<T>& lhs, const cudalab_complex<T>& rhs) { return lhs.real_ == rhs.real_ && lhs.imag_ == rhs.imag_; }
template <typename T> __device__ bool operator!=(const cudalab_complex<T>& lhs, const cudalab_complex<T>& rhs) { return !(lhs == rhs); }
template <typename T, typename U> __device__ CUDALAB_IF_REAL(U, bool) operator==(const cudalab_complex<T>& lhs, const U& rhs) { return lhs.real_ == static_cast<T>(rhs) && lhs.imag_ == T(0); }
template <typename T, typename U> __device__ CUDALAB_IF_REAL(U, bool) operator==(const U& lhs, const cudalab_complex<T>& rhs) { return rhs == lhs; }
template <typename T, typename U> __device__ CUDALAB_IF_REAL(U, bool) operator!=(const cudalab_complex<T>& lhs, const U& rhs) { return !(lhs == rhs); }
template <typename T, typename U> __device__ CUDALAB_IF_REAL(U, bool) operator!=(const U& lhs, const cudalab_complex<T>& rhs) { return !(rhs == lhs); }

template <typename T> __device__ T cudalab_c_abs(const cudalab_complex<T>& z) { return hypot(z.real_, z.imag_); }
template <typename T> __device__ T cudalab_c_arg(const cudalab_complex<T>& z) { return atan2(z.imag_, z.real_); }
template <typename T> __device__ T cudalab_c_norm(const cudalab_complex<T>& z) { return z.real_ * z.real_ + z.imag_ * z.imag_; }
template <typename T> __device__ T cudalab_c_real(const cudalab_complex<T>& z) { return z.real_; }
template <typename T> __device__ T cudalab_c_imag(const cudalab_complex<T>& z) { return z.imag_; }
template <typename T> __device__ cudalab_complex<T> cudalab_c_conj(const cudalab_complex<T>& z) { return cudalab_complex<T>(z.real_, -z.imag_); }
template <typename T> __device__ cudalab_complex<T> cudalab_c_exp(const cudalab_complex<T>& z) {
    if (z.imag_ == T(0)) { return cudalab_complex<T>(exp(z.real_), z.imag_); }
    if (isinf(z.real_) && z.real_ < T(0) && !isfinite(z.imag_)) { return cudalab_complex<T>(T(0), T(0)); }  // C99 cexp(-inf + i nan)
    T e = exp(z.real_);
    return cudalab_complex<T>(e * cos(z.imag_), e * sin(z.imag_));
}
template <typename T> __device__ cudalab_complex<T> cudalab_c_log(const cudalab_complex<T>& z) { return cudalab_complex<T>(log(cudalab_c_abs(z)), cudalab_c_arg(z)); }
template <typename T> __device__ cudalab_complex<T> cudalab_c_log10(const cudalab_complex<T>& z) { return cudalab_c_log(z) / log(T(10)); }
template <typename T> __device__ cudalab_complex<T> cudalab_c_sqrt(const cudalab_complex<T>& z) {
    T re = z.real_, im = z.imag_;
    if (re == T(0) && im == T(0)) { return cudalab_complex<T>(T(0), im); }
    T t = sqrt((fabs(re) + cudalab_c_abs(z)) / T(2));
    if (re >= T(0)) { return cudalab_complex<T>(t, im / (T(2) * t)); }
    return cudalab_complex<T>(fabs(im) / (T(2) * t), copysign(t, im));
}
template <typename T> __device__ cudalab_complex<T> cudalab_c_pow(const cudalab_complex<T>& base, const cudalab_complex<T>& exponent) { return cudalab_c_exp(cudalab_c_log(base) * exponent); }
template <typename T> __device__ cudalab_complex<T> cudalab_c_sinh(const cudalab_complex<T>& z) { return cudalab_complex<T>(sinh(z.real_) * cos(z.imag_), cosh(z.real_) * sin(z.imag_)); }
template <typename T> __device__ cudalab_complex<T> cudalab_c_cosh(const cudalab_complex<T>& z) { return cudalab_complex<T>(cosh(z.real_) * cos(z.imag_), sinh(z.real_) * sin(z.imag_)); }
template <typename T> __device__ cudalab_complex<T> cudalab_c_tanh(const cudalab_complex<T>& z) {
    if (fabs(z.real_) > T(20)) { return cudalab_complex<T>(copysign(T(1), z.real_), copysign(T(0), sin(T(2) * z.imag_))); }
    T d = cosh(T(2) * z.real_) + cos(T(2) * z.imag_);
    return cudalab_complex<T>(sinh(T(2) * z.real_) / d, sin(T(2) * z.imag_) / d);
}
template <typename T> __device__ cudalab_complex<T> cudalab_c_sin(const cudalab_complex<T>& z) { cudalab_complex<T> s = cudalab_c_sinh(cudalab_complex<T>(-z.imag_, z.real_)); return cudalab_complex<T>(s.imag_, -s.real_); }
template <typename T> __device__ cudalab_complex<T> cudalab_c_cos(const cudalab_complex<T>& z) { return cudalab_c_cosh(cudalab_complex<T>(-z.imag_, z.real_)); }
template <typename T> __device__ cudalab_complex<T> cudalab_c_tan(const cudalab_complex<T>& z) { cudalab_complex<T> t = cudalab_c_tanh(cudalab_complex<T>(-z.imag_, z.real_)); return cudalab_complex<T>(t.imag_, -t.real_); }
#define CUDALAB_COMPLEX_FN(R, NAME)                                                        \
template <typename T> __device__ R NAME(const cudalab_complex<T>& z) { return cudalab_c_##NAME(z); } \
namespace std { template <typename T> __device__ R NAME(const cudalab_complex<T>& z) { return cudalab_c_##NAME(z); } }
CUDALAB_COMPLEX_FN(T, abs) CUDALAB_COMPLEX_FN(T, arg) CUDALAB_COMPLEX_FN(T, norm) CUDALAB_COMPLEX_FN(T, real)
CUDALAB_COMPLEX_FN(T, imag) CUDALAB_COMPLEX_FN(cudalab_complex<T>, conj) CUDALAB_COMPLEX_FN(cudalab_complex<T>, exp)
CUDALAB_COMPLEX_FN(cudalab_complex<T>, log) CUDALAB_COMPLEX_FN(cudalab_complex<T>, log10)
CUDALAB_COMPLEX_FN(cudalab_complex<T>, sqrt) CUDALAB_COMPLEX_FN(cudalab_complex<T>, sin)
CUDALAB_COMPLEX_FN(cudalab_complex<T>, cos) CUDALAB_COMPLEX_FN(cudalab_complex<T>, tan)
CUDALAB_COMPLEX_FN(cudalab_complex<T>, sinh) CUDALAB_COMPLEX_FN(cudalab_complex<T>, cosh)
CUDALAB_COMPLEX_FN(cudalab_complex<T>, tanh)
#undef CUDALAB_COMPLEX_FN
template <typename T> __device__ cudalab_complex<T> pow(const cudalab_complex<T>& base, const cudalab_complex<T>& exponent) { return cudalab_c_pow(base, exponent); }
template <typename T, typename U> __device__ CUDALAB_IF_REAL(U, cudalab_complex<T>) pow(const cudalab_complex<T>& base, const U& exponent) { return cudalab_c_pow(base, cudalab_complex<T>(static_cast<T>(exponent))); }
template <typename T, typename U> __device__ CUDALAB_IF_REAL(U, cudalab_complex<T>) pow(const U& base, const cudalab_complex<T>& exponent) { return cudalab_c_pow(cudalab_complex<T>(static_cast<T>(base)), exponent); }
namespace std {
template <typename T> __device__ cudalab_complex<T> pow(const cudalab_complex<T>& base, const cudalab_complex<T>& exponent) { return cudalab_c_pow(base, exponent); }
}

// Conversions from complex: torch keeps the real part (to bool: either part nonzero).
template <typename To> struct cudalab_from_complex {
    template <typename U> __device__ static To apply(const cudalab_complex<U>& v) { return static_cast<To>(v.real_); }
};
template <> struct cudalab_from_complex<bool> {
    template <typename U> __device__ static bool apply(const cudalab_complex<U>& v) { return static_cast<bool>(v); }
};
template <typename T> struct cudalab_from_complex<cudalab_complex<T> > {
    template <typename U> __device__ static cudalab_complex<T> apply(const cudalab_complex<U>& v) { return cudalab_complex<T>(v); }
};
template <typename To, typename U> __device__ __forceinline__ To cudalab_cvt(cudalab_complex<U> v) { return cudalab_from_complex<To>::template apply<U>(v); }
"""


def c_type(dtype: np.dtype) -> str:
    """The C++ type holding one element of ``dtype`` in an elementwise kernel.

    Raises
    ------
    TypeError
        A dtype the elementwise kernels have no C++ type for.
    """
    try:
        return _C_TYPES[dtype.name]
    except KeyError:
        raise TypeError(f"cudalab's elementwise kernels do not support dtype {dtype}") from None


# --------------------------------------------------------------------------- code strings
_CODE_RE = re.compile(
    r"\s*template\s*(?P<template_params>\<.+\>)\s*(?P<return_type>\w+)\s+(?P<function_name>\w+)"
    r"\s*(?P<function_params>\(.+\))\s*(?P<function_body>\{.+\})\s*", re.DOTALL)


class ParsedCode:
    """A jiterator code string, split as torch's ``_CodeParser`` does (the last templated
    function is the entry point).

    Attributes: ``code``, ``name``, ``return_type``, ``template_params`` (type parameter
    names), ``params`` (``(name, is_reference, type word)`` per parameter), ``body``.
    """

    def __init__(self, code: str):
        if not isinstance(code, str):
            raise TypeError(f"code_string must be a str, got {type(code).__name__}")
        m = _CODE_RE.match(code)
        if m is None:
            raise Exception("Couldn't parse code, please check correctness:\n " + code)
        self.code = code
        self.name = m.group("function_name")
        self.return_type = m.group("return_type")
        self.template_params = re.findall(r"(?:typename|class)\s+(\w+)", m.group("template_params"))
        params = m.group("function_params")[1:-1].strip()
        self.params: list[tuple[str, bool, str]] = []
        if params:
            for part in params.split(","):
                names = [w for w in re.findall(r"\w+", part) if w != "const"]
                if not names:
                    raise Exception("Couldn't parse code, please check correctness:\n " + code)
                self.params.append((names[-1], "&" in part, names[0]))
        self.body = m.group("function_body")


def parse_code(code: str) -> ParsedCode:
    """:class:`ParsedCode` of ``code`` (torch's error for code it cannot parse)."""
    return ParsedCode(code)



def _kernel_name(base: str, source: str) -> str:
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    return f"{base}_{digest}"


def build_kernel(parsed: ParsedCode, in_dtypes: Sequence[np.dtype | None], common: np.dtype,
                 out_dtypes: Sequence[np.dtype], extra_kinds: Sequence[tuple[str, str]],
                 excluded: frozenset[int], return_by_ref: bool, vec: int, ndim: int | None,
                 *, index64: bool = False, simulated: bool = False,
                 sim: Callable[..., Any] | None = None) -> Kernel:
    """The :class:`Kernel` for one plan (compiled lazily by the facility).

    Parameters
    ----------
    parsed
        The function's code.
    in_dtypes
        Per input: its dtype in memory, or None for a host scalar (a kernel parameter).
    common
        The promoted dtype; the compute type is its opmath type.
    out_dtypes
        The outputs' dtypes.
    extra_kinds
        ``(type code, C type)`` per extra argument.
    excluded
        Input positions not cast to the compute type (passed as their own type).
    return_by_ref
        The function writes its outputs through references.
    vec
        Vector width of a contiguous kernel (1: no vector loads).
    ndim
        None for a contiguous kernel, else the number of merged dimensions.
    index64
        Index with 64-bit integers (needed from 2**31 elements; 32-bit otherwise).
    simulated
        Add the simulator's twin-token parameter (the source is not compiled for the
        launch; the jiterator checks that it compiles).
    sim
        The simulator implementation registered under the kernel's name.

    Returns
    -------
    Kernel
    """
    compute = tp.opmath_dtype(common)
    ct = c_type(compute)
    n_out = len(out_dtypes)
    params = ["long long n"]
    sig = ["i8"]
    strided = ndim is not None
    for k, dt in enumerate(out_dtypes):
        params.append(f"char* out{k}" if strided else f"{c_type(dt)}* out{k}")
        sig.append("p")
    array_inputs = [k for k, dt in enumerate(in_dtypes) if dt is not None]
    for k in array_inputs:
        in_dt = in_dtypes[k]
        assert in_dt is not None
        params.append(f"const char* in{k}" if strided else f"const {c_type(in_dt)}* in{k}")
        sig.append("p")
    n_ops = n_out + len(array_inputs)
    if strided:
        assert ndim is not None
        params += [f"long long size{d}" for d in range(ndim)]
        params += [f"long long st{o}_{d}" for o in range(n_ops) for d in range(ndim)]
        sig += ["i8"] * (ndim + ndim * n_ops)
    scalar_decls: list[str] = []
    for k, maybe in enumerate(in_dtypes):
        if maybe is None:
            code, ctype = _SCALAR_PARAMS[compute.name]
            if compute.kind == "c":  # two parameters: real, imaginary
                params += [f"{ctype} scalar{k}_re", f"{ctype} scalar{k}_im"]
                sig += [code, code]
                scalar_decls.append(f"    const {ct} s{k}(scalar{k}_re, scalar{k}_im);\n")
                continue
            params.append(f"{ctype} scalar{k}")
            sig.append(code)
            scalar_decls.append(f"    const {ct} s{k} = static_cast<{ct}>(scalar{k});\n")
    extra_args = []
    for k, (code, ctype) in enumerate(extra_kinds):
        params.append(f"{ctype} extra{k}")
        sig.append(code)
        extra_args.append(f"(extra{k} != 0)" if (code, ctype) == EXTRA_BOOL else f"extra{k}")
    if simulated:
        sig.append("u8")

    def load(k: int, ref: str) -> str:
        dt = in_dtypes[k]
        if dt is None:
            return f"s{k}"
        if k in excluded:
            return ref
        value = ref if dt == common else f"cudalab_cvt<{c_type(common)}>({ref})"
        return value if common == compute else f"cudalab_cvt<{ct}>({value})"

    def element(refs_in: list[str], refs_out: list[str]) -> str:
        args = [load(k, r) for k, r in enumerate(refs_in)] + extra_args
        if not return_by_ref:
            call = f"{parsed.name}<{ct}>({', '.join(args)})"
            return f"{refs_out[0]} = cudalab_cvt<{c_type(out_dtypes[0])}>({call});"
        temps = [f"t{k}" for k in range(n_out)]
        stores = " ".join(f"{r} = cudalab_cvt<{c_type(out_dtypes[k])}>({temps[k]});"
                          for k, r in enumerate(refs_out))
        return (f"{{ {ct} {', '.join(temps)}; {parsed.name}<{ct}>({', '.join(args + temps)}); "
                f"{stores} }}")

    ix = "long long" if index64 else "unsigned int"  # 32-bit indices compile and run faster
    body = [f"    const {ix} tid = static_cast<{ix}>(blockIdx.x) * blockDim.x + threadIdx.x;\n",
            f"    const {ix} step = static_cast<{ix}>(gridDim.x) * blockDim.x;\n",
            *scalar_decls]
    if not strided:
        start = "0"
        if vec > 1:
            body.append(f"    const {ix} nvec = static_cast<{ix}>(n / {vec});\n")
            body.append(f"    for ({ix} i = tid; i < nvec; i += step) {{\n")
            for k in array_inputs:
                body.append(f"        const cudalab_vec<{c_type(in_dtypes[k])}, {vec}> a{k} = "  # type: ignore[arg-type]
                            f"reinterpret_cast<const cudalab_vec<{c_type(in_dtypes[k])}, {vec}>*>(in{k})[i];\n")  # type: ignore[arg-type]
            for k, dt in enumerate(out_dtypes):
                body.append(f"        cudalab_vec<{c_type(dt)}, {vec}> r{k};\n")
            body.append("        #pragma unroll\n")
            body.append(f"        for (int j = 0; j < {vec}; ++j) {{\n            ")
            body.append(element([f"a{k}.v[j]" for k in range(len(in_dtypes))],
                                [f"r{k}.v[j]" for k in range(n_out)]))
            body.append("\n        }\n")
            for k, dt in enumerate(out_dtypes):
                body.append(f"        reinterpret_cast<cudalab_vec<{c_type(dt)}, {vec}>*>(out{k})[i] = r{k};\n")
            body.append("    }\n")
            start = f"nvec * {vec}"
        body.append(f"    for ({ix} i = {start} + tid; i < n; i += step) {{\n        ")
        body.append(element([f"in{k}[i]" for k in range(len(in_dtypes))],
                            [f"out{k}[i]" for k in range(n_out)]))
        body.append("\n    }\n")
    else:
        assert ndim is not None
        names = [f"out{k}" for k in range(n_out)] + [f"in{k}" for k in array_inputs]
        body.append(f"    for ({ix} i = tid; i < n; i += step) {{\n")
        body.append(f"        {ix} r = i;\n")
        body.append("".join(f"        long long o{o} = 0;\n" for o in range(n_ops)))
        for d in range(ndim - 1, -1, -1):
            if d:
                body.append(f"        {{ const {ix} size = static_cast<{ix}>(size{d}); const {ix} q = r / size; "
                            f"const long long c = r - q * size; r = q;\n")
            else:
                body.append("        { const long long c = r;\n")
            body.append("".join(f"          o{o} += c * st{o}_{d};\n" for o in range(n_ops)))
            body.append("        }\n")
        refs_in = []
        for k, maybe in enumerate(in_dtypes):
            if maybe is None:
                refs_in.append("")
            else:
                o = n_out + array_inputs.index(k)
                refs_in.append(f"*reinterpret_cast<const {c_type(maybe)}*>({names[o]} + o{o})")
        refs_out = [f"*reinterpret_cast<{c_type(dt)}*>(out{k} + o{k})" for k, dt in enumerate(out_dtypes)]
        body.append("        " + element(refs_in, refs_out) + "\n    }\n")
    kind = (f"v{vec}" if not strided else f"s{ndim}") + ("_i64" if index64 else "")
    complex_types = any(dt is not None and dt.kind == "c" for dt in (*in_dtypes, common, *out_dtypes))
    preamble = PREAMBLE + COMPLEX_PREAMBLE if complex_types else PREAMBLE
    head = f'{preamble}\n#line 1 "jiterator_code"\n{parsed.code}\n#line 1 "cudalab_elementwise"\n'
    kernel_text = (f'extern "C" __global__ void @NAME@({", ".join(params)})\n{{\n'
                   + "".join(body) + "}\n")
    name = _kernel_name(f"{parsed.name}_{kind}", head + kernel_text)
    kernel = Kernel(name, head + kernel_text.replace("@NAME@", name), sig, options=OPTIONS, sim=sim)
    unregister_kernel(kernel)  # generated per call shape: not one of cudalab's fixed kernels
    return kernel
