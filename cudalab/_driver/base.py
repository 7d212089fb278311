"""The driver seam: the one narrow interface between cudalab and a CUDA driver.

Everything above this package (devices, streams, the allocator, RNG, magics, widgets) talks
to a :class:`Backend` and never imports ``cuda.bindings`` or NVML itself. Two implementations
exist: :mod:`cudalab._driver.cuda` over ``cuda.bindings.driver`` and
:mod:`cudalab._driver.sim` (host memory, host clocks, numpy kernels), chosen explicitly
with ``CUDALAB_SIMULATOR=1`` or :func:`cudalab.use_simulator`.

Conventions shared by both implementations (the tests in ``tests/`` check them on both):

* Handles (streams, events, modules, functions) are opaque values owned by the caller, who
  must destroy them. The layer above never inspects them except through
  :meth:`Backend.handle_int`. The null (legacy default) stream is the handle returned by
  :meth:`Backend.null_stream`.
* Device pointers and host pointers are plain ``int`` addresses; copies use unified
  addressing, so one :meth:`memcpy` serves H2D, D2H, D2D and peer copies.
* Calls that need a context take the device ordinal explicitly (``device``) and make that
  device's primary context current on the calling thread if it is not already. Calls that
  take only a stream or event handle need no context, except on the null stream, where the
  caller must first make the stream's device current with :meth:`set_context`.
* Failures raise :class:`cudalab.CudaError` (out of memory: :class:`CudaOutOfMemory`,
  a subclass the allocator catches to run its retry ladder). Queries that can be "not ready"
  return ``False`` instead of raising.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from cudalab.errors import NcclError

# Stream flags (values of CU_STREAM_*).
STREAM_DEFAULT = 0
STREAM_NON_BLOCKING = 1

# Event flags (values of CU_EVENT_*).
EVENT_DEFAULT = 0
EVENT_BLOCKING_SYNC = 1
EVENT_DISABLE_TIMING = 2
EVENT_INTERPROCESS = 4

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

#: Status values returned by :class:`FastPaths` callables (CUresult numbering).
STATUS_SUCCESS = 0
STATUS_NOT_READY = 600


class FastPaths(NamedTuple):
    """Unchecked callables for the hottest calls, each returning a tuple ``(status, ...)``.

    ``Event.record``/``query`` and ``Stream.query`` call these directly, saving a Python
    frame per call (the real backend hands out the cuda.bindings functions themselves).
    A non-zero status other than STATUS_NOT_READY is turned into an exception with
    :meth:`Backend.status_error`.
    """

    event_record: Callable[[Any, Any], tuple]
    event_query: Callable[[Any], tuple]
    stream_query: Callable[[Any], tuple]
    #: ``(status, milliseconds)``; %cuda_timed reads one per repeat after its loop
    event_elapsed_time: Callable[[Any, Any], tuple]


class ClosedHandle:
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
        self.owner = owner

    def error(self) -> RuntimeError:
        """The error every use of the handle raises."""
        return RuntimeError(f"{self.owner} was closed: it can no longer be used")

    def __int__(self) -> int:
        raise self.error()

    __index__ = __int__

    def __repr__(self) -> str:
        return f"<closed handle of {self.owner}>"


@dataclass(frozen=True)
class DeviceInfo:
    """Static properties of one device, read once (torch's ``_CudaDeviceProperties`` fields)."""

    ordinal: int
    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int
    uuid: str  # "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (NVML's spelling)
    pci_bus_id: str  # "0000:00:06.0"
    pci_domain_id: int
    pci_device_id: int
    l2_cache_size: int
    max_threads_per_multi_processor: int
    max_threads_per_block: int
    warp_size: int
    regs_per_multiprocessor: int
    shared_memory_per_block: int
    shared_memory_per_block_optin: int
    shared_memory_per_multiprocessor: int
    clock_rate: int  # kHz
    memory_clock_rate: int  # kHz
    memory_bus_width: int  # bits
    is_integrated: bool
    is_multi_gpu_board: bool
    unified_addressing: bool
    simulated: bool = False
    extra: dict = field(default_factory=dict, compare=False, hash=False)


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

    def handle_int(self, handle: Any) -> int:
        """The C value of a stream/event/module handle, as an int."""
        return int(handle)

    def fast_paths(self) -> FastPaths:
        """Status-returning callables for the hot paths (default: wrap the checked methods)."""

        from cudalab.errors import CudaError

        last = self._last_fast_error = threading.local()

        def guarded(fn: Callable[..., bool | None]) -> Callable[..., tuple]:
            def call(*args: Any) -> tuple:
                try:
                    done = fn(*args)
                except CudaError as exc:  # keep the full exception for status_error()
                    last.exc = exc
                    return (exc.code,)
                return (STATUS_SUCCESS,) if done is not False else (STATUS_NOT_READY,)

            return call

        eet = self.event_elapsed_time

        def elapsed(start: Any, end: Any) -> tuple:
            try:
                return (STATUS_SUCCESS, eet(start, end))
            except CudaError as exc:
                last.exc = exc
                return (exc.code, 0.0)

        return FastPaths(guarded(self.event_record), guarded(self.event_query),
                         guarded(self.stream_query), elapsed)

    def status_error(self, status: int, call: str) -> Exception:
        """The exception for a failed status returned by a :class:`FastPaths` callable."""
        from cudalab.errors import CudaError

        last = getattr(self, "_last_fast_error", None)
        exc = getattr(last, "exc", None) if last is not None else None
        if last is not None and exc is not None and exc.code == int(status):
            last.exc = None
            return exc
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
    def mem_alloc_async(self, device: int, nbytes: int, stream: Any) -> int:
        """Stream-ordered allocation from the device's default pool (cuMemAllocAsync)."""

    @abc.abstractmethod
    def mem_free_async(self, device: int, ptr: int, stream: Any) -> None:
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
    def memcpy_async(self, device: int, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """Stream-ordered copy between any two addresses (host, device or peer)."""

    @abc.abstractmethod
    def memcpy_peer_async(
        self, dst: int, dst_device: int, src: int, src_device: int, nbytes: int, stream: Any
    ) -> None:
        """Copy between two devices' memory on ``stream`` (works without peer access)."""

    def memcpy_ordered(self, dst: int, src: int, nbytes: int, copy_device: int,
                       copy_stream: Any, copy_event: Any, peer_device: int, peer_stream: Any,
                       peer_event: Any, join: bool = True) -> None:
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
    def memset_d8_async(self, device: int, ptr: int, value: int, nbytes: int, stream: Any) -> None:
        """Stream-ordered byte fill."""

    @abc.abstractmethod
    def memset_d32_async(self, device: int, ptr: int, value: int, count: int, stream: Any) -> None:
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
    def null_stream(self, device: int) -> Any:
        """Handle of the legacy default stream (handle value 0)."""

    @abc.abstractmethod
    def stream_create(self, device: int, flags: int = STREAM_NON_BLOCKING, priority: int = 0) -> Any:
        """A new stream on ``device``; ``priority`` is clamped to the device's range."""

    @abc.abstractmethod
    def stream_from_int(self, device: int, value: int) -> Any:
        """Wrap a stream created elsewhere (CuPy, torch, raw bindings) given its C value.

        The handle is not owned: never pass it to :meth:`stream_destroy`. ``value`` 0 is the
        null stream, 1 the legacy stream, 2 the per-thread default stream.
        """

    @abc.abstractmethod
    def stream_destroy(self, stream: Any) -> None:
        """Destroy a stream made by :meth:`stream_create`."""

    @abc.abstractmethod
    def stream_query(self, stream: Any) -> bool:
        """True when all work queued on ``stream`` has completed."""

    @abc.abstractmethod
    def stream_synchronize(self, stream: Any) -> None:
        """Block the host until ``stream`` is idle."""

    @abc.abstractmethod
    def stream_wait_event(self, stream: Any, event: Any) -> None:
        """Make future work on ``stream`` wait for ``event`` (no host sync)."""

    @abc.abstractmethod
    def stream_priority(self, stream: Any) -> int:
        """The stream's (clamped) priority."""

    @abc.abstractmethod
    def stream_priority_range(self, device: int) -> tuple[int, int]:
        """(least, greatest) priority; greatest is numerically smallest, e.g. (0, -5)."""

    @abc.abstractmethod
    def stream_is_capturing(self, stream: Any) -> bool:
        """True while ``stream`` is being captured into a CUDA graph."""

    # ---------------------------------------------------------------- events
    @abc.abstractmethod
    def event_create(self, device: int, flags: int = EVENT_DISABLE_TIMING) -> Any:
        """A new event on ``device`` with CU_EVENT_* ``flags``."""

    @abc.abstractmethod
    def event_destroy(self, event: Any) -> None:
        """Destroy an event."""

    @abc.abstractmethod
    def event_record(self, event: Any, stream: Any) -> None:
        """Record ``event`` on ``stream``. Hot path: no allocation, no logging."""

    @abc.abstractmethod
    def event_query(self, event: Any) -> bool:
        """True when the event has completed (or was never recorded)."""

    @abc.abstractmethod
    def event_synchronize(self, event: Any) -> None:
        """Block the host until the event completes."""

    @abc.abstractmethod
    def event_elapsed_time(self, start: Any, end: Any) -> float:
        """Milliseconds between two completed timing events."""

    @abc.abstractmethod
    def ipc_event_handle(self, event: Any) -> bytes:
        """IPC handle (64 bytes) of an event created with EVENT_INTERPROCESS."""

    @abc.abstractmethod
    def ipc_open_event(self, device: int, handle: bytes) -> Any:
        """Open an event exported by another process."""

    # ---------------------------------------------------------------- modules and kernels
    @abc.abstractmethod
    def module_load(self, device: int, image: bytes) -> Any:
        """Load a CUBIN image into ``device``'s context."""

    @abc.abstractmethod
    def module_unload(self, module: Any) -> None:
        """Unload a module."""

    @abc.abstractmethod
    def module_function(self, module: Any, name: str) -> Any:
        """Look up a ``extern "C"`` kernel by name."""

    @abc.abstractmethod
    def make_args(self, signature: Sequence[str]) -> KernelArgs:
        """A reusable argument pack for a kernel with the given parameter types.

        Types: "p" (pointer), "i4", "u4", "i8", "u8", "f4", "f8".
        """

    @abc.abstractmethod
    def launch(
        self,
        function: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: Any,
        args: KernelArgs,
    ) -> None:
        """Launch ``function`` on ``stream`` with a packed argument list."""

    def launch_values(
        self,
        function: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: Any,
        args: KernelArgs,
        values: Sequence[Any],
    ) -> None:
        """``launch(function, grid, block, shared_mem, stream, args.set(*values))``: the
        kernel launch path's one seam call (the real backend does both in C)."""
        self.launch(function, grid, block, shared_mem, stream, args.set(*values))

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

    def vmm_create(self, device: int, size: int) -> Any:
        """Allocate ``size`` bytes of physical device memory (a multiple of the granularity).

        Raises OutOfMemoryError when the device is full.
        """
        raise NotImplementedError(f"{self.name} backend has no virtual memory management")

    def vmm_release(self, handle: Any) -> None:
        """Release physical memory from :meth:`vmm_create` (after unmapping)."""
        raise NotImplementedError(f"{self.name} backend has no virtual memory management")

    def vmm_map(self, device: int, ptr: int, size: int, handle: Any) -> None:
        """Map ``handle`` at ``ptr`` and make it read/write for ``device``."""
        raise NotImplementedError(f"{self.name} backend has no virtual memory management")

    def vmm_unmap(self, ptr: int, size: int) -> None:
        """Unmap a range mapped by :meth:`vmm_map` (the caller synchronises first)."""
        raise NotImplementedError(f"{self.name} backend has no virtual memory management")

    # ---------------------------------------------------------------- stream-ordered pools
    # Used by the cudaMallocAsync allocator backend: a private cuMemPool per device with an
    # unlimited release threshold, its usage read from pool attributes.
    def pool_create(self, device: int) -> Any:
        """A new memory pool on ``device`` that keeps freed memory cached."""
        raise NotImplementedError(f"{self.name} backend has no memory pools")

    def pool_destroy(self, pool: Any) -> None:
        """Destroy a pool (all its allocations must be freed)."""
        raise NotImplementedError(f"{self.name} backend has no memory pools")

    def pool_alloc_async(self, pool: Any, nbytes: int, stream: Any) -> int:
        """Stream-ordered allocation from ``pool``; free with :meth:`mem_free_async`."""
        raise NotImplementedError(f"{self.name} backend has no memory pools")

    def pool_usage(self, pool: Any) -> tuple[int, int, int, int]:
        """(reserved current, reserved high, used current, used high) in bytes."""
        raise NotImplementedError(f"{self.name} backend has no memory pools")

    def pool_reset_high(self, pool: Any) -> None:
        """Reset the reserved/used high-water marks to the current values."""
        raise NotImplementedError(f"{self.name} backend has no memory pools")

    def pool_trim(self, pool: Any, keep: int = 0) -> None:
        """Release cached memory above ``keep`` bytes back to the device."""
        raise NotImplementedError(f"{self.name} backend has no memory pools")

    # ---------------------------------------------------------------- stream capture, graphs
    # CUDA graphs (cudalab.graphs): a stream in capture mode records the work queued on it
    # (and on streams that join the capture by waiting on its events) instead of running it;
    # the graph it returns is instantiated once and launched any number of times. Failures
    # of the capture rules raise StreamCaptureError (CUDA_ERROR_STREAM_CAPTURE_*).
    def stream_begin_capture(self, stream: Any, mode: int = CAPTURE_MODE_GLOBAL) -> None:
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

    def stream_end_capture(self, stream: Any) -> Any:
        """End the capture begun on ``stream`` and return its graph (cuStreamEndCapture).

        Every stream that joined the capture leaves capture mode. Raises StreamCaptureError
        when the capture was invalidated (901), a forked stream was not joined back (904),
        ``stream`` did not begin a capture (903) or another thread ends a non-relaxed
        capture (908); the streams have left capture mode in every case but the last two.
        """
        raise NotImplementedError(f"{self.name} backend has no stream capture")

    def stream_capture_info(self, stream: Any) -> tuple[int, int]:
        """``(status, capture id)`` of ``stream`` (cuStreamGetCaptureInfo): status is a
        ``CAPTURE_STATUS_*``; the id is unique in the process, 0 when not capturing."""
        raise NotImplementedError(f"{self.name} backend has no stream capture")

    def thread_exchange_capture_mode(self, mode: int) -> int:
        """Set the calling thread's capture interaction mode and return the previous one
        (cuThreadExchangeStreamCaptureMode; use it push/pop, as torch's RELAXED guard)."""
        raise NotImplementedError(f"{self.name} backend has no stream capture")

    def graph_instantiate(self, graph: Any,
                          flags: int = GRAPH_INSTANTIATE_AUTO_FREE_ON_LAUNCH
                          | GRAPH_INSTANTIATE_USE_NODE_PRIORITY) -> Any:
        """An executable graph of ``graph`` (cuGraphInstantiate with ``flags``)."""
        raise NotImplementedError(f"{self.name} backend has no graphs")

    def graph_launch(self, graph_exec: Any, stream: Any) -> None:
        """Run an executable graph on ``stream``, ordered after the work queued on it."""
        raise NotImplementedError(f"{self.name} backend has no graphs")

    def graph_destroy(self, graph: Any) -> None:
        """Destroy a graph from :meth:`stream_end_capture` (its executables stay valid)."""
        raise NotImplementedError(f"{self.name} backend has no graphs")

    def graph_exec_destroy(self, graph_exec: Any) -> None:
        """Destroy an executable graph (freed when a launch in flight completes)."""
        raise NotImplementedError(f"{self.name} backend has no graphs")

    def graph_node_count(self, graph: Any) -> int:
        """How many nodes ``graph`` has (cuGraphGetNodes with no array: one call)."""
        raise NotImplementedError(f"{self.name} backend has no graphs")

    def graph_node_kinds(self, graph: Any) -> list[str]:
        """The kind of each node of ``graph`` (names from :data:`GRAPH_NODE_KINDS`)."""
        raise NotImplementedError(f"{self.name} backend has no graphs")

    def graph_debug_dot_print(self, graph: Any, path: str) -> None:
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


class KernelArgs(abc.ABC):
    """A packed kernel parameter list: set values, then pass to :meth:`Backend.launch`.

    Packing once and reusing the pack keeps the launch hot path free of per-call encoding.
    """

    signature: tuple[str, ...]

    @abc.abstractmethod
    def set(self, *values: Any) -> KernelArgs:
        """Store one value per parameter (in signature order); returns self."""

    @property
    @abc.abstractmethod
    def values(self) -> tuple:
        """The values last stored, as Python numbers."""


class Nvml(abc.ABC):
    """Device management queries (NVML), keyed by the CUDA device's UUID string.

    Every method may raise :class:`cudalab.NvmlError` with a readable message (library
    missing, driver not loaded, query not supported on this device).
    """

    simulated: bool = False

    @abc.abstractmethod
    def device_count(self) -> int:
        """Devices NVML sees (all of them, ignoring CUDA_VISIBLE_DEVICES)."""

    @abc.abstractmethod
    def uuids(self) -> list[str]:
        """UUIDs in NVML index order."""

    @abc.abstractmethod
    def utilization(self, uuid: str) -> tuple[int, int]:
        """(gpu %, memory %) over the last sample period."""

    @abc.abstractmethod
    def memory_info(self, uuid: str) -> tuple[int, int, int]:
        """(total, free, used) bytes for the whole device."""

    @abc.abstractmethod
    def temperature(self, uuid: str) -> int:
        """GPU temperature in degrees C."""

    @abc.abstractmethod
    def power_usage(self, uuid: str) -> int:
        """Power draw in milliwatts."""

    @abc.abstractmethod
    def clock_sm(self, uuid: str) -> int:
        """Current SM clock in MHz."""

    @abc.abstractmethod
    def processes(self, uuid: str) -> list[tuple[int, int | None]]:
        """Compute processes as (pid, used bytes or None when NVML cannot tell)."""

    @abc.abstractmethod
    def clock_event_reasons(self, uuid: str) -> int | None:
        """NVML's clocks-event-reasons bit mask (``nvmlDeviceGetCurrentClocksEventReasons``:
        what limits the device's clocks now, e.g. 0x4 SW power cap, 0x40 HW thermal
        slowdown), or None where there is no such mask to read (the simulator has no clock
        limits; a ``pynvml`` without the call)."""


# NCCL data types (ncclDataType_t) and reduction operators (ncclRedOp_t), as NCCL numbers them.
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
NCCL_FLOAT8E4M3, NCCL_FLOAT8E5M2 = 10, 11
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4

#: numpy's name of each NCCL data type (ml_dtypes' names for bfloat16 and the float8 types).
NCCL_NUMPY_NAMES = {
    NCCL_INT8: "int8", NCCL_UINT8: "uint8", NCCL_INT32: "int32", NCCL_UINT32: "uint32",
    NCCL_INT64: "int64", NCCL_UINT64: "uint64", NCCL_FLOAT16: "float16",
    NCCL_FLOAT32: "float32", NCCL_FLOAT64: "float64", NCCL_BFLOAT16: "bfloat16",
    NCCL_FLOAT8E4M3: "float8_e4m3fn", NCCL_FLOAT8E5M2: "float8_e5m2",
}

#: Size in bytes of an NCCL unique id (ncclUniqueId).
NCCL_UNIQUE_ID_SIZE = 128

#: The collectives :meth:`Nccl.group_call` issues, numbered as the real backend's C group call
#: numbers them (cudalab/_driver/_ncclcall.c; tests/driver/test_ncclcall.py compares the two).
NCCL_CALL_ALL_REDUCE, NCCL_CALL_BROADCAST, NCCL_CALL_REDUCE = 0, 1, 2
NCCL_CALL_ALL_GATHER, NCCL_CALL_REDUCE_SCATTER = 3, 4
#: Each collective's name in NCCL's C API (error messages say which call failed).
NCCL_CALL_NAMES = ("ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather",
                   "ncclReduceScatter")

#: What :meth:`Nccl.group_runner` returns: ``run(call, count, dtype, op, root, sends, recvs,
#: streams)``, one collective on every rank of the clique it was made for.
GroupRunner = Callable[[int, int, int, int, int, Sequence[int], Sequence[int], Sequence[Any]],
                       None]

#: ncclResult_t: code -> (name, ncclGetErrorString's text), as nccl.h and NCCL spell them.
NCCL_RESULTS = {
    0: ("ncclSuccess", "no error"),
    1: ("ncclUnhandledCudaError", "unhandled cuda error (run with NCCL_DEBUG=INFO for details)"),
    2: ("ncclSystemError", "unhandled system error (run with NCCL_DEBUG=INFO for details)"),
    3: ("ncclInternalError", "internal error - please report this issue to the NCCL developers"),
    4: ("ncclInvalidArgument", "invalid argument (run with NCCL_DEBUG=WARN for details)"),
    5: ("ncclInvalidUsage", "invalid usage (run with NCCL_DEBUG=WARN for details)"),
    6: ("ncclRemoteError", "remote process exited or there was a network error"),
    7: ("ncclInProgress", "NCCL operation in progress"),
}


class Nccl(abc.ABC):
    """NCCL, the collective library, at the level of its C API (pointers, counts, handles).

    Conventions:

    * Communicators are opaque handles owned by the caller, who ends them with
      :meth:`comm_finalize` and :meth:`comm_destroy` (or :meth:`comm_abort` after an error).
    * Buffers are device pointers (``int``); counts are in elements of ``dtype`` (an
      ``NCCL_*`` type above); ``stream`` is a :class:`Backend` stream handle on the
      communicator's device. In-place operations pass the same pointer twice.
    * Several ranks driven by one thread (a single-process clique from
      :meth:`comm_init_all`) must issue their calls between :meth:`group_start` and
      :meth:`group_end`, or NCCL waits forever for the peers; callers always group them.
    * Failures raise :class:`cudalab.NcclError` carrying NCCL's result code, its name and
      NCCL's own message (``ncclGetLastError`` where it says more).
    """

    simulated: bool = False

    @abc.abstractmethod
    def version(self) -> int:
        """NCCL's version as NCCL packs it: ``major * 10000 + minor * 100 + patch``."""

    @abc.abstractmethod
    def unique_id(self) -> bytes:
        """A fresh ``ncclUniqueId`` (:data:`NCCL_UNIQUE_ID_SIZE` bytes) for :meth:`comm_init_rank`."""

    @abc.abstractmethod
    def comm_init_all(self, devices: Sequence[int]) -> list[Any]:
        """One communicator per device of a single-process clique; rank ``i`` is ``devices[i]``
        (pairwise distinct). Leaves the calling thread's current context as it was."""

    @abc.abstractmethod
    def comm_init_rank(self, device: int, nranks: int, unique_id: bytes, rank: int) -> Any:
        """This process's rank of an ``nranks`` communicator bootstrapped by ``unique_id``,
        bound to ``device``. Blocks until every rank has joined (a collective call)."""

    @abc.abstractmethod
    def comm_finalize(self, comm: Any) -> None:
        """Flush the communicator's pending work (collective over its ranks; group it)."""

    @abc.abstractmethod
    def comm_destroy(self, comm: Any) -> None:
        """Free the communicator's resources (after :meth:`comm_finalize`)."""

    @abc.abstractmethod
    def comm_abort(self, comm: Any) -> None:
        """Abandon the communicator's pending work and free it (after an error)."""

    @abc.abstractmethod
    def comm_async_error(self, comm: Any) -> int:
        """The communicator's asynchronous error code (0: none), never raising."""

    @abc.abstractmethod
    def error_text(self, code: int, comm: Any = None) -> str:
        """NCCL's description of result ``code`` (``ncclGetErrorString``), followed by
        ``comm``'s last error message (``ncclGetLastError``) when NCCL keeps one. Never raises."""

    @abc.abstractmethod
    def comm_rank(self, comm: Any) -> int:
        """The communicator's rank."""

    @abc.abstractmethod
    def comm_count(self, comm: Any) -> int:
        """The communicator's number of ranks."""

    @abc.abstractmethod
    def comm_device(self, comm: Any) -> int:
        """The device ordinal the communicator is bound to."""

    @abc.abstractmethod
    def group_start(self) -> None:
        """Open a group: the calls until :meth:`group_end` are launched together."""

    @abc.abstractmethod
    def group_end(self) -> None:
        """Close the group opened by :meth:`group_start` and launch its calls."""

    @abc.abstractmethod
    def all_reduce(self, send: int, recv: int, count: int, dtype: int, op: int, comm: Any,
                   stream: Any) -> None:
        """``recv = op(send of every rank)`` on every rank."""

    @abc.abstractmethod
    def broadcast(self, send: int, recv: int, count: int, dtype: int, root: int, comm: Any,
                  stream: Any) -> None:
        """``recv = send of root`` on every rank (``send`` is read on the root only)."""

    @abc.abstractmethod
    def reduce(self, send: int, recv: int, count: int, dtype: int, op: int, root: int,
               comm: Any, stream: Any) -> None:
        """``recv = op(send of every rank)`` on the root (``recv`` is ignored elsewhere)."""

    @abc.abstractmethod
    def all_gather(self, send: int, recv: int, send_count: int, dtype: int, comm: Any,
                   stream: Any) -> None:
        """``recv[r * send_count:(r + 1) * send_count] = send of rank r`` on every rank."""

    @abc.abstractmethod
    def reduce_scatter(self, send: int, recv: int, recv_count: int, dtype: int, op: int,
                       comm: Any, stream: Any) -> None:
        """``recv = op(send[rank * recv_count:(rank + 1) * recv_count] of every rank)``."""

    def group_call(self, call: int, count: int, dtype: int, op: int, root: int,
                   sends: Sequence[int], recvs: Sequence[int], comms: Sequence[Any],
                   streams: Sequence[Any]) -> None:
        """One collective on every rank of a single-process clique, in one group.

        Rank ``i`` runs collective ``call`` (an ``NCCL_CALL_*`` value) with ``sends[i]``,
        ``recvs[i]``, ``comms[i]`` and ``streams[i]`` and the shared ``count`` (the receive
        count of reduce_scatter, the send count of all_gather), ``dtype``, ``op`` (ignored by
        broadcast and all_gather) and ``root`` (used by broadcast and reduce only). The
        calling thread's current context is as it was afterwards. A failed call still closes
        the group, and raises its :class:`cudalab.NcclError`.

        This default makes :meth:`group_start`, the per-rank calls and :meth:`group_end`; a
        backend may make them in one step (the real one does, from C).
        """
        if not 0 <= call < len(NCCL_CALL_NAMES):
            raise ValueError(f"group_call(): unknown collective {call!r}")
        self.group_start()
        try:
            for send, recv, comm, stream in zip(sends, recvs, comms, streams):
                if call == NCCL_CALL_ALL_REDUCE:
                    self.all_reduce(send, recv, count, dtype, op, comm, stream)
                elif call == NCCL_CALL_BROADCAST:
                    self.broadcast(send, recv, count, dtype, root, comm, stream)
                elif call == NCCL_CALL_REDUCE:
                    self.reduce(send, recv, count, dtype, op, root, comm, stream)
                elif call == NCCL_CALL_ALL_GATHER:
                    self.all_gather(send, recv, count, dtype, comm, stream)
                else:
                    self.reduce_scatter(send, recv, count, dtype, op, comm, stream)
        except BaseException:
            try:
                self.group_end()  # NCCL launches nothing of a group with a failed call
            except NcclError:
                pass
            raise
        self.group_end()

    def group_runner(self, comms: Sequence[Any]) -> GroupRunner:
        """:meth:`group_call` bound to one single-process clique, for a caller that issues many
        collectives on it (:mod:`cudalab.nccl`'s communicator cache).

        Returns ``run(call, count, dtype, op, root, sends, recvs, streams)``, which does what
        ``group_call(call, count, dtype, op, root, sends, recvs, comms, streams)`` does. The
        communicators are checked here, once; ``run`` trusts its other arguments to be what
        the caller has already checked (a known ``call``, ``count`` >= 0, an NCCL data type,
        an operator and a root in range, one send, receive and stream per rank), and refuses
        a destroyed communicator. This default binds :meth:`group_call`; a backend may check
        less per call (the real one calls its C group call directly).
        """
        bound = tuple(comms)

        def run(call: int, count: int, dtype: int, op: int, root: int, sends: Sequence[int],
                recvs: Sequence[int], streams: Sequence[Any]) -> None:
            self.group_call(call, count, dtype, op, root, sends, recvs, bound, streams)

        return run

    @abc.abstractmethod
    def send(self, buffer: int, count: int, dtype: int, peer: int, comm: Any,
             stream: Any) -> None:
        """Send ``count`` elements to rank ``peer`` (which posts the matching :meth:`recv`)."""

    @abc.abstractmethod
    def recv(self, buffer: int, count: int, dtype: int, peer: int, comm: Any,
             stream: Any) -> None:
        """Receive ``count`` elements from rank ``peer``."""


#: Signature of a simulator kernel: impl(sim_backend, grid, block, shared_mem, *arg_values).
SimKernel = Callable[..., None]
