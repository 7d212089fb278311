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
           "EXTRA_INT", "EXTRA_BOOL", "EXTRA_DOUBLE"]

#: NVRTC options of every elementwise kernel (the rest is NVRTC's default, as in torch:
#: --fmad=true, IEEE division and square root, no flush to zero).
OPTIONS = ("-std=c++17", "-default-device")

# --------------------------------------------------------------------------- C types
_C_TYPES = {
    "bool": "bool", "int8": "signed char", "int16": "short", "int32": "int",
    "int64": "long long", "uint8": "unsigned char", "uint16": "unsigned short",
    "uint32": "unsigned int", "uint64": "unsigned long long", "float16": "cudalab_half",
    "bfloat16": "cudalab_bfloat16", "float32": "float", "float64": "double",
}
#: compute dtype -> (kernel parameter type code, C parameter type) for host scalars.
_SCALAR_PARAMS = {
    "bool": ("u4", "unsigned int"), "int8": ("i4", "int"), "int16": ("i4", "int"),
    "int32": ("i4", "int"), "int64": ("i8", "long long"), "uint8": ("u4", "unsigned int"),
    "uint16": ("u4", "unsigned int"), "uint32": ("u4", "unsigned int"),
    "uint64": ("u8", "unsigned long long"), "float32": ("f4", "float"),
    "float64": ("f8", "double"),
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


def c_type(dtype: np.dtype) -> str:
    """The C++ type holding one element of ``dtype`` in an elementwise kernel.

    Raises
    ------
    TypeError
        Complex dtypes (not supported by cudalab's elementwise kernels yet).
    """
    try:
        return _C_TYPES[dtype.name]
    except KeyError:
        raise TypeError(f"cudalab's elementwise kernels do not support dtype {dtype} yet "
                        "(complex arrays cannot be computed on)") from None


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
        Add the simulator's twin-token parameter (the source is not compiled then).
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
    head = f'{PREAMBLE}\n#line 1 "jiterator_code"\n{parsed.code}\n#line 1 "cudalab_elementwise"\n'
    kernel_text = (f'extern "C" __global__ void @NAME@({", ".join(params)})\n{{\n'
                   + "".join(body) + "}\n")
    name = _kernel_name(f"{parsed.name}_{kind}", head + kernel_text)
    kernel = Kernel(name, head + kernel_text.replace("@NAME@", name), sig, options=OPTIONS, sim=sim)
    unregister_kernel(kernel)  # generated per call shape: not one of cudalab's fixed kernels
    return kernel
