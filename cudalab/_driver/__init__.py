"""Backend selection for the driver seam (see :mod:`cudalab._driver.base`).

The real backend is the default. The simulator is chosen only explicitly, with
``CUDALAB_SIMULATOR=1`` in the environment or :func:`use_simulator` before CUDA is
initialised; cudalab never falls back to it silently. Probing the real backend
(``is_available()``, ``device_count()``) creates it but does not commit the process to it:
only :func:`commit`, called by :mod:`cudalab.devices` once CUDA is initialised, does.
"""

from __future__ import annotations

import os
import threading

from cudalab._driver.base import Backend
from cudalab._units import echo

_lock = threading.Lock()
_backend: Backend | None = None
_requested: str | None = None  # set by use_simulator()
#: True once cudalab.devices initialised CUDA on ``_backend`` (handles may exist from then
#: on, so the backend can no longer be replaced).
_committed = False

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
        f"CUDALAB_SIMULATOR={echo(raw)} is not understood; use 1/true/yes/on to select the "
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
    """The seam's half of :func:`cudalab.use_simulator` (``cudalab.devices.use_simulator``,
    which adds the fork check and forgets a probed device count): select the backend by name,
    dropping one that was only probed.

    Raises
    ------
    RuntimeError
        The other backend is committed (CUDA was initialised on it, see :func:`commit`).
    """
    global _requested, _backend
    name = "simulator" if enable else "cuda"
    with _lock:
        if _backend is not None:
            if _backend.name == name:
                return
            if _committed:
                raise RuntimeError(
                    f"cudalab has already initialised CUDA with the {_backend.name!r} backend "
                    "(cudalab.is_initialized() is True), so it cannot switch to the "
                    f"{name!r} one; call use_simulator() before the first CUDA call"
                )
            _backend = None  # only probed: nothing holds a handle from it yet
        _requested = name


def commit(backend: Backend) -> None:
    """Record that CUDA is initialised on ``backend``: from now on it cannot be replaced.

    Called by :mod:`cudalab.devices` (under its init lock) once initialisation succeeded.
    """
    global _committed
    with _lock:
        if backend is not _backend:
            raise RuntimeError("the cudalab backend was replaced while CUDA was initialised")
        _committed = True


def get_backend() -> Backend:
    """The process's backend, created on first use (importing the driver bindings lazily)."""
    backend = _backend
    if backend is not None:
        return backend
    return _create()


def probe() -> Backend:
    """The backend that a device count before CUDA is initialised asks: :func:`get_backend`,
    except that a simulator that was only probed (not committed), made under another
    ``CUDA_VISIBLE_DEVICES``, is made anew; it holds no handles yet. torch does not fix the
    count before CUDA is initialised, so a change of the variable before then is seen.
    """
    global _backend
    backend = _backend
    if backend is not None and not _committed and backend.name == "simulator":
        from cudalab._driver.sim import SimulatorBackend
        from cudalab._driver.sim.config import visible_devices_from_env

        if (isinstance(backend, SimulatorBackend)
                and backend.config.visible_devices != visible_devices_from_env()):
            with _lock:
                if _backend is backend and not _committed:
                    _backend = None
    return get_backend()


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


def private_simulator(device_count: int = 1, memory: int | None = None) -> Backend:
    """A simulator backend of the caller's own, initialised: never the process's backend.

    It neither creates, replaces nor commits the backend of :func:`get_backend`, and shares no
    state with it, so a tool can model a device apart from the running program (the what-if
    replays of :mod:`cudalab.memory_tools.replay` run a fresh allocator over one). Upper
    layers reach it as ``cudalab._internal.private_simulator``.

    Parameters
    ----------
    device_count : int, optional
        Simulated devices (default 1).
    memory : int, optional
        Bytes of memory per device (default: the simulator's, 16 GiB).

    Raises
    ------
    TypeError, ValueError
        For a count or size the simulator cannot model (see ``SimulatorConfig``).
    """
    from cudalab._driver.sim import SimulatorBackend, SimulatorConfig

    config = (SimulatorConfig(device_count=device_count) if memory is None
              else SimulatorConfig(device_count=device_count, memory=memory))
    sim = SimulatorBackend(config)
    sim.init()
    return sim


def current_backend() -> Backend | None:
    """The backend if it was already created, else None (never creates one)."""
    return _backend


def _reset_for_tests() -> None:
    """Forget the backend (tests only: live handles from the old one become invalid)."""
    global _backend, _requested, _committed
    with _lock:
        _backend = None
        _requested = None
        _committed = False
