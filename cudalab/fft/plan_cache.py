"""The cuFFT plan cache: torch's ``torch.backends.cuda.cufft_plan_cache``, one LRU per device.

Each device has a :class:`CuFFTPlanCache` of plans keyed by their layout (transform type,
sizes, embeddings, strides, distances, batch), as torch's ``CuFFTParamsLRUCache``:

* ``max_size`` (default 4096, torch's ``CUFFT_DEFAULT_CACHE_SIZE``; any int from 0 to
  2**64 - 1, torch's ``CUFFT_MAX_PLAN_NUM``): lowering it destroys the least recently used
  plans beyond it; 0 turns the cache off: every transform then builds its plan and destroys
  it after queuing, as torch does.
* ``size``: the plans held now (read-only); ``clear()`` destroys them all.
* A hit moves the plan to the front; a miss on a full cache destroys the least recently used.

Plans are created with cuFFT's automatic work-area allocation off; each execution takes its
work area from cudalab's caching allocator (torch's ``_exec_fft``), so the memory views show
it while a transform runs (a ``uint8`` block of the plan's work size, allocated by
``cudalab.fft``). On the simulator the plans are ``numpy.fft`` records counted the same way.
"""

from __future__ import annotations

import collections
import operator
import threading
from typing import Any

from cudalab import _internal

__all__ = ["CUFFT_DEFAULT_CACHE_SIZE", "CUFFT_MAX_PLAN_NUM", "CuFFTPlanCache", "Plan",
           "PlanCacheSizeError", "plan_cache"]

#: torch's default ``max_size``.
CUFFT_DEFAULT_CACHE_SIZE = 4096
#: torch's largest ``max_size`` (``SIZE_MAX``).
CUFFT_MAX_PLAN_NUM = 2**64 - 1


class PlanCacheSizeError(ValueError, RuntimeError):
    """A ``max_size`` out of range: a ValueError, and a RuntimeError as torch's check."""


class Plan:
    """One cuFFT plan: the seam's FFT, its plan, its work-area bytes, its device."""

    __slots__ = ("fft", "plan", "work_size", "device")

    def __init__(self, fft: Any, plan: int, work_size: int, device: int) -> None:
        self.fft = fft  # the backend's seam Fft
        self.plan = plan  # the library's plan (an int)
        self.work_size = work_size  # bytes of work area an execution needs (>= 0)
        self.device = device  # the device it was made on

    def destroy(self) -> None:
        """Release the plan (errors of a driver shutting down are ignored at exit)."""
        self.fft.destroy(self.plan)


def make_plan(device: int, key: tuple[Any, ...]) -> Plan:
    """A new plan on ``device`` for ``key`` = (type, sizes, inembed, istride, idist, onembed,
    ostride, odist, batch)."""
    fft_type, sizes, inembed, istride, idist, onembed, ostride, odist, batch = key
    _internal.ensure_context(device)
    fft = _internal.backend().fft()
    plan, work = fft.plan(device, sizes, inembed, istride, idist, onembed, ostride, odist,
                          fft_type, batch)
    return Plan(fft, plan, work, device)


class CuFFTPlanCache:
    """The plan cache of one device (``cudalab.backends.cuda.cufft_plan_cache[device]``)."""

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index
        self._lock = threading.Lock()
        # key -> Plan, least recently used first; at most _max_size entries
        self._plans: collections.OrderedDict[tuple[Any, ...], Plan] = collections.OrderedDict()
        self._max_size = CUFFT_DEFAULT_CACHE_SIZE  # 0 <= _max_size <= CUFFT_MAX_PLAN_NUM

    def __repr__(self) -> str:
        return (f"<cudalab cuFFT plan cache of cuda:{self.device_index}: {self.size} plans, "
                f"max_size {self._max_size}>")

    @property
    def size(self) -> int:
        """The number of plans held (read-only)."""
        return len(self._plans)

    @property
    def max_size(self) -> int:
        """The most plans held (default 4096); 0 turns caching off."""
        return self._max_size

    @max_size.setter
    def max_size(self, value: int) -> None:
        try:
            new = operator.index(value)
        except TypeError:
            raise TypeError(f"cufft_plan_cache.max_size must be an int, got "
                            f"{type(value).__name__}") from None
        if new < 0:
            raise PlanCacheSizeError(f"cufft_plan_cache.max_size must be non-negative, but "
                                     f"got {new}")
        if new > CUFFT_MAX_PLAN_NUM:
            raise PlanCacheSizeError(f"cufft_plan_cache.max_size can not be larger than "
                                     f"{CUFFT_MAX_PLAN_NUM}, but got {new}")
        with self._lock:
            self._max_size = new
            evicted = []
            while len(self._plans) > new:
                evicted.append(self._plans.popitem(last=False)[1])
        for plan in evicted:
            plan.destroy()

    def clear(self) -> None:
        """Destroy every plan held."""
        with self._lock:
            evicted = list(self._plans.values())
            self._plans.clear()
        for plan in evicted:
            plan.destroy()

    def lookup(self, key: tuple[Any, ...]) -> tuple[Plan, bool]:
        """The plan for ``key`` and whether the caller must destroy it after use (True when
        the cache is off); a miss creates it, evicting the least recently used plan."""
        plans = self._plans
        with self._lock:
            plan = plans.get(key)
            if plan is not None:
                plans.move_to_end(key)
                return plan, False
        plan = make_plan(self.device_index, key)
        evicted = None
        with self._lock:
            if self._max_size == 0:
                return plan, True
            other = plans.get(key)  # another thread made it meanwhile: keep theirs
            if other is not None:
                plans.move_to_end(key)
                evicted, plan = plan, other
            else:
                if len(plans) >= self._max_size:
                    evicted = plans.popitem(last=False)[1]
                plans[key] = plan
        if evicted is not None:
            evicted.destroy()
        return plan, False


_caches: dict[int, CuFFTPlanCache] = {}
_caches_lock = threading.Lock()


def plan_cache(device: int) -> CuFFTPlanCache:
    """The plan cache of the device index ``device`` (created on first use)."""
    cache = _caches.get(device)
    if cache is None:
        with _caches_lock:
            cache = _caches.get(device)
            if cache is None:
                cache = _caches[device] = CuFFTPlanCache(device)
    return cache
