"""``cudalab.comm.group()``: NCCL's ``ncclGroupStart`` / ``ncclGroupEnd`` as a context manager.

The NCCL calls issued inside the block (collectives and point-to-point operations of
:class:`cudalab.comm.Communicator`) are launched together when the outermost block ends.
Groups are needed wherever one thread issues operations that wait for each other: a
``send`` and a ``recv`` between the same two ranks, an exchange with several peers, or
collectives over several communicators driven by one thread. Blocks nest (NCCL counts the
depth; only the outermost ``group_end`` launches).

If the block raises, ``group_end`` is still called (NCCL would otherwise keep the group
open for ever and swallow the next operations), then the block's exception propagates; an
error of ``group_end`` itself is added to it as a note rather than replacing it.
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any, Literal

from cudalab import _internal, _interrupts

__all__ = ["group", "group_depth"]

# This thread's depth of open group() blocks (``.depth``; absent means 0). Invariant: equals
# the number of group() blocks whose group_start succeeded and whose __exit__ has not run.
_thread = threading.local()


def group_depth() -> int:
    """How many :func:`group` blocks this thread is inside (0: none).

    :class:`cudalab.comm.Communicator` reads it to refuse a ``send`` to its own rank outside
    a group (it could never complete: the matching ``recv`` would come after it).
    """
    return _thread.__dict__.get("depth", 0)


class group:  # noqa: N801 - NCCL's and torch's lower-case name for a context manager
    """Group the NCCL calls made inside ``with cudalab.comm.group():``.

    Examples
    --------
    An exchange between two ranks (without the group, each rank's ``send`` would wait for
    a ``recv`` the peer never reaches)::

        with cudalab.comm.group():
            comm.send(outgoing, peer=1 - comm.rank)
            comm.recv(incoming, peer=1 - comm.rank)

    Raises
    ------
    cudalab.NcclError
        NCCL cannot be loaded, or ``group_start`` / ``group_end`` failed (``group_end``
        reports the errors of the calls it launches).
    """

    __slots__ = ("_nccl",)

    _nccl: Any  # the backend's Nccl while the block is open (group_start done), else None

    def __init__(self) -> None:
        self._nccl = None

    def __enter__(self) -> group:
        if self._nccl is not None:
            raise RuntimeError("cudalab.comm.group(): this group block is already open; "
                               "nest a new one (`with cudalab.comm.group():`) instead")
        nccl = _internal.backend().nccl()
        nccl.group_start()
        self._nccl = nccl
        _thread.depth = group_depth() + 1
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> Literal[False]:
        nccl = self._leave()
        if nccl is None:  # (__exit__ without a successful __enter__: nothing to close)
            return False
        if exc is None:
            nccl.group_end()
            return False
        try:
            nccl.group_end()
        except Exception as end_error:  # the block's exception is the one to see
            exc.add_note(f"cudalab.comm.group(): ncclGroupEnd also failed while this "
                         f"exception propagated: {type(end_error).__name__}: {end_error}")
        return False

    def _leave(self) -> Any:
        """Forget the open group (this object's and the thread's depth, together); returns
        the Nccl whose ``group_end`` is still to be called, or None."""
        nccl = self._nccl
        if nccl is not None:
            self._nccl = None
            _thread.depth = group_depth() - 1
        return nccl


# Ctrl-C is deferred while the paired state changes (NCCL's group depth and this thread's
# count), never across group_end, which may wait for peers (Ctrl-C must be able to end that).
_interrupts.guard(group.__enter__, group._leave)
