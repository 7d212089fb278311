"""Backend selection for the driver seam (see :mod:`cudalab._driver.base`).

The real backend is the default. The simulator is chosen only explicitly, with
``CUDALAB_SIMULATOR=1`` in the environment or :func:`use_simulator` before the first CUDA
call; cudalab never falls back to it silently.
"""

from __future__ import annotations

import os
import threading

from cudalab._driver.base import Backend

_lock = threading.Lock()
_backend: Backend | None = None
_requested: str | None = None  # set by use_simulator()

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def _env_wants_simulator() -> bool:
    raw = os.environ.get("CUDALAB_SIMULATOR", "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"CUDALAB_SIMULATOR={raw!r} is not understood; use 1/true/yes/on to select the "
        "simulator or 0/false/no/off (or unset) for the real driver"
    )


def selected_backend_name() -> str:
    """"simulator" or "cuda": what :func:`get_backend` will create (or has created)."""
    if _backend is not None:
        return _backend.name
    if _requested is not None:
        return _requested
    return "simulator" if _env_wants_simulator() else "cuda"


def use_simulator(enable: bool = True) -> None:
    """Select the simulator (or, with ``enable=False``, the real driver) for this process.

    Must be called before cudalab initialises CUDA; afterwards the backend cannot change.
    """
    global _requested
    name = "simulator" if enable else "cuda"
    with _lock:
        if _backend is not None:
            if _backend.name == name:
                return
            raise RuntimeError(
                f"cudalab is already initialised with the {_backend.name!r} backend; "
                "use_simulator() must be called before the first CUDA call"
            )
        _requested = name


def get_backend() -> Backend:
    """The process's backend, created on first use (importing the driver bindings lazily)."""
    backend = _backend
    if backend is not None:
        return backend
    return _create()


def _create() -> Backend:
    global _backend
    with _lock:
        if _backend is None:
            name = _requested or ("simulator" if _env_wants_simulator() else "cuda")
            if name == "simulator":
                from cudalab._driver.sim import SimulatorBackend

                _backend = SimulatorBackend()
            else:
                from cudalab._driver.cuda import CudaBackend

                _backend = CudaBackend()
        return _backend


def current_backend() -> Backend | None:
    """The backend if it was already created, else None (never creates one)."""
    return _backend


def _reset_for_tests() -> None:
    """Forget the backend (tests only: live handles from the old one become invalid)."""
    global _backend, _requested
    with _lock:
        _backend = None
        _requested = None
