"""matmul's resolved GEMM calls (issue 42's small-matmul host time): the C call path
(:mod:`cudalab._driver.blascall`) and its ctypes twin give cuBLAS the same arguments, the
resolved call is made once per (layout, handle, settings state), the handle's records are
Ctrl-C safe, ``out`` takes the cached plan.

cuBLAS itself is replaced by stand-ins: ctypes callbacks with cublas_api.h's prototypes, so
both paths make real C calls into them on any machine and the arguments are read as C saw
them. The ``gpu`` test compares the two paths' results on cuBLAS.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
import sys

import numpy as np
import pytest

import cudalab
from cudalab import _array_matmul, _interrupts, blas
from cudalab._driver import blas_seam, cublas
from cudalab.errors import CublasError

VP, I32, I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
#: form -> the entry point's parameters (cublas_api.h); P marks a pointer, L a 64-bit stride
PROTOTYPES = {
    cublas.FORM_TYPED: "P i i i i i P P i P i P P i",
    cublas.FORM_TYPED_BATCHED: "P i i i i i P P i L P i L P P i L i",
    cublas.FORM_EX: "P i i i i i P P i i P i i P P i i i i",
    cublas.FORM_EX_BATCHED: "P i i i i i P P i i L P i i L P P i i L i i i",
}


def _form(name):
    if name.startswith("cublasGemm"):
        return cublas.FORM_EX_BATCHED if "Batched" in name else cublas.FORM_EX
    return cublas.FORM_TYPED_BATCHED if "Batched" in name else cublas.FORM_TYPED


def _scalar_size(name, data_type, compute_type):
    """Bytes of alpha / beta as cuBLAS reads them for this call (written out from the
    cuBLAS documentation, not from cudalab's code)."""
    if not name.startswith("cublasGemm"):
        return {"S": 4, "D": 8, "C": 8, "Z": 16}[name[6]]
    if compute_type == blas_seam.COMPUTE_16F:
        return 2
    if compute_type == blas_seam.COMPUTE_64F:
        return 16 if data_type == blas_seam.CUDA_C_64F else 8
    return 8 if data_type == blas_seam.CUDA_C_32F else 4


class StandInCublas:
    """cuBLAS's entry points as ctypes callbacks: each GEMM records its arguments (pointers
    as ints, alpha and beta as the bytes they point to) and returns ``status``."""

    def __init__(self, status=0):
        self.status = status
        self.calls = []  # (entry point, arguments)
        self.settings = []  # (setter, arguments)
        self._callbacks = {}

    def _gemm(self, name):
        codes = PROTOTYPES[_form(name)].split()
        types = [{"P": VP, "i": I32, "L": I64}[c] for c in codes]

        def entry(*args):
            args = list(args)
            form = _form(name)
            data_type = args[8] if form in (cublas.FORM_EX, cublas.FORM_EX_BATCHED) else None
            compute = args[-2] if data_type is not None else None
            size = _scalar_size(name, data_type, compute)
            beta_at = [i for i, c in enumerate(codes) if c == "P"][4]  # h, alpha, A, B, beta
            args[6] = ctypes.string_at(args[6], size)
            args[beta_at] = ctypes.string_at(args[beta_at], size)
            self.calls.append((name, tuple(args)))
            return self.status

        return ctypes.CFUNCTYPE(I32, *types)(entry)

    def _setter(self, name, types):
        def entry(*args):
            self.settings.append((name, args))
            return 0

        return ctypes.CFUNCTYPE(I32, *types)(entry)

    def __getitem__(self, name):
        if name not in self._callbacks:
            self._callbacks[name] = self._gemm(name)
        return self._callbacks[name]

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        types = {"cublasSetStream_v2": (VP, VP), "cublasSetWorkspace_v2": (VP, VP, ctypes.c_size_t),
                 "cublasSetMathMode": (VP, I32)}.get(name)
        if types is None:
            raise AttributeError(name)
        if name not in self._callbacks:
            self._callbacks[name] = self._setter(name, types)
        return self._callbacks[name]


PATHS = ["c", "ctypes"]


@pytest.fixture(autouse=True)
def _settings():
    """Every test ends with torch's default matmul settings and no plans or workspaces."""
    yield
    cudalab.set_float32_matmul_precision("highest")
    m = cudalab.backends.cuda.matmul
    m.allow_fp16_reduced_precision_reduction = True
    m.allow_bf16_reduced_precision_reduction = True
    m.allow_fp16_accumulation = False
    _array_matmul.clear_plans()
    _array_matmul.clear_workspaces()


def _use_path(monkeypatch, path):
    if path == "c" and cublas.blascall is None:
        pytest.skip("the optional C extension cudalab._driver.blascall is not built here")
    monkeypatch.setenv("CUDALAB_FASTCALL", "1" if path == "c" else "0")


@pytest.fixture
def stand_in(monkeypatch):
    """cuBLAS's library replaced by stand-ins (this thread's handle of device 0 made first,
    through the real library on a GPU)."""
    blas.bound_handle(0)
    fake = StandInCublas()
    monkeypatch.setattr(cublas, "_lib", fake)
    return fake


BIG = 0x7F12_3456_0000  # addresses above 2**32 must reach C whole
HANDLE = 0x55AA_0000_1000
CASES = [  # (data type, compute type, batch, typed entry points)
    (blas_seam.CUDA_R_32F, blas_seam.COMPUTE_32F, 1, True),
    (blas_seam.CUDA_R_32F, blas_seam.COMPUTE_32F_FAST_TF32, 3, True),
    (blas_seam.CUDA_R_64F, blas_seam.COMPUTE_64F, 1, True),
    (blas_seam.CUDA_C_32F, blas_seam.COMPUTE_32F, 2, True),
    (blas_seam.CUDA_C_64F, blas_seam.COMPUTE_64F, 1, True),
    (blas_seam.CUDA_R_16F, blas_seam.COMPUTE_32F, 1, True),
    (blas_seam.CUDA_R_16F, blas_seam.COMPUTE_16F, 4, True),
    (blas_seam.CUDA_R_16BF, blas_seam.COMPUTE_32F, 2, True),
    (blas_seam.CUDA_R_32F, blas_seam.COMPUTE_32F, 1, False),
    (blas_seam.CUDA_C_64F, blas_seam.COMPUTE_64F, 5, False),
]


def _pack(value, size, complex_type):
    """alpha / beta as cuBLAS reads them, from struct (independent of cudalab's encoding)."""
    if complex_type:
        return struct.pack({8: "ff", 16: "dd"}[size], value.real, value.imag)
    return struct.pack({2: "e", 4: "f", 8: "d"}[size], value.real)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("data_type,compute,batch,typed", CASES)
def test_both_call_paths_pass_cublas_each_argument(monkeypatch, stand_in, path, data_type,
                                                   compute, batch, typed):
    _use_path(monkeypatch, path)
    monkeypatch.setattr(cublas, "TYPED_ENTRY_POINTS", typed)
    complex_type = data_type in (blas_seam.CUDA_C_32F, blas_seam.CUDA_C_64F)
    alpha, beta = (1.5 - 2j, 0.25 + 1j) if complex_type else (1.5, -0.25)
    call = cublas.RealBlas().gemm_call(HANDLE, blas_seam.OP_T, blas_seam.OP_N, 8, 4, 2, alpha,
                                       8, 16, 2, 8, beta, 8, 32, batch, data_type, compute,
                                       blas_seam.GEMM_DEFAULT_TENSOR_OP)
    assert (type(call).__name__ == "GemmCall") == (path == "c")  # the path asked for is taken
    assert call(BIG, BIG + 4096, BIG + 8192) == 0
    assert call(BIG + 64, BIG + 4096, BIG + 8192) == 0  # a second call: the same arguments
    name = blas_seam.gemm_entry_point(data_type, batch == 1, typed)
    size = _scalar_size(name, data_type, compute)
    al, be = _pack(alpha, size, complex_type), _pack(beta, size, complex_type)
    head = (HANDLE, blas_seam.OP_T, blas_seam.OP_N, 8, 4, 2, al)
    form = _form(name)
    if form == cublas.FORM_TYPED:
        rest = (BIG, 8, BIG + 4096, 2, be, BIG + 8192, 8)
    elif form == cublas.FORM_TYPED_BATCHED:
        rest = (BIG, 8, 16, BIG + 4096, 2, 8, be, BIG + 8192, 8, 32, batch)
    elif form == cublas.FORM_EX:
        rest = (BIG, data_type, 8, BIG + 4096, data_type, 2, be, BIG + 8192, data_type, 8,
                compute, blas_seam.GEMM_DEFAULT_TENSOR_OP)
    else:
        rest = (BIG, data_type, 8, 16, BIG + 4096, data_type, 2, 8, be, BIG + 8192, data_type,
                8, 32, batch, compute, blas_seam.GEMM_DEFAULT_TENSOR_OP)
    assert stand_in.calls[0] == (name, head + rest)
    assert stand_in.calls[1][1][head.__len__()] == BIG + 64


@pytest.mark.parametrize("path", PATHS)
def test_a_failed_call_raises_naming_its_entry_point(monkeypatch, stand_in, path):
    _use_path(monkeypatch, path)
    stand_in.status = 13  # CUBLAS_STATUS_EXECUTION_FAILED
    real = cublas.RealBlas()
    call = real.gemm_call(HANDLE, 0, 0, 4, 4, 4, 1, 4, 0, 4, 0, 0, 4, 16, 1,
                          blas_seam.CUDA_R_32F, blas_seam.COMPUTE_32F, blas_seam.GEMM_DEFAULT)
    assert call(BIG, BIG, BIG) == 13
    with pytest.raises(CublasError, match="cublasSgemm_v2 failed: status 13"):
        real.raise_status(13, "cublasSgemm_v2")
    with pytest.raises(CublasError, match="cublasSgemmStridedBatched failed"):
        real.gemm(HANDLE, 0, 0, 4, 4, 4, 1, BIG, 4, 16, BIG, 4, 16, 0, BIG, 4, 16, 2,
                  blas_seam.CUDA_R_32F, blas_seam.COMPUTE_32F, blas_seam.GEMM_DEFAULT)


def test_the_c_call_checks_its_arguments():
    blascall = pytest.importorskip("cudalab._driver.blascall",
                                   reason="the optional C extension is not built here")
    stand_in = StandInCublas()
    address = ctypes.cast(stand_in["cublasSgemm_v2"], VP).value
    good = [0, address, HANDLE, 0, 0, 4, 4, 4, b"\0" * 4, 4, 0, 4, 0, b"\0" * 4, 4, 0, 1, 0,
            68, -1]
    call = blascall.GemmCall(*good)
    assert "GemmCall form 0 m=4 n=4 k=4" in repr(call)
    with pytest.raises(TypeError, match="takes 3 arguments"):
        call(1, 2)
    with pytest.raises(TypeError, match="keyword"):
        call(1, 2, c=3)
    with pytest.raises(OverflowError):
        call(-1, 2, 3)
    with pytest.raises(TypeError):
        call("a", 2, 3)
    for index, value, error, message in [
            (0, 4, ValueError, "unknown form 4"), (1, 0, ValueError, "address is 0"),
            (1, "f", TypeError, "address"), (2, "handle", TypeError, "driver handle"),
            (5, 2**31, OverflowError, None), (8, b"", ValueError, "alpha must be 1 to 16"),
            (13, b"\0" * 17, ValueError, "beta must be 1 to 16"), (10, 2**63, OverflowError, None)]:
        bad = list(good)
        bad[index] = value
        with pytest.raises(error, match=message):
            blascall.GemmCall(*bad)
    with pytest.raises(TypeError):
        blascall.GemmCall(*good[:-1])
    with pytest.raises(TypeError, match="keyword"):
        blascall.GemmCall(*good, form=0)
    assert stand_in.calls == []  # nothing reached the entry point


def test_the_ctypes_call_refuses_what_c_cannot_take(monkeypatch, stand_in):
    _use_path(monkeypatch, "ctypes")
    with pytest.raises(OverflowError, match="does not fit in a C int"):
        cublas.RealBlas().gemm_call(HANDLE, 0, 0, 2**31, 4, 4, 1, 4, 0, 4, 0, 0, 4, 16, 1,
                                    blas_seam.CUDA_R_32F, blas_seam.COMPUTE_32F, -1)


# ------------------------------------------------------------------ through cudalab.matmul
@contextlib.contextmanager
def _real_blas():
    """This thread's bound handle of device 0 made a RealBlas (over the stand-ins the test
    put in cublas._lib; its handle a made-up address); put back after (and the plans
    resolved for it forgotten)."""
    bound = blas.bound_handle(0)
    saved = (bound.blas, bound.handle, bound.stream, bound.workspace, bound.math_mode)
    _array_matmul.clear_plans()
    bound.blas, bound.handle = cublas.RealBlas(), HANDLE
    bound.stream = bound.workspace = bound.math_mode = None
    try:
        yield
    finally:
        _array_matmul.clear_plans()
        _array_matmul.clear_workspaces()
        bound.blas, bound.handle, bound.stream, bound.workspace, bound.math_mode = saved


def _sim_gemms(monkeypatch, run):
    """The seam arguments of each GEMM ``run()`` makes on the simulator's BLAS."""
    bound = blas.bound_handle(0)
    seen = []
    real = bound.blas.gemm

    def gemm(*args):
        seen.append(args)
        return real(*args)

    _array_matmul.clear_plans()
    monkeypatch.setattr(bound.blas, "gemm", gemm)
    run()
    monkeypatch.undo()
    _array_matmul.clear_plans()
    return seen


class _Transposed:
    """A transposed view of a 2-D DeviceArray's memory (through __cuda_array_interface__)."""

    def __init__(self, base):
        rows, cols = base.shape
        item = base.dtype.itemsize
        self.base = base
        self.__cuda_array_interface__ = {
            "shape": (cols, rows), "strides": (item, cols * item), "typestr": base.dtype.str,
            "data": (base.data_ptr(), False), "version": 3, "stream": None}


def _operands(rng):
    """Pairs whose GEMMs take each form: typed one matrix (one operand transposed), typed
    strided batch, GemmEx and GemmStridedBatchedEx."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    f32 = cudalab.asarray(rng.standard_normal((6, 8)).astype(np.float32))
    w = cudalab.asarray(rng.standard_normal((6, 3)).astype(np.float32))
    z = cudalab.asarray(rng.standard_normal((3, 4, 5)).astype(np.complex64))
    z2 = cudalab.asarray(rng.standard_normal((3, 5, 4)).astype(np.complex64))
    h = cudalab.asarray(rng.standard_normal((5, 5)).astype(np.float16))
    bf = cudalab.asarray(rng.standard_normal((2, 4, 4)).astype(ml_dtypes.bfloat16))
    return [(cudalab.asarray(_Transposed(f32)), w), (z, z2), (h, h), (bf, bf)]


@pytest.mark.parametrize("path", PATHS)
def test_matmul_gives_cublas_what_the_simulated_blas_gets(monkeypatch, stand_in, path):
    if not cudalab._internal.backend().simulated:
        pytest.skip("compares with the simulator's BLAS")
    rng = np.random.default_rng(3)
    pairs = _operands(rng)
    expected = _sim_gemms(monkeypatch, lambda: [x @ y for x, y in pairs])
    monkeypatch.setattr(cublas, "_lib", stand_in)  # (_sim_gemms undid the fixture's)
    _use_path(monkeypatch, path)
    with _real_blas():
        ours = [x @ y for x, y in pairs]
        before = len(stand_in.settings)
        pairs[0][0] @ pairs[0][1]
        pairs[0][0] @ pairs[0][1]
        again = stand_in.settings[before:]
        cudalab.set_float32_matmul_precision("high")
        pairs[0][0] @ pairs[0][1]
        pairs[0][0] @ pairs[0][1]
        tf32 = stand_in.settings[before:]
        before = len(stand_in.settings)
        _array_matmul.clear_workspaces()  # every handle sets its stream and workspace again
        pairs[0][0] @ pairs[0][1]
        cleared = [name for name, _ in stand_in.settings[before:]]
    assert len(stand_in.calls) == len(pairs) + 5 and len(expected) == len(pairs)
    for (name, args), seam, result in zip(stand_in.calls, expected, ours):
        (handle, transa, transb, m, n, k, _alpha, a, lda, stride_a, b, ldb, stride_b, _beta, c,
         ldc, stride_c, batch, data_type, compute, algo) = seam
        assert name == blas_seam.gemm_entry_point(data_type, batch == 1)
        assert args[0] == HANDLE and args[1:6] == (transa, transb, m, n, k)
        form = _form(name)
        pointers = [x for x, code in zip(args, PROTOTYPES[form].split()) if code == "P"][1:]
        assert pointers[1] == a and pointers[2] == b and pointers[4] == result.ptr
        values = [x for x, code in zip(args, PROTOTYPES[form].split()) if code in "iL"][5:]
        if form == cublas.FORM_TYPED:
            assert values == [lda, ldb, ldc]
        elif form == cublas.FORM_TYPED_BATCHED:
            assert values == [lda, stride_a, ldb, stride_b, ldc, stride_c, batch]
        elif form == cublas.FORM_EX:
            assert values == [data_type, lda, data_type, ldb, data_type, ldc, compute, algo]
        else:
            assert values == [data_type, lda, stride_a, data_type, ldb, stride_b, data_type, ldc,
                              stride_c, batch, compute, algo]
    # the handle's stream, workspace and math mode were set once, then only on a change
    setters = [name for name, _ in stand_in.settings]
    assert setters.count("cublasSetStream_v2") == 2  # once, and again after clear_workspaces
    assert setters.count("cublasSetWorkspace_v2") == 2
    assert again == []
    assert [(name, args[1]) for name, args in tf32] == [
        ("cublasSetMathMode", blas_seam.MATH_TF32_TENSOR_OP)]
    assert cleared == ["cublasSetStream_v2", "cublasSetWorkspace_v2", "cublasSetMathMode"]


def test_a_failed_gemm_raises_from_matmul(monkeypatch, stand_in):
    stand_in.status = 7
    x = cudalab.ones((4, 4))
    with _real_blas():
        for _ in range(2):  # planned, then cached
            with pytest.raises(CublasError, match="cublasSgemm_v2 failed: status 7"):
                x @ x
    monkeypatch.undo()  # the library back (a GPU's cuBLAS)
    np.testing.assert_array_equal((x @ x).cpu(), np.full((4, 4), 4, np.float32))


def _count_resolutions(monkeypatch):
    """The compute type of each GEMM call matmul resolves, and the handle it is for."""
    made = []
    real = _array_matmul._resolve

    def resolve(plan, bound, state):
        made.append((_array_matmul._math(plan.kind, state)[0], bound.handle))
        return real(plan, bound, state)

    monkeypatch.setattr(_array_matmul, "_resolve", resolve)
    return made


def test_a_call_is_resolved_once_per_handle_and_settings_state(monkeypatch):
    resolved = _count_resolutions(monkeypatch)

    def made():
        return [compute for compute, _handle in resolved]

    _array_matmul.clear_plans()
    x = cudalab.ones((4, 4))
    for _ in range(3):
        x @ x
    assert made() == [blas_seam.COMPUTE_32F]
    cudalab.set_float32_matmul_precision("high")
    x @ x
    x @ x
    assert made() == [blas_seam.COMPUTE_32F, blas_seam.COMPUTE_32F_FAST_TF32]
    cudalab.set_float32_matmul_precision("highest")
    np.testing.assert_array_equal((x @ x).cpu(), np.full((4, 4), 4, np.float32))
    assert made()[-1] == blas_seam.COMPUTE_32F and len(made()) == 3
    y = cudalab.ones((4, 4), dtype=np.float16)
    cudalab.backends.cuda.matmul.allow_fp16_accumulation = True
    y @ y
    cudalab.backends.cuda.matmul.allow_fp16_accumulation = False
    y @ y
    assert made()[-2:] == [blas_seam.COMPUTE_16F, blas_seam.COMPUTE_32F]
    _array_matmul.clear_plans()
    x @ x
    assert len(made()) == 6  # a forgotten plan is planned and resolved again


def test_the_settings_state_is_replaced_whole():
    from cudalab.matmul_precision import SETTINGS

    first = SETTINGS.state
    cudalab.set_float32_matmul_precision("medium")
    second = SETTINGS.state
    assert second is not first and second.float32_precision == "medium" and SETTINGS.tf32
    assert first.float32_precision == "highest"  # the old record is not changed
    cudalab.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    assert SETTINGS.state is not second
    assert SETTINGS.state.float32_precision == "medium"
    assert SETTINGS.allow_bf16_reduced_precision_reduction is False
    cudalab.set_float32_matmul_precision("highest")
    cudalab.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    assert SETTINGS.state == first and not SETTINGS.tf32


def test_ctrl_c_waits_while_the_handle_records_change():
    frames = []
    cudalab._internal.launch_observers.append(lambda *args: frames.append(sys._getframe(1)))
    try:
        x = cudalab.ones((4, 4))
        x @ x
    finally:
        cudalab._internal.launch_observers.clear()
    assert frames and frames[-1].f_code is _array_matmul._launch.__code__
    assert _interrupts.deferring(frames[-1])  # a KeyboardInterrupt is owed until it returns
    for function in (blas.bound_handle, blas.current_blas_handle, _array_matmul.clear_workspaces):
        assert function.__code__ in _interrupts._guarded_codes, function.__name__


def test_out_takes_the_cached_plan_and_is_still_checked():
    rng = np.random.default_rng(4)
    a = rng.standard_normal((5, 7)).astype(np.float32)
    b = rng.standard_normal((7, 3)).astype(np.float32)
    da, db = cudalab.asarray(a), cudalab.asarray(b)
    da @ db  # the plan is cached
    out = cudalab.empty((5, 3))
    assert cudalab.matmul(da, db, out=out) is out
    np.testing.assert_allclose(out.cpu(), a @ b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="out must be a float32 array of shape"):
        cudalab.matmul(da, db, out=cudalab.empty((3, 5)))
    with pytest.raises(ValueError, match="out must be a float32 array"):
        cudalab.matmul(da, db, out=cudalab.empty((5, 3), dtype=np.float64))
    wide = cudalab.empty((5, 6))
    with pytest.raises(ValueError, match="contiguous"):
        cudalab.matmul(da, db, out=wide.narrow(1, 0, 3))
    with pytest.raises(TypeError, match="out must be a cudalab DeviceArray"):
        cudalab.matmul(da, db, out=np.empty((5, 3), np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("name,shape", [("float32", (64, 64)), ("float16", (3, 64, 64)),
                                        ("complex64", (2, 32, 32))])
def test_gpu_c_and_ctypes_calls_give_bit_equal_results(monkeypatch, name, shape):
    if cudalab._internal.backend().simulated:
        pytest.skip("needs a real GPU (running on the simulator)")
    rng = np.random.default_rng(5)
    x = rng.standard_normal(shape)
    if name.startswith("complex"):
        x = x + 1j * rng.standard_normal(shape)
    d = cudalab.asarray(x.astype(name))
    results = {}
    for path in PATHS:
        if path == "c" and cublas.blascall is None:
            continue
        monkeypatch.setenv("CUDALAB_FASTCALL", "1" if path == "c" else "0")
        _array_matmul.clear_plans()
        d @ d  # planned
        results[path] = (d @ d).cpu()  # the cached plan's resolved call
    _array_matmul.clear_plans()
    assert "ctypes" in results
    if "c" in results:
        np.testing.assert_array_equal(results["c"], results["ctypes"])
    print(f"matmul calls: {sorted(results)} bit-equal ({name} {shape})")


def test_a_plan_shared_by_two_threads_calls_through_each_threads_handle(monkeypatch):
    import threading

    rng = np.random.default_rng(6)
    a = rng.standard_normal((16, 16)).astype(np.float32)
    da = cudalab.asarray(a)
    resolved = _count_resolutions(monkeypatch)
    _array_matmul.clear_plans()
    results = {}

    def run(name):
        for _ in range(3):
            results[name] = (da @ da).cpu()

    run("main")
    worker = threading.Thread(target=run, args=("worker",))
    worker.start()
    worker.join()
    run("main")
    handles = [handle for _compute, handle in resolved]
    assert len(set(handles)) == 2  # each thread's own handle, resolved again for it
    assert len(handles) == 3  # main, worker, main again: once per switch, not per call
    for product in results.values():
        np.testing.assert_allclose(product, a @ a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cached", [False, True], ids=["planned", "cached"])
@pytest.mark.parametrize("form", ["operator", "function", "out"])
def test_every_path_reports_to_the_stream_sanitizer(cached, form):
    from cudalab import sanitizer

    def run(x, out):
        return {"operator": lambda: x @ x, "function": lambda: cudalab.matmul(x, x),
                "out": lambda: cudalab.matmul(x, x, out=out)}[form]()

    _array_matmul.clear_plans()
    if cached:  # the plan made (and its call resolved) by other arrays of the same layout
        run(cudalab.ones((32, 32)), cudalab.empty((32, 32)))
        cudalab.synchronize()
    with sanitizer.sanitize(on_race="collect") as reports:
        x = cudalab.zeros((32, 32))
        out = cudalab.empty((32, 32))
        side = cudalab.Stream()
        with cudalab.stream(side):
            y = run(x, out)  # reads x, whose zeros were written on the default stream: a race
        found = [str(r) for r in reports.reports]
    assert any("during cublasSgemm_v2" in r for r in found), found
    assert (y is out) == (form == "out")
    side.synchronize()
    np.testing.assert_array_equal(y.cpu(), np.zeros((32, 32), np.float32))
