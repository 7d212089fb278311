"""A plain-text progress bar on stderr for long replays (``progress=True``, ``--progress``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ProgressBar", "progress_callback"]


class ProgressBar:
    """Plain-text progress bar on stderr (redrawn at most ten times a second)."""

    def __init__(self, label: str = "", stream: Any = None, delay: float = 0.5):
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self._start = time.monotonic()
        self._delay = delay  # short replays never show a bar
        self._last = 0.0
        self._width = 0
        self._drawn = False

    def __call__(self, done: int, total: int, label: str | None = None) -> None:
        now = time.monotonic()
        if now - self._start < self._delay and not self._drawn:
            return
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        text = label if label is not None else self.label
        line = (f"[{bar:<30}] {frac * 100:5.1f}% {done:,}/{total:,} entries"
                f"{'  ' + text if text else ''}")
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def progress_callback(progress: Any, label: str) -> tuple[Callable[[int, int], None] | None,
                                                        ProgressBar | None]:
    """What a ``progress=`` argument asks for: ``(callback, bar)``.

    Parameters
    ----------
    progress : bool, callable or None
        False/None: no progress; True: a :class:`ProgressBar` labelled ``label`` on stderr;
        a ``callable(done, total)``: that callable.
    label : str
        The bar's label.

    Returns
    -------
    tuple
        The ``callback(done, total)`` to call (None: none) and the bar to close at the end
        (None when none was made).

    Raises
    ------
    TypeError
        ``progress`` is none of those.
    """
    if progress is None or progress is False:
        return None, None
    if progress is True:
        bar = ProgressBar(label)
        return bar, bar
    if callable(progress):
        return progress, None
    raise TypeError("progress must be a bool or a callable(done, total)")
