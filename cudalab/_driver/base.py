"""The driver seam: the one narrow interface between cudalab and a CUDA driver.

Everything above this package (devices, streams, the allocator, RNG, magics, widgets) talks
to a :class:`Backend` and never imports ``cuda.bindings`` or NVML itself. Two implementations
exist: :mod:`cudalab._driver.cuda` over ``cuda.bindings.driver`` and
:mod:`cudalab._driver.sim` (host memory, host clocks, numpy kernels), chosen explicitly
with ``CUDALAB_SIMULATOR=1`` or :func:`cudalab.use_simulator`.

Conventions shared by both implementations (the tests in ``tests/`` check them on both):

* Handles (streams, events, modules, functions, graphs, pools, communicators) are opaque
  values owned by the caller, who must destroy them, typed by :mod:`cudalab._driver.handles`
  (``StreamHandle``, ``EventHandle``...: :func:`typing.NewType`, free at run time). The layer
  above never inspects them except through :meth:`Backend.handle_int`. The null (legacy
  default) stream is the handle returned by :meth:`Backend.null_stream`.
* Device pointers and host pointers are plain ``int`` addresses; copies use unified
  addressing, so one :meth:`memcpy` serves H2D, D2H, D2D and peer copies.
* Calls that need a context take the device ordinal explicitly (``device``) and make that
  device's primary context current on the calling thread if it is not already. Calls that
  take only a stream or event handle need no context, except on the null stream, where the
  caller must first make the stream's device current with :meth:`set_context`.
* Failures raise :class:`cudalab.CudaError` (out of memory: :class:`CudaOutOfMemory`,
  a subclass the allocator catches to run its retry ladder). Queries that can be "not ready"
  return ``False`` instead of raising.
* The hot paths read one bound function from the backend's one fast-call registry,
  :meth:`Backend.fast_calls` (:mod:`cudalab._driver.fast_calls`), and call it.

The seam is several modules, one concept each; this one holds :class:`Backend` and its flags
and re-exports the others' names (``from cudalab._driver.base import X`` serves every name of
``__all__``): :mod:`~cudalab._driver.handles` (the handle types, :class:`ClosedHandle`),
:mod:`~cudalab._driver.fast_calls` (:class:`FastCalls`, the ``STATUS_*`` values),
:mod:`~cudalab._driver.device_info` (:class:`DeviceInfo`), :mod:`~cudalab._driver.kernel_args`
(:class:`KernelArgs`), :mod:`~cudalab._driver.nvml_seam` (:class:`Nvml`) and
:mod:`~cudalab._driver.nccl_seam` (:class:`Nccl` and the ``NCCL_*`` numbers).
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from typing import Any, SupportsInt, cast

from cudalab._driver.blas_seam import Blas
from cudalab._driver.device_info import DeviceInfo
from cudalab._driver.fast_calls import (
    STATUS_NOT_READY,
    STATUS_SUCCESS,
    FastCalls,
    checked_fast_calls,
)
from cudalab._driver.fft_seam import Fft
from cudalab._driver.handles import (
    ClosedHandle,
    CommHandle,
    ContextHandle,
    DeviceHandle,
    EventHandle,
    FunctionHandle,
    GraphExecHandle,
    GraphHandle,
    MemoryPoolHandle,
    ModuleHandle,
    PhysicalMemoryHandle,
    StreamHandle,
)
from cudalab._driver.kernel_args import KernelArgs, SimKernel
from cudalab._driver.nccl_seam import (
    NCCL_AVG,
    NCCL_BFLOAT16,
    NCCL_CALL_ALL_GATHER,
    NCCL_CALL_ALL_REDUCE,
    NCCL_CALL_BROADCAST,
    NCCL_CALL_NAMES,
    NCCL_CALL_REDUCE,
    NCCL_CALL_REDUCE_SCATTER,
    NCCL_FLOAT8E4M3,
    NCCL_FLOAT8E5M2,
    NCCL_FLOAT16,
    NCCL_FLOAT32,
    NCCL_FLOAT64,
    NCCL_INT8,
    NCCL_INT32,
    NCCL_INT64,
    NCCL_MAX,
    NCCL_MIN,
    NCCL_NUMPY_NAMES,
    NCCL_PROD,
    NCCL_RESULTS,
    NCCL_SUM,
    NCCL_UINT8,
    NCCL_UINT32,
    NCCL_UINT64,
    NCCL_UNIQUE_ID_SIZE,
    GroupRunner,
    Nccl,
)
from cudalab._driver.nvml_seam import Nvml

__all__ = [
    # this module: the backend and its flags
    "Backend", "STREAM_DEFAULT", "STREAM_NON_BLOCKING", "EVENT_DEFAULT", "EVENT_BLOCKING_SYNC",
    "EVENT_DISABLE_TIMING", "EVENT_INTERPROCESS", "EVENT_RECORD_EXTERNAL", "IPC_HANDLE_SIZE", "CAPTURE_MODE_GLOBAL",
    "CAPTURE_MODE_THREAD_LOCAL", "CAPTURE_MODE_RELAXED", "CAPTURE_STATUS_NONE",
    "CAPTURE_STATUS_ACTIVE", "CAPTURE_STATUS_INVALIDATED", "GRAPH_INSTANTIATE_AUTO_FREE_ON_LAUNCH",
    "GRAPH_INSTANTIATE_USE_NODE_PRIORITY", "GRAPH_NODE_KINDS",
    "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
    "CUDA_ERROR_STREAM_CAPTURE_MERGE", "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
    "CUDA_ERROR_STREAM_CAPTURE_UNJOINED", "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
    "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", "CUDA_ERROR_CAPTURED_EVENT",
    "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
    # re-exported from the seam's other modules
    "ClosedHandle", "CommHandle", "ContextHandle", "DeviceHandle", "EventHandle",
    "FunctionHandle", "GraphExecHandle", "GraphHandle", "MemoryPoolHandle", "ModuleHandle",
    "PhysicalMemoryHandle", "StreamHandle", "FastCalls", "STATUS_SUCCESS", "STATUS_NOT_READY",
    "DeviceInfo", "KernelArgs", "SimKernel", "Nvml", "Nccl", "Blas", "Fft", "GroupRunner", "NCCL_AVG",
    "NCCL_BFLOAT16", "NCCL_CALL_ALL_GATHER", "NCCL_CALL_ALL_REDUCE", "NCCL_CALL_BROADCAST",
    "NCCL_CALL_NAMES", "NCCL_CALL_REDUCE", "NCCL_CALL_REDUCE_SCATTER", "NCCL_FLOAT8E4M3",
    "NCCL_FLOAT8E5M2", "NCCL_FLOAT16", "NCCL_FLOAT32", "NCCL_FLOAT64", "NCCL_INT8",
    "NCCL_INT32", "NCCL_INT64", "NCCL_MAX", "NCCL_MIN", "NCCL_NUMPY_NAMES", "NCCL_PROD",
    "NCCL_RESULTS", "NCCL_SUM", "NCCL_UINT8", "NCCL_UINT32", "NCCL_UINT64",
    "NCCL_UNIQUE_ID_SIZE",
]

# Stream flags (values of CU_STREAM_*).
STREAM_DEFAULT = 0
STREAM_NON_BLOCKING = 1

# Event flags (values of CU_EVENT_*).
EVENT_DEFAULT = 0
EVENT_BLOCKING_SYNC = 1
EVENT_DISABLE_TIMING = 2
EVENT_INTERPROCESS = 4

#: cuEventRecordWithFlags' CU_EVENT_RECORD_EXTERNAL: recorded during a stream capture, the
#: record becomes an event-record node of the graph (each launch records the event) instead
#: of a dependency inside the capture; outside a capture, an ordinary record.
EVENT_RECORD_EXTERNAL = 1

#: Size in bytes of an IPC event or memory handle (CUipcEventHandle, CUipcMemHandle).
IPC_HANDLE_SIZE = 64

# Stream capture modes (CUstreamCaptureMode), torch's capture_error_mode "global",
# "thread_local" and "relaxed".
CAPTURE_MODE_GLOBAL = 0
CAPTURE_MODE_THREAD_LOCAL = 1
CAPTURE_MODE_RELAXED = 2

# Stream capture status (CUstreamCaptureStatus).
CAPTURE_STATUS_NONE = 0
CAPTURE_STATUS_ACTIVE = 1
CAPTURE_STATUS_INVALIDATED = 2

# Graph instantiation flags (CUgraphInstantiate_flags); torch instantiates with both.
GRAPH_INSTANTIATE_AUTO_FREE_ON_LAUNCH = 1
GRAPH_INSTANTIATE_USE_NODE_PRIORITY = 8

# Graph node kinds, as :meth:`Backend.graph_node_kinds` names them (CUgraphNodeType order).
GRAPH_NODE_KINDS = ("kernel", "memcpy", "memset", "host", "graph", "empty", "wait_event",
                    "event_record", "semaphore_signal", "semaphore_wait", "mem_alloc",
                    "mem_free", "batch_mem_op", "conditional")

# Stream capture errors (CUDA_ERROR_STREAM_CAPTURE_*; the runtime API uses the same numbers).
CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900  # not permitted while capturing (sync, query...)
CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901  # the capture was broken by an earlier error
CUDA_ERROR_STREAM_CAPTURE_MERGE = 902  # would merge two independent captures
CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903  # the capture was not begun on this stream
CUDA_ERROR_STREAM_CAPTURE_UNJOINED = 904  # a forked stream was not joined back
CUDA_ERROR_STREAM_CAPTURE_ISOLATION = 905  # a dependency crosses the capture boundary
CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906  # the legacy stream would synchronise with it
CUDA_ERROR_CAPTURED_EVENT = 907  # query/sync of an event recorded in a capture
CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908  # ended from another thread (not relaxed)


class Backend(abc.ABC):
    """One CUDA driver, real or simulated. One instance per process."""

    #: "cuda" or "simulator".
    name: str = "abstract"
    #: True for the simulator; everything that shows a device must then say "simulated".
    simulated: bool = False

    # ---------------------------------------------------------------- lifecycle and identity
    @abc.abstractmethod
    def init(self) -> None:
        """Initialise the driver (idempotent). Raises CudaError or DriverNotFoundError."""

    @abc.abstractmethod
    def driver_version(self) -> int:
        """CUDA driver API version, e.g. 13000 for CUDA 13.0."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """Number of visible devices after init (0 allowed)."""

    @abc.abstractmethod
    def device_info(self, device: int) -> DeviceInfo:
        """Static properties of ``device``."""

    def handle_int(self, handle: SupportsInt) -> int:
        """The C value of a stream/event/module handle, as an int."""
        return int(handle)

    def fast_calls(self) -> FastCalls:
        """This backend's fast-call registry (:class:`FastCalls`): its status calls for the
        hot paths above the seam. This default wraps the checked methods; the real backend
        returns its process-wide registry of the bindings' functions and C twins."""
        last = self._last_fast_error = threading.local()
        return checked_fast_calls(self.event_record, self.event_query, self.stream_query,
                                  self.event_elapsed_time, last)

    def status_error(self, status: int, call: str) -> Exception:
        """The exception for a failed status returned by a :class:`FastCalls` status call."""
        from cudalab.errors import CudaError

        last = getattr(self, "_last_fast_error", None)
        exc = getattr(last, "exc", None) if last is not None else None
        if last is not None and exc is not None and exc.code == int(status):
            last.exc = None
            return cast(Exception, exc)
        return CudaError(int(status), f"CUDA error {int(status)}", "", call=call)

    # ---------------------------------------------------------------- contexts
    @abc.abstractmethod
    def set_context(self, device: int) -> None:
        """Make ``device``'s primary context current on the calling thread."""

    @abc.abstractmethod
    def synchronize(self, device: int) -> None:
        """Wait for all work on ``device`` (cuCtxSynchronize)."""

    @abc.abstractmethod
    def can_access_peer(self, device: int, peer: int) -> bool:
        """Whether ``device`` can access memory of ``peer`` directly."""

    @abc.abstractmethod
    def enable_peer_access(self, device: int, peer: int) -> None:
        """Let ``device`` access ``peer``'s memory (already enabled is not an error)."""

    # ---------------------------------------------------------------- memory
    @abc.abstractmethod
    def mem_alloc(self, device: int, nbytes: int) -> int:
        """Synchronous device allocation (cuMemAlloc). Raises CudaOutOfMemory when full."""

    @abc.abstractmethod
    def mem_free(self, device: int, ptr: int) -> None:
        """Free memory from :meth:`mem_alloc` (synchronises the device, like cuMemFree)."""

    @abc.abstractmethod
    def mem_alloc_async(self, device: int, nbytes: int, stream: StreamHandle) -> int:
        """Stream-ordered allocation from the device's default pool (cuMemAllocAsync)."""

    @abc.abstractmethod
    def mem_free_async(self, device: int, ptr: int, stream: StreamHandle) -> None:
        """Stream-ordered free (cuMemFreeAsync)."""

    @abc.abstractmethod
    def mem_get_info(self, device: int) -> tuple[int, int]:
        """(free, total) bytes of ``device`` as the driver sees them."""

    @abc.abstractmethod
    def host_alloc(self, nbytes: int) -> int:
        """Page-locked host memory, portable across devices (cuMemHostAlloc)."""

    @abc.abstractmethod
    def host_free(self, ptr: int) -> None:
        """Free memory from :meth:`host_alloc`."""

    @abc.abstractmethod
    def memcpy(self, device: int, dst: int, src: int, nbytes: int) -> None:
        """Synchronous copy between any two addresses (host, device or peer)."""

    @abc.abstractmethod
    def memcpy_async(self, device: int, dst: int, src: int, nbytes: int, stream: StreamHandle) -> None:
        """Stream-ordered copy between any two addresses (host, device or peer)."""

    @abc.abstractmethod
    def memcpy_peer_async(
        self, dst: int, dst_device: int, src: int, src_device: int, nbytes: int, stream: StreamHandle
    ) -> None:
        """Copy between two devices' memory on ``stream`` (works without peer access)."""

    def memcpy_ordered(self, dst: int, src: int, nbytes: int, copy_device: int,
                       copy_stream: StreamHandle, copy_event: EventHandle, peer_device: int,
                       peer_stream: StreamHandle, peer_event: EventHandle,
                       join: bool = True) -> None:
        """A copy between two devices with torch's two-way ordering: ``nbytes`` from ``src``
        to ``dst`` (unified addresses, peer access enabled) on ``copy_stream``, a stream of
        ``copy_device``, ordered after the work queued so far on ``peer_stream`` (of the other
        device), which then waits for the copy.

        ``peer_event`` (an event of ``peer_device``) is recorded on ``peer_stream`` and waited
        for by ``copy_stream`` before the copy; ``copy_event`` (of ``copy_device``) is
        recorded on ``copy_stream`` after it and waited for by ``peer_stream``; with ``join``
        false that last wait is left to the caller (several copies into one device can then
        run at once, the destination's stream waiting for them all at the end). Each stream's
        device is made current for its calls (a legacy stream handle acts on the current
        context); the calling thread may be left on either device, as :meth:`set_context`
        records it.

        This default makes the calls one by one; a backend may make them in one step (the
        real one does, from C).
        """
        self.set_context(peer_device)
        self.event_record(peer_event, peer_stream)
        self.set_context(copy_device)
        self.stream_wait_event(copy_stream, peer_event)
        self.memcpy_async(copy_device, dst, src, nbytes, copy_stream)
        self.event_record(copy_event, copy_stream)
        if join:
            self.set_context(peer_device)
            self.stream_wait_event(peer_stream, copy_event)

    @abc.abstractmethod
    def memset_d8(self, device: int, ptr: int, value: int, nbytes: int) -> None:
        """Synchronous byte fill."""

    @abc.abstractmethod
    def memset_d8_async(self, device: int, ptr: int, value: int, nbytes: int, stream: StreamHandle) -> None:
        """Stream-ordered byte fill."""

    @abc.abstractmethod
    def memset_d16_async(self, device: int, ptr: int, value: int, count: int, stream: StreamHandle) -> None:
        """Stream-ordered fill of ``count`` 16-bit words (``ptr`` 2-byte aligned)."""

    @abc.abstractmethod
    def memset_d32_async(self, device: int, ptr: int, value: int, count: int, stream: StreamHandle) -> None:
        """Stream-ordered fill of ``count`` 32-bit words (``ptr`` 4-byte aligned)."""

    @abc.abstractmethod
    def pointer_device(self, ptr: int) -> int | None:
        """Device ordinal owning device pointer ``ptr``; None for host or unknown memory."""

    @abc.abstractmethod
    def ipc_mem_handle(self, ptr: int) -> bytes:
        """IPC handle (64 bytes, a CUipcMemHandle) of the device allocation starting at ``ptr``.

        Parameters
        ----------
        ptr : int
            The base address of a :meth:`mem_alloc` allocation.

        Returns
        -------
        bytes
            :data:`IPC_HANDLE_SIZE` bytes another process can open (cuIpcOpenMemHandle).

        Raises
        ------
        cudalab.CudaError
            For memory the driver cannot share (``CUDA_ERROR_INVALID_VALUE``: not the start
            of a cuMemAlloc allocation, such as pool, virtual or host memory).
        """

    # ---------------------------------------------------------------- streams
    @abc.abstractmethod
    def null_stream(self, device: int) -> StreamHandle:
        """Handle of the legacy default stream (handle value 0)."""

    @abc.abstractmethod
    def stream_create(self, device: int, flags: int = STREAM_NON_BLOCKING, priority: int = 0) -> StreamHandle:
        """A new stream on ``device``; ``priority`` is clamped to the device's range."""

    @abc.abstractmethod
    def stream_from_int(self, device: int, value: int) -> StreamHandle:
        """Wrap a stream created elsewhere (CuPy, torch, raw bindings) given its C value.

        The handle is not owned: never pass it to :meth:`stream_destroy`. ``value`` 0 is the
        null stream, 1 the legacy stream, 2 the per-thread default stream.
        """

    @abc.abstractmethod
    def stream_destroy(self, stream: StreamHandle) -> None:
        """Destroy a stream made by :meth:`stream_create`."""

    @abc.abstractmethod
    def stream_query(self, stream: StreamHandle) -> bool:
        """True when all work queued on ``stream`` has completed."""

    @abc.abstractmethod
    def stream_synchronize(self, stream: StreamHandle) -> None:
        """Block the host until ``stream`` is idle."""

    @abc.abstractmethod
    def stream_wait_event(self, stream: StreamHandle, event: EventHandle) -> None:
        """Make future work on ``stream`` wait for ``event`` (no host sync)."""

    @abc.abstractmethod
    def stream_priority(self, stream: StreamHandle) -> int:
        """The stream's (clamped) priority."""

    @abc.abstractmethod
    def stream_priority_range(self, device: int) -> tuple[int, int]:
        """(least, greatest) priority; greatest is numerically smallest, e.g. (0, -5)."""

    @abc.abstractmethod
    def stream_is_capturing(self, stream: StreamHandle) -> bool:
        """True while ``stream`` is being captured into a CUDA graph."""

    # ---------------------------------------------------------------- events
    @abc.abstractmethod
    def event_create(self, device: int, flags: int = EVENT_DISABLE_TIMING) -> EventHandle:
        """A new event on ``device`` with CU_EVENT_* ``flags``."""

    @abc.abstractmethod
    def event_destroy(self, event: EventHandle) -> None:
        """Destroy an event."""

    @abc.abstractmethod
    def event_record(self, event: EventHandle, stream: StreamHandle) -> None:
        """Record ``event`` on ``stream``. Hot path: no allocation, no logging."""

    @abc.abstractmethod
    def event_record_with_flags(self, event: EventHandle, stream: StreamHandle,
                                flags: int) -> None:
        """Record ``event`` on ``stream`` with CU_EVENT_RECORD_* ``flags``
        (:data:`EVENT_RECORD_EXTERNAL`: an event-record node when ``stream`` captures)."""

    @abc.abstractmethod
    def event_query(self, event: EventHandle) -> bool:
        """True when the event has completed (or was never recorded)."""

    @abc.abstractmethod
    def event_synchronize(self, event: EventHandle) -> None:
        """Block the host until the event completes."""

    @abc.abstractmethod
    def event_elapsed_time(self, start: EventHandle, end: EventHandle) -> float:
        """Milliseconds between two completed timing events."""

    @abc.abstractmethod
    def ipc_event_handle(self, event: EventHandle) -> bytes:
        """IPC handle (64 bytes) of an event created with EVENT_INTERPROCESS."""

    @abc.abstractmethod
    def ipc_open_event(self, device: int, handle: bytes) -> EventHandle:
        """Open an event exported by another process."""

    # ---------------------------------------------------------------- modules and kernels
    @abc.abstractmethod
    def module_load(self, device: int, image: bytes) -> ModuleHandle:
        """Load a CUBIN image into ``device``'s context."""

    @abc.abstractmethod
    def module_unload(self, module: ModuleHandle) -> None:
        """Unload a module."""

    @abc.abstractmethod
    def module_function(self, module: ModuleHandle, name: str) -> FunctionHandle:
        """Look up a ``extern "C"`` kernel by name."""

    @abc.abstractmethod
    def make_args(self, signature: Sequence[str]) -> KernelArgs:
        """A reusable argument pack for a kernel with the given parameter types.

        Types: "p" (pointer), "i4", "u4", "i8", "u8", "f4", "f8".
        """

    @abc.abstractmethod
    def launch(
        self,
        function: FunctionHandle,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: StreamHandle,
        args: KernelArgs,
    ) -> None:
        """Launch ``function`` on ``stream`` with a packed argument list."""

    def launch_values(
        self,
        function: FunctionHandle,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: StreamHandle,
        args: KernelArgs,
        values: Sequence[Any],
    ) -> None:
        """``launch(function, grid, block, shared_mem, stream, args.set(*values))``: the
        kernel launch path's one seam call (the real backend does both in C)."""
        self.launch(function, grid, block, shared_mem, stream, args.set(*values))

    def launch_values_programmatic(
        self,
        function: FunctionHandle,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: StreamHandle,
        args: KernelArgs,
        values: Sequence[Any],
    ) -> None:
        """:meth:`launch_values` with programmatic dependent launch allowed (the launch
        attribute ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``, compute
        capability 9.0+): the kernel may begin before the stream's previous kernel has ended
        and must wait for it (``griddepcontrol.wait``) before touching memory. Only an
        optimisation: a backend without it (the simulator, the real backend without its C
        calls) launches as :meth:`launch_values` does, with the same results."""
        self.launch_values(function, grid, block, shared_mem, stream, args, values)

    # ---------------------------------------------------------------- virtual memory (VMM)
    # Used by expandable segments: reserve a large address range once, then map physical
    # pages into it on demand (cuMemAddressReserve / cuMemCreate / cuMemMap).
    def vmm_granularity(self, device: int) -> int:
        """Minimum page size for :meth:`vmm_create` on ``device`` (2 MiB on current GPUs)."""
        raise NotImplementedError(f"{self.name} backend has no virtual memory management")

    def vmm_reserve(self, device: int, size: int) -> int:
        """Reserve ``size`` bytes of device virtual address space (no memory behind it)."""
        raise NotImplementedError(f"{self.name} backend has no virtual memory management")

    def vmm_free_address(self, ptr: int, size: int) -> None:
        """Return a range from :meth:`vmm_reserve` (everything must be unmapped)."""
        raise NotImplementedError(f"{self.name} backend has no virtual memory management")

    def vmm_create(self, device: int, size: int) -> PhysicalMemoryHandle:
        """Allocate ``size`` bytes of physical device memory (a multiple of the granularity).

        Raises OutOfMemoryError when the device is full.
        """
        raise NotImplementedError(f"{self.name} backend has no virtual memory management")

    def vmm_release(self, handle: PhysicalMemoryHandle) -> None:
        """Release physical memory from :meth:`vmm_create` (after unmapping)."""
        raise NotImplementedError(f"{self.name} backend has no virtual memory management")

    def vmm_map(self, device: int, ptr: int, size: int, handle: PhysicalMemoryHandle) -> None:
        """Map ``handle`` at ``ptr`` and make it read/write for ``device``."""
        raise NotImplementedError(f"{self.name} backend has no virtual memory management")

    def vmm_unmap(self, ptr: int, size: int) -> None:
        """Unmap a range mapped by :meth:`vmm_map` (the caller synchronises first)."""
        raise NotImplementedError(f"{self.name} backend has no virtual memory management")

    # ---------------------------------------------------------------- stream-ordered pools
    # Used by the cudaMallocAsync allocator backend: a private cuMemPool per device with an
    # unlimited release threshold, its usage read from pool attributes.
    def pool_create(self, device: int) -> MemoryPoolHandle:
        """A new memory pool on ``device`` that keeps freed memory cached."""
        raise NotImplementedError(f"{self.name} backend has no memory pools")

    def pool_destroy(self, pool: MemoryPoolHandle) -> None:
        """Destroy a pool (all its allocations must be freed)."""
        raise NotImplementedError(f"{self.name} backend has no memory pools")

    def pool_alloc_async(self, pool: MemoryPoolHandle, nbytes: int, stream: StreamHandle) -> int:
        """Stream-ordered allocation from ``pool``; free with :meth:`mem_free_async`."""
        raise NotImplementedError(f"{self.name} backend has no memory pools")

    def pool_usage(self, pool: MemoryPoolHandle) -> tuple[int, int, int, int]:
        """(reserved current, reserved high, used current, used high) in bytes."""
        raise NotImplementedError(f"{self.name} backend has no memory pools")

    def pool_reset_high(self, pool: MemoryPoolHandle) -> None:
        """Reset the reserved/used high-water marks to the current values."""
        raise NotImplementedError(f"{self.name} backend has no memory pools")

    def pool_trim(self, pool: MemoryPoolHandle, keep: int = 0) -> None:
        """Release cached memory above ``keep`` bytes back to the device."""
        raise NotImplementedError(f"{self.name} backend has no memory pools")

    # ---------------------------------------------------------------- stream capture, graphs
    # CUDA graphs (cudalab.graphs): a stream in capture mode records the work queued on it
    # (and on streams that join the capture by waiting on its events) instead of running it;
    # the graph it returns is instantiated once and launched any number of times. Failures
    # of the capture rules raise StreamCaptureError (CUDA_ERROR_STREAM_CAPTURE_*).
    def stream_begin_capture(self, stream: StreamHandle, mode: int = CAPTURE_MODE_GLOBAL) -> None:
        """Put ``stream`` in capture mode (cuStreamBeginCapture).

        Parameters
        ----------
        stream
            A stream from :meth:`stream_create` (never the null stream).
        mode : int
            ``CAPTURE_MODE_GLOBAL``, ``CAPTURE_MODE_THREAD_LOCAL`` or ``CAPTURE_MODE_RELAXED``:
            which threads' unsafe calls (synchronize, query, cuMemAlloc...) the capture
            forbids while it runs.
        """
        raise NotImplementedError(f"{self.name} backend has no stream capture")

    def stream_end_capture(self, stream: StreamHandle) -> GraphHandle:
        """End the capture begun on ``stream`` and return its graph (cuStreamEndCapture).

        Every stream that joined the capture leaves capture mode. Raises StreamCaptureError
        when the capture was invalidated (901), a forked stream was not joined back (904),
        ``stream`` did not begin a capture (903) or another thread ends a non-relaxed
        capture (908); the streams have left capture mode in every case but the last two.
        """
        raise NotImplementedError(f"{self.name} backend has no stream capture")

    def stream_capture_info(self, stream: StreamHandle) -> tuple[int, int]:
        """``(status, capture id)`` of ``stream`` (cuStreamGetCaptureInfo): status is a
        ``CAPTURE_STATUS_*``; the id is unique in the process, 0 when not capturing."""
        raise NotImplementedError(f"{self.name} backend has no stream capture")

    def thread_exchange_capture_mode(self, mode: int) -> int:
        """Set the calling thread's capture interaction mode and return the previous one
        (cuThreadExchangeStreamCaptureMode; use it push/pop, as torch's RELAXED guard)."""
        raise NotImplementedError(f"{self.name} backend has no stream capture")

    def graph_instantiate(self, graph: GraphHandle,
                          flags: int = GRAPH_INSTANTIATE_AUTO_FREE_ON_LAUNCH
                          | GRAPH_INSTANTIATE_USE_NODE_PRIORITY) -> GraphExecHandle:
        """An executable graph of ``graph`` (cuGraphInstantiate with ``flags``)."""
        raise NotImplementedError(f"{self.name} backend has no graphs")

    def graph_launch(self, graph_exec: GraphExecHandle, stream: StreamHandle) -> None:
        """Run an executable graph on ``stream``, ordered after the work queued on it."""
        raise NotImplementedError(f"{self.name} backend has no graphs")

    def graph_destroy(self, graph: GraphHandle) -> None:
        """Destroy a graph from :meth:`stream_end_capture` (its executables stay valid)."""
        raise NotImplementedError(f"{self.name} backend has no graphs")

    def graph_exec_destroy(self, graph_exec: GraphExecHandle) -> None:
        """Destroy an executable graph (freed when a launch in flight completes)."""
        raise NotImplementedError(f"{self.name} backend has no graphs")

    def graph_node_count(self, graph: GraphHandle) -> int:
        """How many nodes ``graph`` has (cuGraphGetNodes with no array: one call)."""
        raise NotImplementedError(f"{self.name} backend has no graphs")

    def graph_node_kinds(self, graph: GraphHandle) -> list[str]:
        """The kind of each node of ``graph`` (names from :data:`GRAPH_NODE_KINDS`)."""
        raise NotImplementedError(f"{self.name} backend has no graphs")

    def graph_debug_dot_print(self, graph: GraphHandle, path: str) -> None:
        """Write ``graph`` as a verbose DOT file at ``path`` (cuGraphDebugDotPrint)."""
        raise NotImplementedError(f"{self.name} backend has no graphs")

    # ---------------------------------------------------------------- NVML
    @abc.abstractmethod
    def nvml(self) -> Nvml:
        """The management library beside this driver (may raise NvmlError on use)."""

    # ---------------------------------------------------------------- NCCL
    @abc.abstractmethod
    def nccl(self) -> Nccl:
        """The collective library beside this driver (NCCL over ``nccl4py``'s raw bindings,
        or the simulator's numpy cliques). Raises :class:`cudalab.NcclError` with a readable
        message when NCCL cannot be loaded (e.g. ``nccl4py`` is not installed)."""

    # ---------------------------------------------------------------- cuBLAS and cuFFT
    @abc.abstractmethod
    def blas(self) -> Blas:
        """The BLAS library beside this driver (cuBLAS through ctypes, or the simulator's
        numpy GEMM). Its calls raise :class:`cudalab.CublasError` with a readable message
        when cuBLAS cannot be loaded."""

    @abc.abstractmethod
    def fft(self) -> Fft:
        """The FFT library beside this driver (cuFFT through ctypes, or the simulator's
        ``numpy.fft``). Its calls raise :class:`cudalab.CufftError` naming the ``fft`` extra
        when cuFFT cannot be loaded."""
