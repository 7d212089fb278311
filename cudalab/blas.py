"""``cudalab.current_blas_handle()``: torch.cuda's cuBLAS handle, for calling cuBLAS directly.

As torch does: one handle per (device, thread), created lazily on the first call from that
thread with that device current, and bound to the current stream of the current device on
**every** call (``cublasSetStream``), so work queued through it is ordered with cudalab's
work on that stream. Handles are destroyed when the process exits. ``cudalab.matmul``
uses the same handles through :func:`bound_handle` (on the simulator too, where the
seam's numpy BLAS stands in) and gives them a workspace from cudalab's caching allocator,
as torch does (``CUBLAS_WORKSPACE_CONFIG``).

The library is loaded by :mod:`cudalab._driver.cublas` through ``cuda.pathfinder`` (part of
cuda-bindings 13), which finds the cuBLAS of the ``nvidia-cublas`` wheel (the ``cublas``
extra) or the one torch's CUDA wheels bring; see that module for why this dependency.

On the simulator there is no cuBLAS: :func:`current_blas_handle` raises
:class:`cudalab.CublasError` saying so (a fake handle would crash the first cuBLAS call
made through ctypes).
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

from cudalab import _internal, _interrupts
from cudalab import devices as _devices
from cudalab import streams as _streams
from cudalab._driver import cublas as _cublas
from cudalab.errors import CublasError

__all__ = ["BoundHandle", "bound_handle", "current_blas_handle", "forget_settings"]

_tls = threading.local()  # .handles: {device index: BoundHandle} of this thread
_lock = threading.Lock()
#: Every handle created, for destruction at exit. Guarded by ``_lock``.
_created: list[BoundHandle] = []


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
    bound = bound_handle(device)
    stream = _streams.current_stream(device)
    _cublas.set_stream(bound.handle, stream.cuda_stream)
    # the caller may change the handle's settings: matmul sets them all again next time
    bound.stream = bound.workspace = bound.math_mode = None
    return bound.handle


class BoundHandle:
    """One (device, thread)'s BLAS handle and the settings last given to it, so that
    ``cudalab.matmul`` makes a call only for a setting that changes (None: unknown).

    ``blas`` is the backend's :class:`~cudalab._driver.blas_seam.Blas`; ``handle`` its handle
    (an int, never 0 on cuBLAS); ``stream`` the ``cuda_stream`` int, ``workspace`` the
    (address, bytes) pair and ``math_mode`` the ``cublasMath_t`` last set, each None
    when unknown (just created, or handed to a user by :func:`current_blas_handle`).
    """

    __slots__ = ("blas", "handle", "device", "stream", "workspace", "math_mode")

    def __init__(self, blas: Any, handle: int, device: int) -> None:
        self.blas = blas
        self.handle = handle
        self.device = device
        self.stream: int | None = None
        self.workspace: tuple[int, int] | None = None
        self.math_mode: int | None = None


def bound_handle(device: int) -> BoundHandle:
    """The BLAS handle of ``device`` for this thread, created on first use (with ``device``'s
    context current). On the simulator it is the seam's simulated BLAS's handle.

    Raises
    ------
    cudalab.CublasError
        cuBLAS cannot be loaded (the message says what to install).
    """
    handles = getattr(_tls, "handles", None)
    if handles is None:
        handles = _tls.handles = {}
    bound = handles.get(device)
    if bound is None:
        _internal.ensure_context(device)  # cuBLAS attaches to the current context
        blas = _internal.backend().blas()
        bound = BoundHandle(blas, blas.create(device), device)
        handles[device] = bound
        with _lock:
            if not _created:
                atexit.register(_destroy_all)
            _created.append(bound)
    return bound


def forget_settings() -> None:
    """Mark the settings of every handle (of every thread) unknown, so that the next
    ``cudalab.matmul`` on each sets its stream, workspace and math mode again (after
    ``cudalab._array_matmul.clear_workspaces`` gave the workspaces back)."""
    with _lock:
        created = list(_created)
    for bound in created:
        bound.stream = bound.workspace = bound.math_mode = None


def _destroy_all() -> None:
    """Destroy every handle (at exit; errors of a driver already shutting down are ignored)."""
    with _lock:
        created, _created[:] = list(_created), []
    for bound in created:
        try:
            _internal.ensure_context(bound.device)
            bound.blas.destroy(bound.handle)
        except Exception:
            pass


# Ctrl-C waits until these return (cudalab._interrupts): between current_blas_handle's
# cublasSetStream and its reset of the record, or bound_handle's creation and its record,
# an interrupt would leave a record that no longer tells the handle's state.
_interrupts.guard(current_blas_handle, bound_handle, forget_settings, _destroy_all)
