"""Simulated stream capture and CUDA graphs: :class:`SimGraphs`.

The graph concern of the simulator backend. While a stream is capturing (its ``capture`` is
a :class:`_Capture`), every operation submitted to it (kernels, copies, fills; see
:meth:`SimStreams.submit`) is recorded into the capture instead of run. An event recorded
on a capturing stream becomes a dependency inside the capture; a stream that waits on such
an event joins the capture (a fork), and must be joined back (the origin, or another stream
of the capture, waits on an event recorded after its last operation) before the capture
ends. An event recorded with ``EVENT_RECORD_EXTERNAL`` (:meth:`event_record_with_flags`)
becomes an event-record node instead: each launch records it, in its place among the nodes;
outside a capture the flag is refused with ``CUDA_ERROR_ILLEGAL_STATE``, as the driver does.
:meth:`graph_instantiate` copies the recorded operations; :meth:`graph_launch` runs
them in capture order, in the launch stream's order.

The driver's rules (``CUDA_ERROR_STREAM_CAPTURE_*``) hold: the null stream cannot capture;
synchronising or querying a capturing stream, or an event last recorded in a capture, is
refused whatever the mode, and so is synchronising the whole device while one of its
streams captures (from any thread, as the driver does); the other "potentially unsafe" calls
(stream and event synchronize and query, synchronous copies and fills, cuMemFree,
cuGraphExecDestroy) are refused as
``cuStreamBeginCapture``'s mode and the thread's interaction mode
(:meth:`thread_exchange_capture_mode`) define: GLOBAL captures forbid them in every thread
whose mode is GLOBAL, THREAD_LOCAL captures only in the capturing thread, RELAXED captures
nowhere; a thread in RELAXED mode is never refused. A refused call invalidates the captures
that forbade it: their later operations and their end raise 901 (INVALIDATED), and ending
them still takes their streams out of capture mode. An asynchronous copy to or from
pageable host memory cannot be captured. cuMemAlloc is allowed, as under torch's RELAXED
guard (the allocation is not captured). Ending a GLOBAL or THREAD_LOCAL capture from
another thread than the one that began it raises 908 (WRONG_THREAD) and, as on a GPU (torch
sees the stream no longer capturing after it), takes the capture's streams out of capture
mode all the same; a RELAXED capture may be ended from any thread. Not modelled: the legacy stream's implicit
synchronisation with a capturing blocking stream (906).
"""

from __future__ import annotations

import bisect
import itertools
import operator
import threading
from typing import Any

from cudalab._driver.base import (
    CAPTURE_MODE_GLOBAL,
    CAPTURE_MODE_RELAXED,
    CAPTURE_MODE_THREAD_LOCAL,
    CAPTURE_STATUS_ACTIVE,
    CAPTURE_STATUS_INVALIDATED,
    CAPTURE_STATUS_NONE,
    EVENT_RECORD_EXTERNAL,
    GRAPH_INSTANTIATE_AUTO_FREE_ON_LAUNCH,
    GRAPH_INSTANTIATE_USE_NODE_PRIORITY,
)
from cudalab._driver.handles import (
    EventHandle,
    GraphExecHandle,
    GraphHandle,
    OpaqueHandle,
    StreamHandle,
)
from cudalab._driver.sim.core import SimulatorCore, invalid_handle, invalid_value
from cudalab._driver.sim.handles import SimEvent, SimStream, next_handle
from cudalab._driver.sim.heap import FAKE_BASE
from cudalab.errors import CudaError, StreamCaptureError

_capture_ids = itertools.count(1)

#: code -> (name, text) of the stream capture errors, as the driver spells them.
_CAPTURE_ERRORS = {
    900: ("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
          "operation not permitted when stream is capturing"),
    901: ("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
          "operation failed due to a previous error during capture"),
    902: ("CUDA_ERROR_STREAM_CAPTURE_MERGE",
          "operation would result in a merge of separate capture sequences"),
    903: ("CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", "capture was not ended in the same stream "
          "as it began"),
    904: ("CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
          "capturing stream has unjoined work"),
    905: ("CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
          "dependency created on uncaptured work in another stream"),
    907: ("CUDA_ERROR_CAPTURED_EVENT",
          "operation not permitted on an event last recorded in a capturing stream"),
    908: ("CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", "attempt to terminate a thread-local "
          "capture sequence from another thread"),
}

#: Stream operations (by the backend method that runs them) -> the graph node they become.
_NODE_KINDS = {"_kernel_op": "kernel", "_copy_op": "memcpy", "_memset8_op": "memset",
               "_memset16_op": "memset", "_memset32_op": "memset", "_graph_op": "graph",
               "_library_op": "kernel"}  # a simulated cuBLAS / cuFFT call (sim.blas, sim.fft)
_ALL_FLAGS = 1 | 2 | 4 | 8  # CUgraphInstantiate_flags
_MODES = (CAPTURE_MODE_GLOBAL, CAPTURE_MODE_THREAD_LOCAL, CAPTURE_MODE_RELAXED)


def capture_error(code: int, call: str | None, detail: str | None = None) -> StreamCaptureError:
    """The simulator's StreamCaptureError ``code`` for ``call``."""
    name, text = _CAPTURE_ERRORS[code]
    return StreamCaptureError(code, name, f"{text} ({detail})" if detail else text, call=call)


class _Capture:
    """One stream capture sequence.

    Invariants: ``ops`` are ``(node kind, fn, args)`` in submission order; ``streams`` are
    the streams whose ``capture`` is this one (``origin`` first joined); ``tails[s]`` counts
    the operations recorded up to ``s``'s latest one, ``joined[s]`` up to the latest record
    of ``s`` another stream of the capture waited for (joined back when ``joined >= tails``);
    ``ended`` once :meth:`SimGraphs.stream_end_capture` took its streams out of capture.
    """

    __slots__ = ("id", "mode", "origin", "thread", "ops", "streams", "status", "tails",
                 "joined", "ended", "reason")

    def __init__(self, origin: SimStream, mode: int):
        self.id = next(_capture_ids)
        self.mode = mode
        self.origin = origin
        self.thread = threading.get_ident()
        self.ops: list[tuple[str, Any, tuple[Any, ...]]] = []
        self.streams: list[SimStream] = [origin]
        self.status = CAPTURE_STATUS_ACTIVE
        self.tails: dict[SimStream, int] = {}
        self.joined: dict[SimStream, int] = {}
        self.ended = False
        self.reason = ""  # what invalidated it

    def invalidate(self, reason: str) -> None:
        if self.status == CAPTURE_STATUS_ACTIVE:
            self.status = CAPTURE_STATUS_INVALIDATED
            self.reason = reason


class _Graph(OpaqueHandle):
    """A captured graph: its operations, in capture order."""

    __slots__ = ("handle", "device", "ops", "capture_id", "destroyed")

    def __init__(self, device: int, ops: list[Any], capture_id: int):
        self.handle = next_handle()
        self.device = device
        self.ops = ops
        self.capture_id = capture_id
        self.destroyed = False

    def __int__(self) -> int:
        return self.handle

    def __repr__(self) -> str:
        return (f"<simulated graph 0x{self.handle:x} on device {self.device}, "
                f"{len(self.ops)} nodes>")


class _GraphExec(OpaqueHandle):
    """An executable graph: a copy of its graph's operations; ``records`` are the events of
    its event-record nodes, in node order (each launch records them)."""

    __slots__ = ("handle", "device", "ops", "records", "destroyed")

    def __init__(self, graph: _Graph):
        self.handle = next_handle()
        self.device = graph.device
        self.ops = tuple(graph.ops)
        self.records = tuple(args[0] for kind, _fn, args in self.ops if kind == "event_record")
        self.destroyed = False

    def __int__(self) -> int:
        return self.handle

    def __repr__(self) -> str:
        return f"<simulated graph exec 0x{self.handle:x} on device {self.device}>"


class SimGraphs(SimulatorCore):
    """Stream capture and graphs of the simulator (see the module docstring)."""

    # ------------------------------------------------------------ capture
    def stream_begin_capture(self, stream: StreamHandle, mode: int = CAPTURE_MODE_GLOBAL) -> None:
        call = "cuStreamBeginCapture"
        s = self.stream_of(stream, call)
        m = self._capture_mode(mode, call)
        if s.is_null:
            raise capture_error(900, call, "the legacy default stream cannot be captured")
        if s.capture is not None:
            raise CudaError(401, "CUDA_ERROR_ILLEGAL_STATE", "the stream is already capturing",
                            call=call)
        cap = _Capture(s, m)
        s.capture = cap
        self._captures[cap.id] = cap

    def stream_end_capture(self, stream: StreamHandle) -> GraphHandle:
        call = "cuStreamEndCapture"
        s = self.stream_of(stream, call)
        cap = s.capture
        if cap is None or cap.origin is not s:
            raise capture_error(903, call)
        for t in cap.streams:
            t.capture = None
        cap.ended = True
        self._captures.pop(cap.id, None)
        if cap.mode != CAPTURE_MODE_RELAXED and cap.thread != threading.get_ident():
            # As the driver (and torch over it) does: the error, and the capture is over.
            raise capture_error(908, call)
        if cap.status != CAPTURE_STATUS_ACTIVE:
            raise capture_error(901, call, cap.reason)
        unjoined = [t for t in cap.streams[1:] if cap.tails.get(t, 0) > cap.joined.get(t, 0)]
        if unjoined:
            raise capture_error(904, call, f"{unjoined[0]!r} was not joined back")
        return GraphHandle(_Graph(s.device, list(cap.ops), cap.id))

    def stream_capture_info(self, stream: StreamHandle) -> tuple[int, int]:
        cap = self.stream_of(stream, "cuStreamGetCaptureInfo").capture
        return (CAPTURE_STATUS_NONE, 0) if cap is None else (cap.status, cap.id)

    def stream_is_capturing(self, stream: StreamHandle) -> bool:
        s = self.stream_of(stream, "cuStreamIsCapturing")
        if s.is_null and getattr(self._tls, "device", None) is None:
            # The legacy null stream (handle 0) is the current context's: with no context
            # current on this thread the driver answers CUDA_ERROR_INVALID_CONTEXT.
            raise CudaError(201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context",
                            call="cuStreamIsCapturing")
        return s.capture is not None

    def thread_exchange_capture_mode(self, mode: int) -> int:
        m = self._capture_mode(mode, "cuThreadExchangeStreamCaptureMode")
        old = getattr(self._tls, "capture_mode", CAPTURE_MODE_GLOBAL)
        self._tls.capture_mode = m
        return old

    # ------------------------------------------------------------ graphs
    def graph_instantiate(self, graph: GraphHandle,
                          flags: int = GRAPH_INSTANTIATE_AUTO_FREE_ON_LAUNCH
                          | GRAPH_INSTANTIATE_USE_NODE_PRIORITY) -> GraphExecHandle:
        call = "cuGraphInstantiate"
        g = self._graph(graph, call)
        if getattr(self._tls, "device", None) is None:
            # As the driver (seen on an H200): instantiating needs a current context, which
            # a thread that only ended a capture (relaxed mode) need not have.
            raise CudaError(201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context",
                            call=call)
        f = operator.index(flags)
        if f < 0 or f & ~_ALL_FLAGS:
            raise invalid_value(call, f"unknown instantiate flags {f}")
        return GraphExecHandle(_GraphExec(g))

    def graph_launch(self, graph_exec: GraphExecHandle, stream: StreamHandle) -> None:
        call = "cuGraphLaunch"
        if type(graph_exec) is not _GraphExec or graph_exec.destroyed:
            raise invalid_handle(call, f"{graph_exec!r} is not a live executable graph")
        s = self.stream_of(stream, call)
        if s.device != graph_exec.device:
            raise invalid_value(call, "the graph was captured on another device")
        if graph_exec.records:  # event-record nodes: each record is requested now
            epochs = []
            for ev in graph_exec.records:
                ev.epoch += 1
                ev.rec_stream = s
                epochs.append(ev.epoch)
            self.submit(s, self._graph_op, (graph_exec, tuple(epochs)))
            return
        self.submit(s, self._graph_op, (graph_exec,))

    def event_record_with_flags(self, event: EventHandle, stream: StreamHandle,
                                flags: int) -> None:
        call = "cuEventRecordWithFlags"
        f = operator.index(flags)
        if f < 0 or f & ~EVENT_RECORD_EXTERNAL:
            raise invalid_value(call, f"unknown event record flags {f}")
        s = self.stream_of(stream, call)
        cap = s.capture
        if not f:
            self.event_record(event, stream)
            return
        if cap is None:  # as the driver (seen on an H200): the flag needs a capturing stream
            raise CudaError(401, "CUDA_ERROR_ILLEGAL_STATE",
                            "an external event record needs a capturing stream", call=call)
        ev = self._event(event, call)
        if ev.device != s.device:
            raise invalid_handle(call, "event and stream belong to different devices")
        if cap.status != CAPTURE_STATUS_ACTIVE:
            raise capture_error(901, call, cap.reason)
        cap.ops.append(("event_record", self._record_op, (ev, 0)))  # (epoch: at each launch)
        cap.tails[s] = len(cap.ops)

    def graph_destroy(self, graph: GraphHandle) -> None:
        self._graph(graph, "cuGraphDestroy").destroyed = True

    def graph_exec_destroy(self, graph_exec: GraphExecHandle) -> None:
        if type(graph_exec) is not _GraphExec or graph_exec.destroyed:
            raise invalid_handle("cuGraphExecDestroy",
                                 f"{graph_exec!r} is not a live executable graph")
        if self._captures:
            # "potentially unsafe" during a capture (an H200 refuses it with 900 in a global
            # capture, invalidating the capture)
            self._refuse_in_capture("cuGraphExecDestroy")
        graph_exec.destroyed = True  # a launch already queued still runs (it holds the ops)

    def graph_node_count(self, graph: GraphHandle) -> int:
        return len(self._graph(graph, "cuGraphGetNodes").ops)

    def graph_node_kinds(self, graph: GraphHandle) -> list[str]:
        return [kind for kind, _fn, _args in self._graph(graph, "cuGraphGetNodes").ops]

    def graph_debug_dot_print(self, graph: GraphHandle, path: str) -> None:
        g = self._graph(graph, "cuGraphDebugDotPrint")
        lines = [f'digraph "cudalab simulated graph 0x{g.handle:x}" {{',
                 f'  label="cudalab simulated CUDA graph (capture {g.capture_id}, device '
                 f'{g.device}, {len(g.ops)} nodes)";']
        for i, (kind, _fn, args) in enumerate(g.ops):
            what = kind
            if kind == "kernel":
                what = f"kernel {args[0].name} grid={args[1]} block={args[2]}"
            elif kind in ("memcpy", "memset"):
                what = f"{kind} {args[2]} {'bytes' if kind == 'memcpy' else 'items'}"
            lines.append(f'  n{i} [shape=box label="{i}: {what}"];')
        lines.extend(f"  n{i} -> n{i + 1};" for i in range(len(g.ops) - 1))
        lines.append("}")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")

    # ================================================================ internals
    @staticmethod
    def _capture_mode(mode: Any, call: str) -> int:
        m = operator.index(mode)
        if m not in _MODES:
            raise invalid_value(call, f"unknown stream capture mode {m}")
        return m

    def _graph(self, graph: GraphHandle, call: str) -> _Graph:
        if type(graph) is _Graph and not graph.destroyed:
            return graph
        raise invalid_handle(call, f"{graph!r} is not a live graph of this simulator")

    def _capture_op(self, cap: _Capture, s: SimStream, fn: Any, args: tuple[Any, ...]) -> None:
        """Record ``fn(*args)``, submitted to capturing ``s``, into ``cap``."""
        if cap.status != CAPTURE_STATUS_ACTIVE:
            raise capture_error(901, None, cap.reason)
        name = fn.__name__
        if name == "_record_op":  # a dependency inside the capture, not a record that runs
            ev, epoch = args
            ev.epoch = epoch - 1
            ev.captured = (cap, s, cap.tails.get(s, 0), ev.epoch)
            return
        kind = _NODE_KINDS.get(name)
        if kind is None:
            cap.invalidate(f"{name} cannot be captured by the simulator")
            raise capture_error(900, None, f"{name} cannot be captured by the simulator")
        cap.ops.append((kind, fn, args))
        cap.tails[s] = len(cap.ops)

    def _live_capture_of(self, ev: SimEvent) -> tuple[Any, ...] | None:
        """``ev.captured`` when its capture still runs and no later record replaced it."""
        c = ev.captured
        if c is None or c[0].ended or c[3] != ev.epoch:
            return None
        return c

    def _capture_wait(self, s: SimStream, ev: SimEvent, call: str) -> bool:
        """A wait involving a capture: join, fork or refuse. True when it is fully handled."""
        c = self._live_capture_of(ev)
        if c is not None:
            cap, src, pos = c[0], c[1], c[2]
            if s.capture is None:  # a fork: s joins the capture
                s.capture = cap
                cap.streams.append(s)
                return True
            if s.capture is cap:  # a join
                if pos > cap.joined.get(src, 0):
                    cap.joined[src] = pos
                return True
            s.capture.invalidate("merge of two captures")
            cap.invalidate("merge of two captures")
            raise capture_error(902, call)
        if s.capture is None or ev.done >= ev.epoch:
            return s.capture is not None  # an event completed before: nothing to wait for
        s.capture.invalidate(f"{call} on uncaptured work")
        raise capture_error(905, call)

    def _refuse_in_capture(self, call: str, s: SimStream | None = None,
                           ev: SimEvent | None = None, device: int | None = None) -> None:
        """Raise StreamCaptureError when a capture forbids ``call`` now (about stream ``s``,
        event ``ev``, or every stream of ``device``), invalidating the captures that forbid
        it. Called only while some capture runs (``self._captures`` is not empty)."""
        if ev is not None:
            c = self._live_capture_of(ev)
            if c is not None:
                c[0].invalidate(f"{call} of an event recorded in the capture")
                raise capture_error(907, call)
        me = threading.get_ident()
        tmode = getattr(self._tls, "capture_mode", CAPTURE_MODE_GLOBAL)
        blockers = []
        for cap in list(self._captures.values()):
            if (s is not None and s.capture is cap) or device == cap.origin.device:
                blockers.append(cap)
            elif tmode != CAPTURE_MODE_RELAXED and cap.mode != CAPTURE_MODE_RELAXED and (
                    cap.thread == me or (tmode == CAPTURE_MODE_GLOBAL
                                         and cap.mode == CAPTURE_MODE_GLOBAL)):
                blockers.append(cap)
        if blockers:
            for cap in blockers:
                cap.invalidate(f"{call} during the capture")
            raise capture_error(900, call)

    def _pageable(self, p: int) -> bool:
        """Whether ``p`` is host memory that is not a pinned buffer of this simulator."""
        if p >= FAKE_BASE:
            return False
        starts = self._host_starts
        i = bisect.bisect_right(starts, p) - 1
        if i < 0:
            return True
        entry = self._host.get(starts[i])
        return entry is None or p >= starts[i] + entry[1]

    def _refuse_pageable_copy(self, s: SimStream, dst: int, src: int, call: str) -> None:
        """An asynchronous copy on capturing ``s`` must not touch pageable host memory."""
        if self._pageable(dst) or self._pageable(src):
            s.capture.invalidate(f"{call} with pageable host memory")
            raise capture_error(900, call, "a copy to or from pageable host memory cannot be "
                                "captured")

    # -- operations (run in stream order)
    def _graph_op(self, graph_exec: _GraphExec, epochs: tuple[int, ...] = ()) -> None:
        if epochs:  # event-record nodes record the epochs their launch requested
            pending = iter(epochs)
            for kind, fn, args in graph_exec.ops:
                if kind == "event_record":
                    fn(args[0], next(pending))
                else:
                    fn(*args)
            return
        for _kind, fn, args in graph_exec.ops:
            fn(*args)
