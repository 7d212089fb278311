"""Streams: ordered queues of GPU work, and the per-thread, per-device current stream.

Follows ``torch.cuda``: :class:`Stream` (created non-blocking, priority clamped to the
device's range), :class:`ExternalStream` for handles made elsewhere, ``current_stream``,
``default_stream`` (the legacy null stream, ``cuda_stream == 0``), ``set_stream`` and the
``stream(s)`` context manager. The current stream lives in a thread-local list indexed by
device, so ``current_stream()`` is a couple of attribute reads and no driver call.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from cudalab import _observe
from cudalab import devices as _devices
from cudalab._driver.base import STATUS_NOT_READY, STREAM_NON_BLOCKING, ClosedHandle
from cudalab.errors import StreamCaptureError, name_operation

if TYPE_CHECKING:
    from cudalab._driver.base import Backend

__all__ = [
    "Stream",
    "ExternalStream",
    "StreamContext",
    "current_stream",
    "default_stream",
    "get_stream_from_external",
    "set_stream",
    "stream",
]

#: True once the interpreter is exiting: finalizers then leave handles and memory to the driver.
exiting = False


def _stream_query() -> Callable[[Any], tuple]:
    """The seam's unchecked stream query (backend initialised by the caller)."""
    from cudalab import _internal  # (not at import: keeps `import cudalab` lean)

    fast = _internal.fast_paths()
    assert fast is not None  # set together with the backend at init
    return fast.stream_query


def _mark_exiting() -> None:
    global exiting
    exiting = True


atexit.register(_mark_exiting)


def _events_not_imported() -> Any:
    raise RuntimeError("cudalab.events is not imported (`import cudalab` imports it)")


#: Makes the event that :meth:`Stream.record_event` records when it is given none:
#: :class:`cudalab.Event`, installed once by :mod:`cudalab.events` when it is imported.
#: Events sit above streams in the layers (an event is recorded on a stream and reads the
#: current stream), so this module never imports :mod:`cudalab.events`; ``import cudalab``
#: imports both before any stream exists, so the placeholder below is never called.
new_event: Callable[[], Any] = _events_not_imported


class Stream:
    """A CUDA stream on one device (``torch.cuda.Stream``).

    Args:
        device: the device (None = current).
        priority: lower numbers mean higher priority; values outside the device's range
            are clamped to it (on an H100 the range is 0 … -5).

    The stream owns its driver handle: ``close()`` releases it now, otherwise it is
    released when the object is garbage collected (never during interpreter exit, when the
    driver may already be gone). ``with s:`` makes it the current stream of its device.
    A closed stream is refused, with a RuntimeError that names it, by everything that would
    queue work on it or wait for it (its methods, ``Event.record``, the allocator,
    ``set_stream`` and ``with``).

    Beyond torch's names, three plain attributes are for cudalab's own layers (the
    allocator, kernels, copies, graphs, collectives), read on their hot paths without a
    method call; treat them as read-only: :attr:`handle` (the seam's driver stream),
    :attr:`backend` (the seam it belongs to) and :attr:`is_legacy_null`.
    """

    __slots__ = ("handle", "device_index", "cuda_stream", "_owned", "is_legacy_null", "backend",
                 "_ctx_stack", "_q", "__weakref__")

    #: The seam (driver backend) the stream was created on; set once, never changes.
    backend: Backend
    _q: Callable[[Any], tuple]  # the seam's unchecked stream query (the "Stream.query" row)
    #: The driver stream, opaque, for the seam's calls; a ClosedHandle once closed (never
    #: None: the seam reads None as the null stream, so a closed stream would silently
    #: become the null stream).
    handle: Any
    #: True for the legacy default (NULL) stream, ``cuda_stream == 0``: work on it needs its
    #: device's context current (``devices.ensure_context``); set once.
    is_legacy_null: bool
    _ctx_stack: list[StreamContext] | None  # open ``with stream:`` blocks, innermost last

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any):
        from cudalab import _internal  # (not at import: keeps `import cudalab` lean)

        if kwargs:
            raise TypeError(f"Stream() got unexpected keyword arguments {sorted(kwargs)}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"stream priority must be an int, got {priority!r}")
        idx = _internal.device_index(device)
        b = _internal.backend()
        self.backend = b
        self._q = _stream_query()
        self.handle = b.stream_create(idx, STREAM_NON_BLOCKING, priority)
        self.device_index = idx
        self.cuda_stream = b.handle_int(self.handle)
        self._owned = True
        self.is_legacy_null = False
        self._ctx_stack = None
        if _observe.access_on:  # the stream sanitizer: a new stream starts after what the host waited for
            _observe.access_tracker.stream_created(self)

    @classmethod
    def _wrap(cls, device: int, handle: Any, owned: bool) -> Stream:
        from cudalab import _internal  # (not at import: keeps `import cudalab` lean)

        self = object.__new__(cls)
        b = _internal.backend()
        self.backend = b
        self._q = _stream_query()
        self.handle = handle
        self.device_index = device
        self.cuda_stream = b.handle_int(handle)
        self._owned = owned
        self.is_legacy_null = self.cuda_stream == 0
        self._ctx_stack = None
        return self

    # ------------------------------------------------------------------ identity
    @property
    def device(self) -> _devices.Device:
        """The stream's device as a :class:`cudalab.Device`."""
        return _devices.device_object(self.device_index)

    @property
    def stream_id(self) -> int:
        """An int that identifies the stream on its device (torch's ``Stream.stream_id``).

        torch's value is an internal encoding of its stream pool; cudalab's is the driver
        handle's value, the same as :attr:`cuda_stream`: stable for the stream's life, equal
        for every :class:`Stream` object wrapping the same driver stream, and 0 for the
        default (legacy null) stream, whose torch id is 0 too.
        """
        return self.cuda_stream

    @property
    def priority(self) -> int:
        """The (clamped) priority the stream was created with."""
        self._check_open()
        if self.is_legacy_null:
            return 0
        return self.backend.stream_priority(self.handle)

    @staticmethod
    def priority_range(device: Any = None) -> tuple[int, int]:
        """(least, greatest) priority for ``device``; greatest is numerically smaller."""
        from cudalab import _internal  # (not at import: keeps `import cudalab` lean)

        idx = _internal.device_index(device)
        return _internal.backend().stream_priority_range(idx)

    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol (version 0, handle), understood by cuda.core and torch."""
        return (0, self.cuda_stream)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Stream):
            return self.device_index == other.device_index and self.cuda_stream == other.cuda_stream
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.device_index, self.cuda_stream))

    def __repr__(self) -> str:
        closed = type(self.handle) is ClosedHandle
        name = "Stream" if type(self) is _ClosedStream else type(self).__name__
        return (f"<cudalab.{name} device=cuda:{self.device_index} "
                f"cuda_stream={self.cuda_stream:#x}{' closed' if closed else ''}>")

    # ------------------------------------------------------------------ work
    def query(self) -> bool:
        """True if all work submitted to the stream has completed."""
        if self.is_legacy_null:
            # Direct read, not _internal.ensure_context(): the "Stream.query" row of
            # benchmarks/runtime.py.
            _devices.ensure_context(self.device_index)
        err = self._q(self.handle)[0]
        if not err:
            return True
        if err == STATUS_NOT_READY:
            return False
        raise name_operation(self.backend.status_error(err, "cuStreamQuery"), "Stream.query()")

    def synchronize(self) -> None:
        """Block the host until all work on the stream has completed."""
        if _observe.sync_on:  # set_sync_debug_mode (one flag read while it is default)
            _observe.notify_sync("Stream.synchronize()")
        if self.is_legacy_null:
            from cudalab import _internal  # (not at import: keeps `import cudalab` lean)

            _internal.ensure_context(self.device_index)
        try:
            self.backend.stream_synchronize(self.handle)
        except StreamCaptureError as exc:
            raise name_operation(exc, "Stream.synchronize()") from exc
        if _observe.access_on:  # the stream sanitizer (one flag read while it is off)
            _observe.access_tracker.stream_synchronize(self)

    def wait_event(self, event: Any) -> None:
        """Make all future work on this stream wait for ``event`` (no host sync)."""
        h = event.handle
        if h is None:  # never recorded: nothing to wait for (torch does the same)
            self._check_open()  # (a recorded event reaches the seam, which refuses a closed one)
            return
        if self.is_legacy_null:
            from cudalab import _internal  # (not at import: keeps `import cudalab` lean)

            _internal.ensure_context(self.device_index)
        self.backend.stream_wait_event(self.handle, h)
        if _observe.access_on:
            _observe.access_tracker.event_wait(event, self)

    def wait_stream(self, stream: Stream) -> None:
        """Make all future work on this stream wait for the work queued so far on ``stream``."""
        self.wait_event(stream.record_event())

    def record_event(self, event: Any = None) -> Any:
        """Record ``event`` (a new one if None) on this stream and return it."""
        if event is None:
            event = new_event()
        event.record(self)
        return event

    # ------------------------------------------------------------------ ownership
    def close(self) -> None:
        """Release the driver handle now (idempotent). Work already queued still runs.

        From then on the stream is refused (RuntimeError naming it) wherever work would be
        queued on it or waited for. How, without a check on the hot paths: the handle
        becomes a :class:`~cudalab._driver.base.ClosedHandle`, which the seam refuses
        wherever a handle goes (queries, event records, copies, launches); a plain
        :class:`Stream` becomes a :class:`_ClosedStream`, whose type the allocator's
        explicit-stream path does not take (``type(stream) is Stream``), so the allocator
        reaches :func:`~cudalab.allocator.base.stream_key`, which refuses it; and the
        allocators forget it as a memo stream (``close_listeners``). An ExternalStream is
        not owned: closing it does nothing.
        """
        h = self.handle
        if self._owned and type(h) is not ClosedHandle:
            self.handle = ClosedHandle(repr(self))
            if type(self) is Stream:
                self.__class__ = _ClosedStream
            for listener in close_listeners:
                listener(self)
            self.backend.stream_destroy(h)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` released the stream (it can no longer be used)."""
        return type(self.handle) is ClosedHandle

    def _check_open(self) -> None:
        """Raise the closed stream's RuntimeError (for paths that do not reach the seam)."""
        h = self.handle
        if type(h) is ClosedHandle:
            raise h.error()

    def __del__(self) -> None:
        try:
            h = self.handle
            if self._owned and type(h) is not ClosedHandle and not exiting:
                self.backend.stream_destroy(h)
        except Exception:
            pass

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Stream:
        ctx = StreamContext(self)
        ctx.__enter__()
        if self._ctx_stack is None:
            self._ctx_stack = []
        self._ctx_stack.append(ctx)
        return self

    def __exit__(self, *exc: Any) -> Literal[False]:
        assert self._ctx_stack is not None  # __enter__ made it
        self._ctx_stack.pop().__exit__(*exc)
        return False


class _ClosedStream(Stream):
    """A :class:`Stream` after :meth:`Stream.close` (its class is switched; same slots).

    It behaves as a closed Stream in every way (``isinstance(s, Stream)`` holds, its repr
    says ``cudalab.Stream ... closed``); its only purpose is that ``type(s) is Stream`` no
    longer holds, which sends it off the allocator's fast path (see :meth:`Stream.close`).
    """

    __slots__ = ()


#: Called with each stream that :meth:`Stream.close` closes (the allocator registry adds
#: one that makes the allocators forget it). Appended to at import only.
close_listeners: list[Callable[[Stream], None]] = []


class ExternalStream(Stream):
    """A stream created outside cudalab (by CuPy, torch, raw bindings), given its handle.

    cudalab never destroys it: the creator must keep it alive while it is in use.
    """

    __slots__ = ()

    def __init__(self, stream_ptr: int, device: Any = None):
        from cudalab import _internal  # (not at import: keeps `import cudalab` lean)

        if isinstance(stream_ptr, bool) or not isinstance(stream_ptr, int) or stream_ptr < 0:
            raise TypeError(f"stream_ptr must be a non-negative int handle, got {stream_ptr!r}")
        idx = _internal.device_index(device)
        b = _internal.backend()
        self.backend = b
        self._q = _stream_query()
        self.handle = b.stream_from_int(idx, stream_ptr)
        self.device_index = idx
        self.cuda_stream = stream_ptr
        self._owned = False
        self.is_legacy_null = stream_ptr == 0
        self._ctx_stack = None


def get_stream_from_external(data_ptr: int, device: Any = None) -> ExternalStream:
    """Wrap a stream created outside cudalab (torch's ``get_stream_from_external``).

    Parameters
    ----------
    data_ptr : int
        The driver handle of the stream (``cudaStream_t`` / ``CUstream`` as an int, e.g.
        CuPy's ``Stream.ptr`` or torch's ``Stream.cuda_stream``); 0 is the legacy default
        stream.
    device : int, str, Device or None, optional
        The device the stream belongs to (default: the current device).

    Returns
    -------
    ExternalStream
        A stream cudalab never destroys: the caller keeps the external stream alive while
        the returned object is used.

    Raises
    ------
    TypeError
        When ``data_ptr`` is not a non-negative int.
    ValueError
        For a device index out of range.
    """
    return ExternalStream(data_ptr, device)


# --------------------------------------------------------------------------- current stream
# Per thread: .device (current device) and .streams (current streams): the object that
# _internal.thread_state() returns, the same for the life of the process. Bound straight from
# devices because current_stream() reads it ("current_stream()" row of benchmarks/runtime.py)
# and loading _internal here would add its imports to `import cudalab` (the "import" row).
per_thread = _devices.per_thread
_defaults: list[Stream | None] = []
_defaults_lock = threading.Lock()
#: One token per (thread, device) whose current stream is not the default stream (a stream
#: other than handle 0), appended before the slot changes and popped after it changes back
#: (both atomic). Empty means ``stream=None`` is the default stream in every thread, which
#: lets the allocator's cache hit skip the thread-local lookup. Threads that end with a
#: stream current leave their token: the hint stays conservative, never wrong.
custom_stream_tokens: list[None] = []
#: The captures in progress through :class:`cudalab.CUDAGraph`, by capture id: the graph
#: being captured, added once its stream capture has begun and removed when it ends or is
#: abandoned (by :mod:`cudalab.graphs.cuda_graph`, its ``_capturing``, under its lock).
#: Elsewhere only read for emptiness, one global read: empty means no stream is capturing
#: into a CUDAGraph (``DeviceArray.fill_`` then may queue memsets, which replay slowly).
#: The dict itself is never replaced (its readers bind it).
open_captures: dict[int, Any] = {}


def _put(cur: list, idx: int, s: Stream | None) -> None:
    """Set ``cur[idx]`` (a thread's current-stream slot) to ``s``, keeping :data:`custom_stream_tokens`."""
    old = cur[idx]
    was = old is not None and old.cuda_stream != 0
    now = s is not None and s.cuda_stream != 0
    if now and not was:
        custom_stream_tokens.append(None)
    cur[idx] = s
    if was and not now:
        custom_stream_tokens.pop()


def _thread_streams() -> list:
    from cudalab import _internal  # (not at import: keeps `import cudalab` lean)

    _internal.backend()  # initialise CUDA: the device count is known from here on
    cur = per_thread.streams = [None] * _devices.device_count()
    return cur


def default_stream(device: Any = None) -> Stream:
    """The legacy default (null) stream of ``device`` (``cuda_stream == 0``)."""
    # Direct read: current_stream() calls this on a thread's first use of a device.
    idx = _devices.device_index(device)
    if _defaults:
        s = _defaults[idx]
        if s is not None:
            return s
    with _defaults_lock:
        if not _defaults:
            _defaults.extend([None] * _devices.device_count())
        s = _defaults[idx]
        if s is None:
            from cudalab import _internal  # (not at import: keeps `import cudalab` lean)

            s = _defaults[idx] = Stream._wrap(idx, _internal.backend().null_stream(idx),
                                              owned=False)
        return s


def current_stream(device: Any = None) -> Stream:
    """This thread's current stream on ``device`` (None = current device)."""
    t = per_thread
    cur = t.streams
    if cur is None:
        cur = _thread_streams()
    # Direct module read, not _internal.device_index(): the "current_stream()" row of
    # benchmarks/runtime.py.
    if device is None:
        d = t.device
    elif type(device) is int and 0 <= device < len(cur):  # (the elementwise "host/call" rows)
        d = device
    else:
        d = _devices.device_index(device)
    s = cur[d]
    if s is None:
        s = cur[d] = default_stream(d)
    return s


def set_stream(stream: Stream | None) -> None:
    """Make ``stream`` current on its device and make that device current (torch semantics).

    Prefer the :func:`stream` context manager, which restores the previous stream.
    """
    if stream is None:
        return
    if not isinstance(stream, Stream):
        raise TypeError(f"set_stream expects a cudalab.Stream, got {stream!r}")
    stream._check_open()
    cur = per_thread.streams
    if cur is None:
        cur = _thread_streams()
    if per_thread.device != stream.device_index:
        _devices.set_device(stream.device_index)
    _put(cur, stream.device_index, stream)


class StreamContext:
    """Select a stream for the duration of a ``with`` block (``torch.cuda.StreamContext``).

    Inside the block the stream is current on its device and that device is current; on
    exit both the previous device and the previous streams are restored. None is a no-op.
    """

    __slots__ = ("stream", "idx", "src_prev_stream", "dst_prev_stream", "prev_device")

    def __init__(self, stream: Stream | None):
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(f"expected a cudalab.Stream or None, got {stream!r}")
        self.stream = stream
        self.idx = -1 if stream is None else stream.device_index
        self.src_prev_stream: Stream | None = None  # current stream of prev_device on entry
        self.dst_prev_stream: Stream | None = None  # ... of the stream's device, if different
        self.prev_device = -1

    def __enter__(self) -> Stream | None:
        s = self.stream
        if s is None:
            return None
        self.prev_device = _devices.current_device()
        self.src_prev_stream = current_stream(self.prev_device)
        if self.prev_device != s.device_index:
            self.dst_prev_stream = current_stream(s.device_index)
        set_stream(s)
        return s

    def __exit__(self, *exc: Any) -> Literal[False]:
        s = self.stream
        if s is None:
            return False
        cur = per_thread.streams
        assert cur is not None  # __enter__ made this thread's list
        if self.dst_prev_stream is not None:
            _put(cur, s.device_index, self.dst_prev_stream)
        if per_thread.device != self.prev_device:
            _devices.set_device(self.prev_device)
        _put(cur, self.prev_device, self.src_prev_stream)
        return False


def stream(stream: Stream | None) -> StreamContext:
    """Context manager selecting ``stream`` (``torch.cuda.stream``)."""
    return StreamContext(stream)


def is_capturing(stream: Stream) -> bool:
    """Whether ``stream`` is being captured into a CUDA graph (``cuStreamIsCapturing``).

    The legacy null stream is the current context's stream, and the driver refuses the
    query with ``CUDA_ERROR_INVALID_CONTEXT`` on a thread where no context is current (after
    ``cudalab.init()`` alone, or on a new thread): its device's context is made current
    first, as for every other call on the null stream.
    """
    if stream.is_legacy_null:
        _devices.ensure_context(stream.device_index)
    return bool(stream.backend.stream_is_capturing(stream.handle))


def refuse_during_capture(operation: str) -> None:
    """Raise :class:`~cudalab.StreamCaptureError` naming ``operation`` when the current
    stream is being captured into a CUDA graph (``empty_cache()``: the allocator's cache is
    not touched mid-capture).

    The capture is invalidated the way the driver invalidates it for any refused call (a
    stream query on the capturing stream), so the error reads as for ``synchronize()``, and
    ending the capture reports it broken."""
    stream = current_stream()
    handle = stream.handle
    backend = stream.backend
    if not is_capturing(stream):
        return
    try:
        backend.stream_query(handle)  # refused while capturing: the driver invalidates it
    except StreamCaptureError as exc:
        raise name_operation(exc, operation) from exc
    raise StreamCaptureError(operation=operation)
