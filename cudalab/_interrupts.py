"""Ctrl-C is delivered where it cannot break cudalab's state: deferred across critical code.

Why: CPython calls the Python-level SIGINT handler (by default: raise KeyboardInterrupt) at
the next check of the main thread's "eval breaker" (a call returning, a backward jump, a
function starting): almost anywhere. In the allocator that is between its lock's acquire and
the ``try`` that releases it (the next allocation then waits for ever), or between the two
halves of a paired update (the free list and the live map, a counter and its peak); in a
finalizer (``DeviceArray.__del__``) the exception is printed as "Exception ignored" and lost;
in the bookkeeping of ``%%cuda_timed`` it leaves half-updated state for the next cell. No
ordering of Python statements closes every such window, and a ``try`` around each one would
cost the hot paths.

How: :func:`install` wraps the main thread's SIGINT handler. When the signal comes, the
wrapper looks at the interrupted frame and its callers, innermost first; the first frame
whose code is *guarded* (registered with :func:`guard_files` / :func:`guard`) defers the
interrupt, the first whose code is *open* (:func:`open_code`: the user's code that a guarded
function runs, e.g. the body of a ``%%cuda_timed`` cell) or no such frame delivers it (the
wrapped handler is called). Other frames (a user's free-memory callback, a history hook) do
not decide. A deferred interrupt is owed: a helper thread watches the main thread and, once
its innermost deciding frame is no longer guarded, trips SIGINT again
(``_thread.interrupt_main``), so the wrapped handler raises KeyboardInterrupt in the user's
code, right after the allocator call, the finalizer or the bookkeeping ends. Nothing runs in
the guarded code itself: the hot paths cost what they cost before, and the price (a walk
over the main thread's frames) is paid only when Ctrl-C is pressed.

Invariants: at most one interrupt is owed (``_owed``), and while it is, at most one helper
thread runs (``_poller``); the helper trips the signal at most once, then ends. So each
KeyboardInterrupt raised answers one press of Ctrl-C (presses that come while one is owed
are merged into it, as a busy signal handler merges them).

Where the wrapper is installed: by :func:`install`, called when an allocator is created (in
the main thread) and, in IPython, before every cell (``ipykernel`` puts its own handler back
around every request). Code that sets its own SIGINT handler later replaces the wrapper;
then interrupts are delivered as Python delivers them.
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from types import CodeType, FrameType
from typing import Any

__all__ = ["install", "installed", "guard", "guard_files", "open_code", "close_code",
           "deferring", "POLL_SECONDS"]

#: How often the helper thread looks at the main thread while an interrupt is owed.
POLL_SECONDS = 0.0002

# What decides, by code object (functions) and by file-name prefix (whole packages).
_guarded_codes: set[CodeType] = set()
_guarded_prefixes: tuple[str, ...] = ()
_open_codes: set[CodeType] = set()  # user code run by guarded functions (delivers at once)

_lock = threading.Lock()  # guards _owed and _poller (taken by the handler and the helper)
_owed = False  # an interrupt came in guarded code and was not delivered yet
_poller: threading.Thread | None = None  # the helper thread while one runs


def guard(*functions: Any) -> None:
    """Defer Ctrl-C while any of ``functions`` runs (functions or code objects).

    Parameters
    ----------
    *functions
        Functions (their ``__code__``) or code objects; nested functions are not included.

    Raises
    ------
    TypeError
        For an argument that is neither a function nor a code object.
    """
    for f in functions:
        code = f if isinstance(f, CodeType) else getattr(f, "__code__", None)
        if not isinstance(code, CodeType):
            raise TypeError(f"guard() takes functions or code objects, not {type(f).__name__}")
        _guarded_codes.add(code)


def guard_files(prefixes: Iterable[str]) -> None:
    """Defer Ctrl-C while any code from a file whose path starts with a prefix runs.

    Parameters
    ----------
    prefixes
        Path prefixes (e.g. a package's directory with a trailing separator).
    """
    global _guarded_prefixes
    _guarded_prefixes = tuple(dict.fromkeys((*_guarded_prefixes, *prefixes)))


def open_code(code: CodeType) -> None:
    """Deliver Ctrl-C at once in frames of ``code`` (user code run by guarded code); undo
    with :func:`close_code`."""
    _open_codes.add(code)


def close_code(code: CodeType) -> None:
    """Forget a code registered with :func:`open_code` (no error if it was not)."""
    _open_codes.discard(code)


def deferring(frame: FrameType | None) -> bool:
    """Whether an interrupt arriving in ``frame`` is deferred (see the module doc).

    Parameters
    ----------
    frame
        The innermost frame (the walk goes to its callers).

    Returns
    -------
    bool
        True when the first deciding frame is guarded.
    """
    guarded = _guarded_codes
    opened = _open_codes
    prefixes = _guarded_prefixes
    while frame is not None:
        code = frame.f_code
        if code in opened:
            return False
        if code in guarded or code.co_filename.startswith(prefixes):
            return True
        frame = frame.f_back
    return False


class _DeferringHandler:
    """The SIGINT handler that wraps the one it found (see the module doc)."""

    __slots__ = ("wrapped",)

    def __init__(self, wrapped: Callable[[int, FrameType | None], Any]):
        self.wrapped = wrapped

    def __call__(self, signum: int, frame: FrameType | None) -> Any:
        global _owed
        if deferring(frame):
            with _lock:
                _owed = True
                _start_poller()
            return None
        with _lock:
            _owed = False
        return self.wrapped(signum, frame)


def _start_poller() -> None:
    """Start the helper thread unless one runs (``_lock`` held)."""
    global _poller
    if _poller is None:
        _poller = threading.Thread(target=_redeliver, name="cudalab-interrupt", daemon=True)
        _poller.start()


def _redeliver() -> None:
    """The helper thread: trip SIGINT once the main thread left guarded code, then end."""
    global _poller
    main = threading.main_thread().ident
    try:
        while True:
            time.sleep(POLL_SECONDS)
            frame = sys._current_frames().get(main)  # type: ignore[arg-type]
            with _lock:
                if not _owed or frame is None:
                    return
                if not deferring(frame):
                    # the handler takes the owed interrupt (or, if it is back in guarded
                    # code by then, owes it again and starts a new helper)
                    _poller = None
                    _thread.interrupt_main(signal.SIGINT)
                    return
            del frame
    finally:
        with _lock:
            if _poller is threading.current_thread():
                _poller = None


def installed() -> bool:
    """Whether the main thread's SIGINT handler is cudalab's deferring wrapper."""
    return isinstance(signal.getsignal(signal.SIGINT), _DeferringHandler)


def install() -> bool:
    """Wrap the SIGINT handler so that Ctrl-C is deferred across guarded code.

    Does nothing outside the main thread, when the wrapper is already installed, or when
    SIGINT is ignored or left to the system (``SIG_IGN``, ``SIG_DFL``). In IPython it also
    registers itself to run before every cell (once per shell).

    Returns
    -------
    bool
        Whether the wrapper is the SIGINT handler now.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    _hook_ipython()
    current = signal.getsignal(signal.SIGINT)
    if isinstance(current, _DeferringHandler):
        return True
    if not callable(current):  # SIG_IGN, SIG_DFL, or a handler not set from Python
        return False
    signal.signal(signal.SIGINT, _DeferringHandler(current))
    return True


_hooked_shells: list[Any] = []


def _pre_run_cell(*_info: Any) -> None:
    """IPython's ``pre_run_cell`` event: put the wrapper back (ipykernel resets SIGINT)."""
    install()


def _hook_ipython() -> None:
    """Register :func:`_pre_run_cell` with the running IPython shell, once."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return
    try:
        shell = ipython.get_ipython()
    except Exception:
        return
    if shell is None or any(s is shell for s in _hooked_shells):
        return
    try:
        shell.events.register("pre_run_cell", _pre_run_cell)
    except Exception:
        return
    _hooked_shells.append(shell)
