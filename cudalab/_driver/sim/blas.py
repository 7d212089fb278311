"""The simulator's BLAS: :class:`SimulatedBlas`, numpy GEMMs run in stream order.

A handle remembers its device, stream, workspace and math mode as cuBLAS does. A GEMM reads
its column-major operands from simulated device memory with the leading dimensions and
batch strides given, computes the product with numpy and writes ``C`` when its stream
reaches it (captured into a graph while the stream captures). Precision follows what the
call asks of cuBLAS, so tests that check precision see it:

* float32 with ``COMPUTE_32F_FAST_TF32`` (or the TF32 math mode): both inputs rounded to
  TF32 (10 explicit mantissa bits, round to nearest, ties away from zero, as the tensor
  cores' ``cvt.rna.tf32.f32``), then multiplied in float32;
* float16 / bfloat16: products summed in float32 (``COMPUTE_32F``) or float16
  (``COMPUTE_16F``), the result rounded once to the storage type;
* float64, complex64, complex128: numpy's product in that type.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from cudalab._driver.blas_seam import (
    COMPUTE_16F,
    COMPUTE_32F,
    COMPUTE_32F_FAST_TF32,
    CUDA_C_32F,
    CUDA_C_64F,
    CUDA_R_16BF,
    CUDA_R_16F,
    CUDA_R_32F,
    CUDA_R_64F,
    MATH_TF32_TENSOR_OP,
    OP_N,
    Blas,
)
from cudalab._driver.handles import StreamHandle
from cudalab._driver.sim.library_call import LibraryCall, library_op
from cudalab.errors import CublasError

__all__ = ["SimulatedBlas", "round_to_tf32"]


def _dtype(data_type: int) -> np.dtype:
    if data_type == CUDA_R_16BF:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    dtype = {CUDA_R_16F: np.float16, CUDA_R_32F: np.float32, CUDA_R_64F: np.float64,
             CUDA_C_32F: np.complex64, CUDA_C_64F: np.complex128}.get(data_type)
    if dtype is None:
        raise CublasError(f"cublasGemmEx failed: CUBLAS_STATUS_NOT_SUPPORTED (data type "
                          f"{data_type}, simulated)", 15)
    return np.dtype(dtype)


def round_to_tf32(values: Any) -> Any:
    """float32 ``values`` rounded to TF32's 10-bit mantissa (ties away from zero); inf and
    NaN are kept."""
    x = np.ascontiguousarray(values, dtype=np.float32)
    bits = x.view(np.uint32)
    finite = (bits & 0x7F800000) != 0x7F800000
    rounded = ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).astype(np.uint32)
    return np.where(finite, rounded, bits).view(np.float32)


class _Handle:
    """One simulated handle's state (what cuBLAS's handle holds)."""

    __slots__ = ("device", "stream", "workspace", "math_mode")

    def __init__(self, device: int) -> None:
        self.device = device  # the device whose context was current at creation
        self.stream: Any = 0  # the StreamHandle set last (0: the legacy default stream)
        self.workspace = (0, 0)  # (address, bytes) set last
        self.math_mode = 0  # cublasMath_t set last


class SimulatedBlas(Blas):
    """The seam's BLAS on the simulator (numpy GEMMs in stream order)."""

    simulated = True

    def __init__(self, backend: Any) -> None:
        # the SimulatorBackend (typed Any, as the NCCL seam's: naming it would be a cycle)
        self._backend = backend
        self._lock = threading.Lock()
        self._handles: dict[int, _Handle] = {}  # handle -> state; handles count from 1
        self._next = 1

    def _handle(self, handle: int, call: str) -> _Handle:
        state = self._handles.get(handle)
        if state is None:
            raise CublasError(f"{call} failed: CUBLAS_STATUS_NOT_INITIALIZED (handle "
                              f"{handle} is not a live simulated handle)", 1)
        return state

    def create(self, device: int) -> int:
        with self._lock:
            handle, self._next = self._next, self._next + 1
            self._handles[handle] = _Handle(device)
        return handle

    def destroy(self, handle: int) -> None:
        with self._lock:
            self._handle(handle, "cublasDestroy_v2")
            del self._handles[handle]

    def set_stream(self, handle: int, stream: StreamHandle) -> None:
        self._handle(handle, "cublasSetStream_v2").stream = stream

    def set_workspace(self, handle: int, ptr: int, nbytes: int) -> None:
        if nbytes and not ptr:
            raise CublasError("cublasSetWorkspace_v2 failed: CUBLAS_STATUS_INVALID_VALUE "
                              "(no address for a non-empty workspace)", 7)
        self._handle(handle, "cublasSetWorkspace_v2").workspace = (ptr, nbytes)

    def set_math_mode(self, handle: int, mode: int) -> None:
        self._handle(handle, "cublasSetMathMode").math_mode = mode

    def gemm(self, handle: int, transa: int, transb: int, m: int, n: int, k: int,
             alpha: complex, a: int, lda: int, stride_a: int, b: int, ldb: int, stride_b: int,
             beta: complex, c: int, ldc: int, stride_c: int, batch: int, data_type: int,
             compute_type: int, algo: int) -> None:
        call = self.entry_point(data_type, batch == 1)
        state = self._handle(handle, call)
        dtype = _dtype(data_type)
        rows_a, cols_a = (m, k) if transa == OP_N else (k, m)
        rows_b, cols_b = (k, n) if transb == OP_N else (n, k)
        if min(m, n, k, batch) < 0 or lda < max(1, rows_a) or ldb < max(1, rows_b) \
                or ldc < max(1, m):
            raise CublasError(f"{call} failed: CUBLAS_STATUS_INVALID_VALUE (simulated: "
                              f"m={m} n={n} k={k} lda={lda} ldb={ldb} ldc={ldc})", 7)
        tf32 = data_type == CUDA_R_32F and (
            compute_type == COMPUTE_32F_FAST_TF32
            or (compute_type == COMPUTE_32F and state.math_mode & 0xF == MATH_TF32_TENSOR_OP))
        backend = self._backend
        s = backend.stream_of(state.stream, call)
        args = (dtype, transa, transb, m, n, k, alpha, a, lda, stride_a, rows_a, cols_a,
                b, ldb, stride_b, rows_b, cols_b, beta, c, ldc, stride_c, batch, tf32,
                compute_type == COMPUTE_16F)
        backend.submit(s, library_op, (LibraryCall(call, self._run, args), (1, 1, 1), (1, 1, 1)))

    def _matrices(self, ptr: int, dtype: np.dtype, ld: int, stride: int, rows: int, cols: int,
                  batch: int, transposed: bool) -> Any:
        """The batch of stored column-major matrices at ``ptr``, as op(X) (batch, r, c)."""
        item = dtype.itemsize
        if rows == 0 or cols == 0 or batch == 0:
            shape = (batch, cols, rows) if transposed else (batch, rows, cols)
            return np.zeros(shape, dtype)
        count = (batch - 1) * stride + (cols - 1) * ld + rows
        flat = self._backend.array(ptr, dtype, count)
        view = np.lib.stride_tricks.as_strided(
            flat, (batch, rows, cols), (stride * item, item, ld * item), writeable=False)
        return view.transpose(0, 2, 1) if transposed else view

    def _run(self, dtype: np.dtype, transa: int, transb: int, m: int, n: int, k: int,
             alpha: complex, a: int, lda: int, stride_a: int, rows_a: int, cols_a: int,
             b: int, ldb: int, stride_b: int, rows_b: int, cols_b: int, beta: complex, c: int,
             ldc: int, stride_c: int, batch: int, tf32: bool, half_accumulate: bool) -> None:
        if m == 0 or n == 0 or batch == 0:
            return
        op_a = self._matrices(a, dtype, lda, stride_a, rows_a, cols_a, batch, transa != OP_N)
        op_b = self._matrices(b, dtype, ldb, stride_b, rows_b, cols_b, batch, transb != OP_N)
        if dtype.kind == "c" or dtype == np.float64:
            product = np.matmul(op_a, op_b)
        elif dtype == np.float32:
            if tf32:
                op_a, op_b = round_to_tf32(op_a), round_to_tf32(op_b)
            product = np.matmul(op_a, op_b)
        elif half_accumulate:
            product = np.matmul(op_a.astype(np.float16), op_b.astype(np.float16))
        else:
            product = np.matmul(op_a.astype(np.float32), op_b.astype(np.float32))
        item = dtype.itemsize
        count = (batch - 1) * stride_c + (n - 1) * ldc + m
        flat = self._backend.array(c, dtype, count)
        out = np.lib.stride_tricks.as_strided(flat, (batch, m, n),
                                              (stride_c * item, item, ldc * item))
        if alpha != 1:
            product = product * (alpha if dtype.kind == "c" else alpha.real)
        if beta != 0:
            wide = np.float32 if dtype.itemsize == 2 else dtype
            product = product + (beta if dtype.kind == "c" else beta.real) * out.astype(wide)
        out[...] = product.astype(dtype)
