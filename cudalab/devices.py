"""Devices: lazy initialisation, the per-thread current device, device properties.

Names and semantics follow ``torch.cuda``. The current device is per thread and kept in
Python (``current_device()`` makes no driver call); the driver context is made current
only when an operation needs it (:func:`ensure_context`).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Literal

from cudalab import _driver, _observe
from cudalab._units import echo
from cudalab.errors import (
    CudaError,
    CudaUnavailableError,
    DriverNotFoundError,
    OutOfMemoryError,
    StreamCaptureError,
    name_operation,
)

if TYPE_CHECKING:
    from cudalab._driver.base import Backend, FastCalls

__all__ = [
    "Device",
    "DeviceProperties",
    "is_available",
    "is_initialized",
    "init",
    "device_count",
    "current_device",
    "set_device",
    "device",
    "device_of",
    "get_device_name",
    "get_device_capability",
    "get_device_properties",
    "is_bf16_supported",
    "is_tf32_supported",
    "can_device_access_peer",
    "mem_get_info",
    "synchronize",
    "get_arch_list",
    "get_gencode_flags",
    "ipc_collect",
    "check_error",
    "use_simulator",
]


class Device:
    """A CUDA device identifier, like ``torch.device("cuda", 1)``.

    Accepts ``Device(1)``, ``Device("cuda")``, ``Device("cuda:1")``, ``Device("cuda", 1)``.
    ``index`` is None for the bare ``"cuda"`` (meaning the current device).
    """

    __slots__ = ("type", "index")

    type: str  # always "cuda"
    index: int | None  # None: the current device

    def __init__(self, spec: Any = "cuda", index: int | None = None):
        if isinstance(spec, Device):
            dtype, didx = spec.type, spec.index
        elif isinstance(spec, int) and not isinstance(spec, bool):
            dtype, didx = "cuda", spec
        elif isinstance(spec, str):
            dtype, didx = _parse_device_string(spec)
        else:
            raise TypeError(f"expected a device index, 'cuda', 'cuda:N' or Device, got {echo(spec)}")
        if index is not None:
            if didx is not None:
                raise ValueError(f"device {echo(spec)} already has an index; got index={echo(index)} too")
            didx = index
        if didx is not None:
            if isinstance(didx, bool) or not isinstance(didx, int):
                raise TypeError(f"device index must be an int, got {echo(didx)}")
            if didx < 0:
                raise ValueError(f"device index must not be negative, got {didx}")
        self.type = dtype
        self.index = didx

    def __repr__(self) -> str:
        return f"Device({str(self)!r})"

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            try:
                other = Device(other)
            except (TypeError, ValueError):
                return NotImplemented
        if not isinstance(other, Device):
            return NotImplemented
        return self.type == other.type and self.index == other.index

    def __hash__(self) -> int:
        return hash((self.type, self.index))


#: Shared :class:`Device` objects by index (``device_object``); a Device is never mutated
#: after construction, so one object per index can be handed out to every caller.
_device_objects: list[Device] = []


def device_object(index: int) -> Device:
    """The :class:`Device` ``cuda:<index>``, one shared object per index (no validation:
    ``index`` is a valid device index the caller already holds).

    Parameters
    ----------
    index : int
        A device index (>= 0).

    Returns
    -------
    Device
        ``Device("cuda", index)``.
    """
    objs = _device_objects
    if index < len(objs):
        return objs[index]
    while len(objs) <= index:
        objs.append(Device("cuda", len(objs)))
    return objs[index]


def _parse_device_string(text: str) -> tuple[str, int | None]:
    s = text.strip()
    kind, sep, num = s.partition(":")
    if kind != "cuda":
        # torch's wording first, then ours
        shown = s if len(s) <= 40 else echo(s)  # torch's text shows the string unquoted
        raise ValueError(f"Expected a cuda device, but got: {shown} (cudalab takes 'cuda', "
                         f"'cuda:N', a device index or a Device)")
    if not sep:
        return "cuda", None
    if num[:1] == "-" and num[1:].isdigit():  # torch: "Device index must not be negative"
        raise ValueError(f"invalid device string {echo(text)}: the device index must not be "
                         "negative")
    if not num.isdigit():
        raise ValueError(f"invalid device string {echo(text)}: the index after 'cuda:' must be a number")
    return "cuda", int(num)


def _parse_uuid(text: str) -> Any:
    """``"GPU-…"``/``"MIG-…"`` (NVML's spelling) as a :class:`uuid.UUID` (torch's type).

    ``uuid`` is imported here, not at module level, to keep ``import cudalab`` fast.
    """
    import uuid

    digits = text[4:] if text.startswith(("GPU-", "MIG-")) else text
    try:
        return uuid.UUID(digits)
    except ValueError:
        raise ValueError(f"the driver reported a malformed device UUID {text!r}") from None


class DeviceProperties:
    """Properties of one device with torch's attribute names (``_CudaDeviceProperties``).

    ``uuid`` is a :class:`uuid.UUID`, as torch's (``str()`` gives the 36-character form and
    ``.bytes`` the 16 raw bytes); ``nvml_uuid`` is the same identity in NVML's and nvidia-smi's
    spelling (``"GPU-…"``), which NVML lookups take. ``simulated`` is True on the simulator.
    """

    __slots__ = (
        "index", "name", "major", "minor", "total_memory", "multi_processor_count", "uuid",
        "nvml_uuid", "pci_bus_id", "pci_device_id", "pci_domain_id", "L2_cache_size",
        "max_threads_per_multi_processor", "max_threads_per_block", "warp_size",
        "regs_per_multiprocessor", "shared_memory_per_block", "shared_memory_per_block_optin",
        "shared_memory_per_multiprocessor", "clock_rate", "memory_clock_rate",
        "memory_bus_width", "is_integrated", "is_multi_gpu_board", "unified_addressing",
        "simulated",
    )

    def __init__(self, info):
        self.index = info.ordinal
        self.name = info.name
        self.major = info.major
        self.minor = info.minor
        self.total_memory = info.total_memory
        self.multi_processor_count = info.multi_processor_count
        #: ``uuid`` and ``nvml_uuid`` are both read from ``info.uuid``, so the two cannot drift.
        self.nvml_uuid = info.uuid
        self.uuid = _parse_uuid(info.uuid)
        self.pci_bus_id = info.pci_bus_id
        self.pci_device_id = info.pci_device_id
        self.pci_domain_id = info.pci_domain_id
        self.L2_cache_size = info.l2_cache_size
        self.max_threads_per_multi_processor = info.max_threads_per_multi_processor
        self.max_threads_per_block = info.max_threads_per_block
        self.warp_size = info.warp_size
        self.regs_per_multiprocessor = info.regs_per_multiprocessor
        self.shared_memory_per_block = info.shared_memory_per_block
        self.shared_memory_per_block_optin = info.shared_memory_per_block_optin
        self.shared_memory_per_multiprocessor = info.shared_memory_per_multiprocessor
        self.clock_rate = info.clock_rate
        self.memory_clock_rate = info.memory_clock_rate
        self.memory_bus_width = info.memory_bus_width
        self.is_integrated = info.is_integrated
        self.is_multi_gpu_board = info.is_multi_gpu_board
        self.unified_addressing = info.unified_addressing
        self.simulated = info.simulated

    @property
    def gcnArchName(self) -> str:  # noqa: N802 - torch's name
        return ""

    def __repr__(self) -> str:
        sim = ", simulated=True" if self.simulated else ""
        return (
            f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
            f"total_memory={self.total_memory // (1024 * 1024)}MB, "
            f"multi_processor_count={self.multi_processor_count}, uuid={self.uuid}, "
            f"pci_bus_id={self.pci_bus_id}, L2_cache_size={self.L2_cache_size // (1024 * 1024)}MB"
            f"{sim})"
        )


# --------------------------------------------------------------------------- state
class _ThreadState(threading.local):
    """Per-thread current device (the driver context is tracked by the backend)."""

    def __init__(self) -> None:
        self.device = 0
        #: current stream per device (owned by cudalab.streams; one TLS object keeps
        #: current_stream() to a single thread-local lookup)
        self.streams: list[Any] | None = None


# The runtime's state. Besides the torch API above, these module names (no underscore, not
# in __all__) are the friend interface of the core runtime: streams, events, the allocator,
# kernels and copies read them directly on their hot paths ("one global read"); upper layers
# use cudalab._internal instead. Only this module assigns them.

#: Per thread: ``.device`` (the current device index) and ``.streams`` (the per-device
#: current streams, owned by cudalab.streams). The same object for the life of the process.
per_thread = _ThreadState()
_init_lock = threading.RLock()
#: True once CUDA is initialised in this process (False again in a forked child); while
#: True, :func:`backend` returns at once and :data:`seam_fast_calls` is set.
initialized = False
#: True while :data:`initialized` is and the process sees exactly one device: the current
#: device is then 0 in every thread (set_device accepts no other), so the hot paths skip
#: the per-thread read (cudalab.memory's caching_allocator_alloc). Set and cleared with
#: initialized (init, the child of a fork).
sole_device = False
_in_bad_fork = False
_count = 0  # valid after init
_props: list[DeviceProperties | None] = []
#: The initialised backend: None until init, and read directly only where initialized is
#: True (the hot path of ensure_context), hence typed as set.
_backend_obj: Backend = None  # type: ignore[assignment]  # None only before init
#: The backend's fast-call registry (its unchecked hot-path callables): None until init.
seam_fast_calls: FastCalls | None = None
#: Whether a "CUDA unavailable" error already told how to run on the simulator (said once).
_hint_given = False
_SIMULATOR_HINT = "To run without a GPU, set CUDALAB_SIMULATOR=1 or call cudalab.use_simulator()."


def _after_fork_in_child() -> None:
    global initialized, _in_bad_fork, sole_device
    if initialized:
        _in_bad_fork = True
        initialized = sole_device = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def is_initialized() -> bool:
    """Whether cudalab has initialised CUDA in this process (and not lost it to a fork)."""
    return initialized and not _in_bad_fork


def init() -> None:
    """Initialise CUDA now (otherwise it happens on first use). Idempotent."""
    lazy_init()


def lazy_init() -> None:
    """Initialise CUDA unless it is (:func:`init` for cudalab's layers: one flag read)."""
    if initialized:
        return
    with _init_lock:
        _do_init()


def _do_init() -> None:
    global initialized, _count, _props, _backend_obj, seam_fast_calls, sole_device
    if initialized:
        return
    if _in_bad_fork:
        raise RuntimeError(
            "Cannot re-initialize CUDA in forked subprocess. To use CUDA with "
            "multiprocessing, you must use the 'spawn' start method"
        )
    seam = _driver.get_backend()
    try:
        seam.init()
    except DriverNotFoundError as exc:
        raise CudaUnavailableError(_unavailable(f"cudalab cannot use CUDA: {exc}")) from exc
    count = seam.device_count()
    if count <= 0:
        raise CudaUnavailableError("No CUDA GPUs are available")
    _driver.commit(seam)
    _backend_obj = seam
    seam_fast_calls = seam.fast_calls()
    _count = count
    _props = [None] * count
    sole_device = count == 1
    initialized = True


def _unavailable(reason: str) -> str:
    """``reason`` as one sentence, followed by the simulator hint the first time only."""
    global _hint_given
    text = reason.rstrip(". ") + "."
    if _hint_given:
        return text
    _hint_given = True
    return f"{text} {_SIMULATOR_HINT}"


def use_simulator(enable: bool = True) -> None:
    """Run on the simulated devices (or, with ``enable=False``, the real driver).

    Allowed as long as CUDA is not initialised (:func:`is_initialized` is False), also after
    :func:`is_available` or :func:`device_count` probed the real driver, so the fallback
    ``if not cudalab.is_available(): cudalab.use_simulator()`` works.

    Parameters
    ----------
    enable
        True for the simulator, False for the real CUDA driver.

    Raises
    ------
    RuntimeError
        CUDA is already initialised with the other backend (:func:`is_initialized` is
        True), or was initialised before this process was forked.
    """
    with _init_lock:
        current = _driver.current_backend()
        if _in_bad_fork and not (current and current.name == ("simulator" if enable else "cuda")):
            raise RuntimeError(
                "cudalab initialised CUDA before this process was forked; a forked child can "
                "neither use CUDA nor change its backend (use the 'spawn' start method)"
            )
        _driver.use_simulator(enable)


def backend() -> Backend:
    """The initialised backend (initialising CUDA on first call)."""
    if not initialized:
        lazy_init()
    return _backend_obj


# --------------------------------------------------------------------------- counting
def _count_without_init() -> int | None:
    """Device count from NVML and CUDA_VISIBLE_DEVICES, without creating a CUDA context."""
    try:
        uuids = _driver.get_backend().nvml().uuids()
    except Exception:  # NVML missing, driver not loaded, ...: let the driver answer
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return len(uuids)
    from cudalab._driver.visible_devices import parse_visible_devices  # (lazy: import time)

    parsed = parse_visible_devices(visible)
    if parsed and isinstance(parsed[0], str):
        count = 0
        for prefix in parsed:
            matches = [u for u in uuids if u.startswith(prefix)]
            if len(matches) != 1:
                break
            count += 1
        return count
    count = 0
    for idx in parsed:
        if not isinstance(idx, int) or idx >= len(uuids):
            break
        count += 1
    return count


def device_count() -> int:
    """Number of usable devices; 0 when there is no driver or GPU (never raises).

    Like torch, this does not initialise CUDA on the real backend: it asks NVML and parses
    ``CUDA_VISIBLE_DEVICES``, falling back to the driver only if NVML cannot answer (the
    driver reads the variable once per process). Like torch, the count is not cached before
    CUDA is initialised, so a change of ``CUDA_VISIBLE_DEVICES`` before then is seen (the
    simulator is made anew for it). After initialisation the count is fixed.
    """
    if initialized:
        return _count
    if _driver.selected_backend_name() == "cuda":
        n = _count_without_init()
        if n is not None:
            return n
    try:
        with _init_lock:  # (not while lazy_init commits the backend that probe may replace)
            if initialized:
                return _count
            seam = _driver.probe()
            seam.init()
            return seam.device_count()
    except (DriverNotFoundError, CudaError, OSError):
        return 0


def is_available() -> bool:
    """True when at least one device (real, or simulated when selected) can be used."""
    return device_count() > 0


# --------------------------------------------------------------------------- current device
def _invalid(index: int) -> ValueError:
    n = device_count()
    valid = f"valid indices are 0..{n - 1}" if n else "no device is available"
    return ValueError(f"Invalid device index {index}: cudalab sees {n} CUDA device(s); {valid}")


def device_index(device: Any = None, optional: bool = True) -> int:
    """Normalise a device argument (None, int, "cuda", "cuda:N", Device) to a valid index."""
    if type(device) is int:
        if not initialized:
            lazy_init()
        if 0 <= device < _count:
            return device
        raise _invalid(device)
    if device is None:
        if not optional:
            raise ValueError("a device index is required here; got None")
        return current_device()
    if isinstance(device, bool):
        raise TypeError(f"expected a device index, got {echo(device)}")
    if isinstance(device, int):
        return device_index(int(device))
    if isinstance(device, (str, Device)):
        dev = Device(device)
        if dev.index is None:
            return current_device()
        return device_index(dev.index)
    if isinstance(device, _device_context):
        # torch.cuda._utils._get_device_index accepts a torch.cuda.device context object and
        # takes its idx; -1 (made from None or a negative index) means the current device.
        return current_device() if device.idx < 0 else device_index(device.idx)
    idx = getattr(device, "device_index", None)
    if isinstance(idx, int):
        return device_index(idx)
    raise TypeError(f"expected a device index, 'cuda', 'cuda:N' or Device, got {echo(device)}")


def current_device() -> int:
    """Index of this thread's current device (no driver call)."""
    if not initialized:
        lazy_init()
    return per_thread.device


def set_device(device: Any) -> None:
    """Make ``device`` current for this thread. A negative int is ignored (like torch)."""
    if isinstance(device, int) and not isinstance(device, bool) and device < 0:
        return
    idx = device_index(device)
    per_thread.device = idx
    ensure_context(idx)


def ensure_context(device: int) -> None:
    """Make ``device``'s primary context current on this thread if it is not already.

    The backend keeps the only record of which context is current (its own calls switch
    contexts too), so this always asks it; the check there is one thread-local read.
    """
    _backend_obj.set_context(device) if initialized else backend().set_context(device)


class device:  # noqa: N801 - torch's name
    """Context manager that changes the current device (``torch.cuda.device``).

    A negative index or None leaves the device unchanged.
    """

    __slots__ = ("idx", "prev_idx")

    def __init__(self, device: Any):
        if device is None or (isinstance(device, int) and not isinstance(device, bool) and device < 0):
            self.idx = -1
        else:
            self.idx = device_index(device)
        self.prev_idx = -1

    def __enter__(self):
        if self.idx >= 0:
            self.prev_idx = current_device()
            if self.prev_idx != self.idx:
                set_device(self.idx)
        return self

    def __exit__(self, *exc: Any) -> Literal[False]:
        if self.idx >= 0 and self.prev_idx != self.idx and self.prev_idx >= 0:
            set_device(self.prev_idx)
        return False


#: The context manager class under a name that the ``device`` parameters above can't shadow.
_device_context = device


class device_of(device):  # noqa: N801 - torch's name
    """Context manager selecting the device of ``obj`` (an array, stream or event).

    Objects not on a CUDA device (no ``device_index``) leave the device unchanged.
    """

    __slots__ = ()

    def __init__(self, obj: Any):
        idx = getattr(obj, "device_index", None)
        if idx is None:
            dev = getattr(obj, "device", None)
            idx = getattr(dev, "index", dev if isinstance(dev, int) else None)
        super().__init__(idx if isinstance(idx, int) else -1)


# --------------------------------------------------------------------------- properties
def get_device_properties(device: Any = None) -> DeviceProperties:
    """Properties of ``device`` (read from the driver once, then cached)."""
    idx = device_index(device)
    props = _props[idx]
    if props is None:
        props = _props[idx] = DeviceProperties(backend().device_info(idx))
    return props


def get_device_name(device: Any = None) -> str:
    """The device's name (simulated devices say so)."""
    return get_device_properties(device).name


def get_device_capability(device: Any = None) -> tuple[int, int]:
    """(major, minor) compute capability."""
    p = get_device_properties(device)
    return (p.major, p.minor)


#: The lowest compute capability with native bfloat16 and TF32 arithmetic (Ampere, sm_80).
_BF16_TF32_MIN_MAJOR = 8


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """Whether the current device supports bfloat16, as ``torch.cuda.is_bf16_supported``.

    Parameters
    ----------
    including_emulation : bool, optional
        True (default, torch's): also count devices that only emulate bfloat16. Any CUDA
        device can hold bfloat16 data (torch's check creates a bfloat16 tensor, which
        works on every device), so the answer is then True whenever a device is
        available. False: only native support, compute capability 8.0 or higher.

    Returns
    -------
    bool
        False when CUDA is not available. On the simulator the simulated device's
        capability (9.0) decides.
    """
    if not is_available():
        return False
    if get_device_properties(current_device()).major >= _BF16_TF32_MIN_MAJOR:
        return True
    return bool(including_emulation)


def is_tf32_supported() -> bool:
    """Whether the current device has TF32 tensor cores, as ``torch.cuda.is_tf32_supported``.

    Returns
    -------
    bool
        True for compute capability 8.0 or higher (torch: native bfloat16 support,
        ``is_bf16_supported(including_emulation=False)``); False when CUDA is not
        available.
    """
    return is_bf16_supported(including_emulation=False)


def can_device_access_peer(device: Any, peer_device: Any) -> bool:
    """Whether ``device`` can access ``peer_device``'s memory directly."""
    a = device_index(device, optional=False)
    b = device_index(peer_device, optional=False)
    if a == b:
        return False
    return backend().can_access_peer(a, b)


# Direct access between device pairs, decided once per (device, peer) pair: True once
# enabled, False where the hardware has none. Filled only after the driver call succeeded,
# so a call cut short (Ctrl-C, an error) is simply retried next time.
_peer_access: dict[tuple[int, int], bool] = {}


def enable_peer_access(device: int, peer: int) -> bool:
    """Let ``device`` read and write ``peer``'s memory directly (torch's ``get_p2p_access``:
    enabled lazily, once per pair); whether it can (False for one device or no peer link).

    Cross-device copies ask first, as torch's do: with access on, a copy is a plain
    ``cuMemcpyAsync`` through unified addressing (a third of ``cuMemcpyPeerAsync``'s host
    time: the small rows of benchmarks/comm.py), and kernels may read the peer's memory.
    """
    pair = (device, peer)
    able = _peer_access.get(pair)
    if able is None:
        able = device != peer and backend().can_access_peer(device, peer)
        if able:
            backend().enable_peer_access(device, peer)  # "already enabled" is not an error
        _peer_access[pair] = able
    return able


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) device memory in bytes, as the driver reports them."""
    idx = device_index(device)
    return backend().mem_get_info(idx)


def synchronize(device: Any = None) -> None:
    """Wait for all work on ``device`` to finish."""
    if _observe.sync_on:  # set_sync_debug_mode (one flag read while it is default)
        _observe.notify_sync("cudalab.synchronize()")
    idx = device_index(device)
    try:
        backend().synchronize(idx)
    except StreamCaptureError as exc:
        raise name_operation(exc, "cudalab.synchronize()") from exc
    if _observe.access_on:  # the stream sanitizer
        _observe.access_tracker.device_synchronize(idx)


def get_arch_list() -> list[str]:
    """Architectures cudalab can build kernels for (NVRTC's supported ``sm_XX`` list).

    cudalab compiles its kernels at run time for the device's own architecture, so this is
    what the installed NVRTC supports; [] when CUDA is unavailable, like torch.
    """
    if not is_available():
        return []
    try:
        from cudalab._driver import nvrtc

        return list(nvrtc.supported_archs())
    except Exception:
        return []


def get_gencode_flags() -> str:
    """``-gencode`` flags for :func:`get_arch_list`, in torch's format."""
    flags = []
    for arch in get_arch_list():
        num = arch.split("_", 1)[1]
        flags.append(f"-gencode compute=compute_{num},code={arch}")
    return " ".join(flags)


def ipc_collect() -> None:
    """Release memory received from other processes that is no longer referenced.

    cudalab does not import device memory from other processes (only IPC events), so there
    is nothing to collect; it still initialises CUDA like torch's version does.
    """
    lazy_init()


def check_error(code: int) -> None:
    """Raise :class:`cudalab.CudaError` for a failed CUDA status code (torch's
    ``torch.cuda.check_error``).

    Parameters
    ----------
    code : int
        A status code returned by a CUDA call made outside cudalab. cudalab talks to the
        driver, so the code is read as a ``CUresult``; the common codes (1 invalid value,
        2 out of memory, 3 not initialised, ...) are the same numbers as the runtime's
        ``cudaError_t``, which torch's version takes.

    Returns
    -------
    None
        When ``code`` is 0 (success).

    Raises
    ------
    cudalab.CudaError
        For any other code, carrying ``code``, the driver's error name and description
        (``cuGetErrorName`` / ``cuGetErrorString``; the simulator gives ``"CUDA error N"``)
        and ``call="check_error"``; :class:`cudalab.OutOfMemoryError` for code 2.
    TypeError
        When ``code`` is not an int.
    """
    if isinstance(code, bool) or not isinstance(code, int):
        raise TypeError(f"check_error: code must be an int status code, got {code!r}")
    if code == 0:
        return None
    try:
        exc = _driver.get_backend().status_error(int(code), "check_error")
    except (DriverNotFoundError, CudaUnavailableError):  # no driver to name the code
        exc = CudaError(int(code), call="check_error")
    if int(code) == _CUDA_ERROR_OUT_OF_MEMORY and not isinstance(exc, OutOfMemoryError):
        exc = OutOfMemoryError(call="check_error")
    raise exc


#: ``CUDA_ERROR_OUT_OF_MEMORY`` (also ``cudaErrorMemoryAllocation``): check_error raises
#: OutOfMemoryError for it, as the driver seam does.
_CUDA_ERROR_OUT_OF_MEMORY = 2
