"""``cudalab.current_blas_handle()``: torch.cuda's cuBLAS handle, for calling cuBLAS directly.

As torch does: one handle per (device, thread), created lazily on the first call from that
thread with that device current, and bound to the current stream of the current device on
**every** call (``cublasSetStream``), so work queued through it is ordered with cudalab's
work on that stream. Handles are destroyed when the process exits. cudalab sets no cuBLAS
workspace (torch gives cuBLAS one from its allocator; cuBLAS then uses its own).

The library is loaded by :mod:`cudalab._driver.cublas` through ``cuda.pathfinder`` (part of
cuda-bindings 13), which finds the cuBLAS of the ``nvidia-cublas`` wheel (the ``cublas``
extra) or the one torch's CUDA wheels bring; see that module for why this dependency.

On the simulator there is no cuBLAS: :func:`current_blas_handle` raises
:class:`cudalab.CublasError` saying so (a fake handle would crash the first cuBLAS call).
"""

from __future__ import annotations

import atexit
import threading

from cudalab import _internal
from cudalab import devices as _devices
from cudalab import streams as _streams
from cudalab._driver import cublas as _cublas
from cudalab.errors import CublasError

__all__ = ["current_blas_handle"]

_tls = threading.local()  # .handles: {device index: cuBLAS handle} of this thread
_lock = threading.Lock()
#: Every handle created, as (device, handle), for destruction at exit. Guarded by ``_lock``.
_created: list[tuple[int, int]] = []


def current_blas_handle() -> int:
    """The cuBLAS handle (``cublasHandle_t``, an int) of the current device and thread.

    Created on the first call of each (device, thread); bound to the current stream on
    every call, as ``torch.cuda.current_blas_handle``.

    Returns
    -------
    int
        The handle's address, for cuBLAS calls through ctypes or other bindings.

    Raises
    ------
    cudalab.CublasError
        The backend is the simulator (it has no cuBLAS), cuBLAS cannot be loaded
        (the message says what to install), or a cuBLAS call failed.
    """
    backend = _internal.backend()
    if backend.simulated:
        raise CublasError("current_blas_handle(): the simulated backend has no cuBLAS (a "
                          "real GPU is needed; the simulator was chosen by "
                          "CUDALAB_SIMULATOR=1 or cudalab.use_simulator())")
    device = _devices.current_device()
    handles = getattr(_tls, "handles", None)
    if handles is None:
        handles = _tls.handles = {}
    handle = handles.get(device)
    if handle is None:
        _internal.ensure_context(device)  # cuBLAS attaches to the current context
        handle = _cublas.create()
        handles[device] = handle
        with _lock:
            if not _created:
                atexit.register(_destroy_all)
            _created.append((device, handle))
    _cublas.set_stream(handle, _streams.current_stream(device).cuda_stream)
    return handle


def _destroy_all() -> None:
    """Destroy every handle (at exit; errors of a driver already shutting down are ignored)."""
    with _lock:
        created, _created[:] = list(_created), []
    for device, handle in created:
        try:
            _internal.ensure_context(device)
            _cublas.destroy(handle)
        except Exception:
            pass
