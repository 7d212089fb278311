"""cudalab.matmul and ``@`` (issue 42): shapes, layouts, dtypes, TF32 and the reduced-precision
switches, the cuBLAS workspace from the caching allocator, bad input. The simulator runs the
seam's numpy BLAS; the ``gpu`` tests compare with torch on a real GPU."""

from __future__ import annotations

import numpy as np
import pytest

import cudalab
from cudalab import _array_matmul, blas
from cudalab._driver import blas_seam
from cudalab._driver.sim.blas import round_to_tf32

DTYPES = ["float16", "bfloat16", "float32", "float64", "complex64", "complex128"]
#: torch's own tolerances (torch.testing's defaults per dtype, scaled for a k=64 product).
TOLERANCES = {"float16": (1e-3, 1e-2), "bfloat16": (1.6e-2, 5e-2), "float32": (1.3e-6, 1e-4),
              "float64": (1e-7, 1e-9), "complex64": (1.3e-6, 1e-4),
              "complex128": (1e-7, 1e-9)}


def _dtype(name):
    if name == "bfloat16":
        return np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    return np.dtype(name)


def _random(rng, shape, name):
    x = rng.standard_normal(shape)
    if name.startswith("complex"):
        x = x + 1j * rng.standard_normal(shape)
    return x.astype(_dtype(name))


@pytest.fixture(autouse=True)
def _settings():
    """Every test starts and ends with torch's defaults, and gives its workspaces back."""
    m = cudalab.backends.cuda.matmul
    yield
    _array_matmul.clear_workspaces()  # later tests' allocator figures start from nothing of ours
    cudalab.set_float32_matmul_precision("highest")
    m.allow_fp16_reduced_precision_reduction = True
    m.allow_bf16_reduced_precision_reduction = True
    m.allow_fp16_accumulation = False


class _Foreign:
    """A strided view of a DeviceArray's memory, imported through __cuda_array_interface__."""

    def __init__(self, base, shape, strides):
        self.base = base
        self.__cuda_array_interface__ = {
            "shape": shape, "strides": strides, "typestr": base.dtype.str,
            "data": (base.data_ptr(), False), "version": 3, "stream": None}


@pytest.mark.parametrize("name", DTYPES)
def test_each_dtype_matches_the_product_in_double(name):
    rng = np.random.default_rng(1)
    a, b = _random(rng, (33, 64), name), _random(rng, (64, 17), name)
    c = cudalab.matmul(cudalab.asarray(a), cudalab.asarray(b))
    assert c.dtype == _dtype(name) and c.shape == (33, 17)
    wide = np.complex128 if name.startswith("complex") else np.float64
    expected = a.astype(wide) @ b.astype(wide)
    rtol, atol = TOLERANCES[name]
    np.testing.assert_allclose(c.cpu().astype(wide), expected, rtol=rtol * 64, atol=atol * 64)


@pytest.mark.parametrize("a_shape,b_shape,out_shape", [
    ((5, 7), (7, 3), (5, 3)),
    ((4, 5, 7), (4, 7, 3), (4, 5, 3)),
    ((4, 5, 7), (7, 3), (4, 5, 3)),  # folded into one GEMM
    ((5, 7), (4, 7, 3), (4, 5, 3)),  # the matrix broadcast over the batch
    ((1, 5, 7), (4, 7, 3), (4, 5, 3)),
    ((4, 5, 7), (1, 7, 3), (4, 5, 3)),
    ((7,), (7, 3), (3,)),
    ((5, 7), (7,), (5,)),
    ((7,), (7,), ()),
    ((7,), (4, 7, 3), (4, 3)),
    ((4, 5, 7), (7,), (4, 5)),
    ((0, 7), (7, 3), (0, 3)),
    ((4, 5, 0), (4, 0, 3), (4, 5, 3)),  # k == 0: zeros
    ((2, 3, 5, 7), (2, 3, 7, 4), (2, 3, 5, 4)),  # more batch dimensions: flattened
    ((2, 3, 5, 7), (7, 4), (2, 3, 5, 4)),
    ((5, 7), (2, 3, 7, 4), (2, 3, 5, 4)),
    ((1, 1, 5, 7), (2, 3, 7, 4), (2, 3, 5, 4)),
    ((3, 5, 7), (2, 3, 7, 4), (2, 3, 5, 4)),
    ((7,), (2, 3, 7, 4), (2, 3, 4)),
    ((2, 1, 5, 7), (1, 3, 7, 4), (2, 3, 5, 4)),  # broadcast in part: expanded copies
    ((2, 3, 5, 7), (7,), (2, 3, 5)),
])
def test_shapes_follow_torch_matmul(a_shape, b_shape, out_shape):
    rng = np.random.default_rng(2)
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    c = cudalab.asarray(a) @ cudalab.asarray(b)
    assert c.shape == out_shape == np.matmul(a, b).shape
    np.testing.assert_allclose(c.cpu(), np.matmul(a, b), rtol=1e-5, atol=1e-5)


def test_transposed_and_strided_operands_are_read_in_place_or_copied():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((6, 8)).astype(np.float32)
    b = rng.standard_normal((8, 10)).astype(np.float32)
    da, db = cudalab.asarray(a), cudalab.asarray(b)
    # a column-major view of a's memory: the matrix a.T (8 x 6), read with a transpose flag
    at = cudalab.asarray(_Foreign(da, (8, 6), (4, 32)))
    assert not at.is_contiguous()
    np.testing.assert_allclose((at @ cudalab.asarray(a)).cpu(), a.T @ a, rtol=1e-5, atol=1e-5)
    # rows with a leading dimension larger than the width (narrow): read in place
    part = db.narrow(1, 2, 5)
    np.testing.assert_allclose((da @ part).cpu(), a @ b[:, 2:7], rtol=1e-5, atol=1e-5)
    # neither rows nor columns contiguous (every other column): copied first, as torch
    every_other = cudalab.asarray(_Foreign(db, (8, 5), (40, 8)))
    np.testing.assert_allclose((da @ every_other).cpu(), a @ b[:, ::2], rtol=1e-5, atol=1e-5)
    # a batch of transposed matrices
    batch = rng.standard_normal((3, 8, 6)).astype(np.float32)
    dbatch = cudalab.asarray(batch)
    transposed = cudalab.asarray(_Foreign(dbatch, (3, 6, 8), (192, 4, 24)))
    np.testing.assert_allclose((transposed @ db).cpu(), batch.transpose(0, 2, 1) @ b,
                               rtol=1e-5, atol=1e-5)


def test_out_receives_the_product():
    rng = np.random.default_rng(4)
    a = rng.standard_normal((5, 7)).astype(np.float64)
    out = cudalab.empty((5, 5), dtype=np.float64)
    assert cudalab.matmul(cudalab.asarray(a), cudalab.asarray(a.T.copy()), out=out) is out
    np.testing.assert_allclose(out.cpu(), a @ a.T)


def test_tf32_rounds_float32_inputs_and_is_off_by_default():
    rng = np.random.default_rng(5)
    a = rng.standard_normal((32, 48)).astype(np.float32)
    b = rng.standard_normal((48, 16)).astype(np.float32)
    da, db = cudalab.asarray(a), cudalab.asarray(b)
    assert cudalab.backends.cuda.matmul.allow_tf32 is False
    assert cudalab.get_float32_matmul_precision() == "highest"
    exact = (da @ db).cpu()
    np.testing.assert_allclose(exact, a @ b, rtol=1e-5, atol=1e-5)
    cudalab.backends.cuda.matmul.allow_tf32 = True
    assert cudalab.get_float32_matmul_precision() == "high"
    tf32 = (da @ db).cpu()
    model = round_to_tf32(a) @ round_to_tf32(b)
    if cudalab._internal.backend().simulated:  # the simulator's model of TF32, exactly
        np.testing.assert_allclose(tf32, model, rtol=1e-5, atol=1e-5)
    else:  # the tensor cores' rounding of the inputs may differ from round-to-nearest
        np.testing.assert_allclose(tf32, model, rtol=1e-2, atol=2e-2)
    assert np.abs(tf32 - a @ b).max() > 10 * np.abs(exact - a @ b).max()
    # "medium" is TF32 on cuBLAS too; "highest" turns it off; fp32_precision is the same switch
    cudalab.set_float32_matmul_precision("medium")
    assert cudalab.backends.cuda.matmul.allow_tf32 is True
    assert cudalab.backends.cuda.matmul.fp32_precision == "tf32"
    cudalab.backends.cuda.matmul.fp32_precision = "ieee"
    assert cudalab.get_float32_matmul_precision() == "highest"
    np.testing.assert_array_equal((da @ db).cpu(), exact)


def test_round_to_tf32_keeps_ten_mantissa_bits():
    x = np.array([1 + 2**-10, 1 + 2**-11, 1 + 2**-12, -3.0, np.inf, np.nan], np.float32)
    r = round_to_tf32(x)
    assert r[0] == np.float32(1 + 2**-10)  # representable
    assert r[1] == np.float32(1 + 2**-10)  # a tie: away from zero
    assert r[2] == 1.0
    assert r[3] == -3.0 and np.isinf(r[4]) and np.isnan(r[5])


def _recording(monkeypatch):
    """Record the compute type and math mode of each GEMM on this thread's handle.

    Through the seam's ``gemm_call`` (what matmul's resolved plans call: on a GPU the C call
    of cudalab._driver.blascall, which never passes through ``gemm``), with the plan cache
    emptied for the test so that every plan is resolved through the recording."""
    bound = blas.bound_handle(cudalab.current_device())
    calls = []
    real_gemm_call, real_mode = bound.blas.gemm_call, bound.blas.set_math_mode

    def gemm_call(*args):
        call = real_gemm_call(*args)
        compute_type, algo = args[-2], args[-1]

        def recorded(a, b, c):
            calls.append(("gemm", compute_type, algo, bound.math_mode))
            return call(a, b, c)

        return recorded

    def set_math_mode(handle, mode):
        calls.append(("mode", mode))
        return real_mode(handle, mode)

    monkeypatch.setattr(_array_matmul, "_plans", {})  # (restored after: the plans made here
    monkeypatch.setattr(bound.blas, "gemm_call", gemm_call)  # hold the recording)
    monkeypatch.setattr(bound.blas, "set_math_mode", set_math_mode)
    return calls


@pytest.mark.parametrize("name,flag,mode", [
    ("float16", "allow_fp16_reduced_precision_reduction",
     blas_seam.MATH_DISALLOW_REDUCED_PRECISION_REDUCTION),
    ("bfloat16", "allow_bf16_reduced_precision_reduction",
     blas_seam.MATH_DISALLOW_REDUCED_PRECISION_REDUCTION),
])
def test_reduced_precision_flags_set_the_math_mode(monkeypatch, name, flag, mode):
    rng = np.random.default_rng(6)
    a = cudalab.asarray(_random(rng, (8, 8), name))
    calls = _recording(monkeypatch)
    settings = cudalab.backends.cuda.matmul
    assert getattr(settings, flag) is True
    a @ a
    assert calls[-1] == ("gemm", blas_seam.COMPUTE_32F, blas_seam.GEMM_DEFAULT_TENSOR_OP,
                         blas_seam.MATH_DEFAULT)
    setattr(settings, flag, False)
    a @ a
    assert calls[-1] == ("gemm", blas_seam.COMPUTE_32F, blas_seam.GEMM_DEFAULT_TENSOR_OP, mode)


def test_compute_types_follow_the_settings(monkeypatch):
    calls = _recording(monkeypatch)
    x32 = cudalab.ones((4, 4))
    x32 @ x32
    assert calls[-1][1:] == (blas_seam.COMPUTE_32F, blas_seam.GEMM_DEFAULT, blas_seam.MATH_DEFAULT)
    cudalab.set_float32_matmul_precision("high")
    x32 @ x32
    assert calls[-1][1:] == (blas_seam.COMPUTE_32F_FAST_TF32, blas_seam.GEMM_DEFAULT,
                             blas_seam.MATH_TF32_TENSOR_OP)
    x64 = cudalab.ones((4, 4), dtype=np.float64)
    x64 @ x64
    assert calls[-1][1] == blas_seam.COMPUTE_64F
    cudalab.backends.cuda.matmul.allow_fp16_accumulation = True
    h = cudalab.ones((4, 4), dtype=np.float16)
    np.testing.assert_array_equal((h @ h).cpu(), np.full((4, 4), 4, np.float16))
    assert calls[-1][1] == blas_seam.COMPUTE_16F
    # the math mode is set only when it changes
    x32 @ x32  # TF32's mode
    modes = [c for c in calls if c[0] == "mode"]
    assert modes[-1] == ("mode", blas_seam.MATH_TF32_TENSOR_OP)
    x64 @ x64
    x64 @ x64
    assert [c for c in calls if c[0] == "mode"] == modes + [("mode", blas_seam.MATH_DEFAULT)]


def test_launch_observers_see_the_cublas_call():
    seen = []
    cudalab._internal.launch_observers.append(lambda name, *rest: seen.append(name))
    try:
        x = cudalab.ones((4, 4))
        x @ x
        cudalab.ones((2, 4, 4)) @ cudalab.ones((2, 4, 4))
        h = cudalab.ones((4, 4), dtype=np.float16)
        h @ h
        z = cudalab.ones((2, 4, 4), dtype=np.complex128)
        z @ z
    finally:
        cudalab._internal.launch_observers.clear()
    assert [name for name in seen if name.startswith("cublas")] == [
        "cublasSgemm_v2", "cublasSgemmStridedBatched", "cublasGemmEx",
        "cublasZgemmStridedBatched"]  # torch's entry point for each type


def test_the_workspace_comes_from_the_caching_allocator(monkeypatch):
    from cudalab import _array_matmul

    _array_matmul.clear_workspaces()
    size = _array_matmul.workspace_size(0)
    major = cudalab.get_device_properties(0).major
    assert size == (32 << 20 if major >= 9 else 8519680)
    s = cudalab.Stream()
    x = cudalab.ones((8, 8))
    s.wait_stream(cudalab.current_stream())
    cudalab.synchronize()
    before = cudalab.memory_allocated()
    with cudalab.stream(s):
        y = x @ x
        y2 = x @ x  # the same stream: the same workspace
    s.synchronize()
    assert cudalab.memory_allocated() - before == size + 2 * 512
    del y, y2
    blocks = [b for seg in cudalab.memory_snapshot() for b in seg["blocks"]
              if b["size"] == size and b["state"] == "active_allocated"]
    assert blocks, "the workspace is an active block of the caching allocator"
    cudalab.backends.cuda.clear_cublas_workspaces()  # (torch's _cuda_clearCublasWorkspaces)
    cudalab.synchronize()
    assert cudalab.memory_allocated() == before


def test_cublas_workspace_config_is_read_as_torch_does():
    from cudalab._array_matmul import workspace_size

    assert workspace_size(0, ":4096:2:16:8") == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert workspace_size(0, ":4096:8") == 32 << 20
    assert workspace_size(0, ":0:0") == 0
    with pytest.warns(UserWarning, match="Could not parse CUBLAS_WORKSPACE_CONFIG"):
        default = workspace_size(0, "bogus")
    assert default in (32 << 20, 8519680)


def test_a_zero_workspace_config_gives_no_workspace(monkeypatch):
    from cudalab import _array_matmul

    _array_matmul.clear_workspaces()
    monkeypatch.setattr(_array_matmul, "_sizes", {0: 0})
    x = cudalab.ones((4, 4))
    np.testing.assert_array_equal((x @ x).cpu(), np.full((4, 4), 4, np.float32))
    assert blas.bound_handle(0).workspace == (0, 0)
    _array_matmul.clear_workspaces()


# ----------------------------------------------------------------------------- bad input
def test_bad_input_gets_errors_naming_the_argument():
    x = cudalab.ones((3, 4))
    with pytest.raises(TypeError, match="other must be a cudalab DeviceArray"):
        cudalab.matmul(x, np.ones((4, 3)))
    with pytest.raises(TypeError, match="input must be a cudalab DeviceArray"):
        cudalab.matmul([[1.0]], x)
    with pytest.raises(TypeError, match=r"float32 \(input\) and float64 \(other\)"):
        x @ cudalab.ones((4, 3), dtype=np.float64)
    with pytest.raises(TypeError, match="int32 of input and other is not supported"):
        cudalab.ones((2, 2), dtype=np.int32) @ cudalab.ones((2, 2), dtype=np.int32)
    with pytest.raises(ValueError, match=r"cannot be multiplied \(3x4 and 3x4\)"):
        x @ x
    with pytest.raises(ValueError, match="0D \\(input\\)"):
        cudalab.matmul(cudalab.ones(()), x)
    with pytest.raises(ValueError, match=r"batch dimensions of input \(2,\) and other \(3,\) "
                                         "do not broadcast"):
        cudalab.ones((2, 3, 4)) @ cudalab.ones((3, 4, 3))
    with pytest.raises(ValueError, match=r"batch dimensions of input \(2, 2\) and other "
                                         r"\(3,\) do not broadcast"):
        cudalab.ones((2, 2, 3, 4)) @ cudalab.ones((3, 4, 3))
    with pytest.raises(ValueError, match="out must be a float32 array of shape"):
        cudalab.matmul(x, cudalab.ones((4, 3)), out=cudalab.empty((2, 2)))
    with pytest.raises(TypeError, match="out must be a cudalab DeviceArray"):
        cudalab.matmul(x, cudalab.ones((4, 3)), out=np.empty((3, 3), np.float32))
    assert x.__matmul__(3) is NotImplemented


@pytest.mark.skipif(cudalab.device_count() < 2, reason="needs two devices")
def test_operands_on_two_devices_are_refused():
    with pytest.raises(ValueError, match="input is on cuda:0 and other on cuda:1"):
        cudalab.ones((2, 2), device=0) @ cudalab.ones((2, 2), device=1)


def test_settings_refuse_bad_values():
    with pytest.raises(ValueError, match="precision must be 'highest', 'high' or 'medium'"):
        cudalab.set_float32_matmul_precision("bogus")
    with pytest.raises(TypeError, match="allow_tf32 must be a bool"):
        cudalab.backends.cuda.matmul.allow_tf32 = 1
    with pytest.raises(ValueError, match="fp32_precision must be 'ieee' or 'tf32'"):
        cudalab.backends.cuda.matmul.fp32_precision = "bf16"
    with pytest.raises(AttributeError, match="Unknown attribute allow_tf33"):
        cudalab.backends.cuda.matmul.allow_tf33 = True
    m = cudalab.backends.cuda.matmul
    assert (m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction,
            m.allow_fp16_accumulation) == (True, True, False)


# ----------------------------------------------------------------------------- GPU vs torch
#: (rtol, atol) against torch for k <= 512 products of standard normals (|values| ~ 25).
GPU_TOLERANCES = {"float32": (1e-4, 1e-3), "complex64": (1e-4, 1e-3),
                  "float64": (1e-10, 1e-10), "complex128": (1e-10, 1e-10), "tf32": (1e-2, 1e-1)}


def _torch():
    return pytest.importorskip("torch")


@pytest.mark.gpu
@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("tf32", [False, True])
def test_gpu_results_match_torch(name, tf32):
    torch = _torch()
    if tf32 and name not in ("float32", "complex64"):
        pytest.skip("TF32 changes float32 and complex64 only")
    rng = np.random.default_rng(7)
    shapes = [((256, 512), (512, 128)), ((4, 64, 96), (4, 96, 32))]
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        cudalab.backends.cuda.matmul.allow_tf32 = tf32
        for a_shape, b_shape in shapes:
            a = cudalab.asarray(_random(rng, a_shape, name))
            b = cudalab.asarray(_random(rng, b_shape, name))
            mine = a @ b
            theirs = torch.from_dlpack(a) @ torch.from_dlpack(b)
            torch.cuda.synchronize()
            got = torch.from_dlpack(mine)
            same = bool(torch.equal(got, theirs))
            print(f"matmul {name}{' TF32' if tf32 else ''} {a_shape} x {b_shape}: "
                  f"{'bit-equal to torch' if same else 'NOT bit-equal to torch'}")
            if name in ("float16", "bfloat16", "float32"):
                # the same cuBLAS call as torch's (cublasGemmEx / cublasSgemm_v2 and their
                # strided-batched forms, the same math mode, a 32 MiB workspace each):
                # bit-equal (so they were in every H200 run, benchmarks/blas_fft.py too)
                assert same, f"{name} {a_shape} x {b_shape}: not bit-equal to torch"
            else:  # the same calls too; held to the tolerance (printed above when equal)
                rtol, atol = GPU_TOLERANCES["tf32" if tf32 else name]
                torch.testing.assert_close(got, theirs, rtol=rtol, atol=atol)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.gpu
def test_gpu_tf32_changes_float32_results():
    rng = np.random.default_rng(8)
    a = rng.standard_normal((512, 512)).astype(np.float32)
    da = cudalab.asarray(a)
    exact = (da @ da).cpu()
    cudalab.backends.cuda.matmul.allow_tf32 = True
    tf32 = (da @ da).cpu()
    reference = a.astype(np.float64) @ a.astype(np.float64)
    assert np.abs(tf32 - reference).max() > 4 * np.abs(exact - reference).max()


@pytest.mark.gpu
def test_gpu_workspace_is_32_mib_on_hopper(monkeypatch):
    from cudalab import _array_matmul

    if cudalab.get_device_properties(0).major < 9:
        pytest.skip("Hopper's default")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert _array_matmul.workspace_size(0) == 32 << 20


def test_cached_plans_tell_layouts_apart():
    rng = np.random.default_rng(9)
    a = rng.standard_normal((8, 8)).astype(np.float32)
    da = cudalab.asarray(a)
    transposed = cudalab.asarray(_Foreign(da, (8, 8), (4, 32)))
    x4 = rng.standard_normal((2, 1, 8, 8)).astype(np.float32)
    y4 = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    dx4, dy4 = cudalab.asarray(x4), cudalab.asarray(y4)
    gappy = cudalab.asarray(rng.standard_normal((4, 3, 8, 8)).astype(np.float32)).narrow(1, 0, 2)
    for _ in range(2):  # the second round takes the cached plans (none where a copy was made)
        np.testing.assert_allclose((dx4 @ dy4).cpu(), x4 @ y4, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose((gappy @ da).cpu(), gappy.cpu() @ a, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose((da @ da).cpu(), a @ a, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose((transposed @ da).cpu(), a.T @ a, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose((da @ transposed).cpu(), a @ a.T, rtol=1e-5, atol=1e-5)


def test_matmul_and_fft_are_captured_into_a_cuda_graph_and_replayed():
    rng = np.random.default_rng(10)
    a = cudalab.asarray(rng.standard_normal((16, 16)).astype(np.float32))
    signal = cudalab.asarray(rng.standard_normal((4, 32)).astype(np.complex64))
    a @ a  # the workspace and the plan exist before the capture, as torch warms up
    cudalab.fft.fft(signal)
    g = cudalab.CUDAGraph()
    with cudalab.graph(g):
        product = a @ a
        spectrum = cudalab.fft.fft(signal)
    new_a = rng.standard_normal((16, 16)).astype(np.float32)
    new_signal = rng.standard_normal((4, 32)).astype(np.complex64)
    a.copy_(new_a)
    signal.copy_(new_signal)
    g.replay()
    cudalab.synchronize()
    np.testing.assert_allclose(product.cpu(), new_a @ new_a, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(spectrum.cpu(), np.fft.fft(new_signal), rtol=1e-4, atol=1e-4)
    g.reset()


@pytest.mark.skipif(cudalab.device_count() < 2, reason="needs two devices")
def test_a_matmul_on_another_device_than_the_current_one():
    rng = np.random.default_rng(11)
    a = rng.standard_normal((32, 32)).astype(np.float32)
    d1 = cudalab.asarray(a, device=1)
    assert cudalab.current_device() == 0
    product = d1 @ d1
    assert product.device_index == 1
    np.testing.assert_allclose(product.cpu(), a @ a, rtol=1e-4, atol=1e-4)
    spectrum = cudalab.fft.fft(d1.astype(np.complex64))
    assert spectrum.device_index == 1 and cudalab.backends.cuda.cufft_plan_cache[1].size >= 1
    np.testing.assert_allclose(spectrum.cpu(), np.fft.fft(a), rtol=1e-4, atol=1e-3)


def test_strided_batches_of_more_dimensions_are_walked_or_copied():
    rng = np.random.default_rng(12)
    base = rng.standard_normal((4, 3, 6, 8)).astype(np.float32)
    d = cudalab.asarray(base)
    w = rng.standard_normal((8, 2)).astype(np.float32)
    dw = cudalab.asarray(w)
    # the first two dimensions narrowed: their batch is still walked with one stride? no:
    # (a narrow of the second dimension leaves gaps) - copied; the first one alone: walked
    for view, expected in ((d.narrow(0, 1, 2), base[1:3]), (d.narrow(1, 0, 2), base[:, :2]),
                           (d.narrow(3, 0, 5), base[..., :5])):
        other = dw if view.shape[-1] == 8 else cudalab.asarray(w[:5])
        reference = expected @ (w if view.shape[-1] == 8 else w[:5])
        np.testing.assert_allclose((view @ other).cpu(), reference, rtol=1e-5, atol=1e-5)


class _FakeCublas:
    """Records the entry points RealBlas calls and the C types of their arguments."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, name):
        calls = self.calls

        class Entry:
            restype = None

            def __call__(self, *args):
                calls.append((name, args))
                return 0

        return Entry()


@pytest.mark.parametrize("typed", [True, False])
def test_real_blas_calls_each_entry_point_with_its_c_types(monkeypatch, typed):
    import ctypes

    from cudalab._driver import cublas

    fake = _FakeCublas()
    monkeypatch.setattr(cublas, "_lib", fake)
    monkeypatch.setattr(cublas, "TYPED_ENTRY_POINTS", typed)
    real = cublas.RealBlas()
    big = 0x7F00_0000_0000  # addresses above 2**32 must reach C whole
    for data_type in (blas_seam.CUDA_R_32F, blas_seam.CUDA_R_64F, blas_seam.CUDA_C_32F,
                      blas_seam.CUDA_C_64F, blas_seam.CUDA_R_16F, blas_seam.CUDA_R_16BF):
        for batch in (1, 3):
            real.gemm(0x55AA_0000_0000, blas_seam.OP_T, blas_seam.OP_N, 8, 4, 2, 1, big, 8,
                      16, big + 4096, 2, 8, 0, big + 8192, 8, 32, batch, data_type,
                      blas_seam.COMPUTE_32F, blas_seam.GEMM_DEFAULT)
    expected_names = []
    for prefix in ("S", "D", "C", "Z"):
        expected_names += ([f"cublas{prefix}gemm_v2", f"cublas{prefix}gemmStridedBatched"]
                           if typed else ["cublasGemmEx", "cublasGemmStridedBatchedEx"])
    expected_names += ["cublasGemmEx", "cublasGemmStridedBatchedEx"] * 2
    assert [name for name, _ in fake.calls] == expected_names
    arity = {"cublasSgemm_v2": 14, "cublasSgemmStridedBatched": 18, "cublasGemmEx": 19,
             "cublasGemmStridedBatchedEx": 23}
    for name, args in fake.calls:
        key = name if name in arity else name.replace("D", "S").replace("Z", "S").replace(
            "cublasCgemm", "cublasSgemm")
        assert len(args) == arity[key], (name, len(args))
        assert isinstance(args[0], ctypes.c_void_p) and args[0].value == 0x55AA_0000_0000
        pointers = [a.value for a in args if isinstance(a, ctypes.c_void_p)][1:]
        assert pointers == [big, big + 4096, big + 8192], (name, pointers)
        strides = [a.value for a in args if isinstance(a, ctypes.c_longlong)]
        assert strides == ([] if "Batched" not in name else [16, 8, 32]), (name, strides)
        assert all(type(a) in (int, ctypes.c_void_p, ctypes.c_longlong) or
                   type(a).__name__ == "CArgObject" for a in args), name
