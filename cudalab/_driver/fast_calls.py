"""The seam's one fast-call registry: :class:`FastCalls`, the hot paths' unchecked calls.

A hot path (``Event.record``/``query``, ``Stream.query``, %cuda_timed's elapsed times, and
inside the real backend a kernel launch, a stream wait, a context check, a copy) reads one
bound function from one object and calls it: no Python frame of the seam in between. Each
backend has one registry, from :meth:`Backend.fast_calls`:

* the real backend's is :data:`cudalab._driver.cuda_api.FAST`, process-wide (the C
  extension it binds is), filled with ``cuda.bindings``' own functions and, once
  :meth:`CudaBackend.init` has bound them, the C twins of :mod:`cudalab._driver.fastcall`;
* the simulator's (the default of :meth:`Backend.fast_calls`) wraps its checked methods
  (and gives ``event_elapsed_times`` as a loop over its checked elapsed time, so
  %cuda_timed reads its times the same way on both).

Two kinds of fields:

* the *status calls* (:data:`STATUS_CALLS`), always set, read by the layer above through
  ``cudalab._internal.fast_paths()``: each returns a tuple ``(status, *outs)`` and never
  raises for a driver error; a status other than :data:`STATUS_SUCCESS` and
  :data:`STATUS_NOT_READY` becomes an exception with :meth:`Backend.status_error`;
* the *C twins* (:data:`C_TWINS`), read inside the real backend only (but for
  ``event_elapsed_times``, which %cuda_timed reads where it is not None): None where the
  extension is not built, the driver did not give the entry points, ``CUDALAB_FASTCALL=0``
  turned them off, or the backend is the simulator (then the bindings' wrappers are used;
  the simulator's ``event_elapsed_times`` is its own loop, see above).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from cudalab._driver.handles import EventHandle, FunctionHandle, StreamHandle

__all__ = ["C_TWINS", "STATUS_CALLS", "STATUS_NOT_READY", "STATUS_SUCCESS", "FastCalls",
           "checked_fast_calls"]

#: Status values returned by the status calls (CUresult numbering).
STATUS_SUCCESS = 0
STATUS_NOT_READY = 600

#: The fields every registry sets, in the constructor's order.
STATUS_CALLS = ("event_record", "event_query", "stream_query", "event_elapsed_time")
#: The real backend's C twins, None where not bound.
C_TWINS = ("launch_kernel", "stream_wait_event", "ctx_get_current", "ctx_set_current",
           "memcpy_async", "ordered_copy", "event_elapsed_times")

Dim3 = tuple[int, int, int]


class FastCalls:
    """The hot calls of one backend (see the module docstring for who reads which).

    Parameters
    ----------
    event_record, event_query, stream_query, event_elapsed_time : callable
        The status calls: ``event_record(event, stream) -> (status,)``,
        ``event_query(event) -> (status,)``, ``stream_query(stream) -> (status,)`` and
        ``event_elapsed_time(start, end) -> (status, milliseconds)`` (%cuda_timed reads one
        per repeat after its loop). The C twins start as None.

    Notes
    -----
    The C twins, as :mod:`cudalab._driver.fastcall` defines them:
    ``launch_kernel(function, grid, block, shared_mem, stream, params)``,
    ``stream_wait_event(stream, event, flags)``, ``ctx_set_current(context)`` and
    ``memcpy_async(dst, src, nbytes, stream)`` return the CUresult; ``ctx_get_current()`` the
    current context's address (None on failure); ``ordered_copy(dst, src, nbytes,
    copy_context, copy_stream, copy_event, peer_context, peer_stream, peer_event[, join])``
    makes a copy between two devices with torch's two-way ordering and returns None or the
    failed call's ``(name, CUresult)``; ``event_elapsed_times(starts, ends)`` reads many
    event pairs in one call and returns ``(0, [ms, ...])`` or, at the first failed pair,
    ``(CUresult, [the times before it])`` (read by the layer above, where it is not None:
    %cuda_timed's GPU times; the "%%cuda_timed per-repeat overhead" rows). When bound, ``event_record`` is the C twin of the
    bindings' (same ``(CUresult,)`` result). Rows they exist for: "capture, host time per
    launch" of benchmarks/graphs.py, "host/call" of benchmarks/jiterator.py, the launch and
    event rows of benchmarks/timing.py, and the 1 KiB rows of benchmarks/comm.py.
    """

    __slots__ = STATUS_CALLS + C_TWINS

    def __init__(self, event_record: Callable[[EventHandle, StreamHandle], tuple[int]],
                 event_query: Callable[[EventHandle], tuple[int]],
                 stream_query: Callable[[StreamHandle], tuple[int]],
                 event_elapsed_time: Callable[[EventHandle, EventHandle], tuple[int, float]],
                 ) -> None:
        # Status calls: always callable, never raise for a driver error.
        self.event_record = event_record
        self.event_query = event_query
        self.stream_query = stream_query
        self.event_elapsed_time = event_elapsed_time
        # C twins: None, or the extension's function (all bound together, or none).
        self.launch_kernel: Callable[[FunctionHandle, Dim3, Dim3, int, StreamHandle, int],
                                     int] | None = None
        self.stream_wait_event: Callable[[StreamHandle, EventHandle, int], int] | None = None
        self.ctx_get_current: Callable[[], int | None] | None = None
        self.ctx_set_current: Callable[[int], int] | None = None
        self.memcpy_async: Callable[[int, int, int, StreamHandle], int] | None = None
        self.ordered_copy: Callable[..., tuple[str, int] | None] | None = None
        # (bound apart from the others: None where the driver does not give its entry point)
        self.event_elapsed_times: Callable[[Any, Any], tuple[int, list[float]]] | None = None

    def replaced(self, **calls: Callable[..., Any] | None) -> FastCalls:
        """A copy with the named fields replaced (the counters of :mod:`cudalab.testing` and
        tests put wrapped calls in a copy, leaving the backend's own registry alone)."""
        copy = FastCalls(self.event_record, self.event_query, self.stream_query,
                         self.event_elapsed_time)
        for name in C_TWINS:
            setattr(copy, name, getattr(self, name))
        for name, call in calls.items():
            setattr(copy, name, call)
        return copy

    def __repr__(self) -> str:
        bound = [name for name in C_TWINS if getattr(self, name) is not None]
        return f"<FastCalls, C twins: {', '.join(bound) or 'none'}>"


def checked_fast_calls(event_record: Callable[[EventHandle, StreamHandle], None],
                       event_query: Callable[[EventHandle], bool],
                       stream_query: Callable[[StreamHandle], bool],
                       event_elapsed_time: Callable[[EventHandle, EventHandle], float],
                       last: threading.local) -> FastCalls:
    """A registry of status calls made from a backend's checked methods (the default of
    :meth:`Backend.fast_calls`): a :class:`cudalab.CudaError` becomes its code, the exception
    itself kept in ``last.exc`` for :meth:`Backend.status_error`; a ``False`` answer of a
    query becomes :data:`STATUS_NOT_READY`."""
    from cudalab.errors import CudaError

    def guarded(fn: Callable[..., bool | None]) -> Callable[..., tuple[int]]:
        def call(*args: Any) -> tuple[int]:
            try:
                done = fn(*args)
            except CudaError as exc:  # keep the full exception for status_error()
                last.exc = exc
                return (exc.code,)
            return (STATUS_SUCCESS,) if done is not False else (STATUS_NOT_READY,)

        return call

    def elapsed(start: EventHandle, end: EventHandle) -> tuple[int, float]:
        try:
            return (STATUS_SUCCESS, event_elapsed_time(start, end))
        except CudaError as exc:
            last.exc = exc
            return (exc.code, 0.0)

    def elapsed_times(starts: Any, ends: Any) -> tuple[int, list[float]]:
        times: list[float] = []
        append = times.append
        try:
            for start, end in zip(starts, ends):
                append(event_elapsed_time(start, end))
        except CudaError as exc:
            last.exc = exc
            return (exc.code, times)
        return (STATUS_SUCCESS, times)

    registry = FastCalls(guarded(event_record), guarded(event_query), guarded(stream_query),
                         elapsed)
    registry.event_elapsed_times = elapsed_times  # (the C twin's contract, in Python)
    return registry
