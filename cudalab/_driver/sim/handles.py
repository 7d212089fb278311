"""The simulator's handle objects: streams, events, stream-queue waits, modules and kernels.

Each handle is an opaque object the layer above holds (``int(handle)`` is its fake C value,
what :meth:`Backend.handle_int` returns). They carry state only; the behaviour lives in the
backend's concern modules (:mod:`.streams`, :mod:`.events`, :mod:`.kernels`). Every ``repr``
says "simulated". The classes are the simulator package's internal API (``__all__``): the
backend hands them out as the seam's handle types (:mod:`cudalab._driver.handles`) and takes
them back through its handle checks.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable
from typing import Any

from cudalab._driver.base import STREAM_NON_BLOCKING, Backend
from cudalab._driver.handles import OpaqueHandle

__all__ = ["SimEvent", "SimFunction", "SimModule", "SimStream", "StreamWait", "next_handle"]

_handles = itertools.count(1)
#: Fake handle values start here (well apart from fake device addresses).
_HANDLE_BASE = 0x5A00_0000_0000


def next_handle() -> int:
    """A fresh fake C value for a handle (unique in the process)."""
    return _HANDLE_BASE + next(_handles) * 0x40


class SimStream(OpaqueHandle):
    """A simulated stream: a FIFO of operations ``(fn, args)`` and :class:`StreamWait` entries.

    Invariants (under ``lock``): ``draining`` is the ident of the one thread running the
    queue, or 0; a stream with a non-empty ``queue`` is in the backend's ``_pending`` set;
    ``paused`` (a test hook) keeps the queue from running. ``capture`` is the stream capture
    (:class:`cudalab._driver.sim.graphs._Capture`) the stream belongs to, or None: while set,
    work submitted to the stream is recorded into it instead of run.
    """

    __slots__ = ("backend", "device", "handle", "flags", "priority", "is_null", "is_per_thread",
                 "legacy", "queue", "lock", "paused", "draining", "destroyed", "capture",
                 "__weakref__")

    def __init__(self, backend: Backend, device: int, handle: int, flags: int,
                 priority: int, null: bool):
        self.backend = backend
        self.device = device
        self.handle = handle
        self.flags = flags
        self.priority = priority
        self.is_null = null
        self.is_per_thread = False
        # The legacy default stream and blocking streams synchronise with each other.
        self.legacy = null or not (flags & STREAM_NON_BLOCKING)
        self.queue: collections.deque[Any] = collections.deque()
        self.lock = threading.RLock()
        self.paused = False
        self.draining = 0  # ident of the thread running this stream's operations, or 0
        self.destroyed = False
        self.capture: Any = None  # the capture recording this stream's work, or None

    def __int__(self) -> int:
        return self.handle

    def __repr__(self) -> str:
        kind = ("null stream" if self.is_null else "per-thread default stream"
                if self.is_per_thread else f"stream 0x{self.handle:x}")
        return f"<simulated {kind} on device {self.device}>"


class SimEvent(OpaqueHandle):
    """A simulated event: ``epoch`` counts records requested, ``done`` is the latest record
    that completed (``done <= epoch``; complete when equal), ``ts`` its time in ns.
    ``captured`` is ``(capture, stream, position)`` while its latest record was captured into
    a stream capture (a dependency inside the graph, not a record that runs), else None."""

    __slots__ = ("backend", "device", "handle", "flags", "epoch", "done", "ts", "rec_stream",
                 "destroyed", "ipc_key", "target", "captured", "__weakref__")

    def __init__(self, backend: Backend | None, device: int, handle: int, flags: int):
        self.backend = backend
        self.device = device
        self.handle = handle
        self.flags = flags
        self.epoch = 0  # records requested
        self.done = 0  # latest record completed
        self.ts = 0
        self.rec_stream: SimStream | None = None
        self.destroyed = False
        self.ipc_key: tuple[int, int] | None = None
        self.target: SimEvent | None = None  # an IPC handle opened in its own process
        self.captured: tuple[Any, ...] | None = None  # (capture, stream, position) of a captured record

    def __int__(self) -> int:
        return self.handle

    def __repr__(self) -> str:
        return f"<simulated event 0x{self.handle:x} on device {self.device}>"


class StreamWait:
    """A queue entry: later work on the stream waits until ``event`` reaches ``epoch``."""

    __slots__ = ("event", "epoch", "stream")

    def __init__(self, event: SimEvent, epoch: int, stream: SimStream | None):
        self.event = event
        self.epoch = epoch
        self.stream = stream  # where the awaited record is queued


class SimModule(OpaqueHandle):
    """A loaded (simulated) module; kernels are looked up by name in the registry."""

    __slots__ = ("backend", "device", "handle", "size", "unloaded")

    def __init__(self, backend: Backend, device: int, handle: int, size: int):
        self.backend = backend
        self.device = device
        self.handle = handle
        self.size = size
        self.unloaded = False

    def __int__(self) -> int:
        return self.handle

    def __repr__(self) -> str:
        return f"<simulated module 0x{self.handle:x} on device {self.device} ({self.size} bytes)>"


class SimFunction(OpaqueHandle):
    """A kernel of a module: its registered Python implementation."""

    __slots__ = ("module", "name", "impl", "handle")

    def __init__(self, module: SimModule, name: str, impl: Callable[..., None], handle: int):
        self.module = module
        self.name = name
        self.impl = impl
        self.handle = handle

    def __int__(self) -> int:
        return self.handle

    def __repr__(self) -> str:
        return f"<simulated kernel {self.name!r} on device {self.module.device}>"
