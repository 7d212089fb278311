"""A stand-in ``cupti.cupti`` module with the calls cudalab makes, for tests without CUPTI.

:func:`install` puts it in ``sys.modules`` (through ``monkeypatch``, so it is removed after
the test). While its ``CONCURRENT_KERNEL`` kind is enabled it turns every cudalab kernel
launch (seen through :data:`cudalab._internal.launch_observers`) into a kernel record with a
1 µs duration; the memcpy/memset records a test puts in ``state["extra"]`` are delivered
at the next flush. Timestamps are CUPTI's default clock (CLOCK_REALTIME, ns), or, with
``ticks_per_ns``, a foreign clock as kineto registers one (``get_timestamp`` reads it).
``subscribe`` fails with ``ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED``
when ``busy=True`` (another profiler holds CUPTI); ``enable_status`` makes
``activity_enable`` fail with that status.
"""

from __future__ import annotations

import enum
import sys
import time
import types
from typing import Any

__all__ = ["FOREIGN_EPOCH", "KERNEL_NS", "install", "memcpy_record", "memset_record"]

#: The duration of every stand-in kernel record (ns).
KERNEL_NS = 1000
#: Where the stand-in's foreign clock starts (far from any real clock's "now", so the tracer
#: cannot mistake it for torch's TSC or CLOCK_REALTIME).
FOREIGN_EPOCH = 10**16


class ActivityKind(enum.IntEnum):
    """The ``CUpti_ActivityKind`` values cudalab uses (CUPTI's numbers)."""

    MEMCPY = 1
    MEMSET = 2
    KERNEL = 3
    RUNTIME = 5
    CONCURRENT_KERNEL = 10


class Result(enum.IntEnum):
    """A few ``CUptiResult`` values (CUPTI's numbers)."""

    SUCCESS = 0
    ERROR_NOT_INITIALIZED = 15
    ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED = 39


class cuptiError(Exception):  # noqa: N801 - cupti-python's name
    def __init__(self, status: int):
        super().__init__(f"{Result(status).name} ({status})")
        self.status = status


def memcpy_record(nbytes: int, copy_kind: int = 2, device: int = 0, ns: int = 3000) -> Any:
    """A memcpy activity record (``copy_kind`` 1 HtoD, 2 DtoH, 8 DtoD) of ``ns`` ns."""
    t = time.time_ns()
    return types.SimpleNamespace(kind=int(ActivityKind.MEMCPY), bytes=nbytes, copy_kind=copy_kind,
                                 device_id=device, start=t, end=t + ns, stream_id=7)


def memset_record(nbytes: int, device: int = 0, ns: int = 2000) -> Any:
    """A memset activity record of ``ns`` ns."""
    t = time.time_ns()
    return types.SimpleNamespace(kind=int(ActivityKind.MEMSET), bytes=nbytes, value=0,
                                 device_id=device, start=t, end=t + ns, stream_id=7)


def install(monkeypatch: Any, *, busy: bool = False, enable_status: int | None = None,
            ticks_per_ns: float | None = None) -> dict:
    """Install the stand-in as ``cupti`` / ``cupti.cupti``; returns its state dict:
    ``cb`` (the registered buffer callbacks), ``enabled`` (kinds), ``extra`` (records for
    the next flush), ``registrations`` and ``flushes`` (call counts)."""
    from cudalab import _internal
    from cudalab._driver import cupti as seam_cupti

    state: dict[str, Any] = {"cb": None, "enabled": set(), "extra": [], "pending": [],
                             "registrations": 0, "flushes": 0}

    def get_timestamp() -> int:
        if ticks_per_ns is None:
            return time.time_ns()
        return int(time.perf_counter_ns() * ticks_per_ns) + FOREIGN_EPOCH

    def observer(name: str, device: int, stream: Any, grid: tuple, block: tuple) -> None:
        if int(ActivityKind.CONCURRENT_KERNEL) in state["enabled"]:
            t = get_timestamp()
            state["pending"].append(types.SimpleNamespace(
                kind=int(ActivityKind.CONCURRENT_KERNEL), name=name, device_id=device, start=t,
                end=t + round(KERNEL_NS * (ticks_per_ns or 1)), stream_id=7, grid_x=grid[0], grid_y=grid[1], grid_z=grid[2],
                block_x=block[0], block_y=block[1], block_z=block[2]))

    def activity_register_callbacks(requested: Any, completed: Any) -> None:
        state["cb"] = (requested, completed)
        state["registrations"] += 1

    def activity_enable(kind: int) -> None:
        if enable_status is not None:
            raise cuptiError(enable_status)
        state["enabled"].add(int(kind))
        if observer not in _internal.launch_observers:
            _internal.launch_observers.append(observer)

    def activity_disable(kind: int) -> None:
        state["enabled"].discard(int(kind))
        if not state["enabled"] and observer in _internal.launch_observers:
            _internal.launch_observers.remove(observer)

    def activity_flush_all(flag: int) -> None:
        state["flushes"] += 1
        records = state["pending"] + state["extra"] + [types.SimpleNamespace(kind=5)]
        state["pending"], state["extra"] = [], []
        if state["cb"] is not None:
            state["cb"][1](records)

    def subscribe(callback: Any, userdata: Any) -> int:
        if busy:
            raise cuptiError(int(Result.ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED))
        return 1234

    def unsubscribe(handle: int) -> None:
        pass

    mod = types.SimpleNamespace(
        ActivityKind=ActivityKind, Result=Result, cuptiError=cuptiError,
        activity_register_callbacks=activity_register_callbacks,
        activity_enable=activity_enable, activity_disable=activity_disable,
        activity_flush_all=activity_flush_all, subscribe=subscribe, unsubscribe=unsubscribe,
        get_timestamp=get_timestamp)
    pkg = types.ModuleType("cupti")
    pkg.cupti = mod  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupti", pkg)
    monkeypatch.setitem(sys.modules, "cupti.cupti", mod)
    monkeypatch.setattr(seam_cupti, "_kinds", {})
    monkeypatch.setattr(seam_cupti, "_sink", None)
    monkeypatch.setattr(seam_cupti, "_calibrated", {})
    return state
