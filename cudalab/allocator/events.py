"""A per-device pool of reusable events for the allocator's ``record_stream`` bookkeeping.

torch's ``EventPool`` (CUDACachingAllocator.cpp): creating and destroying a CUDA event costs
about as much as recording it, and a block freed after use on other streams needs one event
per stream, so events are created once with ``EVENT_DISABLE_TIMING`` (the cheapest kind) and
recycled. Events stay alive for the life of the pool (torch leaks its pool on purpose to
avoid shutdown-order problems; :meth:`EventPool.close` destroys the idle ones explicitly).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from cudalab._driver.base import EVENT_DISABLE_TIMING

if TYPE_CHECKING:
    from cudalab._driver.base import Backend

__all__ = ["EventPool"]


class EventPool:
    """Idle ``EVENT_DISABLE_TIMING`` events of one device, handed out and taken back.

    ``get()`` returns a driver event handle (an idle one or a new one); ``put(event)`` gives it
    back once the allocator has seen it complete. Thread-safe; no driver call when an idle
    event is available.
    """

    __slots__ = ("backend", "device", "_idle", "_lock", "created")

    def __init__(self, backend: Backend, device: int) -> None:
        self.backend = backend
        self.device = device
        #: Idle events (opaque seam handles). Invariant: ``len(_idle) <= created``; the
        #: difference is the number handed out and not yet put back.
        self._idle: list[Any] = []
        self._lock = threading.Lock()
        #: Number of events this pool has created (for tests and diagnostics).
        self.created = 0

    def get(self) -> Any:
        """An idle event, or a new ``EVENT_DISABLE_TIMING`` one (a driver call) when none is."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self.created += 1
        return self.backend.event_create(self.device, EVENT_DISABLE_TIMING)

    def put(self, event: Any) -> None:
        """Take back an event from :meth:`get` once its recorded work has completed."""
        with self._lock:
            self._idle.append(event)

    def idle(self) -> int:
        """Number of idle events held."""
        return len(self._idle)

    def close(self) -> None:
        """Destroy the idle events (events handed out and not returned are not touched)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for ev in idle:
            try:
                self.backend.event_destroy(ev)
            except Exception:  # driver already gone at shutdown: nothing to give back
                pass
