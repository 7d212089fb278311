"""cudalab.fft and the cuFFT plan cache (issue 42): torch.fft's transforms against numpy.fft,
the per-device LRU of plans (max_size, size, clear, max_size = 0), work areas from the
caching allocator, bad input, and cuFFT missing. The ``gpu`` tests compare with torch.fft."""

from __future__ import annotations

import numpy as np
import pytest

import cudalab
from cudalab.fft import plan_cache as plan_cache_module

CACHE = cudalab.backends.cuda.cufft_plan_cache


@pytest.fixture(autouse=True)
def _fresh_caches():
    for device in range(cudalab.device_count()):
        CACHE[device].max_size = 4096
        CACHE[device].clear()
    yield
    for device in range(cudalab.device_count()):
        CACHE[device].max_size = 4096
        CACHE[device].clear()


def _signal(shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rng.standard_normal(shape)
    return x.astype(dtype)


def _close(got, expected, dtype):
    tol = 1e-4 if np.dtype(dtype) in (np.float32, np.complex64) else 1e-10
    np.testing.assert_allclose(got.cpu(), expected, rtol=tol, atol=tol * 10)


CASES = [
    ("fft", {}, lambda x: np.fft.fft(x)),
    ("fft", {"n": 10, "dim": 1, "norm": "ortho"}, lambda x: np.fft.fft(x, 10, 1, "ortho")),
    ("fft", {"n": 3, "dim": 0, "norm": "forward"}, lambda x: np.fft.fft(x, 3, 0, "forward")),
    ("ifft", {}, lambda x: np.fft.ifft(x)),
    ("ifft", {"n": 5, "norm": "forward"}, lambda x: np.fft.ifft(x, 5, norm="forward")),
    ("fft2", {}, lambda x: np.fft.fft2(x)),
    ("ifft2", {"s": (4, 9), "dim": (0, 2)}, lambda x: np.fft.ifft2(x, (4, 9), (0, 2))),
    ("fftn", {}, lambda x: np.fft.fftn(x)),
    ("fftn", {"s": (5, 7)}, lambda x: np.fft.fftn(x, (5, 7), (1, 2))),
    ("ifftn", {"dim": (2, 0), "norm": "ortho"}, lambda x: np.fft.ifftn(x, axes=(2, 0),
                                                                       norm="ortho")),
]


@pytest.mark.parametrize("dtype", [np.float32, np.complex64, np.float64, np.complex128])
@pytest.mark.parametrize("name,kwargs,reference", CASES)
def test_complex_transforms_match_numpy(dtype, name, kwargs, reference):
    x = _signal((3, 8, 6), dtype)
    y = getattr(cudalab.fft, name)(cudalab.asarray(x), **kwargs)
    expected = reference(x)
    complex_dtype = np.complex128 if np.dtype(dtype).itemsize * (
        2 if np.dtype(dtype).kind == "f" else 1) == 16 else np.complex64
    assert y.dtype == complex_dtype and y.shape == expected.shape
    _close(y, expected, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_real_transforms_match_numpy(dtype):
    x = _signal((4, 6, 10), dtype)
    dx = cudalab.asarray(x)
    _close(cudalab.fft.rfft(dx), np.fft.rfft(x), dtype)
    _close(cudalab.fft.rfft(dx, n=7, dim=1, norm="ortho"), np.fft.rfft(x, 7, 1, "ortho"), dtype)
    _close(cudalab.fft.rfftn(dx), np.fft.rfftn(x), dtype)
    _close(cudalab.fft.rfftn(dx, s=(5, 8), dim=(0, 1)), np.fft.rfftn(x, (5, 8), (0, 1)), dtype)
    spectrum = np.fft.rfftn(x)
    ds = cudalab.asarray(spectrum)
    r = cudalab.fft.irfftn(ds, s=x.shape)
    assert r.dtype == np.dtype(dtype)
    _close(r, x, dtype)
    _close(cudalab.fft.irfft(ds), np.fft.irfft(spectrum), dtype)
    _close(cudalab.fft.irfft(ds, n=11, dim=0, norm="forward"),
           np.fft.irfft(spectrum, 11, 0, "forward"), dtype)
    _close(cudalab.fft.irfftn(ds, dim=(1, 2)), np.fft.irfftn(spectrum, axes=(1, 2)), dtype)
    # irfft leaves its input untouched (cuFFT's C2R overwrites it: a copy is made)
    np.testing.assert_array_equal(ds.cpu(), spectrum)


def test_more_than_three_dimensions_run_in_several_plans():
    x = _signal((2, 3, 4, 5, 6), np.complex64)
    _close(cudalab.fft.fftn(cudalab.asarray(x)), np.fft.fftn(x), np.complex64)
    r = _signal((2, 3, 4, 5, 6), np.float32)
    _close(cudalab.fft.rfftn(cudalab.asarray(r)), np.fft.rfftn(r), np.float32)
    _close(cudalab.fft.irfftn(cudalab.asarray(np.fft.rfftn(r)), s=r.shape), r, np.float32)


def test_integer_input_is_taken_as_float32_and_out_is_written():
    x = np.arange(16, dtype=np.int32).reshape(2, 8)
    out = cudalab.empty((2, 8), dtype=np.complex64)
    assert cudalab.fft.fft(cudalab.asarray(x), out=out) is out
    _close(out, np.fft.fft(x), np.float32)


# ----------------------------------------------------------------------------- plan cache
def _count_plans(monkeypatch):
    made = []
    real = plan_cache_module.make_plan

    def make_plan(device, key):
        made.append(key)
        return real(device, key)

    monkeypatch.setattr(plan_cache_module, "make_plan", make_plan)
    return made


def test_the_plan_cache_is_an_lru_of_max_size(monkeypatch):
    made = _count_plans(monkeypatch)
    cache = CACHE[0]
    assert cache.max_size == 4096 and cache.size == 0
    a, b, c = (cudalab.ones(n, dtype=np.complex64) for n in (8, 16, 32))
    cudalab.fft.fft(a)
    cudalab.fft.fft(a)
    assert cache.size == 1 and len(made) == 1  # the second call hit
    cache.max_size = 2
    cudalab.fft.fft(b)
    cudalab.fft.fft(a)  # a is now the most recently used
    cudalab.fft.fft(c)  # evicts b
    assert cache.size == 2 and len(made) == 3
    cudalab.fft.fft(a)
    assert len(made) == 3
    cudalab.fft.fft(b)  # was evicted: built again (and evicts c)
    assert len(made) == 4 and cache.size == 2
    cache.max_size = 1  # shrinking destroys the least recently used
    assert cache.size == 1
    cudalab.fft.fft(b)
    assert len(made) == 4
    cache.clear()
    assert cache.size == 0 and cache.max_size == 1


def test_max_size_zero_builds_a_plan_every_call(monkeypatch):
    made = _count_plans(monkeypatch)
    fft = cudalab._internal.backend().fft()
    destroyed = []
    real_destroy = fft.destroy
    monkeypatch.setattr(fft, "destroy", lambda plan: (destroyed.append(plan),
                                                      real_destroy(plan))[1])
    CACHE.max_size = 0
    x = cudalab.asarray(_signal((4, 8), np.complex64))
    for _ in range(3):
        _close(cudalab.fft.fft(x), np.fft.fft(x.cpu()), np.complex64)
    assert len(made) == 3 and len(destroyed) == 3 and CACHE.size == 0


def test_without_an_index_the_cache_is_the_current_devices():
    CACHE.max_size = 7
    assert CACHE[0].max_size == 7 and CACHE[cudalab.current_device()] is CACHE[0]
    if cudalab.device_count() > 1:
        assert CACHE[1].max_size == 4096
        with cudalab.device(1):
            assert CACHE.max_size == 4096
            cudalab.fft.fft(cudalab.ones(8, dtype=np.complex64))
            assert CACHE.size == 1
        assert CACHE[1].size == 1 and CACHE[0].size == 0
    assert len(CACHE) == cudalab.device_count()


def test_plan_cache_bad_input():
    with pytest.raises(ValueError, match="max_size must be non-negative, but got -1"):
        CACHE.max_size = -1
    with pytest.raises(RuntimeError, match="max_size must be non-negative"):
        CACHE[0].max_size = -1
    with pytest.raises(ValueError, match="can not be larger than"):
        CACHE.max_size = 2**64
    with pytest.raises(TypeError, match="max_size must be an int"):
        CACHE.max_size = 1.5
    with pytest.raises(AttributeError):
        CACHE.size = 3
    with pytest.raises(IndexError, match="expected 0 <= device index < "):
        CACHE[cudalab.device_count()]
    with pytest.raises(RuntimeError, match="expected 0 <= device index < "):  # torch's type
        CACHE[-1]
    assert CACHE.max_size == 4096


def test_work_areas_come_from_the_caching_allocator():
    # a prime length: cuFFT's Bluestein plan needs a work area on a GPU too
    x = cudalab.asarray(_signal((10007,), np.complex64))
    y = cudalab.fft.fft(x)  # plan made, cached
    plan = next(iter(CACHE[0]._plans.values()))
    assert plan.work_size > 0
    del y
    cudalab.synchronize()
    cudalab.reset_peak_memory_stats()
    before = cudalab.memory_allocated()
    allocations = cudalab.memory_stats()["allocation.all.allocated"]
    y = cudalab.fft.fft(x)
    cudalab.synchronize()
    # the output and the work area, both from the allocator; the work area is freed
    assert cudalab.memory_stats()["allocation.all.allocated"] - allocations == 2
    assert cudalab.max_memory_allocated() - before >= x.nbytes + plan.work_size
    assert cudalab.memory_allocated() - before == -(-y.nbytes // 512) * 512  # (rounded up)


# ----------------------------------------------------------------------------- bad input
def test_bad_input_gets_errors_naming_the_argument():
    x = cudalab.ones((4, 8), dtype=np.complex64)
    with pytest.raises(ValueError, match=r"Invalid number of data points \(0\)"):
        cudalab.fft.fft(x, n=0)
    with pytest.raises(ValueError, match="norm must be 'backward', 'forward', 'ortho' or None, "
                                         "got 'bogus'"):
        cudalab.fft.fft(x, norm="bogus")
    with pytest.raises(TypeError, match="rfft expects a real input array"):
        cudalab.fft.rfft(x)
    with pytest.raises(IndexError, match="Dimension out of range"):
        cudalab.fft.fft(x, dim=2)
    with pytest.raises(ValueError, match="dim must hold unique dimensions"):
        cudalab.fft.fftn(x, dim=(0, 0))
    with pytest.raises(ValueError, match="s has 1 sizes but dim has 2"):
        cudalab.fft.fftn(x, s=(4,), dim=(0, 1))
    with pytest.raises(TypeError, match="input must be a cudalab DeviceArray"):
        cudalab.fft.fft(np.ones(4))
    with pytest.raises(TypeError, match="float16, which cudalab.fft does not support"):
        cudalab.fft.fft(cudalab.ones(8, dtype=np.float16))
    with pytest.raises(ValueError, match="out must be a complex64 DeviceArray of shape"):
        cudalab.fft.fft(x, out=cudalab.empty((2, 2), dtype=np.complex64))
    with pytest.raises(ValueError, match=r"Invalid number of data points \(0\)"):
        cudalab.fft.irfft(cudalab.ones((4, 1), dtype=np.complex64))


def test_without_cufft_the_error_names_the_extra(monkeypatch):
    import cuda.pathfinder

    from cudalab._driver import cufft

    def missing(name):
        raise RuntimeError(f"Failure finding {name}: no cuFFT here")

    monkeypatch.setattr(cufft, "_lib", None)
    monkeypatch.setattr(cuda.pathfinder, "load_nvidia_dynamic_lib", missing)
    monkeypatch.setattr(cufft, "_wheel_libraries", lambda: ())  # (torch's copy on a GPU host)
    with pytest.raises(cudalab.CufftError, match=r"pip install cudalab\[fft\]"):
        cufft.RealFft().version()


# ----------------------------------------------------------------------------- GPU vs torch
@pytest.mark.gpu
def test_gpu_cufft_is_found():
    from cudalab._driver import cufft

    assert cufft.RealFft().version() >= 10000


@pytest.mark.gpu
@pytest.mark.parametrize("name,kwargs", [
    ("fft", {}), ("ifft", {"norm": "ortho"}), ("rfft", {}), ("fft2", {}), ("ifft2", {}),
    ("fftn", {"dim": (0, 2)}), ("rfftn", {}), ("fft", {"n": 100, "dim": 1}),
])
def test_gpu_results_match_torch_fft(name, kwargs):
    torch = pytest.importorskip("torch")
    dtype = np.float32 if name.startswith("r") else np.complex64
    x = cudalab.asarray(_signal((8, 64, 48), dtype))
    mine = torch.from_dlpack(getattr(cudalab.fft, name)(x, **kwargs))
    theirs = getattr(torch.fft, name)(torch.from_dlpack(x), **kwargs)
    torch.cuda.synchronize()
    print(f"fft {name} {kwargs}: {'bit-equal to' if torch.equal(mine, theirs) else 'within'} "
          f"torch.fft")
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
def test_gpu_irfftn_matches_torch_and_keeps_its_input():
    torch = pytest.importorskip("torch")
    spectrum = cudalab.asarray(np.fft.rfftn(_signal((16, 32, 20), np.float32)).astype(np.complex64))
    copy = spectrum.cpu()
    mine = torch.from_dlpack(cudalab.fft.irfftn(spectrum, s=(16, 32, 20)))
    theirs = torch.fft.irfftn(torch.from_dlpack(spectrum), s=(16, 32, 20))
    torch.cuda.synchronize()
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(spectrum.cpu(), copy)


def test_the_short_path_of_repeated_calls_keeps_their_arguments_apart():
    x = _signal((4, 16), np.complex64)
    r = _signal((4, 16), np.float32)
    dx, dr = cudalab.asarray(x), cudalab.asarray(r)
    for _ in range(2):  # the second round takes the short path
        _close(cudalab.fft.fft(dx), np.fft.fft(x), np.complex64)
        _close(cudalab.fft.fft(dx, norm="ortho"), np.fft.fft(x, norm="ortho"), np.complex64)
        _close(cudalab.fft.ifft(dx), np.fft.ifft(x), np.complex64)
        _close(cudalab.fft.fft(dx, dim=0), np.fft.fft(x, axis=0), np.complex64)
        _close(cudalab.fft.fft2(dx, norm="forward"), np.fft.fft2(x, norm="forward"),
               np.complex64)
        _close(cudalab.fft.rfft(dr), np.fft.rfft(r), np.float32)
        _close(cudalab.fft.rfftn(dr), np.fft.rfftn(r), np.float32)
        _close(cudalab.fft.fft(dr), np.fft.fft(r), np.float32)


def test_the_wheel_directories_are_searched_when_pathfinder_fails(monkeypatch, tmp_path):
    from cudalab._driver import cufft

    (tmp_path / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    library = tmp_path / "nvidia" / "cu13" / "lib" / "libcufft.so.12"
    library.write_bytes(b"")
    monkeypatch.setattr("sys.path", [str(tmp_path)])
    assert cufft._wheel_libraries() == (str(library),)


class _FakeCufft:
    """Records the cuFFT calls RealFft makes (each returns CUFFT_SUCCESS)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            return 0
        return call


def test_real_fft_sets_a_plans_stream_and_work_area_only_when_they_change(monkeypatch):
    from cudalab._driver import cufft, fft_seam

    fake = _FakeCufft()
    monkeypatch.setattr(cufft, "_lib", fake)
    real = cufft.RealFft()
    for stream, work in ((7, 0x1000), (7, 0x1000), (8, 0x1000), (8, 0x2000), (8, 0)):
        real.execute(3, stream, work, fft_seam.C2C, 0xA000, 0xB000, fft_seam.FORWARD)
    names = [(name, args[1] if name != "cufftExecC2C" else None) for name, args in fake.calls]
    assert names == [("cufftSetStream", 7), ("cufftSetWorkArea", 0x1000), ("cufftExecC2C", None),
                     ("cufftExecC2C", None),
                     ("cufftSetStream", 8), ("cufftSetWorkArea", 0x1000), ("cufftExecC2C", None),
                     ("cufftSetWorkArea", 0x2000), ("cufftExecC2C", None),
                     ("cufftExecC2C", None)]
    real.destroy(3)  # a later plan of the same number starts afresh
    fake.calls.clear()
    real.execute(3, 8, 0x2000, fft_seam.R2C, 0xA000, 0xB000, fft_seam.FORWARD)
    assert [name for name, _ in fake.calls] == ["cufftSetStream", "cufftSetWorkArea",
                                                "cufftExecR2C"]
