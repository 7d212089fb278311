"""Turning the caching allocator off and on at run time (torch's ``caching_allocator_enable``).

While caching is off, every allocation of a native allocator (the caching allocator and its
expandable-segments flavour) is a plain driver allocation (``cuMemAlloc``) and its free a
plain ``cuMemFree``, as torch's uncached path (``cudaMalloc``/``cudaFree``). Blocks that
came from the cache before stay the cache's: freeing them returns them to the cache, and
blocks allocated while caching was off are returned to the driver whenever they are freed,
even after caching is on again (torch picks the deleter at allocation time too).

As torch's uncached path, those allocations appear in no statistic, snapshot or history
(``mem_get_info`` sees them). The ``cudaMallocAsync`` and pluggable allocators are not
affected (torch's have no cache to turn off).

How: a native allocator's class is switched to a subclass whose ``malloc`` and ``free``
bypass the cache (:func:`set_caching_enabled`), and back; allocators created while caching
is off are switched before they are published (a registry create hook). The cache's own
hot path is untouched: with caching on, no check is added anywhere.
"""

from __future__ import annotations

import threading
from typing import Any

from cudalab.allocator import registry as _registry
from cudalab.allocator.base import stream_key
from cudalab.allocator.caching import DeviceCachingAllocator
from cudalab.allocator.policy import check_size

__all__ = ["caching_enabled", "set_caching_enabled"]

_lock = threading.Lock()
#: False while caching is off (set_caching_enabled); read without the lock.
_enabled = True
#: The bypassing subclass of each native allocator class, made on first use.
_bypass_classes: dict[type, type] = {}


class _Bypass:
    """The methods of a native allocator while caching is off (mixed in before its class).

    ``_bypass_live`` (created on first use, kept across switches): pointer -> size of each
    live allocation made while caching was off; such a pointer is never in ``live``.
    """

    _bypass_live: dict[int, int]

    def malloc(self, size: Any, stream: Any = None) -> int:
        if _enabled:  # caching is back on; this class stays until the last bypass free
            return super().malloc(size, stream)  # type: ignore[misc]
        size = check_size(size)
        if size == 0:
            return 0
        a: Any = self
        if stream is not None:
            stream_key(stream, a.device)  # validate, as the cached path does
        ptr = a.backend.mem_alloc(a.device, size)  # OutOfMemoryError from the driver seam
        a._bypass_live[ptr] = size
        return ptr

    def free(self, ptr: int) -> None:
        a: Any = self
        size = a._bypass_live.pop(ptr, None)
        if size is None:  # a block from the cache, allocated before caching was turned off
            super().free(ptr)  # type: ignore[misc]
            return
        a.backend.mem_free(a.device, ptr)
        if _enabled and not a._bypass_live:
            _restore_class(a)

    def owns(self, ptr: int) -> bool:
        return ptr in self._bypass_live or super().owns(ptr)  # type: ignore[misc]

    def record_stream(self, ptr: int, stream: Any) -> None:
        if ptr in self._bypass_live:
            return  # cuMemFree waits for the device: no event is needed
        super().record_stream(ptr, stream)  # type: ignore[misc]

    def block_size(self, ptr: int) -> int:
        size = self._bypass_live.get(ptr)
        return size if size is not None else super().block_size(ptr)  # type: ignore[misc]


def _bypass_class(cls: type) -> type:
    sub = _bypass_classes.get(cls)
    if sub is None:
        sub = _bypass_classes[cls] = type(f"{cls.__name__}WithoutCaching", (_Bypass, cls),
                                          {"__module__": __name__})
    return sub


def _restore_class(a: Any) -> None:
    """Give ``a`` its own class back (its bypass subclass's MRO: self, _Bypass, class)."""
    cls = type(a)
    if issubclass(cls, _Bypass):
        a.__class__ = cls.__mro__[2]


def _switch(a: Any, enabled: bool) -> None:
    """Put native allocator ``a`` in the requested mode (others are left alone). Turned
    back on, an allocator keeps the bypass class (whose malloc then uses the cache) until
    the allocations made without caching are freed."""
    if not isinstance(a, DeviceCachingAllocator):
        return
    cls = type(a)
    if enabled:
        if isinstance(a, _Bypass) and not a._bypass_live:
            _restore_class(a)
        return
    if isinstance(a, _Bypass):
        return
    a.sync_pending()  # the memo's deferred work first: its hit path lives in malloc
    vars(a).setdefault("_bypass_live", {})  # (kept across switches: see _Bypass)
    a.__class__ = _bypass_class(cls)


def _on_create(a: Any) -> None:
    """Registry create hook: allocators created while caching is off start without it."""
    if not _enabled:
        _switch(a, False)


def caching_enabled() -> bool:
    """Whether the native allocators cache (False after ``set_caching_enabled(False)``)."""
    return _enabled


def set_caching_enabled(enabled: bool) -> None:
    """Turn caching off (``False``) or back on for every native allocator, existing or
    created later (see the module documentation).

    Parameters
    ----------
    enabled : bool
        The new state.

    Raises
    ------
    TypeError
        When ``enabled`` is not a bool.
    """
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"caching_allocator_enable: value must be a bool, got {enabled!r}")
    with _lock:
        _enabled = enabled
        _registry.add_create_hook(_on_create)  # (once, however often it is added)
        for a in list(_registry.active):
            _switch(a, enabled)
