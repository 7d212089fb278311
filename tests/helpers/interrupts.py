"""Ctrl-C by injection: trip SIGINT at every traced line or bytecode of chosen code.

:func:`interrupt_at` runs an operation with ``sys.settrace`` and, at the k-th event (a line,
or an opcode with ``opcodes=True``) of a frame whose code :func:`cudalab._interrupts.deferring`
would see as guarded (or of the given files), simulates Ctrl-C there
(``_thread.interrupt_main``, which CPython handles at its next check, as a real SIGINT);
then it waits for the KeyboardInterrupt and returns it (None when none came).
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import time
from collections.abc import Callable, Iterator
from types import FrameType, TracebackType
from typing import Any

import pytest

from cudalab import _interrupts

#: How long to wait for a deferred interrupt before calling it lost.
DELIVERY_TIMEOUT = 2.0


def count_events(op: Callable[[], Any], traced: Callable[[FrameType], bool],
                 opcodes: bool = False) -> int:
    """How many trace events ``op()`` makes in frames for which ``traced(frame)`` is true."""
    n = [0]

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == ("opcode" if opcodes else "line"):
            n[0] += 1
        return local

    def glob(frame: FrameType, event: str, arg: Any) -> Any:
        if traced(frame):
            frame.f_trace_opcodes = opcodes
            return local
        return None

    with _opcode_tracing(opcodes):
        sys.settrace(glob)
        try:
            op()
        finally:
            sys.settrace(None)
    return n[0]


def _ignore(frame: FrameType, event: str, arg: Any) -> None:
    return None


@contextlib.contextmanager
def _opcode_tracing(opcodes: bool) -> Iterator[None]:
    """Make CPython 3.12 deliver opcode events to frames that ask for them at their call.

    3.12's instrumentation can miss ``f_trace_opcodes`` set by the global trace function at
    a call (the first opcode-traced run of a code after a line-traced one then gives no
    opcode event at all); a frame of the caller tracing opcodes turns them on first.
    """
    if not opcodes:
        yield
        return
    caller = sys._getframe(2)
    old = caller.f_trace, caller.f_trace_opcodes
    caller.f_trace, caller.f_trace_opcodes = _ignore, True
    try:
        yield
    finally:
        caller.f_trace, caller.f_trace_opcodes = old


def interrupt_at(op: Callable[[], Any], traced: Callable[[FrameType], bool], k: int,
                 opcodes: bool = False, timeout: float = DELIVERY_TIMEOUT) -> tuple[bool, BaseException | None, bool]:
    """Run ``op()``, simulating Ctrl-C at its k-th traced event (1-based).

    Returns
    -------
    (bool, KeyboardInterrupt or None, bool)
        Whether op() returned, the KeyboardInterrupt that came (None: none within
        ``timeout`` seconds), and whether the k-th event came (the signal was sent).
    """
    n = [0]

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == ("opcode" if opcodes else "line"):
            n[0] += 1
            if n[0] == k:
                _thread.interrupt_main(signal.SIGINT)
        return local

    def glob(frame: FrameType, event: str, arg: Any) -> Any:
        if traced(frame):
            frame.f_trace_opcodes = opcodes
            return local
        return None

    returned = False
    caught: BaseException | None = None
    try:
        with _opcode_tracing(opcodes):
            sys.settrace(glob)
            try:
                op()
                returned = True
            finally:
                sys.settrace(None)
        deadline = time.monotonic() + (timeout if n[0] >= k else 0.0)
        while time.monotonic() < deadline:
            time.sleep(0.0001)
    except KeyboardInterrupt as exc:
        caught = exc
    return returned, caught, n[0] >= k


def frames_of(tb: TracebackType | None) -> list[FrameType]:
    """The frames a traceback went through, outermost first."""
    out = []
    while tb is not None:
        out.append(tb.tb_frame)
        tb = tb.tb_next
    return out


@pytest.fixture
def deferring() -> Iterator[None]:
    """cudalab's SIGINT wrapper installed over Python's default handler (then restored).
    tests/conftest.py makes it available to every test."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert _interrupts.install()
        yield
    finally:
        signal.signal(signal.SIGINT, old)
