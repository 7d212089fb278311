"""Out-of-memory observers: torch's ``torch.cuda.memory._attach_out_of_memory_observer``.

An observer is called as ``observer(device, alloc, device_allocated, device_free)`` right
before a native allocator (caching, expandable segments, or caching turned off) raises
:class:`cudalab.OutOfMemoryError`, with torch's arguments:

* ``device``: the device index;
* ``alloc``: the bytes of the allocation that failed (the segment size the allocator asked
  the driver for, as torch passes);
* ``device_allocated``: the most this process may hold on the device: the per-process
  limit when :func:`cudalab.set_per_process_memory_fraction` set one, else the device's
  total memory (torch's ``allowed_memory_maximum`` / ``device_total``);
* ``device_free``: the bytes the driver reports free.

Observers run with the allocator's lock released, so they may read statistics or take a
snapshot. An observer that raises does not hide the out-of-memory error: its exception is
reported as a :class:`RuntimeWarning` and the remaining observers still run.

The observers are the observer bus's out-of-memory family (:mod:`cudalab._observe`):
:data:`observers` is :data:`cudalab._observe.out_of_memory_subscribers`, and attaching
subscribes there.
"""

from __future__ import annotations

import warnings

from cudalab import _observe

__all__ = ["attach_out_of_memory_observer", "notify_out_of_memory", "observers"]

#: The attached observers, in attachment order (the bus's out-of-memory list, never rebound).
#: Invariant: only appended to (by attach_out_of_memory_observer) or cleared by tests; the
#: allocators test it for emptiness before building any argument, so no observer costs
#: nothing.
observers: _observe.Subscribers[_observe.OutOfMemoryObserver] = (
    _observe.out_of_memory_subscribers)


def attach_out_of_memory_observer(observer: _observe.OutOfMemoryObserver) -> None:
    """Call ``observer(device, alloc, device_allocated, device_free)`` before every
    out-of-memory error of a native allocator, on every device (see the module doc).

    Parameters
    ----------
    observer : callable
        Called with four ints; its return value is ignored.

    Raises
    ------
    TypeError
        When ``observer`` is not callable.
    """
    if not callable(observer):
        raise TypeError(
            f"observer must be callable as observer(device, alloc, device_allocated, "
            f"device_free), got {type(observer).__name__} {observer!r}")
    _observe.subscribe_out_of_memory(observer)


def notify_out_of_memory(device: int, alloc: int, device_allocated: int,
                         device_free: int) -> None:
    """Call every observer (the allocator's lock must not be held).

    Parameters
    ----------
    device, alloc, device_allocated, device_free : int
        The observers' arguments (see the module doc).
    """
    for observer in list(observers):
        try:
            observer(device, alloc, device_allocated, device_free)
        except Exception as exc:  # noqa: BLE001 - an observer must not hide the OOM
            warnings.warn(f"out-of-memory observer {observer!r} raised "
                          f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)
