"""Simulated streams: the per-stream FIFOs, the pump that runs them, and the test hooks.

The :class:`SimStreams` concern of the simulator backend. Each stream is a FIFO of
operations that normally runs at once, in the caller's thread. The simulator-only test hooks
:meth:`SimStreams.pause_stream` and :meth:`SimStreams.resume_stream` hold a stream's work back
so that tests can observe "not yet complete" states. Event waits and the legacy default
stream's implicit synchronisation with blocking streams are modelled as queue dependencies
(:class:`~cudalab._driver.sim.handles.StreamWait` entries). Synchronising on work that can never
run (a paused stream, or a wait on an event pending on one) raises :class:`RuntimeError`
instead of hanging.
"""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Callable
from typing import Any

from cudalab._driver.base import EVENT_DISABLE_TIMING, STREAM_DEFAULT, STREAM_NON_BLOCKING
from cudalab._driver.handles import EventHandle, StreamHandle
from cudalab._driver.sim.core import SimulatorCore, invalid_handle, invalid_value, now
from cudalab._driver.sim.handles import SimEvent, SimStream, StreamWait, next_handle

#: Stream priorities: (least, greatest); the greatest is numerically smallest, as in CUDA.
PRIORITY_LEAST, PRIORITY_GREATEST = 0, -5


class SimStreams(SimulatorCore):
    """Streams, their ordering machinery and the pause/resume test hooks of the simulator."""

    # ------------------------------------------------------------ streams
    def null_stream(self, device: int) -> StreamHandle:
        return StreamHandle(self._devs[self._device(device, "cuStreamGetNull")].null)

    def stream_create(self, device: int, flags: int = STREAM_NON_BLOCKING, priority: int = 0) -> StreamHandle:
        call = "cuStreamCreateWithPriority"
        d = self._device(device, call)
        f = operator.index(flags)
        if f not in (STREAM_DEFAULT, STREAM_NON_BLOCKING):
            raise invalid_value(call, f"unknown stream flags {f}")
        p = min(PRIORITY_LEAST, max(PRIORITY_GREATEST, operator.index(priority)))
        s = SimStream(self, d, next_handle(), f, p, null=False)
        dev = self._devs[d]
        dev.streams.add(s)
        self._stream_handles[s.handle] = s
        dev.touched = True
        return StreamHandle(s)

    def stream_from_int(self, device: int, value: int) -> StreamHandle:
        """The stream whose C value is ``value``: 0 and 1 (CU_STREAM_LEGACY) are ``device``'s
        null stream, 2 (CU_STREAM_PER_THREAD) the calling thread's per-thread default stream of
        ``device``, anything else must be the value of a live stream of this simulator (other
        libraries' streams do not exist here: CudaError INVALID_HANDLE)."""
        call = "cuStreamFromInt"
        d = self._device(device, call)
        v = operator.index(value)
        if v in (0, 1):
            return StreamHandle(self._devs[d].null)
        if v == 2:
            per_thread = getattr(self._tls, "per_thread", None)
            if per_thread is None:
                per_thread = self._tls.per_thread = {}
            s = per_thread.get(d)
            if s is None:
                # Blocking: the per-thread default stream synchronises with the legacy stream.
                s = per_thread[d] = SimStream(self, d, 2, STREAM_DEFAULT, 0, null=False)
                s.is_per_thread = True
                self._devs[d].streams.add(s)
            return StreamHandle(s)
        s = self._stream_handles.get(v)
        if s is None or s.destroyed:
            raise invalid_handle(call, f"0x{v:x} is not a stream of this simulator")
        return StreamHandle(s)

    def stream_destroy(self, stream: StreamHandle) -> None:
        """Destroy a stream. Work still queued on it (a paused stream) stays queued and runs
        when :meth:`resume_stream` is given the destroyed handle."""
        call = "cuStreamDestroy"
        s = self.stream_of(stream, call)
        if s.is_null or s.is_per_thread:
            raise invalid_handle(call, "a default stream cannot be destroyed")
        with s.lock:
            s.destroyed = True
            if not s.queue and not s.draining:
                self._devs[s.device].streams.discard(s)

    def stream_query(self, stream: StreamHandle) -> bool:
        s = self.stream_of(stream, "cuStreamQuery")
        if self._captures:
            self._refuse_in_capture("cuStreamQuery", s)
        if s.queue:
            self.pump()
        return not s.queue and not s.draining

    def stream_synchronize(self, stream: StreamHandle) -> None:
        """Wait until ``stream`` is idle.

        Raises RuntimeError (instead of hanging) when the stream can never become idle: it
        is paused with :meth:`pause_stream`, or waits for an event pending on such a stream.
        """
        s = self.stream_of(stream, "cuStreamSynchronize")
        if self._captures:
            self._refuse_in_capture("cuStreamSynchronize", s)
        self._sync_stream(s)

    def stream_wait_event(self, stream: StreamHandle, event: EventHandle) -> None:
        call = "cuStreamWaitEvent"
        s = self.stream_of(stream, call)
        ev = self._event(event, call)
        if (ev.captured is not None or s.capture is not None) and self._capture_wait(s, ev, call):
            return
        epoch = ev.epoch
        if ev.done >= epoch:
            return
        with s.lock:
            s.queue.append(StreamWait(ev, epoch, ev.rec_stream))
            self._pending.add(s)
        if ev.done >= epoch:  # completed meanwhile in another thread
            self.pump()

    def stream_priority(self, stream: StreamHandle) -> int:
        return self.stream_of(stream, "cuStreamGetPriority").priority

    def stream_priority_range(self, device: int) -> tuple[int, int]:
        self._device(device, "cuCtxGetStreamPriorityRange")
        return PRIORITY_LEAST, PRIORITY_GREATEST

    # -- simulator-only test hooks
    def pause_stream(self, stream: StreamHandle) -> None:
        """Simulator-only test hook: hold back work submitted to ``stream`` from now on.

        Operations queue up (``stream_query`` is False, events recorded on it stay pending)
        until :meth:`resume_stream`. An operation already running in another thread finishes.
        Synchronising on a paused stream raises RuntimeError.
        """
        s = self.stream_of(stream, "pause_stream", allow_destroyed=True)
        with s.lock:
            s.paused = True

    def resume_stream(self, stream: StreamHandle) -> None:
        """Simulator-only test hook: run ``stream``'s queued work in order, then anything that
        waited for it (streams waiting on its events, the legacy default stream)."""
        s = self.stream_of(stream, "resume_stream", allow_destroyed=True)
        with s.lock:
            s.paused = False
        self.pump()


    # ================================================================ internals
    # -- stream machinery
    def submit(self, s: SimStream, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Run ``fn(*args)`` in ``s``'s order: now if the stream is idle, else queued (or
        recorded into the stream's capture while it captures)."""
        if s.capture is not None:
            self._capture_op(s.capture, s, fn, args)
            return
        waits = self._legacy_waits(s) if (self._pending and s.legacy) else None
        first: Callable[..., Any] | None = fn  # None once queued: _run then drains the queue
        with s.lock:
            if waits:
                s.queue.extend(waits)
            if s.queue or s.draining or s.paused:
                s.queue.append((fn, args))
                self._pending.add(s)
                if s.draining or s.paused:
                    return
                first = None
            s.draining = threading.get_ident()
        seq = self._record_seq
        self._run(s, first, args)
        if self._pending and self._record_seq != seq:
            self.pump()

    def _run(self, s: SimStream, fn: Callable[..., Any] | None, args: tuple[Any, ...]) -> None:
        """Run ``fn`` (if any) then ``s``'s runnable queue; the caller set ``s.draining``."""
        q = s.queue
        try:
            if fn is not None:
                fn(*args)
            while True:
                with s.lock:
                    head = q[0] if q and not s.paused else None
                    if head is not None and head.__class__ is StreamWait:
                        if head.event.done < head.epoch:
                            head = None
                        else:
                            q.popleft()
                            continue
                    if head is None:
                        s.draining = 0
                        if not q:
                            self._pending.discard(s)
                            if s.destroyed:
                                self._devs[s.device].streams.discard(s)
                        return
                    q.popleft()
                head[0](*head[1])
        except BaseException:
            with s.lock:
                s.draining = 0
                if not q:
                    self._pending.discard(s)
            raise

    def _drain(self, s: SimStream) -> bool:
        with s.lock:
            if s.draining or s.paused:
                return False
            q = s.queue
            if not q:
                self._pending.discard(s)
                return False
            head = q[0]
            if head.__class__ is StreamWait and head.event.done < head.epoch:
                return False
            s.draining = threading.get_ident()
        self._run(s, None, ())
        return True

    def pump(self) -> None:
        """Run every stream's runnable work until nothing more can run."""
        while True:
            progressed = False
            for s in list(self._pending):
                if self._drain(s):
                    progressed = True
            if not progressed:
                return

    def _legacy_waits(self, s: SimStream) -> list[StreamWait] | None:
        """Dependencies of new work on ``s`` under legacy default stream semantics."""
        dev = self._devs[s.device]
        if s.is_null:
            others = [t for t in list(dev.streams) if t.legacy and t.queue]
        else:
            others = [dev.null] if dev.null.queue else []
        waits = []
        for t in others:
            marker = SimEvent(None, t.device, 0, EVENT_DISABLE_TIMING)
            with t.lock:
                if not t.queue:
                    continue
                marker.epoch = 1
                marker.rec_stream = t
                t.queue.append((self._record_op, (marker, 1)))
            waits.append(StreamWait(marker, 1, t))
        return waits

    def _stuck_reason(self, s: SimStream, seen: set[Any] | None = None) -> str | None:
        """Why ``s`` can never drain (paused, directly or through event waits), or None."""
        if s.paused:
            return (f"{s!r} is paused by the simulator test hook pause_stream(); "
                    "call resume_stream() first")
        if s.draining:
            return None
        try:
            head = s.queue[0]
        except IndexError:
            return None
        if head.__class__ is StreamWait and head.event.done < head.epoch and head.stream is not None:
            seen = set() if seen is None else seen
            if s in seen:
                return f"{s!r} is part of a cycle of event waits"
            seen.add(s)
            inner = self._stuck_reason(head.stream, seen)
            if inner:
                return f"{s!r} waits for an event pending on {head.stream!r}, and {inner}"
        return None

    def _sync_stream(self, s: SimStream) -> None:
        delay = 1e-4
        while True:
            if s.queue:
                self.pump()
            with s.lock:
                if not s.queue and not s.draining:
                    return
                if s.draining == threading.get_ident():
                    raise RuntimeError(f"simulator: a kernel running on {s!r} synchronised "
                                       "its own stream")
            reason = self._stuck_reason(s)
            if reason:
                raise RuntimeError(f"simulator: synchronising {s!r} would wait forever: {reason}")
            time.sleep(delay)
            delay = min(delay * 2, 5e-3)

    def _sync_op(self, d: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """A synchronous operation: ordered on the legacy default stream, then waited for."""
        if not self._pending:
            fn(*args)
            return
        dev = self._devs[d]
        null = dev.null
        # Refuse up front (rather than queue work and then fail the wait) when the legacy
        # default stream could never get to it.
        for t in [null, *[t for t in list(dev.streams) if t.legacy and t.queue]]:
            reason = self._stuck_reason(t)
            if reason:
                raise RuntimeError("simulator: a synchronous copy/fill on the legacy default "
                                   f"stream of device {d} would wait forever: {reason}")
        self.submit(null, fn, args)
        self._sync_stream(null)


    # -- operations (run in stream order)
    def _record_op(self, ev: SimEvent, epoch: int) -> None:
        if epoch >= ev.done:
            ev.ts = now()
            ev.done = epoch
        self._record_seq += 1
