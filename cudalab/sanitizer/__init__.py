"""The stream sanitizer: finds unsynchronized use of device memory across streams.

A host-side analysis in the manner of torch's CUDA Sanitizer (CSAN): every device access
that cudalab performs (kernel launches, copies, fills, RNG draws, ``numpy()`` reads, frees)
is recorded with its stream, and happens-before comes from stream order, events,
``wait_stream``, the synchronize calls and ``record_stream``, as vector clocks. It reports

* two streams accessing the same bytes, at least one writing, with nothing ordering them;
* a host read (``numpy()``) of memory whose writer the host has not waited for;
* memory freed while another stream may still use it, without ``record_stream``.

::

    import cudalab.sanitizer
    with cudalab.sanitizer.sanitize() as session:   # or enable() / disable()
        ...
    session.reports

``CUDALAB_SANITIZER=1`` (or ``warn``) enables it when cudalab is imported; ``%%cuda_sanitize``
runs one notebook cell under it. Off, it costs each access site one flag read: the
sanitizer's tracker is a memory-access observer of the observer bus (:mod:`cudalab._observe`,
its flag :data:`~cudalab._observe.access_on`). See docs/sanitizer.md.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Sequence
from typing import Any

from cudalab import _interrupts, _observe
from cudalab.sanitizer.report import (
    HOST_READ,
    KINDS,
    NOT_SEEN,
    RACE,
    UNSAFE_REUSE,
    Access,
    Report,
    StreamRaceError,
    StreamRaceWarning,
    html_table,
)
from cudalab.sanitizer.tracking import ON_RACE_MODES, Tracker

__all__ = [
    "HOST_READ",
    "KINDS",
    "NOT_SEEN",
    "ON_RACE_MODES",
    "RACE",
    "UNSAFE_REUSE",
    "Access",
    "Report",
    "Session",
    "StreamRaceError",
    "StreamRaceWarning",
    "disable",
    "enable",
    "enable_from_env",
    "html_table",
    "is_enabled",
    "record_launch",
    "reports",
    "sanitize",
]

#: The environment variable read by ``import cudalab``: unset, empty or "0" leaves the
#: sanitizer off; "warn" or "collect" enables it in that mode; any other value in "raise".
ENV_VAR = "CUDALAB_SANITIZER"


class Session:
    """The findings of one run under the sanitizer (what :func:`sanitize` yields).

    Attributes
    ----------
    reports : list of Report
        Every finding, in order (live while the session runs).
    accesses : int
        How many accesses were checked (one per memory range per operation).
    """

    def __init__(self, tracker: Tracker):
        self._tracker = tracker

    @property
    def reports(self) -> list[Report]:
        return self._tracker.reports

    @property
    def accesses(self) -> int:
        return self._tracker.accesses

    def _repr_html_(self) -> str:
        return html_table(self.reports, self.accesses)

    def __repr__(self) -> str:
        return f"<cudalab.sanitizer.Session {len(self.reports)} findings, {self.accesses} accesses>"


#: The sanitizer's tracker while it is enabled, else None. Invariant: subscribed to the bus's
#: memory-access family exactly while it is set (only _install writes both).
_installed: Tracker | None = None


def _install(tracker: Tracker | None) -> None:
    """Make ``tracker`` the sanitizer's (None: off): the previous one leaves the bus, the
    new one joins it (Ctrl-C deferred across the three steps)."""
    global _installed
    previous, _installed = _installed, tracker
    if previous is not None:
        _observe.unsubscribe_access(previous)
    if tracker is not None:
        _observe.subscribe_access(tracker)


_interrupts.guard(_install)


def enable(on_race: str = "raise") -> Session:
    """Turn the sanitizer on for the whole process (torch's ``enable_cuda_sanitizer``).

    Parameters
    ----------
    on_race : {"raise", "warn", "collect"}, optional
        What a finding does: raise :class:`StreamRaceError` from the operation that found it
        (default), warn a :class:`StreamRaceWarning`, or only collect it. Findings at a free
        (a finalizer cannot raise) are raised at the next access or by :func:`disable`.

    Returns
    -------
    Session
        The findings from now on. Enabling again starts a new analysis.

    Raises
    ------
    ValueError
        For an unknown ``on_race``.
    """
    tracker = Tracker(on_race)
    _install(tracker)
    return Session(tracker)


def enable_from_env() -> Session | None:
    """Enable as :data:`ENV_VAR` asks (``import cudalab`` calls this when it is set).

    Returns
    -------
    Session or None
        The session, or None when the variable leaves the sanitizer off.
    """
    import os

    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "0"):
        return None
    import atexit

    atexit.register(_print_pending)
    return enable(value if value in ("warn", "collect") else "raise")


def _print_pending() -> None:
    """At exit: print the findings of frees that no later access raised (raise mode)."""
    tracker = _installed
    if tracker is None or not tracker.pending:
        return
    import sys

    pending, tracker.pending = tracker.pending, []
    print(f"cudalab sanitizer: {len(pending)} finding(s) at frees after the last access:\n"
          + "\n".join(str(r) for r in pending), file=sys.stderr)


def disable() -> None:
    """Turn the sanitizer off (a no-op when it is off).

    Raises
    ------
    StreamRaceError
        In raise mode, for findings of frees not raised yet.
    """
    tracker = _installed
    _install(None)
    if tracker is not None:
        tracker.flush()


def is_enabled() -> bool:
    """Whether the sanitizer is on."""
    return _installed is not None


def reports() -> list[Report]:
    """The findings of the running analysis ([] when the sanitizer is off)."""
    tracker = _installed
    return [] if tracker is None else list(tracker.reports)


@contextlib.contextmanager
def sanitize(on_race: str = "raise") -> Iterator[Session]:
    """Run a block under a fresh analysis; the previous state comes back at its end.

    Parameters
    ----------
    on_race : {"raise", "warn", "collect"}, optional
        As for :func:`enable`.

    Returns
    -------
    contextlib.AbstractContextManager[Session]
        Yields the block's :class:`Session`.

    Raises
    ------
    StreamRaceError
        In raise mode, from the racing operation, or at the end of the block for findings of
        frees not raised yet.
    """
    previous = _installed
    tracker = Tracker(on_race)
    _install(tracker)
    try:
        yield Session(tracker)
    finally:
        _install(previous)
    tracker.flush()


def _ranges(items: Any, what: str) -> list[tuple[int, int]]:
    if items is None:
        return []
    if not isinstance(items, (list, tuple)):
        items = [items]
    out = []
    for item in items:
        if isinstance(item, tuple):
            if len(item) != 2:
                raise ValueError(f"record_launch: {what} entries that are tuples must be "
                                 f"(ptr, nbytes), got {item!r}")
            out.append((operator.index(item[0]), operator.index(item[1])))
            continue
        cai = getattr(item, "__cuda_array_interface__", None)
        if cai is not None:
            ptr = cai["data"][0] or 0
            nbytes = getattr(item, "nbytes", 0)
            out.append((ptr, int(nbytes)))
            continue
        if isinstance(item, bool) or not hasattr(item, "__index__"):
            raise TypeError(f"record_launch: {what} must hold arrays, (ptr, nbytes) tuples or "
                            f"int pointers, got {type(item).__name__}")
        out.append((operator.index(item), 0))
    return out


def record_launch(reads: Sequence[Any] | Any = (), writes: Sequence[Any] | Any = (), *,
                  stream: Any = None, name: str = "launch") -> None:
    """Tell the sanitizer about device work it cannot see (a foreign or raw launch).

    cudalab's own work reports itself; call this for work queued another way on memory
    cudalab tracks, so that its accesses are checked too. A no-op while the sanitizer is off.

    Parameters
    ----------
    reads, writes : sequence
        The memory the work reads and writes: arrays (anything with
        ``__cuda_array_interface__``; its ``nbytes`` when it has one), ``(ptr, nbytes)``
        tuples, or int pointers (to the end of their allocation). A single item may be
        given without a sequence.
    stream : cudalab.Stream, optional
        The stream the work was queued on (default: the current stream).
    name : str, optional
        How reports name the work.

    Raises
    ------
    TypeError
        For an entry that is not one of those, or a ``stream`` that is not a cudalab.Stream.
    ValueError
        For a tuple that is not ``(ptr, nbytes)``.
    """
    from cudalab import streams

    read_ranges = _ranges(reads, "reads")
    write_ranges = _ranges(writes, "writes")
    if stream is None:
        stream = streams.current_stream()
    elif not isinstance(stream, streams.Stream):
        raise TypeError(f"record_launch: stream must be a cudalab.Stream, got {stream!r}")
    if not isinstance(name, str):
        raise TypeError(f"record_launch: name must be a str, got {type(name).__name__}")
    tracker = _observe.access_tracker
    if _observe.access_on and tracker is not None:
        tracker.access(stream, read_ranges, write_ranges, name)
