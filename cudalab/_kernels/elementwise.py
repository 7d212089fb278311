"""Elementwise kernels from one templated C++ function: the jiterator's and the operators' machinery.

An :class:`ElementwiseFunction` holds a code string in torch's jiterator form (one
``template <typename T> R name(T a, T b, ...)``; multi-output functions return ``void`` and
take ``T&`` outputs last). :func:`run` applies it to arrays and Python scalars:

1. **Plan** (cached per function, keyed by the operands' dtypes, shapes and strides, the
   scalars' kinds and the extra arguments' Python types): torch's type promotion
   (:mod:`cudalab._kernels.type_promotion`), broadcasting, the output dtype and shape, and
   the iteration space with adjacent dimensions merged. Contiguous operands get a
   vectorised kernel (16-byte loads when the pointers allow, else a narrower twin), the
   others a strided kernel whose byte strides are kernel parameters.
2. **Kernel**: CUDA C++ generated around the user's string (``#line`` directives make NVRTC's
   messages point into it), a :class:`~cudalab._kernels.kernel.Kernel` compiled by NVRTC to
   CUBIN for the device's architecture and cached in memory and on disk (the cache key hashes
   the whole source, which spells out the dtypes and the vector width, with the arch).
3. **Launch** on the current stream of the operands' device, outputs allocated through
   the caller's ``empty`` (the caching allocator for DeviceArray), a grid of at most
   one thread per vector (or element): one pass over the data, which measured faster than
   a grid capped at a few blocks per multiprocessor on H200 (the "x+y" bandwidth row of
   benchmarks/jiterator.py: 4330 against 4100 GB/s, torch 4320-4370). The kernels keep
   their grid-stride loops, so a grid capped at :data:`MAX_GRID` still covers everything.

Values follow torch's jiterator: each input is loaded as its own dtype, cast to the common
dtype and then to the compute type (float for float16/bfloat16, else the common dtype); the
result is cast to the output dtype. Python scalars are converted on the host to the compute
type and passed as kernel parameters (a complex one as two: real, imaginary). Complex dtypes
compute with c10::complex's arithmetic (see
:data:`~cudalab._kernels.elementwise_source.COMPLEX_PREAMBLE`). Extra arguments are
``long long`` (Python int), ``bool`` or ``double`` (anything else), as in torch.

On the simulator the kernel's twin is numpy, either a callable given as ``sim=`` or the
function body evaluated by :mod:`cudalab._kernels.c_expression`; functions made with
``compile_on_simulator`` (the jiterator's) are also compiled by NVRTC when it is installed,
so a compile error is NVRTC's, as on a GPU.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cudalab import _internal, _observe
from cudalab._kernels import type_promotion as tp
from cudalab._kernels.c_expression import FunctionBody, UnsupportedExpression, parse_body
from cudalab._kernels.elementwise_sim import make_sim, twin_token
from cudalab._kernels.elementwise_source import (
    EXTRA_BOOL,
    EXTRA_DOUBLE,
    EXTRA_INT,
    ParsedCode,
    build_kernel,
    c_type,
    parse_code,
)
from cudalab._kernels.kernel import Kernel, check_compiles

__all__ = ["ElementwiseFunction", "run", "check_overlap", "extra_value", "kernels_for", "MAX_INPUTS", "MAX_OUTPUTS", "BLOCK", "MAX_GRID",
           "RESULT_COMMON", "RESULT_BOOL", "RESULT_FLOAT", "RESULT_REAL"]

#: torch's limit on jiterator inputs.
MAX_INPUTS = 8
#: torch's limit on jiterator outputs (its kernels' argument arrays hold 8 inputs + 8 outputs).
MAX_OUTPUTS = 8
#: Threads per block.
BLOCK = 256
#: The grid's cap (the driver's limit on gridDim.x); beyond it the grid-stride loops take over.
MAX_GRID = 2**31 - 1
#: Bytes a vectorised thread loads per operand and iteration.
VECTOR_BYTES = 16
#: From this many elements kernels index with 64-bit integers (32-bit below: faster to
#: compile and to run; the grid-stride step stays far below 2**32 - 2**31).
INDEX32_LIMIT = 2**31

# --------------------------------------------------------------------------- functions
#: What :func:`run` computes the output dtype from the common dtype with.
RESULT_COMMON, RESULT_BOOL, RESULT_FLOAT, RESULT_REAL = "common", "bool", "float", "real"


class ElementwiseFunction:
    """One elementwise computation: code, outputs, dtype rules, simulator twin, plans.

    Parameters
    ----------
    code
        A jiterator code string, or a callable ``code(common_dtype) -> str`` (operators whose
        C++ depends on the dtype's category).
    num_outputs
        Number of outputs; more than one requires ``return_by_ref``.
    return_by_ref
        The function returns ``void`` and writes ``T&`` outputs (its last parameters).
    result
        :data:`RESULT_COMMON` (the promoted dtype), :data:`RESULT_BOOL` (comparisons),
        :data:`RESULT_FLOAT` (true division: integral and bool promote to float32) or
        :data:`RESULT_REAL` (``abs``: a complex dtype gives its part's dtype; the function
        returns ``T``, whose real part is stored).
    exclude_from_promotion
        Input positions that keep their own dtype and are not promoted (``where``'s mask).
    check
        ``check(common_dtype, input_dtypes)`` raising TypeError/RuntimeError for dtypes the
        computation refuses (torch's messages).
    sim
        The numpy twin, ``sim(*inputs, **extras)`` with inputs in the compute dtype; returns
        one array (or a tuple for several outputs). None: evaluate the body with numpy.
    compile_on_simulator
        On the simulator, compile each plan's kernel with NVRTC too (when NVRTC is
        installed), so code that does not compile fails with NVRTC's log as on a GPU: the
        jiterator's user code (the operators' code is compiled by the tests instead).
    """

    def __init__(self, code: str | Callable[[np.dtype], str], *, num_outputs: int = 1,
                 return_by_ref: bool = False, result: str = RESULT_COMMON,
                 exclude_from_promotion: Sequence[int] = (),
                 check: Callable[[np.dtype, list[np.dtype]], None] | None = None,
                 sim: Callable[..., Any] | None = None, compile_on_simulator: bool = False):
        self.code = code
        self.compile_on_simulator = compile_on_simulator
        self._parsed: dict[str, ParsedCode] = {}
        if isinstance(code, str):
            self._parsed[code] = parse_code(code)
        self.num_outputs = num_outputs
        self.return_by_ref = return_by_ref
        self.result = result
        self.exclude = frozenset(exclude_from_promotion)
        self.check = check
        self.sim = sim
        self._bodies: dict[str, FunctionBody | str] = {}  # code -> body or why not
        #: plan key -> _Plan; guarded by ``_lock`` for writes (reads are lock-free).
        self._plans: dict[tuple, _Plan] = {}
        self._lock = threading.Lock()

    def parsed(self, common: np.dtype) -> ParsedCode:
        """The parsed code used for ``common`` dtype."""
        code = self.code if isinstance(self.code, str) else self.code(common)
        p = self._parsed.get(code)
        if p is None:
            p = self._parsed[code] = parse_code(code)
        return p

    def body(self, parsed: ParsedCode) -> FunctionBody | str:
        """The numpy-evaluable body, or the reason it is not evaluable."""
        b = self._bodies.get(parsed.code)
        if b is None:
            try:
                b = parse_body(parsed.body, parsed.template_params)
            except UnsupportedExpression as exc:
                b = str(exc)
            self._bodies[parsed.code] = b
        return b


# --------------------------------------------------------------------------- plans
class _Plan:
    """Everything about one call shape that does not change between calls.

    Invariants: ``kernel`` takes ``(n, out pointers, array input pointers, meta, scalars,
    extras[, twin token])``; ``meta`` holds the merged sizes then each operand's byte strides
    (strided kernels only); ``fallback`` is the same plan with vector width 1 (or None).
    """

    __slots__ = ("kernel", "shape", "n", "out_dtypes", "compute", "meta",
                 "masks", "vec", "fallback", "work", "grid", "out_given", "simulated")

    kernel: Kernel
    shape: tuple[int, ...]  # the broadcast shape (the outputs')
    n: int  # elements
    out_dtypes: tuple[np.dtype, ...]
    compute: np.dtype  # host scalars are converted to it
    meta: tuple[int, ...]
    masks: tuple[int, ...]  # per pointer: vec * itemsize - 1 (empty: no alignment needed)
    vec: int
    fallback: _Plan | None
    work: int  # vectors (or elements) the grid covers
    grid: tuple[int, int, int]  # one thread per unit of work, at most MAX_GRID blocks
    out_given: bool
    simulated: bool


def _operand_key(x: Any) -> Any:
    return (x.element_dtype, x.dims, x.strides_or_none)  # (strides_or_none: None when C-contiguous)


def _broadcast_shapes(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for s in shapes:
        for i, d in enumerate(s, ndim - len(s)):
            if d != 1:
                if out[i] != 1 and out[i] != d:
                    raise RuntimeError(
                        f"The size of tensor a ({out[i]}) must match the size of tensor b ({d}) "
                        f"at non-singleton dimension {i}")
                out[i] = d
    return tuple(out)


def _c_strides(shape: tuple[int, ...], itemsize: int) -> list[int]:
    strides, acc = [], itemsize
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return strides[::-1]


def _broadcast_strides(shape: tuple[int, ...], x_shape: tuple[int, ...],
                       x_strides: Sequence[int]) -> list[int]:
    lead = len(shape) - len(x_shape)
    out = [0] * lead
    for d, s in zip(x_shape, x_strides):
        out.append(0 if d == 1 else s)
    return out


def _merge_dims(shape: tuple[int, ...], strides: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dimensions and merge neighbours that every operand walks contiguously."""
    keep = [i for i, d in enumerate(shape) if d != 1]
    sizes = [shape[i] for i in keep]
    st = [[s[i] for i in keep] for s in strides]
    i = len(sizes) - 2
    while i >= 0:
        if all(s[i] == s[i + 1] * sizes[i + 1] for s in st):
            sizes[i] *= sizes[i + 1]
            del sizes[i + 1]
            for s in st:
                s[i] = s[i + 1]
                del s[i + 1]
        i -= 1
    return sizes, st



# --------------------------------------------------------------------------- plans and runs
_PYTHON_SCALARS = (bool, int, float, complex)


def _is_scalar(x: Any) -> bool:
    return isinstance(x, _PYTHON_SCALARS) or (isinstance(x, np.generic) and x.ndim == 0)


def _extra_kind(value: Any) -> tuple[str, str]:
    if isinstance(value, bool):
        return EXTRA_BOOL
    if isinstance(value, int):
        return EXTRA_INT
    if isinstance(value, (complex, np.complexfloating)):
        raise TypeError(_COMPLEX_EXTRA)
    return EXTRA_DOUBLE


_COMPLEX_EXTRA = ("complex extra arguments are not supported by cudalab's jiterator: pass "
                  "the value as an input (a Python complex scalar is one), or its real and "
                  "imaginary parts as two extra arguments")


def _host_scalar(value: Any, compute: np.dtype) -> int | float | complex:
    """``value`` converted on the host to the compute type, as a kernel parameter (a complex
    one is two parameters: see :func:`_complex_parts`)."""
    kind = compute.kind
    t = type(value)
    if kind == "f" and (t is float or t is int):
        return float(value)  # (the f4 parameter rounds to float32 as a cast would)
    if kind == "i" and t is int and compute == _INT64 and -(2**63) <= value < 2**63:
        return value
    with np.errstate(all="ignore"):
        try:
            v = np.asarray(value).astype(compute)
        except OverflowError:
            raise OverflowError(f"value {value!r} cannot be converted to {compute} without "
                                "overflow") from None
    item = v.item()
    if isinstance(item, complex):
        return item
    return int(item) if isinstance(item, (bool, int)) else float(item)


def _complex_parts(scalars: Sequence[Any], compute: np.dtype) -> list[float]:
    """Kernel parameters of host scalars for a complex compute type: real, imaginary each."""
    parts: list[float] = []
    for x in scalars:
        value = complex(_host_scalar(x, compute))
        parts += [value.real, value.imag]
    return parts


_INT64 = np.dtype(np.int64)


def extra_value(value: Any) -> int | float:
    """An extra argument as its kernel parameter (torch's as_scalar: int, bool or double)."""
    t = type(value)
    if t is int or t is bool:
        if not -(2**63) <= value < 2**63:
            raise OverflowError(f"extra argument {value} does not fit a long long")
        return int(value)
    if isinstance(value, (complex, np.complexfloating)):
        raise TypeError(_COMPLEX_EXTRA)
    if isinstance(value, (str, bytes, bytearray)):  # (float("2") would take it; torch raises)
        raise TypeError(f"extra argument {value!r} must be a number, bool or int, not "
                        f"{type(value).__name__}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"extra argument {value!r} must be a number, bool or int") from None


def _build_plan(fn: ElementwiseFunction, inputs: Sequence[Any], extra_kinds: tuple,
                extra_names: Sequence[str], outs: Sequence[Any] | None,
                out_dtype: np.dtype | None, simulated: bool) -> _Plan:
    arrays = [x for x in inputs if not _is_scalar(x)]
    if not arrays:
        raise TypeError("an elementwise kernel needs at least one array input; got only "
                        "scalars")
    operands = []
    for k, x in enumerate(inputs):
        if k in fn.exclude:
            continue
        if _is_scalar(x):
            operands.append((tp.scalar_dtype(x), tp.WRAPPED))
        else:
            operands.append((x.element_dtype, tp.DIMENSIONED if x.dims else tp.ZERO_DIM))
    common = tp.result_type(operands)
    in_dtypes: list[np.dtype | None] = [None if _is_scalar(x) else x.element_dtype for x in inputs]
    for dt in [common, *(d for d in in_dtypes if d is not None)]:
        c_type(dt)  # a dtype without a C++ type: a clear TypeError now
    if fn.check is not None:
        fn.check(common, [d for d in in_dtypes if d is not None])
    if fn.result == RESULT_FLOAT and tp.category(common) < tp.FLOATING:
        common = np.dtype(np.float32)
    result = np.dtype(np.bool_) if fn.result == RESULT_BOOL else common
    if fn.result == RESULT_REAL and common.kind == "c":
        result = np.dtype(f"float{common.itemsize * 4}")
    shape = _broadcast_shapes([x.dims for x in arrays] + [o.dims for o in outs or ()])
    if outs is not None:
        out_dtypes = [o.element_dtype for o in outs]
        for o in outs:
            if out_dtype is None and not tp.can_cast(result, o.element_dtype):  # (copies convert)
                raise RuntimeError(f"result type {tp.torch_name(result)} can't be cast to the "
                                   f"desired output type {tp.torch_name(o.dtype)}")
            if o.dims != shape:
                raise RuntimeError(f"output with shape {list(o.shape)} doesn't match the "
                                   f"broadcast shape {list(shape)}")
        out_strides = [list(o.strides) for o in outs]
    else:
        out_dtypes = [out_dtype or result] * fn.num_outputs
        out_strides = [_c_strides(shape, dt.itemsize) for dt in out_dtypes]
    for dt in out_dtypes:
        c_type(dt)
    in_strides = [_broadcast_strides(shape, x.dims, x.strides) for x in arrays]
    sizes, strides = _merge_dims(shape, out_strides + in_strides)
    op_dtypes = out_dtypes + [x.element_dtype for x in arrays]
    contiguous = len(sizes) == 0 or (len(sizes) == 1 and all(
        s[0] == dt.itemsize for s, dt in zip(strides, op_dtypes)))
    parsed = fn.parsed(common)
    plan = _Plan()
    plan.shape = shape
    plan.n = math.prod(shape)
    plan.out_dtypes = tuple(out_dtypes)
    plan.compute = tp.opmath_dtype(common)
    plan.simulated = simulated
    plan.out_given = outs is not None
    sim_impl = None
    if simulated:
        sim_impl = make_sim(parsed, in_dtypes, common, out_dtypes, extra_kinds, fn.exclude,
                             None if contiguous else len(sizes), extra_names, fn.return_by_ref)

    index64 = math.prod(shape) >= INDEX32_LIMIT

    def make(vec: int, ndim: int | None) -> Kernel:
        return build_kernel(parsed, in_dtypes, common, out_dtypes, extra_kinds, fn.exclude,
                            fn.return_by_ref, vec, ndim, index64=index64, simulated=simulated,
                            sim=sim_impl)

    plan.fallback = None
    if contiguous:
        plan.meta = ()
        vec = 1 if simulated else max(1, VECTOR_BYTES // max(dt.itemsize for dt in op_dtypes))
        plan.vec = vec
        plan.kernel = make(vec, None)
        plan.masks = tuple(vec * dt.itemsize - 1 for dt in op_dtypes) if vec > 1 else ()
        plan.work = -(-plan.n // vec)
        plan.grid = _grid(plan.work)
        if vec > 1:
            fallback = _Plan()
            for slot in _Plan.__slots__:
                setattr(fallback, slot, getattr(plan, slot))
            fallback.vec, fallback.masks, fallback.work = 1, (), plan.n
            fallback.grid = _grid(plan.n)
            fallback.kernel = make(1, None)
            plan.fallback = fallback
    else:
        plan.meta = tuple(sizes) + tuple(s for st in strides for s in st)
        plan.vec = 1
        plan.masks = ()
        plan.kernel = make(1, len(sizes))
        plan.work = plan.n
        plan.grid = _grid(plan.work)
    if simulated and fn.compile_on_simulator:
        check_compiles(plan.kernel, arrays[0].device_index)  # (the GPU's vec=1 kernel's source)
    return plan


_BLOCK3 = (BLOCK, 1, 1)


def _grid(work: int) -> tuple[int, int, int]:
    """One thread per unit of ``work`` (at least one block, at most MAX_GRID)."""
    return (max(1, min(-(-work // BLOCK), MAX_GRID)), 1, 1)


def run(fn: ElementwiseFunction, inputs: Sequence[Any], extras: Sequence[Any] = (),
        extra_names: Sequence[str] = (), *, out: Sequence[Any] | None = None,
        out_dtype: np.dtype | None = None, empty: Callable[..., Any] | None = None,
        sim: Callable[..., Any] | None = None,
        extra_args: Sequence[int | float] | None = None,
        extra_types: tuple[type, ...] | None = None) -> list[Any]:
    """Apply ``fn`` elementwise; returns the outputs (``out`` itself when given).

    Parameters
    ----------
    fn
        The computation.
    inputs
        DeviceArrays (any strides, broadcastable) and Python or numpy scalars.
    extras
        Values of the extra scalar arguments, in declaration order.
    extra_names
        Their names (the keywords a ``sim`` twin receives).
    out
        Existing output arrays (in-place operations); None allocates them with ``empty``.
    out_dtype
        The output dtype when it is not the promoted one (conversions).
    empty
        ``empty(shape, dtype, device, stream)``, the output allocator (``stream`` is the
        device's current stream, where the kernel runs): :data:`cudalab.array.output_array`.
    sim
        A numpy twin for this call (simulator only), overriding ``fn.sim``.
    extra_args
        ``extras`` already converted by :func:`extra_value` (a caller that keeps them).
    extra_types
        ``tuple(map(type, extras))``, likewise kept by the caller.

    Returns
    -------
    list
        The output arrays.

    Raises
    ------
    TypeError
        Unsupported dtypes or operands.
    RuntimeError
        Shapes that do not broadcast, an output the result cannot be cast to, arrays on
        different devices, or a function the simulator cannot run (no twin).
    """
    if len(inputs) > MAX_INPUTS:
        raise AssertionError(f"jiterator only supports up to {MAX_INPUTS} tensor inputs, "
                             f"got {len(inputs)}")
    key_parts: list[Any] = []
    arrays: list[Any] = []
    scalars: list[Any] = []
    device = -1
    for x in inputs:
        try:
            strides = x.strides_or_none  # (None when C-contiguous; numpy scalars lack it)
        except AttributeError:  # a scalar (checked when the plan is built)
            scalars.append(x)
            key_parts.append(type(x) if type(x) in _PYTHON_SCALARS else _scalar_key(x))
            continue
        arrays.append(x)
        key_parts.append((x.element_dtype, x.dims, strides))
        if device != x.device_index:
            if device >= 0:
                raise RuntimeError(
                    "Expected all tensors to be on the same device, but found at least "
                    f"two devices, cuda:{device} and cuda:{x.device_index}!")
            device = x.device_index
    if extra_types is None:
        extra_types = tuple(map(type, extras))
    if out is None:
        out_key = None
    elif len(out) == 1:  # (an in-place operator: no generator, the "a += b" row of house_ab.py)
        out_key = (_operand_key(out[0]),)
    else:
        out_key = tuple([_operand_key(o) for o in out])
    key = (tuple(key_parts), extra_types, out_dtype, out_key)
    plan = fn._plans.get(key)
    if plan is None:
        if device < 0:
            raise TypeError("an elementwise kernel needs at least one array input; got only "
                            "scalars")
        simulated = _internal.backend().simulated
        extra_kinds = tuple(_extra_kind(v) for v in extras)
        plan = _build_plan(fn, inputs, extra_kinds, extra_names, out, out_dtype, simulated)
        with fn._lock:
            fn._plans[key] = plan
    if _current_stream is None:
        _bind_streams()
    stream = _current_stream(device)
    if out is None:
        outs = [empty(plan.shape, dt, device, stream)  # type: ignore[misc]
                for dt in plan.out_dtypes]
    else:
        outs = list(out)
        for o in outs:
            check_overlap(o, arrays)
    if plan.n == 0:
        return outs
    ptrs: list[int | float] = [plan.n]
    for o in outs:
        ptrs.append(o.ptr)
    for x in arrays:
        ptrs.append(x.ptr)
    if plan.masks:
        for p, mask in zip(ptrs[1:], plan.masks):
            if p & mask:  # type: ignore[operator]  # (pointers: ints)
                assert plan.fallback is not None
                plan = plan.fallback
                break
    if plan.meta:
        ptrs += plan.meta
    if scalars:
        if plan.compute.kind == "c":
            ptrs += _complex_parts(scalars, plan.compute)
        else:
            ptrs += [_host_scalar(x, plan.compute) for x in scalars]  # type: ignore[misc]
    if extras:
        ptrs += [extra_value(v) for v in extras] if extra_args is None else extra_args
    if plan.simulated:
        ptrs.append(_sim_token(fn, plan, sim))
    plan.kernel.launch_prepared(plan.grid, _BLOCK3, ptrs, stream)
    if _observe.access_on:  # the stream sanitizer (one flag read while it is off)
        _observe.access_tracker.access(stream, [_extent(x) for x in arrays],
                                       [_extent(o) for o in outs], f"kernel {plan.kernel.name}")
    return outs


#: torch's error for an operation whose input partly overlaps the memory it writes.
OVERLAP_MESSAGE = ("unsupported operation: some elements of the input tensor and the "
                   "written-to tensor refer to a single memory location. Please clone() the "
                   "tensor before performing the operation.")


def check_overlap(written: Any, inputs: Sequence[Any]) -> None:
    """Raise torch's RuntimeError when an array of ``inputs`` shares some, but not exactly
    all, of the memory ``written`` is written through (``c[1:] += c[:-1]``): the result would
    depend on the order the GPU's threads run in. The same memory seen the same way
    (``a += a``) is allowed, as in torch."""
    if not written.byte_count:
        return
    # (contiguous arrays, the common case, without a call: the "a += b" row of
    # benchmarks/house_ab.py)
    if written.contiguous:
        start = written.ptr
        end = start + written.byte_count
    else:
        start, length = _extent(written)
        end = start + length
    for x in inputs:
        if x is written or not x.byte_count:
            continue
        if x.contiguous:
            low = x.ptr
            size = x.byte_count
        else:
            low, size = _extent(x)
        if low < end and start < low + size and not (
                x.ptr == written.ptr and x.dims == written.dims
                and x.strides_or_none == written.strides_or_none
                and x.element_dtype.itemsize == written.element_dtype.itemsize):
            raise RuntimeError(OVERLAP_MESSAGE)


def _extent(x: Any) -> tuple[int, int]:
    """``(first byte, bytes)`` that array ``x`` spans (views: from its lowest to its highest
    element), the range an elementwise kernel reads or writes, for the stream sanitizer."""
    if x.contiguous:
        return x.ptr, x.byte_count
    itemsize = x.element_dtype.itemsize
    low = high = 0
    for n, st in zip(x.dims, x.strides):
        if n == 0:
            return x.ptr, 0
        if st < 0:
            low += (n - 1) * st
        else:
            high += (n - 1) * st
    return x.ptr + low, high - low + itemsize


_current_stream: Any = None  # cudalab.streams.current_stream, bound on first run


def _bind_streams() -> None:
    global _current_stream
    from cudalab import streams

    _current_stream = streams.current_stream


def _scalar_key(x: Any) -> Any:
    if not (isinstance(x, np.generic) and x.ndim == 0):
        raise TypeError(f"elementwise operands are arrays and numbers, got {type(x).__name__}")
    return x.dtype


def _sim_token(fn: ElementwiseFunction, plan: _Plan, sim: Callable[..., Any] | None) -> int:
    twin = sim if sim is not None else fn.sim
    if twin is not None:
        return twin_token("user", twin)
    parsed = fn.parsed(plan.compute)  # (operators' code does not depend on float16 vs float32)
    body = fn.body(parsed)
    if isinstance(body, str):
        raise RuntimeError(
            f"jit function {parsed.name!r} cannot run on the simulator: cudalab evaluates a "
            f"body of simple statements ('return <expression>;') with numpy, but {body}. "
            f"Pass a numpy twin: sim=lambda *inputs, **extras: ... (to _create_jit_fn or "
            "to the call); it receives the inputs as numpy arrays of the compute dtype and "
            "the extra arguments by name, and returns the output (a tuple for several)")
    return twin_token("body", body)


class _Spec:
    """A stand-in operand for :func:`kernels_for`: an array's layout without memory."""

    def __init__(self, dtype: np.dtype, strided: bool, large: bool):
        self.dtype = self.element_dtype = dtype
        self.shape = self.dims = (2**26, 32) if large else (64, 32)
        self.contiguous = not strided
        self.strides = (dtype.itemsize, self.shape[0] * dtype.itemsize) if strided else (
            32 * dtype.itemsize, dtype.itemsize)
        self.strides_or_none = self.strides if strided else None
        self.ptr = 0
        self.device_index = 0


_SCALAR_EXAMPLES = {int: 1, float: 1.0, bool: True, complex: 1j}


def kernels_for(fn: ElementwiseFunction, dtypes: Sequence[Any], extras: Sequence[Any] = (),
                strided: bool = False, out_dtype: np.dtype | None = None,
                large: bool = False) -> list[Kernel]:
    """The CUDA kernels (not the simulator's) ``fn`` uses for inputs of ``dtypes``.

    Parameters
    ----------
    fn
        The computation.
    dtypes
        Per input: a dtype (an array) or ``int``/``float``/``bool``/``complex`` (a Python
        scalar).
    extras
        Example values of the extra arguments (their Python types select the C types).
    strided
        The strided kernel instead of the contiguous ones.
    out_dtype
        The output dtype of a conversion.
    large
        The 64-bit-indexed variants (2**31 elements and more) instead of the 32-bit ones.

    Returns
    -------
    list of Kernel
        The vectorised kernel and its unaligned fallback, or the strided kernel; compile
        them with ``Kernel.cubin(arch)`` (NVRTC only, no GPU).
    """
    from cudalab._dtypes import normalize_dtype

    inputs: list[Any] = []
    for d in dtypes:
        if d in _SCALAR_EXAMPLES:
            inputs.append(_SCALAR_EXAMPLES[d])
        else:
            inputs.append(_Spec(normalize_dtype(d), strided, large))
    extra_kinds = tuple(_extra_kind(v) for v in extras)
    names = tuple(f"extra{i}" for i in range(len(extras)))
    plan = _build_plan(fn, inputs, extra_kinds, names, None, out_dtype, simulated=False)
    kernels = [plan.kernel]
    if plan.fallback is not None:
        kernels.append(plan.fallback.kernel)
    return kernels
