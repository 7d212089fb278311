"""DeviceArray.sum / mean / max / min / amax / amin: torch's dtypes, NaN and empty rules,
strided inputs, one- and two-pass kernels (issue 20), on the simulator and on a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import cudalab
from tests.array.helpers import strided

INTS = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOATS = ["float16", "float32", "float64"]
COMPLEX = ["complex64", "complex128"]


def _values(dtype: str, shape: tuple, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -100), min(info.max, 100), shape).astype(dtype)
    if dtype.startswith("complex"):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _torch_sum(x: np.ndarray, axis, keepdims=False) -> np.ndarray:
    """torch.sum's result: int64 for bool/integers (wrapping), else the input dtype."""
    if x.dtype.kind in "biu":
        return np.sum(x.astype(np.int64), axis=axis, keepdims=keepdims)
    wide = np.complex128 if x.dtype.kind == "c" else np.float64
    return np.sum(x.astype(wide), axis=axis, keepdims=keepdims).astype(x.dtype)


def _close(got: np.ndarray, want: np.ndarray, dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if np.dtype(dtype).kind in "biu":
        np.testing.assert_array_equal(got, want)
    else:
        tol = {"float16": 2e-2, "bfloat16": 2e-2, "float32": 2e-5, "complex64": 2e-5}.get(
            str(np.dtype(dtype)), 1e-12)
        np.testing.assert_allclose(got.astype(np.complex128), want.astype(np.complex128),
                                   rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype", INTS + FLOATS + COMPLEX)
@pytest.mark.parametrize("axis", [None, 0, 1, -1, (0, 2)])
def test_sum_matches_torch_dtype_and_values(dtype, axis):
    host = _values(dtype, (3, 5, 7))
    got = cudalab.asarray(host).sum(axis)
    want = _torch_sum(host, axis)
    assert isinstance(got, cudalab.DeviceArray)
    _close(got.cpu(), np.asarray(want), dtype)


@pytest.mark.parametrize("dtype", FLOATS + COMPLEX)
def test_mean_over_all_and_one_axis_keepdim(dtype):
    host = _values(dtype, (4, 6))
    a = cudalab.asarray(host)
    _close(a.mean().cpu(), np.asarray(host.mean(dtype=np.complex128 if host.dtype.kind == "c"
                                                  else np.float64)).astype(dtype), dtype)
    wide = np.complex128 if host.dtype.kind == "c" else np.float64
    want = host.astype(wide).mean(axis=1, keepdims=True).astype(dtype)
    _close(a.mean(dim=1, keepdim=True).cpu(), want, dtype)


@pytest.mark.parametrize("dtype", INTS + FLOATS)
def test_max_min_values_and_first_indices(dtype):
    host = _values(dtype, (5, 9), seed=3)
    a = cudalab.asarray(host)
    assert a.max().item() == host.max() and a.min().item() == host.min()
    assert a.max().dtype == host.dtype and a.max().shape == ()
    values, indices = a.max(dim=1)
    np.testing.assert_array_equal(values.cpu(), host.max(axis=1))
    np.testing.assert_array_equal(indices.cpu(), host.argmax(axis=1))  # first maximum
    assert indices.dtype == np.int64
    low = a.min(0, keepdim=True)
    np.testing.assert_array_equal(low.values.cpu(), host.min(axis=0, keepdims=True))
    np.testing.assert_array_equal(low.indices.cpu(), host.argmin(axis=0)[None])
    np.testing.assert_array_equal(a.amax(dim=(0, 1)).cpu(), host.max())
    np.testing.assert_array_equal(a.amin(1).cpu(), host.min(axis=1))


def test_ties_keep_the_first_index():
    host = np.array([[1, 7, 7, 0, 7], [3, 3, 3, 3, 3]], np.int32)
    _, idx = cudalab.asarray(host).max(1)
    assert idx.tolist() == [1, 0]
    _, idx = cudalab.asarray(host).min(1)
    assert idx.tolist() == [3, 0]


def test_nan_propagates_with_the_first_nan_index():
    host = np.array([[1.0, np.nan, 5.0, np.nan], [2.0, 9.0, -1.0, 0.5]], np.float32)
    a = cudalab.asarray(host)
    assert np.isnan(a.max().item()) and np.isnan(a.min().item())
    assert np.isnan(a.sum().item()) and np.isnan(a.mean().item())
    values, idx = a.max(1)
    assert np.isnan(values.tolist()[0]) and values.tolist()[1] == 9.0
    assert idx.tolist() == [1, 1]
    values, idx = a.min(1)
    assert np.isnan(values.tolist()[0]) and idx.tolist() == [1, 2]
    assert np.isnan(a.amax(1).tolist()[0])


def test_large_reductions_take_two_passes_and_stay_exact():
    # 3000 ones in float16 sum to 3000 only with a float32 accumulator (float16 stops at 2048)
    assert cudalab.ones(3000, dtype="float16").sum().item() == 3000.0
    n = 300_001
    host = np.arange(n, dtype=np.int64) - 1000
    a = cudalab.asarray(host)
    assert a.sum().item() == int(host.sum())
    assert a.max().item() == n - 1001 and a.min().item() == -1000
    f = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    f[123_456] = np.nan
    fa = cudalab.asarray(f)
    assert np.isnan(fa.max().item()) and np.isnan(fa.sum().item())
    f[123_456] = 0
    np.testing.assert_allclose(cudalab.asarray(f).mean().item(), f.astype(np.float64).mean(),
                               atol=1e-5)
    # a reduction over the long axis of a (2, n) array splits each row
    two = np.stack([f, -f])
    np.testing.assert_allclose(cudalab.asarray(two).sum(1).cpu(), two.astype(np.float64).sum(1),
                               atol=1e-2)
    h = cudalab.asarray(f.astype(np.float16)).mean()
    assert h.dtype == np.float16
    np.testing.assert_allclose(h.item(), f.astype(np.float16).astype(np.float64).mean(), atol=1e-3)


def test_integer_sums_are_int64_and_wrap_like_torch():
    assert cudalab.asarray(np.array([True, True, False])).sum().tolist() == 2
    assert cudalab.asarray(np.array([True, False])).sum().dtype == np.int64
    assert cudalab.asarray(np.array([200, 200], np.uint8)).sum().item() == 400
    big = np.array([2**63 - 1, 2**63 - 1], np.uint64)
    assert cudalab.asarray(big).sum().item() == -2  # torch: int64 accumulation wraps
    assert cudalab.asarray(np.array([True, False])).max().dtype == np.bool_


def test_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    host = np.array([[1.5, -2.0, 3.25], [0.5, 8.0, -7.0]], ml_dtypes.bfloat16)
    a = cudalab.asarray(host)
    assert a.sum().dtype == host.dtype and a.sum().item() == 4.25
    assert a.max().item() == 8.0 and a.max(1).indices.tolist() == [2, 1]
    assert a.mean(0).tolist() == [1.0, 3.0, -1.875]
    assert a.amin().item() == -7.0


@pytest.mark.parametrize("dtype", ["float32", "int16", "float64", "complex64"])
def test_strided_inputs_are_read_in_place(dtype):
    host = _values(dtype, (6, 8, 5), seed=7)
    views = [host.transpose(2, 0, 1), host[:, ::2, 1:4], host[::-1, :, ::-2],
             host.transpose(1, 2, 0)[2:, :, ::3]]
    for view in views:
        a = strided(view)
        assert not a.is_contiguous()
        np.testing.assert_array_equal(a.cpu(), view)
        for axis in (None, 0, 1, (0, 2)):
            _close(a.sum(axis).cpu(), np.asarray(_torch_sum(view, axis)), dtype)
        if dtype != "complex64":
            np.testing.assert_array_equal(a.max(2).values.cpu(), view.max(axis=2))
            np.testing.assert_array_equal(a.max(2).indices.cpu(), view.argmax(axis=2))
            np.testing.assert_array_equal(a.amin((0, 1)).cpu(), view.min(axis=(0, 1)))


def test_empty_arrays_follow_torch():
    e = cudalab.empty((0, 3))
    assert e.sum().item() == 0.0 and e.sum(0).tolist() == [0.0, 0.0, 0.0]
    assert e.sum(1).shape == (0,)
    assert np.isnan(e.mean().item())
    assert cudalab.empty(0, dtype="int32").sum().dtype == np.int64
    with pytest.raises(RuntimeError, match=r"max\(\): Expected reduction dim to be specified "
                                           r"for input.numel\(\) == 0"):
        e.max()
    with pytest.raises(IndexError, match=r"min\(\): Expected reduction dim 0 to have non-zero"):
        e.min(0)
    values, indices = e.max(1)  # reducing a non-empty dim of an empty array: empty results
    assert values.shape == (0,) and indices.shape == (0,)
    with pytest.raises(IndexError, match="amax"):
        e.amax()


def test_zero_dim_inputs():
    a = cudalab.asarray(np.array(4.5, np.float32))
    assert a.sum().item() == 4.5 and a.mean(0).item() == 4.5
    values, idx = a.max(0)
    assert values.item() == 4.5 and idx.item() == 0 and values.shape == ()
    assert a.sum(-1, keepdim=True).shape == ()


def test_keepdim_shapes_and_tuple_dims():
    a = cudalab.ones((2, 3, 4), dtype="int32")
    assert a.sum((0, 2), keepdim=True).shape == (1, 3, 1)
    assert a.sum((0, 2)).tolist() == [8, 8, 8]
    assert a.sum(axis=[2, 0]).tolist() == [8, 8, 8]


def test_bad_arguments_raise_like_torch():
    a = cudalab.ones((2, 3))
    with pytest.raises(RuntimeError, match=r"mean\(\): could not infer output dtype. Input "
                                           r"dtype must be either a floating point or complex "
                                           r"dtype. Got: Long"):
        cudalab.ones(3, dtype="int64").mean()
    with pytest.raises(RuntimeError, match="Got: Bool"):
        cudalab.ones(3, dtype="bool").mean()
    with pytest.raises(IndexError, match=r"Dimension out of range \(expected to be in range of "
                                         r"\[-2, 1\], but got 2\)"):
        a.sum(2)
    with pytest.raises(RuntimeError, match="dim 1 appears multiple times"):
        a.sum((1, -1))
    with pytest.raises(TypeError, match="dim must be an int"):
        a.sum("0")
    with pytest.raises(TypeError, match="dim must be an int"):
        a.sum(True)
    with pytest.raises(TypeError, match="both dim= and axis="):
        a.sum(0, axis=1)
    with pytest.raises(TypeError, match=r"max\(\): dim must be one int"):
        a.max((0, 1))
    with pytest.raises(RuntimeError, match=r"max\(\): does not support complex input"):
        cudalab.ones(2, dtype="complex64").max()
    with pytest.raises(RuntimeError, match="does not support complex"):
        cudalab.ones(2, dtype="complex64").amin()


def test_results_are_new_arrays_on_the_current_stream():
    a = cudalab.asarray(np.arange(10, dtype=np.float32))
    s = cudalab.Stream()
    with cudalab.stream(s):
        total = a.sum()
        assert total.stream is s
    s.synchronize()
    assert total.item() == 45.0 and total.base is None
    before = cudalab.memory_allocated()
    keep = [a.sum(0) for _ in range(3)]
    assert cudalab.memory_allocated() > before and len(keep) == 3


@pytest.mark.parametrize(
    ("shape", "axis", "mode"),
    [((64, 10_000), 0, 0),  # adjacent outputs: a thread per output
     ((20_000, 5), 1, 0),  # few elements per output: a thread per output
     ((100, 5_000), 1, 1),  # a block per output
     ((3, 50_000), 1, 13),  # few long outputs: parts, then a second pass
     ((50_000, 3), 0, 13)],  # the same down a strided column
)
def test_each_launch_plan_gives_torch_results(shape, axis, mode):
    from cudalab._kernels import reduce

    n_out = shape[1 - axis]
    assert reduce.split_count(n_out, shape[axis], axis == 0) == mode
    host = _values("float32", shape, seed=11)
    host[1, 2] = 40.0  # a unique maximum
    a = cudalab.asarray(host)
    np.testing.assert_allclose(a.sum(axis).cpu(), host.astype(np.float64).sum(axis), atol=1e-2)
    np.testing.assert_allclose(a.mean(axis).cpu(), host.astype(np.float64).mean(axis), atol=1e-4)
    values, indices = a.max(axis)
    np.testing.assert_array_equal(values.cpu(), host.max(axis))
    np.testing.assert_array_equal(indices.cpu(), host.argmax(axis))
    np.testing.assert_array_equal(a.amin(axis).cpu(), host.min(axis))
    assert a.amax().item() == 40.0 and a.max().item() == 40.0
