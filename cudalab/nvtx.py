"""NVTX ranges and marks with torch.cuda.nvtx's API, over the ``nvtx`` package.

Ranges go to NVTX's default domain, like torch's, so Nsight Systems shows them in the same row
as torch's and CuPy's. The ``nvtx`` package is imported on the first call; without it (or
with ``NVTX_DISABLE`` set, or when no profiler is attached) every function still works and
still tracks the per-thread range stack, but emits nothing.

Return values follow torch's documentation, computed from cudalab's own per-thread stack
(NVTX itself returns only -2, "no push/pop tracking", unless a tool is attached):
:func:`range_push` returns the zero-based depth of the range it starts, :func:`range_pop`
the zero-based depth of the range it ends, or -1 (NVTX's error value) when no range is open.

:func:`current_ranges` exposes this thread's open push ranges (outermost first). The
allocator history (:mod:`cudalab.memory_tools.history`) tags each entry with the innermost
one on its hot path, so two module attributes are documented for it (not torch API, not
in ``__all__``): :data:`thread_ranges` and :data:`ranges_used`.
"""

from __future__ import annotations

import functools
import itertools
import sys
import threading
from typing import Any, Literal

from cudalab import _interrupts

__all__ = [
    "mark",
    "range_push",
    "range_pop",
    "range_start",
    "range_end",
    "range",
    "current_ranges",
    "current_range",
]

#: How many messages keep prebuilt NVTX event attributes (oldest dropped first).
ATTRIBUTE_CACHE_SIZE = 1024

_UNSET: Any = object()
_domain: Any = _UNSET  # nvtx Domain once resolved; None when nothing is emitted
_make_attributes: Any = None  # msg -> nvtx EventAttributes
_attributes: dict[str, Any] = {}
_resolve_lock = threading.Lock()

_range_ids = itertools.count(1)
_open_ranges: dict[int, Any] = {}  # range_start id -> nvtx range id

#: Per-thread state: ``thread_ranges.messages`` is this thread's list of open push ranges,
#: outermost first, created on the thread's first :func:`range_push` (absent before).
#: For the allocator history's hot path: read it as ``thread_ranges.__dict__.get("messages")``
#: (no exception when absent) and never write it; only this module pushes and pops.
#: Invariant: the object is never rebound, so a reader may bind it once at import.
thread_ranges = threading.local()


def _resolve() -> Any:
    """Import nvtx and pick the default domain (once); None when nothing should be emitted."""
    global _domain, _make_attributes
    with _resolve_lock:
        if _domain is _UNSET:
            domain = None
            try:
                import nvtx
            except ImportError:
                nvtx = None
            if nvtx is not None and nvtx.enabled():
                candidate = nvtx.get_domain(None)  # NVTX's default domain, torch's too
                # With no tool attached nvtx hands out a do-nothing DummyDomain: skip it.
                if isinstance(candidate, nvtx.Domain):
                    domain = candidate
                    _make_attributes = _attribute_factory(domain)
            _domain = domain
    return _domain


def _attribute_factory(domain: Any) -> Any:
    """msg -> EventAttributes, registering the string without nvtx's unbounded caches."""
    try:
        from nvtx._lib import EventAttributes, RegisteredString

        def make(msg: str) -> Any:
            return EventAttributes(domain, RegisteredString(domain.handle, msg))

        make("cudalab")  # check the private constructors still take these arguments
        return make
    except Exception:
        return domain.get_event_attributes


def _attrs(msg: str) -> Any:
    """Prebuilt event attributes for ``msg`` (a bounded cache, oldest entry dropped first)."""
    attrs = _attributes.get(msg)
    if attrs is None:
        _check(msg)
        attrs = _make_attributes(msg)
        if len(_attributes) >= ATTRIBUTE_CACHE_SIZE:
            try:
                del _attributes[next(iter(_attributes))]
            except (KeyError, RuntimeError, StopIteration):  # raced with another thread
                pass
        _attributes[msg] = attrs
    return attrs


def _check(msg: Any) -> None:
    if not isinstance(msg, str):
        raise TypeError(f"NVTX message must be a str, not {type(msg).__name__}")


# The hot paths below test `_domain is not None` first: with no profiler attached (the usual
# case) that single test is all the NVTX work they do.

#: False until the first :func:`range_push` of the process, then True for good: lets the
#: allocator history skip the per-thread range lookup entirely in processes that never use
#: NVTX. A module-level bool that is rebound (once), so readers test ``nvtx.ranges_used``
#: (one attribute load on the module) each time and never bind its value.
ranges_used = False


def range_push(msg: str) -> int:
    """Push a range onto this thread's stack of nested ranges.

    Returns the zero-based depth of the range that is started.
    """
    global ranges_used
    if not ranges_used:
        hist = sys.modules.get("cudalab.memory_tools.history")
        if hist is not None:
            hist.nvtx_first_push()  # before the flag: what was logged without a range
        ranges_used = True
    domain = _domain
    if domain is not None:
        if domain is _UNSET:
            domain = _resolve()
        if domain is not None:
            domain.push_range(_attrs(msg))
        else:
            _check(msg)
    elif msg.__class__ is not str:
        _check(msg)
    try:
        stack = thread_ranges.messages
    except AttributeError:
        stack = thread_ranges.messages = []
    stack.append(msg)
    return len(stack) - 1


def range_pop() -> int:
    """Pop the innermost range of this thread's stack.

    Returns the zero-based depth of the range that is ended, or -1 when no range is open
    (NVTX is then not called).
    """
    try:
        stack = thread_ranges.messages
    except AttributeError:
        return -1
    if not stack:
        return -1
    stack.pop()
    domain = _domain
    if domain is not None and domain is not _UNSET:
        domain.pop_range()
    return len(stack)


# A Ctrl-C inside either waits until it returns: this thread's stack and NVTX's stay paired
# (an interrupt between NVTX's push and the stack's append, or in the ``finally`` of a
# collective's range_pop, would leave a range open for ever).
_interrupts.guard(range_push, range_pop)


def range_start(msg: str) -> int:
    """Start a range that may end on another thread; returns the id to pass to :func:`range_end`."""
    domain = _domain if _domain is not _UNSET else _resolve()
    nvtx_id = None
    if domain is not None:
        nvtx_id = domain.start_range(_attrs(msg))
    else:
        _check(msg)
    range_id = next(_range_ids)
    _open_ranges[range_id] = nvtx_id
    return range_id


def range_end(range_id: int) -> None:
    """End a range started by :func:`range_start` (an unknown or ended id is ignored)."""
    nvtx_id = _open_ranges.pop(range_id, None)
    if nvtx_id is not None:  # only set when a domain emitted the start
        _domain.end_range(nvtx_id)


def mark(msg: str) -> None:
    """Mark an instantaneous event."""
    domain = _domain
    if domain is not None:
        if domain is _UNSET:
            domain = _resolve()
        if domain is not None:
            domain.mark(_attrs(msg))
        else:
            _check(msg)
    elif msg.__class__ is not str:
        _check(msg)


def current_ranges() -> tuple[str, ...]:
    """This thread's open :func:`range_push` ranges, outermost first."""
    return tuple(getattr(thread_ranges, "messages", ()))


def current_range() -> str | None:
    """This thread's innermost open :func:`range_push` range, or None."""
    stack = getattr(thread_ranges, "messages", None)
    return stack[-1] if stack else None


class range:  # noqa: A001 - torch.cuda.nvtx.range's name
    """Push ``msg.format(*args, **kwargs)`` on entry and pop it on exit, also on exceptions.

    Works as a context manager (``with nvtx.range("step {}", i):``) and as a decorator
    (each call of the function is one range). Like torch, the message always goes through
    ``str.format``, so literal braces must be doubled; it is formatted once, here.
    """

    __slots__ = ("msg",)

    def __init__(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.msg = msg.format(*args, **kwargs)

    def __enter__(self) -> None:
        range_push(self.msg)

    def __exit__(self, *exc_info: Any) -> Literal[False]:
        range_pop()
        return False

    def __call__(self, func: Any) -> Any:
        msg = self.msg

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            range_push(msg)
            try:
                return func(*args, **kwargs)
            finally:
                range_pop()

        return wrapper

    def __repr__(self) -> str:
        return f"cudalab.nvtx.range({self.msg!r})"
