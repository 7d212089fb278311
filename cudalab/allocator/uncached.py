"""The pass-through allocator of ``CUDALAB_NO_MEMORY_CACHING=1``: no cache at all."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cudalab.allocator.base import (
    Allocator,
    bad_pointer,
    fraction_total,
    oom_text,
    stream_key,
)
from cudalab.allocator.blocks import SegmentDict
from cudalab.allocator.config import SMALL_SIZE, UNLIMITED, AllocatorConfig
from cudalab.allocator.oom_observers import notify_out_of_memory
from cudalab.allocator.oom_observers import observers as _oom_observers  # never rebound
from cudalab.allocator.policy import check_size
from cudalab.allocator.stats import Counters, DeviceStats
from cudalab.errors import OutOfMemoryError

if TYPE_CHECKING:
    from cudalab._driver.base import Backend
    from cudalab.allocator.hooks import AllocatorTrace

__all__ = ["UncachedAllocator"]


class UncachedAllocator(Allocator):
    """``CUDALAB_NO_MEMORY_CACHING=1``: every malloc is a ``mem_alloc``, every free a
    ``mem_free`` (for compute-sanitizer and similar tools).

    Statistics are kept (each allocation counts as its own segment of exactly the requested
    size), so ``memory_allocated()`` still tells the truth; torch's uncached mode reports 0.
    ``record_stream`` needs no events: ``mem_free`` synchronises the device.
    """

    name = "native"

    def __init__(self, backend: Backend, device: int = 0, config: AllocatorConfig | None = None,
                 stream_resolver: Callable[[], int] | None = None):
        self.backend = backend
        self.device = device
        self.config = config or AllocatorConfig()
        ms = self.config.max_split_size
        self.stats = DeviceStats(-1 if ms >= UNLIMITED else ms)
        self.live: dict[int, tuple[int, int, Counters]] = {}
        self._lock = threading.Lock()
        self._set_fraction = False
        self._fraction = 1.0
        self._allowed = 0
        self._total = 0
        self._trace: AllocatorTrace | None = None

    def malloc(self, size: Any, stream: Any = None) -> int:
        size = check_size(size)
        if size == 0:
            return 0
        if stream is not None:
            stream_key(stream, self.device)
        st = self.stats
        pool = st.small if size <= SMALL_SIZE else st.large
        with self._lock:
            over = self._set_fraction and st.current("b_res") + size > self._allowed
            exc = self._oom(size) if over else None
        if exc is not None:
            raise self._observed(exc, size)
        try:
            ptr = self.backend.mem_alloc(self.device, size)
        except OutOfMemoryError:
            with self._lock:
                exc = self._oom(size)
            raise self._observed(exc, size) from None
        with self._lock:
            self.live[ptr] = (size, size, pool)
            st.num_device_alloc += 1
            for code in ("n_seg", "n_alloc"):
                st.increase(pool, code, 1)
            for code in ("b_res", "b_alloc", "b_req"):
                st.increase(pool, code, size)
            if self._trace is not None:
                self._trace("segment_alloc", ptr, size, 0)
                self._trace("alloc", ptr, size, 0)
        return ptr

    def free(self, ptr: int) -> None:
        with self._lock:
            entry = self.live.pop(ptr, None)
            if entry is None:
                if ptr == 0 and type(ptr) is int:
                    return
                raise bad_pointer(ptr)
            size, _, pool = entry
            st = self.stats
            for code in ("n_seg", "n_alloc"):
                st.decrease(pool, code, 1)
            for code in ("b_res", "b_alloc", "b_req"):
                st.decrease(pool, code, size)
            st.num_device_free += 1
            if self._trace is not None:
                for action in ("free_requested", "free_completed"):
                    self._trace(action, ptr, size, 0)
                self._trace("segment_free", ptr, size, 0)
        self.backend.mem_free(self.device, ptr)

    def owns(self, ptr: int) -> bool:
        return ptr in self.live

    def record_stream(self, ptr: int, stream: Any) -> None:
        if ptr not in self.live:
            raise bad_pointer(ptr)

    def empty_cache(self) -> None:
        with self._lock:
            self.stats.num_sync_all_streams += 1

    def set_memory_fraction(self, fraction: float) -> None:
        total = fraction_total(self.backend, self.device, fraction)
        with self._lock:
            self._total = total
            self._allowed = int(fraction * total)
            self._fraction = float(fraction)  # returned as set (torch stores the fraction)
            self._set_fraction = True

    def segments(self) -> list[SegmentDict]:
        with self._lock:
            items = sorted(self.live.items())
        return [{
            "device": self.device, "address": ptr, "total_size": size, "allocated_size": size,
            "active_size": size, "requested_size": req, "stream": 0,
            "segment_type": "small" if pool is self.stats.small else "large",
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
            "blocks": [{"address": ptr, "size": size, "requested_size": req,
                        "state": "active_allocated", "frames": []}],
        } for ptr, (size, req, pool) in items]

    def _observed(self, exc: OutOfMemoryError, size: int) -> OutOfMemoryError:
        """``exc``, after the out-of-memory observers saw it (lock not held)."""
        if _oom_observers:
            free, total = self.backend.mem_get_info(self.device)
            notify_out_of_memory(self.device, size,
                                 self._allowed if self._set_fraction else total, free)
        return exc

    def _oom(self, size: int) -> OutOfMemoryError:
        free, total = self.backend.mem_get_info(self.device)
        st = self.stats
        st.num_ooms += 1
        if self._trace is not None:
            self._trace("oom", free, size, 0)
        return OutOfMemoryError(text=oom_text(
            self.device, size, free, total, st.current("b_alloc"), st.current("b_res"),
            self._allowed if self._set_fraction else None))
