"""Helpers for tests and benchmarks that pin designs: :func:`count_calls`.

``with count_calls() as counts: ...`` wraps the listed methods of the active driver backend
and the event/stream fast paths (``Event.record``/``query`` and ``Stream.query`` go through
those) with counters, and restores them on exit. Objects that bound a fast path before the
block (events made earlier, for instance) keep the uncounted one. Tests use it to pin
designs such as "a cache hit makes no driver call"; ``benchmarks/timing.py`` uses it to
check what a timed repeat costs.

It lives above the driver seam (it reads the runtime's backend through
:mod:`cudalab.devices`), so the seam itself never imports the layers above it.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["COUNTED", "count_calls"]

#: The backend methods counted by default: events, stream and device syncs, memset.
COUNTED = ("event_create", "event_record", "event_query", "event_synchronize",
           "event_elapsed_time", "stream_synchronize", "memset_d8_async", "synchronize")


@contextlib.contextmanager
def count_calls(names: tuple[str, ...] = COUNTED) -> Iterator[collections.Counter[str]]:
    """Count calls to backend methods, by name, for the ``with`` block.

    Parameters
    ----------
    names : tuple of str, optional
        Backend method names to count (default :data:`COUNTED`). Counted names that are
        also status calls of the fast-call registry (:class:`cudalab._driver.base.FastCalls`)
        are counted there too.

    Returns
    -------
    contextlib.AbstractContextManager[collections.Counter]
        Yields a Counter of calls by method name, live during the block. Initialises CUDA.
    """
    from cudalab import devices
    from cudalab._driver.fast_calls import STATUS_CALLS

    devices.lazy_init()
    backend = devices.backend()
    counts: collections.Counter[str] = collections.Counter()

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*a: Any, **k: Any) -> Any:
            counts[name] += 1
            return fn(*a, **k)
        return counted

    own = {n: vars(backend)[n] for n in names if n in vars(backend)}  # already shadowed
    fast = devices.seam_fast_calls
    for name in names:
        setattr(backend, name, wrap(name, getattr(backend, name)))
    if fast is not None:
        calls = {n: wrap(n, getattr(fast, n)) for n in STATUS_CALLS}
        batch = fast.event_elapsed_times
        if batch is not None:  # many cuEventElapsedTime calls in one: counted one by one

            def elapsed_times(starts: Any, ends: Any) -> Any:
                counts["event_elapsed_time"] += len(starts)
                return batch(starts, ends)

            calls["event_elapsed_times"] = elapsed_times
        devices.seam_fast_calls = fast.replaced(**calls)
    try:
        yield counts
    finally:
        devices.seam_fast_calls = fast
        for name in names:
            if name in own:
                setattr(backend, name, own[name])
            else:
                delattr(backend, name)
