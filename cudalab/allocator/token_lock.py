"""A mutex whose uncontended acquire and release are one ``list.pop`` and one ``list.append``.

Why: the caching allocator's cache hit is a few dozen bytecodes, and an uncontended
``threading.Lock`` acquire + release costs about as much as the rest of an alloc+free pair
(≈ 100 ns of a ≈ 800 ns pair, measured on CPython 3.11/3.12). ``list.pop`` and
``list.append`` are single C calls that are atomic in CPython, with the GIL and in the
free-threaded build (which takes the list's own lock): a one-element list is a token that
exactly one thread can hold. The hot paths inline them (``take()`` raises IndexError when the
token is held; ``give(True)`` puts it back).

A waiter spins with ``time.sleep(0)`` (which hands the GIL to the holder), then backs off to
short sleeps: the allocator never holds its lock across a blocking driver call, so waits are
short. Like ``threading.Lock`` it is not re-entrant and may be released by another thread;
it works with ``threading.Condition``.

Three ways in, one token (so they cannot drift: each is ``take`` then, when busy, ``wait``):

* ``take()`` / ``give(True)``: the raw pair, inlined by the allocator's cache-hit paths
  (benchmark row "cache-hit pair" in ``benchmarks/allocator.py``); only the caching
  allocator, which owns its lock, binds them.
* ``acquire()`` / ``release()``: ``threading.Lock``'s API, and the way in for code outside
  the allocator: an uncontended ``acquire()`` is a compare and one ``take()``, so the pair
  costs what a helper function wrapping the raw ``take()`` plus ``release()`` costs
  (measured on CPython 3.11: about 150 ns), and it works the same on a ``threading.Lock``.
  The peak scopes open and close under it around every notebook cell (benchmark row
  "watch on: added cost per cell" in ``benchmarks/timing.py``).
* ``with lock:``: the convenient form; about 100 ns dearer than the pair above on CPython
  3.11, whose ``with`` calls a Python ``__enter__``/``__exit__`` without its fast call path,
  so hot code outside the allocator uses ``acquire``/``release``.
"""

from __future__ import annotations

import time

__all__ = ["TokenLock"]

_sleep = time.sleep
_monotonic = time.monotonic


class TokenLock:
    """A non-reentrant lock: ``acquire``/``release``/``locked``, a context manager, and the
    raw ``take``/``give`` pair for hot paths (``take()`` raises IndexError when held).

    Invariant: ``_box`` holds exactly one ``True`` while the lock is free and is empty while
    it is held; ``take`` and ``give`` are ``_box.pop`` and ``_box.append``, bound once, so
    the raw pair and the methods move the same token.
    """

    __slots__ = ("_box", "take", "give")

    def __init__(self) -> None:
        box = [True]
        self._box = box
        #: Take the token: returns True, or raises IndexError while the lock is held.
        self.take = box.pop
        #: Put the token back (``give(True)``); only the holder may call it.
        self.give = box.append

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take the lock, as ``threading.Lock.acquire``.

        Uncontended, with the default arguments, this is one compare and one ``take()``:
        the documented cheap way in for code outside the allocator (see the module doc).

        Parameters
        ----------
        blocking : bool, optional
            Wait for the lock (default); False returns at once.
        timeout : float, optional
            Seconds to wait at most; -1 (default) waits for ever.

        Returns
        -------
        bool
            True when the lock was taken, False when it could not be had.

        Raises
        ------
        ValueError
            For a timeout with ``blocking=False``, or a negative timeout other than -1.
        """
        if timeout != -1:
            if not blocking:
                raise ValueError("can't specify a timeout for a non-blocking call")
            if timeout < 0:
                raise ValueError("timeout value must be a non-negative number")
        try:
            self.take()
            return True
        except IndexError:
            if not blocking:
                return False
        return self.wait(timeout)

    def wait(self, timeout: float = -1) -> bool:
        """Block until the token is free, then take it (the contended half of acquire)."""
        deadline = None if timeout == -1 else _monotonic() + timeout
        take = self.take
        delay = 0.0
        spins = 0
        while True:
            try:
                take()
                return True
            except IndexError:
                pass
            if deadline is not None and _monotonic() >= deadline:
                return False
            spins += 1
            if spins > 64:  # the holder is not a few bytecodes away: back off (<= 0.5 ms)
                delay = min(delay * 2 or 1e-6, 5e-4)
            _sleep(delay)

    def release(self) -> None:
        """Give the lock back (RuntimeError when it is not held, as ``threading.Lock``)."""
        if self._box:
            raise RuntimeError("release unlocked lock")
        self.give(True)

    def locked(self) -> bool:
        """Whether some thread holds the lock."""
        return not self._box

    def __enter__(self) -> bool:
        """Take the lock for a ``with`` block (blocking, no timeout): ``take()``, else
        :meth:`wait`, without :meth:`acquire`'s argument checks."""
        try:
            self.take()
        except IndexError:
            self.wait()
        return True

    def __exit__(self, *exc: object) -> None:
        self.give(True)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {'locked' if not self._box else 'unlocked'}>"
