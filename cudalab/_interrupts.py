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
not decide. A deferred interrupt is owed: a helper thread trips SIGINT again every
``POLL_SECONDS`` (``_thread.interrupt_main``), and each time the handler, in the main thread,
looks at its frames again: once the innermost deciding frame is no longer guarded, the
wrapped handler raises KeyboardInterrupt in the user's code, right after the allocator call,
the finalizer or the bookkeeping ends. Nothing runs in the guarded code itself: the hot
paths cost what they cost before, and the price (walks over the main thread's frames, by
the main thread) is paid only while an interrupt is owed, a few milliseconds per press.

Invariants: at most one interrupt is owed (``_owed``); a helper thread (``_poller``) runs
while one is owed; it has at most one trip outstanding (``_tripped``, cleared by the handler),
and a trip that finds nothing owed any more (a safe point, :func:`deliver_owed`, delivered
it) is dropped. So each KeyboardInterrupt raised answers one press of Ctrl-C
(presses that come while one is owed are merged into it, as CPython merges the presses that
come before its handler runs).

Where the wrapper is installed: by :func:`install`, called by ``import cudalab`` and when an
allocator is created (in the main thread) and, in IPython, before every cell (``ipykernel`` puts its own handler back
around every request). Code that sets its own SIGINT handler later replaces the wrapper;
then interrupts are delivered as Python delivers them.
"""

from __future__ import annotations

import _signal  # (not ``signal``: ``import cudalab`` installs the wrapper, and adds no import)
import _thread
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from types import CodeType, FrameType
from typing import Any

__all__ = ["install", "installed", "unhook_ipython", "guard", "guard_files", "guard_imports",
           "open_code", "close_code", "deferring", "deliver_owed", "POLL_SECONDS",
           "SWITCH_SECONDS"]

#: How often the helper thread looks at the main thread while an interrupt is owed.
POLL_SECONDS = 0.0002
#: The interpreter's thread switch interval while an interrupt is owed (so the helper gets to
#: look at a busy main thread every ~50 µs, not every 5 ms); the old one is put back after.
SWITCH_SECONDS = 5e-5

# What decides, by code object (functions) and by file-name prefix (whole packages).
_guarded_codes: set[CodeType] = set()
_guarded_prefixes: tuple[str, ...] = ()
_import_prefixes: tuple[str, ...] = ()  # files whose module code (an import) is guarded
_open_codes: set[CodeType] = set()  # user code run by guarded functions (delivers at once)

# guards the three below; re-entrant: the handler may run again inside itself
_lock = threading.RLock()
_owed = False  # an interrupt came in guarded code and was not delivered yet
_tripped = False  # the helper tripped SIGINT and the handler has not run since
_poller: threading.Thread | None = None  # the helper thread, while an interrupt is owed
_switch = [0.005]  # the switch interval to put back when the helper ends


def _after_fork_in_child() -> None:
    """A forked child has no helper thread, and its copy of the lock may be held."""
    global _lock, _owed, _tripped, _poller
    _lock = threading.RLock()
    if _poller is not None:
        sys.setswitchinterval(_switch[0])
    _owed = _tripped = False
    _poller = None


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_after_fork_in_child)


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


def guard_imports(prefixes: Iterable[str]) -> None:
    """Defer Ctrl-C while the module code of a file whose path starts with a prefix runs (an
    import of it), and so across the imports that module code makes.

    Parameters
    ----------
    prefixes
        Path prefixes (e.g. a package's directory with a trailing separator).
    """
    global _import_prefixes
    _import_prefixes = tuple(dict.fromkeys((*_import_prefixes, *prefixes)))


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
    imports = _import_prefixes
    while frame is not None:
        code = frame.f_code
        if code in opened:
            return False
        if code in guarded or code.co_filename.startswith(prefixes) or (
                code.co_name == "<module>" and code.co_filename.startswith(imports)):
            return True
        frame = frame.f_back
    return False


class _DeferringHandler:
    """The SIGINT handler that wraps the one it found (see the module doc)."""

    __slots__ = ("wrapped",)

    def __init__(self, wrapped: Callable[[int, FrameType | None], Any]):
        self.wrapped = wrapped

    def __call__(self, signum: int, frame: FrameType | None) -> Any:
        global _owed, _tripped, _poller
        with _lock:
            from_helper = _tripped
            _tripped = False
            if from_helper and not _owed:
                return None  # the helper's trip, for an interrupt a safe point delivered
            if deferring(frame):
                _owed = True
                if _poller is None:
                    _switch[0] = sys.getswitchinterval()
                    sys.setswitchinterval(SWITCH_SECONDS)
                    _poller = threading.Thread(target=_redeliver, name="cudalab-interrupt",
                                               daemon=True)
                    _poller.start()
                return None
            _owed = False
        return self.wrapped(signum, frame)


def _redeliver() -> None:
    """The helper thread: while an interrupt is owed, trip SIGINT again and again (one trip
    at a time); the handler, running in the main thread, decides each time whether the main
    thread has left guarded code (then it delivers) or not (then the interrupt stays owed).

    The helper never looks at the main thread's frames itself: reading another thread's
    frames (``sys._current_frames()`` and ``f_back``) while it runs is not safe in CPython
    3.11 (a walk can meet a frame being torn down: seen here as a crash), so every walk is
    done by the main thread, over its own stack.
    """
    global _poller, _tripped, _owed
    sleep = time.sleep
    while True:
        sleep(POLL_SECONDS)
        with _lock:
            if _owed and not isinstance(_signal.getsignal(_signal.SIGINT), _DeferringHandler):
                _owed = False  # the wrapper was replaced (ipykernel after a cell): drop it
            if not _owed:
                _poller = None
                sys.setswitchinterval(_switch[0])
                return
            if not _tripped:
                _tripped = True
                _thread.interrupt_main(_signal.SIGINT)


def deliver_owed() -> None:
    """A safe point: raise the interrupt owed, if any, now (through the wrapped handler).

    For code that ends a guarded stretch and knows it is a good place: e.g. ``%%cuda_timed``
    right before it runs the cell's code and before it returns, so a cell interrupted while
    the magic kept its books still ends as interrupted, however short its body.

    Raises
    ------
    KeyboardInterrupt
        When an interrupt was owed (and the wrapped handler raises, as Python's does).
    """
    global _owed
    if not _owed:
        return
    with _lock:
        if not _owed:
            return
        _owed = False
    handler = _signal.getsignal(_signal.SIGINT)
    wrapped = handler.wrapped if isinstance(handler, _DeferringHandler) else _signal.default_int_handler
    wrapped(_signal.SIGINT, sys._getframe(1))


def installed() -> bool:
    """Whether the main thread's SIGINT handler is cudalab's deferring wrapper."""
    return isinstance(_signal.getsignal(_signal.SIGINT), _DeferringHandler)


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
    current = _signal.getsignal(_signal.SIGINT)
    if isinstance(current, _DeferringHandler):
        return True
    if not callable(current):  # SIG_IGN, SIG_DFL, or a handler not set from Python
        return False
    _signal.signal(_signal.SIGINT, _DeferringHandler(current))
    return True


#: The shells :func:`_pre_run_cell` is registered with (each once).
_hooked_shells: list[Any] = []
#: Those of :data:`_hooked_shells` where it was registered while IPython loaded an extension
#: (``%load_ext cudalab`` importing cudalab, or the extension's own load): the extension's
#: unload takes it away again (:func:`unhook_ipython`); one registered before stays.
_hooked_by_extension: list[Any] = []


def _pre_run_cell(*_info: Any) -> None:
    """IPython's ``pre_run_cell`` event: put the wrapper back (ipykernel resets SIGINT)."""
    install()


def _loading_an_extension() -> bool:
    """Whether IPython's extension manager is on the stack (loading or reloading one)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name in ("_load_extension", "load_extension", "reload_extension") and \
                code.co_filename.replace("\\", "/").endswith("IPython/core/extensions.py"):
            return True
        frame = frame.f_back  # type: ignore[assignment]  # (None ends the loop)
    return False


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
    if _loading_an_extension():
        _hooked_by_extension.append(shell)


def unhook_ipython(shell: Any) -> None:
    """Take :func:`_pre_run_cell` off ``shell`` if an extension load registered it (the
    extension's unload: IPython's callbacks end as they were before ``%load_ext``); a
    registration from before the load stays. A later :func:`install` registers it again."""
    if not any(s is shell for s in _hooked_by_extension):
        return
    _hooked_by_extension[:] = [s for s in _hooked_by_extension if s is not shell]
    _hooked_shells[:] = [s for s in _hooked_shells if s is not shell]
    try:
        shell.events.unregister("pre_run_cell", _pre_run_cell)
    except Exception:  # (already gone: someone else removed it)
        pass
