"""The named internal API: what cudalab's upper layers may use beyond the public API.

The Jupyter layer (:mod:`cudalab.magics`, :mod:`cudalab.widgets`) and the tooling
(:mod:`cudalab.memory_tools`) use cudalab's public names and this module, never another
module's ``_private`` names (an import-linter contract and ``tests/test_layers.py`` check
it). Everything here is documented, kept stable across refactors and tested; a name that an
upper layer needs is added here, next to its owner's real name, rather than reached for.

What it offers
--------------
* **The runtime's state**: :func:`backend` (the initialised driver seam, typed as its
  :class:`~cudalab._driver.base.Backend` protocol), :func:`is_initialized`,
  :func:`device_index` (normalise a device argument), :func:`ensure_context`,
  :func:`thread_state` (the thread's current device and streams) and :func:`fast_paths`
  (the seam's unchecked hot-path callables).
* **Raw handles**: :func:`stream_handle` and :func:`event_handle`, the opaque seam handles
  owned by a :class:`cudalab.Stream` / :class:`cudalab.Event`.
* **Launch observers**: :data:`launch_observers`, called by every runtime kernel launch.
* **Units**: :func:`parse_size`, :func:`format_bytes`, :func:`format_time` (one parser, one
  formatter for the whole package; see :mod:`cudalab._units`).
* **Seam constants** the upper layers compare statuses against (``STATUS_NOT_READY``).

Nothing here creates a CUDA context on import, and importing it is cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from cudalab import devices as _devices
from cudalab._driver.base import STATUS_NOT_READY, STATUS_SUCCESS, FastPaths
from cudalab._units import format_bytes, format_time, parse_size

if TYPE_CHECKING:
    from cudalab._driver.base import Backend

__all__ = [
    "STATUS_NOT_READY",
    "STATUS_SUCCESS",
    "backend",
    "device_index",
    "ensure_context",
    "event_handle",
    "fast_paths",
    "format_bytes",
    "format_time",
    "is_initialized",
    "launch_observers",
    "parse_size",
    "stream_handle",
    "thread_state",
]


def backend() -> Backend:
    """The process's initialised driver backend (initialising CUDA on the first call).

    Raises
    ------
    cudalab.CudaUnavailableError
        When no driver or no device can be used.
    """
    return _devices._backend()


def is_initialized() -> bool:
    """Whether CUDA is initialised in this process (the flag itself: no driver call)."""
    return _devices._initialized


def device_index(device: Any = None, optional: bool = True) -> int:
    """A valid device index from a device argument (None, int, ``"cuda:N"``, Device, ...).

    ``None`` is the current device unless ``optional`` is False (then ValueError).
    Raises ValueError for an index out of range and TypeError for anything else.
    """
    return _devices._device_index(device, optional)


def ensure_context(device: int) -> None:
    """Make ``device``'s primary context current on this thread (one thread-local check
    when it already is)."""
    _devices._ensure_context(device)


def thread_state() -> Any:
    """This process's thread-local runtime state: ``.device`` (the current device index)
    and ``.streams`` (the per-device current streams, owned by :mod:`cudalab.streams`).

    The object itself is returned once and may be kept: it is the same object for the life
    of the process, and its attributes are per thread.
    """
    return _devices._tls


def fast_paths() -> FastPaths | None:
    """The seam's unchecked hot-path callables (None before CUDA is initialised)."""
    return _devices._fast


#: The opaque seam handle of a :class:`cudalab.Stream` (read without a method call).
stream_handle: Callable[[Any], Any] = attrgetter("_handle")

#: The opaque seam handle of a recorded :class:`cudalab.Event` (None before its first record).
event_handle: Callable[[Any], Any] = attrgetter("_handle")

#: Callables told about every kernel launch the runtime makes, as
#: ``observer(name, device, stream, grid, block)`` right after the launch is queued. ``%%cuda_timed`` appends
#: one while it times a cell. Launchers test the list's truth first, so an empty list costs
#: one check per launch. The kernel facility and the RNG bind this list object at import,
#: so it is mutated in place, never rebound.
launch_observers: list[Callable[..., Any]] = []
