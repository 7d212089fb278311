"""Events: markers in a stream's work, for synchronisation and timing (``torch.cuda.Event``).

Like torch, the driver event is created lazily on the first ``record`` (on the recording
stream's device) or ``ipc_handle``. ``record`` and ``query`` are hot paths: one Python frame
over the backend call, no allocation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from cudalab import _observe
from cudalab import devices as _devices
from cudalab import streams as _streams
from cudalab._driver.base import (
    EVENT_BLOCKING_SYNC,
    EVENT_DEFAULT,
    EVENT_DISABLE_TIMING,
    EVENT_INTERPROCESS,
    EVENT_RECORD_EXTERNAL,
    IPC_HANDLE_SIZE,
    STATUS_NOT_READY,
)
from cudalab._units import echo
from cudalab.errors import StreamCaptureError, name_operation

if TYPE_CHECKING:
    from cudalab._driver.base import Backend

__all__ = ["Event"]


class Event:
    """A CUDA event.

    Args:
        enable_timing: the event records a timestamp usable by :meth:`elapsed_time`.
        blocking: :meth:`synchronize` blocks the thread in the driver instead of spinning.
        interprocess: the event can be shared with other processes via :meth:`ipc_handle`
            (incompatible with ``enable_timing``, a CUDA rule).
        external: recorded while its stream is captured into a CUDA graph, the record
            becomes a node of the graph (``cudaEventRecordExternal``): each replay records
            the event, e.g. to time the replay (torch's ``external``). Outside a capture, an
            ordinary record.

    The event owns its driver handle: ``close()`` (or leaving a ``with Event() as e:``
    block) releases it now, otherwise garbage collection does (never during interpreter
    exit).
    """

    __slots__ = ("handle", "_flags", "enable_timing", "blocking", "interprocess", "external",
                 "device_index", "_b", "_rec", "_q", "__weakref__")

    #: The driver event, opaque, for the seam's calls (read by the runtime's layers on hot
    #: paths without a method call; read-only to them); None until the first record (or
    #: ipc_handle / open), None again after close().
    handle: Any
    # Bound together with the first handle (by _bind) and read only while handle is set:
    _b: Backend
    _rec: Callable[[Any, Any], tuple]  # the seam's unchecked event_record (hot path)
    _q: Callable[[Any], tuple]  # the seam's unchecked event_query (hot path)

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, external: bool = False):
        if interprocess and enable_timing:
            raise ValueError("an interprocess Event cannot have enable_timing=True (CUDA requires "
                             "interprocess events to disable timing)")
        flags = EVENT_DEFAULT if enable_timing else EVENT_DISABLE_TIMING
        if blocking:
            flags |= EVENT_BLOCKING_SYNC
        if interprocess:
            flags |= EVENT_INTERPROCESS
        self._flags = flags
        self.enable_timing = bool(enable_timing)
        self.blocking = bool(blocking)
        self.interprocess = bool(interprocess)
        self.external = bool(external)
        self.handle = None
        self.device_index = -1
        self._b = None  # type: ignore[assignment]  # unbound until the first handle
        self._rec = self._q = None  # type: ignore[assignment]  # likewise

    # ------------------------------------------------------------------ creation
    def _bind(self) -> Any:
        from cudalab import _internal  # (not at import: keeps `import cudalab` lean)

        b = self._b = _internal.backend()
        fast = _internal.fast_paths()
        assert fast is not None  # set together with the backend at init
        self._rec = _external_record(b) if self.external else fast.event_record
        self._q = fast.event_query
        return b

    def create_handle(self, device: int) -> Any:
        """Make the driver event on ``device`` now (not at the first record) and return it.

        For cudalab's layers (cross-device copies' ordering events,
        :func:`cudalab._internal.create_event`); the event must not have a handle yet.
        """
        b = self._bind()
        self.handle = b.event_create(device, self._flags)
        self.device_index = device
        return self.handle

    @classmethod
    def from_ipc_handle(cls, device: Any, handle: bytes) -> Event:
        """Open an event exported by another process with :meth:`ipc_handle`."""
        if not isinstance(handle, (bytes, bytearray, memoryview)):
            raise TypeError(f"handle must be bytes from Event.ipc_handle(), got {type(handle).__name__}")
        handle = bytes(handle)
        if len(handle) != IPC_HANDLE_SIZE:
            raise ValueError(f"an event IPC handle has {IPC_HANDLE_SIZE} bytes, got {len(handle)}")
        from cudalab import _internal  # (not at import: keeps `import cudalab` lean)

        idx = _internal.device_index(device)
        self = cls(enable_timing=False, interprocess=True)
        b = self._bind()
        self.handle = b.ipc_open_event(idx, handle)
        self.device_index = idx
        return self

    # ------------------------------------------------------------------ hot paths
    def record(self, stream: Any = None) -> Event:
        """Record the event on ``stream`` (default: the current stream)."""
        if stream is None:
            stream = _streams.current_stream()
        # No type check up front (the "Event.record" row): a non-Stream fails at its first
        # attribute read, and the handler turns that into a TypeError naming the parameter
        # (a try costs nothing until something raises).
        try:
            h = self.handle
            if h is None:
                h = self.create_handle(stream.device_index)
            if stream.is_legacy_null:
                # Direct read, not _internal.ensure_context(): the "Event.record" row of
                # benchmarks/runtime.py (and %%cuda_timed's per-repeat cost, benchmarks/timing.py).
                _devices.ensure_context(stream.device_index)
            if self._rec(h, stream.handle)[0]:
                self._record_failed(stream)
            if _observe.access_on:  # the stream sanitizer (one flag read while it is off)
                _observe.access_tracker.event_record(self, stream)
        except AttributeError:
            if not isinstance(stream, _streams.Stream):
                raise _not_a_stream("Event.record()", stream) from None
            raise
        return self

    def _record_failed(self, stream: Any) -> None:
        """Explain a failed record (off the hot path: the device check happens only here)."""
        if stream.device_index != self.device_index:
            raise ValueError(
                f"Event was created on cuda:{self.device_index} but is being recorded on a "
                f"stream of cuda:{stream.device_index}"
            )
        self._b.event_record(self.handle, stream.handle)  # raises the driver's error

    def query(self) -> bool:
        """True if the work captured by the event has completed (or it was never recorded)."""
        h = self.handle
        if h is None:
            return True
        err = self._q(h)[0]
        if not err:
            return True
        if err == STATUS_NOT_READY:
            return False
        raise name_operation(self._b.status_error(err, "cuEventQuery"), "Event.query()")

    def synchronize(self) -> None:
        """Block the host until the event completes."""
        if _observe.sync_on:
            _observe.notify_sync("Event.synchronize()")
        h = self.handle
        if h is not None:
            try:
                self._b.event_synchronize(h)
            except StreamCaptureError as exc:
                raise name_operation(exc, "Event.synchronize()") from exc
            if _observe.access_on:
                _observe.access_tracker.event_synchronize(self)

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (default: current) wait for this event, without blocking the host."""
        if stream is None:
            stream = _streams.current_stream()
        stream.wait_event(self)

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds between this event and ``end_event`` (both recorded and completed).

        Parameters
        ----------
        end_event : Event
            The later event.

        Returns
        -------
        float
            Milliseconds.

        Raises
        ------
        TypeError
            ``end_event`` is not an :class:`Event`.
        ValueError
            If either event was created without ``enable_timing=True``, or was never recorded
            (torch's ``TORCH_CHECK_VALUE`` checks, same messages).
        """
        if not isinstance(end_event, Event):
            raise TypeError(f"Event.elapsed_time(): end_event must be a cudalab.Event, got "
                            f"{type(end_event).__name__} {echo(end_event)}")
        if not (self.enable_timing and end_event.enable_timing):
            raise ValueError("Both events must be created with argument 'enable_timing=True'.")
        if self.handle is None or end_event.handle is None:
            raise ValueError("Both events must be recorded before calculating elapsed time.")
        return self._b.event_elapsed_time(self.handle, end_event.handle)

    def ipc_handle(self) -> bytes:
        """A 64-byte handle another process can open with :meth:`from_ipc_handle`."""
        if not self.interprocess:
            raise RuntimeError("ipc_handle() needs an Event created with interprocess=True")
        h = self.handle
        if h is None:
            h = self.create_handle(_devices.current_device())
        return self._b.ipc_event_handle(h)

    # ------------------------------------------------------------------ ownership
    @property
    def cuda_event(self) -> int:
        """The driver handle as an int (0 before the first record)."""
        return 0 if self.handle is None else self._b.handle_int(self.handle)

    @property
    def event_id(self) -> int:
        """torch's ``Event.event_id``: the ``CUevent`` handle's integer value, the same as
        :attr:`cuda_event` (0 before the event is created by its first record, and after
        :meth:`close`)."""
        return 0 if self.handle is None else self._b.handle_int(self.handle)

    @property
    def device(self) -> _devices.Device | None:
        """The event's device (torch's ``Event.device``): a :class:`cudalab.Device`, or
        None while the event has not been created (events are created lazily, on the
        device of the stream of their first record, as torch's)."""
        idx = self.device_index
        return None if idx < 0 else _devices.device_object(idx)

    def close(self) -> None:
        """Release the driver handle now (idempotent)."""
        h = self.handle
        if h is not None:
            self.handle = None
            self._b.event_destroy(h)

    def __enter__(self) -> Event:
        return self

    def __exit__(self, *exc: Any) -> Literal[False]:
        """``with Event() as e:`` releases the handle at the end of the block."""
        self.close()
        return False

    def __del__(self) -> None:
        try:
            h = self.handle
            if h is not None and not _streams.exiting:
                self.handle = None
                self._b.event_destroy(h)
        except Exception:
            pass

    def __repr__(self) -> str:
        where = f"cuda:{self.device_index}" if self.handle is not None else "uninitialized"
        return f"<cudalab.Event {where} timing={self.enable_timing}>"


def _external_record(b: Backend) -> Callable[[Any, Any], tuple]:
    """The record call of an ``external`` event, with the status-call shape of the fast
    ``event_record`` (it raises the driver's error itself, so it always returns ``(0,)``)."""
    record = b.event_record_with_flags
    plain = b.event_record
    capturing = b.stream_is_capturing

    def record_external(event: Any, stream: Any) -> tuple:
        # The driver refuses the external flag outside a capture (CUDA_ERROR_ILLEGAL_STATE,
        # seen on an H200): there the event records as any other (torch's behaviour).
        if capturing(stream):
            record(event, stream, EVENT_RECORD_EXTERNAL)
        else:
            plain(event, stream)
        return (0,)

    return record_external


def _not_a_stream(what: str, stream: Any) -> TypeError:
    """The TypeError for a ``stream`` argument that is not a :class:`cudalab.Stream`."""
    return TypeError(f"{what}: stream must be a cudalab.Stream or None, got "
                     f"{type(stream).__name__} {echo(stream)}")


def record_fast(event: Event, stream: Any) -> None:
    """``event.record(stream)`` for a hot path that records an existing event again and again.

    One unchecked record by handle; only when the event has no driver event yet, or that
    record fails (e.g. another context is current for the null stream), does it go through
    :meth:`Event.record`, which creates the event, makes the context current and raises the
    driver's error. It skips :meth:`Event.record`'s null-stream context check, which saves
    about 0.3 µs per call: ``%cuda_memory watch`` records two events per cell (benchmark
    rows "watch hooks, called directly" in benchmarks/timing.py).

    Parameters
    ----------
    event : Event
        The event to record.
    stream : cudalab.Stream
        The stream to record it on (the caller names it: there is no default here).
    """
    h = event.handle
    if h is None or event._rec(h, stream.handle)[0]:
        event.record(stream)


# Stream.record_event() makes its Event through this (streams sit below events: they never
# import this module). Set at import, before any stream can exist.
_streams.new_event = Event
