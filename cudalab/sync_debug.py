"""Flag host-device synchronisations made by cudalab (``torch.cuda.set_sync_debug_mode``).

Every place where cudalab blocks the host on the GPU (stream/event/device synchronize,
synchronous copies to the host) reads the observer bus's synchronization flag
(``cudalab._observe.sync_on``) first, so the check costs one global read when debugging is
off. A mode other than default subscribes :func:`_report` to that family (the bus tells it
of each synchronization, and its RuntimeError in "error" mode stops the operation).
"""

from __future__ import annotations

import warnings

from cudalab import _interrupts, _observe
from cudalab._units import echo

__all__ = ["set_sync_debug_mode", "get_sync_debug_mode"]

_NAMES = {"default": 0, "warn": 1, "error": 2}
#: The mode: 0 (default), 1 (warn) or 2 (error). Invariant: :func:`_report` is subscribed to
#: the bus's synchronization family exactly while it is not 0 (only _set_mode writes both).
_mode = 0


def set_sync_debug_mode(debug_mode: int | str) -> None:
    """Set the debug mode for synchronising operations.

    ``"default"``/0: do nothing; ``"warn"``/1: warn on each synchronising call;
    ``"error"``/2: raise RuntimeError instead of synchronising.
    """
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
    _set_mode(value)


def _set_mode(value: int) -> None:
    """Set :data:`_mode` and the bus subscription with it (Ctrl-C deferred across both)."""
    global _mode
    was, _mode = _mode, value
    if value and not was:
        _observe.subscribe_sync(_report)
    elif was and not value:
        _observe.unsubscribe_sync(_report)


_interrupts.guard(_set_mode)


def get_sync_debug_mode() -> int:
    """The current mode: 0 (default), 1 (warn) or 2 (error)."""
    return _mode


def _report(what: str) -> None:
    """The bus's synchronization observer while the mode is not default: raise (error) or
    warn (warn), the warning pointing at the caller of the synchronizing operation (the
    frames: this, ``_observe.notify_sync``, the operation, its caller)."""
    if _mode == 2:
        raise RuntimeError(f"called a synchronizing CUDA operation: {what} (sync debug mode is 'error')")
    if _mode == 1:
        warnings.warn(f"called a synchronizing CUDA operation: {what}", UserWarning, stacklevel=4)
