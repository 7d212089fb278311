"""The observer bus: the one way anything in cudalab is observed.

Seven event families, each with a typed :class:`~typing.Protocol` for its observers, one
module-level flag and one subscriber list:

==================  =====================================  ===========================  ==============================
family              observer protocol                      flag (hot path)              the idiom that is its view
==================  =====================================  ===========================  ==============================
allocation trace    :class:`AllocationTraceObserver`       :data:`trace_on`             ``allocator.hooks.attach_trace``
memory access       :class:`MemoryAccessObserver`          :data:`access_on`            ``_sanitizer_hook``, the sanitizer
kernel launch       :class:`LaunchObserver`                :data:`launch_on`            ``_internal.launch_observers``
collective          :class:`CollectiveObserver`            :data:`collective_on`        ``_internal.collective_observers``
out of memory       :class:`OutOfMemoryObserver`           :data:`out_of_memory_on`     ``allocator.oom_observers``
allocator created   :class:`AllocatorCreatedObserver`      :data:`allocator_created_on` ``registry.add_create_hook``
synchronization     :class:`SyncObserver`                  :data:`sync_on`              ``sync_debug`` (its modes)
==================  =====================================  ===========================  ==============================

Invariant, per family: ``<family>_on == bool(<family>_subscribers)``. Only the list's
mutating methods (:class:`Subscribers`) and the ``subscribe_<family>`` /
``unsubscribe_<family>`` functions change either, under one lock and with Ctrl-C deferred
(``import cudalab`` registers :data:`MUTATORS` with :mod:`cudalab._interrupts`), so the two
cannot drift: a list appended to through an old idiom (``launch_observers.append(f)``) turns
the flag on as :func:`subscribe_launch` does.

The hot path
------------
A site reads one flag when nobody listens and does nothing else::

    if _observe.access_on:  # one module-global read while the sanitizer is off
        _observe.access_tracker.kernel_launch(kernel, stream, values)

A site that binds a family's list at import (``from cudalab._internal import
launch_observers``) may test the list's truth instead: it agrees with the flag, and costs
the same one global read. The allocation-trace family is the exception in one respect: each
allocator reads its own ``_trace`` field (one attribute read, per allocator); the bus lists
the traces attached to any allocator, and :data:`trace_on` says whether there is one.

Who calls the observers
-----------------------
The idiom that owns the event: the launchers loop over ``launch_observers``,
:func:`cudalab._internal.notify_collective`, :func:`cudalab.allocator.oom_observers.notify_out_of_memory`,
the registry for allocator creation, each allocator for its trace. The bus dispatches two
families itself: :data:`access_tracker` (the one memory-access observer, or a fan-out to
several) and :func:`notify_sync`. What happens when an observer raises is the owner's rule
(written on each protocol).

This module imports nothing of cudalab, so every layer may name it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, Protocol, SupportsIndex, TypeVar

if TYPE_CHECKING:  # typing.Self is Python 3.11+; the package supports 3.10
    from typing import Self

__all__ = [
    "FAMILIES",
    "MUTATORS",
    "AllocationTraceObserver",
    "AllocatorCreatedObserver",
    "CollectiveRecord",
    "CollectiveObserver",
    "LaunchObserver",
    "MemoryAccessObserver",
    "OutOfMemoryObserver",
    "Subscribers",
    "SyncObserver",
    "access_on",
    "access_subscribers",
    "access_tracker",
    "allocator_created_on",
    "allocator_created_subscribers",
    "collective_on",
    "collective_subscribers",
    "launch_on",
    "launch_subscribers",
    "notify_sync",
    "out_of_memory_on",
    "out_of_memory_subscribers",
    "subscribe_access",
    "subscribe_allocator_created",
    "subscribe_collective",
    "subscribe_launch",
    "subscribe_out_of_memory",
    "subscribe_sync",
    "subscribe_trace",
    "sync_on",
    "sync_subscribers",
    "trace_on",
    "trace_subscribers",
    "unsubscribe_access",
    "unsubscribe_allocator_created",
    "unsubscribe_collective",
    "unsubscribe_launch",
    "unsubscribe_out_of_memory",
    "unsubscribe_sync",
    "unsubscribe_trace",
]

#: The families, as the prefixes of their flags and lists.
FAMILIES: tuple[str, ...] = ("trace", "access", "launch", "collective", "out_of_memory",
                             "allocator_created", "sync")


# ----------------------------------------------------------------------------- protocols
class AllocationTraceObserver(Protocol):
    """Told of every operation of the allocator it is attached to, as
    ``trace(action, addr, size, stream)`` (the full contract, with its optional compact and
    pool-segment parts, is :class:`cudalab.allocator.hooks.AllocatorTrace`). Called with the
    allocator's lock held: it must not raise nor call back into the allocator."""

    def __call__(self, action: str, addr: int, size: int, stream: int, /) -> None: ...


class MemoryAccessObserver(Protocol):
    """Told of every place cudalab touches device memory (the stream sanitizer's
    :class:`cudalab.sanitizer.tracking.Tracker`). Streams, events and kernels are cudalab's
    objects (typed loosely: this module imports nothing of cudalab). Its exceptions propagate
    to the operation that reported (the sanitizer's "raise" mode)."""

    def allocated(self, ptr: int, nbytes: int, stream: Any) -> None:
        """An allocation of ``nbytes`` at ``ptr`` on ``stream``."""

    def freed(self, ptr: int, stream: Any = None) -> None:
        """The free request of the allocation at ``ptr``."""

    def stream_recorded(self, ptr: int, stream: Any) -> None:
        """``record_stream``: the allocation at ``ptr`` is used on ``stream`` too."""

    def kernel_launch(self, kernel: Any, stream: Any, values: Sequence[Any]) -> None:
        """A :class:`cudalab.kernels.Kernel` launch (its ``access`` annotation says which
        pointer arguments it reads and writes)."""

    def access(self, stream: Any, reads: Iterable[tuple[int, int]],
               writes: Iterable[tuple[int, int]], name: str) -> None:
        """Other device work: ``reads`` and ``writes`` are ``(ptr, nbytes)`` ranges."""

    def transfer(self, stream: Any, device_ptr: int, nbytes: int, to_host: bool,
                 waited: bool) -> None:
        """A host transfer to the host (a read) or from it (a write); ``waited``: the host
        waited for it."""

    def stream_created(self, stream: Any) -> None:
        """A new stream (it starts after what the host waited for)."""

    def event_record(self, event: Any, stream: Any) -> None:
        """A happens-before edge: ``event`` recorded on ``stream``."""

    def event_wait(self, event: Any, stream: Any) -> None:
        """A happens-before edge: ``stream`` waits for ``event``."""

    def event_synchronize(self, event: Any) -> None:
        """The host waited for ``event``."""

    def stream_synchronize(self, stream: Any) -> None:
        """The host waited for ``stream``."""

    def device_synchronize(self, device: int) -> None:
        """The host waited for every stream of ``device``."""


class LaunchObserver(Protocol):
    """Told of every kernel launch the runtime makes, right after it is queued, as
    ``observer(name, device, stream, grid, block)`` (``stream``: a :class:`cudalab.Stream`;
    ``grid``, ``block``: 3-tuples). Its exceptions propagate to the launch."""

    def __call__(self, name: str, device: int, stream: Any, grid: tuple[int, int, int],
                 block: tuple[int, int, int], /) -> object: ...


class CollectiveRecord(NamedTuple):
    """One collective call, as the collective observers are told of it
    (``cudalab._internal.CollectiveRecord`` is this class).

    ``algorithm_bytes`` and ``bus_factor`` follow NVIDIA's nccl-tests (``doc/PERFORMANCE.md``),
    so that algorithm bandwidth = ``algorithm_bytes / time`` and bus bandwidth = algorithm
    bandwidth x ``bus_factor``: for all_reduce S = count x element size and factor 2(n-1)/n;
    all_gather and reduce_scatter S = the whole gathered array, factor (n-1)/n; broadcast and
    reduce S = count x element size, factor 1; send/recv S = the message, factor 1.
    """

    name: str  # the operation, e.g. "all_reduce", "comm.broadcast"
    algorithm_bytes: int  # S of nccl-tests (bytes, >= 0)
    nranks: int  # ranks (devices) taking part, >= 1
    bus_factor: float  # busbw / algbw: 2(n-1)/n, (n-1)/n or 1
    devices: tuple[int, ...]  # the devices of this process that take part, in rank order


class CollectiveObserver(Protocol):
    """Told of every collective after it is queued, as ``observer(record)``. Its exceptions
    propagate to the collective."""

    def __call__(self, record: CollectiveRecord, /) -> object: ...


class OutOfMemoryObserver(Protocol):
    """Called as ``observer(device, alloc, device_allocated, device_free)`` before a native
    allocator raises OutOfMemoryError (torch's arguments). An exception it raises is turned
    into a RuntimeWarning (it never hides the out-of-memory error)."""

    def __call__(self, device: int, alloc: int, device_allocated: int, device_free: int,
                 /) -> object: ...


class AllocatorCreatedObserver(Protocol):
    """Called with each allocator the registry creates, before it is published, with the
    registry's lock held: it must not raise nor call back into the registry."""

    def __call__(self, allocator: Any, /) -> object: ...


class SyncObserver(Protocol):
    """Called as ``observer(what)`` where cudalab is about to block the host on the device
    (``what``: e.g. ``"Stream.synchronize()"``). Its exceptions propagate: the operation
    does not synchronize (``set_sync_debug_mode("error")`` raises this way). A warning it
    issues with ``stacklevel=4`` points at the caller of the synchronizing operation."""

    def __call__(self, what: str, /) -> object: ...


# ----------------------------------------------------------------------------- the lists
_T = TypeVar("_T")

#: Serialises the changes of every list with its flag (never held while an observer runs).
#: Re-entrant: a finalizer run by the garbage collector in the middle of a change may change
#: a list too (``allocator.hooks`` republishes when a traced allocator is collected); every
#: change ends by setting the flag from the list as it is then.
_lock = threading.RLock()


class Subscribers(list[_T], Generic[_T]):
    """A family's subscriber list: a ``list`` whose every change sets the family's flag to
    the list's truth (under :data:`_lock`), so an old idiom's ``append`` / ``remove`` on it
    subscribes and unsubscribes. Never rebound: sites bind it at import."""

    __slots__ = ("family",)

    def __init__(self, family: str):
        super().__init__()
        #: The family's name (one of :data:`FAMILIES`); fixed.
        self.family = family

    def _agree(self) -> None:
        """Set the family's flag (and the access fan-out) from the list; lock held. The
        tracker is set before the flag turns on and cleared after it turns off (a site in
        another thread that reads the flag just before the last observer leaves may still
        find no tracker, as with the sanitizer's switch before the bus)."""
        on = len(self) > 0
        if self.family == "access":
            global access_tracker
            if on:
                access_tracker = (self[0] if len(self) == 1
                                  else _AccessFanout(tuple(access_subscribers)))
                globals()["access_on"] = True
            else:
                globals()["access_on"] = False
                access_tracker = None
            return
        globals()[self.family + "_on"] = on

    def append(self, observer: _T, /) -> None:
        with _lock:
            list.append(self, observer)
            self._agree()

    def insert(self, index: SupportsIndex, observer: _T, /) -> None:
        with _lock:
            list.insert(self, index, observer)
            self._agree()

    def extend(self, observers: Iterable[_T], /) -> None:
        observers = list(observers)  # (outside the lock: iterating may run code)
        with _lock:
            list.extend(self, observers)
            self._agree()

    def remove(self, observer: _T, /) -> None:
        with _lock:
            try:
                list.remove(self, observer)
            finally:
                self._agree()

    def pop(self, index: SupportsIndex = -1, /) -> _T:
        with _lock:
            try:
                return list.pop(self, index)
            finally:
                self._agree()

    def clear(self) -> None:
        with _lock:
            list.clear(self)
            self._agree()

    def __setitem__(self, index: Any, value: Any, /) -> None:
        with _lock:
            try:
                list.__setitem__(self, index, value)
            finally:
                self._agree()

    def __delitem__(self, index: Any, /) -> None:
        with _lock:
            try:
                list.__delitem__(self, index)
            finally:
                self._agree()

    def __iadd__(self, observers: Iterable[_T], /) -> Self:  # type: ignore[override,misc]
        self.extend(observers)
        return self

    def __imul__(self, times: SupportsIndex, /) -> Self:  # type: ignore[override,misc]
        with _lock:
            list.__imul__(self, times)
            self._agree()
        return self


class _AccessFanout:
    """:data:`access_tracker` while several memory-access observers listen: each hook call
    goes to every one of them, in subscription order."""

    __slots__ = ("observers",)

    def __init__(self, observers: tuple[MemoryAccessObserver, ...]):
        #: The subscribers when the fan-out was made (it is remade on every change).
        self.observers = observers

    def __getattr__(self, hook: str) -> Callable[..., None]:
        methods = [getattr(o, hook) for o in self.observers]

        def fan_out(*args: Any, **kwargs: Any) -> None:
            for method in methods:
                method(*args, **kwargs)

        return fan_out


# Per family: the flag (invariant: == bool of the list; written only by Subscribers) and
# the list (never rebound).
#: Whether any allocator has a trace attached (each allocator reads its own ``_trace``).
trace_on = False
#: The traces attached, one entry per allocator traced (``allocator.hooks`` writes it).
trace_subscribers: Subscribers[AllocationTraceObserver] = Subscribers("trace")
#: Whether a memory-access observer (the sanitizer) listens.
access_on = False
#: The memory-access observers.
access_subscribers: Subscribers[MemoryAccessObserver] = Subscribers("access")
#: What the sites call while :data:`access_on`: the one observer, or a fan-out to all of
#: them; None while nobody listens. Invariant: set with the flag, from the list.
access_tracker: Any = None
#: Whether a kernel-launch observer listens.
launch_on = False
#: The kernel-launch observers (``cudalab._internal.launch_observers`` is this list).
launch_subscribers: Subscribers[LaunchObserver] = Subscribers("launch")
#: Whether a collective observer listens.
collective_on = False
#: The collective observers (``cudalab._internal.collective_observers`` is this list).
collective_subscribers: Subscribers[CollectiveObserver] = Subscribers("collective")
#: Whether an out-of-memory observer listens.
out_of_memory_on = False
#: The out-of-memory observers (``cudalab.allocator.oom_observers.observers`` is this list).
out_of_memory_subscribers: Subscribers[OutOfMemoryObserver] = Subscribers("out_of_memory")
#: Whether an allocator-created observer listens.
allocator_created_on = False
#: The allocator-created observers (the registry's create hooks).
allocator_created_subscribers: Subscribers[AllocatorCreatedObserver] = Subscribers(
    "allocator_created")
#: Whether a synchronization observer listens (``set_sync_debug_mode`` other than default).
sync_on = False
#: The synchronization observers.
sync_subscribers: Subscribers[SyncObserver] = Subscribers("sync")


# ----------------------------------------------------------------------------- subscribe
def _unsubscribe(subscribers: Subscribers[Any], observer: object) -> bool:
    """Remove one subscription of ``observer`` (compared by ``==``, as ``list.remove``)."""
    with _lock:
        if observer not in subscribers:
            return False
        list.remove(subscribers, observer)
        subscribers._agree()
    return True


def subscribe_trace(observer: AllocationTraceObserver) -> None:
    """Add ``observer`` to the allocation-trace list. It attaches nothing: an allocator calls
    the trace ``allocator.hooks.attach_trace`` gave it, and that function sets this list
    from the traces attached."""
    trace_subscribers.append(observer)


def unsubscribe_trace(observer: AllocationTraceObserver) -> bool:
    """Undo one :func:`subscribe_trace`; returns whether ``observer`` was subscribed."""
    return _unsubscribe(trace_subscribers, observer)


def subscribe_access(observer: MemoryAccessObserver) -> None:
    """Tell ``observer`` of every memory access from now on (turns :data:`access_on` on)."""
    access_subscribers.append(observer)


def unsubscribe_access(observer: MemoryAccessObserver) -> bool:
    """Undo one :func:`subscribe_access`; returns whether ``observer`` was subscribed."""
    return _unsubscribe(access_subscribers, observer)


def subscribe_launch(observer: LaunchObserver) -> None:
    """Tell ``observer`` of every kernel launch from now on."""
    launch_subscribers.append(observer)


def unsubscribe_launch(observer: LaunchObserver) -> bool:
    """Undo one :func:`subscribe_launch`; returns whether ``observer`` was subscribed."""
    return _unsubscribe(launch_subscribers, observer)


def subscribe_collective(observer: CollectiveObserver) -> None:
    """Tell ``observer`` of every collective from now on."""
    collective_subscribers.append(observer)


def unsubscribe_collective(observer: CollectiveObserver) -> bool:
    """Undo one :func:`subscribe_collective`; returns whether ``observer`` was subscribed."""
    return _unsubscribe(collective_subscribers, observer)


def subscribe_out_of_memory(observer: OutOfMemoryObserver) -> None:
    """Call ``observer`` before every out-of-memory error of a native allocator."""
    out_of_memory_subscribers.append(observer)


def unsubscribe_out_of_memory(observer: OutOfMemoryObserver) -> bool:
    """Undo one :func:`subscribe_out_of_memory`; returns whether ``observer`` was
    subscribed."""
    return _unsubscribe(out_of_memory_subscribers, observer)


def subscribe_allocator_created(observer: AllocatorCreatedObserver) -> None:
    """Call ``observer`` with every allocator created from now on."""
    allocator_created_subscribers.append(observer)


def unsubscribe_allocator_created(observer: AllocatorCreatedObserver) -> bool:
    """Undo one :func:`subscribe_allocator_created`; returns whether ``observer`` was
    subscribed."""
    return _unsubscribe(allocator_created_subscribers, observer)


def subscribe_sync(observer: SyncObserver) -> None:
    """Call ``observer`` at every host-device synchronization cudalab makes."""
    sync_subscribers.append(observer)


def unsubscribe_sync(observer: SyncObserver) -> bool:
    """Undo one :func:`subscribe_sync`; returns whether ``observer`` was subscribed."""
    return _unsubscribe(sync_subscribers, observer)


def notify_sync(what: str) -> None:
    """Tell the synchronization observers that cudalab is about to block the host on the
    device (a site calls it only while :data:`sync_on`); their exceptions propagate.

    Parameters
    ----------
    what : str
        The operation, e.g. ``"Stream.synchronize()"``.
    """
    for observer in tuple(sync_subscribers):
        observer(what)


#: The code that changes a list with its flag: ``import cudalab`` defers Ctrl-C across it
#: (:func:`cudalab._interrupts.guard`), so no list is left changed with its flag not.
MUTATORS: tuple[Callable[..., Any], ...] = (
    Subscribers._agree, Subscribers.append, Subscribers.insert, Subscribers.extend,
    Subscribers.remove, Subscribers.pop, Subscribers.clear, Subscribers.__setitem__,
    Subscribers.__delitem__, Subscribers.__iadd__, Subscribers.__imul__, _unsubscribe,
)
