"""``cudalab.matmul`` and ``DeviceArray @ DeviceArray``: GEMMs through cuBLAS (torch's rules).

One ``cublasGemmEx`` (two matrices) or ``cublasGemmStridedBatchedEx`` (a batch) per call, on
the current stream of the operands' device, through the handle of ``cudalab.blas`` for this
(device, thread): the seam's :class:`~cudalab._driver.blas_seam.Blas`, cuBLAS on a GPU and
numpy on the simulator. What torch does, cudalab does:

* **Shapes**: 1-D, 2-D and 3-D operands as ``torch.matmul`` (a 1-D operand is a row or a
  column vector whose dimension is dropped from the result; 3-D operands are batches, a
  batch of one broadcasts; a contiguous 3-D ``input`` times a 2-D ``other`` is folded into
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

Every launch is reported to the launch observers as ``cublasGemmEx`` or
``cublasGemmStridedBatchedEx`` (``%%cuda_timed --kernels`` without CUPTI; with CUPTI it
lists cuBLAS's own kernels).
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from typing import Any

import numpy as np

from cudalab import _array_state, _observe
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
from cudalab.matmul_precision import SETTINGS

__all__ = ["MatmulMixin", "clear_workspaces", "matmul", "workspace_size"]

_BFLOAT16_NAME = "bfloat16"
#: dtype name -> cudaDataType_t.
_DATA_TYPES = {"float16": CUDA_R_16F, _BFLOAT16_NAME: CUDA_R_16BF, "float32": CUDA_R_32F,
               "float64": CUDA_R_64F, "complex64": CUDA_C_32F, "complex128": CUDA_C_64F}
_BYTE = np.dtype(np.uint8)

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
    ``torch._C._cuda_clearCublasWorkspaces``); the next matmul on a stream allocates again."""
    with _lock:
        dropped = list(_workspaces.values())
        _workspaces.clear()
    del dropped  # freed here, outside the lock


def _workspace(bound: Any, device: int, stream: Any) -> tuple[int, int]:
    key = (bound.handle, stream.cuda_stream)
    array = _workspaces.get(key)
    if array is None:
        size = _sizes.get(device)
        if size is None:
            size = _sizes[device] = workspace_size(device)
        array = _array_state.output((size,), _BYTE, device, stream) if size else None
        with _lock:
            _workspaces[key] = array
    return (0, 0) if array is None else (array.ptr, array.byte_count)


def _math(dtype_name: str) -> tuple[int, int, int]:
    """(compute type, math mode, algorithm) for ``dtype_name`` under the current settings."""
    settings = SETTINGS
    if dtype_name in ("float32", "complex64"):
        if settings.tf32:
            return COMPUTE_32F_FAST_TF32, MATH_TF32_TENSOR_OP, GEMM_DEFAULT
        return COMPUTE_32F, MATH_DEFAULT, GEMM_DEFAULT
    if dtype_name == "float16":
        mode = MATH_DEFAULT if settings.allow_fp16_reduced_precision_reduction else \
            MATH_DISALLOW_REDUCED_PRECISION_REDUCTION
        compute = COMPUTE_16F if settings.allow_fp16_accumulation else COMPUTE_32F
        return compute, mode, GEMM_DEFAULT_TENSOR_OP
    if dtype_name == _BFLOAT16_NAME:
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
        complex64 or complex128), of 1 to 3 dimensions (see the module's notes).
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
    _check_operand(input, "input")
    _check_operand(other, "other")
    a_dims, b_dims = input.dims, other.dims
    a_nd, b_nd = len(a_dims), len(b_dims)
    if a_nd == 0 or b_nd == 0:
        raise ValueError(f"matmul: both arguments need to be at least 1D, but they are "
                         f"{a_nd}D (input) and {b_nd}D (other)")
    if a_nd > 3 or b_nd > 3:
        raise ValueError(f"matmul: input ({a_nd}D) and other ({b_nd}D) must have at most 3 "
                         f"dimensions (cudalab's matmul takes matrices and batches of them)")
    dtype = input.element_dtype
    if other.element_dtype != dtype:
        raise TypeError(f"matmul: input and other must have the same dtype, got {dtype} "
                        f"(input) and {other.element_dtype} (other)")
    dtype_name = dtype.name
    data_type = _DATA_TYPES.get(dtype_name)
    if data_type is None:
        raise TypeError(f"matmul: dtype {dtype} of input and other is not supported "
                        f"(float16, bfloat16, float32, float64, complex64, complex128)")
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
    batch_a = a.dims[0] if len(a.dims) == 3 else 1
    batch_b = b.dims[0] if len(b.dims) == 3 else 1
    if batch_a != batch_b and batch_a != 1 and batch_b != 1:
        raise ValueError(f"matmul: the batch dimensions of input ({batch_a}) and other "
                         f"({batch_b}) do not broadcast")
    batch = batch_b if batch_a == 1 else batch_a
    shape: tuple[int, ...] = (batch, m, n) if max(a_nd, b_nd) == 3 else (m, n)
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
    layout_a = _layout(a, m, k)
    if layout_a is None:
        a = a.astype(dtype)
        layout_a = _layout(a, m, k)
    layout_b = _layout(b, k, n)
    if layout_b is None:
        b = b.astype(dtype)
        layout_b = _layout(b, k, n)
    assert layout_a is not None and layout_b is not None  # a copy is C-contiguous
    col_a, lda, stride_a = layout_a
    col_b, ldb, stride_b = layout_b
    if batch_a == 1:
        stride_a = 0
    if batch_b == 1:
        stride_b = 0
    compute, mode, algo = _math(dtype_name)
    bound = _blas.bound_handle(device)
    blas, handle = bound.blas, bound.handle
    if bound.stream != stream.cuda_stream:
        blas.set_stream(handle, stream.handle)
        bound.stream = stream.cuda_stream
    workspace = _workspaces.get((handle, stream.cuda_stream))
    span = (0, 0) if workspace is None else (workspace.ptr, workspace.byte_count)
    if workspace is None:
        span = _workspace(bound, device, stream)
    if bound.workspace != span:
        blas.set_workspace(handle, span[0], span[1])
        bound.workspace = span
    if bound.math_mode != mode:
        blas.set_math_mode(handle, mode)
        bound.math_mode = mode
    # row-major C = A B is column-major C^T = B^T A^T: cuBLAS's A is our b, its B our a
    blas.gemm(handle, OP_T if col_b else OP_N, OP_T if col_a else OP_N, n, m, k, 1, b.ptr, ldb,
              stride_b, a.ptr, lda, stride_a, 0, result.ptr, n, m * n, batch, data_type,
              compute, algo)
    if _observe.launch_on:
        name = "cublasGemmEx" if batch == 1 else "cublasGemmStridedBatchedEx"
        for observer in tuple(_observe.launch_subscribers):
            observer(name, device, stream, (1, 1, 1), (1, 1, 1))
    return result


class MatmulMixin:
    """``@`` for :class:`cudalab.DeviceArray` (:func:`matmul`)."""

    __slots__ = ()

    def __matmul__(self: ArrayState, other: Any) -> Any:
        if not isinstance(other, MatmulMixin):
            return NotImplemented
        return matmul(self, other)

    def __rmatmul__(self: ArrayState, other: Any) -> Any:
        if not isinstance(other, MatmulMixin):
            return NotImplemented
        return matmul(other, self)
