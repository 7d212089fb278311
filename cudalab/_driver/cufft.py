"""cuFFT through ctypes: the library loaded by ``cuda.pathfinder`` (the driver seam).

Why this dependency: ``cuda.pathfinder`` ships with cuda-bindings 13 (already a cudalab
dependency) and finds the cuFFT that NVIDIA's wheels install (``nvidia-cufft`` for CUDA 13,
the ``fft`` extra; ``nvidia-cufft-cu12``; the ``nvidia/cu13/lib`` directory torch's CUDA 13
wheels bring) or a CUDA toolkit, the same way :mod:`.cublas` finds cuBLAS. nvmath-python's
bindings would add a large package (and its own cuFFT loader) for the eight calls cudalab
makes: ``cufftCreate``, ``cufftSetAutoAllocation``, ``cufftMakePlanMany64``,
``cufftSetWorkArea``, ``cufftSetStream``, ``cufftExec{C2C,R2C,C2R,Z2Z,D2Z,Z2D}``,
``cufftDestroy`` and ``cufftGetVersion``.

Plans are plain ints. Every failing call raises :class:`cudalab.errors.CufftError` naming the
call and the ``cufftResult``; a missing library raises it naming the ``fft`` extra.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

from cudalab._driver.fft_seam import C2C, C2R, D2Z, R2C, Z2D, Z2Z, Fft
from cudalab._driver.handles import StreamHandle
from cudalab._driver.nvidia_library import open_library
from cudalab.errors import CufftError

__all__ = ["INSTALL_HINT", "RealFft", "library"]

INSTALL_HINT = ("install cuFFT with `pip install cudalab[fft]` (the nvidia-cufft wheel, "
                "CUDA 13); torch's CUDA wheels bring one too")
#: sonames tried when cuda.pathfinder reports the library as loaded without a path.
_SONAMES = ("libcufft.so.12", "libcufft.so.11")

#: cufftResult names, by value (cufft.h).
_RESULTS = {
    1: "CUFFT_INVALID_PLAN", 2: "CUFFT_ALLOC_FAILED", 3: "CUFFT_INVALID_TYPE",
    4: "CUFFT_INVALID_VALUE", 5: "CUFFT_INTERNAL_ERROR", 6: "CUFFT_EXEC_FAILED",
    7: "CUFFT_SETUP_FAILED", 8: "CUFFT_INVALID_SIZE", 9: "CUFFT_UNALIGNED_DATA",
    11: "CUFFT_INVALID_DEVICE", 13: "CUFFT_NO_WORKSPACE", 14: "CUFFT_NOT_IMPLEMENTED",
    16: "CUFFT_NOT_SUPPORTED", 17: "CUFFT_MISSING_DEPENDENCY",
}

_lock = threading.Lock()
_lib: Any = None  # the ctypes.CDLL once loaded and declared


def library() -> Any:
    """The loaded cuFFT library (ctypes), loading it on the first call.

    Raises
    ------
    CufftError
        cuFFT (or cuda.pathfinder) is not installed; the message names the ``fft`` extra.
    """
    lib = _lib
    return lib if lib is not None else _load()


def _load() -> Any:
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        lib = open_library("cufft", "cuFFT", _SONAMES, CufftError, INSTALL_HINT,
                           pathfinder_hint=f", then {INSTALL_HINT}", fallback=_wheel_libraries)
        vp, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        p64 = ctypes.POINTER(i64)
        for name, args in (
            ("cufftCreate", (ctypes.POINTER(i32),)),
            ("cufftDestroy", (i32,)),
            ("cufftSetAutoAllocation", (i32, i32)),
            ("cufftMakePlanMany64", (i32, i32, p64, p64, i64, i64, p64, i64, i64, i32, i64,
                                     ctypes.POINTER(ctypes.c_size_t))),
            ("cufftSetWorkArea", (i32, vp)),
            ("cufftSetStream", (i32, vp)),
            ("cufftExecC2C", (i32, vp, vp, i32)),
            ("cufftExecZ2Z", (i32, vp, vp, i32)),
            ("cufftExecR2C", (i32, vp, vp)),
            ("cufftExecD2Z", (i32, vp, vp)),
            ("cufftExecC2R", (i32, vp, vp)),
            ("cufftExecZ2D", (i32, vp, vp)),
            ("cufftGetVersion", (ctypes.POINTER(i32),)),
        ):
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = i32
        _lib = lib
        return lib


def _wheel_libraries() -> tuple[str, ...]:
    """libcufft files in NVIDIA's wheel directories on ``sys.path`` (``nvidia/cu13/lib``,
    ``nvidia/cufft/lib``), newest soname first: where cuda.pathfinder would look."""
    import glob
    import os
    import sys

    found: list[str] = []
    for root in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cufft/lib"):
            for soname in _SONAMES:
                path = os.path.join(root, sub, soname)
                if os.path.isfile(path):
                    found.append(path)
    if not found:
        for root in sys.path:
            found.extend(sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib",
                                                       "libcufft.so.*")), reverse=True))
    return tuple(found)


def _check(result: int, call: str) -> None:
    if result:
        name = _RESULTS.get(result, "unknown cufftResult")
        raise CufftError(f"{call} failed: {name} ({result})", result)


def _longs(values: Sequence[int]) -> Any:
    return (ctypes.c_longlong * len(values))(*values)


class RealFft(Fft):
    """The seam's FFT over cuFFT (loaded on the first call that needs it).

    Each plan's stream and work area are set only when they change (a plan-cache hit on
    the same stream with the allocator's same block makes one cuFFT call, the execution).
    """

    def __init__(self) -> None:
        #: plan -> (stream int, work area address) last set on it; dropped when destroyed.
        self._bound: dict[int, tuple[int, int]] = {}

    def version(self) -> int:
        out = ctypes.c_int()
        _check(library().cufftGetVersion(ctypes.byref(out)), "cufftGetVersion")
        return out.value

    def plan(self, device: int, sizes: Sequence[int], inembed: Sequence[int], istride: int,
             idist: int, onembed: Sequence[int], ostride: int, odist: int, fft_type: int,
             batch: int) -> tuple[int, int]:
        lib = library()
        handle = ctypes.c_int()
        _check(lib.cufftCreate(ctypes.byref(handle)), "cufftCreate")
        plan = handle.value
        try:
            _check(lib.cufftSetAutoAllocation(plan, 0), "cufftSetAutoAllocation")
            work = ctypes.c_size_t()
            _check(lib.cufftMakePlanMany64(plan, len(sizes), _longs(sizes), _longs(inembed),
                                           istride, idist, _longs(onembed), ostride, odist,
                                           fft_type, batch, ctypes.byref(work)),
                   "cufftMakePlanMany64")
        except BaseException:
            lib.cufftDestroy(plan)
            raise
        self._bound.pop(plan, None)  # (cuFFT may reuse a destroyed plan's number)
        return plan, int(work.value)

    def destroy(self, plan: int) -> None:
        self._bound.pop(plan, None)
        _check(library().cufftDestroy(plan), "cufftDestroy")

    def execute(self, plan: int, stream: StreamHandle, work_area: int, fft_type: int,
                source: int, destination: int, direction: int) -> None:
        lib = _lib if _lib is not None else library()
        stream_int = int(stream)  # type: ignore[call-overload]
        bound = self._bound.get(plan)
        if bound is None or bound[0] != stream_int:
            result = lib.cufftSetStream(plan, stream_int)
            if result:
                _check(result, "cufftSetStream")
            bound = (stream_int, 0)
        if work_area and bound[1] != work_area:  # (a plan of work size 0 needs none)
            result = lib.cufftSetWorkArea(plan, work_area)
            if result:
                _check(result, "cufftSetWorkArea")
            bound = (stream_int, work_area)
        self._bound[plan] = bound
        if fft_type == C2C:
            result, call = lib.cufftExecC2C(plan, source, destination, direction), "cufftExecC2C"
        elif fft_type == Z2Z:
            result, call = lib.cufftExecZ2Z(plan, source, destination, direction), "cufftExecZ2Z"
        elif fft_type == R2C:
            result, call = lib.cufftExecR2C(plan, source, destination), "cufftExecR2C"
        elif fft_type == D2Z:
            result, call = lib.cufftExecD2Z(plan, source, destination), "cufftExecD2Z"
        elif fft_type == C2R:
            result, call = lib.cufftExecC2R(plan, source, destination), "cufftExecC2R"
        elif fft_type == Z2D:
            result, call = lib.cufftExecZ2D(plan, source, destination), "cufftExecZ2D"
        else:
            raise CufftError(f"cufftExec: unknown transform type {fft_type:#x}")
        if result:
            _check(result, call)
