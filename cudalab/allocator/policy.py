"""The size policy of the native caching allocator: torch's rounding and segment sizes.

A request of ``size`` bytes gets a block of :func:`round_size` bytes (512 B steps, or
``roundup_power2_divisions`` steps); a rounded size up to 1 MiB uses the small pool, whose
segments are 2 MiB; larger ones the large pool (:func:`allocation_size`). Every allocator
checks a request with :func:`check_size` first (its cheap part is inlined at the top of the
malloc hot paths, against :data:`MAX_ALLOCATION_SIZE`).
"""

from __future__ import annotations

from operator import index as _index
from typing import Any

from cudalab._units import echo
from cudalab.allocator.config import (
    MIN_BLOCK_SIZE,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    AllocatorConfig,
)
from cudalab.errors import OutOfMemoryError

__all__ = ["MAX_ALLOCATION_SIZE", "allocation_size", "check_size", "round_size",
           "roundup_power2_next_division"]

#: Requests of this many bytes or more (1 EiB) fail at once with OutOfMemoryError, before
#: any rounding: no device has that much memory, and it keeps every size the allocator
#: computes (rounded sizes, ``size << 64 | address`` free-list keys) far from overflowing a
#: driver's 64-bit size.
MAX_ALLOCATION_SIZE = 1 << 60


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """torch's ``roundup_power2_next_division``: 1200 with 4 divisions -> 1280."""
    if size & (size - 1) == 0:
        return size
    if divisions < 2:
        raise ValueError("Only 2 or more divisions are supported")
    power2_floor = 1 << (size.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)
    if step == 0:
        return power2_floor << 1
    floor = size & ~(step - 1)
    return size if floor == size else floor + step


def round_size(size: int, config: AllocatorConfig | None = None) -> int:
    """torch's ``round_size``: the block size a request of ``size`` bytes gets."""
    if size < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    if config is not None:
        divisions = config.divisions_for(size)
        if divisions > 1 and size > MIN_BLOCK_SIZE * divisions:
            return roundup_power2_next_division(size, divisions)
    return (size + MIN_BLOCK_SIZE - 1) & -MIN_BLOCK_SIZE


def allocation_size(rounded: int, large_segment_size: int = 20 * 1024 * 1024) -> int:
    """torch's ``get_allocation_size``: the segment size a rounded request creates."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return large_segment_size
    return (rounded + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE


def check_size(size: Any) -> int:
    """A request size as an int, checked (every allocator's malloc calls it off its fast path).

    Parameters
    ----------
    size
        An int, or an object with ``__index__``.

    Returns
    -------
    int
        ``size`` as an int (0 is valid: malloc returns the null pointer for it).

    Raises
    ------
    TypeError
        ``size`` is not an integer (a bool is refused too).
    ValueError
        ``size`` is negative.
    OutOfMemoryError
        ``size`` is :data:`MAX_ALLOCATION_SIZE` or more.
    """
    if type(size) is not int:
        if isinstance(size, bool):
            raise TypeError(f"allocation size must be an int, got {echo(size)}")
        try:
            size = _index(size)
        except TypeError:
            raise TypeError(
                f"allocation size must be an int, got {type(size).__name__} {echo(size)}"
            ) from None
    if size < 0:
        raise ValueError(f"allocation size must be >= 0, got {size}")
    if size >= MAX_ALLOCATION_SIZE:
        raise OutOfMemoryError(text="CUDA out of memory. Tried to allocate more than 1EB memory.")
    return size
