"""``cudalab.matmul`` and ``DeviceArray @ DeviceArray``: GEMMs through cuBLAS (torch's rules).

One GEMM per call (``cublasSgemm_v2`` / ``cublasSgemmStridedBatched`` and the D, C, Z forms
for float32, float64 and complex, as torch calls them; ``cublasGemmEx`` /
``cublasGemmStridedBatchedEx`` for float16 and bfloat16, as torch; the seam's ``gemm``), on
the current stream of the operands' device, through the handle of ``cudalab.blas`` for this
(device, thread): the seam's :class:`~cudalab._driver.blas_seam.Blas`, cuBLAS on a GPU and
numpy on the simulator. What torch does, cudalab does:

* **Shapes**: as ``torch.matmul`` (a 1-D operand is a row or a column vector whose
  dimension is dropped from the result; the dimensions before the last two are batch
  dimensions, broadcast as numpy does and walked with one stride (copied where they cannot
  be, or where an operand broadcasts over some of them only); a contiguous batched ``input``
  times a 2-D ``other`` is folded into
  one GEMM). The result is a new C-contiguous array (or ``out``).
* **Layouts**: each matrix is read in place when its rows or its columns are contiguous
  (cuBLAS's transpose flags: a transposed view costs no copy), else copied first, as torch.
* **Precision** (:mod:`cudalab.matmul_precision`, ``cudalab.backends.cuda.matmul``):
  float32 and complex64 with TF32 allowed use ``CUBLAS_COMPUTE_32F_FAST_TF32`` and the TF32
  math mode, else ``CUBLAS_COMPUTE_32F``; float16 and bfloat16 use ``CUBLAS_COMPUTE_32F``
  (``CUBLAS_COMPUTE_16F`` with ``allow_fp16_accumulation``) and
  ``CUBLAS_GEMM_DEFAULT_TENSOR_OP``, adding ``CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION``
  to the math mode when the reduced-precision flag is off; float64 and complex128 use
  ``CUBLAS_COMPUTE_64F``.
* **Workspace**: one per (handle, stream), ``CUBLAS_WORKSPACE_CONFIG`` bytes
  (``:SIZE_KiB:COUNT`` pairs summed; default 32 MiB on compute capability 9.0 and later,
  ``4096 KiB * 2 + 16 KiB * 8`` before), allocated from cudalab's caching allocator on that
  stream and kept (torch's ``getNewWorkspace``), so it is counted in ``memory_stats()``
  ("allocated_bytes.all.current", the large pool) and shown in snapshots as an active
  block allocated by ``cudalab.matmul``; :func:`clear_workspaces` gives them back
  (torch's ``torch._C._cuda_clearCublasWorkspaces``).

Every launch is reported to the launch observers under its cuBLAS entry point's name
(``cublasSgemm_v2``, ``cublasGemmStridedBatchedEx``...; ``%%cuda_timed --kernels`` without
CUPTI; with CUPTI it
lists cuBLAS's own kernels).
"""

from __future__ import annotations

import math
import os
import re
import threading
import warnings
from typing import Any, NamedTuple

import numpy as np

from cudalab import _array_state, _interrupts, _observe
from cudalab import blas as _blas
from cudalab import devices as _devices
from cudalab import streams as _streams
from cudalab._array_state import ArrayState
from cudalab._driver.blas_seam import (
    COMPUTE_16F,
    COMPUTE_32F,
    COMPUTE_32F_FAST_TF32,
    COMPUTE_64F,
    CUDA_C_32F,
    CUDA_C_64F,
    CUDA_R_16BF,
    CUDA_R_16F,
    CUDA_R_32F,
    CUDA_R_64F,
    GEMM_DEFAULT,
    GEMM_DEFAULT_TENSOR_OP,
    MATH_DEFAULT,
    MATH_DISALLOW_REDUCED_PRECISION_REDUCTION,
    MATH_TF32_TENSOR_OP,
    OP_N,
    OP_T,
)
from cudalab.matmul_precision import SETTINGS, MatmulState

__all__ = ["MatmulMixin", "clear_plans", "clear_workspaces", "extent", "matmul", "workspace_size"]

#: The kinds of GEMM the settings treat alike (``_Plan.kind``).
_SINGLE, _HALF, _BFLOAT16, _DOUBLE = 0, 1, 2, 3
#: dtype -> (cudaDataType_t, kind); bfloat16 joins when first seen (ml_dtypes is optional).
_DATA_TYPES: dict[np.dtype, tuple[int, int]] = {
    np.dtype(np.float16): (CUDA_R_16F, _HALF), np.dtype(np.float32): (CUDA_R_32F, _SINGLE),
    np.dtype(np.float64): (CUDA_R_64F, _DOUBLE), np.dtype(np.complex64): (CUDA_C_32F, _SINGLE),
    np.dtype(np.complex128): (CUDA_C_64F, _DOUBLE)}
_BYTE = np.dtype(np.uint8)
#: The most plans kept (the cache is emptied when full: a few shapes recur in real code).
_MAX_PLANS = 1024


class _Plan(NamedTuple):
    """One cached GEMM: the result and the cuBLAS call for operands of one shape and layout
    (the key: both operands' dims, strides and dtype). cuBLAS computes C^T = op(B^T) op(A^T)
    column-major, so its ``A`` is ``other`` and its ``B`` is ``input``."""

    shape: tuple[int, ...]  # the result's shape
    dtype: np.dtype  # the result's dtype (the operands')
    data_type: int  # cudaDataType_t of all three matrices
    kind: int  # _SINGLE, _HALF, _BFLOAT16 or _DOUBLE: which settings apply
    trans_other: int  # OP_N or OP_T for other (cuBLAS's A)
    trans_input: int  # OP_N or OP_T for input (cuBLAS's B)
    m: int  # cuBLAS's m: the result's columns (our n), > 0
    n: int  # cuBLAS's n: the result's rows in one batch entry (our m, or batch * m folded), > 0
    k: int  # the shared dimension, > 0
    ld_other: int  # leading dimension of other's matrices (elements)
    stride_other: int  # elements between other's batch entries (0: broadcast)
    ld_input: int  # leading dimension of input's matrices (elements)
    stride_input: int  # elements between input's batch entries (0: broadcast)
    batch: int  # GEMMs in the call, > 0 (1: the one-matrix entry point)


class _Resolved(NamedTuple):
    """A plan's GEMM resolved for one handle under one state of the settings: what the hot
    path calls, with nothing left to look up."""

    bound: Any  # the cudalab.blas.BoundHandle it was resolved for (its handle is in call)
    state: MatmulState  # the settings record's state it was resolved under (by identity)
    call: Any  # the seam's GemmCall: (other, input, result addresses) -> cublasStatus_t
    mode: int  # the cublasMath_t the handle must have for it
    name: str  # the cuBLAS entry point it calls (errors, launch observers)


class _Entry:
    """A plan and its last resolved call (made by :func:`_entry`). ``resolved`` is replaced
    whole (one store), never changed. (No ``__init__``: a method of a class in the array's
    parts types its ``self`` as the array, tests/array/test_structure.py.)"""

    __slots__ = ("plan", "resolved")

    plan: _Plan  # the cached plan
    resolved: _Resolved | None  # None until the first call, and again for another handle or state


def _entry(plan: _Plan) -> _Entry:
    """A new entry of ``plan``, with no resolved call yet."""
    entry = _Entry()
    entry.plan = plan
    entry.resolved = None
    return entry


#: (input dims, strides, dtype, other dims, strides, dtype) -> its plan's entry; only operands
#: read in place (no copy) and products that are not empty have one.
_plans: dict[tuple[Any, ...], _Entry] = {}

#: (handle, stream int) -> the workspace array (kept alive here). Guarded by ``_lock``.
_workspaces: dict[tuple[int, int], Any] = {}
#: device -> workspace bytes (CUBLAS_WORKSPACE_CONFIG read once per device, as torch).
_sizes: dict[int, int] = {}
_lock = threading.Lock()


def workspace_size(device: int, config: str | None = None) -> int:
    """The cuBLAS workspace size in bytes for ``device`` (torch's rule).

    Parameters
    ----------
    device
        A device index (its compute capability picks the default).
    config
        A ``CUBLAS_WORKSPACE_CONFIG`` value (default: the environment's); ``":SIZE:COUNT"``
        pairs, SIZE in KiB, summed. A value without a pair warns and gives the default.
    """
    if config is None:
        config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    major = _devices.get_device_properties(device).major
    default = 4096 * 8 * 1024 if major >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8
    if config is None:
        return default
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if not pairs:
        warnings.warn(f"Could not parse CUBLAS_WORKSPACE_CONFIG={config!r}, using default "
                      f"workspace size of {default} bytes.", UserWarning, stacklevel=2)
        return default
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def clear_workspaces() -> None:
    """Give every cuBLAS workspace back to the caching allocator (torch's
    ``torch._C._cuda_clearCublasWorkspaces``); the next matmul on a stream allocates again
    (every handle's settings are forgotten, so each sets its workspace again)."""
    with _lock:
        dropped = list(_workspaces.values())
        _workspaces.clear()
    _blas.forget_settings()
    del dropped  # freed here, outside the lock


def clear_plans() -> None:
    """Forget every cached plan and the GEMM calls resolved for them (they are made again on
    the next matmul of each layout; for tests and benchmarks that switch a call path)."""
    _plans.clear()


class _Workspace(NamedTuple):
    """One (handle, stream)'s workspace."""

    array: Any  # the uint8 DeviceArray holding it; None for 0 bytes
    span: tuple[int, int]  # (address, bytes), what cublasSetWorkspace is given; (0, 0) for none


def _workspace(bound: Any, device: int, stream: Any) -> tuple[int, int]:
    key = (bound.handle, stream.cuda_stream)
    size = _sizes.get(device)
    if size is None:
        size = _sizes[device] = workspace_size(device)
    array = _array_state.output((size,), _BYTE, device, stream) if size else None
    workspace = _Workspace(array, (0, 0) if array is None else (array.ptr, size))
    with _lock:
        _workspaces[key] = workspace
    return workspace.span


def _math(kind: int, settings: MatmulState) -> tuple[int, int, int]:
    """(compute type, math mode, algorithm) for a GEMM of ``kind`` under ``settings``."""
    if kind == _SINGLE:
        if settings.float32_precision != "highest":
            return COMPUTE_32F_FAST_TF32, MATH_TF32_TENSOR_OP, GEMM_DEFAULT
        return COMPUTE_32F, MATH_DEFAULT, GEMM_DEFAULT
    if kind == _HALF:
        mode = MATH_DEFAULT if settings.allow_fp16_reduced_precision_reduction else \
            MATH_DISALLOW_REDUCED_PRECISION_REDUCTION
        compute = COMPUTE_16F if settings.allow_fp16_accumulation else COMPUTE_32F
        return compute, mode, GEMM_DEFAULT_TENSOR_OP
    if kind == _BFLOAT16:
        mode = MATH_DEFAULT if settings.allow_bf16_reduced_precision_reduction else \
            MATH_DISALLOW_REDUCED_PRECISION_REDUCTION
        return COMPUTE_32F, mode, GEMM_DEFAULT_TENSOR_OP
    return COMPUTE_64F, MATH_DEFAULT, GEMM_DEFAULT


def _layout(x: ArrayState, rows: int, cols: int) -> tuple[bool, int, int] | None:
    """(column-major, leading dimension, batch stride) of ``x``'s matrices (its last two
    dimensions, ``rows`` x ``cols``) in elements, or None when neither rows nor columns are
    contiguous (then the caller copies)."""
    item = x.element_dtype.itemsize
    strides = x.strides_or_none
    if strides is None:
        batch = rows * cols if len(x.dims) == 3 else 0
        return False, max(1, cols), batch
    if any(s % item for s in strides):
        return None
    row_stride, col_stride = strides[-2] // item, strides[-1] // item
    batch = strides[0] // item if len(x.dims) == 3 else 0
    if len(x.dims) == 3 and x.dims[0] == 1:
        batch = 0
    if (col_stride == 1 or cols == 1) and (row_stride >= max(1, cols) or rows == 1):
        return False, max(1, cols, row_stride if rows > 1 else 1), batch
    if (row_stride == 1 or rows == 1) and (col_stride >= max(1, rows) or cols == 1):
        return True, max(1, rows, col_stride if cols > 1 else 1), batch
    return None


def _check_operand(x: Any, name: str) -> None:
    if not isinstance(x, MatmulMixin):
        raise TypeError(f"matmul: {name} must be a cudalab DeviceArray, got "
                        f"{type(x).__name__}")


def matmul(input: Any, other: Any, *, out: Any = None) -> Any:
    """The matrix product of two arrays, as ``torch.matmul`` (through cuBLAS).

    Parameters
    ----------
    input, other
        DeviceArrays on one device, of one dtype (float16, bfloat16, float32, float64,
        complex64 or complex128), of at least one dimension (see the module's notes).
    out
        A C-contiguous array of the result's shape and dtype on that device to write into.

    Returns
    -------
    DeviceArray
        The product (``out`` when given), queued on the device's current stream.

    Raises
    ------
    TypeError
        An operand is not a DeviceArray, the dtypes differ or are not supported.
    ValueError
        The shapes cannot be multiplied, the batches do not broadcast, the operands (or
        ``out``) are on different devices, ``out`` has the wrong shape, dtype or layout.
    cudalab.CublasError
        cuBLAS cannot be loaded or the call failed.
    """
    if not isinstance(input, MatmulMixin) or not isinstance(other, MatmulMixin):
        _check_operand(input, "input")
        _check_operand(other, "other")
    entry = _plans.get((input.dims, input.strides_or_none, input.element_dtype, other.dims,
                        other.strides_or_none, other.element_dtype))
    device = input.device_index
    if entry is None or other.device_index != device:
        return _matmul(input, other, out)
    plan = entry.plan
    stream = _streams.current_stream(device)
    given: Any = out  # (typed Any: isinstance below would narrow ``out`` to the mixin)
    if out is None:
        result = _array_state.output(plan.shape, plan.dtype, device, stream)
    elif (isinstance(out, MatmulMixin) and given.dims == plan.shape and given.contiguous
          and given.element_dtype == plan.dtype and given.device_index == device
          and not given.read_only):
        result = given  # (what _matmul checks, each passed)
    else:
        return _matmul(input, other, out)
    _launch(entry, input.ptr, other.ptr, result.ptr, device, stream)
    if _observe.access_on:  # the stream sanitizer (one flag read while it is off)
        _report_access(stream, plan, input, other, result)
    return result


def extent(x: ArrayState) -> tuple[int, int]:
    """(first address, bytes up to the end of the last element) of ``x``'s memory."""
    if x.contiguous or x.element_count == 0:
        return x.ptr, x.byte_count
    item = x.element_dtype.itemsize
    return x.ptr, sum((d - 1) * s for d, s in zip(x.dims, x.strides) if d > 0) + item


def _report_access(stream: Any, plan: _Plan, a: ArrayState, b: ArrayState,
                   c: ArrayState) -> None:
    """Tell the stream sanitizer what a GEMM read (the operands) and wrote (the result and
    the workspace)."""
    bound = _blas.bound_handle(c.device_index)
    name = bound.blas.entry_point(plan.data_type, plan.batch == 1)
    writes = [extent(c)]
    workspace = _workspaces.get((bound.handle, stream.cuda_stream))
    if workspace is not None and workspace.span[1]:
        writes.append(workspace.span)
    _observe.access_tracker.access(stream, [extent(a), extent(b)], writes, name)


def _dtype_entry(dtype: np.dtype) -> tuple[int, int] | None:
    entry = _DATA_TYPES.get(dtype)
    if entry is None and dtype.name == "bfloat16":
        entry = _DATA_TYPES[dtype] = (CUDA_R_16BF, _BFLOAT16)
    return entry


def _as_batch(x: Any, batch_shape: tuple[int, ...]) -> tuple[Any, bool]:
    """``x`` (at least 2-D) as a matrix (2-D, broadcast over the batch) or a batch of them
    (3-D, one batch stride) for the broadcast ``batch_shape``: a view where the batch
    dimensions can be walked with one stride, else a copy (expanded where ``x`` broadcasts
    over some batch dimensions only); and whether it is a copy."""
    dims = x.dims
    own = dims[:-2]
    if math.prod(own) == 1 and batch_shape:  # one matrix for the whole batch
        if len(dims) == 2:
            return x, False
        strides = x.strides
        return _array_state.wrap(x.ptr, dims[-2:], x.element_dtype, strides[-2:],
                                 x.device_index, x.stream, x if x.owner is None else x.owner,
                                 x.read_only), False
    if (1,) * (len(batch_shape) - len(own)) + own != batch_shape:
        # broadcast in part: expanded by a copy, as torch's expand + reshape copies
        full = _array_state.output(batch_shape + dims[-2:], x.element_dtype, x.device_index,
                                   _streams.current_stream(x.device_index))
        full.copy_(x)
        return full.reshape(math.prod(batch_shape), dims[-2], dims[-1]), True
    if len(dims) <= 3:
        return x, False
    count = math.prod(own)
    if x.contiguous:
        return x.reshape(count, dims[-2], dims[-1]), False
    strides = x.strides
    walked = [(d, st) for d, st in zip(own, strides) if d != 1]
    if all(walked[i][1] == walked[i + 1][1] * walked[i + 1][0] for i in range(len(walked) - 1)):
        step = walked[-1][1] if walked else 0
        return _array_state.wrap(x.ptr, (count, dims[-2], dims[-1]), x.element_dtype,
                                 (step, strides[-2], strides[-1]), x.device_index, x.stream,
                                 x if x.owner is None else x.owner, x.read_only), False
    return x.astype(x.element_dtype).reshape(count, dims[-2], dims[-1]), True


def _matmul(input: Any, other: Any, out: Any) -> Any:
    """:func:`matmul` with every check, making (and caching) the plan."""
    a_dims, b_dims = input.dims, other.dims
    a_nd, b_nd = len(a_dims), len(b_dims)
    if a_nd == 0 or b_nd == 0:
        raise ValueError(f"matmul: both arguments need to be at least 1D, but they are "
                         f"{a_nd}D (input) and {b_nd}D (other)")
    dtype = input.element_dtype
    if other.element_dtype != dtype:
        raise TypeError(f"matmul: input and other must have the same dtype, got {dtype} "
                        f"(input) and {other.element_dtype} (other)")
    entry = _dtype_entry(dtype)
    if entry is None:
        raise TypeError(f"matmul: dtype {dtype} of input and other is not supported "
                        f"(float16, bfloat16, float32, float64, complex64, complex128)")
    data_type, kind = entry
    device = input.device_index
    if other.device_index != device:
        raise ValueError(f"matmul: expected all arrays on the same device, but input is on "
                         f"cuda:{device} and other on cuda:{other.device_index}")
    # the matrices: a is (batch_a, m, k), b is (batch_b, k, n)
    a, b = input, other
    if a_nd == 1:
        a = a.reshape(1, a_dims[0]) if a.contiguous else a.astype(dtype).reshape(1, a_dims[0])
    if b_nd == 1:
        b = b.reshape(b_dims[0], 1) if b.contiguous else b.astype(dtype).reshape(b_dims[0], 1)
    m, k = a.dims[-2], a.dims[-1]
    k_b, n = b.dims[-2], b.dims[-1]
    if k != k_b:
        raise ValueError(f"matmul: input and other shapes cannot be multiplied "
                         f"({'x'.join(map(str, a_dims))} and {'x'.join(map(str, b_dims))}): "
                         f"input's last dimension ({k}) must equal other's "
                         f"{'first' if b_nd == 1 else 'second-to-last'} ({k_b})")
    try:
        batch_shape = tuple(np.broadcast_shapes(a.dims[:-2], b.dims[:-2]))
    except ValueError:
        raise ValueError(f"matmul: the batch dimensions of input {a.dims[:-2]} and other "
                         f"{b.dims[:-2]} do not broadcast") from None
    a, copied_a = _as_batch(a, batch_shape)
    b, copied_b = _as_batch(b, batch_shape)
    batch_a = a.dims[0] if len(a.dims) == 3 else 1
    batch_b = b.dims[0] if len(b.dims) == 3 else 1
    batch = math.prod(batch_shape)
    shape: tuple[int, ...] = batch_shape + (m, n)
    if a_nd == 1:
        shape = shape[:-2] + shape[-1:]
    if b_nd == 1:
        shape = shape[:-1]
    if len(a.dims) == 3 and len(b.dims) == 2 and a.contiguous:
        a = a.reshape(batch_a * m, k)  # one GEMM for the whole batch, as torch
        m, batch, batch_a = batch_a * m, 1, 1
    stream = _streams.current_stream(device)
    if out is None:
        result = _array_state.output(shape, dtype, device, stream)
    else:
        _check_operand(out, "out")
        if out.device_index != device or out.dims != shape or out.element_dtype != dtype:
            raise ValueError(f"matmul: out must be a {dtype} array of shape {shape} on "
                             f"cuda:{device}, got {out.element_dtype} {out.dims} on "
                             f"cuda:{out.device_index}")
        _array_state.require_writable(out, "matmul: out")
        result = out
    if m == 0 or n == 0 or batch == 0:
        return result
    if k == 0:
        return result.fill_(0)
    cacheable = not (copied_a or copied_b)  # a plan reads the operands themselves
    layout_a = _layout(a, m, k)
    if layout_a is None:
        a, cacheable = a.astype(dtype), False
        layout_a = _layout(a, m, k)
    layout_b = _layout(b, k, n)
    if layout_b is None:
        b, cacheable = b.astype(dtype), False
        layout_b = _layout(b, k, n)
    assert layout_a is not None and layout_b is not None  # a copy is C-contiguous
    col_a, lda, stride_a = layout_a
    col_b, ldb, stride_b = layout_b
    plan = _Plan(shape, dtype, data_type, kind, OP_T if col_b else OP_N, OP_T if col_a else OP_N,
                 n, m, k, ldb, 0 if batch_b == 1 else stride_b, lda,
                 0 if batch_a == 1 else stride_a, batch)
    planned = _entry(plan)
    if cacheable and (a_nd > 1 or input.contiguous) and (b_nd > 1 or other.contiguous):
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[(input.dims, input.strides_or_none, dtype, other.dims, other.strides_or_none,
                dtype)] = planned
    _launch(planned, a.ptr, b.ptr, result.ptr, device, stream)
    if _observe.access_on:
        _report_access(stream, plan, a, b, result)
    return result


def _resolve(plan: _Plan, bound: Any, state: MatmulState) -> _Resolved:
    """``plan``'s GEMM on ``bound``'s handle under ``state``: the seam's resolved call."""
    compute, mode, algo = _math(plan.kind, state)
    blas = bound.blas
    call = blas.gemm_call(bound.handle, plan.trans_other, plan.trans_input, plan.m, plan.n,
                          plan.k, 1, plan.ld_other, plan.stride_other, plan.ld_input,
                          plan.stride_input, 0, plan.m, plan.m * plan.n, plan.batch,
                          plan.data_type, compute, algo)
    return _Resolved(bound, state, call, mode, blas.entry_point(plan.data_type, plan.batch == 1))


def _bind(bound: Any, device: int, stream: Any, stream_int: int) -> None:
    """Queue ``bound``'s handle's work on ``stream`` with that stream's workspace (made on
    its first use): each set where it changed, the record after each."""
    bound.blas.set_stream(bound.handle, stream.handle)
    workspace = _workspaces.get((bound.handle, stream_int))
    span = _workspace(bound, device, stream) if workspace is None else workspace.span
    if bound.workspace != span:
        bound.blas.set_workspace(bound.handle, span[0], span[1])
        bound.workspace = span
    bound.stream = stream_int  # last: the record says "bound" only once all is set


def _launch(entry: _Entry, a: int, b: int, c: int, device: int, stream: Any) -> None:
    """Queue ``entry``'s GEMM of ``input`` at ``a`` and ``other`` at ``b`` into ``c`` on
    ``stream``, through this thread's handle of ``device``: the handle's stream (and that
    stream's workspace) and math mode set where they changed, then the resolved call (made again where the
    handle or the settings' state is not the one it was made for)."""
    _devices.ensure_context(device)  # cuBLAS calls run in the context of the handle's device
    bound = _blas.bound_handle(device)
    state = SETTINGS.state
    resolved = entry.resolved
    if resolved is None or resolved.bound is not bound or resolved.state is not state:
        resolved = entry.resolved = _resolve(entry.plan, bound, state)
    stream_int = stream.cuda_stream
    if bound.stream != stream_int:  # (also None: a new handle, or settings forgotten)
        _bind(bound, device, stream, stream_int)
    mode = resolved.mode
    if bound.math_mode != mode:
        bound.blas.set_math_mode(bound.handle, mode)
        bound.math_mode = mode
    status = resolved.call(b, a, c)
    if status:
        bound.blas.raise_status(status, resolved.name)
    if _observe.launch_on:
        for observer in tuple(_observe.launch_subscribers):
            observer(resolved.name, device, stream, (1, 1, 1), (1, 1, 1))


# Ctrl-C waits until these return (cudalab._interrupts): a KeyboardInterrupt between a
# handle's set_stream (or workspace, math mode) and the record of it would leave the record
# naming the old setting, and the next matmul on the old stream would run on the new one.
_interrupts.guard(_launch, _bind, _workspace, clear_workspaces)


class MatmulMixin:
    """``@`` for :class:`cudalab.DeviceArray` (:func:`matmul`)."""

    __slots__ = ()

    def __matmul__(self: ArrayState, operand: Any) -> Any:
        if not isinstance(operand, MatmulMixin):
            return NotImplemented
        other: ArrayState = operand  # type: ignore[assignment]  # (a DeviceArray: its mixin)
        # matmul's cached path, inlined: ``a @ b`` is the user's small matmul (the "a @ b
        # (64x64)" row of benchmarks/blas_fft.py), and a call of matmul() costs a frame
        entry = _plans.get((self.dims, self.strides_or_none, self.element_dtype,
                            other.dims, other.strides_or_none, other.element_dtype))
        device = self.device_index
        if entry is None or other.device_index != device:
            return _matmul(self, other, None)
        plan = entry.plan
        stream = _streams.current_stream(device)
        result = _array_state.output(plan.shape, plan.dtype, device, stream)
        _launch(entry, self.ptr, other.ptr, result.ptr, device, stream)
        if _observe.access_on:  # the stream sanitizer (one flag read while it is off)
            _report_access(stream, plan, self, other, result)
        return result

    def __rmatmul__(self: ArrayState, other: Any) -> Any:
        if not isinstance(other, MatmulMixin):
            return NotImplemented
        return matmul(other, self)
