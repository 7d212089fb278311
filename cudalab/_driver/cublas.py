"""cuBLAS through ctypes: the library loaded by ``cuda.pathfinder`` (the driver seam).

Why this dependency: ``cuda.pathfinder`` ships with cuda-bindings 13 (already a cudalab
dependency) and finds the cuBLAS that the NVIDIA wheels install (``nvidia-cublas`` for CUDA
13, ``nvidia-cublas-cu12``, which every CUDA build of torch brings) or a CUDA toolkit, so
no new Python package is needed: the ``cublas`` extra only adds the library wheel.
nvmath-python's bindings would add a large package for the four calls cudalab makes.

Only what :mod:`cudalab.blas` and ``cudalab.matmul`` need is declared: ``cublasCreate_v2``,
``cublasDestroy_v2``, ``cublasSetStream_v2``, ``cublasGetStream_v2``, ``cublasSgemm_v2``
(tests run a GEMM through a handle), ``cublasSetWorkspace_v2``, ``cublasSetMathMode``,
``cublasGemmEx`` and ``cublasGemmStridedBatchedEx``. Handles and stream handles are plain
ints. Every failing call raises :class:`cudalab.errors.CublasError` naming the call and
cuBLAS's status string. :class:`RealBlas` is the seam's :class:`~.blas_seam.Blas` over them.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, NoReturn

from cudalab._driver.blas_seam import (
    COMPUTE_16F,
    COMPUTE_64F,
    CUDA_C_32F,
    CUDA_C_64F,
    TYPED_GEMMS,
    Blas,
    GemmCall,
    gemm_entry_point,
)
from cudalab._driver.handles import StreamHandle
from cudalab._driver.nvidia_library import open_library
from cudalab.errors import CublasError

__all__ = ["FORM_EX", "FORM_EX_BATCHED", "FORM_TYPED", "FORM_TYPED_BATCHED", "RealBlas",
           "c_calls_available", "create", "destroy", "get_stream", "library", "set_stream",
           "sgemm"]

INSTALL_HINT = ("install cuBLAS with `pip install nvidia-cublas` (CUDA 13) or "
                "`pip install cudalab[cublas]`; torch's CUDA wheels bring one too")
#: sonames tried when cuda.pathfinder reports the library as loaded without a path.
_SONAMES = ("libcublas.so.13", "libcublas.so.12")

_lock = threading.Lock()
_lib: Any = None  # the ctypes.CDLL once loaded and declared

#: cublasOperation_t values.
OP_N = 0
OP_T = 1


def library() -> Any:
    """The loaded cuBLAS library (ctypes), loading it on the first call.

    Raises
    ------
    CublasError
        cuBLAS (or cuda.pathfinder) is not installed.
    """
    lib = _lib
    return lib if lib is not None else _load()


def _load() -> Any:
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        lib = open_library("cublas", "cuBLAS", _SONAMES, CublasError, INSTALL_HINT)
        vp, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        for name, args in (
            ("cublasCreate_v2", (ctypes.POINTER(vp),)),
            ("cublasDestroy_v2", (vp,)),
            ("cublasSetStream_v2", (vp, vp)),
            ("cublasGetStream_v2", (vp, ctypes.POINTER(vp))),
            ("cublasSgemm_v2", (vp, i32, i32, i32, i32, i32, vp, vp, i32, vp, i32, vp, vp, i32)),
            ("cublasSetWorkspace_v2", (vp, vp, ctypes.c_size_t)),
            ("cublasSetMathMode", (vp, i32)),
            ("cublasGemmEx", (vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, vp, i32, i32, vp,
                              vp, i32, i32, i32, i32)),
            ("cublasGemmStridedBatchedEx", (vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, i64,
                                            vp, i32, i32, i64, vp, vp, i32, i32, i64, i32, i32,
                                            i32)),
        ):
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = i32
        try:
            lib.cublasGetStatusString.argtypes = (i32,)
            lib.cublasGetStatusString.restype = ctypes.c_char_p
        except AttributeError:  # pragma: no cover - cuBLAS < 11.4
            pass
        _lib = lib
        return lib


def _check(status: int, call: str) -> None:
    if status == 0:
        return
    text = f"status {status}"
    try:
        raw = _lib.cublasGetStatusString(status)
        if raw:
            text = f"{raw.decode(errors='replace')} (status {status})"
    except Exception:  # pragma: no cover - only when the library misbehaves
        pass
    raise CublasError(f"{call} failed: {text}", status)


def create() -> int:
    """A new cuBLAS handle for the current CUDA context (cublasCreate_v2)."""
    lib = library()
    handle = ctypes.c_void_p()
    _check(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate_v2")
    return int(handle.value or 0)


def destroy(handle: int) -> None:
    """Release ``handle`` (cublasDestroy_v2)."""
    _check(library().cublasDestroy_v2(ctypes.c_void_p(handle)), "cublasDestroy_v2")


def set_stream(handle: int, stream: int) -> None:
    """Bind ``handle`` to the CUDA stream ``stream`` (a raw handle; 0 the legacy default)."""
    _check(library().cublasSetStream_v2(ctypes.c_void_p(handle), ctypes.c_void_p(stream)),
           "cublasSetStream_v2")


def get_stream(handle: int) -> int:
    """The raw CUDA stream ``handle`` is bound to (cublasGetStream_v2)."""
    out = ctypes.c_void_p()
    _check(library().cublasGetStream_v2(ctypes.c_void_p(handle), ctypes.byref(out)),
           "cublasGetStream_v2")
    return int(out.value or 0)


def sgemm(handle: int, transa: int, transb: int, m: int, n: int, k: int, alpha: float,
          a: int, lda: int, b: int, ldb: int, beta: float, c: int, ldc: int) -> None:
    """``C = alpha * op(A) @ op(B) + beta * C`` in float32, column-major (cublasSgemm_v2).

    ``a``, ``b``, ``c`` are device addresses; ``alpha`` and ``beta`` are host scalars.
    """
    al, be = ctypes.c_float(alpha), ctypes.c_float(beta)
    _check(library().cublasSgemm_v2(
        ctypes.c_void_p(handle), transa, transb, m, n, k, ctypes.byref(al), ctypes.c_void_p(a),
        lda, ctypes.c_void_p(b), ldb, ctypes.byref(be), ctypes.c_void_p(c), ldc),
        "cublasSgemm_v2")


def _scalar(value: complex, data_type: int, compute_type: int) -> Any:
    """``value`` as the host scalar cuBLAS reads for ``compute_type`` (a ctypes object)."""
    if compute_type == COMPUTE_16F:
        import numpy as np

        return ctypes.c_uint16(int(np.float16(value.real).view(np.uint16)))
    if compute_type == COMPUTE_64F:
        if data_type == CUDA_C_64F:
            return (ctypes.c_double * 2)(value.real, value.imag)
        return ctypes.c_double(value.real)
    if data_type == CUDA_C_32F:
        return (ctypes.c_float * 2)(value.real, value.imag)
    return ctypes.c_float(value.real)


#: Whether float32 / float64 / complex GEMMs call cuBLAS's typed entry points
#: (``cublasSgemm_v2``... and their ``StridedBatched`` forms: torch's calls, TF32 then from
#: the math mode) rather than ``cublasGemmEx`` with the compute type. Both give bit-equal
#: results on an H200 (benchmarks/blas_fft.py); the typed ones cost the host less.
TYPED_ENTRY_POINTS = True

_VP = ctypes.c_void_p
_I64 = ctypes.c_longlong

#: The forms of GEMM call, as cudalab._driver.blascall numbers them: typed one matrix, typed
#: strided batch, cublasGemmEx, cublasGemmStridedBatchedEx.
FORM_TYPED, FORM_TYPED_BATCHED, FORM_EX, FORM_EX_BATCHED = 0, 1, 2, 3

try:  # the C call path (setup.py builds it where a compiler is found)
    from cudalab._driver import blascall  # type: ignore[attr-defined]  # C, no stub
except ImportError:  # pragma: no cover - only where the extension is not built
    blascall = None


def c_calls_available() -> bool:
    """Whether GEMM calls are made from C (:mod:`cudalab._driver.blascall` is built and
    ``CUDALAB_FASTCALL=0`` does not turn it off; read when a call is resolved)."""
    from cudalab._driver.cuda_api import fastcall_turned_off

    return blascall is not None and not fastcall_turned_off()


def _form(data_type: int, single: bool) -> int:
    if data_type in TYPED_GEMMS and TYPED_ENTRY_POINTS:
        return FORM_TYPED if single else FORM_TYPED_BATCHED
    return FORM_EX if single else FORM_EX_BATCHED


class RealBlas(Blas):
    """The seam's BLAS over cuBLAS (loaded on the first call that needs it).

    :meth:`gemm_call` resolves a kind of GEMM once: a :class:`blascall.GemmCall` (C, about
    0.1 us a call) where the extension is built, else a closure that calls the entry point
    through ctypes without argument declarations (each argument passed as the C type it
    already is: handles and addresses as ``c_void_p``, 64-bit strides as ``c_longlong``, the
    rest as C ints; about 1.1 us a call for cublasSgemm_v2's 14). Both pass cuBLAS the same
    arguments (tests/array/test_matmul_calls.py).
    """

    def __init__(self) -> None:
        #: (value, data type, compute type) -> its ctypes scalar: alpha and beta are nearly
        #: always 1 and 0, so resolving a call builds none.
        self._scalars: dict[tuple[complex, int, int], Any] = {}
        #: entry point name -> its undeclared function (made once)
        self._entries: dict[str, Any] = {}

    def create(self, device: int) -> int:
        return create()

    def destroy(self, handle: int) -> None:
        destroy(handle)

    def set_stream(self, handle: int, stream: StreamHandle) -> None:
        set_stream(handle, int(stream))  # type: ignore[call-overload]

    def set_workspace(self, handle: int, ptr: int, nbytes: int) -> None:
        _check(library().cublasSetWorkspace_v2(handle, ptr or None, nbytes),
               "cublasSetWorkspace_v2")

    def set_math_mode(self, handle: int, mode: int) -> None:
        _check(library().cublasSetMathMode(handle, mode), "cublasSetMathMode")

    def raise_status(self, status: int, call: str) -> NoReturn:
        _check(status, call)
        raise AssertionError("unreachable: a failed call's status is not 0")  # pragma: no cover

    def _scalar(self, value: complex, data_type: int, compute_type: int) -> Any:
        key = (value, data_type, compute_type)
        scalar = self._scalars.get(key)
        if scalar is None:
            scalar = self._scalars[key] = _scalar(value, data_type, compute_type)
        return scalar

    def _entry(self, name: str) -> Any:
        fn = self._entries.get(name)
        if fn is None:
            fn = library()[name]  # a new function object: no argtypes, unlike lib.<name>
            fn.restype = ctypes.c_int
            self._entries[name] = fn
        return fn

    def entry_point(self, data_type: int, single: bool) -> str:
        return gemm_entry_point(data_type, single, TYPED_ENTRY_POINTS)

    def gemm_call(self, handle: int, transa: int, transb: int, m: int, n: int, k: int,
                  alpha: complex, lda: int, stride_a: int, ldb: int, stride_b: int,
                  beta: complex, ldc: int, stride_c: int, batch: int, data_type: int,
                  compute_type: int, algo: int) -> GemmCall:
        single = batch == 1
        form = _form(data_type, single)
        fn = self._entry(gemm_entry_point(data_type, single, TYPED_ENTRY_POINTS))
        al = self._scalar(alpha, data_type, compute_type)
        be = self._scalar(beta, data_type, compute_type)
        address = None
        if c_calls_available():
            try:
                address = ctypes.cast(fn, _VP).value
            except (TypeError, ctypes.ArgumentError):  # not a C function (a test's stand-in)
                address = None
        if address:
            return blascall.GemmCall(  # type: ignore[no-any-return]
                form, address, handle, transa, transb, m, n, k, bytes(al), lda, stride_a, ldb,
                stride_b, bytes(be), ldc, stride_c, batch, data_type, compute_type, algo)
        return _ctypes_call(fn, form, handle, transa, transb, m, n, k, al, lda, stride_a, ldb,
                            stride_b, be, ldc, stride_c, batch, data_type, compute_type, algo)

    def gemm(self, handle: int, transa: int, transb: int, m: int, n: int, k: int,
             alpha: complex, a: int, lda: int, stride_a: int, b: int, ldb: int, stride_b: int,
             beta: complex, c: int, ldc: int, stride_c: int, batch: int, data_type: int,
             compute_type: int, algo: int) -> None:
        status = self.gemm_call(handle, transa, transb, m, n, k, alpha, lda, stride_a, ldb,
                                stride_b, beta, ldc, stride_c, batch, data_type, compute_type,
                                algo)(a, b, c)
        if status:
            _check(status, gemm_entry_point(data_type, batch == 1, TYPED_ENTRY_POINTS))


def _ctypes_call(fn: Any, form: int, handle: int, transa: int, transb: int, m: int, n: int,
                 k: int, alpha: Any, lda: int, stride_a: int, ldb: int, stride_b: int,
                 beta: Any, ldc: int, stride_c: int, batch: int, data_type: int,
                 compute_type: int, algo: int) -> GemmCall:
    """The pure-Python twin of :class:`blascall.GemmCall`: ``fn`` (the entry point of
    ``form``) called through ctypes with the same arguments, the constant ones converted
    once. ``alpha`` and ``beta`` are the ctypes scalars (kept alive by the closure)."""
    for value in (transa, transb, m, n, k, lda, ldb, ldc, batch, data_type, compute_type, algo):
        if not -2**31 <= value < 2**31:  # as GemmCall's constructor refuses them
            raise OverflowError(f"a GEMM argument does not fit in a C int: {value}")
    h, al, be = _VP(handle), ctypes.byref(alpha), ctypes.byref(beta)
    sa, sb, sc = _I64(stride_a), _I64(stride_b), _I64(stride_c)
    vp = _VP
    if form == FORM_TYPED:
        def call(a: int, b: int, c: int) -> int:
            return fn(h, transa, transb, m, n, k, al, vp(a), lda, vp(b), ldb, be,  # type: ignore[no-any-return]
                      vp(c), ldc)
    elif form == FORM_TYPED_BATCHED:
        def call(a: int, b: int, c: int) -> int:
            return fn(h, transa, transb, m, n, k, al, vp(a), lda, sa, vp(b), ldb,  # type: ignore[no-any-return]
                      sb, be, vp(c), ldc, sc, batch)
    elif form == FORM_EX:
        def call(a: int, b: int, c: int) -> int:
            return fn(h, transa, transb, m, n, k, al, vp(a), data_type, lda,  # type: ignore[no-any-return]
                      vp(b), data_type, ldb, be, vp(c), data_type, ldc, compute_type, algo)
    else:
        def call(a: int, b: int, c: int) -> int:
            return fn(h, transa, transb, m, n, k, al, vp(a), data_type, lda, sa,  # type: ignore[no-any-return]
                      vp(b), data_type, ldb, sb, be, vp(c), data_type, ldc, sc, batch,
                      compute_type, algo)
    return call
