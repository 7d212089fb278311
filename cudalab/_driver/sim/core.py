"""The simulator backend's shared core: its state, argument validation and error helpers.

:class:`SimulatorCore` is the base of every concern mixin of the simulator backend
(:mod:`.memory`, :mod:`.vmm`, :mod:`.streams`, :mod:`.events`, :mod:`.kernels`; assembled in
:mod:`.backend`). It holds the state they share, built from a :class:`SimulatorConfig`, the
validation every call starts with, and declares (as abstract methods) the internal services
one concern offers the others, so each mixin is typed against the whole backend.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import mmap
import operator
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from cudalab._driver.base import STREAM_DEFAULT, Backend, ClosedHandle
from cudalab._driver.handles import EventHandle, StreamHandle
from cudalab._driver.sim.config import SimulatorConfig, device_uuid
from cudalab._driver.sim.handles import SimEvent, SimStream
from cudalab._driver.sim.heap import SimDevice, SimPool, SimVmmRange
from cudalab.errors import CudaError, OutOfMemoryError

#: The simulator's clock (events, NVML activity): host nanoseconds.
now = time.perf_counter_ns

#: Kinds of work recorded in the activity log (NVML utilisation): a kernel, a copy or fill.
ACTIVITY_KERNEL = 0
ACTIVITY_COPY = 1


# ---------------------------------------------------------------------------------- errors
def invalid_value(call: str, detail: str | None = None) -> CudaError:
    """CUDA_ERROR_INVALID_VALUE (1) for ``call``."""
    msg = "invalid argument" if not detail else f"invalid argument ({detail})"
    return CudaError(1, "CUDA_ERROR_INVALID_VALUE", msg, call=call)


def invalid_handle(call: str, detail: str | None = None) -> CudaError:
    """CUDA_ERROR_INVALID_HANDLE (400) for ``call``."""
    msg = "invalid resource handle" if not detail else f"invalid resource handle ({detail})"
    return CudaError(400, "CUDA_ERROR_INVALID_HANDLE", msg, call=call)


def invalid_device(call: str, detail: str | None = None) -> CudaError:
    """CUDA_ERROR_INVALID_DEVICE (101) for ``call``."""
    msg = "invalid device ordinal" if not detail else f"invalid device ordinal {detail}"
    return CudaError(101, "CUDA_ERROR_INVALID_DEVICE", msg, call=call)


def out_of_memory(call: str, message: str = "out of memory") -> OutOfMemoryError:
    """CUDA_ERROR_OUT_OF_MEMORY (2) for ``call``."""
    return OutOfMemoryError(2, "CUDA_ERROR_OUT_OF_MEMORY", message, call=call)


# ------------------------------------------------------------------------------------ core
class SimulatorCore(Backend):
    """State and validation shared by the simulator's concern mixins (see the module doc).

    The simulator package's internal API (public spellings, read by its NCCL and NVML
    modules, never outside ``cudalab._driver``): :attr:`total_devices`,
    :attr:`memory_per_device`, :attr:`by_physical`, :attr:`physical_uuids` and
    :attr:`activity` (read by :mod:`.nvml`); :meth:`stream_of`, :meth:`checked_address`,
    :meth:`submit` and :meth:`pump` (used by :mod:`.nccl` to queue a collective's work).
    """

    name = "simulator"
    simulated = True

    def __init__(self, config: SimulatorConfig | None = None) -> None:
        cfg = SimulatorConfig.from_env() if config is None else config
        if not isinstance(cfg, SimulatorConfig):
            raise TypeError(f"SimulatorBackend(config): expected a SimulatorConfig, got "
                            f"{type(cfg).__name__}")
        #: The settings this simulator was built with (frozen).
        self.config = cfg
        #: Simulated devices, visible or not (NVML sees them all).
        self.total_devices = cfg.device_count
        #: Bytes of memory of each device.
        self.memory_per_device = cfg.memory
        #: Visible devices, by CUDA ordinal; ``by_physical`` maps back from NVML's indices.
        self._devs = [SimDevice(i, phys, self.memory_per_device)
                      for i, phys in enumerate(cfg.visible())]
        #: Visible devices by physical (NVML) index.
        self.by_physical = {dev.physical: dev for dev in self._devs}
        #: Every device's UUID, by physical index.
        self.physical_uuids = [device_uuid(i) for i in range(self.total_devices)]
        for dev in self._devs:
            dev.null = SimStream(self, dev.ordinal, 0, STREAM_DEFAULT, 0, null=True)
        self._initialized = False
        self._tls = threading.local()
        # Memory bookkeeping: one re-entrant lock; a free re-entering from a finalizer while
        # this thread is mid-update (_mem_busy) is deferred until the update ends.
        self._mem_lock = threading.RLock()
        self._mem_busy = False
        self._deferred_frees: list[tuple[int, bool]] = []
        # Pinned host buffers by address (mapping, requested size); _host_starts is sorted.
        self._host: dict[int, tuple[mmap.mmap, int]] = {}
        self._host_starts: list[int] = []
        # Mappings freed while work was queued: closed once nothing is queued.
        self._host_graveyard: list[mmap.mmap] = []
        # Virtual memory reservations by start address (_vmm_starts sorted), and the
        # stream-ordered pools' live allocations and chunks by device address.
        self._vmm_ranges: dict[int, SimVmmRange] = {}
        self._vmm_starts: list[int] = []
        self._pool_ptrs: dict[int, SimPool] = {}
        #: occupy_as_other_process: address -> (device, pid) of memory "other processes" hold
        self._foreign: dict[int, tuple[int, int]] = {}
        self._pool_chunks: dict[int, SimPool] = {}
        # Streams with queued operations (empty: every stream idle, the fast paths run work
        # at once), and a counter bumped whenever an event completes.
        self._pending: set[SimStream] = set()
        self._stream_handles: weakref.WeakValueDictionary[int, SimStream] = \
            weakref.WeakValueDictionary()
        self._record_seq = 0
        self._ipc_events: dict[int, SimEvent] = {}
        # Stream captures running now, by capture id (empty: nothing captures, and the calls
        # a capture may refuse check nothing else).
        self._captures: dict[int, Any] = {}
        self._peers: set[tuple[int, int]] = set()
        # (start ns, end ns, ACTIVITY_*) of recent work per physical device, for NVML.
        self.activity: list[collections.deque[tuple[int, int, int]]] = [
            collections.deque(maxlen=4096) for _ in range(self.total_devices)]

    def __repr__(self) -> str:
        return (f"<SimulatorBackend: {len(self._devs)} visible of {self.total_devices} simulated "
                f"devices, {self.memory_per_device} bytes each>")

    # ------------------------------------------------------------ validation
    def _device(self, device: Any, call: str) -> int:
        try:
            d = operator.index(device)
        except TypeError:
            raise invalid_device(call, f"{device!r}") from None
        n = len(self._devs)
        if 0 <= d < n:
            return d
        if n == 0:
            raise CudaError(100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected",
                            call="cuDeviceGet")
        raise invalid_device("cuDeviceGet", f"{d} (device count {n})")

    @staticmethod
    def _size(n: Any, call: str) -> int:
        try:
            v = operator.index(n)
        except TypeError:
            raise invalid_value(call, f"size must be an int, not {type(n).__name__}") from None
        if v < 0:
            raise invalid_value(call, f"negative size {v}")
        return v

    @staticmethod
    def _ptr(p: Any, call: str) -> int:
        try:
            return operator.index(p)
        except TypeError:
            raise invalid_value(call, f"pointer must be an int, not {type(p).__name__}") from None

    @staticmethod
    def _fill_value(value: Any, bits: int, call: str) -> int:
        v = operator.index(value)
        if not -(1 << (bits - 1)) <= v < (1 << bits):
            raise ValueError(f"{call}: fill value {v} does not fit in {bits} bits")
        return v & ((1 << bits) - 1)

    def stream_of(self, stream: StreamHandle, call: str, allow_destroyed: bool = False) -> SimStream:
        if type(stream) is SimStream and stream.backend is self:
            if stream.destroyed and not (allow_destroyed and stream.queue):
                raise invalid_handle(call, "the stream was destroyed")
            return stream
        if stream is None or (type(stream) is int and stream == 0):
            d = getattr(self._tls, "device", None)
            if d is None:
                raise CudaError(201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context",
                                call=call)
            return self._devs[d].null
        if type(stream) is ClosedHandle:  # a closed Stream's (cuda.bindings' int() raises it)
            raise stream.error()
        raise invalid_handle(call, f"{stream!r} is not a stream of this simulator")

    def _event_handle(self, event: EventHandle, call: str) -> SimEvent:
        if type(event) is SimEvent and event.backend is self and not event.destroyed:
            return event
        raise invalid_handle(call, f"{event!r} is not a live event of this simulator")

    def _event(self, event: EventHandle, call: str) -> SimEvent:
        ev = self._event_handle(event, call)
        return ev.target if ev.target is not None else ev

    # ------------------------------------------------------------ services between concerns
    # Declared here so that each mixin is typed against the whole backend; each is defined
    # in the module named in its docstring.
    @abc.abstractmethod
    def submit(self, s: SimStream, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Run ``fn(*args)`` in ``s``'s order (:mod:`.streams`)."""

    @abc.abstractmethod
    def pump(self) -> None:
        """Run every stream's runnable work (:mod:`.streams`)."""

    @abc.abstractmethod
    def _sync_stream(self, s: SimStream) -> None:
        """Wait until ``s`` is idle, or raise if it never can be (:mod:`.streams`)."""

    @abc.abstractmethod
    def _sync_op(self, d: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """A synchronous operation on device ``d``'s legacy stream (:mod:`.streams`)."""

    @abc.abstractmethod
    def _stuck_reason(self, s: SimStream, seen: set[Any] | None = None) -> str | None:
        """Why ``s`` can never drain, or None (:mod:`.streams`)."""

    @abc.abstractmethod
    def _record_op(self, ev: SimEvent, epoch: int) -> None:
        """The stream operation completing an event record (:mod:`.streams`)."""

    @abc.abstractmethod
    def _capture_op(self, cap: Any, s: SimStream, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Record an operation submitted to a capturing stream (:mod:`.graphs`)."""

    @abc.abstractmethod
    def _capture_wait(self, s: SimStream, ev: SimEvent, call: str) -> bool:
        """A stream wait that involves a capture; True when handled (:mod:`.graphs`)."""

    @abc.abstractmethod
    def _refuse_in_capture(self, call: str, s: SimStream | None = None,
                           ev: SimEvent | None = None, device: int | None = None) -> None:
        """Raise when a running capture forbids ``call`` (:mod:`.graphs`)."""

    @abc.abstractmethod
    def _refuse_pageable_copy(self, s: SimStream, dst: int, src: int, call: str) -> None:
        """Refuse a captured copy touching pageable host memory (:mod:`.graphs`)."""

    @abc.abstractmethod
    def _mem_update(self, call: str) -> contextlib.AbstractContextManager[None]:
        """Hold the memory lock for a bookkeeping update (:mod:`.memory`)."""

    @abc.abstractmethod
    def _map(self, dev: SimDevice, call: str) -> None:
        """Create ``dev``'s memory mapping (:mod:`.memory`)."""

    @abc.abstractmethod
    def _flush_graveyard(self) -> None:
        """Close freed host mappings once nothing is queued (:mod:`.memory`)."""

    @abc.abstractmethod
    def _vmm_translate(self, p: int, n: int) -> tuple[int, int] | None:
        """(host address, device) of mapped virtual memory (:mod:`.vmm`)."""

    @abc.abstractmethod
    def _pool_free_locked(self, pool: SimPool, p: int, call: str, from_async: bool) -> None:
        """Return a pool allocation to its pool (:mod:`.vmm`)."""
