"""The named internal API: what cudalab's upper layers may use beyond the public API.

The Jupyter layer (:mod:`cudalab.magics`, :mod:`cudalab.widgets`) uses cudalab's public
names and this module, never another module's ``_private`` names (an import-linter contract
and ``tests/test_layers.py`` check it). The tooling (:mod:`cudalab.memory_tools`) reads no
``_private`` name of a module outside its package either: it uses public names, this module
and the leaves' public functions (``_units``, ``_atomic_write``); its replays drive the
allocator through :class:`cudalab.allocator.replay_target.ReplayTarget` over
:func:`private_simulator` (``tests/allocator/test_allocator_friends.py`` checks the
allocator's side). Everything here is documented, kept stable across refactors and tested;
a name that an upper layer needs is added here, next to its owner's real name, rather than
reached for.

What it offers
--------------
* **The runtime's state**: :func:`backend` (the initialised driver seam, typed as its
  :class:`~cudalab._driver.base.Backend` protocol, named here as :class:`Backend`),
  :func:`is_initialized`, :func:`device_index` (normalise a device argument), :func:`ensure_context`,
  :func:`thread_state` (the thread's current device and streams) and :func:`fast_paths`
  (the seam's unchecked hot-path callables).
* **A private simulator**: :func:`private_simulator` (a simulator backend of the caller's
  own, never the process's: the what-if replays run a fresh allocator over one).
* **Raw handles**: :func:`stream_handle` and :func:`event_handle`, the opaque seam handles
  owned by a :class:`cudalab.Stream` / :class:`cudalab.Event`.
* **Launch observers**: :data:`launch_observers`, called by every runtime kernel launch.
* **Collective observers**: :data:`collective_observers`, told of every collective as a
  :class:`CollectiveRecord` (:func:`notify_collective` tells them; :func:`collective_muted`
  silences the inner collectives of one built on others). Both lists are views of the
  observer bus (:mod:`cudalab._observe`): its kernel-launch and collective families.
* **Files**: :func:`atomic_write`, :func:`write_bytes_atomic` and
  :func:`create_bytes_atomic` (exclusive creation; see
  :mod:`cudalab._atomic_write`): every file cudalab writes replaces its target atomically, so
  a failed export leaves the previous file intact.
* **Units**: :func:`parse_size`, :func:`format_bytes`, :func:`format_time` (one parser, one
  formatter for the whole package; see :mod:`cudalab._units`), and :data:`SIZE_UNITS`, the
  parser's unit table (``%cuda_memory --threshold 64 KiB`` takes a separate unit word), and
  :func:`echo`, the one way an error message repeats a person's input (cut to a prefix).
* **Seam constants** the upper layers compare statuses against (``STATUS_NOT_READY``).
* **Events**: :func:`create_event` (make a :class:`cudalab.Event`'s driver event now, not
  at its first record).
* **Owned raw device memory**: :class:`ScratchBuffer` (a driver allocation outside the
  caching allocator, e.g. ``%%cuda_timed --cold``'s L2 flush buffer).
* **CUPTI**: :func:`cupti_kernel_activity` (kernel, memcpy and memset activity records,
  through the seam's :mod:`cudalab._driver.cupti`).
* **NVML**: :func:`clock_event_reasons` (what limits a device's clocks now).
* **Ctrl-C** (:mod:`cudalab._interrupts`): :func:`defer_interrupts_in` (files whose code
  runs with Ctrl-C deferred: bookkeeping an interrupt must not cut in half) and
  :func:`deliver_interrupts_in` / :func:`stop_delivering_interrupts_in` (the user's code
  that such code runs, where Ctrl-C is delivered at once), :func:`deliver_owed_interrupt`
  (a safe point: raise a deferred Ctrl-C now), :func:`install_interrupts` and
  :func:`unhook_interrupts_from` (the IPython extension's load and unload).

Nothing here creates a CUDA context on import, and importing it is cheap.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from cudalab import _interrupts, _observe
from cudalab import devices as _devices
from cudalab._atomic_write import atomic_write, create_bytes_atomic, write_bytes_atomic
from cudalab._driver import private_simulator
from cudalab._driver.base import (
    STATUS_NOT_READY,
    STATUS_SUCCESS,
    Backend,
    EventHandle,
    FastCalls,
    StreamHandle,
)
from cudalab._units import SIZE_UNITS, echo, format_bytes, format_time, parse_size

if TYPE_CHECKING:
    from cudalab._driver.cupti import KernelActivity

__all__ = [
    "Backend",
    "STATUS_NOT_READY",
    "SIZE_UNITS",
    "STATUS_SUCCESS",
    "ScratchBuffer",
    "atomic_write",
    "backend",
    "clock_event_reasons",
    "create_event",
    "cupti_kernel_activity",
    "defer_interrupts_in",
    "deliver_interrupts_in",
    "deliver_owed_interrupt",
    "device_index",
    "echo",
    "ensure_context",
    "enable_peer_access",
    "event_handle",
    "fast_paths",
    "format_bytes",
    "format_time",
    "is_initialized",
    "launch_observers",
    "collective_observers",
    "CollectiveRecord",
    "notify_collective",
    "collective_muted",
    "parse_size",
    "private_simulator",
    "stop_delivering_interrupts_in",
    "install_interrupts",
    "unhook_interrupts_from",
    "stream_handle",
    "thread_state",
    "write_bytes_atomic",
    "create_bytes_atomic",
]


def backend() -> Backend:
    """The process's initialised driver backend (initialising CUDA on the first call).

    Raises
    ------
    cudalab.CudaUnavailableError
        When no driver or no device can be used.
    """
    return _devices.backend()


def is_initialized() -> bool:
    """Whether CUDA is initialised in this process (the flag itself: no driver call)."""
    return _devices.initialized


def device_index(device: Any = None, optional: bool = True) -> int:
    """A valid device index from a device argument (None, int, ``"cuda:N"``, Device, ...).

    ``None`` is the current device unless ``optional`` is False (then ValueError).
    Raises ValueError for an index out of range and TypeError for anything else.
    """
    return _devices.device_index(device, optional)


def ensure_context(device: int) -> None:
    """Make ``device``'s primary context current on this thread (one thread-local check
    when it already is)."""
    _devices.ensure_context(device)


def enable_peer_access(device: int, peer: int) -> bool:
    """Let ``device`` access ``peer``'s memory directly, once per pair, where the hardware
    can (torch's lazy ``get_p2p_access``); returns whether it can. Cross-device copies and
    collectives ask before they choose how to move bytes."""
    return _devices.enable_peer_access(device, peer)


def thread_state() -> Any:
    """This process's thread-local runtime state: ``.device`` (the current device index)
    and ``.streams`` (the per-device current streams, owned by :mod:`cudalab.streams`).

    The object itself is returned once and may be kept: it is the same object for the life
    of the process, and its attributes are per thread.
    """
    return _devices.per_thread


def fast_paths() -> FastCalls | None:
    """The backend's fast-call registry (:class:`cudalab._driver.fast_calls.FastCalls`), whose
    status calls the hot paths bind (None before CUDA is initialised)."""
    return _devices.seam_fast_calls


#: The opaque seam handle of a :class:`cudalab.Stream` (read without a method call); a closed
#: stream's is a :class:`~cudalab._driver.handles.ClosedHandle`, which every seam call refuses.
stream_handle: Callable[[Any], StreamHandle] = attrgetter("handle")

#: The opaque seam handle of a recorded :class:`cudalab.Event` (None before its first record).
event_handle: Callable[[Any], EventHandle | None] = attrgetter("handle")

#: Callables told about every kernel launch the runtime makes, as
#: ``observer(name, device, stream, grid, block)`` right after the launch is queued. ``%%cuda_timed`` appends
#: one while it times a cell. It is the observer bus's kernel-launch list
#: (:data:`cudalab._observe.launch_subscribers`): appending turns the bus's flag on, removing
#: the last turns it off. Launchers test the list's truth first, so an empty list costs
#: one check per launch. The kernel facility and the RNG bind this list object at import,
#: so it is mutated in place, never rebound.
launch_observers: _observe.Subscribers[_observe.LaunchObserver] = _observe.launch_subscribers


#: One collective call, as :data:`collective_observers` are told of it (defined with the
#: observer bus, :class:`cudalab._observe.CollectiveRecord`).
CollectiveRecord = _observe.CollectiveRecord


#: Callables told about every collective the runtime issues (cudalab.nccl, cudalab.comm,
#: Communicator), as ``observer(record)`` with a :class:`CollectiveRecord` after the
#: collective is queued. ``%%cuda_timed`` appends one while it times a cell. It is the
#: observer bus's collective list (:data:`cudalab._observe.collective_subscribers`). Mutated
#: in place, never rebound; issuers test its truth first, so an empty list costs one check.
collective_observers: _observe.Subscribers[_observe.CollectiveObserver] = (
    _observe.collective_subscribers)


_muted = threading.local()  # .on: this thread is inside a collective that speaks for itself


def notify_collective(name: str, algorithm_bytes: int, nranks: int, bus_factor: float,
                      devices: tuple[int, ...]) -> None:
    """Tell :data:`collective_observers` about one collective (a no-op when none listens, and
    inside :func:`collective_muted`)."""
    if collective_observers and not getattr(_muted, "on", False):
        record = CollectiveRecord(name, algorithm_bytes, nranks, bus_factor, devices)
        for observer in tuple(collective_observers):
            observer(record)


class _Muted:
    """:func:`collective_muted`'s context manager: a class, not a generator (a third of the
    cost, for the 1 KiB reduce_add and broadcast rows of benchmarks/comm.py). Ctrl-C is
    deferred in ``__enter__`` and ``__exit__`` (guarded below), so a mute is never left on."""

    __slots__ = ("previous",)

    def __enter__(self) -> None:
        self.previous = getattr(_muted, "on", False)
        _muted.on = True

    def __exit__(self, *exc_info: Any) -> None:
        _muted.on = self.previous


_interrupts.guard(_Muted.__enter__, _Muted.__exit__)


def collective_muted() -> _Muted:
    """Within the block, this thread's :func:`notify_collective` calls are silent: a
    collective built on another one (``cudalab.comm.broadcast`` over
    ``cudalab.nccl.broadcast``) reports itself once, under its own name."""
    return _Muted()


# ----------------------------------------------------------------------------- events
def create_event(event: Any, device: int) -> Any:
    """Create ``event``'s driver event on ``device`` now and return its handle.

    A :class:`cudalab.Event` creates its driver event at its first record; a caller that
    records by handle on a hot path (``%%cuda_timed``'s event pool) creates them up front.

    Parameters
    ----------
    event : cudalab.Event
        An event whose driver event does not exist yet.
    device : int
        The device index it belongs to.

    Returns
    -------
    object
        The opaque seam handle (the same as :func:`event_handle` returns afterwards).

    Raises
    ------
    cudalab.CudaError
        When the driver refuses to create it.
    """
    return event.create_handle(device)


# ----------------------------------------------------------------------------- raw memory
class ScratchBuffer:
    """A raw driver allocation on one device, owned by its creator.

    It bypasses the caching allocator (its bytes appear in no allocator statistic), which
    is what a measuring tool needs for its own buffers: ``%%cuda_timed --cold`` writes one
    over the L2 cache before every repeat. The creator frees it with :meth:`free`.
    """

    __slots__ = ("device", "nbytes", "ptr")

    def __init__(self, device: int, nbytes: int):
        """Allocate ``nbytes`` on ``device`` (making its context current).

        Raises
        ------
        cudalab.CudaError
            When the driver cannot allocate it (out of memory included).
        """
        b = _devices.backend()
        _devices.ensure_context(device)
        #: The device index the bytes live on.
        self.device = device
        #: The allocation's size in bytes.
        self.nbytes = int(nbytes)
        #: The device pointer; 0 once freed (invariant: ``ptr == 0`` iff freed).
        self.ptr: int = b.mem_alloc(device, self.nbytes)

    def fill_async(self, value: int, stream: Any, nbytes: int | None = None) -> None:
        """Queue a write of the byte ``value & 0xFF`` over the first ``nbytes`` bytes
        (default: all) on ``stream`` (a :class:`cudalab.Stream` of the same device)."""
        n = self.nbytes if nbytes is None else min(int(nbytes), self.nbytes)
        _devices.ensure_context(self.device)
        _devices.backend().memset_d8_async(self.device, self.ptr, value & 0xFF, n,
                                            stream.handle)

    def free(self) -> None:
        """Give the bytes back to the driver (no-op when already freed, or when CUDA was
        never initialised in this process); errors at teardown are ignored."""
        ptr, self.ptr = self.ptr, 0
        if not ptr or not _devices.initialized:
            return
        try:
            _devices.backend().mem_free(self.device, ptr)
        except Exception:
            pass


# ----------------------------------------------------------------------------- CUPTI
def cupti_kernel_activity() -> KernelActivity:
    """A new CUPTI activity tracer of kernels, memcpys and memsets
    (:class:`cudalab._driver.cupti.KernelActivity`; its ``demangle`` gives a kernel symbol's
    C++ name).

    Nothing is imported from ``cupti`` until its ``start()``; when CUPTI cannot be used,
    ``start()`` returns False and its ``note`` says why.
    """
    from cudalab._driver.cupti import KernelActivity

    return KernelActivity()


# ----------------------------------------------------------------------------- NVML
def clock_event_reasons(device: int) -> int | None:
    """NVML's clocks-event-reasons bit mask of ``device`` (what limits its clocks now), or
    None where it cannot be read (the simulator, an NVML without the call, any error).

    Parameters
    ----------
    device : int
        A CUDA device index.

    Returns
    -------
    int or None
        The mask from the seam's :meth:`cudalab._driver.base.Nvml.clock_event_reasons`.
    """
    from cudalab import _driver

    try:
        n = _driver.get_backend().nvml()
        return n.clock_event_reasons(_devices.get_device_properties(device).nvml_uuid)
    except Exception:
        return None


# ------------------------------------------------------------------------------- Ctrl-C
def defer_interrupts_in(paths: list[str]) -> None:
    """Run the code of these source files with Ctrl-C deferred (see :mod:`cudalab._interrupts`):
    a KeyboardInterrupt that comes while it runs is raised once the main thread is out of it
    (or in code given to :func:`deliver_interrupts_in`).

    Parameters
    ----------
    paths : list of str
        Source file paths (a module's ``__file__``).
    """
    _interrupts.guard_files(paths)


def deliver_interrupts_in(code: Any) -> None:
    """Deliver Ctrl-C at once in frames of ``code`` (the user's code run by deferring code,
    e.g. a ``%%cuda_timed`` cell); undo with :func:`stop_delivering_interrupts_in`.

    Parameters
    ----------
    code : code object
        The compiled user code.
    """
    _interrupts.open_code(code)


def stop_delivering_interrupts_in(code: Any) -> None:
    """Undo :func:`deliver_interrupts_in` (no error if it was not done).

    Parameters
    ----------
    code : code object
        The compiled user code.
    """
    _interrupts.close_code(code)


def install_interrupts() -> bool:
    """Make cudalab's Ctrl-C wrapper the SIGINT handler (main thread; in IPython it also puts
    itself back before every cell); see :func:`cudalab._interrupts.install`."""
    return _interrupts.install()


def unhook_interrupts_from(shell: Any) -> None:
    """Take the Ctrl-C wrapper's ``pre_run_cell`` callback off ``shell`` when loading the
    extension registered it; see :func:`cudalab._interrupts.unhook_ipython`."""
    _interrupts.unhook_ipython(shell)


def deliver_owed_interrupt() -> None:
    """A safe point: raise the Ctrl-C that came during deferring code, if one is owed.

    Raises
    ------
    KeyboardInterrupt
        When one is owed.
    """
    _interrupts.deliver_owed()
