"""Opening one of NVIDIA's libraries (cuBLAS, cuFFT) with ctypes, found by ``cuda.pathfinder``.

:func:`open_library` is the one loader of the seam's ctypes libraries: ``cuda.pathfinder``
(shipped with cuda-bindings 13) finds the library NVIDIA's wheels or a CUDA toolkit
install; the first of the paths it gives (or of the known sonames, when it reports the
library as loaded without a path) that ``ctypes.CDLL`` opens is returned. Each library's
module declares its functions on the result and keeps it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

__all__ = ["open_library"]


def open_library(name: str, label: str, sonames: tuple[str, ...], error: type[Exception],
                 install_hint: str, pathfinder_hint: str = "",
                 fallback: Callable[[], tuple[str, ...]] | None = None) -> ctypes.CDLL:
    """The library ``name`` (``"cublas"``, ``"cufft"``), opened.

    Parameters
    ----------
    name : str
        cuda.pathfinder's name of the library.
    label : str
        Its name in messages (``"cuBLAS"``).
    sonames : tuple of str
        Tried when cuda.pathfinder reports the library as loaded without a path.
    error : type of Exception
        Raised (with the library's message) when it cannot be had.
    install_hint : str
        How to install it, ending every message.
    pathfinder_hint : str, optional
        Appended to the message when cuda.pathfinder itself cannot be imported.
    fallback : callable, optional
        Paths to try when cuda.pathfinder does not find the library (an older
        cuda.pathfinder may not know a wheel's layout); none by default.

    Raises
    ------
    error
        cuda.pathfinder is not importable, the library is not found, or it cannot be opened.
    """
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError as exc:
        raise error(f"{label} cannot be loaded: cuda.pathfinder is not importable "
                    f"({exc}); install cuda-bindings>=13{pathfinder_hint}") from exc
    try:
        loaded = load_nvidia_dynamic_lib(name)
        paths: tuple[str, ...] = (loaded.abs_path,) if loaded.abs_path else sonames
    except Exception as exc:  # DynamicLibNotFoundError and its relatives
        paths = fallback() if fallback is not None else ()
        if not paths:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise error(f"{label} cannot be loaded ({first}); {install_hint}") from exc
    for path in paths:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise error(f"{label} was found by cuda.pathfinder but cannot be opened; {install_hint}")
