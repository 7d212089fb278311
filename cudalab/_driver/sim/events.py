"""Simulated events: record, query, synchronise, timing and IPC event handles.

The :class:`SimEvents` concern of the simulator backend. Events read
``time.perf_counter_ns`` when their stream reaches them (the record is an operation in the
stream's FIFO, see :mod:`.streams`). An IPC handle opened in the exporting process follows
the original event; from another process it always reports complete.
"""

from __future__ import annotations

import itertools
import operator
import os
import struct
import time

from cudalab._driver.base import (
    EVENT_BLOCKING_SYNC,
    EVENT_DISABLE_TIMING,
    EVENT_INTERPROCESS,
    IPC_HANDLE_SIZE,
)
from cudalab._driver.handles import EventHandle, StreamHandle
from cudalab._driver.sim.core import SimulatorCore, invalid_handle, invalid_value
from cudalab._driver.sim.handles import SimEvent, next_handle
from cudalab.errors import CudaError

#: Layout of a simulated IPC event handle: magic, version, flags, pid, event id; zero-padded
#: to IPC_HANDLE_SIZE bytes.
_IPC_MAGIC = b"CLSIMEVT"
_IPC_VERSION = 1
_IPC_STRUCT = struct.Struct("<8sIIQQ")

_ipc_ids = itertools.count(1)


class SimEvents(SimulatorCore):
    """Events (timing, cross-stream waits' targets) and IPC events of the simulator."""

    # ------------------------------------------------------------ events
    def event_create(self, device: int, flags: int = EVENT_DISABLE_TIMING) -> EventHandle:
        call = "cuEventCreate"
        d = self._device(device, call)
        f = operator.index(flags)
        if f & ~(EVENT_BLOCKING_SYNC | EVENT_DISABLE_TIMING | EVENT_INTERPROCESS) or f < 0:
            raise invalid_value(call, f"unknown event flags {f}")
        if f & EVENT_INTERPROCESS and not f & EVENT_DISABLE_TIMING:
            raise invalid_value(call, "EVENT_INTERPROCESS requires EVENT_DISABLE_TIMING")
        ev = SimEvent(self, d, next_handle(), f)
        if f & EVENT_INTERPROCESS:
            eid = next(_ipc_ids)
            ev.ipc_key = (os.getpid(), eid)
            self._ipc_events[eid] = ev
        self._devs[d].touched = True
        return EventHandle(ev)

    def event_destroy(self, event: EventHandle) -> None:
        ev = self._event_handle(event, "cuEventDestroy")
        ev.destroyed = True
        if ev.ipc_key is not None and ev.target is None:
            self._ipc_events.pop(ev.ipc_key[1], None)

    def event_record(self, event: EventHandle, stream: StreamHandle) -> None:
        call = "cuEventRecord"
        ev = self._event(event, call)
        s = self.stream_of(stream, call)
        if ev.device != s.device:
            raise invalid_handle(call, "event and stream belong to different devices")
        epoch = ev.epoch = ev.epoch + 1
        ev.rec_stream = s
        self.submit(s, self._record_op, (ev, epoch))

    def event_query(self, event: EventHandle) -> bool:
        ev = self._event(event, "cuEventQuery")
        if self._captures:
            self._refuse_in_capture("cuEventQuery", ev=ev)
        if ev.done >= ev.epoch:
            return True
        if self._pending:
            self.pump()
        return ev.done >= ev.epoch

    def event_synchronize(self, event: EventHandle) -> None:
        """Wait until the event completes; RuntimeError if it is pending on a paused stream."""
        ev = self._event(event, "cuEventSynchronize")
        if self._captures:
            self._refuse_in_capture("cuEventSynchronize", ev=ev)
        delay = 1e-4
        while ev.done < ev.epoch:
            self.pump()
            if ev.done >= ev.epoch:
                return
            s = ev.rec_stream
            reason = self._stuck_reason(s) if s is not None else None
            if reason:
                raise RuntimeError(f"simulator: event_synchronize({ev!r}) would wait forever: "
                                   f"{reason}")
            time.sleep(delay)
            delay = min(delay * 2, 5e-3)

    def event_elapsed_time(self, start: EventHandle, end: EventHandle) -> float:
        call = "cuEventElapsedTime"
        a = self._event(start, call)
        b = self._event(end, call)
        for e in (a, b):
            if e.flags & EVENT_DISABLE_TIMING:
                raise invalid_handle(call, f"{e!r} was created with EVENT_DISABLE_TIMING")
            if e.epoch == 0:
                raise invalid_handle(call, f"{e!r} was never recorded")
        if (a.done < a.epoch or b.done < b.epoch) and self._pending:
            self.pump()
        if a.done < a.epoch or b.done < b.epoch:
            raise CudaError(600, "CUDA_ERROR_NOT_READY", "device not ready", call=call)
        return (b.ts - a.ts) / 1e6

    def ipc_event_handle(self, event: EventHandle) -> bytes:
        call = "cuIpcGetEventHandle"
        ev = self._event_handle(event, call)
        if ev.ipc_key is None or not ev.flags & EVENT_INTERPROCESS:
            raise invalid_value(call, "the event was not created with EVENT_INTERPROCESS")
        pid, eid = ev.ipc_key
        raw = _IPC_STRUCT.pack(_IPC_MAGIC, _IPC_VERSION, ev.flags, pid, eid)
        return raw + bytes(IPC_HANDLE_SIZE - len(raw))

    def ipc_open_event(self, device: int, handle: bytes) -> EventHandle:
        """Open an event exported by :meth:`ipc_event_handle`.

        From another process the event always reports complete (its queue is not visible
        here); opened in the exporting process it follows the original event.
        """
        call = "cuIpcOpenEventHandle"
        d = self._device(device, call)
        if not isinstance(handle, (bytes, bytearray, memoryview)):
            raise TypeError(f"IPC event handle must be bytes-like, got {type(handle).__name__}")
        data = bytes(handle)
        if len(data) != IPC_HANDLE_SIZE:
            raise ValueError(f"IPC event handle must be {IPC_HANDLE_SIZE} bytes, got {len(data)}")
        magic, version, _flags, pid, eid = _IPC_STRUCT.unpack_from(data)
        if magic != _IPC_MAGIC or version != _IPC_VERSION or any(data[_IPC_STRUCT.size:]):
            raise invalid_value(call, "not an IPC event handle of the cudalab simulator")
        ev = SimEvent(self, d, next_handle(), EVENT_INTERPROCESS | EVENT_DISABLE_TIMING)
        ev.ipc_key = (pid, eid)
        if pid == os.getpid():
            target = self._ipc_events.get(eid)
            if target is not None and not target.destroyed:
                ev.target = target
                ev.device = target.device
        self._devs[d].touched = True
        return EventHandle(ev)

