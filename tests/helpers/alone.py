"""``@pytest.mark.alone``: a test that runs with no other test beside it under pytest-xdist.

The README's test command runs pytest on two workers. A test whose assertion is a time budget
over several processes (the browser tests: a Jupyter server, its kernel and Chromium, with a
1 s first-render budget) was written for a machine it had to itself; beside another worker's
test it would measure the other test. Each test therefore holds a lock while it runs
(:func:`hold`): ordinary tests a shared one, ``alone`` tests an exclusive one, so an ``alone``
test waits for the other worker's current test to end and the other worker waits for it.

Two lock files in the run's temporary root (shared by its workers): ``alone.gate``, which an
``alone`` test takes first (exclusively) and an ordinary test only passes through, so that
ordinary tests cannot starve a waiting ``alone`` test; then ``alone.rw``, held shared by
ordinary tests and exclusively by ``alone`` tests for the whole test. Without pytest-xdist
(``PYTEST_XDIST_WORKER`` unset) nothing is locked.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locking (the suite runs on Linux)
    fcntl = None  # type: ignore[assignment]

__all__ = ["hold"]


@contextlib.contextmanager
def hold(run_root: Path, alone: bool) -> Iterator[None]:
    """Hold the run's lock for one test: exclusively when ``alone``, else shared.

    Parameters
    ----------
    run_root
        A directory shared by every worker of this run (the parent of a worker's basetemp).
    alone
        Whether the test must run with no other test beside it.
    """
    if fcntl is None or not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    with open(run_root / "alone.gate", "a") as gate, open(run_root / "alone.rw", "a") as rw:
        if alone:
            fcntl.flock(gate, fcntl.LOCK_EX)  # new tests of the other worker wait here
            fcntl.flock(rw, fcntl.LOCK_EX)  # ... for its current test to end
        else:
            fcntl.flock(gate, fcntl.LOCK_SH)
            fcntl.flock(rw, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(rw, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
