"""NVRTC: CUDA C++ source to CUBIN, through ``cuda.bindings.nvrtc`` (imported on first use).

Only CUBIN is produced, never PTX: the GPU hosts run driver 580 (CUDA 13.0 API), which cannot
JIT PTX from a newer NVRTC, while CUBIN from any 13.x NVRTC loads under minor-version
compatibility.

Every failure, including a missing ``cuda-bindings`` package or NVRTC library, raises
:class:`cudalab.errors.KernelCompileError`.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

from cudalab.errors import KernelCompileError

INSTALL_HINT = (
    "install NVRTC with `pip install nvidia-cuda-nvrtc` (and `pip install cuda-bindings` "
    "for the Python bindings)"
)

_ARCH_RE = re.compile(r"^sm_\d+[af]?$")

_lock = threading.Lock()
_mod: Any = None  # cuda.bindings.nvrtc once it imported and its library loaded
_version: tuple[int, int] | None = None


def _nvrtc() -> Any:
    """The bindings module, with the NVRTC library loaded (checked once per process)."""
    mod = _mod
    if mod is not None:
        return mod
    return _load()


def _load() -> Any:
    global _mod, _version
    with _lock:
        if _mod is not None:
            return _mod
        try:
            from cuda.bindings import nvrtc as mod
        except ImportError as exc:
            raise KernelCompileError(
                f"cannot compile CUDA kernels: cuda.bindings.nvrtc is not importable ({exc}); "
                f"{INSTALL_HINT}"
            ) from exc
        try:
            # The first call loads libnvrtc; a missing library raises
            # cuda.pathfinder.DynamicLibNotFoundError (a RuntimeError) here.
            res, major, minor = mod.nvrtcVersion()
        except (RuntimeError, OSError) as exc:
            raise KernelCompileError(
                f"cannot compile CUDA kernels: the NVRTC library could not be loaded "
                f"({type(exc).__name__}: {exc}); {INSTALL_HINT}"
            ) from exc
        if int(res) != 0:
            raise KernelCompileError(f"nvrtcVersion failed: {_error_string(mod, res)}")
        _version = (int(major), int(minor))
        _mod = mod
        return mod


def _error_string(mod: Any, res: Any) -> str:
    try:
        err, text = mod.nvrtcGetErrorString(res)
        if int(err) == 0 and text:
            return text.decode(errors="replace")
    except Exception:  # pragma: no cover - only when the library misbehaves
        pass
    return f"nvrtcResult {int(res)}"


def available() -> bool:
    """Whether NVRTC (the bindings and the library) can be loaded; never raises."""
    if _mod is not None:
        return True
    try:
        _load()
    except KernelCompileError:
        return False
    return True


def version() -> tuple[int, int]:
    """NVRTC's (major, minor) version, e.g. (13, 0)."""
    _nvrtc()
    assert _version is not None
    return _version


def supported_archs() -> list[str]:
    """The real architectures this NVRTC can compile for, e.g. ``["sm_75", ..., "sm_120"]``."""
    mod = _nvrtc()
    res, archs = mod.nvrtcGetSupportedArchs()
    if int(res) != 0:
        raise KernelCompileError(f"nvrtcGetSupportedArchs failed: {_error_string(mod, res)}")
    return [f"sm_{int(a)}" for a in archs]


def _check_options(options: Sequence[str]) -> tuple[str, ...]:
    if isinstance(options, (str, bytes)):
        raise TypeError(f"options must be a tuple of strings, not a single {type(options).__name__}")
    opts = tuple(options)
    for opt in opts:
        if not isinstance(opt, str):
            raise TypeError(f"compile options must be str, got {opt!r}")
        if opt.startswith(("-arch", "--gpu-architecture")):
            raise ValueError(f"pass the architecture as arch=, not as option {opt!r}")
    return opts


def compile_with_log(
    source: str, name: str, arch: str = "sm_90", options: Sequence[str] = ()
) -> tuple[bytes, str]:
    """Compile ``source`` to CUBIN for ``arch``; returns (cubin, compiler log).

    The log is empty for a clean compile and holds warnings otherwise. ``name`` is the
    kernel's name; the program is named ``name + ".cu"`` in NVRTC's messages.
    """
    if not isinstance(source, str):
        raise TypeError(f"kernel source must be str, got {type(source).__name__}")
    if not isinstance(arch, str) or not _ARCH_RE.match(arch):
        raise ValueError(
            f"arch must name a real architecture such as 'sm_90' (CUBIN only), got {arch!r}"
        )
    opts = _check_options(options)
    mod = _nvrtc()
    argv = [f"-arch={arch}".encode()] + [o.encode() for o in opts]

    def fail(what: str, res: Any, log: str = "") -> KernelCompileError:
        text = (
            f"compiling kernel {name!r} for {arch} with options {list(opts)} failed: "
            f"{what}: {_error_string(mod, res)}"
        )
        if log:
            text += "\nNVRTC log:\n" + log
        return KernelCompileError(text)

    res, prog = mod.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    if int(res) != 0:
        raise fail("nvrtcCreateProgram", res)
    try:
        (res,) = mod.nvrtcCompileProgram(prog, len(argv), argv)
        log = _program_log(mod, prog)
        if int(res) != 0:
            raise fail("nvrtcCompileProgram", res, log)
        res, size = mod.nvrtcGetCUBINSize(prog)
        if int(res) != 0:
            raise fail("nvrtcGetCUBINSize", res, log)
        buf = bytearray(int(size))
        (res,) = mod.nvrtcGetCUBIN(prog, buf)
        if int(res) != 0:
            raise fail("nvrtcGetCUBIN", res, log)
        return bytes(buf), log
    finally:
        mod.nvrtcDestroyProgram(prog)


def compile_cubin(
    source: str, name: str, arch: str = "sm_90", options: Sequence[str] = ()
) -> bytes:
    """Compile ``source`` to a CUBIN image for ``arch`` (see :func:`compile_with_log`)."""
    return compile_with_log(source, name, arch, options)[0]


def _program_log(mod: Any, prog: Any) -> str:
    res, size = mod.nvrtcGetProgramLogSize(prog)
    if int(res) != 0 or int(size) <= 1:
        return ""
    buf = bytearray(int(size))
    (res,) = mod.nvrtcGetProgramLog(prog, buf)
    if int(res) != 0:
        return ""
    return bytes(buf).rstrip(b"\x00").decode(errors="replace").strip()


def _reset_for_tests() -> None:
    """Forget the loaded library state (tests that simulate a missing NVRTC)."""
    global _mod, _version
    with _lock:
        _mod = None
        _version = None
