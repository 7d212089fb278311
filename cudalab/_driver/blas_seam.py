"""The BLAS library's seam: :class:`Blas` (:meth:`Backend.blas`), implemented by
:class:`cudalab._driver.cublas.RealBlas` (cuBLAS through ctypes) and
:class:`cudalab._driver.sim.blas.SimulatedBlas` (numpy, in stream order).

Only what ``cudalab.matmul`` needs: handles, their stream, workspace and math mode, and one
strided-batched GEMM (:meth:`Blas.gemm`, or :meth:`Blas.gemm_call`: the same GEMM with its
arguments resolved once, called with the matrices' addresses only: matmul's hot path), made through the entry point torch uses for the data type
(:func:`gemm_entry_point`: ``cublasSgemm_v2`` / ``cublasSgemmStridedBatched`` and the D, C,
Z forms; ``cublasGemmEx`` / ``cublasGemmStridedBatchedEx`` for half types). Matrices are column-major, as cuBLAS sees them; the caller turns row-major arrays
into that view. The ``CUDA_*``, ``COMPUTE_*`` and ``MATH_*`` numbers are cuBLAS's own.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import NoReturn

from cudalab._driver.handles import StreamHandle
from cudalab.errors import CublasError

__all__ = [
    "Blas", "CUDA_R_16F", "CUDA_R_16BF", "CUDA_R_32F", "CUDA_R_64F", "CUDA_C_32F", "CUDA_C_64F",
    "COMPUTE_16F", "COMPUTE_32F", "COMPUTE_32F_FAST_TF32", "COMPUTE_64F", "MATH_DEFAULT",
    "MATH_TF32_TENSOR_OP", "MATH_DISALLOW_REDUCED_PRECISION_REDUCTION", "OP_N", "OP_T",
    "GEMM_DEFAULT", "GEMM_DEFAULT_TENSOR_OP", "TYPED_GEMMS", "GemmCall", "gemm_entry_point",
]

#: One kind of GEMM, its arguments resolved (:meth:`Blas.gemm_call`): called with the device
#: addresses of cuBLAS's A, B and C, it queues the GEMM and returns the cublasStatus_t (0:
#: success; :meth:`Blas.raise_status` turns any other into the error).
GemmCall = Callable[[int, int, int], int]

#: cudaDataType_t values.
CUDA_R_32F = 0
CUDA_R_64F = 1
CUDA_R_16F = 2
CUDA_C_32F = 4
CUDA_C_64F = 5
CUDA_R_16BF = 14
#: cublasComputeType_t values.
COMPUTE_16F = 64
COMPUTE_32F = 68
COMPUTE_64F = 70
COMPUTE_32F_FAST_TF32 = 77
#: cublasMath_t values (the last one is a flag or-ed into the others).
MATH_DEFAULT = 0
MATH_TF32_TENSOR_OP = 3
MATH_DISALLOW_REDUCED_PRECISION_REDUCTION = 16
#: cublasOperation_t values.
OP_N = 0
OP_T = 1
#: cublasGemmAlgo_t values.
GEMM_DEFAULT = -1
GEMM_DEFAULT_TENSOR_OP = 99


#: data type -> (typed GEMM, typed strided-batched GEMM): cuBLAS's entry points per type.
TYPED_GEMMS = {CUDA_R_32F: ("cublasSgemm_v2", "cublasSgemmStridedBatched"),
               CUDA_R_64F: ("cublasDgemm_v2", "cublasDgemmStridedBatched"),
               CUDA_C_32F: ("cublasCgemm_v2", "cublasCgemmStridedBatched"),
               CUDA_C_64F: ("cublasZgemm_v2", "cublasZgemmStridedBatched")}


def gemm_entry_point(data_type: int, single: bool, typed: bool = True) -> str:
    """The cuBLAS entry point of a GEMM of ``data_type``: one matrix (``single``) or a
    strided batch; the typed one where the type has one and ``typed``, else the ``Ex`` one."""
    names = TYPED_GEMMS.get(data_type) if typed else None
    if names is None:
        return "cublasGemmEx" if single else "cublasGemmStridedBatchedEx"
    return names[0] if single else names[1]


class Blas(abc.ABC):
    """A BLAS library bound to one backend. Handles are plain ints.

    Every method may raise :class:`cudalab.CublasError` naming the call and the status (or,
    when the library cannot be loaded, what to install).
    """

    simulated: bool = False

    @abc.abstractmethod
    def create(self, device: int) -> int:
        """A new handle on ``device`` (its context is current)."""

    @abc.abstractmethod
    def destroy(self, handle: int) -> None:
        """Release ``handle``."""

    @abc.abstractmethod
    def set_stream(self, handle: int, stream: StreamHandle) -> None:
        """Queue the handle's later work on ``stream``."""

    @abc.abstractmethod
    def set_workspace(self, handle: int, ptr: int, nbytes: int) -> None:
        """The handle's workspace: ``nbytes`` of device memory at ``ptr`` (0, 0: none)."""

    @abc.abstractmethod
    def set_math_mode(self, handle: int, mode: int) -> None:
        """The handle's math mode (``MATH_*``, or-ed with the flag)."""

    def entry_point(self, data_type: int, single: bool) -> str:
        """The cuBLAS entry point :meth:`gemm` calls (or stands for) for ``data_type``."""
        return gemm_entry_point(data_type, single)

    @abc.abstractmethod
    def gemm(self, handle: int, transa: int, transb: int, m: int, n: int, k: int,
             alpha: complex, a: int, lda: int, stride_a: int, b: int, ldb: int, stride_b: int,
             beta: complex, c: int, ldc: int, stride_c: int, batch: int, data_type: int,
             compute_type: int, algo: int) -> None:
        """``C[i] = alpha op(A[i]) op(B[i]) + beta C[i]`` for ``i < batch``, column-major.

        ``a``, ``b``, ``c`` are device addresses of ``data_type`` elements (all three the
        same type); strides are in elements (0: the same matrix for every ``i``). ``alpha``
        and ``beta`` are host scalars of the compute type (float32 for half inputs).
        """

    def gemm_call(self, handle: int, transa: int, transb: int, m: int, n: int, k: int,
                  alpha: complex, lda: int, stride_a: int, ldb: int, stride_b: int,
                  beta: complex, ldc: int, stride_c: int, batch: int, data_type: int,
                  compute_type: int, algo: int) -> GemmCall:
        """:meth:`gemm` with every argument but the matrices' addresses given once: the
        returned callable takes ``(a, b, c)`` and returns the status (0: success). Made once
        per kind of GEMM and kept by the caller (``cudalab.matmul``'s resolved plans).

        This default calls :meth:`gemm` (looked up at each call, so a wrapper set on the
        instance sees every call) and returns 0, as :meth:`gemm` raises its own errors.
        """
        def call(a: int, b: int, c: int) -> int:
            self.gemm(handle, transa, transb, m, n, k, alpha, a, lda, stride_a, b, ldb,
                      stride_b, beta, c, ldc, stride_c, batch, data_type, compute_type, algo)
            return 0

        return call

    def raise_status(self, status: int, call: str) -> NoReturn:
        """Raise the :class:`cudalab.CublasError` of a failed ``call`` (a cuBLAS entry point's
        name) that returned ``status`` (not 0)."""
        raise CublasError(f"{call} failed: status {status}", status)
