"""Running a block with no other test beside it under pytest-xdist (``run_lock.alone()``).

The README's test command runs pytest on two workers. A test whose assertion is a time budget
over several processes (the browser tests: a Jupyter server, its kernel and Chromium, with a
1 s first-render budget) was written for a machine it had to itself; beside another worker's
test it would measure that test too. So every test holds the run's lock shared while it runs
(:class:`RunLock`, ``tests/conftest.py``'s autouse fixture ``run_lock``), and such a test
wraps its measured part in ``with run_lock.alone():``, which holds the lock exclusively: it
waits for the other worker's current test to end, and the other worker's next test waits for
it. It takes the lock only once the test knows it will run (after its skips), so a skipped
browser test costs nothing.

Two lock files in the run's temporary root (shared by its workers): ``alone.gate``, which
:meth:`RunLock.alone` takes first (exclusively) and an ordinary test only passes through, so
that ordinary tests cannot starve a waiting ``alone()``; then ``alone.rw``, held shared by
every test and exclusively inside ``alone()``. Without pytest-xdist (``PYTEST_XDIST_WORKER``
unset) nothing is locked.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locking (the suite runs on Linux)
    fcntl = None  # type: ignore[assignment]

__all__ = ["RunLock"]


class RunLock:
    """One test's hold on the run's lock: shared from creation to :meth:`release`.

    Parameters
    ----------
    run_root
        A directory shared by every worker of this run (the parent of a worker's basetemp).
    """

    def __init__(self, run_root: Path) -> None:
        self.gate: IO[str] | None = None  # open only under pytest-xdist on POSIX
        self.rw: IO[str] | None = None  # held shared, except inside alone() (exclusive)
        if fcntl is not None and os.environ.get("PYTEST_XDIST_WORKER"):
            self.gate = open(run_root / "alone.gate", "a")  # noqa: SIM115 - closed by release()
            self.rw = open(run_root / "alone.rw", "a")  # noqa: SIM115
            self._shared()

    def _shared(self) -> None:
        assert self.gate is not None and self.rw is not None
        fcntl.flock(self.gate, fcntl.LOCK_SH)  # (waits while an alone() holds or waits)
        fcntl.flock(self.rw, fcntl.LOCK_SH)
        fcntl.flock(self.gate, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """Run the block with no other test of this run beside it."""
        if self.gate is None or self.rw is None:
            yield
            return
        fcntl.flock(self.rw, fcntl.LOCK_UN)  # never wait while holding: two alone()s would deadlock
        fcntl.flock(self.gate, fcntl.LOCK_EX)  # the other worker's next test waits here
        fcntl.flock(self.rw, fcntl.LOCK_EX)  # ... and this waits for its current one
        try:
            yield
        finally:
            fcntl.flock(self.rw, fcntl.LOCK_UN)
            fcntl.flock(self.gate, fcntl.LOCK_UN)
            self._shared()

    def release(self) -> None:
        """Let go of the lock (the end of the test)."""
        if self.gate is not None and self.rw is not None:
            self.rw.close()  # (closing drops the flock)
            self.gate.close()
            self.gate = self.rw = None
