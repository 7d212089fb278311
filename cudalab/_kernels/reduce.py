"""``cudalab_reduce_<op>_<in>_<acc>_<out>``: block reductions over strided inputs.

One kernel shape serves :meth:`DeviceArray.sum`, ``mean``, ``max``, ``min``, ``amax`` and
``amin``. The problem is ``n_out`` output elements, each reducing ``n_red`` input elements;
the input element of (output ``o``, reduced ``r``) sits at ``in[offset(o) + offset(r)]``,
both offsets (in elements, may be negative) decomposed over at most :data:`MAX_DIMS`
(size, stride) pairs, innermost last. So any strided or transposed input is read in place.

* ``splits == 0``: each thread reduces whole outputs by itself (many outputs of few
  elements, or outputs adjacent in memory, whose reads then coalesce across threads).
* Otherwise each block reduces one (output, part) pair: ``splits`` parts of ``ceil(n_red / splits)``
  reduced elements each (a grid-stride loop over ``n_out * splits`` blocks). Its threads
  accumulate, then combine through shared memory; thread 0 writes ``out[b]`` (contiguous).
  With ``splits > 1`` the caller runs a second pass over the ``(n_out, splits)`` partials.
* ``sum`` accumulates in int64 (bool and integers), float32 (float16, bfloat16, float32) or
  float64, as torch does; ``mean`` is ``sum * factor`` with ``factor = 1 / n`` in the
  accumulation type (torch's MeanOps), so an empty mean is ``0 * inf = nan``.
* ``max``/``min`` propagate NaN and keep the index of the first extreme element (the
  first NaN, when there is one), read from ``in_idx`` when given (a second pass), else
  the reduced index ``r``; ``out_idx`` (int64) receives it when not 0.
* float16 and bfloat16 are read and written as 16-bit patterns (PTX conversions, as the
  Philox kernels do), so NVRTC needs no CUDA headers.

Each kernel has a numpy twin for the simulator (same arguments, same partial layout).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cudalab._kernels.kernel import Kernel

__all__ = [
    "BLOCK",
    "KERNELS",
    "MAX_DIMS",
    "OPS",
    "acc_code",
    "coalesce",
    "dtype_code",
    "np_dtype",
    "out_code",
    "reduce_kernel",
    "split_count",
]

#: Threads per block (the shared-memory tree assumes a power of two).
BLOCK = 256
#: (size, stride) pairs per side after merging; an input needing more raises ValueError.
MAX_DIMS = 6
#: The operations, each one kernel source.
OPS = ("sum", "mean", "max", "min")
#: Reduced elements per block below which a reduction is not split in two passes.
_ELEMENTS_PER_PART = 4096
#: Upper bound on the blocks of a split first pass.
_MAX_PARTS = 1024
#: Elements per output up to which one thread reduces an output by itself.
_THREAD_ELEMENTS = 16
#: Adjacent outputs from which one thread per output is used whatever their length.
_THREAD_OUTPUTS = 8192

# dtype code -> (C++ type struct, numpy storage dtype name)
_TYPES: dict[str, tuple[str, str]] = {
    "b": ("TBool", "bool"),
    "i8": ("TP<signed char>", "int8"),
    "i16": ("TP<short>", "int16"),
    "i32": ("TP<int>", "int32"),
    "i64": ("TP<long long>", "int64"),
    "u8": ("TP<unsigned char>", "uint8"),
    "u16": ("TP<unsigned short>", "uint16"),
    "u32": ("TP<unsigned int>", "uint32"),
    "u64": ("TP<unsigned long long>", "uint64"),
    "f16": ("TF16", "float16"),
    "bf16": ("TBF16", "bfloat16"),
    "f32": ("TP<float>", "float32"),
    "f64": ("TP<double>", "float64"),
}
_CODES = {name: code for code, (_, name) in _TYPES.items()}
_INTEGRAL = ("b", "i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64")
_FLOATING = ("f16", "bf16", "f32", "f64")

_PRELUDE = r"""
template <class T> struct TP {
    typedef T S; typedef T C;
    static __device__ __forceinline__ C load(S v) { return v; }
    static __device__ __forceinline__ S store(C v) { return v; }
};
struct TBool {
    typedef unsigned char S; typedef unsigned char C;
    static __device__ __forceinline__ C load(S v) { return v != 0; }
    static __device__ __forceinline__ S store(C v) { return v != 0; }
};
struct TF16 {
    typedef unsigned short S; typedef float C;
    static __device__ __forceinline__ float load(S h)
    {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
    }
    static __device__ __forceinline__ S store(float x)
    {
        S h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
        return h;
    }
};
struct TBF16 {
    typedef unsigned short S; typedef float C;
    static __device__ __forceinline__ float load(S h) { return __uint_as_float((unsigned int)h << 16); }
    static __device__ __forceinline__ S store(float x)
    {
        const unsigned int b = __float_as_uint(x);
        if (x != x) return 0x7FC0;
        return (S)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
    }
};
struct OpSum {
    template <class A> static __device__ __forceinline__ void add(bool& has, A& acc, long long& ia, A v, long long iv)
    { acc = has ? acc + v : v; has = true; }
    template <class A> static __device__ __forceinline__ A finish(A acc, double factor) { return acc; }
};
struct OpMean {
    template <class A> static __device__ __forceinline__ void add(bool& has, A& acc, long long& ia, A v, long long iv)
    { acc = has ? acc + v : v; has = true; }
    template <class A> static __device__ __forceinline__ A finish(A acc, double factor) { return acc * (A)factor; }
};
template <bool MAX> struct OpExtreme {  // NaN wins; ties and NaNs keep the lowest index
    template <class A> static __device__ __forceinline__ void add(bool& has, A& acc, long long& ia, A v, long long iv)
    {
        if (!has) { acc = v; ia = iv; has = true; return; }
        const bool an = acc != acc, vn = v != v;
        if (an || vn) {
            if (vn && (!an || iv < ia)) { acc = v; ia = iv; }
            return;
        }
        if ((MAX ? v > acc : v < acc) || (v == acc && iv < ia)) { acc = v; ia = iv; }
    }
    template <class A> static __device__ __forceinline__ A finish(A acc, double factor) { return acc; }
};
typedef OpExtreme<true> OpMax;
typedef OpExtreme<false> OpMin;

#define CL_MAXD 6
__device__ __forceinline__ long long cl_offset(long long i, int nd, const long long* shape, const long long* stride)
{
    if (nd == 1) return i * stride[0];
    long long off = 0;
#pragma unroll
    for (int d = CL_MAXD - 1; d >= 0; --d) {
        if (d < nd) {
            const long long q = i / shape[d];
            off += (i - q * shape[d]) * stride[d];
            i = q;
        }
    }
    return off;
}

template <class Op, class In, class A, class Out>
__device__ void cl_reduce(const typename In::S* __restrict__ in, const long long* __restrict__ in_idx,
                          typename Out::S* __restrict__ out, long long* __restrict__ out_idx,
                          long long n_out, long long n_red, long long splits, double factor,
                          int ond, const long long* oshape, const long long* ostride,
                          int rnd, const long long* rshape, const long long* rstride)
{
    __shared__ A s_acc[256];
    __shared__ long long s_idx[256];
    __shared__ bool s_has[256];
    const int tid = threadIdx.x;
    if (splits == 0) {  // one thread per output, reading its n_red elements in turn
        const long long step = (long long)gridDim.x * blockDim.x;
        for (long long o = (long long)blockIdx.x * blockDim.x + tid; o < n_out; o += step) {
            const long long base = cl_offset(o, ond, oshape, ostride);
            bool has = false;
            A acc = A(0);
            long long ia = 0;
            for (long long r = 0; r < n_red; ++r) {
                const long long off = base + cl_offset(r, rnd, rshape, rstride);
                Op::add(has, acc, ia, static_cast<A>(In::load(in[off])), in_idx ? in_idx[off] : r);
            }
            out[o] = Out::store(static_cast<typename Out::C>(Op::finish(has ? acc : A(0), factor)));
            if (out_idx) out_idx[o] = ia;
        }
        return;
    }
    const long long total = n_out * splits;
    const long long chunk = (n_red + splits - 1) / splits;
    for (long long b = blockIdx.x; b < total; b += gridDim.x) {
        const long long o = b / splits;
        const long long r0 = (b - o * splits) * chunk;
        const long long r1 = r0 + chunk < n_red ? r0 + chunk : n_red;
        const long long base = cl_offset(o, ond, oshape, ostride);
        bool has = false;
        A acc = A(0);
        long long ia = 0;
        for (long long r = r0 + tid; r < r1; r += blockDim.x) {
            const long long off = base + cl_offset(r, rnd, rshape, rstride);
            const A v = static_cast<A>(In::load(in[off]));
            Op::add(has, acc, ia, v, in_idx ? in_idx[off] : r);
        }
        s_acc[tid] = acc; s_idx[tid] = ia; s_has[tid] = has;
        __syncthreads();
        for (int s = blockDim.x / 2; s > 0; s >>= 1) {
            if (tid < s && s_has[tid + s]) {
                bool h = s_has[tid]; A a = s_acc[tid]; long long i = s_idx[tid];
                Op::add(h, a, i, s_acc[tid + s], s_idx[tid + s]);
                s_acc[tid] = a; s_idx[tid] = i; s_has[tid] = h;
            }
            __syncthreads();
        }
        if (tid == 0) {
            const A result = s_has[0] ? s_acc[0] : A(0);
            out[b] = Out::store(static_cast<typename Out::C>(Op::finish(result, factor)));
            if (out_idx) out_idx[b] = s_idx[0];
        }
        __syncthreads();
    }
}
"""

_WRAPPER = r"""
extern "C" __global__ void __launch_bounds__(256) {name}(
    const {in_t}::S* in, const long long* in_idx, {out_t}::S* out, long long* out_idx,
    long long n_out, long long n_red, long long splits, double factor,
    int ond, {oparams}, int rnd, {rparams})
{{
    const long long oshape[CL_MAXD] = {{{os}}}, ostride[CL_MAXD] = {{{ot}}};
    const long long rshape[CL_MAXD] = {{{rs}}}, rstride[CL_MAXD] = {{{rt}}};
    cl_reduce<{op_t}, {in_t}, {acc_c}, {out_t}>(in, in_idx, out, out_idx, n_out, n_red, splits,
        factor, ond, oshape, ostride, rnd, rshape, rstride);
}}
"""
_OP_STRUCT = {"sum": "OpSum", "mean": "OpMean", "max": "OpMax", "min": "OpMin"}
#: Kernel parameter types: in, in_idx, out, out_idx, n_out, n_red, splits, factor,
#: ond + MAX_DIMS sizes + MAX_DIMS strides, rnd + the same.
SIGNATURE = (("p", "p", "p", "p", "i8", "i8", "i8", "f8")
             + ("i4",) + ("i8",) * (2 * MAX_DIMS) + ("i4",) + ("i8",) * (2 * MAX_DIMS))
#: What the kernels do with each pointer parameter (the stream sanitizer's annotation):
#: they read the input and its indices, write the output and its indices.
ACCESS = ("r", "r", "w", "w") + ("",) * (len(SIGNATURE) - 4)


def _acc_c(code: str) -> str:
    """The C type an accumulator of dtype code ``code`` is held in."""
    return {"f32": "float", "f64": "double", "i64": "long long"}.get(code) or (
        "unsigned char" if code == "b" else _TYPES[code][0][3:-1])


def acc_code(op: str, code: str) -> str:
    """The accumulation dtype code of ``op`` over elements of ``code`` (torch's acc types)."""
    if op in ("sum", "mean"):
        if code in _INTEGRAL:
            return "i64"
        return "f64" if code == "f64" else "f32"
    return "f32" if code in ("f16", "bf16") else code


def out_code(op: str, code: str) -> str:
    """The result dtype code of ``op`` over elements of ``code`` (sum of integers: int64)."""
    return "i64" if op == "sum" and code in _INTEGRAL else code


def _combos() -> dict[str, list[tuple[str, str, str]]]:
    """Per op, every (in, acc, out) a one- or two-pass reduction launches."""
    combos: dict[str, list[tuple[str, str, str]]] = {op: [] for op in OPS}
    for op in OPS:
        codes = _FLOATING if op == "mean" else tuple(_TYPES)
        for code in codes:
            a, o = acc_code(op, code), out_code(op, code)
            first = "sum" if op == "mean" else op  # a split mean's first pass is a sum
            for key_op, triple in ((op, (code, a, o)), (first, (code, a, a)), (op, (a, a, o))):
                if triple not in combos[key_op]:
                    combos[key_op].append(triple)
    return combos


def _name(op: str, triple: tuple[str, str, str]) -> str:
    return f"cudalab_reduce_{op}_{triple[0]}_{triple[1]}_{triple[2]}"


def _source(op: str, triples: list[tuple[str, str, str]]) -> str:
    parts = [_PRELUDE]

    def names(prefix: str) -> str:
        return ", ".join(f"{prefix}{i}" for i in range(MAX_DIMS))

    def params(side: str) -> str:
        return ", ".join(f"long long {side}{kind}{i}" for kind in "st" for i in range(MAX_DIMS))

    for triple in triples:
        parts.append(_WRAPPER.format(
            name=_name(op, triple), in_t=_TYPES[triple[0]][0], out_t=_TYPES[triple[2]][0],
            acc_c=_acc_c(triple[1]), op_t=_OP_STRUCT[op], oparams=params("o"),
            rparams=params("r"), os=names("os"), ot=names("ot"), rs=names("rs"), rt=names("rt")))
    return "".join(parts)


# --------------------------------------------------------------------------- numpy twin
def np_dtype(code: str) -> np.dtype:
    """The numpy dtype of the kernels' dtype code ``code``."""
    name = _TYPES[code][1]
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _offsets(n: int, nd: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> np.ndarray:
    i = np.arange(n, dtype=np.int64)
    off = np.zeros(n, dtype=np.int64)
    for d in range(nd - 1, -1, -1):
        off += (i % shape[d]) * stride[d]
        i //= shape[d]
    return off


def _sim_impl(op: str, triple: tuple[str, str, str]):
    def impl(sim: Any, grid: Any, block: Any, shared_mem: int, in_ptr: int, in_idx: int,
             out_ptr: int, out_idx: int, n_out: int, n_red: int, splits: int, factor: float,
             ond: int, *rest: int) -> None:
        oshape, ostride = rest[:MAX_DIMS], rest[MAX_DIMS:2 * MAX_DIMS]
        rnd = rest[2 * MAX_DIMS]
        rshape, rstride = rest[2 * MAX_DIMS + 1:3 * MAX_DIMS + 1], rest[3 * MAX_DIMS + 1:]
        in_dt, acc_dt, out_dt = (np_dtype(c) for c in triple)  # (bfloat16: ml_dtypes, lazily)
        splits = max(splits, 1)  # 0: one thread per output, the same results
        total = n_out * splits
        if total == 0:
            return
        off = (_offsets(n_out, ond, oshape, ostride)[:, None]
               + _offsets(n_red, rnd, rshape, rstride)[None, :])
        if n_red:
            lo, hi = int(off.min()), int(off.max())
            mem = sim.array(in_ptr + lo * in_dt.itemsize, in_dt, hi - lo + 1)
            vals = mem[off - lo].astype(acc_dt)
            idx = (sim.array(in_idx + lo * 8, np.int64, hi - lo + 1)[off - lo] if in_idx
                   else np.broadcast_to(np.arange(n_red, dtype=np.int64), off.shape))
        else:
            vals = np.zeros((n_out, 0), acc_dt)
        chunk = -(-n_red // splits) if n_red else 0
        results = np.empty(total, acc_dt)
        indices = np.zeros(total, np.int64)
        with np.errstate(invalid="ignore", over="ignore"):
            for p in range(splits):
                part = vals[:, p * chunk:min(n_red, (p + 1) * chunk)]
                rows = slice(p, total, splits)
                if op in ("sum", "mean"):
                    results[rows] = part.sum(axis=1, dtype=acc_dt)
                    if op == "mean":
                        results[rows] *= acc_dt.type(factor)
                else:
                    pick = part.argmax(axis=1) if op == "max" else part.argmin(axis=1)
                    results[rows] = np.take_along_axis(part, pick[:, None], 1)[:, 0]
                    ipart = idx[:, p * chunk:min(n_red, (p + 1) * chunk)]
                    indices[rows] = np.take_along_axis(ipart, pick[:, None], 1)[:, 0]
            sim.array(out_ptr, out_dt, total)[...] = results.astype(out_dt)
        if out_idx:
            sim.array(out_idx, np.int64, total)[...] = indices

    return impl


#: Kernels by (op, in code, acc code, out code).
KERNELS: dict[tuple[str, str, str, str], Kernel] = {}
for _op, _triples in _combos().items():
    _src = _source(_op, _triples)
    for _triple in _triples:
        KERNELS[(_op, *_triple)] = Kernel(_name(_op, _triple), _src, SIGNATURE, access=ACCESS,
                                          sim=_sim_impl(_op, _triple))


# --------------------------------------------------------------------------- planning helpers
def dtype_code(dtype: np.dtype) -> str:
    """The kernels' code for a (real) numpy dtype: ``"f32"``, ``"i64"``, ``"bf16"``..."""
    try:
        return _CODES[dtype.name]
    except KeyError:
        raise TypeError(f"no reduction kernel for dtype {dtype}") from None


def reduce_kernel(op: str, in_code: str, acc: str, out: str) -> Kernel:
    """The kernel reducing ``in_code`` elements with ``op``, accumulating in ``acc``."""
    return KERNELS[(op, in_code, acc, out)]


def coalesce(dims: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(size, stride) pairs, outermost first, with size-1 dims dropped and neighbours that
    walk memory as one dimension merged (same element order, fewer divisions)."""
    out: list[tuple[int, int]] = []
    for size, stride in dims:
        if size == 1:
            continue
        if out and out[-1][1] == stride * size:
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return out


def split_count(n_out: int, n_red: int, outputs_adjacent: bool = False) -> int:
    """How each output's reduction is cut: 0 (a thread per output), 1 (a block per output)
    or more (parts, then a second pass over them).

    A thread per output when each has few elements, or when the outputs are adjacent in
    memory (``outputs_adjacent``: the innermost output stride is 1) and fill a GPU. Parts
    only when there are too few outputs to fill a GPU and each has many elements; every part
    is non-empty.
    """
    if n_red <= _THREAD_ELEMENTS or (outputs_adjacent and n_out >= _THREAD_OUTPUTS):
        return 0
    if n_red < 2 * _ELEMENTS_PER_PART or n_out >= _MAX_PARTS // 2:
        return 1
    parts = min(math.ceil(n_red / _ELEMENTS_PER_PART), max(1, _MAX_PARTS // n_out))
    chunk = math.ceil(n_red / parts)
    return math.ceil(n_red / chunk)
