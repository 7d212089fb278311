"""Kernels: NVRTC compilation (for real), the CUBIN caches, argument checks, launches.

Compilation tests need only NVRTC (no GPU). Launch tests run on whichever backend the
harness picked (the fill kernels on the simulator or on the GPU); ``gpu`` tests need a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest

import cudalab
from cudalab import _internal, kernels
from cudalab._driver import nvrtc
from cudalab._kernels import kernel as kernel_facility
from cudalab._kernels.fill import FILL_KERNELS, fill_kernel
from cudalab._kernels.spin import spin
from cudalab.errors import KernelCompileError
from cudalab.kernels import Kernel, KernelCacheWarning

ELF = b"\x7fELF"

BAD_SOURCE = """
extern "C" __global__ void cudalab_test_bad(int* p)
{
    p[0] = 1
}
"""

SET_SOURCE = """
extern "C" __global__ void cudalab_test_set(unsigned int* p, unsigned int v)
{
    p[threadIdx.x] = v;
}
"""


def _sim_set(sim, grid, block, shared_mem, ptr, value):
    sim.array(ptr, np.uint32, block[0])[...] = value


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh disk cache directory and empty in-memory cache; counts real compilations."""
    d = tmp_path / "kcache"
    monkeypatch.setenv("CUDALAB_CACHE_DIR", str(d))
    kernel_facility._reset_caches_for_tests()
    calls = []
    real = nvrtc.compile_cubin

    def counting(source, name, arch="sm_90", options=()):
        calls.append((name, arch, tuple(options)))
        done = _COMPILED.get((source, arch, tuple(options)))  # NVRTC's work, done once a run
        return done[0] if done is not None else real(source, name, arch, options)

    monkeypatch.setattr(nvrtc, "compile_cubin", counting)
    yield d, calls
    kernel_facility._reset_caches_for_tests()


def _cubin_files(d):
    return sorted(p for p in d.iterdir() if p.suffix == ".cubin" and not p.name.startswith("."))


# --------------------------------------------------------------------------- NVRTC
def test_nvrtc_version_and_archs():
    major, minor = nvrtc.version()
    assert major >= 12 and minor >= 0
    archs = nvrtc.supported_archs()
    assert "sm_80" in archs and "sm_90" in archs
    assert all(a.startswith("sm_") for a in archs)


def test_registry_lists_the_runtime_kernels():
    names = {k.name for k in kernels.all_kernels()}
    assert {"cudalab_spin", "cudalab_fill_u8", "cudalab_fill_u16", "cudalab_fill_u32",
            "cudalab_fill_u64"} <= names
    # kernels defined outside cudalab (like this test's) are not in the registry
    Kernel("cudalab_test_set", SET_SOURCE, ("p", "u4"))
    assert "cudalab_test_set" not in {k.name for k in kernels.all_kernels()}


#: (source, arch, options) -> (CUBIN, NVRTC's log) of the compilations below, so the
#: facility's test (test_compile_all) counts its compile calls without NVRTC doing every
#: kernel of the runtime a second time per architecture (a minute of CI on two cores).
_COMPILED: dict[tuple, tuple[bytes, str]] = {}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_kernel_compiles_to_cubin_without_warnings(arch):
    # kernels sharing a source (the fills, the 57 reductions) are compiled once, and each
    # one's name must be a symbol of that CUBIN
    images: dict[tuple, bytes] = {}
    for k in kernels.all_kernels():
        key = (k.source, k.options)
        if key not in images:
            cubin, log = nvrtc.compile_with_log(k.source, k.name, arch, k.options)
            _COMPILED[(k.source, arch, tuple(k.options))] = (cubin, log)
            assert cubin[:4] == ELF, k.name
            assert kernel_facility._valid_cubin(cubin)
            assert log == "", f"{k.name} on {arch}: {log}"
            images[key] = cubin
        assert b"\0" + k.name.encode() + b"\0" in images[key], k.name


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compile_all(cache, arch):
    d, calls = cache
    images = kernels.compile_all(arch)
    assert set(images) == {k.name for k in kernels.all_kernels()}
    assert all(img[:4] == ELF for img in images.values())
    # kernels sharing a source (the four fills) are compiled once
    distinct = {(k.source, k.options) for k in kernels.all_kernels()}
    assert len(distinct) < len(images)
    assert len(calls) == len(distinct)
    assert len(_cubin_files(d)) == len(distinct)


def test_syntax_error_raises_with_log_and_name(cache):
    k = Kernel("cudalab_test_bad", BAD_SOURCE, ("p",), options=("-std=c++17",))
    with pytest.raises(KernelCompileError) as info:
        k.cubin("sm_90")
    text = str(info.value)
    assert "cudalab_test_bad" in text
    assert "sm_90" in text and "-std=c++17" in text
    assert "cudalab_test_bad.cu(5): error: expected a \";\"" in text
    assert "NVRTC_ERROR_COMPILATION" in text
    assert not cache[0].exists() or not _cubin_files(cache[0])


def test_compile_rejects_bad_arch_and_options():
    with pytest.raises(ValueError, match="sm_90"):
        nvrtc.compile_cubin(SET_SOURCE, "cudalab_test_set", "compute_90")
    with pytest.raises(ValueError, match="arch="):
        nvrtc.compile_cubin(SET_SOURCE, "cudalab_test_set", "sm_90", ("-arch=sm_80",))
    with pytest.raises(TypeError):
        nvrtc.compile_cubin(SET_SOURCE, "cudalab_test_set", "sm_90", "-std=c++17")


def test_use_fast_math_only_when_asked(cache):
    _, calls = cache
    Kernel("cudalab_test_set", SET_SOURCE, ("p", "u4")).cubin("sm_90")
    Kernel("cudalab_test_set", SET_SOURCE, ("p", "u4"), options=("--use_fast_math",)).cubin("sm_90")
    assert calls == [("cudalab_test_set", "sm_90", ()),
                     ("cudalab_test_set", "sm_90", ("--use_fast_math",))]


@pytest.fixture
def no_nvrtc_state():
    nvrtc._reset_for_tests()
    yield
    nvrtc._reset_for_tests()


def test_missing_bindings_gives_install_hint(monkeypatch, no_nvrtc_state):
    import cuda.bindings

    monkeypatch.delattr(cuda.bindings, "nvrtc", raising=False)
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", None)
    with pytest.raises(KernelCompileError, match="pip install nvidia-cuda-nvrtc"):
        nvrtc.compile_cubin(SET_SOURCE, "cudalab_test_set", "sm_90")


def test_missing_library_gives_install_hint(monkeypatch, no_nvrtc_state):
    import types

    import cuda.bindings

    try:
        from cuda.pathfinder import DynamicLibNotFoundError as missing
    except ImportError:  # pragma: no cover
        missing = RuntimeError

    def version():
        raise missing("Failure finding libnvrtc.so")

    fake = types.ModuleType("cuda.bindings.nvrtc")
    fake.nvrtcVersion = version
    monkeypatch.setattr(cuda.bindings, "nvrtc", fake, raising=False)
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", fake)
    with pytest.raises(KernelCompileError) as info:
        nvrtc.version()
    assert "pip install nvidia-cuda-nvrtc" in str(info.value)
    assert "libnvrtc" in str(info.value)


# --------------------------------------------------------------------------- caches
def test_disk_cache_hit_after_restart(cache):
    d, calls = cache
    k = Kernel("cudalab_test_set", SET_SOURCE, ("p", "u4"))
    first = k.cubin("sm_90")
    assert len(calls) == 1
    assert k.cubin("sm_90") is first  # memory cache
    assert len(calls) == 1
    files = _cubin_files(d)
    assert len(files) == 1 and files[0].read_bytes() == first
    kernel_facility._reset_caches_for_tests()  # a new process: memory empty, disk kept
    assert k.cubin("sm_90") == first
    assert len(calls) == 1
    assert not [p for p in d.iterdir() if p.name.endswith(".tmp")]  # no temporary file left


def test_cache_keys_differ_by_options_arch_source_and_version(cache):
    d, calls = cache
    base = kernels.cache_key(SET_SOURCE, (), "sm_90", (13, 0))
    assert base == kernels.cache_key(SET_SOURCE, [], "sm_90", (13, 0))
    others = {
        kernels.cache_key(SET_SOURCE, ("--use_fast_math",), "sm_90", (13, 0)),
        kernels.cache_key(SET_SOURCE, (), "sm_80", (13, 0)),
        kernels.cache_key(SET_SOURCE + " ", (), "sm_90", (13, 0)),
        kernels.cache_key(SET_SOURCE, (), "sm_90", (13, 1)),
        kernels.cache_key(SET_SOURCE, ("-std=c++17", "--use_fast_math"), "sm_90", (13, 0)),
        kernels.cache_key(SET_SOURCE, ("-std=c++17--use_fast_math",), "sm_90", (13, 0)),
    }
    assert len(others) == 6 and base not in others

    k = Kernel("cudalab_test_set", SET_SOURCE, ("p", "u4"))
    fast = Kernel("cudalab_test_set", SET_SOURCE, ("p", "u4"), options=("--use_fast_math",))
    k.cubin("sm_90")
    k.cubin("sm_80")
    fast.cubin("sm_90")
    assert len(calls) == 3
    assert len(_cubin_files(d)) == 3


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_cache_file_is_recompiled_and_rewritten(cache, damage):
    d, calls = cache
    k = Kernel("cudalab_test_set", SET_SOURCE, ("p", "u4"))
    good = k.cubin("sm_90")
    (path,) = _cubin_files(d)
    if damage == "garbage":
        path.write_bytes(b"not a cubin at all" * 10)
    elif damage == "truncated":
        path.write_bytes(good[: len(good) // 2])
    else:
        path.write_bytes(b"")
    kernel_facility._reset_caches_for_tests()
    again = k.cubin("sm_90")
    assert len(calls) == 2
    assert again[:4] == ELF and kernel_facility._valid_cubin(again)
    assert path.read_bytes() == again


def test_unwritable_cache_dir_falls_back_to_memory_with_one_warning(tmp_path, monkeypatch, cache):
    _, calls = cache
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("CUDALAB_CACHE_DIR", str(blocker / "kernels"))  # parent is a file
    a = Kernel("cudalab_test_set", SET_SOURCE, ("p", "u4"))
    with pytest.warns(KernelCacheWarning, match="memory only"):
        cubin = a.cubin("sm_90")
    assert cubin[:4] == ELF
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a.cubin("sm_80")  # second compile: no second warning
        assert a.cubin("sm_90") is cubin  # memory cache still works
    assert len(calls) == 2


def test_default_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDALAB_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernels.cache_dir() == tmp_path / "cudalab" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernels.cache_dir() == tmp_path / "home" / ".cache" / "cudalab" / "kernels"
    monkeypatch.setenv("CUDALAB_CACHE_DIR", str(tmp_path / "mine"))
    assert kernels.cache_dir() == tmp_path / "mine"


# --------------------------------------------------------------------------- validation
def test_kernel_definition_is_validated():
    with pytest.raises(ValueError):
        Kernel("not a name", SET_SOURCE, ("p",))
    with pytest.raises(ValueError, match="unknown parameter types"):
        Kernel("k", SET_SOURCE, ("p", "int"))
    with pytest.raises(TypeError):
        Kernel("k", SET_SOURCE, "pu4")
    with pytest.raises(TypeError):
        Kernel("k", SET_SOURCE, ("p",), options="--use_fast_math")
    with pytest.raises(TypeError):
        Kernel("k", b"source", ("p",))


class _CAI:
    def __init__(self, ptr):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (1,), "typestr": "<u4",
                                         "version": 3}


class _Torchish:
    def data_ptr(self):
        return 0x7000


class _Cupyish:
    ptr = 0x8000


def test_registered_array_types_take_the_fast_path():
    import cudalab

    k = Kernel("cudalab_test_fast_ptr", SET_SOURCE, ("p", "u8"))
    x = cudalab.array.zeros((4,), np.uint32)
    view = x[1:]
    assert k._fast_args((x, 3)) == (x.data_ptr(), 3)
    assert k._fast_args((view, 3)) == (x.data_ptr() + 4, 3)  # a view's own first byte

    class Sub(cudalab.DeviceArray):
        pass

    sub = Sub((2,), np.uint32)  # exact types only: a subclass goes the generic way
    assert k._fast_args((sub, 1)) is None
    assert k._convert_args((sub, 1)) == [sub.data_ptr(), 1]


def test_argument_conversion_and_errors():
    k = Kernel("cudalab_test_args", SET_SOURCE, ("p", "i4", "u4", "i8", "u8", "f4", "f8"))
    args = (0x1000, -5, 7, -(2**63), 2**64 - 1, 1.5, 2.0)
    assert k._fast_args(args) == args  # the launch fast path takes them as they are
    assert k._convert_args(args) == list(args)
    assert k._fast_args(args[:-1]) is None and k._fast_args(list(args[:-1]) + [2]) is None
    assert Kernel("cudalab_test_noargs", "", ())._fast_args(()) == ()
    assert Kernel("cudalab_test_noargs", "", ())._fast_args((1,)) is None
    assert Kernel("cudalab_test_one", "", ("u8",))._fast_args([5]) == (5,)
    # out of range or of another type: left to _convert_args (which raises or converts)
    assert k._fast_args((-1,) + args[1:]) is None
    assert k._fast_args((0, 2**31) + args[2:]) is None
    assert k._fast_args(args[:5] + (1, 2.0)) is None  # an int for f4
    assert k._fast_args((_CAI(0x2000),) + args[1:]) is None  # not a registered type
    out = k._convert_args((_CAI(0x2000), np.int32(-1), np.uint32(3), True, np.uint64(9), 1, np.float32(0.5)))
    assert list(out) == [0x2000, -1, 3, 1, 9, 1.0, 0.5]
    assert type(out[5]) is float
    assert k._convert_args((_Torchish(),) + args[1:])[0] == 0x7000
    assert k._convert_args((_Cupyish(),) + args[1:])[0] == 0x8000
    assert k._convert_args((np.uint64(0x9000),) + args[1:])[0] == 0x9000

    with pytest.raises(TypeError, match="takes 7 arguments"):
        k._convert_args(args[:-1])
    with pytest.raises(OverflowError, match="argument 1"):
        k._convert_args((0, 2**31) + args[2:])
    with pytest.raises(OverflowError, match="argument 2"):
        k._convert_args((0, 0, -1) + args[3:])
    with pytest.raises(OverflowError, match="argument 0"):
        k._convert_args((-1,) + args[1:])
    with pytest.raises(TypeError, match="argument 2"):
        k._convert_args((0, 0, 1.5) + args[3:])
    with pytest.raises(TypeError, match="device address"):
        k._convert_args(("0x10",) + args[1:])
    with pytest.raises(TypeError, match="bool"):
        k._convert_args((True,) + args[1:])
    with pytest.raises(TypeError, match="real number"):
        k._convert_args(args[:5] + ("1.0", 2.0))


def test_launch_config_1d():
    assert kernels.launch_config_1d(1000) == (4, 256)
    assert kernels.launch_config_1d(1024, 128) == (8, 128)
    assert kernels.launch_config_1d(0) == (1, 256)
    assert kernels.launch_config_1d(10**9, 256, max_blocks=1024) == (1024, 256)
    with pytest.raises(ValueError):
        kernels.launch_config_1d(-1)
    with pytest.raises(ValueError):
        kernels.launch_config_1d(10, block=2048)
    with pytest.raises(ValueError):
        kernels.launch_config_1d(10, max_blocks=0)


def test_grid_block_and_stream_validation(backend):
    k = fill_kernel(4)
    ptr = backend.mem_alloc(0, 64)
    try:
        with pytest.raises(ValueError, match="block"):
            k.launch(1, 2048, (ptr, 1, 16))
        with pytest.raises(ValueError, match="block"):
            k.launch(1, (32, 32, 2), (ptr, 1, 16))
        with pytest.raises(ValueError, match="grid"):
            k.launch(0, 32, (ptr, 1, 16))
        with pytest.raises(ValueError, match="grid"):
            k.launch((1, 1, 1, 1), 32, (ptr, 1, 16))
        with pytest.raises(TypeError, match="grid"):
            k.launch(1.5, 32, (ptr, 1, 16))
        with pytest.raises(ValueError, match="shared_mem"):
            k.launch(1, 32, (ptr, 1, 16), shared_mem=-1)
        with pytest.raises(TypeError, match="cudalab Stream"):
            k.launch(1, 32, (ptr, 1, 16), stream=0)
        with pytest.raises(TypeError, match="takes 3 arguments"):
            k(1, 32, (ptr, 1))
    finally:
        backend.mem_free(0, ptr)


# --------------------------------------------------------------------------- launches
def _read(backend, ptr, dtype, n):
    out = np.zeros(n, dtype=dtype)
    backend.memcpy(0, out.ctypes.data, ptr, out.nbytes)
    return out


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_fill_kernels_write_values(backend, itemsize):
    dtype = np.dtype(f"u{itemsize}")
    n = 1000
    ptr = backend.mem_alloc(0, (n + 8) * itemsize)
    try:
        backend.memset_d8(0, ptr, 0, (n + 8) * itemsize)
        value = int(np.iinfo(dtype).max) - 5
        grid, block = kernels.launch_config_1d(n, 128, max_blocks=3)  # grid-stride: 3 blocks
        fill_kernel(itemsize)(grid, block, (ptr, value, n))
        cudalab.current_stream().synchronize()
        got = _read(backend, ptr, dtype, n + 8)
        assert (got[:n] == value).all()
        assert (got[n:] == 0).all()  # nothing written past n
        # values wider than the element are truncated, like a C cast
        if itemsize < 8:
            fill_kernel(itemsize).launch(1, 64, (ptr, 0x1_0000_0000 - 1 if itemsize < 4 else 7, 4))
            cudalab.current_stream().synchronize()
            expect = int(np.iinfo(dtype).max) if itemsize < 4 else 7
            assert (_read(backend, ptr, dtype, 4) == expect).all()
    finally:
        backend.mem_free(0, ptr)


def test_fill_on_a_created_stream_with_array_argument(backend):
    n = 300
    ptr = backend.mem_alloc(0, n * 4)
    s = cudalab.Stream()
    try:
        fill_kernel(4).launch((2,), (256,), (_CAI(ptr), 42, n), stream=s)
        s.synchronize()
        assert (_read(backend, ptr, np.uint32, n) == 42).all()
        with cudalab.stream(s):
            fill_kernel(4)(2, 256, (ptr, 43, n))  # current stream is s
        s.synchronize()
        assert (_read(backend, ptr, np.uint32, n) == 43).all()
    finally:
        s.synchronize()
        backend.mem_free(0, ptr)


def test_fill_on_second_device(backend, two_devices):
    n = 64
    ptr = backend.mem_alloc(1, n * 4)
    try:
        s = cudalab.Stream(1)
        fill_kernel(4).launch(1, 64, (ptr, 9, n), stream=s)
        s.synchronize()
        out = np.zeros(n, np.uint32)
        backend.memcpy(1, out.ctypes.data, ptr, out.nbytes)
        assert (out == 9).all()
    finally:
        backend.mem_free(1, ptr)


def test_module_loaded_once_per_device_and_pack_per_thread(backend, monkeypatch):
    loads, packs = [], []
    real_load, real_make = backend.module_load, backend.make_args
    monkeypatch.setattr(backend, "module_load", lambda d, img: loads.append(d) or real_load(d, img))
    monkeypatch.setattr(backend, "make_args", lambda sig: packs.append(sig) or real_make(sig))
    k = Kernel("cudalab_test_set", SET_SOURCE, ("p", "u4"), sim=_sim_set)
    ptr = backend.mem_alloc(0, 4 * 64 * 4)
    errors = []

    def worker(i):
        try:
            for _ in range(5):
                k(1, 64, (ptr + i * 256, i + 1))
            cudalab.current_stream().synchronize()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert loads == [0]
        assert len(packs) == 4  # one per thread
        got = _read(backend, ptr, np.uint32, 4 * 64).reshape(4, 64)
        assert (got == np.arange(1, 5, dtype=np.uint32)[:, None]).all()
    finally:
        backend.mem_free(0, ptr)


def test_simulator_launch_compiles_nothing(backend, monkeypatch):
    if not backend.simulated:
        pytest.skip("simulator only")

    def no_nvrtc(*args, **kwargs):
        raise AssertionError("the simulator must not compile")

    monkeypatch.setattr(nvrtc, "compile_cubin", no_nvrtc)
    monkeypatch.setattr(nvrtc, "compile_with_log", no_nvrtc)
    k = Kernel("cudalab_test_set", SET_SOURCE, ("p", "u4"), sim=_sim_set)
    ptr = backend.mem_alloc(0, 16 * 4)
    try:
        k(1, 16, (ptr, 5))
        cudalab.current_stream().synchronize()
        assert (_read(backend, ptr, np.uint32, 16) == 5).all()
        nosim = Kernel("cudalab_test_nosim", SET_SOURCE, ("p", "u4"))
        with pytest.raises(RuntimeError, match="no simulator implementation"):
            nosim(1, 16, (ptr, 5))
    finally:
        backend.mem_free(0, ptr)


def test_launch_observers_called(backend):
    seen = []
    ptr = backend.mem_alloc(0, 256)
    _internal.launch_observers.append(lambda *a: seen.append(a))
    try:
        s = cudalab.Stream()
        fill_kernel(4).launch(2, (32, 2), (ptr, 1, 64), stream=s)
        fill_kernel(1)(1, 32, (ptr, 1, 64))
        s.synchronize()
        cudalab.current_stream().synchronize()
        assert seen == [
            ("cudalab_fill_u32", 0, s, (2, 1, 1), (32, 2, 1)),
            ("cudalab_fill_u8", 0, cudalab.current_stream(), (1, 1, 1), (32, 1, 1)),
        ]
    finally:
        _internal.launch_observers.clear()
        backend.mem_free(0, ptr)


def test_launch_blocking_synchronizes_the_stream(backend, monkeypatch):
    synced = []
    real = backend.stream_synchronize
    monkeypatch.setattr(backend, "stream_synchronize", lambda h: synced.append(h) or real(h))
    ptr = backend.mem_alloc(0, 256)
    s = cudalab.Stream()
    old = kernels.is_launch_blocking()
    try:
        kernels.set_launch_blocking(False)
        fill_kernel(4).launch(1, 64, (ptr, 1, 64), stream=s)
        assert synced == []
        kernels.set_launch_blocking(True)
        assert kernels.is_launch_blocking()
        cudalab.set_sync_debug_mode("error")  # a launch-blocking sync is not flagged
        try:
            fill_kernel(4).launch(1, 64, (ptr, 2, 64), stream=s)
        finally:
            cudalab.set_sync_debug_mode(0)
        assert synced == [s.handle]
    finally:
        kernels.set_launch_blocking(old)
        s.synchronize()
        backend.mem_free(0, ptr)


def _python(code, **env_changes):
    """Run ``code`` in a fresh interpreter that imports this checkout's cudalab."""
    env = dict(os.environ)
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    root = os.path.dirname(os.path.dirname(os.path.abspath(cudalab.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_launch_blocking_env_read_at_import():
    code = "import cudalab.kernels as k; print(k.is_launch_blocking())"
    assert _python(code, CUDA_LAUNCH_BLOCKING="1") == "True"
    assert _python(code, CUDA_LAUNCH_BLOCKING="0") == "False"
    assert _python(code, CUDA_LAUNCH_BLOCKING=None) == "False"


def test_defining_kernels_imports_neither_simulator_nor_nvrtc():
    code = """
        import sys
        import cudalab.kernels, cudalab._kernels
        print(sorted(m for m in ("cudalab._driver.sim", "cuda.bindings.nvrtc")
                     if m in sys.modules))
    """
    assert _python(code, CUDALAB_SIMULATOR=None) == "[]"


def test_spin_kernel_occupies_the_stream(backend):
    spin(1, 1, (0,))  # load outside the measurement
    s = cudalab.current_stream()
    s.synchronize()
    start, end = cudalab.Event(enable_timing=True), cudalab.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    spin(1, 1, (2_000_000,))
    end.record()
    end.synchronize()
    wall = (time.perf_counter() - t0) * 1000
    assert wall >= 1.9
    assert start.elapsed_time(end) >= 1.9


# --------------------------------------------------------------------------- real GPU
@pytest.mark.gpu
def test_gpu_fill_reads_back(backend):
    assert not backend.simulated
    n = 1 << 20
    ptr = backend.mem_alloc(0, n * 8)
    try:
        for itemsize, k in FILL_KERNELS.items():
            value = (0x0123456789ABCDEF >> (64 - 8 * itemsize)) | 1
            grid, block = kernels.launch_config_1d(n, 256, max_blocks=1024)
            k(grid, block, (ptr, value, n))
            cudalab.current_stream().synchronize()
            got = _read(backend, ptr, np.dtype(f"u{itemsize}"), n)
            assert (got == value).all(), itemsize
    finally:
        backend.mem_free(0, ptr)


@pytest.mark.gpu
def test_gpu_spin_2ms_measured_by_events(backend):
    assert not backend.simulated
    s = cudalab.Stream()
    spin.launch(1, 1, (1000,), stream=s)  # compile + load outside the measurement
    s.synchronize()
    times = []
    for _ in range(3):
        start, end = cudalab.Event(enable_timing=True), cudalab.Event(enable_timing=True)
        start.record(s)
        spin.launch(1, 1, (2_000_000,), stream=s)
        end.record(s)
        end.synchronize()
        times.append(start.elapsed_time(end))
    assert all(1.9 <= t <= 3.0 for t in times), times


def test_gpu_sleep_is_public_and_occupies_the_stream(backend):
    """cudalab.kernels.gpu_sleep (the notebooks' spin; torch.cuda._sleep's counterpart)."""
    assert "gpu_sleep" in kernels.__all__
    s = cudalab.Stream()
    start, end = cudalab.Event(enable_timing=True), cudalab.Event(enable_timing=True)
    start.record(s)
    kernels.gpu_sleep(2_000_000, stream=s)
    end.record(s)
    end.synchronize()
    assert start.elapsed_time(end) >= 1.5
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError):
            kernels.gpu_sleep(bad)
