"""Flag host-device synchronisations made by cudalab (``torch.cuda.set_sync_debug_mode``).

Every place where cudalab blocks the host on the GPU (stream/event/device synchronize,
synchronous copies to the host, cuMemFree, empty_cache) checks the module-level ``_mode``
int first, so the check costs one global read when debugging is off.
"""

from __future__ import annotations

import warnings

from cudalab._units import echo

__all__ = ["set_sync_debug_mode", "get_sync_debug_mode"]

_NAMES = {"default": 0, "warn": 1, "error": 2}
_mode = 0


def set_sync_debug_mode(debug_mode: int | str) -> None:
    """Set the debug mode for synchronising operations.

    ``"default"``/0: do nothing; ``"warn"``/1: warn on each synchronising call;
    ``"error"``/2: raise RuntimeError instead of synchronising.
    """
    global _mode
    if isinstance(debug_mode, str):
        if debug_mode not in _NAMES:
            raise RuntimeError(
                f"invalid value of debug_mode {echo(debug_mode)}, expected one of `default`, `warn`, `error`"
            )
        value = _NAMES[debug_mode]
    elif isinstance(debug_mode, int) and not isinstance(debug_mode, bool) and debug_mode in (0, 1, 2):
        value = debug_mode
    else:
        raise RuntimeError(
            f"invalid value of debug_mode {echo(debug_mode)}, expected one of `default`, `warn`, `error` (or 0, 1, 2)"
        )
    _mode = value


def get_sync_debug_mode() -> int:
    """The current mode: 0 (default), 1 (warn) or 2 (error)."""
    return _mode


def _report(what: str) -> None:
    if _mode == 2:
        raise RuntimeError(f"called a synchronizing CUDA operation: {what} (sync debug mode is 'error')")
    if _mode == 1:
        warnings.warn(f"called a synchronizing CUDA operation: {what}", UserWarning, stacklevel=3)


def _note_sync(what: str) -> None:
    """Call at every host-blocking point; cheap when the mode is default."""
    if _mode:
        _report(what)
