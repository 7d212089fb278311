"""The allocator's controls of torch's ``torch.cuda.memory`` API: releasing the cache, the
per-process memory fraction, the backend's name, free and total device memory, turning the
caching off. Re-exported by :mod:`cudalab.memory` (their documented home), split from it so
no module is over 800 lines; the hot getters and the raw allocation pair stay there.
"""

from __future__ import annotations

from typing import Any

from cudalab import _internal
from cudalab import devices as _devices
from cudalab import streams as _streams
from cudalab.allocator.pluggable import current_allocator
from cudalab.allocator.registry import active as _active  # never rebound: bind once
from cudalab.allocator.registry import allocator_config, count_sync_before_creation, get_allocator

__all__ = [
    "caching_allocator_enable",
    "empty_cache",
    "get_allocator_backend",
    "get_per_process_memory_fraction",
    "mem_get_info",
    "set_per_process_memory_fraction",
]


def empty_cache() -> None:
    """Return every cached block that is not part of a live segment to the driver.

    Does nothing (and does not initialise CUDA) when CUDA is not initialised.
    """
    if not _internal.is_initialized():
        return
    _streams.refuse_during_capture("cudalab.memory.empty_cache()")
    for a in list(_active):
        a.empty_cache()
    # torch's emptyCache runs on every device's allocator, so its num_sync_all_streams moves
    # on devices nothing was allocated on yet; count those without creating allocators.
    count_sync_before_creation(_devices.device_count())


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    """Cap this process's reserved memory on ``device`` at ``fraction`` of its total memory.

    Parameters
    ----------
    fraction : float
        In [0, 1].
    device : int, str, Device or None, optional
        The device (default: the current device).

    Raises
    ------
    TypeError
        When ``fraction`` is not a float (as torch).
    ValueError
        When it is outside [0, 1], or for a device index out of range.
    """
    d = _internal.device_index(device)
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if fraction < 0 or fraction > 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    get_allocator(d).set_memory_fraction(fraction)


def get_per_process_memory_fraction(device: Any = None) -> float:
    """The fraction set by :func:`set_per_process_memory_fraction`.

    Parameters
    ----------
    device : int, str, Device or None, optional
        The device (default: the current device).

    Returns
    -------
    float
        The fraction, 1.0 when none was set.
    """
    return get_allocator(_internal.device_index(device)).get_memory_fraction()


def get_allocator_backend() -> str:
    """The allocator backend in use, as torch's function of the same name.

    Returns
    -------
    str
        "native", "cudaMallocAsync" or "pluggable" (after :func:`change_current_allocator`).
    """
    for a in _active:
        return a.name
    if current_allocator() is not None:
        return "pluggable"
    return allocator_config().backend


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """The device's free and total memory as the driver reports them.

    Parameters
    ----------
    device : int, str, Device or None, optional
        The device (default: the current device).

    Returns
    -------
    (int, int)
        ``(free, total)`` bytes (free memory counts every process's use).
    """
    return _devices.mem_get_info(device)


def caching_allocator_enable(value: bool = True) -> None:
    """Turn the caching allocator on or off (torch's function of the same name).

    While it is off, every allocation is a plain driver allocation and every free of such
    an allocation a plain driver free; blocks allocated from the cache before stay the
    cache's. As torch's, allocations made while caching is off appear in no statistic,
    snapshot or history, and the ``cudaMallocAsync`` and pluggable allocators are not
    affected (see :mod:`cudalab.allocator.caching_switch`).

    Parameters
    ----------
    value : bool, optional
        True (default) turns caching on, False off.

    Raises
    ------
    TypeError
        When ``value`` is not a bool.

    Notes
    -----
    As torch's, this does nothing until CUDA is initialised (``cudalab.init()`` or the
    first CUDA call): call it after that.
    """
    if not isinstance(value, bool):
        raise TypeError(f"caching_allocator_enable: value must be a bool, got {value!r}")
    if not _internal.is_initialized():
        return
    from cudalab.allocator.caching_switch import set_caching_enabled

    set_caching_enabled(value)
