"""Count the driver calls a piece of code makes (tests and benchmarks pin designs with it).

``with count_calls() as counts: ...`` wraps the listed methods of the active backend and the
event/stream fast paths (``Event.record``/``query`` and ``Stream.query`` go through those)
with counters, and restores them on exit. Objects that bound a fast path before the block
(events made earlier, for instance) keep the uncounted one.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

__all__ = ["COUNTED", "count_calls"]

#: The backend methods counted by default: events, stream and device syncs, memset.
COUNTED = ("event_create", "event_record", "event_query", "event_synchronize",
           "event_elapsed_time", "stream_synchronize", "memset_d8_async", "synchronize")


@contextlib.contextmanager
def count_calls(names: tuple[str, ...] = COUNTED) -> Iterator[collections.Counter]:
    """A Counter of calls by backend method name, live for the ``with`` block."""
    from cudalab import devices
    from cudalab._driver.base import FastPaths

    devices._lazy_init()
    backend = devices._backend()
    counts: collections.Counter = collections.Counter()

    def wrap(name, fn):
        def counted(*a, **k):
            counts[name] += 1
            return fn(*a, **k)
        return counted

    own = {n: vars(backend)[n] for n in names if n in vars(backend)}  # already shadowed
    fast = devices._fast
    for name in names:
        setattr(backend, name, wrap(name, getattr(backend, name)))
    devices._fast = FastPaths(*(wrap(n, getattr(fast, n)) for n in FastPaths._fields))
    try:
        yield counts
    finally:
        devices._fast = fast
        for name in names:
            if name in own:
                setattr(backend, name, own[name])
            else:
                delattr(backend, name)
