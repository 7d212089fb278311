"""The driver seam's handle types: what :class:`~cudalab._driver.base.Backend` hands out.

Each handle is an opaque value owned by the caller (who destroys it through the seam); the
layer above never inspects one except through :meth:`Backend.handle_int`. The types are
:func:`typing.NewType`: they cost nothing at run time (a handle is the
backend's own object, passed through unchanged: ``cuda.bindings``' ``CUstream``/``CUevent``...
on the real backend, :mod:`cudalab._driver.sim.handles` objects on the simulator) and let
the type checker tell a stream from an event or a communicator across the seam. They are
declared over :class:`OpaqueHandle`, whose ``int()`` is the handle's C value: the
simulator's handle classes derive from it; the real backend's objects (``cuda.bindings``',
nccl4py's) are untyped, so the checker takes them as they are. A backend
makes one from its own object with ``StreamHandle(obj)`` where it hands it out, and turns
one back into its own object where it takes it (the simulator through its handle table).

Handle types (one per kind of driver object):

* :data:`DeviceHandle` (``CUdevice``) and :data:`ContextHandle` (``CUcontext``): inside the
  real backend only;
* :data:`StreamHandle`, :data:`EventHandle`: streams and events (the null stream too);
* :data:`ModuleHandle`, :data:`FunctionHandle`: loaded modules and their kernels;
* :data:`GraphHandle`, :data:`GraphExecHandle`: captured and executable CUDA graphs;
* :data:`MemoryPoolHandle` (``CUmemoryPool``) and :data:`PhysicalMemoryHandle`
  (``CUmemGenericAllocationHandle``, VMM physical memory): memory handles; device and host
  memory itself is addressed by plain ``int`` pointers;
* :data:`CommHandle`: an NCCL communicator (:class:`cudalab._driver.nccl_seam.Nccl`).

:class:`ClosedHandle` is what an owner keeps in place of a handle it released.
"""

from __future__ import annotations

from typing import NewType

__all__ = [
    "ClosedHandle",
    "CommHandle",
    "ContextHandle",
    "DeviceHandle",
    "EventHandle",
    "FunctionHandle",
    "GraphExecHandle",
    "GraphHandle",
    "MemoryPoolHandle",
    "ModuleHandle",
    "OpaqueHandle",
    "PhysicalMemoryHandle",
    "StreamHandle",
]

class OpaqueHandle:
    """What every handle type is declared over: an opaque object whose ``int()`` is its C
    value (:meth:`Backend.handle_int`). No state (empty ``__slots__``): a typing base, which
    the simulator's handle classes derive from."""

    __slots__ = ()

    def __int__(self) -> int:
        raise TypeError(f"{type(self).__name__} has no C value")


#: A device of the driver (``CUdevice``); the real backend's own bookkeeping.
DeviceHandle = NewType("DeviceHandle", OpaqueHandle)
#: A device's primary context (``CUcontext``); the real backend's own bookkeeping.
ContextHandle = NewType("ContextHandle", OpaqueHandle)
#: A stream (``CUstream``): created, the null stream, or wrapped from another library.
StreamHandle = NewType("StreamHandle", OpaqueHandle)
#: An event (``CUevent``), created or opened from an IPC handle.
EventHandle = NewType("EventHandle", OpaqueHandle)
#: A loaded module (``CUmodule``).
ModuleHandle = NewType("ModuleHandle", OpaqueHandle)
#: A kernel of a loaded module (``CUfunction``).
FunctionHandle = NewType("FunctionHandle", OpaqueHandle)
#: A graph made by a stream capture (``CUgraph``).
GraphHandle = NewType("GraphHandle", OpaqueHandle)
#: An executable graph (``CUgraphExec``).
GraphExecHandle = NewType("GraphExecHandle", OpaqueHandle)
#: A stream-ordered memory pool (``CUmemoryPool``).
MemoryPoolHandle = NewType("MemoryPoolHandle", OpaqueHandle)
#: Physical device memory of the virtual memory API (``CUmemGenericAllocationHandle``).
PhysicalMemoryHandle = NewType("PhysicalMemoryHandle", OpaqueHandle)
#: An NCCL communicator (``ncclComm_t``; nccl4py's ``Comm`` on the real backend).
CommHandle = NewType("CommHandle", OpaqueHandle)


class ClosedHandle(OpaqueHandle):
    """What an owner keeps in place of a driver handle it has released (a closed Stream).

    Both backends refuse it wherever a handle is expected, with the error of :meth:`error`,
    which names the owner: cuda.bindings converts a handle argument that is not its own
    type with ``int()``, which raises here, and the simulator raises the same error when
    it meets one. So the hot paths that pass the handle straight to the seam (an event
    record, a stream query, an allocation, a kernel launch) refuse a closed stream without
    checking anything themselves (a ``None`` handle would be the null stream to both).

    Parameters
    ----------
    owner : str
        The owner's description for the error (its repr, e.g. ``<cudalab.Stream ...>``).
    """

    __slots__ = ("owner",)

    def __init__(self, owner: str):
        self.owner = owner  # the owner's repr, named by every error

    def error(self) -> RuntimeError:
        """The error every use of the handle raises."""
        return RuntimeError(f"{self.owner} was closed: it can no longer be used")

    def __int__(self) -> int:
        raise self.error()

    __index__ = __int__

    def __repr__(self) -> str:
        return f"<closed handle of {self.owner}>"
