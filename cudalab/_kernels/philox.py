"""Philox4x32-10 random kernels that reproduce ``torch.cuda``'s generator bit for bit.

torch (``ATen/native/cuda/DistributionTemplates.h``) launches ``G`` blocks of 256 threads,
``G = min(ceil(n / 256), SMs * (maxThreadsPerSM // 256))``, ``S = 256 * G`` threads in all.
Thread ``t`` runs ``curand_init(seed, subsequence=t, offset)`` and, in its ``k``-th
grid-stride iteration, draws one ``curand4`` (Philox4x32-10 of the counter
``(offset / 4 + k, t)`` under the key ``seed``) that yields ``U`` values: element
``k * U * S + ii * S + t`` gets value ``ii`` (``U = 4`` for float, half and bfloat16,
``U = 2`` for double and 64-bit integers). Each call advances the generator's offset by
``4 * K``, ``K = (n - 1) // (U * S) + 1``.

The kernels here give every element that same value but are laid out for speed: a thread
owns ``TPT`` (4; ``-DCL_TPT=1|2|4`` changes it) adjacent torch threads ``t0..t0+TPT-1`` for
one ``k`` (``blockIdx.y``, grid-stride), runs their Philox blocks side by side
(instruction-level parallelism) and writes each ``ii`` row with one vector store. The float math keeps curand's and torch's expression
shapes (so NVRTC contracts the same multiply-adds into FMAs as nvcc does for torch):
``x * 2^-32 + 2^-33`` for uint32 -> float, ``rand * range + from`` (uniform),
``rand * std + mean`` (normal), Box-Muller with ``logf``, ``sqrtf`` and ``__sincosf`` (float)
or ``log``, ``sqrt`` and ``sincospi`` (double), exactly as in curand's headers.

Kernel parameters, in order: ``out, n, S, K, seed, offset, gstate`` and the distribution's
parameters. ``gstate`` is 0 outside CUDA graph capture; inside it points at two uint64
words in device memory (seed, base offset) written before each replay, and ``offset`` is
then the offset inside the graph (torch's ``PhiloxCudaState`` for captured kernels).

The numpy side is the reference: :func:`philox4x32` (vectorised; checked against the
Random123 known-answer vectors), :func:`philox_blocks` (torch's counter layout) and
:func:`reference` (the values one kernel writes). It is also the simulator's implementation.
Uniform bits and everything computed from them without transcendental functions (uniform
floats and doubles, bernoulli, randint, the Box-Muller angle) are bit-identical to the GPU;
``randn``'s ``log``/``sin``/``cos`` come from numpy, so simulated normals agree with the GPU
to a few float ulps, not bit for bit (``__sincosf`` is a hardware approximation).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cudalab._kernels.kernel import Kernel, unregister_kernel

__all__ = [
    "M0", "M1", "W0", "W1",
    "philox4x32", "philox_blocks", "key_schedule", "reference", "uniform_float",
    "uniform_double_hq", "fma_f32", "fma_f64", "float_to_bfloat16_bits",
    "KERNELS", "SET_STATE", "SOURCES", "OPS", "TPT", "unroll", "variant",
]

#: Philox4x32 multipliers and Weyl key increments (Random123, curand).
M0 = 0xD2511F53
M1 = 0xCD9E8D57
W0 = 0x9E3779B9
W1 = 0xBB67AE85
_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF

_U32 = np.uint32
_U64 = np.uint64
_F32 = np.float32
_F64 = np.float64


# --------------------------------------------------------------------------- Philox (numpy)
def key_schedule(seed: int, rounds: int = 10) -> list[tuple[int, int]]:
    """The (k0, k1) round keys for ``seed`` (key = seed's low and high 32-bit words)."""
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    out = []
    for r in range(rounds):
        out.append(((k0 + r * W0) & _MASK32, (k1 + r * W1) & _MASK32))
    return out


def philox4x32(c0, c1, c2, c3, k0: int, k1: int, rounds: int = 10):
    """Philox4x32-``rounds`` of the counters ``(c0, c1, c2, c3)`` (uint32 arrays that
    broadcast together) under the key ``(k0, k1)``; returns four uint32 arrays."""
    c0 = np.asarray(c0, dtype=_U32)
    c1 = np.asarray(c1, dtype=_U32)
    c2 = np.asarray(c2, dtype=_U32)
    c3 = np.asarray(c3, dtype=_U32)
    m0 = _U64(M0)
    m1 = _U64(M1)
    shift = _U64(32)
    for ka, kb in key_schedule(((k1 & _MASK32) << 32) | (k0 & _MASK32), rounds):
        p0 = c0.astype(_U64) * m0
        p1 = c2.astype(_U64) * m1
        hi0 = (p0 >> shift).astype(_U32)
        hi1 = (p1 >> shift).astype(_U32)
        c0, c1, c2, c3 = (hi1 ^ c1 ^ _U32(ka), p1.astype(_U32), hi0 ^ c3 ^ _U32(kb),
                          p0.astype(_U32))
    return c0, c1, c2, c3


def philox_blocks(seed: int, offset: int, S: int, K: int) -> np.ndarray:
    """The words torch's thread ``t`` draws in its ``k``-th ``curand4`` call, as a
    ``(K, S, 4)`` uint32 array: Philox4x32-10 of the counter ``(offset // 4 + k, t)``
    (64-bit halves: low words x, y; subsequence z, w) under the key ``seed``."""
    seed &= _MASK64
    ctr = _U64((offset & _MASK64) >> 2) + np.arange(K, dtype=_U64)  # wraps like the GPU
    c0 = (ctr & _U64(_MASK32)).astype(_U32)[:, None]
    c1 = (ctr >> _U64(32)).astype(_U32)[:, None]
    c2 = np.arange(S, dtype=_U32)[None, :]
    c3 = np.zeros((1, 1), dtype=_U32)
    x = philox4x32(c0, c1, c2, c3, seed & _MASK32, seed >> 32)
    return np.stack(np.broadcast_arrays(*x), axis=-1)


# --------------------------------------------------------------------------- float helpers
_INV32 = _F32(2.0 ** -32)                    # CURAND_2POW32_INV (2.3283064e-10f == 2^-32)
_INV32_HALF = _F32(2.0 ** -33)
_INV32_2PI = _F32(_F32(2.3283064e-10) * _F32(6.2831855))  # CURAND_2POW32_INV_2PI
_INV32_2PI_HALF = _F32(_INV32_2PI / _F32(2))
_INV53 = 2.0 ** -53                          # CURAND_2POW53_INV_DOUBLE


def uniform_float(x: np.ndarray) -> np.ndarray:
    """curand's uint32 -> float in (0, 1]: ``x * 2^-32 + 2^-33`` (one rounding, like the FMA)."""
    return x.astype(_F32) * _INV32 + _INV32_HALF


def uniform_double_hq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """curand's ``_curand_uniform_double_hq``: 53 bits from two words, in (0, 1]."""
    z = x.astype(_U64) ^ (y.astype(_U64) << _U64(21))
    return z.astype(_F64) * _INV53 + _INV53 / 2


def _round_to_odd_sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a + b`` in float64 rounded to odd (exact sums unchanged)."""
    s = a + b
    bb = s - a
    err = (a - (s - bb)) + (b - bb)
    bits = s.view(np.int64)
    fix = (err != 0) & ((bits & 1) == 0)
    if fix.any():
        up = (err > 0) == (s > 0)  # the exact sum is farther from zero than s
        bits = np.where(fix, np.where(up, bits + 1, bits - 1), bits)
        s = bits.view(_F64)
    return s


def fma_f32(a, b, c) -> np.ndarray:
    """Correctly rounded float32 ``a * b + c`` (the GPU's FFMA), through float64 and
    rounding to odd (exact: the product of two floats fits in a double)."""
    a = np.asarray(a, _F32).astype(_F64)
    b = np.asarray(b, _F32).astype(_F64)
    c = np.asarray(c, _F32).astype(_F64)
    p, c = np.broadcast_arrays(a * b, c)
    return _round_to_odd_sum(np.ascontiguousarray(p), np.ascontiguousarray(c)).astype(_F32)


def _split(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = a * 134217729.0  # 2^27 + 1 (Veltkamp)
    hi = t - (t - a)
    return hi, a - hi


def fma_f64(a, b, c) -> np.ndarray:
    """Correctly rounded float64 ``a * b + c`` (the GPU's DFMA) for finite, non-extreme
    values: exact product (Dekker), exact sum, the low parts rounded to odd (Boldo and
    Melquiond's emulation)."""
    a, b, c = np.broadcast_arrays(np.asarray(a, _F64), np.asarray(b, _F64), np.asarray(c, _F64))
    uh = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    ul = ((ah * bh - uh) + ah * bl + al * bh) + al * bl
    th = c + uh
    bb = th - c
    tl = (c - (th - bb)) + (uh - bb)
    v = _round_to_odd_sum(np.ascontiguousarray(tl), np.ascontiguousarray(ul))
    return th + v


def float_to_bfloat16_bits(f: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (c10::BFloat16, ``cvt.rn.bf16.f32``)."""
    f = np.asarray(f, _F32)
    b = f.view(_U32)
    r = ((b + _U32(0x7FFF) + ((b >> _U32(16)) & _U32(1))) >> _U32(16)).astype(np.uint16)
    return np.where(np.isnan(f), np.uint16(0x7FC0), r).astype(np.uint16)


def bfloat16_bits_to_float(h: np.ndarray) -> np.ndarray:
    return (h.astype(_U32) << _U32(16)).view(_F32)


def _sincospi(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sin(pi v), cos(pi v) with an exact quarter-period reduction (approximates CUDA's
    sincospi to an ulp or so)."""
    q = np.rint(v * 2.0)
    r = v - q * 0.5
    a = np.pi * r
    s, c = np.sin(a), np.cos(a)
    qi = q.astype(np.int64) & 3
    sin = np.choose(qi, [s, c, -s, -c])
    cos = np.choose(qi, [c, -s, -c, s])
    return sin, cos


def _box_muller_f32(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    u = uniform_float(x)
    v = fma_f32(y.astype(_F32), _INV32_2PI, _INV32_2PI_HALF)  # bit-exact, like the GPU
    lg = np.log(u.astype(_F64)).astype(_F32)                  # logf: ~correctly rounded
    s = np.sqrt(_F32(-2.0) * lg)                               # sqrtf: exact
    vd = v.astype(_F64)
    return np.sin(vd).astype(_F32) * s, np.cos(vd).astype(_F32) * s  # __sincosf: approx.


def _box_muller_f64(x0, x1, y0, y1) -> tuple[np.ndarray, np.ndarray]:
    u = uniform_double_hq(x0, x1)
    zy = y0.astype(_U64) ^ (y1.astype(_U64) << _U64(21))
    v = zy.astype(_F64) * (_INV53 * 2.0) + _INV53
    s = np.sqrt(-2.0 * np.log(u))
    sin, cos = _sincospi(v)
    return sin * s, cos * s


# --------------------------------------------------------------------------- the kernels
_HEADER = r"""
typedef unsigned int cl_u32;
typedef unsigned long long cl_u64;
typedef unsigned short cl_u16;
typedef unsigned char cl_u8;

#define CL_2POW32_INV (2.3283064e-10f)
#define CL_2POW32_INV_2PI (2.3283064e-10f * 6.2831855f)
#define CL_2POW53_INV_DOUBLE (1.1102230246251565e-16)

// Philox4x32-10 (Random123 / curand_Philox4x32_10): 10 rounds, key bumped between rounds.
__device__ __forceinline__ uint4 cl_philox(cl_u32 c0, cl_u32 c1, cl_u32 c2, cl_u32 c3,
                                           cl_u32 k0, cl_u32 k1)
{
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const cl_u32 lo0 = 0xD2511F53u * c0;
        const cl_u32 hi0 = __umulhi(0xD2511F53u, c0);
        const cl_u32 lo1 = 0xCD9E8D57u * c2;
        const cl_u32 hi1 = __umulhi(0xCD9E8D57u, c2);
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    return make_uint4(c0, c1, c2, c3);
}

// ----------------------------------------------------------------- element conversions
struct ClF32 {
    typedef float T;
    static __device__ __forceinline__ float from_f(float x) { return x; }
    static __device__ __forceinline__ float to_f(float x) { return x; }
};
struct ClF16 {  // c10::Half(float): round to nearest even
    typedef cl_u16 T;
    static __device__ __forceinline__ cl_u16 from_f(float x)
    {
        cl_u16 h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
        return h;
    }
    static __device__ __forceinline__ float to_f(cl_u16 h)
    {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
    }
};
struct ClBF16 {  // c10::BFloat16(float): round to nearest even
    typedef cl_u16 T;
    static __device__ __forceinline__ cl_u16 from_f(float x)
    {
#if __CUDA_ARCH__ >= 800
        cl_u16 h;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
        return h;
#else
        const cl_u32 b = __float_as_uint(x);
        if (x != x) return 0x7FC0;
        return (cl_u16)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
#endif
    }
    static __device__ __forceinline__ float to_f(cl_u16 h) { return __uint_as_float((cl_u32)h << 16); }
};

// ----------------------------------------------------------------- curand's transforms
__device__ __forceinline__ float2 cl_box_muller(cl_u32 x, cl_u32 y)  // _curand_box_muller
{
    float2 result;
    float u = x * CL_2POW32_INV + (CL_2POW32_INV / 2);
    float v = y * CL_2POW32_INV_2PI + (CL_2POW32_INV_2PI / 2);
    float s = sqrtf(-2.0f * logf(u));
    __sincosf(v, &result.x, &result.y);
    result.x *= s;
    result.y *= s;
    return result;
}

__device__ __forceinline__ double cl_uniform_double_hq(cl_u32 x, cl_u32 y)
{
    cl_u64 z = (cl_u64)x ^ ((cl_u64)y << (53 - 32));
    return z * CL_2POW53_INV_DOUBLE + (CL_2POW53_INV_DOUBLE / 2.0);
}

__device__ __forceinline__ double2 cl_box_muller_double(cl_u32 x0, cl_u32 x1, cl_u32 y0, cl_u32 y1)
{
    double2 result;
    cl_u64 zx = (cl_u64)x0 ^ ((cl_u64)x1 << (53 - 32));
    double u = zx * CL_2POW53_INV_DOUBLE + (CL_2POW53_INV_DOUBLE / 2.0);
    cl_u64 zy = (cl_u64)y0 ^ ((cl_u64)y1 << (53 - 32));
    double v = zy * (CL_2POW53_INV_DOUBLE * 2.0) + CL_2POW53_INV_DOUBLE;
    double s = sqrt(-2.0 * log(u));
    sincospi(v, &result.x, &result.y);
    result.x *= s;
    result.y *= s;
    return result;
}

// ----------------------------------------------------------------- torch's distributions
template <class C> struct ClUniform {  // uniform_kernel: float, half, bfloat16
    typedef typename C::T T;
    enum { U = 4 };
    float range, from, to;
    __device__ __forceinline__ void operator()(const uint4& r, T (&o)[4]) const
    {
        const cl_u32 x[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float rand = x[i] * CL_2POW32_INV + (CL_2POW32_INV / 2.0f);
            const T value = C::from_f(rand * range + from);
            o[i] = (C::to_f(value) == to) ? C::from_f(from) : value;
        }
    }
};

struct ClUniformD {  // uniform_kernel: double
    typedef double T;
    enum { U = 2 };
    double range, from, to;
    __device__ __forceinline__ double f(double rand) const
    {
        const double value = rand * range + from;
        return value == to ? from : value;
    }
    __device__ __forceinline__ void operator()(const uint4& r, double (&o)[2]) const
    {
        o[0] = f(cl_uniform_double_hq(r.x, r.y));
        o[1] = f(cl_uniform_double_hq(r.z, r.w));
    }
};

template <class C> struct ClNormal {  // normal_kernel: float, half, bfloat16
    typedef typename C::T T;
    enum { U = 4 };
    float std, mean;
    __device__ __forceinline__ void operator()(const uint4& r, T (&o)[4]) const
    {
        const float2 a = cl_box_muller(r.x, r.y);
        const float2 b = cl_box_muller(r.z, r.w);
        o[0] = C::from_f(a.x * std + mean);
        o[1] = C::from_f(a.y * std + mean);
        o[2] = C::from_f(b.x * std + mean);
        o[3] = C::from_f(b.y * std + mean);
    }
};

struct ClNormalD {  // normal_kernel: double
    typedef double T;
    enum { U = 2 };
    double std, mean;
    __device__ __forceinline__ void operator()(const uint4& r, double (&o)[2]) const
    {
        const double2 a = cl_box_muller_double(r.x, r.y, r.z, r.w);
        o[0] = a.x * std + mean;
        o[1] = a.y * std + mean;
    }
};

template <typename W> struct ClBernoulli {  // bernoulli_(float p): every dtype but double
    typedef W T;
    enum { U = 4 };
    float p;
    W one;
    __device__ __forceinline__ void operator()(const uint4& r, W (&o)[4]) const
    {
        const cl_u32 x[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float rand = x[i] * CL_2POW32_INV + (CL_2POW32_INV / 2.0f);
            o[i] = (rand < p) ? one : (W)0;
        }
    }
};

struct ClBernoulliD {  // bernoulli_(float p): double
    typedef cl_u64 T;
    enum { U = 2 };
    double p;
    cl_u64 one;
    __device__ __forceinline__ void operator()(const uint4& r, cl_u64 (&o)[2]) const
    {
        o[0] = (cl_uniform_double_hq(r.x, r.y) < p) ? one : 0ull;
        o[1] = (cl_uniform_double_hq(r.z, r.w) < p) ? one : 0ull;
    }
};

template <typename W> struct ClRandint32 {  // random_from_to, range < 2^28
    typedef W T;
    enum { U = 4 };
    cl_u64 range, base;
    __device__ __forceinline__ void operator()(const uint4& r, W (&o)[4]) const
    {
        const cl_u32 x[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) o[i] = (W)((cl_u64)x[i] % range + base);
    }
};

template <typename W> struct ClRandint64 {  // random_from_to, range >= 2^28
    typedef W T;
    enum { U = 2 };
    cl_u64 range, base;
    __device__ __forceinline__ void operator()(const uint4& r, W (&o)[2]) const
    {
        o[0] = (W)((((cl_u64)r.x << 32) | r.y) % range + base);
        o[1] = (W)((((cl_u64)r.z << 32) | r.w) % range + base);
    }
};

// ----------------------------------------------------------------- the launch layout
// CL_TPT: torch threads per CUDA thread (1, 2 or 4): that many Philox blocks run side by
// side and each row of CL_TPT adjacent elements is written with one vector store.
#ifndef CL_TPT
#define CL_TPT 4
#endif

template <typename T, int N> struct alignas(N * sizeof(T)) ClVec {
    T v[N];
};

// Thread (x, y): torch threads t0 .. t0 + CL_TPT - 1 (t0 = CL_TPT * global x) in their
// grid-stride iterations k = blockIdx.y, blockIdx.y + gridDim.y, ... < K. Element
// k * U * S + ii * S + t gets value ii of torch thread t's k-th Philox block.
template <class D>
__device__ __forceinline__ void cl_rng_body(typename D::T* __restrict__ out, cl_u64 n,
                                            cl_u32 S, cl_u32 K, cl_u64 seed, cl_u64 offset,
                                            const cl_u64* __restrict__ gstate, const D& dist)
{
    typedef typename D::T T;
    typedef ClVec<T, CL_TPT> V;
    const int U = D::U;
    const cl_u32 t0 = (blockIdx.x * blockDim.x + threadIdx.x) * CL_TPT;
    if (t0 >= S) return;  // S is a multiple of 256, so t0 + CL_TPT - 1 < S too
    if (gstate != nullptr) {  // captured in a CUDA graph: seed and base offset from memory
        seed = gstate[0];
        offset += gstate[1];
    }
    const cl_u64 ctr0 = offset >> 2;
    const cl_u32 k0 = (cl_u32)seed;
    const cl_u32 k1 = (cl_u32)(seed >> 32);
    const bool vec = (reinterpret_cast<size_t>(out) & (sizeof(V) - 1)) == 0;
    for (cl_u32 k = blockIdx.y; k < K; k += gridDim.y) {
        const cl_u64 c = ctr0 + k;
        T v[CL_TPT][U];
#pragma unroll
        for (int j = 0; j < CL_TPT; ++j) {
            dist(cl_philox((cl_u32)c, (cl_u32)(c >> 32), t0 + j, 0u, k0, k1), v[j]);
        }
        const cl_u64 base = (cl_u64)k * U * S + t0;
        if (vec && base + (cl_u64)(U - 1) * S + (CL_TPT - 1) < n) {
#pragma unroll
            for (int ii = 0; ii < U; ++ii) {
                V w;
#pragma unroll
                for (int j = 0; j < CL_TPT; ++j) w.v[j] = v[j][ii];
                *reinterpret_cast<V*>(out + base + (cl_u64)ii * S) = w;
            }
        } else {
#pragma unroll
            for (int ii = 0; ii < U; ++ii) {
#pragma unroll
                for (int j = 0; j < CL_TPT; ++j) {
                    const cl_u64 e = base + (cl_u64)ii * S + j;
                    if (e < n) out[e] = v[j][ii];
                }
            }
        }
    }
}

#define CL_RNG_PARAMS(T) T* __restrict__ out, cl_u64 n, cl_u32 S, cl_u32 K, cl_u64 seed, \
    cl_u64 offset, const cl_u64* __restrict__ gstate
#define CL_RNG_BODY(DIST, ...) { DIST d = {__VA_ARGS__}; cl_rng_body(out, n, S, K, seed, offset, gstate, d); }
"""

SET_STATE_SOURCE = r"""
extern "C" __global__ void cudalab_philox_set_state(unsigned long long* gstate,
                                                    unsigned long long seed,
                                                    unsigned long long offset)
{
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        gstate[0] = seed;
        gstate[1] = offset;
    }
}
"""

_LAUNCH_BOUNDS = "__launch_bounds__(256, 4)"

# (kernel name suffix, C element type, distribution type, parameter declarations,
#  initialiser list, extra signature codes)
_ENTRIES = (
    ("uniform_f32", "float", "ClUniform<ClF32>", "float range, float from, float to",
     "range, from, to", ("f4", "f4", "f4")),
    ("uniform_f16", "cl_u16", "ClUniform<ClF16>", "float range, float from, float to",
     "range, from, to", ("f4", "f4", "f4")),
    ("uniform_bf16", "cl_u16", "ClUniform<ClBF16>", "float range, float from, float to",
     "range, from, to", ("f4", "f4", "f4")),
    ("uniform_f64", "double", "ClUniformD", "double range, double from, double to",
     "range, from, to", ("f8", "f8", "f8")),
    ("normal_f32", "float", "ClNormal<ClF32>", "float std, float mean", "std, mean",
     ("f4", "f4")),
    ("normal_f16", "cl_u16", "ClNormal<ClF16>", "float std, float mean", "std, mean",
     ("f4", "f4")),
    ("normal_bf16", "cl_u16", "ClNormal<ClBF16>", "float std, float mean", "std, mean",
     ("f4", "f4")),
    ("normal_f64", "double", "ClNormalD", "double std, double mean", "std, mean",
     ("f8", "f8")),
    ("bernoulli_u8", "cl_u8", "ClBernoulli<cl_u8>", "float p, cl_u64 one", "p, (cl_u8)one",
     ("f4", "u8")),
    ("bernoulli_u16", "cl_u16", "ClBernoulli<cl_u16>", "float p, cl_u64 one",
     "p, (cl_u16)one", ("f4", "u8")),
    ("bernoulli_u32", "cl_u32", "ClBernoulli<cl_u32>", "float p, cl_u64 one",
     "p, (cl_u32)one", ("f4", "u8")),
    ("bernoulli_u64", "cl_u64", "ClBernoulli<cl_u64>", "float p, cl_u64 one", "p, one",
     ("f4", "u8")),
    ("bernoulli_f64", "cl_u64", "ClBernoulliD", "double p, cl_u64 one", "p, one",
     ("f8", "u8")),
    ("randint32_u8", "cl_u8", "ClRandint32<cl_u8>", "cl_u64 range, cl_u64 base_",
     "range, base_", ("u8", "u8")),
    ("randint32_u16", "cl_u16", "ClRandint32<cl_u16>", "cl_u64 range, cl_u64 base_",
     "range, base_", ("u8", "u8")),
    ("randint32_u32", "cl_u32", "ClRandint32<cl_u32>", "cl_u64 range, cl_u64 base_",
     "range, base_", ("u8", "u8")),
    ("randint32_u64", "cl_u64", "ClRandint32<cl_u64>", "cl_u64 range, cl_u64 base_",
     "range, base_", ("u8", "u8")),
    ("randint64_u32", "cl_u32", "ClRandint64<cl_u32>", "cl_u64 range, cl_u64 base_",
     "range, base_", ("u8", "u8")),
    ("randint64_u64", "cl_u64", "ClRandint64<cl_u64>", "cl_u64 range, cl_u64 base_",
     "range, base_", ("u8", "u8")),
)

#: CUDA source of each kernel by suffix: the shared header plus one entry point (a source
#: per kernel keeps the first use of one distribution to a short NVRTC compile).
SOURCES: dict[str, str] = {
    suffix: _HEADER + (
        f'\nextern "C" __global__ void {_LAUNCH_BOUNDS} cudalab_rng_{suffix}'
        f"(CL_RNG_PARAMS({ctype}), {params})\nCL_RNG_BODY({dist}, {init})\n"
    )
    for suffix, ctype, dist, params, init, _ in _ENTRIES
}

_COMMON_SIGNATURE = ("p", "u8", "u4", "u4", "u8", "u8", "p")
#: The sanitizer's view of those: the output is written, the graph-state words are read.
_COMMON_ACCESS = ("w", "", "", "", "", "", "r")
#: Torch threads per CUDA thread in :data:`KERNELS` (CL_TPT's default).
TPT = 4


# --------------------------------------------------------------------------- reference
def _family(suffix: str) -> tuple[str, str]:
    op, _, tag = suffix.partition("_")
    return op, tag


def unroll(suffix: str) -> int:
    """Values per Philox block for kernel ``cudalab_rng_<suffix>``: 2 for double and for
    64-bit integers, else 4 (torch's unroll factor)."""
    op, tag = _family(suffix)
    return 2 if (tag == "f64" or op == "randint64") else 4


def _values(op: str, tag: str, words: np.ndarray, params: tuple) -> tuple[np.ndarray, np.dtype]:
    """Per-block values ``(K, S, U)`` (storage dtype) from the ``(K, S, 4)`` words."""
    # The parameters' numpy scalar type depends on the family (float32, float or uint64).
    rng: Any
    frm: Any
    to: Any
    std: Any
    mean: Any
    dt: np.dtype
    x, y, z, w = (words[..., i] for i in range(4))
    if op == "uniform" and tag != "f64":
        rng, frm, to = (_F32(p) for p in params)
        u = uniform_float(words)
        if rng == _F32(1) and frm == _F32(0):
            val = u  # rand(): u * 1 + 0 is exact
        else:
            val = fma_f32(u, rng, frm).reshape(u.shape)
        if tag == "f32":
            return np.where(val == to, frm, val).astype(_F32), np.dtype(_F32)
        if tag == "f16":
            h = val.astype(np.float16)
            out = np.where(h.astype(_F32) == to, np.float16(frm), h)
            return out.view(np.uint16), np.dtype(np.uint16)
        bits = float_to_bfloat16_bits(val)
        from_bits = float_to_bfloat16_bits(np.array([frm], _F32))[0]
        out = np.where(bfloat16_bits_to_float(bits) == to, from_bits, bits)
        return out.astype(np.uint16), np.dtype(np.uint16)
    if op == "uniform":  # double
        rng, frm, to = (float(p) for p in params)
        u = np.stack([uniform_double_hq(x, y), uniform_double_hq(z, w)], axis=-1)
        val = u if (rng == 1.0 and frm == 0.0) else fma_f64(u, rng, frm)
        return np.where(val == to, frm, val), np.dtype(_F64)
    if op == "normal" and tag != "f64":
        std, mean = _F32(params[0]), _F32(params[1])
        a0, a1 = _box_muller_f32(x, y)
        b0, b1 = _box_muller_f32(z, w)
        r = np.stack([a0, a1, b0, b1], axis=-1)
        val = r if (std == _F32(1) and mean == _F32(0)) else fma_f32(r, std, mean).reshape(r.shape)
        if tag == "f32":
            return val.astype(_F32), np.dtype(_F32)
        if tag == "f16":
            return val.astype(np.float16).view(np.uint16), np.dtype(np.uint16)
        return float_to_bfloat16_bits(val), np.dtype(np.uint16)
    if op == "normal":  # double
        std, mean = float(params[0]), float(params[1])
        a0, a1 = _box_muller_f64(x, y, z, w)
        r = np.stack([a0, a1], axis=-1)
        val = r if (std == 1.0 and mean == 0.0) else fma_f64(r, std, mean)
        return val, np.dtype(_F64)
    if op == "bernoulli":
        one = int(params[1])
        if tag == "f64":
            u = np.stack([uniform_double_hq(x, y), uniform_double_hq(z, w)], axis=-1)
            hit = u < float(params[0])
            dt = np.dtype(np.uint64)
        else:
            hit = uniform_float(words) < _F32(params[0])
            dt = np.dtype({"u8": np.uint8, "u16": np.uint16, "u32": np.uint32,
                           "u64": np.uint64}[tag])
        return np.where(hit, dt.type(one), dt.type(0)).astype(dt), dt
    if op in ("randint32", "randint64"):
        rng, base = _U64(int(params[0]) & _MASK64), _U64(int(params[1]) & _MASK64)
        dt = np.dtype({"u8": np.uint8, "u16": np.uint16, "u32": np.uint32, "u64": np.uint64}[tag])
        if op == "randint32":
            v = words.astype(_U64)
        else:
            v = np.stack([(x.astype(_U64) << _U64(32)) | y.astype(_U64),
                          (z.astype(_U64) << _U64(32)) | w.astype(_U64)], axis=-1)
        return ((v % rng) + base).astype(dt), dt  # astype truncates like the C++ cast
    raise ValueError(f"unknown random kernel family {op!r}")


def reference(suffix: str, n: int, seed: int, offset: int, S: int, params: tuple,
              K: int | None = None) -> np.ndarray:
    """The ``n`` values kernel ``cudalab_rng_<suffix>`` writes (storage dtype: float32,
    float64, or unsigned ints holding half/bfloat16/integer bits) for ``seed``, ``offset``,
    ``S`` torch threads and distribution ``params``. ``K`` defaults to torch's."""
    op, tag = _family(suffix)
    U = unroll(suffix)
    if n <= 0:
        return np.zeros(0, np.uint8)
    need = (n - 1) // (U * S) + 1
    K = need if K is None else min(K, need)
    words = philox_blocks(seed, offset, S, K)
    vals, dt = _values(op, tag, words, params)
    flat = np.ascontiguousarray(vals.transpose(0, 2, 1)).reshape(-1)
    return flat[:n].astype(dt, copy=False)


_STORAGE = {"f32": np.float32, "f64": np.float64, "f16": np.uint16, "bf16": np.uint16,
            "u8": np.uint8, "u16": np.uint16, "u32": np.uint32, "u64": np.uint64}


def _make_sim(suffix: str):
    op, tag = _family(suffix)
    storage = np.dtype(np.uint64 if (op == "bernoulli" and tag == "f64") else _STORAGE[tag])

    def impl(sim, grid, block, shared_mem, out, n, S, K, seed, offset, gstate, *params):
        if n == 0 or K == 0:
            return
        if gstate:
            st = sim.array(gstate, np.uint64, 2)
            seed = int(st[0])
            offset = (offset + int(st[1])) & _MASK64
        vals = reference(suffix, n, seed, offset, S, params, K=K)
        sim.array(out, storage, vals.size)[...] = vals

    impl.__name__ = f"sim_cudalab_rng_{suffix}"
    return impl


def _sim_set_state(sim, grid, block, shared_mem, gstate, seed, offset):
    sim.array(gstate, np.uint64, 2)[...] = (seed, offset)


#: Kernels by suffix ("uniform_f32", "normal_bf16", "randint64_u64", ...).
KERNELS: dict[str, Kernel] = {
    suffix: Kernel(f"cudalab_rng_{suffix}", SOURCES[suffix], _COMMON_SIGNATURE + extra,
                   sim=_make_sim(suffix), access=_COMMON_ACCESS + ("",) * len(extra))
    for suffix, _c, _d, _p, _i, extra in _ENTRIES
}

#: ``cudalab_philox_set_state(gstate, seed, offset)``: one thread writes the two words.
SET_STATE = Kernel("cudalab_philox_set_state", SET_STATE_SOURCE, ("p", "u8", "u8"),
                   sim=_sim_set_state, access=("w", "", ""))

#: Kernel families (suffix prefixes).
OPS = ("uniform", "normal", "bernoulli", "randint32", "randint64")


def variant(suffix: str, tpt: int, prefix: str = "cudalab_rngv") -> Kernel:
    """An unregistered copy of kernel ``suffix`` with ``tpt`` torch threads per CUDA thread
    (for benchmarks: launch it with ``cudalab.random.launch._set_launch_tuning(tpt=tpt)``). It is
    kept out of the registry of the runtime's kernels."""
    if tpt not in (1, 2, 4):
        raise ValueError("tpt must be 1, 2 or 4")
    name = f"{prefix}_{suffix}_t{tpt}"
    src = SOURCES[suffix].replace(f"cudalab_rng_{suffix}(", f"{name}(")
    k = Kernel(name, src, KERNELS[suffix].signature, options=(f"-DCL_TPT={tpt}",),
               sim=KERNELS[suffix].sim,
               access=_COMMON_ACCESS + ("",) * (len(KERNELS[suffix].signature) - 7))
    unregister_kernel(k)  # not one of the runtime's kernels (CI compiles those)
    return k
