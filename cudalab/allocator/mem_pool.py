"""User-created private pools: torch's ``MemPool`` (its runtime half) and ``use_mem_pool``.

A :class:`MemPoolBase` owns one use of a private pool ``(0, n)`` on the device that was
current when it was made (:mod:`cudalab.allocator.pools`); :func:`use_mem_pool` routes the
calling thread's allocations on that device to it while the ``with`` block runs. Dropping
the object releases its use and empties the pool's cache, as torch's ``~MemPool``; memory
still allocated from it stays valid and goes back to the driver with the first
``empty_cache()`` after it is freed.

:class:`cudalab.memory.MemPool` is the public class (it adds ``snapshot()``, which needs the
snapshot tooling this runtime package does not import).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from cudalab import _internal
from cudalab.allocator import registry as _registry
from cudalab.allocator.pluggable import PluggableAllocator
from cudalab.allocator.pools import graph_pool_handle

__all__ = ["MemPoolBase", "on_use_mem_pool", "use_mem_pool"]

#: Called as ``hook(pool_id, device)`` right after :func:`use_mem_pool` starts routing to a
#: pool. CUDA graphs add one that retains the pool in the graph being captured on the current
#: stream, if any (torch's ``use_mem_pool`` does the same through
#: ``CUDAGraph.get_currently_capturing_graph()._retain_pool``).
on_use_mem_pool: list[Callable[[tuple[int, int], int], None]] = []


def _drop_pool(allocator: Any, pool_id: tuple[int, int]) -> None:
    """torch's ``~MemPool``: no use_on_oom, one use less, release the pool's free memory
    (``drop_pool`` never waits for the allocator's lock: this runs from a finalizer)."""
    allocator.drop_pool(pool_id)


class MemPoolBase:
    """A user-created private pool of the current device (torch's ``MemPool``; see
    :class:`cudalab.memory.MemPool`, the public class).

    Parameters
    ----------
    allocator : PluggableAllocator, optional
        Where the pool's segments come from (``cudalab.memory.PluggableAllocator`` or
        ``CUDAPluggableAllocator``); default: the driver, like every other segment.
    use_on_oom : bool, optional
        When an ordinary allocation of this device runs out of memory, search this pool's
        free blocks before failing.
    no_split : bool, optional
        Never split the pool's blocks (each allocation takes a whole cached block or a new
        segment).

    Raises
    ------
    TypeError
        ``allocator`` is not a PluggableAllocator, or a flag is not a bool.
    NotImplementedError
        The device's allocator has no private pools (not the native caching allocator, or
        expandable segments).
    """

    def __init__(self, allocator: PluggableAllocator | None = None, use_on_oom: bool = False,
                 no_split: bool = False):
        if allocator is not None and not isinstance(allocator, PluggableAllocator):
            raise TypeError(f"MemPool: allocator must be a PluggableAllocator (or None), got "
                            f"{type(allocator).__name__} {allocator!r}")
        for name, flag in (("use_on_oom", use_on_oom), ("no_split", no_split)):
            if not isinstance(flag, bool):
                raise TypeError(f"MemPool: {name} must be a bool, got {type(flag).__name__} "
                                f"{flag!r}")
        device = _internal.device_index(None)
        owner = _registry.get_allocator(device)
        pool_id = graph_pool_handle()
        if getattr(owner, "_expandable", False):
            raise NotImplementedError(
                "MemPool: private memory pools are not supported with expandable_segments:True "
                "yet; set CUDALAB_ALLOC_CONF=expandable_segments:False")
        owner.create_or_incref_pool(pool_id, allocator)
        # From here the pool holds a use: the finalizer gives it back, whatever happens next.
        self._finalizer = weakref.finalize(self, _drop_pool, owner, pool_id)
        self._finalizer.atexit = False
        if use_on_oom or no_split:
            owner.set_pool_options(pool_id, use_on_oom=use_on_oom, no_split=no_split)
        self._id = pool_id
        self._device = device
        self._owner = owner
        self._allocator = allocator

    @property
    def id(self) -> tuple[int, int]:
        """The pool's id ``(0, n)`` (torch's ``MemPool.id``)."""
        return self._id

    @property
    def allocator(self) -> PluggableAllocator | None:
        """The allocator its segments come from (None: the driver)."""
        return self._allocator

    @property
    def device(self) -> int:
        """The device the pool lives on (the current device when it was made)."""
        return self._device

    def use_count(self) -> int:
        """Its use count: 1 for this object, +1 per open :func:`use_mem_pool` block and per
        graph that captured into it and was not reset."""
        return self._owner.get_pool_use_count(self._id)

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} id={self._id} device={self._device} "
                f"use_count={self.use_count()}>")


@contextmanager
def use_mem_pool(pool: MemPoolBase, device: Any = None) -> Iterator[None]:
    """torch's ``use_mem_pool``: route this thread's allocations on ``device`` to ``pool``.

    Only the calling thread's allocations go to the pool (threads it starts do not). On exit
    the routing ends and the use the block held is released.

    Parameters
    ----------
    pool : MemPool
        The pool.
    device : int, str or Device, optional
        Default: the current device. Must be the pool's device.

    Raises
    ------
    TypeError
        ``pool`` is not a MemPool.
    ValueError
        ``device`` is not the pool's device.
    RuntimeError
        This pool is already being allocated to (torch's "already recording" text).
    """
    if not isinstance(pool, MemPoolBase):
        raise TypeError(f"use_mem_pool: pool must be a MemPool, got {type(pool).__name__} "
                        f"{pool!r}")
    d = _internal.device_index(device)
    if d != pool.device:
        raise ValueError(f"use_mem_pool: the pool {pool.id} lives on device {pool.device}, "
                         f"not on device {d}")
    owner = pool._owner
    pool_id = pool.id
    owner.begin_allocate_to_pool(pool_id, None)
    try:
        for hook in on_use_mem_pool:
            hook(pool_id, d)
        yield
    finally:
        try:
            owner.end_allocate_to_pool(pool_id)
        finally:
            owner.release_pool(pool_id)
